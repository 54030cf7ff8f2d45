//! Calendar periods (`period = "day" | "week" | "month"`): where a period
//! starts and ends in a time zone, from a time-zone database compiled into
//! the binary (the release images have no `/usr/share/zoneinfo`).
//!
//! A period limit's total is one counter per period, keyed by the period's
//! start and end instants (`lua/budget/lib/periods.lua`, and the embedded
//! ledger alike): a period starts at local midnight of its first day, so a
//! day in a daylight-saving change is 23 or 25 hours long, and a month
//! anchored on the 31st starts on the last day of a shorter month.
//!
//! The ledger's clock decides which period a call falls in. A pod computes
//! the boundaries around its own clock ([`Calendar::bounds`]: the previous,
//! current and next periods) and the budget script picks the one Redis
//! `TIME` falls in; a time outside all three is refused as transient, never
//! guessed.

use std::sync::{Mutex, OnceLock};

use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::Timestamp;

/// What a period is: a day, a week starting on `start`, or a month starting
/// on its `anchor` day (1..=31; clamped to a shorter month's last day).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeriodKind {
    Day,
    Week { start: Weekday },
    Month { anchor: i8 },
}

impl PeriodKind {
    /// `day`, `week` or `month`: the config's word.
    pub fn word(&self) -> &'static str {
        match self {
            Self::Day => "day",
            Self::Week { .. } => "week",
            Self::Month { .. } => "month",
        }
    }
}

/// A calendar: a kind of period in a time zone. Interned ([`Calendar::intern`]):
/// a config's calendars are few and live as long as the process, so a
/// [`Limit`](crate::config::Limit) holding one stays `Copy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calendar {
    pub kind: PeriodKind,
    /// The IANA name, as the config wrote it (`UTC`, `Europe/Berlin`).
    pub tz_name: String,
    tz: TimeZone,
}

/// The most distinct calendars a process interns: far more than any config
/// holds; past it, parsing a config fails rather than grow without end.
const MAX_CALENDARS: usize = 4096;

/// One period: `[start_ms, end_ms)` on the ledger's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    pub start_ms: u64,
    pub end_ms: u64,
}

impl Span {
    pub fn contains(&self, ms: u64) -> bool {
        self.start_ms <= ms && ms < self.end_ms
    }

    pub fn len_ms(&self) -> u64 {
        self.end_ms.saturating_sub(self.start_ms)
    }
}

/// The boundaries around a time: the previous period's start, the current
/// one's start and end, and the next one's end (ms since the epoch).
pub type Bounds = [u64; 4];

/// The period of `bounds` that `now_ms` falls in, or `None` when it is
/// before the previous period or past the next one (the pod that computed
/// them is too far off the ledger's clock: a transient refusal).
pub fn pick(bounds: &Bounds, now_ms: u64) -> Option<Span> {
    let [a, b, c, d] = *bounds;
    if now_ms < a || now_ms >= d {
        return None;
    }
    Some(if now_ms < b {
        Span {
            start_ms: a,
            end_ms: b,
        }
    } else if now_ms < c {
        Span {
            start_ms: b,
            end_ms: c,
        }
    } else {
        Span {
            start_ms: c,
            end_ms: d,
        }
    })
}

impl Calendar {
    /// Reads a calendar: `tz` an IANA name of the bundled database.
    pub fn new(kind: PeriodKind, tz_name: &str) -> Result<Self, String> {
        let tz = jiff::tz::db()
            .get(tz_name)
            .map_err(|_| format!("unknown time zone {tz_name:?} (an IANA name, e.g. \"UTC\", \"Europe/Berlin\", \"America/New_York\")"))?;
        if let PeriodKind::Month { anchor } = kind {
            if !(1..=31).contains(&anchor) {
                return Err(format!(
                    "anchor must be a day of the month, 1 to 31, got {anchor}"
                ));
            }
        }
        Ok(Self {
            kind,
            tz_name: tz_name.to_owned(),
            tz,
        })
    }

