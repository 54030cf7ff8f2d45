//! Connections to Redis: a deadpool-redis pool of multiplexed connections with
//! bounded waits, and the mapping of Redis failures to typed errors.

use std::time::Duration;

use deadpool_redis::{Config as PoolConfig, Runtime, Timeouts};

pub use deadpool_redis::Pool;

/// How long one call may wait for a connection, or for Redis to answer, before it
/// fails as unavailable (fail closed rather than hang).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_size: usize,
    pub timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_size: 16,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RedisBackendError {
    #[error("bad Redis URL {url}: {message}")]
    BadUrl { url: String, message: String },
    #[error("Redis at {url} is unreachable: {message}")]
    Unreachable { url: String, message: String },
}

/// The URL with any password replaced by `***`, fit for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => format!("{scheme}://***@{host}"),
        },
        None => url.to_owned(),
    }
}

/// Builds a pool for `url` and checks that Redis answers a PING.
pub async fn connect(url: &str, options: &PoolOptions) -> Result<Pool, RedisBackendError> {
    let shown = redact_url(url);
    redis::parse_redis_url(url).ok_or_else(|| RedisBackendError::BadUrl {
        url: shown.clone(),
        message: "expected redis://[:password@]host[:port][/db]".into(),
    })?;
    let mut config = PoolConfig::from_url(url);
    let mut pool_config = deadpool_redis::PoolConfig::new(options.max_size);
    pool_config.timeouts = Timeouts {
        wait: Some(options.timeout),
        create: Some(options.timeout),
        recycle: Some(options.timeout),
    };
    config.pool = Some(pool_config);
    let pool =
        config
            .create_pool(Some(Runtime::Tokio1))
            .map_err(|e| RedisBackendError::BadUrl {
                url: shown.clone(),
                message: e.to_string(),
            })?;
    let ping = async {
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(options.timeout, ping).await {
        Ok(Ok(_)) => Ok(pool),
        Ok(Err(message)) => Err(RedisBackendError::Unreachable {
            url: shown,
            message,
        }),
        Err(_) => Err(RedisBackendError::Unreachable {
            url: shown,
            message: format!("no answer within {:?}", options.timeout),
        }),
    }
}
