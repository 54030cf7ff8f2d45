//! The in-memory ledger: the embedded backend, with the same semantics as the
//! Redis scripts in `lua/`.
//!
//! Users live in a sharded map of `Arc<Mutex<UserLog>>`. A shard lock is held only
//! to find or insert a user's entry, never while a budget is computed, so one hot
//! user serialises only its own requests. Idle users (empty log, no stored plan)
//! are swept a shard at a time as operations go by, the way Redis keys expire.
//!
//! Organisations: a member's log lives in its organisation (`Org`), next to
//! the organisation's own log (`OrgLog`), behind the organisation's lock; the
//! user's entry in its shard keeps only the pointer (`UserLog::org`). A call
//! holds the user's entry's lock, then the organisation's: a move (which takes
//! the user's entry first too) never interleaves with the user's calls.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

mod credits;

use crate::alerts::MemoryAlerts;
use crate::model_limits::ModelCounts;
use crate::periods::Periods;
use crate::rollups::Rollups;
use std::borrow::Cow;
use tollgate_core::alerts::{AlertMarks, Crossing, Latch};
use tollgate_core::clock::{Clock, SystemClock};
use tollgate_core::config::{Config, Limit, ModelLimit, Plan};
use tollgate_core::credits::CreditMode;
use tollgate_core::id::{OrgId, RequestId, UserId};
use tollgate_core::ledger::{
    audit_op, check_custom_limits as check_custom, split_audit_op, unknown_plan, validate_cost,
    Allowed, ChangeKind, ChargeOutcome, ChargeRequest, ClaimOutcome, ClaimRequest, Denied,
    EventCursor, EventPage, ExportEntry, Ledger, LedgerError, Moved, OperatorSettleOutcome,
    OrgList, OrgUsage, OrgWindows, RefundOutcome, ReserveOutcome, SettleOutcome, SettleRequest,
    SpendEvent, Usage, WindowUse, CUSTOM_PLAN,
};
use tollgate_core::lock;
use tollgate_core::period::Span;
use tollgate_core::spend::{Bucket, Dims, Step};

const SHARDS: usize = 64;
/// One shard is swept for idle users every this many operations.
const SWEEP_EVERY: u64 = 1024;
/// And every shard at least this often (ms), when operations come by at all.
pub const FULL_SWEEP_EVERY_MS: u64 = 60_000;

type Shard = Mutex<HashMap<UserId, Arc<Mutex<UserLog>>>>;

/// The embedded budget ledger.
pub struct MemoryLedger<C: Clock = SystemClock> {
    config: Arc<Config>,
    /// How long a log keeps an event ([`Config::retention_ms`]).
    retention: u64,
    clock: C,
    hasher: RandomState,
    shards: Box<[Shard]>,
    ops: AtomicU64,
    /// When an operation next sweeps every shard (clock ms).
    next_full_sweep: AtomicU64,
    /// Where crossings go (`None`: no `[alerts]`), and each plan's thresholds.
    alerts: Option<MemoryAlerts>,
    marks: HashMap<String, Arc<AlertMarks>>,
    /// Every organisation, by name.
    orgs: Mutex<BTreeMap<OrgId, Arc<Mutex<Org>>>>,
    /// The spend rollups (taken under a user's lock, never the other way).
    rollups: Mutex<Rollups>,
}

/// An organisation: its plan, its own log, and its members' logs.
struct Org {
    plan: String,
    log: OrgLog,
    members: BTreeMap<UserId, UserLog>,
}

/// An organisation's log: every live event of its members, keyed by
/// `<request>/<user>`, with the same running window totals as a user's. An
/// event moved in with a past time is inserted at that time (a map ordered
/// by time), so it leaves each window when it would have.
#[derive(Default)]
struct OrgLog {
    events: BTreeMap<(u64, Arc<str>), u64>,
    index: HashMap<Arc<str>, u64>,
    total: u64,
    shorts: Vec<Short>,
    first: usize,
    /// The totals of the plan's calendar periods.
    periods: Periods,
    /// Each window's total once the call under way brought them to now
    /// (`OrgSide::sync`): what the call's change is compared with for alert
    /// crossings.
    before: Vec<u64>,
    /// The thresholds of the organisation's plan in the call under way
    /// (`None`: no alerts), and the crossings its windows keep
    /// ([`Latch`]).
    marks: Option<Arc<AlertMarks>>,
    latches: Vec<Latch>,
}

/// The thresholds of `marks` each window of `log` crossed since its `before`.
fn org_crossings(log: &mut OrgLog, marks: &AlertMarks, now: u64) -> Vec<Crossing> {
    let after: Vec<u64> = (0..log.before.len()).map(|i| log.used(i)).collect();
    marks.crossings(&log.before, &after, now, &mut log.latches)
}

fn org_key(user: &UserId, request: &str) -> Arc<str> {
    Arc::from(format!("{request}/{user}"))
}

impl OrgLog {
    /// Brings every window to `now` (as `UserLog::expire`).
    fn expire(&mut self, now: u64, limits: &[Limit], retain: u64) {
        let longest = longest_window(limits);
        let retain = retain.max(longest);
        self.first = usize::from(longest > 0 && longest >= retain);
        self.periods.sync(now, limits);
        let wanted = windows_from(limits, self.first);
        let Self { shorts, events, .. } = self;
        if !shorts.iter().map(|s| s.window).eq(wanted.clone()) {
            *shorts = wanted
                .map(|window| {
                    let edge = now.saturating_sub(window);
                    Short {
                        window,
                        total: events
                            .range((edge + 1, Arc::from(""))..)
                            .map(|(_, c)| c)
                            .sum(),
                        cursor: edge,
                    }
                })
                .collect();
        } else {
            for s in shorts.iter_mut() {
                let edge = now.saturating_sub(s.window);
                if edge > s.cursor {
                    let left: u64 = events
                        .range((s.cursor + 1, Arc::from(""))..(edge + 1, Arc::from("")))
                        .map(|(_, c)| c)
                        .sum();
                    s.total = s.total.saturating_sub(left);
                    s.cursor = edge;
                }
            }
        }
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0.saturating_add(retain) > now {
                break;
            }
            let ((_, key), cost) = entry.remove_entry();
            self.index.remove(&key);
            self.total = self.total.saturating_sub(cost);
        }
    }

    /// Adds an event spent at `at` (after `expire`): counted in every window
    /// it is still inside.
    fn add(&mut self, key: Arc<str>, at: u64, cost: u64, now: u64, retain: u64) {
        if self.index.contains_key(&key) || at.saturating_add(retain) <= now {
            return;
        }
        self.events.insert((at, Arc::clone(&key)), cost);
        self.index.insert(key, at);
        self.total += cost;
        self.periods.add_at(at, cost);
        for s in &mut self.shorts {
            if at > s.cursor {
                s.total += cost;
            }
        }
    }

    /// Sets an event's cost (0 removes it) for a release, a refund or a
    /// settle: what it gives back keeps the thresholds crossed
    /// ([`Latch`]).
    fn give_back(&mut self, key: &str, cost: u64, now: u64) {
        let Some(marks) = self.marks.clone() else {
            self.recost(key, cost);
            return;
        };
        let Some(&at) = self.index.get(key) else {
            return;
        };
        let before: Vec<u64> = (0..marks.limits.len()).map(|i| self.used(i)).collect();
        self.recost(key, cost);
        let after: Vec<u64> = (0..marks.limits.len()).map(|i| self.used(i)).collect();
        marks.lowered(&before, &after, at, now, &mut self.latches);
    }

    /// Sets an event's cost (0 removes it).
    fn recost(&mut self, key: &str, cost: u64) {
        let Some(&at) = self.index.get(key) else {
            return;
        };
        let key: Arc<str> = Arc::from(key);
        let Some(previous) = self.events.get(&(at, Arc::clone(&key))).copied() else {
            return;
        };
        if cost == 0 {
            self.events.remove(&(at, Arc::clone(&key)));
            self.index.remove(&key);
        } else {
            self.events.insert((at, key), cost);
        }
        self.total = (self.total + cost).saturating_sub(previous);
        self.periods.recost(at, previous, cost);
        for s in &mut self.shorts {
            if at > s.cursor {
                s.total = (s.total + cost).saturating_sub(previous);
            }
        }
    }
}

impl Windowed for OrgLog {
    fn totals(&self) -> (u64, &[Short], usize) {
        (self.total, &self.shorts, self.first)
    }

    fn periods(&self) -> &Periods {
        &self.periods
    }

    fn inside(&self, now: u64, w: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let edge = now.saturating_sub(w);
        self.events
            .range((edge + 1, Arc::from(""))..)
            .map(|((at, _), cost)| (*at, *cost))
    }
}

