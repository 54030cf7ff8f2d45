//! `[alerts]`: where usage alerts are sent (a plan's `alerts` say when).

use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;
use crate::duration;

/// `[alerts]`: where usage alerts are sent (see `docs/src/alerts.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alerts {
    /// The webhook's URL (`http://` or `https://`).
    pub url: String,
    /// The environment variable holding the HMAC-SHA256 secret the
    /// `Tollgate-Signature` header is made with (read at start-up).
    pub secret_env: String,
    /// How long one delivery attempt may take (`timeout`, default 10 s).
    pub timeout: Duration,
    /// How long an alert is retried before it is dropped and counted as
    /// failed (`keep`, default 24 h, at most [`MAX_ALERT_KEEP`]).
    pub keep: Duration,
}

/// Default `[alerts] timeout` and `keep`, and the most `keep` may be (the
/// Redis outbox keys expire a little after it).
pub const DEFAULT_ALERT_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_ALERT_KEEP: Duration = Duration::from_secs(24 * 3600);
pub const MAX_ALERT_KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAlerts {
    url: String,
    secret_env: String,
    timeout: Option<String>,
    keep: Option<String>,
}

pub(super) fn parse_alerts(
    raw: RawAlerts,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Alerts, ConfigError> {
    let url = raw.url.trim().to_owned();
    let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
    if !scheme_ok || url.len() > 2048 || url.chars().any(char::is_whitespace) {
        return Err(invalid(
            "alerts.url".into(),
            format!("must be an http:// or https:// URL, got {url:?}"),
        ));
    }
    let env_ok = !raw.secret_env.is_empty()
        && raw.secret_env.len() <= 128
        && raw
            .secret_env
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !env_ok {
        return Err(invalid(
            "alerts.secret_env".into(),
            format!(
                "must name an environment variable (ASCII letters, digits, _), got {:?}",
                raw.secret_env
            ),
        ));
    }
    let timeout = match &raw.timeout {
        Some(d) => duration::parse(d).map_err(|m| invalid("alerts.timeout".into(), m))?,
        None => DEFAULT_ALERT_TIMEOUT,
    };
    if timeout < Duration::from_millis(100) || timeout > Duration::from_secs(300) {
        return Err(invalid(
            "alerts.timeout".into(),
            "must be between 100ms and 5m".into(),
        ));
    }
    let keep = match &raw.keep {
        Some(d) => duration::parse(d).map_err(|m| invalid("alerts.keep".into(), m))?,
        None => DEFAULT_ALERT_KEEP,
    };
    if keep < Duration::from_secs(1) || keep > MAX_ALERT_KEEP {
        return Err(invalid(
            "alerts.keep".into(),
            "must be between 1s and 7d".into(),
        ));
    }
    Ok(Alerts {
        url,
        secret_env: raw.secret_env,
        timeout,
        keep,
    })
}
