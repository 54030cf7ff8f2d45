//! The pass-through routes: `POST /v1/passthrough/{provider}/{*path}` runs
//! the operation of `provider` whose `path` is the rest of the request's path
//! ([`Config::passthrough`](tollgate_core::config::Config::passthrough)), and
//! answers as the upstream does: its JSON body as-is, no job envelope; or,
//! when the body asks to stream (`"stream": true`), the upstream's events as
//! Server-Sent Events as they arrive. So an official SDK works unchanged with
//! `base_url = <tollgate>/v1/passthrough/<provider>` and a tollgate key
//! (`Authorization: Bearer`, or Anthropic's `x-api-key`).
//!
//! The call is a job like any operation call ([`crate::ops::submit`]: the
//! same charge, throttle, fair share, idempotency and outcome rules); only the
//! answer's shape differs. Errors take the shape the SDKs parse ([`Flavor`]:
//! Anthropic's when the request carries `anthropic-version`, else OpenAI's),
//! with the status and `Retry-After` of the problem they stand for (and
//! `retry-after-ms`, exact, which both SDKs read first); a provider saturated
//! past its `max_wait` is a 503 with `Retry-After: 1`, which the SDKs retry.
//!
//! A stream's client that goes away drops its reader, which tells the worker
//! to cut the upstream call; a stream that cannot be finished (its worker
//! died, its store failed, the reader fell behind) ends with an error event,
//! never as if whole.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tollgate_core::head::Head;
use tollgate_core::job::{self, JobInfo, JobStatus};
use tollgate_core::stream::{wants_stream, Read, StreamEvent, StreamReader};
use tollgate_core::trace::TraceParent;

use crate::auth::Caller;
use crate::cost::{request_id, Priced};
use crate::extract::{json_object, JsonBody};
use crate::open_streams::StreamSlot;
use crate::ops::{finished, forget, submit, timed};
use crate::problem::ApiError;
use crate::state::ApiState;

/// The error shape an SDK parses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `{"error": {"message", "type", "code"}}`; a stream's error is a
    /// `data:` event of that object.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`; a stream's error
    /// is an `event: error`.
    Anthropic,
}

impl Flavor {
    /// Anthropic's when the request carries `anthropic-version` (every
    /// Anthropic SDK sends it), else OpenAI's.
    pub fn of(headers: &HeaderMap) -> Self {
        if headers.contains_key("anthropic-version") {
            Self::Anthropic
        } else {
            Self::OpenAi
        }
    }