/// The first step of a reserve or a charge of `cost` (under the user's
/// lock): refuses a cost that the user's plan, or its organisation's, could
/// never hold, then brings the user's windows and its organisation's to
/// `now`.
fn bring_to_now(
    log: &mut UserLog,
    side: Option<&mut OrgSide<'_>>,
    plan: &Plan,
    cost: u64,
    now: u64,
) -> Result<(), LedgerError> {
    let most = side
        .as_ref()
        .map_or(plan.max_cost(), |s| plan.max_cost().min(s.plan.max_cost()));
    if cost > most {
        return Err(LedgerError::CostExceedsLimit { cost, limit: most });
    }
    log.expire_with_org(now, &plan.limits, side);
    Ok(())
}

/// A member's organisation, as a call sees it (under its lock).
struct OrgSide<'a> {
    org: &'a OrgId,
    plan: &'a Plan,
    log: &'a mut OrgLog,
    user: &'a UserId,
    retain: u64,
}

impl OrgSide<'_> {
    /// After the user's `expire`: the organisation's windows to now, and its
    /// copies of the charges that released gone too.
    fn sync(&mut self, user: &mut UserLog, now: u64) {
        self.log.expire(now, &self.plan.limits, self.retain);
        for request in user.released.drain(..) {
            self.log.give_back(&org_key(self.user, &request), 0, now);
        }
        self.log.before = (0..self.plan.limits.len())
            .map(|i| self.log.used(i))
            .collect();
    }

    fn add(&mut self, request: &str, at: u64, cost: u64, now: u64) {
        let key = org_key(self.user, request);
        self.log.add(key, at, cost, now, self.retain);
    }

    fn recost(&mut self, request: &str, cost: u64, now: u64) {
        self.log.give_back(&org_key(self.user, request), cost, now);
    }

    fn windows(&self, now: u64) -> OrgWindows {
        OrgWindows {
            org: self.org.clone(),
            plan: self.plan.name.clone(),
            windows: self.log.windows(&self.plan.limits, now),
        }
    }

    /// The denial of `cost` when it does not fit the user's or the
    /// organisation's windows.
    fn deny(&self, user: &UserLog, limits: &[Limit], cost: u64, now: u64) -> Option<Denied> {
        if user.fits(limits, cost)
            && user.models_fit(cost, now)
            && self.log.fits(&self.plan.limits, cost)
        {
            return None;
        }
        let retry: Vec<u64> = (self.plan.limits.iter().enumerate())
            .map(|(i, l)| self.log.retry_after(i, l, cost, now))
            .collect();
        Some(Denied::member(
            user.denial(limits, cost, now),
            self.windows(now),
            &retry,
        ))
    }
}

/// One user's sliding window log.
#[derive(Default)]
struct UserLog {
    plan: Option<String>,
    /// The limits an admin set for this user ([`Ledger::set_limits`]): they
    /// replace its plan's.
    custom: Option<Vec<Limit>>,
    /// The live events in time order.
    events: Log,
    /// request -> its sequence number in `events`. The id's text is shared
    /// with the event.
    index: HashMap<Arc<str>, u64>,
    /// (end of hold, seq) -> request: charges no job has claimed yet.
    holds: BTreeMap<(u64, u64), Arc<str>>,
    /// Running sum of the costs of every event in the log (kept for the
    /// retention): no call sums the log.
    total: u64,
    /// The running totals of the plan's windows shorter than the retention
    /// (limits[first..]).
    shorts: Vec<Short>,
    /// 1 when the plan's longest window spans the retention (its total is
    /// `total`), else 0.
    first: usize,
    /// The totals of the plan's calendar periods (limits after the windows).
    periods: Periods,
    /// How long the log keeps an event: the longest window of any plan.
    retain: u64,
    /// Charges an operator refunded while they were held: their jobs are
    /// cancelled. Nonce -> end of the hold, and the same ordered by end to
    /// drop them once it passed.
    cancelled: HashMap<Box<str>, u64>,
    cancel_ends: std::collections::BTreeSet<(u64, Box<str>)>,
    /// The export (`[export] maxlen` entries at most; 0: none), and the id of
    /// its last entry.
    exported: VecDeque<ExportEntry>,
    export_max: u64,
    export_last: (u64, u64),
    /// Numbers holds apart.
    seq: u64,
    /// Removed from its shard by the sweeper; a caller holding a stale `Arc`
    /// looks the user up again.
    retired: bool,
    /// The thresholds of the plan of the call under way (`None`: no alerts).
    marks: Option<Arc<AlertMarks>>,
    /// Crossings this call made, queued to the outbox when it ends, and the
    /// thresholds the windows keep crossed ([`Latch`]).
    crossings: Vec<Crossing>,
    latches: Vec<Latch>,
    /// The organisation the user lives in: its log is there (this entry
    /// keeps only the pointer).
    org: Option<OrgId>,
    /// Charges `expire` released this call (the organisation's copies go too).
    released: Vec<Arc<str>>,
    /// The dimensions' code of the event this call records (0: none).
    code: u32,
    /// The changes this call made to its charges, for the spend rollups
    /// (`MemoryLedger::roll` counts them before the call returns).
    spent: Vec<crate::rollups::Change>,
    /// The counters of the plan's model limits.
    models: ModelCounts,
    /// The model limits this call counts under (a charge's) or shows
    /// (usage): none unless the call sets them.
    call_models: Vec<ModelLimit>,
    /// Prepaid credits (`credits`), and whether this call's charges draw.
    credits: credits::Credits,
    credit: credits::CreditCall,
}

/// One spend event: live, or the hole a removed one left (`request: None`).
struct Event {
    at: u64,
    /// Its number among the events recorded in its millisecond: (at, seq) is
    /// its position, as a Redis stream entry ID is, and the cursor of a page
    /// of the audit trail (`Log::page`). Stable when other events leave.
    seq: u32,
    /// Its dimensions' code in the spend rollups (0: none).
    code: u32,
    request: Option<Arc<str>>,
    cost: u64,
    /// Who owns a job's charge (`charge`); plain reserves have none.
    owner: Option<Box<Owner>>,
}

/// A user's events in time order, each numbered by its position since the
/// first: a deque, about a third of the memory of a B-tree filled in time
/// order (whose nodes stay half full). An event removed before its time (a
/// refund) leaves a hole until the holes reach the front or outnumber the
/// events, when the owner compacts the log (`UserLog::take`).
#[derive(Default)]
struct Log {
    slots: VecDeque<Event>,
    /// The sequence number of `slots[0]`.
    base: u64,
    holes: usize,
    /// The position (at, seq) of the last event pushed, which it keeps once the
    /// event left: the next in the same millisecond follows it.
    last: (u64, u32),
}

impl Log {
    fn is_empty(&self) -> bool {
        self.slots.len() == self.holes
    }

    fn last_at(&self) -> Option<u64> {
        self.slots.back().map(|e| e.at)
    }

    /// Appends an event (at or after the last one's time), giving it its
    /// position; returns its number.
    fn push(&mut self, mut e: Event) -> u64 {
        e.seq = match self.last {
            (at, seq) if at == e.at => seq.saturating_add(1),
            _ => 0,
        };
        self.last = (e.at, e.seq);
        self.slots.push_back(e);
        self.base + self.slots.len() as u64 - 1
    }

    fn slot(&self, seq: u64) -> Option<usize> {
        usize::try_from(seq.checked_sub(self.base)?).ok()
    }

    fn get(&self, seq: u64) -> Option<&Event> {
        self.slots
            .get(self.slot(seq)?)
            .filter(|e| e.request.is_some())
    }

    fn get_mut(&mut self, seq: u64) -> Option<&mut Event> {
        let i = self.slot(seq)?;
        self.slots.get_mut(i).filter(|e| e.request.is_some())
    }

    /// Takes a live event out, leaving a hole.
    fn remove(&mut self, seq: u64) -> Option<Event> {
        let slot = self.get_mut(seq)?;
        let hole = Event {
            at: slot.at,
            seq: slot.seq,
            code: 0,
            request: None,
            cost: 0,
            owner: None,
        };
        let e = std::mem::replace(slot, hole);
        self.holes += 1;
        while self.slots.front().is_some_and(|e| e.request.is_none()) {
            self.slots.pop_front();
            self.base += 1;
            self.holes -= 1;
        }
        Some(e)
    }

    /// The oldest live event and its number.
    fn first(&self) -> Option<(u64, &Event)> {
        // Holes never stay at the front (`remove`).
        self.slots.front().map(|e| (self.base, e))
    }

