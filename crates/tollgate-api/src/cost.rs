//! [`Cost`]: the tower layer that states a route's price where the route is
//! declared, and charges it to the caller's budget around the handler.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{body::Body, http::Request, routing::post, Extension, Router};
//! use tollgate_api::cost::{Budget, Cost, Reservation};
//! use tollgate_core::{Config, Ledger, MemoryLedger, UserId};
//! use tower::ServiceExt;
//!
//! async fn summarize(reservation: Reservation) -> String {
//!     format!("charged {} tokens", reservation.cost)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let config = Arc::new(Config::builtin());
//! let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
//! let app: Router = Router::new()
//!     .route("/summarize", post(summarize).layer(Cost::tokens(8)))
//!     // Your authentication puts the caller's `UserId` into the request
//!     // extensions; here everyone is alice.
//!     .layer(axum::middleware::map_request(|mut req: axum::extract::Request| async move {
//!         req.extensions_mut().insert(UserId::new("alice").expect("valid id"));
//!         req
//!     }))
//!     .layer(Extension(Budget::new(Arc::clone(&ledger), config)));
//!
//! let request = Request::post("/summarize").body(Body::empty()).expect("request");
//! let response = app.oneshot(request).await.expect("infallible");
//! assert_eq!(response.status(), 200);
//! // Built-in plan: 1000 tokens per 12 h, 8 spent.
//! assert_eq!(response.headers()["ratelimit"], "\"budget\";r=992;t=43200");
//! assert_eq!(ledger.usage(&UserId::new("alice").expect("id")).await.expect("usage").used, 8);
//! # }
//! ```
//!
//! What it does with each request:
//! 1. finds the caller's [`UserId`] (none: 401) and the [`Budget`] in the
//!    request extensions, and the price ([`Cost::tokens`], or the `{operation}`
//!    path parameter's `cost` in the config for [`Cost::per_operation`]);
//! 2. takes the request id from the `Idempotency-Key` header (scoped to the
//!    user, so two users' keys never meet) or makes a fresh one;
//! 3. reserves the price: denied answers 429 with `Retry-After` and the
//!    `RateLimit-Policy` / `RateLimit` headers, without calling the handler;
//! 4. calls the handler with a [`Reservation`] in the extensions;
//! 5. refunds when the handler failed (status >= 400) unless it called
//!    [`Reservation::hand_over`] (a job now owns the charge and settles it) or
//!    the reservation was a retry's duplicate (the first request owns it);
//! 6. adds the rate-limit headers to the response.
//!
//! Steps 3 to 5 run in a spawned task that the request awaits: when the client
//! disconnects, hyper drops the request's future, but the task goes on to the
//! end, so a reservation is always either handed over or refunded.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{FromRequestParts, RawPathParams, Request};
use axum::http::request::Parts;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tollgate_core::{
    Allowed, Config, LeaseError, Ledger, RefundOutcome, RequestId, ReservationLeases,
    ReserveOutcome, UserId,
};
use tower::{Layer, Service};

use crate::metrics::Metrics;
use crate::problem::ApiError;
use crate::ratelimit::RateLimit;

/// The header a client sets to make a retry safe.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Longest accepted `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// What the [`Cost`] layer charges with: put it in the request extensions
/// (`.layer(Extension(budget))`).
#[derive(Clone, Debug)]
pub struct Budget {
    ledger: Arc<dyn Ledger>,
    config: Arc<Config>,
    metrics: Option<Arc<Metrics>>,
    in_flight: InFlight,
    leases: Option<(Arc<dyn ReservationLeases>, Duration)>,
}

/// Counts the metered tasks still running, so that a shutting-down server can
/// let them reach a hand-over or a refund before the runtime stops.
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<(AtomicUsize, tokio::sync::Notify)>);

impl InFlight {
    pub fn running(&self) -> usize {
        self.0 .0.load(Ordering::SeqCst)
    }

    fn start(&self) -> InFlightGuard {
        self.0 .0.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(self.clone())
    }

    /// Waits until no metered task runs, at most `limit`; returns how many
    /// were still running.
    pub async fn drain(&self, limit: Duration) -> usize {
        let wait = async {
            loop {
                let idle = self.0 .1.notified();
                if self.running() == 0 {
                    return;
                }
                idle.await;
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
        self.running()
    }
}

struct InFlightGuard(InFlight);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0 .0 .0.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0 .0 .1.notify_waiters();
        }
    }
}

