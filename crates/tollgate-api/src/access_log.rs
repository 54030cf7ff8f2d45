//! The access log: one line per finished request (`--access-log`,
//! `TOLLGATE_ACCESS_LOG`), at `info` on the target `tollgate::access`, with
//! the call's `trace_id`, the `user` (and `service_key`) who made it, its
//! `operation` and `cost` (the price of a metered route; absent elsewhere),
//! the `status` and the `latency_ms` until the answer's head was ready.
//! With `--log-format json` on every pod, `grep <trace id>` finds the api's
//! side of any call, a successful one included.
//!
//! What the line says is gathered while the request runs: the middleware puts
//! an [`AccessNote`] into the request's extensions; authentication notes the
//! caller ([`AccessNote::caller`]) and the [`Cost`](crate::cost::Cost) layer
//! the price ([`AccessNote::priced`]). Each answer also carries the trace as
//! `traceresponse` (W3C Trace Context level 2), so a client that sent no
//! `traceparent` still learns the trace id its call is logged under.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{Extensions, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tollgate_core::trace::TraceParent;

use crate::state::ApiState;

/// The log target of the access lines (filter them with
/// `RUST_LOG=...,tollgate::access=info`).
pub const TARGET: &str = "tollgate::access";

#[derive(Debug, Default)]
struct Fields {
    user: Option<String>,
    service_key: Option<String>,
    operation: Option<String>,
    cost: Option<u64>,
}

/// What the request's handlers learn about it for its access line: shared
/// with the middleware, which writes the line once the answer is ready.
#[derive(Debug, Clone, Default)]
pub struct AccessNote(Arc<Mutex<Fields>>);

impl AccessNote {
    fn fields(&self) -> std::sync::MutexGuard<'_, Fields> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The authenticated caller of the request in `ext`, if it is noted.
    pub fn caller(ext: &Extensions, user: &str, service_key: Option<&str>) {
        if let Some(note) = ext.get::<Self>() {
            let mut f = note.fields();
            f.user = Some(user.to_owned());
            f.service_key = service_key.map(str::to_owned);
        }
    }

    /// The operation and price of the metered request in `ext`.
    pub fn priced(ext: &Extensions, operation: &str, cost: u64) {
        if let Some(note) = ext.get::<Self>() {
            let mut f = note.fields();
            f.operation = Some(operation.to_owned());
            f.cost = Some(cost);
        }
    }
}

/// The middleware: sets `traceresponse`, and with the access log on, writes
/// the request's line.
pub async fn middleware(State(state): State<ApiState>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let trace = req.extensions().get::<TraceParent>().cloned();
    let enabled = state.settings.access_log;
    let note = AccessNote::default();
    if enabled {
        req.extensions_mut().insert(note.clone());
    }
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().clone();
    let mut response = next.run(req).await;
    if let Some(trace) = &trace {
        if let Ok(v) = HeaderValue::from_str(&trace.to_string()) {
            response.headers_mut().insert("traceresponse", v);
        }
    }
    if enabled {
        let f = note.fields();
        let latency_ms = started.elapsed().as_secs_f64() * 1000.0;
        tracing::info!(
            target: TARGET,
            trace_id = trace.as_ref().map(TraceParent::trace_id),
            method = %method,
            route = route.as_str(),
            status = response.status().as_u16(),
            user = f.user.as_deref(),
            service_key = f.service_key.as_deref(),
            operation = f.operation.as_deref(),
            cost = f.cost,
            latency_ms = (latency_ms * 10.0).round() / 10.0,
            "request finished"
        );
    }
    response
}
