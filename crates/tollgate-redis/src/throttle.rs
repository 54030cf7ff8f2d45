//! The distributed throttle: [`RedisThrottle`], the waiter side of the
//! [`Throttle`] trait, and [`Dispatcher`], the throttler side of one provider.
//!
//! A waiter registers a unique ticket with its process's one shared pub/sub
//! subscription (the inbox), makes sure that subscription is live, then queues
//! the ticket (`throttle_enqueue.lua`; when nobody is queued and the bucket has
//! a token, that script takes it and the waiter goes ahead at once). A
//! throttler pops tickets and serves them
//! from the provider's bucket in one atomic script (`throttle_grant.lua`), which
//! also records the grant (the readiness record) and publishes it to the inbox.
//!
//! **No lost wake-ups.** Pub/sub is at-most-once, so every (re)subscription is
//! followed by a re-check of the readiness records of all pending tickets: a grant
//! published while the subscription was down is found there.
//!
//! **A slow wake-up costs a round trip, not a token.** A grant that reaches
//! its waiter past the late bound is re-dated to now when the bucket shows it
//! keeps the bound (`throttle_redate.lua`); only otherwise is its token lost.
//!
//! **Nothing burns a token for nobody.** A waiter that gives up runs
//! `throttle_cancel.lua`: still queued, it leaves the queue; already granted, the
//! token goes back to the bucket. Throttlers skip tickets nobody waits for.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use redis::FromRedisValue;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tollgate_core::{
    config::{Config, Fairness, Provider},
    id::RequestId,
    throttle::{
        late_of, limit_stats, Dispatch, Dispatchers, Grant, LimitStats, MemberStats, Pause,
        Position, ProviderStats, Pumped, Throttle, ThrottleError, Usage, UserSlot, Waiter,
    },
};

use crate::call::{self, bad_reply};
use crate::clock::RedisClock;
use crate::keys::{KeySpace, ThrottleKeys};
use crate::pool::{blocking_connection, Blocking, Pool, DEFAULT_TIMEOUT};
use crate::scripts::{
    self, weighted_ticket, BucketArgs, FairArgs, FunctionCall, PauseArgs, Reclaim,
};
use crate::subscription::{self, Listener};
use tollgate_core::error::StoreError;
use tollgate_core::job::LAPSED_KEPT;
use tollgate_core::lock;
use tollgate_core::metrics::Metrics;

/// The least time a readiness record outlives its grant. A provider's records
/// live at least its `max_wait` (plus [`READY_MARGIN`]): a waiter still waiting
/// always finds its grant after a re-subscription.
pub const READY_TTL: Duration = Duration::from_secs(30);

/// How much longer than a provider's `max_wait` its readiness records live.
pub const READY_MARGIN: Duration = Duration::from_secs(5);

/// How long the readiness records of `provider`'s grants live.
pub fn ready_ttl(provider: &Provider) -> Duration {
    READY_TTL.max(provider.max_wait + READY_MARGIN)
}

/// Idle provider keys (no waiter, no grant) expire after this.
pub const IDLE_TTL: Duration = Duration::from_secs(2 * 3600);

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// One throttle script: its function of [`scripts::THROTTLE`].
async fn run_script<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    f: FunctionCall,
) -> Result<T, ThrottleError> {
    Ok(call::function(pool, timeout, op, &f).await?)
}

/// A script shared with the other roles (EVALSHA): the liveness scripts.
async fn shared_script<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    inv: redis::ScriptInvocation<'_>,
) -> Result<T, ThrottleError> {
    Ok(call::script(pool, timeout, op, &inv).await?)
}

pub use tollgate_core::throttle::MIN_LATE_GRANT;

/// Tunables of the waiter side.
#[derive(Debug, Clone)]
pub struct RedisThrottleOptions {
    /// Bounds each Redis call (not the wait for a slot).
    pub call_timeout: Duration,
    /// Pause before re-subscribing after the subscription dropped.
    pub reconnect_delay: Duration,
    /// A grant that reaches its waiter older than this, or than one token's
    /// time at the provider's rate if that is shorter (but never less than
    /// [`MIN_LATE_GRANT`]: the process was paused, its subscription or its
    /// link was slow or down), is re-dated to now when its bucket allows
    /// (`throttle_redate.lua`: used as a grant made now), else not used: its
    /// token is lost (given back late, a token taken before the bucket
    /// refilled to its cap would be one more than the bucket allows) and the
    /// waiter queues again. Used within
    /// 1/rate of being made, grants can bunch at the upstream by at most one
    /// call: it never sees more than burst + rate·t + 1 (for rates up to
    /// 1/MIN_LATE_GRANT = 500/s; above it, by at most rate · 2 ms of delivery
    /// jitter). The same bound is checked again right before the call is sent
    /// ([`Grant::use_by`]).
    pub late_grant: Duration,
    /// Where tokens handed back to a bucket, late grants and re-dated ones
    /// are counted (`tollgate_throttle_tokens_returned_total`,
    /// `_late_grants_total`, `_redated_grants_total`).
    pub metrics: Option<Arc<Metrics>>,
}

impl Default for RedisThrottleOptions {
    fn default() -> Self {
        Self {
            call_timeout: DEFAULT_TIMEOUT,
            reconnect_delay: Duration::from_millis(100),
            late_grant: tollgate_core::throttle::LATE_GRANT,
            metrics: None,
        }
    }
}

/// One try of [`RedisThrottle::acquire`].
enum Attempt {
    Granted(Grant),
    /// The grant came too late to be used; the waiter queues again.
    Late {
        age: Duration,
    },
}

/// The distributed throttle, waiter side: one per process (it owns the process's
/// single pub/sub subscription and demultiplexes grants to waiters by ticket).
pub struct RedisThrottle {
    shared: Arc<Shared>,
    providers: BTreeMap<String, Provider>,
    options: RedisThrottleOptions,
    /// The subscription, started by the first wait (a process that never
    /// waits, such as an api pod, holds none); dropping it stops it.
    subscription: Mutex<Option<oneshot::Sender<()>>>,
}

impl std::fmt::Debug for RedisThrottle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisThrottle")
            .field("inbox", &self.shared.inbox)
            .field("pending", &lock(&self.shared.pending).len())
            .finish_non_exhaustive()
    }
}

