//! Budget alerts: a crossing of a plan's `alerts` threshold, queued by the
//! budget step that made it, and the outbox the deliverer drains.
//!
//! A crossing is a change (a spend recorded, a settle raising a cost) that
//! takes a window's total from below `ceil(threshold * limit)` to at or above
//! it. It is detected inside the atomic budget step (`lua/budget/lib/state.lua`,
//! `tollgate-memory`'s ledger), so exactly one request sees each crossing, on any number of
//! pods; usage falling back below (events leaving the window, refunds) and
//! rising again is a new crossing. The step only appends the alert to its
//! subject's outbox; the deliverer (`tollgate-alerts`) sends it later, off the
//! request path, with retries, and acks it. See `docs/src/alerts.md`.

use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

use crate::config::threshold_text;
use crate::error::StoreError;

/// One queued alert: a window of a subject crossing a threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alert {
    /// Unique: `<kind>:<name>:<at_ms>-<n>`; sent as `Tollgate-Alert-Id`.
    pub id: String,
    /// `user` (organisations: `org`).
    pub kind: String,
    /// The user's (or organisation's) id.
    pub subject: String,
    pub window_ms: u64,
    /// The threshold crossed, in basis points of the limit (8000: 0.8).
    pub threshold_bp: u32,
    /// Tokens spent in the window just after the crossing.
    pub used: u64,
    pub limit: u64,
    /// When the crossing happened (the ledger's clock, ms).
    pub at_ms: u64,
}

/// The webhook's JSON body (see `docs/src/alerts.md`).
#[derive(Debug, Serialize)]
struct Body<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind_of_event: &'static str,
    subject: Subject<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    org: Option<&'a str>,
    window_ms: u64,
    threshold: serde_json::Value,
    used: crate::money::Amount,
    limit: crate::money::Amount,
    /// Money: its ISO 4217 code (absent for tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    currency: Option<&'static str>,
    at_ms: u64,
}

#[derive(Debug, Serialize)]
struct Subject<'a> {
    kind: &'a str,
    id: &'a str,
}

impl Alert {
    /// The webhook's JSON body, amounts in `currency` (tokens: integers;
    /// money: exact decimal strings, `"16"`, beside `currency`).
    pub fn body(&self, currency: crate::money::Currency) -> String {
        use crate::money::{Amount, Currency};
        let threshold = threshold_text(self.threshold_bp)
            .parse::<serde_json::Number>()
            .map(serde_json::Value::Number)
            .unwrap_or(serde_json::Value::Null);
        let body = Body {
            id: &self.id,
            kind_of_event: "budget.threshold_crossed",
            subject: Subject {
                kind: &self.kind,
                id: &self.subject,
            },
            user: (self.kind == "user").then_some(self.subject.as_str()),
            org: (self.kind == "org").then_some(self.subject.as_str()),
            window_ms: self.window_ms,
            threshold,
            used: Amount::new(currency, self.used),
            limit: Amount::new(currency, self.limit),
            currency: match currency {
                Currency::Tokens => None,
                Currency::Money(code) => Some(code.as_str()),
            },
            at_ms: self.at_ms,
        };
        serde_json::to_string(&body).unwrap_or_default()
    }
}

/// An alert leased to one deliverer until its lease ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    pub alert: Alert,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// The store's clock when it was leased (ms).
    pub now_ms: u64,
    /// The alert's outbox (one per subject): the backend's handle on it
    /// (Redis: the subject's pointer in the due set).
    pub outbox: String,
}

/// What one [`AlertOutbox::take`] leased.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    pub alerts: Vec<Leased>,
    /// Alerts dropped unsent because their subject's outbox was full
    /// ([`OUTBOX_MAX`]) since the last look: counted as failed.
    pub dropped: u64,
}

/// How far behind the outbox is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OutboxDepth {
    /// Subjects with alerts waiting (sent, retried or leased).
    pub subjects: u64,
    /// How long the most overdue subject has been due (ms; 0: none is).
    pub overdue_ms: u64,
}

/// The most alerts one subject's outbox holds: a crossing past it drops the
/// oldest (counted as failed), so a receiver down for long costs bounded memory.
pub const OUTBOX_MAX: usize = 1000;

