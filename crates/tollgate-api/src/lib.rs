//! The api role: the HTTP gateway users talk to.
//!
//! [`router`] builds the axum app over an [`ApiState`] (backends + settings);
//! [`run`] serves it on a listener until a shutdown future resolves. Tests build
//! the router in-process and drive it with `tower::ServiceExt::oneshot`, or serve
//! it on port 0.
//!
//! - [`auth`]: bearer API keys and the admin token;
//! - [`cost`]: the [`Cost`](cost::Cost) layer, which prices a route where it is
//!   declared and charges the caller's budget around the handler;
//! - [`ops`], [`usage`], [`admin`]: the handlers;
//! - [`dashboard`]: the live operations page at `/dashboard` and its
//!   `/admin/overview`;
//! - [`access_log`]: one line per finished request (`--access-log`);
//! - [`health`]: `/healthz`, `/readyz`, `/metrics` (also served alone by a
//!   worker's or throttler's `--metrics-listen`);
//! - [`problem`]: every error as `application/problem+json`;
//! - [`ratelimit`]: `RateLimit-Policy` / `RateLimit` / `Retry-After`;
//! - [`openapi`]: the OpenAPI document at `/openapi.json`.
//!
//! **Invariant:** the api role never calls a provider; it reserves, enqueues a
//! job, and reads the job's outcome.

pub mod abuse;
pub mod access_log;
pub mod admin;
pub mod auth;
pub mod cost;
pub mod credits;
pub mod dashboard;
pub mod edge;
pub mod extract;
pub mod health;
pub mod keycache;
pub mod open_streams;
pub mod openapi;
pub mod ops;
pub mod passthrough;
pub mod problem;
pub mod ratelimit;
pub mod spend;
pub mod state;
pub mod usage;

use std::future::Future;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Extension, Router};
use serde_json::Value;
use tollgate_core::trace::TraceParent;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

pub use axum::http::HeaderName;

use crate::cost::Cost;
use crate::openapi::{schema, Doc, Routes};
use crate::problem::ApiError;
use crate::problem::ProblemType as P;
use crate::state::ApiState;

/// The named operation routes of the built-in operations, each with its
/// summary; its price is the config's (the one source of prices). A named
/// route whose operation the config does not have is left out; every
/// configured operation is reachable at `/v1/ops/{operation}`.
fn named_operations(mut routes: Routes, state: &ApiState) -> Routes {
    let named = [
        ("embeddings", "Embed a text"),
        ("salary.lookup", "Look up a salary"),
        ("jobs.extract", "Extract a job listing"),
        ("llm.structured", "A structured LLM call"),
        ("company.research", "Research a company"),
    ];
    for (name, summary) in named {
        let Some(operation) = state.config.operation(name) else {
            tracing::debug!(
                operation = name,
                "named route left out: no such operation in the config"
            );
            continue;
        };
        routes = routes.metered(
            operation_doc(&format!("/v1/ops/{name}"), summary),
            Cost::job(operation.charged_cost()),
            post(ops::run),
        );
    }
    routes
}

fn operation_doc(path: &str, summary: &str) -> Doc {
    Doc::post(path, summary)
        .user()
        .body(schema("OperationInput"))
        .ok(
            200,
            "The job succeeded: `job_id` and `result`.",
            Some(schema("Job")),
        )
        .ok(
            202,
            "Accepted (async, or still running at the sync timeout): poll the `Location`.",
            Some(schema("Job")),
        )
}

/// A page size's schema: one at the least, at the most what the handler
/// serves (a larger one is a 400, not a silently shorter page).
fn page_limit(max: usize) -> Value {
    serde_json::json!({"type": "integer", "minimum": 1, "maximum": max})
}

/// The `limit` and opaque `cursor` of a page of spend events: the user's own
/// usage and an admin's view of it page alike.
fn event_page(doc: Doc) -> Doc {
    doc.query(
        "limit",
        "Events per page (default 50).",
        page_limit(tollgate_core::ledger::EventPage::MAX_LIMIT),
    )
    .query(
        "cursor",
        "The `next_cursor` of the previous page: the page starts after it (opaque).",
        serde_json::json!({"type": "string", "pattern": "^[0-9]{1,15}-[0-9]{1,19}$"}),
    )
}

