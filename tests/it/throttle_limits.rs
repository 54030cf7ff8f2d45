//! A provider with a request limit and a token limit, against the recording
//! upstream: calls of mixed weights (each its input's `max_tokens`), each
//! answered with the tokens it used (half to all of its weight, given back
//! after the answer). Per window, the upstream sees at most the request
//! limit's calls and the token limit's reported tokens (+ one call's weight),
//! and the binding limit (tokens) is used to at least 0.9. In process (the
//! in-memory throttle under the provider clients) and with real processes (a
//! `tollgate throttler`, two `tollgate worker`s on one Redis).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::Job,
    metrics::Metrics,
    throttle::Throttle,
};
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_providers::CallOptions;
use tollgate_tests::jobs::{submit_queued, wait_final};
use tollgate_tests::process::{spawn_role, Procs};
use tollgate_tests::upstream::{honoured, Arrival, Upstream};
use tollgate_tests::{random_prefix, temp_file, RedisServer};

use crate::jobs::redis_queue;

const CALLS: usize = 160;
/// The limits: 60 calls per 1 s, 6000 tokens per 2 s.
const REQUESTS: usize = 60;
const TOKENS: u64 = 6000;
const TOKENS_PER: Duration = Duration::from_secs(2);
/// The heaviest call's weight.
const HEAVIEST: u64 = 250;

fn config_text(url: &str) -> String {
    format!(
        r#"
[plans.free]
limit = 100000000
window = "1h"
[providers.llm]
max_wait = "60s"
limits = [{{ rate = {REQUESTS}, per = "1s", burst = 3 }}, {{ tokens = {TOKENS}, per = "2s", burst = 300 }}]
usage = "/usage/total_tokens"
url = "{url}"
timeout = "10s"
retries = 0
[operations.call]
cost = 1
provider = "llm"
path = "/llm"
weight = {{ from = "/max_tokens", default = 100 }}
"#
    )
}

/// Call `i`'s input: a weight of 50 to 250 (`max_tokens`), and the tokens
/// the upstream reports it used: half to all of it.
fn input(i: usize) -> Value {
    let weight = 50 + (i as u64 * 37) % 201;
    let used = weight * (50 + (i as u64 * 13) % 51) / 100;
    json!({ "n": i, "max_tokens": weight, "upstream": { "usage": used } })
}

/// The tokens an arrival's call reported: what it asked for, within the
/// `max_tokens` it was sent with.
fn used(a: &Arrival) -> u64 {
    let body: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
    honoured(body["upstream"]["usage"].as_u64().unwrap_or(0), &body)
}

/// The upstream's view: every window within its limits, and the token
/// limit used to at least 0.9 over the run.
fn check(arrivals: &[Arrival]) {
    assert_eq!(
        arrivals.len(),
        CALLS,
        "every call reached the upstream once"
    );
    assert!(
        arrivals.iter().all(|a| a.status == 200),
        "a call was refused"
    );
    let mut calls: Vec<(u64, u64)> = arrivals.iter().map(|a| (a.at_us, used(a))).collect();
    calls.sort_unstable();
    let per_us = TOKENS_PER.as_micros() as u64;
    let mut worst_requests = 0;
    let mut worst_tokens = 0;
    for (i, (at, _)) in calls.iter().enumerate() {
        let in_second = calls[i..].iter().take_while(|(t, _)| *t < at + 1_000_000);
        worst_requests = worst_requests.max(in_second.count());
        let tokens: u64 = calls[i..]
            .iter()
            .take_while(|(t, _)| *t < at + per_us)
            .map(|(_, u)| u)
            .sum();
        worst_tokens = worst_tokens.max(tokens);
    }
    assert!(
        worst_requests <= REQUESTS,
        "{worst_requests} calls within 1 s (limit {REQUESTS})"
    );
    assert!(
        worst_tokens <= TOKENS + HEAVIEST,
        "{worst_tokens} tokens reported within 2 s (limit {TOKENS} + one call's {HEAVIEST})"
    );
    let span = (calls[calls.len() - 1].0 - calls[0].0) as f64 / 1e6;
    let total: u64 = calls.iter().map(|(_, u)| u).sum();
    let utilisation = total as f64 / (TOKENS as f64 / TOKENS_PER.as_secs_f64() * span);
    eprintln!(
        "throttle limits: {CALLS} calls over {span:.2} s, {total} tokens: utilisation {utilisation:.3}, \
         worst 1 s {worst_requests} calls, worst 2 s {worst_tokens} tokens"
    );
    assert!(
        utilisation >= 0.9,
        "the token limit was used to {utilisation:.3} over {span:.2} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_limits_in_process_keep_every_window_and_use_the_binding_one() {
    let upstream = Upstream::unlimited(Duration::from_millis(20)).await;
    let config = Config::parse(&config_text(&upstream.url()), "limits test").unwrap();
    let metrics = Arc::new(Metrics::new(&config));
    let throttle: Arc<dyn Throttle> =
        Arc::new(MemoryThrottle::metered(&config, Arc::clone(&metrics)));
    let clients = tollgate_providers::from_config(&config, throttle, &metrics).unwrap();
    let client = Arc::clone(&clients["llm"]);
    let mut calls = Vec::new();
    for i in 0..CALLS {
        let client = Arc::clone(&client);
        let job = Job {
            id: RequestId::new(format!("call-{i}")).unwrap(),
            user: UserId::new("pat").unwrap(),
            operation: "call".into(),
            provider: "llm".into(),
            input: input(i),
            cost: 1,
            enqueued_at_ms: 0,
            deadline_ms: u64::MAX,
            run: 1,
            nonce: String::new(),
            trace: None,
            price: None,
            charged: None,
        };
        calls.push(tokio::spawn(async move {
            client.call(&job, CallOptions::default()).await
        }));
    }
    for c in calls {
        c.await.unwrap().expect("every call succeeds");
    }
    check(&upstream.arrivals());
    let rendered = metrics.render();
    let given_back = rendered
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "tollgate_throttle_usage_adjustments_total{provider=\"llm\",direction=\"given_back\"} ",
            )
        })
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        given_back >= (CALLS / 2) as f64,
        "answers that used less than their weight gave it back: {given_back}"
    );
}

