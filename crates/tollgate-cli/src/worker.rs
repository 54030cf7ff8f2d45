//! `tollgate worker`: runs the worker role against Redis until SIGINT or
//! SIGTERM, then finishes or hands back its jobs and exits.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_core::job::JobOptions;
use tollgate_core::{Config, JobSource, Ledger, Throttle};
use tollgate_redis::{
    redact_url, KeySpace, PoolOptions, RedisJobQueue, RedisLedger, RedisThrottle,
};
use tollgate_worker::WorkerConfig;

use crate::exit;
use crate::throttler::{fail, shutdown_signal};

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Redis shared by every pod, e.g. redis://127.0.0.1:6379/0.
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true)]
    redis_url: String,

    /// TOML config with plans, providers and operations (default: the built-in config).
    #[arg(long, env = "TOLLGATE_CONFIG")]
    config: Option<PathBuf>,

    /// Prefix of every Redis key: lets several deployments share one Redis.
    #[arg(long, env = "TOLLGATE_KEY_PREFIX", default_value = tollgate_redis::keys::DEFAULT_PREFIX)]
    key_prefix: String,

    /// Jobs run at once, across operations.
    #[arg(long, env = "TOLLGATE_WORKER_CONCURRENCY", default_value_t = 32)]
    concurrency: usize,

    /// A job's lease in ms: a job whose worker stops renewing it (died, paused)
    /// goes back to the queue this long after the last renewal.
    #[arg(long, env = "TOLLGATE_WORKER_LEASE_MS", default_value_t = 10_000)]
    lease_ms: u64,

    /// Operations to serve, comma-separated (default: all configured).
    #[arg(long, env = "TOLLGATE_WORKER_OPERATIONS", value_delimiter = ',')]
    operations: Vec<String>,

    /// On SIGTERM, how long in-flight jobs may finish before they are handed back, in ms.
    #[arg(long, env = "TOLLGATE_WORKER_GRACE_MS", default_value_t = 10_000)]
    grace_ms: u64,
}

pub async fn run(args: WorkerArgs) -> ExitCode {
    let config = match Config::load(args.config.as_deref()) {
        Ok(c) => Arc::new(c),
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let keys = match KeySpace::new(&args.key_prefix) {
        Ok(k) => k,
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    if args.lease_ms < 300 {
        return fail(exit::BAD_INPUT, "--lease-ms must be >= 300");
    }
    let pool = match crate::connect::wait_for_redis(&args.redis_url, &PoolOptions::default()).await
    {
        Ok(p) => p,
        Err(code) => return code,
    };
    tracing::info!(redis = %redact_url(&args.redis_url), prefix = %args.key_prefix, "connected");
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
    ));
    let queue = match RedisJobQueue::new(
        &args.redis_url,
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
        ledger,
        JobOptions::default(),
    ) {
        Ok(q) => Arc::new(q),
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let redis_throttle =
        match RedisThrottle::start(&args.redis_url, pool, keys, &config, Default::default()) {
            Ok(t) => Arc::new(t),
            Err(e) => return fail(exit::BAD_INPUT, e),
        };
    let throttle: Arc<dyn Throttle> = redis_throttle.clone();
    let providers = match tollgate_providers::from_config(&config, throttle) {
        Ok(p) => p,
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let mut cfg = WorkerConfig::new(Arc::clone(&config));
    cfg.concurrency = args.concurrency;
    cfg.lease = Duration::from_millis(args.lease_ms);
    cfg.liveness = (cfg.lease / 2).max(Duration::from_millis(300));
    cfg.maintain_every = (cfg.liveness / 3).max(Duration::from_millis(100));
    cfg.shutdown_grace = Duration::from_millis(args.grace_ms);
    if !args.operations.is_empty() {
        cfg.operations = args.operations;
    }
    let source: Arc<dyn JobSource> = queue;
    let ran = tollgate_worker::run(cfg, source, providers, shutdown_signal()).await;
    // The waits dropped at shutdown cancel their tickets before the runtime
    // stops (else they stay queued until their deadline).
    let left = redis_throttle.drain(Duration::from_secs(5)).await;
    if left > 0 {
        tracing::warn!(
            left,
            "throttle tickets not cancelled at exit; they expire at their deadline"
        );
    }
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::BAD_INPUT, e),
    }
}
