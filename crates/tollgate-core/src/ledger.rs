//! The budget ledger: the one interface both backends implement.
//!
//! Semantics (docs/src/budgets.md): each user has one pool, limited by
//! each of the plan's limits (`limit` tokens over a sliding `window`; one or
//! several), kept as one log of spend events as long as the longest window.
//! `reserve` is one atomic step (drop expired events, check every limit,
//! record); it is idempotent per request id; `refund` removes an event at most
//! once; `settle` corrects an event's cost. A denied reservation is an outcome,
//! not an error. Each window keeps a running total, so no step sums the log.
//! The log keeps every event for the longest window of any configured plan
//! ([`Config::retention_ms`]), so a plan change never erases spend.
//!
//! [`Config::retention_ms`]: crate::config::Config::retention_ms
//!
//! A job's charge has an owner ([`Ledger::charge`], [`Ledger::claim`],
//! [`Ledger::release`]): the charge is taken with a nonce and held for its
//! submission; the job created for it (carrying the nonce) claims it before it
//! calls the provider, and releases it if it fails. Each move is one atomic step
//! of the ledger, and a charge whose job never claimed it by the job's deadline
//! plus a grace is released by the ledger itself (see `lua/budget/lib/state.lua`): a
//! job past its deadline never starts, so no job can claim it any more.

use async_trait::async_trait;
use serde::Serialize;

use crate::error::StoreError;
use crate::id::{OrgId, RequestId, UserId};

/// One entry of the audit trail: `cost` tokens spent by `request_id` at `at_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpendEvent {
    pub request_id: RequestId,
    pub cost: u64,
    pub at_ms: u64,
    /// The operation of a job's charge (`None` for a plain reserve).
    pub operation: Option<String>,
    /// The id (`kid_...`) of the service key that acted for the user, when a
    /// service key made the call (`Tollgate-User`); `None`: the user's own key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_key: Option<String>,
    /// For a job's charge settled to what the provider reported
    /// ([`Ledger::settle_charge`]): what was reserved up front (the most, or
    /// the estimate with `reserve = "estimate"`); `cost` is the actual.
    /// `None`: not settled.
    pub estimate: Option<u64>,
}

/// What changed in an [`ExportEntry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    /// A spend event was recorded (a reserve or a job's charge).
    Spend,
    /// A spend event was removed before it left the window (refund, release,
    /// a hold that ended unclaimed, or a settle to 0).
    Refund,
    /// A spend event's cost was set to `cost` (from `previous_cost`).
    Settle,
    /// Prepaid credits ([`crate::credits`]), each naming its `grant`: a
    /// grant of `cost` (its `request_id` the idempotency key, with its
    /// `expires_at_ms`).
    CreditGrant,
    /// `cost` drawn from the grant by the charge `request_id` (spent at
    /// `spent_at_ms`).
    CreditDraw,
    /// `cost` given back to the grant by the charge's settle down, refund
    /// or release.
    CreditReturn,
    /// The grant expired holding `cost` (its `request_id` the grant's key).
    CreditExpire,
    /// A settle up of `cost` more than the balance could cover (grant 0):
    /// the charge keeps its cost, the balance stays at zero.
    CreditUncovered,
}

/// One entry of a user's export ([`Ledger::exported`]): every change to the
/// spend events, in order, kept past the window for billing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExportEntry {
    /// `<ms>-<seq>` of the change on the ledger's clock: increasing.
    pub id: String,
    pub kind: ChangeKind,
    pub request_id: RequestId,
    /// The event's cost (for a settle: the new one; for a refund: what left).
    pub cost: u64,
    /// For a settle: the cost before it.
    pub previous_cost: Option<u64>,
    /// When the event was spent (ms): with the plan's windows, when it leaves them.
    pub spent_at_ms: u64,
    /// The operation of a job's charge, on its spend.
    pub operation: Option<String>,
    /// On the spend of a job's charge a service key made for the user: that
    /// key's id (`kid_...`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_key: Option<String>,
    /// An operator's forced correction: the removal (a settle to 0, `tollgate
    /// budget settle --force`) of the charge of a job that may have run, so
    /// the upstream's work goes unpaid by the operator's decision.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forced: bool,
    /// On the spend of a priced job's charge: the model the request named,
    /// the price sheet entry that priced it and the prices that applied
    /// ([`crate::price::Applied::export`]), so that the export alone
    /// rebuilds what each call cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prices: Option<serde_json::Value>,
    /// A credits entry's grant ([`ChangeKind::CreditGrant`] and after).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grant: Option<u64>,
    /// A grant's expiry, on its [`ChangeKind::CreditGrant`] entry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

impl ExportEntry {
    /// Sets [`model`](Self::model), [`entry`](Self::entry) and
    /// [`prices`](Self::prices) from the recorded prices' text (nothing for
    /// a text that is not one).
    pub fn with_price(mut self, text: Option<&str>) -> Self {
        if let Some(applied) = text.and_then(crate::price::Applied::parse) {
            self.prices = Some(applied.export());
            self.model = Some(applied.model);
            self.entry = Some(applied.entry.key);
        }
        self
    }

