//! A recording upstream: an HTTP provider served from the test process that
//! notes the arrival time, path and job of every call and answers 429 when its
//! own token bucket (per path) would be overdrawn, so that a test can hold the
//! throttle to what the upstream actually saw rather than to what it granted.
//!
//! A call can ask for a misbehaving answer in its own input (see [`Behaviour`]):
//! a slow answer, a body that is not JSON, a refusal, a failure, a reply cut
//! halfway; every one is recorded as an arrival all the same.
//!
//! A call whose body has `"stream": true` is answered as OpenAI's chat
//! completions API streams (see [`Streamed`]): paced
//! `chat.completion.chunk` events, the usage chunk only when the request
//! asks for it (`stream_options.include_usage: true`), then `data: [DONE]`;
//! its arrival records the usage the stream reports and whether it was sent
//! whole or cut by its caller going away.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::throttle::now_us;

/// An upstream's own limit on one path: at most `burst + rate * t` calls in
/// any interval of `t` seconds.
#[derive(Debug, Clone, Copy)]
pub struct Limit {
    pub rate: f64,
    pub burst: f64,
}

/// One call as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// The path without its leading `/` (one per provider in the tests' configs).
    pub path: String,
    pub at_us: u64,
    /// The `Idempotency-Key` header: the job id the worker sends.
    pub job: Option<String>,
    /// The answer: 200, or 429 when the limit would have been passed, or
    /// the status the call's [`Behaviour`] asked for (0: the reply was cut).
    pub status: u16,
    /// The W3C `traceparent` header the worker sent.
    pub traceparent: Option<String>,
    /// Every header of the call.
    pub headers: HeaderMap,
    pub method: String,
    /// The query string, if any.
    pub query: Option<String>,
    /// The body as received.
    pub body: Bytes,
    /// Calls in flight at the upstream as this one arrived, itself included
    /// (a call is in flight until its answer is written, or its connection
    /// dropped).
    pub in_flight: usize,
    /// When the call ended at the upstream (µs since the epoch): its answer
    /// handed to the connection, or the connection dropped; `None` while it
    /// runs. (A streamed answer ends with its last event, or its cut.)
    pub end_us: Option<u64>,
    /// For a streamed answer: what was sent of it.
    pub stream: Option<Streamed>,
}

/// A streamed answer as the upstream sent it. The call's input sets it in
/// `"upstream"`: `"usage": n` the tokens it reports (`total_tokens`, default
/// 10), `"chunks": k` its content chunks (default 5), `"every_ms": ms` the
/// pause before each event after the first (default 30). The content of
/// chunk `i` is `"t{i} "` ([`streamed_text`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Streamed {
    /// The usage the stream reports: the work the upstream did for it (also
    /// when it is cut before its usage chunk, or was not asked for it).
    pub usage: u64,
    /// The request asked for the usage chunk (`stream_options.include_usage`).
    pub asked_usage: bool,
    /// Events handed to the connection so far.
    pub events_sent: u32,
    /// The usage chunk was handed to the connection.
    pub usage_sent: bool,
    /// Every event was handed to the connection, `data: [DONE]` last.
    pub whole: bool,
    /// The answer ended: sent whole, or cut (its caller went away).
    pub ended: bool,
}

impl Streamed {
    /// Ended without its `[DONE]`: the caller went away mid-stream.
    pub fn cut(&self) -> bool {
        self.ended && !self.whole
    }
}

/// The text a whole streamed answer of `chunks` chunks carries.
pub fn streamed_text(chunks: u32) -> String {
    (0..chunks).map(|i| format!("t{i} ")).collect()
}

#[derive(Debug)]
struct Shared {
    limits: HashMap<String, Limit>,
    latency: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    buckets: HashMap<String, (f64, Instant)>,
    arrivals: Vec<Arrival>,
    in_flight: usize,
    /// [`Upstream::refuse_at`]: from when, and the `Retry-After` to send.
    refusal: Option<(Instant, String)>,
    /// The calls refused so: path and arrival time (µs).
    refused: Vec<(String, u64)>,
}

