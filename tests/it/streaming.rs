//! Pass-through and streamed answers end to end, the same cases on both
//! backends (`tollgate all` embedded, and on Redis): the mock speaks the
//! OpenAI and Anthropic protocols; tollgate answers as the upstream does,
//! relays a stream event by event, settles the charge to the usage the stream
//! reported, answers a budget 429 in the SDK's shape, and a client that goes
//! away mid-stream cuts the upstream call (charged: the upstream worked).
//!
//! Faults with real processes: a worker SIGKILLed mid-stream (api, throttler
//! and workers as separate processes) and Redis restarted mid-stream: the
//! client sees a clean error event or the whole answer, never a cut answer
//! presented as whole; the charge follows the outcome rules; every key a
//! stream leaves in Redis expires within the stream's TTL.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate_core::stream::STREAM_TTL;
use tollgate_tests::http::{reqwest_client, FetchJson};
use tollgate_tests::process::{spawn_all, spawn_mock, Procs};
use tollgate_tests::{random_prefix, RedisServer, TempDir};

fn mock(args: &[&str]) -> (Child, String) {
    let mut all = vec!["--rate", "1000", "--burst", "100"];
    all.extend_from_slice(args);
    spawn_mock(&all)
}

struct System {
    base: String,
    admin: String,
    mock: String,
    http: reqwest::Client,
    _dir: TempDir,
    _procs: Procs,
    redis: Option<RedisServer>,
    prefix: String,
}

/// The config of both backends: an OpenAI-like and an Anthropic-like
/// provider on the mock, each operation settled to its reported usage.
fn config(mock: &str) -> String {
    format!(
        r#"
default_plan = "free"
[plans.free]
limit = 1000
window = "12h"
[plans.tiny]
limit = 200
window = "12h"
[plans.few]
limit = 100000
window = "12h"
max_open_streams = 2
[plans.big]
limit = 100000
window = "12h"
[providers.openai]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}/v1"
retries = 0
[providers.anthropic]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}"
retries = 0
[operations."openai.chat"]
cost = 2
provider = "openai"
path = "/chat/completions"
settle = {{ from = "/usage/total_tokens", per = 1, max = 200 }}
[operations."openai.embeddings"]
cost = 1
provider = "openai"
path = "/embeddings"
settle = {{ from = "/usage/total_tokens", per = 1, max = 50 }}
[operations."anthropic.messages"]
cost = 2
provider = "anthropic"
path = "/v1/messages"
settle = {{ from = "/usage/output_tokens", per = 1, max = 200 }}
[operations."openai.echo"]
cost = 1
provider = "openai"
path = "/echo"
[providers.brief]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}/v1"
retries = 0
[operations."brief.chat"]
cost = 2
provider = "brief"
path = "/chat/completions"
deadline = "1s"
settle = {{ from = "/usage/total_tokens", per = 1, max = 200 }}
[providers.bounded]
max_wait = "10s"
url = "{mock}/v1"
retries = 0
limits = [{{ rate = 100, per = "1s" }}, {{ tokens = 100000, per = "1m", burst = 10000 }}]
usage = "/usage/total_tokens"
[operations."bounded.chat"]
cost = 2
provider = "bounded"
path = "/chat/completions"
weight = {{ from = "/max_tokens", default = 3, input = "bytes" }}
"#
    )
}

fn start(redis: bool, token_interval_ms: u64) -> System {
    start_with(redis.then_some(&[][..]), token_interval_ms)
}

/// `tollgate all`, on a redis-server started with `redis` arguments when
/// given, else embedded.
fn start_with(redis: Option<&[&str]>, token_interval_ms: u64) -> System {
    start_on(redis, None, token_interval_ms)
}

/// `tollgate all` on the suite's Redis Cluster (a stream's key shares its
/// queue's hash tag).
fn start_cluster(token_interval_ms: u64) -> (System, tollgate_tests::TestCluster) {
    let cluster = tollgate_tests::TestCluster::get();
    let sys = start_on(None, Some(cluster.url()), token_interval_ms);
    (sys, cluster)
}