    /// The time of the change, from `id`.
    pub fn at_ms(&self) -> u64 {
        self.id
            .split('-')
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0)
    }
}

/// What a job's charge is taken for ([`Ledger::charge`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeRequest<'a> {
    pub cost: u64,
    /// Names this charge: only the job carrying it can claim or release it.
    pub nonce: &'a str,
    pub operation: &'a str,
    /// The price sheet entry that priced the call (its name or pattern), ""
    /// for an unpriced one: the charge's `model` in the spend rollups
    /// ([`Ledger::spend`]), with its operation, the operation's provider and
    /// the user's organisation.
    pub model: &'a str,
    /// The id of the service key acting for the user (`None`: the user's own
    /// key): recorded with the charge, for the audit trail. Not part of what
    /// the id is bound to: a retry through another key is the same request.
    pub service_key: Option<&'a str>,
    /// A digest of the request body: the same id with another body is refused.
    pub fingerprint: &'a str,
    /// The job's deadline, from now on the ledger's clock.
    pub deadline: std::time::Duration,
    /// How long past the deadline the charge stays held for its job.
    pub grace: std::time::Duration,
    /// A priced call's prices ([`crate::price::Applied::to_text`]), written
    /// with its spend entry in the export; `None`: not priced.
    pub price: Option<&'a str>,
}

impl ChargeRequest<'_> {
    /// The model the request named (a priced call's, from its prices), for
    /// the plan's model limits ([`crate::config::ModelLimit::matches`]).
    pub fn requested_model(&self) -> Option<String> {
        self.price
            .and_then(crate::price::Applied::parse)
            .map(|a| a.model)
    }

    /// The model limits of `plan` this charge counts under.
    pub fn model_limits<'p>(
        &self,
        plan: &'p crate::config::Plan,
    ) -> Vec<&'p crate::config::ModelLimit> {
        if plan.model_limits.is_empty() || (self.model.is_empty() && self.price.is_none()) {
            return Vec::new();
        }
        let name = self.requested_model().unwrap_or_default();
        plan.model_limits
            .iter()
            .filter(|m| m.matches(&name, self.model))
            .collect()
    }
}

/// How a job takes its charge over ([`Ledger::claim`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest<'a> {
    /// The nonce the charge was taken under (the job's).
    pub nonce: &'a str,
    /// The end of the charge's hold (the job's deadline plus the grace it was
    /// charged with), on the ledger's clock.
    pub hold_until_ms: u64,
}

impl<'a> ClaimRequest<'a> {
    pub fn new(nonce: &'a str, hold_until_ms: u64) -> Self {
        Self {
            nonce,
            hold_until_ms,
        }
    }
}

/// What a job settles its charge to ([`Ledger::settle_charge`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleRequest<'a> {
    /// The nonce the charge was taken under (the job's).
    pub nonce: &'a str,
    /// What the provider reported, >= 1.
    pub actual_cost: u64,
    /// The operation reserved its estimate: the cost may rise past the
    /// charge's, and a window past its limit.
    pub may_raise: bool,
}

impl<'a> SettleRequest<'a> {
    pub fn new(nonce: &'a str, actual_cost: u64, may_raise: bool) -> Self {
        Self {
            nonce,
            actual_cost,
            may_raise,
        }
    }
}

/// The answer to [`Ledger::charge`]. `plan`, when charged or found charged:
/// the user's plan name as [`Ledger::plan`] answers it (the named plan, also
/// for a user with limits of its own), read in the same atomic step, so that
/// the plan's other settings (`max_stored_bytes`) need no further read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ChargeOutcome {
    /// Charged now, held for the job until its deadline plus the grace.
    Charged {
        allowed: Allowed,
        deadline_ms: u64,
        plan: String,
    },
    /// The same request (operation and fingerprint) is charged already, under
    /// `nonce`; `claimed` once its job has taken the charge over.
    Existing {
        allowed: Allowed,
        nonce: String,
        deadline_ms: u64,
        claimed: bool,
        plan: String,
    },
    /// The budget does not allow it: nothing charged.
    Denied(Denied),
    /// The id is charged for another request: another operation or body
    /// (`operation` names the first one's), or a plain reserve (`None`).
    Conflict { operation: Option<String> },
}

/// The answer to [`Ledger::claim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimOutcome {
    /// The job owns its charge (or its charge was taken and has since left the
    /// window): it may call the provider.
    Claimed,
    /// The charge is not this job's (released, or the id was charged anew): the
    /// job must not run.
    Refused,
    /// An operator refunded the charge while it was held
    /// ([`RefundOutcome::Cancelled`]): the job is cancelled and must not run.
    Cancelled,
}

