//! `[plans.X]`: a plan's limits (`Limit`), its `share`, its caps and its alert
//! thresholds.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, MAX_TOKENS};
use crate::duration;
use crate::money::Currency;

/// One limit of a plan: at most `limit` tokens spent in any trailing `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub limit: u64,
    pub window: Duration,
}

impl Limit {
    pub fn window_ms(&self) -> u64 {
        u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX)
    }
}

/// Most limits one plan may set.
pub const MAX_LIMITS: usize = 8;

/// A budget plan: one or several [`Limit`]s (distinct windows, longest first). A
/// reservation is recorded only if it fits every one of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub name: String,
    /// Never empty; windows distinct, longest first.
    pub limits: Vec<Limit>,
    /// The plan's weight in a saturated provider's fair queue (`share`,
    /// default 1): while users of two plans both wait, grants go to them in
    /// the ratio of their shares.
    pub share: u32,
    /// At most this many of a user's calls hold a slot of one provider at
    /// once (`max_in_flight`, at each provider; fair queuing only). The rest
    /// wait in the user's own queue.
    pub max_in_flight: Option<u32>,
    /// At most this many bytes of a user's jobs are stored in one operation's
    /// queue at once (`max_stored_bytes`, default [`DEFAULT_MAX_STORED_BYTES`]):
    /// inputs of jobs not finished, results and errors still kept, each job
    /// counted with [`JOB_RECORD_BYTES`] more. Checked when a job is submitted.
    pub max_stored_bytes: u64,
    /// At most this many of a user's streamed answers are open at once on
    /// one api pod (`max_open_streams`, default [`DEFAULT_MAX_OPEN_STREAMS`]):
    /// one more is refused before anything is charged (429
    /// `too-many-streams`).
    pub max_open_streams: u32,
    /// Usage alerts (`alerts = [0.8, 1.0]`): the fractions of each limit
    /// whose crossing queues a webhook (with `[alerts]` configured), in basis
    /// points (1/10000), ascending, each in 1..=10000.
    pub alerts: Vec<u32>,
}

/// The most thresholds a plan's `alerts` may list.
pub const MAX_ALERT_THRESHOLDS: usize = 8;

/// The token count at or above which `bp` basis points of `limit` are
/// reached: `ceil(limit * bp / 10000)`, in integers (exact for every limit).
pub fn threshold_tokens(limit: u64, bp: u32) -> u64 {
    let n = u128::from(limit) * u128::from(bp);
    u64::try_from(n.div_ceil(10_000)).unwrap_or(u64::MAX)
}

/// A threshold in basis points as the fraction it was written as (`0.8`, `1`).
pub fn threshold_text(bp: u32) -> String {
    let whole = bp / 10_000;
    let frac = bp % 10_000;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:04}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// Default `max_open_streams` of a plan: more streams at once than an
/// application serving one person opens, few enough that one user's
/// streams hold a small part of a pod's stream readers.
pub const DEFAULT_MAX_OPEN_STREAMS: u32 = 32;
/// The most `max_open_streams` may be.
pub const MAX_OPEN_STREAMS: u32 = 100_000;

/// Default `max_stored_bytes` of a plan: 8 MiB per operation queue.
pub const DEFAULT_MAX_STORED_BYTES: u64 = 8 << 20;
/// The most `max_stored_bytes` may be: 1 GiB.
pub const MAX_STORED_BYTES: u64 = 1 << 30;
/// What one job counts towards `max_stored_bytes` besides its input and
/// result: its record's own fields and keys.
pub const JOB_RECORD_BYTES: u64 = 256;

impl Plan {
    /// The plan's longest window (the log keeps events for
    /// [`Config::retention_ms`](super::Config::retention_ms), which is at least this).
    pub fn window_ms(&self) -> u64 {
        self.limits.first().map_or(0, Limit::window_ms)
    }

    /// The smallest limit: the largest cost the plan could ever admit.
    pub fn max_cost(&self) -> u64 {
        self.limits.iter().map(|l| l.limit).min().unwrap_or(0)
    }

