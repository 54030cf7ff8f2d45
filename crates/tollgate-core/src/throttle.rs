//! The provider throttle: the [`Throttle`] interface both modes implement, and
//! the in-process token bucket ([`MemoryThrottle`]). The wrapper that makes every
//! call of a provider client pass the throttle is `tollgate_providers`'
//! `ThrottledClient`.
//!
//! Semantics (docs/src/throttling.md): one token bucket per provider of
//! `burst` tokens refilled at `rate` per second; a caller gets its slot as soon as
//! the bucket allows, in arrival order, or fails after `max_wait` with
//! [`ThrottleError::Timeout`]; a call that gave up never burns a token.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, Fairness, LimitKind, Provider, ProviderLimit, FIRST_BACKOFF};
use crate::duration;
use crate::error::StoreError;
use crate::fair::FairQueue;
pub use crate::fair::{Position, Share};
use crate::id::RequestId;
use crate::lock;
use crate::metrics::Metrics;

/// A slot granted by the throttle: the caller may now make one provider call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub provider: String,
    pub request_id: RequestId,
    /// How long the caller waited, from `acquire` to resuming.
    pub waited: Duration,
    /// When the token was taken, in µs since the Unix epoch, on the throttle's
    /// clock (Redis `TIME` in distributed mode, the process clock in-process).
    pub granted_at_us: u64,
    /// The slot counts against its user's `max_in_flight` until
    /// [`Throttle::done`] (or its hold ends): `None` when the user has no cap.
    pub held: Option<Held>,
    /// The grant's slot of its provider's `max_concurrent`, held until
    /// [`Throttle::done`] (renewed meanwhile; a holder that dies lets it
    /// go after `SLOT_LEASE`): `None` when the provider has no cap.
    pub slot: Option<String>,
    /// When the grant becomes late (on this process's monotonic clock): a call
    /// not sent by then must not be sent on it, since calls granted while it
    /// waited may have gone out already (a pause between the grant and the
    /// send, a slow delivery). Its caller ends it with [`Throttle::done`]
    /// unused and waits for a fresh one; its token is lost, not returned (see
    /// `ThrottledClient`). `None`: the grant never becomes late.
    pub use_by: Option<Instant>,
    /// What it took from its provider's token limits (its waiter's weight;
    /// 1 for a provider without any): [`Throttle::usage`] settles it.
    pub weight: u64,
}

/// A grant is late past this age, or past one token's time at its provider's
/// rate if that is shorter ([`late_bound`]); `RedisThrottleOptions::late_grant`
/// and [`MemoryThrottle::with_late_grant`] change it.
pub const LATE_GRANT: Duration = Duration::from_secs(1);

/// The shortest age at which a grant counts as late, whatever the rate: below
/// it, the delivery of a grant (a pub/sub message and a wake-up) is not
/// reliably faster, and grants would go unused for nothing.
pub const MIN_LATE_GRANT: Duration = Duration::from_millis(2);

/// The age past which a grant of a provider at `rate` is late: `late_grant`,
/// or one token's time (1/rate) if shorter, never below [`MIN_LATE_GRANT`].
/// Used within 1/rate of being made, grants bunch at the upstream by at most
/// one call: it never sees more than burst + rate·t + 1.
pub fn late_bound(rate: f64, late_grant: Duration) -> Duration {
    let token = if rate > 0.0 && rate.is_finite() {
        Duration::from_secs_f64((1.0 / rate).min(3600.0))
    } else {
        late_grant
    };
    late_grant.min(token).max(MIN_LATE_GRANT)
}

/// The age past which a grant of provider `p` is late: its
/// `late_allowance` when it has one (the bucket then grants from
/// [`Provider::bucket_burst`]), else [`late_bound`]; never past `late_grant`
/// nor below [`MIN_LATE_GRANT`].
pub fn late_of(p: &Provider, late_grant: Duration) -> Duration {
    match p.late_allowance {
        Some(d) => d.min(late_grant).max(MIN_LATE_GRANT),
        None => late_bound(p.rate, late_grant),
    }
}

/// The longest a grant holds its slot of `max_concurrent` when its caller
/// never says its call ended (it dropped the grant): on Redis, its renewals
/// stop then; in process, the slot frees itself.
pub const SLOT_MAX_HOLD: Duration = Duration::from_secs(600);

/// A slot that counts against a user's cap: what [`Throttle::done`] frees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub user: String,
    pub ticket: String,
}

/// Who asks for a slot: the queue it joins (its user's) and its user's share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    pub request_id: RequestId,
    /// The user whose queue the waiter joins; callers without one share the
    /// anonymous queue `""`.
    pub user: String,
    pub share: Share,
    /// What its call weighs in the provider's token limits (its operation's
    /// `weight`): a grant takes that much of each, and one request of each
    /// request limit. At least 1; ignored by a provider without token limits.
    pub weight: u64,
}

impl Waiter {
    /// A waiter of no user (weight 1, no cap): all such waiters share one queue.
    pub fn anonymous(request_id: &RequestId) -> Self {
        Self {
            request_id: request_id.clone(),
            user: String::new(),
            share: Share::default(),
            weight: 1,
        }
    }

