//! The live operations dashboard: `GET /dashboard` (one page, its HTML, CSS and
//! JavaScript embedded in the binary: no CDN, no fetch beyond this api), which
//! polls `GET /admin/overview` every second. `GET /` redirects to it.
//!
//! **Access** ([`access`]). Everything but the page shell (which shows only a
//! login form until the overview answers) needs the admin token or the
//! read-only viewer token: as `Authorization: Bearer`, or through `POST
//! /dashboard/login`, which opens a server-side session (ended by logout on
//! every pod). With no admin token configured the dashboard is disabled like
//! `/admin/*` (403). A session opens only the read-only routes, never one
//! that changes anything.
//!
//! **The overview** is computed at most once per [`OVERVIEW_INTERVAL`] per
//! process, however many people watch: each provider's bucket and waiters
//! ([`Throttle::stats`](tollgate_core::throttle::Throttle::stats)), each
//! queue ([`JobQueue::stats`](tollgate_core::job::JobQueue::stats)), the roles
//! alive (the workers' and throttlers' liveness records), and from the
//! [`ActivityLog`]: grants per second and the p95 wait over the last minute,
//! the newest spend events (a refunded job's row says why, from its record),
//! the top spenders (their used/limit read from the ledger), the upstream's
//! answers per provider by class, the budget denials per operation and the
//! users most denied; the answer and denial counts over the last [`RECENT`]
//! are taken against the history's sample of that moment.
//!
//! **The history** ([`history`]): the charts' points over the last hour,
//! sampled server-side by every api process (at most one sample per interval
//! across pods), `GET /admin/history`. **The job browser** ([`jobs`]): `GET
//! /admin/jobs` (recent, failed, dead; by user, by operation) and `GET
//! /admin/jobs/{id}` (a job's record and timeline).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use tollgate_core::activity::{
    ActivityLog, ActivityView, JobStep, SpendView, ANSWER_CLASSES, WAITS_CAP,
};
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{JobStatus, QueueStats};
use tollgate_core::money::Amount;
use tollgate_core::session::SessionStore;
use tollgate_core::throttle::{ProviderStats, ThrottleError};

pub mod access;
pub mod history;
pub mod jobs;

use crate::abuse::AuthFailures;
use crate::dashboard::access::Operator;
use crate::problem::ApiError;
use crate::state::ApiState;

/// Overview requests closer together than this share one computation.
pub const OVERVIEW_INTERVAL: Duration = Duration::from_secs(1);
/// The span of the answer and denial counts.
pub const RECENT: Duration = Duration::from_secs(5 * 60);
/// The span of the users most denied.
const DENIED_SPAN_MS: u64 = 3_600_000;
/// Users most denied shown.
const MOST_DENIED: usize = 8;
/// The window of the rates and the p95.
const MINUTE_MS: u64 = 60_000;
/// Spend events in the overview (the newest).
const EVENTS_SHOWN: usize = 50;
/// Top spenders shown, and candidates whose budget is read to rank them.
const TOP_USERS: usize = 8;
const TOP_CANDIDATES: usize = 16;

const PAGE: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/app.js");
const STYLE: &str = include_str!("dashboard/app.css");

/// Everything inline is refused: the page runs only its own script and style.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   connect-src 'self'; img-src 'self'; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'";

/// The dashboard's state in [`ApiState`]: its sessions, the limiter of wrong
/// admin and viewer tokens, the activity log it reads, and the last overview
/// with the charts' history.
#[derive(Debug)]
pub struct Dashboard {
    pub(crate) activity: Arc<dyn ActivityLog>,
    sessions: Arc<dyn SessionStore>,
    failures: AuthFailures,
    pub(crate) sampler: tokio::sync::Mutex<Sampler>,
}

#[derive(Debug, Default)]
pub(crate) struct Sampler {
    last: Option<(Instant, Arc<Overview>)>,
    /// The history as this process has read it.
    pub(crate) ring: history::Ring,
    /// Each pool member's grants count (provider, member) as read at each
    /// overview of the last minute: its grants per second.
    member_grants: BTreeMap<(String, String), VecDeque<(u64, u64)>>,
}

