//! The Rust client (`tollgate-client`) against the real binary: `tollgate all`
//! spawned on a free port, embedded and on a private Redis. A budget refusal
//! is a typed outcome with the server's exact `retry_after`; an async
//! submission is waited for; a 503 while Redis restarts under a running call
//! is retried with the call's Idempotency-Key, and the call is charged once.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tollgate_client::{Client, Outcome, RetryPolicy};
use tollgate_tests::jobs::idempotent_job_id as job_id_of;
use tollgate_tests::process::{banner_value, spawn_all, Procs};
use tollgate_tests::upstream::Upstream;
use tollgate_tests::{random_prefix, RedisServer};

/// The cost of `echo.op` and `slow.op`; the plan holds two calls.
const COST: u64 = 8;
const LIMIT: u64 = 16;
const WINDOW_MS: u64 = 12 * 3600 * 1000;

struct Tollgate {
    base: String,
    key: String,
    _procs: Procs,
    dir: PathBuf,
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Tollgate {
    /// `tollgate all` with a 16-token plan, `echo.op` on the built-in mock,
    /// `busy.op` on a provider that holds one call then one per 100 s, and,
    /// with `upstream`, `slow.op` on it; on `redis` when given.
    fn start(redis: Option<&RedisServer>, upstream: Option<&str>) -> Self {
        let dir = std::env::temp_dir().join(format!("tollgate-client-{}", random_prefix()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut config = format!(
            "default_plan = \"small\"\n[plans.small]\nlimit = {LIMIT}\nwindow = \"12h\"\n\
             [providers.mock]\nrate = 1000\nburst = 100\nmax_wait = \"10s\"\n\
             [operations.\"echo.op\"]\ncost = {COST}\nprovider = \"mock\"\n\
             [providers.busy]\nrate = 0.01\nburst = 1\nmax_wait = \"200ms\"\n\
             [operations.\"busy.op\"]\ncost = 1\nprovider = \"busy\"\n"
        );
        if let Some(url) = upstream {
            config.push_str(&format!(
                "[providers.up]\nrate = 1000\nburst = 100\nmax_wait = \"10s\"\nurl = \"{url}\"\n\
                 timeout = \"20s\"\nretries = 0\n\
                 [operations.\"slow.op\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/slow\"\n"
            ));
        }
        let path = dir.join("client.toml");
        std::fs::write(&path, config).unwrap();
        let url = redis.map(RedisServer::url);
        let (child, lines) = spawn_all(&path, url.as_deref(), &random_prefix());
        Self {
            base: banner_value(&lines, "listening on "),
            key: banner_value(&lines, "Bearer "),
            _procs: Procs(vec![child]),
            dir,
        }
    }

    fn client(&self) -> Client {
        Client::new(&self.base, &self.key).unwrap()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

on_each_backend!(
    [
        budget_exhaustion_is_typed_with_the_exact_retry_after,
        an_async_submission_is_waited_for,
        a_saturated_provider_is_retried_then_provider_busy,
    ]
    embedded => false,
    on_redis => true,
);

/// Two calls fill the plan; the third is `BudgetExhausted` at once (not
/// retried), with `retry_after` the exact time until the first call's charge
/// leaves the window (not `Retry-After` rounded up to seconds), and the plan's
/// window from the headers.
async fn budget_exhaustion_is_typed_with_the_exact_retry_after(redis: bool) {
    let server = redis.then(RedisServer::start);
    let tg = Tollgate::start(server.as_ref(), None);
    let client = tg.client();
    for i in 0..2 {
        match client
            .call("echo.op", json!({"i": i}))
            .send()
            .await
            .unwrap()
        {
            Outcome::Done(done) => {
                assert_eq!(done.attempts, 1);
                assert_eq!(done.cost, COST);
                assert_eq!(done.result["echo"], json!({"i": i}), "{:?}", done.result);
            }
            other => panic!("call {i}: {other:?}"),
        }
    }
    let usage = client.usage().await.unwrap();
    assert_eq!((usage.used, usage.limit), (LIMIT, LIMIT));
    let first_at = usage.events.iter().map(|e| e.at_ms).min().unwrap();

    let before = now_ms();
    let outcome = client
        .call("echo.op", json!({"i": 2}))
        .send()
        .await
        .unwrap();
    let after = now_ms();
    let Outcome::BudgetExhausted {
        retry_after,
        windows,
        ..
    } = outcome
    else {
        panic!("not BudgetExhausted: {outcome:?}")
    };
    let ms = retry_after.as_millis() as u64;
    // The server computed it between `before` and `after`, to the millisecond.
    let (least, most) = (first_at + WINDOW_MS - after, first_at + WINDOW_MS - before);
    assert!(
        ms + 1 >= least && ms <= most + 1,
        "retry_after {ms} ms outside [{least}, {most}]"
    );
    assert_eq!(windows.len(), 1, "{windows:?}");
    assert_eq!(windows[0].limit, LIMIT);
    assert_eq!(windows[0].window, Duration::from_millis(WINDOW_MS));
    assert_eq!(windows[0].remaining, Some(0));
    // Nothing more was charged.
    assert_eq!(client.usage().await.unwrap().used, LIMIT);
}

/// `submit` answers at once with the job's id; `wait` returns its result.
/// `submit_and_wait` does both in one call, under one key.
async fn an_async_submission_is_waited_for(redis: bool) {
    let server = redis.then(RedisServer::start);
    let tg = Tollgate::start(server.as_ref(), None);
    let client = tg.client();
    let call = client.call("echo.op", json!({"q": "async"}));
    let Outcome::Pending(pending) = call.submit().await.unwrap() else {
        panic!("an async submission is pending")
    };
    assert_eq!(pending.job_id, job_id_of("dev", call.key()));
    let done = client
        .wait(&pending.job_id, Duration::from_secs(30))
        .await
        .unwrap();
    let Outcome::Done(done) = done else {
        panic!("not done: {done:?}")
    };
    assert_eq!(done.job_id, pending.job_id);
    assert_eq!(done.result["echo"], json!({"q": "async"}));

    let call = client.call("echo.op", json!({"q": "both"}));
    let outcome = call.submit_and_wait().await.unwrap();
    assert_eq!(
        outcome.job_id(),
        Some(job_id_of("dev", call.key()).as_str())
    );
    assert_eq!(outcome.result().unwrap()["echo"], json!({"q": "both"}));
    // Submitting the same call again is the same job: nothing more charged.
    let again = call.submit_and_wait().await.unwrap();
    assert_eq!(again.job_id(), outcome.job_id());
    assert_eq!(client.usage().await.unwrap().used, 2 * COST);
}

/// The provider's one slot is taken: the next call waits 200 ms at its
/// throttle and fails refunded (504 throttle-timeout, `"charged": false`). The
/// client retries it (a new attempt each time: the key was freed) until its
/// deadline, then says `ProviderBusy` (or, when the deadline cuts its last
/// attempt short, `Pending` waiting for the provider); nothing stays charged
/// for it.
async fn a_saturated_provider_is_retried_then_provider_busy(redis: bool) {
    let server = redis.then(RedisServer::start);
    let tg = Tollgate::start(server.as_ref(), None);
    let client = Client::builder(&tg.base, &tg.key)
        .deadline(Duration::from_millis(2500))
        .build()
        .unwrap();
    let first = client.call("busy.op", json!({})).send().await.unwrap();
    assert!(matches!(first, Outcome::Done(_)), "{first:?}");
    let started = std::time::Instant::now();
    let busy = client
        .call("busy.op", json!({"n": 2}))
        .send()
        .await
        .unwrap();
    match &busy {
        Outcome::ProviderBusy { retry_after, .. } => assert!(*retry_after > Duration::ZERO),
        // A last attempt the deadline cut short while it still waited for
        // the provider (a loaded machine: its 200 ms throttle wait ran past
        // the client's deadline) is answered as it stands: pending, and
        // released when that wait ends (below: nothing stays charged).
        Outcome::Pending(p)
            if p.status == "waiting_for_provider"
                && started.elapsed() >= Duration::from_millis(2400) => {}
        other => panic!("not ProviderBusy: {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_millis(3500),
        "{:?}",
        started.elapsed()
    );
    // Only the first call's token stays spent (every failed job's charge was released).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while client.usage().await.unwrap().used != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the refunds never landed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A sync call is charged and its job runs at the upstream when Redis is
/// killed: the api answers 503 (Retry-After: 1) while Redis is down. The
/// client retries with the same key; once Redis is back (from its AOF) the
/// retry finds the same job and returns its result. Charged once: a client
/// that sent a new key on the retry would queue a second job and spend 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_during_a_redis_restart_is_retried_with_the_same_key_and_charged_once() {
    let upstream = Upstream::unlimited(Duration::ZERO).await;
    let server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let tg = Tollgate::start(Some(&server), Some(&upstream.url()));
    let client = Client::builder(&tg.base, &tg.key)
        .retry(RetryPolicy {
            deadline: Duration::from_secs(60),
            max_retries: 30,
            ..RetryPolicy::default()
        })
        .build()
        .unwrap();
    // The upstream answers 4 s after the call arrives.
    let call = client.call("slow.op", json!({"upstream": {"after_ms": 4000}}));
    let key = call.key().to_owned();
    let task = tokio::spawn(async move { call.send().await });

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while upstream.arrivals().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the call never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut server = server;
    server.stop();
    // Down long enough for the api's wait (it reads the job every 500 ms) to fail.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let server = tokio::task::spawn_blocking(move || {
        server.resume();
        server
    })
    .await
    .unwrap();

    let outcome = tokio::time::timeout(Duration::from_secs(70), task)
        .await
        .expect("the call ends within its deadline")
        .unwrap()
        .unwrap();
    let Outcome::Done(done) = outcome else {
        panic!("not done: {outcome:?}")
    };
    assert!(done.attempts >= 2, "no 503 was retried: {done:?}");
    let usage = client.usage().await.unwrap();
    assert_eq!(usage.used, COST, "charged once: {usage:?}");
    let job = job_id_of("dev", &key);
    assert_eq!(done.job_id, job, "the answer is of the call's own key");
    let ids: Vec<&str> = usage.events.iter().map(|e| e.request_id.as_str()).collect();
    assert_eq!(ids, [job.as_str()]);
    assert!(
        upstream
            .arrivals()
            .iter()
            .all(|a| a.job.as_deref() == Some(job.as_str())),
        "{:?}",
        upstream.arrivals()
    );
    drop(server);
}
