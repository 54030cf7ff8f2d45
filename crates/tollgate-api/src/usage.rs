//! `GET /v1/usage?limit=&cursor=`: the caller's budget and one page of its
//! audit trail (each live spend event with its request id, operation, the
//! service key that acted for the user if one did, cost and
//! time); `next_cursor` leads to the next page.

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use tollgate_core::clock::rfc3339;
use tollgate_core::ledger::{EventCursor, EventPage};
use tollgate_core::money::{Amount, Currency};

use crate::auth::Caller;
use crate::problem::{echo, ApiError};
use crate::ratelimit::{self, ceil_secs};
use crate::state::ApiState;

#[derive(Debug, Serialize)]
pub struct UsageView {
    pub user: String,
    /// The user's plan, or `custom` when an admin set its limits
    /// (`custom_limits`).
    pub plan: String,
    /// True when an admin set this user's limits (`PUT
    /// /admin/users/{user}/limits`): `windows` are those.
    pub custom_limits: bool,
    /// What the amounts count: `tokens` (amounts are integers), or an ISO
    /// 4217 currency (amounts are exact decimal strings of it, `"0.00015"`).
    pub currency: String,
    pub used: Amount,
    pub limit: Amount,
    pub remaining: Amount,
    pub window_secs: u64,
    /// Seconds until the oldest event leaves the window and frees its tokens
    /// (`null` when nothing is spent).
    pub reset_after_secs: Option<u64>,
    /// When that happens (RFC 3339, UTC).
    pub reset_at: Option<String>,
    /// Every limit of the plan, longest window first; the figures above are
    /// the one closest to exhaustion's.
    pub windows: Vec<WindowView>,
    /// One page of the live spend events, oldest first.
    pub events: Vec<EventView>,
    /// The `cursor` of the next page; `null`: this page reached the newest event.
    pub next_cursor: Option<String>,
    /// A member's organisation: its name, plan and windows (every charge
    /// must fit them as well as the user's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub organisation: Option<OrgView>,
}

#[derive(Debug, Serialize)]
pub struct OrgView {
    pub org: String,
    pub plan: String,
    pub windows: Vec<WindowView>,
}

/// A money currency's ISO 4217 code, for the answers that name it only in
/// money (`None` for tokens: those answers stay as they always were).
pub fn money_code(currency: Currency) -> Option<String> {
    match currency {
        Currency::Tokens => None,
        Currency::Money(code) => Some(code.as_str().to_owned()),
    }
}

/// The windows of a budget as the api shows them, amounts in `currency`.
pub fn window_views(
    windows: &[tollgate_core::ledger::WindowUse],
    currency: Currency,
) -> Vec<WindowView> {
    windows
        .iter()
        .map(|w| WindowView::of(windows, w, currency))
        .collect()
}

