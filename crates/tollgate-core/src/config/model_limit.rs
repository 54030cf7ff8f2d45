//! `[plans.X] model_limits`: limits on what a user spends on the models a
//! pattern names, beside the plan's overall limits, checked in the same
//! atomic step (`lua/budget/lib/model_limits.lua`, and the embedded
//! ledger's `model_limits` module).
//!
//! ```toml
//! [plans.pro]
//! limits = [{ limit = "50", period = "month" }]
//! model_limits = [{ model = "o1*", limit = "5", period = "day" }]
//! ```
//!
//! A call counts under a model limit when its pattern matches the model the
//! request named **or** the price sheet entry that priced it, both compared
//! in lowercase with surrounding spaces trimmed: `o1-preview`, `O1-Preview`
//! and a model the sheet prices by its `[default]` entry all count under
//! `o1*` by their name, and a call priced by the entry `o1*` counts under it
//! whatever it named. A call with no model (an unpriced operation, a plain
//! reserve) counts under none.

use serde::Deserialize;

use super::{ConfigError, MAX_TOKENS};
use crate::money::Currency;
use crate::period::Calendar;
use crate::price::glob::Glob;

/// Most model limits one plan may set.
pub const MAX_MODEL_LIMITS: usize = 8;
/// The longest pattern a model limit may have.
pub const MAX_MODEL_PATTERN: usize = 128;

/// One model limit: at most `limit` spent on the models `pattern` matches in
/// each calendar `period`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLimit {
    /// The pattern as written, lowercase (`*` any run of characters, `?` one).
    pub pattern: String,
    pub limit: u64,
    pub period: &'static Calendar,
    /// Names its counter in the ledgers: 8 hex digits of a hash of the
    /// pattern and the calendar, so two plans with the same model limit's
    /// pattern and calendar share the counter (a plan change keeps the
    /// spend of the same calendar, as the plan's own periods do).
    pub tag: String,
    glob: Glob,
}

impl ModelLimit {
    pub fn new(pattern: &str, limit: u64, period: &'static Calendar) -> Self {
        let pattern = pattern.trim().to_lowercase();
        let tag = tag(&pattern, period);
        crate::lock(TAGS.get_or_init(Default::default))
            .entry(tag.clone())
            .or_insert_with(|| pattern.clone());
        Self {
            tag,
            glob: Glob::new(&pattern),
            pattern,
            limit,
            period,
        }
    }

    /// Whether a call that named `model` and was priced by the sheet entry
    /// `entry` (its label: `o1*`, `default`) counts under this limit.
    pub fn matches(&self, model: &str, entry: &str) -> bool {
        let name = |s: &str| s.trim().to_lowercase();
        (!model.trim().is_empty() && self.glob.matches(&name(model)))
            || (!entry.trim().is_empty() && self.glob.matches(&name(entry)))
    }

    /// `5 USD / day (UTC) on o1*`.
    pub fn describe(&self, currency: Currency) -> String {
        format!(
            "{} {currency} / {} on {}",
            crate::money::format_amount(currency, self.limit),
            self.period.describe(),
            self.pattern
        )
    }
}

/// The pattern of every model limit made in this process, by tag: a
/// ledger's reply names a model limit by its tag.
static TAGS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, String>>> =
    std::sync::OnceLock::new();

/// The pattern of the model limit `tag` names (one of the config's).
pub fn pattern_of(tag: &str) -> Option<String> {
    crate::lock(TAGS.get_or_init(Default::default))
        .get(tag)
        .cloned()
}

