//! tollgate's core: the vocabulary every role shares (ids, plans, providers,
//! operations, config), the [`Ledger`], [`Throttle`] and job ([`JobQueue`],
//! [`JobSource`]) traits that backends implement, and the
//! in-memory backends that the embedded mode runs on.
//!
//! Nothing here talks to the network; the Redis backend lives in `tollgate-redis`.

pub mod backend;
pub mod clock;
pub mod config;
pub mod duration;
pub mod error;
pub mod id;
pub mod job;
pub mod job_memory;
pub mod keystore;
pub mod ledger;
pub mod memory;
pub mod throttle;

pub use backend::Backends;
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{Config, ConfigError, Operation, Plan, Provider, Upstream};
pub use error::StoreError;
pub use id::{IdError, RequestId, UserId};
pub use job::{
    Enqueued, FailureCause, Finish, Job, JobError, JobInfo, JobOptions, JobQueue, JobRequest,
    JobSource, JobStatus, Lease, Maintenance, SubmitOutcome, Waiters, Watch,
};
pub use job_memory::MemoryJobQueue;
pub use keystore::{ApiKey, KeyHash, KeyRecord, KeyStore, KeyStoreError, MemoryKeyStore};
pub use ledger::{
    Allowed, ChargeOutcome, ChargeRequest, ClaimOutcome, Denied, Ledger, LedgerError,
    RefundOutcome, ReserveOutcome, SettleOutcome, SpendEvent, Usage,
};
pub use memory::MemoryLedger;
pub use throttle::{Dispatch, Dispatchers, Grant, MemoryThrottle, Pumped, Throttle, ThrottleError};

/// Locks `m`. Every critical section in this crate is panic-free, so a poisoned
/// lock's data is still consistent.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
