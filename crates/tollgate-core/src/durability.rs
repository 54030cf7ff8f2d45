//! What an accepted call (a 200 or 202) survives: the [`Durability`] a
//! deployment asks for, and the [`DurabilityCheck`] through which a store
//! reports what it does now, read at start, on `/readyz` and (on Redis) on
//! every new connection.
//!
//! - [`Durability::None`]: the store's own setting stands, reported with its
//!   loss window (Redis's default AOF `appendfsync everysec`: about the last
//!   second of accepted calls, up to ~2 s when a disk stalls).
//! - [`Durability::Fsync`]: every write is on disk before its reply
//!   (`appendonly yes` + `appendfsync always`); a store that does not say so,
//!   or cannot say (CONFIG renamed or refused), fails closed.
//! - [`Durability::Replica`]: each write that accepts a call (a job's charge,
//!   its enqueue) waits for `replicas` replicas (`WAIT`) before the answer; a
//!   WAIT short of them answers 503.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

/// What a deployment asks of its store before a call is answered 200/202.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// The store's setting stands; its loss window is reported.
    #[default]
    None,
    /// Every write fsynced before its reply (a single Redis with AOF).
    Fsync,
    /// The writes that accept a call reach `replicas` replicas within
    /// `timeout` (`WAIT`), or the call answers 503.
    Replica { replicas: u32, timeout: Duration },
}

impl Durability {
    /// The mode's name, as the flag spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fsync => "fsync",
            Self::Replica { .. } => "replica",
        }
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Replica { replicas, timeout } => {
                write!(f, "replica (WAIT {replicas} within {timeout:?})")
            }
            other => f.write_str(other.name()),
        }
    }
}

/// What the store says about its persistence now, and whether that keeps the
/// promise of the mode: `problem` is set when it does not (the role is then
/// not ready). Serialized as `/readyz`'s `durability`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DurabilityReport {
    /// The mode asked for (`none`, `fsync`, `replica`).
    pub mode: &'static str,
    /// The store's AOF switch (`yes`/`no`), `unknown` when it cannot be read,
    /// `n/a` in memory.
    pub appendonly: String,
    /// The store's fsync policy (`always`, `everysec`, `no`), as above.
    pub appendfsync: String,
    /// Replicas connected to the primary (replica mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// What a crash of the store may lose of the calls it accepted.
    pub loss_window: String,
    /// Why the store does not keep the mode's promise now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// A store's report on its own persistence.
#[async_trait]
pub trait DurabilityCheck: Send + Sync + fmt::Debug {
    /// Reads the store's setting now (never an error: what cannot be read is
    /// `unknown`, and a problem in the modes that need it).
    async fn check(&self) -> DurabilityReport;

    /// Why the store's connections are refused for their durability right
    /// now, if they are (then nothing can be read from it: this says why).
    fn refused(&self) -> Option<String> {
        None
    }
}
