//! `[plans.X]`: a plan's limits (`Limit`), its `share`, its caps and its alert
//! thresholds.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::model_limit::{parse_model_limits, ModelLimit, RawModelLimit};
use super::{ConfigError, MAX_TOKENS};
use crate::duration;
use crate::money::Currency;
use crate::period::{Calendar, PeriodKind};

/// One limit of a plan: at most `limit` tokens spent in any trailing `window`,
/// or, with a `period`, in each calendar period (then `window` is zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub limit: u64,
    pub window: Duration,
    /// A calendar period's limit (`period = "month"`): its total resets at
    /// each period's start ([`crate::period`]).
    pub period: Option<&'static Calendar>,
}

impl Limit {
    /// A trailing window's limit.
    pub fn window(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window,
            period: None,
        }
    }

    /// A trailing window's length (0 for a period's limit).
    pub fn window_ms(&self) -> u64 {
        u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX)
    }

    pub fn is_period(&self) -> bool {
        self.period.is_some()
    }
}

/// How long the log keeps events for a plan with period limits, at least:
/// what refunds, settles and releases of a job's charge need (no job's
/// deadline is near it), not the period's length: each period's total is a
/// counter of its own, so a month's plan keeps no month of events.
pub const PERIOD_LOG_MS: u64 = 24 * 3600 * 1000;

/// Most limits one plan may set.
pub const MAX_LIMITS: usize = 8;

/// A budget plan: one or several [`Limit`]s (distinct windows, longest first). A
/// reservation is recorded only if it fits every one of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub name: String,
    /// Never empty; windows distinct, longest first, then the periods
    /// (distinct), longest first.
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
    /// Limits on the spend of the models a pattern names (`model_limits`),
    /// checked with `limits` in the same step ([`ModelLimit`]).
    pub model_limits: Vec<ModelLimit>,
    /// Whether the plan's users draw on prepaid credits (`credits = "only"`:
    /// every charge must also be covered by the user's balance, and draws
    /// from it; [`crate::credits`]).
    pub credits: crate::credits::CreditMode,
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

    /// How long the log must keep events for this plan: its longest window,
    /// and [`PERIOD_LOG_MS`] when it has a period limit.
    pub fn log_ms(&self) -> u64 {
        let periods = if self.limits.iter().any(Limit::is_period) {
            PERIOD_LOG_MS
        } else {
            0
        };
        self.window_ms().max(periods)
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
                    match l.period {
                        Some(c) => c.describe(),
                        None => duration::format(l.window),
                    }
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
    period: Option<String>,
    tz: Option<String>,
    week_start: Option<String>,
    anchor: Option<i64>,
    limits: Option<Vec<RawLimit>>,
    share: Option<i64>,
    max_in_flight: Option<i64>,
    max_stored_bytes: Option<i64>,
    max_open_streams: Option<i64>,
    alerts: Option<Vec<f64>>,
    model_limits: Option<Vec<RawModelLimit>>,
    credits: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    /// An amount of the deployment's currency: an integer or a decimal string.
    pub(super) limit: toml::Value,
    /// A trailing window (`12h`), or else a calendar `period` (`day`,
    /// `week`, `month`) with its time zone `tz` (default UTC), `week_start`
    /// (weeks; default monday) and `anchor` (months: the day it starts, 1 to
    /// 31, default 1).
    pub(super) window: Option<String>,
    pub(super) period: Option<String>,
    pub(super) tz: Option<String>,
    pub(super) week_start: Option<String>,
    pub(super) anchor: Option<i64>,
}

