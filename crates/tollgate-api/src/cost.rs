//! [`Cost`]: the tower layer that states a route's price where the route is
//! declared, for the job the route's handler submits.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{body::Body, http::Request, routing::post, Extension, Router};
//! use tollgate_api::cost::{Budget, Cost, Priced};
//! use tollgate_core::{config::Config, ledger::Ledger, id::UserId};
//! use tollgate_memory::ledger::MemoryLedger;
//! use tower::ServiceExt;
//!
//! // A job route's handler: it submits the job that charges `priced.cost`
//! // (here it only says what it would charge).
//! async fn summarize(priced: Priced) -> String {
//!     format!("{} would pay {} tokens", priced.user, priced.cost)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let config = Arc::new(Config::builtin());
//! let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
//! let app: Router = Router::new()
//!     .route("/summarize", post(summarize).layer(Cost::job(8)))
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
//! // The layer states the price; only the job's submission charges it.
//! assert_eq!(ledger.usage(&UserId::new("alice").expect("id")).await.expect("usage").used, 0);
//! # }
//! ```
//!
//! A route is priced by a fixed cost ([`Cost::job`]), the `cost` of the
//! operation its path names ([`Cost::per_operation`]) or its pass-through
//! operation ([`Cost::passthrough`]). The layer states the price and hands
//! the handler a [`Priced`]; the handler submits a job, and the job's
//! submission is the one place that charges it
//! ([`tollgate_core::job::JobQueue::submit`]), after the body has been read and
//! fingerprinted. The layer never charges or releases: the job owns its charge.
//!
//! The handler runs in a spawned task that the request awaits: when the
//! client disconnects, hyper drops the request's future, but the task goes on
//! to the end, so a submission is never cut off half way by a client.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    config::Config,
    id::{RequestId, UserId},
    ledger::Ledger,
};
use tower::{Layer, Service};

use crate::extract::extension;
use crate::problem::ApiError;
use tollgate_core::metrics::Metrics;

/// The header a client sets to make a retry safe.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Longest accepted `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// What the [`Cost`] layer prices with: put it in the request extensions
/// (`.layer(Extension(budget))`).
#[derive(Clone, Debug)]
pub struct Budget {
    ledger: Arc<dyn Ledger>,
    config: Arc<Config>,
    metrics: Option<Arc<Metrics>>,
    in_flight: InFlight,
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
        }
    }

    /// Counts this budget's metered tasks in `in_flight`.
    pub fn with_in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// Counts reservations in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    pub fn metrics(&self) -> Option<&Arc<Metrics>> {
        self.metrics.as_ref()
    }
}

/// A route's price. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    price: Price,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Price {
    Tokens(u64),
    PerOperation,
    PassThrough,
}

impl Cost {
    /// A job route's fixed price (>= 1), stated at the route: the handler
    /// receives a [`Priced`], and the job's submission charges it.
    pub const fn job(n: u64) -> Self {
        Self {
            price: Price::Tokens(n),
        }
    }

    /// A job route priced by the `cost` of the operation named by its
    /// `{operation}` path parameter, from the config's `[operations.*]`;
    /// unknown operations get a 404. The job's submission charges it.
    pub const fn per_operation() -> Self {
        Self {
            price: Price::PerOperation,
        }
    }

    /// A pass-through job route (`/v1/passthrough/{provider}/{*path}`):
    /// priced by the operation of that provider whose `path` is the rest of
    /// the request's path ([`Config::passthrough`]); none: 404.
    pub const fn passthrough() -> Self {
        Self {
            price: Price::PassThrough,
        }
    }