fn start_on(redis: Option<&[&str]>, cluster: Option<String>, token_interval_ms: u64) -> System {
    let interval = token_interval_ms.to_string();
    let (mock_child, mock_url) = mock(&["--token-interval-ms", &interval]);
    let dir = TempDir::new("stream");
    let path = dir.0.join("streaming.toml");
    std::fs::write(&path, config(&mock_url)).unwrap();
    let server = redis.map(RedisServer::start_with);
    let prefix = random_prefix();
    let url = server.as_ref().map(|s| s.url()).or(cluster);
    let (child, lines) = spawn_all(&path, url.as_deref(), &prefix);
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    System {
        base: find("listening on "),
        admin: find("admin token: "),
        mock: mock_url,
        http: reqwest_client(Duration::from_secs(60)),
        _dir: dir,
        _procs: Procs(vec![mock_child, child]),
        redis: server,
        prefix,
    }
}

/// One role of a split deployment, on `url` with `prefix`.
fn role(args: &[&str], config: &Path, url: &str, prefix: &str) -> Child {
    tollgate_tests::process::command(args)
        .arg("--config")
        .arg(config)
        .env("TOLLGATE_REDIS_URL", url)
        .env("TOLLGATE_KEY_PREFIX", prefix)
        .env("TOLLGATE_ADMIN_TOKEN", crate::api::ADMIN)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn tollgate {args:?}: {e}"))
}

/// A split deployment on one redis-server: an api, a throttler and a worker
/// (its lease `lease_ms`) as processes; the worker is returned apart, to be
/// killed, with what starts another.
async fn start_split(
    token_interval_ms: u64,
    lease_ms: &'static str,
) -> (System, Child, impl Fn() -> Child) {
    start_split_with(token_interval_ms, vec!["worker", "--lease-ms", lease_ms]).await
}

