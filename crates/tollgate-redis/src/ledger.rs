//! The Redis ledger: each operation is one script call (see `lua/`), on a pooled
//! multiplexed connection, bounded by a timeout so a stalled Redis fails closed.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::{FromRedisValue, Value};
use tollgate_core::config::{Limit, Plan};
use tollgate_core::ledger::{
    check_custom_limits, split_audit_op, unknown_plan, validate_cost, CUSTOM_PLAN,
};
use tollgate_core::{
    config::{Config, MAX_LIMITS},
    error::StoreError,
    id::{RequestId, UserId},
    ledger::{
        Allowed, ChangeKind, ChargeOutcome, ChargeRequest, ClaimOutcome, Denied, EventCursor,
        EventPage, ExportEntry, Ledger, LedgerError, RefundOutcome, ReserveOutcome, SettleOutcome,
        SpendEvent, Usage, WindowUse,
    },
};

use crate::call::{self, bad_reply};
use crate::keys::KeySpace;
use crate::pool::{Pool, DEFAULT_TIMEOUT};
use crate::scripts::{self, PlanArgs};

/// The distributed budget ledger.
pub struct RedisLedger {
    pool: Pool,
    keys: KeySpace,
    config: Arc<Config>,
    plans: PlanArgs,
    timeout: Duration,
}

impl std::fmt::Debug for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLedger")
            .field("prefix", &self.keys.prefix())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The errors a budget script answers when it kept its progress and must be
