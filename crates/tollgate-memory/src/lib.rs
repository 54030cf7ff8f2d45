//! The in-memory backend of tollgate: the embedded mode (`tollgate all`
//! without Redis) and tests. Each store implements its `tollgate_core` trait
//! with the same semantics as `tollgate-redis`, for one process; nothing is
//! shared with another.
//!
//! - [`ledger`] is the [`tollgate_core::ledger::Ledger`] (budgets, charges,
//!   organisations), with the semantics of the scripts in `lua/`;
//! - [`jobs`] is the job queue, both sides ([`tollgate_core::job::JobQueue`]
//!   and [`tollgate_core::job::JobSource`]);
//! - [`throttle`] is the [`tollgate_core::throttle::Throttle`]: a token bucket
//!   per provider;
//! - [`keystore`] holds API keys;
//! - [`activity`] is the dashboard's [`tollgate_core::activity::ActivityLog`];
//! - [`sessions`] holds the dashboard's login sessions;
//! - [`streams`] carries streamed answers from the worker to the api;
//! - [`alerts`] is the budget alerts' outbox;
//! - [`MemoryDurability`] says what an accepted call survives (nothing past
//!   the process).
//!
//! [`backends`] builds them all into one [`Backends`].

pub mod activity;
pub mod alerts;
pub mod jobs;
pub mod keystore;
pub mod ledger;
mod model_limits;
mod periods;
mod rollups;
pub mod sessions;
pub mod streams;
pub mod throttle;

use std::sync::Arc;

use async_trait::async_trait;

use tollgate_core::activity::ActivityLog;
use tollgate_core::backend::{Backends, Stores};
use tollgate_core::clock::SystemClock;
use tollgate_core::config::Config;
use tollgate_core::durability::{Durability, DurabilityCheck, DurabilityReport};
use tollgate_core::metrics::Metrics;

use crate::activity::MemoryActivity;
use crate::alerts::MemoryAlerts;
use crate::jobs::MemoryJobQueue;
use crate::keystore::MemoryKeyStore;
use crate::ledger::MemoryLedger;
use crate::sessions::MemorySessions;
use crate::streams::MemoryStreams;
use crate::throttle::MemoryThrottle;

/// Everything in this process's memory: the embedded mode (`tollgate all`
/// without Redis) and tests. Nothing is shared with another process.
pub fn backends(config: Arc<Config>) -> Backends {
    let metrics = Arc::new(Metrics::new(&config));
    let activity: Arc<dyn ActivityLog> = Arc::new(MemoryActivity::new());
    let alerts = MemoryAlerts::new(Arc::new(SystemClock));
    let stores = Stores {
        throttle: Arc::new(MemoryThrottle::metered(&config, Arc::clone(&metrics))),
        keys: Arc::new(MemoryKeyStore::new()),
        dispatchers: None,
        described: "embedded: in-memory ledger, throttle and job queues".into(),
        durability: Arc::new(MemoryDurability),
        sessions: Arc::new(MemorySessions::new()),
        streams: Arc::new(MemoryStreams::new()),
        alerts: Arc::new(alerts.clone()),
    };
    let ledger = Arc::new(MemoryLedger::new(Arc::clone(&config)).with_alerts(alerts));
    Backends::assemble(
        config,
        metrics,
        activity,
        ledger,
        |config, ledger| Arc::new(MemoryJobQueue::new(config, ledger)),
        stores,
    )
}

/// The in-memory store: nothing outlives the process, so only `none` is
/// possible (the binary refuses the others without Redis).
#[derive(Debug, Default)]
pub struct MemoryDurability;

#[async_trait]
impl DurabilityCheck for MemoryDurability {
    async fn check(&self) -> DurabilityReport {
        DurabilityReport {
            mode: Durability::None.name(),
            appendonly: "n/a".into(),
            appendfsync: "n/a".into(),
            replicas: None,
            loss_window: "everything: the state lives in this process".into(),
            problem: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::id::{RequestId, UserId};
    use tollgate_core::metrics::STATS_TIMEOUT;

    #[tokio::test]
    async fn shared_state_gauges_come_from_the_stores_at_scrape_time() {
        let config = Arc::new(Config::builtin());
        let backends = backends(Arc::clone(&config));
        let m = &backends.metrics;
        assert!(!m.render().contains("tollgate_queue_depth"));
        let failed = m
            .refresh(
                backends.jobs.as_ref(),
                backends.throttle.as_ref(),
                STATS_TIMEOUT,
            )
            .await;
        assert!(failed.is_empty(), "{failed:?}");
        let text = m.render();
        for line in [
            "tollgate_queue_depth{operation=\"llm.structured\"} 0",
            "tollgate_queue_dead{operation=\"llm.structured\"} 0",
            "tollgate_throttle_tokens{provider=\"llm\"} 10",
            "tollgate_throttle_waiters{provider=\"llm\"} 0",
            "tollgate_stats_errors_total{source=\"jobs\"} 0",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        // In process there are no worker or throttler records to count.
        assert!(!text.contains("tollgate_queue_workers"), "{text}");
        assert!(!text.contains("tollgate_throttle_throttlers"), "{text}");
    }

    #[tokio::test]
    async fn denials_are_counted_by_plan() {
        let config = Arc::new(Config::builtin());
        let backends = backends(Arc::clone(&config));
        let user = UserId::new("u").unwrap();
        let free = config.plan("free").unwrap().max_cost();
        let r = backends
            .ledger
            .reserve(&user, &RequestId::new("r1").unwrap(), free)
            .await
            .unwrap();
        assert!(r.is_allowed());
        let r = backends
            .ledger
            .reserve(&user, &RequestId::new("r2").unwrap(), 1)
            .await
            .unwrap();
        assert!(!r.is_allowed());
        let text = backends.metrics.render();
        assert!(
            text.contains("tollgate_budget_denials_total{plan=\"free\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tollgate_ledger_duration_seconds_count{step=\"reserve\"} 2"),
            "{text}"
        );
    }
}
