//! `tollgate all` end to end over HTTP, the same cases in both modes: embedded
//! (no Redis at all) and with `--redis-url`. Budgets, 429s, refunds on provider
//! failure and throttling must behave alike.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate_tests::http::{reqwest_client, FetchJson};
use tollgate_tests::process::{spawn_all, spawn_mock as mock, Procs};
use tollgate_tests::{random_prefix, RedisServer, TempDir};

struct System {
    base: String,
    key: String,
    admin: String,
    good_mock: String,
    http: reqwest::Client,
    _dir: TempDir,
    procs: Procs,
    _redis: Option<RedisServer>,
}

/// Starts two mock providers (one healthy with its own limit, one failing every
/// call) and `tollgate all` on a config that throttles the healthy one below
/// that limit; with `redis`, against a private redis-server.
fn start(redis: bool) -> System {
    let (good, good_url) = mock(&["--rate", "60", "--burst", "10", "--latency-ms", "5"]);
    let (bad, bad_url) = mock(&["--fail-rate", "1.0"]);
    let dir = TempDir::new("all");
    let config = dir.0.join("all.toml");
    std::fs::write(
        &config,
        format!(
            r#"
default_plan = "free"
[plans.free]
limit = 1000
window = "12h"
[providers.good]
rate = 50
burst = 5
max_wait = "30s"
url = "{good_url}"
[providers.bad]
rate = 50
burst = 5
max_wait = "30s"
url = "{bad_url}"
retries = 0
[operations."good.op"]
cost = 8
provider = "good"
[operations."bad.op"]
cost = 8
provider = "bad"
"#
        ),
    )
    .unwrap();
    let server = redis.then(RedisServer::start);
    let url = server.as_ref().map(|s| s.url());
    let (child, lines) = spawn_all(&config, url.as_deref(), &random_prefix());
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    System {
        base: find("listening on "),
        key: find("Bearer "),
        admin: find("admin token: "),
        good_mock: good_url,
        http: reqwest_client(Duration::from_secs(60)),
        _dir: dir,
        procs: Procs(vec![good, bad, child]),
        _redis: server,
    }
}

impl System {
    async fn get(&self, key: &str, path: &str) -> Value {
        self.http
            .get(format!("{}{path}", self.base))
            .bearer_auth(key)
            .fetch_json()
            .await
    }

    /// SIGTERM, then the process must exit 0 by itself.
    fn stop(mut self) {
        let child = self.procs.0.last_mut().unwrap();
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = tollgate_tests::process::exit_by(child, deadline)
            .expect("tollgate all did not stop on SIGTERM");
        assert!(status.success(), "tollgate all exited with {status}");
    }
}

/// 200 concurrent calls of cost 8 on a 1000-token plan: exactly 125 accepted,
/// the rest 429 with Retry-After; every accepted job finishes, usage is exactly
/// 1000, and the throttle kept the upstream under its own limit (no 429 there).
async fn budget_429s_and_throttling(redis: bool) {
    let sys = start(redis);
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..200 {
        let (http, base, key) = (sys.http.clone(), sys.base.clone(), sys.key.clone());
        calls.spawn(async move {
            let r = http
                .post(format!("{base}/v1/ops/good.op"))
                .bearer_auth(&key)
                .header("Prefer", "respond-async")
                .json(&json!({"q": 1}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry_after = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            let body: Value = r.json().await.unwrap();
            (status, retry_after, body)
        });
    }
    let mut jobs = Vec::new();
    let mut denied = 0;
    while let Some(r) = calls.join_next().await {
        let (status, retry_after, body) = r.unwrap();
        match status {
            202 => jobs.push(body["job_id"].as_str().unwrap().to_owned()),
            429 => {
                denied += 1;
                let secs: u64 = retry_after
                    .expect("429 carries Retry-After")
                    .parse()
                    .unwrap();
                assert!(secs > 12 * 3600 - 120 && secs <= 12 * 3600, "{secs}");
                assert!(
                    body["type"].as_str().unwrap().contains("quota-exceeded"),
                    "{body}"
                );
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!((jobs.len(), denied), (125, 75));
    let deadline = Instant::now() + Duration::from_secs(60);
    for id in &jobs {
        loop {
            let v = sys.get(&sys.key, &format!("/v1/jobs/{id}")).await;
            if v["status"] == "succeeded" {
                break;
            }
            assert_ne!(v["status"], "failed", "{v}");
            assert!(Instant::now() < deadline, "job {id} unfinished: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(sys.get(&sys.key, "/v1/usage").await["used"], 1000);
    let stats: Value = sys
        .http
        .get(format!("{}/stats", sys.good_mock))
        .fetch_json()
        .await;
    assert_eq!(stats["rate_limited"], 0, "{stats}");
    assert!(stats["ok"].as_u64().unwrap() >= 125, "{stats}");
    sys.stop();
}

/// A provider that fails every call: 502 naming the cause, and the budget is
/// refunded to exactly 0; a user created through the admin route works.
async fn provider_failures_are_refunded(redis: bool) {
    let sys = start(redis);
    let created: Value = sys
        .http
        .post(format!("{}/admin/users", sys.base))
        .bearer_auth(&sys.admin)
        .json(&json!({"user": "erin", "plan": "free"}))
        .fetch_json()
        .await;
    let key = created["api_key"]
        .as_str()
        .unwrap_or_else(|| panic!("{created}"))
        .to_owned();
    // Through the Rust client, without its retries: each answer as it comes.
    let client = tollgate_client::Client::builder(&sys.base, &key)
        .retry(tollgate_client::RetryPolicy::none())
        .build()
        .unwrap();
    for _ in 0..3 {
        match client.call("bad.op", json!({"q": 1})).send().await.unwrap() {
            tollgate_client::Outcome::Failed(f) => {
                assert_eq!((f.status, f.kind.as_str()), (502, "provider-failure"));
                assert_eq!(
                    (f.cause.as_deref(), f.charged),
                    (Some("provider"), Some(false))
                );
            }
            other => panic!("not a provider failure: {other:?}"),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let used = client.usage().await.unwrap().used;
        if used == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "usage stays at {used}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The same user's good calls still work and are charged.
    let done = client
        .call("good.op", json!({"q": 1}))
        .send()
        .await
        .unwrap();
    assert!(
        matches!(done, tollgate_client::Outcome::Done(_)),
        "{done:?}"
    );
    assert_eq!(client.usage().await.unwrap().used, 8);
    sys.stop();
}

on_each_backend!(
    [
        budget_429s_and_throttling,
        provider_failures_are_refunded,
    ]
    embedded => false,
    distributed => true,
);
