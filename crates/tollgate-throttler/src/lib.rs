//! The throttler role: for each configured provider, pops waiting tickets from the
//! provider's Redis queue and grants them from the provider's token bucket,
//! sleeping exactly until the next token when the bucket is dry.
//!
//! Any number of throttlers may run at once: the grant script is the only place a
//! token is taken, so the rate stays global. Each throttler holds a lease per
//! provider; the tickets of one whose lease ends (kill -9) are moved back to the
//! queue by the others. **Invariant:** the throttler holds no per-user state.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tollgate_core::{Config, Provider, RequestId, ThrottleError};
use tollgate_redis::throttle::{blocking_connection, Dispatcher};
use tollgate_redis::{KeySpace, Pool};
use tracing::Instrument;

/// Tunables of the throttler role.
#[derive(Debug, Clone)]
pub struct ThrottlerConfig {
    /// For the blocking connections (one per provider).
    pub redis_url: String,
    pub keys: KeySpace,
    pub config: Arc<Config>,
    /// Most grants per script call (bounds how long one call holds Redis).
    pub batch: u32,
    /// How long a throttler's claim on its popped tickets outlives its last
    /// heartbeat; heartbeats go every third of it.
    pub lease: Duration,
    /// How long one BLMOVE blocks before the loop looks at shutdown again.
    pub block: Duration,
}

impl ThrottlerConfig {
    pub fn new(redis_url: &str, keys: KeySpace, config: Arc<Config>) -> Self {
        Self {
            redis_url: redis_url.to_owned(),
            keys,
            config,
            batch: 64,
            lease: Duration::from_secs(3),
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
/// back to the queues and ends its leases.
pub async fn run(
    cfg: ThrottlerConfig,
    pool: Pool,
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
    let dispatchers: Vec<Dispatcher> = providers
        .iter()
        .map(|p| Dispatcher::new(pool.clone(), &cfg.keys, p, &id))
        .collect();
    // Lease first, so that no ticket sits in a processing list without one.
    for d in &dispatchers {
        if let Err(e) = d.heartbeat(cfg.lease).await {
            tracing::warn!(error = %e, "first heartbeat failed; retrying in the loop");
        }
    }
    tasks.spawn(heartbeats(dispatchers.clone(), cfg.lease, stop.clone()));
    for (d, p) in dispatchers.iter().zip(&providers) {
        let span = tracing::info_span!("serve", provider = %p.name);
        tasks.spawn(serve(d.clone(), cfg.clone(), stop.clone()).instrument(span));
    }
    shutdown.await;
    tracing::info!("throttler stopping");
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    for d in &dispatchers {
        match d.release().await {
            Ok(n) => tracing::info!(returned = n, "lease released"),
            Err(e) => tracing::warn!(error = %e, "releasing the lease failed"),
        }
    }
    Ok(())
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// One provider: pump while there is work, sleep exactly until the next token
/// when the bucket is dry, block on the queue when it is empty.
async fn serve(d: Dispatcher, cfg: ThrottlerConfig, mut stop: watch::Receiver<bool>) {
    let mut conn = None;
    let mut backoff = Duration::from_millis(50);
    while !*stop.borrow() {
        let step = async {
            let pumped = d.pump(cfg.batch).await?;
            if pumped.granted > 0 || pumped.skipped > 0 {
                tracing::debug!(granted = pumped.granted, skipped = pumped.skipped, "pumped");
            }
            if let Some(wait) = pumped.wait {
                tokio::time::sleep(wait).await;
            } else if !pumped.more {
                if conn.is_none() {
                    conn = Some(blocking_connection(&cfg.redis_url).await?);
                }
                if let Some(c) = conn.as_mut() {
                    if let Err(e) = d.wait_for_ticket(c, cfg.block).await {
                        conn = None;
                        return Err(e);
                    }
                }
            }
            Ok::<_, ThrottleError>(())
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
            // throttler's processing list until `release` puts it back.
            () = stopped(&mut stop) => {}
        }
    }
}

/// Renews the leases and reclaims the tickets of throttlers that died.
async fn heartbeats(ds: Vec<Dispatcher>, lease: Duration, mut stop: watch::Receiver<bool>) {
    let every = lease / 3;
    loop {
        for d in &ds {
            match d.heartbeat(lease).await {
                Ok(dead) => {
                    for other in dead {
                        match d.reclaim(&other).await {
                            Ok(Some(n)) => tracing::warn!(
                                throttler = %other, returned = n,
                                "reclaimed the tickets of a dead throttler"
                            ),
                            Ok(None) => {}
                            Err(e) => tracing::warn!(error = %e, "reclaim failed"),
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
            }
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stopped(&mut stop) => return,
        }
    }
}