    /// A waiter of `user`, on `share`.
    pub fn of(request_id: &RequestId, user: &str, share: Share) -> Self {
        Self {
            request_id: request_id.clone(),
            user: user.to_owned(),
            share,
            weight: 1,
        }
    }

    /// The same waiter, for a call of `weight` (at least 1).
    #[must_use]
    pub fn weighing(mut self, weight: u64) -> Self {
        self.weight = weight.max(1);
        self
    }
}

/// Why no slot was granted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ThrottleError {
    /// No token within `max_wait`. Nothing was spent.
    #[error("provider {provider}: no slot within {}", duration::format(*max_wait))]
    Timeout {
        provider: String,
        max_wait: Duration,
    },
    #[error("unknown provider {name:?} (providers: {known})")]
    UnknownProvider { name: String, known: String },
    /// The call weighs more than a token limit of the provider holds at
    /// once: it could never be granted, so it is refused before it waits.
    #[error("provider {provider}: a call of weight {weight} is more than its token limit {limit} holds at once ({most})")]
    TooHeavy {
        provider: String,
        weight: u64,
        limit: String,
        most: u64,
    },
    /// The throttle's store failed.
    #[error("throttle store: {0}")]
    Store(#[from] StoreError),
}

impl ThrottleError {
    /// Worth retrying: the same call may succeed later (see [`StoreError`]). A
    /// timeout is: the provider may have a slot free by then.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Timeout { .. } => true,
            Self::Store(e) => e.is_transient(),
            Self::UnknownProvider { .. } | Self::TooHeavy { .. } => false,
        }
    }

    /// The error for a provider name missing from `providers`.
    pub fn unknown_provider<'a>(name: &str, providers: impl Iterator<Item = &'a str>) -> Self {
        Self::UnknownProvider {
            name: name.to_owned(),
            known: providers.collect::<Vec<_>>().join(", "),
        }
    }

    /// `Err(TooHeavy)` when a call of `weight` could never be granted by
    /// `provider` (a token limit's burst is less).
    pub fn check_weight(provider: &Provider, weight: u64) -> Result<(), Self> {
        match provider
            .limits
            .iter()
            .find(|l| l.kind == LimitKind::Tokens && weight > l.burst)
        {
            Some(l) => Err(Self::TooHeavy {
                provider: provider.name.clone(),
                weight,
                limit: l.name(),
                most: l.burst,
            }),
            None => Ok(()),
        }
    }
}

/// What [`Throttle::usage`] did to a provider's token limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// The call used what it weighed (or the provider has no token limit).
    Matched,
    /// It used less: this much went back (each limit at most to full).
    GivenBack(u64),
    /// It used more: this much more was taken (each limit at most to empty).
    Taken(u64),
}

impl Usage {
    /// The difference between a grant's `weight` and what its call `used`.
    pub fn of(weight: u64, used: u64) -> Self {
        match weight.cmp(&used) {
            std::cmp::Ordering::Equal => Self::Matched,
            std::cmp::Ordering::Greater => Self::GivenBack(weight - used),
            std::cmp::Ordering::Less => Self::Taken(used - weight),
        }
    }
}