impl Budget {
    pub fn new(ledger: Arc<dyn Ledger>, config: Arc<Config>) -> Self {
        Self {
            ledger,
            config,
            metrics: None,
            in_flight: InFlight::default(),
            leases: None,
        }
    }

    /// Leases every reservation for `ttl` in `leases` until it is handed over or
    /// refunded, so that a reconciler can settle it if this process dies first
    /// (see [`crate::reconcile`]).
    pub fn with_leases(mut self, leases: Arc<dyn ReservationLeases>, ttl: Duration) -> Self {
        self.leases = Some((leases, ttl));
        self
    }

    async fn open_lease(&self, user: &UserId, request: &RequestId) -> Result<(), ApiError> {
        let Some((leases, ttl)) = &self.leases else {
            return Ok(());
        };
        let until = now_ms().saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        leases
            .open(user, request, until)
            .await
            .map_err(|e| match e {
                LeaseError::Unavailable(m) => ApiError::Unavailable(m),
                LeaseError::Backend(m) => ApiError::Internal(m),
            })
    }

    /// Forgets the lease; on failure the reconciler finds it later and settles it
    /// the same way (a job owns it, or a refund that is then a no-op).
    async fn close_lease(&self, user: &UserId, request: &RequestId) {
        if let Some((leases, _)) = &self.leases {
            if let Err(e) = leases.close(user, request).await {
                tracing::warn!(user = %user, request_id = %request, error = %e, "could not close a reservation lease");
            }
        }
    }

    /// Counts this budget's metered tasks in `in_flight`.
    pub fn with_in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// Counts reservations and refunds in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    /// The plan behind `limit` as the headers show it. When every plan has the
    /// same window (the usual case) no store is asked; otherwise the user's plan
    /// is read.
    pub async fn policy(&self, user: &UserId, limit: u64) -> RateLimit {
        let mut windows = self.config.plans().map(|p| p.window_ms());
        let first = windows.next().unwrap_or(0);
        let window_ms = if windows.all(|w| w == first) {
            first
        } else {
            match self.ledger.plan(user).await {
                Ok(name) => self.config.plan_or_default(Some(&name)).window_ms(),
                Err(_) => self.config.default_plan().window_ms(),
            }
        };
        RateLimit { limit, window_ms }
    }
}

/// A route's price. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost(Price);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Price {
    Tokens(u64),
    PerOperation,
}

impl Cost {
    /// A fixed price in budget tokens (>= 1).
    pub const fn tokens(n: u64) -> Self {
        Self(Price::Tokens(n))
    }

    /// The `cost` of the operation named by the route's `{operation}` path
    /// parameter, from the config's `[operations.*]`; unknown operations get a
    /// 404 and are not charged.
    pub const fn per_operation() -> Self {
        Self(Price::PerOperation)
    }

    /// The fixed price, if it is one.
    pub fn fixed(&self) -> Option<u64> {
        match self.0 {
            Price::Tokens(n) => Some(n),
            Price::PerOperation => None,
        }
    }
}

impl<S> Layer<S> for Cost {
    type Service = CostService<S>;
    fn layer(&self, inner: S) -> CostService<S> {
        CostService { inner, cost: *self }
    }
}

/// The service of the [`Cost`] layer.
#[derive(Debug, Clone)]
pub struct CostService<S> {
    inner: S,
    cost: Cost,
}

impl<S> Service<Request> for CostService<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        // The clone that was driven to readiness serves this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cost = self.cost;
        let (gone_tx, gone) = watch::channel(false);
        let guard = req
            .extensions()
            .get::<Budget>()
            .map(|b| b.in_flight.start());
        let task = tokio::spawn(async move {
            let _guard = guard;
            charge(inner, cost, req, gone).await
        });
        Box::pin(async move {
            // Dropped with this future when the client goes away: tells the
            // task that nobody waits for its answer any more.
            let _client = ClientGuard(gone_tx);
            Ok(match task.await {
                Ok(response) => response,
                Err(e) => {
                    ApiError::Internal(format!("metered request task failed: {e}")).into_response()
                }
            })
        })
    }
}

/// Signals [`Reservation::client_gone`] when the request's future is dropped.
struct ClientGuard(watch::Sender<bool>);

impl Drop for ClientGuard {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

/// The reservation made for this request; extract it in the handler.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub user: UserId,
    pub request_id: RequestId,
    /// The operation (the `{operation}` path parameter) or the route's path.
    pub operation: String,
    pub cost: u64,
    pub allowed: Allowed,
    pub rate_limit: RateLimit,
    handed_over: Arc<AtomicBool>,
    gone: watch::Receiver<bool>,
}