/// One of the plan's limits as it stands for a user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WindowUse {
    pub limit: u64,
    pub window_ms: u64,
    /// Tokens spent in the trailing window. A settle that raised a cost can put
    /// it past `limit` for a while: reserves then wait until it fits again.
    pub used: u64,
    pub remaining: u64,
    /// Until the oldest event in this window leaves it; `None` when none is in it.
    /// A calendar period's: until the period ends (its total resets then).
    pub reset_after_ms: Option<u64>,
    /// A calendar period's limit (`period = "month"`): the current period,
    /// `[start_ms, end_ms)` on the ledger's clock (`end_ms` is the exact
    /// reset instant; `window_ms` is the period's length). `None`: a
    /// trailing window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<crate::period::Span>,
    /// A model limit's (`[plans.X] model_limits`): the pattern of the models
    /// it counts (always a calendar period). `None`: one of the plan's
    /// overall limits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl WindowUse {
    pub fn new(limit: u64, window_ms: u64, used: u64, reset_after_ms: Option<u64>) -> Self {
        Self {
            limit,
            window_ms,
            used,
            remaining: limit.saturating_sub(used),
            reset_after_ms,
            period: None,
            model: None,
        }
    }

    /// A model limit's window (`pattern`: the models it counts).
    pub fn for_model(mut self, pattern: &str) -> Self {
        self.model = Some(pattern.to_owned());
        self
    }

    /// A calendar period's limit as it stands at `now_ms` (inside `span`):
    /// it resets at the period's end.
    pub fn period(limit: u64, span: crate::period::Span, used: u64, now_ms: u64) -> Self {
        Self {
            period: Some(span),
            ..Self::new(
                limit,
                span.len_ms(),
                used,
                Some(span.end_ms.saturating_sub(now_ms)),
            )
        }
    }

    /// What the limit is over, for names and messages: the trailing
    /// window's length (`12h`), or the calendar period (`day`, `week`,
    /// `month`, told apart by the period's length: a day is 23 to 25 hours,
    /// a week 7 days give or take one, a month 28 to 31 days).
    /// A model limit's is followed by its pattern: `day on o1*`.
    pub fn label(&self) -> String {
        match &self.model {
            Some(m) => format!("{} on {m}", self.period_label()),
            None => self.period_label(),
        }
    }

    /// [`label`](Self::label) without the model.
    pub fn period_label(&self) -> String {
        const HOUR: u64 = 3_600_000;
        match self.period {
            Some(p) if p.len_ms() <= 25 * HOUR => "day".to_owned(),
            Some(p) if p.len_ms() <= 7 * 24 * HOUR + HOUR => "week".to_owned(),
            Some(_) => "month".to_owned(),
            None => crate::duration::format(std::time::Duration::from_millis(self.window_ms)),
        }
    }

    /// How long until `cost` fits a calendar period's limit: 0, or until
    /// the period ends (nothing leaves a period before).
    pub fn period_retry_after(&self, cost: u64, now_ms: u64) -> u64 {
        match self.period {
            Some(span) if self.used.saturating_add(cost) > self.limit => {
                span.end_ms.saturating_sub(now_ms)
            }
            _ => 0,
        }
    }
}

/// The window closest to exhaustion: the fewest tokens left, and of those the
/// one that frees tokens last. `None` only for an empty list.
pub fn closest_to_exhaustion(windows: &[WindowUse]) -> Option<&WindowUse> {
    windows
        .iter()
        .min_by_key(|w| (w.remaining, std::cmp::Reverse(w.reset_after_ms)))
}

/// The reservation is recorded (or was already: `duplicate`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Allowed {
    /// Tokens used in the window closest to exhaustion, this reservation
    /// included; `limit`, `remaining` and `reset_after_ms` are that window's.
    pub used: u64,
    pub limit: u64,
    pub window_ms: u64,
    pub remaining: u64,
    /// When the event was recorded (for a duplicate: the original time).
    pub at_ms: u64,
    /// The ledger's clock at the time of the call.
    pub now_ms: u64,
    /// Until the oldest live event leaves the window and frees its tokens.
    pub reset_after_ms: u64,
    /// True when this request id was already reserved: nothing was charged again.
    pub duplicate: bool,
    /// Every limit of the plan, longest window first.
    pub windows: Vec<WindowUse>,
}

impl Allowed {
    /// The answer for `windows` (longest first); the top-level figures are the
    /// window closest to exhaustion's.
    pub fn new(windows: Vec<WindowUse>, at_ms: u64, now_ms: u64, duplicate: bool) -> Self {
        let w = closest_to_exhaustion(&windows).cloned();
        let w = w.unwrap_or_else(|| WindowUse::new(0, 0, 0, None));
        Self {
            used: w.used,
            limit: w.limit,
            window_ms: w.window_ms,
            remaining: w.remaining,
            at_ms,
            now_ms,
            reset_after_ms: w.reset_after_ms.unwrap_or(0),
            duplicate,
            windows,
        }
    }

    /// The same answer with `cost` given back: the event, recorded at `at_ms`,
    /// was refunded.
    pub fn refunded(&self, cost: u64) -> Self {
        let windows = self
            .windows
            .iter()
            .map(|w| {
                let used = w.used.saturating_sub(cost);
                WindowUse {
                    used,
                    remaining: w.limit.saturating_sub(used),
                    ..w.clone()
                }
            })
            .collect();
        Self::new(windows, self.at_ms, self.now_ms, self.duplicate)
    }
}

/// Which budget held a denial back: the user's own, or its organisation's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    #[default]
    User,
    Organisation,
}

