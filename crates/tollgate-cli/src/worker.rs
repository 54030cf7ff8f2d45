//! `tollgate worker`: runs the worker role against Redis until SIGINT or
//! SIGTERM, then finishes or hands back its jobs and exits.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::probes::ProbeArgs;
use crate::role::{self, Pod, Stop};
use crate::store::{Failure, StoreArgs};

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    store: StoreArgs,

    #[command(flatten)]
    probes: ProbeArgs,

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

    /// The most of a worker's slots one user's jobs hold at once, as a
    /// fraction of --concurrency in (0, 1]: at most max(1, ceil(concurrency ×
    /// share)) of them, the rest of a user's jobs waiting in the queue behind
    /// other users' (a job taken past it goes back to the queue's tail). The
    /// default, 0.5: one user's flood of long calls (streams) never holds more
    /// than half of a worker, leaving the other half to everyone else. 1: no
    /// bound (a deployment with one heavy user); a plan's `max_in_flight`
    /// sets its users' cap instead.
    #[arg(long, env = "TOLLGATE_WORKER_USER_SHARE", default_value_t = tollgate_worker::USER_SHARE, value_parser = user_share)]
    user_share: f64,
}

/// `--user-share`: a fraction in (0, 1].
pub fn user_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("must be a number in (0, 1], got {s:?}")),
    }
}

pub async fn run(args: WorkerArgs) -> ExitCode {
    let lease_ms = args.lease_ms;
    let started = Pod::start("the worker role", &args.store, &args.probes, |config| {
        if lease_ms < 300 {
            return Err(Failure::bad_input("--lease-ms must be >= 300"));
        }
        crate::alerts::secret(config)
    })
    .await;
    let (pod, alert_secret) = match started {
        Ok(s) => s,
        Err(f) => return f.exit(),
    };
    let (config, backends) = (&pod.config, &pod.backends);
    tracing::info!(store = %backends.described, "worker starting");
    let providers = match role::providers(config, backends) {
        Ok(p) => p,
        Err(f) => return f.exit(),
    };
    let mut cfg = role::worker_config(config, backends);
    cfg.concurrency = args.concurrency;
    cfg.user_share = args.user_share;
    cfg.lease = Duration::from_millis(args.lease_ms);
    cfg.liveness = (cfg.lease / 2).max(Duration::from_millis(300));
    cfg.maintain_every = (cfg.liveness / 3).max(Duration::from_millis(100));
    cfg.shutdown_grace = Duration::from_millis(args.grace_ms);
    if !args.operations.is_empty() {
        cfg.operations = args.operations;
    }
    pod.ready();
    // One stop for the worker and the alerts' deliverer.
    let stop = Stop::on_signal();
    let deliverer = match crate::alerts::spawn(config, alert_secret, backends, stop.stopped()) {
        Ok(d) => d,
        Err(f) => return f.exit(),
    };
    let ran =
        tollgate_worker::run(cfg, Arc::clone(&backends.source), providers, stop.stopped()).await;
    if let Some(d) = deliverer {
        let _ = d.await;
    }
    // The waits dropped at shutdown cancel their tickets before the runtime
    // stops (else they stay queued until their deadline).
    let left = backends.throttle.drain(Duration::from_secs(5)).await;
    if left > 0 {
        tracing::warn!(
            left,
            "throttle tickets not cancelled at exit; they expire at their deadline"
        );
    }
    pod.finish(ran).await
}