/// What a waiter hears of its grant: when it was made (µs, Redis's clock)
/// and the pool member it took from (`None` for a provider served as one
/// upstream).
type Heard = (u64, Option<String>);

struct Shared {
    pool: Pool,
    keys: KeySpace,
    inbox: String,
    process: String,
    next: AtomicU64,
    /// ticket -> (provider, the waiter's receiver of `granted_at_us` and
    /// the pool member granted, if any)
    pending: Mutex<HashMap<String, (String, oneshot::Sender<Heard>)>>,
    subscribed: watch::Sender<bool>,
    call_timeout: Duration,
    /// Cancels of dropped waits still running: [`RedisThrottle::drain`] lets
    /// them finish before a process exits (a runtime that stops first would
    /// drop them, leaving their tickets queued until their deadline).
    cancels: Mutex<tokio::task::JoinSet<()>>,
    metrics: Option<Arc<Metrics>>,
    /// The renewals of the slots of `max_concurrent` this process holds, by
    /// ticket (ended by `done`).
    slots: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// Per provider, Redis's clock as its enqueues bound it (how old a grant
    /// is when it arrives). Per provider: on a cluster, each provider's keys
    /// live on one node, and each node has its own clock.
    clocks: HashMap<String, RedisClock>,
}

impl Shared {
    /// Where this process hears `keys`' provider's grants: on a cluster, a
    /// sharded channel in the provider's slot (`throttle_grant.lua`
    /// SPUBLISHes there); on a single Redis, the process's one inbox.
    fn inbox_of(&self, keys: &ThrottleKeys) -> String {
        if self.pool.is_cluster() {
            keys.inbox(&self.process)
        } else {
            self.inbox.clone()
        }
    }

    fn grant(&self, ticket: &str, granted_at_us: u64, member: Option<String>) {
        if let Some((_, tx)) = lock(&self.pending).remove(ticket) {
            // A waiter that left meanwhile hands the grant back itself (its
            // cancel finds the readiness record).
            let _ = tx.send((granted_at_us, member));
        }
    }

    /// Looks up the readiness record of every pending ticket: the grants
    /// published while this process was not subscribed.
    async fn recheck(&self) -> Result<usize, StoreError> {
        let mut by_provider: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (ticket, (provider, _)) in lock(&self.pending).iter() {
            by_provider
                .entry(provider.clone())
                .or_default()
                .push(ticket.clone());
        }
        let mut found = 0;
        for (provider, tickets) in by_provider {
            let keys = self.keys.throttle(&provider);
            // The grants, and the members of a pool's (none for other
            // providers): one round trip.
            let mut pipe = redis::pipe();
            pipe.cmd("ZMSCORE").arg(&keys.granted).arg(&tickets);
            pipe.cmd("HMGET").arg(keys.granted_by()).arg(&tickets);
            let (scores, members): (Vec<Option<f64>>, Vec<Option<String>>) =
                call::read(&self.pool, self.call_timeout, "recheck", &pipe).await?;
            for ((ticket, score), member) in tickets.iter().zip(scores).zip(members) {
                if let Some(at) = score {
                    found += 1;
                    self.grant(ticket, at as u64, member);
                }
            }
        }
        Ok(found)
    }
}

#[async_trait]
impl Listener for Shared {
    fn name(&self) -> &'static str {
        "throttle inbox"
    }

    async fn resync(&self) -> Result<(), StoreError> {
        let found = self.recheck().await?;
        if found > 0 {
            tracing::info!(found, "grants found after subscribing");
        }
        Ok(())
    }

    fn deliver(&self, payload: &[u8]) {
        // "<ticket> <granted_at_us>[ <member>]" (throttle_grant.lua).
        let parsed = std::str::from_utf8(payload).ok().and_then(|s| {
            let mut words = s.split(' ');
            let ticket = words.next()?;
            let at = words.next()?.parse::<u64>().ok()?;
            let member = words.next().map(str::to_owned);
            words.next().is_none().then_some((ticket, at, member))
        });
        match parsed {
            Some((ticket, at, member)) => self.grant(ticket, at, member),
            None => tracing::warn!(?payload, "malformed readiness message"),
        }
    }

    fn live(&self, live: bool) {
        self.subscribed.send_replace(live);
    }
}

/// A waiter's claim on its ticket. Dropped while armed (the caller's future was
/// dropped, the enqueue failed, or the wait timed out), it cancels the ticket
/// in the background: a waiter's timeout never waits on Redis.
struct Ticket<'a> {
    throttle: &'a RedisThrottle,
    provider: &'a Provider,
    id: String,
    /// The fair queue the ticket is in (its user); `None` on a FIFO provider.
    user: Option<&'a str>,
    armed: bool,
}

/// How long a timed-out waiter waits for its ticket's cancel before it
/// reports the timeout (then the cancel goes on in the background).
const CANCEL_INLINE: Duration = Duration::from_millis(100);

impl Ticket<'_> {
    /// What a cancel of this ticket needs: the call's timeout and the
    /// provider's late bound.
    fn cancel_times(&self) -> (Duration, Duration) {
        (
            self.throttle.options.call_timeout,
            late_of(self.provider, self.throttle.options.late_grant),
        )
    }

    /// Cancels the ticket now if Redis answers within `limit`; otherwise it
    /// stays armed, and its drop cancels it in the background (a cancel is
    /// idempotent: a second one finds nothing).
    async fn cancel_within(&mut self, limit: Duration) {
        let times = self.cancel_times();
        let now = cancel(
            &self.throttle.shared,
            self.provider,
            &self.id,
            self.user,
            times,
            "cancelled",
        );
        if let Ok(Ok(_)) = tokio::time::timeout(limit, now).await {
            self.armed = false;
            lock(&self.throttle.shared.pending).remove(&self.id);
        }
    }
}

