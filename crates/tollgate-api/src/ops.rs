//! Operation calls and job status: `POST /v1/ops/{operation}` (and the named
//! operation routes), `GET /v1/jobs/{id}`.
//!
//! The handler holds only the business logic: the [`Cost`](crate::cost::Cost)
//! layer has reserved the price already; the handler submits the job under the
//! same request id (reserve + enqueue, idempotent: the reservation is not charged
//! twice), hands the charge over to the job, then answers at once (async) or
//! waits for the job up to the sync timeout.

use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header::LOCATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;
use tollgate_core::{JobInfo, JobRequest, JobStatus, RequestId, SubmitOutcome};

use crate::auth::Caller;
use crate::cost::Reservation;
use crate::extract::{Flags, JsonBody, PathParam};
use crate::problem::ApiError;
use crate::state::ApiState;
use crate::usage::rfc3339;

/// The body of an operation's answer and of `GET /v1/jobs/{id}`.
#[derive(Debug, Serialize)]
pub struct JobView {
    pub job_id: String,
    pub operation: String,
    /// `queued`, `running`, `succeeded` or `failed`.
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<JobErrorView>,
    pub cost: u64,
    pub enqueued_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct JobErrorView {
    pub cause: &'static str,
    pub message: String,
}

impl From<&JobInfo> for JobView {
    fn from(info: &JobInfo) -> Self {
        let (status, result, error) = match &info.status {
            JobStatus::Queued => ("queued", None, None),
            JobStatus::Running => ("running", None, None),
            JobStatus::Succeeded { result } => ("succeeded", Some(result.clone()), None),
            JobStatus::Failed { cause, message } => (
                "failed",
                None,
                Some(JobErrorView {
                    cause: cause.as_str(),
                    message: message.clone(),
                }),
            ),
        };
        Self {
            job_id: info.job.id.to_string(),
            operation: info.job.operation.clone(),
            status,
            result,
            error,
            cost: info.job.cost,
            enqueued_at: rfc3339(info.job.enqueued_at_ms),
            finished_at: info.finished_at_ms.map(rfc3339),
        }
    }
}

/// `Prefer: respond-async` (RFC 7240), and `wait=<seconds>` to shorten the
/// synchronous wait.
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

fn accepted(info: &JobInfo) -> Response {
    let location = format!("/v1/jobs/{}", info.job.id);
    let mut response = (StatusCode::ACCEPTED, axum::Json(JobView::from(info))).into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(LOCATION, v);
    }
    response
}

fn finished(state: &ApiState, info: &JobInfo) -> Result<Response, ApiError> {
    match &info.status {
        JobStatus::Succeeded { .. } => {
            state.metrics.job_outcome(&info.job.operation, "succeeded");
            Ok((StatusCode::OK, axum::Json(JobView::from(info))).into_response())
        }
        JobStatus::Failed { cause, message } => {
            state
                .metrics
                .job_outcome(&info.job.operation, cause.as_str());
            Err(ApiError::JobFailed {
                job_id: info.job.id.clone(),
                cause: *cause,
                message: message.clone(),
            })
        }
        JobStatus::Queued | JobStatus::Running => Ok(accepted(info)),
    }
}

/// `POST /v1/ops/{operation}` and the named operation routes.
pub async fn run(
    State(state): State<ApiState>,
    reservation: Reservation,
    flags: Flags,
    headers: HeaderMap,
    body: Result<JsonBody<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let operation = reservation.operation.clone();
    let result = call(&state, reservation, flags, &headers, body).await;
    state.metrics.latency(&operation, started.elapsed());
    result
}

async fn call(
    state: &ApiState,
    reservation: Reservation,
    flags: Flags,
    headers: &HeaderMap,
    body: Result<JsonBody<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let JsonBody(input) = body?;
    let operation = reservation.operation.clone();
    if !input.is_object() {
        return Err(ApiError::InvalidField {
            field: "$".into(),
            detail: "the operation's input must be a JSON object".into(),
        });
    }
    // Kept as long as the spend event it labels can live.
    let window = Duration::from_millis(reservation.rate_limit.window_ms);
    if let Err(e) = state
        .operations
        .record(
            &reservation.user,
            &reservation.request_id,
            &operation,
            window,
        )
        .await
    {
        tracing::warn!(error = %e, "could not record the operation of a request");
    }
    let outcome = state
        .jobs
        .submit(JobRequest {
            id: reservation.request_id.clone(),
            user: reservation.user.clone(),
            operation: operation.clone(),
            input: input.clone(),
        })
        .await?;
    let info = match outcome {
        SubmitOutcome::Queued { job, .. } => {
            reservation.hand_over();
            JobInfo {
                job,
                status: JobStatus::Queued,
                finished_at_ms: None,
            }
        }
        SubmitOutcome::Duplicate { info } if info.job.input != input => {
            // draft-ietf-httpapi-idempotency-key-header: a key reused with
            // another payload is a 422. The first job keeps its charge.
            if !matches!(info.status, JobStatus::Failed { .. }) {
                reservation.hand_over();
            }
            return Err(ApiError::IdempotencyKeyReused {
                job_id: info.job.id,
            });
        }
        SubmitOutcome::Duplicate { info } => {
            // The first submission owns the charge; a failed job was refunded
            // by its worker, and whatever this retry charged is refunded by the
            // layer when the failure is answered.
            if !matches!(info.status, JobStatus::Failed { .. }) {
                reservation.hand_over();
            }
            info
        }
        SubmitOutcome::Denied { denied } => {
            let policy = reservation.rate_limit;
            return Err(ApiError::QuotaExceeded { denied, policy });
        }
    };
    let (prefer_async, prefer_wait) = preferences(headers);
    if prefer_async || flags.get("async") == Some(true) {
        return Ok(accepted(&info));
    }
    let timeout = prefer_wait.map_or(state.settings.sync_timeout, |w| {
        w.min(state.settings.sync_timeout)
    });
    let info = if info.status.is_final() {
        info
    } else {
        let wait = state.jobs.wait(&reservation.user, &info.job.id, timeout);
        tokio::select! {
            waited = wait => waited?.unwrap_or(info),
            // Nobody reads the answer: stop waiting (the job owns the charge).
            () = reservation.client_gone() => return Ok(accepted(&info)),
        }
    };
    finished(state, &info)
}

/// `GET /v1/jobs/{id}`: a job of the caller's (anyone else's: 404).
pub async fn status(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let not_found = || ApiError::NotFound(format!("no job {id:?}"));
    let id = RequestId::new(id.as_str()).map_err(|_| not_found())?;
    let info = state
        .jobs
        .status(&caller.user, &id)
        .await?
        .ok_or_else(not_found)?;
    Ok(axum::Json(JobView::from(&info)).into_response())
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
