//! The Lua scripts of `lua/`, embedded at build time, and typed wrappers that own
//! each script's KEYS/ARGV order.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
//! loads the script and retries: each script is loaded once per server, then called
//! by its SHA.

use std::sync::LazyLock;

use redis::Script;

use crate::keys::BudgetKeys;

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
