//! The in-process fair queue of one provider: start-time fair queuing with a
//! tag per ticket, and an optional per-user cap on calls in flight. The Redis
//! throttle keeps the same queue in keys (`lua/throttle/lib/fair.lua`); the two are
//! held to one behaviour by the throttle conformance suite.
//!
//! A ticket gets its *start tag* on a virtual clock when it is queued:
//! `max(virtual clock, the finish tag of its user's last ticket)`, and its
//! user's finish tag becomes `start + 1 / weight`. The ticket with the least
//! start tag (ties: the oldest) is served next, and the virtual clock moves
//! to its tag. A user's tickets are spaced `1 / weight` apart, so users share
//! the grants by weight while they wait; a user who starts waiting begins at
//! the virtual clock (idle time banks no credit, and a user with nothing
//! waiting costs nothing); with one user waiting this is plain FIFO. Queueing
//! and serving are O(log n) in the tickets waiting. A ticket of a user at its
//! cap is *parked* (out of the order) until a slot of the user ends; it goes
//! back at `max(virtual clock, its tag)`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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
    pub slot_lease: Duration,
}

/// Default [`Share::slot_lease`]: longer than an upstream call may take by default.
pub const DEFAULT_SLOT_LEASE: Duration = Duration::from_secs(60);

impl Default for Share {
    fn default() -> Self {
        Self {
            weight: 1,
            max_in_flight: None,
            slot_lease: DEFAULT_SLOT_LEASE,
        }
    }
}

#[derive(Debug)]
struct User<T> {
    /// Its tickets waiting, in `tickets` or parked.
    queued: u64,
    /// The finish tag of its last ticket.
    finish: f64,
    share: Share,
    /// Slots held: ticket -> when it frees itself.
    in_flight: HashMap<u64, Instant>,
    /// Its tickets held back by its cap, by (start tag, ticket).
    parked: BTreeMap<(Tag, u64), T>,
}

impl<T> User<T> {
    fn new(share: Share) -> Self {
        Self {
            queued: 0,
            finish: 0.0,
            share,
            in_flight: HashMap::new(),
            parked: BTreeMap::new(),
        }
    }

    fn cap(&self) -> usize {
        self.share.max_in_flight.map_or(usize::MAX, |c| c as usize)
    }

    /// Nothing to remember but a finish tag at or below `vtime` (worth it anyway).
    fn forgettable(&self, vtime: f64) -> bool {
        self.queued == 0 && self.in_flight.is_empty() && self.finish <= vtime
    }
}

/// One provider's waiters; `T` is what a grant is delivered to.
#[derive(Debug)]
pub struct FairQueue<T> {
    vtime: f64,
    seq: u64,
    /// Every ticket not parked, by (start tag, ticket): the first is served next.
    tickets: BTreeMap<(Tag, u64), (String, T)>,
    users: HashMap<String, User<T>>,
    /// Users with parked tickets.
    capped: BTreeSet<String>,
    /// Users kept after the last pruning of forgettable ones.
    pruned_at: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            vtime: 0.0,
            seq: 0,
            tickets: BTreeMap::new(),
            users: HashMap::new(),
            capped: BTreeSet::new(),
            pruned_at: 0,
        }
    }
}

/// Whose waiter is served next (the front of the queue; not an upstream
/// answer's [`crate::head::Head`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Next {
    pub user: String,
    pub ticket: u64,
}

