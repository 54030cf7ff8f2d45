//! Who pays for each upstream outcome, through HTTP on both backends, with the
//! real worker, its HTTP provider client and an upstream that records every
//! arrival: a call the upstream may have worked on keeps its charge (and is
//! not sent again unless the operation says it is safe); a call it refused, or
//! never saw, is released; a 5xx is released and counted as absorbed.
//! Each case failed on the worker that released every call it did not record
//! as a success (3 upstream calls for 0 tokens after a timeout; a deadline
//! that abandoned a call the upstream answered; 2xx bodies it could not parse).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::watch;
use tollgate_api::state::ApiState;
use tollgate_core::{config::Config, metrics::Metrics};
use tollgate_redis::{keys::KeySpace, pool::PoolOptions};
use tollgate_tests::upstream::Upstream;
use tollgate_tests::{random_prefix, RedisServer};
use tracing_subscriber::util::SubscriberInitExt;

use crate::api::{settings, Harness};

on_each_backend!(
    [
        an_unanswered_call_is_sent_once_and_keeps_its_charge,
        a_deadline_passing_mid_call_lets_the_call_finish_and_charges_it,
        unparsable_2xx_answers_are_charged_once_each,
        a_rejected_input_is_a_4xx_released_and_not_retried,
        an_exposed_rejection_carries_the_upstream_body,
        misconfiguration_answers_stay_502_without_the_upstream_text,
        providers_send_static_and_secret_headers,
        operations_send_a_get_query_or_a_form_body,
        overload_answers_are_retried_then_released,
        a_server_error_is_released_and_counted_as_absorbed,
        a_reply_cut_midway_keeps_the_charge,
        an_unreachable_upstream_is_retried_free_and_released,
        retry_unanswered_lets_an_operation_resend,
        a_settled_operation_left_unanswered_keeps_its_most_not_its_estimate,
        failed_keyless_sync_calls_leave_no_job_record,
    ]
    memory => false,
    redis => true,
);

/// The cost of every operation below.
const COST: u64 = 5;

/// The built-in config plus providers on the test upstream: `up` (timeout
/// 1 s, 2 retries), `slow` (timeout 5 s), `closed` (nothing listens), and
/// their operations; `extra` is appended.
fn config(url: &str, extra: &str) -> Arc<Config> {
    let provider = |name: &str, url: &str, timeout: &str| {
        format!(
            "[providers.{name}]\nrate = 1000\nburst = 100\nmax_wait = \"5s\"\nurl = \"{url}\"\n\
             timeout = \"{timeout}\"\nretries = 2\n\n"
        )
    };
    let text = format!(
        "{}\n{}{}{}\
         [operations.\"up.call\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/up\"\n\n\
         [operations.\"slow.short\"]\ncost = {COST}\nprovider = \"slow\"\npath = \"/slow\"\ndeadline = \"1s\"\n\n\
         [operations.\"closed.call\"]\ncost = {COST}\nprovider = \"closed\"\n\n{extra}",
        tollgate_core::config::BUILTIN,
        provider("up", url, "1s"),
        provider("slow", url, "5s"),
        provider("closed", &closed_url(), "1s"),
    );
    Arc::new(Config::parse(&text, "outcomes").expect("test config"))
}

/// A URL where nothing listens: a port bound, then released.
fn closed_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

/// The api, a worker (and a throttler on Redis) on one backend, the upstream,
/// and a user's key.
struct Stage {
    h: Harness,
    upstream: Upstream,
    key: String,
    metrics: Arc<Metrics>,
    stop: watch::Sender<bool>,
}

impl Stage {
    async fn start(redis: bool, extra: &str) -> Self {
        Self::start_with(redis, extra, |_| String::new()).await
    }