/// One interface, two modes (in-process and Redis): a provider client never
/// knows which one it runs on.
#[async_trait]
pub trait Throttle: Send + Sync + std::fmt::Debug {
    /// Waits for a slot of `provider`, at most `max_wait`, in the anonymous
    /// queue (see [`Throttle::acquire_as`]).
    async fn acquire(
        &self,
        provider: &str,
        request_id: &RequestId,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError> {
        self.acquire_as(provider, &Waiter::anonymous(request_id), max_wait)
            .await
    }

    /// Waits for a slot of `provider`, at most `max_wait`, in `waiter`'s
    /// user's queue (fair providers; a FIFO provider has one queue). Dropping
    /// the future cancels the wait; a token taken for it meanwhile goes back
    /// to the bucket.
    async fn acquire_as(
        &self,
        provider: &str,
        waiter: &Waiter,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError>;

    /// The call made with `grant` ended: its slot no longer counts against its
    /// user's `max_in_flight`. Nothing to do for a grant that holds nothing.
    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError>;

    /// Before the process exits: lets the cancels of dropped waits finish, at
    /// most `limit`. Returns how many did not (their tickets then expire at
    /// their deadline). Nothing to do in process.
    async fn drain(&self, _limit: Duration) -> usize {
        0
    }

    /// Where the call of `request_id` by `user` stands in `provider`'s
    /// queue (its user's queue on a fair provider, the one queue on a FIFO
    /// one); `None` when it is not waiting there (not queued yet, granted,
    /// or gone). A read: it changes nothing.
    async fn position(
        &self,
        provider: &str,
        user: &str,
        request_id: &RequestId,
    ) -> Result<Option<Position>, ThrottleError>;

    /// Every configured provider's bucket and waiters, by name.
    async fn stats(&self) -> Result<Vec<ProviderStats>, ThrottleError>;

    /// The upstream refused a call of `provider` (a 429, or a 503 with
    /// `Retry-After`): its bucket grants nothing, to any caller of any pod,
    /// for `retry_after` from now, or when it is `None` for a back-off of
    /// [`FIRST_BACKOFF`] doubled for each refusal in a row; either cut to
    /// the provider's `max_pause`. A pause never shortens one in force; the
    /// bucket refills from its end (no burst into an upstream that just
    /// refused). In one atomic step with the grants' (Redis: `throttle_pause.lua`).
    async fn pause(
        &self,
        provider: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError>;

    /// The call made with `grant` used `used` tokens, as its answer reported:
    /// the difference from its weight goes back to its provider's token
    /// limits, or is taken from them, in one atomic step (never below empty,
    /// never past full). Nothing to do for a provider without token limits.
    /// Sent once: a lost answer leaves the weight standing, or adjusted.
    async fn usage(&self, grant: &Grant, used: u64) -> Result<Usage, ThrottleError>;
}

/// A provider's pause, as [`Throttle::pause`] left it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pause {
    /// How long from now the bucket grants nothing (zero: not paused, as
    /// after a `Retry-After: 0`).
    pub left: Duration,
    /// Back-offs in a row (refusals that named no pause).
    pub strikes: u32,
    /// The rate the bucket refills at after it: `rate`, or less on an
    /// adaptive provider.
    pub rate: f64,
}

/// The back-off after `strikes` refusals in a row that named no pause:
/// [`FIRST_BACKOFF`] doubled each time, at most `longest`.
pub fn backoff(strikes: u32, longest: Duration) -> Duration {
    let doublings = strikes.saturating_sub(1).min(40);
    FIRST_BACKOFF
        .checked_mul(1u32 << doublings.min(31))
        .unwrap_or(longest)
        .min(longest)
}

/// A provider's throttle as it stands: for metrics and the operations view.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ProviderStats {
    pub provider: String,
    /// Tokens per second.
    pub rate: f64,
    pub burst: u64,
    /// Tokens in the bucket now.
    pub tokens: f64,
    /// Calls waiting for a slot.
    pub waiters: u64,
    /// Users with calls waiting (fair providers; 1 or 0 for a FIFO one).
    pub users: u64,
    /// Throttlers alive; `None` in process (the bucket grants by itself).
    pub throttlers: Option<u64>,
    /// How long the bucket still grants nothing after an upstream refusal
    /// ([`Throttle::pause`]), in ms; 0 when it is not paused.
    pub paused_ms: u64,
    /// The rate the bucket refills at now: `rate`, or less on an adaptive
    /// provider after a refusal (AIMD).
    pub effective_rate: f64,
    /// Every limit's bucket: the request bucket (`rate`, `burst`) first,
    /// then the provider's other `limits`.
    pub limits: Vec<LimitStats>,
}

/// One limit's bucket of a provider, as it stands.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LimitStats {
    /// `rate` (the simple form), `requests/1m`, `tokens/1m`.
    pub limit: String,
    /// What it holds now (requests, or tokens of weight).
    pub available: f64,
    pub burst: f64,
    /// What it refills at now, per second.
    pub rate: f64,
}

/// The stats of every limit of `p`: its request bucket holding `tokens` and
/// refilling at `effective_rate`, then its other `limits` at `levels`.
pub fn limit_stats(
    p: &Provider,
    tokens: f64,
    effective_rate: f64,
    levels: impl IntoIterator<Item = f64>,
) -> Vec<LimitStats> {
    let mut out = vec![LimitStats {
        limit: p.rate_name(),
        available: tokens,
        burst: p.bucket_burst(),
        rate: effective_rate,
    }];
    out.extend(
        p.limits
            .iter()
            .zip(levels)
            .map(|(l, available)| LimitStats {
                limit: l.name(),
                available,
                burst: l.burst as f64,
                rate: l.rate,
            }),
    );
    out
}

/// An adaptive bucket's rate at `t`: `e` at `since`, growing back by a tenth
/// of `rate` per second, up to `rate` (the same as `lua/lib/bucket.lua`).
fn aimd_rate(aimd: Option<(f64, Instant)>, rate: f64, t: Instant) -> f64 {
    match aimd {
        None => rate,
        Some((e, since)) => {
            rate.min(e + t.saturating_duration_since(since).as_secs_f64() * rate / 10.0)
        }
    }
}

/// What one [`Dispatch::pump`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pumped {
    pub granted: u64,
    pub skipped: u64,
    /// `Some(d)`: the bucket is dry with tickets left; the next token is due in `d`.
    pub wait: Option<Duration>,
    /// The grant limit stopped the call with tickets left: pump again.
    pub more: bool,
    /// `Some(d)`: only users held back by their `max_in_flight` have tickets
    /// left; the first of their slots frees itself (a caller that never said
    /// its call ended) in `d`: wait for a ticket no longer than that.
    pub capped: Option<Duration>,
}

/// The throttler role's side of one provider, where grants are made apart from
/// the waiters (Redis): serves the provider's queue of tickets from its bucket.
/// A throttler's **liveness** is a record it renews; the tickets it popped stay
/// its own while that record lives, and go back to the queue when it lapses.
#[async_trait]
pub trait Dispatch: Send + Sync + std::fmt::Debug {
    /// Grants up to `limit` tickets, oldest first, while the bucket has tokens.
    async fn pump(&self, limit: u32) -> Result<Pumped, ThrottleError>;