impl Dashboard {
    pub fn new(
        activity: Arc<dyn ActivityLog>,
        sessions: Arc<dyn SessionStore>,
        trusted_proxy_header: Option<axum::http::HeaderName>,
    ) -> Self {
        Self {
            activity,
            sessions,
            failures: AuthFailures::new(trusted_proxy_header),
            sampler: tokio::sync::Mutex::new(Sampler::default()),
        }
    }

    /// Where the login sessions live.
    pub fn sessions(&self) -> &dyn SessionStore {
        self.sessions.as_ref()
    }

    /// The limiter of wrong admin and viewer tokens (Bearer and login form).
    pub fn failures(&self) -> &AuthFailures {
        &self.failures
    }
}

/// `GET /admin/overview`: see the module docs.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    pub now_ms: u64,
    /// Money: its ISO 4217 code, in which every amount here is an exact
    /// decimal string (absent for tokens: amounts are integers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    pub providers: Vec<ProviderView>,
    pub queues: Vec<QueueStats>,
    pub roles: Roles,
    pub top_users: Vec<TopUser>,
    /// The newest spend events, newest first.
    pub events: Vec<EventView>,
    /// Budget denials per operation (every configured one, and plain
    /// reserves once denied).
    pub denials: Vec<OperationDenials>,
    /// The users denied most in the last hour, most first.
    pub most_denied: Vec<DeniedUser>,
    /// Budget alerts, when `[alerts]` is configured (`None` otherwise).
    pub alerts: Option<AlertsView>,
}

/// The budget alerts' panel: what waits in the outboxes, and every
/// deliverer's attempts (shared through the store, whichever pod runs them).
#[derive(Debug, Clone, Serialize)]
pub struct AlertsView {
    /// Subjects with alerts waiting to be delivered.
    pub waiting_subjects: u64,
    /// How long the most overdue outbox has waited (ms; 0: none).
    pub overdue_ms: u64,
    #[serde(flatten)]
    pub deliveries: tollgate_core::alerts::Deliveries,
}

/// The alerts' panel (`None` without `[alerts]`, or when the store could not
/// say: the panel is left out rather than the overview failing).
async fn alerts_view(state: &ApiState) -> Option<AlertsView> {
    state.config.alerts()?;
    let (depth, deliveries) = tokio::join!(state.alerts.depth(), state.alerts.deliveries());
    match (depth, deliveries) {
        (Ok(depth), Ok(deliveries)) => Some(AlertsView {
            waiting_subjects: depth.subjects,
            overdue_ms: depth.overdue_ms,
            deliveries,
        }),
        (Err(e), _) | (_, Err(e)) => {
            tracing::debug!(error = %e, "the alerts panel is left out of this overview");
            None
        }
    }
}

