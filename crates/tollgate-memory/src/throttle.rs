//! The in-process provider throttle ([`MemoryThrottle`]): one exact token
//! bucket per provider, its callers queued in a [`FairQueue`]. The contract
//! (the [`Throttle`] trait, grants, waiters, errors, the late-grant bound) is
//! `tollgate_core::throttle`; semantics in docs/src/throttling.md.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use tollgate_core::clock::{Clock, SystemClock};
use tollgate_core::config::{Config, Fairness, LimitKind, Provider, ProviderLimit};
use tollgate_core::error::StoreError;
use tollgate_core::fair::FairQueue;
use tollgate_core::id::RequestId;
use tollgate_core::lock;
use tollgate_core::metrics::Metrics;
use tollgate_core::throttle::{
    backoff, late_bound, limit_stats, Grant, LimitStats, MemberStats, Pause, Position,
    ProviderStats, Share, Throttle, ThrottleError, Usage, UserSlot, Waiter, LATE_GRANT,
    MIN_LATE_GRANT, SLOT_LEASE_MAX,
};

/// An adaptive bucket's rate at `t`: `e` at `since`, growing back by a tenth
/// of `rate` per second, up to `rate` (the same as `lua/throttle/lib/bucket.lua`).
fn aimd_rate(aimd: Option<(f64, Instant)>, rate: f64, t: Instant) -> f64 {
    match aimd {
        None => rate,
        Some((e, since)) => {
            rate.min(e + t.saturating_duration_since(since).as_secs_f64() * rate / 10.0)
        }
    }
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
    /// One instant and the wall clock's µs then: a grant's time is the
    /// monotonic instant its token was counted at, put on the wall clock
    /// from here ([`Bucket::grant_time`]), so that grants' times differ by
    /// exactly what the bucket counted between them.
    anchor: (Instant, u64),
    /// Its pool's members ([`Provider::pool`]): each grant takes from one of
    /// them (the rules of `lua/throttle/lib/pool.lua`), its own token bucket
    /// unused; empty for a provider served as one upstream.
    pool: Vec<Member>,
}

/// A member of a provider's pool: its buckets, a [`Bucket`] of its own
/// whose queue stays empty (the pool's queue is its provider's).
#[derive(Debug)]
struct Member {
    name: String,
    weight: u32,
    meter: Arc<Bucket>,
}

/// Most users a pool remembers the member of (past it, it starts again:
/// users lose their member, not their place), as `lua/throttle/lib/pool.lua`.
const STICKY_MAX: usize = 100_000;

/// A grant as its waiter hears it: its time in µs since the epoch, on the
/// monotonic clock, and the index of the pool member it took from.
type Made = (u64, Instant, Option<usize>);

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
    /// holds it [`SLOT_LEASE_MAX`] at most.)
    slots: HashMap<u64, Instant>,
    /// An adaptive bucket's rate after its last refusal, and from when.
    aimd: Option<(f64, Instant)>,
    /// What each of the provider's other `limits` holds, as of `levels_at`
    /// (never paused: they refill from then).
    levels: Vec<f64>,
    levels_at: Instant,
    queue: FairQueue<Slot>,
    driving: bool,
    /// A grant made before this is never re-dated: the level may have stood
    /// above [`redate_floor`] since (as `hi` in `lua/throttle/lib/bucket.lua`).
    hi: Instant,
    /// When the last `redate_margin + 1` re-datings were made, newest first.
    redated: VecDeque<Instant>,
    /// A pool's: user -> the member of its last grant, and each member's
    /// grants.
    sticky: HashMap<String, usize>,
    counts: Vec<u64>,
}

/// How many re-dated grants may be open at once, and the level the bucket
/// must have stayed at or below since a grant for it to be re-dated: their
/// sum is `burst - 1` (`lua/throttle/lib/bucket.lua` says why).
fn redate_margin(burst: f64) -> usize {
    ((burst - 1.0) / 2.0).floor().max(0.0) as usize
}

fn redate_floor(burst: f64) -> f64 {
    burst - 1.0 - redate_margin(burst) as f64
}