    /// The one shared copy of `self`.
    pub fn intern(self) -> Result<&'static Calendar, String> {
        static ALL: OnceLock<Mutex<Vec<&'static Calendar>>> = OnceLock::new();
        let mut all = crate::lock(ALL.get_or_init(Mutex::default));
        if let Some(c) = all.iter().find(|c| ***c == self) {
            return Ok(c);
        }
        if all.len() >= MAX_CALENDARS {
            return Err(format!("more than {MAX_CALENDARS} distinct periods"));
        }
        let c: &'static Calendar = Box::leak(Box::new(self));
        all.push(c);
        Ok(c)
    }

    /// `month (anchor 15, Europe/Berlin)`, `week (from monday, UTC)`, `day (UTC)`.
    pub fn describe(&self) -> String {
        match self.kind {
            PeriodKind::Day => format!("day ({})", self.tz_name),
            PeriodKind::Week { start } => {
                format!("week (from {}, {})", weekday_word(start), self.tz_name)
            }
            PeriodKind::Month { anchor } => {
                format!("month (anchor {anchor}, {})", self.tz_name)
            }
        }
    }

    /// The first day of the period holding the local date `d`.
    fn first_day(&self, d: Date) -> Option<Date> {
        match self.kind {
            PeriodKind::Day => Some(d),
            PeriodKind::Week { start } => {
                let back = (d.weekday().to_monday_zero_offset() - start.to_monday_zero_offset())
                    .rem_euclid(7);
                d.checked_sub(jiff::Span::new().days(back)).ok()
            }
            PeriodKind::Month { anchor } => {
                let here = anchor_day(d.year(), d.month(), anchor)?;
                if d >= here {
                    Some(here)
                } else {
                    let (y, m) = month_before(d.year(), d.month());
                    anchor_day(y, m, anchor)
                }
            }
        }
    }

    /// The first day of the period after the one starting on `first`.
    fn next_day(&self, first: Date) -> Option<Date> {
        match self.kind {
            PeriodKind::Day => first.tomorrow().ok(),
            PeriodKind::Week { .. } => first.checked_add(jiff::Span::new().days(7)).ok(),
            PeriodKind::Month { anchor } => {
                let (y, m) = month_after(first.year(), first.month());
                anchor_day(y, m, anchor)
            }
        }
    }

    /// The first day of the period before the one starting on `first`.
    fn previous_day(&self, first: Date) -> Option<Date> {
        match self.kind {
            PeriodKind::Day => first.yesterday().ok(),
            PeriodKind::Week { .. } => first.checked_sub(jiff::Span::new().days(7)).ok(),
            PeriodKind::Month { anchor } => {
                let (y, m) = month_before(first.year(), first.month());
                anchor_day(y, m, anchor)
            }
        }
    }

    /// The instant a period starting on local date `d` starts: local
    /// midnight, or the first instant after it when midnight falls in a
    /// daylight-saving gap.
    fn start_ms(&self, d: Date) -> Option<u64> {
        let z = d.to_zoned(self.tz.clone()).ok()?;
        u64::try_from(z.timestamp().as_millisecond()).ok()
    }

    /// The period holding `ms`.
    pub fn period_at(&self, ms: u64) -> Option<Span> {
        let ts = Timestamp::from_millisecond(i64::try_from(ms).ok()?).ok()?;
        let mut first = self.first_day(ts.to_zoned(self.tz.clone()).date())?;
        // A repeated local midnight (a clock set back over it) can put an
        // instant on a local date before the period it is in: step on.
        loop {
            let next = self.next_day(first)?;
            let (start, end) = (self.start_ms(first)?, self.start_ms(next)?);
            if ms < start {
                first = self.previous_day(first)?;
            } else if ms >= end {
                first = next;
            } else {
                return Some(Span {
                    start_ms: start,
                    end_ms: end,
                });
            }
        }
    }

    /// The boundaries around `now_ms` ([`Bounds`]); `None` only out of the
    /// calendar's range (years past 9999).
    pub fn bounds(&self, now_ms: u64) -> Option<Bounds> {
        let cur = self.period_at(now_ms)?;
        let prev = self.period_at(cur.start_ms.checked_sub(1)?)?;
        let next = self.period_at(cur.end_ms)?;
        Some([prev.start_ms, cur.start_ms, cur.end_ms, next.end_ms])
    }
}

/// The day a month's period starts: the anchor, or the month's last day
/// when the month is shorter.
fn anchor_day(year: i16, month: i8, anchor: i8) -> Option<Date> {
    let first = Date::new(year, month, 1).ok()?;
    Date::new(year, month, anchor.min(first.days_in_month())).ok()
}

fn month_before(year: i16, month: i8) -> (i16, i8) {
    if month == 1 {
        (year - 1, 12)
    } else {
        (year, month - 1)
    }
}

fn month_after(year: i16, month: i8) -> (i16, i8) {
    if month == 12 {
        (year + 1, 1)
    } else {
        (year, month + 1)
    }
}

/// A `week_start` as the config writes it (`monday`..`sunday`).
pub fn parse_weekday(s: &str) -> Option<Weekday> {
    Some(match s.to_ascii_lowercase().as_str() {
        "monday" => Weekday::Monday,
        "tuesday" => Weekday::Tuesday,
        "wednesday" => Weekday::Wednesday,
        "thursday" => Weekday::Thursday,
        "friday" => Weekday::Friday,
        "saturday" => Weekday::Saturday,
        "sunday" => Weekday::Sunday,
        _ => return None,
    })
}