    /// The fixed price, if it is one.
    pub fn fixed(&self) -> Option<u64> {
        match self.price {
            Price::Tokens(n) => Some(n),
            Price::PerOperation | Price::PassThrough => None,
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
            priced(inner, cost, req, gone).await
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

/// Signals [`Priced::client_gone`] when the request's future is dropped.
struct ClientGuard(watch::Sender<bool>);

impl Drop for ClientGuard {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

/// A job route's price, stated by its [`Cost`] layer; extract it in the
/// handler, which submits the job that charges it.
#[derive(Debug, Clone)]
pub struct Priced {
    pub user: UserId,
    /// The operation (the `{operation}` path parameter, or the last segment of
    /// the path).
    pub operation: String,
    pub cost: u64,
    gone: watch::Receiver<bool>,
}

impl Priced {
    /// Resolves when the client has gone away (hyper dropped the request): the
    /// handler may stop waiting for a result nobody will read (the job owns its
    /// charge, whatever the handler does).
    pub async fn client_gone(&self) {
        client_gone(&self.gone).await;
    }
}

async fn client_gone(gone: &watch::Receiver<bool>) {
    let mut gone = gone.clone();
    let _ = gone.wait_for(|g| *g).await;
}

impl<S: Send + Sync> FromRequestParts<S> for Priced {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        extension(parts, || {
            ApiError::Internal("the route has no job Cost layer".into())
        })
    }
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
    let params = match RawPathParams::from_request_parts(parts, &()).await {
        Ok(params) => params,
        Err(e) => {
            return Err(ApiError::Malformed {
                detail: format!("bad path parameter: {e}"),
                field: Some("operation".into()),
            })
        }
    };
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    };
    let operation = param("operation");
    if cost.price == Price::PassThrough {
        let provider = param("provider").unwrap_or_default();
        let path = format!("/{}", param("path").unwrap_or_default());
        return match budget.config.passthrough(&provider, &path) {
            Some(op) => Ok((op.charged_cost(), op.name.clone())),
            None => Err(ApiError::UnknownOperation(format!(
                "no operation of provider {:?} has the path {:?}",
                crate::problem::echo(&provider),
                crate::problem::echo(&path)
            ))),
        };
    }
    match cost.price {
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
        Price::PassThrough => Err(ApiError::Internal("priced above".into())),
        Price::PerOperation => {
            let name = operation.ok_or_else(|| {
                ApiError::Internal("Cost::per_operation on a route without {operation}".into())
            })?;
            match budget.config.operation(&name) {
                // A job's charge up front: the most, for an operation that
                // settles down from it.
                Some(op) => Ok((op.charged_cost(), name)),
                None => Err(ApiError::UnknownOperation(format!(
                    "unknown operation {:?} (operations: {})",
                    crate::problem::echo(&name),
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

async fn priced<S>(mut inner: S, cost: Cost, req: Request, gone: watch::Receiver<bool>) -> Response
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
    crate::access_log::AccessNote::priced(&parts.extensions, &operation, tokens);
    parts.extensions.insert(Priced {
        user,
        operation,
        cost: tokens,
        gone,
    });
    let Ok(response) = inner.call(Request::from_parts(parts, body)).await;
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use axum::routing::post;
    use axum::{Extension, Router};
    use tollgate_memory::ledger::MemoryLedger;
    use tower::ServiceExt;

    fn app(handler: axum::routing::MethodRouter) -> (Router, Arc<dyn Ledger>) {
        let config = Arc::new(Config::builtin());
        let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let app = Router::new()
            .route("/op", handler.layer(Cost::job(8)))
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
    async fn the_layer_states_the_price_and_charges_nothing() {
        let (app, ledger) = app(post(|p: Priced| async move {
            format!("{} {} {}", p.user, p.operation, p.cost)
        }));
        let r = app
            .oneshot(
                Request::post("/op")
                    .body(axum::body::Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body = axum::body::to_bytes(r.into_body(), 1024).await.unwrap();
        assert_eq!(&body[..], b"alice op 8");
        assert_eq!(ledger.usage(&alice()).await.unwrap().used, 0);
    }

    #[tokio::test]
    async fn a_dropped_request_finishes_its_handler_and_signals_client_gone() {
        let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
        let done_tx = Arc::new(std::sync::Mutex::new(Some(done_tx)));
        let (app, _ledger) = app(post(move |p: Priced| async move {
            p.client_gone().await;
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
