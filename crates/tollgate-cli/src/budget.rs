//! `tollgate budget ...`: operator commands on user budgets, against Redis.
//!
//! Exit codes: 0 done, 3 denied by the budget, 4 a conflict (the refund or
//! settle of a charge whose job is not final, a settle to 0 of one whose job
//! may have run without --force), 2 bad input, 1 anything else (Redis
//! unreachable). Errors are one line on stderr; `--json` puts the result on
//! stdout as one JSON object.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tollgate_core::{
    config::Config,
    duration,
    id::{RequestId, UserId},
    ledger::{
        EventCursor, EventPage, ExportEntry, Ledger, LedgerError, OperatorSettleOutcome, PageError,
        RefundOutcome, ReserveOutcome, SettleOutcome, Usage,
    },
    money::{self, Amount, Currency},
};

use crate::process::exit;
use crate::store::{Failure, StoreArgs, Wait};

#[derive(Debug, Args)]
pub struct BudgetArgs {
    #[command(flatten)]
    store: StoreArgs,

    /// Print the result as one JSON object on stdout.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: BudgetCommand,
}

#[derive(Debug, Subcommand)]
enum BudgetCommand {
    /// Reserve COST for a user. Exit 0 when reserved, 3 when denied.
    Reserve {
        #[arg(long)]
        user: UserId,
        /// An amount of the config's currency: whole tokens (`40`), or a
        /// decimal of money (`"0.0025"` USD, at most 6 decimals).
        #[arg(long)]
        cost: String,
        /// Idempotency key: reserving the same id twice charges once (default: a new UUID).
        #[arg(long)]
        request_id: Option<RequestId>,
    },
    /// Refund a reservation (a second refund is a no-op). A queued job's charge
    /// is released and the job cancelled (it never runs); a running job's is
    /// refused (exit 4) until the job is final.
    Refund {
        #[arg(long)]
        user: UserId,
        #[arg(long, value_parser = existing_request)]
        request_id: RequestId,
    },
    /// Correct a reservation to what the call really cost (0 removes it). A
    /// job's charge is corrected only once its job is final: before, it is
    /// refused (exit 4), as a refund is. A settle to 0 of the charge of a job
    /// that may have run (it succeeded, or failed keeping its charge) is
    /// refused (exit 4) unless --force; the export records a forced one.
    Settle {
        #[arg(long)]
        user: UserId,
        #[arg(long, value_parser = existing_request)]
        request_id: RequestId,
        /// An amount of the config's currency, as `reserve --cost` reads it.
        #[arg(long)]
        cost: String,
        /// Remove (--cost 0) the charge of a job that may have run: its
        /// upstream's work goes unpaid (exported as a forced correction).
        #[arg(long)]
        force: bool,
    },
    /// Show used / limit / remaining / window and a page of the live spend
    /// events (oldest first), with the cursor of the next page.
    Usage {
        #[arg(long)]
        user: UserId,
        /// Events per page (1 to 50).
        #[arg(long, default_value_t = EventPage::DEFAULT_LIMIT)]
        limit: usize,
        /// Start after this position: the `next_cursor` a page printed.
        #[arg(long, conflicts_with = "all")]
        cursor: Option<String>,
        /// Every live event: follows the cursors, one short call per page.
        #[arg(long)]
        all: bool,
    },
    /// Print a user's exported budget changes (spend, refund, settle; needs
    /// `[export]` in the config), oldest first: one JSON object per line with
    /// --json.
    Events {
        #[arg(long)]
        user: UserId,
        /// From this time on: ms since the epoch, or a duration ago ("1h", "30d").
        #[arg(long, default_value = "0")]
        since: String,
        /// At most this many entries (read EXPORT_PAGE at a time).
        #[arg(long, default_value_t = 1000)]
        count: usize,
    },
    /// Put a user on a configured plan.
    SetPlan {
        #[arg(long)]
        user: UserId,
        #[arg(long)]
        plan: String,
    },
    /// Print a user's effective plan.
    GetPlan {
        #[arg(long)]
        user: UserId,
    },
    /// Walk through budgets on the embedded ledger (or on Redis with --redis-url).
    Demo,
}