impl<T> FairQueue<T> {
    /// No waiter queued (live or not) and no ticket parked.
    pub fn is_empty(&self) -> bool {
        self.tickets.is_empty() && self.capped.is_empty()
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

    /// Queues `item` for `user`; returns its ticket.
    pub fn push(&mut self, user: &str, share: Share, item: T) -> u64 {
        self.seq += 1;
        let ticket = self.seq;
        let vtime = self.vtime;
        let u = self
            .users
            .entry(user.to_owned())
            .or_insert_with(|| User::new(share));
        u.share = share;
        let start = u.finish.max(vtime);
        u.finish = start + 1.0 / f64::from(share.weight.max(1));
        u.queued += 1;
        let key = (Tag(start), ticket);
        if u.parked.is_empty() {
            self.tickets.insert(key, (user.to_owned(), item));
        } else {
            // Behind its parked tickets, in its own order.
            u.parked.insert(key, item);
        }
        ticket
    }

    /// One ticket of `user` less waiting.
    fn gone(&mut self, user: &str) {
        if let Some(u) = self.users.get_mut(user) {
            u.queued = u.queued.saturating_sub(1);
        }
    }

    /// Parked tickets of `user` go back (at `max(vtime, tag)`) as far as its
    /// free slots go; it stays capped while any is left.
    fn unpark(&mut self, user: &str) {
        let vtime = self.vtime;
        let Some(u) = self.users.get_mut(user) else {
            self.capped.remove(user);
            return;
        };
        let free = u.cap().saturating_sub(u.in_flight.len());
        for _ in 0..free {
            let Some(((tag, ticket), item)) = u.parked.pop_first() else {
                break;
            };
            let tag = Tag(tag.0.max(vtime));
            self.tickets.insert((tag, ticket), (user.to_owned(), item));
        }
        if u.parked.is_empty() {
            self.capped.remove(user);
        }
    }

    /// The next waiter to serve: drops waiters for whom `alive` is false at
    /// the head (returns how many), parks the tickets of users at their cap.
    /// `None` when nobody can be served now.
    pub fn head(&mut self, now: Instant, alive: impl Fn(&T) -> bool) -> (Option<Next>, u64) {
        let mut skipped = 0;
        loop {
            let Some((&key, (user, item))) = self.tickets.first_key_value() else {
                self.settle();
                return (None, skipped);
            };
            let user = user.clone();
            if !alive(item) {
                self.tickets.pop_first();
                self.gone(&user);
                skipped += 1;
                continue;
            }
            let vtime = self.vtime;
            let Some(u) = self.users.get_mut(&user) else {
                self.tickets.pop_first();
                continue;
            };
            if u.share.max_in_flight.is_some() {
                u.in_flight.retain(|_, until| *until > now);
                // Older tickets of the user are parked: they go first.
                let behind = u
                    .parked
                    .first_key_value()
                    .is_some_and(|(&(tag, t), _)| (Tag(tag.0.max(vtime)), t) < key);
                if u.in_flight.len() >= u.cap() || behind {
                    if let Some((key, (_, item))) = self.tickets.pop_first() {
                        u.parked.insert(key, item);
                    }
                    self.capped.insert(user.clone());
                    self.unpark(&user);
                    continue;
                }
            }
            return (
                Some(Next {
                    user,
                    ticket: key.1,
                }),
                skipped,
            );
        }
    }

    /// The item of the ticket served next (after [`FairQueue::head`]).
    pub fn first(&self) -> Option<&T> {
        self.tickets.first_key_value().map(|(_, (_, item))| item)
    }

    /// Serves `head` (from [`FairQueue::head`]): the virtual clock moves to
    /// its tag, and a capped user's slot counts as in flight until
    /// [`FairQueue::done`] or its hold ends.
    pub fn grant(&mut self, head: &Next, now: Instant) -> Option<T> {
        let (&key, _) = self.tickets.first_key_value()?;
        if key.1 != head.ticket {
            return None;
        }
        let (_, (user, item)) = self.tickets.pop_first()?;
        self.vtime = self.vtime.max(key.0 .0);
        if let Some(u) = self.users.get_mut(&user) {
            u.queued = u.queued.saturating_sub(1);
            if u.share.max_in_flight.is_some() {
                u.in_flight.insert(head.ticket, now + u.share.slot_lease);
            }
        }
        self.prune();
        Some(item)
    }

    /// The call of `ticket` ended (or its slot was handed back): a user with
    /// parked tickets gets them back as far as its cap allows.
    pub fn done(&mut self, user: &str, ticket: u64) {
        if let Some(u) = self.users.get_mut(user) {
            u.in_flight.remove(&ticket);
        }
        if self.capped.contains(user) {
            self.unpark(user);
        }
        self.settle();
    }

    /// Users with parked tickets whose oldest slot freed itself get them
    /// back; returns when the next slot of a user still capped frees itself.
    pub fn expire(&mut self, now: Instant) -> Option<Instant> {
        let capped: Vec<String> = self.capped.iter().cloned().collect();
        let mut next: Option<Instant> = None;
        for user in capped {
            if let Some(u) = self.users.get_mut(&user) {
                u.in_flight.retain(|_, until| *until > now);
            }
            self.unpark(&user);
            if self.capped.contains(&user) {
                if let Some(first) = self
                    .users
                    .get(&user)
                    .and_then(|u| u.in_flight.values().min())
                {
                    next = Some(next.map_or(*first, |n| n.min(*first)));
                }
            }
        }
        next
    }

    /// With nobody waiting, the tags start again at 0 and the users are
    /// forgotten (those with slots in flight are kept).
    fn settle(&mut self) {
        if !self.is_empty() {
            return;
        }
        self.vtime = 0.0;
        self.users.retain(|_, u| {
            u.finish = 0.0;
            u.queued = 0;
            !u.in_flight.is_empty()
        });
        self.pruned_at = self.users.len();
    }

    /// Forgets the users with nothing to remember, once their number doubled.
    fn prune(&mut self) {
        if self.users.len() > 2 * self.pruned_at.max(32) {
            let vtime = self.vtime;
            self.users.retain(|_, u| !u.forgettable(vtime));
            self.pruned_at = self.users.len();
        }
    }

    /// Waiters queued for which `alive` holds, and the users they belong to.
    pub fn waiting(&self, alive: impl Fn(&T) -> bool) -> (u64, u64) {
        let mut per_user: HashMap<&str, u64> = HashMap::new();
        for (user, item) in self.tickets.values() {
            if alive(item) {
                *per_user.entry(user).or_default() += 1;
            }
        }
        for user in &self.capped {
            if let Some(u) = self.users.get(user) {
                let n = u.parked.values().filter(|t| alive(t)).count() as u64;
                if n > 0 {
                    *per_user.entry(user).or_default() += n;
                }
            }
        }
        (per_user.values().sum(), per_user.len() as u64)
    }

    /// Where the waiter of `user` for which `is` holds stands (see
    /// [`Position`]); `None` when it is not queued.
    pub fn position(&self, user: &str, is: impl Fn(&T) -> bool) -> Option<Position> {
        let u = self.users.get(user)?;
        let (mut ahead, mut before) = (0u64, 0u64);
        let mut found = false;
        for (who, item) in self.tickets.values() {
            if who == user && is(item) {
                found = true;
                break;
            }
            before += 1;
            ahead += u64::from(who == user);
        }
        if !found {
            let (key, _) = u.parked.iter().find(|(_, t)| is(t))?;
            before = self.tickets.range(..*key).count() as u64;
            ahead = self
                .tickets
                .range(..*key)
                .filter(|(_, (who, _))| who == user)
                .count() as u64;
            let parked_ahead = u.parked.range(..*key).count() as u64;
            ahead += parked_ahead;
            before += parked_ahead;
        }
        Some(Position {
            ahead,
            others_ahead: before - ahead,
            users: self.waiting(|_| true).1,
            weight: u.share.weight.max(1),
            paused: Duration::ZERO,
        })
    }
}

/// Where a waiting call stands in its provider's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Calls of its user served before it (on a FIFO provider: every call
    /// ahead of it).
    pub ahead: u64,
    /// Calls of other users served before it, as the queue stands (FIFO: 0):
    /// tags are given when a call queues, so only newcomers can still come
    /// between (a user who starts waiting gets the next round).
    pub others_ahead: u64,
    /// Users waiting at the provider, its own included (FIFO: 1).
    pub users: u64,
    /// Its user's share (FIFO: 1).
    pub weight: u32,
    /// How long the provider still grants nothing: paused after an upstream
    /// refused a call (`Throttle::pause`); zero when it is not.
    pub paused: Duration,
}

