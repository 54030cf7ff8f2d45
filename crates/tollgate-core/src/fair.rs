//! The in-process fair queue of one provider: start-time fair queuing over
//! per-user queues, with an optional per-user cap on calls in flight. The
//! Redis throttle keeps the same structure in keys (`throttle_enqueue_fair.lua`,
//! `throttle_grant.lua`); the two are held to one behaviour by the throttle
//! conformance suite.
//!
//! Each user with waiters has a *start tag* on a virtual clock. The user with
//! the smallest tag is served next; a grant moves the virtual clock to that tag
//! and the user's tag on by `1 / weight`. A user who starts waiting begins at
//! `max(virtual clock, its last finish)`: idle time banks no credit, and a
//! user with nothing waiting costs nothing. With one user waiting this is
//! plain FIFO. Picking the next user is O(log n) in the users waiting.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// A start tag, ordered (tags are finite: sums of `1 / weight`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tag(f64);

impl Eq for Tag {}

impl PartialOrd for Tag {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Tag {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// What the queue knows of a user's plan when one of its waiters queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Grants per round relative to other users (the plan's `share`), >= 1.
    pub weight: u32,
    /// Most calls of the user holding a slot of the provider at once.
    pub max_in_flight: Option<u32>,
    /// How long a granted slot counts as in flight without its end being
    /// reported (a caller that crashed): then it frees itself.
    pub hold: Duration,
}

/// Default [`Share::hold`]: longer than an upstream call may take by default.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(60);

impl Default for Share {
    fn default() -> Self {
        Self {
            weight: 1,
            max_in_flight: None,
            hold: DEFAULT_HOLD,
        }
    }
}

#[derive(Debug)]
struct User<T> {
    waiting: VecDeque<(u64, T)>,
    /// Start tag of the head while waiting; finish tag of the last grant otherwise.
    tag: f64,
    /// Its key in `active`, while it is there.
    key: Option<(Tag, u64)>,
    share: Share,
    /// Slots held: ticket -> when it frees itself.
    in_flight: HashMap<u64, Instant>,
    /// At its cap with waiters: out of the rotation until a slot ends.
    capped: bool,
}

/// One provider's waiters, per user; `T` is what a grant is delivered to.
#[derive(Debug)]
pub struct FairQueue<T> {
    vtime: f64,
    seq: u64,
    users: HashMap<String, User<T>>,
    active: BTreeMap<(Tag, u64), String>,
    capped: BTreeSet<String>,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            vtime: 0.0,
            seq: 0,
            users: HashMap::new(),
            active: BTreeMap::new(),
            capped: BTreeSet::new(),
        }
    }
}

/// The head of the queue: whose waiter is served next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub user: String,
    pub ticket: u64,
}

impl<T> FairQueue<T> {
    /// No waiter queued (live or not) and no user held back by its cap.
    pub fn is_empty(&self) -> bool {
        self.active.is_empty() && self.capped.is_empty()
    }

    /// Whether `user` may take a slot now without queueing (below its cap).
    pub fn below_cap(&self, user: &str, share: &Share, now: Instant) -> bool {
        let Some(cap) = share.max_in_flight else {
            return true;
        };
        let held = self.users.get(user).map_or(0, |u| {
            u.in_flight.values().filter(|until| **until > now).count()
        });
        held < cap as usize
    }