/// The `prefix`, `cursor` and `limit` of a page by user id (the users and
/// the keys, which a page holds by user); `prefix` and `limit` say what is
/// filtered and counted.
fn user_page(doc: Doc, prefix: &str, limit: &str) -> Doc {
    doc.query("prefix", prefix, openapi::id_filter_schema())
        .query(
            "cursor",
            "The `next_cursor` of the previous page: the page starts after it.",
            openapi::id_filter_schema(),
        )
        .query(
            "limit",
            limit,
            page_limit(tollgate_core::keystore::UserQuery::MAX_LIMIT),
        )
}

/// The `after` and `limit` of a page of an organisation list (the
/// organisations, or one's members).
fn org_page(doc: Doc, after: &str, limit: &str) -> Doc {
    doc.query("after", after, openapi::id_filter_schema())
        .query("limit", limit, page_limit(admin::ORG_PAGE_MAX))
}

/// The key cache and failure limiter of one router; `state.keys` becomes the
/// cache, so the admin routes' revocations clear it.
fn guard(state: &mut ApiState) -> auth::AuthGuard {
    let cache = Arc::new(keycache::KeyCache::new(Arc::clone(&state.keys)));
    state.keys = cache.clone();
    auth::AuthGuard {
        cache,
        failures: Arc::new(abuse::AuthFailures::new(
            state.settings.trusted_proxy_header.clone(),
        )),
        legacy_keys: state.settings.legacy_keys,
        ledger: Arc::clone(&state.ledger),
        config: Arc::clone(&state.config),
    }
}

/// The pass-through route: a provider's own API path after its name.
pub const PASSTHROUGH: &str = "/v1/passthrough/{provider}/{*path}";