    /// Live events with a time in (lo, hi] (`None`: unbounded), oldest first.
    fn between(&self, lo: Option<u64>, hi: Option<u64>) -> impl Iterator<Item = &Event> + '_ {
        let start = lo.map_or(0, |lo| self.slots.partition_point(|e| e.at <= lo));
        let end = hi.map_or(self.slots.len(), |hi| {
            self.slots.partition_point(|e| e.at <= hi)
        });
        self.slots
            .range(start..end.max(start))
            .filter(|e| e.request.is_some())
    }

    /// Up to `limit` live events with a time past `lo` and a position past
    /// `after` (`None`: unbounded), oldest first, and whether more follow:
    /// O(log n + limit).
    fn page(
        &self,
        lo: Option<u64>,
        after: Option<EventCursor>,
        limit: usize,
    ) -> (Vec<&Event>, bool) {
        let from = lo.map_or(0, |lo| self.slots.partition_point(|e| e.at <= lo));
        let start = after.map_or(0, |c| {
            self.slots
                .partition_point(|e| (e.at, u64::from(e.seq)) <= (c.at_ms, c.seq))
        });
        let start = start.max(from);
        let mut live = self.slots.range(start..).filter(|e| e.request.is_some());
        let page: Vec<&Event> = live.by_ref().take(limit).collect();
        let more = live.next().is_some();
        (page, more)
    }

    /// Live events inside a window that ends at `now`, oldest first.
    fn inside(&self, now: u64, window: u64) -> impl Iterator<Item = &Event> + '_ {
        self.between(now.checked_sub(window), None)
    }

    /// Drops the holes; calls `renumbered(request, seq)` for every event that
    /// moved.
    fn compact(&mut self, mut renumbered: impl FnMut(&Arc<str>, u64)) {
        self.slots.retain(|e| e.request.is_some());
        self.slots.shrink_to_fit();
        self.holes = 0;
        for (i, e) in self.slots.iter().enumerate() {
            if let Some(r) = &e.request {
                renumbered(r, self.base + i as u64);
            }
        }
    }
}

/// The owner record of a job's charge (the packed log record of `lua/budget/lib/codec.lua`).
struct Owner {
    nonce: Box<str>,
    deadline_ms: u64,
    operation: Box<str>,
    fingerprint: Box<str>,
    /// The key in `holds` while no job has claimed the charge.
    hold: Option<(u64, u64)>,
    /// The cost charged up front, once the charge was settled to the actual.
    estimate: Option<u64>,
    /// The tags of the model limits the charge counted under.
    models: Option<Box<[Arc<str>]>>,
}

/// The subject of one exported change.
struct Change<'a> {
    request: &'a str,
    cost: u64,
    previous: Option<u64>,
    at: u64,
    operation: Option<&'a str>,
}

/// The longest trailing window of `limits` (windows come first; 0: none).
fn longest_window(limits: &[Limit]) -> u64 {
    limits
        .first()
        .filter(|l| !l.is_period())
        .map_or(0, Limit::window_ms)
}

/// The lengths of the trailing windows of `limits` from the `first`-th on.
fn windows_from(limits: &[Limit], first: usize) -> impl Iterator<Item = u64> + Clone + '_ {
    limits
        .iter()
        .skip(first)
        .filter(|l| !l.is_period())
        .map(Limit::window_ms)
}

/// The running total of one of the plan's windows shorter than the retention
/// (the others' is `UserLog::total`).
struct Short {
    window: u64,
    total: u64,
    /// Events at or before this time have been subtracted.
    cursor: u64,
}

/// A log of spend events with running window totals, read alike whether it
/// is a user's (a deque of events) or an organisation's (a map by time):
/// each window's use, reset and wait come from the totals and the events
/// still inside it.
trait Windowed {
    /// The running totals: of the windows as long as the retention, of each
    /// shorter one, and the index of the first limit that is shorter.
    fn totals(&self) -> (u64, &[Short], usize);

    /// The totals of the calendar periods (the limits after the windows).
    fn periods(&self) -> &Periods;

    /// The (time, cost) of the live events inside a window of `w` ms that
    /// ends at `now`, oldest first.
    fn inside(&self, now: u64, w: u64) -> impl Iterator<Item = (u64, u64)> + '_;

    /// How many of the plan's limits are trailing windows (after
    /// `expire`; its periods follow them).
    fn windows_n(&self) -> usize {
        let (_, shorts, first) = self.totals();
        first + shorts.len()
    }

    /// Tokens spent in limit `i`'s window (after `expire`).
    fn used(&self, i: usize) -> u64 {
        let (total, shorts, first) = self.totals();
        match i.checked_sub(first) {
            None => total,
            Some(k) if k < shorts.len() => shorts[k].total,
            Some(k) => self.periods().get(k - shorts.len()).map_or(0, |(_, t)| t),
        }
    }

    fn fits(&self, limits: &[Limit], cost: u64) -> bool {
        limits
            .iter()
            .enumerate()
            .all(|(i, l)| self.used(i) + cost <= l.limit)
    }

    /// Every limit as it stands at `now` (after `expire`).
    fn windows(&self, limits: &[Limit], now: u64) -> Vec<WindowUse> {
        limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if l.is_period() {
                    let span = self.periods().get(i.saturating_sub(self.windows_n()));
                    let span = span.map(|(s, _)| s);
                    let span = span.unwrap_or(Span {
                        start_ms: now,
                        end_ms: now,
                    });
                    return WindowUse::period(l.limit, span, self.used(i), now);
                }
                let w = l.window_ms();
                let reset = self
                    .inside(now, w)
                    .next()
                    .map(|(at, _)| (at + w).saturating_sub(now));
                WindowUse::new(l.limit, w, self.used(i), reset)
            })
            .collect()
    }

    /// Exactly how long until enough old events leave limit `i`'s window for
    /// `cost` to fit it (0: it fits). Terminates within the log because
    /// cost <= limit.
    fn retry_after(&self, i: usize, l: &Limit, cost: u64, now: u64) -> u64 {
        let (used, w) = (self.used(i), l.window_ms());
        let need = (used + cost).saturating_sub(l.limit);
        if need == 0 {
            return 0;
        }
        if l.is_period() {
            // Nothing leaves a period before it ends.
            return self
                .periods()
                .get(i.saturating_sub(self.windows_n()))
                .map_or(0, |(s, _)| s.end_ms.saturating_sub(now));
        }
        let mut freed = 0;
        for (at, cost) in self.inside(now, w) {
            freed += cost;
            if freed >= need {
                return (at + w).saturating_sub(now);
            }
        }
        w
    }
}

impl Windowed for UserLog {
    fn totals(&self) -> (u64, &[Short], usize) {
        (self.total, &self.shorts, self.first)
    }

    fn periods(&self) -> &Periods {
        &self.periods
    }

    fn inside(&self, now: u64, w: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.events.inside(now, w).map(|e| (e.at, e.cost))
    }
}