/// A queued caller: the request it waits for, and where its grant goes (the
/// grant's time in µs since the epoch, and on the monotonic clock).
#[derive(Debug)]
struct Slot {
    request_id: RequestId,
    /// What its grant takes from the token limits.
    weight: u64,
    tx: oneshot::Sender<Made>,
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
                hi: Instant::now(),
                redated: VecDeque::new(),
                sticky: HashMap::new(),
                counts: vec![0; p.pool().len()],
            }),
            handed_back: Notify::new(),
            metrics: metrics.map(|m| (Arc::clone(m), p.name.clone())),
            anchor: (Instant::now(), wall_us()),
            pool: p
                .pool()
                .iter()
                .map(|m| Member {
                    name: m.name.clone(),
                    weight: m.weight,
                    meter: Arc::new(Bucket::new(&p.as_member(m), metrics)),
                })
                .collect(),
        }
    }

    /// The member that takes a grant of `weight` for `user` (`None`: a FIFO
    /// provider's waiter, no stickiness): the user's last member if it
    /// holds it in every limit, else the one that holds it with the fewest
    /// grants per weight; else how long until the first one may.
    fn choose(&self, st: &BucketState, user: Option<&str>, weight: u64) -> Result<usize, Duration> {
        let fits = |i: usize| {
            let m = &self.pool[i].meter;
            let mut ms = lock(&m.state);
            m.refill(&mut ms);
            ms.tokens >= 1.0 && !m.full(&mut ms) && m.fits(&ms, weight)
        };
        if let Some(&i) = user.and_then(|u| st.sticky.get(u)) {
            if fits(i) {
                return Ok(i);
            }
        }
        let mut best: Option<(usize, f64)> = None;
        for (i, m) in self.pool.iter().enumerate() {
            let score = st.counts[i] as f64 / f64::from(m.weight);
            if best.is_none_or(|(_, s)| score < s) && fits(i) {
                best = Some((i, score));
            }
        }
        if let Some((i, _)) = best {
            return Ok(i);
        }
        let now = Instant::now();
        let wait = self
            .pool
            .iter()
            .filter_map(|m| {
                let m = &m.meter;
                let mut ms = lock(&m.state);
                if ThrottleError::check_weight(&m.provider, weight).is_err() {
                    return None;
                }
                Some(if m.full(&mut ms) {
                    // Until a slot ends (which wakes the driver), or the
                    // first frees itself.
                    ms.slots
                        .values()
                        .min()
                        .map_or(Duration::from_secs(3600), |until| {
                            until.saturating_duration_since(now)
                        })
                } else {
                    m.until_next(&ms).max(m.until_fits(&ms, weight))
                })
            })
            .min();
        Err(wait.unwrap_or(Duration::from_secs(3600)))
    }

    /// A pool's grant of `head` (of `weight`) on member `i`: true when its
    /// waiter took it.
    fn grant_on(
        &self,
        st: &mut BucketState,
        i: usize,
        slot: Slot,
        user: &str,
        ticket: u64,
    ) -> bool {
        let m = &self.pool[i].meter;
        let mut ms = lock(&m.state);
        ms.tokens -= 1.0;
        m.mark(&mut ms);
        m.take(&mut ms, slot.weight, 1.0);
        m.take_slot(&mut ms, ticket);
        let (us, made) = m.grant_time(&ms);
        if slot.tx.send((us, made, Some(i))).is_err() {
            // The caller left meanwhile.
            ms.tokens += 1.0;
            m.mark(&mut ms);
            m.take(&mut ms, slot.weight, -1.0);
            ms.slots.remove(&ticket);
            drop(ms);
            st.queue.done(user, ticket);
            return false;
        }
        st.counts[i] += 1;
        if self.fairness == Fairness::Fair && st.sticky.get(user) != Some(&i) {
            if st.sticky.len() >= STICKY_MAX {
                st.sticky.clear();
            }
            st.sticky.insert(user.to_owned(), i);
        }
        true
    }

    /// A grant on member `i` given back by a waiter that left (see
    /// [`Bucket::give_back`]); `late`: its token is lost, only its slots end.
    fn member_give_back(
        self: &Arc<Self>,
        i: usize,
        user: &str,
        ticket: u64,
        weight: u64,
        late: bool,
    ) {
        let m = &self.pool[i].meter;
        if late {
            lock(&m.state).slots.remove(&ticket);
        } else {
            m.give_back(Some(("", ticket)), weight);
        }
        self.end(user, ticket);
    }

    /// Its request bucket's tokens and rate now, how long it is still
    /// paused (ms), its limits' stats, and the slots of `max_concurrent`
    /// held now.
    fn standing(&self) -> (f64, f64, u64, Vec<LimitStats>, u64) {
        let mut st = lock(&self.state);
        self.refill(&mut st);
        let now = Instant::now();
        let effective_rate = aimd_rate(st.aimd, self.rate, now.max(st.at));
        let paused_ms =
            u64::try_from(st.at.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX);
        let limits = limit_stats(
            &self.provider,
            st.tokens,
            effective_rate,
            st.levels.iter().copied(),
        );
        let in_flight = st.slots.values().filter(|until| **until > now).count() as u64;
        (st.tokens, effective_rate, paused_ms, limits, in_flight)
    }

    /// The index of pool member `name`.
    fn member_of(&self, name: Option<&str>) -> Option<usize> {
        let name = name?;
        self.pool.iter().position(|m| m.name == name)
    }

    /// A grant's time: the instant the last refill counted the tokens at
    /// (never ahead of now), in µs since the epoch, and on the monotonic
    /// clock. Reading the wall clock at the grant instead could put it a
    /// preemption later than the instant its token was counted at, and two
    /// grants would look closer than the rate allows.
    fn grant_time(&self, st: &BucketState) -> (u64, Instant) {
        let at = st.at.min(Instant::now());
        let since = u64::try_from(at.saturating_duration_since(self.anchor.0).as_micros())
            .unwrap_or(u64::MAX);
        (self.anchor.1.saturating_add(since), at)
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
        // The level climbed to this since the last count.
        if st.tokens > redate_floor(self.burst) {
            st.hi = st.hi.max(now);
        }
    }

    /// After the level changed at `st.at`: above the floor, grants made
    /// then or before are not re-dated.
    fn mark(&self, st: &mut BucketState) {
        if st.tokens > redate_floor(self.burst) {
            st.hi = st.hi.max(st.at + Duration::from_micros(1));
        }
    }

    /// A grant made at `made`, re-dated to now if the bucket allows (the
    /// rules of `throttle_redate.lua`): its new time.
    fn redate(&self, made: Instant) -> Option<(u64, Instant)> {
        if !self.provider.limits.is_empty() {
            return None;
        }
        let mut st = lock(&self.state);
        self.refill(&mut st);
        let now = Instant::now();
        let margin = redate_margin(self.burst);
        if st.at > now
            || st.paused_until.is_some_and(|until| until > made)
            || made < st.hi
            || st.tokens > redate_floor(self.burst)
            || st.redated.iter().filter(|t| **t > made).count() > margin
        {
            return None;
        }
        st.redated.push_front(now);
        st.redated.truncate(margin + 1);
        Some(self.grant_time(&st))
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
                // Below empty: the debt of a weight declared too low, paid
                // by later grants' waits (at most a minute of the refill).
                let floor = (l.burst as f64).max(l.rate * 60.0);
                *level = (*level + delta).clamp(-floor, l.burst as f64);
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
            self.mark(&mut st);
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
            st.slots.insert(ticket, Instant::now() + SLOT_LEASE_MAX);
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
                    if !self.pool.is_empty() {
                        let user = (self.fairness == Fairness::Fair).then_some(head.user.as_str());
                        match self.choose(&st, user, weight) {
                            Ok(i) => {
                                if let Some(slot) = st.queue.grant(&head, now) {
                                    self.grant_on(&mut st, i, slot, &head.user, head.ticket);
                                }
                                continue;
                            }
                            Err(wait) => break wait,
                        }
                    }
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
                        self.mark(&mut st);
                        self.take(&mut st, slot.weight, 1.0);
                        self.take_slot(&mut st, head.ticket);
                        let (us, made) = self.grant_time(&st);
                        if slot.tx.send((us, made, None)).is_err() {
                            // The caller left meanwhile.
                            st.tokens += 1.0;
                            self.mark(&mut st);
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
    rx: Option<oneshot::Receiver<Made>>,
    late: Duration,
    weight: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if let Ok((_, made, member)) = rx.try_recv() {
                if let Some(i) = member {
                    let late = made.elapsed() > self.late;
                    self.bucket
                        .member_give_back(i, &self.user, self.ticket, self.weight, late);
                    if let (true, Some((metrics, provider))) = (late, &self.bucket.metrics) {
                        metrics.late_grant(provider);
                    }
                } else if made.elapsed() <= self.late {
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

    /// The age past which a grant of `bucket` is late.
    fn late(&self, bucket: &Bucket) -> Duration {
        match bucket.late_allowance {
            Some(d) => d.min(self.late_grant).max(MIN_LATE_GRANT),
            None => late_bound(bucket.rate, self.late_grant),
        }
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
                let (tokens, effective_rate, paused_ms, limits, _) = b.standing();
                let (waiters, users, counts) = {
                    let st = lock(&b.state);
                    let (waiters, users) = st.queue.waiting(open);
                    (waiters, users, st.counts.clone())
                };
                let members = b
                    .pool
                    .iter()
                    .zip(counts)
                    .map(|(m, grants)| {
                        let (_, effective_rate, paused_ms, limits, in_flight) = m.meter.standing();
                        MemberStats {
                            member: m.name.clone(),
                            paused_ms,
                            effective_rate,
                            in_flight,
                            grants,
                            limits,
                        }
                    })
                    .collect();
                ProviderStats {
                    provider: name.clone(),
                    rate: b.rate,
                    burst: b.burst as u64,
                    tokens,
                    waiters,
                    users,
                    throttlers: None,
                    paused_ms,
                    effective_rate,
                    limits,
                    members: Vec::new(),
                }
                .pooled(&b.provider, members)
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
        let late = self.late(bucket);
        let grant = |(granted_at_us, made, member): Made, ticket: u64| {
            // A pool's grant holds its member's slot.
            let member = member.map(|i| &bucket.pool[i]);
            let max_concurrent = match member {
                Some(m) => m.meter.max_concurrent,
                None => bucket.max_concurrent,
            };
            Grant {
                provider: provider.to_owned(),
                request_id: waiter.request_id.clone(),
                waited: started.elapsed(),
                granted_at_us,
                user_slot: (share.max_in_flight.is_some() || max_concurrent.is_some()).then(|| {
                    UserSlot {
                        user: user.to_owned(),
                        ticket: ticket.to_string(),
                    }
                }),
                slot: max_concurrent.map(|_| ticket.to_string()),
                use_by: Some(made + late),
                weight,
                ticket: Some(ticket.to_string()),
                member: member.map(|m| m.name.clone()),
            }
        };
        let (rx, ticket) = {
            let mut st = lock(&bucket.state);
            bucket.refill(&mut st);
            let now = Instant::now();
            // A pool's driver chooses the member: its callers always queue
            // (the driver serves them at once when one holds their call).
            if bucket.pool.is_empty()
                && st.queue.is_empty()
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
                        bucket.mark(&mut st);
                        bucket.take(&mut st, weight, 1.0);
                        bucket.take_slot(&mut st, head.ticket);
                        let (us, made) = bucket.grant_time(&st);
                        let _ = slot.tx.send((us, made, None));
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

    async fn pause_member(
        &self,
        provider: &str,
        member: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        let pool = self.bucket(provider)?;
        let Some(i) = pool.member_of(Some(member)) else {
            return Ok(Pause {
                left: Duration::ZERO,
                strikes: 0,
                rate: pool.rate,
            });
        };
        let pause = pool.pool[i].meter.pause(retry_after);
        // Its driver sleeps on the members' times: it looks again.
        pool.handed_back.notify_one();
        Ok(pause)
    }

    async fn usage(&self, grant: &Grant, used: u64) -> Result<Usage, ThrottleError> {
        let pool = self.bucket(&grant.provider)?;
        // A pool's grant took from its member's limits.
        let bucket = match pool.member_of(grant.member.as_deref()) {
            Some(i) => &pool.pool[i].meter,
            None => pool,
        };
        if bucket.provider.max_weight().is_none() {
            return Ok(Usage::Matched);
        }
        let usage = bucket.usage(grant.weight, used);
        pool.handed_back.notify_one();
        Ok(usage)
    }

    async fn redate(&self, grant: &Grant) -> Result<Option<Grant>, ThrottleError> {
        let bucket = self.bucket(&grant.provider)?;
        // A pool's grants are never re-dated (as on Redis).
        if grant.ticket.is_none() || !bucket.pool.is_empty() {
            return Ok(None);
        }
        let (anchor, anchor_us) = bucket.anchor;
        let made = anchor + Duration::from_micros(grant.granted_at_us.saturating_sub(anchor_us));
        let Some((granted_at_us, now)) = bucket.redate(made) else {
            return Ok(None);
        };
        if let Some((metrics, provider)) = &bucket.metrics {
            metrics.grant_redated(provider);
        }
        Ok(Some(Grant {
            granted_at_us,
            use_by: Some(now + self.late(bucket)),
            ..grant.clone()
        }))
    }

    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError> {
        let Some(held) = &grant.user_slot else {
            return Ok(());
        };
        let bucket = self.bucket(&grant.provider)?;
        if let Ok(ticket) = held.ticket.parse() {
            if let Some(i) = bucket.member_of(grant.member.as_deref()) {
                lock(&bucket.pool[i].meter.state).slots.remove(&ticket);
            }
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
            max_pause: tollgate_core::config::DEFAULT_MAX_PAUSE,
            late_allowance: None,
            max_concurrent: None,
            adaptive: false,
            rate_limit: None,
            limits: Vec::new(),
            usage: None,
            members: Vec::new(),
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
