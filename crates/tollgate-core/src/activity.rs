//! The activity log: what the operations dashboard shows beyond the gauges of
//! shared state: the newest spend events (the audit trail across users), which
//! of them were refunded, each provider's grants and their waits, the
//! upstream's answers by class, and the budget denials (per operation, and
//! the newest with their users).
//!
//! It is fed by two decorators every backend wraps its stores in:
//! [`ObservedLedger`](crate::observed::ObservedLedger) (charges, reserves,
//! refunds, releases, denials) and
//! [`RecordingThrottle`] (grants and how long they waited), and by the
//! process's [`Metrics`](crate::metrics::Metrics) for each upstream answer
//! ([`Metrics::note_answers_into`](crate::metrics::Metrics::note_answers_into)),
//! so both backends record the same things the same way. The log is **observational**: noting
//! never waits on the store and never fails a budget step; a note lost to a
//! store failure only leaves a gap on the dashboard. Everything it keeps is
//! bounded ([`EVENTS_CAP`], [`WAITS_CAP`]): it is a window on the recent past,
//! not a ledger (the ledger's own audit trail is `Ledger::usage`).
//!
//! In memory (`tollgate_memory::activity`) it is a ring per kind; on Redis
//! (`tollgate_redis::activity`) it is buffered and flushed by one script into
//! capped keys under their own hash tag, so every pod sees every pod's notes.
//!
//! Two more things live here, for the job browser and the charts:
//! - **Job timelines**: each job's steps as the decorators saw them
//!   ([`JobNote`]: charged, granted a slot after a wait, started, succeeded or
//!   failed with its cause, its charge released or refunded), for the newest
//!   [`TIMELINES_CAP`] jobs, [`STEPS_CAP`] steps each, and the newest
//!   [`FAILED_CAP`] failures. A timeline outlives the job's record (a sync
//!   call without an Idempotency-Key is forgotten once answered).
//!   [`RecordingSource`] notes the worker's steps.
//! - **History** ([`ActivityLog::sample`], [`ActivityLog::history`]): a ring of
//!   [`Sample`]s, at most one per interval *across every pod* (the slot is
//!   the store's clock divided by the interval; the first pod to sample a
//!   slot writes it, the others find it written), each holding the log's
//!   counters and the gauges the sampling pod read, kept [`HISTORY_SPAN`].
//!   An interval no pod sampled is simply absent: a gap, never a guess.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::id::{RequestId, UserId};
use crate::job::{
    Charge, Failure, Finish, JobError, JobSource, Lease, Maintenance, Settled, Taker,
};
use crate::throttle::{Grant, Pause, Position, ProviderStats, Throttle, ThrottleError, Waiter};

/// Spend events kept (the newest), and refund marks kept.
pub const EVENTS_CAP: usize = 1000;
/// Grant waits kept per provider (the newest): enough for a p95.
pub const WAITS_CAP: usize = 512;
/// Budget denials kept (the newest), for the users most denied.
pub const DENIED_CAP: usize = 1000;

/// How often the history is sampled by default (`--history-interval-ms`).
pub const HISTORY_INTERVAL: Duration = Duration::from_secs(10);
/// How far back the history is kept: the dashboard's hour and a margin.
pub const HISTORY_SPAN: Duration = Duration::from_secs(65 * 60);
/// The most samples kept, whatever the interval.
pub const HISTORY_MAX_SAMPLES: usize = 4000;
/// The shortest interval a sampler accepts.
pub const HISTORY_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// Job timelines kept (the newest jobs noted).
pub const TIMELINES_CAP: usize = 1000;
/// Steps kept per job timeline (a job run again adds steps).
pub const STEPS_CAP: usize = 16;
/// Job failures kept (the newest).
pub const FAILED_CAP: usize = 1000;
/// The longest failure message a timeline keeps, in bytes.
pub const MESSAGE_LIMIT: usize = 300;

/// The classes of an upstream answer, as the dashboard shows them: a
/// [`CallOutcome`](crate::metrics::CallOutcome) `ok` or `bad_response` is a
/// `2xx`, `transport` (no answer: refused, reset, timed out) is `timeout`.
pub const ANSWER_CLASSES: [&str; 5] = ["2xx", "4xx", "429", "5xx", "timeout"];

