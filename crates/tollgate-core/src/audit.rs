//! The operation behind each spend event, for the audit trail of `GET /v1/usage`.
//!
//! The ledger's events carry request id, cost and time; which operation a request
//! ran is recorded beside them (not inside the budget scripts), per user, and kept
//! as long as a budget window so it outlives every event it labels.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use crate::clock::{Clock, SystemClock};
use crate::id::{RequestId, UserId};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuditError {
    /// The store cannot be reached; retrying later may succeed.
    #[error("audit store unavailable: {0}")]
    Unavailable(String),
    #[error("audit store error: {0}")]
    Backend(String),
}

/// Request id -> operation name, per user.
#[async_trait]
pub trait OperationLog: Send + Sync + std::fmt::Debug {
    /// Records that `request` of `user` ran `operation`; kept at least `keep`.
    async fn record(
        &self,
        user: &UserId,
        request: &RequestId,
        operation: &str,
        keep: Duration,
    ) -> Result<(), AuditError>;

    /// The operations of `requests`, in order (`None`: not recorded).
    async fn operations(
        &self,
        user: &UserId,
        requests: &[RequestId],
    ) -> Result<Vec<Option<String>>, AuditError>;
}

/// One user's labels: request id -> (operation, expires at ms).
type Labels = HashMap<RequestId, (String, u64)>;

/// The embedded operation log.
#[derive(Debug, Default)]
pub struct MemoryOperationLog<C: Clock = SystemClock> {
    clock: C,
    users: Mutex<HashMap<UserId, Labels>>,
}

impl MemoryOperationLog<SystemClock> {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl<C: Clock + Default> OperationLog for MemoryOperationLog<C> {
    async fn record(
        &self,
        user: &UserId,
        request: &RequestId,
        operation: &str,
        keep: Duration,
    ) -> Result<(), AuditError> {
        let now = self.clock.now_ms();
        let until = now.saturating_add(u64::try_from(keep.as_millis()).unwrap_or(u64::MAX));
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        let log = users.entry(user.clone()).or_default();
        log.retain(|_, (_, expires)| *expires > now);
        log.insert(request.clone(), (operation.to_owned(), until));
        Ok(())
    }

    async fn operations(
        &self,
        user: &UserId,
        requests: &[RequestId],
    ) -> Result<Vec<Option<String>>, AuditError> {
        let users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        let log = users.get(user);
        Ok(requests
            .iter()
            .map(|r| log.and_then(|l| l.get(r)).map(|(op, _)| op.clone()))
            .collect())
    }
}
