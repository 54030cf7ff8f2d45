//! The Redis ledger: each operation is one script call (see `lua/`), on a pooled
//! multiplexed connection, bounded by a timeout so a stalled Redis fails closed.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::{FromRedisValue, ScriptInvocation, Value};
use tollgate_core::ledger::{unknown_plan, validate_cost};
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    ledger::{
        Allowed, ChargeOutcome, ChargeRequest, ClaimOutcome, Denied, Ledger, LedgerError,
        RefundOutcome, ReserveOutcome, SettleOutcome, SpendEvent, Usage,
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

    async fn script<T: FromRedisValue>(
        &self,
        op: &'static str,
        inv: ScriptInvocation<'_>,
    ) -> Result<T, LedgerError> {
        Ok(call::script(&self.pool, self.timeout, op, &inv).await?)
    }

    async fn command<T: FromRedisValue>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T, LedgerError> {
        Ok(call::command(&self.pool, self.timeout, op, &cmd).await?)
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
        let r: Vec<i64> = self
            .script(
                "reserve",
                scripts::reserve(&keys, request.as_str(), cost, &self.plans),
            )
            .await?;
        match r.as_slice() {
            &[s @ (1 | 2), used, limit, at, now, reset] => {
                let (used, limit) = (to_u64(used), to_u64(limit));
                Ok(ReserveOutcome::Allowed(Allowed {
                    used,
                    limit,
                    remaining: limit.saturating_sub(used),
                    at_ms: to_u64(at),
                    now_ms: to_u64(now),
                    reset_after_ms: to_u64(reset),
                    duplicate: s == 2,
                }))
            }
            &[0, used, limit, retry, now] => {
                let (used, limit) = (to_u64(used), to_u64(limit));
                Ok(ReserveOutcome::Denied(Denied {
                    used,
                    limit,
                    remaining: limit.saturating_sub(used),
                    retry_after_ms: to_u64(retry),
                    now_ms: to_u64(now),
                }))
            }
            &[-1, limit] => Err(LedgerError::CostExceedsLimit {
                cost,
                limit: to_u64(limit),
            }),
            other => Err(bad_reply("reserve", other)),
        }
    }

    async fn refund(
        &self,
        user: &UserId,
        request: &RequestId,
    ) -> Result<RefundOutcome, LedgerError> {
        let keys = self.keys.budget(user);
        let r: Vec<i64> = self
            .script(
                "refund",
                scripts::refund(&keys, request.as_str(), &self.plans),
            )
            .await?;
        refund_outcome("refund", &r)
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
        let keys = self.keys.budget(user);
        let r: Vec<i64> = self
            .script(
                "settle",
                scripts::settle(&keys, request.as_str(), actual_cost, &self.plans),
            )
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

    async fn usage(&self, user: &UserId) -> Result<Usage, LedgerError> {
        let keys = self.keys.budget(user);
        let reply: Vec<Value> = self
            .script("usage", scripts::usage(&keys, &self.plans))
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
                "charge",
                scripts::charge(&keys, request.as_str(), charge, &self.plans),
            )
            .await?;
        let n = |i: usize| {
            r.get(i)
                .and_then(int)
                .ok_or_else(|| bad_reply::<LedgerError>("charge", &r))
        };
        let allowed = |duplicate: bool, at: u64| -> Result<Allowed, LedgerError> {
            let (used, limit) = (n(1)?, n(2)?);
            Ok(Allowed {
                used,
                limit,
                remaining: limit.saturating_sub(used),
                at_ms: at,
                now_ms: n(3)?,
                reset_after_ms: n(4)?,
                duplicate,
            })
        };
        match r.first().and_then(signed) {
            Some(1) => Ok(ChargeOutcome::Charged {
                allowed: allowed(false, n(3)?)?,
                deadline_ms: n(5)?,
            }),
            Some(2) => Ok(ChargeOutcome::Existing {
                allowed: allowed(true, n(6)?)?,
                deadline_ms: n(5)?,
                nonce: r
                    .get(7)
                    .and_then(text)
                    .ok_or_else(|| bad_reply::<LedgerError>("charge", &r))?,
                claimed: r.get(8).and_then(text).as_deref() == Some("j"),
            }),
            Some(0) => {
                let (used, limit) = (n(1)?, n(2)?);
                Ok(ChargeOutcome::Denied(Denied {
                    used,
                    limit,
                    remaining: limit.saturating_sub(used),
                    retry_after_ms: n(3)?,
                    now_ms: n(4)?,
                }))
            }
            Some(3) => Ok(ChargeOutcome::Conflict {
                operation: r.get(1).and_then(text),
            }),
            Some(4) => Ok(ChargeOutcome::Conflict { operation: None }),
            Some(-1) => Err(LedgerError::CostExceedsLimit { cost, limit: n(1)? }),
            _ => Err(bad_reply("charge", &r)),
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
        Ok(if r == 1 {
            ClaimOutcome::Claimed
        } else {
            ClaimOutcome::Refused
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

    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError> {
        if self.config.plan(plan).is_none() {
            return Err(unknown_plan(&self.config, plan));
        }
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.keys.budget(user).plan).arg(plan);
        self.command("set_plan", cmd).await
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.budget(user).plan);
        let stored: Option<String> = self.command("plan", cmd).await?;
        Ok(self.config.plan_or_default(stored.as_deref()).name.clone())
    }
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
    if reply.len() < 6 || (reply.len() - 6) % 4 != 0 {
        return Err(bad_reply("usage", format!("{} elements", reply.len())));
    }
    let (head, tail) = reply.split_at(6);
    let (used, limit) = (int(&head[1])?, int(&head[2])?);
    let reset = match &head[5] {
        Value::Int(i) if *i >= 0 => Some(to_u64(*i)),
        _ => None,
    };
    let events = tail
        .chunks_exact(4)
        .map(|e| {
            let operation = text(&e[3])?;
            Ok(SpendEvent {
                request_id: RequestId::new(text(&e[0])?)
                    .map_err(|err| bad_reply::<LedgerError>("usage", err))?,
                at_ms: int(&e[1])?,
                cost: int(&e[2])?,
                operation: (!operation.is_empty()).then_some(operation),
            })
        })
        .collect::<Result<_, LedgerError>>()?;
    Ok(Usage {
        plan: text(&head[0])?,
        used,
        limit,
        remaining: limit.saturating_sub(used),
        window_ms: int(&head[3])?,
        now_ms: int(&head[4])?,
        reset_after_ms: reset,
        events,
    })
}
