//! Where a process keeps its state: the flags every role and operator command
//! shares ([`StoreArgs`], flattened into each), and the one place that builds
//! the [`Backends`] from them.
//!
//! The store is named by a URL: `memory` (this process only: `tollgate all`
//! and `budget demo`), or `redis://` (shared by every pod). A
//! long-running role waits for a Redis that is down, with backoff (pods and
//! their Redis restart in any order, and a role that exits only to be
//! restarted recovers no sooner), while a bad URL fails at once. Operator
//! commands (`budget`, `users`) fail fast instead.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use tollgate_core::backend::Backends;
use tollgate_core::config::Config;
use tollgate_core::durability::Durability;
use tollgate_redis::{
    keys::KeySpace,
    pool::{Pool, PoolOptions, RedisBackendError, Tls},
};

use crate::process::{exit, fail, shutdown_signal};

/// The flags that say where the state lives and how it is configured.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Where the shared state lives: redis://[user:password@]host[:port][/db],
    /// rediss://… (TLS), redis+cluster://[user:password@]host:port[,host:port...]
    /// (a Redis Cluster's seed nodes; rediss+cluster:// for TLS), or `memory`
    /// (this process only; `tollgate all`'s default).
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_REDIS_URL",
        hide_env_values = true
    )]
    pub redis_url: Option<String>,

    /// TOML config with plans, providers and operations (default: the built-in config).
    #[arg(long, global = true, env = "TOLLGATE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Prefix of every Redis key: lets several deployments share one Redis.
    #[arg(long, global = true, env = "TOLLGATE_KEY_PREFIX", default_value = tollgate_redis::keys::DEFAULT_PREFIX)]
    pub key_prefix: String,

    /// PEM file of the CA that signed Redis's certificate (rediss:// URLs;
    /// default: the system's trusted roots).
    #[arg(long, global = true, env = "TOLLGATE_REDIS_CA_CERT")]
    pub redis_ca_cert: Option<PathBuf>,

    /// PEM file of a client certificate, for a Redis that authenticates
    /// clients by certificate (with --redis-client-key).
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_REDIS_CLIENT_CERT",
        requires = "redis_client_key"
    )]
    pub redis_client_cert: Option<PathBuf>,

    /// PEM file of the client certificate's private key.
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_REDIS_CLIENT_KEY",
        requires = "redis_client_cert"
    )]
    pub redis_client_key: Option<PathBuf>,

    /// What a 200/202 survives: `none` (Redis's own setting, reported with
    /// its loss window: ~1 s of accepted calls with `appendfsync everysec`),
    /// `fsync` (a Redis that fsyncs every write, `appendfsync always`; any
    /// other or unreadable setting refuses the start, or makes the role not
    /// ready), `replica` (each write accepting a call waits for
    /// --wait-replicas replicas, else 503).
    #[arg(long, global = true, env = "TOLLGATE_DURABILITY", value_enum, default_value_t = DurabilityArg::None)]
    pub durability: DurabilityArg,

    /// Replica mode: replicas (per primary) that must acknowledge each write
    /// accepting a call. Set it to the replicas each primary has, so that any
    /// replica a failover promotes holds every accepted call.
    #[arg(long, global = true, env = "TOLLGATE_WAIT_REPLICAS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub wait_replicas: u32,

    /// Replica mode: how long a write waits for its replicas before the call
    /// answers 503 (milliseconds, below the 3 s Redis timeout).
    #[arg(long, global = true, env = "TOLLGATE_WAIT_TIMEOUT_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..2500))]
    pub wait_timeout_ms: u64,
}

/// The `--durability` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DurabilityArg {
    None,
    Fsync,
    Replica,
}

/// How to treat a Redis that does not answer yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Wait for it, with backoff, until it answers or the process is told
    /// to stop (a role).
    UntilReachable,
    /// Fail at once (an operator command).
    No,
}

/// A failed start: what to print and how to exit.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn bad_input(message: impl Into<String>) -> Self {
        Self {
            code: exit::BAD_INPUT,
            message: message.into(),
        }
    }

    pub fn other(message: impl Into<String>) -> Self {
        Self {
            code: exit::FAILURE,
            message: message.into(),
        }
    }

    /// Prints the message; the exit code to end with.
    pub fn exit(self) -> ExitCode {
        if self.code == STOPPED {
            return ExitCode::SUCCESS;
        }
        fail(self.code, self.message)
    }
}

/// A stop signal came while waiting for Redis: nothing was started.
const STOPPED: u8 = 0;

impl StoreArgs {
    /// The config file, or the built-in config.
    pub fn load_config(&self) -> Result<Config, Failure> {
        Config::load(self.config.as_deref()).map_err(|e| Failure::bad_input(e.to_string()))
    }

    /// The URL, `None` for `memory` or no URL at all.
    fn redis(&self) -> Option<&str> {
        self.redis_url
            .as_deref()
            .filter(|u| !matches!(*u, "memory" | "memory://"))
    }

