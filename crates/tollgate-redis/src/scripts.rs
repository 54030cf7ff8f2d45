//! The Lua scripts of `lua/`, embedded at build time, and typed wrappers that own
//! each script's KEYS/ARGV order.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
//! loads the script and retries: each script is loaded once per server, then called
//! by its SHA.
//!
//! The budget scripts are one function library instead ([`BUDGET`], `FUNCTION
//! LOAD`, called by `FCALL`): its shared top level (`lua/lib/budget.lua`) runs
//! once when Redis loads it, not on every call. See [`Library`].

use std::sync::LazyLock;

use redis::{Cmd, RedisError, RedisResult, Script};

use crate::keys::{ActivityKeys, BudgetKeys, Head, JobKeys, Location, Members, ThrottleKeys};

/// A Redis function library: a shared Lua prelude, then one function per
/// script, each script's text the body of its function (called with the
/// prelude's `begin(keys, args)` first, which resets the per-call state).
///
/// The library and its functions are named after a version, the first 16 hex
/// digits of the SHA-1 of the prelude and the scripts
/// (`tollgate_<name>_<version>`, `tollgate_<name>_<version>_<script>`), so
/// that builds of different code coexist on one Redis during a rolling
/// upgrade. Redis keeps functions in its data set: they survive a restart with
/// persistence and reach replicas, so a failover keeps them. A Redis without
/// the library (new, flushed, a new cluster node) answers `FCALL` with
/// "Function not found" without running anything; [`FunctionCall`] then
/// loads the library (`FUNCTION LOAD`, sent to every primary of a
/// cluster) and calls again.
#[derive(Debug)]
pub struct Library {
    name: String,
    text: String,
    prefix: String,
}

impl Library {
    /// `scripts`: (name, body) per function.
    pub fn new(name: &str, prelude: &str, scripts: &[(&str, &str)]) -> Self {
        Self::build(name, prelude, scripts, None)
    }

    /// Like [`Library::new`], each function's reply passed through the
    /// prelude's function `finish` (the budget library's: it wraps a reply
    /// whose caller must add an alert pointer, see `lua/lib/budget.lua`).
    pub fn with_finish(name: &str, prelude: &str, scripts: &[(&str, &str)], finish: &str) -> Self {
        Self::build(name, prelude, scripts, Some(finish))
    }

    fn build(name: &str, prelude: &str, scripts: &[(&str, &str)], finish: Option<&str>) -> Self {
        let mut parts = prelude.to_owned();
        for (script, body) in scripts {
            parts.push('\0');
            parts.push_str(script);
            parts.push('\0');
            parts.push_str(body);
        }
        let hash = Script::new(&parts).get_hash().to_owned();
        let version = &hash[..16];
        let library = format!("tollgate_{name}_{version}");
        let prefix = format!("{library}_");
        let mut text = format!("#!lua name={library}\n{prelude}");
        for (script, body) in scripts {
            let body = match finish {
                Some(f) => format!("return {f}((function()\n{body}\nend)())"),
                None => (*body).to_owned(),
            };
            text.push_str(&format!(
                "\nredis.register_function('{prefix}{script}', function(keys, args)\n\
                 begin(keys, args)\n{body}\nend)\n"
            ));
        }
        Self {
            name: library,
            text,
            prefix,
        }
    }

    /// The library's name (`FUNCTION LIST LIBRARYNAME`, `FUNCTION DELETE`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The full name of one script's function.
    pub fn function(&self, script: &str) -> String {
        format!("{}{script}", self.prefix)
    }

    /// `FUNCTION LOAD <library>` (on every primary of a cluster), without
    /// `REPLACE`: a Redis that has this version answers "already exists"
    /// before compiling anything. The name is the version, a hash of the
    /// code, so a library of that name is this code: never worth replacing.
    pub fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg(&self.text);
        cmd
    }

    /// Loads the library on `conn`'s server where it is missing ("already
    /// exists" is success). After a flush, the pods whose calls all found
    /// the function missing at once compile it once, not once each: every
    /// compile holds Redis (~4–6 ms for the budget library).
    pub async fn load_async(&self, conn: &mut impl redis::aio::ConnectionLike) -> RedisResult<()> {
        match self.load_cmd().query_async::<redis::Value>(conn).await {
            Ok(_) => Ok(()),
            Err(e) if already_loaded(&e.to_string()) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A call of `script`'s function: add its keys and args, then send it.
    pub fn prepare(&'static self, script: &str) -> FunctionCall {
        FunctionCall {
            library: self,
            function: self.function(script),
            keys: Vec::new(),
            args: Vec::new(),
        }
    }
}

/// Loads the function libraries (budget, job, throttle) on `pool`'s Redis (every
/// primary of a cluster) where it lacks this build's version: a process
/// does it as it connects, so that no call waits for Redis to compile a
/// library (a first call on a new version would otherwise pay for it, and a
/// grant's use-by shrinks by the time its call took). Best effort: a Redis
/// that refuses (an ACL without `FUNCTION`) loads on the first call's
/// "Function not found" as before.
pub async fn preload(pool: &crate::pool::Pool, timeout: std::time::Duration) {
    for library in [&*BUDGET, &*JOBS, &*THROTTLE] {
        let cmd = library.load_cmd();
        match crate::call::command::<redis::Value>(pool, timeout, "function_load", &cmd).await {
            Ok(_) => {}
            Err(e) if already_loaded(&e.to_string()) => {}
            Err(e) => {
                tracing::debug!(library = library.name(), error = %e, "function library not preloaded: the first call loads it");
            }
        }
    }
}

/// Whether an error's text is Redis answering a `FUNCTION LOAD` (without
/// `REPLACE`) that it has this library already: the load's goal holds.
fn already_loaded(message: &str) -> bool {
    message.contains("already exists")
}

/// Whether Redis answered that it has no such function (the library is not
/// loaded there): the call did not run.
pub fn is_missing_function(e: &RedisError) -> bool {
    e.code() == Some("ERR") && e.to_string().contains("Function not found")
}

/// Whether Redis answered that it has no such script (`NOSCRIPT`: flushed,
/// or never loaded there): the call did not run.
pub fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// One `FCALL` of a [`Library`]'s function.
#[derive(Debug, Clone)]
pub struct FunctionCall {
    library: &'static Library,
    function: String,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl FunctionCall {
    pub fn key(&mut self, key: impl redis::ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub fn arg(&mut self, arg: impl redis::ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    pub fn library(&self) -> &'static Library {
        self.library
    }

    /// The bare `FCALL` (for a pipeline, which does not load the library on
    /// "Function not found": load it on the server first).
    pub fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.function).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        for a in &self.args {
            cmd.arg(a);
        }
        cmd
    }

    /// `FCALL`; on "Function not found", loads the library and calls again,
    /// up to `loads` loads (a library flushed again between its load and the
    /// call). The error answers "Function not found" ran nothing, so this
    /// never runs the function twice.
    pub async fn invoke_async<T: redis::FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
        loads: usize,
    ) -> RedisResult<T> {
        let cmd = self.cmd();
        let mut loaded = 0;
        loop {
            match cmd.query_async::<T>(conn).await {
                Err(e) if is_missing_function(&e) && loaded < loads => {
                    loaded += 1;
                    self.library.load_async(conn).await?;
                }
                done => return done,
            }
        }
    }
}