/// The upstream; it stops serving when dropped.
#[derive(Debug)]
pub struct Upstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    /// [`start`](Self::start)s one with no limits (a call is never refused);
    /// panics when it cannot serve.
    pub async fn unlimited(latency: Duration) -> Self {
        Self::start(HashMap::new(), latency)
            .await
            .unwrap_or_else(|e| panic!("start the upstream: {e}"))
    }

    /// Serves on `127.0.0.1:<free port>`; a path without a limit is never refused.
    /// Each call takes `latency` before it is answered, so that a fault can land
    /// while a call is in flight.
    pub async fn start(limits: HashMap<String, Limit>, latency: Duration) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            limits,
            latency,
            inner: Mutex::default(),
        });
        let app = Router::new()
            .route("/{*path}", any(call))
            .with_state(Arc::clone(&shared));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, shared, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The first call that arrives at `at` or later (whatever its path) is
    /// answered 429 with `Retry-After: <retry_after>` (and recorded so);
    /// once.
    pub fn refuse_at(&self, at: Instant, retry_after: &str) {
        if let Ok(mut inner) = self.shared.inner.lock() {
            inner.refusal = Some((at, retry_after.to_owned()));
        }
    }

    /// The calls [`Upstream::refuse_at`] refused: path and arrival time (µs
    /// since the epoch), in order.
    pub fn refusals(&self) -> Vec<(String, u64)> {
        self.shared
            .inner
            .lock()
            .map(|i| i.refused.clone())
            .unwrap_or_default()
    }

    /// Every call so far, in arrival order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.shared
            .inner
            .lock()
            .map(|i| i.arrivals.clone())
            .unwrap_or_default()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How the upstream answers a call whose input holds `"upstream": {"answer":
/// ..., "after_ms": n}`: after `latency` plus `after_ms`, with `answer`:
/// `"ok"` (the default: 200 and a JSON echo), `"text"` (200, plain text),
/// `"empty"` (200, no body), `"204"`, `"1e400"` (200, a JSON number no
/// parser holds), `"400"`, `"401"`, `"404"`, `"413"`, `"415"`, `"422"` (each
/// with a JSON body naming its status), `"401-echo"` (401 whose body echoes the
/// credentials the call carried, `authorization` and `x-api-key`, as some APIs
/// do), `"429"`, `"500"`, `"503"`, or `"cut"` (200 whose body stops halfway:
/// the connection is dropped mid-reply).
/// `"usage": n` makes an `"ok"` answer report `{"usage": {"total_tokens":
/// n}}`, as an LLM API reports the tokens a call used; and, as an LLM API
/// honours it, a whole-number `max_tokens` in the body bounds the output
/// ([`honoured`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behaviour {
    pub answer: String,
    pub after: Duration,
}

impl Behaviour {
    fn of(input: &Value) -> Self {
        let b = &input["upstream"];
        Self {
            answer: b["answer"].as_str().unwrap_or("ok").to_owned(),
            after: Duration::from_millis(b["after_ms"].as_u64().unwrap_or(0)),
        }
    }

    /// The status the answer carries (0: none, the reply is cut).
    fn status(&self) -> u16 {
        match self.answer.as_str() {
            "204" => 204,
            "400" => 400,
            "401" | "401-echo" => 401,
            "404" => 404,
            "413" => 413,
            "415" => 415,
            "422" => 422,
            "429" => 429,
            "500" => 500,
            "503" => 503,
            "cut" => 0,
            _ => 200,
        }
    }