/// One spend event as noted: a charge (a job's, with its operation) or a
/// plain reserve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spend {
    /// On the ledger's clock.
    pub at_ms: u64,
    pub user: String,
    pub operation: Option<String>,
    /// The service key that made the charge for `user` (its id), if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_key: Option<String>,
    pub cost: u64,
    pub request_id: String,
    /// Names this charge for its refund mark: the user, the request id and,
    /// for a job's charge, its nonce (a retried attempt is another charge).
    pub key: String,
}

/// What the decorators note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    Spent(Spend),
    /// The charge with this [`Spend::key`] was refunded or released.
    Refunded {
        key: String,
    },
    /// A provider slot was granted after `waited_us`.
    Granted {
        provider: String,
        at_ms: u64,
        waited_us: u64,
    },
    /// The budget denied `user` a call of `operation` (`None`: a plain
    /// reserve); the log stamps it with its own clock.
    Denied {
        user: String,
        operation: Option<String>,
    },
    /// `provider` answered an attempt; `class` is one of [`ANSWER_CLASSES`].
    Answered {
        provider: String,
        class: &'static str,
    },
    /// A step of a job's timeline.
    Job(JobNote),
}

/// One step of a job, as a decorator saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobNote {
    /// The job's id (its budget request id).
    pub id: String,
    pub user: String,
    /// On the clock of the step's source: the ledger's for a charge, the
    /// throttle's for a grant, the noting process's for the worker's steps.
    pub at_ms: u64,
    #[serde(flatten)]
    pub step: JobStep,
}

/// What happened to a job at one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum JobStep {
    /// The submission charged the budget: the job is queued.
    Charged { operation: String, cost: u64 },
    /// A provider slot was granted after `waited_us`, of its pool's
    /// `member` (`None`: a provider served as one upstream, or a step
    /// written before members were noted).
    Granted {
        provider: String,
        waited_us: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        member: Option<String>,
    },
    /// A worker's run claimed the charge, about to call the provider.
    Started { run: u32 },
    /// The job succeeded: the charge stands, at `charged` when its settle
    /// changed it (`None`: at what was reserved).
    Succeeded { charged: Option<u64> },
    /// The job failed for `cause` ([`FailureCause`](crate::job::FailureCause)
    /// name); `charge_stands`: the upstream may have done the work.
    Failed {
        operation: String,
        cause: String,
        charge_stands: bool,
        message: String,
    },
    /// The job's own charge went back to the user (its failure released it).
    Released,
    /// An operator refunded the charge (a queued job is cancelled by it).
    Refunded,
}

impl JobStep {
    /// The step as one line of text (`<kind>[ <fields>]`), the message last.
    pub fn encode(&self) -> String {
        match self {
            Self::Charged { operation, cost } => format!("charged {operation} {cost}"),
            // The member last: a reader that knows none ignores it.
            Self::Granted {
                provider,
                waited_us,
                member: None,
            } => format!("granted {provider} {waited_us}"),
            Self::Granted {
                provider,
                waited_us,
                member: Some(m),
            } => format!("granted {provider} {waited_us} {m}"),
            Self::Started { run } => format!("started {run}"),
            Self::Succeeded { charged: None } => "succeeded".into(),
            Self::Succeeded { charged: Some(c) } => format!("succeeded {c}"),
            Self::Failed {
                operation,
                cause,
                charge_stands,
                message,
            } => format!(
                "failed {operation} {cause} {} {}",
                if *charge_stands { "stands" } else { "released" },
                one_line(message)
            ),
            Self::Released => "released".into(),
            Self::Refunded => "refunded".into(),
        }
    }