/// Gives up `ticket`; `(timeout, late)`: the call's timeout and the
/// provider's late bound (a grant older than it keeps its token lost).
async fn cancel(
    shared: &Shared,
    provider: &Provider,
    ticket: &str,
    user: Option<&str>,
    (timeout, late): (Duration, Duration),
    why: &'static str,
) -> Result<i64, ThrottleError> {
    let keys = shared.keys.throttle(&provider.name);
    let r = run_script(
        &shared.pool,
        timeout,
        "throttle_cancel",
        scripts::throttle_cancel(&keys, ticket, BucketArgs::from(provider), user, late),
    )
    .await;
    match r {
        Ok(2) => {
            tracing::debug!(provider = %provider.name, ticket, why, "granted token handed back");
            if let Some(m) = &shared.metrics {
                m.token_returned(&provider.name, why);
            }
        }
        Ok(3) => {
            tracing::debug!(provider = %provider.name, ticket, why, "a late grant given up: its token is lost");
            if let Some(m) = &shared.metrics {
                m.late_grant(&provider.name);
            }
        }
        _ => {}
    }
    r
}

pub use tollgate_core::throttle::SLOT_LEASE_MAX;

/// Renews the slot of `ticket` at `provider` every third of its lease while
/// its call runs, until `done` ends it (or [`SLOT_LEASE_MAX`]); a process that
/// dies stops renewing, and the slot ends with its lease.
fn renew_slot(shared: &Arc<Shared>, keys: &ThrottleKeys, ticket: &str) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let lease = tollgate_core::config::SLOT_LEASE;
    let task = {
        let shared = Arc::clone(shared);
        let keys = keys.clone();
        let ticket = ticket.to_owned();
        async move {
            let started = Instant::now();
            while started.elapsed() < SLOT_LEASE_MAX {
                tokio::time::sleep(lease / 3).await;
                let r: Result<i64, _> = run_script(
                    &shared.pool,
                    shared.call_timeout,
                    "throttle_slot",
                    scripts::throttle_slot(&keys, &ticket, true),
                )
                .await;
                match r {
                    Ok(1) => {}
                    Ok(_) => {
                        tracing::warn!(ticket, "a slot's lease ended before its call (a pause)");
                        break;
                    }
                    Err(e) => tracing::warn!(error = %e, ticket, "renewing a slot failed"),
                }
            }
            lock(&shared.slots).remove(&ticket);
        }
    };
    let handle = rt.spawn(task).abort_handle();
    lock(&shared.slots).insert(ticket.to_owned(), handle);
}

/// Ends the slot of `ticket` in `keys`' `inflight` (its renewal stops).
async fn end_provider_slot(
    shared: &Shared,
    timeout: Duration,
    keys: &ThrottleKeys,
    ticket: &str,
) -> Result<(), ThrottleError> {
    if let Some(renewal) = lock(&shared.slots).remove(ticket) {
        renewal.abort();
    }
    let _: i64 = run_script(
        &shared.pool,
        timeout,
        "throttle_slot",
        scripts::throttle_slot(keys, ticket, false),
    )
    .await?;
    Ok(())
}

/// Ends the slot `held` of a capped user at `provider` (its call ended, or
/// its grant was not used).
async fn end_slot(
    shared: &Shared,
    timeout: Duration,
    provider: &str,
    held: &UserSlot,
) -> Result<(), ThrottleError> {
    let keys = shared.keys.throttle(provider);
    let _: i64 = run_script(
        &shared.pool,
        timeout,
        "throttle_done",
        scripts::throttle_done(&keys, &held.user, &held.ticket),
    )
    .await?;
    Ok(())
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        lock(&self.throttle.shared.pending).remove(&self.id);
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the ticket expires at its deadline
        };
        let shared = Arc::clone(&self.throttle.shared);
        let provider = self.provider.clone();
        let ticket = std::mem::take(&mut self.id);
        let user = self.user.map(str::to_owned);
        let times = self.cancel_times();
        let task = async move {
            let user = user.as_deref();
            if let Err(e) = cancel(&shared, &provider, &ticket, user, times, "cancelled").await {
                tracing::warn!(error = %e, ticket, "cancelling a dropped wait failed");
            }
        };
        lock(&self.throttle.shared.cancels).spawn_on(task, &rt);
    }
}

