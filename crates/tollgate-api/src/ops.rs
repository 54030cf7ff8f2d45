//! Operation calls and job status: `POST /v1/ops/{operation}` (and the named
//! operation routes), `GET /v1/jobs/{id}`.
//!
//! The handler holds only the business logic: the [`Cost`](crate::cost::Cost)
//! layer states the price; the handler reads the body, then submits the job
//! ([`JobQueue::submit`](tollgate_core::job::JobQueue::submit): the one place a job
//! is charged, bound to the request id, the operation and the body), then
//! answers at once (async) or waits for the job up to the sync timeout. It
//! never releases: the job owns its charge.
//!
//! Idempotency (draft-ietf-httpapi-idempotency-key-header): the same key with
//! the same operation and body is the same job, charged once (answered with
//! that job, waiting for it when it is still in flight); with another
//! operation or body, a 422; once the first job's charge has left the window
//! (or was released after a failure), a new run, charged and run again.

use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header::LOCATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Serialize;
use serde_json::Value;
use tollgate_core::{
    id::RequestId,
    job::{FailureCause, JobError, JobInfo, JobRequest, JobStatus, Rejection, SubmitOutcome},
    ledger::LedgerError,
};

use crate::auth::Caller;
use crate::cost::{request_id, Priced};
use crate::extract::{json_object, Flags, JsonBody, PathParam};
use crate::problem::ApiError;
use crate::state::ApiState;
use tollgate_core::clock::{rfc3339, Clock, SystemClock};
use tollgate_core::money::{Amount, Currency};
use tollgate_core::throttle::Position;
use tollgate_core::trace::TraceParent;