const BUDGET_LIB: &str = include_str!("../../../lua/lib/budget.lua");

/// The budget scripts, one function each of one library. Adding a script is
/// one line here.
pub static BUDGET: LazyLock<Library> = LazyLock::new(|| {
    Library::with_finish(
        "budget",
        BUDGET_LIB,
        &[
            ("reserve", include_str!("../../../lua/reserve.lua")),
            ("refund", include_str!("../../../lua/refund.lua")),
            ("settle", include_str!("../../../lua/settle.lua")),
            ("usage", include_str!("../../../lua/usage.lua")),
            ("charge", include_str!("../../../lua/charge.lua")),
            ("claim", include_str!("../../../lua/claim.lua")),
            ("release", include_str!("../../../lua/release.lua")),
            ("retry", include_str!("../../../lua/retry.lua")),
            ("move_out", include_str!("../../../lua/move_out.lua")),
            ("move_in", include_str!("../../../lua/move_in.lua")),
            ("org_usage", include_str!("../../../lua/org_usage.lua")),
        ],
        "finish",
    )
});

/// What a budget script answers in place of its reply when its caller must
/// add the subject's outbox pointer to the alerts' due set:
/// `[ALERT_MARK, pointer..., reply]`: the user's outbox, its organisation's,
/// or both (`finish` in `lua/lib/budget.lua`).
pub const ALERT_MARK: &str = "TOLLGATE_ALERT";

/// The budget scripts by their file in `lua/` (see [`all`]).
pub const BUDGET_SCRIPTS: [&str; 11] = [
    "reserve",
    "refund",
    "settle",
    "usage",
    "charge",
    "claim",
    "release",
    "retry",
    "move_out",
    "move_in",
    "org_usage",
];

/// The ARGV tail of every budget script: the export's maxlen (0: none), the
/// retention (ms: the longest window of any plan, how long the log keeps an
/// event), then the plan table, `name, limits` pairs, the default plan first,
/// where limits is `limit:window_ms,...` longest window first. Built once per
/// config.
#[derive(Debug, Clone)]
pub struct PlanArgs(Vec<String>);

impl PlanArgs {
    /// The ARGV tail itself (for a bare EVALSHA, as benches send it).
    pub fn args(&self) -> &[String] {
        &self.0
    }

    /// The same tail with no export: a move's steps export nothing (the
    /// events neither leave nor come: they change place).
    pub fn without_export(&self) -> Self {
        let mut args = self.0.clone();
        if let Some(first) = args.first_mut() {
            *first = "0".to_owned();
        }
        Self(args)
    }

    pub fn new(config: &tollgate_core::config::Config) -> Self {
        let default = config.default_plan();
        let rest = config.plans().filter(|p| p.name != default.name);
        let export = config.export_maxlen().unwrap_or(0).to_string();
        let retention = config.retention_ms().to_string();
        let plans = std::iter::once(default).chain(rest).flat_map(|p| {
            let mut spec = Self::limits(p);
            spec.push_str(&Self::alerts(p, config.alert_thresholds(p)));
            [p.name.clone(), spec]
        });
        let args = [export, retention].into_iter().chain(plans).collect();
        Self(args)
    }

    /// The plan's alert thresholds as lib/budget.lua's `alert_marks` reads
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

