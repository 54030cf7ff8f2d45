//! The api's edge under clients that hold connections without finishing a
//! request: slow headers, a trickled body, idle keep-alive, and one address
//! opening more connections than its share. Each case held connections open
//! indefinitely before the edge had its bounds (800 slow-header connections
//! took the api from 11 to 811 file descriptors for over 70 s).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tollgate_api::edge::{Edge, Listener};

use crate::api::{settings, Harness};

/// An api on the embedded backend, on 127.0.0.1, under `edge`.
struct Served {
    addr: SocketAddr,
    /// An API key of user `u`, so that requests reach their handlers.
    key: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve(edge: Edge) -> Served {
    let h = Harness::memory(settings()).await;
    let key = h.user("u", "free").await;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tollgate_api::run(
        h.state,
        Listener::new(tcp, edge),
        async move {
            let _ = stopped.await;
        },
    ));
    Served {
        addr,
        key,
        _stop: stop,
    }
}

/// A connection to `to` from the loopback address `from` (127.0.0.x: Linux
/// routes the whole 127/8 to the loopback, so each is another client).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

/// Waits at most `limit` for the server to end the connection; `Some(after)`
/// when it did (EOF or a reset), `None` when it was still open. Whatever the
/// server wrote before (a 408, a 400) is read and dropped.
async fn closed_within(conn: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        let left = limit.checked_sub(start.elapsed())?;
        match tokio::time::timeout(left, conn.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

/// One whole request on a fresh connection from `from`: the status line.
/// A new connection from `from` that has sent the head of a call of
/// `embeddings` as `key`, declaring a JSON body of `length` bytes.
async fn post_head(from: [u8; 4], to: SocketAddr, key: &str, length: u64) -> TcpStream {
    let mut conn = connect_from(from, to).await;
    let head = format!(
        "POST /v1/ops/embeddings HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn
}

/// Whether a new connection from `from` is closed within 5 s, unasked.
async fn refused(from: [u8; 4], to: SocketAddr) -> bool {
    let mut conn = connect_from(from, to).await;
    closed_within(&mut conn, Duration::from_secs(5))
        .await
        .is_some()
}

async fn get_healthz(from: [u8; 4], to: SocketAddr) -> String {
    let mut conn = connect_from(from, to).await;
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

fn edge() -> Edge {
    Edge {
        header_timeout: Duration::from_millis(500),
        body_timeout: Duration::from_millis(500),
        max_connections: 64,
        max_per_client: 16,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_closed() {
    let api = serve(edge()).await;
    let mut conns = Vec::new();
    for i in 0..10u8 {
        let mut c = connect_from([127, 0, 0, 10 + i], api.addr).await;
        // Half a request head, then nothing (slowloris), or nothing at all.
        if i % 2 == 0 {
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
                .await
                .unwrap();
        }
        conns.push(c);
    }
    for (i, c) in conns.iter_mut().enumerate() {
        let closed = closed_within(c, Duration::from_secs(10)).await;
        assert!(
            closed.is_some(),
            "connection {i} still open after 10 s (header timeout 0.5 s)"
        );
    }
    // A keep-alive connection idle after a whole request is closed too.
    let mut c = connect_from([127, 0, 0, 30], api.addr).await;
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    c.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    assert!(
        closed_within(&mut c, Duration::from_secs(10))
            .await
            .is_some(),
        "an idle keep-alive connection stayed open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_cut_off() {
    let api = serve(edge()).await;
    let mut c = post_head([127, 0, 0, 40], api.addr, &api.key, 100).await;
    c.write_all(b"{\"in").await.unwrap();
    let closed = closed_within(&mut c, Duration::from_secs(10)).await;
    let after = closed.expect("a body stalled at 4 of 100 bytes held its connection for 10 s");
    // Cut off by the body timeout (0.5 s), not refused up front.
    assert!(
        after >= Duration::from_millis(400),
        "closed after {after:?}: before the body timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_the_connections_of_others() {
    let api = serve(Edge {
        header_timeout: Duration::from_secs(60),
        max_connections: 8,
        max_per_client: 4,
        ..edge()
    })
    .await;
    // 127.0.0.2 takes its share: four connections that send nothing.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(connect_from([127, 0, 0, 2], api.addr).await);
    }
    // Its fifth is closed at once; another address is served.
    assert!(
        refused([127, 0, 0, 2], api.addr).await,
        "a fifth connection of 127.0.0.2 was kept (its share is 4)"
    );
    assert_eq!(
        get_healthz([127, 0, 0, 1], api.addr).await,
        "HTTP/1.1 200 OK"
    );
    // Another address fills the rest: now every new connection is refused,
    // until one of the held ones goes away.
    for _ in 0..4 {
        held.push(connect_from([127, 0, 0, 3], api.addr).await);
    }
    // The accepts above are handled in order: a request sent now is the
    // ninth connection.
    assert!(
        refused([127, 0, 0, 4], api.addr).await,
        "a ninth connection was kept (the api's most is 8)"
    );
    drop(held.pop());
    // The place is given back once the server sees the close.
    let mut served = String::new();
    for _ in 0..50 {
        served = get_healthz([127, 0, 0, 4], api.addr).await;
        if served == "HTTP/1.1 200 OK" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served, "HTTP/1.1 200 OK");
}

/// Writes `bytes` one at a time, one every `every`, until the server ends the
/// connection (a write or a read fails, or it reads EOF); `Some(after)` from
/// the start when it did, `None` when every byte was sent and it was open.
async fn trickle_until_closed(
    conn: &mut TcpStream,
    bytes: &[u8],
    every: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    for b in bytes {
        if conn.write_all(&[*b]).await.is_err() {
            return Some(start.elapsed());
        }
        // Reads until `every` passed: whatever the server answered, then EOF.
        let until = Instant::now() + every;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match tokio::time::timeout(left, conn.read(&mut buf)).await {
                Err(_) => break,
                Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
                Ok(Ok(_)) => continue,
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steadily_trickled_body_is_cut_off_at_its_total_deadline() {
    // The body deadline is 1 s in all; a byte comes every 200 ms, so an idle
    // timer of 1 s would never fire (it did: a byte per 5 s held a
    // connection for over 100 s under the 30 s default).
    let api = serve(Edge {
        header_timeout: Duration::from_secs(5),
        body_timeout: Duration::from_secs(1),
        ..edge()
    })
    .await;
    let mut c = post_head([127, 0, 0, 41], api.addr, &api.key, 100).await;
    // 50 bytes of the 100 declared, over 10 s at most.
    let body = [b' '; 50];
    let closed = trickle_until_closed(&mut c, &body, Duration::from_millis(200)).await;
    let after = closed.expect("a body trickled a byte per 200 ms held its connection for 10 s");
    assert!(
        after <= Duration::from_secs(3),
        "closed after {after:?}: past the total body deadline (1 s) + 2 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_over_the_limit_is_refused_unread() {
    // A long body deadline: the answer must not wait for it.
    let api = serve(Edge {
        body_timeout: Duration::from_secs(60),
        ..edge()
    })
    .await;
    // 10 GB declared (the body limit is 4096 here), 1 KB sent.
    let mut c = post_head([127, 0, 0, 42], api.addr, &api.key, 10_000_000_000).await;
    c.write_all(&[b' '; 1024]).await.unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(
        read.is_ok(),
        "no answer and still open after 10 s (body deadline 60 s): {text:?}"
    );
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("application/problem+json"), "{text}");
    assert!(text.contains("/problems/payload-too-large"), "{text}");
}

/// The status line of a GET /healthz whose head carries a header of `pad`
/// bytes; "" when the connection was closed (or reset) without one.
async fn healthz_with_header_of(from: [u8; 4], to: SocketAddr, pad: usize) -> String {
    let mut conn = connect_from(from, to).await;
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(pad)
    );
    // The server may stop reading (and close) before the whole head is sent.
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.write_all(head.as_bytes())).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_is_bounded_in_bytes() {
    let api = serve(edge()).await;
    assert_eq!(
        healthz_with_header_of([127, 0, 0, 43], api.addr, 16 * 1024).await,
        "HTTP/1.1 200 OK",
        "a 16 KiB header is served"
    );
    // Over `MAX_HEADER_BYTES` (64 KiB), under hyper's own default (~400 KiB).
    let big = 96 * 1024;
    let status = healthz_with_header_of([127, 0, 0, 44], api.addr, big).await;
    assert!(
        status.is_empty() || status.starts_with("HTTP/1.1 431"),
        "a head over MAX_HEADER_BYTES was answered {status:?}"
    );
}
