//! Authentication: `Authorization: Bearer <key>` for users, checked against the
//! [`KeyStore`](tollgate_core::keystore::KeyStore) by the key's SHA-256 (through the
//! in-process [`KeyCache`]); the admin token (`TOLLGATE_ADMIN_TOKEN`) for
//! `/admin/*`, compared in constant time ([`Admin`]; the dashboard's tokens and
//! sessions are in [`crate::dashboard::access`]).
//!
//! A user key is first read in process ([`KeyShape::of`]): one without the key
//! format's prefix and checksum is refused (401) without a lookup and without
//! counting against its address. A key with a valid checksum is always looked up
//! (cached: a valid key is never refused because of its address); one that then
//! fails counts against its address in [`AuthFailures`], which answers 429 for
//! such failures over its budget. Keys of the old format (`tg_` + 64 hex digits,
//! no checksum) are handled as before the checksum, unless `legacy_keys` is off:
//! from an address over its budget only one cached as valid passes; any other
//! is answered 429 before a lookup (the old format cannot tell a random key from
//! a real one, so looking each up would let a flood cost Redis a command each).
//!
//! A service key (`tg_svc_...`) acts for the user each call names in
//! [`TOLLGATE_USER`]: that user becomes the caller (its budget pays, its jobs
//! and usage are read), and the key's id rides along for the audit trail. A
//! user key may name only its own user. [`TOLLGATE_PLAN`] lets a service give
//! the user one of the plans the admin allowed the key (see [`assign_plan`]).

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tollgate_core::config::Config;
use tollgate_core::keystore::{secrets_equal, KeyKind, KeyRecord, KeyShape};
use tollgate_core::ledger::Ledger;
use tollgate_core::session::Role;
use tollgate_core::{
    id::UserId,
    keystore::{KeyHash, KeyStore},
};

use crate::abuse::AuthFailures;
use crate::dashboard::access::{self, Credential};
use crate::extract::extension;
use crate::keycache::KeyCache;
use crate::problem::ApiError;
use crate::state::ApiState;

/// What [`authenticate`] keeps between requests: the key cache (also the
/// state's `keys`, so a revocation here clears it) and the failure limiter.
#[derive(Debug, Clone)]
pub struct AuthGuard {
    pub cache: std::sync::Arc<KeyCache>,
    pub failures: std::sync::Arc<AuthFailures>,
    /// Whether keys of the old format (`tg_` + 64 hex digits) are looked up.
    pub legacy_keys: bool,
    /// Where a service's `Tollgate-Plan` is stored.
    pub ledger: std::sync::Arc<dyn Ledger>,
    pub config: std::sync::Arc<Config>,
}

/// The header that names the user a service key acts for.
pub const TOLLGATE_USER: &str = "tollgate-user";
/// The header a service key gives a user a plan with (one of the key's
/// `allowed_plans`).
pub const TOLLGATE_PLAN: &str = "tollgate-plan";

fn valid(record: &Option<tollgate_core::keystore::KeyRecord>) -> bool {
    record.as_ref().is_some_and(|r| !r.revoked)
}

/// The presented key and its shape, refused when its shape can name no
/// stored key.
fn well_formed(key: &str, legacy_keys: bool) -> Result<(&str, KeyShape), ApiError> {
    match KeyShape::of(key) {
        Ok(shape @ KeyShape::Current(_)) => Ok((key, shape)),
        Ok(KeyShape::Legacy) if legacy_keys => Ok((key, KeyShape::Legacy)),
        Ok(KeyShape::Legacy) => Err(ApiError::Unauthorized(
            "this API key has the old format, which is no longer accepted: ask for a new key",
        )),
        Err(tollgate_core::keystore::MalformedKey::Checksum) => Err(ApiError::Unauthorized(
            "malformed API key: its checksum does not match (mistyped or truncated?)",
        )),
        Err(tollgate_core::keystore::MalformedKey::Shape) => Err(ApiError::Unauthorized(
            "malformed API key: expected tg_user_... or tg_svc_...",
        )),
    }
}

/// The authenticated caller, put into the request extensions by [`authenticate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Whose budget pays and whose jobs and usage are read: the key's user,
    /// or the user a service key names.
    pub user: UserId,
    pub key_id: String,
    /// A service key acting for `user`: its id (the same as `key_id`),
    /// recorded with each charge.
    pub service_key: Option<String>,
}

fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<Option<&'a str>, ApiError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let bad = |detail: &str| ApiError::Malformed {
        detail: format!("{name}: {detail}"),
        field: Some(name.into()),
    };
    if values.next().is_some() {
        return Err(bad("sent more than once"));
    }
    let text = value.to_str().map_err(|_| bad("must be visible ASCII"))?;
    Ok(Some(text.trim()))
}

