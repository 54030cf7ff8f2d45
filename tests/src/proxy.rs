//! A TCP proxy between a role and Redis that loses the reply of one chosen
//! command: the command reaches Redis and runs, but its connection is cut
//! before the answer comes back. The caller cannot tell what happened, which
//! is the point: an outcome it could not observe must not be taken as a
//! failure.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The proxy; it stops accepting when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    pub addr: SocketAddr,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    tripped: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Proxies `127.0.0.1:<free port>` to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let armed: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let tripped = Arc::new(AtomicU64::new(0));
        let (a, t) = (Arc::clone(&armed), Arc::clone(&tripped));
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(pipe(client, server, Arc::clone(&a), Arc::clone(&t)));
            }
        });
        Self {
            addr,
            armed,
            tripped,
            task,
        }
    }

    /// `redis://` URL of the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// The next request whose bytes contain `needle` goes through to Redis,
    /// and its connection is cut before the reply is passed back.
    pub fn lose_reply_of(&self, needle: &[u8]) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some(needle.to_vec());
    }

    /// How many replies were lost so far.
    pub fn tripped(&self) -> u64 {
        self.tripped.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    tripped: Arc<AtomicU64>,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let cut = Arc::new(AtomicBool::new(false));
    let cut_up = Arc::clone(&cut);
    let upstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let hit = {
                let mut armed = armed.lock().unwrap_or_else(|e| e.into_inner());
                let hit = armed
                    .as_ref()
                    .is_some_and(|needle| buf[..n].windows(needle.len()).any(|w| w == needle));
                if hit {
                    *armed = None;
                }
                hit
            };
            if hit {
                // Cut first, so that no byte of the reply can pass back.
                cut_up.store(true, Ordering::SeqCst);
                tripped.fetch_add(1, Ordering::SeqCst);
            }
            if server_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
            if hit {
                return;
            }
        }
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if cut.load(Ordering::SeqCst) || client_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_tx.shutdown().await;
    };
    // The reply side closes the client's connection once the cut is made (or
    // either side ends); the command itself was written to Redis in full.
    tokio::select! {
        () = upstream => {
            // Upstream ended (cut or closed): give Redis a moment to run what it
            // got, then drop the connection without passing anything back.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        () = downstream => {}
    }
}