/// A member's organisation as it stands: its name, plan and windows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrgWindows {
    pub org: OrgId,
    pub plan: String,
    /// Every limit of the organisation's plan, longest window first.
    pub windows: Vec<WindowUse>,
}

/// The reservation does not fit; nothing was recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Denied {
    /// The figures of the window that holds the request back longest.
    pub used: u64,
    pub limit: u64,
    pub window_ms: u64,
    pub remaining: u64,
    /// Exactly how long until enough old events leave every window for this
    /// cost to fit them all.
    pub retry_after_ms: u64,
    pub now_ms: u64,
    /// Every limit of the plan, longest window first.
    pub windows: Vec<WindowUse>,
    /// Whose budget binds: the top-level figures are that budget's window's.
    pub scope: Scope,
    /// A member's organisation (its windows as they stand).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub organisation: Option<Box<OrgWindows>>,
    /// What the refused request needed (its reservation), where its caller
    /// knows it (a job's submission: [`crate::job::JobQueue::submit`]); 0
    /// when not said.
    #[serde(skip_serializing_if = "is_zero")]
    pub needed: u64,
    /// What the amounts count, for messages.
    #[serde(skip)]
    pub currency: crate::money::Currency,
    /// Refused because the user's prepaid balance (this) cannot cover the
    /// cost (`needed`): the plan draws on credits ([`crate::credits`]).
    /// `None`: a window or period refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credits: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Denied {
    /// A member's denial: `user` over its own windows, `org` (with the
    /// retry_after of each of its windows) over its organisation's; the
    /// retry_after is the later of the two (both must fit), and the binding
    /// window is that level's.
    pub fn member(user: Denied, org: OrgWindows, org_retry: &[u64]) -> Self {
        let o = Denied::new(org.windows.clone(), org_retry, user.now_ms);
        let binds = o.retry_after_ms > user.retry_after_ms
            || (o.retry_after_ms == user.retry_after_ms && o.remaining < user.remaining);
        let top = if binds { &o } else { &user };
        Self {
            used: top.used,
            limit: top.limit,
            window_ms: top.window_ms,
            remaining: top.remaining,
            retry_after_ms: user.retry_after_ms.max(o.retry_after_ms),
            now_ms: user.now_ms,
            windows: user.windows.clone(),
            scope: if binds {
                Scope::Organisation
            } else {
                Scope::User
            },
            organisation: Some(Box::new(org)),
            needed: 0,
            currency: crate::money::Currency::Tokens,
            credits: None,
        }
    }

    /// The refusal of a cost `needed` that the user's credit `balance`
    /// cannot cover: nothing leaves by itself, so no retry_after (a top-up
    /// is what helps).
    pub fn credits(balance: u64, needed: u64, windows: Vec<WindowUse>, now_ms: u64) -> Self {
        Self {
            credits: Some(balance),
            needed,
            ..Self::new(windows, &[], now_ms)
        }
    }

    /// `retry_after[i]` is when the cost fits `windows[i]` (0: it fits now).
    pub fn new(windows: Vec<WindowUse>, retry_after: &[u64], now_ms: u64) -> Self {
        let binding = (0..windows.len())
            .max_by_key(|&i| (retry_after.get(i).copied().unwrap_or(0), usize::MAX - i))
            .unwrap_or(0);
        let w = windows
            .get(binding)
            .cloned()
            .unwrap_or_else(|| WindowUse::new(0, 0, 0, None));
        Self {
            used: w.used,
            limit: w.limit,
            window_ms: w.window_ms,
            remaining: w.remaining,
            retry_after_ms: retry_after.iter().copied().max().unwrap_or(0),
            now_ms,
            windows,
            scope: Scope::User,
            organisation: None,
            needed: 0,
            currency: crate::money::Currency::Tokens,
            credits: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReserveOutcome {
    Allowed(Allowed),
    Denied(Denied),
}

impl ReserveOutcome {
    pub fn is_allowed(&self) -> bool {
        matches!(self, Self::Allowed(_))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RefundOutcome {
    /// The event was removed and its `cost` returned to the pool. `used` is the
    /// plan's longest window's, here and below.
    Refunded { cost: u64, used: u64 },
    /// No live event has this id (never reserved, already refunded, or expired).
    NotFound { used: u64 },
    /// A job's charge no worker had claimed yet: released, and its job
    /// cancelled in the same step (its claim answers
    /// [`ClaimOutcome::Cancelled`]), so it never reaches the provider.
    Cancelled { cost: u64, used: u64 },
    /// The charge is owned by its job, which may be calling the provider:
    /// nothing changed (refund it once the job is final).
    Running { used: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SettleOutcome {
    /// The event's cost is now `cost` (0 removes the event).
    Settled {
        previous_cost: u64,
        cost: u64,
        used: u64,
    },
    NotFound {
        used: u64,
    },
}

/// The answer to an operator's settle ([`Ledger::settle_operator`],
/// [`crate::correction::operator_settle`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum OperatorSettleOutcome {
    /// The event's cost is now `cost` (0 removes the event).
    Settled {
        previous_cost: u64,
        cost: u64,
        used: u64,
    },
    /// No live event has this id.
    NotFound { used: u64 },
    /// The charge is its job's, and the job is not final (held for it, or
    /// owned by it: it may yet call the provider): nothing changed (a
    /// conflict, as for a refund; settle it once the job is final).
    Running { used: u64 },
    /// A settle to 0 of the charge of a job that may have run (succeeded, or
    /// failed keeping its charge) without force: nothing changed.
    MayHaveRun,
}

/// Where a page of the audit trail resumes: the position, in the user's log, of
/// the last event of the page before (`<ms>-<seq>`, the Redis stream entry ID;
/// the embedded backend numbers its events the same way). Clients treat it as
/// opaque. The event it names may have left since: the next page still starts
/// right after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventCursor {
    pub at_ms: u64,
    pub seq: u64,
}

impl EventCursor {
    /// Digits of `at_ms` a cursor may carry: 15 stay below 2^53, which a Lua
    /// number holds exactly (a real one is a Unix time in ms: 13).
    pub const MS_DIGITS: usize = 15;
    /// Digits of `seq`: 19 stay below 2^64.
    pub const SEQ_DIGITS: usize = 19;
}

impl std::fmt::Display for EventCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.at_ms, self.seq)
    }
}

impl std::str::FromStr for EventCursor {
    type Err = PageError;

    /// Only what [`Display`](std::fmt::Display) writes: `<digits>-<digits>`,
    /// at most [`MS_DIGITS`](Self::MS_DIGITS) and
    /// [`SEQ_DIGITS`](Self::SEQ_DIGITS) of them.
    fn from_str(s: &str) -> Result<Self, PageError> {
        let num = |t: &str, digits: usize| {
            (!t.is_empty() && t.len() <= digits && t.bytes().all(|b| b.is_ascii_digit()))
                .then(|| t.parse::<u64>().ok())
                .flatten()
        };
        let (ms, seq) = s.split_once('-').ok_or(PageError::BadCursor)?;
        match (num(ms, Self::MS_DIGITS), num(seq, Self::SEQ_DIGITS)) {
            (Some(at_ms), Some(seq)) => Ok(Self { at_ms, seq }),
            _ => Err(PageError::BadCursor),
        }
    }
}

impl Serialize for EventCursor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A bad page request (the HTTP edge answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    #[error("limit must be between 1 and {max}, got {0}", max = EventPage::MAX_LIMIT)]
    BadLimit(usize),
    #[error("not a cursor this server returned (expected the next_cursor of a page)")]
    BadCursor,
}

/// One page of the audit trail: at most `limit` live events after `after`
/// (from the oldest when `None`), oldest first. Reading a page costs the
/// ledger O(limit), however many events are live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventPage {
    after: Option<EventCursor>,
    limit: usize,
}

