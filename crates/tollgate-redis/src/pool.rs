//! Connections to Redis: a [`Pool`] for a standalone Redis (a deadpool pool of
//! multiplexed connections with bounded waits) or for a Redis Cluster
//! (`redis+cluster://host:port[,host:port...]`: redis-rs's cluster connection,
//! with its own slot routing, MOVED/ASK retries and topology refresh), and the
//! mapping of Redis failures to typed errors.
//!
//! The pool uses its own [`Manager`] rather than deadpool-redis's: that one sends
//! UNWATCH + PING on every checkout, one extra round trip per budget call, which
//! measured at about half of the achievable throughput (BENCHMARKS.md). Ours
//! checks a connection without a round trip instead: each [`PooledConnection`]
//! keeps the task that drives its socket, and that task ends the moment Redis
//! closes the socket (a restart, a kill, `CLIENT KILL`, an idle timeout). Recycling
//! discards a connection whose task ended, so an idle pool never hands out a
//! connection that can only answer "broken pipe". A connection idle for longer
//! than [`IDLE_PING`] is also PINGed first: a peer that vanished without closing
//! the socket (a dropped NAT entry, a dead host) leaves the task running. And a
//! call that fails at the connection level marks its connection broken, so the
//! pool never hands it out again ([`Multiplexed::fail`]). With `--durability
//! fsync` a new connection first reads Redis's AOF setting, and one to a Redis
//! that does not fsync every write is refused ([`crate::durability`]).
//!
//! **A checkout lasts an instant.** The connections are multiplexed: any number
//! of calls share one, each reply reaching its own caller. So a call takes a
//! handle to a connection ([`checkout`]) and gives the connection back to the
//! pool at once, before its round trip. Held for the round trip, a pool of `n`
//! connections would serve at most `n / round trip` calls per second: over a
//! 300 ms link, 16 connections make 50 calls/s, and the rest queue for a
//! connection until they time out (a readiness PING among them). The pool
//! hands its connections out in turn (FIFO), so the load spreads over all of them.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use deadpool::Runtime;
use redis::aio::MultiplexedConnection;
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, RedisError, TlsCertificates,
    Value,
};
use tokio::task::JoinHandle;
use tollgate_core::durability::Durability;
use tollgate_core::error::StoreError;

use crate::durability;
use crate::scripts::{is_missing_function, is_noscript};

/// How long one call may wait for a connection, or for Redis to answer, before it
/// fails as unavailable (fail closed rather than hang).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// A connection idle for longer than this is PINGed before it is handed out.
pub const IDLE_PING: Duration = Duration::from_secs(30);

/// A pool of multiplexed connections to a standalone Redis.
pub type SinglePool = managed::Pool<Manager>;

/// The connections of one process to its Redis deployment. Cheap to clone.
#[derive(Clone)]
pub enum Pool {
    /// A standalone Redis.
    Single(SinglePool),
    /// A Redis Cluster: one multiplexed cluster connection (it keeps one
    /// connection per node), shared by every call.
    Cluster(Box<ClusterPool>),
}

/// The cluster side of a [`Pool`].
#[derive(Clone)]
pub struct ClusterPool {
    client: ClusterClient,
    conn: ClusterConnection,
    /// The seed URLs and certificates, for the clients of the process's
    /// sharded pub/sub subscriptions ([`ClusterPool::subscriber`]).
    seeds: Vec<String>,
    tls: Tls,
    timeout: Duration,
    durability: Durability,
    /// Fsync mode's check where a call is accepted ([`durability::FsyncGate`]).
    gate: std::sync::Arc<durability::FsyncGate>,
}