/// Who a call with the key of `record` is for, and the plan it asks for
/// that user (`Tollgate-Plan`, checked against the key's `allowed_plans`).
fn acting(headers: &HeaderMap, record: &KeyRecord) -> Result<(Caller, Option<String>), ApiError> {
    let named = header(headers, TOLLGATE_USER)?
        .map(|u| {
            UserId::new(u).map_err(|e| ApiError::Malformed {
                detail: format!("Tollgate-User: {e}"),
                field: Some(TOLLGATE_USER.into()),
            })
        })
        .transpose()?;
    let plan = header(headers, TOLLGATE_PLAN)?.map(str::to_owned);
    let caller = match (record.kind, named) {
        (KeyKind::Service, Some(user)) => Caller {
            user,
            key_id: record.key_id.clone(),
            service_key: Some(record.key_id.clone()),
        },
        (KeyKind::Service, None) => return Err(ApiError::UserRequired),
        (KeyKind::User, Some(user)) if user != record.user => {
            return Err(ApiError::ActingForAnotherUser)
        }
        (KeyKind::User, _) => Caller {
            user: record.user.clone(),
            key_id: record.key_id.clone(),
            service_key: None,
        },
    };
    if let Some(plan) = &plan {
        if !record.allowed_plans.iter().any(|p| p == plan) {
            return Err(ApiError::PlanNotAllowed(match record.kind {
                KeyKind::User => "Tollgate-Plan: only a service key may name a plan".into(),
                KeyKind::Service => format!(
                    "Tollgate-Plan: this key may give users the plans [{}], not {:?}",
                    record.allowed_plans.join(", "),
                    crate::problem::echo(plan)
                ),
            }));
        }
    }
    Ok((caller, plan))
}

/// A service names `plan` (one of its key's `allowed_plans`) for `user`:
/// stored when the user's plan is the default (a user first seen) or another
/// plan the key may give; a plan an admin set outside the key's allowed plans
/// stays (the admin's word wins). One read, and a write only on a change.
pub async fn assign_plan(
    ledger: &dyn Ledger,
    config: &Config,
    user: &UserId,
    plan: &str,
    allowed: &[String],
) -> Result<(), ApiError> {
    if config.plan(plan).is_none() {
        return Err(ApiError::PlanNotAllowed(format!(
            "Tollgate-Plan: no plan {:?} is configured",
            crate::problem::echo(plan)
        )));
    }
    let current = ledger.plan(user).await?;
    if current == plan {
        return Ok(());
    }
    if current == config.default_plan().name || allowed.contains(&current) {
        ledger.set_plan(user, plan).await?;
        tracing::info!(user = %user, plan, from = %current, "plan given by a service key");
    }
    Ok(())
}

pub(crate) fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(AUTHORIZATION)
        .ok_or(ApiError::Unauthorized(
            "missing Authorization: Bearer <api key>",
        ))?
        .to_str()
        .map_err(|_| ApiError::Unauthorized("malformed Authorization header"))?;
    let (scheme, token) = value.split_once(' ').ok_or(ApiError::Unauthorized(
        "expected Authorization: Bearer <api key>",
    ))?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(ApiError::Unauthorized(
            "expected Authorization: Bearer <api key>",
        ));
    }
    Ok(token.trim())
}

/// The user's key: `Authorization: Bearer <key>`, or without that header
/// `x-api-key: <key>` (the header Anthropic's SDKs send, so that they work
/// through the pass-through routes unchanged).
pub(crate) fn presented_key(headers: &HeaderMap) -> Result<&str, ApiError> {
    if headers.contains_key(AUTHORIZATION) {
        return bearer(headers);
    }
    match headers.get(X_API_KEY) {
        Some(v) => v
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(ApiError::Unauthorized("malformed x-api-key header")),
        None => bearer(headers),
    }
}

/// The header Anthropic's SDKs carry their key in.
pub const X_API_KEY: &str = "x-api-key";

