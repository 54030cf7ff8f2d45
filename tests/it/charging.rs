//! One owner per charge, tried as a hostile user and as a fault would: a
//! request sharing another's Idempotency-Key, a key reused after its job's
//! record is gone, a retry of a failed job, a lost reply, a worker whose clock
//! is wrong. Each case failed on the charging path that reserved in the Cost
//! layer and refunded from what one request saw.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_api::problem::ProblemType;
use tollgate_core::job::{JobOptions, Taker};
use tollgate_core::{
    clock::ManualClock,
    config::Config,
    id::{RequestId, UserId},
    job::{JobError, JobQueue, JobRequest, JobSource, SubmitOutcome},
    ledger::Ledger,
};
use tollgate_memory::jobs::MemoryJobQueue;
use tollgate_memory::ledger::MemoryLedger;
use tollgate_tests::api::ApiServer;
use tollgate_tests::proxy::FaultProxy;
use tollgate_tests::RedisServer;

use crate::api::{settings, Harness};

on_each_backend!(
    [
        a_slow_request_cannot_refund_the_charge_of_another_with_its_key,
        a_failed_job_retried_with_its_key_is_charged_again_and_runs,
    ]
    memory => crate::api::Harness::memory(crate::api::settings()).await,
    redis => crate::api::Harness::redis(crate::api::settings()).await,
);

/// Request A (`embeddings`, cost 1) sends its headers, then stalls before its
/// body; request B (`company.research`, cost 20) with the same key runs to the
/// end; then A's body arrives. B's job owns the only charge: A is a 422 and
/// charges nothing, and B stays paid. (Before: A's layer had reserved the key,
/// B's submit found it a duplicate, A's 409 refunded it, and B ran free.)
async fn a_slow_request_cannot_refund_the_charge_of_another_with_its_key(h: Harness) {
    let key = h.user("ada", "free").await;
    let worker = h.worker(0.0);
    let server = ApiServer::start(h.state.clone()).await;
    let body_a = br#"{"text":"slow"}"#;
    let head = format!(
        "POST /v1/ops/embeddings HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n\
         Idempotency-Key: shared-1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body_a.len()
    );
    let mut a = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    a.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let auth = format!("Bearer {key}");
    let b = tollgate_tests::http::send(
        server.addr,
        "POST",
        "/v1/ops/company.research",
        &[
            ("Authorization", auth.as_str()),
            ("Idempotency-Key", "shared-1"),
            ("Content-Type", "application/json"),
        ],
        br#"{"company":"acme"}"#,
    )
    .await
    .unwrap();
    assert_eq!(b.status, 200, "{}", b.text());

    a.write_all(body_a).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), a.read_to_end(&mut raw))
        .await
        .expect("A answered")
        .unwrap();
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.starts_with("HTTP/1.1 422"), "{raw}");
    assert!(raw.contains("idempotency-key-reused"), "{raw}");

    let u = h.usage(&key).await;
    assert_eq!(u["used"], 20, "{u}");
    assert_eq!(u["events"][0]["operation"], "company.research", "{u}");
    assert_eq!(worker.succeeded().len(), 1);
    worker.stop().await;
}