impl std::fmt::Debug for ClusterPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPool")
            .field("seeds", &self.seeds.len())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ClusterPool {
    /// The shared cluster connection.
    pub fn connection(&self) -> ClusterConnection {
        self.conn.clone()
    }

    /// A client of its own for sharded pub/sub (SSUBSCRIBE), with the pool's
    /// seeds and certificates: RESP3, every push (messages, subscription
    /// confirmations, disconnections) sent to `pushes`. redis-rs keeps its
    /// subscriptions and makes them again, each on the node that owns its
    /// slot, after a reconnection or a topology change.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn subscriber(
        &self,
        pushes: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
    ) -> Result<ClusterClient, RedisError> {
        cluster_builder(self.seeds.clone(), &self.tls, self.timeout)
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(pushes)
            .build()
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Single(p) => f.debug_tuple("Single").field(&p.status()).finish(),
            Self::Cluster(c) => c.fmt(f),
        }
    }
}

impl Pool {
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// What an accepted call must survive on this pool's Redis.
    pub fn durability(&self) -> Durability {
        match self {
            Self::Single(p) => p.manager().durability,
            Self::Cluster(c) => c.durability,
        }
    }

    /// Fsync mode's check where a call is accepted.
    pub(crate) fn fsync_gate(&self) -> &durability::FsyncGate {
        match self {
            Self::Single(p) => &p.manager().gate,
            Self::Cluster(c) => &c.gate,
        }
    }

    /// Why the last new connection was refused for its Redis's durability,
    /// while no later one was accepted.
    pub fn refusal(&self) -> Option<String> {
        match self {
            Self::Single(p) => p
                .manager()
                .refusal
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            Self::Cluster(_) => None,
        }
    }
}

/// A multiplexed connection and the task that drives its socket (aborted once
/// the connection is dropped and its calls in flight had their time). Derefs to the `MultiplexedConnection`.
#[derive(Debug)]
pub struct PooledConnection {
    conn: MultiplexedConnection,
    /// `None` when the connection was made by redis-rs itself (a unix socket):
    /// its liveness is then known only by the idle PING and by failures.
    driver: Option<JoinHandle<()>>,
    /// Set by a call that failed on it at the connection level.
    broken: Arc<AtomicBool>,
    /// How long a call may await its reply: the socket outlives the
    /// connection's last checkout by this much.
    grace: Duration,
}

impl PooledConnection {
    fn new(conn: MultiplexedConnection, driver: Option<JoinHandle<()>>, grace: Duration) -> Self {
        Self {
            conn,
            driver,
            broken: Arc::default(),
            grace,
        }
    }

    /// False once the socket is closed (every command on it would fail with
    /// "broken pipe" without reaching Redis), or once a call failed on it at
    /// the connection level.
    pub fn is_alive(&self) -> bool {
        !self.broken.load(Ordering::Relaxed)
            && !self.driver.as_ref().is_some_and(|d| d.is_finished())
    }
}

/// A handle to one of the pool's connections, for one call: the connection
/// itself is back in the pool already (see the module docs).
#[derive(Debug)]
pub struct Multiplexed {
    pub conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
}

impl Multiplexed {
    /// After a failure of this call: when it failed at the connection level
    /// (reset, refused, timed out), the pool hands the connection out no more.
    /// Calls in flight on it end on their own.
    pub fn fail(&self, e: &RedisError) {
        if is_connection_error(e) {
            self.broken.store(true, Ordering::Relaxed);
        }
    }
}

/// A connection for one call, given back to the pool before the call is sent.
pub async fn checkout(pool: &SinglePool) -> Result<Multiplexed, StoreError> {
    let object = pool
        .get()
        .await
        .map_err(|e| StoreError::unavailable(format!("no Redis connection: {e}")))?;
    Ok(Multiplexed {
        conn: object.conn.clone(),
        broken: Arc::clone(&object.broken),
    })
}

impl Deref for PooledConnection {
    type Target = MultiplexedConnection;
    fn deref(&self) -> &MultiplexedConnection {
        &self.conn
    }
}

impl DerefMut for PooledConnection {
    fn deref_mut(&mut self) -> &mut MultiplexedConnection {
        &mut self.conn
    }
}

