//! `tollgate throttler`: runs the throttler role against Redis until SIGINT or
//! SIGTERM, then hands its popped tickets back and exits.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_throttler::ThrottlerConfig;

use crate::probes::ProbeArgs;
use crate::process::shutdown_signal;
use crate::role::Pod;
use crate::store::{Failure, StoreArgs};

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
    let (batch, liveness_ms) = (args.batch, args.liveness_ms);
    let started = Pod::start("the throttler role", &args.store, &args.probes, |_| {
        if batch == 0 || liveness_ms < 300 {
            return Err(Failure::bad_input(
                "--batch must be >= 1 and --liveness-ms >= 300",
            ));
        }
        Ok(())
    })
    .await;
    let pod = match started {
        Ok((pod, ())) => pod,
        Err(f) => return f.exit(),
    };
    let Some(dispatchers) = pod.backends.dispatchers.clone() else {
        return Failure::bad_input("this store's throttle needs no throttler").exit();
    };
    tracing::info!(store = %pod.backends.described, "throttler starting");
    let mut cfg = ThrottlerConfig::new(Arc::clone(&pod.config));
    cfg.metrics = Arc::clone(&pod.backends.metrics);
    cfg.batch = args.batch;
    cfg.liveness = Duration::from_millis(args.liveness_ms);
    pod.ready();
    let ran = tollgate_throttler::run(cfg, dispatchers, shutdown_signal()).await;
    pod.finish(ran).await
}
