//! A provider's HTTP upstream (`url`, auth, headers, `timeout`, `retries` in
//! `[providers.X]`): where its calls go.

use std::collections::BTreeMap;
use std::time::Duration;

use super::ConfigError;
use crate::duration;

/// Where a provider's calls go. Without one, workers use the built-in
/// in-process mock provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `http://host[:port][/base]`: jobs' input JSON is POSTed here (plus the
    /// operation's `path`).
    pub url: String,
    /// Header that carries the credential, e.g. `Authorization`.
    pub auth_header: Option<String>,
    /// Environment variable holding the header's value (read when the worker
    /// starts; never stored in the config).
    pub auth_env: Option<String>,
    /// Static headers sent with every call (`headers = { "anthropic-version"
    /// = "2023-06-01" }`).
    pub headers: BTreeMap<String, String>,
    /// Secret headers: header name -> the environment variable holding its
    /// value (read when the worker starts, which refuses to start without it;
    /// never logged), e.g. `secret_headers = { "x-api-key" = "ANTHROPIC_API_KEY" }`.
    pub secret_headers: BTreeMap<String, String>,
    /// Bounds one HTTP call.
    pub timeout: Duration,
    /// Retries after a 429 or 5xx (each after the upstream's `Retry-After`, or
    /// an exponential backoff, and a new throttle grant).
    pub retries: u32,
    /// The model name sent in place of the request's `model` (a pool
    /// member's `model`: the same model under another deployment's name);
    /// `None`: the request's own.
    pub model: Option<String>,
}

/// The upstream fields of a `[providers.X]` table, or of one of its
/// `members` (which has no `auth_*`, and takes `timeout` and `retries` from
/// its provider).
pub(super) struct UpstreamFields<'a> {
    pub url: Option<&'a String>,
    pub auth_header: Option<&'a String>,
    pub auth_env: Option<&'a String>,
    pub headers: Option<&'a BTreeMap<String, String>>,
    pub secret_headers: Option<&'a BTreeMap<String, String>>,
    pub timeout: Option<&'a String>,
    pub retries: Option<i64>,
}

/// Default `timeout` of an upstream call.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `retries` of an upstream.
pub const DEFAULT_RETRIES: u32 = 2;

/// `http://` or `https://`, then a host (a name, an IPv4 address or a
/// bracketed IPv6 one), an optional numeric port, and no blank anywhere:
/// `http://`, `http://:80` and `http:///x` have no host.
pub fn http_url_with_host(url: &str) -> bool {
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return false;
    };
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = if let Some(v6) = host_port.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, p)) if !h.is_empty() => (h, p.strip_prefix(':')),
            _ => return false,
        }
    } else {
        match host_port.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        }
    };
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
    !host.is_empty() && port_ok
}
/// Headers of an upstream call that tollgate sets itself: no provider's
/// `headers` or `secret_headers` may name them.
pub const RESERVED_HEADERS: [&str; 7] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "idempotency-key",
    "traceparent",
    "content-type",
];

/// An HTTP header name (an RFC 9110 token).
fn header_name(h: &str) -> bool {
    !h.is_empty()
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c))
}

pub(super) fn parse_upstream(
    key: &str,
    p: &UpstreamFields<'_>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Option<Upstream>, ConfigError> {
    let Some(url) = p.url else {
        for (field, set) in [
            ("auth_header", p.auth_header.is_some()),
            ("auth_env", p.auth_env.is_some()),
            ("headers", p.headers.is_some()),
            ("secret_headers", p.secret_headers.is_some()),
            ("timeout", p.timeout.is_some()),
            ("retries", p.retries.is_some()),
        ] {
            if set {
                return Err(invalid(
                    format!("{key}.{field}"),
                    "needs `url` (without url the built-in mock runs the calls)".into(),
                ));
            }
        }
        return Ok(None);
    };
    if !http_url_with_host(url) {
        return Err(invalid(
            format!("{key}.url"),
            format!("must be an http:// or https:// URL with a host, got {url:?}"),
        ));
    }
    if p.auth_header.is_some() != p.auth_env.is_some() {
        return Err(invalid(
            format!("{key}.auth_env"),
            "auth_header and auth_env go together (the header's value is read from the variable)"
                .into(),
        ));
    }
    if let Some(h) = p.auth_header {
        if !header_name(h) {
            return Err(invalid(
                format!("{key}.auth_header"),
                format!("is not a valid header name: {h:?}"),
            ));
        }
    }
    let headers = p.headers.cloned().unwrap_or_default();
    let secret_headers = p.secret_headers.cloned().unwrap_or_default();
    let mut seen: Vec<String> = p
        .auth_header
        .iter()
        .map(|h| h.to_ascii_lowercase())
        .collect();
    for (field, map) in [("headers", &headers), ("secret_headers", &secret_headers)] {
        for (name, value) in map {
            let at = || format!("{key}.{field}.{name}");
            if !header_name(name) {
                return Err(invalid(at(), "is not a valid header name".into()));
            }
            let lower = name.to_ascii_lowercase();
            if RESERVED_HEADERS.contains(&lower.as_str()) {
                return Err(invalid(
                    at(),
                    format!(
                        "tollgate sets this header itself (reserved: {})",
                        RESERVED_HEADERS.join(", ")
                    ),
                ));
            }
            if seen.contains(&lower) {
                return Err(invalid(
                    at(),
                    "is set twice (headers, secret_headers and auth_header name each header once)"
                        .into(),
                ));
            }
            seen.push(lower);
            let ok = if field == "headers" {
                value
                    .bytes()
                    .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
            } else {
                !value.is_empty()
                    && !value.starts_with(|c: char| c.is_ascii_digit())
                    && value
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_')
            };
            if !ok {
                return Err(invalid(
                    at(),
                    if field == "headers" {
                        "must be visible ASCII (spaces and tabs allowed)".into()
                    } else {
                        format!(
                            "must name an environment variable (letters, digits, _), got {value:?}"
                        )
                    },
                ));
            }
        }
    }
    let (timeout, retries) = parse_call_policy(key, p.timeout, p.retries, invalid)?;
    Ok(Some(Upstream {
        url: url.trim_end_matches('/').to_owned(),
        auth_header: p.auth_header.cloned(),
        auth_env: p.auth_env.cloned(),
        headers,
        secret_headers,
        timeout,
        retries,
        model: None,
    }))
}

