//! tollgate's core: the vocabulary every role shares (ids, plans, providers,
//! config), the [`Ledger`] and [`Throttle`] traits that backends implement, and the
//! in-memory backends that the embedded mode runs on.
//!
//! Nothing here talks to the network; the Redis backend lives in `tollgate-redis`.

pub mod clock;
pub mod config;
pub mod duration;
pub mod id;
pub mod ledger;
pub mod memory;
pub mod throttle;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{Config, ConfigError, Plan, Provider};
pub use id::{IdError, RequestId, UserId};
pub use ledger::{
    Allowed, Denied, Ledger, LedgerError, RefundOutcome, ReserveOutcome, SettleOutcome, SpendEvent,
    Usage,
};
pub use memory::MemoryLedger;
pub use throttle::{Grant, MemoryThrottle, Throttle, ThrottleError, Throttled};
