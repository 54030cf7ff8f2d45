//! The dashboard's history: the sampler each api process runs, and `GET
//! /admin/history`, the charts' points over the last hour.
//!
//! **Sampling.** Every api process with a `--history-interval-ms` runs one
//! task: it reads the gauges (each queue's depth and jobs running, each
//! provider's waiters, the workers and throttlers alive) and asks the
//! activity log to write the sample of the current slot
//! ([`ActivityLog::sample`]). The store's clock picks the slot and the first
//! process to sample it writes it: at most one sample per interval however
//! many pods run, and a slot no pod sampled stays empty (a gap). The log
//! answers when the next slot begins; the task sleeps until then, plus a
//! little jitter, so each pod tries each slot once.
//!
//! **Points.** A point is a sample read back: the gauges as sampled, and for
//! the counters (calls, denials, grants, upstream answers) what changed since
//! the slot before. After a gap (the previous slot has no sample) the counts
//! are `null`: nothing is known of that interval but the gauges.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tollgate_core::activity::{
    ActivityLog, Gauges, Sample, Sampled, ANSWER_CLASSES, HISTORY_INTERVAL, HISTORY_SPAN,
};
use tollgate_core::job::JobQueue;
use tollgate_core::throttle::Throttle;

use super::access::Operator;
use super::{counted, Dashboard};
use crate::extract::QueryParams;
use crate::problem::ApiError;
use crate::state::ApiState;

/// How far back the charts go.
pub const CHART_SPAN: Duration = Duration::from_secs(3600);
/// The ring read from the store at most this often per process.
const REFRESH: Duration = Duration::from_secs(1);

/// The samples this process has read, by slot: refreshed with only the slots
/// after the newest it holds (slots are written in the order of the store's
/// clock, so none can appear before it).
#[derive(Debug, Default)]
pub(crate) struct Ring {
    samples: BTreeMap<u64, Sample>,
    read_at: Option<Instant>,
}

impl Ring {
    /// Reads the samples written since the last read (at most once per
    /// [`REFRESH`]), and forgets those past [`HISTORY_SPAN`].
    pub(super) async fn refresh(
        &mut self,
        activity: &dyn ActivityLog,
        now_ms: u64,
    ) -> Result<(), ApiError> {
        if self.read_at.is_some_and(|at| at.elapsed() < REFRESH) {
            return Ok(());
        }
        let after = self.samples.keys().next_back().copied();
        for s in activity.history(after).await? {
            self.samples.insert(s.at_ms, s);
        }
        let horizon = now_ms.saturating_sub(HISTORY_SPAN.as_millis() as u64);
        self.samples = self.samples.split_off(&horizon);
        self.read_at = Some(Instant::now());
        Ok(())
    }

    /// The newest sample at or before `at_ms`.
    pub(super) fn at_or_before(&self, at_ms: u64) -> Option<&Sample> {
        self.samples.range(..=at_ms).next_back().map(|(_, s)| s)
    }
}

/// Starts the sampler of `dashboard` (see the module docs); it ends once the
/// dashboard is dropped. Without a Tokio runtime it does not start.
pub fn spawn(
    dashboard: Weak<Dashboard>,
    jobs: Arc<dyn JobQueue>,
    throttle: Arc<dyn Throttle>,
    interval: Duration,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!("no runtime: the dashboard's history is not sampled by this process");
        return;
    };
    runtime.spawn(async move {
        loop {
            let Some(activity) = dashboard.upgrade().map(|d| Arc::clone(&d.activity)) else {
                return;
            };
            let next = match sample(
                activity.as_ref(),
                jobs.as_ref(),
                throttle.as_ref(),
                interval,
            )
            .await
            {
                Ok(s) => s.next_in,
                Err(e) => {
                    tracing::debug!(error = %e, "dashboard history: no sample this time");
                    interval
                }
            };
            drop(activity);
            tokio::time::sleep(next + jitter(interval)).await;
        }
    });
}

/// A pause after the slot's start before sampling it: 10 to 500 ms (at most
/// a tenth of the interval), different per pod and per round, so pods do not
/// all sample at the same instant, and a sample lands inside its slot.
fn jitter(interval: Duration) -> Duration {
    let most = (interval / 10).clamp(Duration::from_millis(10), Duration::from_millis(500));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    Duration::from_millis(10) + most.mul_f64(f64::from(nanos % 1000) / 1000.0)
}

/// Reads the gauges and writes the slot's sample unless a pod has.
pub async fn sample(
    activity: &dyn ActivityLog,
    jobs: &dyn JobQueue,
    throttle: &dyn Throttle,
    interval: Duration,
) -> Result<Sampled, ApiError> {
    let (queues, providers) = tokio::join!(jobs.stats(), throttle.stats());
    let (queues, providers) = (queues?, providers.map_err(super::throttle_error)?);
    let gauges = Gauges {
        queued: queues
            .iter()
            .map(|q| (q.operation.clone(), q.queued))
            .collect(),
        running: queues
            .iter()
            .map(|q| (q.operation.clone(), q.running))
            .collect(),
        waiters: providers
            .iter()
            .map(|p| (p.provider.clone(), p.waiters))
            .collect(),
        workers: queues.iter().filter_map(|q| q.workers).max(),
        throttlers: providers.iter().filter_map(|p| p.throttlers).max(),
    };
    Ok(activity.sample(interval, &gauges).await?)
}

#[derive(Debug, Deserialize)]
pub struct HistoryQuery {
    /// Only the points after this slot (ms): a page polls for what is new.
    after_ms: Option<u64>,
}