pub fn weekday_word(d: Weekday) -> &'static str {
    match d {
        Weekday::Monday => "monday",
        Weekday::Tuesday => "tuesday",
        Weekday::Wednesday => "wednesday",
        Weekday::Thursday => "thursday",
        Weekday::Friday => "friday",
        Weekday::Saturday => "saturday",
        Weekday::Sunday => "sunday",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Milliseconds of a local time `y-m-d h:mi:s.ms` in `tz`.
    fn local(tz: &str, (y, m, d): (i16, i8, i8), (h, mi, s, ms): (i8, i8, i8, i16)) -> u64 {
        let dt = jiff::civil::date(y, m, d).at(h, mi, s, i32::from(ms) * 1_000_000);
        let z = dt.to_zoned(jiff::tz::db().get(tz).unwrap()).unwrap();
        u64::try_from(z.timestamp().as_millisecond()).unwrap()
    }

    fn midnight(tz: &str, ymd: (i16, i8, i8)) -> u64 {
        local(tz, ymd, (0, 0, 0, 0))
    }

    fn month(anchor: i8, tz: &str) -> Calendar {
        Calendar::new(PeriodKind::Month { anchor }, tz).unwrap()
    }

    const HOUR: u64 = 3_600_000;

    #[test]
    fn a_month_anchored_on_the_first_ends_at_local_midnight() {
        let c = month(1, "Europe/Berlin");
        let last = local("Europe/Berlin", (2027, 3, 31), (23, 59, 59, 900));
        let p = c.period_at(last).unwrap();
        assert_eq!(p.start_ms, midnight("Europe/Berlin", (2027, 3, 1)));
        assert_eq!(p.end_ms, midnight("Europe/Berlin", (2027, 4, 1)));
        assert_eq!(p.end_ms, last + 100);
        // March 2027 in Berlin loses an hour (the 28th).
        assert_eq!(p.len_ms(), 31 * 24 * HOUR - HOUR);
        // UTC: 22:00 of March 31st.
        assert_eq!(p.end_ms, local("UTC", (2027, 3, 31), (22, 0, 0, 0)));
        let next = c.period_at(p.end_ms).unwrap();
        assert_eq!(next.start_ms, p.end_ms);
    }

    #[test]
    fn an_anchor_of_31_clamps_to_the_end_of_february() {
        for (year, feb_last) in [(2027, 28), (2028, 29)] {
            let c = month(31, "UTC");
            let in_feb = midnight("UTC", (year, 2, 10));
            let p = c.period_at(in_feb).unwrap();
            assert_eq!(p.start_ms, midnight("UTC", (year, 1, 31)), "{year}");
            assert_eq!(p.end_ms, midnight("UTC", (year, 2, feb_last)), "{year}");
            let q = c.period_at(p.end_ms).unwrap();
            assert_eq!(q.end_ms, midnight("UTC", (year, 3, 31)), "{year}");
            // The day before the clamp is still the January period.
            let eve = local("UTC", (year, 2, feb_last - 1), (23, 59, 59, 900));
            assert_eq!(c.period_at(eve).unwrap(), p);
            let bounds = c.bounds(in_feb).unwrap();
            assert_eq!(
                bounds,
                [
                    midnight("UTC", (year - 1, 12, 31)),
                    p.start_ms,
                    p.end_ms,
                    q.end_ms
                ]
            );
        }
    }

    #[test]
    fn an_anchor_of_1_across_february() {
        for (year, days) in [(2027, 28), (2028, 29)] {
            let c = month(1, "UTC");
            let p = c.period_at(midnight("UTC", (year, 2, 14))).unwrap();
            assert_eq!(p.start_ms, midnight("UTC", (year, 2, 1)));
            assert_eq!(p.end_ms, midnight("UTC", (year, 3, 1)));
            assert_eq!(p.len_ms(), days * 24 * HOUR);
        }
    }

    #[test]
    fn an_anchor_of_15_in_a_time_zone() {
        let c = month(15, "America/New_York");
        let p = c
            .period_at(midnight("America/New_York", (2027, 1, 3)))
            .unwrap();
        assert_eq!(p.start_ms, midnight("America/New_York", (2026, 12, 15)));
        assert_eq!(p.end_ms, midnight("America/New_York", (2027, 1, 15)));
        // 05:00 UTC: New York's midnight in winter.
        assert_eq!(p.end_ms, local("UTC", (2027, 1, 15), (5, 0, 0, 0)));
    }

    #[test]
    fn daylight_saving_days_are_23_and_25_hours() {
        let day = Calendar::new(PeriodKind::Day, "America/New_York").unwrap();
        let p = day
            .period_at(local("America/New_York", (2027, 3, 14), (12, 0, 0, 0)))
            .unwrap();
        assert_eq!(p.start_ms, midnight("America/New_York", (2027, 3, 14)));
        assert_eq!(p.len_ms(), 23 * HOUR);
        let day = Calendar::new(PeriodKind::Day, "Europe/Berlin").unwrap();
        let p = day
            .period_at(local("Europe/Berlin", (2027, 10, 31), (12, 0, 0, 0)))
            .unwrap();
        assert_eq!(p.start_ms, midnight("Europe/Berlin", (2027, 10, 31)));
        assert_eq!(p.len_ms(), 25 * HOUR);
        // Around a 23-hour day: the days before and after are 24 hours.
        let b = Calendar::new(PeriodKind::Day, "America/New_York")
            .unwrap()
            .bounds(local("America/New_York", (2027, 3, 14), (1, 0, 0, 0)))
            .unwrap();
        assert_eq!(
            [b[1] - b[0], b[2] - b[1], b[3] - b[2]],
            [24 * HOUR, 23 * HOUR, 24 * HOUR]
        );
    }

    #[test]
    fn a_month_holding_a_23_hour_day_ends_at_local_midnight() {
        // Anchor 14: the period from 2027-02-14 ends at the start of
        // 2027-03-14, the New York day that is 23 hours long; the next one
        // holds it.
        let c = month(14, "America/New_York");
        let eve = local("America/New_York", (2027, 3, 13), (23, 59, 59, 900));
        let p = c.period_at(eve).unwrap();
        assert_eq!(p.end_ms, eve + 100);
        assert_eq!(p.end_ms, local("UTC", (2027, 3, 14), (5, 0, 0, 0)));
        let q = c.period_at(p.end_ms).unwrap();
        assert_eq!(q.end_ms, midnight("America/New_York", (2027, 4, 14)));
        assert_eq!(q.len_ms(), 31 * 24 * HOUR - HOUR);
    }

    #[test]
    fn weeks_start_on_their_week_start() {
        // 2027-03-10 is a Wednesday.
        let wed = local("UTC", (2027, 3, 10), (15, 0, 0, 0));
        for (start, first) in [
            (Weekday::Monday, (2027, 3, 8)),
            (Weekday::Sunday, (2027, 3, 7)),
            (Weekday::Wednesday, (2027, 3, 10)),
            (Weekday::Thursday, (2027, 3, 4)),
        ] {
            let c = Calendar::new(PeriodKind::Week { start }, "UTC").unwrap();
            let p = c.period_at(wed).unwrap();
            assert_eq!(p.start_ms, midnight("UTC", first), "{start:?}");
            assert_eq!(p.len_ms(), 7 * 24 * HOUR, "{start:?}");
        }
        // A week holding the Berlin change to summer time is an hour short.
        let c = Calendar::new(
            PeriodKind::Week {
                start: Weekday::Monday,
            },
            "Europe/Berlin",
        )
        .unwrap();
        let p = c
            .period_at(midnight("Europe/Berlin", (2027, 3, 28)))
            .unwrap();
        assert_eq!(p.start_ms, midnight("Europe/Berlin", (2027, 3, 22)));
        assert_eq!(p.len_ms(), 7 * 24 * HOUR - HOUR);
    }

    #[test]
    fn pick_refuses_a_time_outside_the_bounds() {
        let b: Bounds = [10, 20, 30, 40];
        assert_eq!(pick(&b, 9), None);
        assert_eq!(pick(&b, 10).unwrap().start_ms, 10);
        assert_eq!(pick(&b, 19).unwrap().end_ms, 20);
        assert_eq!(pick(&b, 20).unwrap().start_ms, 20);
        assert_eq!(pick(&b, 39).unwrap().start_ms, 30);
        assert_eq!(pick(&b, 40), None);
    }

    #[test]
    fn bad_zones_and_anchors_are_refused() {
        assert!(Calendar::new(PeriodKind::Day, "Mars/Olympus")
            .unwrap_err()
            .contains("unknown time zone"));
        for anchor in [0, 32] {
            assert!(Calendar::new(PeriodKind::Month { anchor }, "UTC")
                .unwrap_err()
                .contains("1 to 31"));
        }
        let a = Calendar::new(PeriodKind::Day, "UTC")
            .unwrap()
            .intern()
            .unwrap();
        let b = Calendar::new(PeriodKind::Day, "UTC")
            .unwrap()
            .intern()
            .unwrap();
        assert!(std::ptr::eq(a, b));
    }
}