    /// `1000 tokens / 12h` or `1000 tokens / 12h + 100 tokens / 1m`; in a
    /// money `currency`, `20 USD / 30d`.
    pub fn describe(&self, currency: Currency) -> String {
        self.limits
            .iter()
            .map(|l| {
                format!(
                    "{} {currency} / {}",
                    crate::money::format_amount(currency, l.limit),
                    duration::format(l.window)
                )
            })
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// Largest accepted plan `share` and `max_in_flight`.
pub const MAX_SHARE: u32 = 1000;
pub const MAX_IN_FLIGHT: u32 = 100_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlan {
    limit: Option<toml::Value>,
    window: Option<String>,
    limits: Option<Vec<RawLimit>>,
    share: Option<i64>,
    max_in_flight: Option<i64>,
    max_stored_bytes: Option<i64>,
    max_open_streams: Option<i64>,
    alerts: Option<Vec<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    /// An amount of the deployment's currency: an integer or a decimal string.
    pub(super) limit: toml::Value,
    pub(super) window: String,
}

/// The `[plans.X]` tables, each checked (its name, limits, share, caps and
/// thresholds).
pub(super) fn parse_plans(
    raw: BTreeMap<String, RawPlan>,
    currency: Currency,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<BTreeMap<String, Plan>, ConfigError> {
    let mut plans = BTreeMap::new();
    for (name, p) in raw {
        let key = format!("plans.{name}");
        if let Err(e) = crate::id::UserId::new(name.as_str()) {
            return Err(invalid(key, format!("bad plan name: {e}")));
        }
        let raw_limits = match (p.limit, p.window, p.limits) {
            (Some(limit), Some(window), None) => vec![RawLimit { limit, window }],
            (None, None, Some(limits)) => limits,
            _ => {
                return Err(invalid(
                    key,
                    "set either `limit` and `window`, or `limits = [{ limit, window }, ...]`"
                        .into(),
                ))
            }
        };
        let limits = parse_limits(&key, raw_limits, currency, invalid)?;
        let share = p.share.unwrap_or(1);
        if !(1..=i64::from(MAX_SHARE)).contains(&share) {
            return Err(invalid(
                format!("{key}.share"),
                format!("must be between 1 and {MAX_SHARE}, got {share}"),
            ));
        }
        let max_in_flight = match p.max_in_flight {
            None => None,
            Some(n) if (1..=i64::from(MAX_IN_FLIGHT)).contains(&n) => Some(n as u32),
            Some(n) => {
                return Err(invalid(
                    format!("{key}.max_in_flight"),
                    format!("must be between 1 and {MAX_IN_FLIGHT}, got {n}"),
                ))
            }
        };
        let max_stored_bytes = match p.max_stored_bytes {
            None => DEFAULT_MAX_STORED_BYTES,
            Some(n) if (1024..=MAX_STORED_BYTES as i64).contains(&n) => n as u64,
            Some(n) => {
                return Err(invalid(
                    format!("{key}.max_stored_bytes"),
                    format!("must be between 1024 and {MAX_STORED_BYTES}, got {n}"),
                ))
            }
        };
        let max_open_streams = match p.max_open_streams {
            None => DEFAULT_MAX_OPEN_STREAMS,
            Some(n) if (1..=i64::from(MAX_OPEN_STREAMS)).contains(&n) => n as u32,
            Some(n) => {
                return Err(invalid(
                    format!("{key}.max_open_streams"),
                    format!("must be between 1 and {MAX_OPEN_STREAMS}, got {n}"),
                ))
            }
        };
        let alerts = parse_thresholds(&key, p.alerts.unwrap_or_default(), invalid)?;
        plans.insert(
            name.clone(),
            Plan {
                name,
                limits,
                share: share as u32,
                max_in_flight,
                max_stored_bytes,
                max_open_streams,
                alerts,
            },
        );
    }
    Ok(plans)
}

/// A plan's `alerts`: fractions of each limit in (0, 1] with at most 4
/// decimals, distinct; returned in basis points, ascending.
fn parse_thresholds(
    key: &str,
    raw: Vec<f64>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<u32>, ConfigError> {
    let key = format!("{key}.alerts");
    if raw.len() > MAX_ALERT_THRESHOLDS {
        return Err(invalid(
            key,
            format!(
                "at most {MAX_ALERT_THRESHOLDS} thresholds, got {}",
                raw.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(raw.len());
    for t in raw {
        if !(t.is_finite() && t > 0.0 && t <= 1.0) {
            return Err(invalid(
                key,
                format!("each threshold must be a fraction of the limit in (0, 1], got {t}"),
            ));
        }
        let bp = (t * 10_000.0).round();
        if (bp - t * 10_000.0).abs() > 1e-6 || bp < 1.0 {
            return Err(invalid(
                key,
                format!("thresholds have at most 4 decimals (0.0001 steps), got {t}"),
            ));
        }
        let bp = bp as u32;
        if out.contains(&bp) {
            return Err(invalid(key, format!("{t} is listed twice")));
        }
        out.push(bp);
    }
    out.sort_unstable();
    Ok(out)
}

pub(super) fn parse_limits(
    key: &str,
    raw: Vec<RawLimit>,
    currency: Currency,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<Limit>, ConfigError> {
    if raw.is_empty() || raw.len() > MAX_LIMITS {
        return Err(invalid(
            format!("{key}.limits"),
            format!("must hold 1 to {MAX_LIMITS} limits, got {}", raw.len()),
        ));
    }
    let single = raw.len() == 1;
    let mut limits: Vec<Limit> = Vec::with_capacity(raw.len());
    for (i, l) in raw.into_iter().enumerate() {
        let key = if single {
            key.to_owned()
        } else {
            format!("{key}.limits[{i}]")
        };
        let limit = crate::money::parse_toml(currency, &l.limit)
            .map_err(|m| invalid(format!("{key}.limit"), m))?;
        if limit == 0 {
            return Err(invalid(format!("{key}.limit"), "must be > 0, got 0".into()));
        }
        if limit > MAX_TOKENS {
            return Err(invalid(
                format!("{key}.limit"),
                format!("must be <= {MAX_TOKENS}"),
            ));
        }
        let window = duration::parse(&l.window).map_err(|m| invalid(format!("{key}.window"), m))?;
        if window < Duration::from_millis(1) {
            return Err(invalid(
                format!("{key}.window"),
                "must be at least 1ms".into(),
            ));
        }
        if window > Duration::from_secs(366 * 86_400) {
            return Err(invalid(
                format!("{key}.window"),
                "must be at most 366d".into(),
            ));
        }
        // Milliseconds are what the ledger counts in: two windows equal there are one.
        let ms = Limit { limit, window }.window_ms();
        if limits.iter().any(|o| o.window_ms() == ms) {
            return Err(invalid(
                format!("{key}.window"),
                format!("{} is set twice in one plan", l.window),
            ));
        }
        limits.push(Limit { limit, window });
    }
    limits.sort_by_key(|l| std::cmp::Reverse(l.window));
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use crate::config::tests::err;
    use crate::config::Config;

    const WINDOWS: &str = r#"
[plans.free]
limits = [{ limit = 100, window = "1m" }, { limit = 1000, window = "12h" }, { limit = 5, window = "1s" }]
"#;

    #[test]
    fn reads_several_limits_longest_window_first() {
        let c = Config::parse(WINDOWS, "t.toml").unwrap();
        let p = c.default_plan();
        let shape: Vec<(u64, u64)> = p.limits.iter().map(|l| (l.limit, l.window_ms())).collect();
        assert_eq!(shape, vec![(1000, 43_200_000), (100, 60_000), (5, 1000)]);
        assert_eq!(p.window_ms(), 43_200_000);
        assert_eq!(p.max_cost(), 5);
        assert_eq!(
            p.describe(crate::money::Currency::Tokens),
            "1000 tokens / 12h + 100 tokens / 1m + 5 tokens / 1s"
        );
    }

    #[test]
    fn limits_errors_name_the_key() {
        for (from, to, key) in [
            ("limit = 100,", "limit = 0,", "plans.free.limits[0].limit"),
            ("\"1s\"", "\"1m\"", "plans.free.limits[2].window"),
            (
                "window = \"12h\"",
                "window = \"later\"",
                "plans.free.limits[1].window",
            ),
            ("limits = [", "limit = 3\nlimits = [", "plans.free"),
        ] {
            let e = err(&WINDOWS.replacen(from, to, 1));
            assert!(e.contains(key), "{to}: {e}");
        }
        let e = err("[plans.free]\nlimits = []");
        assert!(
            e.contains("plans.free.limits") && e.contains("1 to 8"),
            "{e}"
        );
        let nine = (1..=9)
            .map(|i| format!("{{ limit = 1, window = \"{i}s\" }}"))
            .collect::<Vec<_>>()
            .join(", ");
        let e = err(&format!("[plans.free]\nlimits = [{nine}]"));
        assert!(e.contains("1 to 8"), "{e}");
        let e = err("[plans.free]\nwindow = \"1h\"");
        assert!(e.contains("plans.free") && e.contains("either"), "{e}");
    }
}
