//! The budget alerts' deliverer as a task of `tollgate worker` and `tollgate
//! all` (with `[alerts]` configured): see `tollgate-alerts`.

use std::sync::Arc;

use tollgate_alerts::Deliverer;
use tollgate_core::backend::Backends;
use tollgate_core::config::Config;

use crate::store::Failure;

/// The HMAC secret of `[alerts]`, read before anything starts: a missing
/// variable is a start-up error naming it. `None` without `[alerts]`.
pub fn secret(config: &Config) -> Result<Option<Vec<u8>>, Failure> {
    let Some(alerts) = config.alerts() else {
        return Ok(None);
    };
    tollgate_alerts::secret_from_env(alerts)
        .map(Some)
        .map_err(|e| Failure::bad_input(e.to_string()))
}

/// Spawns the deliverer (with `[alerts]`) until `stop` resolves.
pub fn spawn(
    config: &Config,
    secret: Option<Vec<u8>>,
    backends: &Backends,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<Option<tokio::task::JoinHandle<()>>, Failure> {
    let (Some(alerts), Some(secret)) = (config.alerts(), secret) else {
        return Ok(None);
    };
    let mut deliverer = Deliverer::new(
        alerts,
        secret,
        Arc::clone(&backends.alerts),
        Arc::clone(&backends.metrics),
    )
    .map_err(|e| Failure::bad_input(e.to_string()))?;
    deliverer.currency = config.currency();
    Ok(Some(tokio::spawn(deliverer.run(stop))))
}
