//! `--metrics-listen`: the probes and metrics of a role without an api port (a
//! worker, a throttler), served on their own listener from the role's start to
//! its exit. `tollgate all` and `tollgate api` serve the same endpoints on the
//! api's port.

use std::net::SocketAddr;

use clap::Args;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate_api::health::Probes;
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
        tokio::net::TcpListener::bind(addr)
            .await
            .map(Some)
            .map_err(|e| Failure::other(format!("cannot listen on {addr} (--metrics-listen): {e}")))
    }
}

/// The probes server of a running role.
#[derive(Debug)]
pub struct ProbeServer {
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

/// Serves the probes of `backends` on `listener` until [`ProbeServer::stop`].
pub fn spawn(listener: tokio::net::TcpListener, backends: &Backends) -> ProbeServer {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(tollgate_api::health::serve(
        Probes::new(backends),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    ProbeServer { stop, task }
}

impl ProbeServer {
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