    /// `limit:window_ms,...`, as lib/budget.lua's `resolve_plan` reads it.
    pub fn limits(plan: &tollgate_core::config::Plan) -> String {
        plan.limits
            .iter()
            .map(|l| format!("{}:{}", l.limit, l.window_ms()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn budget_keys(inv: &mut FunctionCall, keys: &BudgetKeys) {
    inv.key(&keys.events)
        .key(&keys.costs)
        .key(&keys.plan)
        .key(&keys.owners)
        .key(&keys.holds)
        .key(&keys.audit)
        .key(&keys.log)
        .key(&keys.meta)
        .key(&keys.cancelled);
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
    inv.arg("freeze").arg(to).arg(&plans.0);
    inv
}

/// `move_out.lua`'s `batch` step: up to `n` of the oldest live events.
pub fn move_batch(loc: &Location, n: usize, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("move_out", loc);
    inv.arg("batch").arg(n).arg(&plans.0);
    inv
}

/// `move_out.lua`'s `drop` step: drops `ids` (moved) from the location.
pub fn move_drop(loc: &Location, ids: &[String], plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("move_out", loc);
    inv.arg("drop").arg(ids.join(" ")).arg(&plans.0);
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
    inv.arg(&plans.0);
    inv
}

/// `org_usage.lua`: an organisation's plan and windows.
pub fn org_usage(org: &BudgetKeys, plans: &PlanArgs) -> FunctionCall {
    let mut inv = BUDGET.prepare("org_usage");
    budget_keys(&mut inv, org);
    inv.arg(&plans.0);
    inv
}

/// `reserve.lua`: returns the raw reply (see the script's header).
pub fn reserve(keys: &Location, request: &str, cost: u64, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("reserve", keys);
    inv.arg(request).arg(cost).arg(&plans.0);
    inv
}

/// `reserve.lua` as a bare `FCALL` with [`reserve`]'s KEYS and ARGV, for a
/// pipeline (bulk loads in tests and benches): a pipeline does not load the
/// library on "Function not found", so load [`BUDGET`] on the server first.
pub fn reserve_cmd(keys: &BudgetKeys, request: &str, cost: u64, plans: &PlanArgs) -> redis::Cmd {
    let loc = Location {
        user: keys.clone(),
        org: None,
    };
    reserve(&loc, request, cost, plans).cmd()
}

/// `refund.lua`: `finished` is the nonce of the charge's job when it was read
/// as final (the refund is then a plain credit), or `""`.
pub fn refund(keys: &Location, request: &str, finished: &str, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("refund", keys);
    inv.arg(request).arg(finished).arg(&plans.0);
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
        .arg(&plans.0);
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
    inv.arg(cursor).arg(page.limit()).arg(&plans.0);
    inv
}

/// `charge.lua`: returns the raw reply (see the script's header).
pub fn charge(
    keys: &Location,
    request: &str,
    charge: &tollgate_core::ledger::ChargeRequest<'_>,
    plans: &PlanArgs,
) -> FunctionCall {
    let mut inv = invocation("charge", keys);
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
        .arg(&plans.0);
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
        .arg(&plans.0);
    inv
}

/// `release.lua`
pub fn release(keys: &Location, request: &str, nonce: &str, plans: &PlanArgs) -> FunctionCall {
    let mut inv = invocation("release", keys);
    inv.arg(request).arg(nonce).arg(&plans.0);
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

const CLOCK_LIB: &str = include_str!("../../../lua/lib/clock.lua");

/// A script that needs only the time: `lua/lib/clock.lua`, then `body`.
fn clock_script(body: &str) -> Script {
    Script::new(&format!("{CLOCK_LIB}\n{body}"))
}

const BUCKET_LIB: &str = include_str!("../../../lua/lib/bucket.lua");
const FAIR_LIB: &str = include_str!("../../../lua/lib/fair.lua");

/// The throttle scripts, one function each of one library (see [`Library`]):
/// `lua/lib/bucket.lua` and `lua/lib/fair.lua` are its prelude, run once when
/// Redis loads it, not on every call. Adding a script is one line here and
/// one in [`THROTTLE_SCRIPTS`].
pub static THROTTLE: LazyLock<Library> = LazyLock::new(|| {
    Library::new(
        "throttle",
        &format!("{BUCKET_LIB}\n{FAIR_LIB}"),
        &[
            (
                "throttle_enqueue",
                include_str!("../../../lua/throttle_enqueue.lua"),
            ),
            (
                "throttle_grant",
                include_str!("../../../lua/throttle_grant.lua"),
            ),
            (
                "throttle_cancel",
                include_str!("../../../lua/throttle_cancel.lua"),
            ),
            (
                "throttle_enqueue_fair",
                include_str!("../../../lua/throttle_enqueue_fair.lua"),
            ),
            (
                "throttle_done",
                include_str!("../../../lua/throttle_done.lua"),
            ),
            (
                "throttle_position",
                include_str!("../../../lua/throttle_position.lua"),
            ),
            (
                "throttle_slot",
                include_str!("../../../lua/throttle_slot.lua"),
            ),
            (
                "throttle_pause",
                include_str!("../../../lua/throttle_pause.lua"),
            ),
            (
                "throttle_usage",
                include_str!("../../../lua/throttle_usage.lua"),
            ),
        ],
    )
});

/// The throttle scripts by their file in `lua/` (see [`all`]).
pub const THROTTLE_SCRIPTS: [&str; 9] = [
    "throttle_enqueue",
    "throttle_grant",
    "throttle_cancel",
    "throttle_enqueue_fair",
    "throttle_done",
    "throttle_position",
    "throttle_slot",
    "throttle_pause",
    "throttle_usage",
];

fn fair_keys(inv: &mut FunctionCall, keys: &ThrottleKeys) {
    inv.key(&keys.tickets).key(&keys.capped).key(&keys.tags);
}

/// A provider's bucket parameters as the throttle scripts read them.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketArgs {
    pub rate: f64,
    /// The capacity the bucket grants from (`Provider::bucket_burst`).
    pub burst: f64,
    /// `max_concurrent`, 0 for none.
    pub slots: u32,
    /// The provider's other limits as `lua/lib/bucket.lua` reads them
    /// ([`limits_spec`]); empty for none.
    pub limits: String,
}

impl From<&tollgate_core::config::Provider> for BucketArgs {
    fn from(p: &tollgate_core::config::Provider) -> Self {
        Self {
            rate: p.rate,
            burst: p.bucket_burst(),
            slots: p.max_concurrent.unwrap_or(0),
            limits: limits_spec(&p.limits),
        }
    }
}

/// `"<field> <burst> <rate> ..."`, a limit's field of the provider's
/// `bucket` hash being its kind and window (`r:<per_ms>`, `t:<per_ms>`; the
/// config allows one limit per kind and window): `lua/lib/bucket.lua`.
pub fn limits_spec(limits: &[tollgate_core::config::ProviderLimit]) -> String {
    use tollgate_core::config::LimitKind;
    limits
        .iter()
        .map(|l| {
            let kind = match l.kind {
                LimitKind::Requests => 'r',
                LimitKind::Tokens => 't',
            };
            format!("{kind}:{} {} {}", l.per_ms(), l.burst, l.rate)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A ticket as the throttle scripts read its weight: `<ticket>*<weight>`
/// for a provider with other limits (`lua/lib/bucket.lua`), else as it is.
pub fn weighted_ticket(ticket: String, bucket: &BucketArgs, weight: u64) -> String {
    if bucket.limits.is_empty() {
        ticket
    } else {
        format!("{ticket}*{}", weight.max(1))
    }
}

/// `throttle_enqueue.lua`
pub fn throttle_enqueue(
    keys: &ThrottleKeys,
    ticket: &str,
    inbox: &str,
    max_wait_us: u64,
    idle_ms: u64,
    bucket: BucketArgs,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_enqueue");
    inv.key(&keys.queue)
        .key(&keys.waiting)
        .key(&keys.bucket)
        .key(&keys.inflight);
    inv.arg(ticket)
        .arg(inbox)
        .arg(max_wait_us)
        .arg(idle_ms)
        .arg(bucket.rate)
        .arg(bucket.burst)
        .arg(bucket.slots)
        .arg(SLOT_LEASE_US)
        .arg(&bucket.limits);
    inv
}

/// `throttle_grant.lua`
pub fn throttle_grant(
    keys: &ThrottleKeys,
    throttler: &str,
    bucket: BucketArgs,
    limit: u32,
    ready_ttl_us: u64,
    idle_ms: u64,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_grant");
    inv.key(&keys.queue)
        .key(keys.processing(throttler))
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.key(&keys.inflight);
    inv.arg(bucket.rate)
        .arg(bucket.burst)
        .arg(limit)
        .arg(ready_ttl_us)
        .arg(idle_ms)
        .arg(keys.base())
        .arg(bucket.slots)
        .arg(SLOT_LEASE_US)
        .arg(&bucket.limits);
    inv
}

/// `throttle_cancel.lua`; `user`: the fair queue the ticket is in, `None`
/// for a FIFO ticket.
pub fn throttle_cancel(
    keys: &ThrottleKeys,
    ticket: &str,
    bucket: BucketArgs,
    user: Option<&str>,
    late: std::time::Duration,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_cancel");
    inv.key(&keys.queue)
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.key(&keys.inflight);
    inv.arg(ticket).arg(bucket.rate).arg(bucket.burst);
    match user {
        Some(user) => inv.arg("fair").arg(user),
        None => inv.arg("fifo").arg(""),
    };
    inv.arg(keys.base())
        .arg(late.as_micros() as u64)
        .arg(&bucket.limits);
    inv
}

/// A waiter of the fair queue: its user and share (`throttle_enqueue_fair.lua`).
#[derive(Debug, Clone, Copy)]
pub struct FairArgs<'a> {
    pub user: &'a str,
    pub weight: u32,
    pub max_in_flight: u32,
    pub hold_us: u64,
}

impl FairArgs<'_> {
    /// `"<weight> <max_in_flight> <hold µs> <user>"`: one argument of the
    /// script, and the tail of the ticket's `waiting` entry as it is (the
    /// script checks it with one pattern and copies it; `lua/lib/fair.lua`).
    fn share(&self) -> String {
        format!(
            "{} {} {} {}",
            self.weight.max(1),
            self.max_in_flight,
            self.hold_us.max(1),
            self.user
        )
    }
}

/// `throttle_enqueue_fair.lua`
pub fn throttle_enqueue_fair(
    keys: &ThrottleKeys,
    ticket: &str,
    inbox: &str,
    max_wait_us: u64,
    idle_ms: u64,
    bucket: BucketArgs,
    fair: FairArgs<'_>,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_enqueue_fair");
    inv.key(&keys.queue).key(&keys.waiting).key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.key(&keys.inflight);
    inv.arg(ticket)
        .arg(inbox)
        .arg(max_wait_us)
        .arg(idle_ms)
        .arg(bucket.rate)
        .arg(bucket.burst)
        .arg(fair.share())
        .arg(keys.base())
        .arg(bucket.slots)
        .arg(SLOT_LEASE_US)
        .arg(&bucket.limits);
    inv
}

/// `throttle_done.lua`
pub fn throttle_done(keys: &ThrottleKeys, user: &str, ticket: &str) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_done");
    inv.key(&keys.queue).key(&keys.waiting);
    fair_keys(&mut inv, keys);
    inv.arg(user).arg(ticket).arg(keys.base());
    inv
}

/// A slot's lease, as the scripts take it (µs).
const SLOT_LEASE_US: u64 = tollgate_core::config::SLOT_LEASE.as_micros() as u64;

/// `throttle_slot.lua`: renews the slot of `ticket` for a lease from now, or
/// ends it (`renew` false).
pub fn throttle_slot(keys: &ThrottleKeys, ticket: &str, renew: bool) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_slot");
    inv.key(&keys.inflight).key(&keys.queue);
    inv.arg(ticket).arg(if renew { SLOT_LEASE_US } else { 0 });
    inv
}

/// How an upstream's refusal pauses a provider's bucket (`throttle_pause.lua`).
#[derive(Debug, Clone, Copy)]
pub struct PauseArgs {
    /// The pause the upstream named (`Retry-After`); `None`: back off.
    pub named: Option<std::time::Duration>,
    /// The first back-off, doubled for each refusal in a row.
    pub first: std::time::Duration,
    /// The longest pause, named or not.
    pub longest: std::time::Duration,
    /// AIMD: the refusal halves the effective rate too.
    pub adaptive: bool,
}

/// `throttle_pause.lua`
pub fn throttle_pause(keys: &ThrottleKeys, bucket: BucketArgs, pause: PauseArgs) -> FunctionCall {
    let us = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let mut inv = THROTTLE.prepare("throttle_pause");
    inv.key(&keys.bucket);
    inv.arg(bucket.rate).arg(bucket.burst);
    match pause.named {
        Some(d) => inv.arg(us(d)),
        None => inv.arg(-1),
    };
    inv.arg(us(pause.first).max(1))
        .arg(us(pause.longest).max(1))
        .arg(u8::from(pause.adaptive));
    inv
}

/// `throttle_usage.lua`: the call of a grant that took `weight` used `used`
/// (a provider with other limits: `bucket.limits` is not empty).
pub fn throttle_usage(
    keys: &ThrottleKeys,
    bucket: &BucketArgs,
    weight: u64,
    used: u64,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_usage");
    inv.key(&keys.bucket);
    inv.arg(&bucket.limits).arg(weight).arg(used);
    inv
}

/// How many tickets of a queue `throttle_position.lua` looks at, at most.
pub const POSITION_SCAN: u32 = 10_000;

/// `throttle_position.lua`; `user`: the fair queue to look in, `None` for a
/// FIFO provider's one queue.
pub fn throttle_position(
    keys: &ThrottleKeys,
    request_id: &str,
    user: Option<&str>,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_position");
    inv.key(&keys.queue).key(&keys.waiting);
    fair_keys(&mut inv, keys);
    inv.key(&keys.lists).key(&keys.bucket);
    inv.arg(request_id);
    match user {
        Some(user) => inv.arg("fair").arg(user),
        None => inv.arg("fifo").arg(""),
    };
    inv.arg(keys.base()).arg(POSITION_SCAN);
    inv
}

pub static LIVENESS_HEARTBEAT: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/liveness_heartbeat.lua")));
pub static LIVENESS_RECLAIM: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/liveness_reclaim.lua")));

/// `liveness_heartbeat.lua`: the listed members whose liveness lapsed.
pub fn liveness_heartbeat<'a>(
    m: Members<'_>,
    member: &str,
    liveness_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = LIVENESS_HEARTBEAT.prepare_invoke();
    inv.key(m.members).key(m.lists).arg(member).arg(liveness_ms);
    inv
}

/// Whose list `liveness_reclaim.lua` gives back.
#[derive(Debug, Clone, Copy)]
pub enum Reclaim {
    /// A member whose liveness lapsed: it stays listed, its list reclaimed
    /// again by every heartbeat of the others, until it has been lapsed for
    /// `forget_ms` (a pop of its may still land).
    Lapsed { forget_ms: u64 },
    /// The caller itself, stopping: reclaimed even though live, then lapsed.
    Stopping,
}

/// `liveness_reclaim.lua`: moves `processing` (the list of `member`) back to
/// the head of the queue; -1 when the member is live (and not stopping).
pub fn liveness_reclaim<'a>(
    m: Members<'_>,
    member: &str,
    processing: &str,
    reclaim: Reclaim,
) -> redis::ScriptInvocation<'a> {
    let mut inv = LIVENESS_RECLAIM.prepare_invoke();
    inv.key(m.members).key(processing).key(m.queue).key(m.lists);
    let (force, forget_ms) = match reclaim {
        Reclaim::Lapsed { forget_ms } => ("0", forget_ms),
        Reclaim::Stopping => ("1", 0),
    };
    inv.arg(member)
        .arg(force)
        .arg(match m.head {
            Head::Left => "LEFT",
            Head::Right => "RIGHT",
        })
        .arg(forget_ms);
    inv
}