impl Reservation {
    /// A job has taken the charge over: it settles it (keeps it on success,
    /// refunds it on failure), so the layer must not refund it.
    pub fn hand_over(&self) {
        self.handed_over.store(true, Ordering::SeqCst);
    }

    /// Resolves when the client has gone away (hyper dropped the request). The
    /// handler keeps running in its own task either way; after
    /// [`hand_over`](Self::hand_over) it may stop waiting for a result nobody
    /// will read.
    pub async fn client_gone(&self) {
        let mut gone = self.gone.clone();
        let _ = gone.wait_for(|g| *g).await;
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Reservation {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Reservation>()
            .cloned()
            .ok_or_else(|| ApiError::Internal("the route has no Cost layer".into()))
    }
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The request id of a request: the user-scoped hash of its `Idempotency-Key`,
/// or a fresh UUID.
pub fn request_id(user: &UserId, headers: &HeaderMap) -> Result<RequestId, ApiError> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(RequestId::generate());
    };
    let bad = |detail: &str| ApiError::Malformed {
        detail: format!("Idempotency-Key {detail}"),
        field: Some("Idempotency-Key".into()),
    };
    let key = value
        .to_str()
        .map_err(|_| bad("must be visible ASCII"))?
        .trim();
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(bad("must be 1 to 255 characters"));
    }
    let mut h = Sha256::new();
    h.update(user.as_str().as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    RequestId::new(format!("idem-{hex}")).map_err(|e| ApiError::Internal(e.to_string()))
}

