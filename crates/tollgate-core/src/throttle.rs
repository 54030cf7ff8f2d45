//! The provider throttle: the [`Throttle`] interface both modes implement (the
//! in-process token bucket is `tollgate_memory::throttle`, the Redis one
//! `tollgate_redis::throttle`). The wrapper that makes every
//! call of a provider client pass the throttle is `tollgate_providers`'
//! `ThrottledClient`.
//!
//! Semantics (docs/src/throttling.md): one token bucket per provider of
//! `burst` tokens refilled at `rate` per second; a caller gets its slot as soon as
//! the bucket allows, in arrival order, or fails after `max_wait` with
//! [`ThrottleError::Timeout`]; a call that gave up never burns a token.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::config::{LimitKind, Provider, FIRST_BACKOFF};
use crate::duration;
use crate::error::StoreError;
pub use crate::fair::{Position, Share};
use crate::id::RequestId;

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
    /// [`Throttle::done`] (or its lease ends, [`Share::slot_lease`](crate::fair::Share::slot_lease)): `None` when the user has no cap.
    pub user_slot: Option<UserSlot>,
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
    /// The throttle's name for the grant, by which [`Throttle::redate`]
    /// finds it; `None` when it cannot be re-dated.
    pub ticket: Option<String>,
    /// The member of its provider's pool ([`Provider::pool`]) whose buckets
    /// the grant took from, and where its call goes; `None` for a provider
    /// served as one upstream.
    pub member: Option<String>,
}

/// A grant is late past this age, or past one token's time at its provider's
/// rate if that is shorter ([`late_bound`]); `RedisThrottleOptions::late_grant`
/// and `MemoryThrottle::with_late_grant` change it.
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
pub const SLOT_LEASE_MAX: Duration = Duration::from_secs(600);

/// A slot that counts against a user's cap: what [`Throttle::done`] frees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserSlot {
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
        // A pool: too heavy only for every member (the others take it).
        let pool = provider.pool();
        if !pool.is_empty() {
            let heaviest =
                pool.iter()
                    .map(|m| provider.as_member(m))
                    .try_fold(None::<Self>, |_, m| match Self::check_weight(&m, weight) {
                        Ok(()) => Err(()),
                        Err(e) => Ok(Some(e)),
                    });
            return match heaviest {
                Ok(Some(e)) => Err(e),
                _ => Ok(()),
            };
        }
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
    /// It used more: this much more was taken (below empty: a debt later
    /// grants wait for, at most a minute of the limit's refill).
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

    /// `grant` went stale before its call could be sent (its `use_by`
    /// passed, or it reached its waiter late): the same grant re-dated to
    /// now, with its `granted_at_us` and `use_by` as if made now, when its
    /// bucket shows that moving its token from then to now keeps the
    /// provider's bound (docs/src/throttling.md, "Late grants"); `None` when
    /// it does not, and then the token stays lost. Nothing changes in the
    /// bucket: a re-dated grant takes no other token. A grant is re-dated once
    /// (the re-dated one may be again); a provider with other `limits` never
    /// re-dates.
    async fn redate(&self, grant: &Grant) -> Result<Option<Grant>, ThrottleError>;

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

    /// The upstream of `member` of `provider`'s pool refused a call (or
    /// could not be reached): that member's buckets grant nothing, to any
    /// caller of any pod, as [`Throttle::pause`] pauses a provider's (its
    /// own back-off, its `Retry-After`, the provider's `max_pause`), and
    /// the pool's other members take its calls. A member the pool does not
    /// list (a config changed meanwhile) pauses nothing.
    async fn pause_member(
        &self,
        provider: &str,
        member: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError>;

    /// The call made with `grant` used `used` tokens, as its answer reported:
    /// the difference from its weight goes back to its provider's token
    /// limits, or is taken from them, in one atomic step (never past full;
    /// taken below empty as a debt later grants wait for, at most a minute
    /// of the limit's refill: a weight declared too low cannot buy more than
    /// the limit over time). Nothing to do for a provider without token limits.
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
    /// then the provider's other `limits`. A pool's ([`Provider::pool`]):
    /// its request bucket only, the sum of its members' (the figures
    /// above are the pool's too: `tokens`, `rate`, `burst` and
    /// `effective_rate` summed, `paused_ms` the shortest of its members').
    pub limits: Vec<LimitStats>,
    /// A pool's members, in config order (empty for a provider served as
    /// one upstream): each one's own buckets, pause and grants.
    pub members: Vec<MemberStats>,
}

/// One member of a provider's pool, as it stands. Named by its config
/// `name`, never by its secrets.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemberStats {
    pub member: String,
    /// How long its buckets still grant nothing after its upstream refused
    /// a call ([`Throttle::pause_member`]), in ms; 0 when it is not paused.
    pub paused_ms: u64,
    /// The rate its request bucket refills at now.
    pub effective_rate: f64,
    /// Its slots of its `max_concurrent` held now (0 without a cap).
    pub in_flight: u64,
    /// The grants it took, as the pool's choice counts them (the tie-break
    /// of `lua/throttle/lib/pool.lua`; on Redis they start again after the
    /// pool idles): a growing count, for a share or a rate between reads.
    pub grants: u64,
    /// Its limits' buckets, as [`ProviderStats::limits`] a provider's.
    pub limits: Vec<LimitStats>,
}

impl ProviderStats {
    /// The stats of pool `p` whose members stand at `members`: the
    /// provider's row becomes their sum (its own bucket is never written),
    /// its limits the summed request bucket.
    pub fn pooled(mut self, p: &Provider, members: Vec<MemberStats>) -> Self {
        if members.is_empty() {
            return self;
        }
        let (mut available, mut burst, mut rate) = (0.0, 0.0, 0.0);
        for l in members.iter().filter_map(|m| m.limits.first()) {
            available += l.available;
            burst += l.burst;
            rate += l.rate;
        }
        self.rate = p.pool().iter().map(|m| m.rate).sum();
        self.tokens = available;
        self.burst = burst.round() as u64;
        self.effective_rate = rate;
        self.paused_ms = members.iter().map(|m| m.paused_ms).min().unwrap_or(0);
        let limit = self
            .limits
            .first()
            .map_or_else(|| "rate".to_owned(), |l| l.limit.clone());
        self.limits = vec![LimitStats {
            limit,
            available,
            burst,
            rate,
        }];
        self.members = members;
        self
    }
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
    async fn retire(&self) -> Result<u64, ThrottleError>;
}

/// Makes the [`Dispatch`] of each provider for a throttler.
pub trait Dispatchers: Send + Sync + std::fmt::Debug {
    /// The dispatcher of `provider` for the throttler named `throttler`.
    fn dispatcher(&self, provider: &Provider, throttler: &str) -> Arc<dyn Dispatch>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_longest() {
        let longest = Duration::from_secs(60);
        let secs: Vec<u64> = (1..=8).map(|n| backoff(n, longest).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(backoff(u32::MAX, longest), longest);
        assert_eq!(backoff(0, longest), FIRST_BACKOFF);
    }
}