const JOB_LIB: &str = include_str!("../../../lua/lib/job.lua");

/// The job scripts, one function each of one library (see [`Library`]): the
/// shared `lua/lib/job.lua` runs once when Redis loads it, not on every call.
/// Adding a script is one line here and one in [`JOB_SCRIPTS`].
pub static JOBS: LazyLock<Library> = LazyLock::new(|| {
    Library::new(
        "job",
        JOB_LIB,
        &[
            ("job_enqueue", include_str!("../../../lua/job_enqueue.lua")),
            ("job_lease", include_str!("../../../lua/job_lease.lua")),
            ("job_renew", include_str!("../../../lua/job_renew.lua")),
            ("job_started", include_str!("../../../lua/job_started.lua")),
            (
                "job_complete",
                include_str!("../../../lua/job_complete.lua"),
            ),
            ("job_fail", include_str!("../../../lua/job_fail.lua")),
            (
                "job_refunded",
                include_str!("../../../lua/job_refunded.lua"),
            ),
            (
                "job_hand_back",
                include_str!("../../../lua/job_hand_back.lua"),
            ),
            ("job_due", include_str!("../../../lua/job_due.lua")),
            ("job_requeue", include_str!("../../../lua/job_requeue.lua")),
            ("job_unstick", include_str!("../../../lua/job_unstick.lua")),
            ("job_forget", include_str!("../../../lua/job_forget.lua")),
        ],
    )
});

