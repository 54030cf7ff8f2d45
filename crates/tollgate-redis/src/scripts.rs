//! The Lua scripts of `lua/`, embedded at build time, and typed wrappers that own
//! each script's KEYS/ARGV order.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
//! loads the script and retries: each script is loaded once per server, then called
//! by its SHA.

use std::sync::LazyLock;

use redis::Script;

use crate::keys::{ActivityKeys, BudgetKeys, JobKeys, ThrottleKeys};

const BUDGET_LIB: &str = include_str!("../../../lua/lib/budget.lua");

fn budget_script(body: &str) -> Script {
    Script::new(&format!("{BUDGET_LIB}\n{body}"))
}

pub static RESERVE: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/reserve.lua")));
pub static REFUND: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/refund.lua")));
pub static SETTLE: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/settle.lua")));
pub static USAGE: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/usage.lua")));
pub static CHARGE: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/charge.lua")));
pub static CLAIM: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/claim.lua")));
pub static RELEASE: LazyLock<Script> =
    LazyLock::new(|| budget_script(include_str!("../../../lua/release.lua")));

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

    pub fn new(config: &tollgate_core::config::Config) -> Self {
        let default = config.default_plan();
        let rest = config.plans().filter(|p| p.name != default.name);
        let export = config.export_maxlen().unwrap_or(0).to_string();
        let retention = config.retention_ms().to_string();
        let plans = std::iter::once(default)
            .chain(rest)
            .flat_map(|p| [p.name.clone(), Self::limits(p)]);
        let args = [export, retention].into_iter().chain(plans).collect();
        Self(args)
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

fn invocation<'a>(script: &'a Script, keys: &BudgetKeys) -> redis::ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(&keys.events)
        .key(&keys.costs)
        .key(&keys.plan)
        .key(&keys.owners)
        .key(&keys.holds)
        .key(&keys.audit)
        .key(&keys.log)
        .key(&keys.meta)
        .key(&keys.cancelled);
    inv
}

/// `reserve.lua`: returns the raw reply (see the script's header).
pub fn reserve<'a>(
    keys: &BudgetKeys,
    request: &str,
    cost: u64,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&RESERVE, keys);
    inv.arg(request).arg(cost).arg(&plans.0);
    inv
}

/// `reserve.lua` as a bare `EVALSHA` with [`reserve`]'s KEYS and ARGV, for a
/// pipeline (bulk loads in tests and benches): a pipeline does not reload a
/// script on NOSCRIPT, so load [`RESERVE`] on the server first.
pub fn reserve_cmd(keys: &BudgetKeys, request: &str, cost: u64, plans: &PlanArgs) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(RESERVE.get_hash())
        .arg(9)
        .arg(&keys.events)
        .arg(&keys.costs)
        .arg(&keys.plan)
        .arg(&keys.owners)
        .arg(&keys.holds)
        .arg(&keys.audit)
        .arg(&keys.log)
        .arg(&keys.meta)
        .arg(&keys.cancelled)
        .arg(request)
        .arg(cost)
        .arg(&plans.0);
    cmd
}

/// `refund.lua`: `finished` is the nonce of the charge's job when it was read
/// as final (the refund is then a plain credit), or `""`.
pub fn refund<'a>(
    keys: &BudgetKeys,
    request: &str,
    finished: &str,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&REFUND, keys);
    inv.arg(request).arg(finished).arg(&plans.0);
    inv
}

/// `settle.lua`: `nonce` is `""` for an operator's correction of any event, or
/// the nonce of the job settling its own charge; `may_raise` false settles
/// only down.
pub fn settle<'a>(
    keys: &BudgetKeys,
    request: &str,
    actual_cost: u64,
    nonce: &str,
    may_raise: bool,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&SETTLE, keys);
    inv.arg(request)
        .arg(actual_cost)
        .arg(nonce)
        .arg(if may_raise { "1" } else { "0" })
        .arg(&plans.0);
    inv
}

/// `usage.lua`: the budget and one page of the audit trail.
pub fn usage<'a>(
    keys: &BudgetKeys,
    page: tollgate_core::ledger::EventPage,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&USAGE, keys);
    let cursor = page.after().map(|c| c.to_string()).unwrap_or_default();
    inv.arg(cursor).arg(page.limit()).arg(&plans.0);
    inv
}

/// `charge.lua`: returns the raw reply (see the script's header).
pub fn charge<'a>(
    keys: &BudgetKeys,
    request: &str,
    charge: &tollgate_core::ledger::ChargeRequest<'_>,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&CHARGE, keys);
    inv.arg(request)
        .arg(charge.cost)
        .arg(charge.nonce)
        .arg(charge.operation)
        .arg(charge.fingerprint)
        .arg(u64::try_from(charge.deadline.as_millis()).unwrap_or(u64::MAX))
        .arg(u64::try_from(charge.grace.as_millis()).unwrap_or(u64::MAX))
        .arg(&plans.0);
    inv
}

