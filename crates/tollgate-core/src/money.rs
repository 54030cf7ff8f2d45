//! Budgets in money: a [`Currency`] and exact amounts of it.
//!
//! An amount is a `u64` count of the currency's minor unit, never a float: a
//! budget summed over millions of calls must not drift. [`Currency::Tokens`]
//! (the abstract unit budgets have always been in) has scale 0: an amount is a
//! plain count of tokens. Every ISO 4217 currency has scale 6: its minor unit is
//! the **micro-unit** (1 USD = 1,000,000 micro-USD), whatever its cash decimals
//! (JPY too). One scale for all money keeps the arithmetic and the Lua scripts
//! currency-blind, and a micro-unit is fine enough to charge a single call of a
//! cheap model (a few hundred tokens at $0.15 per million is 30–60 micro-USD).
//!
//! The parsers return a message fit to follow the key's name, as
//! [`crate::duration::parse`] does: the config wraps it in a
//! [`crate::config::ConfigError::Invalid`] naming the key.

use std::fmt;

/// The largest amount (in minor units) any parser here accepts: amounts flow
/// into Redis Lua scripts, whose numbers (Lua 5.1) are doubles, exact integers
/// only up to 2^53: past it, an amount could silently round.
pub const MAX_AMOUNT: u64 = (1 << 53) - 1;

/// Decimal places of every money currency: its minor unit is the micro-unit.
pub const MONEY_SCALE: u32 = 6;

/// What budgets are kept in: tokens (the default), or an ISO 4217 currency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Currency {
    /// The abstract unit (config string `"tokens"`): scale 0.
    #[default]
    Tokens,
    /// An ISO 4217 currency (config string `"USD"`, `"EUR"`, …): scale 6.
    Money(IsoCode),
}

/// An active ISO 4217 code, one of [`ISO_4217`]: only [`IsoCode::new`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IsoCode(&'static str);

impl IsoCode {
    /// The code `code` (exactly as written: uppercase), if it is in [`ISO_4217`].
    pub fn new(code: &str) -> Option<Self> {
        ISO_4217
            .binary_search(&code)
            .ok()
            .and_then(|i| ISO_4217.get(i))
            .map(|c| Self(c))
    }

    /// The three uppercase letters.
    pub fn as_str(&self) -> &'static str {
        self.0
    }
}

/// The active ISO 4217 currency codes (list one, as of 2025), sorted: the
/// currencies in circulation. Left out: fund codes (`BOV`, `CHE`, `USN`, …),
/// precious metals (`XAU`, …), `XDR`/`XSU`/`XUA`, the test and "no currency"
/// codes (`XTS`, `XXX`), and withdrawn codes (`HRK`, `SLL`, `ZWL`, …). A code
/// missing here is a one-line addition.
pub const ISO_4217: &[&str] = &[
    "AED", "AFN", "ALL", "AMD", "ANG", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT",
    "BGN", "BHD", "BIF", "BMD", "BND", "BOB", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD", "CAD",
    "CDF", "CHF", "CLP", "CNY", "COP", "CRC", "CUP", "CVE", "CZK", "DJF", "DKK", "DOP", "DZD",
    "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP", "GEL", "GHS", "GIP", "GMD", "GNF", "GTQ",
    "GYD", "HKD", "HNL", "HTG", "HUF", "IDR", "ILS", "INR", "IQD", "IRR", "ISK", "JMD", "JOD",
    "JPY", "KES", "KGS", "KHR", "KMF", "KPW", "KRW", "KWD", "KYD", "KZT", "LAK", "LBP", "LKR",
    "LRD", "LSL", "LYD", "MAD", "MDL", "MGA", "MKD", "MMK", "MNT", "MOP", "MRU", "MUR", "MVR",
    "MWK", "MXN", "MYR", "MZN", "NAD", "NGN", "NIO", "NOK", "NPR", "NZD", "OMR", "PAB", "PEN",
    "PGK", "PHP", "PKR", "PLN", "PYG", "QAR", "RON", "RSD", "RUB", "RWF", "SAR", "SBD", "SCR",
    "SDG", "SEK", "SGD", "SHP", "SLE", "SOS", "SRD", "SSP", "STN", "SVC", "SYP", "SZL", "THB",
    "TJS", "TMT", "TND", "TOP", "TRY", "TTD", "TWD", "TZS", "UAH", "UGX", "USD", "UYU", "UZS",
    "VED", "VES", "VND", "VUV", "WST", "XAF", "XCD", "XCG", "XOF", "XPF", "YER", "ZAR", "ZMW",
    "ZWG",
];

