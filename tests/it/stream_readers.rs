//! The api pod's stream readers on Redis, through the library
//! (`tollgate_redis::streams::RedisStreams`) against a private redis-server:
//! open streams share a few hub connections (bounded, closed once idle), an
//! unread stream's backlog is bounded (the writer's append is refused), and a
//! reader that keeps up is never refused (what it read is released).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate_core::config::Config;
use tollgate_core::id::RequestId;
use tollgate_core::job::Job;
use tollgate_core::stream::{JobStreams, Read, StreamEvent, StreamReader, STREAM_BACKLOG_BYTES};
use tollgate_redis::keys::KeySpace;
use tollgate_redis::pool::PoolOptions;
use tollgate_redis::streams::{RedisStreams, HUB_IDLE, STREAMS_PER_CONNECTION};
use tollgate_tests::{random_prefix, RedisServer};

const CONFIG: &str = r#"
default_plan = "free"
[plans.free]
limit = 100
window = "1h"
[providers.p]
rate = 1000
burst = 100
max_wait = "5s"
[operations.work]
cost = 1
provider = "p"
"#;

struct Setup {
    server: RedisServer,
    /// The api side: readers.
    api: RedisStreams,
    /// The worker side (its own pool): writers.
    worker: RedisStreams,
    prefix: String,
}

async fn setup() -> Setup {
    let server = RedisServer::start();
    let config = Arc::new(Config::parse(CONFIG, "stream readers").unwrap());
    let prefix = random_prefix();
    let streams = || async {
        let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
            .await
            .unwrap();
        RedisStreams::new(pool, KeySpace::new(&prefix).unwrap(), Arc::clone(&config))
    };
    let api = streams().await;
    let worker = streams().await;
    Setup {
        api,
        worker,
        prefix,
        server,
    }
}

/// A streamed job `id` of `work` on `p`.
fn job(id: &RequestId) -> Job {
    tollgate_tests::jobs::job(
        id.as_str(),
        "u",
        "work",
        "p",
        serde_json::json!({"stream": true}),
    )
}

async fn conn(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `connected_clients` of INFO clients, and how many clients block in (or
/// last sent) `XREAD`: the readers' connections.
async fn clients(server: &RedisServer) -> (usize, usize) {
    let mut c = conn(server).await;
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut c)
        .await
        .unwrap();
    let connected: usize = info
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut c)
        .await
        .unwrap();
    let xread = list.lines().filter(|l| l.contains("cmd=xread")).count();
    // This connection is counted; it closes on return.
    (connected - 1, xread)
}

/// Reads `reader` to its end: the data events, in order.
async fn read_all(mut reader: Box<dyn StreamReader>) -> Vec<String> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "no end after {got:?}");
        match reader.next(Duration::from_secs(5)).await.unwrap() {
            Read::Event(StreamEvent::Data(t)) => got.push(t),
            Read::Event(StreamEvent::End) => return got,
            Read::Event(StreamEvent::Head(_)) => {}
            Read::Event(e @ StreamEvent::Error(_)) => panic!("{e:?} after {got:?}"),
            Read::Idle => {}
        }
    }
}

