//! The throttler role: for each configured provider, pops waiting tickets from the
//! provider's shared queue and grants them from the provider's token bucket,
//! sleeping exactly until the next token when the bucket is dry. It works
//! through the backends' [`Dispatchers`] (Redis); an in-process throttle grants
//! by itself and needs no throttler.
//!
//! Any number of throttlers may run at once: the grant script is the only place a
//! token is taken, so the rate stays global. Each throttler renews its liveness
//! per provider; the tickets of one whose liveness lapses (kill -9) are moved back
//! to the queue by the others. **Invariant:** the throttler holds no per-user state.
//!
//! Observed in [`ThrottlerConfig::metrics`]: grants and skipped tickets per
//! provider (from each [`Dispatch::pump`]), tickets reclaimed from dead
//! throttlers; each serve loop and the liveness loop beat a [`LoopBeat`]
//! (`/readyz` reports a silent one).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tollgate_core::{
    config::{Config, Provider},
    id::RequestId,
    metrics::{LoopBeat, Metrics},
    throttle::{Dispatch, Dispatchers},
};
use tracing::Instrument;

/// Tunables of the throttler role.
#[derive(Debug, Clone)]
pub struct ThrottlerConfig {
    pub config: Arc<Config>,
    /// Most grants per script call (bounds how long one call holds Redis).
    pub batch: u32,
    /// How long a throttler's claim on its popped tickets outlives its last
    /// heartbeat; heartbeats go every third of it.
    pub liveness: Duration,
    /// How long one BLMOVE blocks before the loop looks at shutdown again.
    pub block: Duration,
    /// Where the throttler's metrics and loop beats go: the process's
    /// registry (`Backends::metrics`); a private one by default.
    pub metrics: Arc<Metrics>,
}

impl ThrottlerConfig {
    pub fn new(config: Arc<Config>) -> Self {
        Self {
            metrics: Arc::new(Metrics::new(&config)),
            config,
            batch: 64,
            liveness: Duration::from_secs(3),
            block: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ThrottlerError {
    #[error("the config has no [providers.*]: nothing to throttle")]
    NoProviders,
}

/// Runs the throttler until `shutdown` resolves, then hands its popped tickets
/// back to the queues and ends its liveness.
pub async fn run(
    cfg: ThrottlerConfig,
    dispatchers: Arc<dyn Dispatchers>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ThrottlerError> {
    let providers: Vec<Provider> = cfg.config.providers().cloned().collect();
    if providers.is_empty() {
        return Err(ThrottlerError::NoProviders);
    }
    let id = RequestId::generate().as_str().replace('-', "");
    tracing::info!(throttler = %id, providers = providers.len(), "throttler starting");
    let (stop_tx, stop) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let dispatchers: Vec<Arc<dyn Dispatch>> = providers
        .iter()
        .map(|p| dispatchers.dispatcher(p, &id))
        .collect();
    // Liveness first, so that no ticket sits in a processing list without it.
    for d in &dispatchers {
        if let Err(e) = d.heartbeat(cfg.liveness).await {
            tracing::warn!(error = %e, "first heartbeat failed; retrying in the loop");
        }
    }
    let loops = cfg.metrics.loops();
    let named: Vec<(String, Arc<dyn Dispatch>)> = providers
        .iter()
        .map(|p| p.name.clone())
        .zip(dispatchers.iter().cloned())
        .collect();
    tasks.spawn(heartbeats(
        named,
        cfg.liveness,
        Arc::clone(&cfg.metrics),
        loops.register("throttler heartbeat", cfg.liveness / 3),
        stop.clone(),
    ));
    for (d, p) in dispatchers.iter().zip(&providers) {
        let span = tracing::info_span!("serve", provider = %p.name);
        let beat = loops.register(format!("throttler serve {}", p.name), cfg.block);
        tasks.spawn(
            serve(
                Arc::clone(d),
                p.name.clone(),
                cfg.clone(),
                beat,
                stop.clone(),
            )
            .instrument(span),
        );
    }
    shutdown.await;
    tracing::info!("throttler stopping");
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    for d in &dispatchers {
        match d.retire().await {
            Ok(n) => tracing::info!(returned = n, "retired: its tickets are back in the queue"),
            Err(e) => tracing::warn!(error = %e, "retiring failed"),
        }
    }
    Ok(())
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// One provider: pump while there is work, sleep exactly until the next token
/// when the bucket is dry, block on the queue when it is empty.
async fn serve(
    d: Arc<dyn Dispatch>,
    provider: String,
    cfg: ThrottlerConfig,
    beat: LoopBeat,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(50);
    while !*stop.borrow() {
        beat.beat(cfg.block);
        let step = async {
            let pumped = d.pump(cfg.batch).await?;
            if pumped.granted > 0 || pumped.skipped > 0 {
                cfg.metrics
                    .pumped(&provider, pumped.granted, pumped.skipped);
                tracing::debug!(granted = pumped.granted, skipped = pumped.skipped, "pumped");
            }
            if let Some(wait) = pumped.wait {
                // A slow bucket sleeps long: the loop says so first.
                beat.beat(wait);
                tokio::time::sleep(wait).await;
            } else if !pumped.more {
                // A user held back by its cap whose slot frees itself rejoins
                // on the next pump: no later than that (BLMOVE's 0 is forever).
                let block = pumped.capped.map_or(cfg.block, |d| {
                    d.max(Duration::from_millis(1)).min(cfg.block)
                });
                d.wait_for_ticket(block).await?;
            }
            Ok::<_, tollgate_core::throttle::ThrottleError>(())
        };
        tokio::select! {
            r = step => match r {
                Ok(()) => backoff = Duration::from_millis(50),
                Err(e) => {
                    tracing::warn!(error = %e, "throttle step failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = stopped(&mut stop) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            },
            // A BLMOVE dropped here may still move a ticket: it waits in this
            // throttler's processing list until `retire` puts it back.
            () = stopped(&mut stop) => {}
        }
    }
}

/// Renews the liveness and reclaims the tickets of throttlers that died.
async fn heartbeats(
    ds: Vec<(String, Arc<dyn Dispatch>)>,
    liveness: Duration,
    metrics: Arc<Metrics>,
    beat: LoopBeat,
    mut stop: watch::Receiver<bool>,
) {
    let every = liveness / 3;
    loop {
        for (provider, d) in &ds {
            match d.heartbeat(liveness).await {
                Ok(dead) => {
                    for other in dead {
                        match d.reclaim(&other).await {
                            Ok(Some(n)) => {
                                metrics.tickets_reclaimed(provider, n);
                                tracing::warn!(
                                    throttler = %other, returned = n,
                                    "reclaimed the tickets of a dead throttler"
                                )
                            }
                            Ok(None) => {}
                            Err(e) => tracing::warn!(error = %e, "reclaim failed"),
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
            }
        }
        beat.beat(every);
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stopped(&mut stop) => return,
        }
    }
}
