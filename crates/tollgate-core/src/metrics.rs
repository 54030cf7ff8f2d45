//! [`Metrics`]: the one Prometheus registry of a process, shared by every role
//! in it (`tollgate all` serves one registry for api, worker and throttler),
//! and [`Loops`], the beats of the roles' loops that `/readyz` reads.
//!
//! Counters and histograms are observed where things happen: the api's
//! requests, the ledger's steps ([`ObservedLedger`]), a provider call's
//! throttle wait and attempts (`tollgate_providers::ThrottledClient`), a
//! worker's jobs, a throttler's grants. Gauges of shared state (queue depths,
//! dead lists, waiters, tokens, live workers and throttlers) are read at scrape
//! time from [`JobQueue::stats`] and [`Throttle::stats`] ([`Metrics::refresh`]),
//! so every pod shows the same numbers: aggregate them with `max`, not `sum`.
//!
//! Every label is bounded: provider, pool member, operation and plan names come from the
//! config, outcomes and causes from fixed lists, routes from the route table.
//! No user id or request id is ever a label.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::config::Config;
use crate::job::{JobQueue, Maintenance, QueueStats};
use crate::ledger::LedgerError;
use crate::lock;
use crate::throttle::{ProviderStats, Throttle};

/// `Content-Type` of [`Metrics::render`]: the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How long [`Metrics::refresh`] waits for the shared state by default.
pub const STATS_TIMEOUT: Duration = Duration::from_secs(2);

