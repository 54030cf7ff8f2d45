//! The operations surface against the real binaries: every metric that the
//! Grafana dashboard (`deploy/grafana/tollgate.json`) and the alerts
//! (`deploy/prometheus/alerts.yml`) query is exposed by `tollgate all`,
//! `tollgate worker` or `tollgate throttler` (the last two on
//! `--metrics-listen`) once a few calls ran on a shared Redis; and a worker's
//! `/readyz` says it is not ready while its Redis is gone, and ready again
//! once it is back.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate_tests::process::{spawn, spawn_reading, Procs};
use tollgate_tests::redis_server::free_port;
use tollgate_tests::{random_prefix, RedisServer};

fn repo_file(path: &str) -> String {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// Every `tollgate_*` metric name in `expr`.
fn metric_names(expr: &str, into: &mut BTreeSet<String>) {
    let mut rest = expr;
    while let Some(at) = rest.find("tollgate_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        into.insert(name);
    }
}

/// The metric names of every query of the dashboard (panels nested in rows too).
fn dashboard_metrics() -> BTreeSet<String> {
    fn walk(v: &Value, names: &mut BTreeSet<String>, exprs: &mut usize) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => {
                            *exprs += 1;
                            metric_names(e, names);
                        }
                        _ => walk(v, names, exprs),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, names, exprs)),
            _ => {}
        }
    }
    let dashboard: Value = serde_json::from_str(&repo_file("deploy/grafana/tollgate.json"))
        .expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "tollgate");
    let (mut names, mut exprs) = (BTreeSet::new(), 0);
    walk(&dashboard, &mut names, &mut exprs);
    assert!(exprs >= 20, "only {exprs} queries in the dashboard");
    names
}

/// The metric names of every `expr:` of the alert rules: the value on its
/// line, or the block under it (`expr: |`).
fn alert_metrics() -> BTreeSet<String> {
    let text = repo_file("deploy/prometheus/alerts.yml");
    let lines: Vec<&str> = text.lines().collect();
    let (mut names, mut exprs) = (BTreeSet::new(), 0);
    for (i, line) in lines.iter().enumerate() {
        let Some((indent, value)) = line.split_once("expr:") else {
            continue;
        };
        exprs += 1;
        metric_names(value, &mut names);
        if value.trim() == "|" {
            let depth = indent.len();
            for block in lines[i + 1..]
                .iter()
                .take_while(|l| l.len() - l.trim_start().len() > depth)
            {
                metric_names(block, &mut names);
            }
        }
    }
    assert!(exprs >= 5, "only {exprs} alert expressions");
    names
}

/// The sample names (`tollgate_x_bucket` included) and family names (`# TYPE`)
/// of one exposition.
fn exposed(text: &str, into: &mut BTreeSet<String>) {
    for line in text.lines() {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            into.extend(family.split(' ').next().map(str::to_owned));
        } else if !line.starts_with('#') {
            into.extend(line.split(['{', ' ']).next().map(str::to_owned));
        }
    }
}

fn client() -> reqwest::Client {
    tollgate_tests::http::reqwest_client(Duration::from_secs(10))
}

