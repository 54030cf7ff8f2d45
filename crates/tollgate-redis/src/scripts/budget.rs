//! The budget family (`lua/budget/`): reserve, charge, claim, release,
//! refund, settle, usage, retry, moves between organisations, and a user's
//! plan.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use tollgate_core::period::{Bounds, Calendar};

use super::FunctionCall;
use crate::keys::{BudgetKeys, Location};

library! {
    /// The budget scripts, one function each of one library; their replies
    /// pass through the prelude's `finish` (an alert pointer to add).
    static BUDGET, const BUDGET_SCRIPTS = "budget" in "budget" {
        prelude: [
            "state", "periods", "model_limits", "rollups", "plan", "codec", "index", "windows", "alerts",
            "credits", "expire", "events", "orgs",
        ],
        finish: "finish",
        scripts: [
            "reserve", "refund", "settle", "usage", "charge", "claim", "release", "retry",
            "move_out", "move_in", "org_usage", "credits",
        ],
    }
}

eval_scripts!(static BUDGET_EVAL in "budget" {
    PLAN_SET = "plan_set";
});

/// What a budget script answers in place of its reply when its caller must
/// add the subject's outbox pointer to the alerts' due set:
/// `[ALERT_MARK, pointer..., reply]`: the user's outbox, its organisation's,
/// or both (`finish` in `lua/budget/lib/alerts.lua`).
pub const ALERT_MARK: &str = "TOLLGATE_ALERT";

/// The ARGV tail of every budget script: the export's maxlen (0: none), the
/// retention (ms: the longest window of any plan, how long the log keeps an
/// event; at least [`PERIOD_LOG_MS`] with a period limit), the spend
/// rollups' keeps (`<hourly_ms> <daily_ms>`, `lua/budget/lib/rollups.lua`), the calendars'
/// boundaries (their count, then `<prev start> <start> <end> <next end>`
/// each, around the ledger's clock: see [`Calendars`]), then the plan table,
/// `name, limits` pairs, the default plan first, where limits is
/// `limit:window_ms,...` longest window first, then `limit:p<calendar>` per
/// period limit. Built once per config, but for the boundaries.
///
/// [`PERIOD_LOG_MS`]: tollgate_core::config::PERIOD_LOG_MS
#[derive(Debug, Clone)]
pub struct PlanArgs {
    export: String,
    retention: String,
    keeps: String,
    table: Vec<String>,
    calendars: Arc<Calendars>,
    /// Every plan's model limits, one per tag.
    models: Arc<Vec<tollgate_core::config::ModelLimit>>,
}

/// The calendars of the config's period limits, numbered from 1 in the order
/// the plan table names them (`p<n>`), and the boundaries last computed for
/// each. The script decides which period Redis `TIME` falls in; the
/// boundaries are computed around this pod's clock corrected by what the
/// ledger's clock was last seen to be ([`Calendars::learn`]), so a pod whose
/// clock is off is refused at most once per period.
#[derive(Debug, Default)]
pub struct Calendars {
    list: Vec<&'static Calendar>,
    /// The ledger's clock minus this pod's (ms), as last learned.
    skew_ms: AtomicI64,
    /// Per calendar, the boundaries last computed.
    bounds: Mutex<Vec<Option<Bounds>>>,
}

impl Calendars {
    fn of(config: &tollgate_core::config::Config) -> Self {
        let mut list: Vec<&'static Calendar> = Vec::new();
        for p in config.plans() {
            let models = p.model_limits.iter().map(|m| m.period);
            for c in p.limits.iter().filter_map(|l| l.period).chain(models) {
                if !list.iter().any(|o| std::ptr::eq(*o, c)) {
                    list.push(c);
                }
            }
        }
        let bounds = Mutex::new(vec![None; list.len()]);
        Self {
            list,
            skew_ms: AtomicI64::new(0),
            bounds,
        }
    }

    /// The number the plan table gives calendar `c` (from 1).
    fn number(&self, c: &'static Calendar) -> usize {
        self.list
            .iter()
            .position(|o| std::ptr::eq(*o, c))
            .map_or(0, |i| i + 1)
    }

    /// The ledger's clock as this pod reckons it (ms).
    fn now_ms(&self) -> u64 {
        let pod = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        u64::try_from(pod.saturating_add(self.skew_ms.load(Ordering::Relaxed))).unwrap_or(0)
    }

    /// The ledger's clock read `ledger_ms` (a script refused boundaries that
    /// did not hold it): the next boundaries are computed around it.
    pub fn learn(&self, ledger_ms: u64) {
        let pod = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let ledger = i64::try_from(ledger_ms).unwrap_or(i64::MAX);
        self.skew_ms
            .store(ledger.saturating_sub(pod), Ordering::Relaxed);
    }