    fn respond(&self, input: Value, headers: &HeaderMap) -> Response {
        let json = [("content-type", "application/json")];
        match self.answer.as_str() {
            "401-echo" => {
                let sent = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned()
                };
                let error = format!(
                    "Incorrect API key provided: {} (x-api-key: {})",
                    sent("authorization"),
                    sent("x-api-key")
                );
                (StatusCode::UNAUTHORIZED, Json(json!({"error": error}))).into_response()
            }
            "text" => (StatusCode::OK, "plain words, not JSON").into_response(),
            "empty" => (StatusCode::OK, json, "").into_response(),
            "204" => StatusCode::NO_CONTENT.into_response(),
            "1e400" => (StatusCode::OK, json, "1e400").into_response(),
            "400" => (StatusCode::BAD_REQUEST, Json(json!({"error": "bad input"}))).into_response(),
            "401" | "404" | "413" | "415" | "422" => {
                let status = StatusCode::from_u16(self.status()).unwrap_or(StatusCode::BAD_REQUEST);
                let error = format!("upstream says {} to this input", status.as_u16());
                (status, Json(json!({"error": error}))).into_response()
            }
            "429" => (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "0")],
                Json(json!({"error": "slow down"})),
            )
                .into_response(),
            "500" => (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": "boom"})),
            )
                .into_response(),
            "503" => (
                StatusCode::SERVICE_UNAVAILABLE,
                [("retry-after", "0")],
                Json(json!({"error": "overloaded"})),
            )
                .into_response(),
            "cut" => {
                // A promised length, half of it sent, then an error: the
                // connection is dropped in the middle of the reply.
                let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
                    Ok(Bytes::from_static(b"{\"ok\": tr")),
                    Err(std::io::Error::other("cut mid-reply")),
                ];
                let mut r = axum::body::Body::from_stream(futures_util::stream::iter(chunks))
                    .into_response();
                r.headers_mut().insert(
                    axum::http::header::CONTENT_LENGTH,
                    axum::http::HeaderValue::from_static("200"),
                );
                r
            }
            _ => match input["upstream"]["usage"].as_u64() {
                Some(n) => {
                    let n = honoured(n, &input);
                    Json(json!({"ok": true, "echo": input, "usage": {"total_tokens": n}}))
                        .into_response()
                }
                None => Json(json!({"ok": true, "echo": input})).into_response(),
            },
        }
    }
}

/// The tokens a call that would use `asked` reports when its body sets a
/// whole-number `max_tokens`: its prompt (the bytes of the body's `prompt`
/// text, at most `asked`: a token is at least a byte) and at most
/// `max_tokens` of the rest, as an LLM API never writes more output than
/// `max_tokens`.
pub fn honoured(asked: u64, input: &Value) -> u64 {
    let Some(max) = input["max_tokens"].as_u64() else {
        return asked;
    };
    let prompt = input["prompt"]
        .as_str()
        .map_or(0, |p| p.len() as u64)
        .min(asked);
    prompt + (asked - prompt).min(max)
}

/// One call in flight at the upstream, from its arrival until the handler
/// ends or is dropped; its end is written into its arrival (`end_us`).
struct InFlight(Arc<Shared>, Option<usize>);

impl InFlight {
    fn enter(shared: &Arc<Shared>) -> Self {
        if let Ok(mut inner) = shared.inner.lock() {
            inner.in_flight += 1;
        }
        Self(Arc::clone(shared), None)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut inner) = self.0.inner.lock() {
            inner.in_flight = inner.in_flight.saturating_sub(1);
            if let Some(a) = self.1.and_then(|i| inner.arrivals.get_mut(i)) {
                a.end_us = Some(now_us());
                if let Some(s) = &mut a.stream {
                    s.ended = true;
                }
            }
        }
    }
}

impl InFlight {
    /// Notes on this call's arrival that `event` was handed to the connection.
    fn sent(&self, event: &SseEvent) {
        if let Ok(mut inner) = self.0.inner.lock() {
            if let Some(s) = self
                .1
                .and_then(|i| inner.arrivals.get_mut(i))
                .and_then(|a| a.stream.as_mut())
            {
                s.events_sent += 1;
                match event {
                    SseEvent::Usage(_) => s.usage_sent = true,
                    SseEvent::Done => s.whole = true,
                    SseEvent::Chunk(_) => {}
                }
            }
        }
    }
}

/// One event of a streamed answer.
#[derive(Debug, Clone)]
enum SseEvent {
    Chunk(Value),
    Usage(Value),
    Done,
}

impl SseEvent {
    fn bytes(&self) -> Bytes {
        match self {
            Self::Chunk(v) | Self::Usage(v) => Bytes::from(format!("data: {v}\n\n")),
            Self::Done => Bytes::from_static(b"data: [DONE]\n\n"),
        }
    }
}

/// Whether a call asks for a streamed answer.
fn wants_stream(input: &Value) -> bool {
    input["stream"] == Value::Bool(true)
}

