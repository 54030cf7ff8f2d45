//! Reservation leases: a reservation made ahead of the work it pays for (the api's
//! `Cost` layer reserves before its handler submits the job) is leased until it is
//! handed over to a job or refunded. If the process dies in between, the lease
//! runs out and a reconciler settles it: a job with that id owns the charge,
//! otherwise the charge is refunded. Nothing here decides a budget: refunds go
//! through the ledger, which is idempotent by request id.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use crate::id::{RequestId, UserId};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The store cannot be reached; retrying later may succeed.
    #[error("lease store unavailable: {0}")]
    Unavailable(String),
    #[error("lease store error: {0}")]
    Backend(String),
}

/// Open reservations, each with the time (ms since the epoch) its lease ends.
#[async_trait]
pub trait ReservationLeases: Send + Sync + std::fmt::Debug {
    /// Leases `request` of `user` until `until_ms`.
    async fn open(
        &self,
        user: &UserId,
        request: &RequestId,
        until_ms: u64,
    ) -> Result<(), LeaseError>;

    /// The reservation was handed over or refunded: forget it.
    async fn close(&self, user: &UserId, request: &RequestId) -> Result<(), LeaseError>;

    /// At most `limit` leases that ended at or before `now_ms`.
    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<(UserId, RequestId)>, LeaseError>;
}

/// The embedded lease store.
#[derive(Debug, Default)]
pub struct MemoryLeases {
    leases: Mutex<BTreeMap<(UserId, RequestId), u64>>,
}

impl MemoryLeases {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(UserId, RequestId), u64>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl ReservationLeases for MemoryLeases {
    async fn open(
        &self,
        user: &UserId,
        request: &RequestId,
        until_ms: u64,
    ) -> Result<(), LeaseError> {
        self.lock()
            .insert((user.clone(), request.clone()), until_ms);
        Ok(())
    }

    async fn close(&self, user: &UserId, request: &RequestId) -> Result<(), LeaseError> {
        self.lock().remove(&(user.clone(), request.clone()));
        Ok(())
    }

    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<(UserId, RequestId)>, LeaseError> {
        Ok(self
            .lock()
            .iter()
            .filter(|(_, until)| **until <= now_ms)
            .take(limit)
            .map(|(k, _)| k.clone())
            .collect())
    }
}