    /// The ARGV section: the count, then each calendar's boundaries around
    /// now (computed again once now leaves the current period).
    fn push_args(&self, out: &mut Vec<String>) {
        out.push(self.list.len().to_string());
        if self.list.is_empty() {
            return;
        }
        let now = self.now_ms();
        let mut cached = tollgate_core::lock(&self.bounds);
        for (c, b) in self.list.iter().zip(cached.iter_mut()) {
            if !b.is_some_and(|b| b[1] <= now && now < b[2]) {
                *b = c.bounds(now);
            }
            // No boundaries (a clock past the calendar's range): none hold
            // the ledger's clock, and the script refuses.
            let [a, s, e, n] = b.unwrap_or([0; 4]);
            out.push(format!("{a} {s} {e} {n}"));
        }
    }
}

impl PlanArgs {
    /// The ARGV tail itself, with the boundaries around now (for a bare
    /// EVALSHA, as benches send it).
    pub fn args(&self) -> Vec<String> {
        let mut out = Vec::with_capacity(4 + self.calendars.list.len() + self.table.len());
        out.push(self.export.clone());
        out.push(self.retention.clone());
        out.push(self.keeps.clone());
        self.calendars.push_args(&mut out);
        out.extend(self.table.iter().cloned());
        out
    }

    /// The calendars (to [`learn`](Calendars::learn) the ledger's clock).
    pub fn calendars(&self) -> &Calendars {
        &self.calendars
    }

    /// The same tail with no export: a move's steps export nothing (the
    /// events neither leave nor come: they change place).
    pub fn without_export(&self) -> Self {
        Self {
            export: "0".to_owned(),
            ..self.clone()
        }
    }

    pub fn new(config: &tollgate_core::config::Config) -> Self {
        let calendars = Calendars::of(config);
        let default = config.default_plan();
        let rest = config.plans().filter(|p| p.name != default.name);
        let table = std::iter::once(default)
            .chain(rest)
            .flat_map(|p| {
                let mut spec = Self::spec(p, &calendars);
                if p.credits == tollgate_core::credits::CreditMode::Only {
                    // budget/lib/credits.lua: the plan draws on credits.
                    spec.insert(0, 'C');
                }
                spec.push_str(&Self::alerts(p, config.alert_thresholds(p)));
                spec.push_str(&Self::model_limits(p, &calendars));
                [p.name.clone(), spec]
            })
            .collect();
        Self {
            export: config.export_maxlen().unwrap_or(0).to_string(),
            retention: config.retention_ms().to_string(),
            keeps: {
                let k = config.spend_keep();
                format!("{} {}", k.hourly.as_millis(), k.daily.as_millis())
            },
            table,
            calendars: Arc::new(calendars),
            models: Arc::new({
                let mut all: Vec<tollgate_core::config::ModelLimit> = Vec::new();
                for m in config.plans().flat_map(|p| p.model_limits.iter()) {
                    if !all.iter().any(|o| o.tag == m.tag) {
                        all.push(m.clone());
                    }
                }
                all
            }),
        }
    }

    /// The plan's model limits as budget/lib/model_limits.lua reads them
    /// after its limits and alerts: `~<limit>:p<calendar>:<tag>,...`, or
    /// nothing.
    fn model_limits(plan: &tollgate_core::config::Plan, calendars: &Calendars) -> String {
        if plan.model_limits.is_empty() {
            return String::new();
        }
        let items = plan
            .model_limits
            .iter()
            .map(|m| format!("{}:p{}:{}", m.limit, calendars.number(m.period), m.tag))
            .collect::<Vec<_>>();
        format!("~{}", items.join(","))
    }