    /// The inverse of [`encode`](Self::encode).
    pub fn parse(s: &str) -> Option<Self> {
        let (kind, rest) = s.split_once(' ').unwrap_or((s, ""));
        let mut f = rest.splitn(4, ' ');
        Some(match kind {
            "charged" => Self::Charged {
                operation: f.next()?.to_owned(),
                cost: f.next()?.parse().ok()?,
            },
            "granted" => Self::Granted {
                provider: f.next()?.to_owned(),
                waited_us: f.next()?.parse().ok()?,
                member: f.next().filter(|m| !m.is_empty()).map(str::to_owned),
            },
            "started" => Self::Started {
                run: f.next()?.parse().ok()?,
            },
            // A step written before the charge was noted has none.
            "succeeded" => Self::Succeeded {
                charged: match f.next().filter(|c| !c.is_empty()) {
                    Some(c) => Some(c.parse().ok()?),
                    None => None,
                },
            },
            "failed" => Self::Failed {
                operation: f.next()?.to_owned(),
                cause: f.next()?.to_owned(),
                charge_stands: f.next()? == "stands",
                message: f.next().unwrap_or("").to_owned(),
            },
            "released" => Self::Released,
            "refunded" => Self::Refunded,
            _ => return None,
        })
    }
}

/// `message` on one line, at most [`MESSAGE_LIMIT`] bytes.
fn one_line(message: &str) -> String {
    let flat: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let mut end = flat.len().min(MESSAGE_LIMIT);
    while !flat.is_char_boundary(end) {
        end -= 1;
    }
    flat[..end].to_owned()
}

impl JobNote {
    /// The note as a timeline line: `<at_ms> <user> <step>`.
    pub fn line(&self) -> String {
        format!("{} {} {}", self.at_ms, self.user, self.step.encode())
    }

    /// The inverse of [`line`](Self::line), for job `id`.
    pub fn parse_line(id: &str, line: &str) -> Option<Self> {
        let mut f = line.splitn(3, ' ');
        Some(Self {
            id: id.to_owned(),
            at_ms: f.next()?.parse().ok()?,
            user: f.next()?.to_owned(),
            step: JobStep::parse(f.next()?)?,
        })
    }

    /// The failure this note records, if it is one.
    pub fn failure(&self) -> Option<FailedView> {
        match &self.step {
            JobStep::Failed {
                operation, cause, ..
            } => Some(FailedView {
                at_ms: self.at_ms,
                id: self.id.clone(),
                user: self.user.clone(),
                operation: operation.clone(),
                cause: cause.clone(),
            }),
            _ => None,
        }
    }
}

/// One job failure as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedView {
    pub at_ms: u64,
    pub id: String,
    pub user: String,
    pub operation: String,
    pub cause: String,
}

impl FailedView {
    /// `<at_ms> <id> <user> <operation> <cause>`, as the failures list keeps it.
    pub fn line(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.at_ms, self.id, self.user, self.operation, self.cause
        )
    }

    pub fn parse_line(line: &str) -> Option<Self> {
        let mut f = line.split(' ');
        Some(Self {
            at_ms: f.next()?.parse().ok()?,
            id: f.next()?.to_owned(),
            user: f.next()?.to_owned(),
            operation: f.next()?.to_owned(),
            cause: f.next()?.to_owned(),
        })
    }
}

/// What the sampling pod read of the shared state at a sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Gauges {
    /// Per operation: jobs waiting for a worker.
    #[serde(default)]
    pub queued: BTreeMap<String, u64>,
    /// Per operation: jobs a worker holds.
    #[serde(default)]
    pub running: BTreeMap<String, u64>,
    /// Per provider: calls waiting for a slot.
    #[serde(default)]
    pub waiters: BTreeMap<String, u64>,
    /// Workers alive (the most on any queue); `None` embedded.
    #[serde(default)]
    pub workers: Option<u64>,
    /// Throttlers alive; `None` embedded.
    #[serde(default)]
    pub throttlers: Option<u64>,
}

/// The log's counters at a sample (each since the log began: a counter
/// restarts at 0 when the store forgot an idle log).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Per operation ([`PLAIN`] for plain reserves): new charges.
    #[serde(default)]
    pub calls: BTreeMap<String, u64>,
    /// Per provider: slots granted.
    #[serde(default)]
    pub grants: BTreeMap<String, u64>,
    /// Per `"<provider> <class>"`: the upstream's answers.
    #[serde(default)]
    pub answers: BTreeMap<String, u64>,
    /// Per operation ([`PLAIN`] for plain reserves): budget denials.
    #[serde(default)]
    pub denials: BTreeMap<String, u64>,
}