/// `timeout` (default [`DEFAULT_UPSTREAM_TIMEOUT`]) and `retries` (default
/// [`DEFAULT_RETRIES`]) of `key`.
pub(super) fn parse_call_policy(
    key: &str,
    timeout: Option<&String>,
    retries: Option<i64>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<(Duration, u32), ConfigError> {
    let timeout = match timeout {
        Some(t) => duration::parse(t).map_err(|m| invalid(format!("{key}.timeout"), m))?,
        None => DEFAULT_UPSTREAM_TIMEOUT,
    };
    if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(600) {
        return Err(invalid(
            format!("{key}.timeout"),
            "must be between 1ms and 10m".into(),
        ));
    }
    let retries = retries.unwrap_or(i64::from(DEFAULT_RETRIES));
    if !(0..=10).contains(&retries) {
        return Err(invalid(
            format!("{key}.retries"),
            format!("must be between 0 and 10, got {retries}"),
        ));
    }
    Ok((timeout, retries as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{err, OPERATIONS};
    use crate::config::Config;

    #[test]
    fn provider_headers_are_checked() {
        let with = |lines: &str| {
            OPERATIONS.replace(
                "url = \"http://127.0.0.1:9100\"\n",
                &format!("url = \"http://127.0.0.1:9100\"\n{lines}\n"),
            )
        };
        let c = Config::parse(
            &with("headers = { \"anthropic-version\" = \"2023-06-01\" }\nsecret_headers = { \"x-api-key\" = \"ANTHROPIC_API_KEY\" }"),
            "t.toml",
        )
        .unwrap();
        let up = c.upstream("llm").unwrap();
        assert_eq!(up.headers["anthropic-version"], "2023-06-01");
        assert_eq!(up.secret_headers["x-api-key"], "ANTHROPIC_API_KEY");
        for (lines, key) in [
            ("headers = { \"bad header\" = \"x\" }", "headers.bad header"),
            ("headers = { \"x-a\" = \"line\\nbreak\" }", "headers.x-a"),
            ("headers = { \"Content-Type\" = \"text/plain\" }", "reserved"),
            ("headers = { \"Idempotency-Key\" = \"x\" }", "reserved"),
            ("secret_headers = { \"x-api-key\" = \"NOT A VAR\" }", "secret_headers.x-api-key"),
            ("secret_headers = { \"x-api-key\" = \"\" }", "secret_headers.x-api-key"),
            (
                "headers = { \"X-Key\" = \"a\" }\nsecret_headers = { \"x-key\" = \"K\" }",
                "set twice",
            ),
            (
                "auth_header = \"X-Key\"\nauth_env = \"K\"\nsecret_headers = { \"x-key\" = \"K2\" }",
                "set twice",
            ),
        ] {
            let e = err(&with(lines));
            assert!(e.contains(key), "{lines}: {e}");
        }
        let no_url = OPERATIONS.replace(
            "url = \"http://127.0.0.1:9100\"\n",
            "headers = { \"a\" = \"b\" }\n",
        );
        assert!(err(&no_url).contains("needs `url`"), "{}", err(&no_url));
        let exposed = OPERATIONS.replace(
            "provider = \"llm\"\n",
            "provider = \"llm\"\nexpose_upstream_errors = true\n",
        );
        let c = Config::parse(&exposed, "t.toml").unwrap();
        assert!(
            c.operation("llm.structured")
                .unwrap()
                .expose_upstream_errors
        );
        let c = Config::parse(OPERATIONS, "t.toml").unwrap();
        assert!(
            !c.operation("llm.structured")
                .unwrap()
                .expose_upstream_errors
        );
    }

    #[test]
    fn urls_need_a_host() {
        for good in [
            "http://x",
            "https://api.example.com/v1",
            "http://127.0.0.1:9100",
            "http://[::1]:80/p",
            "https://user:pw@h.example:8443?q",
        ] {
            assert!(http_url_with_host(good), "{good}");
        }
        for bad in [
            "http://",
            "https://",
            "http:///x",
            "http://:80",
            "http://h:",
            "http://h:99999",
            "http://[]:1",
            "ftp://x",
            "http://a b",
            "http://u@/x",
        ] {
            assert!(!http_url_with_host(bad), "{bad}");
        }
    }
}