/// A job fails (502, released); the same key again, async, is a new attempt:
/// charged again, and its job runs. (Before: the retry's reservation found the
/// failed job, answered 202 with it, and the user paid for nothing.)
async fn a_failed_job_retried_with_its_key_is_charged_again_and_runs(h: Harness) {
    let key = h.user("rita", "free").await;
    let failing = h.worker(1.0);
    let call = |prefer: Option<&'static str>| {
        let mut headers = vec![("idempotency-key", "retry-1")];
        if let Some(p) = prefer {
            headers.push(("prefer", p));
        }
        let key = key.clone();
        let h = &h;
        async move {
            h.post_with(
                "/v1/ops/jobs.extract",
                &key,
                &headers,
                json!({"url": "https://example.com/job"}),
            )
            .await
        }
    };
    let r = call(None).await;
    r.problem(ProblemType::ProviderFailure);
    let job_id = r.body["job_id"].as_str().unwrap().to_owned();
    failing.stop().await;
    h.wait_used(&key, 0).await;

    let worker = h.worker(0.0);
    let r = call(Some("respond-async")).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    assert_eq!(r.body["job_id"], job_id.as_str());
    assert_eq!(h.usage(&key).await["used"], 5, "charged again");
    let deadline = Instant::now() + Duration::from_secs(10);
    while worker.succeeded().is_empty() {
        assert!(Instant::now() < deadline, "the retry's job never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The key now names the succeeded attempt: the same result, charged once.
    let r = call(None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["status"], "succeeded");
    assert_eq!(h.usage(&key).await["used"], 5);
    assert_eq!(worker.succeeded().len(), 1);
    worker.stop().await;
}

/// The reply of a charge, then of an enqueue, is lost (the command ran in
/// Redis, the api saw its connection drop). Neither is taken as a failure: the
/// client gets a 503, nothing is refunded on a guess, the job (made by the
/// retry when the first request never made it) runs once, paid once.
/// (Before: the layer refunded after the 503 while the job ran: free work.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_is_not_taken_as_a_failure() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
    let h = Harness::redis_via(&proxy.url(), server, settings()).await;
    let key = h.user("lou", "free").await;
    let worker = h.worker(0.0);
    let call = |idem: &'static str| {
        let key = key.clone();
        let h = &h;
        async move {
            h.post_with(
                "/v1/ops/llm.structured",
                &key,
                &[("idempotency-key", idem)],
                json!({"prompt": idem}),
            )
            .await
        }
    };
    // What a job of the operation is charged up front (the most: it settles).
    let cost = h
        .state
        .config
        .operation("llm.structured")
        .unwrap()
        .charged_cost();
    let charge = tollgate_redis::scripts::BUDGET.function("charge");
    let enqueue = tollgate_redis::scripts::JOBS.function("job_enqueue");
    let scripts = [("enqueue", enqueue.as_str()), ("charge", charge.as_str())];
    for (n, (what, sha)) in scripts.into_iter().enumerate() {
        let idem = ["lost-enqueue", "lost-charge"][n];
        proxy.lose_reply_of(sha.as_bytes());
        let r = call(idem).await;
        assert_eq!(proxy.tripped(), n as u64 + 1, "the {what} reply was cut");
        r.problem(ProblemType::BackendUnavailable);
        // The charge stands: its job runs (or will be made by the retry).
        assert_eq!(h.usage(&key).await["used"], cost * (n as u64 + 1), "{what}");
        let r = call(idem).await;
        assert_eq!(r.status, StatusCode::OK, "{what}: {}", r.body);
        assert_eq!(r.body["status"], "succeeded");
        assert_eq!(h.usage(&key).await["used"], cost * (n as u64 + 1), "{what}");
        assert_eq!(worker.succeeded().len(), n + 1, "{what}: one job each");
    }
    worker.stop().await;
}

fn short_config() -> Arc<Config> {
    let text = r#"
hold_grace = "200ms"
[plans.free]
limit = 100
window = "3s"
[providers.p]
rate = 1000
burst = 100
max_wait = "5s"
[operations.work]
cost = 10
provider = "p"
[operations.other]
cost = 1
provider = "p"
"#;
    Arc::new(Config::parse(text, "short window").unwrap())
}

fn short_options() -> JobOptions {
    JobOptions {
        result_ttl: Duration::from_millis(300),
        poll: Duration::from_millis(50),
        release_grace: Duration::ZERO,
    }
}

