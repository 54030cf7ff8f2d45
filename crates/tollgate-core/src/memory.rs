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
    unknown_plan, validate_cost, Allowed, Denied, Ledger, LedgerError, RefundOutcome,
    ReserveOutcome, SettleOutcome, SpendEvent, Usage,
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
    /// Running sum of live costs: no call sums the log.
    total: u64,
    seq: u64,
    /// Removed from its shard by the sweeper; a caller holding a stale `Arc`
    /// looks the user up again.
    retired: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere never leaves a log half-written (every mutation below is
    // panic-free), so a poisoned lock's data is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl UserLog {
    /// Drops events at or past their expiry (`at + window <= now`).
    fn expire(&mut self, now: u64, window: u64) {
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0.saturating_add(window) > now {
                break;
            }
            let (request, cost) = entry.remove();
            self.index.remove(&request);
            self.total = self.total.saturating_sub(cost);
        }
    }

    fn reset_after(&self, now: u64, window: u64) -> Option<u64> {
        self.events
            .keys()
            .next()
            .map(|(at, _)| (at + window).saturating_sub(now))
    }

    fn remove(&mut self, request: &RequestId) -> Option<u64> {
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
                // The log makes this exact: walk the oldest events until enough
                // tokens are freed. Terminates because cost <= limit.
                let need = log.total + cost - limit;
                let mut freed = 0;
                let mut retry_after_ms = 0;
                for ((at, _), (_, c)) in &log.events {
                    freed += c;
                    if freed >= need {
                        retry_after_ms = (at + window).saturating_sub(now);
                        break;
                    }
                }
                return Ok(ReserveOutcome::Denied(Denied {
                    used: log.total,
                    limit,
                    remaining: limit.saturating_sub(log.total),
                    retry_after_ms,
                    now_ms: now,
                }));
            }
            log.seq += 1;
            let key = (now, log.seq);
            log.events.insert(key, (request.clone(), cost));
            log.index.insert(request.clone(), key);
            log.total += cost;
            Ok(ReserveOutcome::Allowed(Allowed {
                used: log.total,
                limit,
                remaining: limit - log.total,
                at_ms: now,
                now_ms: now,
                reset_after_ms: log.reset_after(now, window).unwrap_or(window),
                duplicate: false,
            }))
        })
    }

    async fn refund(
        &self,
        user: &UserId,
        request: &RequestId,
    ) -> Result<RefundOutcome, LedgerError> {
        Ok(self.with_user(user, false, |log, now| {
            let window = self.plan_of(log).window_ms();
            log.expire(now, window);
            match log.remove(request) {
                Some(cost) => RefundOutcome::Refunded {
                    cost,
                    used: log.total,
                },
                None => RefundOutcome::NotFound { used: log.total },
            }
        }))
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
                    })
                    .collect(),
            }
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
