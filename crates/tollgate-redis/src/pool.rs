//! Connections to Redis: a deadpool pool of multiplexed connections with bounded
//! waits, and the mapping of Redis failures to typed errors.
//!
//! The pool uses its own [`Manager`] rather than deadpool-redis's: that one sends
//! UNWATCH + PING on every checkout, one extra round trip per budget call, which
//! measured at about half of the achievable throughput (BENCHMARKS.md). Ours
//! hands out idle connections as they are and instead evicts a connection the
//! moment a call on it fails at the connection level ([`discard_if_broken`]), so
//! a restarted Redis is reconnected to on the next call.

use std::time::Duration;

use deadpool::managed::{self, Metrics, Object, RecycleResult};
use deadpool::Runtime;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError};

/// How long one call may wait for a connection, or for Redis to answer, before it
/// fails as unavailable (fail closed rather than hang).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// A pool of multiplexed Redis connections.
pub type Pool = managed::Pool<Manager>;
/// A connection checked out of the [`Pool`]; derefs to a `MultiplexedConnection`.
pub type Connection = Object<Manager>;

/// Creates multiplexed connections; see the module docs on recycling.
#[derive(Debug)]
pub struct Manager {
    client: Client,
    timeout: Duration,
}

impl managed::Manager for Manager {
    type Type = MultiplexedConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<MultiplexedConnection, RedisError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    async fn recycle(
        &self,
        _: &mut MultiplexedConnection,
        _: &Metrics,
    ) -> RecycleResult<RedisError> {
        Ok(())
    }
}

/// True for failures of the connection (refused, reset, timed out) rather than
/// of the command.
pub fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped()
}

/// Drops `conn` instead of returning it to the pool when `e` says the connection
/// is broken.
pub fn discard_if_broken(conn: Connection, e: &RedisError) {
    if is_connection_error(e) {
        drop(Object::take(conn));
    }
}

#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_size: usize,
    pub timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_size: 8,
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
    let bad_url = |message: String| RedisBackendError::BadUrl {
        url: shown.clone(),
        message,
    };
    if redis::parse_redis_url(url).is_none() {
        return Err(bad_url(
            "expected redis://[:password@]host[:port][/db]".into(),
        ));
    }
    let client = Client::open(url).map_err(|e| bad_url(e.to_string()))?;
    let pool = Pool::builder(Manager {
        client,
        timeout: options.timeout,
    })
    .max_size(options.max_size)
    .wait_timeout(Some(options.timeout))
    .create_timeout(Some(options.timeout))
    .runtime(Runtime::Tokio1)
    .build()
    .map_err(|e| bad_url(e.to_string()))?;
    let ping = async {
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        redis::cmd("PING")
            .query_async::<String>(&mut *conn)
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
