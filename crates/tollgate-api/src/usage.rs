//! `GET /v1/usage`: the caller's budget and audit trail (each live spend event
//! with its request id, operation, cost and time).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::auth::Caller;
use crate::problem::ApiError;
use crate::ratelimit::{ceil_secs, RateLimit};
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
    /// Live spend events, oldest first.
    pub events: Vec<EventView>,
}

#[derive(Debug, Serialize)]
pub struct EventView {
    pub request_id: String,
    /// The operation the request ran (`null` for a charge of a plain route).
    pub operation: Option<String>,
    pub cost: u64,
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
        events: usage
            .events
            .iter()
            .map(|e| EventView {
                request_id: e.request_id.to_string(),
                operation: e.operation.clone(),
                cost: e.cost,
                at: rfc3339(e.at_ms),
                at_ms: e.at_ms,
            })
            .collect(),
    };
    let rl = RateLimit {
        limit: usage.limit,
        window_ms: usage.window_ms,
    };
    let mut response = axum::Json(view).into_response();
    rl.state(usage.remaining, usage.reset_after_ms.unwrap_or(0))
        .apply(response.headers_mut());
    Ok(response)
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC (`2026-11-30T09:00:00.123Z`).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_796_029_200_000), "2026-11-30T09:00:00.000Z");
    }
}
