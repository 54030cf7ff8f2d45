//! `/admin/*`: create users (and issue their key) and service keys, change
//! plans or set a user's own limits, revoke keys, refund a spend event; list
//! and search users (paged), one user's keys and usage.
//! Every handler extracts [`Admin`], so none runs without the admin token.

use axum::extract::{RawPathParams, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tollgate_core::clock::{rfc3339, Clock, SystemClock};
use tollgate_core::keystore::{generate_key_id, UserQuery, UserQueryError};
use tollgate_core::{
    config::{Config, Limit},
    duration,
    id::{OrgId, RequestId, UserId},
    keystore::{ApiKey, KeyKind, KeyRecord, KeyStore},
    ledger::{EventPage, Ledger, RefundOutcome, CUSTOM_PLAN},
    money::{self, Amount, Currency},
};

use crate::auth::Admin;
use crate::extract::{JsonBody, PathParam, QueryParams};
use crate::problem::{echo, ApiError};
use crate::state::ApiState;
use crate::usage::{money_code, PageQuery, UsageView};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateUser {
    /// The user; for a service key, the service's own name.
    pub user: UserId,
    /// A configured plan; the default plan when omitted. Not for a service
    /// key (it pays nothing: each call charges the user it names).
    pub plan: Option<String>,
    /// `user` (the default) or `service`: a key that acts for any user it
    /// names in `Tollgate-User`.
    #[serde(default)]
    pub kind: KeyKind,
    /// A service key: the configured plans it may give a user with
    /// `Tollgate-Plan` (default none).
    #[serde(default)]
    pub allowed_plans: Vec<String>,
}

impl CreateUser {
    /// A user's key on the default plan.
    pub fn user(user: UserId) -> Self {
        Self {
            user,
            plan: None,
            kind: KeyKind::User,
            allowed_plans: Vec::new(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct CreatedUser {
    pub user: String,
    /// The user's plan (absent for a service key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    pub kind: KeyKind,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_plans: Vec<String>,
    pub key_id: String,
    /// The secret key: shown this once, stored only as a hash.
    pub api_key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetPlan {
    pub plan: String,
}

#[derive(Debug, Serialize)]
pub struct PlanView {
    pub user: String,
    pub plan: String,
}

#[derive(Debug, Serialize)]
pub struct RevokedKey {
    pub key_id: String,
    pub user: String,
    pub revoked: bool,
}

fn check_plan(config: &Config, plan: &str) -> Result<(), ApiError> {
    if config.plan(plan).is_some() {
        return Ok(());
    }
    let known: Vec<_> = config.plans().map(|p| p.name.as_str()).collect();
    Err(ApiError::InvalidField {
        field: "plan".into(),
        detail: format!(
            "plan: unknown plan {:?} (plans: {})",
            echo(plan),
            known.join(", ")
        ),
    })
}

/// Issues a key: for `user` on `plan`, or a service key (`kind: service`)
/// that may give the users it acts for its `allowed_plans`. What `POST
/// /admin/users` and `tollgate users create` do.
pub async fn create_user(
    config: &Config,
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    body: CreateUser,
) -> Result<CreatedUser, ApiError> {
    let CreateUser {
        user,
        plan,
        kind,
        mut allowed_plans,
    } = body;
    let plan = match kind {
        KeyKind::User => {
            if !allowed_plans.is_empty() {
                return Err(ApiError::InvalidField {
                    field: "allowed_plans".into(),
                    detail: "allowed_plans: only a service key gives plans (kind: service)".into(),
                });
            }
            let plan = plan.unwrap_or_else(|| config.default_plan().name.clone());
            check_plan(config, &plan)?;
            ledger.set_plan(&user, &plan).await?;
            Some(plan)
        }
        KeyKind::Service => {
            if plan.is_some() {
                return Err(ApiError::InvalidField {
                    field: "plan".into(),
                    detail: "plan: a service key has no plan (each call charges the user it names); see allowed_plans".into(),
                });
            }
            for p in &allowed_plans {
                check_plan(config, p).map_err(|_| ApiError::InvalidField {
                    field: "allowed_plans".into(),
                    detail: format!("allowed_plans: unknown plan {:?}", echo(p)),
                })?;
            }
            allowed_plans.sort();
            allowed_plans.dedup();
            None
        }
    };
    let key = ApiKey::generate_kind(kind)?;
    let record = KeyRecord {
        key_id: generate_key_id()?,
        user: user.clone(),
        created_ms: SystemClock.now_ms(),
        revoked: false,
        kind,
        allowed_plans,
    };
    keys.insert(&key, &record).await?;
    tracing::info!(user = %user, key_id = %record.key_id, kind = kind.as_str(), plan = ?plan, "API key issued");
    Ok(CreatedUser {
        user: user.to_string(),
        plan,
        kind,
        allowed_plans: record.allowed_plans,
        key_id: record.key_id,
        api_key: key.expose().to_owned(),
    })
}

/// `POST /admin/users`
pub async fn create(
    _: Admin,
    State(state): State<ApiState>,
    JsonBody(body): JsonBody<CreateUser>,
) -> Result<Response, ApiError> {
    let created = create_user(
        &state.config,
        state.ledger.as_ref(),
        state.keys.as_ref(),
        body,
    )
    .await?;
    Ok((StatusCode::CREATED, axum::Json(created)).into_response())
}

/// `PUT /admin/users/{user}/plan`
pub async fn set_plan(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
    JsonBody(body): JsonBody<SetPlan>,
) -> Result<Response, ApiError> {
    let user = UserId::new(user).map_err(|e| ApiError::InvalidField {
        field: "user".into(),
        detail: format!("user: {e}"),
    })?;
    check_plan(&state.config, &body.plan)?;
    // A user exists once a key was issued to it (POST /admin/users, `tollgate
    // users create`), or once a service key acted for it (its budget holds
    // live events or a plan); a plan stored for a typo would charge nobody
    // and hide it.
    if !known_user(&state, &user).await? {
        return Err(ApiError::NotFound(format!(
            "no user {:?}: create it with POST /admin/users (or call for it with a service key)",
            echo(user.as_str())
        )));
    }
    state.ledger.set_plan(&user, &body.plan).await?;
    Ok(axum::Json(PlanView {
        user: user.to_string(),
        plan: body.plan,
    })
    .into_response())
}

/// Whether `user` was issued a key, or has a budget of its own: live spend
/// events, or a plan other than the default (a service key acted for it).
async fn known_user(state: &ApiState, user: &UserId) -> Result<bool, ApiError> {
    if state.keys.has_user(user).await? {
        return Ok(true);
    }
    let usage = state
        .ledger
        .usage_page(
            user,
            tollgate_core::ledger::EventPage::new(None, 1)
                .map_err(|e| ApiError::Internal(e.to_string()))?,
        )
        .await?;
    Ok(!usage.events.is_empty() || usage.plan != state.config.default_plan().name)
}

/// `DELETE /admin/keys/{key_id}`
pub async fn revoke(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(key_id): PathParam,
) -> Result<Response, ApiError> {
    let record = state
        .keys
        .revoke(&key_id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no key {:?}", echo(&key_id))))?;
    tracing::info!(user = %record.user, key_id = %record.key_id, "API key revoked");
    Ok(axum::Json(RevokedKey {
        key_id: record.key_id,
        user: record.user.to_string(),
        revoked: record.revoked,
    })
    .into_response())
}

/// The answer to an operator's refund.
#[derive(Debug, Serialize)]
pub struct RefundView {
    pub user: String,
    pub request_id: String,
    /// `refunded` (a plain reserve, or a final job's charge), `cancelled` (a
    /// held charge released and its job cancelled: it never runs) or
    /// `not_found` (nothing live under this id: a second refund is a no-op).
    pub outcome: &'static str,
    /// What was given back (absent for `not_found`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<Amount>,
    /// Used in the plan's longest window after it.
    pub used: Amount,
    /// Money: its ISO 4217 code (absent for tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
}

impl RefundView {
    /// `outcome` of a refund, amounts in `currency`; `None` for
    /// [`RefundOutcome::Running`]: nothing changed, the answer is a 409.
    fn of(
        user: &UserId,
        request: &RequestId,
        outcome: &RefundOutcome,
        currency: Currency,
    ) -> Option<Self> {
        let amount = |n| Amount::new(currency, n);
        let (name, cost, used) = match *outcome {
            RefundOutcome::Refunded { cost, used } => ("refunded", Some(cost), used),
            RefundOutcome::Cancelled { cost, used } => ("cancelled", Some(cost), used),
            RefundOutcome::NotFound { used } => ("not_found", None, used),
            RefundOutcome::Running { .. } => return None,
        };
        Some(Self {
            user: user.to_string(),
            request_id: request.to_string(),
            outcome: name,
            cost: cost.map(amount),
            used: amount(used),
            currency: money_code(currency),
        })
    }
}

/// `POST /admin/users/{user}/refunds/{request_id}`: what `tollgate budget
/// refund` does ([`tollgate_core::refund::operator_refund`]). A charge its
/// running job owns is a 409 problem: nothing changed.
pub async fn refund(
    _: Admin,
    State(state): State<ApiState>,
    params: Result<RawPathParams, axum::extract::rejection::RawPathParamsRejection>,
) -> Result<Response, ApiError> {
    // A parameter that is not UTF-8 is a problem, like every other error.
    let params = params.map_err(|e| ApiError::Malformed {
        detail: format!("bad path parameter: {e}"),
        field: None,
    })?;
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
            .ok_or_else(|| ApiError::Internal(format!("route has no {{{name}}}")))
    };
    let user = existing_user(param("user")?)?;
    let request =
        RequestId::existing(param("request_id")?).map_err(|e| ApiError::InvalidField {
            field: "request_id".into(),
            detail: format!("request_id: {e}"),
        })?;
    let outcome = tollgate_core::refund::operator_refund(
        state.ledger.as_ref(),
        state.jobs.as_ref(),
        &user,
        &request,
    )
    .await?;
    let Some(view) = RefundView::of(&user, &request, &outcome, state.config.currency()) else {
        return Err(ApiError::ChargeOwnedByJob(format!(
            "job {:?} owns its charge and may be calling the provider: refund it once the job is final",
            echo(request.as_str())
        )));
    };
    tracing::info!(user = %user, request_id = %request, ?outcome, "operator refund");
    Ok(axum::Json(view).into_response())
}

/// `PUT /admin/users/{user}/limits`: a user's own limits, as a `[plans.X]
/// limits` list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetLimits {
    pub limits: Vec<LimitBody>,
}

/// One limit: at most `limit` in any trailing `window` (`"1h"`). The
/// limit is an amount of the deployment's currency as requests write it
/// ([`tollgate_core::money::parse_json`]): an integer of tokens, or a
/// decimal string of money (`"20"`, `"0.0025"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitBody {
    pub limit: serde_json::Value,
    pub window: String,
}

/// One limit as the admin views show it.
#[derive(Debug, Clone, Serialize)]
pub struct LimitView {
    pub limit: Amount,
    /// The window as the config writes it (`1h`, `90s`); a calendar
    /// period's: the period, its anchor and time zone (`month (anchor 15,
    /// Europe/Berlin)`), with `window_ms` 0.
    pub window: String,
    pub window_ms: u64,
    /// A calendar period's limit: `day`, `week` or `month`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
}

impl LimitView {
    pub fn of(limits: &[Limit], currency: Currency) -> Vec<Self> {
        limits
            .iter()
            .map(|l| Self {
                limit: Amount::new(currency, l.limit),
                window: l
                    .period
                    .map_or_else(|| duration::format(l.window), |c| c.describe()),
                window_ms: l.window_ms(),
                period: l.period.map(|c| c.kind.word().to_owned()),
            })
            .collect()
    }
}

/// A user's limits: its own (`custom_limits`) or its plan's.
#[derive(Debug, Serialize)]
pub struct LimitsView {
    pub user: String,
    /// `custom` when an admin set the user's limits, else its plan.
    pub plan: String,
    /// The named plan: what the user returns to when its own limits are
    /// cleared, and whose other settings (share, max_in_flight,
    /// max_stored_bytes) apply meanwhile.
    pub base_plan: String,
    pub custom_limits: bool,
    /// Money: its ISO 4217 code, in which `limits` are decimal strings
    /// (absent for tokens: integers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// The limits that apply, longest window first.
    pub limits: Vec<LimitView>,
}

/// The limits `user` is held to now, as [`LimitsView`].
pub async fn limits_view(
    config: &Config,
    ledger: &dyn Ledger,
    user: &UserId,
) -> Result<LimitsView, ApiError> {
    let base = ledger.plan(user).await?;
    let custom = ledger.custom_limits(user).await?;
    let limits = match &custom {
        Some(l) => l.clone(),
        None => config.plan_or_default(Some(&base)).limits.clone(),
    };
    Ok(LimitsView {
        user: user.to_string(),
        plan: if custom.is_some() {
            CUSTOM_PLAN.to_owned()
        } else {
            base.clone()
        },
        base_plan: base,
        custom_limits: custom.is_some(),
        currency: money_code(config.currency()),
        limits: LimitView::of(&limits, config.currency()),
    })
}

/// Sets `user`'s own limits (validated as a plan's, none past the
/// retention): what `PUT /admin/users/{user}/limits` and `tollgate users
/// set-limits` do. An unknown user is a 404 (as for its plan).
pub async fn set_user_limits(
    config: &Config,
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    user: &UserId,
    limits: Vec<LimitBody>,
) -> Result<LimitsView, ApiError> {
    // Each amount read exactly first: one that is not an amount of the
    // currency (too precise, negative, not a number, a JSON number in money,
    // a fraction of a token) is a 422 naming it, as every limit that does
    // not validate is, and nothing changes.
    let currency = config.currency();
    let limits = limits
        .into_iter()
        .enumerate()
        .map(|(i, l)| match money::parse_json(currency, &l.limit) {
            Ok(n) => Ok((n, l.window)),
            Err(m) => {
                let field = format!("limits[{i}].limit");
                Err(ApiError::InvalidField {
                    detail: format!("{field}: {m}"),
                    field,
                })
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let limits = config
        .override_limits(limits)
        .map_err(|detail| ApiError::InvalidField {
            field: "limits".into(),
            detail,
        })?;
    require_user(ledger, keys, config, user).await?;
    ledger.set_limits(user, &limits).await?;
    tracing::info!(user = %user, limits = ?limits, "custom limits set");
    limits_view(config, ledger, user).await
}

/// Returns `user` to its plan's limits: `DELETE /admin/users/{user}/limits`,
/// `tollgate users clear-limits`. Clearing twice is no error.
pub async fn clear_user_limits(
    config: &Config,
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    user: &UserId,
) -> Result<LimitsView, ApiError> {
    require_user(ledger, keys, config, user).await?;
    if ledger.clear_limits(user).await? {
        tracing::info!(user = %user, "custom limits cleared");
    }
    limits_view(config, ledger, user).await
}

/// A 404 unless `user` was issued a key or has a budget of its own.
pub(crate) async fn require_user(
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    config: &Config,
    user: &UserId,
) -> Result<(), ApiError> {
    if keys.has_user(user).await? {
        return Ok(());
    }
    let usage = ledger
        .usage_page(
            user,
            EventPage::new(None, 1).map_err(|e| ApiError::Internal(e.to_string()))?,
        )
        .await?;
    if !usage.events.is_empty() || usage.custom_limits || usage.plan != config.default_plan().name {
        return Ok(());
    }
    Err(ApiError::NotFound(format!(
        "no user {:?}: create it with POST /admin/users (or call for it with a service key)",
        echo(user.as_str())
    )))
}

fn path_user(user: String) -> Result<UserId, ApiError> {
    UserId::new(user).map_err(|e| ApiError::InvalidField {
        field: "user".into(),
        detail: format!("user: {e}"),
    })
}

/// A `{user}` a read or a refund names: also one stored before `.` and `..`
/// were refused ([`UserId::existing`]), so that what it has stays reachable.
fn existing_user(user: String) -> Result<UserId, ApiError> {
    UserId::existing(user).map_err(|e| ApiError::InvalidField {
        field: "user".into(),
        detail: format!("user: {e}"),
    })
}

/// `PUT /admin/users/{user}/limits`
pub async fn set_limits(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
    JsonBody(body): JsonBody<SetLimits>,
) -> Result<Response, ApiError> {
    let user = path_user(user)?;
    let view = set_user_limits(
        &state.config,
        state.ledger.as_ref(),
        state.keys.as_ref(),
        &user,
        body.limits,
    )
    .await?;
    Ok(axum::Json(view).into_response())
}

/// `DELETE /admin/users/{user}/limits`
pub async fn clear_limits(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
) -> Result<Response, ApiError> {
    let user = path_user(user)?;
    let view = clear_user_limits(
        &state.config,
        state.ledger.as_ref(),
        state.keys.as_ref(),
        &user,
    )
    .await?;
    Ok(axum::Json(view).into_response())
}

/// One key as the admin views show it: never its secret or its hash.
#[derive(Debug, Clone, Serialize)]
pub struct KeyView {
    pub key_id: String,
    pub kind: KeyKind,
    pub created: String,
    pub created_ms: u64,
    pub revoked: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_plans: Vec<String>,
}

impl KeyView {
    pub fn of(r: &KeyRecord) -> Self {
        Self {
            key_id: r.key_id.clone(),
            kind: r.kind,
            created: rfc3339(r.created_ms),
            created_ms: r.created_ms,
            revoked: r.revoked,
            allowed_plans: r.allowed_plans.clone(),
        }
    }
}

/// One user of the users list.
#[derive(Debug, Serialize)]
pub struct UserSummary {
    pub user: String,
    /// `custom` (its own limits) or its plan.
    pub plan: String,
    pub base_plan: String,
    pub custom_limits: bool,
    pub limits: Vec<LimitView>,
    /// `service` when every key of the user is a service key, else `user`.
    pub kind: KeyKind,
    /// Keys not revoked.
    pub live_keys: usize,
    pub keys: usize,
    /// When its first key was issued (`null`: none readable).
    pub created: Option<String>,
    pub created_ms: Option<u64>,
}

/// `GET /admin/users`: one page.
#[derive(Debug, Serialize)]
pub struct UserList {
    pub users: Vec<UserSummary>,
    /// Pass as `cursor` for the next page; `null`: the last page.
    pub next_cursor: Option<String>,
}

/// One user's summary (its plan and keys).
pub async fn user_summary(
    config: &Config,
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    user: &UserId,
) -> Result<UserSummary, ApiError> {
    let (limits, records) = tokio::try_join!(limits_view(config, ledger, user), async {
        keys.user_keys(user).await.map_err(ApiError::from)
    })?;
    let kind = if !records.is_empty() && records.iter().all(|r| r.kind == KeyKind::Service) {
        KeyKind::Service
    } else {
        KeyKind::User
    };
    let created_ms = records.iter().map(|r| r.created_ms).min();
    Ok(UserSummary {
        user: user.to_string(),
        plan: limits.plan,
        base_plan: limits.base_plan,
        custom_limits: limits.custom_limits,
        limits: limits.limits,
        kind,
        live_keys: records.iter().filter(|r| !r.revoked).count(),
        keys: records.len(),
        created: created_ms.map(rfc3339),
        created_ms,
    })
}

/// One page of users (`GET /admin/users`, `tollgate users list`).
pub async fn list_users(
    config: &Config,
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    query: &UserQuery,
) -> Result<UserList, ApiError> {
    let page = keys.users(query).await?;
    let users = futures_util::future::try_join_all(
        page.users
            .iter()
            .map(|u| user_summary(config, ledger, keys, u)),
    )
    .await?;
    Ok(UserList {
        users,
        next_cursor: page.next_cursor.map(|u| u.to_string()),
    })
}

#[derive(Debug, Deserialize)]
pub struct UsersQuery {
    pub prefix: Option<String>,
    pub cursor: Option<String>,
    pub limit: Option<usize>,
}

/// `GET /admin/users?prefix=&cursor=&limit=`
pub async fn users(
    _: Admin,
    State(state): State<ApiState>,
    QueryParams(q): QueryParams<UsersQuery>,
) -> Result<Response, ApiError> {
    let query = users_query(&q)?;
    let list = list_users(
        &state.config,
        state.ledger.as_ref(),
        state.keys.as_ref(),
        &query,
    )
    .await?;
    Ok(axum::Json(list).into_response())
}

/// `GET /admin/users/{user}/keys`
#[derive(Debug, Serialize)]
pub struct UserKeys {
    pub user: String,
    pub keys: Vec<KeyView>,
}

/// `GET /admin/users/{user}/keys`: every key issued to the user, oldest
/// first (ids, kinds, times, revoked or not; never a secret or its hash).
pub async fn user_keys(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
) -> Result<Response, ApiError> {
    let user = existing_user(user)?;
    let records = state.keys.user_keys(&user).await?;
    if records.is_empty() && !state.keys.has_user(&user).await? {
        return Err(ApiError::NotFound(format!(
            "no key was issued to user {:?}",
            echo(user.as_str())
        )));
    }
    Ok(axum::Json(UserKeys {
        user: user.to_string(),
        keys: records.iter().map(KeyView::of).collect(),
    })
    .into_response())
}

/// `PUT /admin/users/{user}/org`: `{"org": "<org>"}` or `{"org": null}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetOrg {
    /// Required; `null`: in no organisation.
    #[serde(default, deserialize_with = "present")]
    pub org: Option<Option<String>>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

#[derive(Debug, Serialize)]
pub struct OrgPlanView {
    pub org: String,
    pub plan: String,
}

#[derive(Debug, Serialize)]
pub struct UserOrgView {
    pub user: String,
    pub org: Option<String>,
    /// Live spend events this call moved with the user.
    pub moved_events: u64,
}

#[derive(Debug, Serialize)]
pub struct OrgDetailView {
    pub org: String,
    pub plan: String,
    /// Money: its ISO 4217 code, in which the windows' amounts are decimal
    /// strings (absent for tokens: integers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    pub windows: Vec<crate::usage::WindowView>,
    pub members: Vec<String>,
    /// Pass as `after` for the next page of members; absent on the last.
    pub next_member: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct OrgListView {
    pub orgs: Vec<String>,
    /// Pass as `after` for the next page; absent on the last.
    pub next: Option<String>,
}

/// `?after=<name>&limit=<n>` of the organisation lists.
#[derive(Debug, Deserialize)]
pub struct PageParams {
    pub after: Option<String>,
    pub limit: Option<usize>,
}

/// Names per page of the organisation lists: the default and the most.
pub const ORG_PAGE: usize = 50;
pub const ORG_PAGE_MAX: usize = 500;

fn org_id(field: &str, s: String) -> Result<OrgId, ApiError> {
    OrgId::new(s).map_err(|e| ApiError::InvalidField {
        field: field.into(),
        detail: format!("{field}: {e}"),
    })
}

fn page_params(q: PageParams) -> Result<(Option<String>, usize), ApiError> {
    let limit = q.limit.unwrap_or(ORG_PAGE);
    if !(1..=ORG_PAGE_MAX).contains(&limit) {
        return Err(ApiError::InvalidField {
            field: "limit".into(),
            detail: format!("limit: expected 1 to {ORG_PAGE_MAX}, got {limit}"),
        });
    }
    Ok((q.after.filter(|a| !a.is_empty()), limit))
}

/// `PUT /admin/orgs/{org}`: creates the organisation on a plan, or changes it.
pub async fn set_org(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(org): PathParam,
    JsonBody(body): JsonBody<SetPlan>,
) -> Result<Response, ApiError> {
    let org = org_id("org", org)?;
    check_plan(&state.config, &body.plan)?;
    state.ledger.set_org_plan(&org, &body.plan).await?;
    tracing::info!(org = %org, plan = %body.plan, "organisation plan set");
    Ok(axum::Json(OrgPlanView {
        org: org.to_string(),
        plan: body.plan,
    })
    .into_response())
}

/// `PUT /admin/users/{user}/org`: puts the user in an organisation (or in
/// none), moving its live spend events with it.
pub async fn set_user_org(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
    JsonBody(body): JsonBody<SetOrg>,
) -> Result<Response, ApiError> {
    let user = UserId::new(user).map_err(|e| ApiError::InvalidField {
        field: "user".into(),
        detail: format!("user: {e}"),
    })?;
    let org = match body.org {
        None => {
            return Err(ApiError::InvalidField {
                field: "org".into(),
                detail: "org: required (null: in no organisation)".into(),
            })
        }
        Some(None) => None,
        Some(Some(o)) => Some(org_id("org", o)?),
    };
    if !known_user(&state, &user).await? {
        return Err(ApiError::NotFound(format!(
            "no user {:?}: create it with POST /admin/users (or call for it with a service key)",
            echo(user.as_str())
        )));
    }
    let moved = state.ledger.set_user_org(&user, org.as_ref()).await?;
    tracing::info!(user = %user, org = ?moved.org, events = moved.events, "user organisation set");
    Ok(axum::Json(UserOrgView {
        user: user.to_string(),
        org: moved.org.map(|o| o.to_string()),
        moved_events: moved.events,
    })
    .into_response())
}

/// `GET /admin/users/{user}/usage`: what `/v1/usage` shows the user, and
/// the plan it returns to.
#[derive(Debug, Serialize)]
pub struct AdminUsage {
    #[serde(flatten)]
    pub usage: UsageView,
    pub base_plan: String,
}

/// `GET /admin/users/{user}/usage?cursor=&limit=`
pub async fn user_usage(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(user): PathParam,
    PageQuery(page): PageQuery,
) -> Result<Response, ApiError> {
    let user = existing_user(user)?;
    require_user(
        state.ledger.as_ref(),
        state.keys.as_ref(),
        &state.config,
        &user,
    )
    .await?;
    let (usage, base_plan) = tokio::try_join!(
        state.ledger.usage_page(&user, page),
        state.ledger.plan(&user)
    )?;
    Ok(axum::Json(AdminUsage {
        usage: UsageView::of(&user, &usage, state.config.currency()),
        base_plan,
    })
    .into_response())
}

/// One key of `GET /admin/keys`: its user and what [`KeyView`] shows.
#[derive(Debug, Serialize)]
pub struct KeyRow {
    pub user: String,
    #[serde(flatten)]
    pub key: KeyView,
}

/// `GET /admin/keys`: one page.
#[derive(Debug, Serialize)]
pub struct KeyList {
    pub keys: Vec<KeyRow>,
    /// Pass as `cursor` for the next page; `null`: the last page.
    pub next_cursor: Option<String>,
}

/// `GET /admin/keys?cursor=&limit=`: every key, by user (the users index):
/// a page holds the keys of up to `limit` users, each user's all in one
/// page, oldest first.
pub async fn keys(
    _: Admin,
    State(state): State<ApiState>,
    QueryParams(q): QueryParams<UsersQuery>,
) -> Result<Response, ApiError> {
    let query = users_query(&q)?;
    let page = state.keys.users(&query).await?;
    let keys = state.keys.as_ref();
    let records =
        futures_util::future::try_join_all(page.users.iter().map(|u| keys.user_keys(u))).await?;
    Ok(axum::Json(KeyList {
        keys: records
            .iter()
            .flatten()
            .map(|r| KeyRow {
                user: r.user.to_string(),
                key: KeyView::of(r),
            })
            .collect(),
        next_cursor: page.next_cursor.map(|u| u.to_string()),
    })
    .into_response())
}

/// `GET /admin/orgs/{org}?after=&limit=`: the organisation's plan, windows
/// and a page of its members.
pub async fn org(
    _: Admin,
    State(state): State<ApiState>,
    PathParam(org): PathParam,
    q: Result<QueryParams<PageParams>, ApiError>,
) -> Result<Response, ApiError> {
    let org = org_id("org", org)?;
    let (after, limit) = page_params(q?.0)?;
    let after = after
        .map(|a| {
            UserId::new(a).map_err(|e| ApiError::InvalidField {
                field: "after".into(),
                detail: format!("after: {e}"),
            })
        })
        .transpose()?;
    let u = state.ledger.org_usage(&org, after.as_ref(), limit).await?;
    Ok(axum::Json(OrgDetailView {
        org: u.org.to_string(),
        plan: u.plan,
        currency: money_code(state.config.currency()),
        windows: crate::usage::window_views(&u.windows, state.config.currency()),
        members: u.members.iter().map(ToString::to_string).collect(),
        next_member: u.next_member.map(|m| m.to_string()),
    })
    .into_response())
}

/// The users page a `prefix`/`cursor`/`limit` query asks for (400 naming a
/// bad parameter).
fn users_query(q: &UsersQuery) -> Result<UserQuery, ApiError> {
    UserQuery::new(
        q.prefix.as_deref().unwrap_or(""),
        q.cursor.as_deref().filter(|c| !c.is_empty()),
        q.limit.unwrap_or(UserQuery::DEFAULT_LIMIT),
    )
    .map_err(|e| {
        let field = match e {
            UserQueryError::BadLimit(_) => "limit",
            UserQueryError::BadPrefix(_) => "prefix",
            UserQueryError::BadCursor => "cursor",
        };
        ApiError::Malformed {
            detail: format!("query parameter {field}: {e}"),
            field: Some(field.to_owned()),
        }
    })
}

/// `GET /admin/orgs?after=&limit=`: the organisations by name, a page at a time.
pub async fn orgs(
    _: Admin,
    State(state): State<ApiState>,
    QueryParams(q): QueryParams<PageParams>,
) -> Result<Response, ApiError> {
    let (after, limit) = page_params(q)?;
    let after = after.map(|a| org_id("after", a)).transpose()?;
    let list = state.ledger.orgs(after.as_ref(), limit).await?;
    Ok(axum::Json(OrgListView {
        orgs: list.orgs.iter().map(ToString::to_string).collect(),
        next: list.next.map(|o| o.to_string()),
    })
    .into_response())
}