    /// Waits until a ticket is queued, at most `block`, and takes it into this
    /// throttler's own list. Returns whether a ticket came.
    async fn wait_for_ticket(&self, block: Duration) -> Result<bool, ThrottleError>;

    /// Renews this throttler's liveness for `liveness`; returns the throttlers
    /// whose liveness lapsed.
    async fn heartbeat(&self, liveness: Duration) -> Result<Vec<String>, ThrottleError>;

    /// Puts a lapsed throttler's tickets back at the head of the queue. Returns
    /// how many, or `None` when it turned out to be alive.
    async fn reclaim(&self, lapsed: &str) -> Result<Option<u64>, ThrottleError>;

    /// This throttler stops: its tickets go back to the queue, its liveness ends.
    async fn release(&self) -> Result<u64, ThrottleError>;
}

/// Makes the [`Dispatch`] of each provider for a throttler.
pub trait Dispatchers: Send + Sync + std::fmt::Debug {
    /// The dispatcher of `provider` for the throttler named `throttler`.
    fn dispatcher(&self, provider: &Provider, throttler: &str) -> Arc<dyn Dispatch>;
}

/// A provider's other `limits` (as `BucketState::levels` holds them).
fn limits(p: &Provider) -> std::slice::Iter<'_, ProviderLimit> {
    p.limits.iter()
}

/// Microseconds since the Unix epoch on the process clock.
fn wall_us() -> u64 {
    SystemClock.now_us()
}

/// The in-process throttle: one exact token bucket per provider.
///
/// A caller that finds the bucket non-empty and nobody queued takes a token
/// without waiting. Otherwise it queues in its user's queue of the provider's
/// [`FairQueue`] (a FIFO provider puts every caller in one queue); one driver
/// task per busy bucket hands tokens to the queue's head, sleeping exactly
/// until the next token is due (no polling), skipping callers that gave up.
/// The driver exits when the queue drains.
#[derive(Debug)]
pub struct MemoryThrottle {
    buckets: BTreeMap<String, Arc<Bucket>>,
    /// See [`late_bound`].
    late_grant: Duration,
}

#[derive(Debug)]
struct Bucket {
    rate: f64,
    /// [`Provider::bucket_burst`].
    burst: f64,
    /// [`Provider::late_allowance`].
    late_allowance: Option<Duration>,
    /// [`Provider::max_concurrent`].
    max_concurrent: Option<u32>,
    /// [`Provider::adaptive`].
    adaptive: bool,
    fairness: Fairness,
    max_pause: Duration,
    /// Its provider: its other `limits` are `BucketState::levels`.
    provider: Provider,
    state: Mutex<BucketState>,
    /// Wakes a sleeping driver when a token is handed back or a slot ends.
    handed_back: Notify,
    /// Where handed-back tokens are counted.
    metrics: Option<(Arc<Metrics>, String)>,
}

#[derive(Debug)]
struct BucketState {
    tokens: f64,
    /// When `tokens` was counted; ahead of now while the bucket is paused
    /// ([`Throttle::pause`]): it refills from then.
    at: Instant,
    /// The end of the last pause, and the back-offs in a row.
    paused_until: Option<Instant>,
    strikes: u32,
    /// The tickets holding a slot of `max_concurrent`.
    /// (ticket -> when it frees itself: a grant dropped without `done`
    /// holds it [`SLOT_MAX_HOLD`] at most.)
    slots: HashMap<u64, Instant>,
    /// An adaptive bucket's rate after its last refusal, and from when.
    aimd: Option<(f64, Instant)>,
    /// What each of the provider's other `limits` holds, as of `levels_at`
    /// (never paused: they refill from then).
    levels: Vec<f64>,
    levels_at: Instant,
    queue: FairQueue<Slot>,
    driving: bool,
}

/// A queued caller: the request it waits for, and where its grant goes (the
/// grant's time in µs since the epoch, and on the monotonic clock).
#[derive(Debug)]
struct Slot {
    request_id: RequestId,
    /// What its grant takes from the token limits.
    weight: u64,
    tx: oneshot::Sender<(u64, Instant)>,
}

fn open(slot: &Slot) -> bool {
    !slot.tx.is_closed()
}

impl Bucket {
    fn new(p: &Provider, metrics: Option<&Arc<Metrics>>) -> Self {
        Self {
            rate: p.rate,
            burst: p.bucket_burst(),
            late_allowance: p.late_allowance,
            max_concurrent: p.max_concurrent,
            adaptive: p.adaptive,
            fairness: p.fairness,
            max_pause: p.max_pause,
            provider: p.clone(),
            state: Mutex::new(BucketState {
                tokens: p.bucket_burst(),
                at: Instant::now(),
                paused_until: None,
                strikes: 0,
                slots: HashMap::new(),
                aimd: None,
                levels: p.limits.iter().map(|l| l.burst as f64).collect(),
                levels_at: Instant::now(),
                queue: FairQueue::default(),
                driving: false,
            }),
            handed_back: Notify::new(),
            metrics: metrics.map(|m| (Arc::clone(m), p.name.clone())),
        }
    }