impl RedisThrottle {
    /// The waiter side on `pool`'s Redis; the process's subscription to its
    /// inbox starts with the first wait.
    pub fn start(
        pool: Pool,
        keys: KeySpace,
        config: &Config,
        options: RedisThrottleOptions,
    ) -> Self {
        let process = RequestId::generate().as_str().replace('-', "");
        let (subscribed, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            pool,
            inbox: keys.inbox(&process),
            keys,
            process,
            next: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            subscribed,
            call_timeout: options.call_timeout,
            cancels: Mutex::default(),
            slots: Mutex::default(),
            metrics: options.metrics.clone(),
            clocks: config
                .providers()
                .map(|p| (p.name.clone(), RedisClock::new()))
                .collect(),
        });
        Self {
            shared,
            providers: config
                .providers()
                .map(|p| (p.name.clone(), p.clone()))
                .collect(),
            options,
            subscription: Mutex::new(None),
        }
    }

    fn ensure_subscribed(&self) {
        let mut subscription = lock(&self.subscription);
        if subscription.is_none() {
            let shared = &self.shared;
            let channels = if shared.pool.is_cluster() {
                self.providers
                    .keys()
                    .map(|p| shared.keys.throttle(p).inbox(&shared.process))
                    .collect()
            } else {
                vec![shared.inbox.clone()]
            };
            *subscription = Some(subscription::spawn(
                &shared.pool,
                channels,
                Arc::clone(&self.shared),
                self.options.reconnect_delay,
            ));
        }
    }

    /// The pub/sub channel this process's waiters hear their grants on (on a
    /// single Redis; on a cluster, [`ThrottleKeys::inbox`] of each provider).
    pub fn inbox(&self) -> &str {
        &self.shared.inbox
    }

    /// Tickets this process is waiting on.
    pub fn pending(&self) -> usize {
        lock(&self.shared.pending).len()
    }

    /// Starts the subscription if no wait has, and waits until it is live, at
    /// most `within`.
    pub async fn subscribed(&self, within: Duration) -> bool {
        self.ensure_subscribed();
        let mut rx = self.shared.subscribed.subscribe();
        tokio::time::timeout(within, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

#[async_trait]
impl Throttle for RedisThrottle {
    #[tracing::instrument(skip_all, fields(provider, request_id = %waiter.request_id))]
    async fn acquire_as(
        &self,
        provider: &str,
        waiter: &Waiter,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError> {
        let started = Instant::now();
        let deadline = started + max_wait;
        let p = self.providers.get(provider).ok_or_else(|| {
            ThrottleError::unknown_provider(provider, self.providers.keys().map(String::as_str))
        })?;
        loop {
            match self.attempt(p, waiter, started, max_wait).await? {
                Attempt::Granted(grant) => return Ok(grant),
                Attempt::Late { age } => {
                    tracing::warn!(
                        provider = %p.name, ?age,
                        "a grant arrived late (a pause or a lost subscription): not used, queued again"
                    );
                    if Instant::now() >= deadline {
                        return Err(ThrottleError::Timeout {
                            provider: p.name.clone(),
                            max_wait,
                        });
                    }
                }
            }
        }
    }

    /// One read-only pipeline: Redis TIME, then per provider its bucket, its
    /// waiting tickets and its throttlers' liveness. The bucket is refilled to
    /// now as the scripts would (throttle/lib/bucket.lua), without writing it.
    async fn stats(&self) -> Result<Vec<ProviderStats>, ThrottleError> {
        let mut cmds = vec![redis::cmd("TIME")];
        for name in self.providers.keys() {
            let keys = self.shared.keys.throttle(name);
            let p = &self.providers[name];
            cmds.push(bucket_fields(&keys.bucket, p));
            cmds.push(redis::cmd("HLEN").arg(&keys.waiting).to_owned());
            cmds.push(redis::cmd("HVALS").arg(&keys.throttlers).to_owned());
            cmds.push(redis::cmd("HGET").arg(&keys.tags).arg(":n").to_owned());
            // A pool's members: each one's buckets and slots, then their
            // grants (lua/throttle/lib/pool.lua).
            let pool = p.pool();
            for m in pool {
                let own = keys.member(&m.name);
                cmds.push(bucket_fields(&own.bucket, &p.as_member(m)));
                cmds.push(
                    redis::cmd("ZRANGE")
                        .arg(&own.inflight)
                        .arg(0)
                        .arg(-1)
                        .arg("WITHSCORES")
                        .to_owned(),
                );
            }
            if !pool.is_empty() {
                let mut counts = redis::cmd("HMGET");
                counts.arg(keys.member_counts());
                for m in pool {
                    counts.arg(&m.name);
                }
                cmds.push(counts);
            }
        }
        let reply: redis::Value = call::gather(
            &self.shared.pool,
            self.options.call_timeout,
            "throttle_stats",
            &cmds,
        )
        .await?;
        let items = match reply {
            redis::Value::Array(items) => items,
            other => return Err(bad_reply("throttle_stats", other)),
        };
        let (secs, micros): (u64, u64) = items
            .first()
            .and_then(|t| redis::from_redis_value_ref(t).ok())
            .ok_or_else(|| bad_reply::<ThrottleError>("TIME", items.first()))?;
        let now_us = secs * 1_000_000 + micros;
        let mut out = Vec::with_capacity(self.providers.len());
        let mut rest = items.get(1..).unwrap_or_default();
        for p in self.providers.values() {
            let pool = p.pool();
            let n = 4 + 2 * pool.len() + usize::from(!pool.is_empty());
            if rest.len() < n {
                return Err(bad_reply("throttle_stats", rest.len()));
            }
            let (r, next) = rest.split_at(n);
            rest = next;
            let own = BucketStanding::read(p, &r[0], now_us)?;
            let waiters: u64 = redis::from_redis_value_ref(&r[1])
                .map_err(|e| bad_reply::<ThrottleError>("HLEN", e))?;
            let lives: Vec<u64> = redis::from_redis_value_ref(&r[2])
                .map_err(|e| bad_reply::<ThrottleError>("HVALS", e))?;
            let fair_users: Option<u64> = redis::from_redis_value_ref(&r[3])
                .map_err(|e| bad_reply::<ThrottleError>("HGET", e))?;
            let fair_users = fair_users.unwrap_or(0);
            let users = match p.fairness {
                Fairness::Fair => fair_users,
                Fairness::Fifo => u64::from(waiters > 0),
            };
            let mut members = Vec::with_capacity(pool.len());
            if !pool.is_empty() {
                let counts: Vec<Option<u64>> = redis::from_redis_value_ref(&r[n - 1])
                    .map_err(|e| bad_reply::<ThrottleError>("HMGET", e))?;
                for (i, m) in pool.iter().enumerate() {
                    let standing = BucketStanding::read(&p.as_member(m), &r[4 + 2 * i], now_us)?;
                    let slots: Vec<(String, f64)> = redis::from_redis_value_ref(&r[5 + 2 * i])
                        .map_err(|e| bad_reply::<ThrottleError>("ZRANGE", e))?;
                    members.push(MemberStats {
                        member: m.name.clone(),
                        paused_ms: standing.paused_ms,
                        effective_rate: standing.effective_rate,
                        in_flight: slots
                            .iter()
                            .filter(|(_, until)| *until >= now_us as f64)
                            .count() as u64,
                        grants: counts.get(i).copied().flatten().unwrap_or(0),
                        limits: standing.limits,
                    });
                }
            }
            let now_ms = now_us / 1000;
            out.push(
                ProviderStats {
                    provider: p.name.clone(),
                    rate: p.rate,
                    burst: p.burst,
                    tokens: own.tokens,
                    waiters,
                    users,
                    throttlers: Some(lives.iter().filter(|until| **until >= now_ms).count() as u64),
                    paused_ms: own.paused_ms,
                    effective_rate: own.effective_rate,
                    limits: own.limits,
                    members: Vec::new(),
                }
                .pooled(p, members),
            );
        }
        Ok(out)
    }

    async fn position(
        &self,
        provider: &str,
        user: &str,
        request_id: &RequestId,
    ) -> Result<Option<Position>, ThrottleError> {
        let p = self.providers.get(provider).ok_or_else(|| {
            ThrottleError::unknown_provider(provider, self.providers.keys().map(String::as_str))
        })?;
        let keys = self.shared.keys.throttle(&p.name);
        let user = (p.fairness == Fairness::Fair).then_some(user);
        let r: Vec<u64> = run_script(
            &self.shared.pool,
            self.options.call_timeout,
            "throttle_position",
            scripts::throttle_position(&keys, request_id.as_str(), user),
        )
        .await?;
        match r[..] {
            [] => Ok(None),
            [ahead, others_ahead, users, weight, paused_us] => Ok(Some(Position {
                ahead,
                others_ahead,
                users,
                weight: u32::try_from(weight).unwrap_or(1).max(1),
                paused: Duration::from_micros(paused_us),
            })),
            _ => Err(bad_reply("throttle_position", r)),
        }
    }

    async fn pause(
        &self,
        provider: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        let p = self.providers.get(provider).ok_or_else(|| {
            ThrottleError::unknown_provider(provider, self.providers.keys().map(String::as_str))
        })?;
        let keys = self.shared.keys.throttle(&p.name);
        self.pause_keys(p, &keys, retry_after).await
    }

    async fn pause_member(
        &self,
        provider: &str,
        member: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        let p = self.providers.get(provider).ok_or_else(|| {
            ThrottleError::unknown_provider(provider, self.providers.keys().map(String::as_str))
        })?;
        let Some(m) = p.pool_member(member) else {
            return Ok(Pause {
                left: Duration::ZERO,
                strikes: 0,
                rate: p.rate,
            });
        };
        let keys = self.shared.keys.throttle(&p.name).member(&m.name);
        let own = p.as_member(m);
        self.pause_keys(&own, &keys, retry_after).await
    }

    async fn usage(&self, grant: &Grant, used: u64) -> Result<Usage, ThrottleError> {
        let p = self.providers.get(&grant.provider).ok_or_else(|| {
            ThrottleError::unknown_provider(
                &grant.provider,
                self.providers.keys().map(String::as_str),
            )
        })?;
        let usage = Usage::of(grant.weight, used);
        // A pool's grant took from its member's limits.
        let (p, keys) = self.grant_buckets(p, grant);
        if p.max_weight().is_none() || usage == Usage::Matched {
            return Ok(Usage::Matched);
        }
        let _: i64 = run_script(
            &self.shared.pool,
            self.options.call_timeout,
            "throttle_usage",
            scripts::throttle_usage(&keys, &BucketArgs::from(&p), grant.weight, used),
        )
        .await?;
        Ok(usage)
    }

    async fn redate(&self, grant: &Grant) -> Result<Option<Grant>, ThrottleError> {
        let p = self.providers.get(&grant.provider).ok_or_else(|| {
            ThrottleError::unknown_provider(
                &grant.provider,
                self.providers.keys().map(String::as_str),
            )
        })?;
        let Some(ticket) = &grant.ticket else {
            return Ok(None);
        };
        let deadline = Instant::now() + self.options.call_timeout;
        let sent = Instant::now();
        let Some(now_us) = self
            .redate_at(p, ticket, grant.granted_at_us, deadline)
            .await
        else {
            return Ok(None);
        };
        let late = late_of(p, self.options.late_grant);
        // Without a bound (one proven wrong meanwhile), from this call alone.
        let (now, upper_us) = self
            .shared
            .clocks
            .get(&p.name)
            .and_then(RedisClock::now)
            .unwrap_or_else(|| {
                (
                    Instant::now(),
                    now_us.saturating_add(micros(sent.elapsed())),
                )
            });
        Ok(Some(Grant {
            granted_at_us: now_us,
            use_by: Some(RedisClock::earliest(
                now,
                upper_us,
                now_us.saturating_add(micros(late)),
            )),
            ..grant.clone()
        }))
    }

    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError> {
        if let Some(slot) = &grant.slot {
            let keys = match &grant.member {
                Some(m) => self.shared.keys.throttle(&grant.provider).member(m),
                None => self.shared.keys.throttle(&grant.provider),
            };
            end_provider_slot(&self.shared, self.options.call_timeout, &keys, slot).await?;
        }
        let Some(held) = &grant.user_slot else {
            return Ok(());
        };
        end_slot(
            &self.shared,
            self.options.call_timeout,
            &grant.provider,
            held,
        )
        .await
    }

    async fn drain(&self, limit: Duration) -> usize {
        let mut cancels = std::mem::take(&mut *lock(&self.shared.cancels));
        let _ = tokio::time::timeout(limit, async {
            while cancels.join_next().await.is_some() {}
        })
        .await;
        cancels.len()
    }
}

impl RedisThrottle {
    /// Pauses the bucket at `keys` of `p` (a provider, or a pool member as
    /// one: [`Provider::as_member`]): `throttle_pause.lua`.
    async fn pause_keys(
        &self,
        p: &Provider,
        keys: &ThrottleKeys,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        let pause = PauseArgs {
            named: retry_after,
            first: tollgate_core::config::FIRST_BACKOFF,
            longest: p.max_pause,
            adaptive: p.adaptive,
        };
        let r: Vec<u64> = run_script(
            &self.shared.pool,
            self.options.call_timeout,
            "throttle_pause",
            scripts::throttle_pause(keys, BucketArgs::from(p), pause),
        )
        .await?;
        match r[..] {
            [_, left_us, strikes, milli] => Ok(Pause {
                left: Duration::from_micros(left_us),
                strikes: u32::try_from(strikes).unwrap_or(u32::MAX),
                rate: milli as f64 / 1000.0,
            }),
            _ => Err(bad_reply("throttle_pause", r)),
        }
    }

    /// The buckets `grant` took from: its member's (a provider of its own,
    /// and its keys) when its provider is a pool, else its provider's.
    fn grant_buckets(&self, p: &Provider, grant: &Grant) -> (Provider, ThrottleKeys) {
        let keys = self.shared.keys.throttle(&p.name);
        match grant.member.as_deref().and_then(|m| p.pool_member(m)) {
            Some(m) => (p.as_member(m), keys.member(&m.name)),
            None => (p.clone(), keys),
        }
    }

    /// One ticket: queued (or granted on the way in), then its grant, its
    /// timeout, or a grant too old to use (not used).
    async fn attempt(
        &self,
        p: &Provider,
        waiter: &Waiter,
        started: Instant,
        max_wait: Duration,
    ) -> Result<Attempt, ThrottleError> {
        let request_id = &waiter.request_id;
        ThrottleError::check_weight(p, waiter.weight)?;
        let bucket = BucketArgs::from(p);
        let weight = waiter.weight.max(1);
        let fair = match p.fairness {
            Fairness::Fair => Some(FairArgs {
                user: &waiter.user,
                weight: waiter.share.weight,
                max_in_flight: waiter.share.max_in_flight.unwrap_or(0),
                slot_lease_us: micros(waiter.share.slot_lease),
            }),
            Fairness::Fifo => None,
        };
        let deadline = started + max_wait;
        let left = deadline.saturating_duration_since(Instant::now());
        self.ensure_subscribed();
        let shared = &self.shared;
        let n = shared.next.fetch_add(1, Ordering::Relaxed);
        // A provider with other limits reads the ticket's weight from it.
        let id = weighted_ticket(
            format!("{request_id}~{}.{n:x}", shared.process),
            &bucket,
            weight,
        );
        let (tx, rx) = oneshot::channel();
        // Registered before the subscription is checked: a subscription that
        // drops from here on is followed by a re-check that includes this ticket.
        lock(&shared.pending).insert(id.clone(), (p.name.clone(), tx));
        let mut ticket = Ticket {
            throttle: self,
            provider: p,
            id,
            user: fair.map(|f| f.user),
            armed: false,
        };
        let timeout = || ThrottleError::Timeout {
            provider: p.name.clone(),
            max_wait,
        };
        let connect_wait = self.options.call_timeout.min(left);
        if !self.subscribed(connect_wait).await {
            return Err(if connect_wait == left {
                timeout()
            } else {
                StoreError::unavailable("no pub/sub subscription to Redis").into()
            });
        }
        ticket.armed = true;
        let keys = shared.keys.throttle(&p.name);
        let inbox = shared.inbox_of(&keys);
        // The script runs after this instant: Redis's clock, estimated from
        // here, is never behind (a slow link makes grants look older, never
        // younger).
        let sent_at = Instant::now();
        let idle_ms = u64::try_from(IDLE_TTL.as_millis()).unwrap_or(u64::MAX);
        let invocation = match fair {
            Some(fair) => scripts::throttle_enqueue_fair(
                &keys,
                &ticket.id,
                &inbox,
                micros(left),
                idle_ms,
                bucket,
                fair,
            ),
            None => {
                scripts::throttle_enqueue(&keys, &ticket.id, &inbox, micros(left), idle_ms, bucket)
            }
        };
        // Bounded by the wait's deadline too: a waiter is owed its slot or
        // its timeout within `max_wait`, and a stalled Redis must not hold it
        // for the call's timeout. Past the deadline the ticket stays armed,
        // and its drop cancels it in the background (whether the script ran
        // or not).
        let enqueue = run_script(
            &shared.pool,
            self.options.call_timeout,
            "throttle_enqueue",
            invocation,
        );
        let queued: Vec<i64> = match tokio::time::timeout_at(deadline, enqueue).await {
            Ok(queued) => queued?,
            Err(_) => return Err(timeout()),
        };
        let held = fair.filter(|f| f.max_in_flight > 0).map(|f| UserSlot {
            user: f.user.to_owned(),
            ticket: ticket.id.clone(),
        });
        let late = late_of(p, self.options.late_grant);
        // [2, granted_at_us]: nobody was queued and the bucket had a token,
        // taken at once; [1, now_us]: queued.
        let (taken, redis_now_us) = match queued[..] {
            [kind @ (1 | 2), now_us] => (kind == 2, u64::try_from(now_us).unwrap_or(0)),
            _ => {
                return Err(StoreError::backend(format!(
                    "throttle_enqueue refused ticket {}: {queued:?}",
                    ticket.id
                ))
                .into())
            }
        };
        // The script ran after `sent_at`: Redis's clock read at most
        // `redis_now_us` then. The provider's clock keeps the tightest such
        // bound (see `RedisClock`): a grant's age is never underestimated,
        // and an enqueue that waited behind others does not age its grant.
        let clock = shared.clocks.get(&p.name);
        if let Some(clock) = clock {
            clock.observe(sent_at, Instant::now(), redis_now_us);
        }
        // Redis's clock now, at the latest, and this process's clock then
        // (without a bound, from this enqueue alone).
        let redis_now = || {
            clock.and_then(RedisClock::now).unwrap_or_else(|| {
                (
                    Instant::now(),
                    redis_now_us.saturating_add(micros(sent_at.elapsed())),
                )
            })
        };
        // A grant made at `granted_at_us` is late once Redis's clock, at the
        // latest, passes `granted_at_us + late`.
        let slot = p.max_concurrent.map(|_| ticket.id.clone());
        let grant = |granted_at_us: u64, (now, upper_us): (Instant, u64)| Grant {
            provider: p.name.clone(),
            request_id: request_id.clone(),
            waited: started.elapsed(),
            granted_at_us,
            user_slot: held.clone(),
            slot: slot.clone(),
            use_by: Some(RedisClock::earliest(
                now,
                upper_us,
                granted_at_us.saturating_add(micros(late)),
            )),
            weight,
            ticket: Some(ticket.id.clone()),
            member: None,
        };
        if taken {
            ticket.armed = false;
            lock(&shared.pending).remove(&ticket.id);
            if slot.is_some() {
                renew_slot(shared, &keys, &ticket.id);
            }
            return Ok(Attempt::Granted(grant(redis_now_us, redis_now())));
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok((granted_at_us, member))) => {
                // A pool's grant: its member's slot and keys.
                let member = member.and_then(|m| p.pool_member(&m));
                let (slot, keys) = match member {
                    Some(m) => (
                        m.max_concurrent.map(|_| ticket.id.clone()),
                        keys.member(&m.name),
                    ),
                    None => (slot.clone(), keys.clone()),
                };
                let grant = |at: u64, now: (Instant, u64)| Grant {
                    slot: slot.clone(),
                    member: member.map(|m| m.name.clone()),
                    ..grant(at, now)
                };
                // Made before it was heard of: Redis's clock is past it.
                if let Some(clock) = clock {
                    clock.at_least(Instant::now(), granted_at_us);
                }
                let now = redis_now();
                let age = Duration::from_micros(now.1.saturating_sub(granted_at_us));
                if age > late {
                    // Re-dated to now when the bucket allows (a slow wake-up
                    // then costs a round trip, not a token).
                    if let Some(redated) =
                        self.redate_at(p, &ticket.id, granted_at_us, deadline).await
                    {
                        tracing::debug!(provider = %p.name, ?age, "a grant that arrived late is re-dated");
                        ticket.armed = false;
                        if slot.is_some() {
                            renew_slot(shared, &keys, &ticket.id);
                        }
                        return Ok(Attempt::Granted(grant(redated, redis_now())));
                    }
                    // Not used, and its token is lost, not returned: given back
                    // now, a token taken before the bucket refilled to its cap
                    // would add to it (see `late_grant`). Its slot of the
                    // user's cap ends; the caller queues again.
                    ticket.armed = false;
                    // In the background, like a cancel: the caller's wait
                    // goes on (or times out) without waiting on Redis.
                    if held.is_some() || slot.is_some() {
                        let shared = Arc::clone(shared);
                        let (provider, timeout) = (p.name.clone(), self.options.call_timeout);
                        let (held, slot, keys) = (held.clone(), slot.clone(), keys.clone());
                        let task = async move {
                            if let Some(slot) = slot {
                                if let Err(e) =
                                    end_provider_slot(&shared, timeout, &keys, &slot).await
                                {
                                    tracing::warn!(error = %e, "ending the slot of a late grant failed");
                                }
                            }
                            if let Some(held) = held {
                                if let Err(e) = end_slot(&shared, timeout, &provider, &held).await {
                                    tracing::warn!(error = %e, "ending the slot of a late grant failed");
                                }
                            }
                        };
                        lock(&self.shared.cancels).spawn(task);
                    }
                    if let Some(m) = &shared.metrics {
                        m.late_grant(&p.name);
                    }
                    return Ok(Attempt::Late { age });
                }
                ticket.armed = false;
                if slot.is_some() {
                    renew_slot(shared, &keys, &ticket.id);
                }
                Ok(Attempt::Granted(grant(granted_at_us, now)))
            }
            Ok(Err(_)) => Err(StoreError::backend("the throttle subscriber stopped").into()),
            // On time, whatever Redis is doing: the ticket is cancelled
            // before the timeout is reported when Redis answers at once (the
            // caller then finds its ticket gone, as in process), else it
            // stays armed and its drop cancels it in the background.
            Err(_) => {
                ticket.cancel_within(CANCEL_INLINE).await;
                Err(timeout())
            }
        }
    }
}

impl RedisThrottle {
    /// Re-dates `ticket`'s late grant, made at `granted_at_us`, to now if the
    /// bucket allows (`throttle_redate.lua`): the new grant time, or `None`
    /// (not allowed, or Redis did not answer by `deadline` or the call's
    /// timeout: the grant stays late).
    async fn redate_at(
        &self,
        p: &Provider,
        ticket: &str,
        granted_at_us: u64,
        deadline: Instant,
    ) -> Option<u64> {
        let clock = self.shared.clocks.get(&p.name);
        // A pool's grants are never re-dated (as a provider's with other
        // limits): a late one waits for a fresh grant.
        if !p.limits.is_empty() || !p.pool().is_empty() {
            return None;
        }
        let shared = &self.shared;
        let keys = shared.keys.throttle(&p.name);
        let sent = Instant::now();
        let call = run_script::<Vec<i64>>(
            &shared.pool,
            self.options.call_timeout,
            "throttle_redate",
            scripts::throttle_redate(
                &keys,
                ticket,
                granted_at_us,
                &BucketArgs::from(p),
                millis(IDLE_TTL),
            ),
        );
        let reply = match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, provider = %p.name, "re-dating a late grant failed");
                return None;
            }
            Err(_) => return None,
        };
        match reply[..] {
            [redated, now_us] => {
                let now_us = u64::try_from(now_us).unwrap_or(0);
                // The reply carries Redis's clock: a bound like an enqueue's.
                if let Some(clock) = clock {
                    clock.observe(sent, Instant::now(), now_us);
                }
                if redated != 1 {
                    return None;
                }
                tracing::debug!(provider = %p.name, "a late grant re-dated");
                if let Some(m) = &shared.metrics {
                    m.grant_redated(&p.name);
                }
                Some(now_us)
            }
            _ => {
                tracing::warn!(?reply, "throttle_redate: unexpected reply");
                None
            }
        }
    }
}