impl RawLimit {
    /// A trailing window's limit, as the admin's override writes it.
    pub(super) fn window(limit: toml::Value, window: String) -> Self {
        Self {
            limit,
            window: Some(window),
            period: None,
            tz: None,
            week_start: None,
            anchor: None,
        }
    }
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
        let single = p.window.is_some() || p.period.is_some();
        let calendar = p.tz.is_some() || p.week_start.is_some() || p.anchor.is_some();
        let raw_limits = match (p.limit, single, p.limits) {
            (Some(limit), true, None) => vec![RawLimit {
                limit,
                window: p.window,
                period: p.period,
                tz: p.tz,
                week_start: p.week_start,
                anchor: p.anchor,
            }],
            (None, false, Some(limits)) if !calendar => limits,
            _ => {
                return Err(invalid(
                    key,
                    "set either `limit` and `window` (or `period`), or `limits = [{ limit, window }, { limit, period }, ...]`"
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
        let model_limits =
            parse_model_limits(&key, p.model_limits.unwrap_or_default(), currency, invalid)?;
        let credits = match p.credits.as_deref() {
            None => crate::credits::CreditMode::Off,
            Some(s) => crate::credits::CreditMode::parse(s).ok_or_else(|| {
                invalid(
                    format!("{key}.credits"),
                    format!("must be \"only\" or \"off\", got {s:?}"),
                )
            })?,
        };
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
                model_limits,
                credits,
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
        let window = match (l.window, l.period) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    format!("{key}.period"),
                    "set either `window` (a trailing window) or `period` (a calendar period), not both".into(),
                ))
            }
            (None, None) => {
                return Err(invalid(
                    format!("{key}.window"),
                    "set `window` (a trailing window, e.g. \"12h\") or `period` (\"day\", \"week\" or \"month\")".into(),
                ))
            }
            (None, Some(period)) => {
                let c = parse_period(&key, &period, l.tz, l.week_start, l.anchor, invalid)?;
                if limits.iter().any(|o| o.period == Some(c)) {
                    return Err(invalid(
                        format!("{key}.period"),
                        format!("{} is set twice in one plan", c.describe()),
                    ));
                }
                limits.push(Limit {
                    limit,
                    window: Duration::ZERO,
                    period: Some(c),
                });
                continue;
            }
            (Some(window), None) => {
                for (set, name) in [
                    (l.tz.is_some(), "tz"),
                    (l.week_start.is_some(), "week_start"),
                    (l.anchor.is_some(), "anchor"),
                ] {
                    if set {
                        return Err(invalid(
                            format!("{key}.{name}"),
                            "only a calendar `period` has one, not a trailing `window`".into(),
                        ));
                    }
                }
                window
            }
        };
        let window = duration::parse(&window).map_err(|m| invalid(format!("{key}.window"), m))?;
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
        let ms = Limit::window(limit, window).window_ms();
        if limits.iter().any(|o| !o.is_period() && o.window_ms() == ms) {
            return Err(invalid(
                format!("{key}.window"),
                format!("{} is set twice in one plan", duration::format(window)),
            ));
        }
        limits.push(Limit::window(limit, window));
    }
    // Windows longest first, then periods longest first (months, weeks, days).
    limits.sort_by_key(|l| {
        let kind = l.period.map_or(0, |c| match c.kind {
            PeriodKind::Month { .. } => 1,
            PeriodKind::Week { .. } => 2,
            PeriodKind::Day => 3,
        });
        (kind, std::cmp::Reverse(l.window))
    });
    Ok(limits)
}