/// A key whose job ran and whose record has expired, while its charge is still
/// in the window: another operation or body is a 422, the same request is a
/// `ResultExpired` (not run again, not charged again); once the charge has left
/// the window, the key is new and charged in full. Never free.
async fn a_key_outliving_its_job_record_is_never_free(
    queue: &dyn JobQueue,
    source: &dyn JobSource,
    ledger: &dyn Ledger,
    advance: &(dyn Fn(Duration) + Sync),
) {
    let user = UserId::new("kim").unwrap();
    let req = |op: &str, body: serde_json::Value| JobRequest {
        id: RequestId::new("idem-kept").unwrap(),
        user: user.clone(),
        operation: op.into(),
        input: body,
        trace: None,
        service_key: None,
    };
    let r = queue.submit(req("work", json!({"a": 1}))).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    let lease = source
        .take(
            "work",
            Taker::new("w", Duration::from_secs(2), Duration::from_secs(5)),
        )
        .await
        .unwrap()
        .expect("the job");
    assert!(source.start(&lease).await.unwrap());
    source.complete(&lease, json!({"ok": true})).await.unwrap();
    advance(Duration::from_millis(500));
    source.maintain("w", Duration::from_secs(5)).await.unwrap();
    assert!(
        queue.status(&user, &lease.job.id).await.unwrap().is_none(),
        "the record is gone"
    );
    let e = queue.submit(req("other", json!({"a": 1}))).await;
    assert!(matches!(e, Err(JobError::KeyReused { .. })), "{e:?}");
    let e = queue.submit(req("work", json!({"a": 2}))).await;
    assert!(matches!(e, Err(JobError::KeyReused { .. })), "{e:?}");
    let e = queue.submit(req("work", json!({"a": 1}))).await;
    assert!(matches!(e, Err(JobError::ResultExpired(_))), "{e:?}");
    assert_eq!(ledger.usage(&user).await.unwrap().used, 10);
    assert!(source
        .take(
            "work",
            Taker::new("w", Duration::from_millis(100), Duration::from_secs(5))
        )
        .await
        .unwrap()
        .is_none());
    // The charge leaves the window: the key is new, and costs in full.
    advance(Duration::from_millis(3000));
    assert_eq!(ledger.usage(&user).await.unwrap().used, 0);
    let r = queue.submit(req("other", json!({"a": 1}))).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    assert_eq!(ledger.usage(&user).await.unwrap().used, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_key_outliving_its_job_record_is_never_free() {
    let config = short_config();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let ledger = Arc::new(MemoryLedger::with_clock(
        Arc::clone(&config),
        Arc::clone(&clock),
    ));
    let queue = MemoryJobQueue::with_clock(config, ledger.clone(), clock.clone(), short_options());
    let advance = move |d: Duration| clock.advance(d);
    a_key_outliving_its_job_record_is_never_free(&queue, &queue, &*ledger, &advance).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_key_outliving_its_job_record_is_never_free() {
    let server = RedisServer::start();
    let (queue, ledger) = crate::jobs::redis_queue_with(
        &server,
        &tollgate_tests::random_prefix(),
        short_config(),
        short_options(),
    )
    .await;
    // Real time: each advance sleeps it.
    let advance = |d: Duration| std::thread::sleep(d);
    a_key_outliving_its_job_record_is_never_free(&*queue, &*queue, &*ledger, &advance).await;
}

/// Where Debian's `faketime` package puts the library.
const LIBFAKETIME: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
];

/// A process of the `tollgate` binary, killed when dropped; `skew` runs it
/// under libfaketime with its wall clock that far ahead.
struct Role(std::process::Child);

impl Role {
    fn start(args: &[&str], redis: &RedisServer, prefix: &str, skew: Option<&str>) -> Self {
        let mut cmd = std::process::Command::new(tollgate_tests::workspace_bin("tollgate"));
        if let Some(offset) = skew {
            // libfaketime preloaded into the binary itself (not the `faketime`
            // wrapper, whose child would outlive a kill of the wrapper).
            let lib = LIBFAKETIME
                .iter()
                .map(std::path::Path::new)
                .find(|p| p.is_file())
                .unwrap_or_else(|| {
                    panic!(
                        "libfaketime is required for the clock-skew test: \
                         `apt-get install faketime` (scripts/test installs it)"
                    )
                });
            cmd.env("LD_PRELOAD", lib)
                .env("FAKETIME", offset)
                // Only the wall clock is skewed; monotonic timers stay sane.
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let child = cmd
            .args(args)
            .env("TOLLGATE_REDIS_URL", redis.url())
            .env("TOLLGATE_KEY_PREFIX", prefix)
            .env("TOLLGATE_ADMIN_TOKEN", crate::api::ADMIN)
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start tollgate");
        Self(child)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn up(addr: std::net::SocketAddr) {
    tollgate_tests::http::wait_ready(addr, Instant::now() + Duration::from_secs(15)).await;
}

/// Pod clocks never decide a charge or a job's deadline: with one api process
/// and the only worker an hour ahead (libfaketime), every call still runs and
/// is charged exactly once. (Before: the worker timed each job against its
/// own clock, saw every deadline passed, and failed them all as expired; an
/// api pod ahead reconciled the others' reservations.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_with_skewed_clocks_decide_nothing() {
    let redis = RedisServer::start();
    let prefix = tollgate_tests::random_prefix();
    let ports = [
        tollgate_tests::redis_server::free_port(),
        tollgate_tests::redis_server::free_port(),
    ];
    let addrs: Vec<std::net::SocketAddr> = ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
        .collect();
    let (a0, a1) = (addrs[0].to_string(), addrs[1].to_string());
    let _api = Role::start(&["api", "--listen", &a0], &redis, &prefix, None);
    let _ahead = Role::start(&["api", "--listen", &a1], &redis, &prefix, Some("+1h"));
    let _throttler = Role::start(&["throttler"], &redis, &prefix, None);
    let _worker = Role::start(&["worker"], &redis, &prefix, Some("+1h"));
    up(addrs[0]).await;
    up(addrs[1]).await;
    let key = tollgate_tests::http::user_key(addrs[0], crate::api::ADMIN, "skew", "free").await;
    for i in 0..20 {
        let r = tollgate_tests::http::json(
            addrs[i % 2],
            "POST",
            "/v1/ops/salary.lookup",
            Some(&key),
            Some(&json!({"title": "engineer", "i": i})),
        )
        .await;
        assert_eq!(r.status, 200, "call {i}: {}", r.text());
        assert_eq!(r.json()["status"], "succeeded");
    }
    let usage = tollgate_tests::http::json(addrs[1], "GET", "/v1/usage", Some(&key), None).await;
    let usage = usage.json();
    assert_eq!(usage["used"], 20 * 3, "{usage}");
    assert_eq!(usage["events"].as_array().unwrap().len(), 20);
}