/// The job scripts by their file in `lua/` (see [`all`]).
pub const JOB_SCRIPTS: [&str; 12] = [
    "job_enqueue",
    "job_lease",
    "job_renew",
    "job_started",
    "job_complete",
    "job_fail",
    "job_refunded",
    "job_hand_back",
    "job_due",
    "job_requeue",
    "job_unstick",
    "job_forget",
];

/// `job_status.lua`, bare (no job library): a job's record for its owner only.
/// Sent as `EVAL` with this source, so that it rides in a pipeline of plain
/// commands ([`job_status`]).
pub const JOB_STATUS_SOURCE: &str = include_str!("../../../lua/job_status.lua");
pub static JOB_STATUS: LazyLock<Script> = LazyLock::new(|| Script::new(JOB_STATUS_SOURCE));

/// `job_status.lua` as an `EVAL` of job `id`'s record for `user`.
pub fn job_status(keys: &JobKeys, id: &str, user: &str) -> redis::Cmd {
    redis::cmd("EVAL")
        .arg(JOB_STATUS_SOURCE)
        .arg(1)
        .arg(keys.job(id))
        .arg(user)
        .to_owned()
}

/// Every script called by EVALSHA, by the name of its file in `lua/`: what the
/// cluster audit checks ran on the suite's Redis Cluster (`tollgate-bench
/// cluster-audit`). The budget scripts are [`BUDGET`]'s functions
/// ([`BUDGET_SCRIPTS`]), the job scripts [`JOBS`]' ([`JOB_SCRIPTS`]) and the throttle scripts
/// [`THROTTLE`]'s ([`THROTTLE_SCRIPTS`]).
pub fn all() -> Vec<(&'static str, &'static Script)> {
    vec![
        ("liveness_heartbeat.lua", &LIVENESS_HEARTBEAT),
        ("liveness_reclaim.lua", &LIVENESS_RECLAIM),
        ("job_status.lua", &JOB_STATUS),
        ("activity_record.lua", &ACTIVITY_RECORD),
        ("activity_read.lua", &ACTIVITY_READ),
        ("activity_sample.lua", &ACTIVITY_SAMPLE),
        ("session_open.lua", &SESSION_OPEN),
        ("session_touch.lua", &SESSION_TOUCH),
        ("stream_push.lua", &STREAM_PUSH),
        ("stream_trim.lua", &STREAM_TRIM),
        ("alert_take.lua", &ALERT_TAKE),
        ("alert_lease.lua", &ALERT_LEASE),
        ("alert_done.lua", &ALERT_DONE),
        ("alert_point.lua", &ALERT_POINT),
        ("plan_set.lua", &PLAN_SET),
    ]
}