/// One limit of the plan, as the caller stands in it.
#[derive(Debug, Serialize)]
pub struct WindowView {
    /// Its item in `RateLimit-Policy`: `budget`, or `budget-<window>` when the
    /// plan has several limits.
    pub policy: String,
    pub limit: Amount,
    pub window_secs: u64,
    /// Spent in the trailing window; a settle that raised a cost can put
    /// it past `limit` for a while (reserves wait until it fits again).
    pub used: Amount,
    pub remaining: Amount,
    /// Seconds until the oldest event in this window leaves it (a calendar
    /// period's: until it ends).
    pub reset_after_secs: Option<u64>,
    /// A calendar period's limit: `day`, `week` or `month`, and the current
    /// period's start and end (the exact instant it resets), RFC 3339 with
    /// milliseconds. Absent for a trailing window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_start: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resets_at: Option<String>,
    /// A model limit's: the pattern of the models it counts (`o1*`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl WindowView {
    /// `w`, one of `windows` (a plan's), amounts in `currency`.
    pub fn of(
        windows: &[tollgate_core::ledger::WindowUse],
        w: &tollgate_core::ledger::WindowUse,
        currency: Currency,
    ) -> Self {
        let amount = |minor| Amount::new(currency, minor);
        WindowView {
            policy: ratelimit::policy_of(windows, w),
            limit: amount(w.limit),
            window_secs: ceil_secs(w.window_ms),
            used: amount(w.used),
            remaining: amount(w.remaining),
            reset_after_secs: w.reset_after_ms.map(ceil_secs),
            period: w.period.map(|_| w.period_label()),
            model: w.model.clone(),
            period_start: w.period.map(|p| rfc3339(p.start_ms)),
            resets_at: w.period.map(|p| rfc3339(p.end_ms)),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct EventView {
    pub request_id: String,
    /// The operation the request ran (`null` for an operator's reserve).
    pub operation: Option<String>,
    /// The id of the service key that made the call for the user (absent:
    /// the user's own key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_key: Option<String>,
    pub cost: Amount,
    /// For a charge settled to what the provider reported: the estimate
    /// reserved up front (`cost` is the actual); `null` otherwise.
    pub estimate: Option<Amount>,
    pub at: String,
    pub at_ms: u64,
}

/// The page a request asks for: `limit` (1..=[`EventPage::MAX_LIMIT`], default
/// [`EventPage::DEFAULT_LIMIT`]) events after `cursor`. Other parameters are
/// ignored; a bad value is a 400 naming it.
#[derive(Debug, Clone, Copy)]
pub struct PageQuery(pub EventPage);

impl<S: Send + Sync> FromRequestParts<S> for PageQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let bad = |name: &str, detail: String| ApiError::Malformed {
            detail: format!("query parameter {name}: {detail}"),
            field: Some(name.to_owned()),
        };
        let (mut limit, mut cursor) = (EventPage::DEFAULT_LIMIT, None);
        for pair in parts.uri.query().unwrap_or("").split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "limit" => {
                    limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|_| value.bytes().all(|b| b.is_ascii_digit()))
                        .filter(|n| (1..=EventPage::MAX_LIMIT).contains(n))
                        .ok_or_else(|| {
                            bad(
                                "limit",
                                format!(
                                    "expected an integer from 1 to {}, got {:?}",
                                    EventPage::MAX_LIMIT,
                                    echo(value)
                                ),
                            )
                        })?;
                }
                "cursor" => {
                    let c = value
                        .parse::<EventCursor>()
                        .map_err(|e| bad("cursor", format!("{e}, got {:?}", echo(value))))?;
                    cursor = Some(c);
                }
                _ => {}
            }
        }
        EventPage::new(cursor, limit)
            .map(PageQuery)
            .map_err(|e| bad("limit", e.to_string()))
    }
}

pub async fn usage(
    State(state): State<ApiState>,
    caller: Caller,
    PageQuery(page): PageQuery,
) -> Result<Response, ApiError> {
    let usage = state.ledger.usage_page(&caller.user, page).await?;
    let view = UsageView::of(&caller.user, &usage, state.config.currency());
    let headers = ratelimit::usage(&usage);
    let mut response = axum::Json(view).into_response();
    headers.apply(response.headers_mut());
    Ok(response)
}

impl UsageView {
    /// What `/v1/usage` (and the admin's view of a user) shows of `usage`,
    /// counted in `currency`.
    pub fn of(
        user: &tollgate_core::id::UserId,
        usage: &tollgate_core::ledger::Usage,
        currency: Currency,
    ) -> Self {
        let amount = |minor| Amount::new(currency, minor);
        UsageView {
            user: user.to_string(),
            plan: usage.plan.clone(),
            custom_limits: usage.custom_limits,
            currency: currency.to_string(),
            used: amount(usage.used),
            limit: amount(usage.limit),
            remaining: amount(usage.remaining),
            window_secs: ceil_secs(usage.window_ms),
            reset_after_secs: usage.reset_after_ms.map(ceil_secs),
            reset_at: usage
                .reset_after_ms
                .map(|r| rfc3339(usage.now_ms.saturating_add(r))),
            windows: window_views(&usage.windows, currency),
            events: usage
                .events
                .iter()
                .map(|e| EventView {
                    request_id: e.request_id.to_string(),
                    operation: e.operation.clone(),
                    service_key: e.service_key.clone(),
                    cost: amount(e.cost),
                    estimate: e.estimate.map(amount),
                    at: rfc3339(e.at_ms),
                    at_ms: e.at_ms,
                })
                .collect(),
            next_cursor: usage.next_cursor.map(|c| c.to_string()),
            organisation: usage.organisation.as_ref().map(|o| OrgView {
                org: o.org.to_string(),
                plan: o.plan.clone(),
                windows: window_views(&o.windows, currency),
            }),
        }
    }
}
