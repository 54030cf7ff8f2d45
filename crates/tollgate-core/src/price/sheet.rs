//! [`PriceSheet`]: the operator's prices, per model name or pattern, read from
//! TOML and checked strictly, every error naming its key.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::glob::{is_pattern, Glob};
use super::{Entry, UnitPrice};
use crate::config::ConfigError;
use crate::money::{decimal, format_scaled, Currency, DecimalError, MAX_AMOUNT};

/// Prices per model: exact names, patterns, and an optional `[default]`.
///
/// [`PriceSheet::entry`] looks a model up: the entry whose key is exactly the
/// name first; else the most specific matching pattern (more literal
/// characters, then a longer literal prefix, then the smaller key in
/// lexicographic order: `gpt-4o-mini*` before `gpt-4o*` before `*-mini*`);
/// else `[default]`; else none (the caller refuses the call, naming the model).
/// Names and patterns are case-sensitive, as the providers' model names are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceSheet {
    currency: Currency,
    exact: BTreeMap<String, Entry>,
    /// Sorted by [`Glob::precedence`]: the first match wins.
    patterns: Vec<(Glob, Entry)>,
    default: Option<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSheet {
    currency: String,
    #[serde(default)]
    models: BTreeMap<String, RawEntry>,
    default: Option<RawEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    input: Option<toml::Value>,
    output: Option<toml::Value>,
    cached_input: Option<toml::Value>,
    cache_write: Option<toml::Value>,
    reasoning: Option<toml::Value>,
    request: Option<toml::Value>,
    max_output: Option<toml::Value>,
    #[serde(default)]
    units: BTreeMap<String, toml::Value>,
    #[serde(default)]
    max_units: BTreeMap<String, toml::Value>,
}

impl PriceSheet {
    /// Parses and checks a price sheet; `origin` names it in errors and
    /// `currency` is the deployment's, which the sheet's `currency` must be.
    pub fn parse(text: &str, origin: &str, currency: Currency) -> Result<Self, ConfigError> {
        let raw: RawSheet = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let invalid = |key: String, message: String| ConfigError::Invalid {
            origin: origin.to_owned(),
            key,
            message,
        };
        let theirs = Currency::parse(&raw.currency).map_err(|m| invalid("currency".into(), m))?;
        if theirs != currency {
            return Err(invalid(
                "currency".into(),
                format!(
                    "the sheet is in {theirs} but budgets are in {currency}: its prices must be \
                     in the budgets' currency"
                ),
            ));
        }
        if raw.models.is_empty() && raw.default.is_none() {
            return Err(invalid(
                "models".into(),
                "the sheet prices no model: add a [models.\"name\"] table or a [default]".into(),
            ));
        }
        let mut exact = BTreeMap::new();
        let mut patterns = Vec::new();
        for (name, r) in raw.models {
            let key = format!("models.{}", key_part(&name));
            if name.is_empty() {
                return Err(invalid(key, "a model name must not be empty".into()));
            }
            let entry = parse_entry(key, r, currency, &invalid)?;
            if is_pattern(&name) {
                patterns.push((Glob::new(&name), entry));
            } else {
                exact.insert(name, entry);
            }
        }
        patterns.sort_by(|(a, _), (b, _)| a.precedence().cmp(&b.precedence()));
        let default = match raw.default {
            Some(r) => Some(parse_entry("default".into(), r, currency, &invalid)?),
            None => None,
        };
        Ok(Self {
            currency,
            exact,
            patterns,
            default,
        })
    }

    /// Reads and parses the sheet at `path`.
    pub fn load(path: &Path, currency: Currency) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string(), currency)
    }

    /// The currency of every price (the deployment's).
    pub fn currency(&self) -> Currency {
        self.currency
    }

    /// The entry that prices `model` (see [`PriceSheet`] for the order), or
    /// `None`: nothing prices it.
    pub fn entry(&self, model: &str) -> Option<&Entry> {
        if let Some(e) = self.exact.get(model) {
            return Some(e);
        }
        self.patterns
            .iter()
            .find(|(g, _)| g.matches(model))
            .map(|(_, e)| e)
            .or(self.default.as_ref())
    }

    /// Every entry: exact names, then patterns in lookup order, then
    /// `[default]`.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.exact
            .values()
            .chain(self.patterns.iter().map(|(_, e)| e))
            .chain(self.default.as_ref())
    }
}