    fn next_ticket(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Queues `item` for `user`; returns its ticket.
    pub fn push(&mut self, user: &str, share: Share, item: T) -> u64 {
        let ticket = self.next_ticket();
        let vtime = self.vtime;
        let u = self.users.entry(user.to_owned()).or_insert_with(|| User {
            waiting: VecDeque::new(),
            tag: vtime,
            key: None,
            share,
            in_flight: HashMap::new(),
            capped: false,
        });
        u.share = share;
        u.waiting.push_back((ticket, item));
        if u.key.is_none() && !u.capped {
            self.activate(user);
        }
        ticket
    }

    fn activate(&mut self, user: &str) {
        let seq = self.next_ticket();
        let vtime = self.vtime;
        if let Some(u) = self.users.get_mut(user) {
            u.tag = u.tag.max(vtime);
            let key = (Tag(u.tag), seq);
            u.key = Some(key);
            self.active.insert(key, user.to_owned());
        }
    }

    fn deactivate(&mut self, user: &str) {
        if let Some(key) = self.users.get_mut(user).and_then(|u| u.key.take()) {
            self.active.remove(&key);
        }
    }

    /// The next waiter to serve: drops waiters for whom `alive` is false at
    /// the heads (returns how many), takes users at their cap out of the
    /// rotation. `None` when nobody can be served now.
    pub fn head(&mut self, now: Instant, alive: impl Fn(&T) -> bool) -> (Option<Head>, u64) {
        let mut skipped = 0;
        loop {
            let Some((_, user)) = self.active.first_key_value() else {
                self.settle();
                return (None, skipped);
            };
            let user = user.clone();
            let Some(u) = self.users.get_mut(&user) else {
                self.active.pop_first();
                continue;
            };
            while u.waiting.front().is_some_and(|(_, t)| !alive(t)) {
                u.waiting.pop_front();
                skipped += 1;
            }
            let Some(&(ticket, _)) = u.waiting.front() else {
                self.deactivate(&user);
                continue;
            };
            u.in_flight.retain(|_, until| *until > now);
            if let Some(cap) = u.share.max_in_flight {
                if u.in_flight.len() >= cap as usize {
                    u.capped = true;
                    self.capped.insert(user.clone());
                    self.deactivate(&user);
                    continue;
                }
            }
            return (Some(Head { user, ticket }), skipped);
        }
    }

    /// Serves `head` (from [`FairQueue::head`]): the user's tag moves on by
    /// `1 / weight` and a capped user's slot counts as in flight until
    /// [`FairQueue::done`] or its hold ends.
    pub fn grant(&mut self, head: &Head, now: Instant) -> Option<T> {
        let u = self.users.get_mut(&head.user)?;
        if u.waiting.front().map(|(t, _)| *t) != Some(head.ticket) {
            return None;
        }
        let (ticket, item) = u.waiting.pop_front()?;
        self.vtime = self.vtime.max(u.tag);
        u.tag += 1.0 / f64::from(u.share.weight.max(1));
        if u.share.max_in_flight.is_some() {
            u.in_flight.insert(ticket, now + u.share.hold);
        }
        let more = !u.waiting.is_empty();
        self.deactivate(&head.user);
        if more {
            self.activate(&head.user);
        }
        Some(item)
    }

    /// The call of `ticket` ended (or its slot was handed back): a user held
    /// back by its cap rejoins the rotation.
    pub fn done(&mut self, user: &str, ticket: u64) {
        let rejoin = match self.users.get_mut(user) {
            Some(u) => {
                u.in_flight.remove(&ticket);
                let below = u
                    .share
                    .max_in_flight
                    .map_or(true, |cap| u.in_flight.len() < cap as usize);
                if u.capped && below {
                    u.capped = false;
                    true
                } else {
                    false
                }
            }
            None => false,
        };
        if rejoin {
            self.capped.remove(user);
            self.activate(user);
        }
        self.settle();
    }

    /// Users at their cap whose oldest slot freed itself rejoin; returns when
    /// the next one does, if any is held back.
    pub fn expire(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut rejoin = Vec::new();
        for user in &self.capped {
            if let Some(u) = self.users.get_mut(user) {
                u.in_flight.retain(|_, until| *until > now);
                let cap = u.share.max_in_flight.unwrap_or(u32::MAX) as usize;
                if u.in_flight.len() < cap {
                    rejoin.push(user.clone());
                } else if let Some(first) = u.in_flight.values().min() {
                    next = Some(next.map_or(*first, |n| n.min(*first)));
                }
            }
        }
        for user in rejoin {
            self.capped.remove(&user);
            if let Some(u) = self.users.get_mut(&user) {
                u.capped = false;
            }
            self.activate(&user);
        }
        next
    }

    /// With nobody waiting, the virtual clock jumps past every finish tag and
    /// the idle users are forgotten (those with slots in flight are kept).
    fn settle(&mut self) {
        if !self.is_empty() {
            return;
        }
        let top = self
            .users
            .values()
            .map(|u| u.tag)
            .fold(self.vtime, f64::max);
        self.vtime = top;
        self.users
            .retain(|_, u| !u.in_flight.is_empty() || !u.waiting.is_empty());
    }

    /// Waiters queued for which `alive` holds, and the users they belong to.
    pub fn waiting(&self, alive: impl Fn(&T) -> bool) -> (u64, u64) {
        let (mut waiters, mut users) = (0, 0);
        for u in self.users.values() {
            let n = u.waiting.iter().filter(|(_, t)| alive(t)).count() as u64;
            waiters += n;
            users += u64::from(n > 0);
        }
        (waiters, users)
    }

    /// Where the waiter of `user` for which `is` holds stands (see
    /// [`Position`]); `None` when it is not queued.
    pub fn position(&self, user: &str, is: impl Fn(&T) -> bool) -> Option<Position> {
        let u = self.users.get(user)?;
        let ahead = u.waiting.iter().position(|(_, t)| is(t))? as u64;
        let users_ahead = match u.key {
            Some(key) => self.active.range(..key).count() as u64,
            None => self.active.len() as u64,
        };
        Some(Position {
            ahead,
            users_ahead,
            users: (self.active.len() + self.capped.len()) as u64,
            weight: u.share.weight.max(1),
        })
    }
}

/// Where a waiting call stands in its provider's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Calls of its user queued ahead of it (on a FIFO provider: every call
    /// ahead of it).
    pub ahead: u64,
    /// Users served before its user in the current round (FIFO: 0).
    pub users_ahead: u64,
    /// Users waiting at the provider, its own included (FIFO: 1).
    pub users: u64,
    /// Its user's share (FIFO: 1).
    pub weight: u32,
}

