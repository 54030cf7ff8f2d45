//! The operation log in Redis: one hash per user (`{u:<user>}:ops`, request id ->
//! operation), in the user's hash tag, expiring a window after its last write.

use std::time::Duration;

use async_trait::async_trait;
use tollgate_core::{AuditError, OperationLog, RequestId, UserId};

use crate::call::{self, CallError};
use crate::keys::KeySpace;
use crate::pool::{Pool, DEFAULT_TIMEOUT};

/// The distributed [`OperationLog`].
#[derive(Debug)]
pub struct RedisOperationLog {
    pool: Pool,
    keys: KeySpace,
}

impl From<CallError> for AuditError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Unavailable(m) => Self::Unavailable(m),
            CallError::Backend(m) => Self::Backend(m),
        }
    }
}

impl RedisOperationLog {
    pub fn new(pool: Pool, keys: KeySpace) -> Self {
        Self { pool, keys }
    }
}

#[async_trait]
impl OperationLog for RedisOperationLog {
    async fn record(
        &self,
        user: &UserId,
        request: &RequestId,
        operation: &str,
        keep: Duration,
    ) -> Result<(), AuditError> {
        let key = self.keys.budget(user).operations;
        let keep_ms = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut pipe = redis::pipe();
        pipe.cmd("HSET")
            .arg(&key)
            .arg(request.as_str())
            .arg(operation)
            .ignore()
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(keep_ms)
            .ignore();
        call::pipeline::<()>(&self.pool, DEFAULT_TIMEOUT, "ops_record", &pipe)
            .await
            .map_err(AuditError::from)
    }

    async fn operations(
        &self,
        user: &UserId,
        requests: &[RequestId],
    ) -> Result<Vec<Option<String>>, AuditError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(self.keys.budget(user).operations)
            .arg(requests.iter().map(RequestId::as_str).collect::<Vec<_>>());
        let (ops,): (Vec<Option<String>>,) =
            call::pipeline(&self.pool, DEFAULT_TIMEOUT, "ops_lookup", &pipe)
                .await
                .map_err(AuditError::from)?;
        Ok(ops)
    }
}
