//! Every pooled Redis round trip goes through here: one checkout from the pool,
//! one timeout (a stalled Redis fails closed), one tracing span, eviction of a
//! connection that broke, and one classification of failures ([`CallError`]),
//! which each backend turns into its own error type.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{Cmd, FromRedisValue, Pipeline, RedisError, ScriptInvocation};
use tracing::Instrument;

use crate::pool::{discard_if_broken, is_connection_error, Pool};

/// Why a Redis call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// Redis cannot be reached now (refused, reset, timed out, no connection):
    /// retrying later may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// Redis answered with an error.
    #[error("{0}")]
    Backend(String),
}

impl From<RedisError> for CallError {
    fn from(e: RedisError) -> Self {
        if is_connection_error(&e) {
            Self::Unavailable(e.to_string())
        } else {
            Self::Backend(e.to_string())
        }
    }
}

enum Request<'a, 'b> {
    Script(&'a ScriptInvocation<'b>),
    Command(&'a Cmd),
    Pipeline(&'a Pipeline),
}

/// EVALSHA (loading the script on NOSCRIPT) on a pooled connection.
pub async fn script<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    inv: &ScriptInvocation<'_>,
) -> Result<T, CallError> {
    call(pool, timeout, op, Request::Script(inv)).await
}

/// One command on a pooled connection.
pub async fn command<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    cmd: &Cmd,
) -> Result<T, CallError> {
    call(pool, timeout, op, Request::Command(cmd)).await
}

/// A pipeline on a pooled connection.
pub async fn pipeline<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    pipe: &Pipeline,
) -> Result<T, CallError> {
    call(pool, timeout, op, Request::Pipeline(pipe)).await
}

/// One command on a dedicated connection (a blocking pop, never the pool's shared
/// ones), bounded by `timeout`.
pub async fn dedicated<T: FromRedisValue>(
    conn: &mut MultiplexedConnection,
    timeout: Duration,
    op: &'static str,
    cmd: &Cmd,
) -> Result<T, CallError> {
    bounded(timeout, op, async { Ok(cmd.query_async::<T>(conn).await?) }).await
}

async fn bounded<T>(
    timeout: Duration,
    op: &'static str,
    fut: impl std::future::Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    tokio::time::timeout(timeout, fut)
        .instrument(tracing::debug_span!("redis", op))
        .await
        .unwrap_or_else(|_| {
            Err(CallError::Unavailable(format!(
                "Redis did not answer {op} within {timeout:?}"
            )))
        })
}

async fn call<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    request: Request<'_, '_>,
) -> Result<T, CallError> {
    let round_trip = async {
        let mut conn = pool
            .get()
            .await
            .map_err(|e| CallError::Unavailable(format!("no Redis connection: {e}")))?;
        let result = match request {
            Request::Script(inv) => inv.invoke_async::<T>(&mut *conn).await,
            Request::Command(cmd) => cmd.query_async::<T>(&mut *conn).await,
            Request::Pipeline(pipe) => pipe.query_async::<T>(&mut *conn).await,
        };
        result.map_err(|e| {
            discard_if_broken(conn, &e);
            CallError::from(e)
        })
    };
    bounded(timeout, op, round_trip).await
}