impl Position {
    /// Grants the provider is expected to make before this call's, assuming
    /// the other users have share 1 and keep waiting: the users ahead in this
    /// round, then for each call of its own ahead of it one grant for it and,
    /// every `weight` of those, one for each other user:
    /// `users_ahead + ahead + ceil(ahead / weight) × (users - 1)`.
    pub fn grants_ahead(&self) -> u64 {
        let weight = u64::from(self.weight.max(1));
        let others = self.users.saturating_sub(1);
        self.users_ahead
            .saturating_add(self.ahead)
            .saturating_add(self.ahead.div_ceil(weight).saturating_mul(others))
    }

    /// The estimated wait for its slot at `rate` grants per second:
    /// `(grants_ahead + 1) / rate` (a saturated provider: no token to spare).
    pub fn estimated_wait(&self, rate: f64) -> Duration {
        let secs = (self.grants_ahead() as f64 + 1.0) / rate.max(1e-9);
        Duration::from_secs_f64(secs.min(86_400.0 * 365.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(weight: u32) -> Share {
        Share {
            weight,
            ..Share::default()
        }
    }

    fn serve(q: &mut FairQueue<&'static str>, n: usize) -> Vec<&'static str> {
        let now = Instant::now();
        (0..n)
            .filter_map(|_| {
                let head = q.head(now, |_| true).0?;
                q.grant(&head, now)
            })
            .collect()
    }

    #[test]
    fn one_user_is_fifo() {
        let mut q = FairQueue::default();
        for item in ["a1", "a2", "a3"] {
            q.push("a", share(1), item);
        }
        assert_eq!(serve(&mut q, 5), ["a1", "a2", "a3"]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_flood_does_not_starve_a_newcomer() {
        let mut q = FairQueue::default();
        for item in ["a1", "a2", "a3", "a4", "a5"] {
            q.push("a", share(1), item);
        }
        assert_eq!(serve(&mut q, 2), ["a1", "a2"]);
        q.push("b", share(1), "b1");
        q.push("b", share(1), "b2");
        assert_eq!(serve(&mut q, 7), ["b1", "a3", "b2", "a4", "a5"]);
    }

    #[test]
    fn weights_split_grants() {
        let mut q = FairQueue::default();
        for _ in 0..10 {
            q.push("pro", share(4), "p");
            q.push("free", share(1), "f");
        }
        let got = serve(&mut q, 10);
        assert_eq!(got.iter().filter(|x| **x == "p").count(), 8, "{got:?}");
    }

    #[test]
    fn a_capped_user_waits_for_its_slot() {
        let mut q = FairQueue::default();
        let capped = Share {
            max_in_flight: Some(1),
            ..share(1)
        };
        q.push("a", capped, "a1");
        q.push("a", capped, "a2");
        let now = Instant::now();
        let head = q.head(now, |_| true).0.unwrap();
        let ticket = head.ticket;
        assert_eq!(q.grant(&head, now), Some("a1"));
        assert_eq!(q.head(now, |_| true).0, None);
        q.done("a", ticket);
        assert_eq!(serve(&mut q, 2), ["a2"]);
    }

    #[test]
    fn position_counts_the_round() {
        let mut q = FairQueue::default();
        for item in ["a1", "a2", "a3"] {
            q.push("a", share(1), item);
        }
        q.push("b", share(1), "b1");
        q.push("b", share(1), "b2");
        q.push("c", share(2), "c1");
        // a is first in the round, then b, then c.
        let a3 = q.position("a", |t| *t == "a3").unwrap();
        assert_eq!((a3.ahead, a3.users_ahead, a3.users), (2, 0, 3));
        assert_eq!(a3.grants_ahead(), 2 + 2 * 2);
        let b2 = q.position("b", |t| *t == "b2").unwrap();
        assert_eq!((b2.ahead, b2.users_ahead), (1, 1));
        let c1 = q.position("c", |t| *t == "c1").unwrap();
        assert_eq!((c1.ahead, c1.users_ahead, c1.weight), (0, 2, 2));
        assert_eq!(c1.estimated_wait(2.0), Duration::from_millis(1500));
        assert_eq!(q.position("c", |t| *t == "a1"), None);
        assert_eq!(q.position("d", |_| true), None);
    }

    #[test]
    fn a_lost_slot_frees_itself() {
        let mut q = FairQueue::default();
        let capped = Share {
            max_in_flight: Some(1),
            hold: Duration::from_secs(5),
            ..share(1)
        };
        q.push("a", capped, "a1");
        q.push("a", capped, "a2");
        let now = Instant::now();
        let head = q.head(now, |_| true).0.unwrap();
        q.grant(&head, now);
        assert_eq!(q.head(now, |_| true).0, None);
        assert_eq!(q.expire(now), Some(now + Duration::from_secs(5)));
        let later = now + Duration::from_secs(6);
        assert_eq!(q.expire(later), None);
        assert!(q.head(later, |_| true).0.is_some());
    }
}