/// One sample of the history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The start of the sample's interval (slot), on the store's clock.
    pub at_ms: u64,
    pub gauges: Gauges,
    pub counters: Counters,
}

/// The answer to [`ActivityLog::sample`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampled {
    /// Whether this call wrote the slot's sample (false: a pod had already).
    pub written: bool,
    /// The slot's start (ms, the store's clock).
    pub slot_ms: u64,
    /// Until the next slot begins.
    pub next_in: Duration,
}

/// The slot of `now_ms` for `interval_ms`, and the time to the next one.
pub fn slot_of(now_ms: u64, interval_ms: u64) -> (u64, Duration) {
    let interval_ms = interval_ms.max(1);
    let slot = now_ms - now_ms % interval_ms;
    (slot, Duration::from_millis(slot + interval_ms - now_ms))
}

/// One budget denial as read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DenialView {
    pub at_ms: u64,
    pub user: String,
    /// `None`: a plain reserve.
    pub operation: Option<String>,
}

/// The name a plain reserve's denials are counted under.
pub const PLAIN: &str = "(plain reserve)";

/// A spend event as read back, with whether it was refunded since.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpendView {
    pub at_ms: u64,
    pub user: String,
    pub operation: Option<String>,
    /// The service key that acted for `user`, if one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_key: Option<String>,
    /// In minor units; not serialized: the dashboard writes it in the
    /// deployment's currency (`tollgate_core::money::Amount`).
    #[serde(skip)]
    pub cost: u64,
    pub request_id: String,
    pub refunded: bool,
}

/// The log as it stands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActivityView {
    /// The store's clock now.
    pub now_ms: u64,
    /// Newest first, at most [`EVENTS_CAP`].
    pub events: Vec<SpendView>,
    /// Grants per provider since the log began (a counter: it may restart at
    /// 0 when the store forgot an idle log).
    pub grants: BTreeMap<String, u64>,
    /// Per provider, the newest grants' `(at_ms, waited_us)`, newest first.
    pub waits: BTreeMap<String, Vec<(u64, u64)>>,
    /// Per provider and answer class ([`ANSWER_CLASSES`]), the upstream's
    /// answers since the log began (counters, like `grants`).
    pub answers: BTreeMap<String, BTreeMap<String, u64>>,
    /// Budget denials per operation ([`PLAIN`] for plain reserves) since the
    /// log began (counters).
    pub denials: BTreeMap<String, u64>,
    /// The newest denials, newest first, at most [`DENIED_CAP`].
    pub denied: Vec<DenialView>,
}

/// Where notes go; see the module docs.
#[async_trait]
pub trait ActivityLog: Send + Sync + std::fmt::Debug {
    /// Notes `note`; never waits on the store, never fails.
    fn note(&self, note: Note);

    /// The log as it stands (notes of the last moments may still be on their
    /// way: a buffered store flushes every [`FLUSH_INTERVAL`]).
    async fn read(&self) -> Result<ActivityView, StoreError>;

    /// Writes the sample of the current slot of `interval` (the store's clock)
    /// from the log's counters and `gauges`, unless the slot has one (another
    /// pod sampled it); drops samples older than [`HISTORY_SPAN`].
    async fn sample(&self, interval: Duration, gauges: &Gauges) -> Result<Sampled, StoreError>;

    /// The samples kept whose slot starts after `after_ms` (every one kept:
    /// `None`), oldest first.
    async fn history(&self, after_ms: Option<u64>) -> Result<Vec<Sample>, StoreError>;

    /// The timelines of jobs `ids` (empty: none kept), oldest step first.
    async fn timelines(&self, ids: &[String]) -> Result<Vec<Vec<JobNote>>, StoreError>;

    /// The newest job failures, newest first, at most `limit`.
    async fn failed(&self, limit: usize) -> Result<Vec<FailedView>, StoreError>;
}

/// How often a buffered log writes its notes to the store.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(250);

impl Spend {
    /// The event as read back.
    pub fn view(&self, refunded: bool) -> SpendView {
        SpendView {
            at_ms: self.at_ms,
            user: self.user.clone(),
            operation: self.operation.clone(),
            service_key: self.service_key.clone(),
            cost: self.cost,
            request_id: self.request_id.clone(),
            refunded,
        }
    }
}