    /// The queue `waiter` joins and the share it counts with: its own on a
    /// fair provider, the one shared queue (no weight, no cap) on a FIFO one.
    fn queue_of<'w>(&self, waiter: &'w Waiter) -> (&'w str, Share) {
        match self.fairness {
            Fairness::Fair => (&waiter.user, waiter.share),
            Fairness::Fifo => ("", Share::default()),
        }
    }

    fn refill(&self, st: &mut BucketState) {
        let now = Instant::now();
        let dt = now.saturating_duration_since(st.levels_at).as_secs_f64();
        for (level, l) in st.levels.iter_mut().zip(&self.provider.limits) {
            *level = (*level + dt * l.rate).min(l.burst as f64);
        }
        st.levels_at = st.levels_at.max(now);
        if now <= st.at {
            return; // paused until `at`: it refills from then
        }
        let dt = now.saturating_duration_since(st.at).as_secs_f64();
        let rate = aimd_rate(st.aimd, self.rate, st.at);
        st.tokens = (st.tokens + dt * rate).min(self.burst);
        st.at = now;
    }

    /// Until one whole token is due, rounded up to the next µs (a pause's
    /// end included).
    fn until_next(&self, st: &BucketState) -> Duration {
        let rate = aimd_rate(st.aimd, self.rate, Instant::now().max(st.at));
        let secs = ((1.0 - st.tokens).max(0.0) / rate).min(3600.0);
        st.at.saturating_duration_since(Instant::now())
            + Duration::from_micros((secs * 1e6).ceil() as u64)
    }

    /// Whether every other limit holds what a grant of `weight` takes
    /// (refilled: [`Bucket::refill`]).
    fn fits(&self, st: &BucketState, weight: u64) -> bool {
        limits(&self.provider)
            .zip(&st.levels)
            .all(|(l, level)| *level >= l.take(weight) as f64)
    }

    /// Until every other limit holds what a grant of `weight` takes.
    fn until_fits(&self, st: &BucketState, weight: u64) -> Duration {
        limits(&self.provider)
            .zip(&st.levels)
            .map(|(l, level)| {
                let short = (l.take(weight) as f64 - level).max(0.0);
                Duration::from_micros(((short / l.rate).min(3600.0) * 1e6).ceil() as u64)
            })
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// A grant of `weight` takes from every other limit (`sign` 1.0), or
    /// gives it back (-1.0; at most to full).
    fn take(&self, st: &mut BucketState, weight: u64, sign: f64) {
        for (l, level) in limits(&self.provider).zip(st.levels.iter_mut()) {
            *level = (*level - sign * l.take(weight) as f64).min(l.burst as f64);
        }
    }

    /// See [`Throttle::usage`].
    fn usage(&self, weight: u64, used: u64) -> Usage {
        let usage = Usage::of(weight, used);
        let delta = match usage {
            Usage::Matched => return usage,
            Usage::GivenBack(n) => n as f64,
            Usage::Taken(n) => -(n as f64),
        };
        let mut st = lock(&self.state);
        self.refill(&mut st);
        for (l, level) in self.provider.limits.iter().zip(st.levels.iter_mut()) {
            if l.kind == LimitKind::Tokens {
                *level = (*level + delta).clamp(0.0, l.burst as f64);
            }
        }
        drop(st);
        if delta > 0.0 {
            self.handed_back.notify_one();
        }
        usage
    }

    /// A token back: not while the bucket is paused (the pause emptied it;
    /// the token would be granted before the pause ends); the other limits
    /// get back what the grant of `weight` took.
    fn give_back(self: &Arc<Self>, held: Option<(&str, u64)>, weight: u64) {
        let mut st = lock(&self.state);
        self.refill(&mut st);
        let paused = st.at > Instant::now();
        if !paused {
            st.tokens = (st.tokens + 1.0).min(self.burst);
        }
        self.take(&mut st, weight, -1.0);
        if let Some((user, ticket)) = held {
            st.slots.remove(&ticket);
            st.queue.done(user, ticket);
        }
        drop(st);
        self.handed_back.notify_one();
        if let (Some((metrics, provider)), false) = (&self.metrics, paused) {
            metrics.token_returned(provider, "cancelled");
        }
    }

    /// See [`Throttle::pause`]; the same rules as `throttle_pause.lua`.
    fn pause(&self, retry_after: Option<Duration>) -> Pause {
        let mut st = lock(&self.state);
        self.refill(&mut st);
        let now = Instant::now();
        let target = match (retry_after, st.paused_until) {
            (Some(d), _) => now + d.min(self.max_pause),
            (None, Some(last)) if now < last => last,
            (None, last) => {
                let in_a_row = st.strikes > 0
                    && last.is_some_and(|l| now < l + backoff(st.strikes, self.max_pause));
                st.strikes = if in_a_row { st.strikes + 1 } else { 1 };
                now + backoff(st.strikes, self.max_pause)
            }
        };
        let ends = target.max(st.at);
        let strikes = st.strikes;
        let mut rate = aimd_rate(st.aimd, self.rate, now.max(st.at));
        // A refusal while a pause is in force (its calls in flight) halves
        // nothing more.
        if self.adaptive && st.paused_until.is_none_or(|last| now >= last) {
            rate = (rate / 2.0).max(self.rate / 100.0);
            st.aimd = Some((rate, ends.max(now)));
        }
        if ends <= now {
            return Pause {
                left: Duration::ZERO,
                strikes,
                rate,
            };
        }
        st.tokens = 0.0;
        st.at = ends;
        st.paused_until = Some(ends);
        drop(st);
        // A sleeping driver sleeps on to the pause's end instead.
        self.handed_back.notify_one();
        Pause {
            left: ends - now,
            strikes,
            rate,
        }
    }

    /// Whether every slot of `max_concurrent` is held.
    fn full(&self, st: &mut BucketState) -> bool {
        let Some(cap) = self.max_concurrent else {
            return false;
        };
        let now = Instant::now();
        st.slots.retain(|_, until| *until > now);
        st.slots.len() >= cap as usize
    }

    /// A grant's slot of `max_concurrent`, if the provider has one.
    fn take_slot(&self, st: &mut BucketState, ticket: u64) {
        if self.max_concurrent.is_some() {
            st.slots.insert(ticket, Instant::now() + SLOT_MAX_HOLD);
        }
    }

    /// A slot's call ended: its user may be back in the rotation.
    fn end(self: &Arc<Self>, user: &str, ticket: u64) {
        let mut st = lock(&self.state);
        st.slots.remove(&ticket);
        st.queue.done(user, ticket);
        self.kick(&mut st);
        drop(st);
        self.handed_back.notify_one();
    }

    /// Starts the driver if there are waiters and none runs.
    fn kick(self: &Arc<Self>, st: &mut BucketState) {
        if !st.driving && !st.queue.is_empty() {
            st.driving = true;
            tokio::spawn(Arc::clone(self).drive());
        }
    }

    /// Serves the queue until it is empty.
    async fn drive(self: Arc<Self>) {
        loop {
            let wait = {
                let mut st = lock(&self.state);
                self.refill(&mut st);
                let now = Instant::now();
                let capped_until = st.queue.expire(now);
                loop {
                    let Some(head) = st.queue.head(now, open).0 else {
                        match capped_until {
                            // Everyone waiting is at their cap: until the
                            // first slot frees itself (or one ends).
                            Some(at) => break at.saturating_duration_since(now),
                            None => {
                                st.driving = false;
                                return;
                            }
                        }
                    };
                    let weight = st.queue.first().map_or(1, |slot| slot.weight);
                    if st.tokens < 1.0 || !self.fits(&st, weight) {
                        break self.until_next(&st).max(self.until_fits(&st, weight));
                    }
                    if self.full(&mut st) {
                        // Until a slot ends (which wakes this driver), or
                        // the first frees itself.
                        let first = st.slots.values().min().copied();
                        break first.map_or(Duration::from_secs(3600), |until| {
                            until.saturating_duration_since(now)
                        });
                    }
                    if let Some(slot) = st.queue.grant(&head, now) {
                        st.tokens -= 1.0;
                        self.take(&mut st, slot.weight, 1.0);
                        self.take_slot(&mut st, head.ticket);
                        if slot.tx.send((wall_us(), Instant::now())).is_err() {
                            // The caller left meanwhile.
                            st.tokens += 1.0;
                            self.take(&mut st, slot.weight, -1.0);
                            st.slots.remove(&head.ticket);
                            st.queue.done(&head.user, head.ticket);
                        }
                    }
                }
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.handed_back.notified() => {}
            }
        }
    }
}

