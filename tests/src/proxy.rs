//! A TCP proxy between the roles and Redis that injects network faults, each
//! switchable at run time:
//!
//! - it loses the reply of one chosen command: the command reaches Redis and
//!   runs, but its connection is cut before the answer comes back. The caller
//!   cannot tell what happened, which is the point: an outcome it could not
//!   observe must not be taken as a failure;
//! - it delays every chunk, each way, by a set latency (in order per
//!   connection; the delayed bytes wait in the proxy, other connections go on);
//! - it cuts every open connection at once, and can refuse new ones for a
//!   while (a partition): a refused connection is accepted and closed at once,
//!   so its client sees an error rather than a hang.
//!
//! The upstream address stays the same for the proxy's life: a Redis restarted
//! on the same port is reached again by new connections, and a connection made
//! while it is down is closed at once.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// How long a new connection may take to reach the upstream.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Chunks read but not yet passed on, per direction of a connection; a full
/// queue stops the reading (and so the sender, by TCP's own flow control).
const QUEUE: usize = 256;

/// What the proxy did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Open connections cut by [`FaultProxy::cut_all`].
    pub cut: u64,
    /// New connections closed at once during a partition.
    pub refused: u64,
    /// New connections closed at once because the upstream was unreachable.
    pub unreachable: u64,
    /// Replies lost by [`FaultProxy::lose_reply_of`].
    pub tripped: u64,
}

/// The proxy; it stops accepting, and cuts every connection, when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    armed: Mutex<Option<Vec<u8>>>,
    /// Added to every chunk, each way, in µs.
    latency_us: AtomicU64,
    /// New connections are closed at once until then.
    partition_until: Mutex<Option<Instant>>,
    /// Bumped to cut every open connection.
    epoch: watch::Sender<u64>,
    /// Connections between their upstream connect and their end.
    open: AtomicU64,
    accepted: AtomicU64,
    cut: AtomicU64,
    refused: AtomicU64,
    unreachable: AtomicU64,
    tripped: AtomicU64,
}

impl Shared {
    fn partitioned(&self) -> bool {
        lock(&self.partition_until).is_some_and(|until| Instant::now() < until)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FaultProxy {
    /// Proxies `127.0.0.1:<free port>` to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let shared = Arc::new(Shared {
            armed: Mutex::default(),
            latency_us: AtomicU64::new(0),
            partition_until: Mutex::default(),
            epoch: watch::Sender::new(0),
            open: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            unreachable: AtomicU64::new(0),
            tripped: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((client, _)) => {
                        s.accepted.fetch_add(1, Ordering::SeqCst);
                        tokio::spawn(serve(client, upstream, Arc::clone(&s)));
                    }
                    // Out of descriptors, or a connection reset in the backlog.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        });
        Self { addr, shared, task }
    }

    /// `redis://` URL of the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// The next request whose bytes contain `needle` goes through to Redis,
    /// and its connection is cut before the reply is passed back.
    pub fn lose_reply_of(&self, needle: &[u8]) {
        *lock(&self.shared.armed) = Some(needle.to_vec());
    }

    /// How many replies were lost so far.
    pub fn tripped(&self) -> u64 {
        self.shared.tripped.load(Ordering::SeqCst)
    }

    /// Every chunk read from now on, either way, is passed on `latency` after
    /// it was read (`Duration::ZERO`: at once). Order is kept per connection.
    pub fn set_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.shared.latency_us.store(us, Ordering::SeqCst);
    }

    /// Cuts every open connection now (both of its sockets closed, whatever
    /// was waiting in the proxy lost), and closes new connections at once
    /// for `partition` from now (`Duration::ZERO`: none; a longer partition
    /// already under way is kept). Returns how many connections were open.
    pub fn cut_all(&self, partition: Duration) -> u64 {
        {
            let mut until = lock(&self.shared.partition_until);
            let end = Instant::now() + partition;
            *until = Some(until.map_or(end, |u| u.max(end)));
        }
        // After the partition is set: a connection that checked it before is cut here.
        let open = self.shared.open.load(Ordering::SeqCst);
        self.shared.epoch.send_modify(|e| *e += 1);
        open
    }

