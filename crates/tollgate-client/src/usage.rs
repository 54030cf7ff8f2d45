//! `GET /v1/usage`: the caller's budget and one page of its audit trail.

use serde::Deserialize;

use crate::amount;

/// The budget as it stands, and one page of the live spend events.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Usage {
    pub user: String,
    /// The user's plan, or `custom` when an admin set its limits.
    pub plan: String,
    /// True when an admin set this user's limits: `windows` are those.
    #[serde(default)]
    pub custom_limits: bool,
    /// What the amounts count: `tokens`, or an ISO 4217 currency. Every
    /// amount here is an exact integer of its minor unit: tokens, or
    /// micro-units of the currency (1 USD = 1,000,000), whichever form the
    /// server wrote (an integer, or a decimal string of money: `"0.00015"`).
    #[serde(default = "tokens")]
    pub currency: String,
    /// Used in the window closest to exhaustion (the figures below are that window's).
    #[serde(deserialize_with = "amount::minor")]
    pub used: u64,
    #[serde(deserialize_with = "amount::minor")]
    pub limit: u64,
    #[serde(deserialize_with = "amount::minor")]
    pub remaining: u64,
    pub window_secs: u64,
    pub reset_after_secs: Option<u64>,
    pub reset_at: Option<String>,
    /// Every limit of the plan, longest window first.
    #[serde(default)]
    pub windows: Vec<UsageWindow>,
    /// One page of events, oldest first.
    #[serde(default)]
    pub events: Vec<SpendEvent>,
    /// Pass to [`Client::usage_page`](crate::Client::usage_page) for the next
    /// page; `None` on the last.
    pub next_cursor: Option<String>,
}

fn tokens() -> String {
    "tokens".into()
}

/// One limit of the plan and its use.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct UsageWindow {
    pub policy: String,
    #[serde(deserialize_with = "amount::minor")]
    pub limit: u64,
    pub window_secs: u64,
    #[serde(deserialize_with = "amount::minor")]
    pub used: u64,
    #[serde(deserialize_with = "amount::minor")]
    pub remaining: u64,
    pub reset_after_secs: Option<u64>,
}

/// One spend: which request, what it cost, when (RFC 3339 and ms since the epoch).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SpendEvent {
    pub request_id: String,
    pub operation: Option<String>,
    #[serde(deserialize_with = "amount::minor")]
    pub cost: u64,
    /// The estimate reserved up front, for a charge settled to what the
    /// provider reported (`cost` is then the actual).
    #[serde(default, deserialize_with = "amount::minor_opt")]
    pub estimate: Option<u64>,
    pub at: String,
    pub at_ms: u64,
}