impl UserLog {
    /// Brings every window's total to `now` (subtracting what left the windows
    /// shorter than the retention, dropping what left the retention), then
    /// releases charges still held past their hold (no job can claim them any
    /// more), and forgets cancelled jobs' holds that ended.
    fn expire(&mut self, now: u64, limits: &[Limit]) {
        let longest = longest_window(limits);
        self.retain = self.retain.max(longest);
        self.first = usize::from(longest > 0 && longest >= self.retain);
        self.sync_shorts(now, limits);
        self.periods.sync(now, limits);
        self.models.sync(now);
        let window = self.retain;
        while let Some((_, e)) = self.events.first() {
            if e.at.saturating_add(window) > now {
                break;
            }
            // Leaving the window is not a change: nothing is exported.
            let Some(request) = e.request.clone() else {
                break; // never: holes do not stay at the front
            };
            self.take(&request, now);
            self.credits.forget(&request);
        }
        while let Some(entry) = self.holds.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let request = entry.remove();
            self.remove(&request, now);
            self.released.push(request);
        }
        while let Some(first) = self.cancel_ends.first() {
            if first.0 > now {
                break;
            }
            if let Some((_, nonce)) = self.cancel_ends.pop_first() {
                self.cancelled.remove(&nonce);
            }
        }
    }

    /// Brings the user's windows, and then its organisation's (when it has
    /// one), to `now`: the first step of every call that reads or changes
    /// them.
    fn expire_with_org(&mut self, now: u64, limits: &[Limit], side: Option<&mut OrgSide<'_>>) {
        self.expire(now, limits);
        if let Some(side) = side {
            side.sync(self, now);
        }
    }

    /// Cancels the job of a held charge (refunded by an operator): its claim
    /// is refused until `hold_end`.
    fn cancel(&mut self, nonce: &str, hold_end: u64) {
        if let Some(old) = self.cancelled.insert(nonce.into(), hold_end) {
            self.cancel_ends.remove(&(old, nonce.into()));
        }
        self.cancel_ends.insert((hold_end, nonce.into()));
    }

    /// Moves the total of each window shorter than the retention to `now`. A
    /// plan whose windows changed (a plan change) has them rebuilt from the
    /// log, once.
    fn sync_shorts(&mut self, now: u64, limits: &[Limit]) {
        let wanted = windows_from(limits, self.first);
        let Self { shorts, events, .. } = self;
        if !shorts.iter().map(|s| s.window).eq(wanted.clone()) {
            *shorts = wanted
                .map(|window| Short {
                    window,
                    total: events.inside(now, window).map(|e| e.cost).sum(),
                    cursor: now.saturating_sub(window),
                })
                .collect();
            return;
        }
        for s in shorts.iter_mut() {
            let edge = now.saturating_sub(s.window);
            if edge > s.cursor {
                let left = events.between(Some(s.cursor), Some(edge));
                s.total = s.total.saturating_sub(left.map(|e| e.cost).sum());
                s.cursor = edge;
            }
        }
    }

    /// Appends the entry `entry` makes of its export id (`<ms>-<seq>`, in
    /// time order even if the clock went back), when there is an export, and
    /// drops the oldest past its length.
    fn push_export(&mut self, now: u64, entry: impl FnOnce(String) -> ExportEntry) {
        if self.export_max == 0 {
            return;
        }
        let ms = now.max(self.export_last.0);
        let seq = if ms == self.export_last.0 {
            self.export_last.1 + 1
        } else {
            0
        };
        self.export_last = (ms, seq);
        self.exported.push_back(entry(format!("{ms}-{seq}")));
        while self.exported.len() as u64 > self.export_max {
            self.exported.pop_front();
        }
    }

    /// Appends one change to the export (when there is one).
    fn export(&mut self, now: u64, kind: ChangeKind, e: Change<'_>) {
        self.push_export(now, |id| ExportEntry {
            id,
            kind,
            request_id: RequestId::from_kept(e.request),
            cost: e.cost,
            previous_cost: e.previous,
            spent_at_ms: e.at,
            operation: e.operation.map(|op| split_audit_op(op).0.to_owned()),
            service_key: e
                .operation
                .and_then(|op| split_audit_op(op).1)
                .map(str::to_owned),
            forced: false,
            model: None,
            entry: None,
            prices: None,
            grant: None,
            expires_at_ms: None,
        });
    }

    /// Records a spend event of `cost` at `now` (inside every window); returns
    /// its time: `now`, or the last event's if the clock went back meanwhile,
    /// so that the log stays in time order.
    fn record(
        &mut self,
        request: &RequestId,
        cost: u64,
        now: u64,
        operation: Option<&str>,
        mut owner: Option<Box<Owner>>,
    ) -> u64 {
        let before = self.window_totals();
        if let Some(o) = owner.as_mut() {
            let limits: Vec<&ModelLimit> = self.call_models.iter().collect();
            o.models = self.models.add_now(&limits, cost, now);
        }
        let at = self.events.last_at().map_or(now, |last| now.max(last));
        let change = Change {
            request: request.as_str(),
            cost,
            previous: None,
            at,
            operation,
        };
        self.export(now, ChangeKind::Spend, change);
        let request: Arc<str> = Arc::from(request.as_str());
        if self.code != 0 {
            self.spent.push((at, self.code, cost as i64));
        }
        let seq = self.events.push(Event {
            at,
            seq: 0,
            code: self.code,
            request: Some(Arc::clone(&request)),
            cost,
            owner,
        });
        self.credit_charged(&request, cost, at, now);
        self.index.insert(request, seq);
        self.total += cost;
        self.periods.add_now(cost);
        for s in &mut self.shorts {
            s.total += cost;
        }
        self.note_crossings(before, now);
        at
    }

    /// Every window's total, in the plan's order, when the call's plan has
    /// alert thresholds (`lua/budget/lib/alerts.lua`'s `snapshot`).
    fn window_totals(&self) -> Option<Vec<u64>> {
        let marks = self.marks.as_ref()?;
        Some((0..marks.limits.len()).map(|i| self.used(i)).collect())
    }

    /// Notes the thresholds a change crossed (from the totals `before` it).
    fn note_crossings(&mut self, before: Option<Vec<u64>>, now: u64) {
        let (Some(before), Some(marks)) = (before, self.marks.clone()) else {
            return;
        };
        let after: Vec<u64> = (0..marks.limits.len()).map(|i| self.used(i)).collect();
        self.crossings
            .extend(marks.crossings(&before, &after, now, &mut self.latches));
    }

    /// Notes what a release, a refund or a settle down of an event spent at
    /// `at` gave back (from the totals `before` it): the thresholds crossed
    /// stay crossed ([`Latch`]).
    fn note_lowered(&mut self, before: Option<Vec<u64>>, at: u64, now: u64) {
        let (Some(before), Some(marks)) = (before, self.marks.clone()) else {
            return;
        };
        let after: Vec<u64> = (0..marks.limits.len()).map(|i| self.used(i)).collect();
        marks.lowered(&before, &after, at, now, &mut self.latches);
    }

    /// Gives back the index's capacity once it is mostly empty.
    fn shrink(&mut self) {
        if self.index.capacity() > 4 * self.index.len().max(16) {
            self.index.shrink_to_fit();
        }
    }

    /// The live event of `request`, with its number.
    fn event(&self, request: &str) -> Option<(u64, &Event)> {
        let seq = *self.index.get(request)?;
        self.events.get(seq).map(|e| (seq, e))
    }

    /// The owner record of `request`'s charge (`None`: not live, or a plain reserve).
    fn owner(&self, request: &str) -> Option<&Owner> {
        self.event(request).and_then(|(_, e)| e.owner.as_deref())
    }

    fn owner_mut(&mut self, request: &str) -> Option<&mut Owner> {
        let seq = *self.index.get(request)?;
        self.events.get_mut(seq)?.owner.as_deref_mut()
    }

    /// Tokens spent in the plan's longest window: the `used` of refunds and
    /// settles.
    fn longest_used(&self) -> u64 {
        self.used(0)
    }

    /// The denial of `cost` (the retry_after of each window; 0 where it fits).
    fn denial(&self, limits: &[Limit], cost: u64, now: u64) -> Denied {
        let mut retry: Vec<u64> = limits
            .iter()
            .enumerate()
            .map(|(i, l)| self.retry_after(i, l, cost, now))
            .collect();
        let mut windows = self.windows(limits, now);
        let models: Vec<&ModelLimit> = self.call_models.iter().collect();
        let (w, r) = self.models.windows(&models, cost, now);
        windows.extend(w);
        retry.extend(r);
        Denied::new(windows, &retry, now)
    }

    /// Every limit as it stands, then the model limits of this call.
    fn all_windows(&self, limits: &[Limit], now: u64) -> Vec<WindowUse> {
        let mut windows = self.windows(limits, now);
        let models: Vec<&ModelLimit> = self.call_models.iter().collect();
        windows.extend(self.models.windows(&models, 0, now).0);
        windows
    }

    /// Whether `cost` fits this call's model limits.
    fn models_fit(&self, cost: u64, now: u64) -> bool {
        let models: Vec<&ModelLimit> = self.call_models.iter().collect();
        self.models.fits(&models, cost, now)
    }

    /// Records `cost` if it fits every limit; else the denial.
    fn admit(
        &mut self,
        request: &RequestId,
        cost: u64,
        limits: &[Limit],
        now: u64,
        operation: Option<&str>,
        owner: Option<Box<Owner>>,
    ) -> Result<Allowed, Box<Denied>> {
        let fits = limits
            .iter()
            .enumerate()
            .all(|(i, l)| self.used(i) + cost <= l.limit);
        if !fits || !self.models_fit(cost, now) {
            return Err(Box::new(self.denial(limits, cost, now)));
        }
        if let Some(balance) = self.credit_short(cost, now) {
            return Err(Box::new(Denied::credits(
                balance,
                cost,
                self.windows(limits, now),
                now,
            )));
        }
        let at = self.record(request, cost, now, operation, owner);
        Ok(Allowed::new(self.all_windows(limits, now), at, now, false))
    }

    /// Changes the cost of a live event (number `seq`) in every window it is inside.
    fn recost(&mut self, seq: u64, cost: u64, now: u64) -> Option<u64> {
        let before = self.window_totals();
        let previous = self.recost_event(seq, cost, now);
        match previous {
            Some(p) if p > cost => {
                let at = self.events.get(seq).map_or(now, |e| e.at);
                self.note_lowered(before, at, now);
            }
            _ => self.note_crossings(before, now),
        }
        previous
    }

    fn recost_event(&mut self, seq: u64, cost: u64, now: u64) -> Option<u64> {
        let slot = self.events.get_mut(seq)?;
        let previous = std::mem::replace(&mut slot.cost, cost);
        let at = slot.at;
        if let Some(tags) = slot.owner.as_ref().and_then(|o| o.models.as_deref()) {
            self.models.recost(tags, at, previous, cost);
        }
        if slot.code != 0 {
            self.spent
                .push((at, slot.code, cost as i64 - previous as i64));
        }
        let request = slot.request.clone()?;
        let change = Change {
            request: &request,
            cost,
            previous: Some(previous),
            at,
            operation: None,
        };
        self.export(now, ChangeKind::Settle, change);
        self.credit_recost(&request, at, previous, cost, now);
        self.total = (self.total + cost).saturating_sub(previous);
        self.periods.recost(at, previous, cost);
        for s in &mut self.shorts {
            if at.saturating_add(s.window) > now {
                s.total = (s.total + cost).saturating_sub(previous);
            }
        }
        Some(previous)
    }

    /// [`remove`](Self::remove), exported as an operator's forced correction
    /// when `forced`.
    fn remove_forced(&mut self, request: &str, now: u64, forced: bool) -> Option<u64> {
        let cost = self.remove(request, now)?;
        // `remove` exported the change last (when there is an export).
        if forced && self.export_max > 0 {
            if let Some(last) = self.exported.back_mut() {
                last.forced = true;
            }
        }
        Some(cost)
    }

    /// Removes a live event before it left the window (a refund): exported.
    fn remove(&mut self, request: &str, now: u64) -> Option<u64> {
        let before = self.window_totals();
        let tags = self.owner(request).and_then(|o| o.models.clone());
        let (at, cost, code) = self.take(request, now)?;
        if let Some(tags) = tags {
            self.models.recost(&tags, at, cost, 0);
        }
        if code != 0 {
            self.spent.push((at, code, -(cost as i64)));
        }
        self.credit_give(request, at, 0, now);
        // A refund lands in the period the charge was made in (an event
        // leaving the retention, `take` alone, stays counted in its period).
        self.periods.recost(at, cost, 0);
        self.note_lowered(before, at, now);
        let change = Change {
            request,
            cost,
            previous: None,
            at,
            operation: None,
        };
        self.export(now, ChangeKind::Refund, change);
        Some(cost)
    }

    /// Removes an event; returns its time, cost and dimensions' code.
    fn take(&mut self, request: &str, now: u64) -> Option<(u64, u64, u32)> {
        let seq = self.index.remove(request)?;
        let Event {
            at,
            cost,
            owner,
            code,
            ..
        } = self.events.remove(seq)?;
        if let Some(hold) = owner.and_then(|o| o.hold) {
            self.holds.remove(&hold);
        }
        self.total = self.total.saturating_sub(cost);
        for s in &mut self.shorts {
            if at.saturating_add(s.window) > now {
                s.total = s.total.saturating_sub(cost);
            }
        }
        // Holes outnumbering the events (many refunds): compact, amortised O(1)
        // per removal, so that refunds never grow the log.
        if self.events.holes > 64 && self.events.holes > self.index.len() {
            let index = &mut self.index;
            self.events.compact(|request, seq| {
                if let Some(n) = index.get_mut(request) {
                    *n = seq;
                }
            });
        }
        Some((at, cost, code))
    }
}