/// `claim.lua`: 1 claimed, 0 refused, 2 cancelled by an operator.
pub fn claim<'a>(
    keys: &BudgetKeys,
    request: &str,
    nonce: &str,
    hold_until_ms: u64,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&CLAIM, keys);
    inv.arg(request).arg(nonce).arg(hold_until_ms).arg(&plans.0);
    inv
}

/// `release.lua`
pub fn release<'a>(
    keys: &BudgetKeys,
    request: &str,
    nonce: &str,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&RELEASE, keys);
    inv.arg(request).arg(nonce).arg(&plans.0);
    inv
}

const BUCKET_LIB: &str = include_str!("../../../lua/lib/bucket.lua");
const FAIR_LIB: &str = include_str!("../../../lua/lib/fair.lua");

fn bucket_script(body: &str) -> Script {
    Script::new(&format!("{BUCKET_LIB}\n{FAIR_LIB}\n{body}"))
}

pub static THROTTLE_ENQUEUE: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_enqueue.lua")));
pub static THROTTLE_GRANT: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_grant.lua")));
pub static THROTTLE_CANCEL: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_cancel.lua")));
pub static THROTTLE_ENQUEUE_FAIR: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_enqueue_fair.lua")));
pub static THROTTLE_DONE: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_done.lua")));
pub static THROTTLE_POSITION: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_position.lua")));

/// The fair queue's keys, in the order the throttle scripts take them.
fn fair_keys(inv: &mut redis::ScriptInvocation<'_>, keys: &ThrottleKeys) {
    inv.key(&keys.tickets).key(&keys.capped).key(&keys.tags);
}

/// A provider's bucket parameters as the throttle scripts read them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketArgs {
    pub rate: f64,
    pub burst: u64,
}

impl From<&tollgate_core::config::Provider> for BucketArgs {
    fn from(p: &tollgate_core::config::Provider) -> Self {
        Self {
            rate: p.rate,
            burst: p.burst,
        }
    }
}

/// `throttle_enqueue.lua`
pub fn throttle_enqueue<'a>(
    keys: &ThrottleKeys,
    ticket: &str,
    inbox: &str,
    max_wait_us: u64,
    idle_ms: u64,
    bucket: BucketArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_ENQUEUE.prepare_invoke();
    inv.key(&keys.queue).key(&keys.waiting).key(&keys.bucket);
    inv.arg(ticket)
        .arg(inbox)
        .arg(max_wait_us)
        .arg(idle_ms)
        .arg(bucket.rate)
        .arg(bucket.burst);
    inv
}

/// `throttle_grant.lua`
pub fn throttle_grant<'a>(
    keys: &ThrottleKeys,
    throttler: &str,
    bucket: BucketArgs,
    limit: u32,
    ready_ttl_us: u64,
    idle_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_GRANT.prepare_invoke();
    inv.key(&keys.queue)
        .key(keys.processing(throttler))
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.arg(bucket.rate)
        .arg(bucket.burst)
        .arg(limit)
        .arg(ready_ttl_us)
        .arg(idle_ms)
        .arg(keys.base());
    inv
}

/// `throttle_cancel.lua`; `user`: the fair queue the ticket is in, `None`
/// for a FIFO ticket.
pub fn throttle_cancel<'a>(
    keys: &ThrottleKeys,
    ticket: &str,
    bucket: BucketArgs,
    user: Option<&str>,
    late: std::time::Duration,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_CANCEL.prepare_invoke();
    inv.key(&keys.queue)
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.arg(ticket).arg(bucket.rate).arg(bucket.burst);
    match user {
        Some(user) => inv.arg("fair").arg(user),
        None => inv.arg("fifo").arg(""),
    };
    inv.arg(keys.base()).arg(late.as_micros() as u64);
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
pub fn throttle_enqueue_fair<'a>(
    keys: &ThrottleKeys,
    ticket: &str,
    inbox: &str,
    max_wait_us: u64,
    idle_ms: u64,
    bucket: BucketArgs,
    fair: FairArgs<'_>,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_ENQUEUE_FAIR.prepare_invoke();
    inv.key(&keys.queue).key(&keys.waiting).key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.arg(ticket)
        .arg(inbox)
        .arg(max_wait_us)
        .arg(idle_ms)
        .arg(bucket.rate)
        .arg(bucket.burst)
        .arg(fair.share())
        .arg(keys.base());
    inv
}

