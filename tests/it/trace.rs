//! One trace id from request to provider: a call with a W3C `traceparent`
//! through an `api` process and a `worker` process (JSON logs) to a recording
//! upstream. Both processes' log lines about the call carry its `trace_id`,
//! and the upstream receives the same trace. With `--access-log` the api
//! writes one line per finished request, a successful one included, under the
//! trace id the client sees (its own `traceparent`, or the `traceresponse`
//! header of the answer when it sent none).

use std::collections::HashMap;
use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tollgate_tests::upstream::Upstream;
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// A role whose stderr (JSON logs) is kept in a file, killed on drop.
struct Role {
    child: Child,
    log: std::path::PathBuf,
}

impl Role {
    fn start(args: &[&str], redis: &RedisServer, prefix: &str, config: &std::path::Path) -> Self {
        let log = std::env::temp_dir().join(format!("tollgate-trace-{prefix}-{}.log", args[0]));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(workspace_bin("tollgate"))
            .args(["--log-format", "json"])
            .args(args)
            .arg("--config")
            .arg(config)
            .env("TOLLGATE_REDIS_URL", redis.url())
            .env("TOLLGATE_KEY_PREFIX", prefix)
            .env("TOLLGATE_ADMIN_TOKEN", crate::api::ADMIN)
            .env("RUST_LOG", "info,tollgate_worker=debug,tower_http=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start tollgate");
        Self { child, log }
    }