/// Middleware of the user routes: resolves the bearer key to a [`Caller`] (and
/// its [`UserId`], which the [`Cost`](crate::cost::Cost) layer charges), or
/// answers 401.
pub async fn authenticate(
    State(guard): State<AuthGuard>,
    mut req: Request,
    next: Next,
) -> Response {
    // Read and hash first: the request (its body is not Sync) must not be
    // borrowed across the store's await. A malformed key stops here: no
    // lookup, and it does not count against its address.
    let key = presented_key(req.headers()).and_then(|key| well_formed(key, guard.legacy_keys));
    let legacy = matches!(key, Ok((_, KeyShape::Legacy)));
    let hash = key.map(|(key, _)| KeyHash::of(key));
    let client = guard.failures.client(&req);
    let caller = async {
        let hash = hash?;
        // A checksummed key is looked up whatever its address did (the cache
        // answers a repeated one): a valid key is never refused for its
        // address; only a failed one counts, and is answered 429 over budget.
        // An old-format key from an address over its budget passes only when
        // cached as valid.
        let cached = guard.cache.cached(&hash);
        if legacy && !cached.as_ref().is_some_and(valid) {
            if let Some(wait) = guard.failures.wait(client) {
                return Err(ApiError::AuthFailures(wait));
            }
        }
        let record = match cached {
            Some(record) => record,
            None => guard.cache.lookup(&hash).await?,
        };
        let failure = match &record {
            None => ApiError::Unauthorized("unknown API key"),
            Some(r) if r.revoked => ApiError::Unauthorized("this API key was revoked"),
            Some(r) => return Ok(r.clone()),
        };
        match guard
            .failures
            .wait(client)
            .or_else(|| guard.failures.failed(client))
        {
            Some(wait) => Err(ApiError::AuthFailures(wait)),
            None => Err(failure),
        }
    };
    let caller = match caller.await {
        Ok(record) => acting(req.headers(), &record).map(|a| (a, record)),
        Err(e) => Err(e),
    };
    let caller = match caller {
        Ok(((caller, Some(plan)), record)) => assign_plan(
            guard.ledger.as_ref(),
            &guard.config,
            &caller.user,
            &plan,
            &record.allowed_plans,
        )
        .await
        .map(|()| caller),
        Ok(((caller, None), _)) => Ok(caller),
        Err(e) => Err(e),
    };
    match caller {
        Ok(caller) => {
            let span = tracing::Span::current();
            span.record("user", caller.user.as_str());
            if let Some(kid) = &caller.service_key {
                span.record("service_key", kid.as_str());
            }
            crate::access_log::AccessNote::caller(
                req.extensions(),
                caller.user.as_str(),
                caller.service_key.as_deref(),
            );
            req.extensions_mut().insert(caller.user.clone());
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        extension(parts, || ApiError::Unauthorized("authentication required"))
    }
}

/// Proof that the request carried the admin token as `Authorization: Bearer`;
/// extract it in admin handlers. The viewer token, or a dashboard session
/// (of either role: a cookie never changes anything), gets 403; a wrong token
/// 401, or 429 once its address is over its budget of failures (the right
/// token always passes; see [`crate::dashboard::access`]).
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<ApiState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, ApiError> {
        match access::credential(parts, state).await? {
            Credential::Bearer(Role::Admin) => Ok(Admin),
            Credential::Bearer(Role::Viewer) => Err(ApiError::ReadOnly(
                "the viewer token only reads the dashboard: this route needs the admin token",
            )),
            Credential::Session(Some(_)) => Err(ApiError::ReadOnly(
                "a dashboard session only reads: send Authorization: Bearer <admin token>",
            )),
            Credential::Session(None) => Err(ApiError::Unauthorized(
                "missing Authorization: Bearer <admin token>",
            )),
        }
    }
}

/// The least length of the admin and viewer tokens.
pub const MIN_TOKEN_LEN: usize = 16;

/// Why `viewer` cannot be the viewer token next to `admin`, naming the
/// setting: blank, shorter than [`MIN_TOKEN_LEN`], or the admin token itself
/// (it would open the admin routes).
pub fn check_viewer_token(viewer: &str, admin: Option<&str>) -> Result<(), String> {
    if viewer.trim().is_empty() {
        return Err("TOLLGATE_VIEWER_TOKEN (--viewer-token) is blank".into());
    }
    if viewer.chars().count() < MIN_TOKEN_LEN {
        return Err(format!(
            "TOLLGATE_VIEWER_TOKEN (--viewer-token) must be at least {MIN_TOKEN_LEN} characters"
        ));
    }
    if admin.is_some_and(|a| secrets_equal(viewer, a)) {
        return Err(
            "TOLLGATE_VIEWER_TOKEN (--viewer-token) must differ from TOLLGATE_ADMIN_TOKEN".into(),
        );
    }
    if admin.is_none() {
        return Err(
            "TOLLGATE_VIEWER_TOKEN (--viewer-token) needs TOLLGATE_ADMIN_TOKEN: without it the dashboard is off".into(),
        );
    }
    Ok(())
}