/// A queued caller's receiver. Dropped without having delivered its grant (a
/// timeout, or the caller's future dropped), it hands a token that arrived
/// meanwhile back to the bucket, if the grant is younger than `late`: a call
/// that gave up never burns a token. An older one's token is lost, as a late
/// grant's is (given back, it would add to the tokens granted since).
struct Pending {
    bucket: Arc<Bucket>,
    user: String,
    ticket: u64,
    rx: Option<oneshot::Receiver<(u64, Instant)>>,
    late: Duration,
    weight: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if let Ok((_, made)) = rx.try_recv() {
                if made.elapsed() <= self.late {
                    self.bucket
                        .give_back(Some((&self.user, self.ticket)), self.weight);
                } else {
                    self.bucket.end(&self.user, self.ticket);
                    if let Some((metrics, provider)) = &self.bucket.metrics {
                        metrics.late_grant(provider);
                    }
                }
            }
        }
    }
}

impl MemoryThrottle {
    /// One bucket per provider of `config`, each starting full.
    pub fn new(config: &Config) -> Self {
        Self::with_providers(config.providers())
    }

    /// The same, counting in `metrics` the tokens handed back by callers
    /// that gave up.
    pub fn metered(config: &Config, metrics: Arc<Metrics>) -> Self {
        Self::build(config.providers(), Some(&metrics))
    }

