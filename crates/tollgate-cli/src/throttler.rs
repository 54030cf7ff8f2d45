//! `tollgate throttler`: runs the throttler role against Redis until SIGINT or
//! SIGTERM, then hands its popped tickets back and exits.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_core::Config;
use tollgate_redis::{redact_url, KeySpace, PoolOptions};
use tollgate_throttler::ThrottlerConfig;

use crate::exit;

#[derive(Debug, Args)]
pub struct ThrottlerArgs {
    /// Redis shared by every pod, e.g. redis://127.0.0.1:6379/0.
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true)]
    redis_url: String,

    /// TOML config with the providers (default: the built-in config).
    #[arg(long, env = "TOLLGATE_CONFIG")]
    config: Option<PathBuf>,

    /// Prefix of every Redis key: lets several deployments share one Redis.
    #[arg(long, env = "TOLLGATE_KEY_PREFIX", default_value = tollgate_redis::keys::DEFAULT_PREFIX)]
    key_prefix: String,

    /// Most grants per script call.
    #[arg(long, env = "TOLLGATE_THROTTLER_BATCH", default_value_t = 64)]
    batch: u32,

    /// How long tickets popped by a throttler that died stay its own before
    /// other throttlers put them back in the queue, in ms.
    #[arg(long, env = "TOLLGATE_THROTTLER_LEASE_MS", default_value_t = 3000)]
    lease_ms: u64,
}

pub async fn run(args: ThrottlerArgs) -> ExitCode {
    let config = match Config::load(args.config.as_deref()) {
        Ok(c) => Arc::new(c),
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let keys = match KeySpace::new(&args.key_prefix) {
        Ok(k) => k,
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    if args.batch == 0 || args.lease_ms < 300 {
        return fail(
            exit::BAD_INPUT,
            "--batch must be >= 1 and --lease-ms >= 300",
        );
    }
    let pool = match crate::connect::wait_for_redis(&args.redis_url, &PoolOptions::default()).await
    {
        Ok(p) => p,
        Err(code) => return code,
    };
    tracing::info!(redis = %redact_url(&args.redis_url), prefix = %args.key_prefix, "connected");
    let mut cfg = ThrottlerConfig::new(&args.redis_url, keys, config);
    cfg.batch = args.batch;
    cfg.lease = Duration::from_millis(args.lease_ms);
    match tollgate_throttler::run(cfg, pool, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::BAD_INPUT, e),
    }
}

pub(crate) fn fail(code: u8, e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(code)
}

/// Resolves on SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
