//! The Lua scripts of `lua/`, embedded at build time, and typed wrappers that own
//! each script's KEYS/ARGV order.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
//! loads the script and retries: each script is loaded once per server, then called
//! by its SHA.

use std::sync::LazyLock;

use redis::Script;

use crate::keys::{BudgetKeys, ThrottleKeys};

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

/// The plan table the budget scripts read from their ARGV tail: `name, limit,
/// window_ms` triples, the default plan first. Built once per config.
#[derive(Debug, Clone)]
pub struct PlanArgs(Vec<String>);

impl PlanArgs {
    pub fn new(config: &tollgate_core::Config) -> Self {
        let default = config.default_plan();
        let rest = config.plans().filter(|p| p.name != default.name);
        let args = std::iter::once(default)
            .chain(rest)
            .flat_map(|p| {
                [
                    p.name.clone(),
                    p.limit.to_string(),
                    p.window_ms().to_string(),
                ]
            })
            .collect();
        Self(args)
    }
}

fn invocation<'a>(script: &'a Script, keys: &BudgetKeys) -> redis::ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(&keys.events).key(&keys.costs).key(&keys.plan);
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

/// `refund.lua`
pub fn refund<'a>(
    keys: &BudgetKeys,
    request: &str,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&REFUND, keys);
    inv.arg(request).arg(&plans.0);
    inv
}

/// `settle.lua`
pub fn settle<'a>(
    keys: &BudgetKeys,
    request: &str,
    actual_cost: u64,
    plans: &PlanArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&SETTLE, keys);
    inv.arg(request).arg(actual_cost).arg(&plans.0);
    inv
}

/// `usage.lua`
pub fn usage<'a>(keys: &BudgetKeys, plans: &PlanArgs) -> redis::ScriptInvocation<'a> {
    let mut inv = invocation(&USAGE, keys);
    inv.arg(&plans.0);
    inv
}

const BUCKET_LIB: &str = include_str!("../../../lua/lib/bucket.lua");

fn bucket_script(body: &str) -> Script {
    Script::new(&format!("{BUCKET_LIB}\n{body}"))
}

pub static THROTTLE_ENQUEUE: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_enqueue.lua")));
pub static THROTTLE_GRANT: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_grant.lua")));
pub static THROTTLE_CANCEL: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_cancel.lua")));
pub static THROTTLE_HEARTBEAT: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_heartbeat.lua")));
pub static THROTTLE_RECLAIM: LazyLock<Script> =
    LazyLock::new(|| bucket_script(include_str!("../../../lua/throttle_reclaim.lua")));

/// A provider's bucket parameters as the throttle scripts read them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketArgs {
    pub rate: f64,
    pub burst: u64,
}

impl From<&tollgate_core::Provider> for BucketArgs {
    fn from(p: &tollgate_core::Provider) -> Self {
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
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_ENQUEUE.prepare_invoke();
    inv.key(&keys.queue).key(&keys.waiting);
    inv.arg(ticket).arg(inbox).arg(max_wait_us).arg(idle_ms);
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
    inv.arg(bucket.rate)
        .arg(bucket.burst)
        .arg(limit)
        .arg(ready_ttl_us)
        .arg(idle_ms);
    inv
}

/// `throttle_cancel.lua`
pub fn throttle_cancel<'a>(
    keys: &ThrottleKeys,
    ticket: &str,
    bucket: BucketArgs,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_CANCEL.prepare_invoke();
    inv.key(&keys.queue)
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    inv.arg(ticket).arg(bucket.rate).arg(bucket.burst);
    inv
}

/// `throttle_heartbeat.lua`
pub fn throttle_heartbeat<'a>(
    keys: &ThrottleKeys,
    throttler: &str,
    lease_us: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_HEARTBEAT.prepare_invoke();
    inv.key(&keys.throttlers);
    inv.arg(throttler).arg(lease_us);
    inv
}

/// `throttle_reclaim.lua`
pub fn throttle_reclaim<'a>(
    keys: &ThrottleKeys,
    throttler: &str,
    force: bool,
) -> redis::ScriptInvocation<'a> {
    let mut inv = THROTTLE_RECLAIM.prepare_invoke();
    inv.key(&keys.throttlers)
        .key(keys.processing(throttler))
        .key(&keys.queue);
    inv.arg(throttler).arg(if force { "1" } else { "0" });
    inv
}