    /// Whether new connections are being closed at once.
    pub fn partitioned(&self) -> bool {
        self.shared.partitioned()
    }

    /// Ends every fault: no latency, no partition, no reply to lose.
    pub fn clear(&self) {
        self.set_latency(Duration::ZERO);
        *lock(&self.shared.partition_until) = None;
        *lock(&self.shared.armed) = None;
    }

    pub fn stats(&self) -> ProxyStats {
        let s = &self.shared;
        ProxyStats {
            accepted: s.accepted.load(Ordering::SeqCst),
            cut: s.cut.load(Ordering::SeqCst),
            refused: s.refused.load(Ordering::SeqCst),
            unreachable: s.unreachable.load(Ordering::SeqCst),
            tripped: s.tripped.load(Ordering::SeqCst),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.epoch.send_modify(|e| *e += 1);
    }
}

/// Counts a connection open from its upstream connect to its end.
struct Open<'a>(&'a AtomicU64);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn serve(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    // Before the partition check: a cut made after it still reaches this one.
    let mut epoch = shared.epoch.subscribe();
    if shared.partitioned() {
        shared.refused.fetch_add(1, Ordering::SeqCst);
        return;
    }
    let server = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream)).await {
        Ok(Ok(server)) => server,
        _ => {
            shared.unreachable.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    shared.open.fetch_add(1, Ordering::SeqCst);
    let _open = Open(&shared.open);
    tokio::select! {
        () = pipe(client, server, &shared) => {}
        _ = epoch.changed() => {
            shared.cut.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn pipe(client: TcpStream, server: TcpStream, shared: &Shared) {
    let (client_rx, client_tx) = client.into_split();
    let (server_rx, server_tx) = server.into_split();
    // Set when the armed request is read, before it is written: no byte of a
    // reply passes back after that.
    let lost = AtomicBool::new(false);
    let hit = |bytes: &[u8]| {
        let mut armed = lock(&shared.armed);
        let hit = armed
            .as_ref()
            .is_some_and(|needle| bytes.windows(needle.len()).any(|w| w == needle));
        if hit {
            *armed = None;
            lost.store(true, Ordering::SeqCst);
            shared.tripped.fetch_add(1, Ordering::SeqCst);
        }
        hit
    };
    let never = AtomicBool::new(false);
    // Once the armed request is read, replies are dropped; the request side
    // ends after writing it to Redis in full. Either side's end ends both.
    tokio::select! {
        () = forward(client_rx, server_tx, shared, hit, &never) => {
            // Upstream ended (cut or closed): give Redis a moment to run what it
            // got, then drop the connection without passing anything back.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        () = forward(server_rx, client_tx, shared, |_| false, &lost) => {}
    }
}

/// A chunk read, and when to pass it on.
struct Chunk {
    due: Instant,
    bytes: Vec<u8>,
    /// Nothing is read after it.
    last: bool,
}

/// Passes what `from` reads to `to`, each chunk the proxy's latency after it
/// was read and in order, until either side ends or `last` says a chunk is
/// the last one. Once `held` is set, what was read is dropped instead.
async fn forward(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    mut last: impl FnMut(&[u8]) -> bool,
    held: &AtomicBool,
) {
    let (queue, mut queued) = mpsc::channel::<Chunk>(QUEUE);
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let latency = Duration::from_micros(shared.latency_us.load(Ordering::SeqCst));
            let chunk = Chunk {
                due: Instant::now() + latency,
                last: last(&buf[..n]),
                bytes: buf[..n].to_vec(),
            };
            let end = chunk.last;
            if queue.send(chunk).await.is_err() || end {
                return;
            }
        }
    };
    let write = async {
        while let Some(chunk) = queued.recv().await {
            if chunk.due > Instant::now() {
                tokio::time::sleep_until(chunk.due).await;
            }
            if held.load(Ordering::SeqCst) {
                continue;
            }
            if to.write_all(&chunk.bytes).await.is_err() || chunk.last {
                return;
            }
        }
    };
    tokio::pin!(write);
    tokio::select! {
        () = &mut write => return,
        () = read => {}
    }
    // Read to its end: what is queued still goes out.
    write.await;
}