/// The body of an operation's answer and of `GET /v1/jobs/{id}`.
#[derive(Debug, Serialize)]
pub struct JobView {
    pub job_id: String,
    pub operation: String,
    /// `queued` (for a worker), `waiting_for_provider` (a worker holds it and
    /// waits for a slot of the provider's throttle), `running`, `succeeded`
    /// or `failed`.
    pub status: &'static str,
    /// While `waiting_for_provider`: where it stands.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider_queue: Option<ProviderQueueView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<JobErrorView>,
    /// What the job is charged: its settled charge once the upstream
    /// reported usage, else its reservation. Tokens: an integer; money: an
    /// exact decimal string of `currency` (`"0.00015"`).
    pub cost: Amount,
    /// What was reserved up front (the most it could be charged).
    pub reserved: Amount,
    /// Money: its ISO 4217 code (absent for tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    pub enqueued_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// Where a job waiting for its provider stands ([`Position`]).
#[derive(Debug, Serialize)]
pub struct ProviderQueueView {
    pub provider: String,
    /// Its place in its user's queue at the provider: 1 is served next of
    /// that user's calls (a FIFO provider: its place in the one queue).
    pub position: u64,
    /// Calls of other users served before it, as the queue stands.
    pub others_ahead: u64,
    /// Users waiting at the provider, its own included.
    pub users_waiting: u64,
    /// [`Position::estimated_wait`] at the provider's rate.
    pub estimated_wait_ms: u64,
    /// Now plus the estimated wait.
    pub estimated_start: String,
}

impl ProviderQueueView {
    fn new(provider: &str, rate: f64, p: &Position, now_ms: u64) -> Self {
        let wait = p.estimated_wait(rate);
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        Self {
            provider: provider.to_owned(),
            position: p.ahead.saturating_add(1),
            others_ahead: p.others_ahead,
            users_waiting: p.users,
            estimated_wait_ms: wait_ms,
            estimated_start: rfc3339(now_ms.saturating_add(wait_ms)),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct JobErrorView {
    pub cause: &'static str,
    pub message: String,
    /// Whether the job's charge stands (the upstream may have done the work)
    /// or was released.
    pub charged: bool,
    /// Cause `rejected`: the upstream's status code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_status: Option<u16>,
    /// Cause `rejected`: the upstream's body, only when the operation sets
    /// `expose_upstream_errors = true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_body: Option<String>,
}

impl JobErrorView {
    fn new(cause: FailureCause, message: &str) -> Self {
        let rejection = (cause == FailureCause::Rejected)
            .then(|| Rejection::parse(message))
            .flatten();
        Self {
            cause: cause.as_str(),
            message: match &rejection {
                Some(r) => format!("the upstream answered {} to the input", r.upstream_status),
                None => message.to_owned(),
            },
            charged: cause.charged(),
            upstream_status: rejection.as_ref().map(|r| r.upstream_status),
            upstream_body: rejection.and_then(|r| r.upstream_body),
        }
    }
}

impl JobView {
    /// What the api shows of `info`, amounts in `currency`.
    pub fn of(info: &JobInfo, currency: Currency) -> Self {
        let (status, result, error) = match &info.status {
            JobStatus::Queued => ("queued", None, None),
            JobStatus::Running => ("running", None, None),
            JobStatus::Succeeded { result, .. } => ("succeeded", Some(result.clone()), None),
            JobStatus::Failed { cause, message } => {
                ("failed", None, Some(JobErrorView::new(*cause, message)))
            }
        };
        Self {
            job_id: info.job.id.to_string(),
            operation: info.job.operation.clone(),
            status,
            provider_queue: None,
            result,
            error,
            cost: Amount::new(currency, info.job.charged.unwrap_or(info.job.cost)),
            reserved: Amount::new(currency, info.job.cost),
            currency: crate::usage::money_code(currency),
            enqueued_at: rfc3339(info.job.enqueued_at_ms),
            finished_at: info.finished_at_ms.map(rfc3339),
        }
    }
}

/// `Prefer: respond-async` (RFC 7240), and `wait=<seconds>`: how long to wait
/// for the result before a 202 (a sync call's wait, shortened; an async
/// call's, which is otherwise none). Either way at most the sync timeout.
fn preferences(headers: &HeaderMap) -> (bool, Option<Duration>) {
    let mut respond_async = false;
    let mut wait = None;
    for value in headers.get_all("prefer") {
        let Ok(value) = value.to_str() else { continue };
        for pref in value.split(',') {
            let pref = pref.split(';').next().unwrap_or("").trim();
            let (name, arg) = match pref.split_once('=') {
                Some((n, a)) => (n.trim(), Some(a.trim().trim_matches('"'))),
                None => (pref, None),
            };
            if name.eq_ignore_ascii_case("respond-async") {
                respond_async = true;
            } else if name.eq_ignore_ascii_case("wait") {
                wait = arg
                    .and_then(|a| a.parse::<u64>().ok())
                    .map(Duration::from_secs);
            }
        }
    }
    (respond_async, wait)
}

fn accepted(state: &ApiState, info: &JobInfo) -> Response {
    let location = format!("/v1/jobs/{}", info.job.id);
    let view = JobView::of(info, state.config.currency());
    let mut response = (StatusCode::ACCEPTED, axum::Json(view)).into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(LOCATION, v);
    }
    response
}

pub(crate) fn finished(state: &ApiState, info: &JobInfo) -> Result<Response, ApiError> {
    match &info.status {
        JobStatus::Succeeded { .. } => {
            state.metrics.job_outcome(&info.job.operation, "succeeded");
            let view = JobView::of(info, state.config.currency());
            Ok((StatusCode::OK, axum::Json(view)).into_response())
        }
        JobStatus::Failed { cause, message } => {
            state
                .metrics
                .job_outcome(&info.job.operation, cause.as_str());
            Err(ApiError::JobFailed {
                job_id: info.job.id.clone(),
                cause: *cause,
                message: message.clone(),
                waited_ms: info
                    .finished_at_ms
                    .map(|end| end.saturating_sub(info.job.enqueued_at_ms)),
            })
        }
        JobStatus::Queued | JobStatus::Running => Ok(accepted(state, info)),
    }
}

/// `POST /v1/ops/{operation}` and the named operation routes.
pub async fn run(
    State(state): State<ApiState>,
    priced: Priced,
    flags: Flags,
    trace: Option<Extension<TraceParent>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Result<JsonBody<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let operation = priced.operation.clone();
    let trace = trace.map(|Extension(t)| t);
    let caller = caller.map(|Extension(c)| c);
    let call = call(&state, priced, flags, trace, caller, &headers, body);
    timed(&state, &operation, call).await
}

/// Awaits `call`, a call of `operation`, and records how long it took
/// whatever its outcome.
pub(crate) async fn timed<T>(
    state: &ApiState,
    operation: &str,
    call: impl std::future::Future<Output = T>,
) -> T {
    let started = Instant::now();
    let result = call.await;
    state
        .metrics
        .operation_latency(operation, started.elapsed());
    result
}

async fn call(
    state: &ApiState,
    priced: Priced,
    flags: Flags,
    trace: Option<TraceParent>,
    caller: Option<Caller>,
    headers: &HeaderMap,
    body: Result<JsonBody<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let input = json_object(body, "the operation's input must be a JSON object")?;
    let id = request_id(&priced.user, headers)?;
    // Before the job exists, so that its end cannot be missed.
    let watch = state.jobs.watch(&id);
    let (info, allowed) = submit(state, &priced, trace, caller, id.clone(), input).await?;
    let rate_limit = crate::ratelimit::allowed(&allowed);
    let (prefer_async, prefer_wait) = preferences(headers);
    let respond_async = prefer_async || flags.get("async") == Some(true);
    let answer = if respond_async && prefer_wait.is_none_or(|w| w.is_zero()) {
        Ok(accepted(state, &info))
    } else {
        let timeout = prefer_wait.map_or(state.settings.sync_timeout, |w| {
            w.min(state.settings.sync_timeout)
        });
        let (user, op) = (&priced.user, info.job.operation.clone());
        let wait = watch.until_final(Some(info.clone()), timeout, state.jobs.poll(), || {
            state.jobs.read(user, &op, &id)
        });
        tokio::select! {
            waited = wait => {
                let info = waited?.unwrap_or(info);
                if info.status.is_final() && !headers.contains_key(crate::cost::IDEMPOTENCY_KEY) {
                    forget(state, &info);
                }
                finished(state, &info)
            }
            // Nobody reads the answer: stop waiting (the job owns the charge).
            () = priced.client_gone() => Ok(accepted(state, &info)),
        }
    };
    let mut response = answer.unwrap_or_else(IntoResponse::into_response);
    rate_limit.apply(response.headers_mut());
    Ok(response)
}

/// Submits the job of a priced call ([`JobQueue::submit`](tollgate_core::job::JobQueue::submit):
/// the one place a job is charged): its info and the budget it left, or the
/// 429 of a denied charge. Open the job's watch (and a streamed job's reader)
/// before: its end cannot be missed.
pub(crate) async fn submit(
    state: &ApiState,
    priced: &Priced,
    trace: Option<TraceParent>,
    caller: Option<Caller>,
    id: RequestId,
    input: Value,
) -> Result<(JobInfo, tollgate_core::ledger::Allowed), ApiError> {
    let operation = priced.operation.clone();
    let service_key = caller.and_then(|c| c.service_key);
    let outcome = state
        .jobs
        .submit(JobRequest {
            id,
            user: priced.user.clone(),
            operation: operation.clone(),
            input,
            trace,
            service_key,
        })
        .await
        .map_err(|e| match e {
            // A price that can never fit, said in the deployment's currency.
            JobError::Ledger(LedgerError::CostExceedsLimit { cost, limit }) => {
                let c = state.config.currency();
                ApiError::CostExceedsLimit(format!(
                    "cost {} exceeds the plan limit of {}, so it could never be reserved",
                    Amount::new(c, cost),
                    match c {
                        Currency::Tokens => format!("{limit} tokens"),
                        _ => Amount::new(c, limit).to_string(),
                    }
                ))
            }
            other => other.into(),
        })?;
    match outcome {
        SubmitOutcome::Queued { job, allowed } => {
            state.metrics.reservation(&operation, true);
            let info = JobInfo {
                job,
                status: JobStatus::Queued,
                finished_at_ms: None,
            };
            Ok((info, allowed))
        }
        SubmitOutcome::Duplicate { info, allowed } => Ok((info, allowed)),
        SubmitOutcome::Denied { denied } => {
            state.metrics.reservation(&operation, false);
            Err(ApiError::QuotaExceeded(Box::new(denied)))
        }
    }
}

/// A sync call without an Idempotency-Key is answered with its job's final
/// outcome: nobody can ask for the job again (its id was never the client's),
/// so its record goes now rather than at the end of the operation's
/// `result_ttl` (in the background: the answer does not wait for it; if it
/// fails, the record expires as usual).
pub(crate) fn forget(state: &ApiState, info: &JobInfo) {
    let jobs = std::sync::Arc::clone(&state.jobs);
    let info = info.clone();
    tokio::spawn(async move {
        if let Err(e) = jobs.answered(&info).await {
            tracing::debug!(error = %e, job = %info.job.id, "the answered job's record stays until its result_ttl");
        }
    });
}

/// `GET /v1/jobs/{id}`: a job of the caller's (anyone else's: 404).
pub async fn status(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let not_found = || ApiError::NotFound(format!("no job {:?}", crate::problem::echo(&id)));
    let id = RequestId::existing(id.as_str()).map_err(|_| not_found())?;
    let info = state
        .jobs
        .status(&caller.user, &id)
        .await?
        .ok_or_else(not_found)?;
    let mut view = JobView::of(&info, state.config.currency());
    if info.status == JobStatus::Running {
        view.provider_queue = provider_queue(&state, &info).await;
        if view.provider_queue.is_some() {
            view.status = "waiting_for_provider";
        }
    }
    Ok(axum::Json(view).into_response())
}

/// Where a running job stands at its provider's throttle, if it waits there.
/// A failed read only leaves the status at `running`.
async fn provider_queue(state: &ApiState, info: &JobInfo) -> Option<ProviderQueueView> {
    let job = &info.job;
    let rate = state.config.provider(&job.provider)?.rate;
    match state
        .throttle
        .position(&job.provider, job.user.as_str(), &job.id)
        .await
    {
        Ok(position) => {
            position.map(|p| ProviderQueueView::new(&job.provider, rate, &p, SystemClock.now_ms()))
        }
        Err(e) => {
            tracing::warn!(error = %e, job = %job.id, "reading a job's place at its provider failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_prefer() {
        let mut h = HeaderMap::new();
        assert_eq!(preferences(&h), (false, None));
        h.insert("prefer", HeaderValue::from_static("respond-async, wait=5"));
        assert_eq!(preferences(&h), (true, Some(Duration::from_secs(5))));
        h.insert("prefer", HeaderValue::from_static("wait=2"));
        assert_eq!(preferences(&h), (false, Some(Duration::from_secs(2))));
    }
}
