//! The budget ledger: the one interface both backends implement.
//!
//! Semantics (DESIGN.md, "Budget semantics"): each user has one pool of `limit`
//! tokens over a sliding `window`, kept as a log of spend events. `reserve` is one
//! atomic step (drop expired events, check, record); it is idempotent per request
//! id; `refund` removes an event at most once; `settle` corrects an event's cost.
//! A denied reservation is an outcome, not an error.

use async_trait::async_trait;
use serde::Serialize;

use crate::id::{RequestId, UserId};

/// One entry of the audit trail: `cost` tokens spent by `request_id` at `at_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpendEvent {
    pub request_id: RequestId,
    pub cost: u64,
    pub at_ms: u64,
}

/// The reservation is recorded (or was already: `duplicate`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Allowed {
    /// Tokens used in the window, this reservation included.
    pub used: u64,
    pub limit: u64,
    pub remaining: u64,
    /// When the event was recorded (for a duplicate: the original time).
    pub at_ms: u64,
    /// The ledger's clock at the time of the call.
    pub now_ms: u64,
    /// Until the oldest live event leaves the window and frees its tokens.
    pub reset_after_ms: u64,
    /// True when this request id was already reserved: nothing was charged again.
    pub duplicate: bool,
}

/// The reservation does not fit; nothing was recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Denied {
    pub used: u64,
    pub limit: u64,
    pub remaining: u64,
    /// Exactly how long until enough old events leave the window for this cost.
    pub retry_after_ms: u64,
    pub now_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReserveOutcome {
    Allowed(Allowed),
    Denied(Denied),
}

impl ReserveOutcome {
    pub fn is_allowed(&self) -> bool {
        matches!(self, Self::Allowed(_))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RefundOutcome {
    /// The event was removed and its `cost` returned to the pool.
    Refunded { cost: u64, used: u64 },
    /// No live event has this id (never reserved, already refunded, or expired).
    NotFound { used: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SettleOutcome {
    /// The event's cost is now `cost` (0 removes the event).
    Settled {
        previous_cost: u64,
        cost: u64,
        used: u64,
    },
    NotFound {
        used: u64,
    },
}

/// A user's budget right now, with the live events (the audit trail).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub plan: String,
    pub used: u64,
    pub limit: u64,
    pub remaining: u64,
    pub window_ms: u64,
    pub now_ms: u64,
    /// Until the oldest live event expires; `None` when there is none.
    pub reset_after_ms: Option<u64>,
    /// Live events, oldest first.
    pub events: Vec<SpendEvent>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("cost must be at least 1 token")]
    ZeroCost,
    #[error("cost {cost} exceeds the plan limit of {limit} tokens, so it could never be reserved")]
    CostExceedsLimit { cost: u64, limit: u64 },
    #[error("cost {cost} is larger than the largest accepted cost")]
    CostTooLarge { cost: u64 },
    #[error("unknown plan {name:?} (configured: {known})")]
    UnknownPlan { name: String, known: String },
    /// The store cannot be reached; retrying later may succeed.
    #[error("budget store unavailable: {0}")]
    Unavailable(String),
    /// The store answered something unexpected.
    #[error("budget store error: {0}")]
    Backend(String),
}

impl LedgerError {
    /// True for failures of the store rather than of the request.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// A budget ledger. Both implementations give identical answers to identical
/// sequences of calls (the conformance suite in `tests/it` holds them to it).
#[async_trait]
pub trait Ledger: Send + Sync + std::fmt::Debug {
    /// Atomically: drop expired events, check `used + cost <= limit`, record the
    /// event. A second call with the same `request` charges nothing and reports
    /// the original reservation with `duplicate: true`.
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError>;

    /// Removes the event of `request`, once.
    async fn refund(
        &self,
        user: &UserId,
        request: &RequestId,
    ) -> Result<RefundOutcome, LedgerError>;

    /// Corrects the event of `request` to `actual_cost` (0 removes it). Raising a
    /// cost records what was really spent even if that takes `used` past the limit.
    async fn settle(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
    ) -> Result<SettleOutcome, LedgerError>;

    async fn usage(&self, user: &UserId) -> Result<Usage, LedgerError>;

    /// Stores `plan` as the user's plan (it must be configured).
    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError>;

    /// The user's effective plan name: the stored one, else the default.
    async fn plan(&self, user: &UserId) -> Result<String, LedgerError>;
}

/// Rejects costs no plan could ever admit (0, or past [`MAX_TOKENS`]); both
/// backends call it before touching state. `cost > limit` is checked against the
/// user's plan inside the atomic step.
///
/// [`MAX_TOKENS`]: crate::config::MAX_TOKENS
pub fn validate_cost(cost: u64) -> Result<(), LedgerError> {
    if cost == 0 {
        return Err(LedgerError::ZeroCost);
    }
    if cost > crate::config::MAX_TOKENS {
        return Err(LedgerError::CostTooLarge { cost });
    }
    Ok(())
}

/// The error for a plan name missing from `config`.
pub fn unknown_plan(config: &crate::Config, name: &str) -> LedgerError {
    LedgerError::UnknownPlan {
        name: name.to_owned(),
        known: config
            .plans()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    }
}