/// Every route of the api, registered with its documentation.
fn routes(state: &ApiState, guard: auth::AuthGuard) -> Routes {
    let user = Routes::new()
        .metered(
            operation_doc(
                "/v1/ops/{operation}",
                "Run an operation (its cost comes from the config)",
            ),
            Cost::per_operation(),
            post(ops::run),
        )
        .route(
            Doc::get(
                "/v1/jobs/{id}",
                "A job's status and result (your own jobs only)",
            )
            .user()
            .ok(200, "The job.", Some(schema("Job")))
            .errors(&[P::NotFound]),
            get(ops::status),
        )
        .route(
            event_page(Doc::get("/v1/usage", "Your budget and audit trail").user()).ok(
                200,
                "Used, limit, remaining, window, reset time and one page of the live spend events.",
                Some(schema("Usage")),
            ),
            get(usage::usage),
        );
    let user = named_operations(user, state);
    let (user_router, user_docs) = user.into_parts();
    // The providers' own APIs: their contract is the provider's, not in this
    // document. Errors leave in the SDKs' shape (outside authentication).
    let user_router = user_router
        .route(
            PASSTHROUGH,
            post(passthrough::call).layer(Cost::passthrough()),
        )
        .route_layer(middleware::from_fn_with_state(guard, auth::authenticate))
        .route_layer(middleware::from_fn(passthrough::sdk_errors));

    Routes::from_parts(user_router, user_docs)
        .route(
            Doc::post(
                "/admin/users",
                "Create a user on a plan and issue its API key",
            )
            .admin()
            .body(schema("CreateUser"))
            .ok(
                201,
                "The user's key, shown this once.",
                Some(schema("CreatedUser")),
            ),
            post(admin::create),
        )
        .route(
            Doc::put("/admin/users/{user}/plan", "Change a user's plan")
                .admin()
                .body(schema("SetPlan"))
                .ok(200, "The user's plan.", Some(schema("Plan")))
                .errors(&[P::NotFound]),
            put(admin::set_plan),
        )
        .route(
            Doc::put(
                "/admin/users/{user}/limits",
                "Set a user's own limits (a custom plan for one user), replacing its plan's until cleared or a plan is set",
            )
            .admin()
            .body(schema("SetLimits"))
            .ok(200, "The limits the user is held to now.", Some(schema("Limits")))
            .errors(&[P::NotFound]),
            put(admin::set_limits),
        )
        .route(
            Doc::post(
                "/admin/users/{user}/credits",
                "Add a grant to a user's prepaid balance (idempotent per idempotency_key)",
            )
            .admin()
            .body(schema("Grant"))
            .ok(201, "Granted: the balance now.", Some(schema("Granted")))
            .ok(200, "The key names this very grant already: nothing added.", Some(schema("Granted")))
            .errors(&[P::NotFound, P::IdempotencyConflict]),
            post(credits::post),
        )
        .route(
            Doc::get("/admin/users/{user}/credits", "A user's prepaid balance and live grants")
                .admin()
                .ok(200, "The balance.", Some(schema("Credits")))
                .errors(&[P::InvalidField]),
            get(credits::show),
        )
        .route(
            Doc::get(
                "/admin/users/{user}/credits/history",
                "Every grant, draw, return and expiry of a user's balance (from the export)",
            )
            .admin()
            .ok(200, "The history, oldest first.", Some(schema("CreditsHistory")))
            .errors(&[P::InvalidField]),
            get(credits::show_history),
        )
        .route(
            Doc::delete(
                "/admin/users/{user}/limits",
                "Return a user to its plan's limits",
            )
            .admin()
            .ok(200, "The limits the user is held to now.", Some(schema("Limits")))
            .errors(&[P::MalformedRequest, P::InvalidField, P::NotFound]),
            delete(admin::clear_limits),
        )
        .route(
            user_page(
                Doc::get(
                    "/admin/users",
                    "List and search the users issued a key, by id (paged)",
                )
                .admin(),
                "Only users whose id starts with this.",
                "Users per page (default 50).",
            )
            .ok(200, "One page of users, by id.", Some(schema("UserList"))),
            get(admin::users),
        )
        .route(
            user_page(
                Doc::get(
                    "/admin/keys",
                    "Every key (never a secret), by user: a page holds the keys of up to `limit` users",
                )
                .admin(),
                "Only the keys of users whose id starts with this.",
                "Users per page (default 50), each with all its keys.",
            )
            .ok(200, "One page of keys, by user, each user's oldest first.", Some(schema("KeyList"))),
            get(admin::keys),
        )
        .route(
            Doc::get("/admin/users/{user}/keys", "A user's keys (never their secrets)")
                .admin()
                .ok(200, "Every key issued to the user, oldest first.", Some(schema("UserKeys")))
                .errors(&[P::MalformedRequest, P::InvalidField, P::NotFound]),
            get(admin::user_keys),
        )
        .route(
            event_page(
                Doc::get(
                    "/admin/users/{user}/usage",
                    "A user's budget: its plan or own limits, every window, one page of its spend events",
                )
                .admin(),
            )
            .ok(200, "What /v1/usage shows the user, and its base plan.", Some(schema("AdminUsage")))
            .errors(&[P::InvalidField, P::NotFound]),
            get(admin::user_usage),
        )
        .route(
            Doc::put(
                "/admin/users/{user}/org",
                "Put a user in an organisation (or in none: null), moving its live spend events with it",
            )
            .admin()
            .body(schema("SetOrg"))
            .ok(200, "The user's organisation.", Some(schema("UserOrg")))
            .errors(&[P::NotFound]),
            put(admin::set_user_org),
        )
        .route(
            Doc::put(
                "/admin/orgs/{org}",
                "Create an organisation on a plan, or change its plan",
            )
            .admin()
            .body(schema("SetPlan"))
            .ok(200, "The organisation's plan.", Some(schema("OrgPlan"))),
            put(admin::set_org),
        )
        .route(
            org_page(
                Doc::get("/admin/orgs", "The organisations, by name (a page)").admin(),
                "Start after this organisation (the page before's next).",
                "Organisations per page (default 50).",
            )
            .ok(200, "One page of organisations.", Some(schema("OrgList")))
            .errors(&[P::InvalidField]),
            get(admin::orgs),
        )
        .route(
            org_page(
                Doc::get(
                    "/admin/orgs/{org}",
                    "One organisation: its plan, its windows' usage and a page of its members",
                )
                .admin(),
                "Members after this user (the page before's next_member).",
                "Members per page (default 50).",
            )
            .ok(200, "The organisation.", Some(schema("Org")))
            .errors(&[P::InvalidField, P::NotFound]),
            get(admin::org),
        )
        .route(
            Doc::delete("/admin/keys/{key_id}", "Revoke an API key")
                .admin()
                .ok(200, "The revoked key.", Some(schema("RevokedKey")))
                .errors(&[P::NotFound]),
            delete(admin::revoke),
        )
        .route(
            Doc::post(
                "/admin/users/{user}/refunds/{request_id}",
                "Refund a spend event: a plain reserve, a final job's charge, or a queued job's (which cancels the job)",
            )
            .admin()
            .ok(200, "What the refund did.", Some(schema("Refund")))
            .errors(&[P::MalformedRequest, P::InvalidField, P::ChargeOwnedByJob]),
            post(admin::refund),
        )
        .route(
            Doc::get(
                "/admin/overview",
                "The operations overview the dashboard polls (providers, queues, roles, top users, newest spend events)",
            )
            .viewer()
            .ok(
                200,
                "The overview (the admin or viewer token, or a dashboard session cookie).",
                Some(schema("Overview")),
            ),
            get(dashboard::overview),
        )
        .route(
            Doc::get(
                "/admin/spend",
                "Spend by user, organisation, model, operation or provider, per hour or day, from the rollups kept as charges change (JSON or CSV, paged)",
            )
            .viewer()
            .required_query(
                "by",
                "user, org, model (the price sheet entry), operation or provider.",
                serde_json::json!({"type": "string", "enum": ["user", "org", "model", "operation", "provider"]}),
            )
            .query(
                "step",
                "1h or 1d (default): hourly buckets are kept 48 h, daily ones 400 days by default (`[spend]`).",
                serde_json::json!({"type": "string", "enum": ["1h", "1d"]}),
            )
            .query(
                "from",
                "The first bucket: an RFC 3339 time or a date (UTC midnight), rounded down to the step; default `to` less a day (1h) or 30 days (1d).",
                serde_json::json!({"type": "string"}),
            )
            .query(
                "to",
                "Buckets starting before this (RFC 3339 or a date); default the end of the current step. At most 400 buckets.",
                serde_json::json!({"type": "string"}),
            )
            .query(
                "cursor",
                "The `next_cursor` of the previous page (CSV: its `Tollgate-Next-Cursor` header).",
                serde_json::json!({"type": "string"}),
            )
            .query(
                "limit",
                "Rows per page (default 1000); by user, a page ends after the user that reaches it.",
                page_limit(tollgate_core::spend::SpendQuery::MAX_LIMIT),
            )
            .query(
                "format",
                "json or csv; without it, `Accept: text/csv` asks for CSV.",
                serde_json::json!({"type": "string", "enum": ["json", "csv"]}),
            )
            .ok(200, "One page of rows, by key then bucket start; amounts as every answer writes them.", Some(schema("SpendPage")))
            .errors(&[P::MalformedRequest, P::InvalidField]),
            get(spend::spend),
        )
        .route(
            Doc::get(
                "/admin/history",
                "The dashboard's history: a point per sampled interval over the last hour (gaps where no pod sampled)",
            )
            .viewer()
            .query(
                "after_ms",
                "Only the points after this slot (ms since the epoch).",
                serde_json::json!({"type": "integer", "minimum": 0}),
            )
            .ok(200, "The points, oldest first.", Some(schema("History"))),
            get(dashboard::history::history),
        )
        .route(
            Doc::get(
                "/admin/jobs",
                "The job browser: recent, failed or dead jobs, by user and by operation (a bounded page)",
            )
            .viewer()
            .query(
                "view",
                "recent (default), failed or dead.",
                serde_json::json!({"type": "string", "enum": ["recent", "failed", "dead"]}),
            )
            .query("user", "Only this user's jobs (empty: every user's).", openapi::id_filter_schema())
            .query("operation", "Only this operation's jobs.", serde_json::json!({"type": "string"}))
            .query(
                "limit",
                "Rows per page (default 25).",
                page_limit(dashboard::jobs::MAX_LIMIT),
            )
            .query(
                "offset",
                "Rows skipped.",
                serde_json::json!({"type": "integer", "minimum": 0, "maximum": tollgate_core::activity::EVENTS_CAP}),
            )
            .ok(200, "One page of jobs.", Some(schema("JobList")))
            .errors(&[P::InvalidField, P::UnknownOperation]),
            get(dashboard::jobs::list),
        )
        .route(
            Doc::get(
                "/admin/jobs/{id}",
                "One job: its record, its timeline (queued, waited for the provider, started, outcome) and what became of its charge",
            )
            .viewer()
            .query(
                "user",
                "Whose job (needed once the activity log no longer keeps its timeline; empty: not given).",
                openapi::id_filter_schema(),
            )
            .ok(200, "The job(s) of this id, or why none was found.", Some(schema("JobDetail")))
            .errors(&[P::InvalidField]),
            get(dashboard::jobs::detail),
        )
        .route(
            Doc::get("/healthz", "The process answers").ok(200, "Up.", Some(schema("Status"))),
            get(health::healthz),
        )
        .route(
            Doc::get(
                "/readyz",
                "The backing store answers and keeps the durability asked for, and every loop of the process is alive",
            )
            .ok(200, "Ready, with what an accepted call survives.", Some(schema("Ready")))
            .errors(&[P::BackendUnavailable, P::NotReady]),
            get(health::readyz),
        )
        .route(
            Doc::get("/metrics", "Prometheus metrics").ok(
                200,
                "Text exposition format 0.0.4.",
                Some(serde_json::json!({"type": "string"})),
            ),
            get(health::metrics),
        )
        .describe(Doc::get("/openapi.json", "This document").ok(
            200,
            "OpenAPI 3.1.",
            Some(serde_json::json!({"type": "object"})),
        ))
}