/// A spend event, and why it was refunded.
#[derive(Debug, Clone, Serialize)]
pub struct EventView {
    #[serde(flatten)]
    pub spend: SpendView,
    /// What the charge is: a job's settled charge once its timeline says
    /// the settle changed it, else `spend.cost` (what was reserved), in the
    /// deployment's currency.
    pub cost: Amount,
    /// What was reserved, when the settle made the charge another amount.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<Amount>,
    /// For a refunded job's charge: the job's failure as its record says it
    /// (`<cause>: <message>`); `None` when not refunded, or the record is gone.
    pub refund_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OperationDenials {
    pub operation: String,
    /// Denials since `since_ms` ([`RECENT`] ago), or since the activity log
    /// began (`None`: this pod has not sampled that long).
    pub recent: u64,
    pub since_ms: Option<u64>,
    /// Since the activity log began.
    pub total: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeniedUser {
    pub user: String,
    /// Denials in the last hour (among the newest kept).
    pub denials: u64,
    /// The operations denied (`(plain reserve)` for plain ones).
    pub operations: Vec<String>,
    pub last_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProviderView {
    #[serde(flatten)]
    pub stats: ProviderStats,
    /// Grants in the last minute, per second.
    pub grants_per_sec: f64,
    /// Grants in the last minute.
    pub grants_last_minute: u64,
    /// The 95th percentile of the waits for a slot granted in the last
    /// minute, in ms; `None` without grants.
    pub p95_wait_ms: Option<f64>,
    /// The upstream's answers by class (`2xx`, `4xx`, `429`, `5xx`,
    /// `timeout`) since `answers_since_ms` ([`RECENT`] ago), or since the
    /// activity log began (`None`: this pod has not sampled that long).
    pub answers: BTreeMap<String, u64>,
    pub answers_since_ms: Option<u64>,
    /// A pool's members' grants per second, by member, over the overviews
    /// of the last minute this pod computed (absent until two of them).
    pub member_grants_per_sec: BTreeMap<String, f64>,
}

/// The roles alive, from their liveness records; `None` when embedded (the
/// worker and the throttle run inside the api's process).
#[derive(Debug, Clone, Serialize)]
pub struct Roles {
    pub embedded: bool,
    pub workers: Option<u64>,
    pub throttlers: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopUser {
    pub user: String,
    /// The user's plan, or `custom` when an admin set its limits.
    pub plan: String,
    pub custom_limits: bool,
    /// Spent in the user's window now, and the limit.
    pub used: Amount,
    pub limit: Amount,
    pub window_secs: u64,
    /// When that limit is a calendar period's: the period (`month`) and the
    /// instant it resets (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resets_at: Option<String>,
}

pub(crate) fn throttle_error(e: ThrottleError) -> ApiError {
    match e {
        ThrottleError::Store(e) => ApiError::Store(e),
        other => ApiError::Internal(other.to_string()),
    }
}

/// The 95th percentile (nearest rank) of `values`, sorted in place.
fn p95(values: &mut [u64]) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = (values.len() * 95).div_ceil(100).max(1);
    values.get(rank - 1).copied()
}

impl Sampler {
    /// Each provider's view; the counts over the last [`RECENT`] are taken
    /// from the history's sample at or before its start.
    fn providers(
        &mut self,
        stats: Vec<ProviderStats>,
        activity: &ActivityView,
    ) -> Vec<ProviderView> {
        let now = activity.now_ms;
        let since = now.saturating_sub(MINUTE_MS);
        let horizon = now.saturating_sub(RECENT.as_millis() as u64);
        let baseline = self.ring.at_or_before(horizon);
        let member_grants = &mut self.member_grants;
        member_grants.retain(|(p, m), _| {
            stats
                .iter()
                .any(|s| &s.provider == p && s.members.iter().any(|x| &x.member == m))
        });
        stats
            .into_iter()
            .map(|s| {
                let member_grants_per_sec = s
                    .members
                    .iter()
                    .filter_map(|m| {
                        let seen = member_grants
                            .entry((s.provider.clone(), m.member.clone()))
                            .or_default();
                        while seen.front().is_some_and(|(at, _)| *at < since) {
                            seen.pop_front();
                        }
                        seen.push_back((now, m.grants));
                        let (&(t0, g0), &(t1, g1)) = (seen.front()?, seen.back()?);
                        // A count that went back started again (Redis: the
                        // pool idled): no rate until the next reads.
                        if g1 < g0 {
                            seen.retain(|(at, _)| *at == t1);
                            return None;
                        }
                        (t1 > t0).then(|| {
                            (
                                m.member.clone(),
                                (g1 - g0) as f64 / ((t1 - t0) as f64 / 1000.0),
                            )
                        })
                    })
                    .collect();
                let answered = activity
                    .answers
                    .get(&s.provider)
                    .cloned()
                    .unwrap_or_default();
                let mut recent: Vec<u64> = activity
                    .waits
                    .get(&s.provider)
                    .map(|w| {
                        w.iter()
                            .filter(|(at, _)| *at >= since)
                            .map(|(_, w)| *w)
                            .collect()
                    })
                    .unwrap_or_default();
                // The waits list holds every grant of the minute unless it is
                // full; then the grants counter against the history's sample
                // of a minute ago tells the rate.
                let grants_per_sec = match self.ring.at_or_before(since) {
                    Some(a) if recent.len() >= WAITS_CAP && now > a.at_ms => {
                        let before = a.counters.grants.get(&s.provider).copied().unwrap_or(0);
                        let after = activity.grants.get(&s.provider).copied().unwrap_or(0);
                        counted(before, after) as f64 / ((now - a.at_ms) as f64 / 1000.0)
                    }
                    _ => recent.len() as f64 / 60.0,
                };
                let answers = ANSWER_CLASSES
                    .iter()
                    .map(|class| {
                        let after = answered.get(*class).copied().unwrap_or(0);
                        let key = format!("{} {class}", s.provider);
                        let before = baseline
                            .and_then(|b| b.counters.answers.get(&key).copied())
                            .unwrap_or(0);
                        ((*class).to_owned(), counted(before, after))
                    })
                    .collect();
                ProviderView {
                    member_grants_per_sec,
                    answers,
                    answers_since_ms: baseline.map(|b| b.at_ms),
                    grants_last_minute: (grants_per_sec * 60.0).round() as u64,
                    p95_wait_ms: p95(&mut recent).map(|us| us as f64 / 1000.0),
                    grants_per_sec,
                    stats: s,
                }
            })
            .collect()
    }

    /// Budget denials per operation over the last [`RECENT`], against the
    /// history's sample at or before its start.
    fn denials(&self, state: &ApiState, activity: &ActivityView) -> Vec<OperationDenials> {
        let horizon = activity.now_ms.saturating_sub(RECENT.as_millis() as u64);
        let baseline = self.ring.at_or_before(horizon);
        let mut names: Vec<String> = state.config.operations().map(|o| o.name.clone()).collect();
        for name in activity.denials.keys() {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names
            .into_iter()
            .map(|operation| {
                let total = activity.denials.get(&operation).copied().unwrap_or(0);
                let before = baseline
                    .and_then(|b| b.counters.denials.get(&operation).copied())
                    .unwrap_or(0);
                OperationDenials {
                    recent: counted(before, total),
                    since_ms: baseline.map(|b| b.at_ms),
                    total,
                    operation,
                }
            })
            .collect()
    }
}

/// The users denied most among the newest denials of the last hour.
fn most_denied(activity: &ActivityView) -> Vec<DeniedUser> {
    let since = activity.now_ms.saturating_sub(DENIED_SPAN_MS);
    let mut by_user: HashMap<&str, DeniedUser> = HashMap::new();
    for d in activity.denied.iter().filter(|d| d.at_ms >= since) {
        let entry = by_user
            .entry(d.user.as_str())
            .or_insert_with(|| DeniedUser {
                user: d.user.clone(),
                denials: 0,
                operations: Vec::new(),
                last_ms: d.at_ms,
            });
        entry.denials += 1;
        entry.last_ms = entry.last_ms.max(d.at_ms);
        let op = d
            .operation
            .clone()
            .unwrap_or_else(|| tollgate_core::activity::PLAIN.to_owned());
        if !entry.operations.contains(&op) {
            entry.operations.push(op);
        }
    }
    let mut users: Vec<DeniedUser> = by_user.into_values().collect();
    users.sort_by(|a, b| b.denials.cmp(&a.denials).then(a.user.cmp(&b.user)));
    users.truncate(MOST_DENIED);
    users
}

/// The shown events, each refunded job's with its record's failure.
async fn events(state: &ApiState, activity: &ActivityView) -> Vec<EventView> {
    let shown: Vec<SpendView> = activity.events.iter().take(EVENTS_SHOWN).cloned().collect();
    let reasons = shown.iter().map(|e| {
        let jobs = Arc::clone(&state.jobs);
        let ids = (e.refunded && e.operation.is_some())
            .then(|| {
                Some((
                    UserId::existing(&e.user).ok()?,
                    RequestId::existing(&e.request_id).ok()?,
                ))
            })
            .flatten();
        async move {
            let (user, id) = ids?;
            let info = jobs.status(&user, &id).await.ok()??;
            match info.status {
                JobStatus::Failed { cause, message } => {
                    Some(format!("{}: {message}", cause.as_str()))
                }
                _ => None,
            }
        }
    });
    let reasons = futures_util::future::join_all(reasons).await;
    // A job's settle may have changed its charge: its timeline says what to
    // (one read for the shown events; a plain reserve has no timeline).
    let ids: Vec<String> = shown.iter().map(|e| e.request_id.clone()).collect();
    // A failed read shows the reservations: the view is observational.
    let timelines = state
        .dashboard
        .activity
        .timelines(&ids)
        .await
        .unwrap_or_default();
    let settled = shown.iter().enumerate().map(|(i, e)| {
        let steps = timelines.get(i)?;
        steps
            .iter()
            .filter(|n| n.user == e.user && e.operation.is_some())
            .rev()
            .find_map(|n| match n.step {
                JobStep::Succeeded { charged } => charged,
                _ => None,
            })
            .filter(|&c| c != e.cost)
    });
    let settled: Vec<Option<u64>> = settled.collect();
    let currency = state.config.currency();
    shown
        .into_iter()
        .zip(reasons)
        .zip(settled)
        .map(|((spend, refund_reason), settled)| EventView {
            refund_reason: if spend.refunded {
                refund_reason.or_else(|| {
                    spend.operation.is_none().then(|| {
                        "a plain charge: refunded by an operator, or its route failed".to_owned()
                    })
                })
            } else {
                None
            },
            cost: Amount::new(currency, settled.unwrap_or(spend.cost)),
            reserved: settled.map(|_| Amount::new(currency, spend.cost)),
            spend,
        })
        .collect()
}

/// Grants between two readings of a counter that restarts at 0 when the store
/// forgot an idle log.
pub(crate) fn counted(before: u64, after: u64) -> u64 {
    if after >= before {
        after - before
    } else {
        after
    }
}

/// The overview, computed at most once per [`OVERVIEW_INTERVAL`].
pub async fn compute(state: &ApiState) -> Result<Arc<Overview>, ApiError> {
    let dash = &state.dashboard;
    let mut sampler = dash.sampler.lock().await;
    if let Some((at, overview)) = &sampler.last {
        if at.elapsed() < OVERVIEW_INTERVAL {
            return Ok(Arc::clone(overview));
        }
    }
    let (providers, queues, activity) = tokio::join!(
        state.throttle.stats(),
        state.jobs.stats(),
        dash.activity.read()
    );
    let (providers, queues, activity) = (providers.map_err(throttle_error)?, queues?, activity?);
    let roles = Roles {
        embedded: queues.iter().all(|q| q.workers.is_none())
            && providers.iter().all(|p| p.throttlers.is_none()),
        workers: queues.iter().filter_map(|q| q.workers).max(),
        throttlers: providers.iter().filter_map(|p| p.throttlers).max(),
    };
    let most_denied = most_denied(&activity);
    let (top_users, events, alerts) = tokio::join!(
        top_users(state, &activity, &most_denied),
        events(state, &activity),
        alerts_view(state)
    );
    if let Err(e) = sampler
        .ring
        .refresh(dash.activity.as_ref(), activity.now_ms)
        .await
    {
        tracing::debug!(error = %e, "dashboard history not read: the recent counts start with the log");
    }
    let providers = sampler.providers(providers, &activity);
    let denials = sampler.denials(state, &activity);
    let overview = Arc::new(Overview {
        now_ms: activity.now_ms,
        currency: crate::usage::money_code(state.config.currency()),
        providers,
        queues,
        roles,
        top_users,
        events,
        denials,
        most_denied,
        alerts,
    });
    sampler.last = Some((Instant::now(), Arc::clone(&overview)));
    Ok(overview)
}

/// The users who spent most in the log's (unrefunded) events, and those
/// denied most (a user stopped at its limit spends nothing new, but its window
/// is full), ranked by what their window holds now.
async fn top_users(
    state: &ApiState,
    activity: &ActivityView,
    denied: &[DeniedUser],
) -> Vec<TopUser> {
    let mut spent: HashMap<&str, u64> = HashMap::new();
    for e in activity.events.iter().filter(|e| !e.refunded) {
        *spent.entry(e.user.as_str()).or_default() += e.cost;
    }
    let mut candidates: Vec<(&str, u64)> = spent.into_iter().collect();
    candidates.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    candidates.truncate(TOP_CANDIDATES);
    for d in denied {
        if !candidates.iter().any(|(u, _)| *u == d.user) {
            candidates.push((d.user.as_str(), 0));
        }
    }
    let reads = candidates.iter().filter_map(|(user, _)| {
        let user = UserId::existing(*user).ok()?;
        let ledger = Arc::clone(&state.ledger);
        Some(async move { (ledger.usage(&user).await, user) })
    });
    let currency = state.config.currency();
    let mut top: Vec<TopUser> = futures_util::future::join_all(reads)
        .await
        .into_iter()
        .filter_map(|(usage, user)| {
            let usage = usage.ok()?;
            // The limit the figures are of (the closest to exhaustion).
            let period = usage
                .windows
                .iter()
                .find(|w| w.window_ms == usage.window_ms && w.limit == usage.limit)
                .and_then(|w| w.period.map(|p| (w.period_label(), p.end_ms)));
            (usage.used > 0).then(|| TopUser {
                user: user.to_string(),
                plan: usage.plan,
                custom_limits: usage.custom_limits,
                used: Amount::new(currency, usage.used),
                limit: Amount::new(currency, usage.limit),
                window_secs: usage.window_ms / 1000,
                period: period.as_ref().map(|(word, _)| word.clone()),
                resets_at: period.map(|(_, end)| tollgate_core::clock::rfc3339(end)),
            })
        })
        .collect();
    top.sort_by(|a, b| b.used.minor.cmp(&a.used.minor).then(a.user.cmp(&b.user)));
    top.truncate(TOP_USERS);
    top
}

/// `GET /admin/overview`
pub async fn overview(_: Operator, State(state): State<ApiState>) -> Result<Response, ApiError> {
    let overview = compute(&state).await?;
    let mut response = axum::Json(overview.as_ref()).into_response();
    response
        .headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

/// The page and its assets, `/` and the login: routes outside the OpenAPI
/// document (HTML and a form, not the JSON API).
pub fn pages() -> Router<ApiState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/dashboard") }))
        .route("/dashboard", get(page))
        .route(
            "/dashboard/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/dashboard/app.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route("/dashboard/session", get(access::session_view))
        .route("/dashboard/login", post(access::login))
        .route("/dashboard/logout", post(access::logout))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    r
}

async fn page(State(state): State<ApiState>) -> Result<Response, ApiError> {
    if state.settings.admin_token.is_none() {
        return Err(ApiError::AdminDisabled);
    }
    let mut r = asset("text/html; charset=utf-8", PAGE);
    let h = r.headers_mut();
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    Ok(r)
}

/// The overview's schema in the OpenAPI document.
pub fn schema(currency: tollgate_core::money::Currency) -> serde_json::Value {
    let int = serde_json::json!({"type": "integer"});
    let amount = crate::openapi::amount_schema(currency);
    let nullable_int = serde_json::json!({"type": ["integer", "null"]});
    let members = serde_json::json!({"type": "array", "description": "A pool's members (empty for a provider served as one upstream), by their config names: each one's own buckets; the provider's figures above are then the pool's (summed; paused_ms the shortest).", "items": {"type": "object",
    "required": ["member", "paused_ms", "effective_rate", "in_flight", "grants", "limits"],
    "properties": {
        "member": {"type": "string"},
        "paused_ms": {"type": "integer", "minimum": 0, "description": "How long the member still grants nothing after its upstream refused a call or could not be reached (0: not paused)."},
        "effective_rate": {"type": "number"},
        "in_flight": {"type": "integer", "minimum": 0, "description": "Slots of the member's max_concurrent held now."},
        "grants": {"type": "integer", "minimum": 0, "description": "The member's grants as the pool's choice counts them (a growing count; on Redis it starts again after the pool idles)."},
        "limits": {"type": "array", "items": {"type": "object",
            "required": ["limit", "available", "burst", "rate"],
            "properties": {"limit": {"type": "string"}, "available": {"type": "number"}, "burst": {"type": "number"}, "rate": {"type": "number"}}}},
    }}});
    serde_json::json!({
        "type": "object",
        "required": ["now_ms", "providers", "queues", "roles", "top_users", "events", "denials", "most_denied"],
        "properties": {
            "currency": {"type": "string", "description": "A money deployment's ISO 4217 code: the amounts are decimal strings of it (absent for tokens)."},
            "now_ms": int,
            "providers": {"type": "array", "items": {
                "type": "object",
                "required": ["provider", "rate", "burst", "tokens", "waiters", "grants_per_sec", "grants_last_minute", "members"],
                "properties": {
                    "provider": {"type": "string"},
                    "rate": {"type": "number"},
                    "burst": int,
                    "tokens": {"type": "number"},
                    "waiters": int,
                    "throttlers": nullable_int,
                    "paused_ms": {"type": "integer", "minimum": 0, "description": "How long the bucket still grants nothing after the upstream refused a call (0: not paused)."},
                    "effective_rate": {"type": "number", "description": "The rate the bucket refills at now: rate, or less on an adaptive provider after refusals."},
                    "limits": {"type": "array", "description": "Every limit's bucket: the request bucket (limit: rate, or requests/<per>), then the provider's other limits.", "items": {"type": "object",
                        "required": ["limit", "available", "burst", "rate"],
                        "properties": {"limit": {"type": "string"}, "available": {"type": "number"}, "burst": {"type": "number"}, "rate": {"type": "number"}}}},
                    "grants_per_sec": {"type": "number", "description": "Grants per second over the last minute."},
                    "grants_last_minute": int,
                    "p95_wait_ms": {"type": ["number", "null"], "description": "The p95 wait for a slot over the last minute."},
                    "answers": {"type": "object", "additionalProperties": int, "description": "The upstream's answers by class (2xx, 4xx, 429, 5xx, timeout) since answers_since_ms: the history's sample at or before 5 minutes ago (null: since the activity log began)."},
                    "answers_since_ms": nullable_int,
                    "members": members,
                    "member_grants_per_sec": {"type": "object", "additionalProperties": {"type": "number"}, "description": "Each pool member's grants per second over the overviews of the last minute (a member is absent until two)."},
                },
            }},
            "queues": {"type": "array", "items": {
                "type": "object",
                "required": ["operation", "queued", "running", "dead"],
                "properties": {"operation": {"type": "string"}, "queued": int, "running": int, "dead": int, "workers": nullable_int},
            }},
            "roles": {"type": "object", "required": ["embedded"], "properties": {
                "embedded": {"type": "boolean"}, "workers": nullable_int, "throttlers": nullable_int,
            }},
            "top_users": {"type": "array", "items": {
                "type": "object",
                "required": ["user", "plan", "used", "limit", "window_secs"],
                "properties": {"user": {"type": "string"}, "plan": {"type": "string"}, "custom_limits": {"type": "boolean", "description": "An admin set this user's limits (plan is then `custom`)."}, "used": amount, "limit": amount, "window_secs": int, "period": {"type": "string", "description": "The limit is a calendar period's (day, week, month)."}, "resets_at": {"type": "string", "format": "date-time", "description": "When that period ends and resets."}},
            }},
            "events": {"type": "array", "items": {
                "type": "object",
                "required": ["at_ms", "user", "cost", "request_id", "refunded"],
                "properties": {
                    "at_ms": int, "user": {"type": "string"}, "operation": {"type": ["string", "null"]},
                    "service_key": {"type": "string", "description": "The service key (its id) that made the charge for the user, if one did."},
                    "cost": {"description": "What the charge is: a job's settled charge once its settle changed it, else what was reserved.", "allOf": [amount]},
                    "reserved": {"description": "What was reserved, when the settle made the charge another amount.", "allOf": [amount]},
                    "request_id": {"type": "string"}, "refunded": {"type": "boolean"},
                    "refund_reason": {"type": ["string", "null"], "description": "Why a refunded job's charge went back: its failure as the job's record says it."},
                },
            }},
            "denials": {"type": "array", "items": {
                "type": "object",
                "required": ["operation", "recent", "since_ms", "total"],
                "properties": {"operation": {"type": "string"}, "recent": int, "since_ms": nullable_int, "total": int},
            }},
            "most_denied": {"type": "array", "items": {
                "type": "object",
                "required": ["user", "denials", "operations", "last_ms"],
                "properties": {"user": {"type": "string"}, "denials": int, "operations": {"type": "array", "items": {"type": "string"}}, "last_ms": int},
            }},
            "alerts": {"type": ["object", "null"], "description": "Budget alerts (null without [alerts]): outboxes waiting, and every deliverer's attempts.",
                "required": ["waiting_subjects", "overdue_ms", "delivered", "retried", "failed"],
                "properties": {
                    "waiting_subjects": int, "overdue_ms": int, "delivered": int, "retried": int, "failed": int,
                    "last_failure_ms": nullable_int, "last_failure": {"type": ["string", "null"]},
                }},
        },
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn p95_is_the_nearest_rank() {
        let mut v: Vec<u64> = (1..=100).collect();
        assert_eq!(p95(&mut v), Some(95));
        assert_eq!(p95(&mut [7]), Some(7));
        assert_eq!(p95(&mut []), None);
    }
}