/// Export entries read per call: each call is one bounded `XRANGE ... COUNT`.
const EXPORT_PAGE: usize = 1000;

impl From<PageError> for Failure {
    fn from(e: PageError) -> Self {
        Self::bad_input(e.to_string())
    }
}

impl From<LedgerError> for Failure {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Store(_) => Self::other(e.to_string()),
            _ => Self::bad_input(e.to_string()),
        }
    }
}

pub async fn run(args: BudgetArgs) -> ExitCode {
    match execute(args).await {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

/// `--cost` as an amount of `currency` (exit 2 naming the flag, before
/// anything is read or changed).
fn cost_arg(currency: Currency, text: &str) -> Result<u64, Failure> {
    money::parse_amount(currency, text).map_err(|m| Failure::bad_input(format!("--cost: {m}")))
}

async fn execute(args: BudgetArgs) -> Result<u8, Failure> {
    let config = Arc::new(args.store.load_config()?);
    if let BudgetCommand::Reserve { cost, .. } | BudgetCommand::Settle { cost, .. } = &args.command
    {
        cost_arg(config.currency(), cost)?;
    }
    if let BudgetCommand::Demo = args.command {
        let backends = args.store.open(Arc::clone(&config), 4, Wait::No).await?;
        return demo(backends.ledger, &backends.described, &config)
            .await
            .map(|()| 0);
    }
    let backends = args
        .store
        .shared("budget commands", Arc::clone(&config), 4, Wait::No)
        .await?;
    let ledger = Arc::clone(&backends.ledger);
    let currency = config.currency();
    let out = Output {
        json: args.json,
        currency,
    };

    match args.command {
        BudgetCommand::Reserve {
            user,
            cost,
            request_id,
        } => {
            let cost = cost_arg(currency, &cost)?;
            let request = request_id.unwrap_or_else(RequestId::generate);
            let outcome = ledger.reserve(&user, &request, cost).await?;
            out.reserve(&user, &request, cost, &outcome);
            Ok(if outcome.is_allowed() {
                0
            } else {
                exit::DENIED
            })
        }
        BudgetCommand::Events { user, since, count } => {
            let since_ms = match since.parse::<u64>() {
                Ok(ms) => ms,
                Err(_) => {
                    let ago = duration::parse(&since).map_err(|m| {
                        Failure::bad_input(format!(
                            "--since: ms since the epoch or a duration ago: {m}"
                        ))
                    })?;
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default();
                    u64::try_from(now.saturating_sub(ago).as_millis()).unwrap_or(0)
                }
            };
            if config.export_maxlen().is_none() {
                eprintln!("note: the config has no [export]: nothing new is exported");
            }
            for e in exported(ledger.as_ref(), &user, since_ms, count).await? {
                if out.json {
                    // The entry as exported (`cost` in minor units), with
                    // money's `amount` beside it: the exact decimal string.
                    let mut v = serde_json::to_value(&e).unwrap_or(Value::Null);
                    if let (Currency::Money(code), Value::Object(map)) = (currency, &mut v) {
                        map.insert(
                            "amount".into(),
                            json!(money::format_amount(currency, e.cost)),
                        );
                        map.insert("currency".into(), json!(code.as_str()));
                    }
                    println!("{v}");
                } else {
                    let previous = e
                        .previous_cost
                        .map(|p| format!(" (was {})", out.text(p)))
                        .unwrap_or_default();
                    let op = e
                        .operation
                        .as_deref()
                        .map(|o| format!(" {o}"))
                        .unwrap_or_default();
                    let forced = if e.forced {
                        " (an operator's forced correction)"
                    } else {
                        ""
                    };
                    let model = match (&e.model, &e.entry) {
                        (Some(m), Some(k)) => format!(" model {m} priced by {k}"),
                        _ => String::new(),
                    };
                    println!(
                        "{} {} {} {}{previous}, spent at {} ms{op}{model}{forced}",
                        e.id,
                        format!("{:?}", e.kind).to_lowercase(),
                        e.request_id,
                        out.text(e.cost),
                        e.spent_at_ms
                    );
                }
            }
            Ok(0)
        }
        BudgetCommand::Refund { user, request_id } => {
            let outcome = tollgate_core::refund::operator_refund(
                ledger.as_ref(),
                backends.jobs.as_ref(),
                &user,
                &request_id,
            )
            .await
            .map_err(|e| Failure::other(e.to_string()))?;
            let t = |n| out.text(n);
            let (refunded, cost, used, text) = match outcome {
                RefundOutcome::Refunded { cost, used } => (true, cost, used, format!("refunded {} to {user} (request {request_id}); used now {}", t(cost), t(used))),
                RefundOutcome::Cancelled { cost, used } => (true, cost, used, format!("refunded {} to {user} and cancelled job {request_id}: it never runs; used now {}", t(cost), t(used))),
                RefundOutcome::NotFound { used } => (false, 0, used, format!("nothing to refund: {user} has no live event {request_id}; used {}", t(used))),
                RefundOutcome::Running { used } => {
                    return Err(Failure {
                        code: exit::CONFLICT,
                        message: format!("job {request_id} of {user} owns its charge and may be calling the provider: nothing refunded (used {}); refund it once the job is final", t(used)),
                    });
                }
            };
            let cancelled = matches!(outcome, RefundOutcome::Cancelled { .. });
            out.print(
                out.amounts(
                    json!({"user": user, "request_id": request_id, "refunded": refunded, "cancelled": cancelled, "cost": cost, "used": used}),
                    &["cost", "used"],
                ),
                || text,
            );
            Ok(0)
        }
        BudgetCommand::Settle {
            user,
            request_id,
            cost,
            force,
        } => {
            let cost = cost_arg(currency, &cost)?;
            let outcome = tollgate_core::correction::operator_settle(
                ledger.as_ref(),
                backends.jobs.as_ref(),
                &user,
                &request_id,
                cost,
                force,
            )
            .await
            .map_err(|e| Failure::other(e.to_string()))?;
            let t = |n| out.text(n);
            let text = match &outcome {
                OperatorSettleOutcome::Settled {
                    previous_cost,
                    cost,
                    used,
                } => {
                    format!(
                        "settled {request_id} of {user}: {} -> {}; used now {}",
                        t(*previous_cost),
                        t(*cost),
                        t(*used)
                    )
                }
                OperatorSettleOutcome::NotFound { used } => {
                    format!(
                        "nothing to settle: {user} has no live event {request_id}; used {}",
                        t(*used)
                    )
                }
                OperatorSettleOutcome::Running { used } => {
                    return Err(Failure {
                        code: exit::CONFLICT,
                        message: format!("job {request_id} of {user} is not final and may yet call the provider: nothing settled (used {}); settle it once the job is final", t(*used)),
                    });
                }
                OperatorSettleOutcome::MayHaveRun => {
                    return Err(Failure {
                        code: exit::CONFLICT,
                        message: format!("job {request_id} of {user} may have run (the upstream may have done the work): nothing settled; settle it to 0 with --force to leave it unpaid (exported as a forced correction)"),
                    });
                }
            };
            let mut value = serde_json::to_value(&outcome).unwrap_or(Value::Null);
            value["user"] = json!(user);
            value["request_id"] = json!(request_id);
            value["settled"] = json!(matches!(outcome, OperatorSettleOutcome::Settled { .. }));
            out.print(
                out.amounts(value, &["previous_cost", "cost", "used"]),
                || text,
            );
            Ok(0)
        }
        BudgetCommand::Usage {
            user,
            limit,
            cursor,
            all,
        } => {
            let after = cursor.map(|c| c.parse::<EventCursor>()).transpose()?;
            let page = EventPage::new(after, limit)?;
            let mut usage = ledger.usage_page(&user, page).await?;
            // --all: the figures of the first page, the events of every page;
            // each page is its own short step of the ledger.
            while let (true, Some(next)) = (all, usage.next_cursor) {
                let more = ledger.usage_page(&user, page.next(next)).await?;
                usage.events.extend(more.events);
                usage.next_cursor = more.next_cursor;
            }
            out.print(
                out.amounts(usage_json(&user, &usage), USAGE_AMOUNTS),
                || usage_text(&out, &user, &usage),
            );
            Ok(0)
        }
        BudgetCommand::SetPlan { user, plan } => {
            ledger.set_plan(&user, &plan).await?;
            out.print(json!({"user": user, "plan": plan}), || {
                format!("{user} is now on plan {plan}")
            });
            Ok(0)
        }
        BudgetCommand::GetPlan { user } => {
            let plan = ledger.plan(&user).await?;
            out.print(json!({"user": user, "plan": plan}), || plan.clone());
            Ok(0)
        }
        BudgetCommand::Demo => unreachable!("handled above"),
    }
}

struct Output {
    json: bool,
    currency: Currency,
}

/// `value` with each integer field named in `fields`, at any depth, written
/// as the api writes amounts ([`Amount`]: money as an exact decimal string),
/// and `currency` beside them in money; with tokens `value` unchanged.
pub(crate) fn money_json(mut value: Value, currency: Currency, fields: &[&str]) -> Value {
    fn walk(v: &mut Value, currency: Currency, fields: &[&str]) {
        match v {
            Value::Object(map) => {
                for (k, x) in map.iter_mut() {
                    match x.as_u64() {
                        Some(n) if fields.contains(&k.as_str()) => {
                            *x = Amount::new(currency, n).to_json();
                        }
                        _ => walk(x, currency, fields),
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|x| walk(x, currency, fields)),
            _ => {}
        }
    }
    if let Currency::Money(code) = currency {
        walk(&mut value, currency, fields);
        if let Value::Object(map) = &mut value {
            map.insert("currency".into(), json!(code.as_str()));
        }
    }
    value
}

/// The amounts of `usage_json`, at any depth (its windows and events too).
const USAGE_AMOUNTS: &[&str] = &["used", "limit", "remaining", "cost", "estimate"];

impl Output {
    /// An amount for a sentence: `40 tokens`, `0.00015 USD`.
    fn text(&self, minor: u64) -> String {
        match self.currency {
            Currency::Tokens => format!("{minor} tokens"),
            c => Amount::new(c, minor).to_string(),
        }
    }

    /// `value` with its amounts in the currency ([`money_json`]).
    fn amounts(&self, value: Value, fields: &[&str]) -> Value {
        money_json(value, self.currency, fields)
    }

    fn print(&self, value: Value, text: impl FnOnce() -> String) {
        if self.json {
            println!("{value}");
        } else {
            println!("{}", text());
        }
    }

    fn reserve(&self, user: &UserId, request: &RequestId, cost: u64, outcome: &ReserveOutcome) {
        let value = self.amounts(
            reserve_json(user, request, cost, outcome),
            &["cost", "used", "limit", "remaining"],
        );
        let t = |n| self.text(n);
        self.print(value, || match outcome {
            ReserveOutcome::Allowed(a) => {
                format!(
                    "reserved {} for {user} (request {request}){}: used {}/{}, {} remaining",
                    t(cost),
                    if a.duplicate {
                        ", already reserved: not charged again"
                    } else {
                        ""
                    },
                    t(a.used),
                    t(a.limit),
                    t(a.remaining)
                )
            }
            ReserveOutcome::Denied(d) => format!(
                "denied: {user} has used {}/{}; {} more fits in {} ({} ms)",
                t(d.used),
                t(d.limit),
                t(cost),
                duration::format_approx(std::time::Duration::from_millis(d.retry_after_ms)),
                d.retry_after_ms
            ),
        });
    }
}

fn reserve_json(user: &UserId, request: &RequestId, cost: u64, outcome: &ReserveOutcome) -> Value {
    match outcome {
        ReserveOutcome::Allowed(a) => json!({
            "allowed": true, "user": user, "request_id": request, "cost": cost,
            "used": a.used, "limit": a.limit, "remaining": a.remaining,
            "duplicate": a.duplicate, "at_ms": a.at_ms, "reset_after_ms": a.reset_after_ms,
            "windows": a.windows,
        }),
        ReserveOutcome::Denied(d) => json!({
            "allowed": false, "user": user, "request_id": request, "cost": cost,
            "used": d.used, "limit": d.limit, "remaining": d.remaining,
            "retry_after_ms": d.retry_after_ms, "windows": d.windows,
        }),
    }
}

fn usage_json(user: &UserId, u: &Usage) -> Value {
    json!({
        "user": user, "plan": u.plan, "used": u.used, "limit": u.limit, "remaining": u.remaining,
        "window_secs": u.window_ms / 1000, "window_ms": u.window_ms, "now_ms": u.now_ms,
        "reset_after_ms": u.reset_after_ms, "windows": u.windows, "events": u.events,
        "next_cursor": u.next_cursor, "organisation": u.organisation,
    })
}

fn usage_text(out: &Output, user: &UserId, u: &Usage) -> String {
    // `used 600/1000 tokens`, `used 0.25/20 USD`.
    let unit = out.currency.to_string();
    let amount = |n: u64| money::format_amount(out.currency, n);
    let mut s = format!("{user} on plan {}:", u.plan);
    for w in &u.windows {
        let window = duration::format(std::time::Duration::from_millis(w.window_ms));
        s += &format!(
            "\n  used {}/{} {unit} in the last {window}, {} remaining",
            amount(w.used),
            amount(w.limit),
            amount(w.remaining)
        );
        if let Some(r) = w.reset_after_ms {
            s += &format!(
                "; the oldest event in it frees its tokens in {}",
                duration::format_approx(std::time::Duration::from_millis(r))
            );
        }
    }
    if let Some(o) = &u.organisation {
        s += &format!("\n  in organisation {} on plan {}:", o.org, o.plan);
        for w in &o.windows {
            let window = duration::format(std::time::Duration::from_millis(w.window_ms));
            s += &format!(
                "\n    used {}/{} {unit} in the last {window}, {} remaining",
                amount(w.used),
                amount(w.limit),
                amount(w.remaining)
            );
        }
    }
    if !u.events.is_empty() {
        s += &format!(
            "\n{:<40} {:>8}  {:>14}",
            "request id", "cost", "at (ms ago)"
        );
        for e in &u.events {
            let cost = match e.estimate {
                Some(est) => format!("{} (est. {})", amount(e.cost), amount(est)),
                None => amount(e.cost),
            };
            s += &format!(
                "\n{:<40} {:>8}  {:>14}",
                e.request_id,
                cost,
                u.now_ms.saturating_sub(e.at_ms)
            );
        }
    }
    if let Some(next) = u.next_cursor {
        s += &format!("\nmore events: --cursor {next} (or --all)");
    }
    s
}

/// Up to `count` export entries from `since_ms` on, EXPORT_PAGE per call: the
/// next call starts at the last entry's millisecond and skips what was read.
async fn exported(
    ledger: &dyn Ledger,
    user: &UserId,
    since_ms: u64,
    count: usize,
) -> Result<Vec<ExportEntry>, Failure> {
    fn position(e: &ExportEntry) -> Option<EventCursor> {
        e.id.parse().ok()
    }
    let mut out: Vec<ExportEntry> = Vec::new();
    let mut since = since_ms;
    while out.len() < count {
        let last = out.last().and_then(position);
        let want = (count - out.len()).min(EXPORT_PAGE);
        // What was read already comes again from `since` on: ask for that too.
        let seen = out
            .iter()
            .rev()
            .take_while(|e| position(e).is_some_and(|p| p.at_ms == since))
            .count();
        let page = ledger.exported(user, since, want + seen).await?;
        let full = page.len() == want + seen;
        let before = out.len();
        out.extend(
            page.into_iter()
                .filter(|e| last.is_none() || position(e) > last)
                .take(want),
        );
        match out.last().and_then(position) {
            Some(p) if full && out.len() > before => since = p.at_ms,
            _ => break,
        }
    }
    Ok(out)
}

/// A short narrated tour of the budget semantics on any ledger.
async fn demo(ledger: Arc<dyn Ledger>, on: &str, config: &Config) -> Result<(), Failure> {
    let alice = UserId::new(format!(
        "demo-alice-{}",
        &RequestId::generate().as_str()[..8]
    ))
    .map_err(|e| Failure::other(e.to_string()))?;
    let bob = UserId::new(format!("demo-bob-{}", &RequestId::generate().as_str()[..8]))
        .map_err(|e| Failure::other(e.to_string()))?;
    let plan = config.default_plan();
    println!("tollgate budget demo on {on}");
    println!(
        "plans: {}",
        config
            .plans()
            .map(|p| format!("{} = {}", p.name, p.describe(config.currency())))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!();

    let cost = (plan.max_cost() / 50).max(1);
    let attempts = plan.max_cost() / cost + 10;
    println!(
        "1. {alice} (plan {}) fires {attempts} concurrent calls of {cost} tokens:",
        plan.name
    );
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..attempts {
        let (ledger, alice, request) = (Arc::clone(&ledger), alice.clone(), RequestId::generate());
        calls.spawn(async move {
            let outcome = ledger.reserve(&alice, &request, cost).await;
            (request, outcome)
        });
    }
    let mut admitted = Vec::new();
    let mut denied = Vec::new();
    while let Some(joined) = calls.join_next().await {
        let (request, outcome) =
            joined.map_err(|e| Failure::other(format!("demo task failed: {e}")))?;
        match outcome? {
            ReserveOutcome::Allowed(_) => admitted.push(request),
            ReserveOutcome::Denied(d) => denied.push(d),
        }
    }
    println!(
        "   {} admitted, {} denied: the pool never overspends",
        admitted.len(),
        denied.len()
    );
    if let Some(d) = denied.first() {
        println!(
            "   a denied call learns exactly when it fits: retry after {} ({} ms), when the oldest events leave the {} window",
            duration::format_approx(std::time::Duration::from_millis(d.retry_after_ms)),
            d.retry_after_ms,
            duration::format(std::time::Duration::from_millis(d.window_ms))
        );
    }

    if let Some(failed) = admitted.first() {
        println!("\n2. the provider call of {failed} fails: refund it by request id");
        if let RefundOutcome::Refunded { cost, used } = ledger.refund(&alice, failed).await? {
            println!("   refunded {cost} tokens; used now {used}");
        }
        let again = ledger.refund(&alice, failed).await?;
        println!("   refunding again is a no-op: {again:?}");
    }
    if let Some(retried) = admitted.get(1) {
        let r = ledger.reserve(&alice, retried, cost).await?;
        if let ReserveOutcome::Allowed(a) = r {
            println!(
                "\n3. a client retries {retried}: duplicate = {}, used stays {}",
                a.duplicate, a.used
            );
        }
    }
    if let Some(llm) = admitted.get(2) {
        if let SettleOutcome::Settled {
            previous_cost,
            cost,
            used,
        } = ledger.settle(&alice, llm, cost / 3).await?
        {
            println!("\n4. an LLM call reserved at {previous_cost} used only {cost}: settled, used now {used}");
        }
    }
    if let Some(pro) = config.plans().find(|p| p.name != plan.name) {
        ledger.set_plan(&bob, &pro.name).await?;
        let r = ledger.reserve(&bob, &RequestId::generate(), cost).await?;
        println!(
            "\n5. {bob} is on plan {} and unaffected by alice: allowed = {}",
            pro.name,
            r.is_allowed()
        );
    }
    let usage = ledger.usage(&alice).await?;
    println!(
        "\n6. the audit trail of {alice}: {} live events, used {}/{}",
        usage.events.len(),
        usage.used,
        usage.limit
    );
    for e in usage.events.iter().take(3) {
        println!("   {}  {} tokens at {} ms", e.request_id, e.cost, e.at_ms);
    }
    println!("\nnext: `tollgate budget --help` for the operator commands against Redis");
    Ok(())
}

/// A request id a refund or a settle names: one stored before `.` and `..`
/// were refused is still addressable (a new reservation may not take one).
fn existing_request(s: &str) -> Result<RequestId, String> {
    RequestId::existing(s).map_err(|e| e.to_string())
}