/// The alerts' outbox scripts (see each one's header and
/// `tollgate_redis::alerts`).
pub static ALERT_TAKE: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/alert_take.lua")));
pub static ALERT_LEASE: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/alert_lease.lua")));
pub static ALERT_DONE: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/alert_done.lua")));
pub static ALERT_POINT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/alert_point.lua")));

pub static PLAN_SET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/plan_set.lua")));

/// `plan_set.lua`: the user's plan, replacing limits of its own.
pub fn plan_set<'a>(keys: &BudgetKeys, plan: &str) -> redis::ScriptInvocation<'a> {
    let mut inv = PLAN_SET.prepare_invoke();
    inv.key(&keys.plan).key(keys.limits()).arg(plan);
    inv
}

/// `job_enqueue.lua`: creates `job` (queued) unless it exists.
pub fn job_enqueue(
    keys: &JobKeys,
    job: &tollgate_core::job::Job,
    input: &str,
    create: bool,
    stored: Stored,
    waiter: &str,
) -> FunctionCall {
    let mut inv = JOBS.prepare("job_enqueue");
    inv.key(keys.job(job.id.as_str()))
        .key(&keys.queue)
        .key(&keys.leases)
        .key(&keys.refunds);
    inv.arg(job.id.as_str())
        .arg(job.user.as_str())
        .arg(&job.operation)
        .arg(&job.provider)
        .arg(input)
        .arg(job.cost)
        .arg(job.enqueued_at_ms)
        .arg(job.deadline_ms)
        .arg(&job.nonce)
        .arg(if create { "1" } else { "0" })
        .arg(
            job.trace
                .as_ref()
                .map(|t| t.to_string())
                .unwrap_or_default(),
        )
        .arg(keys.stored_prefix())
        .arg(stored.width_ms)
        .arg(stored.limit)
        .arg(waiter);
    inv
}

/// The stored-bytes accounting's settings for a job script (`lua/lib/job.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Width of a time bucket (ms): [`stored_width_ms`].
    pub width_ms: u64,
    /// The user's bound in the queue (bytes; 0: none). Read by `job_enqueue.lua` only.
    pub limit: u64,
}

/// The bucket width for a queue whose jobs have `deadline_ms` to run and whose
/// results stay `result_ttl_ms`: a minute, or a sixtieth of the two when
/// longer, so a user's hash has at most ~120 buckets (unfinished jobs' by
/// deadline, results' by expiry) and a submit reads a bounded hash. A record
/// counts at most one bucket longer than it is kept.
pub fn stored_width_ms(deadline_ms: u64, result_ttl_ms: u64) -> u64 {
    (deadline_ms.saturating_add(result_ttl_ms) / 60).max(60_000)
}

/// What `job_lease.lua` is asked.
#[derive(Debug, Clone, Copy)]
pub struct LeaseArgs<'a> {
    pub id: &'a str,
    pub worker: &'a str,
    pub lease_ms: u64,
    pub max_attempts: u32,
    /// The queue's operation.
    pub operation: &'a str,
    /// How long a record failed here with nothing to release stays readable.
    pub result_ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_lease.lua`
pub fn job_lease(keys: &JobKeys, a: LeaseArgs<'_>, channel: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_lease");
    inv.key(keys.job(a.id))
        .key(keys.processing(a.worker))
        .key(&keys.leases)
        .key(&keys.refunds)
        .key(&keys.dead);
    inv.arg(a.id)
        .arg(a.worker)
        .arg(a.lease_ms)
        .arg(a.max_attempts)
        .arg(a.operation)
        .arg(channel)
        .arg(a.result_ttl_ms)
        .arg(keys.stored_prefix())
        .arg(a.width_ms);
    inv
}

/// `job_renew.lua`
pub fn job_renew(keys: &JobKeys, id: &str, token: u64, lease_ms: u64) -> FunctionCall {
    let mut inv = JOBS.prepare("job_renew");
    inv.key(keys.job(id)).key(&keys.leases);
    inv.arg(id).arg(token).arg(lease_ms);
    inv
}

/// `job_started.lua`: marks the run started (`mark`), or takes the mark back.
pub fn job_started(keys: &JobKeys, id: &str, token: u64, mark: bool) -> FunctionCall {
    let mut inv = JOBS.prepare("job_started");
    inv.key(keys.job(id));
    inv.arg(token).arg(if mark { "1" } else { "0" });
    inv
}

/// How long a finished record stays readable, and its stored-bytes bucket width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    pub ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_complete.lua`; `head`: the upstream answer's status and safe headers
/// (JSON), `""` when a plain 200.
#[allow(clippy::too_many_arguments)]
pub fn job_complete(
    keys: &JobKeys,
    id: &str,
    worker: &str,
    token: u64,
    result: &str,
    head: &str,
    kept: Kept,
    channel: &str,
) -> FunctionCall {
    let mut inv = JOBS.prepare("job_complete");
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.leases);
    inv.arg(id)
        .arg(token)
        .arg(result)
        .arg(kept.ttl_ms)
        .arg(channel)
        .arg(keys.stored_prefix())
        .arg(kept.width_ms)
        .arg(head);
    inv
}