impl MemoryLedger<SystemClock> {
    pub fn new(config: Arc<Config>) -> Self {
        Self::with_clock(config, SystemClock)
    }
}

impl<C: Clock> MemoryLedger<C> {
    pub fn with_clock(config: Arc<Config>, clock: C) -> Self {
        Self {
            retention: config.retention_ms(),
            config,
            clock,
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            ops: AtomicU64::new(0),
            orgs: Mutex::new(BTreeMap::new()),
            rollups: Mutex::new(Rollups::default()),
            next_full_sweep: AtomicU64::new(0),
            alerts: None,
            marks: HashMap::new(),
        }
    }

    /// Queues the crossings of the plans' `alerts` thresholds into `alerts`
    /// (with `[alerts]` configured; else nothing is ever queued).
    pub fn with_alerts(mut self, alerts: MemoryAlerts) -> Self {
        self.marks = self
            .config
            .plans()
            .filter_map(|p| Some((p.name.clone(), Arc::new(AlertMarks::of(&self.config, p)?))))
            .collect();
        if !self.marks.is_empty() {
            self.alerts = Some(alerts);
        }
        self
    }

    fn shard(&self, user: &UserId) -> &Shard {
        &self.shards[(self.hasher.hash_one(user) as usize) % SHARDS]
    }

    /// Runs `f` on the user's log under its lock. With `create == false` an
    /// unknown user is shown an empty log and nothing is stored.
    fn with_user<R>(
        &self,
        user: &UserId,
        create: bool,
        f: impl FnOnce(&mut UserLog, Option<OrgSide<'_>>, u64) -> R,
    ) -> R {
        let n = self.ops.fetch_add(1, Ordering::Relaxed);
        if n % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.sweep_shard(((n / SWEEP_EVERY) as usize) % SHARDS);
        }
        // However few operations come by, expired users go within a sweep
        // period: one caller per period sweeps every shard.
        let now = self.clock.now_ms();
        let due = self.next_full_sweep.load(Ordering::Relaxed);
        if now >= due
            && self
                .next_full_sweep
                .compare_exchange(
                    due,
                    now + FULL_SWEEP_EVERY_MS,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            self.sweep_expired();
        }
        loop {
            let entry = {
                let mut shard = lock(self.shard(user));
                match shard.get(user) {
                    Some(e) => Arc::clone(e),
                    None if create => Arc::clone(shard.entry(user.clone()).or_default()),
                    None => {
                        drop(shard);
                        let mut empty = UserLog {
                            retain: self.retention,
                            ..UserLog::default()
                        };
                        return f(&mut empty, None, self.clock.now_ms());
                    }
                }
            };
            let mut log = lock(&entry);
            if log.retired {
                continue;
            }
            // Read the clock under the user's lock so that events are recorded in
            // time order.
            let now = self.clock.now_ms();
            log.export_max = self.config.export_maxlen().unwrap_or(0);
            log.retain = self.retention;
            log.released.clear();
            log.code = 0;
            log.call_models.clear();
            log.credit = match self.config.plan_or_default(log.plan.as_deref()).credits {
                CreditMode::Only => credits::CreditCall::Draw,
                CreditMode::Off => credits::CreditCall::Off,
            };
            let Some(org) = log.org.clone() else {
                let Some(alerts) = &self.alerts else {
                    let r = f(&mut log, None, now);
                    self.roll(user, &mut log, now);
                    return r;
                };
                log.marks = self.marks.get(&self.plan_of(&log).name).cloned();
                let r = f(&mut log, None, now);
                self.roll(user, &mut log, now);
                if !log.crossings.is_empty() {
                    alerts.queue("user", user.as_str(), std::mem::take(&mut log.crossings));
                }
                return r;
            };
            let o = Arc::clone(lock(&self.orgs).get(&org).expect("a member's organisation"));
            let mut og = lock(&o);
            let Org {
                plan,
                log: olog,
                members,
            } = &mut *og;
            let plan = self.config.plan_or_default(Some(plan.as_str()));
            let member = members.entry(user.clone()).or_default();
            member.export_max = log.export_max;
            member.retain = self.retention;
            member.released.clear();
            member.code = 0;
            member.call_models.clear();
            member.credit = match self.config.plan_or_default(member.plan.as_deref()).credits {
                CreditMode::Only => credits::CreditCall::Member,
                CreditMode::Off => credits::CreditCall::Off,
            };
            if self.alerts.is_some() {
                member.marks = self.marks.get(&self.plan_of(member).name).cloned();
            }
            olog.before.clear();
            olog.marks = self
                .alerts
                .as_ref()
                .and_then(|_| self.marks.get(&plan.name).cloned());
            let side = OrgSide {
                org: &org,
                plan,
                log: olog,
                user,
                retain: self.retention,
            };
            let r = f(member, Some(side), now);
            self.roll(user, member, now);
            if let Some(alerts) = &self.alerts {
                if !member.crossings.is_empty() {
                    alerts.queue("user", user.as_str(), std::mem::take(&mut member.crossings));
                }
                // The organisation's windows that this call took across a
                // threshold (from where they stood once brought to now).
                if let Some(marks) = self.marks.get(&plan.name) {
                    let crossings = org_crossings(olog, marks, now);
                    if !crossings.is_empty() {
                        alerts.queue("org", org.as_str(), crossings);
                    }
                }
            }
            return r;
        }
    }

    fn sweep_shard(&self, i: usize) {
        let mut shard = lock(&self.shards[i]);
        let now = self.clock.now_ms();
        shard.retain(|user, entry| {
            let Ok(mut log) = entry.try_lock() else {
                return true; // busy: certainly not idle
            };
            let plan = self.plan_of(&log);
            log.retain = self.retention;
            log.expire(now, &plan.limits);
            self.roll(user, &mut log, now);
            if log.events.is_empty()
                && log.periods.is_empty()
                && log.models.is_empty()
                && log.plan.is_none()
                && log.custom.is_none()
                && log.cancelled.is_empty()
                && log.org.is_none()
                && log.credits.is_empty()
            {
                log.retired = true;
                return false;
            }
            log.shrink();
            true
        });
        // A map keeps its capacity when entries leave: give it back once it is
        // mostly empty, so that a burst of users costs nothing after it expired.
        if shard.capacity() > 4 * shard.len().max(16) {
            shard.shrink_to_fit();
        }
    }

    /// Removes the event of `request` (a job's release) when `owns` agrees
    /// with its owner record (`None` for a plain reserve).
    fn remove_if(
        &self,
        user: &UserId,
        request: &RequestId,
        owns: impl FnOnce(Option<&Owner>) -> bool,
    ) -> RefundOutcome {
        self.with_user(user, false, |log, mut side, now| {
            log.expire_with_org(now, &self.plan_of(log).limits, side.as_mut());
            if !owns(log.owner(request.as_str())) {
                return RefundOutcome::NotFound {
                    used: log.longest_used(),
                };
            }
            match log.remove(request.as_str(), now) {
                Some(cost) => {
                    if let Some(side) = side.as_mut() {
                        side.recost(request.as_str(), 0, now);
                    }
                    RefundOutcome::Refunded {
                        cost,
                        used: log.longest_used(),
                    }
                }
                None => RefundOutcome::NotFound {
                    used: log.longest_used(),
                },
            }
        })
    }

