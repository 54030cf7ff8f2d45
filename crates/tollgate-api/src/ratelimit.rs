//! The budget headers of every metered response: `RateLimit-Policy` and
//! `RateLimit` (draft-ietf-httpapi-ratelimit-headers), and `Retry-After` on 429.
//!
//! ```text
//! RateLimit-Policy: "budget";q=1000;w=43200     the plan: 1000 tokens per 12 h
//! RateLimit: "budget";r=992;t=3600              992 left; more frees up in 3600 s
//! Retry-After: 17                               (429 only) ceil(retry_after_ms / 1000)
//! ```

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use tollgate_core::ledger::{Allowed, Denied};

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The policy name in both headers.
pub const POLICY: &str = "budget";

/// A user's plan, as the headers show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub limit: u64,
    pub window_ms: u64,
}

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

impl RateLimit {
    fn policy(&self) -> String {
        format!(
            "\"{POLICY}\";q={};w={}",
            self.limit,
            ceil_secs(self.window_ms)
        )
    }

    /// `remaining` tokens left; more become free in `reset_ms`.
    pub fn state(&self, remaining: u64, reset_ms: u64) -> RateLimitHeaders {
        RateLimitHeaders {
            policy: self.policy(),
            state: format!("\"{POLICY}\";r={remaining};t={}", ceil_secs(reset_ms)),
            retry_after: None,
        }
    }

    pub fn allowed(&self, a: &Allowed) -> RateLimitHeaders {
        self.state(a.remaining, a.reset_after_ms)
    }

    /// A denial: `t` and `Retry-After` are when this request's cost fits.
    pub fn denied(&self, d: &Denied) -> RateLimitHeaders {
        let mut h = self.state(d.remaining, d.retry_after_ms);
        h.retry_after = Some(ceil_secs(d.retry_after_ms));
        h
    }
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
        let rl = RateLimit {
            limit: 1000,
            window_ms: 43_200_000,
        };
        let d = Denied {
            used: 996,
            limit: 1000,
            remaining: 4,
            retry_after_ms: 16_001,
            now_ms: 0,
        };
        let h = rl.denied(&d);
        assert_eq!(h.policy, "\"budget\";q=1000;w=43200");
        assert_eq!(h.state, "\"budget\";r=4;t=17");
        assert_eq!(h.retry_after, Some(17));
        let mut map = HeaderMap::new();
        h.apply(&mut map);
        assert_eq!(map["retry-after"], "17");
        assert_eq!(map["ratelimit"], "\"budget\";r=4;t=17");
    }
}
