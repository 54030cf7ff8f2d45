//! The in-memory ledger: the embedded backend, with the same semantics as the
//! Redis scripts in `lua/`.
//!
//! Users live in a sharded map of `Arc<Mutex<UserLog>>`. A shard lock is held only
//! to find or insert a user's entry, never while a budget is computed, so one hot
//! user serialises only its own requests. Idle users (empty log, no stored plan)
//! are swept a shard at a time as operations go by, the way Redis keys expire.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, Plan};
use crate::id::{RequestId, UserId};
use crate::ledger::{
    unknown_plan, validate_cost, Allowed, ChargeOutcome, ChargeRequest, ClaimOutcome, Denied,
    Ledger, LedgerError, RefundOutcome, ReserveOutcome, SettleOutcome, SpendEvent, Usage,
};

const SHARDS: usize = 64;
/// One shard is swept for idle users every this many operations.
const SWEEP_EVERY: u64 = 1024;

type Shard = Mutex<HashMap<UserId, Arc<Mutex<UserLog>>>>;

/// The embedded budget ledger.
pub struct MemoryLedger<C: Clock = SystemClock> {
    config: Arc<Config>,
    clock: C,
    hasher: RandomState,
    shards: Box<[Shard]>,
    ops: AtomicU64,
}

/// One user's sliding window log.
#[derive(Default)]
struct UserLog {
    plan: Option<String>,
    /// (at_ms, seq) -> (request, cost); `seq` keeps two events of one
    /// millisecond apart and in arrival order.
    events: BTreeMap<(u64, u64), (RequestId, u64)>,
    index: HashMap<RequestId, (u64, u64)>,
    /// Who owns each job's charge (`charge`); plain reserves have none.
    owners: HashMap<RequestId, Owner>,
    /// (end of hold, seq) -> request: charges no job has claimed yet.
    holds: BTreeMap<(u64, u64), RequestId>,
    /// Running sum of live costs: no call sums the log.
    total: u64,
    seq: u64,
    /// Removed from its shard by the sweeper; a caller holding a stale `Arc`
    /// looks the user up again.
    retired: bool,
}

/// The owner record of a job's charge (the `owners` hash of `lua/lib/budget.lua`).
struct Owner {
    nonce: String,
    deadline_ms: u64,
    operation: String,
    fingerprint: String,
    /// The key in `holds` while no job has claimed the charge.
    hold: Option<(u64, u64)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere never leaves a log half-written (every mutation below is
    // panic-free), so a poisoned lock's data is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl UserLog {
    /// Drops events at or past their expiry (`at + window <= now`), and charges
    /// still held past their hold (released: no job can claim them any more).
    fn expire(&mut self, now: u64, window: u64) {
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0.saturating_add(window) > now {
                break;
            }
            let (request, _) = entry.get().clone();
            self.remove(&request);
        }
        while let Some(entry) = self.holds.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let request = entry.remove();
            self.remove(&request);
        }
    }

    /// Records a spend event of `cost` at `now`.
    fn record(&mut self, request: &RequestId, cost: u64, now: u64) {
        self.seq += 1;
        let key = (now, self.seq);
        self.events.insert(key, (request.clone(), cost));
        self.index.insert(request.clone(), key);
        self.total += cost;
    }

    /// Exactly how long until enough old events leave the window for `cost`
    /// to fit. Terminates within the log because cost <= limit.
    fn retry_after(&self, cost: u64, limit: u64, now: u64, window: u64) -> u64 {
        let need = (self.total + cost).saturating_sub(limit);
        let mut freed = 0;
        for ((at, _), (_, c)) in &self.events {
            freed += c;
            if freed >= need {
                return (at + window).saturating_sub(now);
            }
        }
        window
    }

    fn allowed(&self, limit: u64, at_ms: u64, now: u64, window: u64, duplicate: bool) -> Allowed {
        Allowed {
            used: self.total,
            limit,
            remaining: limit.saturating_sub(self.total),
            at_ms,
            now_ms: now,
            reset_after_ms: self.reset_after(now, window).unwrap_or(window),
            duplicate,
        }
    }

    fn reset_after(&self, now: u64, window: u64) -> Option<u64> {
        self.events
            .keys()
            .next()
            .map(|(at, _)| (at + window).saturating_sub(now))
    }

    fn remove(&mut self, request: &RequestId) -> Option<u64> {
        if let Some(hold) = self.owners.remove(request).and_then(|o| o.hold) {
            self.holds.remove(&hold);
        }
        let key = self.index.remove(request)?;
        let (_, cost) = self.events.remove(&key)?;
        self.total = self.total.saturating_sub(cost);
        Some(cost)
    }
}

