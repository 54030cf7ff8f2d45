//! [`Head`]: what an upstream's successful answer said besides its body (its
//! status and the headers safe to pass on), kept with a job's result so that
//! a pass-through answer carries them to the caller.
//!
//! Safe means an allow-list ([`Head::SAFE`]): the upstream's request ids and
//! timing, which a caller quotes to the provider's support and the SDKs expose.
//! Never hop-by-hop or framing headers (tollgate frames its own answer), never
//! cookies or auth, never the provider's account (`openai-organization`,
//! `anthropic-organization-id`), and not the provider's rate-limit headers
//! (`x-ratelimit-*`, `anthropic-ratelimit-*`, `retry-after`): they describe the
//! operator's shared quota at the provider, not the caller's, and would
//! mislead a client that paces itself by them; tollgate's own `RateLimit`
//! headers describe the caller's budget.

use serde::{Deserialize, Serialize};

/// The most bytes of one header value kept.
const MAX_VALUE: usize = 256;

/// An upstream answer's status and safe headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    /// A 2xx status (a successful answer).
    pub status: u16,
    /// Safe headers, lower-case names, in the upstream's order.
    pub headers: Vec<(String, String)>,
}

impl Head {
    /// The headers passed on (lower case): request ids and processing time.
    pub const SAFE: [&'static str; 4] = [
        "x-request-id",
        "request-id",
        "openai-processing-ms",
        "openai-version",
    ];

    /// The head of an answer with `status` and `headers` (name, value): only
    /// the safe ones, values of printable ASCII and at most 256 bytes.
    pub fn safe<'a>(status: u16, headers: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        let headers = headers
            .into_iter()
            .filter_map(|(name, value)| {
                let name = name.to_ascii_lowercase();
                let ok = Self::SAFE.contains(&name.as_str())
                    && value.len() <= MAX_VALUE
                    && value.iter().all(|b| (0x20..0x7f).contains(b));
                ok.then(|| (name, String::from_utf8_lossy(value).into_owned()))
            })
            .collect();
        Self { status, headers }
    }

    /// Its stored size in bytes (what it adds to a user's stored bytes).
    pub fn stored_len(&self) -> usize {
        3 + self
            .headers
            .iter()
            .map(|(n, v)| n.len() + v.len() + 2)
            .sum::<usize>()
    }

    /// Whether passing it on changes anything (not a plain 200 without
    /// headers).
    pub fn is_plain(&self) -> bool {
        self.status == 200 && self.headers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_safe_printable_headers() {
        let long = "x".repeat(MAX_VALUE + 1);
        let head = Head::safe(
            201,
            [
                ("X-Request-Id", b"req_1".as_slice()),
                ("openai-organization", b"org-secret".as_slice()),
                ("x-ratelimit-remaining-requests", b"3".as_slice()),
                ("set-cookie", b"a=b".as_slice()),
                ("transfer-encoding", b"chunked".as_slice()),
                ("request-id", b"bad\nvalue".as_slice()),
                ("openai-processing-ms", long.as_bytes()),
                ("openai-version", b"2020-10-01".as_slice()),
            ],
        );
        assert_eq!(head.status, 201);
        assert_eq!(
            head.headers,
            vec![
                ("x-request-id".into(), "req_1".into()),
                ("openai-version".into(), "2020-10-01".into()),
            ]
        );
        assert!(!head.is_plain());
        assert!(Head::safe(200, []).is_plain());
    }
}
