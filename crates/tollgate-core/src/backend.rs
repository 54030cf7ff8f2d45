//! [`Backends`]: the one seam between the roles and their store. Every role
//! (api, worker, throttler, `all`) and every operator command receives one,
//! built once from a backend URL by the binary: in memory by `tollgate-memory`,
//! on Redis by `tollgate-redis`, both through [`Backends::assemble`]. No role
//! names a backend.

use std::sync::Arc;

use crate::activity::{ActivityLog, RecordingSource, RecordingThrottle};
use crate::alerts::AlertOutbox;
use crate::config::Config;
use crate::durability::DurabilityCheck;
use crate::job::{JobQueue, JobSource};
use crate::keystore::KeyStore;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::observed::ObservedLedger;
use crate::session::SessionStore;
use crate::stream::JobStreams;
use crate::throttle::{Dispatchers, Throttle};

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
    /// The process's one metrics registry (and its loops' beats): every
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
    /// Budget alerts queued by the ledger's steps, drained by the deliverer
    /// (`tollgate-alerts`); never written without `[alerts]`.
    pub alerts: Arc<dyn AlertOutbox>,
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
    pub alerts: Arc<dyn AlertOutbox>,
}

impl Backends {
    /// The one assembly step of every backend: wraps what it built with this
    /// process's metrics and activity recording, the same way whatever the
    /// store. `ledger` is the backend's own; `queue` builds its job queue, of
    /// `config`, on the wrapped ledger (the queue charges and claims through
    /// it, so its steps are counted and noted too).
    pub fn assemble<Q: JobQueue + JobSource + 'static>(
        config: Arc<Config>,
        metrics: Arc<Metrics>,
        activity: Arc<dyn ActivityLog>,
        ledger: Arc<dyn Ledger>,
        queue: impl FnOnce(Arc<Config>, Arc<dyn Ledger>) -> Arc<Q>,
        stores: Stores,
    ) -> Self {
        metrics.note_answers_into(Arc::clone(&activity));
        let ledger: Arc<dyn Ledger> = Arc::new(ObservedLedger::new(
            ledger,
            Arc::clone(&metrics),
            Arc::clone(&activity),
        ));
        let queue = queue(Arc::clone(&config), Arc::clone(&ledger));
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
            alerts: stores.alerts,
        }
    }
}