/// `job_forget.lua`: 1 deleted (a final record of `user` owing nothing), 0 left alone.
pub fn job_forget(keys: &JobKeys, id: &str, user: &str, nonce: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_forget");
    inv.key(keys.job(id));
    inv.arg(user).arg(keys.stored_prefix()).arg(nonce);
    inv
}

/// What `job_fail.lua` records.
#[derive(Debug, Clone, Copy)]
pub struct FailArgs<'a> {
    pub id: &'a str,
    pub worker: &'a str,
    pub token: u64,
    pub cause: &'a str,
    pub message: &'a str,
    /// The job owns its charge: its release goes pending.
    pub release: bool,
    /// How long the record stays readable when nothing is to be released.
    pub ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_fail.lua`
pub fn job_fail(keys: &JobKeys, a: FailArgs<'_>, channel: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_fail");
    inv.key(keys.job(a.id))
        .key(keys.processing(a.worker))
        .key(&keys.leases)
        .key(&keys.refunds);
    inv.arg(a.id)
        .arg(a.token)
        .arg(a.cause)
        .arg(a.message)
        .arg(channel)
        .arg(if a.release { "1" } else { "0" })
        .arg(a.ttl_ms)
        .arg(keys.stored_prefix())
        .arg(a.width_ms);
    inv
}

/// `job_refunded.lua`
pub fn job_refunded(keys: &JobKeys, id: &str, ttl_ms: u64) -> FunctionCall {
    let mut inv = JOBS.prepare("job_refunded");
    inv.key(keys.job(id)).key(&keys.refunds);
    inv.arg(id).arg(ttl_ms);
    inv
}

/// Where [`job_hand_back`] puts a job back in its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueEnd {
    /// Next to be taken (a worker stopping).
    Head,
    /// Behind every queued job (a deferral).
    Tail,
}

/// `job_hand_back.lua`: job `id`, taken by `worker` under fencing `token` and
/// not run, back to `end` of its queue.
pub fn job_hand_back(
    keys: &JobKeys,
    id: &str,
    worker: &str,
    token: u64,
    end: QueueEnd,
) -> FunctionCall {
    let mut inv = JOBS.prepare("job_hand_back");
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.leases)
        .key(&keys.queue);
    let side = match end {
        QueueEnd::Head => "head",
        QueueEnd::Tail => "tail",
    };
    inv.arg(id).arg(token).arg(side);
    inv
}

/// `job_due.lua` on one of the time-scored sets of `keys`.
pub fn job_due(set: &str, age_ms: u64, limit: u32) -> FunctionCall {
    let mut inv = JOBS.prepare("job_due");
    inv.key(set).arg(age_ms).arg(limit);
    inv
}

/// `job_requeue.lua`
pub fn job_requeue(keys: &JobKeys, id: &str, worker: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_requeue");
    inv.key(keys.job(id))
        .key(&keys.leases)
        .key(&keys.queue)
        .key(keys.processing(worker));
    inv.arg(id);
    inv
}

/// `job_unstick.lua`: 1 requeued, 0 dropped as stale, -1 left alone.
pub fn job_unstick(keys: &JobKeys, id: &str, worker: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_unstick");
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.queue);
    inv.arg(id);
    inv
}

pub static ACTIVITY_RECORD: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/activity_record.lua")));
pub static ACTIVITY_READ: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/activity_read.lua")));
pub static ACTIVITY_SAMPLE: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/activity_sample.lua")));

fn activity_keys(inv: &mut redis::ScriptInvocation<'_>, keys: &ActivityKeys, providers: &[String]) {
    inv.key(&keys.events)
        .key(&keys.refunded)
        .key(&keys.grants)
        .key(&keys.answers)
        .key(&keys.denials)
        .key(&keys.denied);
    for p in providers {
        inv.key(keys.waits(p));
    }
}

/// The caps of the activity log (`activity_record.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivityCaps {
    pub events: usize,
    pub waits: usize,
    pub denied: usize,
    pub idle_ms: u64,
    pub timelines: usize,
    pub steps: usize,
    pub failed: usize,
}

/// `activity_sample.lua`: the history's sample of the current slot of
/// `interval_ms`, with `gauges` (JSON), unless a pod wrote it already.
pub fn activity_sample<'a>(
    keys: &ActivityKeys,
    interval_ms: u64,
    span_ms: u64,
    max_samples: usize,
    idle_ms: u64,
    gauges: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = ACTIVITY_SAMPLE.prepare_invoke();
    inv.key(&keys.history)
        .key(&keys.calls)
        .key(&keys.grants)
        .key(&keys.answers)
        .key(&keys.denials);
    inv.arg(interval_ms)
        .arg(span_ms)
        .arg(max_samples)
        .arg(idle_ms)
        .arg(gauges);
    inv
}