    /// `more` adds config text that needs the upstream's URL.
    async fn start_with(redis: bool, extra: &str, more: impl Fn(&str) -> String) -> Self {
        let upstream = Upstream::unlimited(Duration::ZERO).await;
        let extra = format!("{extra}\n{}", more(&upstream.url()));
        let config = config(&upstream.url(), &extra);
        let (backends, server) = if redis {
            let server = RedisServer::start();
            let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
                .await
                .unwrap();
            let keys = KeySpace::new(&random_prefix()).unwrap();
            let b = tollgate_redis::backends(pool, keys, Arc::clone(&config), "test".into());
            (b, Some(server))
        } else {
            (tollgate_memory::backends(Arc::clone(&config)), None)
        };
        let (stop, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        if let Some(dispatchers) = backends.dispatchers.clone() {
            let mut cfg = tollgate_throttler::ThrottlerConfig::new(Arc::clone(&config));
            cfg.metrics = Arc::clone(&backends.metrics);
            tokio::spawn(tollgate_throttler::run(
                cfg,
                dispatchers,
                stopped(stop_rx.clone()),
            ));
        }
        let mut cfg = tollgate_worker::WorkerConfig::new(Arc::clone(&config));
        cfg.metrics = Arc::clone(&backends.metrics);
        cfg.shutdown_grace = Duration::from_millis(200);
        let providers = tollgate_providers::from_config(
            &config,
            Arc::clone(&backends.throttle),
            &backends.metrics,
        )
        .unwrap();
        tokio::spawn(tollgate_worker::run(
            cfg,
            Arc::clone(&backends.source),
            providers,
            stopped(stop_rx),
        ));
        let state = ApiState::new(&backends, settings());
        let h = Harness {
            app: tollgate_api::router(state.clone()),
            state,
            source: Arc::clone(&backends.source),
            redis: server,
            _cluster: None,
        };
        let key = h.user("ada", "free").await;
        Self {
            h,
            upstream,
            key,
            metrics: Arc::clone(&backends.metrics),
            stop,
        }
    }

    /// One synchronous call of `operation` asking the upstream for `answer`
    /// after `after_ms`; returns the response and the upstream's arrivals for
    /// it. Waits until the worker is done with the job (a release included).
    async fn call(
        &self,
        operation: &str,
        answer: &str,
        after_ms: u64,
    ) -> (crate::api::Resp, usize) {
        let before = self.ended();
        let seen = self.upstream.arrivals().len();
        let r = self
            .h
            .post(
                &format!("/v1/ops/{operation}"),
                &self.key,
                json!({"upstream": {"answer": answer, "after_ms": after_ms}}),
            )
            .await;
        self.wait_ended(before + 1).await;
        (r, self.upstream.arrivals().len() - seen)
    }

    /// One synchronous call of `up.call` with Idempotency-Key `key`, asking
    /// the upstream for `upstream`; returns once the worker is done with it.
    async fn keyed_call(&self, key: &str, upstream: Value) -> crate::api::Resp {
        let before = self.ended();
        let body = json!({ "upstream": upstream });
        let r = self
            .h
            .post_with(
                "/v1/ops/up.call",
                &self.key,
                &[("idempotency-key", key)],
                body,
            )
            .await;
        self.wait_ended(before + 1).await;
        r
    }

    /// The job record of the call answered `r`.
    async fn job_of(&self, r: &crate::api::Resp) -> Value {
        let id = r.body["job_id"].as_str().unwrap();
        self.h
            .get(&format!("/v1/jobs/{id}"), &self.key, &[])
            .await
            .body
    }

    /// Jobs the worker ended so far (recorded, released when it released).
    fn ended(&self) -> u64 {
        metric_sum(&self.metrics.render(), "tollgate_worker_jobs_total{")
    }

    async fn wait_ended(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.ended() < n {
            assert!(Instant::now() < deadline, "the worker never ended job {n}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn used(&self) -> u64 {
        self.h.usage(&self.key).await["used"].as_u64().unwrap()
    }

    fn absorbed(&self, reason: &str) -> u64 {
        metric_sum(
            &self.metrics.render(),
            &format!("tollgate_absorbed_calls_total{{provider=\"up\",reason=\"{reason}\"}}"),
        )
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The sum of the samples whose line starts with `prefix`.
fn metric_sum(text: &str, prefix: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A failed job's problem: its `type` slug, `cause` and `charged`.
#[track_caller]
fn failed(r: &crate::api::Resp, status: u16, slug: &str, cause: &str, charged: bool) {
    let b: &Value = &r.body;
    assert_eq!(r.status.as_u16(), status, "{b}");
    assert_eq!(r.header("content-type"), "application/problem+json", "{b}");
    assert_eq!(b["type"], format!("/problems/{slug}"), "{b}");
    assert_eq!(b["cause"], cause, "{b}");
    assert_eq!(b["charged"], charged, "{b}");
}

/// Provider timeout 1 s, the upstream answers after 2 s: it may have done the
/// work, so the charge stands; the call is not sent again. (Before: 3 calls,
/// released: 0 tokens.)
async fn an_unanswered_call_is_sent_once_and_keeps_its_charge(redis: bool) {
    let s = Stage::start(redis, "").await;
    let (r, arrivals) = s.call("up.call", "ok", 2000).await;
    failed(&r, 504, "upstream-unanswered", "unanswered", true);
    let detail = r.body["detail"].as_str().unwrap();
    assert!(detail.contains("charged"), "{detail}");
    assert_eq!(arrivals, 1);
    assert_eq!(s.used().await, COST);
    // A sync call answered without an Idempotency-Key leaves no job record
    // (deleted in the background, just after the answer).
    let id = r.body["job_id"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let gone = s.h.get(&format!("/v1/jobs/{id}"), &s.key, &[]).await;
        if gone.status.as_u16() == 404 {
            break;
        }
        assert!(Instant::now() < deadline, "{}", gone.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // With a key, the job's status says so too.
    let upstream = json!({"answer": "ok", "after_ms": 2000});
    let r = s.keyed_call("unanswered-1", upstream).await;
    failed(&r, 504, "upstream-unanswered", "unanswered", true);
    let job = s.job_of(&r).await;
    assert_eq!(job["status"], "failed", "{job}");
    assert_eq!(job["error"]["cause"], "unanswered", "{job}");
    assert_eq!(job["error"]["charged"], true, "{job}");
}

/// The job's deadline (1 s) passes while its call (answered after 1.5 s,
/// within the provider's 5 s timeout) is in flight: the call finishes and its
/// answer decides. (Before: 504 job-expired at 1 s, charged 0, while the
/// upstream answered 200.)
async fn a_deadline_passing_mid_call_lets_the_call_finish_and_charges_it(redis: bool) {
    let s = Stage::start(redis, "").await;
    let (r, arrivals) = s.call("slow.short", "ok", 1500).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.body);
    assert_eq!(r.body["status"], "succeeded", "{}", r.body);
    assert_eq!(arrivals, 1);
    assert_eq!(s.used().await, COST);
}

/// A 2xx the worker cannot read as JSON is work done: 502 bad-response,
/// charged, one upstream call each.
async fn unparsable_2xx_answers_are_charged_once_each(redis: bool) {
    let s = Stage::start(redis, "").await;
    let answers = ["text", "empty", "204", "1e400"];
    for (i, answer) in answers.iter().enumerate() {
        let (r, arrivals) = s.call("up.call", answer, 0).await;
        failed(&r, 502, "bad-upstream-response", "bad_response", true);
        assert_eq!(arrivals, 1, "{answer}");
        assert_eq!(s.used().await, COST * (i as u64 + 1), "{answer}");
    }
}

/// 400, 413, 415, 422: the upstream rejected the input before any work: the
/// client gets 422 upstream-rejected with the upstream's status (its body
/// only when the operation exposes it: not here); released, not retried.
/// (Before: 502 provider-failure, the upstream's text in the detail.)
async fn a_rejected_input_is_a_4xx_released_and_not_retried(redis: bool) {
    let s = Stage::start(redis, "").await;
    for answer in ["400", "413", "415", "422"] {
        let (r, arrivals) = s.call("up.call", answer, 0).await;
        failed(&r, 422, "upstream-rejected", "rejected", false);
        assert_eq!(
            r.body["upstream_status"],
            answer.parse::<u16>().unwrap(),
            "{}",
            r.body
        );
        assert!(r.body.get("upstream_body").is_none(), "{}", r.body);
        let text = r.body.to_string();
        assert!(
            !text.contains("bad input") && !text.contains("upstream says"),
            "{text}"
        );
        assert_eq!(arrivals, 1, "{answer}");
        assert_eq!(s.used().await, 0, "{answer}");
    }
    assert_eq!(s.absorbed("server_error"), 0);
    // The job's record says the same.
    let r = s.keyed_call("rejected-1", json!({"answer": "422"})).await;
    failed(&r, 422, "upstream-rejected", "rejected", false);
    let job = s.job_of(&r).await;
    let error = &job["error"];
    assert_eq!(error["cause"], "rejected", "{job}");
    assert_eq!(error["upstream_status"], 422, "{job}");
    assert_eq!(error["charged"], false, "{job}");
    assert!(error.get("upstream_body").is_none(), "{job}");
}

/// An operation with `expose_upstream_errors = true`: the rejection carries
/// the upstream's body, in the answer and in the job's record.
async fn an_exposed_rejection_carries_the_upstream_body(redis: bool) {
    let extra = format!(
        "[operations.\"up.exposed\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/up\"\n\
         expose_upstream_errors = true\n"
    );
    let s = Stage::start(redis, &extra).await;
    let (r, arrivals) = s.call("up.exposed", "422", 0).await;
    failed(&r, 422, "upstream-rejected", "rejected", false);
    assert_eq!(r.body["upstream_status"], 422, "{}", r.body);
    let body: Value = serde_json::from_str(r.body["upstream_body"].as_str().unwrap()).unwrap();
    assert_eq!(
        body["error"], "upstream says 422 to this input",
        "{}",
        r.body
    );
    assert_eq!(arrivals, 1);
    assert_eq!(s.used().await, 0);
    // A 5xx stays a 502, its text kept from the client even here.
    let (r, _) = s.call("up.exposed", "500", 0).await;
    failed(&r, 502, "provider-failure", "provider", false);
    assert!(!r.body.to_string().contains("boom"), "{}", r.body);
}

/// 401 and 404 from the upstream are the operator's misconfiguration (a
/// wrong key, a wrong path), not the client's input: 502, released, and the
/// upstream's text does not reach the client.
async fn misconfiguration_answers_stay_502_without_the_upstream_text(redis: bool) {
    let s = Stage::start(redis, "").await;
    for answer in ["401", "404"] {
        let (r, arrivals) = s.call("up.call", answer, 0).await;
        failed(&r, 502, "provider-failure", "provider", false);
        assert!(r.body.get("upstream_status").is_none(), "{}", r.body);
        assert!(!r.body.to_string().contains("upstream says"), "{}", r.body);
        assert_eq!(arrivals, 1, "{answer}");
    }
    assert_eq!(s.used().await, 0);
}

/// A provider's static `headers` and `secret_headers` (from the environment)
/// reach the upstream on every call, beside the old `auth_header`.
async fn providers_send_static_and_secret_headers(redis: bool) {
    std::env::set_var("TOLLGATE_TEST_OUTCOMES_SECRET", "s3cret-value");
    std::env::set_var("TOLLGATE_TEST_OUTCOMES_AUTH", "Bearer old-form");
    let s = Stage::start_with(redis, "", |url| {
        format!(
            "[providers.hdr]\nrate = 1000\nburst = 100\nmax_wait = \"5s\"\nurl = \"{url}\"\n\
             auth_header = \"Authorization\"\nauth_env = \"TOLLGATE_TEST_OUTCOMES_AUTH\"\n\
             headers = {{ \"anthropic-version\" = \"2023-06-01\", \"x-static\" = \"a b\" }}\n\
             secret_headers = {{ \"x-api-key\" = \"TOLLGATE_TEST_OUTCOMES_SECRET\" }}\n\n\
             [operations.\"hdr.call\"]\ncost = {COST}\nprovider = \"hdr\"\npath = \"/hdr\"\n"
        )
    })
    .await;
    let (r, arrivals) = s.call("hdr.call", "ok", 0).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.body);
    assert_eq!(arrivals, 1);
    let arrival = s.upstream.arrivals().pop().unwrap();
    let h = |name: &str| {
        arrival
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(h("anthropic-version").as_deref(), Some("2023-06-01"));
    assert_eq!(h("x-static").as_deref(), Some("a b"));
    assert_eq!(h("x-api-key").as_deref(), Some("s3cret-value"));
    assert_eq!(h("authorization").as_deref(), Some("Bearer old-form"));
}

/// 503 and 429 refuse before work: retried within `retries` (2), then
/// released, nothing absorbed.
async fn overload_answers_are_retried_then_released(redis: bool) {
    let s = Stage::start(redis, "").await;
    for answer in ["503", "429"] {
        let (r, arrivals) = s.call("up.call", answer, 0).await;
        failed(&r, 502, "provider-failure", "provider", false);
        assert_eq!(arrivals, 3, "{answer}");
        assert_eq!(s.used().await, 0, "{answer}");
    }
    assert_eq!(s.absorbed("server_error"), 0);
}

/// A 500 may have come after work: the user does not pay for the provider's
/// failure (released, after the retries), and the operator sees it absorbed.
async fn a_server_error_is_released_and_counted_as_absorbed(redis: bool) {
    let s = Stage::start(redis, "").await;
    let (r, arrivals) = s.call("up.call", "500", 0).await;
    failed(&r, 502, "provider-failure", "provider", false);
    assert_eq!(arrivals, 3);
    assert_eq!(s.used().await, 0);
    assert_eq!(s.absorbed("server_error"), 1);
}

/// A 200 whose body stops halfway: sent, no whole answer: the charge stands,
/// no second call.
async fn a_reply_cut_midway_keeps_the_charge(redis: bool) {
    let s = Stage::start(redis, "").await;
    let (r, arrivals) = s.call("up.call", "cut", 0).await;
    failed(&r, 504, "upstream-unanswered", "unanswered", true);
    assert_eq!(arrivals, 1);
    assert_eq!(s.used().await, COST);
}

/// Nothing listens: provably nothing was sent, so the retries are free and the
/// charge is released.
async fn an_unreachable_upstream_is_retried_free_and_released(redis: bool) {
    let s = Stage::start(redis, "").await;
    let (r, _) = s.call("closed.call", "ok", 0).await;
    failed(&r, 502, "provider-failure", "provider", false);
    assert_eq!(s.used().await, 0);
    let retries = metric_sum(
        &s.metrics.render(),
        "tollgate_provider_retries_total{provider=\"closed\"}",
    );
    assert_eq!(retries, 2);
}

/// An operation that says resending is safe (`retry_unanswered = true`) is
/// sent again after a timeout, within `retries`, under its one charge.
async fn retry_unanswered_lets_an_operation_resend(redis: bool) {
    let extra = format!(
        "[operations.\"up.idempotent\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/up\"\n\
         retry_unanswered = true\n"
    );
    let s = Stage::start(redis, &extra).await;
    let (r, arrivals) = s.call("up.idempotent", "ok", 2000).await;
    failed(&r, 504, "upstream-unanswered", "unanswered", true);
    assert_eq!(arrivals, 3);
    assert_eq!(s.used().await, COST);
}

/// An operation that settles reserves its most (40) up front; unanswered, no
/// usage is ever reported, and the charge that stands is the most, not its
/// estimate (5): the upstream may have done all the call allowed, and the
/// price must not depend on whether its report arrived.
async fn a_settled_operation_left_unanswered_keeps_its_most_not_its_estimate(redis: bool) {
    let extra = format!(
        "[operations.\"up.settled\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/up\"\n\
         settle = {{ from = \"/usage/total_tokens\", per = 100, max = 40 }}\n"
    );
    let s = Stage::start(redis, &extra).await;
    let (r, arrivals) = s.call("up.settled", "ok", 2000).await;
    failed(&r, 504, "upstream-unanswered", "unanswered", true);
    assert_eq!(arrivals, 1);
    assert_eq!(s.used().await, 40);
}

/// `method = "GET"` sends the input as the query string of a bodiless GET;
/// `body = "form"` as a form body; the default stays a JSON POST.
async fn operations_send_a_get_query_or_a_form_body(redis: bool) {
    let extra = format!(
        "[operations.\"up.get\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/search\"\nmethod = \"GET\"\n\n\
         [operations.\"up.form\"]\ncost = {COST}\nprovider = \"up\"\npath = \"/token\"\nbody = \"form\"\n"
    );
    let s = Stage::start(redis, &extra).await;
    let input = json!({"q": "rust & redis", "page": 2, "tag": ["a", "b"], "skip": null});
    for operation in ["up.get", "up.form"] {
        let before = s.ended();
        let r =
            s.h.post(&format!("/v1/ops/{operation}"), &s.key, input.clone())
                .await;
        s.wait_ended(before + 1).await;
        assert_eq!(r.status.as_u16(), 200, "{operation}: {}", r.body);
    }
    let arrivals = s.upstream.arrivals();
    let get = arrivals.iter().find(|a| a.path == "search").unwrap();
    assert_eq!(get.method, "GET");
    // The pairs in the input's member order (an array's in its own).
    let sorted = |text: &str| {
        let mut pairs: Vec<String> = text.split('&').map(str::to_owned).collect();
        pairs.sort();
        pairs
    };
    let expected = sorted("q=rust+%26+redis&page=2&tag=a&tag=b");
    assert_eq!(sorted(get.query.as_deref().unwrap_or("")), expected);
    assert!(get.body.is_empty());
    let form = arrivals.iter().find(|a| a.path == "token").unwrap();
    assert_eq!(form.method, "POST");
    assert_eq!(
        form.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/x-www-form-urlencoded")
    );
    assert_eq!(sorted(&String::from_utf8_lossy(&form.body)), expected);
    assert_eq!(s.used().await, 2 * COST);
}

/// A sync call without an Idempotency-Key leaves no job record once answered,
/// failed or not: a failure whose charge is released (5xx, 503, a rejected
/// input) is answered while its release is still pending, so its record could
/// not go then; it goes once the release is confirmed. (Before: the record of
/// most such calls stayed for the operation's `result_ttl`.)
async fn failed_keyless_sync_calls_leave_no_job_record(redis: bool) {
    let s = Stage::start(redis, "").await;
    let mut ids = Vec::new();
    for answer in ["500", "503", "400"].iter().cycle().take(12) {
        let (r, _) = s.call("up.call", answer, 0).await;
        assert!(
            matches!(r.status.as_u16(), 422 | 502),
            "{answer}: {}",
            r.body
        );
        ids.push(r.body["job_id"].as_str().expect("job_id").to_owned());
    }
    assert_eq!(s.used().await, 0, "every charge released");
    // The records go in the background, just after the answer (or the
    // release): wait for that, boundedly.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut left = Vec::new();
        for id in &ids {
            let r = s.h.get(&format!("/v1/jobs/{id}"), &s.key, &[]).await;
            if r.status.as_u16() != 404 {
                left.push((id.clone(), r.status.as_u16()));
            }
        }
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} keyless failed calls left a job record: {left:?}",
            left.len(),
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Some(server) = &s.h.redis {
        // Nothing else of theirs either: no job key in Redis at all.
        let mut c = ::redis::Client::open(server.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg("*:job:*")
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(keys.is_empty(), "{keys:?}");
    }
}

/// Log lines, as the `tollgate` binary writes them (without colours), kept
/// in memory.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut b) = self.0.lock() {
            b.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        self.0
            .lock()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }
}

/// An upstream 401 whose body echoes the operator's credentials: the
/// worker's log at INFO has neither the body nor a credential; at DEBUG it
/// has the body, with every secret header's value masked. (Before: the body
/// at INFO, both keys in it.) One thread runs the test and every task it
/// spawns, so the subscriber set for this thread sees all of the worker's
/// lines.
async fn an_upstream_error_body_is_logged_at_debug_with_secrets_masked(redis: bool) {
    const SECRET: &str = "sk-live-0123456789abcdef-SECRET";
    const BEARER: &str = "bearer-0123456789-OTHER-SECRET";
    std::env::set_var("TOLLGATE_TEST_LOG_SECRET", SECRET);
    std::env::set_var("TOLLGATE_TEST_LOG_AUTH", format!("Bearer {BEARER}"));
    let captured = Captured::default();
    let writer = captured.clone();
    let _subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish()
        .set_default();
    let s = Stage::start_with(redis, "", |url| {
        format!(
            "[providers.keyed]\nrate = 1000\nburst = 100\nmax_wait = \"5s\"\nurl = \"{url}\"\n\
             auth_header = \"Authorization\"\nauth_env = \"TOLLGATE_TEST_LOG_AUTH\"\n\
             secret_headers = {{ \"x-api-key\" = \"TOLLGATE_TEST_LOG_SECRET\" }}\n\n\
             [operations.\"keyed.call\"]\ncost = {COST}\nprovider = \"keyed\"\npath = \"/keyed\"\n"
        )
    })
    .await;
    let (r, arrivals) = s.call("keyed.call", "401-echo", 0).await;
    failed(&r, 502, "provider-failure", "provider", false);
    assert_eq!(arrivals, 1);
    assert!(!r.body.to_string().contains(SECRET), "{}", r.body);
    let text = captured.text();
    let at = |level: &str| -> Vec<&str> {
        text.lines()
            .filter(|l| l.split_whitespace().nth(1) == Some(level))
            .collect()
    };
    let info = at("INFO");
    assert!(
        info.iter().any(|l| l.contains("job failed")),
        "the failure is logged at INFO: {text}"
    );
    for line in &info {
        assert!(
            !line.contains("Incorrect API key"),
            "no upstream body at INFO: {line}"
        );
    }
    let debug = at("DEBUG");
    assert!(
        debug
            .iter()
            .any(|l| l.contains("Incorrect API key provided")),
        "the body at DEBUG: {text}"
    );
    for secret in [SECRET, BEARER] {
        assert!(!text.contains(secret), "{secret} in the log: {text}");
    }
}

/// On a runtime of one thread (the test's own): the subscriber set for the
/// thread sees every task.
mod upstream_logs {
    #[tokio::test(flavor = "current_thread")]
    async fn memory() {
        super::an_upstream_error_body_is_logged_at_debug_with_secrets_masked(false).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn redis() {
        super::an_upstream_error_body_is_logged_at_debug_with_secrets_masked(true).await;
    }
}