/// The fields of `p`'s other limits in its bucket hash (throttle/lib/bucket.lua).
/// The read of a bucket's fields for [`BucketStanding::read`].
fn bucket_fields(bucket: &str, p: &Provider) -> redis::Cmd {
    redis::cmd("HMGET")
        .arg(bucket)
        .arg("tokens")
        .arg("at")
        .arg("aimd")
        .arg("aimd_at")
        .arg(limit_fields(p))
        .to_owned()
}

/// A bucket of `p` (a provider, or a pool member as one) as it stands.
struct BucketStanding {
    tokens: f64,
    paused_ms: u64,
    effective_rate: f64,
    limits: Vec<LimitStats>,
}

impl BucketStanding {
    /// From the reply to [`bucket_fields`] at `now_us` (Redis `TIME`).
    fn read(p: &Provider, reply: &redis::Value, now_us: u64) -> Result<Self, ThrottleError> {
        let fields: Vec<Option<String>> = redis::from_redis_value_ref(reply)
            .map_err(|e| bad_reply::<ThrottleError>("HMGET", e))?;
        let field = |i: usize| fields.get(i).cloned().flatten();
        let (tokens, at, aimd, aimd_at): (Option<f64>, Option<u64>, Option<f64>, Option<u64>) = (
            field(0).and_then(|v| v.parse().ok()),
            field(1).and_then(|v| v.parse().ok()),
            field(2).and_then(|v| v.parse().ok()),
            field(3).and_then(|v| v.parse().ok()),
        );
        // The other limits (throttle/lib/bucket.lua's limits_read).
        let levels = p.limits.iter().enumerate().map(|(i, l)| {
            let cap = l.burst as f64;
            let parsed = field(4 + i).and_then(|v| {
                let (level, at) = v.split_once(' ')?;
                Some((level.parse::<f64>().ok()?, at.parse::<u64>().ok()?))
            });
            match parsed {
                Some((level, at)) => {
                    (level + now_us.saturating_sub(at) as f64 * l.rate / 1e6).min(cap)
                }
                None => cap,
            }
        });
        // throttle/lib/bucket.lua's aimd_rate.
        let aimd_rate = |t: u64| match (aimd, aimd_at) {
            (Some(e), Some(since)) => p
                .rate
                .min(e + t.saturating_sub(since) as f64 * p.rate / 1e7),
            _ => p.rate,
        };
        let burst = p.bucket_burst();
        let tokens = match (tokens, at) {
            (Some(t), Some(at)) if now_us > at => {
                (t + (now_us - at) as f64 * aimd_rate(at) / 1e6).min(burst)
            }
            (Some(t), Some(_)) => t,
            _ => burst,
        };
        // A paused bucket's `at` is its pause's end (throttle/lib/bucket.lua).
        let paused_ms = at.map_or(0, |at| at.saturating_sub(now_us) / 1000);
        let effective_rate = aimd_rate(now_us.max(at.unwrap_or(0)));
        Ok(Self {
            tokens,
            paused_ms,
            effective_rate,
            limits: limit_stats(p, tokens, effective_rate, levels),
        })
    }
}