/// `throttle_done.lua`
pub fn throttle_done<'a>(
    keys: &ThrottleKeys,
    user: &str,
    ticket: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_DONE.prepare_invoke();
    inv.key(&keys.queue).key(&keys.waiting);
    fair_keys(&mut inv, keys);
    inv.arg(user).arg(ticket).arg(keys.base());
    inv
}

/// How many tickets of a queue `throttle_position.lua` looks at, at most.
pub const POSITION_SCAN: u32 = 10_000;

/// `throttle_position.lua`; `user`: the fair queue to look in, `None` for a
/// FIFO provider's one queue.
pub fn throttle_position<'a>(
    keys: &ThrottleKeys,
    request_id: &str,
    user: Option<&str>,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_POSITION.prepare_invoke();
    inv.key(&keys.queue).key(&keys.waiting);
    fair_keys(&mut inv, keys);
    inv.key(&keys.lists);
    inv.arg(request_id);
    match user {
        Some(user) => inv.arg("fair").arg(user),
        None => inv.arg("fifo").arg(""),
    };
    inv.arg(keys.base()).arg(POSITION_SCAN);
    inv
}

/// The members of a queue that pop ids into processing lists of their own
/// (workers of an operation's job queue, throttlers of a provider's ticket
/// queue): the keys `liveness_heartbeat.lua` and `liveness_reclaim.lua` use.
#[derive(Debug, Clone, Copy)]
pub struct Members<'k> {
    /// Hash: member id -> end of its liveness (ms).
    pub members: &'k str,
    /// Set: every member id that may have a processing list.
    pub lists: &'k str,
    pub queue: &'k str,
    /// The queue's head: where the next id is popped from.
    pub head: Head,
}

/// The end of a queue its ids are popped from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    Left,
    Right,
}

pub static LIVENESS_HEARTBEAT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/liveness_heartbeat.lua")));
pub static LIVENESS_RECLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/liveness_reclaim.lua")));

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

fn job_script(body: &str) -> Script {
    Script::new(&format!("{JOB_LIB}\n{body}"))
}

macro_rules! job_scripts {
    ($($name:ident => $file:literal),* $(,)?) => {
        $(pub static $name: LazyLock<Script> =
            LazyLock::new(|| job_script(include_str!(concat!("../../../lua/", $file))));)*
    };
}

job_scripts! {
    JOB_ENQUEUE => "job_enqueue.lua",
    JOB_LEASE => "job_lease.lua",
    JOB_RENEW => "job_renew.lua",
    JOB_STARTED => "job_started.lua",
    JOB_COMPLETE => "job_complete.lua",
    JOB_FAIL => "job_fail.lua",
    JOB_REFUNDED => "job_refunded.lua",
    JOB_HAND_BACK => "job_hand_back.lua",
    JOB_DUE => "job_due.lua",
    JOB_REQUEUE => "job_requeue.lua",
    JOB_UNSTICK => "job_unstick.lua",
    JOB_FORGET => "job_forget.lua",
}

/// Every script, by the name of its file in `lua/`: what the cluster audit
/// checks ran on the suite's Redis Cluster (`tollgate-bench cluster-audit`).
pub fn all() -> Vec<(&'static str, &'static Script)> {
    vec![
        ("reserve.lua", &RESERVE),
        ("refund.lua", &REFUND),
        ("settle.lua", &SETTLE),
        ("usage.lua", &USAGE),
        ("charge.lua", &CHARGE),
        ("claim.lua", &CLAIM),
        ("release.lua", &RELEASE),
        ("throttle_enqueue.lua", &THROTTLE_ENQUEUE),
        ("throttle_enqueue_fair.lua", &THROTTLE_ENQUEUE_FAIR),
        ("throttle_done.lua", &THROTTLE_DONE),
        ("throttle_position.lua", &THROTTLE_POSITION),
        ("throttle_grant.lua", &THROTTLE_GRANT),
        ("throttle_cancel.lua", &THROTTLE_CANCEL),
        ("liveness_heartbeat.lua", &LIVENESS_HEARTBEAT),
        ("liveness_reclaim.lua", &LIVENESS_RECLAIM),
        ("job_enqueue.lua", &JOB_ENQUEUE),
        ("job_lease.lua", &JOB_LEASE),
        ("job_renew.lua", &JOB_RENEW),
        ("job_started.lua", &JOB_STARTED),
        ("job_complete.lua", &JOB_COMPLETE),
        ("job_fail.lua", &JOB_FAIL),
        ("job_refunded.lua", &JOB_REFUNDED),
        ("job_hand_back.lua", &JOB_HAND_BACK),
        ("job_due.lua", &JOB_DUE),
        ("job_requeue.lua", &JOB_REQUEUE),
        ("job_unstick.lua", &JOB_UNSTICK),
        ("job_forget.lua", &JOB_FORGET),
        ("activity_record.lua", &ACTIVITY_RECORD),
        ("activity_read.lua", &ACTIVITY_READ),
    ]
}