/// 300 open streams on one pod take ceil(300 / 128) = 3 hub connections,
/// not 300; each reader gets its own events in order; a stream opened while
/// the hub blocks is read at once (the wake-up); and once every reader is
/// dropped the hub's connections close within [`HUB_IDLE`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_streams_share_a_bounded_number_of_connections() {
    let s = setup().await;
    const N: usize = 300;
    let hubs = N.div_ceil(STREAMS_PER_CONNECTION);
    // The worker's pool is warm and the api's too: what follows is the hub's.
    let warm = RequestId::new("warm").unwrap();
    drop(s.api.open("work", &warm).await.unwrap());
    s.worker
        .writer(&job(&warm))
        .push(StreamEvent::End)
        .await
        .unwrap();
    tokio::time::sleep(HUB_IDLE + Duration::from_secs(2)).await;
    let (before, _) = clients(&s.server).await;

    let ids: Vec<RequestId> = (0..N)
        .map(|i| RequestId::new(format!("job-{i}")).unwrap())
        .collect();
    let mut readers = Vec::new();
    for id in &ids {
        readers.push(s.api.open("work", id).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (open, xread) = clients(&s.server).await;
    println!("{N} open streams: {open} clients ({before} before), {xread} in XREAD");
    assert_eq!(s.api.hub_connections(), hubs);
    assert!(
        xread <= hubs,
        "{xread} readers' connections for {N} streams"
    );
    // The hub's, and at most the pools' growth (8 each).
    assert!(
        open <= before + hubs + 16,
        "{open} clients for {N} streams ({before} before)"
    );

    // Each reader its own events, in order.
    let reads: Vec<_> = readers
        .drain(..)
        .map(|r| tokio::spawn(read_all(r)))
        .collect();
    let writers: Vec<_> = ids
        .iter()
        .map(|id| {
            let w = s.worker.writer(&job(id));
            let id = id.as_str().to_owned();
            tokio::spawn(async move {
                for n in 0..5 {
                    assert!(w
                        .push(StreamEvent::Data(format!("data: {id} {n}")))
                        .await
                        .unwrap());
                }
                assert!(w.push(StreamEvent::End).await.unwrap());
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    for (id, r) in ids.iter().zip(reads) {
        let want: Vec<String> = (0..5)
            .map(|n| format!("data: {} {n}", id.as_str()))
            .collect();
        assert_eq!(r.await.unwrap(), want);
    }

    // A stream opened while the hub blocks is read at once, not after the
    // block (1 s).
    let keep = s
        .api
        .open("work", &RequestId::new("keep").unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = RequestId::new("late").unwrap();
    let mut reader = s.api.open("work", &late).await.unwrap();
    let start = Instant::now();
    assert!(s
        .worker
        .writer(&job(&late))
        .push(StreamEvent::Data("data: first".into()))
        .await
        .unwrap());
    assert_eq!(
        reader.next(Duration::from_secs(5)).await.unwrap(),
        Read::Event(StreamEvent::Data("data: first".into()))
    );
    let first = start.elapsed();
    println!("first event of a stream opened while the hub blocks: {first:?}");
    assert!(first < Duration::from_millis(500), "{first:?}");
    drop((reader, keep));

    // Every reader gone: the hub's connections close within its idle time.
    let deadline = Instant::now() + HUB_IDLE + Duration::from_secs(5);
    loop {
        let (now, xread) = clients(&s.server).await;
        if xread == 0 && now <= before + 16 && s.api.hub_connections() == 0 {
            println!("readers dropped: {now} clients ({before} before)");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{now} clients ({xread} in XREAD) {:?} after every reader left ({before} before)",
            HUB_IDLE + Duration::from_secs(5)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = &s.prefix;
}

/// Pushes 2 KiB events to `id`'s stream until an append is refused: how
/// many were taken.
async fn push_until_refused(s: &Setup, id: &RequestId) -> usize {
    let w = s.worker.writer(&job(id));
    let text = format!("data: {}", "x".repeat(2048));
    for n in 0..4000 {
        if !w.push(StreamEvent::Data(text.clone())).await.unwrap() {
            return n;
        }
    }
    panic!("4000 events of 2 KiB taken by a stream nobody reads");
}

/// A stream whose reader reads nothing (or that nobody opened) takes appends
/// up to its backlog bound only: then `push` answers `Ok(false)` (the worker
/// cuts the call), and the stream holds about the bound in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_stream_refuses_appends_past_its_bound() {
    let s = setup().await;
    let mut c = conn(&s.server).await;
    let bound = usize::try_from(STREAM_BACKLOG_BYTES).unwrap();
    for opened in [true, false] {
        let id = RequestId::new(format!("unread-{opened}")).unwrap();
        let reader = if opened {
            Some(s.api.open("work", &id).await.unwrap())
        } else {
            None
        };
        let taken = push_until_refused(&s, &id).await;
        let key = KeySpace::new(&s.prefix)
            .unwrap()
            .jobs("work")
            .stream(id.as_str());
        let bytes: usize = tollgate_tests::redis_info::memory_usage(&mut c, &key)
            .await
            .unwrap()
            .unwrap_or(0);
        println!("unread stream (reader open: {opened}): {taken} events of 2 KiB taken, {bytes} bytes in Redis");
        // The bound and one event, and what the hub holds for the reader
        // (its buffer: at most 128 KiB and one read).
        assert!(taken * 2048 <= bound + 2048 + if opened { 200 * 1024 } else { 0 });
        // Redis's own overhead: a 2 KiB entry gets a stream node of its own
        // (stream-node-max-bytes 4096), in an allocation of 2.5 to 3 KiB.
        assert!(bytes <= bound * 3 / 2 + 64 * 1024, "{bytes} bytes");
        drop(reader);
    }
}

/// A reader that keeps up with a long stream (5,000 events of 200 bytes,
/// about 1.3 MB: five times the bound) is never refused: the hub releases
/// what it read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_keeps_up_is_never_refused() {
    let s = setup().await;
    keeps_up(&s.api, &s.worker, 5000).await;
}

/// The same on the suite's Redis Cluster (`stream_push.lua` and the hub's
/// `stream_trim.lua` on the node of the operation's hash tag): 1,500 events,
/// more than the bound, each released as read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_keeps_up_is_never_refused_on_a_cluster() {
    let cluster = tollgate_tests::TestCluster::get();
    let config = Arc::new(Config::parse(CONFIG, "stream readers").unwrap());
    let prefix = random_prefix();
    let streams = || async {
        let pool = tollgate_redis::pool::connect(&cluster.url(), &PoolOptions::default())
            .await
            .unwrap();
        RedisStreams::new(pool, KeySpace::new(&prefix).unwrap(), Arc::clone(&config))
    };
    let (api, worker) = (streams().await, streams().await);
    keeps_up(&api, &worker, 1500).await;
}

/// `events` events of 200 bytes through one stream whose reader keeps up:
/// none refused, all read in order.
async fn keeps_up(api: &RedisStreams, worker: &RedisStreams, events: usize) {
    let id = RequestId::new("long").unwrap();
    let reader = api.open("work", &id).await.unwrap();
    let read = tokio::spawn(read_all(reader));
    let w = worker.writer(&job(&id));
    let pad = "y".repeat(190);
    for n in 0..events {
        assert!(
            w.push(StreamEvent::Data(format!("{n:>8} {pad}")))
                .await
                .unwrap(),
            "event {n} refused"
        );
    }
    assert!(w.push(StreamEvent::End).await.unwrap());
    let got = read.await.unwrap();
    assert_eq!(got.len(), events);
    for (n, t) in got.iter().enumerate() {
        assert_eq!(t, &format!("{n:>8} {pad}"));
    }
}
