//! The api's edge: how connections are accepted, and how long and how many of
//! them one client may hold. A client that opens connections and sends its
//! headers slowly (or nothing at all) must not exhaust the process's file
//! descriptors or memory, and one address's connections must not crowd out
//! another's.
//!
//! - **Header time** ([`Edge::header_timeout`]): a request's head must arrive
//!   whole within it, or the connection is closed. hyper starts the timer when
//!   it waits for a head, so it also bounds how long a keep-alive connection
//!   may sit idle between requests.
//! - **Body time** ([`Edge::body_timeout`]): a request's body must arrive whole
//!   within it (a body trickled a byte at a time is cut off).
//! - **Connections** ([`Edge::max_connections`], [`Edge::max_per_client`]): a
//!   connection over either cap is closed as soon as it is accepted, before
//!   anything is read from it; the per-client cap keys on the TCP peer's
//!   address.
//!
//! Shutdown: no new connection is accepted, each open one finishes the request
//! it serves and is closed, then [`serve`] returns.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt as _;

/// How the api's listener bounds its clients; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edge {
    /// The longest a request's head may take to arrive, and a keep-alive
    /// connection may stay idle.
    pub header_timeout: Duration,
    /// The longest a request's body may take to arrive.
    pub body_timeout: Duration,
    /// Connections open at once, over every client.
    pub max_connections: usize,
    /// Connections open at once from one peer address.
    pub max_per_client: usize,
}

/// 10 s for a head: a browser or an SDK sends one in milliseconds.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// 30 s for a body: a 2 MiB body at ~70 KB/s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Well under the 65,536 file descriptors a container usually gets.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Room for a busy client (an application server's pool, a NAT) without
/// letting one address take the whole process.
pub const DEFAULT_MAX_PER_CLIENT: usize = 512;

impl Default for Edge {
    fn default() -> Self {
        Self {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_client: DEFAULT_MAX_PER_CLIENT,
        }
    }
}

/// Why an [`Edge`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EdgeError(String);

impl Edge {
    /// Every bound must be positive, and a client's share at most the whole.
    pub fn validate(&self) -> Result<(), EdgeError> {
        if self.header_timeout.is_zero() || self.body_timeout.is_zero() {
            return Err(EdgeError(
                "the header and body timeouts must be > 0".to_owned(),
            ));
        }
        if self.max_connections == 0 || self.max_per_client == 0 {
            return Err(EdgeError("the connection limits must be >= 1".to_owned()));
        }
        if self.max_per_client > self.max_connections {
            return Err(EdgeError(format!(
                "the connections per client ({}) exceed the connections in all ({})",
                self.max_per_client, self.max_connections
            )));
        }
        Ok(())
    }
}

/// A TCP listener and the bounds it serves under. A bare
/// [`tokio::net::TcpListener`] converts into one with [`Edge::default`].
#[derive(Debug)]
pub struct Listener {
    tcp: TcpListener,
    edge: Edge,
}

impl Listener {
    pub fn new(tcp: TcpListener, edge: Edge) -> Self {
        Self { tcp, edge }
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

impl From<TcpListener> for Listener {
    fn from(tcp: TcpListener) -> Self {
        Self::new(tcp, Edge::default())
    }
}

/// Open connections per peer address; a [`Held`] gives its place back when
/// dropped.
#[derive(Debug, Default)]
struct Clients(Mutex<HashMap<IpAddr, usize>>);

/// One connection's place in [`Clients`].
struct Held {
    clients: Arc<Clients>,
    ip: IpAddr,
}

impl Clients {
    fn hold(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<Held> {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = map.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Held {
            clients: Arc::clone(self),
            ip,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut map = self
            .clients
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// Serves `app` on `listener` under its [`Edge`], each request carrying its
/// peer's address (`ConnectInfo<SocketAddr>`), until `shutdown` resolves;
/// then waits for the open connections to finish their requests.
pub async fn serve(
    app: axum::Router,
    listener: Listener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Listener { tcp, edge } = listener;
    edge.validate().map_err(std::io::Error::other)?;
    let open = Arc::new(Semaphore::new(edge.max_connections));
    let clients = Arc::new(Clients::default());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(edge.header_timeout)
        .keep_alive(true);
    let app = tower_http::timeout::RequestBodyTimeout::new(app, edge.body_timeout);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = tcp.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors (EMFILE) or a connection reset
                    // before it was accepted: not fatal; a pause keeps an
                    // exhausted process from spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&open).try_acquire_owned() else {
            tracing::debug!(%peer, max = edge.max_connections, "connection refused: the api holds its most connections");
            continue;
        };
        let Some(held) = clients.hold(peer.ip(), edge.max_per_client) else {
            tracing::debug!(%peer, max = edge.max_per_client, "connection refused: this client holds its most connections");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = app
            .clone()
            .map_request(move |mut req: axum::extract::Request<_>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            });
        let conn = http.serve_connection(
            TokioIo::new(stream),
            hyper_util::service::TowerToHyperService::new(service),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                // A client that went away, or one cut off by a timeout.
                tracing::debug!(%peer, error = %e, "connection ended");
            }
            drop((slot, held));
        });
    }
    drop(tcp);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_its_bounds() {
        assert_eq!(Edge::default().validate(), Ok(()));
        let zero = Edge {
            header_timeout: Duration::ZERO,
            ..Edge::default()
        };
        assert!(zero.validate().is_err());
        let none = Edge {
            max_per_client: 0,
            ..Edge::default()
        };
        assert!(none.validate().is_err());
        let more = Edge {
            max_connections: 4,
            max_per_client: 5,
            ..Edge::default()
        };
        assert!(more.validate().unwrap_err().to_string().contains("exceed"));
    }

    #[test]
    fn a_client_holds_at_most_its_share_and_gets_it_back() {
        let clients = Arc::new(Clients::default());
        let a: IpAddr = [127, 0, 0, 2].into();
        let b: IpAddr = [127, 0, 0, 3].into();
        let first = clients.hold(a, 2);
        let second = clients.hold(a, 2);
        assert!(first.is_some() && second.is_some());
        assert!(clients.hold(a, 2).is_none(), "a third for the same address");
        assert!(
            clients.hold(b, 2).is_some(),
            "another address is not crowded out"
        );
        drop(first);
        assert!(
            clients.hold(a, 2).is_some(),
            "a place given back is free again"
        );
        drop(second);
    }
}
