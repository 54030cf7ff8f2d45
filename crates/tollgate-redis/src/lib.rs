//! The Redis backend of tollgate.
//!
//! - [`keys`] builds every key name (prefix, schema version, hash tags);
//! - [`scripts`] embeds the Lua scripts of `lua/` and owns their KEYS/ARGV order;
//! - [`pool`] connects (a deadpool of multiplexed connections) and classifies failures;
//! - [`keystore`] holds API keys;
//! - [`ledger`] is the [`tollgate_core::ledger::Ledger`], charges and their owners included;
//! - [`throttle`] is the [`tollgate_core::throttle::Throttle`] (waiter side) and the
//!   throttler's [`throttle::Dispatcher`];
//! - [`jobs`] is the job queue, both sides ([`tollgate_core::job::JobQueue`] and
//!   [`tollgate_core::job::JobSource`]) on reliable lists;
//! - [`activity`] is the dashboard's [`tollgate_core::activity::ActivityLog`];
//! - [`sessions`] holds the dashboard's login sessions;
//! - [`durability`] reads what Redis promises an accepted call (fsync, replicas).
//!
//! **Invariant:** spend events, running totals and token buckets are written only
//! by the scripts in `lua/`, one atomic script per operation, with time from Redis
//! `TIME`; so are job records and queues.

// The budget steps' futures nest deep (an async-trait method, the step's
// retries across a move, the pool's call with its WAIT): computing their
// layouts takes the compiler past its default depth of 128.
#![recursion_limit = "256"]

pub mod activity;
pub mod alerts;
pub mod call;
pub mod clock;
pub mod credits;
pub mod durability;
pub mod jobs;
pub mod keys;
pub mod keystore;
pub mod ledger;
pub mod pool;
pub mod scripts;
pub mod sessions;
pub mod streams;
mod subscription;
pub mod throttle;

use std::sync::Arc;

use crate::jobs::RedisJobQueue;
use crate::keys::KeySpace;
use crate::keystore::RedisKeyStore;
use crate::ledger::RedisLedger;
use crate::pool::Pool;
use crate::throttle::{RedisDispatchers, RedisThrottle, RedisThrottleOptions};

use tollgate_core::activity::ActivityLog;
use tollgate_core::backend::{Backends, Stores};
use tollgate_core::config::Config;
use tollgate_core::job::JobOptions;
use tollgate_core::metrics::Metrics;

/// Every backend on one Redis: the pool the caller connected, the key space of
/// one deployment. `described` names the Redis (without its password).
pub fn backends(pool: Pool, keys: KeySpace, config: Arc<Config>, described: String) -> Backends {
    let metrics = Arc::new(Metrics::new(&config));
    let activity: Arc<dyn ActivityLog> =
        Arc::new(activity::RedisActivity::start(pool.clone(), &keys, &config));
    let stores = Stores {
        throttle: Arc::new(RedisThrottle::start(
            pool.clone(),
            keys.clone(),
            &config,
            RedisThrottleOptions {
                metrics: Some(Arc::clone(&metrics)),
                ..RedisThrottleOptions::default()
            },
        )),
        keys: Arc::new(RedisKeyStore::new(pool.clone(), keys.clone())),
        dispatchers: Some(Arc::new(RedisDispatchers {
            pool: pool.clone(),
            keys: keys.clone(),
        })),
        described,
        durability: Arc::new(durability::RedisDurability::new(
            pool.clone(),
            pool::DEFAULT_TIMEOUT,
        )),
        sessions: Arc::new(sessions::RedisSessions::new(pool.clone(), keys.clone())),
        streams: Arc::new(streams::RedisStreams::new(
            pool.clone(),
            keys.clone(),
            Arc::clone(&config),
        )),
        alerts: Arc::new(alerts::RedisAlerts::new(pool.clone(), keys.clone())),
    };
    let ledger = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
    ));
    Backends::assemble(
        config,
        metrics,
        activity,
        ledger,
        |config, ledger| {
            Arc::new(RedisJobQueue::new(
                pool,
                keys,
                config,
                ledger,
                JobOptions::default(),
            ))
        },
        stores,
    )
}