    pub fn with_providers<'a>(providers: impl IntoIterator<Item = &'a Provider>) -> Self {
        Self::build(providers, None)
    }

    fn build<'a>(
        providers: impl IntoIterator<Item = &'a Provider>,
        metrics: Option<&Arc<Metrics>>,
    ) -> Self {
        Self {
            buckets: providers
                .into_iter()
                .map(|p| (p.name.clone(), Arc::new(Bucket::new(p, metrics))))
                .collect(),
            late_grant: LATE_GRANT,
        }
    }

    /// Grants are late past `late_grant` of age (or 1/rate if shorter, see
    /// [`late_bound`]) instead of [`LATE_GRANT`].
    pub fn with_late_grant(mut self, late_grant: Duration) -> Self {
        self.late_grant = late_grant;
        self
    }

    /// Callers queued for `provider` right now (for tests and metrics).
    pub fn queued(&self, provider: &str) -> usize {
        self.buckets
            .get(provider)
            .map(|b| lock(&b.state).queue.waiting(open).0 as usize)
            .unwrap_or(0)
    }

    fn bucket(&self, provider: &str) -> Result<&Arc<Bucket>, ThrottleError> {
        self.buckets.get(provider).ok_or_else(|| {
            ThrottleError::unknown_provider(provider, self.buckets.keys().map(String::as_str))
        })
    }
}

