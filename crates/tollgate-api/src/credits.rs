//! The admin routes of prepaid credits ([`tollgate_core::credits`]): add a
//! grant to a user's balance, read the balance and its history (the
//! credits' entries of the export).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tollgate_core::clock::rfc3339;
use tollgate_core::config::Config;
use tollgate_core::credits::{self, CreditBalance, GrantOutcome, GrantRequest};
use tollgate_core::id::UserId;
use tollgate_core::keystore::KeyStore;
use tollgate_core::ledger::{ChangeKind, Ledger};
use tollgate_core::money::{self, Amount};

use crate::auth::Admin;
use crate::extract::{JsonBody, PathParam};
use crate::problem::ApiError;
use crate::state::ApiState;
use crate::usage::money_code;

/// `POST /admin/users/{user}/credits`: a grant. `amount` as every amount
/// input (an integer of tokens, a decimal string of money); `expires_at`
/// an RFC 3339 instant (absent: never).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantBody {
    pub amount: serde_json::Value,
    #[serde(default)]
    pub expires_at: Option<String>,
    pub idempotency_key: String,
}

/// One grant as the views show it.
#[derive(Debug, Serialize)]
pub struct GrantView {
    pub id: u64,
    pub remaining: Amount,
    pub expires_at: Option<String>,
    pub expires_at_ms: Option<u64>,
}

/// A user's balance.
#[derive(Debug, Serialize)]
pub struct CreditsView {
    pub user: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    pub balance: Amount,
    /// The live grants with something left, in the order charges draw them.
    pub grants: Vec<GrantView>,
    pub now_ms: u64,
}

impl CreditsView {
    pub fn of(user: &UserId, b: &CreditBalance, config: &Config) -> Self {
        let currency = config.currency();
        Self {
            user: user.to_string(),
            currency: money_code(currency),
            balance: Amount::new(currency, b.balance),
            grants: b
                .grants
                .iter()
                .map(|g| GrantView {
                    id: g.id,
                    remaining: Amount::new(currency, g.remaining),
                    expires_at: g.expires_at_ms.map(rfc3339),
                    expires_at_ms: g.expires_at_ms,
                })
                .collect(),
            now_ms: b.now_ms,
        }
    }
}

/// The answer to a grant.
#[derive(Debug, Serialize)]
pub struct GrantedView {
    /// `granted`, or `existing` (the key named this very grant already:
    /// nothing added).
    pub outcome: &'static str,
    pub grant: u64,
    pub credits: CreditsView,
}

/// One entry of a balance's history.
#[derive(Debug, Serialize)]
pub struct HistoryEntry {
    /// The export entry's id (`<ms>-<seq>`, increasing).
    pub id: String,
    pub kind: ChangeKind,
    pub grant: u64,
    pub amount: Amount,
    /// The charge's request id; a grant's or an expiry's: the grant's key.
    pub request_id: String,
    /// A draw's or return's charge time; an expiry's: when it expired.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct HistoryView {
    pub user: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// Oldest first; empty without `[export]`.
    pub entries: Vec<HistoryEntry>,
}

/// The most history entries one answer holds.
pub const HISTORY_MAX: usize = 1000;

/// Reads a grant's body exactly (a 422 naming the field otherwise) and
/// adds it: what `POST /admin/users/{user}/credits` and `tollgate credits
/// add` do. An unknown user is a 404, as for its limits.
pub async fn add(
    config: &Config,
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    user: &UserId,
    body: GrantBody,
) -> Result<(StatusCode, GrantedView), ApiError> {
    let amount =
        money::parse_json(config.currency(), &body.amount).map_err(|m| ApiError::InvalidField {
            field: "amount".into(),
            detail: format!("amount: {m}"),
        })?;
    let expires_at_ms = body
        .expires_at
        .as_deref()
        .map(credits::parse_expires_at)
        .transpose()?;
    let grant = GrantRequest {
        amount,
        expires_at_ms,
        idempotency_key: &body.idempotency_key,
    };
    grant.check()?;
    crate::admin::require_user(ledger, keys, config, user).await?;
    let outcome = ledger.add_credits(user, &grant).await?;
    let (status, name, n) = match &outcome {
        GrantOutcome::Granted { grant, .. } => (StatusCode::CREATED, "granted", *grant),
        GrantOutcome::Existing { grant, .. } => (StatusCode::OK, "existing", *grant),
    };
    if status == StatusCode::CREATED {
        tracing::info!(user = %user, grant = n, amount, ?expires_at_ms, "credits granted");
    }
    Ok((
        status,
        GrantedView {
            outcome: name,
            grant: n,
            credits: CreditsView::of(user, outcome.credits(), config),
        },
    ))
}

/// The credits' entries of the user's export (the first [`HISTORY_MAX`]).
pub async fn history(
    config: &Config,
    ledger: &dyn Ledger,
    user: &UserId,
) -> Result<HistoryView, ApiError> {
    let currency = config.currency();
    let mut entries = Vec::new();
    let mut since = 0;
    // The export holds spend entries too: read it in pages until enough.
    'pages: loop {
        let page = ledger.exported(user, since, HISTORY_MAX).await?;
        let last = page.last().map(|e| e.at_ms());
        let full = page.len() >= HISTORY_MAX;
        for e in page {
            if !credits::is_credit(e.kind) || entries.iter().any(|h: &HistoryEntry| h.id == e.id) {
                continue;
            }
            entries.push(HistoryEntry {
                id: e.id.clone(),
                kind: e.kind,
                grant: e.grant.unwrap_or(0),
                amount: Amount::new(currency, e.cost),
                request_id: e.request_id.to_string(),
                at_ms: (e.kind != ChangeKind::CreditGrant).then_some(e.spent_at_ms),
                expires_at_ms: e.expires_at_ms,
            });
            if entries.len() >= HISTORY_MAX {
                break 'pages;
            }
        }
        match last {
            Some(t) if full && t > since => since = t,
            _ => break,
        }
    }
    Ok(HistoryView {
        user: user.to_string(),
        currency: money_code(currency),
        entries,
    })
}

fn path_user(user: String) -> Result<UserId, ApiError> {
    UserId::existing(user).map_err(|e| ApiError::InvalidField {
        field: "user".into(),
        detail: format!("user: {e}"),
    })
}

/// `POST /admin/users/{user}/credits`
pub async fn post(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
    JsonBody(body): JsonBody<GrantBody>,
) -> Result<Response, ApiError> {
    let user = path_user(user)?;
    let (status, view) = add(
        &state.config,
        state.ledger.as_ref(),
        state.keys.as_ref(),
        &user,
        body,
    )
    .await?;
    Ok((status, axum::Json(view)).into_response())
}

/// `GET /admin/users/{user}/credits`
pub async fn show(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
) -> Result<Response, ApiError> {
    let user = path_user(user)?;
    let b = state.ledger.credits(&user).await?;
    Ok(axum::Json(CreditsView::of(&user, &b, &state.config)).into_response())
}

/// `GET /admin/users/{user}/credits/history`
pub async fn show_history(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
) -> Result<Response, ApiError> {
    let user = path_user(user)?;
    let view = history(&state.config, state.ledger.as_ref(), &user).await?;
    Ok(axum::Json(view).into_response())
}
