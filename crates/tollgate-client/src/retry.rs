//! When to try again: [`RetryPolicy`] bounds a logical call in time (one
//! deadline over every attempt) and count, and spaces attempts by the
//! server's `Retry-After` or, without one, by exponential backoff, both with
//! jitter so that many clients refused at once do not come back in step.

use std::time::Duration;

/// How a client retries. Which answers are retried is fixed (see the crate
/// docs); this says how long and how often.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The most one logical call may take, every attempt and wait included.
    pub deadline: Duration,
    /// The most retries after the first attempt (waiting for a pending job
    /// does not count).
    pub max_retries: u32,
    /// The first backoff when the server gave no `Retry-After` (a transport
    /// error, a refunded provider failure); doubled on each retry.
    pub base: Duration,
    /// The longest backoff.
    pub max_backoff: Duration,
    /// Wait out a budget refusal when it fits in this much (and before the
    /// deadline), then retry with the same key. `None` (the default): a 429
    /// is returned at once as [`Outcome::BudgetExhausted`](crate::Outcome::BudgetExhausted).
    pub wait_for_budget: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(60),
            max_retries: 8,
            base: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            wait_for_budget: None,
        }
    }
}

impl RetryPolicy {
    /// No retries at all: every answer is returned as it comes.
    pub fn none() -> Self {
        Self {
            max_retries: 0,
            ..Self::default()
        }
    }

    /// The pause before retry number `retry` (1 for the first retry).
    ///
    /// With a server hint (`Retry-After`, or a budget's exact `retry_after`):
    /// the hint plus up to a quarter of it more (at most 1 s more), never
    /// less, since the server said "not before". Without one: "full jitter"
    /// exponential backoff, uniform in `[b/2, b]` for `b = base * 2^(retry-1)`
    /// capped at `max_backoff`.
    pub fn backoff(&self, retry: u32, hint: Option<Duration>) -> Duration {
        match hint {
            Some(h) => h + (h / 4).min(Duration::from_secs(1)).mul_f64(unit()),
            None => {
                let b = self.ceiling(retry);
                b / 2 + (b / 2).mul_f64(unit())
            }
        }
    }

    /// The backoff before retry `retry` without jitter: what a caller told
    /// "try again later" should wait at least.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(20);
        self.base
            .saturating_mul(1u32 << exp)
            .min(self.max_backoff)
            .max(Duration::from_millis(1))
    }
}

/// A uniform number in [0, 1) from the OS's randomness (through a v4 UUID,
/// already a dependency for the idempotency keys).
fn unit() -> f64 {
    let bits = (uuid::Uuid::new_v4().as_u128() >> 75) as u64; // 53 random bits
    bits as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_never_undercuts_the_server_hint_and_stays_bounded() {
        let p = RetryPolicy::default();
        for _ in 0..200 {
            let d = p.backoff(1, Some(Duration::from_secs(1)));
            assert!(
                d >= Duration::from_secs(1) && d <= Duration::from_millis(1250),
                "{d:?}"
            );
            let d = p.backoff(3, Some(Duration::from_secs(20)));
            assert!(
                d >= Duration::from_secs(20) && d <= Duration::from_secs(21),
                "{d:?}"
            );
            let d = p.backoff(1, None);
            assert!(
                d >= Duration::from_millis(100) && d <= Duration::from_millis(200),
                "{d:?}"
            );
            let d = p.backoff(30, None);
            assert!(
                d >= Duration::from_millis(2500) && d <= Duration::from_secs(5),
                "{d:?}"
            );
        }
    }

    #[test]
    fn jitter_spreads_the_retries() {
        let p = RetryPolicy::default();
        let mut seen: Vec<Duration> = (0..50).map(|_| p.backoff(4, None)).collect();
        seen.sort();
        seen.dedup();
        assert!(seen.len() > 40, "{seen:?}");
    }
}