/// The OpenAPI document of the api over `state`'s config.
pub fn openapi(state: &ApiState) -> Value {
    let mut state = state.clone();
    let guard = guard(&mut state);
    routes(&state, guard).finish(&state.config).1
}

/// The api's axum app.
pub fn router(mut state: ApiState) -> Router {
    let guard = guard(&mut state);
    let (router, document) = routes(&state, guard).finish(&state.config);
    let document = Arc::new(document);
    router
        .route(
            "/openapi.json",
            get(move || {
                let document = Arc::clone(&document);
                async move { axum::Json(document.as_ref().clone()) }
            }),
        )
        .merge(dashboard::pages())
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn_with_state(
            state.clone(),
            request_timeout,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_declared_too_large,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            access_log::middleware,
        ))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            let route = req
                .extensions()
                .get::<MatchedPath>()
                .map_or(req.uri().path(), |p| p.as_str());
            let trace_id = req
                .extensions()
                .get::<TraceParent>()
                .map(|t| t.trace_id().to_owned());
            tracing::info_span!(
                "request",
                method = %req.method(),
                route,
                trace_id,
                user = tracing::field::Empty,
                service_key = tracing::field::Empty
            )
        }))
        .layer(middleware::from_fn(trace_context))
        .layer(DefaultBodyLimit::max(state.settings.body_limit))
        .layer(Extension(state.budget()))
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::Internal("a handler panicked".into()).into_response()
            },
        ))
        .with_state(state)
}

