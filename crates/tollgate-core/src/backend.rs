//! [`Backends`]: the one seam between the roles and their store. Every role
//! (api, worker, throttler, `all`) and every operator command receives one,
//! built once from a backend URL by the binary: in memory here
//! ([`Backends::memory`]), on Redis by `tollgate-redis`. No role names a backend.

use std::sync::Arc;

use crate::activity::{
    ActivityLog, MemoryActivity, RecordingLedger, RecordingSource, RecordingThrottle,
};
use crate::config::Config;
use crate::durability::{DurabilityCheck, MemoryDurability};
use crate::job::{JobQueue, JobSource};
use crate::job_memory::MemoryJobQueue;
use crate::keystore::{KeyStore, MemoryKeyStore};
use crate::ledger::Ledger;
use crate::memory::MemoryLedger;
use crate::metrics::{MeteredLedger, Metrics};
use crate::session::{MemorySessions, SessionStore};
use crate::stream::{JobStreams, MemoryStreams};
use crate::throttle::{Dispatchers, MemoryThrottle, Throttle};

/// The stores of one process, each behind its trait.
#[derive(Clone, Debug)]
pub struct Backends {
    pub config: Arc<Config>,
    /// User budgets: charges, refunds, usage.
    pub ledger: Arc<dyn Ledger>,
    /// The api's side of the job queue (submit, status, wait), on `ledger`.
    pub jobs: Arc<dyn JobQueue>,
    /// The workers' side of the same queue.
    pub source: Arc<dyn JobSource>,
    /// The waiters' side of the provider throttle.
    pub throttle: Arc<dyn Throttle>,
    /// API keys.
    pub keys: Arc<dyn KeyStore>,
    /// The throttler role's side of the throttle; `None` where the throttle
    /// grants by itself (in process).
    pub dispatchers: Option<Arc<dyn Dispatchers>>,
    /// Where the state lives, for logs and banners (no secrets).
    pub described: String,
    /// The process's one metrics registry (and its loops' heartbeats): every
    /// role of the process records into it, `/metrics` renders it.
    pub metrics: Arc<Metrics>,
    /// The recent activity (spend events, refunds, grants) the operations
    /// dashboard reads; `ledger` and `throttle` note into it.
    pub activity: Arc<dyn ActivityLog>,
    /// What the store's persistence promises now (`/readyz`, the startup log).
    pub durability: Arc<dyn DurabilityCheck>,
    /// The dashboard's login sessions.
    pub sessions: Arc<dyn SessionStore>,
    /// Streamed answers, from the worker running a job to the api holding
    /// its client.
    pub streams: Arc<dyn JobStreams>,
}

/// What a backend builds besides its ledger and job queue: the stores no
/// decorator wraps, and the throttle before its activity recording.
#[derive(Debug)]
pub struct Stores {
    pub throttle: Arc<dyn Throttle>,
    pub keys: Arc<dyn KeyStore>,
    pub dispatchers: Option<Arc<dyn Dispatchers>>,
    pub described: String,
    pub durability: Arc<dyn DurabilityCheck>,
    pub sessions: Arc<dyn SessionStore>,
    pub streams: Arc<dyn JobStreams>,
}

impl Backends {
    /// The one assembly step of every backend: wraps what it built with this
    /// process's metrics and activity recording, the same way whatever the
    /// store. `ledger` is the backend's own; `queue` builds its job queue on
    /// the wrapped ledger (the queue charges and claims through it, so its
    /// steps are counted and noted too).
    pub fn assemble<Q: JobQueue + JobSource + 'static>(
        config: Arc<Config>,
        metrics: Arc<Metrics>,
        activity: Arc<dyn ActivityLog>,
        ledger: Arc<dyn Ledger>,
        queue: impl FnOnce(Arc<dyn Ledger>) -> Arc<Q>,
        stores: Stores,
    ) -> Self {
        metrics.note_answers_into(Arc::clone(&activity));
        let ledger: Arc<dyn Ledger> = Arc::new(RecordingLedger::new(
            Arc::new(MeteredLedger::new(ledger, Arc::clone(&metrics))),
            Arc::clone(&activity),
        ));
        let queue = queue(Arc::clone(&ledger));
        Self {
            throttle: Arc::new(RecordingThrottle::new(
                stores.throttle,
                Arc::clone(&activity),
            )),
            config,
            ledger,
            jobs: queue.clone(),
            source: Arc::new(RecordingSource::new(queue, Arc::clone(&activity))),
            keys: stores.keys,
            dispatchers: stores.dispatchers,
            described: stores.described,
            metrics,
            activity,
            durability: stores.durability,
            sessions: stores.sessions,
            streams: stores.streams,
        }
    }

    /// Everything in this process's memory: the embedded mode (`tollgate all`
    /// without Redis) and tests. Nothing is shared with another process.
    pub fn memory(config: Arc<Config>) -> Self {
        let metrics = Arc::new(Metrics::new(&config));
        let activity: Arc<dyn ActivityLog> = Arc::new(MemoryActivity::new());
        let stores = Stores {
            throttle: Arc::new(MemoryThrottle::metered(&config, Arc::clone(&metrics))),
            keys: Arc::new(MemoryKeyStore::new()),
            dispatchers: None,
            described: "embedded: in-memory ledger, throttle and job queues".into(),
            durability: Arc::new(MemoryDurability),
            sessions: Arc::new(MemorySessions::new()),
            streams: Arc::new(MemoryStreams::new()),
        };
        let ledger = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let queue_config = Arc::clone(&config);
        Self::assemble(
            config,
            metrics,
            activity,
            ledger,
            |ledger| Arc::new(MemoryJobQueue::new(queue_config, ledger)),
            stores,
        )
    }
}