    /// The error type the SDKs expect for `status`.
    fn error_type(self, status: u16) -> &'static str {
        match (self, status) {
            (_, 401) => "authentication_error",
            (_, 403) => "permission_error",
            (Self::Anthropic, 404) => "not_found_error",
            (Self::Anthropic, 413) => "request_too_large",
            (_, 429) => "rate_limit_error",
            (Self::Anthropic, 503 | 529) => "overloaded_error",
            (Self::Anthropic, 500..) => "api_error",
            (Self::OpenAi, 500..) => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error body.
    pub fn body(self, status: u16, message: &str, code: &str) -> Value {
        let kind = self.error_type(status);
        match self {
            Self::OpenAi => json!({"error": {
                "message": message, "type": kind, "param": null, "code": code,
            }}),
            Self::Anthropic => json!({
                "type": "error", "error": {"type": kind, "message": message},
            }),
        }
    }

    /// The event that ends a stream that could not be finished.
    fn stream_error(self, message: &str) -> Bytes {
        let text = match self {
            Self::OpenAi => format!(
                "data: {}\n\n",
                self.body(502, message, "stream_interrupted")
            ),
            Self::Anthropic => format!("event: error\ndata: {}\n\n", self.body(502, message, "")),
        };
        Bytes::from(text)
    }
}

/// The largest problem body read to reshape.
const PROBLEM_LIMIT: usize = 64 * 1024;

/// Route middleware of the pass-through routes: every `application/problem+json`
/// answer (from authentication, pricing, the budget or the job) leaves in the
/// SDK's shape, with its status and headers (`Retry-After`, `RateLimit*`).
pub async fn sdk_errors(req: Request, next: Next) -> Response {
    let passthrough = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .is_some_and(|p| p.as_str() == crate::PASSTHROUGH);
    if !passthrough {
        return next.run(req).await;
    }
    let flavor = Flavor::of(req.headers());
    let response = next.run(req).await;
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !is_problem {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let problem: Value = match axum::body::to_bytes(body, PROBLEM_LIMIT).await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let slug = problem["type"]
        .as_str()
        .and_then(|t| t.rsplit('/').next())
        .unwrap_or("internal")
        .to_owned();
    let message = problem["detail"]
        .as_str()
        .or_else(|| problem["title"].as_str())
        .unwrap_or("error")
        .to_owned();
    // The upstream rejected the input: its own status, and its own body when
    // the operation exposes it.
    if let Some(status) = problem["upstream_status"]
        .as_u64()
        .and_then(|s| StatusCode::from_u16(u16::try_from(s).ok()?).ok())
    {
        parts.status = status;
    }
    if slug == "throttle-timeout" {
        // The provider is saturated: a status the SDKs retry, soon.
        parts.status = StatusCode::SERVICE_UNAVAILABLE;
        parts
            .headers
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    if let Some(ms) = problem["retry_after_ms"].as_u64() {
        parts
            .headers
            .insert("retry-after-ms", HeaderValue::from(ms));
        // Past the SDKs' own cap on a wait (60 s) a retry is pointless.
        if ms > 60_000 {
            parts
                .headers
                .insert("x-should-retry", HeaderValue::from_static("false"));
        }
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = match problem["upstream_body"].as_str() {
        Some(upstream) if serde_json::from_str::<Value>(upstream).is_ok() => upstream.to_owned(),
        _ => flavor
            .body(parts.status.as_u16(), &message, &slug.replace('-', "_"))
            .to_string(),
    };
    Response::from_parts(parts, Body::from(body))
}

/// `POST /v1/passthrough/{provider}/{*path}`.
pub async fn call(
    State(state): State<ApiState>,
    priced: Priced,
    trace: Option<Extension<TraceParent>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Result<JsonBody<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let operation = priced.operation.clone();
    let trace = trace.map(|Extension(t)| t);
    let caller = caller.map(|Extension(c)| c);
    let run = run(&state, priced, trace, caller, &headers, body);
    timed(&state, &operation, run).await
}

async fn run(
    state: &ApiState,
    priced: Priced,
    trace: Option<TraceParent>,
    caller: Option<Caller>,
    headers: &HeaderMap,
    body: Result<JsonBody<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let input = json_object(body, "the request body must be a JSON object")?;
    let streamed = wants_stream(&input);
    // A whole call without an Idempotency-Key: an SDK's retry of it (after
    // its connection was cut, say) joins the job it left running.
    let retry = (!streamed && !headers.contains_key(crate::cost::IDEMPOTENCY_KEY))
        .then(|| job::retry_key(&priced.user, &priced.operation, &input));
    let joined = match &retry {
        Some(key) if is_retry(headers) => {
            match state.jobs.retry_target(&priced.operation, key).await {
                Ok(target) => target,
                Err(e) => {
                    tracing::warn!(error = %e, "looking up the job a retry joins failed; a new job");
                    None
                }
            }
        }
        _ => None,
    };
    let id = match &joined {
        Some(id) => id.clone(),
        None => request_id(&priced.user, headers)?,
    };
    // Within the user's open streams, before anything is charged; then,
    // before the job exists, its reader: no event and no end can be missed.
    let reader = match streamed {
        true => {
            let slot = state
                .open_streams
                .admit(&state.config, state.ledger.as_ref(), &priced.user)
                .await?;
            Some((slot, state.streams.open(&priced.operation, &id).await?))
        }
        false => None,
    };
    let watch = state.jobs.watch(&id);
    let (info, allowed) = submit(state, &priced, trace, caller, id.clone(), input).await?;
    let rate_limit = crate::ratelimit::allowed(&allowed);
    let answer = match reader {
        // A retry of a stream that failed: its job's error, as the first
        // attempt had it (or would have, had it begun).
        Some(_) if matches!(info.status, JobStatus::Failed { .. }) => finished(state, &info),
        Some(_) if info.status.is_final() => Err(ApiError::IdempotencyConflict(
            "this Idempotency-Key's streamed answer was given already; a stream is not replayed"
                .into(),
        )),
        Some((slot, reader)) => {
            // A job a retry joined, or one its key can ask for again, keeps
            // its record for the next.
            let keep = joined.is_some() || headers.contains_key(crate::cost::IDEMPOTENCY_KEY);
            stream(
                state,
                &priced,
                info,
                watch,
                (slot, reader),
                Flavor::of(headers),
                keep,
            )
            .await
        }
        None => {
            let (user, op) = (&priced.user, info.job.operation.clone());
            // Held until the job ends: an answer before it (a 503 the SDK
            // retries) would have the work done twice.
            let hold = hold_for(state, &op, headers);
            let wait = watch.until_final(Some(info.clone()), hold, state.jobs.poll(), || {
                state.jobs.read(user, &op, &id)
            });
            let waited = tokio::select! {
                waited = wait => Some(waited?.unwrap_or(info)),
                () = priced.client_gone() => None,
            };
            match waited {
                Some(info) if info.status.is_final() => {
                    // A job a retry joined keeps its record for the next.
                    let keep =
                        joined.is_some() || headers.contains_key(crate::cost::IDEMPOTENCY_KEY);
                    whole(state, &info, !keep)
                }
                // Left unanswered while its job runs: a retry finds the job.
                unanswered => {
                    if let Some(key) = &retry {
                        let ttl = hold + RETRY_TARGET_MARGIN;
                        if let Err(e) = state.jobs.remember_retry_target(&op, key, &id, ttl).await {
                            tracing::warn!(error = %e, "remembering the job a retry would join failed");
                        }
                    }
                    match unanswered {
                        Some(info) => whole(state, &info, false),
                        None => Err(ApiError::RequestTimeout(hold)),
                    }
                }
            }
        }
    };
    let mut response = answer.unwrap_or_else(IntoResponse::into_response);
    rate_limit.apply(response.headers_mut());
    Ok(response)
}

/// Whether a request says it is a client's retry: the OpenAI and Anthropic
/// SDKs number their attempts (`x-stainless-retry-count`, 0 for the first).
fn is_retry(headers: &HeaderMap) -> bool {
    headers
        .get("x-stainless-retry-count")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .is_some_and(|n| n > 0)
}

/// How long past its hold a call left unanswered can be joined by a retry.
const RETRY_TARGET_MARGIN: Duration = Duration::from_secs(60);
/// What a whole call waits past its operation's deadline and its upstream's
/// timeout: the job's failure to be recorded.
const HOLD_MARGIN: Duration = Duration::from_secs(5);

/// How long a whole call waits for its job: until the job must have ended
/// (its deadline, plus a call sent just before it), but answered a second
/// before the client says it stops reading (`x-stainless-read-timeout`,
/// seconds), so that its retry is one that joins.
fn hold_for(state: &ApiState, operation: &str, headers: &HeaderMap) -> Duration {
    let config = &state.config;
    let op = config.operation(operation);
    let deadline = op.map_or(tollgate_core::config::DEFAULT_JOB_DEADLINE, |o| o.deadline);
    let upstream = op
        .and_then(|o| config.upstreams(&o.provider).first().copied())
        .map_or(Duration::ZERO, |u| u.timeout);
    let hold = deadline + upstream + HOLD_MARGIN;
    let client = headers
        .get("x-stainless-read-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(|s| Duration::from_secs_f64(s.min(86_400.0)));
    match client {
        Some(c) => hold.min(
            c.saturating_sub(Duration::from_secs(1))
                .max(Duration::from_secs(1)),
        ),
        None => hold,
    }
}

/// A whole answer: the upstream's JSON as-is, or the job's error; a final
/// record nobody can ask for again goes when `forget_it`.
fn whole(state: &ApiState, info: &JobInfo, forget_it: bool) -> Result<Response, ApiError> {
    if info.status.is_final() && forget_it {
        forget(state, info);
    }
    match &info.status {
        JobStatus::Succeeded { result, head } => {
            state.metrics.job_outcome(&info.job.operation, "succeeded");
            let mut response = axum::Json(result.clone()).into_response();
            if let Some(head) = head {
                apply_head(&mut response, head);
            }
            Ok(response)
        }
        JobStatus::Failed { .. } => finished(state, info),
        // Still running at the sync timeout: the SDK's timeout error, and a
        // retry with the same Idempotency-Key finds the same job.
        JobStatus::Queued | JobStatus::Running => {
            Err(ApiError::RequestTimeout(state.settings.sync_timeout))
        }
    }
}

/// The upstream answer's status (a 2xx) and safe headers on `response`.
fn apply_head(response: &mut Response, head: &Head) {
    if let Ok(status) = StatusCode::from_u16(head.status) {
        if status.is_success() {
            *response.status_mut() = status;
        }
    }
    for (name, value) in &head.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
}

/// How long a stream's reader waits for an event before it looks again.
const READ_WAIT: Duration = Duration::from_millis(500);
/// After the job's record is final, how long its stream's last events may
/// still take to arrive.
const END_GRACE: Duration = Duration::from_secs(2);
/// Events buffered between the reader and the client's connection.
const CLIENT_BUFFER: usize = 16;

/// Waits for the job's final record, at most its deadline and a margin; sends
/// it (or the last record seen) on `tx`.
fn watch_final(
    state: &ApiState,
    priced: &Priced,
    info: JobInfo,
    watch: tollgate_core::job::Watch,
) -> oneshot::Receiver<Option<JobInfo>> {
    let (tx, rx) = oneshot::channel();
    let jobs = std::sync::Arc::clone(&state.jobs);
    let user = priced.user.clone();
    let limit = state
        .config
        .operation(&info.job.operation)
        .map_or(Duration::from_secs(300), |o| o.deadline)
        + Duration::from_secs(60);
    tokio::spawn(async move {
        let (op, id) = (info.job.operation.clone(), info.job.id.clone());
        let last = watch
            .until_final(Some(info), limit, jobs.poll(), || {
                jobs.read(&user, &op, &id)
            })
            .await
            .ok()
            .flatten();
        let _ = tx.send(last);
    });
    rx
}

/// A streamed answer: waits for its first event (an error before any is the
/// job's error, as a whole answer's), then answers `text/event-stream` and
/// pumps the rest to the client. A job final without a single event is
/// answered with its record, which goes unless `keep` (a retry with the same
/// Idempotency-Key must find it).
async fn stream(
    state: &ApiState,
    priced: &Priced,
    info: JobInfo,
    watch: tollgate_core::job::Watch,
    (slot, mut reader): (StreamSlot, Box<dyn StreamReader>),
    flavor: Flavor,
    keep: bool,
) -> Result<Response, ApiError> {
    let mut final_rx = watch_final(state, priced, info.clone(), watch);
    let mut final_info: Option<Option<JobInfo>> = None;
    let mut grace_end: Option<tokio::time::Instant> = None;
    let mut head: Option<Head> = None;
    let first = loop {
        let wait = grace_end.map_or(READ_WAIT, |end| {
            end.saturating_duration_since(tokio::time::Instant::now())
        });
        tokio::select! {
            read = reader.next(wait) => match read? {
                Read::Event(StreamEvent::Head(h)) => head = Some(h),
                Read::Event(event @ StreamEvent::Data(_)) => break event,
                Read::Event(StreamEvent::End) => break StreamEvent::End,
                // Failed before any event: the job's own error, once recorded.
                Read::Event(StreamEvent::Error(message)) => {
                    let last = match final_info.take() {
                        Some(last) => last,
                        None => tokio::time::timeout(END_GRACE, &mut final_rx).await.ok().and_then(Result::ok).flatten(),
                    };
                    // The watch may have ended on a store fault before the
                    // worker recorded the failure (it records it right after
                    // its error event): read the record itself.
                    let last = match last {
                        Some(info) if info.status.is_final() => Some(info),
                        _ => final_record(state, priced, &info).await,
                    };
                    return match last {
                        Some(info) if info.status.is_final() => finished(state, &info),
                        // Not readable yet: a fault of the store, not a bug.
                        _ => {
                            tracing::warn!(error = %message, "a stream failed before its first event and its record is not readable yet");
                            Err(ApiError::RequestTimeout(state.settings.sync_timeout))
                        }
                    };
                }
                Read::Idle if grace_end.is_some_and(|e| tokio::time::Instant::now() >= e) => {
                    // Final without a single event: the record answers.
                    return match final_info.flatten() {
                        Some(info) if info.status.is_final() => whole(state, &info, !keep),
                        _ => Err(ApiError::RequestTimeout(state.settings.sync_timeout)),
                    };
                }
                Read::Idle => {}
            },
            last = &mut final_rx, if final_info.is_none() => {
                final_info = Some(last.ok().flatten());
                grace_end = Some(tokio::time::Instant::now() + END_GRACE);
            }
            () = priced.client_gone() => return Err(ApiError::RequestTimeout(state.settings.sync_timeout)),
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(CLIENT_BUFFER);
    tokio::spawn(async move {
        pump(reader, first, tx, final_rx, final_info, flavor).await;
        drop(slot); // The stream is over: its place in the user's count frees.
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    let mut response = (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response();
    if let Some(head) = &head {
        apply_head(&mut response, head);
    }
    Ok(response)
}

/// The job's final record, read again until [`END_GRACE`] has passed (a
/// read that fails is tried again): `None` when it is not final by then.
async fn final_record(state: &ApiState, priced: &Priced, info: &JobInfo) -> Option<JobInfo> {
    let end = tokio::time::Instant::now() + END_GRACE;
    loop {
        let read = state
            .jobs
            .read(&priced.user, &info.job.operation, &info.job.id)
            .await;
        if let Ok(Some(last)) = read {
            if last.status.is_final() {
                return Some(last);
            }
        }
        if tokio::time::Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn event_bytes(text: &str) -> Bytes {
    Bytes::from(format!("{text}\n\n"))
}

/// Passes a stream's events to the client until its end, an error, or the
/// client's going away (the reader is dropped: the worker cuts the call).
async fn pump(
    mut reader: Box<dyn StreamReader>,
    first: StreamEvent,
    tx: mpsc::Sender<Bytes>,
    mut final_rx: oneshot::Receiver<Option<JobInfo>>,
    final_seen: Option<Option<JobInfo>>,
    flavor: Flavor,
) {
    let mut event = Some(first);
    let mut grace_end = final_seen.map(|_| tokio::time::Instant::now() + END_GRACE);
    loop {
        let next = match event.take() {
            Some(e) => Ok(Read::Event(e)),
            None => {
                let wait = grace_end.map_or(READ_WAIT, |end| {
                    end.saturating_duration_since(tokio::time::Instant::now())
                });
                tokio::select! {
                    r = reader.next(wait) => r,
                    last = &mut final_rx, if grace_end.is_none() => {
                        let _ = last;
                        grace_end = Some(tokio::time::Instant::now() + END_GRACE);
                        continue;
                    }
                    () = tx.closed() => return,
                }
            }
        };
        let bytes = match next {
            Ok(Read::Event(StreamEvent::Data(text))) => event_bytes(&text),
            // A head comes first, before the answer began: none later.
            Ok(Read::Event(StreamEvent::Head(_))) => continue,
            Ok(Read::Event(StreamEvent::End)) => return,
            Ok(Read::Event(StreamEvent::Error(message))) => {
                let _ = tx.send(flavor.stream_error(&message)).await;
                return;
            }
            Ok(Read::Idle) if grace_end.is_some_and(|e| tokio::time::Instant::now() >= e) => {
                let _ = tx
                    .send(flavor.stream_error(
                        "the job ended without finishing its stream; the answer is incomplete",
                    ))
                    .await;
                return;
            }
            Ok(Read::Idle) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading a job's stream failed");
                let _ = tx
                    .send(flavor.stream_error(
                        "the stream's store failed mid-stream; the answer is incomplete",
                    ))
                    .await;
                return;
            }
        };
        if tx.send(bytes).await.is_err() {
            return; // The client went away.
        }
    }
}
