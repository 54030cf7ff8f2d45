//! What every long-running role does around its own work, written once: a pod
//! role without an api port ([`Pod`]: `tollgate worker`, `tollgate throttler`)
//! from its config to its exit, the one stop that every task of a process
//! shares ([`Stop`]), and the worker role's set-up on a process's backends
//! (`tollgate worker` and `tollgate all` run the same worker).

use std::collections::BTreeMap;
use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;

use tokio::sync::watch;
use tollgate_core::backend::Backends;
use tollgate_core::config::Config;
use tollgate_providers::Client;
use tollgate_worker::WorkerConfig;

use crate::probes::{self, ProbeArgs, ProbeServer};
use crate::process::{exit, fail, shutdown_signal};
use crate::store::{Failure, StoreArgs, Wait};

/// A pod role without an api port, started: its config read, its probes
/// listening (`--metrics-listen`), its backends on the shared store.
#[derive(Debug)]
pub struct Pod {
    pub config: Arc<Config>,
    pub backends: Backends,
    probes: Option<ProbeServer>,
}

impl Pod {
    /// Reads the config and runs `check` on it (what the role cannot run
    /// with fails before anything listens); binds the probes, which answer
    /// `/healthz` while the store is awaited; then opens the shared store,
    /// waiting for a Redis that is down. `role` names it in errors.
    pub async fn start<T>(
        role: &str,
        store: &StoreArgs,
        probes: &ProbeArgs,
        check: impl FnOnce(&Config) -> Result<T, Failure>,
    ) -> Result<(Self, T), Failure> {
        let config = Arc::new(store.load_config()?);
        let checked = check(&config)?;
        let probes = probes.bind().await?.map(probes::spawn);
        let backends = store
            .shared(role, Arc::clone(&config), 8, Wait::UntilReachable)
            .await?;
        Ok((
            Self {
                config,
                backends,
                probes,
            },
            checked,
        ))
    }

    /// The role's own work begins: its probes and metrics answer from its
    /// backends from now on.
    pub fn ready(&self) {
        if let Some(p) = &self.probes {
            p.ready(&self.backends);
        }
    }

    /// The role's work ended with `ran`: stops the probes; the exit code.
    pub async fn finish(self, ran: Result<(), impl std::fmt::Display>) -> ExitCode {
        if let Some(p) = self.probes {
            p.stop().await;
        }
        match ran {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(exit::BAD_INPUT, e),
        }
    }
}

/// One stop for every task of a process: SIGINT or SIGTERM flips it.
#[derive(Debug, Clone)]
pub struct Stop(watch::Receiver<bool>);

impl Stop {
    /// Watches for the signals from now on.
    pub fn on_signal() -> Self {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = tx.send(true);
        });
        Self(rx)
    }

    /// Resolves once the process is told to stop.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// The worker role's config on `backends`: its metrics and loop beats
/// in the process's one registry, its streamed answers to the api's readers.
pub fn worker_config(config: &Arc<Config>, backends: &Backends) -> WorkerConfig {
    let mut cfg = WorkerConfig::new(Arc::clone(config));
    cfg.metrics = Arc::clone(&backends.metrics);
    cfg.streams = Arc::clone(&backends.streams);
    cfg.plans = Some(Arc::clone(&backends.ledger));
    cfg
}

/// The worker role's provider clients: through `backends`' throttle, counted
/// in its metrics, each user's share read from its ledger.
pub fn providers(
    config: &Config,
    backends: &Backends,
) -> Result<BTreeMap<String, Arc<dyn Client>>, Failure> {
    tollgate_providers::from_config_with_plans(
        config,
        Arc::clone(&backends.throttle),
        &backends.metrics,
        Arc::clone(&backends.ledger),
    )
    .map_err(|e| Failure::bad_input(e.to_string()))
}
