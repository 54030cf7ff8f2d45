//! `tollgate worker`: runs the worker role against Redis until SIGINT or
//! SIGTERM, then finishes or hands back its jobs and exits.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_worker::WorkerConfig;

use crate::probes::{self, ProbeArgs};
use crate::process::{exit, fail, shutdown_signal};
use crate::store::{Failure, StoreArgs, Wait};

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
}

pub async fn run(args: WorkerArgs) -> ExitCode {
    let config = match args.store.load_config() {
        Ok(c) => Arc::new(c),
        Err(f) => return f.exit(),
    };
    if args.lease_ms < 300 {
        return Failure::bad_input("--lease-ms must be >= 300").exit();
    }
    let alert_secret = match crate::alerts::secret(&config) {
        Ok(s) => s,
        Err(f) => return f.exit(),
    };
    // Listening before the store answers (see `probes`).
    let probes = match args.probes.bind().await {
        Ok(l) => l.map(probes::spawn),
        Err(f) => return f.exit(),
    };
    let backends = match args
        .store
        .shared(
            "the worker role",
            Arc::clone(&config),
            8,
            Wait::UntilReachable,
        )
        .await
    {
        Ok(b) => b,
        Err(f) => return f.exit(),
    };
    tracing::info!(store = %backends.described, "worker starting");
    let providers = match tollgate_providers::from_config_with_plans(
        &config,
        Arc::clone(&backends.throttle),
        &backends.metrics,
        Arc::clone(&backends.ledger),
    ) {
        Ok(p) => p,
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let mut cfg = WorkerConfig::new(Arc::clone(&config));
    cfg.metrics = Arc::clone(&backends.metrics);
    cfg.streams = Arc::clone(&backends.streams);
    cfg.concurrency = args.concurrency;
    cfg.lease = Duration::from_millis(args.lease_ms);
    cfg.liveness = (cfg.lease / 2).max(Duration::from_millis(300));
    cfg.maintain_every = (cfg.liveness / 3).max(Duration::from_millis(100));
    cfg.shutdown_grace = Duration::from_millis(args.grace_ms);
    if !args.operations.is_empty() {
        cfg.operations = args.operations;
    }
    if let Some(p) = &probes {
        p.ready(&backends);
    }
    // One shutdown for the worker and the alerts' deliverer.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let deliverer =
        match crate::alerts::spawn(&config, alert_secret, &backends, stopped(stop_rx.clone())) {
            Ok(d) => d,
            Err(f) => return f.exit(),
        };
    let ran = tollgate_worker::run(
        cfg,
        Arc::clone(&backends.source),
        providers,
        stopped(stop_rx),
    )
    .await;
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
    if let Some(p) = probes {
        p.stop().await;
    }
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::BAD_INPUT, e),
    }
}