    /// The tags of the model limits (of any plan) `charge` counts under,
    /// space separated, as charge.lua reads them.
    pub fn model_tags(&self, charge: &tollgate_core::ledger::ChargeRequest<'_>) -> String {
        if self.models.is_empty() || (charge.model.is_empty() && charge.price.is_none()) {
            return String::new();
        }
        let name = charge.requested_model().unwrap_or_default();
        self.models
            .iter()
            .filter(|m| m.matches(&name, charge.model))
            .map(|m| m.tag.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The pattern of the model limit `tag` names (a reply's window).
    pub fn model_pattern(&self, tag: &str) -> Option<&str> {
        self.models
            .iter()
            .find(|m| m.tag == tag)
            .map(|m| m.pattern.as_str())
    }

    /// The plan's alert thresholds as budget/lib/plan.lua's `alert_marks` reads
    /// them after its limits: `|<bp>:<tokens>:<tokens>,...` (per threshold
    /// its basis points, then the tokens that reach it in each limit), or
    /// nothing (no thresholds, or no `[alerts]`: no alert is ever queued).
    pub fn alerts(plan: &tollgate_core::config::Plan, thresholds: &[u32]) -> String {
        if thresholds.is_empty() {
            return String::new();
        }
        let groups = thresholds
            .iter()
            .map(|&bp| {
                let mut g = bp.to_string();
                for l in &plan.limits {
                    g.push(':');
                    g.push_str(&tollgate_core::config::threshold_tokens(l.limit, bp).to_string());
                }
                g
            })
            .collect::<Vec<_>>();
        format!("|{}", groups.join(","))
    }

    /// `limit:window_ms,...`, as budget/lib/plan.lua's `resolve_plan` reads it
    /// (a user's own limits: windows only).
    pub fn limits(plan: &tollgate_core::config::Plan) -> String {
        Self::spec(plan, &Calendars::default())
    }

    /// `limit:window_ms,...,limit:p<calendar>,...`.
    fn spec(plan: &tollgate_core::config::Plan, calendars: &Calendars) -> String {
        plan.limits
            .iter()
            .map(|l| match l.period {
                Some(c) => format!("{}:p{}", l.limit, calendars.number(c)),
                None => format!("{}:{}", l.limit, l.window_ms()),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn budget_keys(inv: &mut FunctionCall, keys: &BudgetKeys) {
    inv.key(&keys.ordered()[..]);
}

/// A budget script at a user's location: its keys, then, for a member, its
/// organisation's (the script applies each step to both).
fn invocation(script: &str, loc: &Location) -> FunctionCall {
    let mut inv = BUDGET.prepare(script);
    budget_keys(&mut inv, &loc.user);
    if let Some(org) = &loc.org {
        budget_keys(&mut inv, org);
    }
    inv
}

/// `move_out.lua`'s `freeze` step: `to` is `-` (the user's own tag) or `o:<org>`.
pub fn move_freeze(loc: &Location, to: &str, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("move_out", loc);
    inv.arg("freeze").arg(to).arg(plans.args());
    inv
}

/// `move_out.lua`'s `batch` step: up to `n` of the oldest live events.
pub fn move_batch(loc: &Location, n: usize, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("move_out", loc);
    inv.arg("batch").arg(n).arg(plans.args());
    inv
}

/// `move_out.lua`'s `drop` step: drops `ids` (moved) from the location.
pub fn move_drop(loc: &Location, ids: &[String], plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("move_out", loc);
    inv.arg("drop").arg(ids.join(" ")).arg(plans.args());
    inv
}

/// `move_in.lua`: `events` are the batch's fields, ten per event, as
/// `move_out.lua` reads them.
pub fn move_in(
    loc: &Location,
    plan: &str,
    cancelled: &str,
    events: &[Vec<u8>],
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("move_in", loc);
    inv.arg(events.len() / 10).arg(plan).arg(cancelled);
    for f in events {
        inv.arg(f.as_slice());
    }
    inv.arg(plans.args());
    inv
}

/// `org_usage.lua`: an organisation's plan and windows.
pub fn org_usage(org: &BudgetKeys, plans: &PlanArgs) -> FunctionCall {
    let mut inv = BUDGET.prepare("org_usage");
    budget_keys(&mut inv, org);
    inv.arg(plans.args());
    inv
}

/// `reserve.lua`: returns the raw reply (see the script's header).
pub fn reserve(keys: &Location, request: &str, cost: u64, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("reserve", keys);
    let dims = tollgate_core::spend::Dims {
        org: keys.org_name.clone().unwrap_or_default(),
        ..Default::default()
    };
    inv.arg(request)
        .arg(cost)
        .arg(dims.to_text())
        .arg(plans.args());
    inv
}

/// `reserve.lua` as a bare `FCALL` with [`reserve`]'s KEYS and ARGV, for a
/// pipeline (bulk loads in tests and benches): a pipeline does not load the
/// library on "Function not found", so load [`BUDGET`] on the server first.
pub fn reserve_cmd(keys: &BudgetKeys, request: &str, cost: u64, plans: &PlanArgs) -> redis::Cmd {
    let loc = Location {
        user: keys.clone(),
        org: None,
        org_name: None,
    };
    reserve(&loc, request, cost, plans).cmd()
}

/// `refund.lua`: `finished` is the nonce of the charge's job when it was read
/// as final (the refund is then a plain credit), or `""`.
pub fn refund(keys: &Location, request: &str, finished: &str, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("refund", keys);
    inv.arg(request).arg(finished).arg(plans.args());
    inv
}

/// `settle.lua`: `settle.nonce` is `""` for an operator's correction of any
/// event, or the nonce of the job settling its own charge; `may_raise` false
/// settles only down.
pub fn settle(
    keys: &Location,
    request: &str,
    settle: &tollgate_core::ledger::SettleRequest<'_>,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("settle", keys);
    inv.arg(request)
        .arg(settle.actual_cost)
        .arg(settle.nonce)
        .arg(if settle.may_raise { "1" } else { "0" })
        .arg(plans.args());
    inv
}

/// `settle.lua` for an operator: `finished` the nonce of the charge's job read
/// as final (`None`: no such job); `forced` exports a removal as forced.
pub fn settle_operator(
    keys: &Location,
    request: &str,
    actual_cost: u64,
    finished: Option<&str>,
    forced: bool,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("settle", keys);
    inv.arg(request)
        .arg(actual_cost)
        .arg(finished.unwrap_or(""))
        .arg(if forced { "f" } else { "o" })
        .arg(plans.args());
    inv
}

/// `usage.lua`: the budget and one page of the audit trail.
pub fn usage(
    keys: &Location,
    page: tollgate_core::ledger::EventPage,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("usage", keys);
    let cursor = page.after().map(|c| c.to_string()).unwrap_or_default();
    inv.arg(cursor).arg(page.limit()).arg(plans.args());
    inv
}

/// `charge.lua`: returns the raw reply (see the script's header).
/// `refuse_new`: answer a request charged already, but charge no new one
/// (fsync mode while Redis is not known to fsync every write).
/// `provider`: the operation's, counted with the charge in the spend rollups.
pub fn charge(
    keys: &Location,
    request: &str,
    charge: &tollgate_core::ledger::ChargeRequest<'_>,
    provider: &str,
    refuse_new: bool,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("charge", keys);
    let dims = tollgate_core::spend::Dims {
        org: keys.org_name.clone().unwrap_or_default(),
        operation: charge.operation.to_owned(),
        provider: provider.to_owned(),
        model: charge.model.to_owned(),
    };
    inv.arg(request)
        .arg(charge.cost)
        .arg(charge.nonce)
        .arg(tollgate_core::ledger::audit_op(
            charge.operation,
            charge.service_key,
        ))
        .arg(charge.fingerprint)
        .arg(u64::try_from(charge.deadline.as_millis()).unwrap_or(u64::MAX))
        .arg(u64::try_from(charge.grace.as_millis()).unwrap_or(u64::MAX))
        .arg(if refuse_new { "1" } else { "0" })
        .arg(dims.to_text())
        .arg(charge.price.unwrap_or(""))
        .arg(plans.model_tags(charge))
        .arg(plans.args());
    inv
}

/// `claim.lua`: 1 claimed, 0 refused, 2 cancelled by an operator.
pub fn claim(
    keys: &Location,
    request: &str,
    claim: &tollgate_core::ledger::ClaimRequest<'_>,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("claim", keys);
    inv.arg(request)
        .arg(claim.nonce)
        .arg(claim.hold_until_ms)
        .arg(plans.args());
    inv
}

/// `release.lua`
pub fn release(keys: &Location, request: &str, nonce: &str, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("release", keys);
    inv.arg(request).arg(nonce).arg(plans.args());
    inv
}

/// `retry.lua`: goes on with a denial's walk toward its exact retry_after
/// (`more`: the text the denial answered for a window of `window_ms`).
/// `org`: the walk is over an organisation's log (`keys` its budget keys).
pub fn retry(
    keys: &BudgetKeys,
    more: &str,
    window_ms: u64,
    now_ms: u64,
    org: bool,
) -> FunctionCall {
    let mut inv = BUDGET.prepare("retry");
    budget_keys(&mut inv, keys);
    inv.arg(more)
        .arg(window_ms)
        .arg(now_ms)
        .arg(if org { "org" } else { "user" });
    inv
}

/// `plan_set.lua`: the user's plan, replacing limits of its own.
pub fn plan_set<'a>(keys: &BudgetKeys, plan: &str) -> redis::ScriptInvocation<'a> {
    let mut inv = PLAN_SET.prepare_invoke();
    inv.key(&keys.plan).key(keys.limits()).arg(plan);
    inv
}

/// `credits.lua`: a grant (`Some`: amount, expiry or 0, idempotency key)
/// or, with `None`, a read of the balance.
pub fn credits(
    loc: &Location,
    grant: Option<&tollgate_core::credits::GrantRequest<'_>>,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("credits", loc);
    match grant {
        Some(g) => inv
            .arg("grant")
            .arg(g.amount)
            .arg(g.expires_at_ms.unwrap_or(0))
            .arg(g.idempotency_key),
        None => inv.arg("show").arg(0).arg(0).arg(""),
    };
    inv.arg(plans.args());
    inv
}