/// What a streamed answer to `input` will send, as [`Streamed`] says.
fn stream_plan(input: &Value, job: Option<&str>) -> (Streamed, Vec<SseEvent>, Duration) {
    let b = &input["upstream"];
    let usage = honoured(b["usage"].as_u64().unwrap_or(10), input);
    let chunks = b["chunks"].as_u64().unwrap_or(5);
    let every = Duration::from_millis(b["every_ms"].as_u64().unwrap_or(30));
    let asked = input.pointer("/stream_options/include_usage") == Some(&Value::Bool(true));
    let id = format!("chatcmpl-{}", job.unwrap_or("none"));
    let model = input["model"].as_str().unwrap_or("m");
    let chunk = |delta: Value, finish: Value| {
        let mut c = json!({"id": id, "object": "chat.completion.chunk", "created": 0,
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        // Asked for usage, OpenAI gives every other chunk `"usage": null`.
        if asked {
            c["usage"] = Value::Null;
        }
        SseEvent::Chunk(c)
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    for i in 0..chunks {
        events.push(chunk(json!({"content": format!("t{i} ")}), Value::Null));
    }
    events.push(chunk(json!({}), json!("stop")));
    if asked {
        let prompt = usage.min(usage / 3 + 1);
        events.push(SseEvent::Usage(
            json!({"id": id, "object": "chat.completion.chunk",
            "created": 0, "model": model, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": usage - prompt,
                      "total_tokens": usage}}),
        ));
    }
    events.push(SseEvent::Done);
    let streamed = Streamed {
        usage,
        asked_usage: asked,
        ..Streamed::default()
    };
    (streamed, events, every)
}

/// The streamed answer: `events`, the first at once, then one every
/// `every`; each noted on the call's arrival as it is handed to the
/// connection. The call stays in flight until the last is sent or the
/// connection drops (the body is dropped: `guard` notes the end).
fn stream_response(guard: InFlight, events: Vec<SseEvent>, every: Duration) -> Response {
    let body = futures_util::stream::unfold(
        (guard, events.into_iter(), true),
        move |(guard, mut events, first)| async move {
            let event = events.next()?;
            if !first {
                tokio::time::sleep(every).await;
            }
            guard.sent(&event);
            Some((
                Ok::<_, std::convert::Infallible>(event.bytes()),
                (guard, events, false),
            ))
        },
    );
    (
        StatusCode::OK,
        [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
        ],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

async fn call(
    State(shared): State<Arc<Shared>>,
    Path(path): Path<String>,
    method: axum::http::Method,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (job, traceparent) = (header("idempotency-key"), header("traceparent"));
    let input: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut in_flight_guard = InFlight::enter(&shared);
    let behaviour = Behaviour::of(&input);
    let streamed = (wants_stream(&input) && behaviour.answer == "ok")
        .then(|| stream_plan(&input, job.as_deref()));
    let (allowed, refused) = {
        let Ok(mut inner) = shared.inner.lock() else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        let refused = match inner.refusal.take() {
            Some((at, retry_after)) if Instant::now() >= at => Some(retry_after),
            other => {
                inner.refusal = other;
                None
            }
        };
        let allowed = match shared.limits.get(&path) {
            None => true,
            Some(limit) => {
                let now = Instant::now();
                let (tokens, at) = inner
                    .buckets
                    .entry(path.clone())
                    .or_insert((limit.burst, now));
                let refilled =
                    (*tokens + now.duration_since(*at).as_secs_f64() * limit.rate).min(limit.burst);
                *at = now;
                *tokens = if refilled >= 1.0 {
                    refilled - 1.0
                } else {
                    refilled
                };
                refilled >= 1.0
            }
        };
        let in_flight = inner.in_flight;
        let at_us = now_us();
        in_flight_guard.1 = Some(inner.arrivals.len());
        if refused.is_some() {
            inner.refused.push((path.clone(), at_us));
        }
        inner.arrivals.push(Arrival {
            path,
            at_us,
            job,
            status: if allowed && refused.is_none() {
                behaviour.status()
            } else {
                429
            },
            traceparent,
            headers: headers.clone(),
            method: method.to_string(),
            query: query.clone(),
            body: body.clone(),
            in_flight,
            end_us: None,
            stream: streamed
                .as_ref()
                .filter(|_| allowed && refused.is_none())
                .map(|(s, _, _)| s.clone()),
        });
        (allowed, refused)
    };
    if let Some(retry_after) = refused {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", retry_after)],
            Json(json!({"error": "refused at the test's moment"})),
        )
            .into_response();
    }
    if !allowed {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1")],
            Json(json!({"error": "rate limited"})),
        )
            .into_response();
    }
    tokio::time::sleep(shared.latency + behaviour.after).await;
    match streamed {
        Some((_, events, every)) => stream_response(in_flight_guard, events, every),
        None => behaviour.respond(input, &headers),
    }
}
