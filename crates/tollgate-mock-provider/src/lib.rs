//! A mock upstream provider that behaves like a real one: it enforces its own
//! token bucket (429 with `Retry-After` beyond it), fails a fraction of calls
//! with 500, waits a fixed latency, answers JSON, and counts everything at
//! `GET /stats`. The demo and the tests use it to show that the throttle keeps
//! its `rate_limited` counter at 0.
//!
//! It also speaks the real protocols of the OpenAI and Anthropic APIs
//! ([`protocols`]: chat completions, embeddings, messages; streamed or not,
//! with usage, at a configurable token pace), so that the official SDKs, the
//! demo and the tests run offline.
//!
//! A library (`run(listener, options, shutdown)`) so that `tollgate all` can
//! start it in-process; `tollgate mock-provider` runs it on its own.

pub mod protocols;
pub mod text;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::{json, Value};

/// How the mock behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct MockOptions {
    /// Requests per second the mock accepts (its bucket's refill), > 0.
    pub rate: f64,
    /// Its bucket's capacity, >= 1.
    pub burst: u64,
    /// Fraction of accepted requests answered 500, in [0, 1]. Deterministic:
    /// exactly `floor(n * fail_rate)` of the first `n` accepted requests fail.
    pub fail_rate: f64,
    /// Time spent on each accepted request before answering.
    pub latency: Duration,
    /// Between two events of a streamed answer (one token each).
    pub token_interval: Duration,
    /// Each streamed event opens with an SSE comment `: sent_us=<µs since
    /// the epoch>` taken as it is written (every SSE client skips comments):
    /// what `tollgate-bench stream` measures each event's delay from.
    pub stamp_events: bool,
}

impl Default for MockOptions {
    fn default() -> Self {
        Self {
            rate: 50.0,
            burst: 10,
            fail_rate: 0.0,
            latency: Duration::ZERO,
            token_interval: Duration::ZERO,
            stamp_events: false,
        }
    }
}

/// Why options were rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OptionsError(pub String);

impl MockOptions {
    pub fn validate(&self) -> Result<(), OptionsError> {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(OptionsError(format!(
                "--rate must be > 0, got {}",
                self.rate
            )));
        }
        if self.burst < 1 {
            return Err(OptionsError("--burst must be >= 1".into()));
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(OptionsError(format!(
                "--fail-rate must be between 0 and 1, got {}",
                self.fail_rate
            )));
        }
        Ok(())
    }
}

/// The counters served at `GET /stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Stats {
    pub requests: u64,
    pub ok: u64,
    pub rate_limited: u64,
    pub failed: u64,
    /// Streamed answers whose caller went away before their last event.
    #[serde(default)]
    pub streams_cut: u64,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug)]