/// called again: it moved a batch of a user's events from the previous key
/// layout, or read its slice of the log before every window reached now
/// (`lib/budget.lua`'s `expire`). How many such calls a request makes at most
/// (each moves 250 events or reads 100: 10 million).
const MIGRATING: &str = "TOLLGATE_MIGRATING";
const AGAIN: &str = "TOLLGATE_AGAIN";
const AGAIN_CALLS: usize = 100_000;

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl RedisLedger {
    pub fn new(pool: Pool, keys: KeySpace, config: Arc<Config>) -> Self {
        let plans = PlanArgs::new(&config);
        Self {
            pool,
            keys,
            config,
            plans,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Bounds every call (waiting for a connection included) by `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// One budget script. No call reads more than a slice of the user's log:
    /// one that would (a user still in the previous key layout, a whole log
    /// leaving the window at once, a window's total being rebuilt) keeps its
    /// progress and answers `TOLLGATE_MIGRATING` or `TOLLGATE_AGAIN`, and is
    /// called again, so other users' calls run in between.
    async fn script<T: FromRedisValue>(
        &self,
        op: &'static str,
        inv: scripts::FunctionCall,
    ) -> Result<T, LedgerError> {
        let mut calls = 0;
        let v: Value = loop {
            match call::function(&self.pool, self.timeout, op, &inv).await {
                Err(e) if calls < AGAIN_CALLS && is_again(&e) => calls += 1,
                r => break r?,
            }
        };
        let v = match v {
            Value::Array(mut parts)
                if parts.len() == 3 && text(&parts[0]).as_deref() == Some(scripts::ALERT_MARK) =>
            {
                let reply = parts.pop().unwrap_or(Value::Nil);
                if let Some(pointer) = text(&parts[1]) {
                    self.point(pointer);
                }
                reply
            }
            v => v,
        };
        T::from_redis_value(v).map_err(|e| bad_reply(op, e))
    }

    /// Adds a subject's outbox pointer to the alerts' due set, due at once:
    /// at minus this pod's clock (ms; negative marks a budget step's pointer,
    /// see `lua/alert_point.lua`; `ZADD LT` lowers a deliverer's time),
    /// in the background: the budget step is done, its answer waits for
    /// nothing. A pointer lost here (the process dies first, Redis fails) is
    /// added again by a later budget step of the subject (`repoint` in
    /// `lua/lib/budget.lua`).
    fn point(&self, pointer: String) {
        let pool = self.pool.clone();
        let timeout = self.timeout;
        let mut cmd = redis::cmd("ZADD");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| {
                i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
            });
        cmd.arg(self.keys.alert_due())
            .arg("LT")
            .arg(-now)
            .arg(&pointer);
        tokio::spawn(async move {
            if let Err(e) = call::command::<i64>(&pool, timeout, "alert_point", &cmd).await {
                tracing::warn!(
                    pointer,
                    error = %e,
                    "could not add an alert outbox's pointer; the subject's next budget step adds it"
                );
            }
        });
    }

    /// The exact retry_after of each window of a denial: a walk the denial
    /// left unfinished (its slice of the log ran out) goes on with
    /// `retry.lua`, a slice per call.
    async fn retry_after(
        &self,
        user: &UserId,
        windows: &[WindowUse],
        retry: Vec<Retry>,
        now_ms: u64,
    ) -> Result<Vec<u64>, LedgerError> {
        let keys = self.keys.budget(user);
        let mut out = Vec::with_capacity(retry.len());
        for (w, r) in windows.iter().zip(retry) {
            let mut r = r;
            let mut calls = 0;
            let ms = loop {
                match r {
                    Retry::Known(ms) => break ms,
                    // A walk longer than every call allowed: the window is the
                    // most any event can take to leave it.
                    Retry::More(_) if calls >= AGAIN_CALLS => break w.window_ms,
                    Retry::More(more) => {
                        calls += 1;
                        let inv = scripts::retry(&keys, &more, w.window_ms, now_ms);
                        let v: Value = self.script("retry", inv).await?;
                        r = Retry::parse(&v)
                            .ok_or_else(|| bad_reply::<LedgerError>("retry", &v))?;
                    }
                }
            };
            out.push(ms);
        }
        Ok(out)
    }

    async fn command<T: FromRedisValue>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T, LedgerError> {
        Ok(call::command(&self.pool, self.timeout, op, &cmd).await?)
    }
}

impl RedisLedger {
    /// `settle.lua`: any event (`nonce` empty) or the charge held under `nonce`.
    async fn settle_with(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
        actual_cost: u64,
        may_raise: bool,
    ) -> Result<SettleOutcome, LedgerError> {
        let keys = self.keys.budget(user);
        let inv = scripts::settle(
            &keys,
            request.as_str(),
            actual_cost,
            nonce,
            may_raise,
            &self.plans,
        );
        let r: Vec<i64> = self.script("settle", inv).await?;
        match r.as_slice() {
            &[1, previous, cost, used] => Ok(SettleOutcome::Settled {
                previous_cost: to_u64(previous),
                cost: to_u64(cost),
                used: to_u64(used),
            }),
            &[0, used] => Ok(SettleOutcome::NotFound { used: to_u64(used) }),
            other => Err(bad_reply("settle", other)),
        }
    }
}

#[async_trait]
impl Ledger for RedisLedger {
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError> {
        validate_cost(cost)?;
        let keys = self.keys.budget(user);
        let r: Vec<Value> = self
            .script(
                "reserve",
                scripts::reserve(&keys, request.as_str(), cost, &self.plans),
            )
            .await?;
        let bad = || bad_reply::<LedgerError>("reserve", &r);
        let n = |i: usize| r.get(i).and_then(int).ok_or_else(bad);
        match r.first().and_then(signed) {
            Some(s @ (1 | 2)) => {
                let (windows, _) = windows("reserve", &r, 3)?;
                Ok(ReserveOutcome::Allowed(Allowed::new(
                    windows,
                    n(1)?,
                    n(2)?,
                    s == 2,
                )))
            }
            Some(0) => {
                let (windows, retry) = windows("reserve", &r, 3)?;
                let now = n(2)?;
                let retry = self.retry_after(user, &windows, retry, now).await?;
                Ok(ReserveOutcome::Denied(Denied::new(windows, &retry, now)))
            }
            Some(-1) => Err(LedgerError::CostExceedsLimit { cost, limit: n(1)? }),
            _ => Err(bad()),
        }
    }

    async fn refund_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        finished: Option<&str>,
    ) -> Result<RefundOutcome, LedgerError> {
        let keys = self.keys.budget(user);
        let inv = scripts::refund(&keys, request.as_str(), finished.unwrap_or(""), &self.plans);
        let r: Vec<i64> = self.script("refund", inv).await?;
        match *r.as_slice() {
            [2, cost, used] => Ok(RefundOutcome::Cancelled {
                cost: to_u64(cost),
                used: to_u64(used),
            }),
            [3, used] => Ok(RefundOutcome::Running { used: to_u64(used) }),
            _ => refund_outcome("refund", &r),
        }
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
        self.settle_with(user, request, "", actual_cost, true).await
    }

    async fn settle_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
        actual_cost: u64,
        may_raise: bool,
    ) -> Result<SettleOutcome, LedgerError> {
        validate_cost(actual_cost)?;
        self.settle_with(user, request, nonce, actual_cost, may_raise)
            .await
    }

    async fn usage_page(&self, user: &UserId, page: EventPage) -> Result<Usage, LedgerError> {
        let keys = self.keys.budget(user);
        let reply: Vec<Value> = self
            .script("usage", scripts::usage(&keys, page, &self.plans))
            .await?;
        parse_usage(reply)
    }

    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError> {
        let cost = charge.cost;
        validate_cost(cost)?;
        let keys = self.keys.budget(user);
        let r: Vec<Value> = self
            .script(
                call::CHARGE,
                scripts::charge(&keys, request.as_str(), charge, &self.plans),
            )
            .await?;
        let bad = || bad_reply::<LedgerError>("charge", &r);
        let n = |i: usize| r.get(i).and_then(int).ok_or_else(bad);
        match r.first().and_then(signed) {
            Some(1) => Ok(ChargeOutcome::Charged {
                allowed: Allowed::new(windows("charge", &r, 3)?.0, n(1)?, n(1)?, false),
                deadline_ms: n(2)?,
            }),
            Some(2) => Ok(ChargeOutcome::Existing {
                allowed: Allowed::new(windows("charge", &r, 6)?.0, n(3)?, n(1)?, true),
                deadline_ms: n(2)?,
                nonce: r.get(4).and_then(text).ok_or_else(bad)?,
                claimed: r.get(5).and_then(text).as_deref() == Some("j"),
            }),
            Some(0) => {
                let (windows, retry) = windows("charge", &r, 2)?;
                let now = n(1)?;
                let retry = self.retry_after(user, &windows, retry, now).await?;
                Ok(ChargeOutcome::Denied(Denied::new(windows, &retry, now)))
            }
            Some(3) => Ok(ChargeOutcome::Conflict {
                operation: r
                    .get(1)
                    .and_then(text)
                    .map(|op| split_audit_op(&op).0.to_owned()),
            }),
            Some(4) => Ok(ChargeOutcome::Conflict { operation: None }),
            Some(-1) => Err(LedgerError::CostExceedsLimit { cost, limit: n(1)? }),
            _ => Err(bad()),
        }
    }

    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
        hold_until_ms: u64,
    ) -> Result<ClaimOutcome, LedgerError> {
        let keys = self.keys.budget(user);
        let r: i64 = self
            .script(
                "claim",
                scripts::claim(&keys, request.as_str(), nonce, hold_until_ms, &self.plans),
            )
            .await?;
        Ok(match r {
            1 => ClaimOutcome::Claimed,
            2 => ClaimOutcome::Cancelled,
            _ => ClaimOutcome::Refused,
        })
    }

    async fn release(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
    ) -> Result<RefundOutcome, LedgerError> {
        let keys = self.keys.budget(user);
        let r: Vec<i64> = self
            .script(
                "release",
                scripts::release(&keys, request.as_str(), nonce, &self.plans),
            )
            .await?;
        refund_outcome("release", &r)
    }

    async fn exported(
        &self,
        user: &UserId,
        since_ms: u64,
        count: usize,
    ) -> Result<Vec<ExportEntry>, LedgerError> {
        let mut cmd = redis::cmd("XRANGE");
        cmd.arg(self.keys.budget(user).audit)
            .arg(since_ms)
            .arg("+")
            .arg("COUNT")
            .arg(count.max(1));
        let reply: Vec<Value> = self.command("exported", cmd).await?;
        reply.iter().map(parse_export).collect()
    }

    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError> {
        if self.config.plan(plan).is_none() {
            return Err(unknown_plan(&self.config, plan));
        }
        // The plan and the end of limits of the user's own, in one step.
        let inv = scripts::plan_set(&self.keys.budget(user), plan);
        let _: i64 = call::script(&self.pool, self.timeout, "set_plan", &inv).await?;
        Ok(())
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.budget(user).plan);
        let stored: Option<String> = self.command("plan", cmd).await?;
        Ok(self.config.plan_or_default(stored.as_deref()).name.clone())
    }

    async fn set_limits(&self, user: &UserId, limits: &[Limit]) -> Result<(), LedgerError> {
        check_custom_limits(limits)?;
        let plan = Plan {
            name: CUSTOM_PLAN.to_owned(),
            limits: limits.to_vec(),
            ..self.config.default_plan().clone()
        };
        // One SET: the budget scripts read it with the plan (`resolve_plan`).
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.keys.budget(user).limits())
            .arg(PlanArgs::limits(&plan));
        self.command("set_limits", cmd).await
    }

    async fn clear_limits(&self, user: &UserId) -> Result<bool, LedgerError> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.keys.budget(user).limits());
        let removed: i64 = self.command("clear_limits", cmd).await?;
        Ok(removed > 0)
    }

    async fn custom_limits(&self, user: &UserId) -> Result<Option<Vec<Limit>>, LedgerError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.budget(user).limits());
        let stored: Option<String> = self.command("custom_limits", cmd).await?;
        stored
            .map(|spec| parse_spec(&spec).ok_or_else(|| bad_reply("custom_limits", spec)))
            .transpose()
    }
}

/// Limits in the plan table's `limit:window_ms,...` form ([`PlanArgs::limits`]).
fn parse_spec(spec: &str) -> Option<Vec<Limit>> {
    spec.split(',')
        .map(|part| {
            let (limit, window) = part.split_once(':')?;
            Some(Limit {
                limit: limit.parse().ok()?,
                window: Duration::from_millis(window.parse().ok()?),
            })
        })
        .collect::<Option<Vec<_>>>()
        .filter(|l| !l.is_empty())
}

fn refund_outcome(what: &str, r: &[i64]) -> Result<RefundOutcome, LedgerError> {
    match *r {
        [1, cost, used] => Ok(RefundOutcome::Refunded {
            cost: to_u64(cost),
            used: to_u64(used),
        }),
        [0, used] => Ok(RefundOutcome::NotFound { used: to_u64(used) }),
        _ => Err(bad_reply(what, r)),
    }
}

fn signed(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

fn int(v: &Value) -> Option<u64> {
    signed(v).and_then(|i| u64::try_from(i).ok())
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// One XRANGE entry of the export stream: `[id, [field, value, ...]]` (the
/// fields of lib/budget.lua's `export`).
pub fn parse_export(v: &Value) -> Result<ExportEntry, LedgerError> {
    let bad = || bad_reply::<LedgerError>("exported", v);
    let Value::Array(parts) = v else {
        return Err(bad());
    };
    let [id, Value::Array(fields)] = parts.as_slice() else {
        return Err(bad());
    };
    let id = text(id).ok_or_else(bad)?;
    let mut f = std::collections::HashMap::new();
    for pair in fields.chunks_exact(2) {
        f.insert(
            text(&pair[0]).ok_or_else(bad)?,
            text(&pair[1]).ok_or_else(bad)?,
        );
    }
    let num = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok());
    let kind = match f.get("kind").map(String::as_str) {
        Some("spend") => ChangeKind::Spend,
        Some("refund") => ChangeKind::Refund,
        Some("settle") => ChangeKind::Settle,
        _ => return Err(bad()),
    };
    let request_id = f
        .get("id")
        .and_then(|r| RequestId::new(r.clone()).ok())
        .ok_or_else(bad)?;
    let op = f.get("op").filter(|o| !o.is_empty());
    let (operation, service_key) = match op {
        Some(op) => {
            let (operation, kid) = split_audit_op(op);
            (Some(operation.to_owned()), kid.map(str::to_owned))
        }
        None => (None, None),
    };
    Ok(ExportEntry {
        id,
        kind,
        request_id,
        cost: num("cost").ok_or_else(bad)?,
        previous_cost: (kind == ChangeKind::Settle).then(|| num("prev")).flatten(),
        spent_at_ms: num("at").ok_or_else(bad)?,
        operation,
        service_key,
    })
}

/// Fields per window in a budget script's reply (`push_windows` in lib/budget.lua).
const WINDOW_FIELDS: usize = 5;

/// Whether a budget script kept its progress and asks to be called again:
/// its error reply's code (the first word, `error({ err = 'CODE ...' })` in
/// Lua), read from the Redis error the store error keeps as its source.
fn is_again(e: &StoreError) -> bool {
    let code = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<redis::RedisError>())
        .and_then(redis::RedisError::code);
    matches!(code, Some(AGAIN | MIGRATING))
}

/// A window's retry_after in a denial: known (ms; 0 when the cost fits), or
/// where the walk toward it stopped ('more <bound> <freed> <need>').
#[derive(Debug, Clone, PartialEq, Eq)]
enum Retry {
    Known(u64),
    More(String),
}

impl Retry {
    fn parse(v: &Value) -> Option<Self> {
        match v {
            Value::BulkString(b) if b.starts_with(b"more ") => {
                String::from_utf8(b.clone()).ok().map(Self::More)
            }
            other => int(other).map(Self::Known),
        }
    }
}

/// Reads the windows of a reply from `at` (their count, then five fields each):
/// every limit as it stands, and the retry_after of each (0 when it fits).
fn windows(
    what: &str,
    r: &[Value],
    at: usize,
) -> Result<(Vec<WindowUse>, Vec<Retry>), LedgerError> {
    let count = r
        .get(at)
        .and_then(int)
        .and_then(|c| usize::try_from(c).ok())
        .filter(|&c| c <= MAX_LIMITS && r.len() >= at + 1 + c * WINDOW_FIELDS)
        .ok_or_else(|| bad_reply::<LedgerError>(what, r))?;
    let fields = &r[at + 1..at + 1 + count * WINDOW_FIELDS];
    let mut windows = Vec::with_capacity(count);
    let mut retry = Vec::with_capacity(count);
    for w in fields.chunks_exact(WINDOW_FIELDS) {
        let n = |i: usize| int(&w[i]).ok_or_else(|| bad_reply::<LedgerError>(what, w));
        let reset = signed(&w[3]).and_then(|v| u64::try_from(v).ok());
        windows.push(WindowUse::new(n(1)?, n(2)?, n(0)?, reset));
        retry.push(Retry::parse(&w[4]).ok_or_else(|| bad_reply::<LedgerError>(what, w))?);
    }
    Ok((windows, retry))
}

fn parse_usage(reply: Vec<Value>) -> Result<Usage, LedgerError> {
    fn int(v: &Value) -> Result<u64, LedgerError> {
        match v {
            Value::Int(i) => Ok(to_u64(*i)),
            other => Err(bad_reply("usage", other)),
        }
    }
    fn text(v: &Value) -> Result<String, LedgerError> {
        match v {
            Value::BulkString(b) => String::from_utf8(b.clone()).map_err(|_| bad_reply("usage", v)),
            Value::SimpleString(s) => Ok(s.clone()),
            other => Err(bad_reply("usage", other)),
        }
    }
    let (windows, _) = windows("usage", &reply, 2)?;
    let head = 3 + windows.len() * WINDOW_FIELDS;
    let next = text(
        reply
            .get(head)
            .ok_or_else(|| bad_reply::<LedgerError>("usage", "no next_cursor"))?,
    )?;
    let next_cursor = match next.as_str() {
        "" => None,
        id => Some(
            id.parse::<EventCursor>()
                .map_err(|e| bad_reply::<LedgerError>("usage", e))?,
        ),
    };
    let head = head + 1;
    if !(reply.len() - head).is_multiple_of(5) {
        return Err(bad_reply("usage", format!("{} elements", reply.len())));
    }
    let events = reply[head..]
        .chunks_exact(5)
        .map(|e| {
            let op = text(&e[3])?;
            let (operation, service_key) = split_audit_op(&op);
            Ok(SpendEvent {
                request_id: RequestId::new(text(&e[0])?)
                    .map_err(|err| bad_reply::<LedgerError>("usage", err))?,
                at_ms: int(&e[1])?,
                cost: int(&e[2])?,
                operation: (!operation.is_empty()).then(|| operation.to_owned()),
                service_key: service_key.map(str::to_owned),
                estimate: signed(&e[4]).and_then(|v| u64::try_from(v).ok()),
            })
        })
        .collect::<Result<_, LedgerError>>()?;
    let plan = text(
        reply
            .first()
            .ok_or_else(|| bad_reply::<LedgerError>("usage", "empty"))?,
    )?;
    // `lib/budget.lua` names the plan of a user with limits of its own
    // `custom:<plan>` (no plan name has a ':').
    let custom = plan.starts_with("custom:");
    let usage = Usage::new(plan, windows, int(&reply[1])?, events, next_cursor);
    Ok(if custom {
        usage.with_custom_limits()
    } else {
        usage
    })
}
