//! Redis's clock as this process can bound it: never behind, and as tight as
//! the fastest round trip allows.
//!
//! A waiter tells a late grant from a fresh one by its age on Redis's clock
//! (grants carry Redis `TIME`). Each script reply that carries Redis `TIME`
//! bounds that clock from above: the script ran after the call was sent, so
//! read as if it ran at the send, Redis's clock is at most that far ahead of
//! this process's monotonic one. A call that waited behind others (hundreds of
//! waiters enqueueing at once over a few multiplexed connections, a blocking
//! command on the same socket) gives a loose bound: taken alone, it made grants
//! look up to that wait older than they were, and a saturated provider's
//! waiters threw fresh grants away as late, each one a token lost.
//!
//! So the process keeps the tightest bound any call gave it, and loosens it by
//! [`DRIFT_PPM`] of the time since it was taken (the two clocks drift apart:
//! NTP slews a clock by up to 500 ppm, and Redis may run on another host); a
//! newer bound takes over once it is tighter. The bound stays an upper bound:
//! grants may look older than they are, never younger. Each reading of `TIME`
//! also bounds Redis's clock from below (it was read before this process saw
//! it): one above the bound proves the bound wrong (Redis's clock stepped
//! forward, or a failover put Redis on a host whose clock is ahead), and the
//! bound starts over from that call. A step back needs nothing: the next call
//! gives a tighter bound, which takes over.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How fast a bound loosens: µs per second since it was taken.
pub const DRIFT_PPM: u64 = 1_000;

/// One bound: at `at_us` (this process's clock, µs since `epoch`), Redis's
/// clock read at most `at_us + offset_us`.
#[derive(Debug, Clone, Copy)]
struct Bound {
    offset_us: i64,
    at_us: i64,
}

impl Bound {
    /// Redis's clock at `t_us` (this process's clock), at the latest.
    fn upper(&self, t_us: i64) -> i64 {
        let drift = (t_us - self.at_us)
            .unsigned_abs()
            .div_ceil(1_000_000 / DRIFT_PPM);
        t_us + self.offset_us + i64::try_from(drift).unwrap_or(i64::MAX / 4)
    }
}

/// The process's upper bound on Redis's clock.
#[derive(Debug)]
pub struct RedisClock {
    epoch: Instant,
    best: Mutex<Option<Bound>>,
}

impl Default for RedisClock {
    fn default() -> Self {
        Self::new()
    }
}