/// `activity_record.lua`: `notes` encoded as the script reads them; a grant's
/// index counts from 1 in `providers`.
pub fn activity_record<'a>(
    keys: &ActivityKeys,
    providers: &[String],
    caps: ActivityCaps,
    notes: &[String],
) -> redis::ScriptInvocation<'a> {
    let mut inv = ACTIVITY_RECORD.prepare_invoke();
    inv.key(&keys.events)
        .key(&keys.refunded)
        .key(&keys.grants)
        .key(&keys.answers)
        .key(&keys.denials)
        .key(&keys.denied)
        .key(&keys.calls)
        .key(&keys.timelines)
        .key(&keys.timeline_order)
        .key(&keys.failed);
    for p in providers {
        inv.key(keys.waits(p));
    }
    inv.arg(caps.events)
        .arg(caps.waits)
        .arg(caps.idle_ms)
        .arg(caps.denied)
        .arg(caps.timelines)
        .arg(caps.steps)
        .arg(caps.failed);
    for n in notes {
        inv.arg(n);
    }
    inv
}

/// `activity_read.lua`
pub fn activity_read<'a>(
    keys: &ActivityKeys,
    providers: &[String],
    limit: usize,
) -> redis::ScriptInvocation<'a> {
    let mut inv = ACTIVITY_READ.prepare_invoke();
    activity_keys(&mut inv, keys, providers);
    inv.arg(limit).arg(tollgate_core::activity::DENIED_CAP);
    inv
}

pub static SESSION_OPEN: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/session_open.lua")));
pub static SESSION_TOUCH: LazyLock<Script> =
    LazyLock::new(|| clock_script(include_str!("../../../lua/session_touch.lua")));

/// `session_open.lua`
pub fn session_open<'a>(
    key: &str,
    session: &tollgate_core::session::NewSession,
    lifetime_ms: u64,
    idle_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = SESSION_OPEN.prepare_invoke();
    inv.key(key)
        .arg(session.role.as_str())
        .arg(&session.csrf)
        .arg(&session.credential)
        .arg(lifetime_ms)
        .arg(idle_ms);
    inv
}

/// `session_touch.lua`
pub fn session_touch<'a>(key: &str, idle_ms: u64) -> redis::ScriptInvocation<'a> {
    let mut inv = SESSION_TOUCH.prepare_invoke();
    inv.key(key).arg(idle_ms);
    inv
}

pub static STREAM_PUSH: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/stream_push.lua")));

/// One entry of a streamed job's answer (`stream_push.lua`).
#[derive(Debug, Clone, Copy)]
pub struct StreamPush<'a> {
    pub attempt: u32,
    pub seq: u64,
    /// `d` data, `x` end, `e` error.
    pub kind: &'static str,
    pub text: &'a str,
    /// The most unread bytes: an append finding that many is refused.
    pub backlog: u64,
    pub ttl_ms: u64,
    /// The answer's head (JSON) riding with this entry, or `""`.
    pub head: &'a str,
    /// The bytes this entry counts for (`streams::entry_bytes`).
    pub size: u64,
}

/// `stream_push.lua`'s answer: appended.
pub const STREAM_APPENDED: i64 = 1;
/// `stream_push.lua`'s answer: the reader went away.
pub const STREAM_CANCELLED: i64 = 0;
/// `stream_push.lua`'s answer: the stream's unread backlog is full.
pub const STREAM_FULL: i64 = 2;

/// `stream_push.lua`: [`STREAM_APPENDED`], [`STREAM_CANCELLED`] or
/// [`STREAM_FULL`].
pub fn stream_push<'a>(
    keys: &JobKeys,
    id: &str,
    push: StreamPush<'_>,
) -> redis::ScriptInvocation<'a> {
    let mut inv = STREAM_PUSH.prepare_invoke();
    inv.key(keys.stream(id))
        .key(keys.stream_cancel(id))
        .key(keys.stream_bytes(id));
    inv.arg(push.attempt)
        .arg(push.seq)
        .arg(push.kind)
        .arg(push.text)
        .arg(push.backlog)
        .arg(push.ttl_ms)
        .arg(push.head)
        .arg(push.size);
    inv
}

pub static STREAM_TRIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/stream_trim.lua")));

/// What a reader read of one stream and releases (`stream_trim.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamTrim {
    /// The job's id.
    pub id: String,
    /// Entries with an id below this one were read (`XTRIM MINID`).
    pub minid: String,
    /// The bytes they counted for.
    pub bytes: u64,
}

/// `stream_trim.lua` for streams of one operation (`keys`): how many it trimmed.
pub fn stream_trim<'a>(keys: &JobKeys, trims: &[StreamTrim]) -> redis::ScriptInvocation<'a> {
    let mut inv = STREAM_TRIM.prepare_invoke();
    for t in trims {
        inv.key(keys.stream(&t.id)).key(keys.stream_bytes(&t.id));
        inv.arg(&t.minid).arg(t.bytes);
    }
    inv
}

#[cfg(test)]
mod tests {
    /// A script added to `lua/` and left out of [`super::all`] would escape
    /// the cluster audit.
    #[test]
    fn every_script_file_is_listed() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../lua");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .expect("lua/")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".lua"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = super::all().iter().map(|(n, _)| (*n).to_owned()).collect();
        listed.extend(super::BUDGET_SCRIPTS.iter().map(|n| format!("{n}.lua")));
        listed.extend(super::JOB_SCRIPTS.iter().map(|n| format!("{n}.lua")));
        listed.extend(super::THROTTLE_SCRIPTS.iter().map(|n| format!("{n}.lua")));
        listed.sort();
        assert_eq!(files, listed, "lua/*.lua and scripts::all() differ");
    }
}