    /// The certificate files named by the flags, read.
    fn tls(&self) -> Result<Tls, Failure> {
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).map_err(|e| {
                Failure::bad_input(format!("cannot read the {what} {}: {e}", path.display()))
            })
        };
        let ca_cert = match &self.redis_ca_cert {
            Some(p) => Some(read(p, "Redis CA certificate")?),
            None => None,
        };
        let client = match (&self.redis_client_cert, &self.redis_client_key) {
            (Some(cert), Some(key)) => Some((
                read(cert, "Redis client certificate")?,
                read(key, "Redis client key")?,
            )),
            _ => None,
        };
        Ok(Tls { ca_cert, client })
    }

    /// The durability the flags ask for.
    pub fn durability(&self) -> Durability {
        match self.durability {
            DurabilityArg::None => Durability::None,
            DurabilityArg::Fsync => Durability::Fsync,
            DurabilityArg::Replica => Durability::Replica {
                replicas: self.wait_replicas,
                timeout: Duration::from_millis(self.wait_timeout_ms),
            },
        }
    }

    /// Whether the state is this process's own (no URL, or `memory`).
    pub fn is_memory(&self) -> bool {
        self.redis().is_none()
    }

    /// The backends of a role that shares its state with other pods: a Redis
    /// URL is required.
    pub async fn shared(
        &self,
        role: &str,
        config: Arc<Config>,
        pool_size: usize,
        wait: Wait,
    ) -> Result<Backends, Failure> {
        if self.is_memory() {
            return Err(Failure::bad_input(format!(
                "{role} needs the Redis every pod shares: pass --redis-url redis://… or set TOLLGATE_REDIS_URL (`memory` works only within one process: tollgate all)"
            )));
        }
        self.open(config, pool_size, wait).await
    }

    /// An operator command's config and backends on the shared store, with
    /// `pool_size` connections: it fails at once on a Redis that is down.
    /// `commands` names them in errors.
    pub async fn operator(
        &self,
        commands: &str,
        pool_size: usize,
    ) -> Result<(Arc<Config>, Backends), Failure> {
        let config = Arc::new(self.load_config()?);
        let backends = self
            .shared(commands, Arc::clone(&config), pool_size, Wait::No)
            .await?;
        Ok((config, backends))
    }

    /// The backends: in memory for `memory` or no URL, else on Redis.
    pub async fn open(
        &self,
        config: Arc<Config>,
        pool_size: usize,
        wait: Wait,
    ) -> Result<Backends, Failure> {
        let durability = self.durability();
        let Some(url) = self.redis() else {
            if durability != Durability::None {
                return Err(Failure::bad_input(format!(
                    "--durability {} needs Redis: the in-memory store keeps nothing past its process",
                    durability.name()
                )));
            }
            return Ok(tollgate_memory::backends(config));
        };
        let keys =
            KeySpace::new(&self.key_prefix).map_err(|e| Failure::bad_input(e.to_string()))?;
        let options = PoolOptions {
            max_size: pool_size.max(1),
            tls: self.tls()?,
            durability,
            ..Default::default()
        };
        let pool = match wait {
            Wait::UntilReachable => wait_for_redis(url, &options).await?,
            Wait::No => {
                tollgate_redis::pool::connect(url, &options)
                    .await
                    .map_err(|e| match e {
                        RedisBackendError::BadUrl { .. } | RedisBackendError::NotCluster { .. } => {
                            Failure::bad_input(e.to_string())
                        }
                        RedisBackendError::Unreachable { .. }
                        | RedisBackendError::NotDurable { .. } => Failure::other(e.to_string()),
                    })?
            }
        };
        let described = format!(
            "Redis at {} (prefix {})",
            tollgate_redis::pool::redact_url(url),
            self.key_prefix
        );
        tracing::debug!(store = %described, "connected");
        let backends = tollgate_redis::backends(pool, keys, config, described);
        // A role says it at start; an operator command (one line of output
        // or one of error) only under RUST_LOG=debug.
        let report = backends.durability.check().await;
        macro_rules! log_report {
            ($level:ident) => {
                tracing::$level!(
                    durability = report.mode,
                    appendonly = %report.appendonly,
                    appendfsync = %report.appendfsync,
                    replicas = ?report.replicas,
                    loss_window = %report.loss_window,
                    problem = ?report.problem,
                    "what an accepted call survives a Redis crash"
                )
            };
        }
        match wait {
            Wait::UntilReachable => log_report!(info),
            Wait::No => log_report!(debug),
        }
        Ok(backends)
    }
}

/// Connects, waiting for an unreachable Redis until it answers or the process
/// is told to stop (then a failure with a success code: nothing was started).
async fn wait_for_redis(url: &str, options: &PoolOptions) -> Result<Pool, Failure> {
    let mut backoff = Duration::from_millis(200);
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        match tollgate_redis::pool::connect(url, options).await {
            Ok(pool) => return Ok(pool),
            Err(e @ (RedisBackendError::BadUrl { .. } | RedisBackendError::NotCluster { .. })) => {
                return Err(Failure::bad_input(e.to_string()))
            }
            // A setting, not an outage: waiting would hide it (a role that
            // exits is restarted and says why each time).
            Err(e @ RedisBackendError::NotDurable { .. }) => {
                return Err(Failure::other(e.to_string()))
            }
            Err(e @ RedisBackendError::Unreachable { .. }) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "waiting for Redis");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = &mut stop => return Err(Failure { code: STOPPED, message: String::new() }),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}