impl Drop for PooledConnection {
    /// The socket is closed once the calls still in flight on it had their
    /// time: other handles to it may be awaiting replies ([`checkout`]).
    fn drop(&mut self) {
        let Some(driver) = self.driver.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !driver.is_finished() => {
                let grace = self.grace;
                runtime.spawn(async move {
                    tokio::time::sleep(grace).await;
                    driver.abort();
                });
            }
            _ => driver.abort(),
        }
    }
}

/// Creates multiplexed connections; see the module docs on recycling.
#[derive(Debug)]
pub struct Manager {
    client: Client,
    timeout: Duration,
    /// In fsync mode each new connection first checks that Redis fsyncs
    /// every write: a Redis restarted with another setting is refused at its
    /// first reconnection, not trusted until the next `/readyz`.
    durability: Durability,
    /// The last refusal's reason, until a connection is accepted again: what
    /// `/readyz` says while no call can be made.
    refusal: Mutex<Option<String>>,
    /// Fsync mode's check where a call is accepted ([`durability::FsyncGate`]).
    gate: std::sync::Arc<durability::FsyncGate>,
}

impl Manager {
    /// The client the pool connects with: for the connections that must not
    /// be shared (pub/sub, blocking commands).
    pub fn client(&self) -> &Client {
        &self.client
    }
}

/// A connection of its own for blocking commands (BLMOVE): on a shared
/// multiplexed connection a blocking command stalls every other command. On a
/// cluster it is a cluster connection of its own, so each command goes to the
/// node that owns its key, re-resolved after a topology change.
pub enum Blocking {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Blocking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Blocking::Single",
            Self::Cluster(_) => "Blocking::Cluster",
        })
    }
}

impl redis::aio::ConnectionLike for Blocking {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Opens a [`Blocking`] connection to the pool's Redis. No response timeout:
/// the caller bounds each command.
pub async fn blocking_connection(pool: &Pool) -> Result<Blocking, StoreError> {
    match pool {
        Pool::Single(p) => {
            let manager = p.manager();
            let config = AsyncConnectionConfig::new()
                .set_response_timeout(None)
                .set_connection_timeout(Some(manager.timeout));
            manager
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map(Blocking::Single)
                .map_err(store_error)
        }
        Pool::Cluster(c) => {
            let config = ClusterConfig::new()
                .set_connection_timeout(c.timeout)
                .set_response_timeout(Duration::from_secs(24 * 3600));
            c.client
                .get_async_connection_with_config(config)
                .await
                .map(Blocking::Cluster)
                .map_err(store_error)
        }
    }
}

impl managed::Manager for Manager {
    type Type = PooledConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<PooledConnection, RedisError> {
        let mut conn = self.connect().await?;
        if self.durability == Durability::Fsync {
            let persistence = durability::config_get()
                .query_async(&mut conn.conn)
                .await
                .map_err(|e| e.to_string())
                .and_then(durability::parse);
            let problem = durability::judge(self.durability, persistence, None).problem;
            *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = problem.clone();
            if let Some(problem) = problem {
                return Err(RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    NOT_DURABLE,
                    problem,
                )));
            }
        }
        Ok(conn)
    }

    async fn recycle(
        &self,
        conn: &mut PooledConnection,
        metrics: &Metrics,
    ) -> RecycleResult<RedisError> {
        if !conn.is_alive() {
            return Err(RecycleError::message(
                "Redis closed the connection, or a call failed on it",
            ));
        }
        if metrics.last_used() > IDLE_PING {
            redis::cmd("PING")
                .query_async::<String>(&mut conn.conn)
                .await
                .map_err(RecycleError::Backend)?;
        }
        Ok(())
    }
}

/// The description of the error of a connection refused because its Redis
/// does not keep the pool's [`Durability`].
const NOT_DURABLE: &str = "Redis does not keep the durability asked for";

/// True for a connection refused by the durability check: the message says
/// why, and waiting does not help.
pub fn is_not_durable(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::InvalidClientConfig && e.to_string().contains(NOT_DURABLE)
}

