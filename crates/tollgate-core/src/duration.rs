//! Human durations in config files: `500ms`, `30s`, `5m`, `12h`, `7d`, `1h30m`.

use std::time::Duration;

/// Parses a duration written as one or more `<integer><unit>` parts, where unit is
/// `ms`, `s`, `m`, `h` or `d`. Returns a message fit to follow the key's name.
pub fn parse(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("is empty; write e.g. 500ms, 30s, 5m, 12h or 7d".into());
    }
    let bad =
        || format!("cannot parse {input:?} as a duration; write e.g. 500ms, 30s, 5m, 12h or 7d");
    let mut total: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(bad());
        }
        let n: u128 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let ms_per = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total = total
            .checked_add(n.checked_mul(ms_per).ok_or_else(bad)?)
            .ok_or_else(bad)?;
    }
    let ms = u64::try_from(total).map_err(|_| bad())?;
    Ok(Duration::from_millis(ms))
}

/// The shortest exact spelling of `d` in the units [`parse`] reads (to the ms).
pub fn format(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, per) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms > 0 && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

/// `d` rounded for people: `450ms`, `12s`, `3m 20s`, `5h 2m`, `2d 4h`.
pub fn format_approx(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    let s = ms / 1000;
    match s {
        0 => format!("{ms}ms"),
        1..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_compounds() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("12h"), Ok(Duration::from_secs(12 * 3600)));
        assert_eq!(parse("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse(" 7d "), Ok(Duration::from_secs(7 * 86400)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "12",
            "h",
            "12x",
            "1.5h",
            "-1s",
            "12 h",
            "99999999999999999999d",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn formats_for_people() {
        assert_eq!(format_approx(Duration::from_millis(450)), "450ms");
        assert_eq!(format_approx(Duration::from_secs(200)), "3m 20s");
        assert_eq!(format_approx(Duration::from_secs(5 * 3600 + 120)), "5h 2m");
    }

    #[test]
    fn formats_round_trip() {
        for s in ["12h", "30s", "1500ms", "7d", "90m"] {
            assert_eq!(format(parse(s).unwrap()), s);
        }
    }
}