impl Position {
    /// Grants the provider makes before this call's as the queue stands:
    /// `ahead + others_ahead`.
    pub fn grants_ahead(&self) -> u64 {
        self.ahead.saturating_add(self.others_ahead)
    }

    /// The estimated wait for its slot at `rate` grants per second:
    /// `paused + (grants_ahead + 1) / rate` (a saturated provider: no token
    /// to spare; a paused one refills from an empty bucket when it resumes).
    pub fn estimated_wait(&self, rate: f64) -> Duration {
        let secs = self.paused.as_secs_f64() + (self.grants_ahead() as f64 + 1.0) / rate.max(1e-9);
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

    /// A share of weight 1 with at most `max_in_flight` in flight.
    fn capped(max_in_flight: u32) -> Share {
        Share {
            max_in_flight: Some(max_in_flight),
            ..share(1)
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
        let capped = capped(1);
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
    fn position_counts_the_tickets_ahead() {
        let mut q = FairQueue::default();
        for item in ["a1", "a2", "a3"] {
            q.push("a", share(1), item);
        }
        q.push("b", share(1), "b1");
        q.push("b", share(1), "b2");
        q.push("c", share(2), "c1");
        // Served in the order a1 b1 c1 a2 b2 a3 (tags 0 0 0 1 1 2).
        let a3 = q.position("a", |t| *t == "a3").unwrap();
        assert_eq!((a3.ahead, a3.others_ahead, a3.users), (2, 3, 3));
        assert_eq!(a3.grants_ahead(), 5);
        let b2 = q.position("b", |t| *t == "b2").unwrap();
        assert_eq!((b2.ahead, b2.others_ahead), (1, 3));
        let c1 = q.position("c", |t| *t == "c1").unwrap();
        assert_eq!((c1.ahead, c1.others_ahead, c1.weight), (0, 2, 2));
        assert_eq!(c1.estimated_wait(2.0), Duration::from_millis(1500));
        assert_eq!(q.position("c", |t| *t == "a1"), None);
        assert_eq!(q.position("d", |_| true), None);
        assert_eq!(serve(&mut q, 6), ["a1", "b1", "c1", "a2", "b2", "a3"]);
    }

    /// Tickets tagged as they arrive, one at a time per user (each user's
    /// next call queues when its last is served): 4:1 all the same.
    #[test]
    fn weights_hold_for_tickets_that_arrive_one_by_one() {
        let mut q = FairQueue::default();
        let now = Instant::now();
        q.push("pro", share(4), "p");
        q.push("free", share(1), "f");
        let (mut pro, mut free) = (0, 0);
        for _ in 0..1000 {
            let head = q.head(now, |_| true).0.unwrap();
            let who = q.grant(&head, now).unwrap();
            if who == "p" {
                pro += 1;
                q.push("pro", share(4), "p");
            } else {
                free += 1;
                q.push("free", share(1), "f");
            }
        }
        assert_eq!((pro, free), (800, 200));
    }

    /// A user who waited nothing for a while starts at the virtual clock: it
    /// banks no credit, and is served in the next round.
    #[test]
    fn idle_time_banks_no_credit() {
        let mut q = FairQueue::default();
        for _ in 0..6 {
            q.push("a", share(1), "a");
        }
        assert_eq!(serve(&mut q, 3), ["a", "a", "a"]);
        for _ in 0..3 {
            q.push("b", share(1), "b");
        }
        assert_eq!(serve(&mut q, 6), ["b", "a", "b", "a", "b", "a"]);
        assert!(q.is_empty());
    }

    /// Under a cap of 2, a user's 5 tickets are served in order, never more
    /// than 2 in flight, while another user's are not held up.
    #[test]
    fn a_cap_parks_the_rest_in_order() {
        let mut q = FairQueue::default();
        let capped = capped(2);
        for item in ["c1", "c2", "c3", "c4", "c5"] {
            q.push("c", capped, item);
        }
        for item in ["o1", "o2", "o3"] {
            q.push("o", share(1), item);
        }
        let now = Instant::now();
        let mut got = Vec::new();
        let mut held = Vec::new();
        while let (Some(head), _) = q.head(now, |_| true) {
            if head.user == "c" {
                held.push(head.ticket);
            }
            got.push(q.grant(&head, now).unwrap());
        }
        assert_eq!(got, ["c1", "o1", "c2", "o2", "o3"]);
        assert_eq!(q.position("c", |t| *t == "c4").map(|p| p.ahead), Some(1));
        q.done("c", held[0]);
        assert_eq!(serve(&mut q, 5), ["c3"]);
        q.done("c", held[1]);
        assert_eq!(serve(&mut q, 5), ["c4"]);
        assert!(!q.is_empty());
    }

    #[test]
    fn a_lost_slot_frees_itself() {
        let mut q = FairQueue::default();
        let capped = Share {
            slot_lease: Duration::from_secs(5),
            ..capped(1)
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
