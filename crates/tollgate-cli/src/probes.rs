//! `--metrics-listen`: the probes and metrics of a role without an api port (a
//! worker, a throttler), served on their own listener from the role's start to
//! its exit: while the role waits for Redis, `/healthz` answers and the rest is
//! 503 (`health::Starting`). `tollgate all` and `tollgate api` serve the same endpoints on the
//! api's port.

use std::net::SocketAddr;

use clap::Args;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate_api::health::{Probes, Starting};
use tollgate_core::backend::Backends;

use crate::store::Failure;

#[derive(Debug, Clone, Args)]
pub struct ProbeArgs {
    /// Serve /healthz, /readyz and /metrics (Prometheus) on this address, e.g.
    /// 0.0.0.0:9091. Unset: no listener.
    #[arg(long, env = "TOLLGATE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
}

impl ProbeArgs {
    /// Binds the address now, so that a bad or taken one fails at start.
    pub async fn bind(&self) -> Result<Option<tokio::net::TcpListener>, Failure> {
        let Some(addr) = self.metrics_listen else {
            return Ok(None);
        };
        crate::process::listen(addr, "--metrics-listen")
            .await
            .map(Some)
    }
}

/// The probes server of a role, from its start.
#[derive(Debug)]
pub struct ProbeServer {
    starting: Starting,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

/// Serves the probes on `listener` until [`ProbeServer::stop`]: those of a
/// role still waiting for its store until [`ProbeServer::ready`].
pub fn spawn(listener: tokio::net::TcpListener) -> ProbeServer {
    let (stop, stopped) = oneshot::channel::<()>();
    let starting = Starting::default();
    let task = tokio::spawn(tollgate_api::health::serve(
        starting.router(),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    ProbeServer {
        starting,
        stop,
        task,
    }
}

impl ProbeServer {
    /// The role's backends exist: its probes and metrics answer from now on.
    pub fn ready(&self, backends: &Backends) {
        self.starting
            .ready(tollgate_api::health::router(Probes::new(backends)));
    }

    /// Stops serving (the role has finished) and waits for the server.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the probes server failed"),
            Err(e) => tracing::warn!(error = %e, "the probes server task failed"),
        }
    }
}