/// The queued alerts of every subject, as the deliverer sees them. Every
/// step is atomic in the store; a lease keeps two deliverers from sending one
/// alert at once (a deliverer paused past its lease can still send a
/// duplicate, which the receiver drops by `Tollgate-Alert-Id`).
#[async_trait]
pub trait AlertOutbox: Send + Sync + std::fmt::Debug {
    /// Leases up to `max` alerts that are due, for `lease`.
    async fn take(&self, max: usize, lease: Duration) -> Result<Taken, StoreError>;
    /// Removes a delivered (or given up) alert.
    async fn ack(&self, alert: &Leased) -> Result<(), StoreError>;
    /// Makes an alert due again `after` from now, unless another lease took
    /// it meanwhile.
    async fn retry(&self, alert: &Leased, after: Duration) -> Result<(), StoreError>;
    async fn depth(&self) -> Result<OutboxDepth, StoreError>;
    /// Counts `n` attempts that ended in `result` (`delivered`, `retried`,
    /// `failed`) where every pod's dashboard reads them; `detail`: why a
    /// retried or failed one did not go through (kept as the last failure).
    async fn note(&self, result: &str, n: u64, detail: Option<&str>) -> Result<(), StoreError>;
    /// What every deliverer noted so far.
    async fn deliveries(&self) -> Result<Deliveries, StoreError>;
}

/// Delivery attempts of every deliverer sharing the store, by result, and
/// the last failure (the dashboard's alerts panel).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Deliveries {
    pub delivered: u64,
    pub retried: u64,
    pub failed: u64,
    /// When (ms, the store's clock) and why the last attempt did not go through.
    pub last_failure_ms: Option<u64>,
    pub last_failure: Option<String>,
}

/// A failure's text as stored for the dashboard: one line, at most 200
/// characters.
pub fn failure_text(detail: &str) -> String {
    detail
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(200)
        .collect()
}

/// A crossing found by a budget step, before it has an id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    pub window_ms: u64,
    pub threshold_bp: u32,
    pub used: u64,
    pub limit: u64,
    pub at_ms: u64,
}

/// One limit's thresholds: `(limit, window_ms, [(threshold_bp, tokens)])`.
pub type LimitMarks = (u64, u64, Vec<(u32, u64)>);

/// One plan's thresholds per limit, as the budget steps check them, the
/// limits in the plan's order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AlertMarks {
    pub limits: Vec<LimitMarks>,
    /// Each limit's calendar period (`None`: a trailing window): a period's
    /// crossings are per period, and what a release gave back counts until
    /// the period ends.
    pub periods: Vec<Option<&'static crate::period::Calendar>>,
}

impl AlertMarks {
    /// `None` when the plan queues no alert (no thresholds, or no `[alerts]`).
    pub fn of(config: &crate::config::Config, plan: &crate::config::Plan) -> Option<Self> {
        let bps = config.alert_thresholds(plan);
        if bps.is_empty() {
            return None;
        }
        let limits = plan
            .limits
            .iter()
            .map(|l| {
                let marks = bps
                    .iter()
                    .map(|&bp| (bp, crate::config::threshold_tokens(l.limit, bp)))
                    .collect();
                (l.limit, l.window_ms(), marks)
            })
            .collect();
        let periods = plan.limits.iter().map(|l| l.period).collect();
        Some(Self { limits, periods })
    }

    /// Limit `k`'s window as a crossing names it (a period's: the length of
    /// the one holding `at_ms`), and when an event spent at `spent_ms` has
    /// left it (a period's: when that period ends).
    fn span(&self, k: usize, window_ms: u64, at_ms: u64) -> (u64, u64) {
        match self.periods.get(k).copied().flatten() {
            Some(c) => c
                .period_at(at_ms)
                .map_or((0, at_ms), |p| (p.len_ms(), p.end_ms)),
            None => (window_ms, at_ms.saturating_add(window_ms)),
        }
    }