impl Manager {
    async fn connect(&self) -> Result<PooledConnection, RedisError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let info = self.client.get_connection_info();
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            let conn = self
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            return Ok(PooledConnection::new(conn, None, self.timeout));
        };
        // Over TCP we open the socket and spawn its driver ourselves, to keep
        // the driver's handle: it is how `recycle` sees a closed socket.
        let connect = async {
            let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
            stream.set_nodelay(true)?;
            let (conn, driver) =
                MultiplexedConnection::new_with_config(info.redis_settings(), stream, config)
                    .await?;
            Ok::<_, RedisError>(PooledConnection::new(
                conn,
                Some(tokio::spawn(driver)),
                self.timeout,
            ))
        };
        match tokio::time::timeout(self.timeout, connect).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection to Redis within {:?}", self.timeout),
            ))),
        }
    }
}

/// A Redis failure as a [`StoreError`]: transient when Redis cannot be reached
/// now (refused, reset, timed out, no connection) or answers "not now"
/// (`LOADING` its data after a restart; a script flushed as it was loaded),
/// not when it answered with an error.
pub fn store_error(e: RedisError) -> StoreError {
    // NOSCRIPT (a function not found) here: the script (library) was flushed
    // again after each of its loads (see `invoke`): it did not run, and a
    // retry soon may find it loaded.
    let failed =
        if is_connection_error(&e) || is_busy(&e) || is_noscript(&e) || is_missing_function(&e) {
            StoreError::unavailable(e.to_string())
        } else {
            StoreError::backend(e.to_string())
        };
    failed.with_source(e)
}

/// True for failures of the connection (refused, reset, timed out) rather than
/// of the command.
pub fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped()
}

/// True for answers that mean "not now" from a Redis that is up: `LOADING`
/// (reading its AOF or RDB after a restart), `MASTERDOWN`, `TRYAGAIN`,
/// `CLUSTERDOWN`. The command did not run; the connection is fine.
pub fn is_busy(e: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
                | ServerErrorKind::MasterDown
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
        )
    )
}

#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_size: usize,
    pub timeout: Duration,
    /// Certificates for `rediss://` and `rediss+cluster://` URLs.
    pub tls: Tls,
    /// What an accepted call must survive (checked on connection, WAIT after
    /// the writes that accept a call).
    pub durability: Durability,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_size: 8,
            timeout: DEFAULT_TIMEOUT,
            tls: Tls::default(),
            durability: Durability::None,
        }
    }
}

/// The certificates of a TLS connection to Redis (`rediss://`), PEM-encoded.
/// Without a CA, the server's certificate is checked against the system's
/// trusted roots (what a managed Redis with a public CA needs).
#[derive(Clone, Default)]
pub struct Tls {
    /// The CA (bundle) that signed the servers' certificates.
    pub ca_cert: Option<Vec<u8>>,
    /// A client certificate and its private key, for servers that
    /// authenticate clients (`tls-auth-clients yes`).
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_cert", &self.ca_cert.is_some())
            .field("client", &self.client.is_some())
            .finish()
    }
}

impl Tls {
    fn is_set(&self) -> bool {
        self.ca_cert.is_some() || self.client.is_some()
    }

    fn certificates(&self) -> TlsCertificates {
        TlsCertificates {
            client_tls: self
                .client
                .clone()
                .map(|(client_cert, client_key)| ClientTlsConfig {
                    client_cert,
                    client_key,
                }),
            root_cert: self.ca_cert.clone(),
        }
    }