impl Currency {
    /// Reads a config string: `"tokens"`, or an uppercase ISO 4217 code.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text == "tokens" {
            return Ok(Self::Tokens);
        }
        if let Some(code) = IsoCode::new(text) {
            return Ok(Self::Money(code));
        }
        if text.eq_ignore_ascii_case("tokens") {
            return Err(format!("{text:?} is not a currency; write \"tokens\""));
        }
        let upper = text.to_ascii_uppercase();
        if IsoCode::new(&upper).is_some() {
            return Err(format!(
                "{text:?} is not a currency: ISO 4217 codes are uppercase; write {upper:?}"
            ));
        }
        Err(format!(
            "{text:?} is not an active ISO 4217 currency code; write e.g. \"USD\", \"EUR\", \
             or \"tokens\""
        ))
    }

    /// Decimal places of an amount: 0 for tokens, [`MONEY_SCALE`] for money.
    pub fn scale(&self) -> u32 {
        match self {
            Self::Tokens => 0,
            Self::Money(_) => MONEY_SCALE,
        }
    }

    /// Minor units in one whole unit: 1 for tokens, 1,000,000 for money.
    pub fn minor_per_unit(&self) -> u64 {
        10u64.pow(self.scale())
    }
}

impl fmt::Display for Currency {
    /// As the config writes it: `tokens`, `USD`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tokens => f.write_str("tokens"),
            Self::Money(code) => f.write_str(code.as_str()),
        }
    }
}

/// Reads a decimal amount of `currency` (`"20"`, `"0.0025"`) as minor units,
/// exactly: at most [`Currency::scale`] decimal places, no sign, no exponent,
/// at most [`MAX_AMOUNT`].
pub fn parse_amount(currency: Currency, text: &str) -> Result<u64, String> {
    match decimal(text, currency.scale()) {
        Ok(minor) => at_most_max(currency, text, minor),
        Err(DecimalError::TooLarge) => at_most_max(currency, text, u128::MAX),
        Err(e) => Err(e.message(text, currency, "amounts", currency.scale())),
    }
}

/// Reads a TOML integer amount of `currency` (`limit = 20`: 20 USD) as minor
/// units; at most [`MAX_AMOUNT`] of them.
pub fn parse_int(currency: Currency, whole: i64) -> Result<u64, String> {
    if whole < 0 {
        return Err(format!("must not be negative, got {whole}"));
    }
    let minor = u128::from(whole.unsigned_abs()) * u128::from(currency.minor_per_unit());
    at_most_max(currency, &whole.to_string(), minor)
}

/// Reads an amount written either way in TOML: a string (`"0.15"`) or an
/// integer (`20`). A float is refused: it is not exact.
pub fn parse_toml(currency: Currency, value: &toml::Value) -> Result<u64, String> {
    match value {
        toml::Value::String(s) => parse_amount(currency, s),
        toml::Value::Integer(n) => parse_int(currency, *n),
        toml::Value::Float(f) => Err(format!(
            "got the float {f}: write the amount as a string, e.g. \"{f}\", so that it is exact"
        )),
        other => Err(format!(
            "must be an amount (a string such as \"0.15\" or an integer), got a {}",
            other.type_str()
        )),
    }
}

/// The shortest decimal spelling of `minor` minor units of `currency`, which
/// [`parse_amount`] reads back: `20_000_000` micro-USD is `"20"`, `2_500` is
/// `"0.0025"`.
pub fn format_amount(currency: Currency, minor: u64) -> String {
    format_scaled(u128::from(minor), currency.scale())
}

/// `value / 10^scale` written in decimal, with no trailing zeros.
pub(crate) fn format_scaled(value: u128, scale: u32) -> String {
    let per = 10u128.pow(scale);
    let (whole, frac) = (value / per, value % per);
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:0width$}", width = scale as usize);
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// An amount as the JSON answers give it ([`Amount::serialize`]): with
/// [`Currency::Tokens`] an integer (what answers always were), with money a
/// decimal string of the major unit in [`format_amount`]'s shortest spelling
/// (`"0.00015"`, `"20"`), exact where a JSON number would be read as a float.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amount {
    pub minor: u64,
    pub currency: Currency,
}

impl Amount {
    pub fn new(currency: Currency, minor: u64) -> Self {
        Self { minor, currency }
    }