/// Continues the caller's W3C `traceparent` (or starts a trace) as a request
/// extension: the request's span, its job and the job's provider call carry it.
async fn trace_context(mut req: Request, next: Next) -> Response {
    let header = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok());
    let trace = TraceParent::continue_or_start(header).child();
    req.extensions_mut().insert(trace);
    next.run(req).await
}

/// A request whose `Content-Length` declares more than the body limit is
/// answered `413` at once, its body unread (waiting for a body that would be
/// refused anyway only holds the connection), and the connection closed. A
/// body without a length is cut off at the limit as it is read
/// ([`DefaultBodyLimit`]).
async fn refuse_declared_too_large(
    State(state): State<ApiState>,
    req: Request,
    next: Next,
) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let limit = u64::try_from(state.settings.body_limit).unwrap_or(u64::MAX);
    if declared.is_some_and(|n| n > limit) {
        let mut response = ApiError::PayloadTooLarge.into_response();
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        return response;
    }
    next.run(req).await
}

/// Whether `req` may legitimately wait past the request timeout: an
/// operation call (sync by default, or `Prefer: wait`) waits for its job up to
/// the sync timeout.
fn waits_for_a_job(req: &Request) -> bool {
    let path = req.uri().path();
    req.method() == axum::http::Method::POST
        && (path.starts_with("/v1/ops/") || path.starts_with("/v1/passthrough/"))
}