#[async_trait]
impl Throttle for MemoryThrottle {
    async fn stats(&self) -> Result<Vec<ProviderStats>, ThrottleError> {
        Ok(self
            .buckets
            .iter()
            .map(|(name, b)| {
                let mut st = lock(&b.state);
                b.refill(&mut st);
                let (waiters, users) = st.queue.waiting(open);
                let effective_rate = aimd_rate(st.aimd, b.rate, Instant::now().max(st.at));
                ProviderStats {
                    provider: name.clone(),
                    rate: b.rate,
                    burst: b.burst as u64,
                    tokens: st.tokens,
                    waiters,
                    users,
                    throttlers: None,
                    paused_ms: u64::try_from(
                        st.at.saturating_duration_since(Instant::now()).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                    effective_rate,
                    limits: limit_stats(
                        &b.provider,
                        st.tokens,
                        effective_rate,
                        st.levels.iter().copied(),
                    ),
                }
            })
            .collect())
    }

    async fn acquire_as(
        &self,
        provider: &str,
        waiter: &Waiter,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError> {
        let started = Instant::now();
        let bucket = self.bucket(provider)?;
        ThrottleError::check_weight(&bucket.provider, waiter.weight)?;
        let weight = waiter.weight.max(1);
        let (user, share) = bucket.queue_of(waiter);
        let late = match bucket.late_allowance {
            Some(d) => d.min(self.late_grant).max(MIN_LATE_GRANT),
            None => late_bound(bucket.rate, self.late_grant),
        };
        let grant = |(granted_at_us, made): (u64, Instant), ticket: u64| Grant {
            provider: provider.to_owned(),
            request_id: waiter.request_id.clone(),
            waited: started.elapsed(),
            granted_at_us,
            held: (share.max_in_flight.is_some() || bucket.max_concurrent.is_some()).then(|| {
                Held {
                    user: user.to_owned(),
                    ticket: ticket.to_string(),
                }
            }),
            slot: bucket.max_concurrent.map(|_| ticket.to_string()),
            use_by: Some(made + late),
            weight,
        };
        let (rx, ticket) = {
            let mut st = lock(&bucket.state);
            bucket.refill(&mut st);
            let now = Instant::now();
            if st.queue.is_empty()
                && st.tokens >= 1.0
                && !bucket.full(&mut st)
                && bucket.fits(&st, weight)
                && st.queue.below_cap(user, &share, now)
            {
                // Through the queue, so that the slot counts against the cap.
                let (tx, mut rx) = oneshot::channel();
                let slot = Slot {
                    request_id: waiter.request_id.clone(),
                    weight,
                    tx,
                };
                let ticket = st.queue.push(user, share, slot);
                if let Some(head) = st.queue.head(now, open).0 {
                    if let Some(slot) = st.queue.grant(&head, now) {
                        st.tokens -= 1.0;
                        bucket.take(&mut st, weight, 1.0);
                        bucket.take_slot(&mut st, head.ticket);
                        let _ = slot.tx.send((wall_us(), Instant::now()));
                    }
                }
                if let Ok(at) = rx.try_recv() {
                    return Ok(grant(at, ticket));
                }
                return Err(StoreError::backend("the fast path lost its own slot").into());
            }
            let (tx, rx) = oneshot::channel();
            let slot = Slot {
                request_id: waiter.request_id.clone(),
                weight,
                tx,
            };
            let ticket = st.queue.push(user, share, slot);
            bucket.kick(&mut st);
            (rx, ticket)
        };
        let mut pending = Pending {
            bucket: Arc::clone(bucket),
            user: user.to_owned(),
            ticket,
            rx: Some(rx),
            late,
            weight,
        };
        let timeout = || ThrottleError::Timeout {
            provider: provider.to_owned(),
            max_wait,
        };
        let Some(rx) = pending.rx.as_mut() else {
            return Err(timeout());
        };
        match tokio::time::timeout(max_wait, rx).await {
            Ok(Ok(at)) => {
                pending.rx = None;
                Ok(grant(at, ticket))
            }
            Ok(Err(_)) => Err(StoreError::backend("the bucket's driver stopped").into()),
            // Dropping `pending` hands back a token that raced the timeout.
            Err(_) => Err(timeout()),
        }
    }

    async fn position(
        &self,
        provider: &str,
        user: &str,
        request_id: &RequestId,
    ) -> Result<Option<Position>, ThrottleError> {
        let bucket = self.bucket(provider)?;
        let probe = Waiter::of(request_id, user, Share::default());
        let (queue, _) = bucket.queue_of(&probe);
        let st = lock(&bucket.state);
        let paused = st.at.saturating_duration_since(Instant::now());
        Ok(st
            .queue
            .position(queue, |slot| open(slot) && slot.request_id == *request_id)
            .map(|p| match bucket.fairness {
                Fairness::Fair => Position { paused, ..p },
                Fairness::Fifo => Position {
                    others_ahead: 0,
                    users: 1,
                    weight: 1,
                    paused,
                    ..p
                },
            }))
    }

    async fn pause(
        &self,
        provider: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        Ok(self.bucket(provider)?.pause(retry_after))
    }

    async fn usage(&self, grant: &Grant, used: u64) -> Result<Usage, ThrottleError> {
        let bucket = self.bucket(&grant.provider)?;
        if bucket.provider.max_weight().is_none() {
            return Ok(Usage::Matched);
        }
        Ok(bucket.usage(grant.weight, used))
    }

    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError> {
        let Some(held) = &grant.held else {
            return Ok(());
        };
        let bucket = self.bucket(&grant.provider)?;
        if let Ok(ticket) = held.ticket.parse() {
            bucket.end(&held.user, ticket);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(rate: f64, burst: u64) -> Provider {
        Provider {
            name: "p".into(),
            rate,
            burst,
            max_wait: Duration::from_secs(30),
            fairness: Fairness::Fair,
            max_pause: crate::config::DEFAULT_MAX_PAUSE,
            late_allowance: None,
            max_concurrent: None,
            adaptive: false,
            rate_limit: None,
            limits: Vec::new(),
            usage: None,
        }
    }

    fn rid(i: usize) -> RequestId {
        RequestId::new(format!("r{i}")).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn burst_then_rate_in_order() {
        let t = Arc::new(MemoryThrottle::with_providers([&provider(10.0, 3)]));
        let start = Instant::now();
        let mut handles = Vec::new();
        for i in 0..8 {
            let t = Arc::clone(&t);
            handles.push(tokio::spawn(async move {
                t.acquire("p", &rid(i), Duration::from_secs(5))
                    .await
                    .unwrap();
                Instant::now() - start
            }));
            tokio::task::yield_now().await;
        }
        let mut at = Vec::new();
        for h in handles {
            at.push(h.await.unwrap());
        }
        // 3 at once, then one per 100ms, in arrival order.
        let ms: Vec<u128> = at.iter().map(|d| d.as_millis()).collect();
        assert_eq!(ms, vec![0, 0, 0, 100, 200, 300, 400, 500]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_timed_out_caller_burns_no_token() {
        let t = Arc::new(MemoryThrottle::with_providers([&provider(1.0, 1)]));
        t.acquire("p", &rid(0), Duration::from_secs(1))
            .await
            .unwrap();
        let err = t
            .acquire("p", &rid(1), Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "provider p: no slot within 300ms");
        assert_eq!(t.queued("p"), 0);
        // The next token is still due 1s after the first grant.
        let start = Instant::now();
        t.acquire("p", &rid(2), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!((Instant::now() - start).as_millis(), 700);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_caller_is_skipped() {
        let t = Arc::new(MemoryThrottle::with_providers([&provider(1.0, 1)]));
        t.acquire("p", &rid(0), Duration::from_secs(1))
            .await
            .unwrap();
        let waiting = {
            let t = Arc::clone(&t);
            tokio::spawn(async move { t.acquire("p", &rid(1), Duration::from_secs(9)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(t.queued("p"), 1);
        waiting.abort();
        let _ = waiting.await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        // The bucket refilled untouched: one token at once.
        let g = t.acquire("p", &rid(2), Duration::from_millis(1)).await;
        assert!(g.is_ok(), "{g:?}");
    }

    #[test]
    fn backoff_doubles_up_to_the_longest() {
        let longest = Duration::from_secs(60);
        let secs: Vec<u64> = (1..=8).map(|n| backoff(n, longest).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(backoff(u32::MAX, longest), longest);
        assert_eq!(backoff(0, longest), FIRST_BACKOFF);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_holds_the_driver_and_the_bucket_refills_from_its_end() {
        let t = Arc::new(MemoryThrottle::with_providers([&provider(10.0, 3)]));
        let start = Instant::now();
        let pause = t.pause("p", Some(Duration::from_secs(2))).await.unwrap();
        assert_eq!(pause.left, Duration::from_secs(2));
        let mut at = Vec::new();
        for i in 0..3 {
            t.acquire("p", &rid(i), Duration::from_secs(5))
                .await
                .unwrap();
            at.push((Instant::now() - start).as_millis());
        }
        // Nothing before 2 s, then one per 100 ms from an empty bucket.
        assert_eq!(at, vec![2100, 2200, 2300]);
    }

    #[tokio::test]
    async fn unknown_provider_is_named() {
        let t = MemoryThrottle::with_providers([&provider(1.0, 1)]);
        let e = t
            .acquire("nope", &rid(0), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert_eq!(
            e,
            ThrottleError::UnknownProvider {
                name: "nope".into(),
                known: "p".into()
            }
        );
    }
}
