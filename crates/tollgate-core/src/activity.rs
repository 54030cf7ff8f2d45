//! The activity log: what the operations dashboard shows beyond the gauges of
//! shared state: the newest spend events (the audit trail across users), which
//! of them were refunded, each provider's grants and their waits, the
//! upstream's answers by class, and the budget denials (per operation, and
//! the newest with their users).
//!
//! It is fed by two decorators every backend wraps its stores in:
//! [`RecordingLedger`] (charges, reserves, refunds, releases, denials) and
//! [`RecordingThrottle`] (grants and how long they waited), and by the
//! process's [`Metrics`](crate::metrics::Metrics) for each upstream answer
//! ([`Metrics::note_answers_into`](crate::metrics::Metrics::note_answers_into)),
//! so both backends record the same things the same way. The log is **observational**: noting
//! never waits on the store and never fails a budget step; a note lost to a
//! store failure only leaves a gap on the dashboard. Everything it keeps is
//! bounded ([`EVENTS_CAP`], [`WAITS_CAP`]): it is a window on the recent past,
//! not a ledger (the ledger's own audit trail is `Ledger::usage`).
//!
//! In memory ([`MemoryActivity`]) it is a ring per kind; on Redis
//! (`tollgate_redis::activity`) it is buffered and flushed by one script into
//! capped keys under their own hash tag, so every pod sees every pod's notes.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::id::{RequestId, UserId};
use crate::ledger::{
    ChargeOutcome, ChargeRequest, ClaimOutcome, Ledger, LedgerError, RefundOutcome, ReserveOutcome,
    SettleOutcome, Usage,
};
use crate::lock;
use crate::throttle::{Grant, Pause, Position, ProviderStats, Throttle, ThrottleError, Waiter};

/// Spend events kept (the newest), and refund marks kept.
pub const EVENTS_CAP: usize = 1000;
/// Grant waits kept per provider (the newest): enough for a p95.
pub const WAITS_CAP: usize = 512;
/// Budget denials kept (the newest), for the users most denied.
pub const DENIED_CAP: usize = 1000;

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
}

/// How often a buffered log writes its notes to the store.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(250);

/// The activity log of one process, in memory (the embedded mode).
#[derive(Debug, Default)]
pub struct MemoryActivity {
    state: Mutex<MemoryState>,
}

#[derive(Debug, Default)]
struct MemoryState {
    events: VecDeque<Spend>,
    refunded: VecDeque<String>,
    refunded_set: HashSet<String>,
    grants: BTreeMap<String, u64>,
    waits: BTreeMap<String, VecDeque<(u64, u64)>>,
    answers: BTreeMap<String, BTreeMap<String, u64>>,
    denials: BTreeMap<String, u64>,
    denied: VecDeque<DenialView>,
}

impl MemoryActivity {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl ActivityLog for MemoryActivity {
    fn note(&self, note: Note) {
        let mut st = lock(&self.state);
        match note {
            Note::Spent(spend) => {
                st.events.push_front(spend);
                st.events.truncate(EVENTS_CAP);
            }
            Note::Refunded { key } => {
                if st.refunded_set.insert(key.clone()) {
                    st.refunded.push_front(key);
                }
                while st.refunded.len() > EVENTS_CAP {
                    if let Some(old) = st.refunded.pop_back() {
                        st.refunded_set.remove(&old);
                    }
                }
            }
            Note::Granted {
                provider,
                at_ms,
                waited_us,
            } => {
                *st.grants.entry(provider.clone()).or_default() += 1;
                let waits = st.waits.entry(provider).or_default();
                waits.push_front((at_ms, waited_us));
                waits.truncate(WAITS_CAP);
            }
            Note::Denied { user, operation } => {
                let name = operation.clone().unwrap_or_else(|| PLAIN.to_owned());
                *st.denials.entry(name).or_default() += 1;
                st.denied.push_front(DenialView {
                    at_ms: SystemClock.now_ms(),
                    user,
                    operation,
                });
                st.denied.truncate(DENIED_CAP);
            }
            Note::Answered { provider, class } => {
                *st.answers
                    .entry(provider)
                    .or_default()
                    .entry(class.to_owned())
                    .or_default() += 1;
            }
        }
    }

    async fn read(&self) -> Result<ActivityView, StoreError> {
        let st = lock(&self.state);
        Ok(ActivityView {
            now_ms: SystemClock.now_ms(),
            events: st
                .events
                .iter()
                .map(|s| s.view(st.refunded_set.contains(&s.key)))
                .collect(),
            grants: st.grants.clone(),
            waits: st
                .waits
                .iter()
                .map(|(p, w)| (p.clone(), w.iter().copied().collect()))
                .collect(),
            answers: st.answers.clone(),
            denials: st.denials.clone(),
            denied: st.denied.iter().cloned().collect(),
        })
    }
}

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
fn spend_key(user: &UserId, request: &RequestId, nonce: Option<&str>) -> String {
    match nonce {
        Some(nonce) => format!("{user} {request} {nonce}"),
        None => format!("{user} {request}"),
    }
}

/// A [`Ledger`] that notes every new charge and every refund of another one
/// into an [`ActivityLog`]. A duplicate (nothing charged again) is not noted;
/// a charge the ledger releases by itself (its job never claimed it) is not
/// seen here. Its `Debug` is the inner ledger's.
pub struct RecordingLedger {
    inner: Arc<dyn Ledger>,
    log: Arc<dyn ActivityLog>,
}

impl std::fmt::Debug for RecordingLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl RecordingLedger {
    pub fn new(inner: Arc<dyn Ledger>, log: Arc<dyn ActivityLog>) -> Self {
        Self { inner, log }
    }