/// The [`Spend::key`] of a charge: `user request_id [nonce]`.
pub(crate) fn spend_key(user: &UserId, request: &RequestId, nonce: Option<&str>) -> String {
    match nonce {
        Some(nonce) => format!("{user} {request} {nonce}"),
        None => format!("{user} {request}"),
    }
}

/// A [`Throttle`] that notes every grant (its provider, time and wait) into an
/// [`ActivityLog`]. Its `Debug` is the inner throttle's.
pub struct RecordingThrottle {
    inner: Arc<dyn Throttle>,
    log: Arc<dyn ActivityLog>,
}

impl std::fmt::Debug for RecordingThrottle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl RecordingThrottle {
    pub fn new(inner: Arc<dyn Throttle>, log: Arc<dyn ActivityLog>) -> Self {
        Self { inner, log }
    }
}

#[async_trait]
impl Throttle for RecordingThrottle {
    async fn acquire_as(
        &self,
        provider: &str,
        waiter: &Waiter,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError> {
        let r = self.inner.acquire_as(provider, waiter, max_wait).await;
        if let Ok(grant) = &r {
            let waited_us = u64::try_from(grant.waited.as_micros()).unwrap_or(u64::MAX);
            self.log.note(Note::Granted {
                provider: grant.provider.clone(),
                at_ms: grant.granted_at_us / 1000,
                waited_us,
            });
            if !waiter.user.is_empty() {
                self.log.note(Note::Job(JobNote {
                    id: waiter.request_id.to_string(),
                    user: waiter.user.clone(),
                    at_ms: grant.granted_at_us / 1000,
                    step: JobStep::Granted {
                        provider: grant.provider.clone(),
                        waited_us,
                        member: grant.member.clone(),
                    },
                }));
            }
        }
        r
    }

    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError> {
        self.inner.done(grant).await
    }

    /// Not a grant of its own (no token): not noted.
    async fn redate(&self, grant: &Grant) -> Result<Option<Grant>, ThrottleError> {
        self.inner.redate(grant).await
    }

    async fn position(
        &self,
        provider: &str,
        user: &str,
        request_id: &RequestId,
    ) -> Result<Option<Position>, ThrottleError> {
        self.inner.position(provider, user, request_id).await
    }

    async fn drain(&self, limit: Duration) -> usize {
        self.inner.drain(limit).await
    }

    async fn stats(&self) -> Result<Vec<ProviderStats>, ThrottleError> {
        self.inner.stats().await
    }

    async fn pause(
        &self,
        provider: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        self.inner.pause(provider, retry_after).await
    }

    async fn pause_member(
        &self,
        provider: &str,
        member: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        self.inner.pause_member(provider, member, retry_after).await
    }

    async fn usage(
        &self,
        grant: &Grant,
        used: u64,
    ) -> Result<crate::throttle::Usage, ThrottleError> {
        self.inner.usage(grant, used).await
    }
}

/// A job step noted now, on this process's clock.
pub(crate) fn job_note(id: &str, user: &str, step: JobStep) -> Note {
    Note::Job(JobNote {
        id: id.to_owned(),
        user: user.to_owned(),
        at_ms: SystemClock.now_ms(),
        step,
    })
}

/// A [`JobSource`] that notes each job's worker steps (started, succeeded,
/// failed with its cause and message) into an [`ActivityLog`]: the job
/// browser's timelines, also for jobs whose record is gone. Its `Debug` is
/// the inner source's.
pub struct RecordingSource {
    inner: Arc<dyn JobSource>,
    log: Arc<dyn ActivityLog>,
}

impl std::fmt::Debug for RecordingSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl RecordingSource {
    pub fn new(inner: Arc<dyn JobSource>, log: Arc<dyn ActivityLog>) -> Self {
        Self { inner, log }
    }

    fn noted(&self, lease: &Lease, step: JobStep) {
        self.log.note(job_note(
            lease.job.id.as_str(),
            lease.job.user.as_str(),
            step,
        ));
    }
}

#[async_trait]
impl JobSource for RecordingSource {
    async fn take(&self, operation: &str, taker: Taker<'_>) -> Result<Option<Lease>, JobError> {
        self.inner.take(operation, taker).await
    }