/// FNV-1a (32 bits) of the pattern and the calendar, in hex: stable across
/// pods and releases (never `std`'s randomised hasher).
fn tag(pattern: &str, period: &Calendar) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in pattern
        .bytes()
        .chain(std::iter::once(b'\n'))
        .chain(period.describe().into_bytes())
    {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModelLimit {
    model: Option<String>,
    limit: Option<toml::Value>,
    window: Option<String>,
    period: Option<String>,
    tz: Option<String>,
    week_start: Option<String>,
    anchor: Option<i64>,
}

/// A plan's `model_limits` (`key`: `plans.<name>`).
pub(super) fn parse_model_limits(
    key: &str,
    raw: Vec<RawModelLimit>,
    currency: Currency,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<ModelLimit>, ConfigError> {
    if raw.is_empty() {
        return Ok(Vec::new());
    }
    if currency == Currency::Tokens {
        return Err(invalid(
            format!("{key}.model_limits"),
            "model limits count what calls on a model cost in money: set `currency` (e.g. \"USD\") and price the operations with a sheet (`prices`)".into(),
        ));
    }
    if raw.len() > MAX_MODEL_LIMITS {
        return Err(invalid(
            format!("{key}.model_limits"),
            format!("at most {MAX_MODEL_LIMITS} model limits, got {}", raw.len()),
        ));
    }
    let mut out: Vec<ModelLimit> = Vec::with_capacity(raw.len());
    for (i, l) in raw.into_iter().enumerate() {
        let key = format!("{key}.model_limits[{i}]");
        let Some(pattern) = l.model else {
            return Err(invalid(
                format!("{key}.model"),
                "set the model (a name or pattern: `model = \"o1*\"`) the limit applies to".into(),
            ));
        };
        let p = pattern.trim();
        if p.is_empty()
            || p.len() > MAX_MODEL_PATTERN
            || p.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                format!("{key}.model"),
                format!("must be a model name or pattern of 1 to {MAX_MODEL_PATTERN} characters, no spaces (`*` any run of characters, `?` one), got {pattern:?}"),
            ));
        }
        let Some(limit) = l.limit else {
            return Err(invalid(format!("{key}.limit"), "set the limit".into()));
        };
        let limit = crate::money::parse_toml(currency, &limit)
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
        if l.window.is_some() {
            return Err(invalid(
                format!("{key}.window"),
                "a model limit counts a calendar `period` (\"day\", \"week\" or \"month\"); trailing windows are not supported for model limits".into(),
            ));
        }
        let Some(period) = l.period else {
            return Err(invalid(
                format!("{key}.period"),
                "set `period` (\"day\", \"week\" or \"month\")".into(),
            ));
        };
        let c = super::plan::parse_period(&key, &period, l.tz, l.week_start, l.anchor, invalid)?;
        let m = ModelLimit::new(p, limit, c);
        if out.iter().any(|o| o.tag == m.tag) {
            return Err(invalid(
                format!("{key}.model"),
                format!(
                    "{} per {} is set twice in one plan",
                    m.pattern,
                    c.describe()
                ),
            ));
        }
        out.push(m);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::config::tests::err;
    use crate::config::Config;

    const PLAN: &str = r#"
currency = "USD"
[plans.pro]
limits = [{ limit = "50", period = "month" }]
model_limits = [{ model = "o1*", limit = "5", period = "day" }, { model = "GPT-4o*", limit = "1", period = "week", tz = "Europe/Berlin" }]
"#;

    #[test]
    fn reads_model_limits_lowercase_with_stable_tags() {
        let c = Config::parse(PLAN, "t.toml").unwrap();
        let m = &c.default_plan().model_limits;
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].pattern, "o1*");
        assert_eq!(m[0].limit, 5_000_000);
        assert_eq!(m[1].pattern, "gpt-4o*");
        assert_eq!(m[0].tag.len(), 8);
        assert_ne!(m[0].tag, m[1].tag);
        // The same pattern and calendar: the same counter in every plan.
        let again = Config::parse(PLAN, "t.toml").unwrap();
        assert_eq!(again.default_plan().model_limits[0].tag, m[0].tag);
    }

    #[test]
    fn a_model_is_matched_by_name_or_entry_whatever_its_case() {
        let c = Config::parse(PLAN, "t.toml").unwrap();
        let o1 = &c.default_plan().model_limits[0];
        assert!(o1.matches("o1-preview", "default"));
        assert!(o1.matches(" O1-Preview ", "default"));
        assert!(o1.matches("my-alias", "o1*"));
        assert!(!o1.matches("gpt-4o", "gpt-4o*"));
        assert!(!o1.matches("", ""));
    }

    #[test]
    fn bad_model_limits_name_their_key() {
        for (from, to, key, why) in [
            (
                "model = \"o1*\", ",
                "",
                "plans.pro.model_limits[0].model",
                "set the model",
            ),
            (
                "\"o1*\"",
                "\"o1 *\"",
                "plans.pro.model_limits[0].model",
                "no spaces",
            ),
            (
                "\"o1*\"",
                "\"\"",
                "plans.pro.model_limits[0].model",
                "1 to 128",
            ),
            (
                "period = \"day\"",
                "period = \"fortnight\"",
                "plans.pro.model_limits[0].period",
                "unknown period",
            ),
            (
                "period = \"day\"",
                "window = \"1h\"",
                "plans.pro.model_limits[0].window",
                "period",
            ),
            (
                "limit = \"5\"",
                "limit = \"0\"",
                "plans.pro.model_limits[0].limit",
                "> 0",
            ),
            (
                "\"GPT-4o*\", limit = \"1\", period = \"week\", tz = \"Europe/Berlin\"",
                "\"O1*\", limit = \"1\", period = \"day\"",
                "plans.pro.model_limits[1].model",
                "twice",
            ),
        ] {
            assert!(PLAN.contains(from), "{from}");
            let e = err(&PLAN.replacen(from, to, 1));
            assert!(e.contains(key) && e.contains(why), "{to}: {e}");
        }
        let e = err("[plans.pro]\nlimit = 5\nwindow = \"1h\"\nmodel_limits = [{ model = \"o1*\", limit = 1, period = \"day\" }]\n");
        assert!(
            e.contains("plans.pro.model_limits") && e.contains("currency"),
            "{e}"
        );
    }
}