/// [`start_split`], its workers started with `worker_args`.
async fn start_split_with(
    token_interval_ms: u64,
    worker_args: Vec<&'static str>,
) -> (System, Child, impl Fn() -> Child) {
    let interval = token_interval_ms.to_string();
    let (mock_child, mock_url) = mock(&["--token-interval-ms", &interval]);
    let dir = TempDir::new("split");
    let path = dir.0.join("streaming.toml");
    std::fs::write(&path, config(&mock_url)).unwrap();
    let server = RedisServer::start();
    let (url, prefix) = (server.url(), random_prefix());
    let addr = format!("127.0.0.1:{}", tollgate_tests::redis_server::free_port());
    let api = role(&["api", "--listen", &addr], &path, &url, &prefix);
    let throttler = role(&["throttler"], &path, &url, &prefix);
    let worker = role(&worker_args, &path, &url, &prefix);
    let another = {
        let (path, url, prefix) = (path.clone(), url.clone(), prefix.clone());
        move || role(&worker_args, &path, &url, &prefix)
    };
    let sys = System {
        base: format!("http://{addr}"),
        admin: crate::api::ADMIN.to_owned(),
        mock: mock_url,
        http: reqwest_client(Duration::from_secs(60)),
        _dir: dir,
        _procs: Procs(vec![mock_child, api, throttler]),
        redis: Some(server),
        prefix,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ready = sys.http.get(format!("{}/readyz", sys.base)).send().await;
        if matches!(&ready, Ok(r) if r.status() == 200) {
            break;
        }
        assert!(Instant::now() < deadline, "the api is not ready: {ready:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (sys, worker, another)
}

impl System {
    async fn user(&self, name: &str, plan: &str) -> String {
        let r = self
            .http
            .post(format!("{}/admin/users", self.base))
            .bearer_auth(&self.admin)
            .json(&json!({"user": name, "plan": plan}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        r.json::<Value>().await.unwrap()["api_key"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn used(&self, key: &str) -> u64 {
        let v: Value = self
            .http
            .get(format!("{}/v1/usage", self.base))
            .bearer_auth(key)
            .fetch_json()
            .await;
        v["used"].as_u64().unwrap()
    }

    /// `used` once it equals `want`, or what it is after 10 s.
    async fn used_until(&self, key: &str, want: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let used = self.used(key).await;
            if used == want || Instant::now() > deadline {
                return used;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `used` once the user's latest job has ended (at most 10 s): its
    /// charge settled, kept or released.
    async fn settled_used(&self, key: &str) -> u64 {
        let v: Value = self
            .http
            .get(format!("{}/v1/usage", self.base))
            .bearer_auth(key)
            .fetch_json()
            .await;
        let events = v["events"].as_array().expect("events");
        let last = events
            .iter()
            .max_by_key(|e| e["at_ms"].as_u64())
            .expect("a charge");
        let id = last["request_id"].as_str().unwrap().to_owned();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = self
                .http
                .get(format!("{}/v1/jobs/{id}", self.base))
                .bearer_auth(key)
                .send()
                .await
                .unwrap();
            let status = r.json::<Value>().await.ok().map(|v| v["status"].clone());
            if matches!(
                status.as_ref().and_then(Value::as_str),
                Some("succeeded" | "failed")
            ) {
                return self.used(key).await;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} did not end: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn mock_stats(&self) -> Value {
        self.http
            .get(format!("{}/stats", self.mock))
            .fetch_json()
            .await
    }

    fn openai(&self, key: &str, path: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}/v1/passthrough/openai{path}", self.base))
            .bearer_auth(key)
    }

    fn anthropic(&self, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!(
                "{}/v1/passthrough/anthropic/v1/messages",
                self.base
            ))
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01")
    }
}

impl System {
    /// Every key of this deployment whose name has `stream`, with its PTTL.
    async fn stream_keys(&self) -> Vec<(String, i64)> {
        let server = self.redis.as_ref().expect("on Redis");
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*stream*", self.prefix))
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut out = Vec::new();
        for k in keys {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&k)
                .query_async(&mut conn)
                .await
                .unwrap();
            out.push((k, ttl));
        }
        out
    }

    /// No key of a stream stays longer than the stream's TTL (a reader gone
    /// leaves its cancel mark, so there is one at least).
    async fn streams_expire(&self) {
        let ttl = i64::try_from(STREAM_TTL.as_millis()).unwrap();
        let keys = self.stream_keys().await;
        assert!(!keys.is_empty(), "no stream key under {}", self.prefix);
        for (key, pttl) in keys {
            // -2: the key went between the listing and its PTTL (expired or
            // deleted): gone is within the bound. -1 (no expiry) is not.
            assert!(
                pttl == -2 || (pttl > 0 && pttl <= ttl),
                "{key} has PTTL {pttl}"
            );
        }
    }

    /// Reads `r`'s body until it ends (at most 30 s): its `data:` payloads.
    async fn rest(r: &mut reqwest::Response, mut body: String) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, r.chunk()).await {
                Ok(Ok(Some(chunk))) => body.push_str(&String::from_utf8_lossy(&chunk)),
                Ok(Ok(None)) => return datas(&body),
                Ok(Err(e)) => {
                    panic!("the stream broke instead of ending cleanly: {e}; so far {body}")
                }
                Err(_) => panic!("the stream did not end within 30 s: {body}"),
            }
        }
    }
}

/// Starts a long streamed chat (60 words at the mock's pace) and reads its
/// first three events: the answer is under way.
async fn long_stream(sys: &System, key: &str) -> (reqwest::Response, String) {
    let words = vec!["w"; 60].join(" ");
    let mut r = sys
        .openai(key, "/chat/completions")
        .json(
            &json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": words}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = String::new();
    while body.matches("data: ").count() < 3 {
        let chunk = r.chunk().await.unwrap().expect("more of the stream");
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    (r, body)
}

/// Whether `datas` is a whole chat answer (its text complete, `[DONE]`
/// last), or a cut one ending in an error event; panics on anything else.
fn whole_or_clean_error(datas: &[String], text: &str) -> bool {
    let last = datas.last().map(String::as_str);
    if last == Some("[DONE]") {
        let chunks: Vec<Value> = datas[..datas.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let got: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(got, text, "a cut answer presented as whole");
        return true;
    }
    let error: Value = serde_json::from_str(last.unwrap_or("null")).unwrap_or(Value::Null);
    assert!(
        error["error"]["message"].as_str().is_some() && error["error"]["type"] == "server_error",
        "neither whole nor a clean error event: {datas:?}"
    );
    assert!(!datas.iter().any(|d| d == "[DONE]"), "{datas:?}");
    false
}

/// The `data:` payloads of an SSE body.
fn datas(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(str::to_owned)
        .collect()
}

async fn whole_and_streamed_answers(redis: bool) {
    whole_and_streamed_answers_on(start(redis, 2)).await;
}

async fn whole_and_streamed_answers_on(sys: System) {
    let key = sys.user("ada", "free").await;

    // Chat, whole: the upstream's body as-is; charged its total_tokens.
    let r = sys
        .openai(&key, "/chat/completions")
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "mock answer to: hello there"
    );
    let total = v["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(total, 2 + 5);
    assert_eq!(sys.used_until(&key, total).await, total);

    // Chat, streamed: every token in order, the usage chunk, [DONE].
    let r = sys
        .openai(&key, "/chat/completions")
        .json(
            &json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "one two three"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let body = r.text().await.unwrap();
    let sent = datas(&body);
    assert_eq!(sent.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = sent[..sent.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "mock answer to: one two three");
    let streamed = chunks.last().unwrap()["usage"]["total_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(streamed, 3 + 6);
    assert_eq!(
        sys.used_until(&key, total + streamed).await,
        total + streamed
    );

    // Embeddings (floats and base64).
    let r = sys
        .openai(&key, "/embeddings")
        .json(&json!({"model": "e", "input": ["a b", "c"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["total_tokens"], 3);
    let so_far = total + streamed + 3;
    assert_eq!(sys.used_until(&key, so_far).await, so_far);

    // Anthropic messages, streamed, with its own key header.
    let r = sys
        .anthropic(&key)
        .json(&json!({"model": "c", "max_tokens": 64, "stream": true,
                      "messages": [{"role": "user", "content": "four five"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let events: Vec<Value> = datas(&body)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{body}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{body}");
    let text: String = events
        .iter()
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "mock answer to: four five");
    let output = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .unwrap()["usage"]["output_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(output, 5);
    assert_eq!(sys.used_until(&key, so_far + output).await, so_far + output);

    // A path no operation has: 404 in OpenAI's shape.
    let r = sys
        .openai(&key, "/images/generations")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    // A wrong key: 401 in Anthropic's shape.
    let r = sys
        .anthropic("tg_user_nope")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("authentication_error")),
        "{v}"
    );
}

/// Out of budget: 429 in each SDK's shape, with the exact Retry-After (and
/// `retry-after-ms`), and a far one says not to retry.
/// A call of an operation whose weight reads `max_tokens` goes upstream
/// with the operation's default (3) when it sets none, whole or streamed,
/// so the upstream writes no more than its weight counts: the mock's answer
/// ("mock answer to: one two three four five") stops after 3 words. One that
/// sets its own keeps it.
async fn a_call_without_max_tokens_goes_with_its_default(redis: bool) {
    let sys = start(redis, 2);
    let key = sys.user("bo", "big").await;
    let messages = json!([{"role": "user", "content": "one two three four five"}]);
    let bounded = |path: &str| {
        sys.http
            .post(format!("{}/v1/passthrough/bounded{path}", sys.base))
            .bearer_auth(&key)
    };
    let r = bounded("/chat/completions")
        .json(&json!({"model": "m", "messages": messages}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"], "mock answer to:",
        "{v}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    let r = bounded("/chat/completions")
        .json(&json!({"model": "m", "stream": true, "messages": messages}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let text: String = datas(&body)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, "mock answer to:", "{body}");
    let r = bounded("/chat/completions")
        .json(&json!({"model": "m", "max_tokens": 5, "messages": messages}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
}

async fn budget_429_in_the_sdks_shape(redis: bool) {
    let sys = start(redis, 0);
    let key = sys.user("tim", "tiny").await;
    let ask = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let r = sys
        .openai(&key, "/chat/completions")
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // 200 reserved up front (the most), settled to the few used: 200 more do not fit.
    let r = sys
        .openai(&key, "/chat/completions")
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let secs: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let ms: u64 = r.headers()["retry-after-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(secs > 12 * 3600 - 120 && secs <= 12 * 3600, "{secs}");
    assert_eq!(secs, ms.div_ceil(1000));
    assert_eq!(r.headers()["x-should-retry"], "false");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert_eq!(v["error"]["code"], "quota_exceeded", "{v}");
    let r = sys
        .anthropic(&key)
        .json(&json!({"model": "c", "max_tokens": 8, "stream": true, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
}

/// A client that goes away mid-stream (a plain `stream: true`, usage not
/// asked for): the upstream call is cut (the mock sees its stream's caller
/// leave), and the charge stands at the reservation: the upstream did work
/// and its usage was never seen, so the client cannot pick the price by
/// leaving (the old code settled it to the estimate, 2).
async fn a_client_gone_mid_stream_cuts_the_upstream(redis: bool) {
    let sys = start(redis, 40);
    let key = sys.user("cat", "free").await;
    let words = vec!["w"; 60].join(" ");
    let mut r = sys
        .openai(&key, "/chat/completions")
        .json(&json!({"model": "m", "stream": true,
                      "messages": [{"role": "user", "content": words}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut got = 0;
    while got < 3 {
        let chunk = r.chunk().await.unwrap().expect("more of the stream");
        got += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    drop(r);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = sys.mock_stats().await;
        if stats["streams_cut"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the upstream stream was not cut: {stats}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Reserved 200, and it stands: the upstream may have done all of it.
    assert_eq!(sys.settled_used(&key).await, 200);
}

/// A user with its plan's `max_open_streams` (2) open: one more stream is
/// refused at once, 429 `too-many-streams` in the SDK's shape with
/// `Retry-After: 1`, before anything is charged; another user's stream is
/// served meanwhile; once one of the two ends, a new one is admitted.
async fn streams_past_the_plans_bound_are_refused(redis: bool) {
    let sys = start(redis, 40);
    let key = sys.user("fay", "few").await;
    let (first, _) = long_stream(&sys, &key).await;
    let (_second, _) = long_stream(&sys, &key).await;
    let used = sys.used(&key).await;
    assert_eq!(used, 2 * 200, "each stream reserved its most");
    let r = sys
        .openai(&key, "/chat/completions")
        .json(&json!({"model": "m", "stream": true,
                      "messages": [{"role": "user", "content": "third"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "too_many_streams", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_open_streams of 2"),
        "{v}"
    );
    assert_eq!(
        sys.used(&key).await,
        used,
        "a refused stream is not charged"
    );

    // Another user's stream is served meanwhile.
    let other = sys.user("gus", "free").await;
    let r = sys
        .openai(&other, "/chat/completions")
        .json(&json!({"model": "m", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(whole_or_clean_error(
        &datas(&r.text().await.unwrap()),
        "mock answer to: hi"
    ));

    // One of the two gone: a new one is admitted (its place frees as soon as
    // the api sees its client leave).
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = sys
            .openai(&key, "/chat/completions")
            .json(&json!({"model": "m", "stream": true,
                          "messages": [{"role": "user", "content": "again"}]}))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            break;
        }
        assert_eq!(r.status(), 429);
        assert!(Instant::now() < deadline, "the stream's place never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pass-through answer carries the upstream's 2xx status and its request
/// ids; never the provider's account or rate-limit headers (the mock sends
/// `openai-organization` and `x-ratelimit-remaining-requests`).
async fn upstream_status_and_safe_headers(redis: bool) {
    let sys = start(redis, 0);
    let key = sys.user("hal", "free").await;
    let leaked = |h: &reqwest::header::HeaderMap| {
        ["openai-organization", "x-ratelimit-remaining-requests"]
            .into_iter()
            .filter(|n| h.contains_key(*n))
            .collect::<Vec<_>>()
    };
    // A 201 from the upstream is a 201 to the caller, its body as-is.
    let r = sys
        .openai(&key, "/echo")
        .json(&json!({"mock_status": 201, "x": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(id.starts_with("req_mock_"), "{id}");
    assert_eq!(r.headers()["openai-processing-ms"], "1");
    assert_eq!(leaked(r.headers()), Vec::<&str>::new());
    assert!(
        r.headers().contains_key("ratelimit"),
        "tollgate's own budget headers"
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["echo"]["x"], 1);

    // Whole and streamed chat: the request ids of each protocol.
    let r = sys
        .openai(&key, "/chat/completions")
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-request-id"));
    assert_eq!(leaked(r.headers()), Vec::<&str>::new());
    let r = sys
        .anthropic(&key)
        .json(&json!({"model": "c", "max_tokens": 8, "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert!(r.headers()["request-id"]
        .to_str()
        .unwrap()
        .starts_with("req_mock_"));
    assert_eq!(leaked(r.headers()), Vec::<&str>::new());
    assert!(r.text().await.unwrap().contains("message_stop"));
}

/// A worker SIGKILLed mid-stream (api, throttler, workers as processes):
/// once its lease ends another worker takes the job, does not run it again
/// (the client has part of the answer; the upstream worked) and ends the
/// stream with an error event; the charge stands at the reservation (no
/// usage was seen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_worker_killed_mid_stream() {
    let (sys, mut worker, another) = start_split(50, "1000").await;
    let key = sys.user("kim", "free").await;
    let (mut r, body) = long_stream(&sys, &key).await;
    worker.kill().unwrap(); // SIGKILL
    worker.wait().unwrap();
    let _next = Procs(vec![another()]);
    let datas = System::rest(&mut r, body).await;
    let words = vec!["w"; 60].join(" ");
    assert!(
        !whole_or_clean_error(&datas, &format!("mock answer to: {words}")),
        "the killed worker's answer could not have been finished: {datas:?}"
    );
    // Reserved 200, and it stands: the upstream worked, its usage unseen.
    assert_eq!(sys.settled_used(&key).await, 200);
    assert_eq!(sys.mock_stats().await["streams_cut"], 1);
    sys.streams_expire().await;
}

/// A streamed call with an Idempotency-Key whose job ends before a single
/// event (here: it expired in its queue while no worker ran) is answered
/// from its record, and the record stays once its charge's release is
/// confirmed: a retry with the key must find the job. Before, the stream's
/// path forgot it as if the call had no key (GET of the job: 404 once the
/// release was confirmed); under faults, a charge could then stand for a job
/// nobody could read (chaos --seed 1 --durable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_keyed_call_ended_before_any_event_keeps_its_record() {
    use sha2::{Digest, Sha256};
    let (sys, mut worker, another) = start_split(50, "1000").await;
    worker.kill().unwrap();
    worker.wait().unwrap();
    let key = sys.user("kit", "free").await;
    let restart = tokio::spawn(async move {
        // Past the job's 1 s deadline: the worker fails it as expired, with
        // no stream event.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        another()
    });
    let r = sys
        .http
        .post(format!("{}/v1/passthrough/brief/chat/completions", sys.base))
        .bearer_auth(&key)
        .header("idempotency-key", "brief-1")
        .json(&json!({ "model": "m", "stream": true, "messages": [{ "role": "user", "content": "hi" }] }))
        .send()
        .await
        .unwrap();
    let _worker = Procs(vec![restart.await.unwrap()]);
    let status = r.status();
    let body = r.text().await.unwrap();
    assert!(
        body.contains("expired"),
        "an expired job's answer: {status} {body}"
    );
    // The release confirmed (used back to 0): a forgotten record goes then.
    assert_eq!(
        sys.used_until(&key, 0).await,
        0,
        "the expired job's charge is released"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut h = Sha256::new();
    h.update(b"kit\0brief-1");
    let id: String = h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let job = sys
        .http
        .get(format!("{}/v1/jobs/idem-{id}", sys.base))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    let job_status = job.status();
    let job: Value = job.json().await.unwrap_or(Value::Null);
    assert_eq!(job_status, 200, "the keyed job's record is kept: {job}");
    assert_eq!(job["status"], "failed", "{job}");
}

/// Workers shared fairly (split deployment: api, throttler, 2 workers of 8
/// slots): one user opens 20 streams of ~15 s through the pass-through (the
/// config's plans set no `max_in_flight`); another user's sync call to
/// another provider answers within its upstream time (none: the mock answers
/// at once) + 1 s. Each worker gives one user at most half of its slots
/// (`--user-share` 0.5). Before (as with `--user-share 1`): the streams held
/// all 16 slots and the call waited for one to end (past a 15 s sync timeout
/// with 40 s streams).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_one_users_streams_leave_the_workers_to_others() {
    let (sys, worker, another) = start_split_with(150, vec!["worker", "--concurrency", "8"]).await;
    let _workers = Procs(vec![worker, another()]);
    let heavy = sys.user("hal", "big").await;
    let light = sys.user("lia", "free").await;
    // ~15 s each: still under way once the old workers had let them hold
    // every slot (a slot every second per idle fetch loop).
    let words = vec!["w"; 100].join(" ");
    let mut streams = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let r = sys
            .openai(&heavy, "/chat/completions")
            .json(&json!({"model": "m", "stream": true,
                          "messages": [{"role": "user", "content": words}]}));
        streams.spawn(async move {
            let mut r = r.send().await.unwrap();
            while let Ok(Some(_)) = r.chunk().await {}
        });
    }
    // The streams under way, as many as the workers let them hold: no new
    // one for 3 s (a worker's idle fetch loop of another operation lets its
    // slot go every second, its take's block).
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut streaming, mut since) = (0, Instant::now());
    loop {
        let now = sys.mock_stats().await["requests"].as_u64().unwrap_or(0);
        if now != streaming {
            (streaming, since) = (now, Instant::now());
        } else if streaming >= 8 && since.elapsed() > Duration::from_secs(3) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the streams did not start: {streaming}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let began = Instant::now();
    let r = sys
        .anthropic(&light)
        .json(&json!({"model": "c", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let took = began.elapsed();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    assert!(
        took < Duration::from_secs(1),
        "another user's call waited {took:?} behind {streaming} streams"
    );
    assert_eq!(streaming, 8, "one user's streams hold half of each worker");
    streams.abort_all();
}

/// Redis restarted mid-stream (its AOF kept): the client gets the whole
/// answer (the reader reads on from where it was) or a clean error event,
/// and the charge is the one the outcome rules give for it: the reported
/// usage for a whole answer; for a clean error (the worker's append failed
/// while Redis was down: the answer was cut after the upstream began) the
/// reservation, the charge standing with its usage unseen. The worker's
/// settle waits the restart out (as its recording does), so a whole answer
/// is paid its usage. Then a new stream works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_redis_restarted_mid_stream() {
    let mut sys = start_with(
        Some(&["--appendonly", "yes", "--appendfsync", "always"]),
        30,
    );
    let key = sys.user("rex", "free").await;
    let (mut r, body) = long_stream(&sys, &key).await;
    RedisServer::restart_in(&mut sys.redis).await;
    let sent = System::rest(&mut r, body).await;
    let words = vec!["w"; 60].join(" ");
    let whole = whole_or_clean_error(&sent, &format!("mock answer to: {words}"));
    if whole {
        assert_eq!(sys.used_until(&key, 60 + 63).await, 60 + 63);
    } else {
        assert_eq!(sys.settled_used(&key).await, 200, "cut: the reservation");
    }
    // Back to normal: a stream after the restart is whole.
    let r = sys
        .openai(&key, "/chat/completions")
        .json(&json!({"model": "m", "stream": true,
                      "messages": [{"role": "user", "content": "again"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let again = datas(&r.text().await.unwrap());
    assert!(whole_or_clean_error(&again, "mock answer to: again"));
    sys.streams_expire().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_upstream_status_and_headers_embedded() {
    upstream_status_and_safe_headers(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_upstream_status_and_headers_redis() {
    upstream_status_and_safe_headers(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_whole_and_streamed_answers_embedded() {
    whole_and_streamed_answers(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_whole_and_streamed_answers_redis() {
    whole_and_streamed_answers(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_default_output_bound_sent_embedded() {
    a_call_without_max_tokens_goes_with_its_default(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_default_output_bound_sent_redis() {
    a_call_without_max_tokens_goes_with_its_default(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_budget_429_embedded() {
    budget_429_in_the_sdks_shape(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_budget_429_redis() {
    budget_429_in_the_sdks_shape(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_client_gone_embedded() {
    a_client_gone_mid_stream_cuts_the_upstream(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_client_gone_redis() {
    a_client_gone_mid_stream_cuts_the_upstream(true).await;
}

/// The same answers on a Redis Cluster: `stream_push.lua` and the stream's
/// `XREAD` on the node that owns the job's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_whole_and_streamed_answers_cluster() {
    let (sys, _cluster) = start_cluster(2);
    whole_and_streamed_answers_on(sys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_max_open_streams_embedded() {
    streams_past_the_plans_bound_are_refused(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_max_open_streams_redis() {
    streams_past_the_plans_bound_are_refused(true).await;
}
