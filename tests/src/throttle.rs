//! Throttle test support shared by the integration tests and `tollgate-bench`:
//! running many waiters, recording their grants, and checking the bucket's bound.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tollgate_core::{
    id::RequestId,
    throttle::{Grant, Share, Throttle, ThrottleError, Waiter},
};

/// One waiter's outcome, as `tollgate-bench throttle-waiters` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantRecord {
    pub request_id: String,
    /// Throttle clock time the token was taken (µs since the epoch), if granted.
    pub granted_at_us: Option<u64>,
    /// Process clock time the waiter resumed or gave up (µs since the epoch).
    pub resumed_at_us: u64,
    pub waited_ms: u64,
    pub error: Option<String>,
}

/// The late grants counted in a process's rendered metrics: of `provider`,
/// or of every provider.
pub fn late_grants(rendered: &str, provider: Option<&str>) -> f64 {
    rendered
        .lines()
        .filter_map(|l| l.strip_prefix("tollgate_throttle_late_grants_total{"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once("} ")?;
            let wanted = provider.is_none_or(|p| labels == format!("provider=\"{p}\""));
            wanted.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Runs `count` concurrent waiters on `provider`, each waiting at most
/// `max_wait`, and returns their records in request order.
pub async fn run_waiters(
    throttle: Arc<dyn Throttle>,
    provider: &str,
    tag: &str,
    count: usize,
    max_wait: Duration,
) -> Vec<GrantRecord> {
    run_waiters_of(throttle, provider, tag, count, max_wait, 0).await
}

/// The same, waiter `i` queueing as user `u<i % users>` (with `users` > 0;
/// otherwise in the anonymous queue).
pub async fn run_waiters_of(
    throttle: Arc<dyn Throttle>,
    provider: &str,
    tag: &str,
    count: usize,
    max_wait: Duration,
    users: usize,
) -> Vec<GrantRecord> {
    let mut set = tokio::task::JoinSet::new();
    for i in 0..count {
        let throttle = Arc::clone(&throttle);
        let provider = provider.to_owned();
        let request_id = format!("{tag}-{i}");
        set.spawn(async move {
            let started = std::time::Instant::now();
            let r = match RequestId::new(request_id.as_str()) {
                Ok(id) if users > 0 => {
                    let waiter = Waiter::of(&id, &format!("u{}", i % users), Share::default());
                    throttle.acquire_as(&provider, &waiter, max_wait).await
                }
                Ok(id) => throttle.acquire(&provider, &id, max_wait).await,
                Err(e) => Err(tollgate_core::error::StoreError::backend(e.to_string()).into()),
            };
            record(request_id, started, r)
        });
    }
    in_request_order(set).await
}

/// `count` concurrent waiters of `user` on `provider`, with `share`.
pub async fn run_waiters_as(
    throttle: Arc<dyn Throttle>,
    provider: &str,
    tag: &str,
    count: usize,
    max_wait: Duration,
    user: &str,
    share: Share,
) -> Vec<GrantRecord> {
    let mut set = tokio::task::JoinSet::new();
    for i in 0..count {
        let throttle = Arc::clone(&throttle);
        let provider = provider.to_owned();
        let user = user.to_owned();
        let request_id = format!("{tag}-{i}");
        set.spawn(async move {
            let started = std::time::Instant::now();
            let r = match RequestId::new(request_id.as_str()) {
                Ok(id) => {
                    let waiter = Waiter::of(&id, &user, share);
                    throttle.acquire_as(&provider, &waiter, max_wait).await
                }
                Err(e) => Err(tollgate_core::error::StoreError::backend(e.to_string()).into()),
            };
            record(request_id, started, r)
        });
    }
    in_request_order(set).await
}

/// A waiter's record: its outcome `r`, after waiting since `started`.
fn record(
    request_id: String,
    started: std::time::Instant,
    r: Result<Grant, ThrottleError>,
) -> GrantRecord {
    let waited_ms = started.elapsed().as_millis() as u64;
    GrantRecord {
        request_id,
        granted_at_us: r.as_ref().ok().map(|g| g.granted_at_us),
        resumed_at_us: now_us(),
        waited_ms,
        error: r.err().map(|e| e.to_string()),
    }
}

/// The records of every waiter of `set` that ended, by request id.
async fn in_request_order(mut set: tokio::task::JoinSet<GrantRecord>) -> Vec<GrantRecord> {
    let mut out = Vec::with_capacity(set.len());
    while let Some(r) = set.join_next().await {
        if let Ok(rec) = r {
            out.push(rec);
        }
    }
    out.sort_by(|a, b| a.request_id.cmp(&b.request_id));
    out
}

/// The largest excess of grants over `burst + rate * t` in any interval that
/// starts and ends at a grant: `<= 0` when the bucket's bound holds. Times in µs.
pub fn max_excess(times_us: &[u64], rate: f64, burst: u64) -> f64 {
    let mut t = times_us.to_vec();
    t.sort_unstable();
    let mut worst = f64::NEG_INFINITY;
    for i in 0..t.len() {
        for j in i..t.len() {
            let span = (t[j] - t[i]) as f64 / 1e6;
            let excess = (j - i + 1) as f64 - (burst as f64 + rate * span);
            worst = worst.max(excess);
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_grants_are_read_per_provider_or_summed() {
        let text = "# TYPE tollgate_throttle_late_grants_total counter\n\
                    tollgate_throttle_late_grants_total{provider=\"slow\"} 2\n\
                    tollgate_throttle_late_grants_total{provider=\"slower\"} 3\n\
                    tollgate_throttle_wait_seconds_count{provider=\"slow\"} 9\n";
        assert_eq!(late_grants(text, Some("slow")), 2.0);
        assert_eq!(late_grants(text, Some("fast")), 0.0);
        assert_eq!(late_grants(text, None), 5.0);
    }

    #[test]
    fn the_bound_is_checked_over_every_interval() {
        // burst 2, rate 1/s: 2 at once, then one per second.
        assert!(max_excess(&[0, 0, 1_000_000, 2_000_000], 1.0, 2) <= 0.0);
        assert!(max_excess(&[0, 0, 0], 1.0, 2) > 0.0);
        assert!(max_excess(&[0, 0, 1_000_000, 1_500_000], 1.0, 2) > 0.0);
    }
}