impl EventPage {
    /// Events per page when the caller names no limit.
    pub const DEFAULT_LIMIT: usize = 50;
    /// The most a page holds: a page is one short step of the ledger. Each
    /// event of a page costs the Redis script a lookup in its index bucket,
    /// 5-20 µs on the 2-core bench machine (quiet to loaded; BENCHMARKS.md):
    /// more with many live events (colder caches): 50 keep a page under the
    /// 5 ms no script may exceed.
    pub const MAX_LIMIT: usize = 50;

    pub fn new(after: Option<EventCursor>, limit: usize) -> Result<Self, PageError> {
        if limit == 0 || limit > Self::MAX_LIMIT {
            return Err(PageError::BadLimit(limit));
        }
        Ok(Self { after, limit })
    }

    /// The first page, of [`DEFAULT_LIMIT`](Self::DEFAULT_LIMIT) events.
    pub fn first() -> Self {
        Self {
            after: None,
            limit: Self::DEFAULT_LIMIT,
        }
    }

    /// The page after `cursor`, of the same size.
    pub fn next(self, cursor: EventCursor) -> Self {
        Self {
            after: Some(cursor),
            ..self
        }
    }

    pub fn after(&self) -> Option<EventCursor> {
        self.after
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl Default for EventPage {
    fn default() -> Self {
        Self::first()
    }
}

/// A user's budget right now, with one page of the live events (the audit
/// trail). The top-level figures are the window closest to exhaustion's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub plan: String,
    pub used: u64,
    pub limit: u64,
    pub remaining: u64,
    pub window_ms: u64,
    pub now_ms: u64,
    /// Until the oldest live event expires; `None` when there is none.
    pub reset_after_ms: Option<u64>,
    /// One page of the live events in the plan's longest window, oldest
    /// first (the log may keep older ones for another plan's longer window).
    pub events: Vec<SpendEvent>,
    /// Where the next page starts; `None`: this page reached the newest event.
    pub next_cursor: Option<EventCursor>,
    /// Every limit of the plan, longest window first.
    pub windows: Vec<WindowUse>,
    /// True when an admin set this user's limits directly
    /// ([`Ledger::set_limits`]): `plan` is then [`CUSTOM_PLAN`] and `windows`
    /// are the override's.
    pub custom_limits: bool,
    /// The user's organisation, when it is a member: its windows (every
    /// charge must fit them too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub organisation: Option<OrgWindows>,
}

/// The plan name a user with its own limits ([`Ledger::set_limits`]) shows.
pub const CUSTOM_PLAN: &str = "custom";

impl Usage {
    pub fn new(
        plan: String,
        windows: Vec<WindowUse>,
        now_ms: u64,
        events: Vec<SpendEvent>,
        next_cursor: Option<EventCursor>,
    ) -> Self {
        // The top-level figures are the plan's overall limits': a model
        // limit binds only the calls on its models.
        let overall: Vec<WindowUse> = windows
            .iter()
            .filter(|w| w.model.is_none())
            .cloned()
            .collect();
        let w = closest_to_exhaustion(&overall).cloned();
        let w = w.unwrap_or_else(|| WindowUse::new(0, 0, 0, None));
        Self {
            plan,
            used: w.used,
            limit: w.limit,
            remaining: w.remaining,
            window_ms: w.window_ms,
            now_ms,
            reset_after_ms: w.reset_after_ms,
            events,
            next_cursor,
            windows,
            custom_limits: false,
            organisation: None,
        }
    }

