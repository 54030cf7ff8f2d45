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
/// period's: `budget-month`, `budget-week`, `budget-day`). The plan's own
/// limit of that length, where a model limit has the same.
pub fn policy_name(windows: &[WindowUse], window_ms: u64) -> String {
    let w = windows
        .iter()
        .filter(|w| w.window_ms == window_ms)
        .min_by_key(|w| w.model.is_some());
    match w {
        Some(w) => policy_of(windows, w),
        None if overall(windows) <= 1 => POLICY.to_owned(),
        None => format!(
            "{POLICY}-{}",
            duration::format(std::time::Duration::from_millis(window_ms))
        ),
    }
}

/// How many of `windows` are the plan's own limits (not a model limit's):
/// a plan of one is named `budget` whatever its model limits.
fn overall(windows: &[WindowUse]) -> usize {
    windows.iter().filter(|w| w.model.is_none()).count()
}

/// The policy name of `w`, one of `windows`: as [`policy_name`]; a model
/// limit's is followed by its pattern (`budget-day-o1*`).
pub fn policy_of(windows: &[WindowUse], w: &WindowUse) -> String {
    match &w.model {
        Some(m) => format!("{POLICY}-{}-{m}", w.period_label()),
        None if overall(windows) <= 1 => POLICY.to_owned(),
        None => format!("{POLICY}-{}", w.period_label()),
    }
}

fn headers(windows: &[WindowUse], window_ms: u64, remaining: u64, t_ms: u64) -> RateLimitHeaders {
    // The binding window: the plan's own limit of that length, else a model
    // limit's (a call refused by it).
    let binding = windows
        .iter()
        .filter(|w| w.window_ms == window_ms && w.remaining == remaining)
        .min_by_key(|w| w.model.is_some());
    let policy = windows
        .iter()
        .map(|w| {
            format!(
                "\"{}\";q={};w={}",
                policy_of(windows, w),
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
            binding.map_or_else(
                || policy_name(windows, window_ms),
                |w| policy_of(windows, w)
            ),
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

    #[test]
    fn a_model_limit_is_named_by_its_period_and_pattern() {
        use tollgate_core::period::Span;
        let day = Span {
            start_ms: 0,
            end_ms: 86_400_000,
        };
        let now = day.end_ms - 10_000;
        // A plan of one limit (a day too) and a model limit of a day.
        let windows = vec![
            WindowUse::period(50, day, 30, now),
            WindowUse::period(5, day, 3, now).for_model("o1*"),
        ];
        let d = Denied::new(windows.clone(), &[0, 10_000], now);
        let h = denied(&d);
        assert_eq!(
            h.policy,
            "\"budget\";q=50;w=86400, \"budget-day-o1*\";q=5;w=86400"
        );
        assert_eq!(h.state, "\"budget-day-o1*\";r=2;t=10");
        assert_eq!(windows[1].label(), "day on o1*");
        // Allowed: the plan's own limit is named `budget` as before.
        let a = Allowed::new(vec![windows[0].clone()], 0, now, false);
        assert_eq!(allowed(&a).state, "\"budget\";r=20;t=10");
    }
}