/// A limit's calendar period: `period` with its `tz`, `week_start` and
/// `anchor` (each refused where it does not belong).
pub(super) fn parse_period(
    key: &str,
    period: &str,
    tz: Option<String>,
    week_start: Option<String>,
    anchor: Option<i64>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<&'static Calendar, ConfigError> {
    let kind = match period {
        "day" => PeriodKind::Day,
        "week" => {
            let start = match week_start.as_deref() {
                None => jiff::civil::Weekday::Monday,
                Some(w) => crate::period::parse_weekday(w).ok_or_else(|| {
                    invalid(
                        format!("{key}.week_start"),
                        format!("unknown day {w:?} (monday, tuesday, ..., sunday)"),
                    )
                })?,
            };
            PeriodKind::Week { start }
        }
        "month" => {
            let anchor = anchor.unwrap_or(1);
            if !(1..=31).contains(&anchor) {
                return Err(invalid(
                    format!("{key}.anchor"),
                    format!("must be a day of the month, 1 to 31, got {anchor} (a shorter month starts its period on its last day)"),
                ));
            }
            PeriodKind::Month {
                anchor: anchor as i8,
            }
        }
        other => {
            return Err(invalid(
                format!("{key}.period"),
                format!("unknown period {other:?} (day, week or month)"),
            ))
        }
    };
    if week_start.is_some() && !matches!(kind, PeriodKind::Week { .. }) {
        return Err(invalid(
            format!("{key}.week_start"),
            "only a `period = \"week\"` has one".into(),
        ));
    }
    if anchor.is_some() && !matches!(kind, PeriodKind::Month { .. }) {
        return Err(invalid(
            format!("{key}.anchor"),
            "only a `period = \"month\"` has one".into(),
        ));
    }
    let tz = tz.unwrap_or_else(|| "UTC".to_owned());
    Calendar::new(kind, &tz)
        .and_then(Calendar::intern)
        .map_err(|m| invalid(format!("{key}.tz"), m))
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

    const PERIODS: &str = r#"
[plans.free]
limits = [
  { limit = "20", period = "month", anchor = 15, tz = "Europe/Berlin" },
  { limit = 5, window = "1h" },
  { limit = 3, period = "day" },
  { limit = 4, period = "week", week_start = "sunday", tz = "America/New_York" },
]
"#;

    #[test]
    fn reads_periods_beside_windows_windows_first() {
        let c = Config::parse(PERIODS, "t.toml").unwrap();
        let p = c.default_plan();
        let shape: Vec<String> = p
            .limits
            .iter()
            .map(|l| match l.period {
                Some(c) => format!("{} {}", l.limit, c.describe()),
                None => format!("{} {}", l.limit, l.window_ms()),
            })
            .collect();
        assert_eq!(
            shape,
            [
                "5 3600000",
                "20 month (anchor 15, Europe/Berlin)",
                "4 week (from sunday, America/New_York)",
                "3 day (UTC)"
            ]
        );
        assert_eq!(p.max_cost(), 3);
        // The log keeps a day for the periods' refunds, not a month.
        assert_eq!(c.retention_ms(), super::PERIOD_LOG_MS);
        let single = "[plans.free]\nlimit = 7\nperiod = \"month\"\nanchor = 31\n";
        let c = Config::parse(single, "t.toml").unwrap();
        let l = c.default_plan().limits[0];
        assert_eq!(
            l.period.map(|c| c.describe()).as_deref(),
            Some("month (anchor 31, UTC)")
        );
    }

    #[test]
    fn bad_periods_name_their_key_and_say_why() {
        for (from, to, key, why) in [
            (
                "\"Europe/Berlin\"",
                "\"Europe/Berlyn\"",
                "plans.free.limits[0].tz",
                "unknown time zone",
            ),
            (
                "anchor = 15",
                "anchor = 0",
                "plans.free.limits[0].anchor",
                "1 to 31",
            ),
            (
                "anchor = 15",
                "anchor = 32",
                "plans.free.limits[0].anchor",
                "1 to 31",
            ),
            (
                "\"sunday\"",
                "\"sonday\"",
                "plans.free.limits[3].week_start",
                "unknown day",
            ),
            (
                "period = \"day\"",
                "period = \"fortnight\"",
                "plans.free.limits[2].period",
                "unknown period",
            ),
            (
                "period = \"day\"",
                "period = \"day\", window = \"1d\"",
                "plans.free.limits[2].period",
                "not both",
            ),
            (
                "period = \"day\"",
                "period = \"day\", anchor = 3",
                "plans.free.limits[2].anchor",
                "month",
            ),
            (
                "window = \"1h\"",
                "window = \"1h\", tz = \"UTC\"",
                "plans.free.limits[1].tz",
                "period",
            ),
            (
                "{ limit = 3, period = \"day\" }",
                "{ limit = 3 }",
                "plans.free.limits[2].window",
                "period",
            ),
            (
                "{ limit = 3, period = \"day\" }",
                "{ limit = 3, period = \"month\", tz = \"Europe/Berlin\", anchor = 15 }",
                "plans.free.limits[2].period",
                "twice",
            ),
        ] {
            assert!(PERIODS.contains(from), "{from}");
            let e = err(&PERIODS.replacen(from, to, 1));
            assert!(e.contains(key) && e.contains(why), "{to}: {e}");
        }
        let e = err("[plans.free]\nlimit = 3\nperiod = \"month\"\nanchor = 0\n");
        assert!(
            e.contains("plans.free.anchor") && e.contains("1 to 31"),
            "{e}"
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
