//! The budget headers of every metered response: `RateLimit-Policy` and
//! `RateLimit` (draft-ietf-httpapi-ratelimit-headers), and `Retry-After` on 429.
//!
//! ```text
//! RateLimit-Policy: "budget";q=1000;w=43200     the plan: 1000 tokens per 12 h
//! RateLimit: "budget";r=992;t=3600              992 left; more frees up in 3600 s
//! Retry-After: 17                               (429 only) ceil(retry_after_ms / 1000)
//! ```
//!
//! A plan of several limits names one policy item per window, longest first
//! (`"budget-12h";q=1000;w=43200, "budget-1m";q=100;w=60`), and `RateLimit`
//! shows the window closest to exhaustion (on a 429: the one that holds the
//! request back longest, with `t` = when the cost fits every window). A
//! calendar period is an item too (`"budget-month";q=2000;w=2678400`: `w` the
//! current period's length); its `t` and a 429's `Retry-After` are the
//! seconds until the period ends, rounded up (the exact instant is in
//! `/v1/usage`: `windows[].period.end_ms`).

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use tollgate_core::duration;
use tollgate_core::ledger::{Allowed, Denied, Usage, WindowUse};

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The policy name in both headers (for a one-limit plan).
pub const POLICY: &str = "budget";

/// Seconds, rounded up: a client waiting this long is never early.
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The headers to add to one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub policy: String,
    pub state: String,
    pub retry_after: Option<u64>,
}

/// The policy name of the window `window_ms` of a plan with `windows`:
/// `budget`, or `budget-<window>` when the plan has several (a calendar
/// period's: `budget-month`, `budget-week`, `budget-day`).
pub fn policy_name(windows: &[WindowUse], window_ms: u64) -> String {
    if windows.len() <= 1 {
        return POLICY.to_owned();
    }
    let label = windows
        .iter()
        .find(|w| w.window_ms == window_ms)
        .map(WindowUse::label)
        .unwrap_or_else(|| duration::format(std::time::Duration::from_millis(window_ms)));
    format!("{POLICY}-{label}")
}

fn headers(windows: &[WindowUse], window_ms: u64, remaining: u64, t_ms: u64) -> RateLimitHeaders {
    let policy = windows
        .iter()
        .map(|w| {
            format!(
                "\"{}\";q={};w={}",
                policy_name(windows, w.window_ms),
                w.limit,
                ceil_secs(w.window_ms)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    RateLimitHeaders {
        policy,
        state: format!(
            "\"{}\";r={remaining};t={}",
            policy_name(windows, window_ms),
            ceil_secs(t_ms)
        ),
        retry_after: None,
    }
}

/// A recorded reservation (or a refunded one: [`Allowed::refunded`]).
pub fn allowed(a: &Allowed) -> RateLimitHeaders {
    headers(&a.windows, a.window_ms, a.remaining, a.reset_after_ms)
}

/// A denial: `t` and `Retry-After` are when this request's cost fits.
pub fn denied(d: &Denied) -> RateLimitHeaders {
    let mut h = headers(&d.windows, d.window_ms, d.remaining, d.retry_after_ms);
    h.retry_after = Some(ceil_secs(d.retry_after_ms));
    h
}

/// `GET /v1/usage`.
pub fn usage(u: &Usage) -> RateLimitHeaders {
    headers(
        &u.windows,
        u.window_ms,
        u.remaining,
        u.reset_after_ms.unwrap_or(0),
    )
}

impl RateLimitHeaders {
    pub fn apply(&self, headers: &mut HeaderMap) {
        if let Ok(v) = HeaderValue::from_str(&self.policy) {
            headers.insert(RATELIMIT_POLICY.clone(), v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.state) {
            headers.insert(RATELIMIT.clone(), v);
        }
        if let Some(secs) = self.retry_after {
            headers.insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_the_draft_headers() {
        let windows = vec![WindowUse::new(1000, 43_200_000, 996, Some(20_000))];
        let d = Denied::new(windows, &[16_001], 0);
        let h = denied(&d);
        assert_eq!(h.policy, "\"budget\";q=1000;w=43200");
        assert_eq!(h.state, "\"budget\";r=4;t=17");
        assert_eq!(h.retry_after, Some(17));
        let mut map = HeaderMap::new();
        h.apply(&mut map);
        assert_eq!(map["retry-after"], "17");
        assert_eq!(map["ratelimit"], "\"budget\";r=4;t=17");
    }

    #[test]
    fn names_every_window_and_shows_the_closest_to_exhaustion() {
        let windows = vec![
            WindowUse::new(1000, 43_200_000, 300, Some(40_000_000)),
            WindowUse::new(100, 60_000, 95, Some(30_500)),
        ];
        let a = Allowed::new(windows.clone(), 0, 0, false);
        let h = allowed(&a);
        assert_eq!(
            h.policy,
            "\"budget-12h\";q=1000;w=43200, \"budget-1m\";q=100;w=60"
        );
        assert_eq!(h.state, "\"budget-1m\";r=5;t=31");
        // Denied by the long window only: it names that one.
        let d = Denied::new(windows, &[40_000_000, 0], 0);
        assert_eq!(denied(&d).state, "\"budget-12h\";r=700;t=40000");
    }

    #[test]
    fn a_period_is_named_by_its_kind_and_resets_when_it_ends() {
        use tollgate_core::period::Span;
        // 31 days from the 1st: now is 2.5 s before the end.
        let month = Span {
            start_ms: 1_000,
            end_ms: 1_000 + 31 * 86_400_000,
        };
        let now = month.end_ms - 2_500;
        let windows = vec![
            WindowUse::new(100, 60_000, 10, Some(30_000)),
            WindowUse::period(2000, month, 2000, now),
        ];
        let d = Denied::new(
            windows.clone(),
            &[0, windows[1].period_retry_after(1, now)],
            now,
        );
        let h = denied(&d);
        assert_eq!(
            h.policy,
            "\"budget-1m\";q=100;w=60, \"budget-month\";q=2000;w=2678400"
        );
        assert_eq!(h.state, "\"budget-month\";r=0;t=3");
        assert_eq!(h.retry_after, Some(3));
        assert_eq!(windows[1].label(), "month");
    }
}