struct Mock {
    options: MockOptions,
    bucket: Mutex<Bucket>,
    requests: AtomicU64,
    ok: AtomicU64,
    rate_limited: AtomicU64,
    failed: AtomicU64,
    accepted: AtomicU64,
    streams_cut: Arc<AtomicU64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Mock {
    /// Takes a token, or says how long until one is due.
    fn take(&self) -> Result<(), Duration> {
        let mut b = lock(&self.bucket);
        let now = Instant::now();
        let burst = self.options.burst as f64;
        b.tokens =
            (b.tokens + now.duration_since(b.at).as_secs_f64() * self.options.rate).min(burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            let secs = (1.0 - b.tokens) / self.options.rate;
            Err(Duration::try_from_secs_f64(secs).unwrap_or(Duration::from_secs(1)))
        }
    }

    fn stats(&self) -> Stats {
        Stats {
            requests: self.requests.load(Ordering::SeqCst),
            ok: self.ok.load(Ordering::SeqCst),
            rate_limited: self.rate_limited.load(Ordering::SeqCst),
            failed: self.failed.load(Ordering::SeqCst),
            streams_cut: self.streams_cut.load(Ordering::SeqCst),
        }
    }
}

/// The mock's routes: `POST /` and `POST /{*path}` (the call: a path ending
/// in `chat/completions`, `embeddings` or `messages` speaks that protocol,
/// any other echoes its input), `GET /stats`, `GET /healthz`.
pub fn router(options: MockOptions) -> Router {
    let mock = Arc::new(Mock {
        bucket: Mutex::new(Bucket {
            tokens: options.burst as f64,
            at: Instant::now(),
        }),
        options,
        requests: AtomicU64::new(0),
        ok: AtomicU64::new(0),
        rate_limited: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        accepted: AtomicU64::new(0),
        streams_cut: Arc::new(AtomicU64::new(0)),
    });
    Router::new()
        .route("/", post(call_root))
        .route("/{*path}", post(call))
        .route("/stats", get(stats))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(mock)
}

async fn stats(State(mock): State<Arc<Mock>>) -> Json<Stats> {
    Json(mock.stats())
}

async fn call_root(state: State<Arc<Mock>>, body: Bytes) -> Response {
    handle(state, String::new(), body).await
}

async fn call(state: State<Arc<Mock>>, Path(path): Path<String>, body: Bytes) -> Response {
    handle(state, path, body).await
}

async fn handle(State(mock): State<Arc<Mock>>, path: String, body: Bytes) -> Response {
    mock.requests.fetch_add(1, Ordering::SeqCst);
    if let Err(wait) = mock.take() {
        mock.rate_limited.fetch_add(1, Ordering::SeqCst);
        let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, secs.to_string())],
            Json(json!({ "error": "rate limited" })),
        )
            .into_response();
    }
    if !mock.options.latency.is_zero() {
        tokio::time::sleep(mock.options.latency).await;
    }
    let n = mock.accepted.fetch_add(1, Ordering::SeqCst) + 1;
    let f = mock.options.fail_rate;
    let fails = ((n as f64) * f).floor() > (((n - 1) as f64) * f).floor();
    if fails {
        mock.failed.fetch_add(1, Ordering::SeqCst);
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({ "error": "mock failure" })),
        )
            .into_response();
    }
    let input: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    mock.ok.fetch_add(1, Ordering::SeqCst);
    let mut response = match protocols::Protocol::of(&path) {
        Some(protocol) => protocol.answer(
            &input,
            n,
            protocols::Pace {
                interval: mock.options.token_interval,
                stamp: mock.options.stamp_events,
            },
            Arc::clone(&mock.streams_cut),
        ),
        None => {
            // The usage a metered upstream reports (`settle` rules read it): the
            // input's `mock_total_tokens` when it is a number, else 800; as an
            // LLM API, never more output than a whole-number `max_tokens`
            // (the prompt, the bytes of the input's `prompt` text, and at
            // most `max_tokens` more).
            let asked = input["mock_total_tokens"].as_u64().unwrap_or(800);
            let tokens = match input["max_tokens"].as_u64() {
                Some(max) => {
                    let prompt = input["prompt"]
                        .as_str()
                        .map_or(0, |p| p.len() as u64)
                        .min(asked);
                    prompt + (asked - prompt).min(max)
                }
                None => asked,
            };
            Json(json!({
                "ok": true, "path": format!("/{path}"), "echo": input,
                "usage": { "total_tokens": tokens },
            }))
            .into_response()
        }
    };
    provider_headers(&mut response, n, &input);
    response
}

/// What a real provider adds to an answer: request ids (OpenAI's
/// `x-request-id`, Anthropic's `request-id`), timing, and headers that are
/// its own business (its account, its rate limits); and the status the input
/// asks for (`mock_status`, a 2xx), for tests of what tollgate passes on.
fn provider_headers(response: &mut Response, n: u64, input: &Value) {
    if response.status() != StatusCode::OK {
        return;
    }
    if let Some(status) = input["mock_status"]
        .as_u64()
        .and_then(|s| StatusCode::from_u16(u16::try_from(s).ok()?).ok())
        .filter(StatusCode::is_success)
    {
        *response.status_mut() = status;
    }
    let h = response.headers_mut();
    let id = header::HeaderValue::from_str(&format!("req_mock_{n}"));
    if let Ok(id) = id {
        h.insert("x-request-id", id.clone());
        h.insert("request-id", id);
    }
    h.insert(
        "openai-processing-ms",
        header::HeaderValue::from_static("1"),
    );
    h.insert(
        "openai-organization",
        header::HeaderValue::from_static("mock-org"),
    );
    h.insert(
        "x-ratelimit-remaining-requests",
        header::HeaderValue::from_static("99"),
    );
}

/// Serves the mock on `listener` until `shutdown` resolves.
pub async fn run(
    listener: tokio::net::TcpListener,
    options: MockOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    options
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.0))?;
    tracing::info!(addr = ?listener.local_addr().ok(), ?options, "mock provider listening");
    // No Nagle: a stream's events leave as written, as a real provider's do
    // (else each small event waits for the previous one's ACK, 40 ms).
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(options))
        .with_graceful_shutdown(shutdown)
        .await
}