    /// The crossings of a change that took the windows' totals from `before`
    /// to `after` (one per limit, in order), but none of a threshold the
    /// window crossed already and left only by releases (`latches`, kept by
    /// [`lowered`](Self::lowered); see [`Latch`]). Latches the thresholds
    /// crossed.
    pub fn crossings(
        &self,
        before: &[u64],
        after: &[u64],
        at_ms: u64,
        latches: &mut Vec<Latch>,
    ) -> Vec<Crossing> {
        self.fit(latches);
        let mut out = Vec::new();
        for (k, (limit, window_ms, marks)) in self.limits.iter().enumerate() {
            let (Some(&b), Some(&a)) = (before.get(k), after.get(k)) else {
                continue;
            };
            let latch = &mut latches[k];
            latch.lapse(at_ms);
            for (i, &(bp, tokens)) in marks.iter().enumerate() {
                if b < tokens && a >= tokens {
                    if latch.latched[i] && b.saturating_add(latch.released) >= tokens {
                        continue;
                    }
                    latch.latched[i] = true;
                    out.push(Crossing {
                        window_ms: self.span(k, *window_ms, at_ms).0,
                        threshold_bp: bp,
                        used: a,
                        limit: *limit,
                        at_ms,
                    });
                }
            }
        }
        out
    }

    /// A release, a refund or a settle down of an event spent at `spent_ms`
    /// took the windows' totals from `before` to `after`: while a window's
    /// threshold stays latched, what it gave back is added to the window's
    /// `released` until that event would have left the window.
    pub fn lowered(
        &self,
        before: &[u64],
        after: &[u64],
        spent_ms: u64,
        now_ms: u64,
        latches: &mut Vec<Latch>,
    ) {
        self.fit(latches);
        for (k, (_, window_ms, marks)) in self.limits.iter().enumerate() {
            let (Some(&b), Some(&a)) = (before.get(k), after.get(k)) else {
                continue;
            };
            if a >= b {
                continue;
            }
            let latch = &mut latches[k];
            latch.lapse(now_ms);
            // A threshold the window left by sliding is re-armed.
            let gross = b.saturating_add(latch.released);
            for (i, &(_, tokens)) in marks.iter().enumerate() {
                if gross < tokens {
                    latch.latched[i] = false;
                }
            }
            if latch.latched.iter().any(|&l| l) {
                latch.released += b - a;
                latch.until_ms = latch.until_ms.max(self.span(k, *window_ms, spent_ms).1);
            } else {
                latch.released = 0;
                latch.until_ms = 0;
            }
        }
    }

    /// `latches` as this plan's (one per limit, one flag per threshold); a
    /// plan whose limits changed starts unlatched.
    fn fit(&self, latches: &mut Vec<Latch>) {
        let fits = latches.len() == self.limits.len()
            && latches
                .iter()
                .zip(&self.limits)
                .all(|(l, (_, _, m))| l.latched.len() == m.len());
        if !fits {
            *latches = self
                .limits
                .iter()
                .map(|(_, _, m)| Latch {
                    latched: vec![false; m.len()],
                    ..Latch::default()
                })
                .collect();
        }
    }
}

/// One window's thresholds crossed (each alerted once) and what releases,
/// refunds and settles down gave back since: a threshold stays crossed
/// while the window's total plus `released` is at or above it, so a total
/// brought back below it by a release and up again crosses nothing new.
/// Only the window sliding re-arms it: events leaving the window lower the
/// total and not `released`, and `released` itself lapses once every event
/// it counts would have left the window (`until_ms`). Kept by the budget
/// step, as `lua/budget/lib/alerts.lua` keeps meta's field 'q'.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Latch {
    pub released: u64,
    pub until_ms: u64,
    /// Per threshold, in the plan's order: crossed (alerted) and not re-armed.
    pub latched: Vec<bool>,
}

impl Latch {
    /// Forgets `released` once every event it counts left the window.
    fn lapse(&mut self, now_ms: u64) {
        if self.released > 0 && now_ms >= self.until_ms {
            self.released = 0;
            self.until_ms = 0;
        }
    }
}

/// An outbox where nothing is ever queued (no `[alerts]`).
#[derive(Debug, Default)]
pub struct NoAlerts;