    /// The same usage of a user whose limits an admin set: `plan` becomes
    /// [`CUSTOM_PLAN`].
    pub fn with_custom_limits(mut self) -> Self {
        self.plan = CUSTOM_PLAN.to_owned();
        self.custom_limits = true;
        self
    }
}

/// An organisation as the admin api shows it: its plan, windows and one page
/// of its members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrgUsage {
    pub org: OrgId,
    pub plan: String,
    pub now_ms: u64,
    /// Every limit of the plan, longest window first.
    pub windows: Vec<WindowUse>,
    /// Members, in name order, after the page's `after`.
    pub members: Vec<UserId>,
    /// The last member of this page when there are more.
    pub next_member: Option<UserId>,
}

/// One page of the organisations, in name order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrgList {
    pub orgs: Vec<OrgId>,
    /// The last of this page when there are more.
    pub next: Option<OrgId>,
}

/// Where a user's budget lives, and what a move did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Moved {
    /// The organisation the user is in now (`None`: none).
    pub org: Option<OrgId>,
    /// Live events moved with the user.
    pub events: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("cost must be at least 1 token")]
    ZeroCost,
    #[error("cost {cost} exceeds the plan limit of {limit} tokens, so it could never be reserved")]
    CostExceedsLimit { cost: u64, limit: u64 },
    #[error("cost {cost} is larger than the largest accepted cost")]
    CostTooLarge { cost: u64 },
    #[error("unknown plan {name:?} (configured: {known})")]
    UnknownPlan { name: String, known: String },
    /// Limits no plan could have ([`check_custom_limits`]).
    #[error("limits: {0}")]
    BadLimits(String),
    /// A bad grant of credits: the field and why.
    #[error("{field}: {reason}")]
    BadCredit { field: &'static str, reason: String },
    /// A grant's idempotency key used already for another grant (another
    /// amount or expiry): nothing added.
    #[error("idempotency_key {key:?} was used for another grant (amount {amount}, expires_at_ms {expires_at_ms:?})")]
    CreditKeyReused {
        key: String,
        amount: u64,
        expires_at_ms: Option<u64>,
    },
    /// An organisation is created with a plan (`set_org_plan`) before users join.
    #[error("no organisation {0:?}: create it with a plan first")]
    UnknownOrg(String),
    /// The budget store failed.
    #[error("budget store: {0}")]
    Store(#[from] StoreError),
}

impl LedgerError {
    /// Worth retrying: the same call may succeed later (see [`StoreError`]).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Store(e) if e.is_transient())
    }
}

/// A budget ledger. Both implementations give identical answers to identical
/// sequences of calls (the conformance suite in `tests/it` holds them to it).
#[async_trait]
pub trait Ledger: Send + Sync + std::fmt::Debug {
    /// Atomically: drop expired events, check `used + cost <= limit`, record the
    /// event. A second call with the same `request` charges nothing and reports
    /// the original reservation with `duplicate: true`.
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError>;

    /// Removes the event of `request`, once: [`refund_charge`](Self::refund_charge)
    /// without a finished job.
    async fn refund(
        &self,
        user: &UserId,
        request: &RequestId,
    ) -> Result<RefundOutcome, LedgerError> {
        self.refund_charge(user, request, None).await
    }

