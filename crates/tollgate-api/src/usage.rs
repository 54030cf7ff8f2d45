//! `GET /v1/usage`: the caller's budget and audit trail (each live spend event
//! with its request id, operation, cost and time).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use tollgate_core::clock::rfc3339;

use crate::auth::Caller;
use crate::problem::ApiError;
use crate::ratelimit::{self, ceil_secs};
use crate::state::ApiState;

#[derive(Debug, Serialize)]
pub struct UsageView {
    pub user: String,
    pub plan: String,
    pub used: u64,
    pub limit: u64,
    pub remaining: u64,
    pub window_secs: u64,
    /// Seconds until the oldest event leaves the window and frees its tokens
    /// (`null` when nothing is spent).
    pub reset_after_secs: Option<u64>,
    /// When that happens (RFC 3339, UTC).
    pub reset_at: Option<String>,
    /// Every limit of the plan, longest window first; the figures above are
    /// the one closest to exhaustion's.
    pub windows: Vec<WindowView>,
    /// Live spend events, oldest first.
    pub events: Vec<EventView>,
}

/// One limit of the plan, as the caller stands in it.
#[derive(Debug, Serialize)]
pub struct WindowView {
    /// Its item in `RateLimit-Policy`: `budget`, or `budget-<window>` when the
    /// plan has several limits.
    pub policy: String,
    pub limit: u64,
    pub window_secs: u64,
    /// Tokens spent in the trailing window; a settle that raised a cost can put
    /// it past `limit` for a while (reserves wait until it fits again).
    pub used: u64,
    pub remaining: u64,
    /// Seconds until the oldest event in this window leaves it.
    pub reset_after_secs: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct EventView {
    pub request_id: String,
    /// The operation the request ran (`null` for a charge of a plain route).
    pub operation: Option<String>,
    pub cost: u64,
    /// For a charge settled to what the provider reported: the estimate
    /// reserved up front (`cost` is the actual); `null` otherwise.
    pub estimate: Option<u64>,
    pub at: String,
    pub at_ms: u64,
}

pub async fn usage(State(state): State<ApiState>, caller: Caller) -> Result<Response, ApiError> {
    let usage = state.ledger.usage(&caller.user).await?;
    let view = UsageView {
        user: caller.user.to_string(),
        plan: usage.plan.clone(),
        used: usage.used,
        limit: usage.limit,
        remaining: usage.remaining,
        window_secs: ceil_secs(usage.window_ms),
        reset_after_secs: usage.reset_after_ms.map(ceil_secs),
        reset_at: usage
            .reset_after_ms
            .map(|r| rfc3339(usage.now_ms.saturating_add(r))),
        windows: usage
            .windows
            .iter()
            .map(|w| WindowView {
                policy: ratelimit::policy_name(&usage.windows, w.window_ms),
                limit: w.limit,
                window_secs: ceil_secs(w.window_ms),
                used: w.used,
                remaining: w.remaining,
                reset_after_secs: w.reset_after_ms.map(ceil_secs),
            })
            .collect(),
        events: usage
            .events
            .iter()
            .map(|e| EventView {
                request_id: e.request_id.to_string(),
                operation: e.operation.clone(),
                cost: e.cost,
                estimate: e.estimate,
                at: rfc3339(e.at_ms),
                at_ms: e.at_ms,
            })
            .collect(),
    };
    let headers = ratelimit::usage(&usage);
    let mut response = axum::Json(view).into_response();
    headers.apply(response.headers_mut());
    Ok(response)
}