    /// What [`Amount::serialize`] writes, as a JSON value.
    pub fn to_json(self) -> serde_json::Value {
        match self.currency {
            Currency::Tokens => serde_json::Value::from(self.minor),
            c => serde_json::Value::String(format_amount(c, self.minor)),
        }
    }
}

impl fmt::Display for Amount {
    /// For a sentence: tokens as the bare count (`40`), money with its code
    /// (`0.00015 USD`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.currency {
            Currency::Tokens => write!(f, "{}", self.minor),
            c => write!(f, "{} {c}", format_amount(c, self.minor)),
        }
    }
}

impl serde::Serialize for Amount {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.currency {
            Currency::Tokens => s.serialize_u64(self.minor),
            c => s.serialize_str(&format_amount(c, self.minor)),
        }
    }
}

/// Reads an amount of `currency` from a JSON request body, exactly, as
/// minor units: with money a decimal string of the major unit (`"20"`,
/// `"0.0025"`, at most 6 decimals); with tokens an integer (or a string of
/// one), as before. A JSON number is refused in money: as an integer it
/// would be ambiguous (whole units in the config, micro-units in the JSON
/// answers of old), as a fraction a float. The message follows the field's
/// name.
pub fn parse_json(currency: Currency, value: &serde_json::Value) -> Result<u64, String> {
    use serde_json::Value;
    match (currency, value) {
        (_, Value::String(s)) => parse_amount(currency, s),
        (Currency::Tokens, Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(n), _) => at_most_max(currency, &n.to_string(), u128::from(n)),
            (None, Some(n)) => Err(format!("must not be negative, got {n}")),
            (None, None) => Err(format!(
                "{n} is not a whole number: amounts in tokens have no fraction"
            )),
        },
        (Currency::Money(_), Value::Number(n)) => Err(format!(
            "got the number {n}: write amounts of {currency} as a decimal string, e.g. \"{n}\" \
             for {n} {currency} (a JSON number is not exact)"
        )),
        (_, other) => Err(format!(
            "must be an amount (a decimal string such as \"20\" or \"0.0025\"), got {}",
            match other {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Array(_) => "an array",
                _ => "an object",
            }
        )),
    }
}

fn at_most_max(currency: Currency, text: &str, minor: u128) -> Result<u64, String> {
    match u64::try_from(minor) {
        Ok(m) if m <= MAX_AMOUNT => Ok(m),
        _ => Err(format!(
            "{text} {currency} is more than the largest amount, {} {currency}: amounts are \
             summed in Redis Lua scripts, whose numbers are doubles, exact only up to 2^53 \
             minor units",
            format_amount(currency, MAX_AMOUNT)
        )),
    }
}

/// Why a decimal string could not be read (see [`decimal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecimalError {
    Empty,
    Negative,
    Exponent,
    NotDecimal,
    TooPrecise,
    TooLarge,
}

impl DecimalError {
    /// The message for `text`, read at `scale` decimal places as one of `what`
    /// (a plural: "amounts", "prices per request") in `currency`.
    /// [`DecimalError::TooLarge`] is the caller's to word with its own bound.
    pub(crate) fn message(self, text: &str, currency: Currency, what: &str, scale: u32) -> String {
        match self {
            Self::Empty => "is empty; write e.g. \"20\" or \"0.0025\"".into(),
            Self::Negative => format!("must not be negative, got {text:?}"),
            Self::Exponent => format!(
                "cannot read {text:?}: exponent notation is not accepted; write the digits, \
                 e.g. \"0.0025\""
            ),
            Self::NotDecimal => format!(
                "cannot read {text:?} as a number: write digits with an optional decimal \
                 point, e.g. \"20\" or \"0.0025\""
            ),
            Self::TooPrecise if scale == 0 => {
                format!("{text:?} is not a whole number: {what} in {currency} have no fraction")
            }
            Self::TooPrecise => format!(
                "{text:?} is too precise: {what} in {currency} have at most {scale} decimal places"
            ),
            Self::TooLarge => format!("{text:?} is too large"),
        }
    }
}