    /// The user's plan; with limits of its own, its plan under
    /// [`CUSTOM_PLAN`] with those limits.
    fn plan_of<'a>(&'a self, log: &UserLog) -> Cow<'a, Plan> {
        let plan = self.config.plan_or_default(log.plan.as_deref());
        match &log.custom {
            None => Cow::Borrowed(plan),
            Some(limits) => Cow::Owned(Plan {
                name: CUSTOM_PLAN.to_owned(),
                limits: limits.clone(),
                ..plan.clone()
            }),
        }
    }

    /// Drops every user whose window is empty and who has no stored plan: what
    /// an idle user leaves behind once its events expired (Redis lets such
    /// keys expire). Operations call it by themselves once per
    /// [`FULL_SWEEP_EVERY_MS`]; O(users).
    pub fn sweep_expired(&self) {
        for i in 0..SHARDS {
            self.sweep_shard(i);
        }
        let now = self.clock.now_ms();
        lock(&self.rollups).sweep(&self.config.spend_keep(), now);
    }

    /// The code of a new charge's dimensions in the spend rollups.
    fn dims_code(&self, org: Option<&OrgId>, operation: &str, model: &str) -> u32 {
        let provider = self
            .config
            .operation(operation)
            .map(|op| op.provider.clone())
            .unwrap_or_default();
        lock(&self.rollups).code(Dims {
            org: org.map(ToString::to_string).unwrap_or_default(),
            operation: operation.to_owned(),
            provider,
            model: model.to_owned(),
        })
    }

    /// Counts the changes `log`'s call made to `user`'s charges in the
    /// spend rollups (under the user's lock: before the call returns).
    fn roll(&self, user: &UserId, log: &mut UserLog, now: u64) {
        if log.spent.is_empty() {
            return;
        }
        lock(&self.rollups).apply(user, log.spent.drain(..), &self.config.spend_keep(), now);
    }

    /// Users currently held in memory (for tests and metrics).
    pub fn resident_users(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

impl<C: Clock> std::fmt::Debug for MemoryLedger<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryLedger")
            .field("clock", &self.clock)
            .field("resident_users", &self.resident_users())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<C: Clock> Ledger for MemoryLedger<C> {
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError> {
        validate_cost(cost)?;
        self.with_user(user, true, |log, mut side, now| {
            let plan = self.plan_of(log);
            let limits = &plan.limits;
            bring_to_now(log, side.as_mut(), &plan, cost, now)?;
            if let Some((_, e)) = log.event(request.as_str()) {
                let at = e.at;
                return Ok(ReserveOutcome::Allowed(Allowed::new(
                    log.windows(limits, now),
                    at,
                    now,
                    true,
                )));
            }
            if let Some(d) = side.as_ref().and_then(|s| s.deny(log, limits, cost, now)) {
                return Ok(ReserveOutcome::Denied(d));
            }
            log.code = self.dims_code(side.as_ref().map(|s| s.org), "", "");
            Ok(match log.admit(request, cost, limits, now, None, None) {
                Ok(a) => {
                    if let Some(side) = side.as_mut() {
                        side.add(request.as_str(), a.at_ms, cost, now);
                    }
                    ReserveOutcome::Allowed(a)
                }
                Err(d) => ReserveOutcome::Denied(*d),
            })
        })
    }

    async fn refund_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        finished: Option<&str>,
    ) -> Result<RefundOutcome, LedgerError> {
        // A user without a log has nothing to refund or cancel.
        Ok(self.with_user(user, false, |log, mut side, now| {
            log.expire_with_org(now, &self.plan_of(log).limits, side.as_mut());
            let owner = log.owner(request.as_str());
            let held = owner.and_then(|o| Some((o.hold?.0, o.nonce.clone())));
            let credit = match owner {
                None => true,
                Some(o) => finished == Some(&*o.nonce),
            };
            if log.event(request.as_str()).is_none() {
                return RefundOutcome::NotFound {
                    used: log.longest_used(),
                };
            }
            if !credit && held.is_none() {
                return RefundOutcome::Running {
                    used: log.longest_used(),
                };
            }
            let cost = log.remove(request.as_str(), now).unwrap_or(0);
            if let Some(side) = side.as_mut() {
                side.recost(request.as_str(), 0, now);
            }
            let used = log.longest_used();
            match held {
                Some((hold_end, nonce)) if !credit => {
                    log.cancel(&nonce, hold_end);
                    RefundOutcome::Cancelled { cost, used }
                }
                _ => RefundOutcome::Refunded { cost, used },
            }
        }))
    }

    async fn settle(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
    ) -> Result<SettleOutcome, LedgerError> {
        if actual_cost > tollgate_core::config::MAX_TOKENS {
            return Err(LedgerError::CostTooLarge { cost: actual_cost });
        }
        Ok(self.with_user(user, false, |log, mut side, now| {
            log.expire_with_org(now, &self.plan_of(log).limits, side.as_mut());
            let Some(&key) = log.index.get(request.as_str()) else {
                return SettleOutcome::NotFound {
                    used: log.longest_used(),
                };
            };
            if let Some(side) = side.as_mut() {
                side.recost(request.as_str(), actual_cost, now);
            }
            if actual_cost == 0 {
                let previous_cost = log.remove(request.as_str(), now).unwrap_or(0);
                return SettleOutcome::Settled {
                    previous_cost,
                    cost: 0,
                    used: log.longest_used(),
                };
            }
            match log.recost(key, actual_cost, now) {
                Some(previous_cost) => SettleOutcome::Settled {
                    previous_cost,
                    cost: actual_cost,
                    used: log.longest_used(),
                },
                None => SettleOutcome::NotFound {
                    used: log.longest_used(),
                },
            }
        }))
    }

    async fn settle_operator(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
        finished: Option<&str>,
        forced: bool,
    ) -> Result<OperatorSettleOutcome, LedgerError> {
        if actual_cost > tollgate_core::config::MAX_TOKENS {
            return Err(LedgerError::CostTooLarge { cost: actual_cost });
        }
        Ok(self.with_user(user, false, |log, mut side, now| {
            log.expire_with_org(now, &self.plan_of(log).limits, side.as_mut());
            let Some(&key) = log.index.get(request.as_str()) else {
                return OperatorSettleOutcome::NotFound {
                    used: log.longest_used(),
                };
            };
            // A job's charge only once its job is final (the caller read it).
            if log
                .owner(request.as_str())
                .is_some_and(|o| finished != Some(&*o.nonce))
            {
                return OperatorSettleOutcome::Running {
                    used: log.longest_used(),
                };
            }
            if let Some(side) = side.as_mut() {
                side.recost(request.as_str(), actual_cost, now);
            }
            if actual_cost == 0 {
                let previous_cost = log
                    .remove_forced(request.as_str(), now, forced)
                    .unwrap_or(0);
                return OperatorSettleOutcome::Settled {
                    previous_cost,
                    cost: 0,
                    used: log.longest_used(),
                };
            }
            match log.recost(key, actual_cost, now) {
                Some(previous_cost) => OperatorSettleOutcome::Settled {
                    previous_cost,
                    cost: actual_cost,
                    used: log.longest_used(),
                },
                None => OperatorSettleOutcome::NotFound {
                    used: log.longest_used(),
                },
            }
        }))
    }

    async fn settle_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        settle: &SettleRequest<'_>,
    ) -> Result<SettleOutcome, LedgerError> {
        let &SettleRequest {
            nonce,
            actual_cost,
            may_raise,
        } = settle;
        validate_cost(actual_cost)?;
        Ok(self.with_user(user, false, |log, mut side, now| {
            log.expire_with_org(now, &self.plan_of(log).limits, side.as_mut());
            let owned = log
                .owner(request.as_str())
                .is_some_and(|o| &*o.nonce == nonce);
            let key = log.index.get(request.as_str()).copied();
            let (true, Some(key)) = (owned, key) else {
                return SettleOutcome::NotFound {
                    used: log.longest_used(),
                };
            };
            let current = log.events.get(key).map_or(0, |e| e.cost);
            let actual_cost = if may_raise {
                actual_cost
            } else {
                actual_cost.min(current)
            };
            let Some(previous_cost) = log.recost(key, actual_cost, now) else {
                return SettleOutcome::NotFound {
                    used: log.longest_used(),
                };
            };
            if let Some(o) = log.owner_mut(request.as_str()) {
                o.estimate.get_or_insert(previous_cost);
            }
            if let Some(side) = side.as_mut() {
                side.recost(request.as_str(), actual_cost, now);
            }
            SettleOutcome::Settled {
                previous_cost,
                cost: actual_cost,
                used: log.longest_used(),
            }
        }))
    }

    async fn usage_page(&self, user: &UserId, page: EventPage) -> Result<Usage, LedgerError> {
        Ok(self.with_user(user, false, |log, mut side, now| {
            let plan = self.plan_of(log);
            log.expire_with_org(now, &plan.limits, side.as_mut());
            // The log may keep older events for another plan's longer window:
            // a page starts inside this plan's longest window.
            let (slice, more) = log.events.page(
                now.checked_sub(plan.window_ms()),
                page.after(),
                page.limit(),
            );
            let next_cursor = slice.last().filter(|_| more).map(|e| EventCursor {
                at_ms: e.at,
                seq: u64::from(e.seq),
            });
            let events = slice
                .into_iter()
                .filter_map(|e| Some((RequestId::from_kept(e.request.as_deref()?), e)))
                .map(|(request_id, e)| SpendEvent {
                    request_id,
                    cost: e.cost,
                    at_ms: e.at,
                    operation: e
                        .owner
                        .as_ref()
                        .map(|o| split_audit_op(&o.operation).0.to_owned()),
                    service_key: e
                        .owner
                        .as_ref()
                        .and_then(|o| split_audit_op(&o.operation).1)
                        .map(str::to_owned),
                    estimate: e.owner.as_ref().and_then(|o| o.estimate),
                })
                .collect();
            log.call_models.clone_from(&plan.model_limits);
            let mut usage = Usage::new(
                plan.name.clone(),
                log.all_windows(&plan.limits, now),
                now,
                events,
                next_cursor,
            );
            usage.organisation = side.map(|s| s.windows(now));
            if log.custom.is_some() {
                usage.with_custom_limits()
            } else {
                usage
            }
        }))
    }

    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError> {
        let cost = charge.cost;
        validate_cost(cost)?;
        self.with_user(user, true, |log, mut side, now| {
            // The named plan, as `plan` answers it (also with limits of its own).
            let named = &self.config.plan_or_default(log.plan.as_deref()).name;
            let plan = self.plan_of(log);
            let limits = &plan.limits;
            bring_to_now(log, side.as_mut(), &plan, cost, now)?;
            log.call_models = charge.model_limits(&plan).into_iter().cloned().collect();
            if let Some((_, e)) = log.event(request.as_str()) {
                let at = e.at;
                let Some(o) = e.owner.as_deref() else {
                    return Ok(ChargeOutcome::Conflict { operation: None });
                };
                let first = split_audit_op(&o.operation).0;
                if first != charge.operation || &*o.fingerprint != charge.fingerprint {
                    return Ok(ChargeOutcome::Conflict {
                        operation: Some(first.to_owned()),
                    });
                }
                let (nonce, deadline_ms, claimed) =
                    (o.nonce.to_string(), o.deadline_ms, o.hold.is_none());
                return Ok(ChargeOutcome::Existing {
                    allowed: Allowed::new(log.all_windows(limits, now), at, now, true),
                    nonce,
                    deadline_ms,
                    claimed,
                    plan: named.clone(),
                });
            }
            if let Some(d) = side.as_ref().and_then(|s| s.deny(log, limits, cost, now)) {
                return Ok(ChargeOutcome::Denied(d));
            }
            let deadline_ms = now.saturating_add(tollgate_core::job::millis(charge.deadline));
            log.seq += 1;
            let hold = (
                deadline_ms.saturating_add(tollgate_core::job::millis(charge.grace)),
                log.seq,
            );
            let owner = Box::new(Owner {
                nonce: charge.nonce.into(),
                deadline_ms,
                operation: audit_op(charge.operation, charge.service_key).into(),
                fingerprint: charge.fingerprint.into(),
                hold: Some(hold),
                estimate: None,
                models: None,
            });
            let op = audit_op(charge.operation, charge.service_key);
            let operation = Some(op.as_str());
            log.code = self.dims_code(side.as_ref().map(|s| s.org), charge.operation, charge.model);
            let allowed = match log.admit(request, cost, limits, now, operation, Some(owner)) {
                Ok(a) => a,
                Err(d) => return Ok(ChargeOutcome::Denied(*d)),
            };
            // The spend was exported last (when there is an export): it
            // carries the prices the call was reserved at.
            if let (Some(price), true) = (charge.price, log.export_max > 0) {
                if let Some(last) = log.exported.back_mut() {
                    *last = last.clone().with_price(Some(price));
                }
            }
            if let Some(side) = side.as_mut() {
                side.add(request.as_str(), allowed.at_ms, cost, now);
            }
            if let Some((kept, _)) = log.index.get_key_value(request.as_str()) {
                let kept = Arc::clone(kept);
                log.holds.insert(hold, kept);
            }
            Ok(ChargeOutcome::Charged {
                allowed,
                deadline_ms,
                plan: named.clone(),
            })
        })
    }

    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        claim: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, LedgerError> {
        let &ClaimRequest {
            nonce,
            hold_until_ms,
        } = claim;
        Ok(self.with_user(user, false, |log, mut side, now| {
            log.expire_with_org(now, &self.plan_of(log).limits, side.as_mut());
            if let Some(o) = log.owner_mut(request.as_str()) {
                if &*o.nonce != nonce {
                    return ClaimOutcome::Refused;
                }
                if let Some(hold) = o.hold.take() {
                    log.holds.remove(&hold);
                }
                return ClaimOutcome::Claimed;
            }
            // No owner: a plain reserve owns the id, or the charge is gone:
            // refunded by an operator while it was held (the job is
            // cancelled), released at the hold's end, or (before that) it left
            // the window (paid).
            if log.cancelled.contains_key(nonce) {
                return ClaimOutcome::Cancelled;
            }
            let released = now >= hold_until_ms;
            if log.index.contains_key(request.as_str()) || released {
                ClaimOutcome::Refused
            } else {
                ClaimOutcome::Claimed
            }
        }))
    }

    async fn release(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
    ) -> Result<RefundOutcome, LedgerError> {
        Ok(self.remove_if(user, request, |owner| {
            owner.is_some_and(|o| &*o.nonce == nonce)
        }))
    }

    async fn exported(
        &self,
        user: &UserId,
        since_ms: u64,
        count: usize,
    ) -> Result<Vec<ExportEntry>, LedgerError> {
        Ok(self.with_user(user, false, |log, _, _| {
            log.exported
                .iter()
                .filter(|e| e.at_ms() >= since_ms)
                .take(count)
                .cloned()
                .collect()
        }))
    }

    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError> {
        if self.config.plan(plan).is_none() {
            return Err(unknown_plan(&self.config, plan));
        }
        // A named plan replaces limits of the user's own.
        self.with_user(user, true, |log, _, _| {
            log.plan = Some(plan.to_owned());
            log.custom = None;
        });
        Ok(())
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        // The named plan, whatever limits of its own the user has.
        Ok(self.with_user(user, false, |log, _, _| {
            self.config
                .plan_or_default(log.plan.as_deref())
                .name
                .clone()
        }))
    }

    async fn set_limits(&self, user: &UserId, limits: &[Limit]) -> Result<(), LedgerError> {
        check_custom(limits)?;
        self.with_user(user, true, |log, _, _| log.custom = Some(limits.to_vec()));
        Ok(())
    }

    async fn clear_limits(&self, user: &UserId) -> Result<bool, LedgerError> {
        Ok(self.with_user(user, false, |log, _, _| log.custom.take().is_some()))
    }

    async fn custom_limits(&self, user: &UserId) -> Result<Option<Vec<Limit>>, LedgerError> {
        Ok(self.with_user(user, false, |log, _, _| log.custom.clone()))
    }

    async fn set_org_plan(&self, org: &OrgId, plan: &str) -> Result<(), LedgerError> {
        if self.config.plan(plan).is_none() {
            return Err(unknown_plan(&self.config, plan));
        }
        let o = Arc::clone(lock(&self.orgs).entry(org.clone()).or_insert_with(|| {
            Arc::new(Mutex::new(Org {
                plan: plan.to_owned(),
                log: OrgLog::default(),
                members: BTreeMap::new(),
            }))
        }));
        lock(&o).plan = plan.to_owned();
        Ok(())
    }

    async fn set_user_org(&self, user: &UserId, org: Option<&OrgId>) -> Result<Moved, LedgerError> {
        let target = match org {
            Some(o) => Some(
                lock(&self.orgs)
                    .get(o)
                    .cloned()
                    .ok_or_else(|| LedgerError::UnknownOrg(o.to_string()))?,
            ),
            None => None,
        };
        // The user's entry, held for the whole move: none of its calls runs
        // in between (they take it first too).
        let entry = loop {
            let e = Arc::clone(lock(self.shard(user)).entry(user.clone()).or_default());
            if !lock(&e).retired {
                break e;
            }
        };
        let mut home = lock(&entry);
        let now = self.clock.now_ms();
        let src = home.org.clone();
        if src.as_ref() == org {
            return Ok(Moved {
                org: src,
                events: 0,
            });
        }
        let mut moved = match &src {
            None => {
                let mut log = std::mem::take(&mut *home);
                log.org = None;
                log
            }
            Some(a) => {
                let o = Arc::clone(lock(&self.orgs).get(a).expect("a member's organisation"));
                let mut og = lock(&o);
                let mut log = og.members.remove(user).unwrap_or_default();
                let limits = self.plan_of(&log).limits.clone();
                log.retain = self.retention;
                log.expire(now, &limits);
                let retain = self.retention;
                let org_limits = self
                    .config
                    .plan_or_default(Some(og.plan.as_str()))
                    .limits
                    .clone();
                og.log.expire(now, &org_limits, retain);
                for request in log.released.drain(..) {
                    og.log.recost(&org_key(user, &request), 0);
                }
                for e in log.events.between(None, None) {
                    if let Some(request) = &e.request {
                        og.log.recost(&org_key(user, request), 0);
                    }
                }
                log
            }
        };
        moved.released.clear();
        // What its organisation's `expire` released above counts now.
        self.roll(user, &mut moved, now);
        let events = moved.index.len() as u64;
        match (org, target) {
            (Some(b), Some(o)) => {
                let mut og = lock(&o);
                let org_limits = self
                    .config
                    .plan_or_default(Some(og.plan.as_str()))
                    .limits
                    .clone();
                og.log.expire(now, &org_limits, self.retention);
                for e in moved.events.between(None, None) {
                    if let Some(request) = &e.request {
                        og.log
                            .add(org_key(user, request), e.at, e.cost, now, self.retention);
                    }
                }
                og.members.insert(user.clone(), moved);
                *home = UserLog {
                    org: Some(b.clone()),
                    retain: self.retention,
                    ..UserLog::default()
                };
            }
            _ => *home = moved,
        }
        Ok(Moved {
            org: org.cloned(),
            events,
        })
    }

    async fn user_org(&self, user: &UserId) -> Result<Option<OrgId>, LedgerError> {
        Ok(self.with_user(user, false, |_, side, _| side.map(|s| s.org.clone())))
    }

    async fn org_usage(
        &self,
        org: &OrgId,
        after: Option<&UserId>,
        limit: usize,
    ) -> Result<OrgUsage, LedgerError> {
        let o = lock(&self.orgs)
            .get(org)
            .cloned()
            .ok_or_else(|| LedgerError::UnknownOrg(org.to_string()))?;
        let mut og = lock(&o);
        let now = self.clock.now_ms();
        let plan = self.config.plan_or_default(Some(og.plan.as_str()));
        og.log.expire(now, &plan.limits, self.retention);
        let limit = limit.clamp(1, 1000);
        let mut names = og
            .members
            .keys()
            .filter(|m| after.is_none_or(|a| *m > a))
            .take(limit + 1)
            .cloned()
            .collect::<Vec<_>>();
        let more = names.len() > limit;
        names.truncate(limit);
        Ok(OrgUsage {
            org: org.clone(),
            plan: plan.name.clone(),
            now_ms: now,
            windows: og.log.windows(&plan.limits, now),
            next_member: more.then(|| names.last().cloned()).flatten(),
            members: names,
        })
    }

    async fn orgs(&self, after: Option<&OrgId>, limit: usize) -> Result<OrgList, LedgerError> {
        let limit = limit.clamp(1, 1000);
        let orgs = lock(&self.orgs);
        let mut names: Vec<OrgId> = match after {
            Some(a) => orgs
                .range::<OrgId, _>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded))
                .map(|(k, _)| k.clone())
                .take(limit + 1)
                .collect(),
            None => orgs.keys().take(limit + 1).cloned().collect(),
        };
        let more = names.len() > limit;
        names.truncate(limit);
        Ok(OrgList {
            next: more.then(|| names.last().cloned()).flatten(),
            orgs: names,
        })
    }

    async fn spend(
        &self,
        user: &UserId,
        step: Step,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<Vec<Bucket>, LedgerError> {
        let now = self.clock.now_ms();
        let keep = self.config.spend_keep();
        Ok(lock(&self.rollups).buckets(user, step, from_ms, to_ms, &keep, now))
    }

    async fn add_credits(
        &self,
        user: &UserId,
        grant: &tollgate_core::credits::GrantRequest<'_>,
    ) -> Result<tollgate_core::credits::GrantOutcome, LedgerError> {
        grant.check()?;
        self.with_user(user, true, |log, side, now| {
            if side.is_some() {
                return Err(credits::member_refused());
            }
            log.credit_grant(grant, now)
        })
    }

    async fn credits(
        &self,
        user: &UserId,
    ) -> Result<tollgate_core::credits::CreditBalance, LedgerError> {
        Ok(self.with_user(user, false, |log, side, now| {
            // A member holds no credits of its own (as credits.lua answers).
            if side.is_some() {
                return tollgate_core::credits::CreditBalance::new(Vec::new(), now);
            }
            log.credit_balance(now)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tollgate_core::clock::ManualClock;

    #[tokio::test]
    async fn idle_users_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let ledger = MemoryLedger::with_clock(Arc::new(Config::builtin()), Arc::clone(&clock));
        let keeper = UserId::new("keeper").unwrap();
        ledger.set_plan(&keeper, "pro").await.unwrap();
        for i in 0..100 {
            let u = UserId::new(format!("u{i}")).unwrap();
            ledger.reserve(&u, &RequestId::generate(), 1).await.unwrap();
        }
        assert_eq!(ledger.resident_users(), 101);
        clock.advance(Duration::from_secs(13 * 3600));
        for i in 0..(SWEEP_EVERY * SHARDS as u64) {
            ledger
                .usage(&UserId::new(format!("r{i}")).unwrap())
                .await
                .unwrap();
        }
        assert_eq!(
            ledger.resident_users(),
            1,
            "only the user with a stored plan stays"
        );
        assert_eq!(ledger.plan(&keeper).await.unwrap(), "pro");
    }

    #[tokio::test]
    async fn refunds_leave_no_holes_behind() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let ledger = MemoryLedger::with_clock(Arc::new(Config::builtin()), Arc::clone(&clock));
        let user = UserId::new("u").unwrap();
        let ids: Vec<RequestId> = (0..1000)
            .map(|i| RequestId::new(format!("r{i}")).unwrap())
            .collect();
        for (i, id) in ids.iter().enumerate() {
            ledger.reserve(&user, id, 1).await.unwrap();
            if i % 100 == 99 {
                clock.advance(Duration::from_millis(5));
            }
        }
        // Refund all but every 100th, oldest last: the holes cannot leave by the front.
        for (i, id) in ids.iter().enumerate().rev() {
            if i % 100 != 0 {
                let out = ledger.refund(&user, id).await.unwrap();
                assert!(
                    matches!(out, RefundOutcome::Refunded { cost: 1, .. }),
                    "{i}: {out:?}"
                );
            }
        }
        let usage = ledger.usage(&user).await.unwrap();
        assert_eq!(usage.used, 10);
        let kept: Vec<_> = usage
            .events
            .iter()
            .map(|e| e.request_id.as_str().to_owned())
            .collect();
        let want: Vec<_> = (0..10).map(|k| format!("r{}", k * 100)).collect();
        assert_eq!(kept, want, "the live events, in time order");
        ledger.with_user(&user, false, |log, _, _| {
            assert!(
                log.events.slots.len() <= 10 + 64,
                "{} slots for 10 events",
                log.events.slots.len()
            );
        });
        // The survivors are still found by id after the compaction renumbered them.
        for k in 0..10 {
            let out = ledger.refund(&user, &ids[k * 100]).await.unwrap();
            assert!(
                matches!(out, RefundOutcome::Refunded { .. }),
                "{k}: {out:?}"
            );
        }
        assert_eq!(ledger.usage(&user).await.unwrap().used, 0);
    }

    #[tokio::test]
    async fn expired_users_go_within_a_sweep_period_with_little_traffic() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let ledger = MemoryLedger::with_clock(Arc::new(Config::builtin()), Arc::clone(&clock));
        for i in 0..500 {
            let u = UserId::new(format!("u{i}")).unwrap();
            ledger.reserve(&u, &RequestId::generate(), 1).await.unwrap();
        }
        clock.advance(Duration::from_secs(13 * 3600));
        assert_eq!(
            ledger.resident_users(),
            500,
            "nothing swept without an operation"
        );
        // One operation past the sweep period, far fewer than the per-operation
        // sweeper needs to reach every shard.
        let other = UserId::new("other").unwrap();
        ledger.usage(&other).await.unwrap();
        assert_eq!(ledger.resident_users(), 0);
        // The next period sweeps again.
        ledger
            .reserve(&other, &RequestId::generate(), 1)
            .await
            .unwrap();
        clock.advance(Duration::from_secs(13 * 3600));
        ledger.usage(&UserId::new("third").unwrap()).await.unwrap();
        assert_eq!(ledger.resident_users(), 0, "a new period sweeps again");
    }
}
