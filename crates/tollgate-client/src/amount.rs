//! Amounts as tollgate's answers write them, read exactly into integers of
//! the minor unit: with `currency = "tokens"` an integer of tokens, with
//! money an exact decimal string of the currency (`"0.00015"` USD), read as
//! micro-units (150): every money currency has 6 decimal places. Never a
//! float.

use serde::{de, Deserialize, Deserializer};

/// Decimal places of a money amount: its minor unit is the micro-unit.
pub const MONEY_SCALE: u32 = 6;

/// `text`, a decimal string of money, in micro-units: digits, optionally a
/// point and at most [`MONEY_SCALE`] more; `None` for anything else.
pub fn parse_money(text: &str) -> Option<u64> {
    let (whole, frac) = match text.split_once('.') {
        Some((w, f)) => (w, f),
        None => (text, ""),
    };
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty()
        || !digits(whole)
        || !digits(frac)
        || frac.len() > MONEY_SCALE as usize
        || (text.contains('.') && frac.is_empty())
    {
        return None;
    }
    let mut value: u64 = 0;
    for b in whole.bytes().chain(frac.bytes()) {
        value = value.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    value.checked_mul(10u64.pow(MONEY_SCALE - frac.len() as u32))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Either {
    Minor(u64),
    Decimal(String),
}

/// A serde field of an amount in either form, as minor units.
pub(crate) fn minor<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match Either::deserialize(d)? {
        Either::Minor(n) => Ok(n),
        Either::Decimal(s) => parse_money(&s).ok_or_else(|| {
            de::Error::custom(format!(
                "{s:?} is not an amount: expected a decimal with at most {MONEY_SCALE} places"
            ))
        }),
    }
}

/// [`minor`] of an optional field (`null`: `None`).
pub(crate) fn minor_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrap(#[serde(deserialize_with = "minor")] u64);
    Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_decimal_money_exactly() {
        assert_eq!(parse_money("0.00015"), Some(150));
        assert_eq!(parse_money("20"), Some(20_000_000));
        assert_eq!(parse_money("0.000001"), Some(1));
        assert_eq!(parse_money("9007199254.740991"), Some((1 << 53) - 1));
        for bad in [
            "",
            ".5",
            "5.",
            "-1",
            "1e6",
            "0.0000001",
            "1,5",
            " 1",
            "abc",
            "1.2.3",
            "99999999999999999999",
        ] {
            assert_eq!(parse_money(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn fields_read_both_forms() {
        #[derive(Deserialize)]
        struct T {
            #[serde(deserialize_with = "minor")]
            a: u64,
            #[serde(default, deserialize_with = "minor_opt")]
            b: Option<u64>,
        }
        let t: T = serde_json::from_str(r#"{"a": 40, "b": null}"#).unwrap();
        assert_eq!((t.a, t.b), (40, None));
        let t: T = serde_json::from_str(r#"{"a": "0.0025", "b": "1.5"}"#).unwrap();
        assert_eq!((t.a, t.b), (2_500, Some(1_500_000)));
        let t: T = serde_json::from_str(r#"{"a": 7}"#).unwrap();
        assert_eq!(t.b, None);
        assert!(serde_json::from_str::<T>(r#"{"a": 0.5}"#).is_err());
        assert!(serde_json::from_str::<T>(r#"{"a": "0.0000001"}"#).is_err());
    }
}