impl MemoryLedger<SystemClock> {
    pub fn new(config: Arc<Config>) -> Self {
        Self::with_clock(config, SystemClock)
    }
}

impl<C: Clock> MemoryLedger<C> {
    pub fn with_clock(config: Arc<Config>, clock: C) -> Self {
        Self {
            config,
            clock,
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            ops: AtomicU64::new(0),
        }
    }

    fn shard(&self, user: &UserId) -> &Shard {
        &self.shards[(self.hasher.hash_one(user) as usize) % SHARDS]
    }

    /// Runs `f` on the user's log under its lock. With `create == false` an
    /// unknown user is shown an empty log and nothing is stored.
    fn with_user<R>(
        &self,
        user: &UserId,
        create: bool,
        f: impl FnOnce(&mut UserLog, u64) -> R,
    ) -> R {
        let n = self.ops.fetch_add(1, Ordering::Relaxed);
        if n % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.sweep_shard(((n / SWEEP_EVERY) as usize) % SHARDS);
        }
        loop {
            let entry = {
                let mut shard = lock(self.shard(user));
                match shard.get(user) {
                    Some(e) => Arc::clone(e),
                    None if create => Arc::clone(shard.entry(user.clone()).or_default()),
                    None => {
                        drop(shard);
                        return f(&mut UserLog::default(), self.clock.now_ms());
                    }
                }
            };
            let mut log = lock(&entry);
            if log.retired {
                continue;
            }
            // Read the clock under the user's lock so that events are recorded in
            // time order.
            let now = self.clock.now_ms();
            return f(&mut log, now);
        }
    }

    fn sweep_shard(&self, i: usize) {
        let mut shard = lock(&self.shards[i]);
        let now = self.clock.now_ms();
        shard.retain(|_, entry| {
            let Ok(mut log) = entry.try_lock() else {
                return true; // busy: certainly not idle
            };
            let window = self.config.plan_or_default(log.plan.as_deref()).window_ms();
            log.expire(now, window);
            if log.events.is_empty() && log.plan.is_none() {
                log.retired = true;
                return false;
            }
            true
        });
    }

    /// Removes the event of `request` (refund and release) when `owns` agrees
    /// with its owner record (`None` for a plain reserve).
    fn remove_if(
        &self,
        user: &UserId,
        request: &RequestId,
        owns: impl FnOnce(Option<&Owner>) -> bool,
    ) -> RefundOutcome {
        self.with_user(user, false, |log, now| {
            let window = self.plan_of(log).window_ms();
            log.expire(now, window);
            if !owns(log.owners.get(request)) {
                return RefundOutcome::NotFound { used: log.total };
            }
            match log.remove(request) {
                Some(cost) => RefundOutcome::Refunded {
                    cost,
                    used: log.total,
                },
                None => RefundOutcome::NotFound { used: log.total },
            }
        })
    }

    fn plan_of(&self, log: &UserLog) -> &Plan {
        self.config.plan_or_default(log.plan.as_deref())
    }

    /// Users currently held in memory (for tests and metrics).
    pub fn resident_users(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

impl<C: Clock> std::fmt::Debug for MemoryLedger<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryLedger")
            .field("clock", &self.clock)
            .field("resident_users", &self.resident_users())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<C: Clock> Ledger for MemoryLedger<C> {
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError> {
        validate_cost(cost)?;
        self.with_user(user, true, |log, now| {
            let plan = self.plan_of(log);
            let (limit, window) = (plan.limit, plan.window_ms());
            if cost > limit {
                return Err(LedgerError::CostExceedsLimit { cost, limit });
            }
            log.expire(now, window);
            if let Some(&key) = log.index.get(request) {
                return Ok(ReserveOutcome::Allowed(Allowed {
                    used: log.total,
                    limit,
                    remaining: limit.saturating_sub(log.total),
                    at_ms: key.0,
                    now_ms: now,
                    reset_after_ms: log.reset_after(now, window).unwrap_or(0),
                    duplicate: true,
                }));
            }
            if log.total + cost > limit {
                return Ok(ReserveOutcome::Denied(Denied {
                    used: log.total,
                    limit,
                    remaining: limit.saturating_sub(log.total),
                    retry_after_ms: log.retry_after(cost, limit, now, window),
                    now_ms: now,
                }));
            }
            log.record(request, cost, now);
            Ok(ReserveOutcome::Allowed(
                log.allowed(limit, now, now, window, false),
            ))
        })
    }

    async fn refund(
        &self,
        user: &UserId,
        request: &RequestId,
    ) -> Result<RefundOutcome, LedgerError> {
        Ok(self.remove_if(user, request, |_| true))
    }

    async fn settle(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
    ) -> Result<SettleOutcome, LedgerError> {
        if actual_cost > crate::config::MAX_TOKENS {
            return Err(LedgerError::CostTooLarge { cost: actual_cost });
        }
        Ok(self.with_user(user, false, |log, now| {
            let window = self.plan_of(log).window_ms();
            log.expire(now, window);
            let Some(&key) = log.index.get(request) else {
                return SettleOutcome::NotFound { used: log.total };
            };
            if actual_cost == 0 {
                let previous_cost = log.remove(request).unwrap_or(0);
                return SettleOutcome::Settled {
                    previous_cost,
                    cost: 0,
                    used: log.total,
                };
            }
            let Some(slot) = log.events.get_mut(&key) else {
                return SettleOutcome::NotFound { used: log.total };
            };
            let previous_cost = std::mem::replace(&mut slot.1, actual_cost);
            log.total = log.total - previous_cost + actual_cost;
            SettleOutcome::Settled {
                previous_cost,
                cost: actual_cost,
                used: log.total,
            }
        }))
    }

    async fn usage(&self, user: &UserId) -> Result<Usage, LedgerError> {
        Ok(self.with_user(user, false, |log, now| {
            let plan = self.plan_of(log);
            let (limit, window) = (plan.limit, plan.window_ms());
            log.expire(now, window);
            Usage {
                plan: plan.name.clone(),
                used: log.total,
                limit,
                remaining: limit.saturating_sub(log.total),
                window_ms: window,
                now_ms: now,
                reset_after_ms: log.reset_after(now, window),
                events: log
                    .events
                    .iter()
                    .map(|((at, _), (request, cost))| SpendEvent {
                        request_id: request.clone(),
                        cost: *cost,
                        at_ms: *at,
                        operation: log.owners.get(request).map(|o| o.operation.clone()),
                    })
                    .collect(),
            }
        }))
    }

    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError> {
        let cost = charge.cost;
        validate_cost(cost)?;
        self.with_user(user, true, |log, now| {
            let plan = self.plan_of(log);
            let (limit, window) = (plan.limit, plan.window_ms());
            if cost > limit {
                return Err(LedgerError::CostExceedsLimit { cost, limit });
            }
            log.expire(now, window);
            if let Some(&(at, _)) = log.index.get(request) {
                let Some(o) = log.owners.get(request) else {
                    return Ok(ChargeOutcome::Conflict { operation: None });
                };
                if o.operation != charge.operation || o.fingerprint != charge.fingerprint {
                    return Ok(ChargeOutcome::Conflict {
                        operation: Some(o.operation.clone()),
                    });
                }
                let (nonce, deadline_ms, claimed) =
                    (o.nonce.clone(), o.deadline_ms, o.hold.is_none());
                return Ok(ChargeOutcome::Existing {
                    allowed: log.allowed(limit, at, now, window, true),
                    nonce,
                    deadline_ms,
                    claimed,
                });
            }
            if log.total + cost > limit {
                return Ok(ChargeOutcome::Denied(Denied {
                    used: log.total,
                    limit,
                    remaining: limit.saturating_sub(log.total),
                    retry_after_ms: log.retry_after(cost, limit, now, window),
                    now_ms: now,
                }));
            }
            log.record(request, cost, now);
            let deadline_ms = now.saturating_add(crate::job::millis(charge.deadline));
            log.seq += 1;
            let hold = (
                deadline_ms.saturating_add(crate::job::millis(charge.grace)),
                log.seq,
            );
            log.holds.insert(hold, request.clone());
            log.owners.insert(
                request.clone(),
                Owner {
                    nonce: charge.nonce.to_owned(),
                    deadline_ms,
                    operation: charge.operation.to_owned(),
                    fingerprint: charge.fingerprint.to_owned(),
                    hold: Some(hold),
                },
            );
            Ok(ChargeOutcome::Charged {
                allowed: log.allowed(limit, now, now, window, false),
                deadline_ms,
            })
        })
    }

    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
        hold_until_ms: u64,
    ) -> Result<ClaimOutcome, LedgerError> {
        Ok(self.with_user(user, false, |log, now| {
            let window = self.plan_of(log).window_ms();
            log.expire(now, window);
            if let Some(o) = log.owners.get_mut(request) {
                if o.nonce != nonce {
                    return ClaimOutcome::Refused;
                }
                if let Some(hold) = o.hold.take() {
                    log.holds.remove(&hold);
                }
                return ClaimOutcome::Claimed;
            }
            // No owner: a plain reserve owns the id, or the charge is gone. A
            // hold is released only at its end; before that, a charge that is
            // gone left the window (paid).
            let released = now >= hold_until_ms;
            if log.index.contains_key(request) || released {
                ClaimOutcome::Refused
            } else {
                ClaimOutcome::Claimed
            }
        }))
    }

    async fn release(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
    ) -> Result<RefundOutcome, LedgerError> {
        Ok(self.remove_if(user, request, |owner| {
            owner.is_some_and(|o| o.nonce == nonce)
        }))
    }

    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError> {
        if self.config.plan(plan).is_none() {
            return Err(unknown_plan(&self.config, plan));
        }
        self.with_user(user, true, |log, _| log.plan = Some(plan.to_owned()));
        Ok(())
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        Ok(self.with_user(user, false, |log, _| self.plan_of(log).name.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::time::Duration;

    #[tokio::test]
    async fn idle_users_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let ledger = MemoryLedger::with_clock(Arc::new(Config::builtin()), Arc::clone(&clock));
        let keeper = UserId::new("keeper").unwrap();
        ledger.set_plan(&keeper, "pro").await.unwrap();
        for i in 0..100 {
            let u = UserId::new(format!("u{i}")).unwrap();
            ledger.reserve(&u, &RequestId::generate(), 1).await.unwrap();
        }
        assert_eq!(ledger.resident_users(), 101);
        clock.advance(Duration::from_secs(13 * 3600));
        for i in 0..(SWEEP_EVERY * SHARDS as u64) {
            ledger
                .usage(&UserId::new(format!("r{i}")).unwrap())
                .await
                .unwrap();
        }
        assert_eq!(
            ledger.resident_users(),
            1,
            "only the user with a stored plan stays"
        );
        assert_eq!(ledger.plan(&keeper).await.unwrap(), "pro");
    }
}
