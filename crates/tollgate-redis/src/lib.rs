//! The Redis backend of tollgate.
//!
//! - [`keys`] builds every key name (prefix, schema version, hash tags);
//! - [`scripts`] embeds the Lua scripts of `lua/` and owns their KEYS/ARGV order;
//! - [`pool`] connects (a deadpool of multiplexed connections) and classifies failures;
//! - [`ledger`] is the [`tollgate_core::Ledger`] on top of them.
//!
//! **Invariant:** spend events and running totals are written only by the scripts
//! in `lua/`, one atomic script per operation, with time from Redis `TIME`.

pub mod keys;
pub mod ledger;
pub mod pool;
pub mod scripts;

pub use keys::{KeyError, KeySpace};
pub use ledger::RedisLedger;
pub use pool::{connect, redact_url, Connection, Pool, PoolOptions, RedisBackendError};
