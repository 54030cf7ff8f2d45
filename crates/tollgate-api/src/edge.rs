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
//! - **Head size** ([`MAX_HEADER_BYTES`]): a head that does not fit is answered
//!   `431` and the connection closed, so a head costs at most that much memory.
//! - **Body time** ([`Edge::body_timeout`]): a request's body must arrive whole
//!   within it, counted from the end of its head: a **total** deadline, not an
//!   idle timer, so a body trickled a byte at a time is cut off then however
//!   steadily it trickles (reading it fails, the request is answered and the
//!   connection closed). A body the client declares larger than the body
//!   limit is refused at once, unread (`413`, see the router).
//! - **Connections** ([`Edge::max_connections`], [`Edge::max_per_client`]): a
//!   connection over either cap is shed as soon as it is accepted: it is
//!   answered a fixed `503` with `Retry-After` (written without reading the
//!   request, within [`SHED_WRITE_TIMEOUT`]), then closed. The per-client cap
//!   keys on the TCP peer's address. Shedding takes descriptors too, so
//!   [`Edge::max_connections`] counts the connections being shed: a 16th of it
//!   (at most [`MAX_SHEDDING`]) is kept for them, the rest serves requests; when
//!   every shedding place is taken, a connection over the cap is closed
//!   without an answer. The process's connections never exceed
//!   `max_connections`, whatever the clients do.
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
    /// The longest a request's body may take to arrive, in all, from the end
    /// of its head (a total deadline, not an idle timer).
    pub body_timeout: Duration,
    /// Connections open at once, over every client.
    pub max_connections: usize,
    /// Connections open at once from one peer address.
    pub max_per_client: usize,
}

/// The most connections being shed at once (see the module docs).
pub const MAX_SHEDDING: usize = 64;
/// How long a shed connection gets to take its 503 ...
pub const SHED_WRITE_TIMEOUT: Duration = Duration::from_millis(500);
/// ... and then to close (what it sends meanwhile is read and dropped).
pub const SHED_LINGER: Duration = Duration::from_millis(100);
/// The whole answer of a shed connection.
const SHED_RESPONSE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/problem+json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 130\r\n\r\n\
{\"type\":\"/problems/overloaded\",\"title\":\"The api holds its most connections: retry after Retry-After\",\"status\":503,\"detail\":\"shed\"}";

/// 10 s for a head: a browser or an SDK sends one in milliseconds.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// 30 s for a whole body: a 2 MiB body at ~70 KB/s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// The most bytes a request's head (request line and headers) may take, so
/// the memory a connection holds while its head arrives is bounded; a longer
/// head is answered `431` and its connection closed. 64 KiB: twice what
/// common proxies accept by default.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
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
    /// Of [`Edge::max_connections`], the places kept for shedding.
    pub fn shedding(&self) -> usize {
        (self.max_connections / 16).min(MAX_SHEDDING)
    }

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
    let open = Arc::new(Semaphore::new(edge.max_connections - edge.shedding()));
    let shedding = Arc::new(Semaphore::new(edge.shedding()));
    let clients = Arc::new(Clients::default());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(edge.header_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .keep_alive(true);
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
            tracing::debug!(%peer, max = edge.max_connections, "connection shed: the api holds its most connections");
            shed(stream, &shedding);
            continue;
        };
        let Some(held) = clients.hold(peer.ip(), edge.max_per_client) else {
            tracing::debug!(%peer, max = edge.max_per_client, "connection shed: this client holds its most connections");
            shed(stream, &shedding);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = app
            .clone()
            .map_request(move |req: hyper::Request<hyper::body::Incoming>| {
                let mut req = req.map(|body| Deadline::body(body, edge.body_timeout));
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

/// A request body that must arrive whole by a deadline set when its head was
/// read ([`Edge::body_timeout`]): past it, reading fails with
/// [`BodyDeadlinePassed`], however recently a byte came.
struct Deadline<B> {
    inner: B,
    timeout: Duration,
    at: std::pin::Pin<Box<tokio::time::Sleep>>,
    passed: bool,
}

/// The error of a body read past its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive whole within {0:?}")]
pub struct BodyDeadlinePassed(Duration);

impl<B> Deadline<B>
where
    B: hyper::body::Body<Data = hyper::body::Bytes> + Unpin + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    /// `body` under a deadline `timeout` from now; an empty body as it is
    /// (no timer to keep).
    fn body(body: B, timeout: Duration) -> axum::body::Body {
        if body.is_end_stream() {
            return axum::body::Body::new(body);
        }
        axum::body::Body::new(Self {
            inner: body,
            timeout,
            at: Box::pin(tokio::time::sleep(timeout)),
            passed: false,
        })
    }
}

impl<B> hyper::body::Body for Deadline<B>
where
    B: hyper::body::Body<Data = hyper::body::Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = hyper::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        use std::future::Future as _;
        let this = self.get_mut();
        if this.passed {
            return std::task::Poll::Ready(None);
        }
        // The deadline first: a body that keeps a byte ready is cut off too.
        if this.at.as_mut().poll(cx).is_ready() {
            this.passed = true;
            return std::task::Poll::Ready(Some(Err(BodyDeadlinePassed(this.timeout).into())));
        }
        std::pin::Pin::new(&mut this.inner)
            .poll_frame(cx)
            .map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.passed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Answers `stream` the fixed 503 and closes it, in a task holding one of the
/// `shedding` places for at most [`SHED_WRITE_TIMEOUT`] + [`SHED_LINGER`];
/// with no place free, closes it at once. The request is never parsed: after
/// the answer the write side is shut, and what the client sends is drained
/// for [`SHED_LINGER`] or until it closes (a close with unread data would
/// reset the connection, and could discard the answer before the client
/// reads it).
fn shed(stream: tokio::net::TcpStream, shedding: &Arc<Semaphore>) {
    let Ok(place) = Arc::clone(shedding).try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = stream;
        let answered = tokio::time::timeout(SHED_WRITE_TIMEOUT, async {
            stream.write_all(SHED_RESPONSE).await?;
            stream.shutdown().await
        })
        .await;
        if matches!(answered, Ok(Ok(()))) {
            let mut sink = [0u8; 1024];
            let _ = tokio::time::timeout(SHED_LINGER, async {
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        }
        drop((stream, place));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shed_answer_is_whole() {
        let text = std::str::from_utf8(SHED_RESPONSE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["type"], crate::problem::ProblemType::Overloaded.uri());
        assert_eq!(
            Edge {
                max_connections: 8,
                ..Edge::default()
            }
            .shedding(),
            0
        );
        assert_eq!(Edge::default().shedding(), MAX_SHEDDING);
    }

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