/// `GET /admin/history`: see [`History`].
#[derive(Debug, Serialize)]
pub struct History {
    /// The store's clock now.
    pub now_ms: u64,
    /// The sampling interval (this process's, or the default): two points
    /// further apart than this have a gap between them.
    pub interval_ms: u64,
    /// How far back the charts go.
    pub span_ms: u64,
    /// Oldest first, over the last [`CHART_SPAN`] (after `after_ms`).
    pub points: Vec<Point>,
}

/// One sample as the charts draw it.
#[derive(Debug, Serialize)]
pub struct Point {
    pub at_ms: u64,
    /// New charges (calls) and budget denials since the slot before, over
    /// every operation; `null` after a gap.
    pub calls: Option<u64>,
    pub denials: Option<u64>,
    /// Jobs queued and running, over every operation.
    pub queued: u64,
    pub running: u64,
    /// Alive; `null` embedded.
    pub workers: Option<u64>,
    pub throttlers: Option<u64>,
    pub providers: BTreeMap<String, ProviderPoint>,
}

#[derive(Debug, Serialize)]
pub struct ProviderPoint {
    pub waiters: u64,
    /// Grants per second since the slot before; `null` after a gap.
    pub grants_per_sec: Option<f64>,
    /// The upstream's answers by class since the slot before; `null` after
    /// a gap.
    pub answers: Option<BTreeMap<String, u64>>,
}

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, key: &str) -> u64 {
    counted(
        before.get(key).copied().unwrap_or(0),
        after.get(key).copied().unwrap_or(0),
    )
}

fn total(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> u64 {
    after.keys().map(|k| delta(before, after, k)).sum()
}

/// `sample` as a point, with `before` the sample of the slot before (`None`:
/// a gap, or the oldest kept).
fn point(
    sample: &Sample,
    before: Option<&Sample>,
    providers: &[String],
    interval_ms: u64,
) -> Point {
    let (g, c) = (&sample.gauges, &sample.counters);
    let b = before.map(|b| &b.counters);
    Point {
        at_ms: sample.at_ms,
        calls: b.map(|b| total(&b.calls, &c.calls)),
        denials: b.map(|b| total(&b.denials, &c.denials)),
        queued: g.queued.values().sum(),
        running: g.running.values().sum(),
        workers: g.workers,
        throttlers: g.throttlers,
        providers: providers
            .iter()
            .map(|p| {
                let view = ProviderPoint {
                    waiters: g.waiters.get(p).copied().unwrap_or(0),
                    grants_per_sec: b.map(|b| {
                        delta(&b.grants, &c.grants, p) as f64 / (interval_ms as f64 / 1000.0)
                    }),
                    answers: b.map(|b| {
                        ANSWER_CLASSES
                            .iter()
                            .map(|class| {
                                let key = format!("{p} {class}");
                                ((*class).to_owned(), delta(&b.answers, &c.answers, &key))
                            })
                            .collect()
                    }),
                };
                (p.clone(), view)
            })
            .collect(),
    }
}

/// The points of `ring` after `after_ms`, within [`CHART_SPAN`] of `now_ms`.
pub(super) fn points(
    ring: &Ring,
    after_ms: Option<u64>,
    now_ms: u64,
    providers: &[String],
    interval_ms: u64,
) -> Vec<Point> {
    let from = now_ms
        .saturating_sub(CHART_SPAN.as_millis() as u64)
        .max(after_ms.map_or(0, |a| a + 1));
    ring.samples
        .range(from..)
        .map(|(at, s)| {
            let before = at
                .checked_sub(interval_ms)
                .and_then(|b| ring.samples.get(&b));
            point(s, before, providers, interval_ms)
        })
        .collect()
}

/// `GET /admin/history`
pub async fn history(
    _: Operator,
    State(state): State<ApiState>,
    QueryParams(q): QueryParams<HistoryQuery>,
) -> Result<Response, ApiError> {
    let dash = &state.dashboard;
    let interval_ms = state
        .settings
        .history_interval
        .unwrap_or(HISTORY_INTERVAL)
        .as_millis() as u64;
    let now_ms = tollgate_core::clock::Clock::now_ms(&tollgate_core::clock::SystemClock);
    let mut sampler = dash.sampler.lock().await;
    sampler.ring.refresh(dash.activity.as_ref(), now_ms).await?;
    let providers: Vec<String> = state.config.providers().map(|p| p.name.clone()).collect();
    let body = History {
        now_ms,
        interval_ms,
        span_ms: CHART_SPAN.as_millis() as u64,
        points: points(&sampler.ring, q.after_ms, now_ms, &providers, interval_ms),
    };
    drop(sampler);
    let mut response = axum::Json(body).into_response();
    response.headers_mut().insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    Ok(response)
}

/// The history's schema in the OpenAPI document.
pub fn schema() -> serde_json::Value {
    let int = serde_json::json!({"type": "integer"});
    let nullable_int = serde_json::json!({"type": ["integer", "null"]});
    serde_json::json!({
        "type": "object",
        "required": ["now_ms", "interval_ms", "span_ms", "points"],
        "properties": {
            "now_ms": int,
            "interval_ms": int,
            "span_ms": int,
            "points": {"type": "array", "items": {
                "type": "object",
                "required": ["at_ms", "calls", "denials", "queued", "running", "workers", "throttlers", "providers"],
                "properties": {
                    "at_ms": int,
                    "calls": nullable_int,
                    "denials": nullable_int,
                    "queued": int,
                    "running": int,
                    "workers": nullable_int,
                    "throttlers": nullable_int,
                    "providers": {"type": "object", "additionalProperties": {
                        "type": "object",
                        "required": ["waiters", "grants_per_sec", "answers"],
                        "properties": {
                            "waiters": int,
                            "grants_per_sec": {"type": ["number", "null"]},
                            "answers": {"type": ["object", "null"], "additionalProperties": int},
                        },
                    }},
                },
            }},
        },
    })
}