async fn price(cost: Cost, budget: &Budget, parts: &mut Parts) -> Result<(u64, String), ApiError> {
    let operation = match RawPathParams::from_request_parts(parts, &()).await {
        Ok(params) => params
            .iter()
            .find(|(k, _)| *k == "operation")
            .map(|(_, v)| v.to_owned()),
        Err(e) => {
            return Err(ApiError::Malformed {
                detail: format!("bad path parameter: {e}"),
                field: Some("operation".into()),
            })
        }
    };
    match cost.0 {
        Price::Tokens(n) => {
            let label = operation.unwrap_or_else(|| {
                parts
                    .uri
                    .path()
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            });
            Ok((n, label))
        }
        Price::PerOperation => {
            let name = operation.ok_or_else(|| {
                ApiError::Internal("Cost::per_operation on a route without {operation}".into())
            })?;
            match budget.config.operation(&name) {
                Some(op) => Ok((op.cost, name)),
                None => Err(ApiError::UnknownOperation(format!(
                    "unknown operation {name:?} (operations: {})",
                    budget
                        .config
                        .operations()
                        .map(|o| o.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))),
            }
        }
    }
}

async fn charge<S>(mut inner: S, cost: Cost, req: Request, gone: watch::Receiver<bool>) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    let (mut parts, body) = req.into_parts();
    let Some(budget) = parts.extensions.get::<Budget>().cloned() else {
        return ApiError::Internal("no Budget extension: add .layer(Extension(budget))".into())
            .into_response();
    };
    let Some(user) = parts.extensions.get::<UserId>().cloned() else {
        return ApiError::Unauthorized("authentication required").into_response();
    };
    let (tokens, operation) = match price(cost, &budget, &mut parts).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let request_id = match request_id(&user, &parts.headers) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = budget.open_lease(&user, &request_id).await {
        return e.into_response();
    }
    let outcome = match budget.ledger.reserve(&user, &request_id, tokens).await {
        Ok(o) => o,
        Err(e) => {
            // Whether the reserve happened is unknown: the lease stays, and the
            // reconciler refunds it if no job takes it.
            return ApiError::from(e).into_response();
        }
    };
    let metrics = budget.metrics.clone();
    let allowed = match outcome {
        ReserveOutcome::Allowed(a) => a,
        ReserveOutcome::Denied(denied) => {
            budget.close_lease(&user, &request_id).await;
            if let Some(m) = &metrics {
                m.reservation(&operation, false);
            }
            let policy = budget.policy(&user, denied.limit).await;
            return ApiError::QuotaExceeded { denied, policy }.into_response();
        }
    };
    if let Some(m) = &metrics {
        m.reservation(&operation, true);
    }
    let rate_limit = budget.policy(&user, allowed.limit).await;
    let handed_over = Arc::new(AtomicBool::new(false));
    let reservation = Reservation {
        user: user.clone(),
        request_id: request_id.clone(),
        operation: operation.clone(),
        cost: tokens,
        allowed: allowed.clone(),
        rate_limit,
        handed_over: Arc::clone(&handed_over),
        gone,
    };
    parts.extensions.insert(reservation);
    let Ok(mut response) = inner.call(Request::from_parts(parts, body)).await;

    let mut headers = rate_limit.allowed(&allowed);
    let failed = response.status().is_client_error() || response.status().is_server_error();
    // A duplicate reservation belongs to the first request with this id: only
    // the request that charged may refund.
    let mut settled = true;
    if failed && !allowed.duplicate && !handed_over.load(Ordering::SeqCst) {
        match budget.ledger.refund(&user, &request_id).await {
            Ok(RefundOutcome::Refunded { used, .. }) => {
                if let Some(m) = &metrics {
                    m.refund(&operation);
                }
                let remaining = allowed.limit.saturating_sub(used);
                headers = rate_limit.state(remaining, allowed.reset_after_ms);
            }
            Ok(RefundOutcome::NotFound { .. }) => {}
            Err(e) => {
                // The lease stays open: the reconciler retries the refund.
                settled = false;
                tracing::error!(
                    user = %user, request_id = %request_id, error = %e,
                    "refund of a failed request failed; left to the reconciler"
                );
            }
        }
    }
    if settled {
        budget.close_lease(&user, &request_id).await;
    }
    headers.apply(response.headers_mut());
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use axum::routing::post;
    use axum::{Extension, Router};
    use tollgate_core::MemoryLedger;
    use tower::ServiceExt;

    fn app(handler: axum::routing::MethodRouter) -> (Router, Arc<dyn Ledger>) {
        let config = Arc::new(Config::builtin());
        let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let app = Router::new()
            .route("/op", handler.layer(Cost::tokens(8)))
            .layer(axum::middleware::map_request(
                |mut req: Request| async move {
                    req.extensions_mut().insert(UserId::new("alice").unwrap());
                    req
                },
            ))
            .layer(Extension(Budget::new(Arc::clone(&ledger), config)));
        (app, ledger)
    }

    fn alice() -> UserId {
        UserId::new("alice").unwrap()
    }

    #[tokio::test]
    async fn failures_are_refunded_unless_handed_over() {
        let (failing, ledger) = app(post(|| async {
            (axum::http::StatusCode::BAD_GATEWAY, "no")
        }));
        let r = failing
            .oneshot(
                Request::post("/op")
                    .body(axum::body::Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 502);
        assert_eq!(r.headers()["ratelimit"], "\"budget\";r=1000;t=43200");
        assert_eq!(ledger.usage(&alice()).await.unwrap().used, 0);

        let (handed, ledger) = app(post(|r: Reservation| async move {
            r.hand_over();
            (axum::http::StatusCode::BAD_GATEWAY, "the job refunds")
        }));
        let r = handed
            .oneshot(
                Request::post("/op")
                    .body(axum::body::Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 502);
        assert_eq!(ledger.usage(&alice()).await.unwrap().used, 8);
    }

    #[tokio::test]
    async fn a_dropped_request_finishes_its_handler_and_signals_client_gone() {
        let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
        let done_tx = Arc::new(std::sync::Mutex::new(Some(done_tx)));
        let (app, ledger) = app(post(move |r: Reservation| async move {
            r.hand_over();
            r.client_gone().await;
            if let Some(tx) = done_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            "unread"
        }));
        let call = app.oneshot(
            Request::post("/op")
                .body(axum::body::Body::empty())
                .unwrap(),
        );
        // The client hangs up before the handler answers.
        assert!(tokio::time::timeout(Duration::from_millis(50), call)
            .await
            .is_err());
        tokio::time::timeout(Duration::from_secs(5), done)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ledger.usage(&alice()).await.unwrap().used, 8);
    }

    #[test]
    fn idempotency_keys_are_scoped_to_the_user() {
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("order-7"));
        let alice = UserId::new("alice").unwrap();
        let bob = UserId::new("bob").unwrap();
        let a1 = request_id(&alice, &h).unwrap();
        assert_eq!(a1, request_id(&alice, &h).unwrap());
        assert_ne!(a1, request_id(&bob, &h).unwrap());
        assert_ne!(
            request_id(&alice, &HeaderMap::new()).unwrap(),
            request_id(&alice, &HeaderMap::new()).unwrap()
        );
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_static(""));
        assert!(request_id(&alice, &h).is_err());
    }
}