    /// A client for `url`, with these certificates when it is a `rediss://`
    /// URL. Certificates for a plain `redis://` URL are a mistake: refused
    /// rather than ignored, since the operator meant the link to be private.
    fn client(&self, url: &str) -> Result<Client, String> {
        let tls = url.starts_with("rediss://");
        if !tls && self.is_set() {
            return Err(
                "TLS certificates were given for a plain redis:// URL; use rediss://".into(),
            );
        }
        let client = if tls && self.is_set() {
            Client::build_with_tls(url, self.certificates())
        } else {
            Client::open(url)
        };
        client.map_err(|e| e.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RedisBackendError {
    #[error("bad Redis URL {url}: {message}")]
    BadUrl { url: String, message: String },
    #[error("Redis at {url} is unreachable: {message}")]
    Unreachable { url: String, message: String },
    /// Redis answers but does not keep the durability asked for (or cannot
    /// say): waiting does not help.
    #[error("Redis at {url}: {message}")]
    NotDurable { url: String, message: String },
    /// A cluster URL whose seed is a Redis without cluster mode: waiting does
    /// not help.
    #[error("bad Redis URL {url}: its node {node} is not a Redis Cluster node (cluster_enabled:0); use redis://{node} for a standalone Redis")]
    NotCluster { url: String, node: String },
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

/// The seed URLs of a `redis+cluster://[user:password@]host:port[,host:port...]`
/// URL, as `redis://` URLs (`rediss+cluster://`: `rediss://` URLs); `None` when
/// `url` is not a cluster URL.
pub fn cluster_seeds(url: &str) -> Option<Result<Vec<String>, String>> {
    let (scheme, rest) = match url.strip_prefix("redis+cluster://") {
        Some(rest) => ("redis", rest),
        None => ("rediss", url.strip_prefix("rediss+cluster://")?),
    };
    let (userinfo, hosts) = match rest.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), rest),
    };
    let hosts = hosts.trim_end_matches('/');
    let seeds: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("{scheme}://{userinfo}{h}"))
        .collect();
    if seeds.is_empty() {
        return Some(Err(format!(
            "expected {scheme}+cluster://[user:password@]host:port[,host:port...]"
        )));
    }
    if let Some(bad) = seeds.iter().find(|s| redis::parse_redis_url(s).is_none()) {
        return Some(Err(format!("bad seed {}", redact_url(bad))));
    }
    Some(Ok(seeds))
}

/// Builds a pool for `url` (a standalone Redis, or a cluster's seeds),
/// checks that Redis answers a PING, and loads the script libraries it lacks
/// ([`crate::scripts::preload`]).
pub async fn connect(url: &str, options: &PoolOptions) -> Result<Pool, RedisBackendError> {
    let pool = connect_pool(url, options).await?;
    crate::scripts::preload(&pool, options.timeout).await;
    Ok(pool)
}