    /// An operator's refund of `request`, in one atomic step. A plain reserve
    /// is removed. A job's charge: still held (no worker has claimed it) →
    /// released and its job cancelled (`Cancelled`); owned by its job →
    /// `Running`, untouched, unless `finished` is that job's nonce (the caller
    /// read the job as final: the refund is then a plain credit). A worker's
    /// claim and this step decide the race between them.
    async fn refund_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        finished: Option<&str>,
    ) -> Result<RefundOutcome, LedgerError>;

    /// Corrects the event of `request` to `actual_cost` (0 removes it). Raising a
    /// cost records what was really spent even if that takes `used` past the limit.
    async fn settle(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
    ) -> Result<SettleOutcome, LedgerError>;

    /// An operator's correction of `request` to `actual_cost` (0 removes it),
    /// in one step. A plain reserve is settled as by [`settle`](Self::settle);
    /// a job's charge only when `finished` is its job's nonce (the caller read
    /// that job as final), else `Running`, untouched: held or owned, its job
    /// may yet call the provider, and would then run at the corrected cost.
    /// `forced`: the change is exported as a forced correction
    /// ([`ExportEntry::forced`]). Never answers `MayHaveRun` (the caller's).
    async fn settle_operator(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
        finished: Option<&str>,
        forced: bool,
    ) -> Result<OperatorSettleOutcome, LedgerError>;

    /// The job with `settle.nonce` settles its charge to `actual_cost` (>= 1),
    /// what the provider reported, and the event keeps the cost it was charged
    /// at up front. A charge that is not this job's (released, left the window,
    /// or charged anew under another nonce) is `NotFound`, untouched. The cost
    /// is set, not added: a retried settle changes nothing more. With
    /// `may_raise` (an operation that reserved its estimate), like `settle`, it
    /// may take a window past its limit; without (it reserved the most), a
    /// cost above the charge's current one leaves it as it is, so no window
    /// ever passes its limit.
    async fn settle_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        settle: &SettleRequest<'_>,
    ) -> Result<SettleOutcome, LedgerError>;

    /// The user's budget and the first page of its audit trail
    /// ([`EventPage::first`]).
    async fn usage(&self, user: &UserId) -> Result<Usage, LedgerError> {
        self.usage_page(user, EventPage::first()).await
    }

    /// The user's budget, from the running totals, and one page of its live
    /// events (the audit trail): O(page), whatever the number of live events.
    /// Follow `next_cursor` for the rest; an event that leaves between two
    /// pages is simply not in the later one.
    async fn usage_page(&self, user: &UserId, page: EventPage) -> Result<Usage, LedgerError>;

    /// Charges a job, atomically: expire, check the id against the request it
    /// was first charged for (operation, fingerprint), check the budget, record
    /// the event and its owner (held for the job, under `charge.nonce`).
    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError>;

    /// The job with `claim.nonce` takes its charge over (idempotent).
    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        claim: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, LedgerError>;

    /// The job with `nonce` failed: removes its charge, at most once. A charge
    /// under another nonce (a later attempt's) is left alone.
    async fn release(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
    ) -> Result<RefundOutcome, LedgerError>;

    /// The user's export from `since_ms` on (at most `count` entries, oldest
    /// first): empty unless `[export]` is configured. Kept to about `maxlen`
    /// entries per user; the embedded backend keeps them in memory while the
    /// user is (an idle user's go with it).
    async fn exported(
        &self,
        user: &UserId,
        since_ms: u64,
        count: usize,
    ) -> Result<Vec<ExportEntry>, LedgerError>;

    /// Stores `plan` as the user's plan (it must be configured).
    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError>;

    /// The user's effective plan name: the stored one, else the default.
    /// Limits an admin set ([`set_limits`](Self::set_limits)) replace this
    /// plan's limits only: its other settings (share, `max_in_flight`,
    /// `max_stored_bytes`) still apply, and it is the plan the user returns
    /// to when they are cleared.
    async fn plan(&self, user: &UserId) -> Result<String, LedgerError>;

    /// An admin sets the user's own limits (a custom plan for one user):
    /// every budget step from the next on checks these instead of its plan's,
    /// on every pod, read in the same atomic step as the log. `limits` were
    /// validated ([`Config::override_limits`]: longest window first, none
    /// past the retention). The log is kept as it is: a lower limit refuses
    /// until enough spend leaves its window; a window the plan did not have
    /// counts the live events already in it. [`set_plan`](Self::set_plan)
    /// replaces them.
    ///
    /// [`Config::override_limits`]: crate::config::Config::override_limits
    async fn set_limits(
        &self,
        user: &UserId,
        limits: &[crate::config::Limit],
    ) -> Result<(), LedgerError>;

    /// Returns the user to its plan's limits; true when it had limits of its own.
    async fn clear_limits(&self, user: &UserId) -> Result<bool, LedgerError>;

    /// The limits an admin set for the user (longest window first), if any.
    async fn custom_limits(
        &self,
        user: &UserId,
    ) -> Result<Option<Vec<crate::config::Limit>>, LedgerError>;

    /// Creates the organisation `org` on `plan` (it must be configured), or
    /// changes its plan.
    async fn set_org_plan(&self, org: &OrgId, plan: &str) -> Result<(), LedgerError>;

    /// Puts `user` in `org` (`None`: in no organisation), moving its live
    /// events (and held charges) with it: none lost, none counted twice once
    /// the move is done. Idempotent, and resumable: a move interrupted at any
    /// step is finished by the next call. `UnknownOrg` for an organisation
    /// never created.
    async fn set_user_org(&self, user: &UserId, org: Option<&OrgId>) -> Result<Moved, LedgerError>;

    /// The organisation `user` is in (`None`: none).
    async fn user_org(&self, user: &UserId) -> Result<Option<OrgId>, LedgerError>;

    /// The organisation's plan, windows and up to `limit` members after
    /// `after` (name order). `UnknownOrg` for one never created.
    async fn org_usage(
        &self,
        org: &OrgId,
        after: Option<&UserId>,
        limit: usize,
    ) -> Result<OrgUsage, LedgerError>;

    /// Up to `limit` organisations after `after`, in name order.
    async fn orgs(&self, after: Option<&OrgId>, limit: usize) -> Result<OrgList, LedgerError>;

    /// The user's spend rollup: its `step` buckets whose start is in
    /// `[from_ms, to_ms)` and still kept ([`Config::spend_keep`]), one per
    /// bucket and dimensions, in no particular order. Kept in the same atomic
    /// step as every charge, settle, refund and release changes a charge (a
    /// change lands in the bucket of the time the charge was made), so each
    /// bucket equals the cost of the charges made in it, as they stand. One
    /// bounded read: at most the user's kept buckets.
    ///
    /// [`Config::spend_keep`]: crate::config::Config::spend_keep
    async fn spend(
        &self,
        user: &UserId,
        step: crate::spend::Step,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<Vec<crate::spend::Bucket>, LedgerError>;

    /// Adds a grant to the user's prepaid balance ([`crate::credits`]), in
    /// one step, idempotent per key; exported as
    /// [`ChangeKind::CreditGrant`]. A grant whose expiry is not after the
    /// ledger's clock is refused (`BadCredit` naming `expires_at`), as is
    /// one past [`MAX_GRANTS`](crate::credits::MAX_GRANTS) held.
    async fn add_credits(
        &self,
        user: &UserId,
        grant: &crate::credits::GrantRequest<'_>,
    ) -> Result<crate::credits::GrantOutcome, LedgerError>;

    /// The user's balance and live grants; grants that expired go now
    /// (exported as [`ChangeKind::CreditExpire`]). A member of an
    /// organisation holds none: 0.
    async fn credits(&self, user: &UserId) -> Result<crate::credits::CreditBalance, LedgerError>;
}