impl RedisClock {
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
            best: Mutex::new(None),
        }
    }

    fn local_us(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(i64::MAX / 4)
    }

    /// A call sent at `sent` ran on Redis when its clock read `redis_us`
    /// (µs since the Unix epoch), and its reply was read at `replied`.
    pub fn observe(&self, sent: Instant, replied: Instant, redis_us: u64) {
        let at_us = self.local_us(sent);
        let redis = i64::try_from(redis_us).unwrap_or(i64::MAX / 4);
        let new = Bound {
            offset_us: redis - at_us,
            at_us,
        };
        let mut best = self.best.lock().unwrap_or_else(|p| p.into_inner());
        let tighter = match *best {
            None => true,
            // Redis's clock read past the bound: the bound is wrong.
            Some(old) if redis > old.upper(self.local_us(replied)) => true,
            // Compared where the later of the two was taken: from there on
            // both loosen at the same pace, so the tighter one stays so.
            Some(old) => {
                let t = old.at_us.max(at_us);
                new.upper(t) <= old.upper(t)
            }
        };
        if tighter {
            *best = Some(new);
        }
    }

    /// Redis's clock read at least `redis_us` at `at` (a grant made then,
    /// heard of by then): past the bound, the bound is wrong and is dropped
    /// until the next call ([`Self::now`] is `None` till then).
    pub fn at_least(&self, at: Instant, redis_us: u64) {
        let mut best = self.best.lock().unwrap_or_else(|p| p.into_inner());
        let redis = i64::try_from(redis_us).unwrap_or(i64::MAX / 4);
        if best.is_some_and(|b| redis > b.upper(self.local_us(at))) {
            *best = None;
        }
    }

    /// Now on this process's clock, and Redis's clock now at the latest
    /// (`None` before any call was observed).
    pub fn now(&self) -> Option<(Instant, u64)> {
        let best = *self.best.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let upper = best?.upper(self.local_us(now));
        Some((now, u64::try_from(upper).unwrap_or(0)))
    }

    /// The earliest instant at which Redis's clock may read `redis_us`,
    /// given that at `now` it read at most `upper_us` (from [`Self::now`]):
    /// the bound runs at most [`DRIFT_PPM`] faster than this process's clock.
    pub fn earliest(now: Instant, upper_us: u64, redis_us: u64) -> Instant {
        let ahead = redis_us.saturating_sub(upper_us);
        now + Duration::from_micros(ahead - ahead.div_ceil(1_000_000 / DRIFT_PPM).min(ahead))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPOCH_US: u64 = 1_800_000_000_000_000;

    /// Redis's clock, `skew_us` ahead of this process's and running at
    /// `1 + ppm/1e6` its pace, at local µs `t`.
    fn redis_at(t: i64, skew_us: i64, ppm: i64) -> u64 {
        (EPOCH_US as i64 + skew_us + t + t * ppm / 1_000_000) as u64
    }

    fn clock() -> RedisClock {
        RedisClock::new()
    }

    #[test]
    fn a_slow_call_does_not_loosen_the_bound_of_a_fast_one() {
        let c = clock();
        let at = |us: u64| c.epoch + Duration::from_micros(us);
        // Fast: sent at 1 ms, ran at 1.1 ms.
        c.observe(at(1_000), at(1_200), redis_at(1_100, 0, 0));
        let fast = *c.best.lock().unwrap();
        // Slow: sent at 2 ms, ran 300 ms later.
        c.observe(at(2_000), at(302_100), redis_at(302_000, 0, 0));
        let kept = c.best.lock().unwrap().unwrap();
        assert_eq!(
            kept.offset_us,
            fast.unwrap().offset_us,
            "the fast bound stays"
        );
        // At local 400 ms, the bound is Redis's true clock plus the fast
        // call's 100 µs and 0.4 ms of drift allowance, not 300 ms more.
        let upper = kept.upper(400_000) as u64;
        let truth = redis_at(400_000, 0, 0);
        assert!(upper >= truth, "never behind: {upper} < {truth}");
        assert!(
            upper - truth <= 100 + 400,
            "tight: {} µs ahead",
            upper - truth
        );
    }

    #[test]
    fn a_newer_tighter_bound_takes_over_and_an_old_one_loosens() {
        let c = clock();
        let at = |us: u64| c.epoch + Duration::from_micros(us);
        c.observe(at(0), at(10_000), redis_at(5_000, 0, 0)); // 5 ms each way
                                                             // 10 s later the old bound has loosened by 10 ms: a 6 ms call is tighter.
        c.observe(at(10_000_000), at(10_012_000), redis_at(10_006_000, 0, 0));
        let b = c.best.lock().unwrap().unwrap();
        assert_eq!(b.at_us, 10_000_000);
        assert_eq!(b.upper(10_000_000) as u64, redis_at(10_006_000, 0, 0));
    }

    #[test]
    fn the_bound_holds_against_a_clock_that_runs_fast() {
        // Redis's clock runs 900 ppm fast and starts 3 s ahead; calls take
        // anywhere from 50 µs to 200 ms before they run.
        let c = clock();
        let mut t: i64 = 0;
        let mut worst_gap = 0i64;
        for i in 0..2_000i64 {
            let wait = if i % 7 == 3 {
                200_000
            } else {
                50 + (i * 37) % 900
            };
            let sent = c.epoch + Duration::from_micros(t as u64);
            let replied = sent + Duration::from_micros(wait as u64 + 100);
            c.observe(sent, replied, redis_at(t + wait, 3_000_000, 900));
            t += 5_000 + (i * 131) % 20_000;
            let b = c.best.lock().unwrap().unwrap();
            let truth = redis_at(t, 3_000_000, 900) as i64;
            let gap = b.upper(t) - truth;
            assert!(gap >= 0, "behind Redis's clock by {} µs at {t}", -gap);
            worst_gap = worst_gap.max(gap);
        }
        assert!(worst_gap < 30_000, "loose by {worst_gap} µs");
    }

    #[test]
    fn a_clock_that_steps_forward_replaces_the_bound() {
        let c = clock();
        let at = |us: u64| c.epoch + Duration::from_micros(us);
        c.observe(at(0), at(200), redis_at(100, 0, 0));
        // Redis's clock stepped 1 s forward (or a failover): a slower call
        // than the first, but one that proves the first bound behind.
        c.observe(at(1_000), at(3_000), redis_at(2_000, 1_000_000, 0));
        let b = c.best.lock().unwrap().unwrap();
        assert_eq!(b.upper(1_000) as u64, redis_at(2_000, 1_000_000, 0));
        // A grant made past the bound drops it; the next call sets it again.
        c.at_least(at(5_000), redis_at(5_000, 2_000_000, 0));
        assert!(c.now().is_none(), "the bound was proven behind");
        c.observe(at(6_000), at(6_200), redis_at(6_100, 2_000_000, 0));
        assert!(c.now().is_some());
    }

    #[test]
    fn a_clock_that_steps_back_takes_the_next_call() {
        let c = clock();
        let at = |us: u64| c.epoch + Duration::from_micros(us);
        c.observe(at(0), at(200), redis_at(100, 0, 0));
        c.observe(at(1_000), at(1_200), redis_at(1_100, -1_000_000, 0));
        let b = c.best.lock().unwrap().unwrap();
        assert_eq!(b.upper(1_000) as u64, redis_at(1_100, -1_000_000, 0));
    }

    #[test]
    fn earliest_is_never_late() {
        let now = Instant::now();
        assert_eq!(RedisClock::earliest(now, 10, 5), now, "already reached");
        let e = RedisClock::earliest(now, 0, 1_000_000);
        // The bound may run 1000 ppm fast: 1 s of it in 999 ms here.
        assert_eq!(e - now, Duration::from_micros(999_000));
    }

    #[test]
    fn no_bound_before_a_call() {
        assert!(clock().now().is_none());
    }
}