async fn connect_pool(url: &str, options: &PoolOptions) -> Result<Pool, RedisBackendError> {
    let shown = redact_url(url);
    let bad_url = |message: String| RedisBackendError::BadUrl {
        url: shown.clone(),
        message,
    };
    if let Some(seeds) = cluster_seeds(url) {
        let seeds = seeds.map_err(bad_url)?;
        return connect_cluster(&shown, seeds, options).await;
    }
    if redis::parse_redis_url(url).is_none() {
        return Err(bad_url(
            "expected redis://[user:password@]host[:port][/db] or rediss://…".into(),
        ));
    }
    let client = options.tls.client(url).map_err(bad_url)?;
    let pool = SinglePool::builder(Manager {
        client,
        timeout: options.timeout,
        durability: options.durability,
        refusal: Mutex::default(),
        gate: std::sync::Arc::default(),
    })
    .max_size(options.max_size)
    .wait_timeout(Some(options.timeout))
    .create_timeout(Some(options.timeout))
    .runtime(Runtime::Tokio1)
    .build()
    .map_err(|e| bad_url(e.to_string()))?;
    let ping = async {
        let mut conn = pool.get().await.map_err(|e| match e {
            managed::PoolError::Backend(e) if is_not_durable(&e) => RedisBackendError::NotDurable {
                url: shown.clone(),
                message: e.detail().unwrap_or(NOT_DURABLE).to_owned(),
            },
            e => RedisBackendError::Unreachable {
                url: shown.clone(),
                message: e.to_string(),
            },
        })?;
        redis::cmd("PING")
            .query_async::<String>(&mut **conn)
            .await
            .map_err(|e| RedisBackendError::Unreachable {
                url: shown.clone(),
                message: e.to_string(),
            })
    };
    match tokio::time::timeout(options.timeout, ping).await {
        Ok(Ok(_)) => Ok(Pool::Single(pool)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(RedisBackendError::Unreachable {
            url: shown,
            message: format!("no answer within {:?}", options.timeout),
        }),
    }
}

async fn connect_cluster(
    shown: &str,
    seeds: Vec<String>,
    options: &PoolOptions,
) -> Result<Pool, RedisBackendError> {
    let bad_url = |message: String| RedisBackendError::BadUrl {
        url: shown.to_owned(),
        message,
    };
    let unreachable = |message: String| RedisBackendError::Unreachable {
        url: shown.to_owned(),
        message,
    };
    // Each seed is checked as a client URL would be (certificates for a
    // plain redis:// seed are refused).
    for seed in &seeds {
        options.tls.client(seed).map_err(bad_url)?;
    }
    let client = cluster_builder(seeds.clone(), &options.tls, options.timeout)
        .build()
        .map_err(|e| bad_url(e.to_string()))?;
    let connect = async {
        let mut conn = client.get_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        Ok::<_, RedisError>(conn)
    };
    match tokio::time::timeout(options.timeout, connect).await {
        Ok(Ok(conn)) => {
            let pool = Pool::Cluster(Box::new(ClusterPool {
                client,
                conn,
                seeds,
                tls: options.tls.clone(),
                timeout: options.timeout,
                durability: options.durability,
                gate: std::sync::Arc::default(),
            }));
            // No connection of a cluster is made here (redis-rs makes them):
            // fsync mode is checked on every primary at start and by /readyz.
            if options.durability == Durability::Fsync {
                let report = tollgate_core::durability::DurabilityCheck::check(
                    &durability::RedisDurability::new(pool.clone(), options.timeout),
                )
                .await;
                if let Some(message) = report.problem {
                    return Err(RedisBackendError::NotDurable {
                        url: shown.to_owned(),
                        message,
                    });
                }
            }
            Ok(pool)
        }
        Ok(Err(e)) => Err(not_a_cluster(shown, &seeds, options)
            .await
            .unwrap_or_else(|| unreachable(e.to_string()))),
        Err(_) => Err(not_a_cluster(shown, &seeds, options)
            .await
            .unwrap_or_else(|| unreachable(format!("no answer within {:?}", options.timeout)))),
    }
}

/// After a cluster connection failed: the first seed that answers as a
/// standalone Redis (`INFO cluster` says `cluster_enabled:0`), as an error
/// naming it. A seed that does not answer (within the pool's timeout) says
/// nothing: the cluster may be starting.
async fn not_a_cluster(
    shown: &str,
    seeds: &[String],
    options: &PoolOptions,
) -> Option<RedisBackendError> {
    for seed in seeds {
        let Ok(client) = options.tls.client(seed) else {
            continue;
        };
        let info = tokio::time::timeout(options.timeout, async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("INFO")
                .arg("cluster")
                .query_async::<String>(&mut conn)
                .await
        })
        .await;
        if let Ok(Ok(info)) = info {
            if info.lines().any(|l| l.trim() == "cluster_enabled:0") {
                let node = redact_url(seed);
                let node = node.split_once("://").map_or(node.as_str(), |(_, n)| n);
                return Some(RedisBackendError::NotCluster {
                    url: shown.to_owned(),
                    node: node.to_owned(),
                });
            }
        }
    }
    None
}

/// The cluster client of `seeds`: the pool's and the subscribers' share it.
fn cluster_builder(seeds: Vec<String>, tls: &Tls, timeout: Duration) -> ClusterClientBuilder {
    let mut builder = ClusterClientBuilder::new(seeds)
        .connection_timeout(timeout)
        .response_timeout(timeout);
    if tls.is_set() {
        builder = builder.certs(tls.certificates());
    }
    builder
}