fn limit_fields(p: &Provider) -> Vec<String> {
    let spec = scripts::limits_spec(&p.limits);
    spec.split(' ')
        .step_by(3)
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A throttler's liveness before its first heartbeat says its own (the
/// role's default).
const DEFAULT_LIVENESS: Duration = Duration::from_secs(3);

/// The throttler side of one provider: serves its queue from its bucket.
#[derive(Debug)]
pub struct Dispatcher {
    pool: Pool,
    keys: ThrottleKeys,
    throttler: String,
    bucket: BucketArgs,
    ready_ttl: Duration,
    timeout: Duration,
    /// For BLMOVE; dropped after a failure, opened again on the next wait.
    blocking: tokio::sync::Mutex<Option<Blocking>>,
    /// The liveness of this throttler's last heartbeat (ms; 0 before it).
    liveness_ms: AtomicU64,
}

impl Dispatcher {
    pub fn new(pool: Pool, keys: &KeySpace, provider: &Provider, throttler: &str) -> Self {
        Self {
            pool,
            keys: keys.throttle(&provider.name),
            throttler: throttler.to_owned(),
            bucket: BucketArgs::from(provider),
            ready_ttl: ready_ttl(provider),
            timeout: DEFAULT_TIMEOUT,
            blocking: tokio::sync::Mutex::new(None),
            liveness_ms: AtomicU64::new(0),
        }
    }

    pub fn keys(&self) -> &ThrottleKeys {
        &self.keys
    }
}

/// Makes the [`Dispatcher`]s of a throttler, on one pool.
#[derive(Debug, Clone)]
pub struct RedisDispatchers {
    pub pool: Pool,
    pub keys: KeySpace,
}

impl Dispatchers for RedisDispatchers {
    fn dispatcher(&self, provider: &Provider, throttler: &str) -> Arc<dyn Dispatch> {
        Arc::new(Dispatcher::new(
            self.pool.clone(),
            &self.keys,
            provider,
            throttler,
        ))
    }
}

#[async_trait]
impl Dispatch for Dispatcher {
    async fn pump(&self, limit: u32) -> Result<Pumped, ThrottleError> {
        let r: Vec<i64> = run_script(
            &self.pool,
            self.timeout,
            "throttle_grant",
            scripts::throttle_grant(
                &self.keys,
                &self.throttler,
                self.bucket.clone(),
                limit,
                micros(self.ready_ttl),
                u64::try_from(IDLE_TTL.as_millis()).unwrap_or(u64::MAX),
            ),
        )
        .await?;
        match r.as_slice() {
            &[granted, skipped, wait, more, capped] => Ok(Pumped {
                granted: granted.max(0) as u64,
                skipped: skipped.max(0) as u64,
                wait: (wait > 0).then(|| Duration::from_micros(wait as u64)),
                more: more == 1,
                capped: (capped > 0).then(|| Duration::from_micros(capped as u64)),
            }),
            other => Err(bad_reply("throttle_grant", other)),
        }
    }

    /// BLMOVE on a connection of its own, into this throttler's processing list.
    async fn wait_for_ticket(&self, block: Duration) -> Result<bool, ThrottleError> {
        let mut blocking = self.blocking.lock().await;
        let conn = match blocking.as_mut() {
            Some(conn) => conn,
            None => blocking.insert(blocking_connection(&self.pool).await?),
        };
        let mut cmd = redis::cmd("BLMOVE");
        cmd.arg(&self.keys.queue)
            .arg(self.keys.processing(&self.throttler))
            .arg("LEFT")
            .arg("RIGHT")
            .arg(block.as_secs_f64());
        match call::dedicated::<Option<String>>(conn, block + self.timeout, "blmove", &cmd).await {
            Ok(moved) => Ok(moved.is_some()),
            Err(e) => {
                *blocking = None;
                Err(e.into())
            }
        }
    }

    async fn heartbeat(&self, liveness: Duration) -> Result<Vec<String>, ThrottleError> {
        self.liveness_ms.store(millis(liveness), Ordering::Relaxed);
        shared_script(
            &self.pool,
            self.timeout,
            "liveness_heartbeat",
            scripts::liveness_heartbeat(self.keys.members(), &self.throttler, millis(liveness)),
        )
        .await
    }

    async fn reclaim(&self, dead: &str) -> Result<Option<u64>, ThrottleError> {
        // Kept as long as this throttler's own liveness says (throttlers of
        // a deployment share theirs).
        let liveness = match self.liveness_ms.load(Ordering::Relaxed) {
            0 => millis(DEFAULT_LIVENESS),
            ms => ms,
        };
        let forget_ms = liveness * u64::from(LAPSED_KEPT);
        let r = self.reclaim_of(dead, Reclaim::Lapsed { forget_ms }).await?;
        Ok(u64::try_from(r).ok())
    }

    async fn retire(&self) -> Result<u64, ThrottleError> {
        Ok(self
            .reclaim_of(&self.throttler, Reclaim::Stopping)
            .await?
            .max(0) as u64)
    }
}

impl Dispatcher {
    /// `liveness_reclaim.lua` on `member`'s processing list: how many tickets
    /// went back, -1 when it is alive (and `force` is false).
    async fn reclaim_of(&self, member: &str, reclaim: Reclaim) -> Result<i64, ThrottleError> {
        shared_script(
            &self.pool,
            self.timeout,
            "liveness_reclaim",
            scripts::liveness_reclaim(
                self.keys.members(),
                member,
                &self.keys.processing(member),
                reclaim,
            ),
        )
        .await
    }
}