/// Every route but an operation call answers within
/// [`Settings::request_timeout`](state::Settings::request_timeout), or 503
/// `overloaded` with Retry-After. What the handler was doing is dropped at
/// that point, as if the reply were lost: a read is simply cut off; an admin
/// write may have taken effect (each writes its keys in an order that a cut
/// leaves consistent), so read before repeating it.
async fn request_timeout(State(state): State<ApiState>, req: Request, next: Next) -> Response {
    if waits_for_a_job(&req) {
        return next.run(req).await;
    }
    let limit = state.settings.request_timeout;
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => ApiError::RequestTimeout(limit).into_response(),
    }
}

async fn count_requests(State(state): State<ApiState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().clone();
    let response = next.run(req).await;
    state
        .metrics
        .request(&route, method.as_str(), response.status().as_u16());
    response
}

/// How long [`run`] waits, after the last connection closed, for metered tasks
/// whose clients went away (so each submission reaches its job).
pub const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the api on `listener` until `shutdown` resolves, then finishes the
/// requests in flight, and the metered tasks of clients that went away.
/// `listener` is a [`edge::Listener`] (its bounds on clients), or a bare
/// `TcpListener` under [`edge::Edge::default`].
pub async fn run(
    state: ApiState,
    listener: impl Into<edge::Listener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let prices = tokio::spawn(reload_prices(std::sync::Arc::clone(&state.config)));
    let served = serve(router(state.clone()), listener, shutdown).await;
    prices.abort();
    drain(&state).await;
    served
}

/// How often the api looks for a changed price sheet file.
pub const PRICES_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads each price sheet again when its file changed (every
/// [`PRICES_EVERY`]): an operator's new prices apply to the calls reserved
/// from then on; a call reserved before keeps the prices it was reserved at.
/// A sheet that no longer parses is refused, and the prices in use stay.
async fn reload_prices(config: std::sync::Arc<tollgate_core::config::Config>) {
    if config.price_sheets().next().is_none() {
        return;
    }
    let mut tick = tokio::time::interval(PRICES_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for prices in config.price_sheets() {
            let path = prices.path().display();
            match prices.reload() {
                Ok(true) => tracing::info!(%path, "price sheet reloaded: new prices apply"),
                Ok(false) => {}
                Err(e) => tracing::warn!(
                    %path,
                    error = %e,
                    "price sheet not reloaded: the prices in use stay"
                ),
            }
        }
    }
}

/// Serves `app` (the [`router`], or a [`health::Starting`]'s while the role
/// waits for its store) on `listener`, with each client's address, until
/// `shutdown` resolves; see [`edge`] for the bounds on each client.
pub async fn serve(
    app: axum::Router,
    listener: impl Into<edge::Listener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = listener.into();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "api listening");
    }
    edge::serve(app, listener, shutdown).await
}

/// After serving: waits (bounded) for the metered tasks the requests left.
pub async fn drain(state: &ApiState) {
    let left = state.in_flight.drain(DRAIN_LIMIT).await;
    if left > 0 {
        tracing::warn!(left, "metered tasks still running at exit");
    }
}
