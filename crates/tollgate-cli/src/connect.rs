//! How a long-running role reaches Redis at start: a Redis that is down is
//! waited for, with backoff (pods and their Redis restart in any order, and a
//! role that exits only to be restarted recovers no sooner), while a bad URL
//! fails at once. Operator commands (`budget`, `users`) fail fast instead.

use std::process::ExitCode;
use std::time::Duration;

use tollgate_redis::{Pool, PoolOptions, RedisBackendError};

use crate::exit;
use crate::throttler::{fail, shutdown_signal};

/// Connects, waiting for an unreachable Redis until it answers or the process
/// is told to stop (then `Err` with a success code: nothing was started).
pub(crate) async fn wait_for_redis(url: &str, options: &PoolOptions) -> Result<Pool, ExitCode> {
    let mut backoff = Duration::from_millis(200);
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        match tollgate_redis::connect(url, options).await {
            Ok(pool) => return Ok(pool),
            Err(e @ RedisBackendError::BadUrl { .. }) => return Err(fail(exit::BAD_INPUT, e)),
            Err(e @ RedisBackendError::Unreachable { .. }) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "waiting for Redis");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = &mut stop => return Err(ExitCode::SUCCESS),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}