/// GET `url` until it answers `status` (at most 30 s); returns the last body.
async fn until_status(http: &reqwest::Client, url: &str, status: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let last = match http.get(url).send().await {
            Ok(r) => {
                let got = r.status().as_u16();
                let body = r.text().await.unwrap_or_default();
                if got == status {
                    return body;
                }
                format!("{got}: {body}")
            }
            Err(e) => e.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "{url} never answered {status}; last: {last}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A worker or throttler on `redis` with `--metrics-listen`: its probes' base URL.
fn role(procs: &mut Procs, role: &str, redis: &str, prefix: &str) -> String {
    let addr = format!("127.0.0.1:{}", free_port());
    procs.0.push(spawn(&[
        role,
        "--redis-url",
        redis,
        "--key-prefix",
        prefix,
        "--metrics-listen",
        &addr,
    ]));
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_of_the_dashboard_and_the_alerts_is_exposed() {
    let wanted = dashboard_metrics();
    let alerted = alert_metrics();
    // The extraction found real names, the ones the brief's alerts need.
    for name in [
        "tollgate_upstream_errors_total",
        "tollgate_throttle_wait_seconds_bucket",
        "tollgate_throttle_max_wait_seconds",
        "tollgate_worker_releases_total",
        "tollgate_throttle_throttlers",
        "tollgate_queue_dead",
    ] {
        assert!(alerted.contains(name), "{name} not in {alerted:?}");
    }

    let redis = RedisServer::start();
    let prefix = random_prefix();
    let url = redis.url();
    let mut procs = Procs::default();
    let (all, lines) = spawn_reading(
        &[
            "all",
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            &url,
            "--key-prefix",
            &prefix,
        ],
        |l| l.iter().any(|l| l.contains("/v1/usage")),
    );
    procs.0.push(all);
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    let (base, key) = (find("listening on "), find("Bearer "));
    let worker = role(&mut procs, "worker", &url, &prefix);
    let throttler = role(&mut procs, "throttler", &url, &prefix);
    let http = client();
    for probes in [&base, &worker, &throttler] {
        until_status(&http, &format!("{probes}/healthz"), 200).await;
        until_status(&http, &format!("{probes}/readyz"), 200).await;
    }

    // A few calls, synchronous: each runs through the throttle and a provider.
    for (i, op) in [
        "embeddings",
        "llm.structured",
        "salary.lookup",
        "embeddings",
    ]
    .iter()
    .enumerate()
    {
        let r = http
            .post(format!("{base}/v1/ops/{op}"))
            .bearer_auth(&key)
            .json(&json!({"i": i}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{op}: {}", r.text().await.unwrap());
    }

    let mut names = BTreeSet::new();
    let mut texts = Vec::new();
    for probes in [&base, &worker, &throttler] {
        let r = http.get(format!("{probes}/metrics")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let content_type = r.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(
            content_type.starts_with("text/plain; version=0.0.4"),
            "{content_type}"
        );
        let text = r.text().await.unwrap();
        exposed(&text, &mut names);
        texts.push(text);
    }
    let missing: Vec<&String> = wanted
        .union(&alerted)
        .filter(|n| !names.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "queried by the dashboard or the alerts but exposed by no binary: {missing:?}"
    );

    // Each role shows the shared state it lives on, read from Redis.
    let [all_text, worker_text, throttler_text] = &texts[..] else {
        unreachable!()
    };
    for (text, line) in [
        (
            all_text,
            "tollgate_reservations_total{operation=\"embeddings\",outcome=\"allowed\"} 2",
        ),
        (
            all_text,
            "tollgate_job_outcomes_total{operation=\"llm.structured\",outcome=\"succeeded\"} 1",
        ),
        (
            worker_text,
            "tollgate_queue_workers{operation=\"embeddings\"} 2",
        ),
        (
            worker_text,
            "tollgate_stats_errors_total{source=\"jobs\"} 0",
        ),
        (
            throttler_text,
            "tollgate_throttle_throttlers{provider=\"llm\"} 2",
        ),
        (
            throttler_text,
            "tollgate_throttle_max_wait_seconds{provider=\"llm\"} 30",
        ),
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
    // Jobs ran in one of the two workers (the one in `all` or the pod).
    let succeeded = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("tollgate_worker_jobs_total{") && l.contains("\"succeeded\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    assert_eq!(succeeded(all_text) + succeeded(worker_text), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_not_ready_while_its_redis_is_gone() {
    let mut redis = RedisServer::start();
    let mut procs = Procs::default();
    let worker = role(&mut procs, "worker", &redis.url(), &random_prefix());
    let http = client();
    until_status(&http, &format!("{worker}/readyz"), 200).await;

    redis.stop();
    let body = until_status(&http, &format!("{worker}/readyz"), 503).await;
    let problem: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        problem["type"], "/problems/backend-unavailable",
        "{problem}"
    );
    // Alive all the same: nothing to restart.
    until_status(&http, &format!("{worker}/healthz"), 200).await;

    redis.resume();
    until_status(&http, &format!("{worker}/readyz"), 200).await;
}

/// A role started while Redis is down listens at once: `/healthz` is 200 (a
/// liveness probe must not restart a process that only waits), `/readyz`,
/// `/metrics` and every call are 503 `backend-unavailable` with
/// `Retry-After: 1`; once Redis answers, each serves as usual. Before, no
/// role listened until Redis answered: `/healthz` was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_started_while_redis_is_down_is_alive_and_not_ready() {
    let mut redis = RedisServer::start();
    redis.stop();
    let (url, prefix) = (redis.url(), random_prefix());
    let mut procs = Procs::default();
    let api = format!("127.0.0.1:{}", free_port());
    procs.0.push(spawn(&[
        "api",
        "--redis-url",
        &url,
        "--key-prefix",
        &prefix,
        "--listen",
        &api,
    ]));
    let api = format!("http://{api}");
    let worker = role(&mut procs, "worker", &url, &prefix);
    let throttler = role(&mut procs, "throttler", &url, &prefix);
    let http = client();
    for base in [&api, &worker, &throttler] {
        until_status(&http, &format!("{base}/healthz"), 200).await;
        for path in ["/readyz", "/metrics", "/v1/usage"] {
            let r = http.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 503, "{base}{path}");
            assert_eq!(r.headers()["retry-after"], "1", "{base}{path}");
            let body: Value = r.json().await.unwrap();
            assert!(
                body["type"]
                    .as_str()
                    .unwrap_or_default()
                    .ends_with("backend-unavailable"),
                "{base}{path}: {body}"
            );
        }
    }

    redis.resume();
    for base in [&api, &worker, &throttler] {
        until_status(&http, &format!("{base}/readyz"), 200).await;
    }
    // The api's own routes answer now: an unknown key is refused, not 503.
    let r = http
        .get(format!("{api}/v1/usage"))
        .bearer_auth("tg_not_a_key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "{}", r.text().await.unwrap());
}