/// `text` (trimmed) times `10^scale`, exactly: digits, optionally a point and
/// at most `scale` more digits. Leading zeros are fine; a bare point
/// (`".5"`, `"5."`), a sign, an exponent or a space inside are not.
pub(crate) fn decimal(text: &str, scale: u32) -> Result<u128, DecimalError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(DecimalError::Empty);
    }
    if s.starts_with('-') {
        return Err(DecimalError::Negative);
    }
    let (whole, frac) = match s.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (s, None),
    };
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || frac.is_some_and(|f| !digits(f)) {
        let mantissa =
            |m: &str| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit() || b == b'.');
        let exponent = s
            .split_once(['e', 'E'])
            .is_some_and(|(m, e)| mantissa(m) && digits(e.trim_start_matches(['+', '-'])));
        return Err(if exponent {
            DecimalError::Exponent
        } else {
            DecimalError::NotDecimal
        });
    }
    let frac = frac.unwrap_or("");
    if frac.len() > scale as usize {
        return Err(DecimalError::TooPrecise);
    }
    let mut value: u128 = 0;
    for b in whole.bytes().chain(frac.bytes()) {
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u128::from(b - b'0')))
            .ok_or(DecimalError::TooLarge)?;
    }
    let pad = scale - frac.len() as u32;
    value
        .checked_mul(10u128.pow(pad))
        .ok_or(DecimalError::TooLarge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rng;

    fn usd() -> Currency {
        Currency::parse("USD").unwrap()
    }

    #[test]
    fn reads_currencies() {
        assert_eq!(Currency::parse("tokens"), Ok(Currency::Tokens));
        assert_eq!(Currency::default(), Currency::Tokens);
        for code in ["USD", "EUR", "GBP", "JPY", "CHF"] {
            let c = Currency::parse(code).unwrap();
            assert_eq!(c.to_string(), code);
            assert_eq!((c.scale(), c.minor_per_unit()), (6, 1_000_000), "{code}");
        }
        assert_eq!(Currency::Tokens.scale(), 0);
        assert_eq!(Currency::Tokens.minor_per_unit(), 1);
        assert_eq!(Currency::Tokens.to_string(), "tokens");
    }

    #[test]
    fn currency_errors_name_the_value_and_hint() {
        let e = Currency::parse("usd").unwrap_err();
        assert!(
            e.contains("\"usd\"") && e.contains("uppercase") && e.contains("\"USD\""),
            "{e}"
        );
        let e = Currency::parse("XYZ").unwrap_err();
        assert!(e.contains("\"XYZ\"") && e.contains("ISO 4217"), "{e}");
        let e = Currency::parse("Tokens").unwrap_err();
        assert!(e.contains("\"tokens\""), "{e}");
        for bad in ["", "US", "USDX", " USD", "HRK", "XXX"] {
            assert!(Currency::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_iso_list_is_sorted_unique_codes() {
        assert!(ISO_4217.len() > 150);
        for pair in ISO_4217.windows(2) {
            assert!(pair[0] < pair[1], "{pair:?}");
        }
        for code in ISO_4217 {
            assert!(code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase()));
            assert_eq!(IsoCode::new(code).map(|c| c.as_str()), Some(*code));
        }
    }

    #[test]
    fn parses_exact_amounts() {
        let usd = usd();
        assert_eq!(parse_amount(usd, "20"), Ok(20_000_000));
        assert_eq!(parse_amount(usd, "0.0025"), Ok(2_500));
        assert_eq!(parse_amount(usd, "1000000"), Ok(1_000_000_000_000));
        assert_eq!(parse_amount(usd, "0.000001"), Ok(1));
        assert_eq!(parse_amount(usd, "0"), Ok(0));
        assert_eq!(parse_amount(usd, "007.50"), Ok(7_500_000));
        assert_eq!(parse_amount(usd, " 1.5 "), Ok(1_500_000));
        assert_eq!(parse_amount(Currency::Tokens, "1000000"), Ok(1_000_000));
        // JPY is micro-yen like every other currency.
        let jpy = Currency::parse("JPY").unwrap();
        assert_eq!(parse_amount(jpy, "150"), Ok(150_000_000));
    }

    #[test]
    fn amount_errors_say_what_is_wrong() {
        let usd = usd();
        for (text, needle) in [
            ("", "empty"),
            ("   ", "empty"),
            ("-1", "negative"),
            ("-0.5", "negative"),
            ("0.0000001", "at most 6 decimal places"),
            ("1.1234567", "too precise"),
            ("abc", "\"abc\""),
            ("1,5", "\"1,5\""),
            ("+5", "\"+5\""),
            (".5", "\".5\""),
            ("5.", "\"5.\""),
            ("1.2.3", "\"1.2.3\""),
            ("1 000", "\"1 000\""),
            ("NaN", "\"NaN\""),
            ("1e6", "exponent"),
            ("2.5E-3", "exponent"),
            ("9007199255", "2^53"),
            (
                "99999999999999999999999999999999999999999",
                "largest amount",
            ),
        ] {
            let e = parse_amount(usd, text).unwrap_err();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
        let e = parse_amount(Currency::Tokens, "1.5").unwrap_err();
        assert!(e.contains("\"1.5\"") && e.contains("whole"), "{e}");
        let e = parse_amount(Currency::Tokens, "1.0").unwrap_err();
        assert!(e.contains("whole"), "{e}");
        let e = parse_amount(Currency::Tokens, "9007199254740992").unwrap_err();
        assert!(
            e.contains("9007199254740991 tokens") && e.contains("Lua"),
            "{e}"
        );
    }

    #[test]
    fn integers_are_whole_units() {
        let usd = usd();
        assert_eq!(parse_int(usd, 20), Ok(20_000_000));
        assert_eq!(parse_int(usd, 0), Ok(0));
        assert_eq!(parse_int(Currency::Tokens, 20), Ok(20));
        assert_eq!(
            parse_int(Currency::Tokens, MAX_AMOUNT as i64),
            Ok(MAX_AMOUNT)
        );
        let e = parse_int(usd, -3).unwrap_err();
        assert!(e.contains("negative") && e.contains("-3"), "{e}");
        let e = parse_int(usd, i64::MAX).unwrap_err();
        assert!(e.contains("2^53"), "{e}");
        let e = parse_int(usd, 9_007_199_255).unwrap_err();
        assert!(e.contains("9007199254.740991 USD"), "{e}");
        assert_eq!(parse_int(usd, 9_007_199_254), Ok(9_007_199_254_000_000));
    }

    #[test]
    fn toml_values_are_strings_or_integers() {
        let usd = usd();
        let v = |s: &str| s.parse::<toml::Table>().unwrap()["v"].clone();
        assert_eq!(parse_toml(usd, &v("v = 20")), Ok(20_000_000));
        assert_eq!(parse_toml(usd, &v("v = \"0.15\"")), Ok(150_000));
        let e = parse_toml(usd, &v("v = 0.15")).unwrap_err();
        assert!(e.contains("float") && e.contains("\"0.15\""), "{e}");
        let e = parse_toml(usd, &v("v = true")).unwrap_err();
        assert!(e.contains("boolean"), "{e}");
    }

    #[test]
    fn formats_the_shortest_spelling() {
        let usd = usd();
        assert_eq!(format_amount(usd, 20_000_000), "20");
        assert_eq!(format_amount(usd, 2_500), "0.0025");
        assert_eq!(format_amount(usd, 0), "0");
        assert_eq!(format_amount(usd, 1), "0.000001");
        assert_eq!(format_amount(usd, 1_500_000), "1.5");
        assert_eq!(format_amount(usd, MAX_AMOUNT), "9007199254.740991");
        assert_eq!(format_amount(usd, u64::MAX), "18446744073709.551615");
        assert_eq!(format_amount(Currency::Tokens, 20), "20");
        assert_eq!(
            format_amount(Currency::Tokens, u64::MAX),
            u64::MAX.to_string()
        );
    }

    #[test]
    fn format_and_parse_round_trip() {
        let mut next = rng(0x9e37_79b9_7f4a_7c15);
        let mut values = vec![
            0,
            1,
            9,
            10,
            999_999,
            1_000_000,
            1_000_001,
            MAX_AMOUNT - 1,
            MAX_AMOUNT,
        ];
        values.extend((0..53).map(|b| 1u64 << b));
        values.extend((0..5_000).map(|i| {
            let r = next();
            // Small, mid and full-width values alike.
            match i % 3 {
                0 => r % 10_000_000,
                1 => r % 1_000_000_000_000,
                _ => r & MAX_AMOUNT,
            }
        }));
        for currency in [usd(), Currency::Tokens] {
            for &x in &values {
                let s = format_amount(currency, x);
                assert_eq!(parse_amount(currency, &s), Ok(x), "{s}");
                // Canonical: no trailing zeros after a point, no leading zeros.
                assert!(!(s.contains('.') && s.ends_with('0')), "{s}");
                assert!(
                    s == "0" || s.starts_with("0.") || !s.starts_with('0'),
                    "{s}"
                );
            }
            // Past the Lua bound: formatted, but not read back.
            for x in [MAX_AMOUNT + 1, u64::MAX] {
                let e = parse_amount(currency, &format_amount(currency, x)).unwrap_err();
                assert!(e.contains("2^53"), "{e}");
            }
        }
        // A non-canonical spelling reads to the value whose spelling is canonical.
        for (text, canonical) in [("020.500", "20.5"), ("0.000", "0"), ("1.000000", "1")] {
            assert_eq!(
                format_amount(usd(), parse_amount(usd(), text).unwrap()),
                canonical
            );
        }
    }

    #[test]
    fn every_parsed_amount_is_lua_safe() {
        let mut next = rng(42);
        for _ in 0..5_000 {
            let digits = (next() % 25) as usize;
            let point = (next() % 8) as usize;
            let mut s: String = (0..digits.max(1))
                .map(|_| char::from(b'0' + (next() % 10) as u8))
                .collect();
            if point < s.len() && point > 0 {
                s.insert(s.len() - point, '.');
            }
            for currency in [usd(), Currency::Tokens] {
                if let Ok(x) = parse_amount(currency, &s) {
                    assert!(x <= MAX_AMOUNT, "{s}");
                }
            }
            let n = next() as i64;
            if let Ok(x) = parse_int(usd(), n) {
                assert!(x <= MAX_AMOUNT, "{n}");
            }
        }
    }

    #[test]
    fn answers_speak_integers_in_tokens_and_decimal_strings_in_money() {
        let usd = usd();
        let j = |a: Amount| serde_json::to_string(&a).unwrap();
        assert_eq!(j(Amount::new(Currency::Tokens, 40)), "40");
        assert_eq!(j(Amount::new(usd, 150)), "\"0.00015\"");
        assert_eq!(j(Amount::new(usd, 20_000_000)), "\"20\"");
        assert_eq!(j(Amount::new(usd, 0)), "\"0\"");
        assert_eq!(Amount::new(usd, 150).to_string(), "0.00015 USD");
        assert_eq!(Amount::new(Currency::Tokens, 40).to_string(), "40");
        assert_eq!(j(Amount::new(usd, MAX_AMOUNT)), "\"9007199254.740991\"");
        for a in [Amount::new(usd, 2_500), Amount::new(Currency::Tokens, 7)] {
            assert_eq!(serde_json::to_value(a).unwrap(), a.to_json());
            // What an answer writes, a request reads back.
            assert_eq!(parse_json(a.currency, &a.to_json()), Ok(a.minor));
        }
    }

    #[test]
    fn json_inputs_are_exact_or_refused() {
        use serde_json::json;
        let usd = usd();
        assert_eq!(parse_json(usd, &json!("20")), Ok(20_000_000));
        assert_eq!(parse_json(usd, &json!("0.0025")), Ok(2_500));
        assert_eq!(parse_json(Currency::Tokens, &json!(20)), Ok(20));
        assert_eq!(parse_json(Currency::Tokens, &json!("20")), Ok(20));
        for (currency, v, needle) in [
            (usd, json!(20), "decimal string"),
            (usd, json!(0.5), "\"0.5\""),
            (usd, json!("0.0000001"), "too precise"),
            (usd, json!("-1"), "negative"),
            (usd, json!("abc"), "\"abc\""),
            (usd, json!(null), "null"),
            (usd, json!(true), "boolean"),
            (usd, json!("9007199255"), "2^53"),
            (Currency::Tokens, json!(-3), "negative"),
            (Currency::Tokens, json!(1.5), "whole"),
            (Currency::Tokens, json!("1.5"), "whole"),
            (Currency::Tokens, json!(9_007_199_254_740_992u64), "2^53"),
            (Currency::Tokens, json!([1]), "array"),
        ] {
            let e = parse_json(currency, &v).unwrap_err();
            assert!(e.contains(needle), "{v}: {e}");
        }
    }

    #[test]
    fn scaled_decimals_are_exact() {
        assert_eq!(decimal("0.15", 12), Ok(150_000_000_000));
        assert_eq!(decimal("3", 0), Ok(3));
        assert_eq!(decimal("0.000000000001", 12), Ok(1));
        assert_eq!(
            decimal("0.0000000000001", 12),
            Err(DecimalError::TooPrecise)
        );
        assert_eq!(format_scaled(150_000_000_000, 12), "0.15");
    }
}