/// `name` as a TOML key part: bare when it can be, else quoted.
fn key_part(name: &str) -> String {
    let bare = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if bare {
        name.to_owned()
    } else {
        format!("{name:?}")
    }
}

fn parse_entry(
    key: String,
    r: RawEntry,
    currency: Currency,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Entry, ConfigError> {
    let token_price = |field: &str, v: &Option<toml::Value>| -> Result<Option<u64>, ConfigError> {
        v.as_ref()
            .map(|v| per_million(currency, v).map_err(|m| invalid(format!("{key}.{field}"), m)))
            .transpose()
    };
    let input = token_price("input", &r.input)?;
    let output = token_price("output", &r.output)?;
    let cached_input = token_price("cached_input", &r.cached_input)?;
    let cache_write = token_price("cache_write", &r.cache_write)?;
    let reasoning = token_price("reasoning", &r.reasoning)?;
    let any_token_price = [input, output, cached_input, cache_write, reasoning]
        .iter()
        .any(Option::is_some);
    if any_token_price {
        for (field, v) in [("input", input), ("output", output)] {
            if v.is_none() {
                return Err(invalid(
                    format!("{key}.{field}"),
                    "is required when the entry prices tokens (write \"0\" if they are free)"
                        .into(),
                ));
            }
        }
    }
    let request = match &r.request {
        Some(v) => per_one(currency, v, "prices per request")
            .map_err(|m| invalid(format!("{key}.request"), m))?,
        None => 0,
    };
    let max_output = match &r.max_output {
        Some(v) => Some(whole_count(v).map_err(|m| invalid(format!("{key}.max_output"), m))?),
        None => None,
    };
    let mut units = BTreeMap::new();
    for (pointer, v) in &r.units {
        let at = format!("{key}.units.{}", key_part(pointer));
        if !pointer.starts_with('/') {
            return Err(invalid(
                at,
                format!("a unit is named by a JSON pointer into the answer, starting with /, got {pointer:?}"),
            ));
        }
        let price = per_one(currency, v, "prices per unit").map_err(|m| invalid(at, m))?;
        units.insert(pointer.clone(), UnitPrice { price, max: None });
    }
    for (pointer, v) in &r.max_units {
        let at = format!("{key}.max_units.{}", key_part(pointer));
        let Some(unit) = units.get_mut(pointer) else {
            let priced = r.units.keys().cloned().collect::<Vec<_>>().join(", ");
            return Err(invalid(
                at,
                format!("{pointer:?} is not a priced unit (units: {priced})"),
            ));
        };
        unit.max = Some(whole_count(v).map_err(|m| invalid(at, m))?);
    }
    if !any_token_price && r.request.is_none() && units.is_empty() {
        return Err(invalid(
            key,
            "prices nothing: give input and output (per million tokens), request or units".into(),
        ));
    }
    let (input, output) = (input.unwrap_or(0), output.unwrap_or(0));
    Ok(Entry {
        key,
        input,
        output,
        cached_input: cached_input.unwrap_or(input),
        cache_write: cache_write.unwrap_or(input),
        reasoning: reasoning.unwrap_or(output),
        request,
        max_output,
        units,
    })
}

/// A price per million tokens: a money amount (at most the currency's scale of
/// decimals, at most [`MAX_AMOUNT`] minor units), which is its price per token
/// in millionths of the minor unit.
fn per_million(currency: Currency, v: &toml::Value) -> Result<u64, String> {
    price(
        currency,
        v,
        "prices per million tokens",
        currency.scale(),
        MAX_AMOUNT,
    )
}

/// A price per request or per unit: up to six more decimals than an amount
/// (a millionth of the minor unit, e.g. a pico-dollar), at most `u64::MAX` of
/// those.
fn per_one(currency: Currency, v: &toml::Value, what: &str) -> Result<u64, String> {
    price(currency, v, what, currency.scale() + 6, u64::MAX)
}

/// `v` (a decimal string or a TOML integer) times `10^scale`, at most `max`.
fn price(
    currency: Currency,
    v: &toml::Value,
    what: &str,
    scale: u32,
    max: u64,
) -> Result<u64, String> {
    let (text, scaled) = match v {
        toml::Value::String(s) => (s.clone(), decimal(s, scale)),
        toml::Value::Integer(n) if *n < 0 => return Err(format!("must not be negative, got {n}")),
        toml::Value::Integer(n) => (
            n.to_string(),
            u128::from(n.unsigned_abs())
                .checked_mul(10u128.pow(scale))
                .ok_or(DecimalError::TooLarge),
        ),
        toml::Value::Float(f) => {
            return Err(format!(
                "got the float {f}: write the price as a string, e.g. \"{f}\", so that it is exact"
            ))
        }
        other => {
            return Err(format!(
                "must be a price (a string such as \"0.15\" or an integer), got a {}",
                other.type_str()
            ))
        }
    };
    match scaled.map(u64::try_from) {
        Ok(Ok(p)) if p <= max => Ok(p),
        Ok(_) | Err(DecimalError::TooLarge) => Err(format!(
            "{text:?} is too large: {what} in {currency} are at most {}",
            format_scaled(u128::from(max), scale)
        )),
        Err(e) => Err(e.message(&text, currency, what, scale)),
    }
}

/// A count of tokens or units: a TOML integer in `1..=MAX_AMOUNT`.
fn whole_count(v: &toml::Value) -> Result<u64, String> {
    match v.as_integer() {
        Some(n) if n >= 1 && n.unsigned_abs() <= MAX_AMOUNT => Ok(n.unsigned_abs()),
        Some(n) => Err(format!("must be between 1 and {MAX_AMOUNT}, got {n}")),
        None => Err(format!("must be a whole number, got a {}", v.type_str())),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn usd() -> Currency {
        Currency::parse("USD").unwrap()
    }

    /// Dated examples (mid-2025 list prices); the operator keeps their own.
    pub(in crate::price) const SHEET: &str = r#"
currency = "USD"

[models."gpt-4o*"]
input = "2.50"
output = "10.00"
cached_input = "1.25"
max_output = 16384

[models."gpt-4o-mini*"]
input = "0.15"
output = "0.60"
cached_input = "0.075"
max_output = 16384

[models.gpt-4o-mini-2024-07-18]
input = "0.15"
output = "0.60"
cached_input = "0.075"
request = "0.001"
max_output = 16384

[models."claude-sonnet-4*"]
input = 3
output = 15
cached_input = "0.30"
cache_write = "3.75"
max_output = 64000

[models.search]
request = "0.005"
[models.search.units]
"/usage/results" = "0.0001"
[models.search.max_units]
"/usage/results" = 50

[default]
input = "10"
output = "30"
"#;

    fn sheet() -> PriceSheet {
        PriceSheet::parse(SHEET, "prices.toml", usd()).unwrap()
    }

    fn err(text: &str) -> String {
        PriceSheet::parse(text, "prices.toml", usd())
            .unwrap_err()
            .to_string()
    }

    fn key_of(model: &str) -> Option<String> {
        sheet().entry(model).map(|e| e.key.clone())
    }

    #[test]
    fn reads_prices_per_token_in_millionths_of_a_micro_unit() {
        let s = sheet();
        assert_eq!(s.currency(), usd());
        let mini = s.entry("gpt-4o-mini").unwrap();
        // $0.15 per 1M tokens = 150,000 pico-dollars per token.
        assert_eq!(
            (mini.input, mini.output, mini.cached_input),
            (150_000, 600_000, 75_000)
        );
        assert_eq!(mini.cache_write, mini.input, "defaults to the input price");
        assert_eq!(mini.reasoning, mini.output, "defaults to the output price");
        assert_eq!((mini.request, mini.max_output), (0, Some(16384)));
        let claude = s.entry("claude-sonnet-4-20250514").unwrap();
        assert_eq!(
            (
                claude.input,
                claude.output,
                claude.cached_input,
                claude.cache_write
            ),
            (3_000_000, 15_000_000, 300_000, 3_750_000)
        );
        let search = s.entry("search").unwrap();
        assert!(!search.prices_tokens());
        // $0.005 per request = 5,000,000,000 pico-dollars.
        assert_eq!(search.request, 5_000_000_000);
        let unit = search.units["/usage/results"];
        assert_eq!((unit.price, unit.max), (100_000_000, Some(50)));
        assert_eq!(s.entries().count(), 6);
    }

    #[test]
    fn exact_then_most_specific_pattern_then_default() {
        assert_eq!(
            key_of("gpt-4o-mini-2024-07-18").as_deref(),
            Some("models.gpt-4o-mini-2024-07-18")
        );
        assert_eq!(
            key_of("gpt-4o-mini").as_deref(),
            Some("models.\"gpt-4o-mini*\"")
        );
        assert_eq!(
            key_of("gpt-4o-mini-2025-01-01").as_deref(),
            Some("models.\"gpt-4o-mini*\"")
        );
        assert_eq!(key_of("gpt-4o").as_deref(), Some("models.\"gpt-4o*\""));
        assert_eq!(
            key_of("gpt-4o-2024-08-06").as_deref(),
            Some("models.\"gpt-4o*\"")
        );
        assert_eq!(key_of("gpt-4").as_deref(), Some("default"));
        assert_eq!(key_of("o3").as_deref(), Some("default"));
        let no_default = SHEET.split("[default]").next().unwrap();
        let s = PriceSheet::parse(no_default, "p.toml", usd()).unwrap();
        assert_eq!(s.entry("o3"), None, "nothing prices it");
        assert!(s.entry("gpt-4o").is_some());
    }

    #[test]
    fn pattern_ties_break_the_same_whatever_the_file_order() {
        let a = "currency = \"USD\"\n[models.\"a*c\"]\nrequest = \"1\"\n[models.\"?bc\"]\nrequest = \"2\"\n";
        let b = "currency = \"USD\"\n[models.\"?bc\"]\nrequest = \"2\"\n[models.\"a*c\"]\nrequest = \"1\"\n";
        for text in [a, b] {
            let s = PriceSheet::parse(text, "p.toml", usd()).unwrap();
            // Both have 2 literal characters; "a*c" has the longer literal prefix.
            assert_eq!(s.entry("abc").unwrap().key, "models.\"a*c\"");
            assert_eq!(s.entry("xbc").unwrap().key, "models.\"?bc\"");
        }
    }

    #[test]
    fn a_sheet_can_be_in_tokens() {
        let text = "currency = \"tokens\"\n[default]\ninput = \"1000000\"\noutput = 4000000\nrequest = \"0.5\"\n";
        let s = PriceSheet::parse(text, "p.toml", Currency::Tokens).unwrap();
        let e = s.entry("any").unwrap();
        // Micro-tokens per token: one budget token per input token, 4 per output.
        assert_eq!(
            (e.input, e.output, e.request),
            (1_000_000, 4_000_000, 500_000)
        );
        let e = PriceSheet::parse(
            &text.replace("\"0.5\"", "\"0.0000005\""),
            "p.toml",
            Currency::Tokens,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("default.request") && e.contains("at most 6 decimal places"),
            "{e}"
        );
        let e = PriceSheet::parse(
            &text.replace("\"1000000\"", "\"1.5\""),
            "p.toml",
            Currency::Tokens,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("default.input") && e.contains("whole number"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_key() {
        for (from, to, key, needle) in [
            (
                "input = \"0.15\"",
                "input = \"-0.15\"",
                "models.\"gpt-4o-mini*\".input",
                "negative",
            ),
            (
                "input = \"0.15\"",
                "input = -1",
                "models.\"gpt-4o-mini*\".input",
                "negative",
            ),
            (
                "input = \"0.15\"",
                "input = \"0.15$\"",
                "models.\"gpt-4o-mini*\".input",
                "\"0.15$\"",
            ),
            (
                "input = \"0.15\"",
                "input = \"\"",
                "models.\"gpt-4o-mini*\".input",
                "empty",
            ),
            (
                "input = \"0.15\"",
                "input = \"1e-6\"",
                "models.\"gpt-4o-mini*\".input",
                "exponent",
            ),
            (
                "input = \"0.15\"",
                "input = 0.15",
                "models.\"gpt-4o-mini*\".input",
                "float",
            ),
            (
                "input = \"0.15\"",
                "input = true",
                "models.\"gpt-4o-mini*\".input",
                "boolean",
            ),
            (
                "input = \"0.15\"",
                "input = \"0.0000001\"",
                "models.\"gpt-4o-mini*\".input",
                "at most 6 decimal places",
            ),
            (
                "output = \"0.60\"",
                "output = \"9007199255\"",
                "models.\"gpt-4o-mini*\".output",
                "at most 9007199254.740991",
            ),
            (
                "output = \"0.60\"",
                "output = 9223372036854775807",
                "models.\"gpt-4o-mini*\".output",
                "too large",
            ),
            (
                "request = \"0.001\"",
                "request = \"0.0000000000001\"",
                "models.gpt-4o-mini-2024-07-18.request",
                "at most 12 decimal places",
            ),
            (
                "request = \"0.001\"",
                "request = \"18446745\"",
                "models.gpt-4o-mini-2024-07-18.request",
                "at most 18446744.073709551615",
            ),
            (
                "max_output = 64000",
                "max_output = 0",
                "models.\"claude-sonnet-4*\".max_output",
                "between 1",
            ),
            (
                "max_output = 64000",
                "max_output = \"lots\"",
                "models.\"claude-sonnet-4*\".max_output",
                "whole number",
            ),
            (
                "\"/usage/results\" = \"0.0001\"",
                "\"usage.results\" = \"0.0001\"",
                "models.search.units.\"usage.results\"",
                "JSON pointer",
            ),
            (
                "\"/usage/results\" = 50",
                "\"/usage/result\" = 50",
                "models.search.max_units.\"/usage/result\"",
                "not a priced unit",
            ),
            (
                "\"/usage/results\" = 50",
                "\"/usage/results\" = -2",
                "models.search.max_units.\"/usage/results\"",
                "-2",
            ),
            (
                "\"/usage/results\" = \"0.0001\"",
                "\"/usage/results\" = \"0.00000000000001\"",
                "models.search.units.\"/usage/results\"",
                "too precise",
            ),
            ("output = \"30\"", "", "default.output", "required"),
            (
                "currency = \"USD\"",
                "currency = \"EUR\"",
                "currency",
                "in EUR but budgets are in USD",
            ),
            (
                "currency = \"USD\"",
                "currency = \"usd\"",
                "currency",
                "uppercase",
            ),
            (
                "currency = \"USD\"",
                "currency = \"XYZ\"",
                "currency",
                "\"XYZ\"",
            ),
            ("[models.search]", "[models.\"\"]", "models.\"\"", "empty"),
        ] {
            assert!(SHEET.contains(from), "{from}");
            let e = err(&SHEET.replacen(from, to, 1));
            assert!(
                e.contains(&format!("prices.toml: {key}: ")) && e.contains(needle),
                "{to}: {e}"
            );
        }
    }

    #[test]
    fn unknown_keys_and_empty_sheets_are_refused() {
        let e = err(&SHEET.replacen("cached_input = \"0.075\"", "cache_input = \"0.075\"", 1));
        assert!(e.contains("cache_input"), "{e}");
        let e = err(&SHEET.replacen("currency = \"USD\"", "currency = \"USD\"\nprices = 1", 1));
        assert!(e.contains("prices"), "{e}");
        let e = err(&SHEET.replacen("currency = \"USD\"\n", "", 1));
        assert!(e.contains("currency"), "{e}");
        let e = err("currency = \"USD\"\n");
        assert!(e.contains("models") && e.contains("prices no model"), "{e}");
        let e = err("currency = \"USD\"\n[models]\n");
        assert!(e.contains("prices no model"), "{e}");
        let e = err("currency = \"USD\"\n[models.x]\nmax_output = 5\n");
        assert!(e.contains("models.x: prices nothing"), "{e}");
        // A free model is written as such.
        let free = "currency = \"USD\"\n[models.x]\ninput = 0\noutput = \"0\"\n";
        let s = PriceSheet::parse(free, "p.toml", usd()).unwrap();
        assert!(!s.entry("x").unwrap().prices_tokens());
    }

    #[test]
    fn loads_a_file_or_names_it() {
        let dir = std::env::temp_dir().join(format!("tollgate-prices-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("prices.toml");
        std::fs::write(&path, SHEET).unwrap();
        assert_eq!(PriceSheet::load(&path, usd()).unwrap(), sheet());
        std::fs::remove_dir_all(&dir).unwrap();
        let e = PriceSheet::load(&path, usd()).unwrap_err().to_string();
        assert!(e.contains("prices.toml"), "{e}");
    }
}