#[async_trait]
impl AlertOutbox for NoAlerts {
    async fn take(&self, _max: usize, _lease: Duration) -> Result<Taken, StoreError> {
        Ok(Taken::default())
    }
    async fn ack(&self, _alert: &Leased) -> Result<(), StoreError> {
        Ok(())
    }
    async fn retry(&self, _alert: &Leased, _after: Duration) -> Result<(), StoreError> {
        Ok(())
    }
    async fn depth(&self) -> Result<OutboxDepth, StoreError> {
        Ok(OutboxDepth::default())
    }
    async fn note(&self, _result: &str, _n: u64, _detail: Option<&str>) -> Result<(), StoreError> {
        Ok(())
    }
    async fn deliveries(&self) -> Result<Deliveries, StoreError> {
        Ok(Deliveries::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crossing_is_from_below_to_at_or_above() {
        let marks = AlertMarks {
            limits: vec![(10, 1000, vec![(8000, 8), (10_000, 10)])],
            ..AlertMarks::default()
        };
        let fresh = || Vec::new();
        assert!(marks.crossings(&[7], &[7], 1, &mut fresh()).is_empty());
        assert_eq!(marks.crossings(&[7], &[8], 1, &mut fresh()).len(), 1);
        assert!(marks.crossings(&[8], &[9], 1, &mut fresh()).is_empty());
        let both = marks.crossings(&[0], &[10], 1, &mut fresh());
        assert_eq!(
            both.iter().map(|c| c.threshold_bp).collect::<Vec<_>>(),
            [8000, 10_000]
        );
    }

    #[test]
    fn a_period_alerts_once_per_period() {
        use crate::period::{Calendar, PeriodKind};
        let day = Calendar::new(PeriodKind::Day, "UTC")
            .unwrap()
            .intern()
            .unwrap();
        let marks = AlertMarks {
            limits: vec![(10, 0, vec![(8000, 8)])],
            periods: vec![Some(day)],
        };
        const DAY: u64 = 86_400_000;
        let mut l = Vec::new();
        let c = marks.crossings(&[7], &[8], 100, &mut l);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].window_ms, DAY);
        // A refund in the day, then charged again: the same crossing, even
        // late in the day.
        marks.lowered(&[8], &[5], 100, 200, &mut l);
        assert!(marks.crossings(&[5], &[8], DAY - 1, &mut l).is_empty());
        // The next day starts from 0: its crossing alerts.
        assert_eq!(marks.crossings(&[0], &[8], DAY + 5, &mut l).len(), 1);
    }

    #[test]
    fn a_release_does_not_re_arm_a_threshold_the_window_sliding_does() {
        let marks = AlertMarks {
            limits: vec![(10, 1000, vec![(8000, 8)])],
            ..AlertMarks::default()
        };
        let mut l = Vec::new();
        assert_eq!(marks.crossings(&[7], &[8], 100, &mut l).len(), 1);
        // Released (spent at 100), charged again: the same crossing.
        for now in 101..150 {
            marks.lowered(&[8], &[7], 100, now, &mut l);
            assert!(marks.crossings(&[7], &[8], now, &mut l).is_empty());
        }
        // The 7 left by sliding (to 0), then 8 more: a new crossing.
        assert_eq!(marks.crossings(&[0], &[8], 1200, &mut l).len(), 1);
        // Slid below (7 left, 1 stays) with releases still counted: a
        // release there finds the threshold re-armed.
        marks.lowered(&[8], &[7], 1200, 1300, &mut l);
        marks.lowered(&[1], &[0], 1250, 2100, &mut l);
        assert_eq!(marks.crossings(&[7], &[8], 2150, &mut l).len(), 1);
    }

    #[test]
    fn the_body_names_the_threshold_as_written() {
        use serde_json::json;
        let a = Alert {
            id: "user:alice:5-1".into(),
            kind: "user".into(),
            subject: "alice".into(),
            window_ms: 1000,
            threshold_bp: 8000,
            used: 8,
            limit: 10,
            at_ms: 5,
        };
        let v: serde_json::Value =
            serde_json::from_str(&a.body(crate::money::Currency::Tokens)).expect("json");
        assert_eq!(v["threshold"], json!(0.8));
        assert_eq!(v["user"], "alice");
        assert_eq!(v["subject"]["kind"], "user");
        // Tokens: integers and no currency, as the body always was.
        assert_eq!(
            (v["used"].clone(), v["limit"].clone()),
            (json!(8), json!(10))
        );
        assert!(v.get("currency").is_none(), "{v}");
        // Money: exact decimal strings of the currency, which it names.
        let usd = crate::money::Currency::parse("USD").expect("USD");
        let a = Alert {
            used: 16_000_150,
            limit: 20_000_000,
            ..a
        };
        let v: serde_json::Value = serde_json::from_str(&a.body(usd)).expect("json");
        assert_eq!(v["used"], json!("16.00015"));
        assert_eq!(v["limit"], json!("20"));
        assert_eq!(v["currency"], json!("USD"));
    }
}