    async fn start(&self, lease: &Lease) -> Result<bool, JobError> {
        let r = self.inner.start(lease).await;
        if let Ok(true) = r {
            self.noted(lease, JobStep::Started { run: lease.job.run });
        }
        r
    }

    async fn settle(&self, lease: &Lease, answer: &serde_json::Value) -> Result<Settled, JobError> {
        self.inner.settle(lease, answer).await
    }

    async fn renew(&self, lease: &Lease, by: Duration) -> Result<Finish, JobError> {
        self.inner.renew(lease, by).await
    }

    async fn complete(&self, lease: &Lease, result: serde_json::Value) -> Result<Finish, JobError> {
        let r = self.inner.complete(lease, result).await;
        if let Ok(Finish::Recorded) = r {
            self.noted(lease, JobStep::Succeeded { charged: None });
        }
        r
    }

    async fn complete_with(
        &self,
        lease: &Lease,
        result: serde_json::Value,
        head: Option<crate::head::Head>,
        charged: Option<u64>,
    ) -> Result<Finish, JobError> {
        let r = self.inner.complete_with(lease, result, head, charged).await;
        if let Ok(Finish::Recorded) = r {
            self.noted(lease, JobStep::Succeeded { charged });
        }
        r
    }

    async fn fail(&self, lease: &Lease, failure: Failure<'_>) -> Result<Finish, JobError> {
        let r = self.inner.fail(lease, failure).await;
        if let Ok(Finish::Recorded) = r {
            self.noted(
                lease,
                JobStep::Failed {
                    operation: lease.job.operation.clone(),
                    cause: failure.cause.as_str().to_owned(),
                    charge_stands: matches!(failure.charge, Charge::Keep),
                    message: one_line(failure.message),
                },
            );
        }
        r
    }

    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError> {
        self.inner.hand_back(lease).await
    }

    async fn defer(&self, lease: &Lease) -> Result<Finish, JobError> {
        self.inner.defer(lease).await
    }

    async fn maintain(&self, worker: &str, lease: Duration) -> Result<Maintenance, JobError> {
        self.inner.maintain(worker, lease).await
    }

    async fn retire(&self, worker: &str) -> Result<(), JobError> {
        self.inner.retire(worker).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    #[test]
    fn job_steps_read_back_as_written() {
        let steps = [
            JobStep::Charged {
                operation: "llm.structured".into(),
                cost: 8,
            },
            JobStep::Granted {
                provider: "llm".into(),
                waited_us: 1234,
                member: None,
            },
            JobStep::Granted {
                provider: "llm".into(),
                waited_us: 1234,
                member: Some("eu-1".into()),
            },
            JobStep::Started { run: 2 },
            JobStep::Succeeded { charged: None },
            JobStep::Succeeded { charged: Some(7) },
            JobStep::Failed {
                operation: "op".into(),
                cause: "provider".into(),
                charge_stands: true,
                message: "upstream answered 502: bad gateway".into(),
            },
            JobStep::Released,
            JobStep::Refunded,
        ];
        for step in steps {
            let note = JobNote {
                id: "id-1".into(),
                user: "alice".into(),
                at_ms: 42,
                step,
            };
            assert_eq!(JobNote::parse_line("id-1", &note.line()), Some(note));
        }
        // A step of an older writer, and one whose charge is not a number.
        let old = JobNote::parse_line("id-1", "42 alice succeeded");
        assert_eq!(
            old.map(|n| n.step),
            Some(JobStep::Succeeded { charged: None })
        );
        assert_eq!(JobNote::parse_line("id-1", "42 alice succeeded x"), None);
        // A grant of an older writer names no member.
        let old = JobNote::parse_line("id-1", "42 alice granted llm 7");
        assert_eq!(
            old.map(|n| n.step),
            Some(JobStep::Granted {
                provider: "llm".into(),
                waited_us: 7,
                member: None,
            })
        );
        let long = JobStep::Failed {
            operation: "op".into(),
            cause: "provider".into(),
            charge_stands: false,
            message: "x\n".repeat(400),
        };
        let line = long.encode();
        assert!(!line.contains('\n'));
        assert!(line.len() < MESSAGE_LIMIT + 40);
    }
}
