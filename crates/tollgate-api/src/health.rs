//! Operations endpoints, for every role: `/healthz` (the process answers),
//! `/readyz` (the store answers a PING, every loop of the process beats:
//! see [`Loops`](tollgate_core::metrics::Loops), and the store keeps the
//! durability asked for: its setting is in the answer, `durability`), `/metrics` (the process's one
//! registry, the shared state read at scrape time). The api serves them on its
//! own port; a worker or a throttler serves them alone on `--metrics-listen`
//! ([`serve`]).
//!
//! A role listens from its start, before its store answers: a role started
//! while Redis is down waits for it, and meanwhile [`Starting`] answers
//! `/healthz` (the process is up: a liveness probe must not restart it) and
//! everything else with 503 `backend-unavailable` and `Retry-After: 1`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;
use tollgate_core::backend::Backends;
use tollgate_core::durability::{DurabilityCheck, DurabilityReport};
use tollgate_core::error::StoreError;
use tollgate_core::job::JobQueue;
use tollgate_core::keystore::KeyStore;
use tollgate_core::metrics::{Metrics, CONTENT_TYPE as METRICS_CONTENT_TYPE, STATS_TIMEOUT};
use tollgate_core::throttle::Throttle;
use tower::ServiceExt;

use crate::problem::ApiError;
use crate::state::ApiState;

/// What the probes read: the store (readiness), the process's metrics and
/// loops, and the shared state behind the scrape-time gauges.
#[derive(Clone, Debug)]
pub struct Probes {
    pub keys: Arc<dyn KeyStore>,
    pub jobs: Arc<dyn JobQueue>,
    pub throttle: Arc<dyn Throttle>,
    pub metrics: Arc<Metrics>,
    pub durability: Arc<dyn DurabilityCheck>,
}

impl Probes {
    pub fn new(backends: &Backends) -> Self {
        Self {
            keys: Arc::clone(&backends.keys),
            jobs: Arc::clone(&backends.jobs),
            throttle: Arc::clone(&backends.throttle),
            metrics: Arc::clone(&backends.metrics),
            durability: Arc::clone(&backends.durability),
        }
    }

    /// Ready: the store answers, no loop of the process is overdue or ended,
    /// and the store keeps the durability asked for (read now: a Redis
    /// restarted or reconfigured since the start is judged again).
    pub async fn ready(&self) -> Result<DurabilityReport, ApiError> {
        if let Err(e) = self.keys.ping().await {
            // Connections refused for their Redis's durability answer no
            // call: say why, rather than "cannot be reached".
            return Err(match self.durability.refused() {
                Some(problem) => ApiError::NotReady(problem),
                None => e.into(),
            });
        }
        let mut problems = self.metrics.loops().problems();
        let durability = self.durability.check().await;
        problems.extend(durability.problem.clone());
        if problems.is_empty() {
            Ok(durability)
        } else {
            Err(ApiError::NotReady(problems.join("; ")))
        }
    }

    /// The exposition, after reading the shared state (bounded by
    /// [`STATS_TIMEOUT`]; what did not answer is left out and counted).
    pub async fn render(&self) -> String {
        let failed = self
            .metrics
            .refresh(self.jobs.as_ref(), self.throttle.as_ref(), STATS_TIMEOUT)
            .await;
        for error in failed {
            tracing::warn!(%error, "metrics: shared state left out of this scrape");
        }
        self.metrics.render()
    }
}

pub async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn ready(probes: &Probes) -> Result<Response, ApiError> {
    let durability = probes.ready().await?;
    Ok(axum::Json(json!({"status": "ready", "durability": durability})).into_response())
}

async fn exposition(probes: &Probes) -> Response {
    (
        [(CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        probes.render().await,
    )
        .into_response()
}

pub async fn readyz(State(state): State<ApiState>) -> Result<Response, ApiError> {
    ready(&state.probes()).await
}

pub async fn metrics(State(state): State<ApiState>) -> Response {
    exposition(&state.probes()).await
}

/// `/healthz`, `/readyz` and `/metrics` alone: a worker's or a throttler's
/// `--metrics-listen`.
pub fn router(probes: Probes) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route(
            "/readyz",
            get(|State(p): State<Probes>| async move { ready(&p).await }),
        )
        .route(
            "/metrics",
            get(|State(p): State<Probes>| async move { exposition(&p).await }),
        )
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .with_state(probes)
}

/// Serves `app` (a role's [`router`], or a [`Starting`]'s) on `listener`
/// until `shutdown` resolves.
pub async fn serve(
    app: Router,
    listener: impl Into<crate::edge::Listener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = listener.into();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "probes and metrics listening");
    }
    crate::edge::serve(app, listener, shutdown).await
}

/// A role's listener from its start to its exit: until [`Starting::ready`]
/// hands it the role's router, `/healthz` is 200 and every other request is
/// 503 `backend-unavailable` with `Retry-After: 1` (the store is not reached
/// yet); from then on the role's router answers everything.
#[derive(Clone, Debug, Default)]
pub struct Starting {
    app: Arc<OnceLock<Router>>,
}

impl Starting {
    /// The role's router answers from now on (a second call changes nothing).
    pub fn ready(&self, app: Router) {
        let _ = self.app.set(app);
    }

    /// What the listener serves.
    pub fn router(&self) -> Router {
        let app = Arc::clone(&self.app);
        Router::new().fallback_service(tower::service_fn(move |request: Request| {
            let app = app.get().cloned();
            async move {
                match app {
                    Some(app) => app.oneshot(request).await,
                    None => Ok::<_, Infallible>(starting(&request)),
                }
            }
        }))
    }
}

fn starting(request: &Request) -> Response {
    if request.uri().path() == "/healthz" {
        return axum::Json(json!({"status": "ok"})).into_response();
    }
    ApiError::Store(StoreError::unavailable(
        "starting: the store does not answer yet",
    ))
    .into_response()
}
