//! Operations endpoints: `/healthz` (the process answers), `/readyz` (the
//! backing store answers), `/metrics` (Prometheus text).

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::problem::ApiError;
use crate::state::ApiState;

pub async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

pub async fn readyz(State(state): State<ApiState>) -> Result<Response, ApiError> {
    state.keys.ping().await?;
    Ok(axum::Json(json!({"status": "ready"})).into_response())
}

pub async fn metrics(State(state): State<ApiState>) -> Response {
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}
