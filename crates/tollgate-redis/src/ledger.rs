//! The Redis ledger: each operation is one script call (see `lua/`), on a pooled
//! multiplexed connection, bounded by a timeout so a stalled Redis fails closed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::{FromRedisValue, Value};
use tollgate_core::config::{Limit, Plan};
use tollgate_core::error::StoreError;
use tollgate_core::ledger::{
    check_custom_limits, split_audit_op, unknown_plan, validate_cost, CUSTOM_PLAN,
};
use tollgate_core::{
    config::{Config, MAX_LIMITS},
    id::{OrgId, RequestId, UserId},
    ledger::{
        Allowed, ChangeKind, ChargeOutcome, ChargeRequest, ClaimOutcome, ClaimRequest, Denied,
        EventCursor, EventPage, ExportEntry, Ledger, LedgerError, Moved, OperatorSettleOutcome,
        OrgList, OrgUsage, OrgWindows, RefundOutcome, ReserveOutcome, SettleOutcome, SettleRequest,
        SpendEvent, Usage, WindowUse,
    },
};

use tollgate_core::spend::{Bucket, Dims, Step};

use crate::call::{self, bad_reply};
use crate::keys::{BudgetKeys, KeySpace, Location};
use crate::pool::{Pool, DEFAULT_TIMEOUT};
use crate::scripts::reply::{int, signed, text};
use crate::scripts::{self, PlanArgs};

/// The distributed budget ledger.
pub struct RedisLedger {
    pool: Pool,
    keys: KeySpace,
    config: Arc<Config>,
    plans: PlanArgs,
    timeout: Duration,
    /// Where each user's budget lives (its organisation, or `None`), as last
    /// read from its pointer: a script at a location the user left answers
    /// TOLLGATE_MOVED and the pointer is read again, so a stale entry costs
    /// one more round trip, never a write in the wrong place.
    homes: Mutex<HashMap<UserId, Option<OrgId>>>,
}

/// Users whose location a process keeps (then it starts over).
const HOMES: usize = 100_000;
/// The errors of a budget script at a location the user left, or one a move
/// froze; how long a call waits for a move (polls of MOVING_POLL) before it
/// answers 503.
const MOVED: &str = "TOLLGATE_MOVED";
const MOVING: &str = "TOLLGATE_MOVING";
const MOVING_POLL: Duration = Duration::from_millis(25);
const MOVING_POLLS: usize = 200;
/// Fields one `HSCAN` step of a spend rollup reads.
const SPEND_SCAN: usize = 500;
/// Log entries a move reads per batch.
const MOVE_BATCH: usize = 50;
/// How `budget/lib/plan.lua` (`resolve_plan`) names the plan of a user with limits
/// of its own: this, then the named plan (no plan name has a ':').
const CUSTOM_PREFIX: &str = "custom:";

impl std::fmt::Debug for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLedger")
            .field("prefix", &self.keys.prefix())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The error a budget script answers when it kept its progress and must be