/// The under-declaring calls' config: the same limits, with room for a
/// burst of 10 calls, and a weight that bounds the input too.
fn under_config_text(url: &str) -> String {
    config_text(url)
        .replace(
            &format!("rate = {REQUESTS}, per = \"1s\", burst = 3"),
            &format!("rate = {REQUESTS}, per = \"1s\", burst = 10"),
        )
        .replace("default = 100 }", "default = 100, input = \"bytes\" }")
}

/// What an under-declaring call would use, unbounded.
const WOULD_USE: u64 = 1000;
const UNDER: usize = 90;

/// Call `i` of the under-declaring ones: a 100-byte prompt, and `max_tokens`
/// 0, 1 or none (the operation's default of 100); each would use 1,000
/// tokens if the upstream let it.
fn under_input(i: usize) -> Value {
    let mut input =
        json!({ "n": i, "prompt": "p".repeat(100), "upstream": { "usage": WOULD_USE } });
    match i % 3 {
        0 => input["max_tokens"] = json!(0),
        1 => input["max_tokens"] = json!(1),
        _ => {}
    }
    input
}

/// The upstream's view of the under-declaring calls: in any 2 s, the
/// tokens reported stay within the limit plus one call's weight (the
/// heaviest's), and the calls sent without `max_tokens` went with the
/// default written in.
fn check_under(config: &Config, arrivals: &[Arrival]) {
    assert_eq!(
        arrivals.len(),
        UNDER,
        "every call reached the upstream once"
    );
    let weight = config.operation("call").unwrap().weight.clone().unwrap();
    let heaviest = (0..UNDER)
        .map(|i| weight.of(&under_input(i)))
        .max()
        .unwrap();
    let mut calls: Vec<(u64, u64)> = Vec::new();
    for a in arrivals {
        assert_eq!(a.status, 200, "a call was refused");
        let body: Value = serde_json::from_slice(&a.body).unwrap();
        assert!(body["max_tokens"].is_u64(), "sent without a bound: {body}");
        calls.push((a.at_us, used(a)));
    }
    calls.sort_unstable();
    let per_us = TOKENS_PER.as_micros() as u64;
    let worst = (0..calls.len())
        .map(|i| {
            calls[i..]
                .iter()
                .take_while(|(t, _)| *t < calls[i].0 + per_us)
                .map(|(_, u)| u)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    eprintln!(
        "under-declared: worst 2 s {worst} tokens (limit {TOKENS}, heaviest call {heaviest})"
    );
    assert!(
        worst <= TOKENS + heaviest,
        "{worst} tokens within 2 s (limit {TOKENS} + one call's {heaviest})"
    );
}

/// Calls that declare a weight far below what they would use (`max_tokens`
/// 0, 1, or none), each able to use 1,000 tokens: the weight bounds what
/// the upstream can do (the input's bytes plus the output bound, and the
/// operation's default sent upstream when the call declares none), so the
/// upstream sees at most the limit plus one call's weight in any 2 s, from
/// the first burst on. Before, the burst granted before the first usage came
/// back went far past it (a call weighed its `max_tokens` alone, 1, and one
/// without went with no bound, using 1,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_limits_hold_against_calls_that_under_declare_their_weight() {
    let upstream = Upstream::unlimited(Duration::from_millis(100)).await;
    let config = Config::parse(&under_config_text(&upstream.url()), "limits test").unwrap();
    let metrics = Arc::new(Metrics::new(&config));
    let throttle: Arc<dyn Throttle> =
        Arc::new(MemoryThrottle::metered(&config, Arc::clone(&metrics)));
    let clients = tollgate_providers::from_config(&config, throttle, &metrics).unwrap();
    let client = Arc::clone(&clients["llm"]);
    let mut calls = Vec::new();
    for i in 0..UNDER {
        let client = Arc::clone(&client);
        let job = Job {
            id: RequestId::new(format!("under-{i}")).unwrap(),
            user: UserId::new("pat").unwrap(),
            operation: "call".into(),
            provider: "llm".into(),
            input: under_input(i),
            cost: 1,
            enqueued_at_ms: 0,
            deadline_ms: u64::MAX,
            run: 1,
            nonce: String::new(),
            trace: None,
            price: None,
            charged: None,
        };
        calls.push(tokio::spawn(async move {
            client.call(&job, CallOptions::default()).await
        }));
    }
    for c in calls {
        c.await.unwrap().expect("every call succeeds");
    }
    check_under(&config, &upstream.arrivals());
}

/// The same across processes: a `tollgate throttler` and two `tollgate
/// worker`s on one Redis, every job queued before they start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_limits_across_processes_hold_against_calls_that_under_declare_their_weight() {
    let upstream = Upstream::unlimited(Duration::from_millis(100)).await;
    let server = RedisServer::start();
    let prefix = random_prefix();
    let text = under_config_text(&upstream.url());
    let (dir, config_path) = temp_file("it", "under.toml", &text).unwrap();
    let config = Arc::new(Config::parse(&text, "limits test").unwrap());
    let (q, _ledger) = redis_queue(&server, &prefix, Arc::clone(&config)).await;
    let user = UserId::new("pat").unwrap();
    let ids = submit_queued(&*q, &user, "call", (0..UNDER).map(under_input)).await;
    let worker = ["worker", "--concurrency", "16"];
    let _procs = Procs(vec![
        spawn_role(&server.url(), &prefix, &config_path, &["throttler"]),
        spawn_role(&server.url(), &prefix, &config_path, &worker),
        spawn_role(&server.url(), &prefix, &config_path, &worker),
    ]);
    let (_, failed) = wait_final(&*q, &user, &ids, Duration::from_secs(60)).await;
    assert!(failed.is_empty(), "jobs failed: {failed:?}");
    check_under(&config, &upstream.arrivals());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_limits_across_processes_keep_every_window_and_use_the_binding_one() {
    let upstream = Upstream::unlimited(Duration::from_millis(20)).await;
    let server = RedisServer::start();
    let prefix = random_prefix();
    let text = config_text(&upstream.url());
    let (dir, config_path) = temp_file("it", "limits.toml", &text).unwrap();
    let config = Arc::new(Config::parse(&text, "limits test").unwrap());
    let (q, _ledger) = redis_queue(&server, &prefix, Arc::clone(&config)).await;
    let user = UserId::new("pat").unwrap();
    let ids = submit_queued(&*q, &user, "call", (0..CALLS).map(input)).await;
    // Every job queued before the roles start: the limits bind from the first.
    let worker = ["worker", "--concurrency", "16"];
    let _procs = Procs(vec![
        spawn_role(&server.url(), &prefix, &config_path, &["throttler"]),
        spawn_role(&server.url(), &prefix, &config_path, &worker),
        spawn_role(&server.url(), &prefix, &config_path, &worker),
    ]);
    let (_, failed) = wait_final(&*q, &user, &ids, Duration::from_secs(60)).await;
    assert!(failed.is_empty(), "jobs failed: {failed:?}");
    check(&upstream.arrivals());
    let _ = std::fs::remove_dir_all(&dir);
}
