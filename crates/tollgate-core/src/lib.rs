//! tollgate's core: the vocabulary every role shares (ids, plans, providers,
//! operations, config), the [`Ledger`], [`Throttle`] and job ([`JobQueue`],
//! [`JobSource`]) traits that backends implement, and the
//! in-memory backends that the embedded mode runs on.
//!
//! Nothing here talks to the network; the Redis backend lives in `tollgate-redis`.

pub mod audit;
pub mod clock;
pub mod config;
pub mod duration;
pub mod id;
pub mod job;
pub mod job_memory;
pub mod keystore;
pub mod lease;
pub mod ledger;
pub mod memory;
pub mod throttle;

pub use audit::{AuditError, MemoryOperationLog, OperationLog};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{Config, ConfigError, Operation, Plan, Provider, Upstream};
pub use id::{IdError, RequestId, UserId};
pub use job::{
    FailureCause, Finish, Job, JobError, JobInfo, JobOptions, JobQueue, JobRequest, JobSource,
    JobStatus, Lease, Maintenance, SubmitOutcome,
};
pub use job_memory::MemoryJobQueue;
pub use keystore::{ApiKey, KeyHash, KeyRecord, KeyStore, KeyStoreError, MemoryKeyStore};
pub use lease::{LeaseError, MemoryLeases, ReservationLeases};
pub use ledger::{
    Allowed, Denied, Ledger, LedgerError, RefundOutcome, ReserveOutcome, SettleOutcome, SpendEvent,
    Usage,
};
pub use memory::MemoryLedger;
pub use throttle::{Grant, MemoryThrottle, Throttle, ThrottleError, Throttled};