/// called again: it read its slice of the log before every window reached now
/// (`budget/lib/expire.lua`'s `expire`). How many such calls a request makes at most
/// (each reads 100 entries: 10 million).
const AGAIN: &str = "TOLLGATE_AGAIN";
const AGAIN_CALLS: usize = 100_000;
/// The error of a budget script whose period boundaries do not hold Redis's
/// clock, and how many times a call computes them again before it fails.
const PERIOD: &str = "TOLLGATE_PERIOD";
const PERIOD_TRIES: usize = 2;

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
            homes: Mutex::new(HashMap::new()),
        }
    }

    fn cached_home(&self, user: &UserId) -> Option<Option<OrgId>> {
        let homes = self.homes.lock().unwrap_or_else(|e| e.into_inner());
        homes.get(user).cloned()
    }

    fn cache_home(&self, user: &UserId, org: Option<OrgId>) {
        let mut homes = self.homes.lock().unwrap_or_else(|e| e.into_inner());
        if homes.len() >= HOMES {
            homes.clear();
        }
        homes.insert(user.clone(), org);
    }

    /// The organisation `user` lives in, from its pointer (`{u:<user>}:at`).
    async fn read_home(&self, user: &UserId) -> Result<Option<OrgId>, LedgerError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.budget(user).at());
        let at: Option<String> = self.command("user_org", cmd).await?;
        let org = at
            .as_deref()
            .and_then(|a| a.strip_prefix("o:"))
            .and_then(|o| OrgId::new(o).ok());
        self.cache_home(user, org.clone());
        Ok(org)
    }

    async fn home(&self, user: &UserId) -> Result<Option<OrgId>, LedgerError> {
        match self.cached_home(user) {
            Some(org) => Ok(org),
            None => self.read_home(user).await,
        }
    }

    /// One budget script at `user`'s location: `make` builds the call for
    /// it. A location the user left answers TOLLGATE_MOVED (the pointer is
    /// read again and the call made there); one a move froze, TOLLGATE_MOVING
    /// (the call waits, up to MOVING_POLLS polls, then fails as unavailable:
    /// 503, retry).
    async fn at_home<T: FromRedisValue>(
        &self,
        op: &'static str,
        user: &UserId,
        make: impl Fn(&Location) -> scripts::FunctionCall,
    ) -> Result<(T, Location, Option<OrgId>), LedgerError> {
        let mut org = self.home(user).await?;
        let mut polls = 0;
        let mut periods = 0;
        loop {
            let loc = self.keys.location(user, org.as_ref());
            match self.script::<T>(op, make(&loc)).await {
                Ok(v) => return Ok((v, loc, org)),
                Err(e) if period_clock(&e).is_some() => {
                    periods += 1;
                    self.period_refused(&e, periods)?;
                }
                Err(e) if is_error(&e, MOVED) && polls < MOVING_POLLS => {
                    polls += 1;
                    org = self.read_home(user).await?;
                }
                Err(e) if is_error(&e, MOVING) => {
                    if polls >= MOVING_POLLS {
                        return Err(StoreError::unavailable(
                            "the user is moving between organisations: retry shortly",
                        )
                        .into());
                    }
                    polls += 1;
                    tokio::time::sleep(MOVING_POLL).await;
                    org = self.read_home(user).await?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A script refused the period boundaries passed (`TOLLGATE_PERIOD
    /// <ledger now>`: the ledger's clock is outside them, this pod's clock
    /// being off by more than a period): the next boundaries are computed
    /// around the ledger's clock, once; a second refusal in a row fails as
    /// unavailable (503, retry).
    fn period_refused(&self, e: &LedgerError, tries: usize) -> Result<(), LedgerError> {
        let Some(ledger_ms) = period_clock(e) else {
            return Ok(());
        };
        self.plans.calendars().learn(ledger_ms);
        if tries > PERIOD_TRIES {
            return Err(StoreError::unavailable(
                "the period boundaries computed here do not hold the ledger's clock: retry shortly",
            )
            .into());
        }
        Ok(())
    }

    /// One budget script whose ARGV carries the period boundaries (`make`
    /// builds it anew with the current ones): a refusal of the boundaries
    /// is answered by computing them around the ledger's clock, once.
    async fn planned<T: FromRedisValue>(
        &self,
        op: &'static str,
        make: impl Fn() -> scripts::FunctionCall,
    ) -> Result<T, LedgerError> {
        let mut tries = 0;
        loop {
            match self.script(op, make()).await {
                Err(e) if period_clock(&e).is_some() => {
                    tries += 1;
                    self.period_refused(&e, tries)?;
                }
                r => return r,
            }
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
    /// one that would (a whole log leaving the window at once, a window's
    /// total being rebuilt) keeps its progress and answers `TOLLGATE_AGAIN`, and is
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
                if parts.len() >= 3 && text(&parts[0]).as_deref() == Some(scripts::ALERT_MARK) =>
            {
                let reply = parts.pop().unwrap_or(Value::Nil);
                for pointer in parts[1..].iter().filter_map(text) {
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
    /// see `lua/alerts/alert_point.lua`; `ZADD LT` lowers a deliverer's time),
    /// in the background: the budget step is done, its answer waits for
    /// nothing. A pointer lost here (the process dies first, Redis fails) is
    /// added again by a later budget step of the subject (`repoint` in
    /// `lua/budget/lib/state.lua`).
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
        keys: &crate::keys::BudgetKeys,
        org: bool,
        windows: &[WindowUse],
        retry: Vec<Retry>,
        now_ms: u64,
    ) -> Result<Vec<u64>, LedgerError> {
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
                        let inv = scripts::retry(keys, &more, w.window_ms, now_ms, org);
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

    /// A denial from a reply: the user's windows at `at`, and a member's
    /// organisation's after them; each level's retry_after walked to the end.
    async fn denial(
        &self,
        what: &str,
        r: &[Value],
        at: usize,
        now: u64,
        loc: &Location,
        org: Option<&OrgId>,
    ) -> Result<Denied, LedgerError> {
        let (windows, retry) = windows(what, r, at)?;
        let next = at + 1 + windows.len() * WINDOW_FIELDS;
        let retry = self
            .retry_after(&loc.user, false, &windows, retry, now)
            .await?;
        let user = Denied::new(windows, &retry, now);
        match (org_section(what, r, next)?, org, &loc.org) {
            (Some((plan, windows, retry)), Some(org), Some(keys)) => {
                let retry = self.retry_after(keys, true, &windows, retry, now).await?;
                let org = OrgWindows {
                    org: org.clone(),
                    plan,
                    windows,
                };
                Ok(Denied::member(user, org, &retry))
            }
            _ => Ok(user),
        }
    }

    /// Copies the live events of `user` at `src` to `dst` a batch at a time
    /// (oldest first), then drops them from `src`; returns how many moved.
    /// Each step is idempotent: run again after a crash, it adds nothing twice.
    async fn copy(
        &self,
        user: &UserId,
        src: Option<&OrgId>,
        dst: Option<&OrgId>,
    ) -> Result<u64, LedgerError> {
        let from = self.keys.location(user, src);
        let to = self.keys.location(user, dst);
        let plans = self.plans.without_export();
        // The user's period totals travel whole (the log keeps only a day
        // of the events they count), read once: the location is frozen, and
        // a move's steps leave them as they are.
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(from.user.periods());
        // Totals and eras (some '<total>:<since>:<till>', periods.lua).
        let periods: Vec<(String, String)> = self.command("set_user_org", cmd).await?;
        let mut periods = periods
            .iter()
            .map(|(field, total)| format!("{field}={total}"))
            .collect::<Vec<_>>();
        // The model limits' counters too, spelled so that the periods'
        // reading passes them by: 'm<tag>:<start>_<end>~<total>'
        // (move_in.lua).
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(from.user.model_counts());
        let models: Vec<(String, String)> = self.command("set_user_org", cmd).await?;
        periods.extend(
            models
                .iter()
                .map(|(field, total)| format!("m{}~{total}", field.replace('-', "_"))),
        );
        let periods = periods.join(" ");
        // The spend rollups travel whole too, with the first batch: the
        // events' codes name the dictionary that comes with them.
        let mut rollups = Some(self.rollups_of(&from.user).await?);
        let mut moved = 0;
        loop {
            let b: Vec<Value> = self
                .script("move_out", scripts::move_batch(&from, MOVE_BATCH, &plans))
                .await?;
            let bad = || bad_reply::<LedgerError>("move_out", &b);
            let plan = b.first().and_then(text).ok_or_else(bad)?;
            let plan = format!("{plan}\n{periods}\n{}", rollups.take().unwrap_or_default());
            let cancelled = b.get(1).and_then(text).ok_or_else(bad)?;
            let read = b.get(2).and_then(int).ok_or_else(bad)?;
            let fields: Vec<Vec<u8>> = b[3..]
                .iter()
                .map(|v| match v {
                    Value::Int(i) => Ok(i.to_string().into_bytes()),
                    Value::BulkString(s) => Ok(s.clone()),
                    Value::SimpleString(s) => Ok(s.clone().into_bytes()),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?;
            if !fields.len().is_multiple_of(10) {
                return Err(bad());
            }
            let _: Vec<i64> = self
                .planned("move_in", || {
                    scripts::move_in(&to, &plan, &cancelled, &fields, &plans)
                })
                .await?;
            let ids: Vec<String> = fields
                .chunks_exact(10)
                .map(|e| String::from_utf8_lossy(&e[0]).into_owned())
                .collect();
            if !ids.is_empty() {
                let _: Vec<i64> = self
                    .planned("move_out", || scripts::move_drop(&from, &ids, &plans))
                    .await?;
                moved += ids.len() as u64;
            }
            if read == 0 {
                return Ok(moved);
            }
        }
    }

    /// A user's spend rollups at a location, as `move_in.lua` reads them:
    /// `R<pttl hourly> <pttl daily> ` then `<h|d><len>:<field><len>:<value>`
    /// per field (lengths in bytes). Read while the location is frozen.
    async fn rollups_of(&self, keys: &BudgetKeys) -> Result<String, LedgerError> {
        let mut out = String::new();
        let mut entries = String::new();
        for (which, key) in [("h", keys.spend_hourly()), ("d", keys.spend_daily())] {
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(&key);
            let fields: Vec<(String, String)> = self.command("set_user_org", cmd).await?;
            for (f, v) in &fields {
                entries.push_str(&format!("{which}{}:{f}{}:{v}", f.len(), v.len()));
            }
            let mut cmd = redis::cmd("PTTL");
            cmd.arg(&key);
            let ttl: i64 = self.command("set_user_org", cmd).await?;
            out.push_str(if out.is_empty() { "R" } else { " " });
            out.push_str(&ttl.to_string());
        }
        out.push(' ');
        out.push_str(&entries);
        Ok(out)
    }

    /// The end of a move whose events all moved: the destination's marker,
    /// the pointer, then the source's marker (each a plain write; a crash
    /// between them leaves the source frozen, and the next call finishes).
    async fn finish(
        &self,
        user: &UserId,
        src: Option<&OrgId>,
        dst: Option<&OrgId>,
    ) -> Result<(), LedgerError> {
        let pointer = self.keys.budget(user).at();
        if let Some(b) = dst {
            let mut cmd = redis::cmd("SET");
            cmd.arg(self.keys.member_budget(b, user).at()).arg("here");
            let () = self.command("set_user_org", cmd).await?;
            let mut cmd = redis::cmd("ZADD");
            cmd.arg(self.keys.org_members(b)).arg(0).arg(user.as_str());
            let _: i64 = self.command("set_user_org", cmd).await?;
            let mut cmd = redis::cmd("SET");
            cmd.arg(&pointer).arg(format!("o:{b}"));
            let () = self.command("set_user_org", cmd).await?;
            if src.is_none() {
                // The scripts at the user's own tag read meta's 'w'.
                let mut cmd = redis::cmd("HSET");
                cmd.arg(self.keys.budget(user).meta)
                    .arg("w")
                    .arg(format!("o:{b}"));
                let _: i64 = self.command("set_user_org", cmd).await?;
            }
        } else {
            // Home again: meta expires with the log again (its next write
            // sets the expiry anew; this one bounds it meanwhile).
            let meta = self.keys.budget(user).meta;
            let mut cmd = redis::cmd("HDEL");
            cmd.arg(&meta).arg("w").arg("x");
            let _: i64 = self.command("set_user_org", cmd).await?;
            let mut cmd = redis::cmd("PEXPIRE");
            cmd.arg(&meta).arg(self.config.retention_ms().max(1));
            let _: i64 = self.command("set_user_org", cmd).await?;
            let mut cmd = redis::cmd("DEL");
            cmd.arg(&pointer);
            let _: i64 = self.command("set_user_org", cmd).await?;
        }
        if let Some(a) = src {
            let keys = self.keys.member_budget(a, user);
            let mut cmd = redis::cmd("DEL");
            cmd.arg(keys.at()).arg(&keys.plan).arg(&keys.cancelled);
            let _: i64 = self.command("set_user_org", cmd).await?;
            let mut cmd = redis::cmd("ZREM");
            cmd.arg(self.keys.org_members(a)).arg(user.as_str());
            let _: i64 = self.command("set_user_org", cmd).await?;
        }
        self.cache_home(user, dst.cloned());
        Ok(())
    }

    async fn org_exists(&self, org: &OrgId) -> Result<(), LedgerError> {
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(self.keys.org_budget(org).plan);
        let n: i64 = self.command("org", cmd).await?;
        if n == 0 {
            return Err(LedgerError::UnknownOrg(org.to_string()));
        }
        Ok(())
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
        settle: &SettleRequest<'_>,
    ) -> Result<SettleOutcome, LedgerError> {
        let (r, _, _): (Vec<i64>, _, _) = self
            .at_home("settle", user, |loc| {
                scripts::settle(loc, request.as_str(), settle, &self.plans)
            })
            .await?;
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
        let (r, loc, org): (Vec<Value>, _, _) = self
            .at_home("reserve", user, |loc| {
                scripts::reserve(loc, request.as_str(), cost, &self.plans)
            })
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
                let now = n(2)?;
                let denied = self
                    .denial("reserve", &r, 3, now, &loc, org.as_ref())
                    .await?;
                Ok(ReserveOutcome::Denied(denied))
            }
            Some(6) => Ok(ReserveOutcome::Denied(Denied::credits(
                n(2)?,
                cost,
                windows("reserve", &r, 3)?.0,
                n(1)?,
            ))),
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
        let (r, _, _): (Vec<i64>, _, _) = self
            .at_home("refund", user, |loc| {
                scripts::refund(loc, request.as_str(), finished.unwrap_or(""), &self.plans)
            })
            .await?;
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
        let any = SettleRequest {
            nonce: "",
            actual_cost,
            may_raise: true,
        };
        self.settle_with(user, request, &any).await
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
        let (r, _, _): (Vec<i64>, _, _) = self
            .at_home("settle", user, |loc| {
                scripts::settle_operator(
                    loc,
                    request.as_str(),
                    actual_cost,
                    finished,
                    forced,
                    &self.plans,
                )
            })
            .await?;
        match r.as_slice() {
            &[1, previous, cost, used] => Ok(OperatorSettleOutcome::Settled {
                previous_cost: to_u64(previous),
                cost: to_u64(cost),
                used: to_u64(used),
            }),
            &[0, used] => Ok(OperatorSettleOutcome::NotFound { used: to_u64(used) }),
            &[3, used] => Ok(OperatorSettleOutcome::Running { used: to_u64(used) }),
            other => Err(bad_reply("settle", other)),
        }
    }

    async fn settle_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        settle: &SettleRequest<'_>,
    ) -> Result<SettleOutcome, LedgerError> {
        validate_cost(settle.actual_cost)?;
        self.settle_with(user, request, settle).await
    }

    async fn usage_page(&self, user: &UserId, page: EventPage) -> Result<Usage, LedgerError> {
        let (reply, _, org): (Vec<Value>, _, _) = self
            .at_home("usage", user, |loc| scripts::usage(loc, page, &self.plans))
            .await?;
        parse_usage(reply, org)
    }

    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError> {
        let cost = charge.cost;
        validate_cost(cost)?;
        // Fsync mode reads Redis's AOF setting again where a call is
        // accepted (a verdict at most FSYNC_RECHECK old), so a Redis
        // reconfigured at runtime stops accepting calls on pooled
        // connections too. The charge script applies it: a retry of a call
        // accepted before is still answered with its job (a 503 there would
        // tell the client "not accepted" of a call that runs and is charged);
        // only a new charge is refused.
        let not_durable = match self.pool.durability() {
            tollgate_core::durability::Durability::Fsync => {
                crate::durability::fsync_problem(&self.pool, self.timeout).await
            }
            _ => None,
        };
        let refuse_new = not_durable.is_some();
        let provider = self
            .config
            .operation(charge.operation)
            .map_or("", |op| op.provider.as_str());
        let (r, loc, org): (Vec<Value>, _, _) = self
            .at_home(call::CHARGE, user, |loc| {
                scripts::charge(
                    loc,
                    request.as_str(),
                    charge,
                    provider,
                    refuse_new,
                    &self.plans,
                )
            })
            .await?;
        let bad = || bad_reply::<LedgerError>("charge", &r);
        let n = |i: usize| r.get(i).and_then(int).ok_or_else(bad);
        // The user's plan, the reply's last element, as `plan` answers it:
        // the named plan, also for a user with limits of its own.
        let plan = || {
            let name = r.last().and_then(text).ok_or_else(bad)?;
            Ok::<_, LedgerError>(match name.strip_prefix(CUSTOM_PREFIX) {
                Some(named) => named.to_owned(),
                None => name,
            })
        };
        match r.first().and_then(signed) {
            Some(1) => Ok(ChargeOutcome::Charged {
                allowed: Allowed::new(windows("charge", &r, 3)?.0, n(1)?, n(1)?, false),
                deadline_ms: n(2)?,
                plan: plan()?,
            }),
            Some(2) => Ok(ChargeOutcome::Existing {
                allowed: Allowed::new(windows("charge", &r, 6)?.0, n(3)?, n(1)?, true),
                deadline_ms: n(2)?,
                nonce: r.get(4).and_then(text).ok_or_else(bad)?,
                claimed: r.get(5).and_then(text).as_deref() == Some("j"),
                plan: plan()?,
            }),
            Some(0) => {
                let now = n(1)?;
                let denied = self
                    .denial("charge", &r, 2, now, &loc, org.as_ref())
                    .await?;
                Ok(ChargeOutcome::Denied(denied))
            }
            Some(3) => Ok(ChargeOutcome::Conflict {
                operation: r
                    .get(1)
                    .and_then(text)
                    .map(|op| split_audit_op(&op).0.to_owned()),
            }),
            Some(4) => Ok(ChargeOutcome::Conflict { operation: None }),
            Some(6) => Ok(ChargeOutcome::Denied(Denied::credits(
                n(2)?,
                cost,
                windows("charge", &r, 3)?.0,
                n(1)?,
            ))),
            Some(5) => Err(StoreError::unavailable(format!(
                "Redis no longer keeps an accepted call: {}",
                not_durable.unwrap_or_default()
            ))
            .into()),
            Some(-1) => Err(LedgerError::CostExceedsLimit { cost, limit: n(1)? }),
            _ => Err(bad()),
        }
    }

    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        claim: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, LedgerError> {
        let (r, _, _): (i64, _, _) = self
            .at_home("claim", user, |loc| {
                scripts::claim(loc, request.as_str(), claim, &self.plans)
            })
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
        let (r, _, _): (Vec<i64>, _, _) = self
            .at_home("release", user, |loc| {
                scripts::release(loc, request.as_str(), nonce, &self.plans)
            })
            .await?;
        refund_outcome("release", &r)
    }

    async fn exported(
        &self,
        user: &UserId,
        since_ms: u64,
        count: usize,
    ) -> Result<Vec<ExportEntry>, LedgerError> {
        let org = self.home(user).await?;
        let mut cmd = redis::cmd("XRANGE");
        cmd.arg(self.keys.location(user, org.as_ref()).user.audit)
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
        // The plan and the end of limits of the user's own, in one step, where
        // the user lives.
        let org = self.read_home(user).await?;
        let inv = scripts::plan_set(&self.keys.location(user, org.as_ref()).user, plan);
        let _: i64 = call::script(&self.pool, self.timeout, "set_plan", &inv).await?;
        Ok(())
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        let org = self.home(user).await?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.location(user, org.as_ref()).user.plan);
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
        // One SET where the user lives: the budget scripts read it with the
        // plan (`resolve_plan`); a move between organisations carries it.
        let org = self.read_home(user).await?;
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.keys.location(user, org.as_ref()).user.limits())
            .arg(PlanArgs::limits(&plan));
        self.command("set_limits", cmd).await
    }

    async fn clear_limits(&self, user: &UserId) -> Result<bool, LedgerError> {
        let org = self.read_home(user).await?;
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.keys.location(user, org.as_ref()).user.limits());
        let removed: i64 = self.command("clear_limits", cmd).await?;
        Ok(removed > 0)
    }

    async fn custom_limits(&self, user: &UserId) -> Result<Option<Vec<Limit>>, LedgerError> {
        let org = self.read_home(user).await?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.location(user, org.as_ref()).user.limits());
        let stored: Option<String> = self.command("custom_limits", cmd).await?;
        stored
            .map(|spec| parse_spec(&spec).ok_or_else(|| bad_reply("custom_limits", spec)))
            .transpose()
    }

    async fn set_org_plan(&self, org: &OrgId, plan: &str) -> Result<(), LedgerError> {
        if self.config.plan(plan).is_none() {
            return Err(unknown_plan(&self.config, plan));
        }
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.keys.org_budget(org).plan).arg(plan);
        let () = self.command("set_org_plan", cmd).await?;
        let mut cmd = redis::cmd("ZADD");
        cmd.arg(self.keys.orgs()).arg(0).arg(org.as_str());
        let _: i64 = self.command("set_org_plan", cmd).await?;
        Ok(())
    }

    async fn set_user_org(&self, user: &UserId, org: Option<&OrgId>) -> Result<Moved, LedgerError> {
        if let Some(o) = org {
            self.org_exists(o).await?;
        }
        let target = match org {
            Some(o) => format!("o:{o}"),
            None => "-".to_owned(),
        };
        let parse = |to: &str| -> Result<Option<OrgId>, LedgerError> {
            match to {
                "-" => Ok(None),
                t => t
                    .strip_prefix("o:")
                    .and_then(|o| OrgId::new(o).ok())
                    .map(Some)
                    .ok_or_else(|| bad_reply("set_user_org", t)),
            }
        };
        let mut events = 0;
        // Each round finishes a move under way or starts ours; a move another
        // caller races with is finished, then ours made.
        for _ in 0..16 {
            let mut cmd = redis::cmd("GET");
            cmd.arg(self.keys.budget(user).at());
            let pointer: Option<String> = self.command("set_user_org", cmd).await?;
            let (src, pending) = match pointer.as_deref() {
                None => (None, None),
                Some(p) if p.starts_with("moving ") => (None, Some(p[7..].to_owned())),
                Some(p) => {
                    let a = parse(p)?;
                    let mut cmd = redis::cmd("GET");
                    if let Some(a) = &a {
                        cmd.arg(self.keys.member_budget(a, user).at());
                    }
                    let at: Option<String> = self.command("set_user_org", cmd).await?;
                    let pending = at.and_then(|m| m.strip_prefix("moving ").map(str::to_owned));
                    (a, pending)
                }
            };
            if let Some(to) = pending {
                let dst = parse(&to)?;
                events += self.copy(user, src.as_ref(), dst.as_ref()).await?;
                self.finish(user, src.as_ref(), dst.as_ref()).await?;
                continue;
            }
            if src.as_ref() == org {
                self.cache_home(user, src.clone());
                return Ok(Moved { org: src, events });
            }
            let loc = self.keys.location(user, src.as_ref());
            let plans = self.plans.without_export();
            let _: Vec<Value> = self
                .script("move_out", scripts::move_freeze(&loc, &target, &plans))
                .await?;
        }
        Err(StoreError::unavailable("the user's organisation keeps changing: retry").into())
    }

    async fn user_org(&self, user: &UserId) -> Result<Option<OrgId>, LedgerError> {
        self.read_home(user).await
    }

    async fn org_usage(
        &self,
        org: &OrgId,
        after: Option<&UserId>,
        limit: usize,
    ) -> Result<OrgUsage, LedgerError> {
        self.org_exists(org).await?;
        let keys = self.keys.org_budget(org);
        let r: Vec<Value> = self
            .planned("org_usage", || scripts::org_usage(&keys, &self.plans))
            .await?;
        let bad = || bad_reply::<LedgerError>("org_usage", &r);
        let plan = r.first().and_then(text).ok_or_else(bad)?;
        let now_ms = r.get(1).and_then(int).ok_or_else(bad)?;
        let (windows, _) = windows("org_usage", &r, 2)?;
        let (members, next_member) = self
            .page(self.keys.org_members(org), after.map(UserId::as_str), limit)
            .await?;
        let members = members
            .into_iter()
            .filter_map(|m| UserId::existing(m).ok())
            .collect();
        Ok(OrgUsage {
            org: org.clone(),
            plan,
            now_ms,
            windows,
            members,
            next_member: next_member.and_then(|m| UserId::existing(m).ok()),
        })
    }

    async fn orgs(&self, after: Option<&OrgId>, limit: usize) -> Result<OrgList, LedgerError> {
        let (orgs, next) = self
            .page(self.keys.orgs(), after.map(OrgId::as_str), limit)
            .await?;
        Ok(OrgList {
            orgs: orgs
                .into_iter()
                .filter_map(|o| OrgId::new(o).ok())
                .collect(),
            next: next.and_then(|o| OrgId::new(o).ok()),
        })
    }

    async fn spend(
        &self,
        user: &UserId,
        step: Step,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<Vec<Bucket>, LedgerError> {
        let org = self.home(user).await?;
        let loc = self.keys.location(user, org.as_ref());
        // The hours and the days in one atomic read: a charge of a new day
        // folds the hours of the days before into the days (the hours of
        // 'f''s day and later are counted only in the hours).
        let (hours, mut daily): (HashMap<String, String>, HashMap<String, String>) = call::read(
            &self.pool,
            self.timeout,
            "spend",
            redis::pipe()
                .atomic()
                .cmd("HGETALL")
                .arg(loc.user.spend_hourly())
                .cmd("HGETALL")
                .arg(loc.user.spend_daily()),
        )
        .await?;
        let buckets = match step {
            Step::Day => {
                let folded = hours
                    .get("f")
                    .and_then(|f| f.parse::<u64>().ok())
                    .map_or(0, |f| f / 24);
                for (field, value) in &hours {
                    let Some((n, code)) = field.split_once(':') else {
                        continue;
                    };
                    let (Ok(n), Ok(amount)) = (n.parse::<u64>(), value.parse::<u64>()) else {
                        continue;
                    };
                    let day = n / 24;
                    if day < folded {
                        continue; // counted in the day's bucket already
                    }
                    let f = format!("{day}:{code}");
                    let sum = daily
                        .get(&f)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                        .saturating_add(amount);
                    daily.insert(f, sum.to_string());
                }
                daily.clone()
            }
            Step::Hour => {
                // Hours before the fold, until they expire: each charge is in
                // one of the two, an hour's bucket is their sum.
                let mut all = self
                    .hash_fields(loc.user.spend_hourly_before_fold())
                    .await?;
                for (field, value) in &hours {
                    if !field.contains(':') {
                        continue; // 'f'
                    }
                    let here = value.parse::<u64>().unwrap_or(0);
                    let before = all
                        .get(field)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                    all.insert(field.clone(), here.saturating_add(before).to_string());
                }
                all
            }
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let keep = self.config.spend_keep();
        let mut out = Vec::new();
        for (field, value) in &buckets {
            let Some((n, code)) = field.split_once(':') else {
                continue; // the dictionary, '^'
            };
            let (Ok(n), Ok(amount)) = (n.parse::<u64>(), value.parse::<u64>()) else {
                continue;
            };
            let start_ms = n.saturating_mul(step.ms());
            if start_ms < from_ms || start_ms >= to_ms || !keep.kept(step, start_ms, now) {
                continue;
            }
            let Some(dims) = daily.get(&format!("c{code}")).and_then(|d| Dims::parse(d)) else {
                continue;
            };
            if amount > 0 {
                out.push(Bucket {
                    start_ms,
                    dims,
                    amount,
                });
            }
        }
        Ok(out)
    }

    async fn add_credits(
        &self,
        user: &UserId,
        grant: &tollgate_core::credits::GrantRequest<'_>,
    ) -> Result<tollgate_core::credits::GrantOutcome, LedgerError> {
        grant.check()?;
        let (r, _, _): (Vec<Value>, _, _) = self
            .at_home("credits", user, |loc| {
                scripts::credits(loc, Some(grant), &self.plans)
            })
            .await?;
        crate::credits::parse(&r, Some(grant))
    }

    async fn credits(
        &self,
        user: &UserId,
    ) -> Result<tollgate_core::credits::CreditBalance, LedgerError> {
        let (r, _, _): (Vec<Value>, _, _) = self
            .at_home("credits", user, |loc| {
                scripts::credits(loc, None, &self.plans)
            })
            .await?;
        crate::credits::parse(&r, None).map(|o| o.credits().clone())
    }
}

impl RedisLedger {
    /// Every field of hash `key`, a bounded `HSCAN` step at a time (a field
    /// `HSCAN` gives twice counts once).
    async fn hash_fields(&self, key: String) -> Result<HashMap<String, String>, LedgerError> {
        let mut out = HashMap::new();
        let mut cursor = 0u64;
        loop {
            let mut cmd = redis::cmd("HSCAN");
            cmd.arg(&key).arg(cursor).arg("COUNT").arg(SPEND_SCAN);
            let (next, items): (u64, Vec<String>) = self.command("spend", cmd).await?;
            let mut it = items.into_iter();
            while let (Some(f), Some(v)) = (it.next(), it.next()) {
                out.insert(f, v);
            }
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    /// A page of a name-ordered sorted set (all scores 0): up to `limit`
    /// names after `after`, and the page's last when there are more.
    async fn page(
        &self,
        key: String,
        after: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<String>, Option<String>), LedgerError> {
        let limit = limit.clamp(1, 1000);
        let start = match after {
            Some(a) => format!("({a}"),
            None => "-".to_owned(),
        };
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(key)
            .arg(start)
            .arg("+")
            .arg("BYLEX")
            .arg("LIMIT")
            .arg(0)
            .arg(limit + 1);
        let mut names: Vec<String> = self.command("org_page", cmd).await?;
        let more = names.len() > limit;
        names.truncate(limit);
        let next = more.then(|| names.last().cloned()).flatten();
        Ok((names, next))
    }
}

/// A member's organisation section of a reply at `at` (the plan's name, then
/// its windows, as `push_windows`): `None` when the reply ends there (a user
/// in no organisation) or holds `''` there (usage.lua's).
#[allow(clippy::type_complexity)]
fn org_section(
    what: &str,
    r: &[Value],
    at: usize,
) -> Result<Option<(String, Vec<WindowUse>, Vec<Retry>)>, LedgerError> {
    match r.get(at).and_then(text) {
        None => Ok(None),
        Some(plan) if plan.is_empty() => Ok(None),
        Some(plan) => {
            let (windows, retry) = windows(what, r, at + 1)?;
            Ok(Some((plan, windows, retry)))
        }
    }
}

/// Whether a budget script answered the error `code` (the Redis error's
/// code, as [`is_again`] reads it; never a match in the message's text).
fn is_error(e: &LedgerError, code: &str) -> bool {
    match e {
        LedgerError::Store(e) => error_code(e) == Some(code),
        _ => false,
    }
}

/// Limits in the plan table's `limit:window_ms,...` form ([`PlanArgs::limits`]).
fn parse_spec(spec: &str) -> Option<Vec<Limit>> {
    spec.split(',')
        .map(|part| {
            let (limit, window) = part.split_once(':')?;
            Some(Limit::window(
                limit.parse().ok()?,
                Duration::from_millis(window.parse().ok()?),
            ))
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

/// One XRANGE entry of the export stream: `[id, [field, value, ...]]` (the
/// fields of budget/lib/windows.lua's `export`).
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
        Some(k) => crate::credits::change_kind(k).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    let credit = tollgate_core::credits::is_credit(kind);
    let request_id = f
        .get("id")
        .and_then(|r| RequestId::existing(r.clone()).ok())
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
        spent_at_ms: match kind {
            ChangeKind::CreditGrant => 0,
            _ => num("at").ok_or_else(bad)?,
        },
        operation,
        service_key,
        forced: f.get("forced").is_some_and(|v| v == "1"),
        model: None,
        entry: None,
        prices: None,
        grant: credit.then(|| num("prev")).flatten(),
        expires_at_ms: (kind == ChangeKind::CreditGrant)
            .then(|| num("at"))
            .flatten()
            .filter(|&e| e != 0),
    }
    .with_price(f.get("pr").map(String::as_str)))
}

/// Fields per window in a budget script's reply (`push_windows` in budget/lib/events.lua).
const WINDOW_FIELDS: usize = 6;

/// Whether a budget script kept its progress and asks to be called again:
/// its error reply's code (the first word, `error({ err = 'CODE ...' })` in
/// Lua), read from the Redis error the store error keeps as its source.
/// The ledger's clock (ms) of a script's refusal of the period boundaries
/// passed (`TOLLGATE_PERIOD <now_ms> ...`, budget/lib/periods.lua).
fn period_clock(e: &LedgerError) -> Option<u64> {
    let LedgerError::Store(e) = e else {
        return None;
    };
    let r = std::error::Error::source(e)?.downcast_ref::<redis::RedisError>()?;
    if r.code() != Some(PERIOD) {
        return None;
    }
    r.detail()?.split_whitespace().next()?.parse().ok()
}

fn is_again(e: &StoreError) -> bool {
    matches!(error_code(e), Some(AGAIN))
}

/// The code of the Redis error reply a store error keeps as its source (the
/// first word of a script's `error({ err = 'CODE ...' })`).
fn error_code(e: &StoreError) -> Option<&str> {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<redis::RedisError>())
        .and_then(redis::RedisError::code)
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
        .filter(|&c| {
            c <= MAX_LIMITS + tollgate_core::config::MAX_MODEL_LIMITS
                && r.len() >= at + 1 + c * WINDOW_FIELDS
        })
        .ok_or_else(|| bad_reply::<LedgerError>(what, r))?;
    let fields = &r[at + 1..at + 1 + count * WINDOW_FIELDS];
    let mut windows = Vec::with_capacity(count);
    let mut retry = Vec::with_capacity(count);
    for w in fields.chunks_exact(WINDOW_FIELDS) {
        let n = |i: usize| int(&w[i]).ok_or_else(|| bad_reply::<LedgerError>(what, w));
        let reset = signed(&w[3]).and_then(|v| u64::try_from(v).ok());
        let mut window = WindowUse::new(n(1)?, n(2)?, n(0)?, reset);
        // A calendar period's start (-1: a trailing window); a model
        // limit's is '<start> <tag>' (budget/lib/model_limits.lua).
        let (start, model) = match &w[5] {
            Value::BulkString(b) => {
                let t = String::from_utf8_lossy(b);
                let (start, tag) = t.split_once(' ').unwrap_or((&t, ""));
                let pattern =
                    tollgate_core::config::pattern_of(tag).unwrap_or_else(|| tag.to_owned());
                (start.parse::<u64>().ok(), Some(pattern))
            }
            other => (signed(other).and_then(|v| u64::try_from(v).ok()), None),
        };
        if let Some(start) = start {
            window.period = Some(tollgate_core::period::Span {
                start_ms: start,
                end_ms: start.saturating_add(window.window_ms),
            });
        }
        window.model = model;
        windows.push(window);
        retry.push(Retry::parse(&w[4]).ok_or_else(|| bad_reply::<LedgerError>(what, w))?);
    }
    Ok((windows, retry))
}

fn parse_usage(reply: Vec<Value>, org: Option<OrgId>) -> Result<Usage, LedgerError> {
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
    let section = org_section("usage", &reply, head)?;
    let head = match &section {
        Some((_, w, _)) => head + 2 + w.len() * WINDOW_FIELDS,
        None => head + 1,
    };
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
                request_id: RequestId::existing(text(&e[0])?)
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
    let custom = plan.starts_with(CUSTOM_PREFIX);
    let mut usage = Usage::new(plan, windows, int(&reply[1])?, events, next_cursor);
    if let (Some((plan, windows, _)), Some(org)) = (section, org) {
        usage.organisation = Some(OrgWindows { org, plan, windows });
    }
    Ok(if custom {
        usage.with_custom_limits()
    } else {
        usage
    })
}