    /// The JSON log lines that mention `needle`.
    fn lines_with(&self, needle: &str) -> Vec<Value> {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        text.lines()
            .filter(|l| l.contains(needle))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect()
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Logs written to a file or a container's stream (not a terminal) are plain
/// text: no ANSI colour codes.
#[test]
fn text_logs_off_a_terminal_have_no_colour_codes() {
    let log = std::env::temp_dir().join(format!("tollgate-colour-{}.log", random_prefix()));
    let file = std::fs::File::create(&log).expect("log file");
    let mut child = Command::new(workspace_bin("tollgate"))
        .args(["mock-provider", "--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("start tollgate");
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut text = String::new();
    while Instant::now() < deadline && !text.contains("listening") {
        std::thread::sleep(Duration::from_millis(50));
        text = std::fs::read_to_string(&log).unwrap_or_default();
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&log);
    assert!(text.contains("listening"), "no log line: {text}");
    assert!(
        !text.contains('\u{1b}'),
        "ANSI codes in a file's log: {text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_id_from_request_to_provider() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let upstream = Upstream::start(HashMap::new(), Duration::ZERO)
        .await
        .expect("start the upstream");
    let config = std::env::temp_dir().join(format!("tollgate-trace-{prefix}.toml"));
    std::fs::write(
        &config,
        format!(
            "[plans.free]\nlimit = 1000\nwindow = \"1h\"\n\
             [providers.llm]\nrate = 10\nburst = 5\nmax_wait = \"10s\"\nurl = \"{}\"\n\
             [operations.\"llm.call\"]\ncost = 1\nprovider = \"llm\"\npath = \"/llm\"\n",
            upstream.url()
        ),
    )
    .unwrap();
    let port = tollgate_tests::redis_server::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let listen = addr.to_string();
    // No --access-log: the access log is on by default.
    let api = Role::start(&["api", "--listen", &listen], &redis, &prefix, &config);
    let worker = Role::start(&["worker"], &redis, &prefix, &config);
    let _throttler = Role::start(&["throttler"], &redis, &prefix, &config);
    tollgate_tests::http::wait_ready(addr, Instant::now() + Duration::from_secs(15)).await;
    let key = tollgate_tests::http::user_key(addr, crate::api::ADMIN, "tracer", "free").await;
    let key = format!("Bearer {key}");
    let traceparent = format!("00-{TRACE_ID}-00f067aa0ba902b7-01");
    let body = json!({"prompt": "hi"}).to_string();
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        tollgate_tests::http::send(
            addr,
            "POST",
            "/v1/ops/llm.call",
            &[
                ("Authorization", key.as_str()),
                ("Content-Type", "application/json"),
                ("traceparent", traceparent.as_str()),
            ],
            body.as_bytes(),
        ),
    )
    .await
    .expect("an answer within 60s")
    .expect("the call");
    assert_eq!(r.status, 200, "{}", r.text());
    let echoed = r.header("traceresponse").expect("a traceresponse header");
    assert!(echoed.starts_with(&format!("00-{TRACE_ID}-")), "{echoed}");

    // A call without a traceparent: its answer names the trace it started.
    let untraced = tollgate_tests::http::send(
        addr,
        "POST",
        "/v1/ops/llm.call",
        &[
            ("Authorization", key.as_str()),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    )
    .await
    .expect("the call");
    assert_eq!(untraced.status, 200, "{}", untraced.text());
    let started = untraced
        .header("traceresponse")
        .and_then(|v| v.split('-').nth(1))
        .expect("a traceresponse header")
        .to_owned();
    assert_eq!(started.len(), 32, "{started}");
    assert_ne!(started, TRACE_ID);

    // The access log: one line for each call, under the trace id the client
    // saw, with who, what, the price, the status and the latency.
    for trace_id in [TRACE_ID, started.as_str()] {
        let deadline = Instant::now() + Duration::from_secs(10);
        let line = loop {
            let lines: Vec<Value> = api
                .lines_with(trace_id)
                .into_iter()
                .filter(|l| l["target"] == "tollgate::access")
                .collect();
            if let Some(line) = lines.first() {
                assert_eq!(lines.len(), 1, "one line per request: {lines:?}");
                break line.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no access line for {trace_id} in the api's log"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let f = &line["fields"];
        assert_eq!(f["trace_id"], trace_id, "{line}");
        assert_eq!(f["user"], "tracer", "{line}");
        assert_eq!(f["operation"], "llm.call", "{line}");
        assert_eq!(f["route"], "/v1/ops/{operation}", "{line}");
        assert_eq!(f["method"], "POST", "{line}");
        assert_eq!(f["status"], 200, "{line}");
        assert_eq!(f["cost"], 1, "{line}");
        assert!(
            f["latency_ms"].as_f64().is_some_and(|ms| ms > 0.0),
            "{line}"
        );
    }
    // A request that fails authentication has its line too, without a user.
    let denied = tollgate_tests::http::send(
        addr,
        "GET",
        "/v1/usage",
        &[(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )],
        b"",
    )
    .await
    .expect("the call");
    assert_eq!(denied.status, 401);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = api.lines_with("0af7651916cd43dd8448eb211c80319c");
        if let Some(l) = lines.iter().find(|l| l["target"] == "tollgate::access") {
            assert_eq!(l["fields"]["status"], 401, "{l}");
            assert!(l["fields"].get("user").is_none(), "{l}");
            break;
        }
        assert!(Instant::now() < deadline, "no access line for the 401");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The upstream got the same trace, from the worker's own hop.
    let sent: Vec<String> = upstream
        .arrivals()
        .into_iter()
        .filter_map(|a| a.traceparent)
        .collect();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[0].starts_with(&format!("00-{TRACE_ID}-")), "{sent:?}");
    assert_ne!(
        sent[0], traceparent,
        "the worker's hop has its own parent id"
    );

    // Both processes logged about the call with its trace id, as a field.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (a, w) = (api.lines_with(TRACE_ID), worker.lines_with(TRACE_ID));
        let names_it = |lines: &[Value]| {
            lines.iter().any(|l| {
                l.to_string()
                    .contains(&format!("\"trace_id\":\"{TRACE_ID}\""))
            })
        };
        if names_it(&a) && names_it(&w) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "trace_id {TRACE_ID} not in both logs: api {a:?}, worker {w:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_file(&config);
}