/// `job_enqueue.lua`: creates `job` (queued) unless it exists.
pub fn job_enqueue<'a>(
    keys: &JobKeys,
    job: &tollgate_core::job::Job,
    input: &str,
    create: bool,
    stored: Stored,
) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_ENQUEUE.prepare_invoke();
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
        .arg(stored.limit);
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
pub fn job_lease<'a>(
    keys: &JobKeys,
    a: LeaseArgs<'_>,
    channel: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_LEASE.prepare_invoke();
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
pub fn job_renew<'a>(
    keys: &JobKeys,
    id: &str,
    token: u64,
    lease_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_RENEW.prepare_invoke();
    inv.key(keys.job(id)).key(&keys.leases);
    inv.arg(id).arg(token).arg(lease_ms);
    inv
}

/// `job_started.lua`
pub fn job_started<'a>(keys: &JobKeys, id: &str, token: u64) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_STARTED.prepare_invoke();
    inv.key(keys.job(id));
    inv.arg(token);
    inv
}

/// How long a finished record stays readable, and its stored-bytes bucket width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    pub ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_complete.lua`
pub fn job_complete<'a>(
    keys: &JobKeys,
    id: &str,
    worker: &str,
    token: u64,
    result: &str,
    kept: Kept,
    channel: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_COMPLETE.prepare_invoke();
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.leases);
    inv.arg(id)
        .arg(token)
        .arg(result)
        .arg(kept.ttl_ms)
        .arg(channel)
        .arg(keys.stored_prefix())
        .arg(kept.width_ms);
    inv
}

/// `job_forget.lua`: 1 deleted (a final record of `user` owing nothing), 0 left alone.
pub fn job_forget<'a>(
    keys: &JobKeys,
    id: &str,
    user: &str,
    nonce: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_FORGET.prepare_invoke();
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
pub fn job_fail<'a>(keys: &JobKeys, a: FailArgs<'_>, channel: &str) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_FAIL.prepare_invoke();
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
pub fn job_refunded<'a>(keys: &JobKeys, id: &str, ttl_ms: u64) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_REFUNDED.prepare_invoke();
    inv.key(keys.job(id)).key(&keys.refunds);
    inv.arg(id).arg(ttl_ms);
    inv
}

/// `job_hand_back.lua`
pub fn job_hand_back<'a>(
    keys: &JobKeys,
    id: &str,
    worker: &str,
    token: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_HAND_BACK.prepare_invoke();
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.leases)
        .key(&keys.queue);
    inv.arg(id).arg(token);
    inv
}

/// `job_due.lua` on one of the time-scored sets of `keys`.
pub fn job_due<'a>(set: &str, age_ms: u64, limit: u32) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_DUE.prepare_invoke();
    inv.key(set).arg(age_ms).arg(limit);
    inv
}

/// `job_requeue.lua`
pub fn job_requeue<'a>(keys: &JobKeys, id: &str, worker: &str) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_REQUEUE.prepare_invoke();
    inv.key(keys.job(id))
        .key(&keys.leases)
        .key(&keys.queue)
        .key(keys.processing(worker));
    inv.arg(id);
    inv
}

/// `job_unstick.lua`: 1 requeued, 0 dropped as stale, -1 left alone.
pub fn job_unstick<'a>(keys: &JobKeys, id: &str, worker: &str) -> redis::ScriptInvocation<'a> {
    let mut inv = JOB_UNSTICK.prepare_invoke();
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.queue);
    inv.arg(id);
    inv
}

pub static ACTIVITY_RECORD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/activity_record.lua")));
pub static ACTIVITY_READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/activity_read.lua")));

fn activity_keys(inv: &mut redis::ScriptInvocation<'_>, keys: &ActivityKeys, providers: &[String]) {
    inv.key(&keys.events).key(&keys.refunded).key(&keys.grants);
    for p in providers {
        inv.key(keys.waits(p));
    }
}

/// The caps of the activity log (`activity_record.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivityCaps {
    pub events: usize,
    pub waits: usize,
    pub idle_ms: u64,
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
    activity_keys(&mut inv, keys, providers);
    inv.arg(caps.events).arg(caps.waits).arg(caps.idle_ms);
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
    inv.arg(limit);
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
        listed.sort();
        assert_eq!(files, listed, "lua/*.lua and scripts::all() differ");
    }
}