    fn spent(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: Option<&str>,
        operation: Option<(&str, Option<&str>)>,
        cost: u64,
        at_ms: u64,
    ) {
        self.log.note(Note::Spent(Spend {
            at_ms,
            user: user.to_string(),
            operation: operation.map(|(op, _)| op.to_owned()),
            service_key: operation.and_then(|(_, kid)| kid).map(str::to_owned),
            cost,
            request_id: request.to_string(),
            key: spend_key(user, request, nonce),
        }));
    }
}

#[async_trait]
impl Ledger for RecordingLedger {
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError> {
        let r = self.inner.reserve(user, request, cost).await;
        match &r {
            Ok(ReserveOutcome::Allowed(a)) if !a.duplicate => {
                self.spent(user, request, None, None, cost, a.at_ms);
            }
            Ok(ReserveOutcome::Denied(_)) => self.log.note(Note::Denied {
                user: user.to_string(),
                operation: None,
            }),
            _ => {}
        }
        r
    }

    async fn refund_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        finished: Option<&str>,
    ) -> Result<RefundOutcome, LedgerError> {
        let r = self.inner.refund_charge(user, request, finished).await;
        if let Ok(RefundOutcome::Refunded { .. } | RefundOutcome::Cancelled { .. }) = &r {
            self.log.note(Note::Refunded {
                key: spend_key(user, request, None),
            });
        }
        r
    }

    async fn settle(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
    ) -> Result<SettleOutcome, LedgerError> {
        self.inner.settle(user, request, actual_cost).await
    }

    async fn settle_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
        actual_cost: u64,
        may_raise: bool,
    ) -> Result<SettleOutcome, LedgerError> {
        self.inner
            .settle_charge(user, request, nonce, actual_cost, may_raise)
            .await
    }

    async fn exported(
        &self,
        user: &UserId,
        since_ms: u64,
        count: usize,
    ) -> Result<Vec<crate::ledger::ExportEntry>, LedgerError> {
        self.inner.exported(user, since_ms, count).await
    }

    async fn usage_page(
        &self,
        user: &UserId,
        page: crate::ledger::EventPage,
    ) -> Result<Usage, LedgerError> {
        self.inner.usage_page(user, page).await
    }

    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError> {
        let r = self.inner.charge(user, request, charge).await;
        match &r {
            Ok(ChargeOutcome::Charged { allowed, .. }) => self.spent(
                user,
                request,
                Some(charge.nonce),
                Some((charge.operation, charge.service_key)),
                charge.cost,
                allowed.at_ms,
            ),
            Ok(ChargeOutcome::Denied(_)) => self.log.note(Note::Denied {
                user: user.to_string(),
                operation: Some(charge.operation.to_owned()),
            }),
            _ => {}
        }
        r
    }

    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
        hold_until_ms: u64,
    ) -> Result<ClaimOutcome, LedgerError> {
        self.inner.claim(user, request, nonce, hold_until_ms).await
    }

    async fn release(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
    ) -> Result<RefundOutcome, LedgerError> {
        let r = self.inner.release(user, request, nonce).await;
        if let Ok(RefundOutcome::Refunded { .. }) = &r {
            self.log.note(Note::Refunded {
                key: spend_key(user, request, Some(nonce)),
            });
        }
        r
    }

    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError> {
        self.inner.set_plan(user, plan).await
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        self.inner.plan(user).await
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
            self.log.note(Note::Granted {
                provider: grant.provider.clone(),
                at_ms: grant.granted_at_us / 1000,
                waited_us: u64::try_from(grant.waited.as_micros()).unwrap_or(u64::MAX),
            });
        }
        r
    }

    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError> {
        self.inner.done(grant).await
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

    async fn usage(
        &self,
        grant: &Grant,
        used: u64,
    ) -> Result<crate::throttle::Usage, ThrottleError> {
        self.inner.usage(grant, used).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn spend(i: u64, key: &str) -> Note {
        Note::Spent(Spend {
            at_ms: i,
            user: "u".into(),
            operation: None,
            service_key: None,
            cost: 1,
            request_id: format!("r{i}"),
            key: key.into(),
        })
    }

    #[tokio::test]
    async fn memory_log_is_bounded_and_marks_refunds() {
        let log = MemoryActivity::new();
        for i in 0..(EVENTS_CAP as u64 + 5) {
            log.note(spend(i, &format!("k{i}")));
        }
        log.note(Note::Refunded {
            key: format!("k{}", EVENTS_CAP + 4),
        });
        for i in 0..(WAITS_CAP as u64 + 3) {
            log.note(Note::Granted {
                provider: "p".into(),
                at_ms: i,
                waited_us: i,
            });
        }
        let view = log.read().await.unwrap();
        assert_eq!(view.events.len(), EVENTS_CAP);
        assert_eq!(view.events[0].at_ms, EVENTS_CAP as u64 + 4);
        assert!(view.events[0].refunded);
        assert!(!view.events[1].refunded);
        assert_eq!(view.grants["p"], WAITS_CAP as u64 + 3);
        assert_eq!(view.waits["p"].len(), WAITS_CAP);
        assert_eq!(
            view.waits["p"][0],
            (WAITS_CAP as u64 + 2, WAITS_CAP as u64 + 2)
        );
    }
}