/// Separates the operation from the acting service key's id in the `op` a
/// charge is recorded under ([`audit_op`]): no operation name has it.
pub const AUDIT_OP_SEPARATOR: char = '/';

/// The `op` both ledgers record a job's charge under: the operation, then
/// `/<key id>` when a service key acted for the user. One field, so that the
/// Redis budget log's packed records keep their shape.
pub fn audit_op(operation: &str, service_key: Option<&str>) -> String {
    match service_key {
        Some(kid) => format!("{operation}{AUDIT_OP_SEPARATOR}{kid}"),
        None => operation.to_owned(),
    }
}

/// The inverse of [`audit_op`]: the operation, and the service key's id.
pub fn split_audit_op(op: &str) -> (&str, Option<&str>) {
    match op.split_once(AUDIT_OP_SEPARATOR) {
        Some((operation, kid)) => (operation, Some(kid)),
        None => (op, None),
    }
}

/// Rejects costs no plan could ever admit (0, or past [`MAX_TOKENS`]); both
/// backends call it before touching state. `cost > limit` is checked against the
/// user's plan inside the atomic step.
///
/// [`MAX_TOKENS`]: crate::config::MAX_TOKENS
pub fn validate_cost(cost: u64) -> Result<(), LedgerError> {
    if cost == 0 {
        return Err(LedgerError::ZeroCost);
    }
    if cost > crate::config::MAX_TOKENS {
        return Err(LedgerError::CostTooLarge { cost });
    }
    Ok(())
}

/// The error for a plan name missing from `config`.
pub fn unknown_plan(config: &crate::config::Config, name: &str) -> LedgerError {
    LedgerError::UnknownPlan {
        name: name.to_owned(),
        known: config
            .plans()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// What both ledgers check of the limits given to [`Ledger::set_limits`]
/// (the api validated them with [`Config::override_limits`], which also
/// holds them to the retention): 1 to [`MAX_LIMITS`], each limit 1 to
/// [`MAX_TOKENS`], windows of at least 1 ms, distinct, longest first.
///
/// [`Config::override_limits`]: crate::config::Config::override_limits
/// [`MAX_LIMITS`]: crate::config::MAX_LIMITS
/// [`MAX_TOKENS`]: crate::config::MAX_TOKENS
pub fn check_custom_limits(limits: &[crate::config::Limit]) -> Result<(), LedgerError> {
    use crate::config::{MAX_LIMITS, MAX_TOKENS};
    if limits.is_empty() || limits.len() > MAX_LIMITS {
        return Err(LedgerError::BadLimits(format!(
            "1 to {MAX_LIMITS} limits, got {}",
            limits.len()
        )));
    }
    if limits.iter().any(|l| l.is_period()) {
        return Err(LedgerError::BadLimits(
            "a user's own limits are trailing windows: calendar periods are set by plans".into(),
        ));
    }
    if limits
        .iter()
        .any(|l| l.limit == 0 || l.limit > MAX_TOKENS || l.window_ms() == 0)
    {
        return Err(LedgerError::BadLimits(format!(
            "every limit 1 to {MAX_TOKENS} tokens over a window of at least 1ms"
        )));
    }
    if limits
        .windows(2)
        .any(|w| w[0].window_ms() <= w[1].window_ms())
    {
        return Err(LedgerError::BadLimits(
            "windows distinct, longest first".into(),
        ));
    }
    Ok(())
}
