//! `tollgate api`: serves the HTTP api against Redis until SIGINT or SIGTERM,
//! then finishes the requests in flight.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_api::{ApiState, Settings};
use tollgate_core::job::JobOptions;
use tollgate_core::{Config, Ledger};
use tollgate_redis::{redact_url, KeySpace, PoolOptions, RedisJobQueue, RedisLedger};

use crate::exit;
use crate::throttler::fail;

#[derive(Debug, Args)]
pub struct ApiArgs {
    /// Address to listen on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,

    /// Redis shared by every pod, e.g. redis://127.0.0.1:6379/0.
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true)]
    redis_url: String,

    /// TOML config with plans, providers and operations (default: the built-in config).
    #[arg(long, env = "TOLLGATE_CONFIG")]
    config: Option<PathBuf>,

    /// Prefix of every Redis key: lets several deployments share one Redis.
    #[arg(long, env = "TOLLGATE_KEY_PREFIX", default_value = tollgate_redis::keys::DEFAULT_PREFIX)]
    key_prefix: String,

    /// Token that guards /admin/* (unset: the admin routes answer 403).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,

    /// Largest accepted request body, in bytes (larger: 413).
    #[arg(long, env = "TOLLGATE_BODY_LIMIT", default_value_t = tollgate_api::state::DEFAULT_BODY_LIMIT)]
    body_limit: usize,

    /// How long a synchronous operation call waits for its result, in ms,
    /// before answering 202 with the job's Location.
    #[arg(long, env = "TOLLGATE_SYNC_TIMEOUT_MS", default_value_t = 30_000)]
    sync_timeout_ms: u64,

    /// Behind a reverse proxy: the header that carries the client's address
    /// (e.g. X-Forwarded-For; its last entry is used), for the limiter of
    /// failed authentications. Unset: the TCP peer's address; no header is
    /// trusted by default.
    #[arg(long, env = "TOLLGATE_TRUSTED_PROXY_HEADER")]
    trusted_proxy_header: Option<tollgate_api::HeaderName>,

    /// Redis connections in the pool.
    #[arg(long, env = "TOLLGATE_REDIS_POOL", default_value_t = 16)]
    redis_pool: usize,
}

pub async fn run(args: ApiArgs) -> ExitCode {
    let config = match Config::load(args.config.as_deref()) {
        Ok(c) => Arc::new(c),
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let keys = match KeySpace::new(&args.key_prefix) {
        Ok(k) => k,
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    if args.admin_token.as_deref().is_some_and(|t| t.len() < 16) {
        return fail(
            exit::BAD_INPUT,
            "TOLLGATE_ADMIN_TOKEN must be at least 16 characters",
        );
    }
    let options = PoolOptions {
        max_size: args.redis_pool.max(1),
        ..Default::default()
    };
    let pool = match crate::connect::wait_for_redis(&args.redis_url, &options).await {
        Ok(p) => p,
        Err(code) => return code,
    };
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
    ));
    let jobs = match RedisJobQueue::new(
        &args.redis_url,
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
        Arc::clone(&ledger),
        JobOptions::default(),
    ) {
        Ok(j) => Arc::new(j),
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let settings = Settings {
        admin_token: args.admin_token,
        body_limit: args.body_limit,
        sync_timeout: Duration::from_millis(args.sync_timeout_ms),
        trusted_proxy_header: args.trusted_proxy_header,
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            return fail(
                exit::FAILURE,
                format!("cannot listen on {}: {e}", args.listen),
            )
        }
    };
    tracing::info!(
        redis = %redact_url(&args.redis_url), prefix = %args.key_prefix,
        admin = settings.admin_token.is_some(), "api starting"
    );
    let state = ApiState::redis(config, pool, keys, ledger, jobs, settings);
    match tollgate_api::run(state, listener, crate::throttler::shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::FAILURE, e),
    }
}