/// Scrapes closer together than this share one read of the shared state:
/// `/metrics` needs no credentials, so its cost to Redis is bounded by time,
/// not by how often it is asked.
pub const STATS_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Latency of an api call end to end, in seconds.
const REQUEST_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// One ledger step (a script on Redis, a lock in memory), in seconds.
const LEDGER_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];
/// The steps of [`ObservedLedger`] (the `step` label).
///
/// [`ObservedLedger`]: crate::observed::ObservedLedger
const LEDGER_STEPS: [&str; 14] = [
    "reserve",
    "refund",
    "settle",
    "usage",
    "charge",
    "claim",
    "release",
    "set_plan",
    "plan",
    "set_limits",
    "clear_limits",
    "custom_limits",
    "orgs",
    "move",
];
/// A wait for a throttle grant, in seconds: dense around the usual `max_wait`
/// values, so that "p95 above half of max_wait" is read from real buckets.
const WAIT_BUCKETS: [f64; 18] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
    60.0, 120.0,
];
/// One upstream HTTP attempt, in seconds.
const CALL_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabel {
    operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationOutcome {
    operation: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
    method: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabel {
    step: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The results of [`Metrics::alert_delivery`].
pub const ALERT_RESULTS: [&str; 3] = ["delivered", "retried", "failed"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PlanLabel {
    plan: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLabel {
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderOutcome {
    provider: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderClass {
    provider: String,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MemberLabel {
    provider: String,
    member: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MemberOutcome {
    provider: String,
    member: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderReason {
    provider: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderDirection {
    provider: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SpendLabels {
    provider: String,
    operation: String,
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn counters<L: Clone + std::hash::Hash + Eq>() -> Family<L, Counter> {
    Family::default()
}

fn histograms<L: Clone + std::hash::Hash + Eq>(make: fn() -> Histogram) -> Histograms<L> {
    Family::new_with_constructor(make)
}

/// How one upstream attempt ended: the `outcome` of
/// `tollgate_provider_call_duration_seconds` and, for a failure, the `class`
/// of `tollgate_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// 2xx with a JSON body.
    Ok,
    /// 429 Too Many Requests: the upstream's own limit was hit.
    RateLimited,
    /// 5xx.
    ServerError,
    /// Another 4xx.
    ClientError,
    /// No answer: connection refused, reset, timed out.
    Transport,
    /// 2xx whose body is not JSON.
    BadResponse,
}

impl CallOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::RateLimited => "429",
            Self::ServerError => "5xx",
            Self::ClientError => "4xx",
            Self::Transport => "transport",
            Self::BadResponse => "bad_response",
        }
    }

    /// The dashboard's class of this outcome: one of
    /// [`ANSWER_CLASSES`](crate::activity::ANSWER_CLASSES).
    pub fn answer_class(self) -> &'static str {
        match self {
            Self::Ok | Self::BadResponse => "2xx",
            Self::ClientError => "4xx",
            Self::RateLimited => "429",
            Self::ServerError => "5xx",
            Self::Transport => "timeout",
        }
    }

    /// The class of an HTTP status (`None` when no status came back).
    pub fn of_status(status: Option<u16>) -> Self {
        match status {
            None => Self::Transport,
            Some(429) => Self::RateLimited,
            Some(s) if s >= 500 => Self::ServerError,
            Some(s) if (200..300).contains(&s) => Self::BadResponse,
            Some(_) => Self::ClientError,
        }
    }
}

/// How a worker ended a job it took: the `outcome` of `tollgate_worker_jobs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// The result is recorded.
    Succeeded,
    /// The failure is recorded and the charge released.
    Failed,
    /// Back in its queue, the attempt not counted (shutdown, throttle store down).
    HandedBack,
    /// Its charge was not its own any more: failed unrun.
    Unpaid,
    /// Another worker holds it now: nothing recorded.
    LeaseLost,
    /// Recording failed until the worker gave up: the lease expires and the job runs again.
    Unrecorded,
}

impl JobEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::HandedBack => "handed_back",
            Self::Unpaid => "unpaid",
            Self::LeaseLost => "lease_lost",
            Self::Unrecorded => "unrecorded",
        }
    }
}

/// The shared state as the last [`Metrics::refresh`] read it; `None`: that
/// source did not answer (its gauges are left out of the scrape).
#[derive(Debug, Default)]
struct Snapshot {
    queues: Option<Vec<QueueStats>>,
    providers: Option<Vec<ProviderStats>>,
}

/// Encodes the [`Snapshot`] at scrape time.
#[derive(Debug, Default)]
struct StatsCollector {
    snapshot: Mutex<Snapshot>,
}

/// The shared-state gauges: name and help.
const QUEUE_DEPTH: (&str, &str) = (
    "tollgate_queue_depth",
    "Jobs waiting for a worker, per operation (shared state: the same from every pod).",
);
const QUEUE_RUNNING: (&str, &str) = (
    "tollgate_queue_running",
    "Jobs a worker holds now, per operation (shared state).",
);
const QUEUE_DEAD: (&str, &str) = (
    "tollgate_queue_dead",
    "Malformed entries moved to the dead list, per operation (shared state).",
);
const QUEUE_WORKERS: (&str, &str) = (
    "tollgate_queue_workers",
    "Workers alive on the queue of each operation (shared state; absent when embedded).",
);
const THROTTLE_WAITERS: (&str, &str) = (
    "tollgate_throttle_waiters",
    "Calls queued for a slot of each provider (shared state).",
);
const THROTTLE_USERS: (&str, &str) = (
    "tollgate_throttle_users_waiting",
    "Users with calls queued for a slot of each provider (shared state; a fair provider \
     serves them in weighted round robin).",
);
const THROTTLE_TOKENS: (&str, &str) = (
    "tollgate_throttle_tokens",
    "Tokens in each provider's bucket now (shared state).",
);
const THROTTLE_PAUSED: (&str, &str) = (
    "tollgate_throttle_paused_seconds",
    "How long each provider's bucket still grants nothing after the upstream refused a call \
     (a 429, or a 503 with Retry-After); 0 when it is not paused (shared state).",
);
const THROTTLE_EFFECTIVE_RATE: (&str, &str) = (
    "tollgate_throttle_effective_rate",
    "The rate each provider's bucket refills at now: its rate, or less on an adaptive provider \
     after the upstream refused calls (AIMD; shared state).",
);
const THROTTLE_LIMIT_AVAILABLE: (&str, &str) = (
    "tollgate_throttle_limit_available",
    "What each limit of each provider holds now: requests, or tokens of weight (limit: rate for \
     the rate/burst bucket, else requests/<per> or tokens/<per>; shared state).",
);
const THROTTLE_LIMIT_RATE: (&str, &str) = (
    "tollgate_throttle_limit_rate",
    "What each limit of each provider refills at now, per second (the rate bucket's is its \
     effective rate; shared state).",
);
const THROTTLE_THROTTLERS: (&str, &str) = (
    "tollgate_throttle_throttlers",
    "Throttlers alive for each provider (shared state; absent when embedded, where the \
     bucket grants by itself).",
);

const MEMBER_TOKENS: (&str, &str) = (
    "tollgate_pool_member_tokens",
    "Tokens in the request bucket of each member of each provider's pool now (shared state).",
);
const MEMBER_PAUSED: (&str, &str) = (
    "tollgate_pool_member_paused_seconds",
    "How long each pool member's buckets still grant nothing after its upstream refused a \
     call or could not be reached; 0 when it is not paused (shared state).",
);
const MEMBER_EFFECTIVE_RATE: (&str, &str) = (
    "tollgate_pool_member_effective_rate",
    "The rate each pool member's request bucket refills at now (shared state).",
);
const MEMBER_IN_FLIGHT: (&str, &str) = (
    "tollgate_pool_member_in_flight",
    "Slots of its max_concurrent each pool member holds now (shared state).",
);

/// One gauge family of every member of every pool.
fn member_gauges(
    encoder: &mut DescriptorEncoder,
    (name, help): (&str, &str),
    providers: &[ProviderStats],
    value: impl Fn(&crate::throttle::MemberStats) -> f64,
) -> Result<(), std::fmt::Error> {
    if providers.iter().all(|p| p.members.is_empty()) {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for p in providers {
        for m in &p.members {
            let labels = [
                ("provider", p.provider.as_str()),
                ("member", m.member.as_str()),
            ];
            ConstGauge::new(value(m)).encode(metric.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// One gauge family of the snapshot: a series per row that has a value.
fn gauges<T, V: EncodeGaugeValue + std::fmt::Debug>(
    encoder: &mut DescriptorEncoder,
    (name, help): (&str, &str),
    (label, key): (&str, fn(&T) -> &str),
    rows: &[T],
    value: impl Fn(&T) -> Option<V>,
) -> Result<(), std::fmt::Error> {
    let values: Vec<(&str, V)> = rows
        .iter()
        .filter_map(|row| Some((key(row), value(row)?)))
        .collect();
    if values.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (key, v) in values {
        let labels = [(label, key)];
        ConstGauge::new(v).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One gauge family of every limit of every provider.
fn limit_gauges(
    encoder: &mut DescriptorEncoder,
    (name, help): (&str, &str),
    providers: &[ProviderStats],
    value: impl Fn(&crate::throttle::LimitStats) -> f64,
) -> Result<(), std::fmt::Error> {
    if providers.iter().all(|p| p.limits.is_empty()) {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for p in providers {
        for l in &p.limits {
            let labels = [
                ("provider", p.provider.as_str()),
                ("limit", l.limit.as_str()),
            ];
            ConstGauge::new(value(l)).encode(metric.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

fn operation(s: &QueueStats) -> &str {
    &s.operation
}

fn provider(s: &ProviderStats) -> &str {
    &s.provider
}

impl Collector for StatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = lock(&self.snapshot);
        let e = &mut encoder;
        if let Some(q) = &snapshot.queues {
            let by_op = ("operation", operation as fn(&QueueStats) -> &str);
            gauges(e, QUEUE_DEPTH, by_op, q, |s| Some(s.queued))?;
            gauges(e, QUEUE_RUNNING, by_op, q, |s| Some(s.running))?;
            gauges(e, QUEUE_DEAD, by_op, q, |s| Some(s.dead))?;
            gauges(e, QUEUE_WORKERS, by_op, q, |s| s.workers)?;
        }
        if let Some(p) = &snapshot.providers {
            let by_provider = ("provider", provider as fn(&ProviderStats) -> &str);
            gauges(e, THROTTLE_WAITERS, by_provider, p, |s| Some(s.waiters))?;
            gauges(e, THROTTLE_USERS, by_provider, p, |s| Some(s.users))?;
            gauges(e, THROTTLE_TOKENS, by_provider, p, |s| Some(s.tokens))?;
            gauges(e, THROTTLE_THROTTLERS, by_provider, p, |s| s.throttlers)?;
            gauges(e, THROTTLE_PAUSED, by_provider, p, |s| {
                Some(s.paused_ms as f64 / 1000.0)
            })?;
            gauges(e, THROTTLE_EFFECTIVE_RATE, by_provider, p, |s| {
                Some(s.effective_rate)
            })?;
            limit_gauges(e, THROTTLE_LIMIT_AVAILABLE, p, |l| l.available)?;
            limit_gauges(e, THROTTLE_LIMIT_RATE, p, |l| l.rate)?;
            let tokens =
                |m: &crate::throttle::MemberStats| m.limits.first().map_or(0.0, |l| l.available);
            member_gauges(e, MEMBER_TOKENS, p, tokens)?;
            member_gauges(e, MEMBER_PAUSED, p, |m| m.paused_ms as f64 / 1000.0)?;
            member_gauges(e, MEMBER_EFFECTIVE_RATE, p, |m| m.effective_rate)?;
            member_gauges(e, MEMBER_IN_FLIGHT, p, |m| m.in_flight as f64)?;
        }
        Ok(())
    }
}

/// The metrics of one process; see the module docs. Cheap to share (`Arc`).
pub struct Metrics {
    registry: Registry,
    stats: Arc<StatsCollector>,
    /// When the shared state was last read; held while it is read, so that
    /// concurrent scrapes wait for one read instead of each making their own.
    refreshed: tokio::sync::Mutex<Option<Instant>>,
    loops: Loops,
    // api
    reservations: Family<OperationOutcome, Counter>,
    job_outcomes: Family<OperationOutcome, Counter>,
    requests: Family<RouteLabels, Counter>,
    operation_duration: Histograms<OperationLabel>,
    // ledger
    ledger_duration: Histograms<StepLabel>,
    ledger_errors: Family<StepLabel, Counter>,
    denials: Family<PlanLabel, Counter>,
    // throttle, waiter side
    wait: Histograms<ProviderLabel>,
    acquires: Family<ProviderOutcome, Counter>,
    tokens_returned: Family<ProviderReason, Counter>,
    late_grants: Family<ProviderLabel, Counter>,
    redated_grants: Family<ProviderLabel, Counter>,
    pauses: Family<ProviderLabel, Counter>,
    usage_adjustments: Family<ProviderDirection, Counter>,
    usage_adjusted: Family<ProviderDirection, Counter>,
    // throttle, throttler side
    grants: Family<ProviderLabel, Counter>,
    skipped: Family<ProviderLabel, Counter>,
    reclaimed: Family<ProviderLabel, Counter>,
    // pool members (labels only of configured members)
    member_grants: Family<MemberLabel, Counter>,
    member_calls: Family<MemberOutcome, Counter>,
    member_pauses: Family<MemberLabel, Counter>,
    members: BTreeMap<String, Vec<String>>,
    // worker
    in_flight: Family<OperationLabel, Gauge>,
    jobs: Family<OperationOutcome, Counter>,
    worker_releases: Family<CauseLabel, Counter>,
    leases_lost: Family<OperationLabel, Counter>,
    deferred: Family<OperationLabel, Counter>,
    jobs_reclaimed: Counter,
    jobs_abandoned: Counter,
    call_duration: Histograms<ProviderOutcome>,
    upstream_errors: Family<ProviderClass, Counter>,
    retries: Family<ProviderLabel, Counter>,
    absorbed: Family<ProviderReason, Counter>,
    spend: Family<SpendLabels, Counter>,
    // alerts
    alert_deliveries: Family<ResultLabel, Counter>,
    alert_subjects: Gauge,
    alert_overdue: Gauge,
    // scrapes
    stats_errors: Family<SourceLabel, Counter>,
    /// Where each upstream answer is also noted (the dashboard's activity
    /// log), once the backends are built.
    answers_log: std::sync::OnceLock<Arc<dyn crate::activity::ActivityLog>>,
    /// Plan names by limit: a denial's limit names its plan when only one has it.
    plans_by_limit: BTreeMap<u64, Vec<String>>,
    plan_names: Vec<String>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("loops", &self.loops)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// A registry with every metric of every role, the config's providers'
    /// settings as gauges, and the series alerts rely on started at zero (a
    /// counter that appears at 1 hides its first increase from `increase()`).
    pub fn new(config: &Config) -> Self {
        let mut r = Registry::default();
        let stats = Arc::new(StatsCollector::default());
        r.register_collector(Box::new(Arc::clone(&stats)));

        let reservations = counters();
        r.register(
            "tollgate_reservations",
            "Budget reservations by operation and outcome (allowed, denied)",
            reservations.clone(),
        );
        let job_outcomes = counters();
        r.register(
            "tollgate_job_outcomes",
            "Final outcomes of the jobs the api waited for (succeeded, provider, \
             throttle_timeout, expired, abandoned, rejected, ...)",
            job_outcomes.clone(),
        );
        let requests = counters();
        r.register(
            "tollgate_http_requests",
            "HTTP requests by route, method and status",
            requests.clone(),
        );
        let operation_duration = histograms(|| Histogram::new(REQUEST_BUCKETS));
        r.register(
            "tollgate_operation_duration_seconds",
            "Time from request to response of each operation call",
            operation_duration.clone(),
        );

        let ledger_duration = histograms(|| Histogram::new(LEDGER_BUCKETS));
        r.register(
            "tollgate_ledger_duration_seconds",
            "Time of one budget ledger step (reserve, charge, claim, release, refund, settle, \
             usage, plan, set_plan)",
            ledger_duration.clone(),
        );
        let ledger_errors = counters();
        r.register(
            "tollgate_ledger_errors",
            "Budget ledger steps that failed (the store did not answer, bad input), by step",
            ledger_errors.clone(),
        );
        let denials = counters();
        r.register(
            "tollgate_budget_denials",
            "Reservations and charges the budget denied, by the user's plan",
            denials.clone(),
        );

        let wait = histograms(|| Histogram::new(WAIT_BUCKETS));
        r.register(
            "tollgate_throttle_wait_seconds",
            "Time from asking a provider's throttle for a slot to getting it (granted waits only)",
            wait.clone(),
        );
        let acquires = counters();
        r.register(
            "tollgate_throttle_acquires",
            "Waits for a throttle grant by how they ended: granted, timeout (max_wait passed), \
             cancelled (the caller gave up), error (the throttle's store failed)",
            acquires.clone(),
        );
        let tokens_returned = counters();
        r.register(
            "tollgate_throttle_tokens_returned",
            "Tokens handed back to a provider's bucket: cancelled (granted to a waiter that had \
             given up)",
            tokens_returned.clone(),
        );
        let alert_deliveries = Family::<ResultLabel, Counter>::default();
        r.register(
            "tollgate_alert_deliveries",
            "Budget alert webhook attempts by result: delivered (2xx), retried (failed, due \
             again after a back-off), failed (given up past [alerts] keep, or dropped from a \
             full outbox)",
            alert_deliveries.clone(),
        );
        for result in ALERT_RESULTS {
            alert_deliveries
                .get_or_create(&ResultLabel { result })
                .inc_by(0);
        }
        let alert_subjects = Gauge::default();
        r.register(
            "tollgate_alert_outbox_subjects",
            "Users (or organisations) with budget alerts waiting to be delivered, as this pod's \
             deliverer last read it (shared state: aggregate with max)",
            alert_subjects.clone(),
        );
        let alert_overdue = Gauge::default();
        r.register(
            "tollgate_alert_outbox_overdue_seconds",
            "How long the most overdue outbox of budget alerts has been due, as this pod's \
             deliverer last read it (shared state: aggregate with max)",
            alert_overdue.clone(),
        );
        let late_grants = Family::<ProviderLabel, Counter>::default();
        r.register(
            "tollgate_throttle_late_grants",
            "Grants not used because they were too old (a pause or a slow link between the grant \
             and its call): the call waited for a fresh grant, or had given up; the token is not \
             returned",
            late_grants.clone(),
        );
        let redated_grants = Family::<ProviderLabel, Counter>::default();
        r.register(
            "tollgate_throttle_redated_grants",
            "Grants that reached their waiter too old to use and were re-dated to then (the bucket \
             allowed it): used, their token not lost",
            redated_grants.clone(),
        );
        let pauses = Family::<ProviderLabel, Counter>::default();
        r.register(
            "tollgate_throttle_pauses",
            "Upstream refusals (a 429, or a 503 with Retry-After) that paused a provider's \
             bucket for every pod: for the Retry-After, or an exponential back-off",
            pauses.clone(),
        );
        let usage_adjustments = counters();
        r.register(
            "tollgate_throttle_usage_adjustments",
            "Answers whose reported usage differed from the call's weight, by provider and \
             direction: given_back (it used less: the rest went back to the token limits) or \
             taken (it used more)",
            usage_adjustments.clone(),
        );
        let usage_adjusted = counters();
        r.register(
            "tollgate_throttle_usage_adjusted_tokens",
            "Tokens given back to (given_back) or taken from (taken) the token limits of each \
             provider after the answers reported their usage",
            usage_adjusted.clone(),
        );
        let max_wait = Family::<ProviderLabel, Gauge<f64, AtomicU64>>::default();
        r.register(
            "tollgate_throttle_max_wait_seconds",
            "The configured max_wait of each provider: a call fails after waiting this long for a \
             slot",
            max_wait.clone(),
        );
        let rate = Family::<ProviderLabel, Gauge<f64, AtomicU64>>::default();
        r.register(
            "tollgate_throttle_rate",
            "The configured rate of each provider's bucket, tokens per second",
            rate.clone(),
        );
        let burst = Family::<ProviderLabel, Gauge>::default();
        r.register(
            "tollgate_throttle_burst",
            "The configured burst (bucket capacity) of each provider",
            burst.clone(),
        );

        let grants = counters();
        r.register(
            "tollgate_throttler_grants",
            "Slots this throttler granted, by provider",
            grants.clone(),
        );
        let skipped = counters();
        r.register(
            "tollgate_throttler_skipped",
            "Tickets this throttler skipped because nobody waited for them any more, by provider",
            skipped.clone(),
        );
        let reclaimed = counters();
        r.register(
            "tollgate_throttler_reclaimed",
            "Tickets of dead throttlers this throttler put back in the queue, by provider",
            reclaimed.clone(),
        );

        let in_flight: Family<OperationLabel, Gauge> = Family::default();
        r.register(
            "tollgate_worker_jobs_in_flight",
            "Jobs this worker is running now, by operation",
            in_flight.clone(),
        );
        let jobs = counters();
        r.register(
            "tollgate_worker_jobs",
            "Jobs this worker ended, by operation and outcome (succeeded, failed, handed_back, \
             unpaid, lease_lost, unrecorded)",
            jobs.clone(),
        );
        let worker_releases = counters();
        r.register(
            "tollgate_worker_releases",
            "Job charges released to their users' budgets, by cause (provider, throttle_timeout, \
             expired, rejected: by this worker; abandoned: by its maintenance)",
            worker_releases.clone(),
        );
        // The same counters under their name before the glossary's: kept so
        // that operators' alerts and dashboards on it keep working.
        r.register(
            "tollgate_worker_refunds",
            "Deprecated alias of tollgate_worker_releases_total (same counters)",
            worker_releases.clone(),
        );
        let leases_lost = counters();
        r.register(
            "tollgate_worker_leases_lost",
            "Jobs whose lease this worker lost while running them (it was paused or cut off past \
             its lease), by operation",
            leases_lost.clone(),
        );
        let deferred = counters();
        r.register(
            "tollgate_worker_jobs_deferred",
            "Jobs this worker took and put back at the tail of their queue unrun, their user \
             holding its share of the worker's slots (--user-share, or its plan's \
             max_in_flight), by operation",
            deferred.clone(),
        );
        let jobs_reclaimed = Counter::default();
        r.register(
            "tollgate_worker_jobs_reclaimed",
            "Jobs whose lease expired or whose worker died, put back in their queue by this \
             worker's maintenance",
            jobs_reclaimed.clone(),
        );
        let jobs_abandoned = Counter::default();
        r.register(
            "tollgate_worker_jobs_abandoned",
            "Jobs past their attempts, failed and released by this worker's maintenance",
            jobs_abandoned.clone(),
        );
        let call_duration = histograms(|| Histogram::new(CALL_BUCKETS));
        r.register(
            "tollgate_provider_call_duration_seconds",
            "Time of one upstream attempt, by provider and outcome (ok, 429, 5xx, 4xx, transport, \
             bad_response)",
            call_duration.clone(),
        );
        let upstream_errors = counters();
        r.register(
            "tollgate_upstream_errors",
            "Upstream attempts that failed, by provider and class (429, 5xx, 4xx, transport, \
             bad_response)",
            upstream_errors.clone(),
        );
        let retries = counters();
        r.register(
            "tollgate_provider_retries",
            "Upstream attempts retried after a 429, 5xx or transport failure, by provider",
            retries.clone(),
        );

        let absorbed = counters();
        r.register(
            "tollgate_absorbed_calls",
            "Jobs whose charge went back to the user although the upstream may have worked \
             (a 5xx): what the outcome policy costs the operator, by provider and reason",
            absorbed.clone(),
        );
        let spend = counters();
        r.register(
            "tollgate_spend",
            "What finished jobs charged their users, in minor units of the currency (tokens, or \
             micro-units of money), by provider, operation and price sheet entry (`model`: the \
             entry's name or pattern, never the raw model a request named; \"\" when unpriced)",
            spend.clone(),
        );

        let member_grants = counters();
        r.register(
            "tollgate_pool_member_grants",
            "Slots granted to calls of each member of each provider's pool (this pod's callers)",
            member_grants.clone(),
        );
        let member_calls = counters();
        r.register(
            "tollgate_pool_member_calls",
            "Upstream attempts sent to each pool member, by outcome (ok, 429, 5xx, 4xx, \
             transport, bad_response)",
            member_calls.clone(),
        );
        let member_pauses = counters();
        r.register(
            "tollgate_pool_member_pauses",
            "Back-offs of each pool member: its upstream refused a call (a 429, or a 503 with \
             Retry-After) or could not be reached, and its buckets were paused for every pod",
            member_pauses.clone(),
        );
        let mut members: BTreeMap<String, Vec<String>> = BTreeMap::new();

        let build_info = Family::<VersionLabel, Gauge>::default();
        r.register(
            "tollgate_build_info",
            "Always 1; its version label is the tollgate release this process runs",
            build_info.clone(),
        );
        build_info
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);

        let stats_errors = counters();
        r.register(
            "tollgate_stats_errors",
            "Scrapes whose shared-state read (jobs: queue gauges, throttle: bucket gauges) failed \
             or timed out; those gauges are left out of that scrape",
            stats_errors.clone(),
        );

        // Known label sets start at zero: a counter that appears at 1 hides
        // its first increase from increase(), and a dashboard shows 0, not
        // "no data". The api's own families stay lazy (a series of theirs
        // means that route was used).
        for p in config.providers() {
            let l = ProviderLabel {
                provider: p.name.clone(),
            };
            max_wait.get_or_create(&l).set(p.max_wait.as_secs_f64());
            rate.get_or_create(&l).set(p.rate);
            burst
                .get_or_create(&l)
                .set(i64::try_from(p.burst).unwrap_or(i64::MAX));
            for family in [&grants, &skipped, &reclaimed, &retries] {
                family.get_or_create(&l).inc_by(0);
            }
            let provider = || p.name.clone();
            for m in p.pool() {
                let l = MemberLabel {
                    provider: provider(),
                    member: m.name.clone(),
                };
                member_grants.get_or_create(&l).inc_by(0);
                member_pauses.get_or_create(&l).inc_by(0);
                for outcome in [
                    CallOutcome::Ok,
                    CallOutcome::RateLimited,
                    CallOutcome::ServerError,
                ] {
                    member_calls
                        .get_or_create(&MemberOutcome {
                            provider: provider(),
                            member: m.name.clone(),
                            outcome: outcome.as_str(),
                        })
                        .inc_by(0);
                }
                members.entry(provider()).or_default().push(m.name.clone());
            }
            for class in [CallOutcome::RateLimited, CallOutcome::ServerError] {
                let class = class.as_str();
                let l = ProviderClass {
                    provider: provider(),
                    class,
                };
                upstream_errors.get_or_create(&l).inc_by(0);
            }
            for outcome in ["granted", "timeout", "cancelled", "error"] {
                let l = ProviderOutcome {
                    provider: provider(),
                    outcome,
                };
                acquires.get_or_create(&l).inc_by(0);
            }
            late_grants
                .get_or_create(&ProviderLabel {
                    provider: provider(),
                })
                .inc_by(0);
            redated_grants
                .get_or_create(&ProviderLabel {
                    provider: provider(),
                })
                .inc_by(0);
            pauses
                .get_or_create(&ProviderLabel {
                    provider: provider(),
                })
                .inc_by(0);
            tokens_returned
                .get_or_create(&ProviderReason {
                    provider: provider(),
                    reason: "cancelled",
                })
                .inc_by(0);
            if p.max_weight().is_some() {
                for direction in ["given_back", "taken"] {
                    let l = ProviderDirection {
                        provider: provider(),
                        direction,
                    };
                    usage_adjustments.get_or_create(&l).inc_by(0);
                    usage_adjusted.get_or_create(&l).inc_by(0);
                }
            }
        }
        for cause in [
            "provider",
            "throttle_timeout",
            "expired",
            "abandoned",
            "rejected",
        ] {
            worker_releases
                .get_or_create(&CauseLabel { cause })
                .inc_by(0);
        }
        for op in config.operations() {
            let l = OperationLabel {
                operation: op.name.clone(),
            };
            in_flight.get_or_create(&l).set(0);
            leases_lost.get_or_create(&l).inc_by(0);
            deferred.get_or_create(&l).inc_by(0);
            let outcome = JobEnd::Succeeded.as_str();
            jobs.get_or_create(&OperationOutcome {
                operation: op.name.clone(),
                outcome,
            })
            .inc_by(0);
        }
        for p in config.plans() {
            let l = PlanLabel {
                plan: p.name.clone(),
            };
            denials.get_or_create(&l).inc_by(0);
        }
        for step in LEDGER_STEPS {
            ledger_errors.get_or_create(&StepLabel { step }).inc_by(0);
        }
        for source in ["jobs", "throttle"] {
            stats_errors
                .get_or_create(&SourceLabel { source })
                .inc_by(0);
        }
        let mut plans_by_limit: BTreeMap<u64, Vec<String>> = BTreeMap::new();
        for p in config.plans() {
            for l in &p.limits {
                let names = plans_by_limit.entry(l.limit).or_default();
                if !names.contains(&p.name) {
                    names.push(p.name.clone());
                }
            }
        }

        Self {
            registry: r,
            stats,
            refreshed: tokio::sync::Mutex::new(None),
            loops: Loops::default(),
            reservations,
            job_outcomes,
            requests,
            operation_duration,
            ledger_duration,
            ledger_errors,
            denials,
            wait,
            acquires,
            tokens_returned,
            late_grants,
            redated_grants,
            pauses,
            usage_adjustments,
            usage_adjusted,
            grants,
            skipped,
            reclaimed,
            member_grants,
            member_calls,
            member_pauses,
            members,
            in_flight,
            jobs,
            worker_releases,
            leases_lost,
            deferred,
            jobs_reclaimed,
            jobs_abandoned,
            call_duration,
            upstream_errors,
            retries,
            absorbed,
            spend,
            stats_errors,
            alert_deliveries,
            alert_subjects,
            alert_overdue,
            answers_log: std::sync::OnceLock::new(),
            plans_by_limit,
            plan_names: config.plans().map(|p| p.name.clone()).collect(),
        }
    }

    /// From now on each upstream answer ([`provider_call`](Self::provider_call))
    /// is also noted into `log`, by class (the dashboard's view of the
    /// upstream, from every pod); the first log set stays.
    pub fn note_answers_into(&self, log: Arc<dyn crate::activity::ActivityLog>) {
        let _ = self.answers_log.set(log);
    }

    /// The beats of this process's loops.
    pub fn loops(&self) -> &Loops {
        &self.loops
    }

    /// Reads the shared state (each source bounded by `within`) for the next
    /// [`render`](Self::render). A source that fails or times out counts in
    /// `tollgate_stats_errors_total` and its gauges are left out, the other's
    /// are still shown; the returned list says what failed, for the log.
    /// A read less than [`STATS_MIN_INTERVAL`] old is reused.
    pub async fn refresh(
        &self,
        jobs: &dyn JobQueue,
        throttle: &dyn Throttle,
        within: Duration,
    ) -> Vec<String> {
        let mut last = self.refreshed.lock().await;
        if last.is_some_and(|at| at.elapsed() < STATS_MIN_INTERVAL) {
            return Vec::new();
        }
        let (queues, providers) = tokio::join!(
            tokio::time::timeout(within, jobs.stats()),
            tokio::time::timeout(within, throttle.stats()),
        );
        let mut failed = Vec::new();
        let queues = match queues {
            Ok(Ok(q)) => Some(q),
            Ok(Err(e)) => {
                failed.push(format!("jobs: {e}"));
                None
            }
            Err(_) => {
                failed.push(format!("jobs: no answer within {within:?}"));
                None
            }
        };
        let providers = match providers {
            Ok(Ok(p)) => Some(p),
            Ok(Err(e)) => {
                failed.push(format!("throttle: {e}"));
                None
            }
            Err(_) => {
                failed.push(format!("throttle: no answer within {within:?}"));
                None
            }
        };
        for (source, missing) in [
            ("jobs", queues.is_none()),
            ("throttle", providers.is_none()),
        ] {
            if missing {
                self.stats_errors
                    .get_or_create(&SourceLabel { source })
                    .inc();
            }
        }
        *lock(&self.stats.snapshot) = Snapshot { queues, providers };
        *last = Some(Instant::now());
        failed
    }

    /// The text exposition (Prometheus format 0.0.4, [`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; a metric that could not encode
        // would leave a partial scrape, which Prometheus rejects as a whole.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }

    // --- api -------------------------------------------------------------

    /// A job submission's budget step: `allowed` or `denied`.
    pub fn reservation(&self, operation: &str, allowed: bool) {
        let outcome = if allowed { "allowed" } else { "denied" };
        self.reservations
            .get_or_create(&OperationOutcome {
                operation: operation.to_owned(),
                outcome,
            })
            .inc();
    }

    /// The final outcome of a job the api waited for: `succeeded` or a failure cause.
    pub fn job_outcome(&self, operation: &str, outcome: &'static str) {
        self.job_outcomes
            .get_or_create(&OperationOutcome {
                operation: operation.to_owned(),
                outcome,
            })
            .inc();
    }

    /// One request answered. `route` is a route template (or `unmatched`), so
    /// its values come from the route table; a method outside the standard
    /// ones counts as `other`: a client inventing methods cannot add series.
    pub fn request(&self, route: &str, method: &str, status: u16) {
        self.requests
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
                method: method_label(method),
                status,
            })
            .inc();
    }

    /// How long one call of `operation` took, end to end in the api.
    pub fn operation_latency(&self, operation: &str, took: Duration) {
        self.operation_duration
            .get_or_create(&OperationLabel {
                operation: operation.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    // --- ledger ----------------------------------------------------------

    pub(crate) fn ledger_step<T>(
        &self,
        step: &'static str,
        took: Duration,
        r: &Result<T, LedgerError>,
    ) {
        let l = StepLabel { step };
        self.ledger_duration
            .get_or_create(&l)
            .observe(took.as_secs_f64());
        if r.is_err() {
            self.ledger_errors.get_or_create(&l).inc();
        }
    }

    /// The plans a denial's `limit` may belong to: one name when only one plan
    /// has that limit.
    pub(crate) fn plan_of_limit(&self, limit: u64) -> Option<&str> {
        match self.plans_by_limit.get(&limit).map(Vec::as_slice) {
            Some([one]) => Some(one),
            _ => None,
        }
    }

    pub(crate) fn denied(&self, plan: &str) {
        let plan = if self.plan_names.iter().any(|p| p == plan) {
            plan
        } else {
            "unknown"
        };
        self.denials
            .get_or_create(&PlanLabel {
                plan: plan.to_owned(),
            })
            .inc();
    }

    // --- throttle --------------------------------------------------------

    /// A wait for a slot of `provider` starts; see [`Acquiring`].
    pub fn acquiring(&self, provider: &str) -> Acquiring<'_> {
        Acquiring {
            metrics: self,
            provider: provider.to_owned(),
            started: Instant::now(),
            done: false,
        }
    }

    fn acquired(&self, provider: &str, outcome: &'static str) {
        self.acquires
            .get_or_create(&ProviderOutcome {
                provider: provider.to_owned(),
                outcome,
            })
            .inc();
    }

    /// One budget alert's attempt ended `result` (one of [`ALERT_RESULTS`]).
    pub fn alert_delivery(&self, result: &'static str, n: u64) {
        self.alert_deliveries
            .get_or_create(&ResultLabel { result })
            .inc_by(n);
    }

    /// The alerts' outbox as the deliverer last read it.
    pub fn alert_outbox(&self, depth: crate::alerts::OutboxDepth) {
        self.alert_subjects
            .set(i64::try_from(depth.subjects).unwrap_or(i64::MAX));
        self.alert_overdue
            .set(i64::try_from(depth.overdue_ms / 1000).unwrap_or(i64::MAX));
    }

    /// A grant of `provider` was too old to use (its token is lost).
    pub fn late_grant(&self, provider: &str) {
        self.late_grants
            .get_or_create(&ProviderLabel {
                provider: provider.to_owned(),
            })
            .inc();
    }

    /// A late grant of `provider` was re-dated and used (its token kept).
    pub fn grant_redated(&self, provider: &str) {
        self.redated_grants
            .get_or_create(&ProviderLabel {
                provider: provider.to_owned(),
            })
            .inc();
    }

    /// The upstream refused a call of `provider` and its bucket was paused.
    pub fn paused(&self, provider: &str) {
        self.pauses
            .get_or_create(&ProviderLabel {
                provider: provider.to_owned(),
            })
            .inc();
    }

    /// The label of `member` of `provider`'s pool: `None` when the config
    /// lists no such member (a label is never a name from elsewhere).
    fn member(&self, provider: &str, member: &str) -> Option<MemberLabel> {
        self.members
            .get(provider)
            .is_some_and(|ms| ms.iter().any(|m| m == member))
            .then(|| MemberLabel {
                provider: provider.to_owned(),
                member: member.to_owned(),
            })
    }

    /// A call of `provider` was granted a slot of its pool's `member`.
    pub fn member_granted(&self, provider: &str, member: &str) {
        if let Some(l) = self.member(provider, member) {
            self.member_grants.get_or_create(&l).inc();
        }
    }

    /// An upstream attempt sent to `member` of `provider`'s pool ended with
    /// `outcome`.
    pub fn member_call(&self, provider: &str, member: &str, outcome: CallOutcome) {
        if let Some(l) = self.member(provider, member) {
            self.member_calls
                .get_or_create(&MemberOutcome {
                    provider: l.provider,
                    member: l.member,
                    outcome: outcome.as_str(),
                })
                .inc();
        }
    }

    /// `member` of `provider`'s pool was backed off ([`Throttle::pause_member`]).
    pub fn member_paused(&self, provider: &str, member: &str) {
        if let Some(l) = self.member(provider, member) {
            self.member_pauses.get_or_create(&l).inc();
        }
    }

    /// An answer's reported usage differed from its call's weight.
    pub fn usage_adjusted(&self, provider: &str, usage: crate::throttle::Usage) {
        let (direction, n) = match usage {
            crate::throttle::Usage::Matched => return,
            crate::throttle::Usage::GivenBack(n) => ("given_back", n),
            crate::throttle::Usage::Taken(n) => ("taken", n),
        };
        let l = ProviderDirection {
            provider: provider.to_owned(),
            direction,
        };
        self.usage_adjustments.get_or_create(&l).inc();
        self.usage_adjusted.get_or_create(&l).inc_by(n);
    }

    /// A token went back to `provider`'s bucket: `cancelled`.
    pub fn token_returned(&self, provider: &str, reason: &'static str) {
        self.tokens_returned
            .get_or_create(&ProviderReason {
                provider: provider.to_owned(),
                reason,
            })
            .inc();
    }

    /// One `Dispatch::pump` of the throttler role.
    pub fn pumped(&self, provider: &str, granted: u64, skipped: u64) {
        let l = ProviderLabel {
            provider: provider.to_owned(),
        };
        self.grants.get_or_create(&l).inc_by(granted);
        self.skipped.get_or_create(&l).inc_by(skipped);
    }

    /// Tickets of a dead throttler put back in `provider`'s queue.
    pub fn tickets_reclaimed(&self, provider: &str, n: u64) {
        self.reclaimed
            .get_or_create(&ProviderLabel {
                provider: provider.to_owned(),
            })
            .inc_by(n);
    }

    // --- worker ----------------------------------------------------------

    /// A job of `operation` starts running here; the gauge goes down when the
    /// returned guard drops.
    pub fn job_running(&self, operation: &str) -> Running {
        let gauge = self.in_flight.get_or_create_owned(&OperationLabel {
            operation: operation.to_owned(),
        });
        gauge.inc();
        Running(gauge)
    }

    /// How a worker ended a job.
    pub fn job_ended(&self, operation: &str, end: JobEnd) {
        self.jobs
            .get_or_create(&OperationOutcome {
                operation: operation.to_owned(),
                outcome: end.as_str(),
            })
            .inc();
        if end == JobEnd::LeaseLost {
            self.leases_lost
                .get_or_create(&OperationLabel {
                    operation: operation.to_owned(),
                })
                .inc();
        }
    }

    /// A job of `operation` was taken and deferred: its user held its share
    /// of this worker.
    pub fn job_deferred(&self, operation: &str) {
        self.deferred
            .get_or_create(&OperationLabel {
                operation: operation.to_owned(),
            })
            .inc();
    }

    /// A job's charge went back to its user, for `cause` (a
    /// [`FailureCause`](crate::job::FailureCause) name).
    pub fn job_released(&self, cause: &'static str) {
        self.worker_releases
            .get_or_create(&CauseLabel { cause })
            .inc();
    }

    /// What one maintenance round did.
    pub fn maintained(&self, m: &Maintenance) {
        self.jobs_reclaimed.inc_by(m.requeued);
        self.jobs_abandoned.inc_by(m.abandoned);
        if m.abandoned > 0 {
            self.worker_releases
                .get_or_create(&CauseLabel { cause: "abandoned" })
                .inc_by(m.abandoned);
        }
    }

    /// One upstream attempt of `provider` ended with `outcome` after `took`.
    pub fn provider_call(&self, provider: &str, outcome: CallOutcome, took: Duration) {
        self.call_duration
            .get_or_create(&ProviderOutcome {
                provider: provider.to_owned(),
                outcome: outcome.as_str(),
            })
            .observe(took.as_secs_f64());
        if let Some(log) = self.answers_log.get() {
            log.note(crate::activity::Note::Answered {
                provider: provider.to_owned(),
                class: outcome.answer_class(),
            });
        }
        if outcome != CallOutcome::Ok {
            self.upstream_errors
                .get_or_create(&ProviderClass {
                    provider: provider.to_owned(),
                    class: outcome.as_str(),
                })
                .inc();
        }
    }

    /// A job's charge went back to its user although `provider` may have
    /// worked on its call, for `reason` (e.g. `server_error`).
    pub fn absorbed(&self, provider: &str, reason: &'static str) {
        self.absorbed
            .get_or_create(&ProviderReason {
                provider: provider.to_owned(),
                reason,
            })
            .inc();
    }

    /// A finished job of `operation` at `provider` charged `amount` minor
    /// units, priced by the sheet entry `model` (`""` when unpriced).
    pub fn spent(&self, provider: &str, operation: &str, model: &str, amount: u64) {
        self.spend
            .get_or_create(&SpendLabels {
                provider: provider.to_owned(),
                operation: operation.to_owned(),
                model: model.to_owned(),
            })
            .inc_by(amount);
    }

    /// An upstream attempt of `provider` is retried.
    pub fn retry(&self, provider: &str) {
        self.retries
            .get_or_create(&ProviderLabel {
                provider: provider.to_owned(),
            })
            .inc();
    }
}

/// The gauge of `tollgate_worker_jobs_in_flight`, held while a job runs.
#[derive(Debug)]
pub struct Running(Gauge);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One wait for a throttle grant, observed by its caller: end it with
/// [`granted`](Self::granted), [`timed_out`](Self::timed_out) or
/// [`failed`](Self::failed); dropped before that (the caller's future was
/// dropped), it counts as `cancelled`.
#[derive(Debug)]
pub struct Acquiring<'a> {
    metrics: &'a Metrics,
    provider: String,
    started: Instant,
    done: bool,
}

impl Acquiring<'_> {
    /// The slot came: observes the wait.
    pub fn granted(mut self) {
        self.done = true;
        self.metrics
            .wait
            .get_or_create(&ProviderLabel {
                provider: self.provider.clone(),
            })
            .observe(self.started.elapsed().as_secs_f64());
        self.metrics.acquired(&self.provider, "granted");
    }

    /// No slot within `max_wait`.
    pub fn timed_out(mut self) {
        self.done = true;
        self.metrics.acquired(&self.provider, "timeout");
    }

    /// The throttle's store failed.
    pub fn failed(mut self) {
        self.done = true;
        self.metrics.acquired(&self.provider, "error");
    }
}

impl Drop for Acquiring<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.acquired(&self.provider, "cancelled");
        }
    }
}

/// The label of an HTTP method: one of a fixed set.
fn method_label(method: &str) -> &'static str {
    const KNOWN: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
    KNOWN.into_iter().find(|m| *m == method).unwrap_or("other")
}

/// The beats of a process's long-running loops (a worker's fetch and
/// maintenance loops, a throttler's serve and liveness loops). Each loop
/// [`register`](Self::register)s a [`LoopBeat`] and beats it every round,
/// saying when its next beat is due at the latest; `/readyz` reports the loops
/// that are overdue (stuck) or ended (panicked or stopped).
#[derive(Debug, Default)]
pub struct Loops {
    beats: Mutex<Vec<Arc<Beat>>>,
}

/// Slack past a loop's own promise before it counts as stuck: covers a slow
/// store call (Redis calls time out after a few seconds) and a busy runtime.
pub const LOOP_SLACK: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Beat {
    name: String,
    base: Instant,
    /// Ms since `base` by which the next beat is due.
    due_ms: AtomicU64,
    ended: AtomicBool,
}

/// One loop's beat; see [`Loops`]. Dropping it (the loop returned or
/// panicked) marks the loop ended.
#[derive(Debug)]
pub struct LoopBeat(Arc<Beat>);

impl LoopBeat {
    /// The loop is alive, and beats again within `next` (plus [`LOOP_SLACK`]).
    pub fn beat(&self, next: Duration) {
        let due = self.0.base.elapsed() + next + LOOP_SLACK;
        self.0.due_ms.store(
            u64::try_from(due.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
}

impl Drop for LoopBeat {
    fn drop(&mut self) {
        self.0.ended.store(true, Ordering::Relaxed);
    }
}

impl Loops {
    /// A new loop named `name`, alive from now for `first` (plus [`LOOP_SLACK`]).
    pub fn register(&self, name: impl Into<String>, first: Duration) -> LoopBeat {
        let beat = Arc::new(Beat {
            name: name.into(),
            base: Instant::now(),
            due_ms: AtomicU64::new(0),
            ended: AtomicBool::new(false),
        });
        let hb = LoopBeat(Arc::clone(&beat));
        hb.beat(first);
        lock(&self.beats).push(beat);
        hb
    }

    /// What keeps the process from being ready: each loop that ended or is
    /// overdue, described. Empty: every loop is alive (or none is registered).
    pub fn problems(&self) -> Vec<String> {
        lock(&self.beats)
            .iter()
            .filter_map(|b| {
                if b.ended.load(Ordering::Relaxed) {
                    return Some(format!("{} ended", b.name));
                }
                let now = u64::try_from(b.base.elapsed().as_millis()).unwrap_or(u64::MAX);
                let due = b.due_ms.load(Ordering::Relaxed);
                (now > due)
                    .then(|| format!("{} silent for {} ms past its due beat", b.name, now - due))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn metrics() -> Metrics {
        Metrics::new(&Config::builtin())
    }

    #[test]
    fn renders_counters_and_histograms_in_the_text_format() {
        let m = metrics();
        m.reservation("llm.structured", true);
        m.reservation("llm.structured", false);
        m.job_outcome("llm.structured", "provider");
        m.operation_latency("llm.structured", Duration::from_millis(30));
        m.request("/v1/ops/{operation}", "POST", 200);
        let text = m.render();
        for line in [
            "# HELP tollgate_reservations_total Budget reservations by operation and outcome (allowed, denied).",
            "# TYPE tollgate_reservations_total counter",
            "tollgate_reservations_total{operation=\"llm.structured\",outcome=\"allowed\"} 1",
            "tollgate_reservations_total{operation=\"llm.structured\",outcome=\"denied\"} 1",
            "tollgate_job_outcomes_total{operation=\"llm.structured\",outcome=\"provider\"} 1",
            "# TYPE tollgate_operation_duration_seconds histogram",
            "tollgate_operation_duration_seconds_bucket{operation=\"llm.structured\",le=\"0.05\"} 1",
            "tollgate_operation_duration_seconds_bucket{operation=\"llm.structured\",le=\"0.025\"} 0",
            "tollgate_operation_duration_seconds_bucket{operation=\"llm.structured\",le=\"+Inf\"} 1",
            "tollgate_operation_duration_seconds_count{operation=\"llm.structured\"} 1",
            "tollgate_http_requests_total{route=\"/v1/ops/{operation}\",method=\"POST\",status=\"200\"} 1",
            // The config's providers, and the series alerts rely on, from the start.
            "tollgate_throttle_max_wait_seconds{provider=\"llm\"} 30",
            "tollgate_upstream_errors_total{provider=\"llm\",class=\"429\"} 0",
            "tollgate_worker_releases_total{cause=\"provider\"} 0",
            // Its alias, the name before the glossary's.
            "tollgate_worker_refunds_total{cause=\"provider\"} 0",
            concat!("tollgate_build_info{version=\"", env!("CARGO_PKG_VERSION"), "\"} 1"),
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        // Help and type lines once per family.
        assert_eq!(
            text.matches("# TYPE tollgate_reservations_total ").count(),
            1
        );
    }

    #[test]
    fn invented_methods_share_one_series() {
        let m = metrics();
        for i in 0..100 {
            m.request("unmatched", &format!("X{i}"), 405);
        }
        m.request("unmatched", "GET", 404);
        let text = m.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("tollgate_http_requests_total{"))
            .count();
        assert_eq!(series, 2, "{text}");
        assert!(
            text.contains("method=\"other\",status=\"405\"} 100"),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let m = metrics();
        m.request("/a\"b\\c\nd", "GET", 200);
        let text = m.render();
        assert!(text.contains("route=\"/a\\\"b\\\\c\\nd\""), "{text}");
    }

    #[test]
    fn an_abandoned_wait_counts_as_cancelled() {
        let m = metrics();
        m.acquiring("llm").granted();
        m.acquiring("llm").timed_out();
        drop(m.acquiring("llm"));
        let text = m.render();
        for outcome in ["granted", "timeout", "cancelled"] {
            let line = format!(
                "tollgate_throttle_acquires_total{{provider=\"llm\",outcome=\"{outcome}\"}} 1"
            );
            assert!(text.contains(&line), "{line}\n{text}");
        }
        assert!(text.contains("tollgate_throttle_wait_seconds_count{provider=\"llm\"} 1"));
    }

    #[test]
    fn jobs_in_flight_go_down_when_they_end() {
        let m = metrics();
        let a = m.job_running("embeddings");
        let _b = m.job_running("embeddings");
        drop(a);
        m.job_ended("embeddings", JobEnd::LeaseLost);
        m.job_deferred("embeddings");
        let text = m.render();
        for line in [
            "tollgate_worker_jobs_in_flight{operation=\"embeddings\"} 1",
            "tollgate_worker_jobs_total{operation=\"embeddings\",outcome=\"lease_lost\"} 1",
            "tollgate_worker_leases_lost_total{operation=\"embeddings\"} 1",
            "tollgate_worker_jobs_deferred_total{operation=\"embeddings\"} 1",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
    }

    #[test]
    fn loops_report_when_they_end_or_fall_silent() {
        let loops = Loops::default();
        assert!(loops.problems().is_empty());
        let a = loops.register("a", Duration::from_secs(60));
        let b = loops.register("b", Duration::from_secs(60));
        assert!(loops.problems().is_empty());
        drop(b);
        assert_eq!(loops.problems(), vec!["b ended".to_owned()]);
        // A beat promised in the past (saturating at zero) plus the slack is
        // still in the future: alive.
        a.beat(Duration::ZERO);
        assert_eq!(loops.problems().len(), 1);
        // Overdue: the due time is set behind now.
        a.0.due_ms.store(0, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        let problems = loops.problems();
        assert!(problems[0].starts_with("a silent for "), "{problems:?}");
    }
}
