//! `tollgate throttler`: runs the throttler role against Redis until SIGINT or
//! SIGTERM, then hands its popped tickets back and exits.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_throttler::ThrottlerConfig;

use crate::probes::{self, ProbeArgs};
use crate::process::{exit, fail, shutdown_signal};
use crate::store::{Failure, StoreArgs, Wait};

#[derive(Debug, Args)]
pub struct ThrottlerArgs {
    #[command(flatten)]
    store: StoreArgs,

    #[command(flatten)]
    probes: ProbeArgs,

    /// Most grants per script call.
    #[arg(long, env = "TOLLGATE_THROTTLER_BATCH", default_value_t = 64)]
    batch: u32,

    /// How long the tickets popped by a throttler that stopped renewing its
    /// liveness (died, paused) stay its own before other throttlers put them
    /// back in the queue, in ms. `--lease-ms` is its former name, still
    /// accepted (deprecated: the throttler holds a liveness, not a lease).
    #[arg(
        long,
        alias = "lease-ms",
        env = "TOLLGATE_THROTTLER_LIVENESS_MS",
        default_value_t = 3000
    )]
    liveness_ms: u64,
}

pub async fn run(args: ThrottlerArgs) -> ExitCode {
    let config = match args.store.load_config() {
        Ok(c) => Arc::new(c),
        Err(f) => return f.exit(),
    };
    if args.batch == 0 || args.liveness_ms < 300 {
        return Failure::bad_input("--batch must be >= 1 and --liveness-ms >= 300").exit();
    }
    // Listening before the store answers (see `probes`).
    let probes = match args.probes.bind().await {
        Ok(l) => l.map(probes::spawn),
        Err(f) => return f.exit(),
    };
    let backends = match args
        .store
        .shared(
            "the throttler role",
            Arc::clone(&config),
            8,
            Wait::UntilReachable,
        )
        .await
    {
        Ok(b) => b,
        Err(f) => return f.exit(),
    };
    let Some(dispatchers) = backends.dispatchers.clone() else {
        return Failure::bad_input("this store's throttle needs no throttler").exit();
    };
    tracing::info!(store = %backends.described, "throttler starting");
    let mut cfg = ThrottlerConfig::new(config);
    cfg.metrics = Arc::clone(&backends.metrics);
    cfg.batch = args.batch;
    cfg.liveness = Duration::from_millis(args.liveness_ms);
    if let Some(p) = &probes {
        p.ready(&backends);
    }
    let ran = tollgate_throttler::run(cfg, dispatchers, shutdown_signal()).await;
    if let Some(p) = probes {
        p.stop().await;
    }
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::BAD_INPUT, e),
    }
}
