//! Spend reports: what the users' charges came to per hour or per day, by
//! user, organisation, operation, provider or price sheet entry, from the
//! rollups each ledger keeps in the same atomic step as every charge changes
//! ([`Ledger::spend`]), never from a walk of the event log. The report
//! (`GET /admin/spend`, `tollgate spend`) is written once here, over both
//! backends.
//!
//! A rollup bucket counts what the charges spent in its hour (or UTC day)
//! cost *now*: a settle, refund or release lands in the bucket of the hour the
//! charge was made in, so a bucket is exact against the live events and the
//! changes the export records.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::id::UserId;
use crate::keystore::{KeyStore, KeyStoreError, UserQuery, UserQueryError};
use crate::ledger::{Ledger, LedgerError};
use crate::money::{Amount, Currency};

/// One hour and one day, in ms: the two steps of the rollups.
pub const HOUR_MS: u64 = 3_600_000;
pub const DAY_MS: u64 = 86_400_000;

/// Default `[spend] hourly_keep`: hourly buckets are kept 48 hours.
pub const DEFAULT_HOURLY_KEEP: Duration = Duration::from_secs(48 * 3600);
/// Default `[spend] daily_keep`: daily buckets are kept 400 days.
pub const DEFAULT_DAILY_KEEP: Duration = Duration::from_secs(400 * 86_400);
/// The longest either may be kept (buckets per user and dimension: the
/// memory bound).
pub const MAX_HOURLY_KEEP: Duration = Duration::from_secs(31 * 86_400);
pub const MAX_DAILY_KEEP: Duration = Duration::from_secs(3 * 366 * 86_400);

/// A rollup's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    Hour,
    Day,
}

impl Step {
    pub fn ms(self) -> u64 {
        match self {
            Step::Hour => HOUR_MS,
            Step::Day => DAY_MS,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Step::Hour => "1h",
            Step::Day => "1d",
        }
    }

    pub fn parse(s: &str) -> Result<Self, SpendQueryError> {
        match s {
            "1h" | "hour" => Ok(Step::Hour),
            "1d" | "day" => Ok(Step::Day),
            other => Err(SpendQueryError::Step(other.to_owned())),
        }
    }
}

/// How long the rollups keep their buckets (`[spend]`): a bucket older than
/// its keep is dropped as new ones are written, and its key expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keep {
    pub hourly: Duration,
    pub daily: Duration,
}

impl Default for Keep {
    fn default() -> Self {
        Self {
            hourly: DEFAULT_HOURLY_KEEP,
            daily: DEFAULT_DAILY_KEEP,
        }
    }
}

impl Keep {
    /// How many buckets of `step` are kept: the current one and those before
    /// it, `keep / step` in all (at least 1).
    pub fn buckets(&self, step: Step) -> u64 {
        let keep = match step {
            Step::Hour => self.hourly,
            Step::Day => self.daily,
        };
        (u64::try_from(keep.as_millis()).unwrap_or(u64::MAX) / step.ms()).max(1)
    }

    /// Whether the bucket starting at `start_ms` is still kept at `now_ms`.
    pub fn kept(&self, step: Step, start_ms: u64, now_ms: u64) -> bool {
        let cur = now_ms / step.ms();
        start_ms / step.ms() + self.buckets(step) > cur
    }
}

/// What a charge is counted under: the organisation the user was in when it
/// was made, the operation, its provider and the price sheet entry that
/// priced it (its name or pattern: bounded by the sheet, never the raw model
/// a request named). Empty where there is none (a plain reserve has no
/// operation; an unpriced call no entry).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Dims {
    pub org: String,
    pub operation: String,
    pub provider: String,
    pub model: String,
}

impl Dims {
    /// The form the rollups store: the four joined by tabs (a tab or a line
    /// break inside one is written as a space).
    pub fn to_text(&self) -> String {
        let clean = |s: &str| s.replace(['\t', '\n', '\r'], " ");
        format!(
            "{}\t{}\t{}\t{}",
            clean(&self.org),
            clean(&self.operation),
            clean(&self.provider),
            clean(&self.model)
        )
    }

    /// Reads [`to_text`](Self::to_text)'s form; `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        let mut it = text.split('\t');
        let d = Self {
            org: it.next()?.to_owned(),
            operation: it.next()?.to_owned(),
            provider: it.next()?.to_owned(),
            model: it.next()?.to_owned(),
        };
        it.next().is_none().then_some(d)
    }
}

/// One bucket of one user's rollup ([`Ledger::spend`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// The bucket's start (ms): a whole hour, or a UTC midnight.
    pub start_ms: u64,
    pub dims: Dims,
    /// What the charges spent in it cost, in minor units; never 0 (an empty
    /// bucket is dropped).
    pub amount: u64,
}

/// What a report groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    User,
    Org,
    Model,
    Operation,
    Provider,
}

impl By {
    pub fn parse(s: &str) -> Result<Self, SpendQueryError> {
        Ok(match s {
            "user" => By::User,
            "org" => By::Org,
            "model" => By::Model,
            "operation" => By::Operation,
            "provider" => By::Provider,
            other => return Err(SpendQueryError::By(other.to_owned())),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            By::User => "user",
            By::Org => "org",
            By::Model => "model",
            By::Operation => "operation",
            By::Provider => "provider",
        }
    }

    fn key<'a>(self, user: &'a UserId, d: &'a Dims) -> &'a str {
        match self {
            By::User => user.as_str(),
            By::Org => &d.org,
            By::Model => &d.model,
            By::Operation => &d.operation,
            By::Provider => &d.provider,
        }
    }
}

/// A bad report request (the HTTP edge answers 400, naming the parameter).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpendQueryError {
    #[error("by: must be user, org, model, operation or provider, got {0:?}")]
    By(String),
    #[error("step: must be 1h or 1d, got {0:?}")]
    Step(String),
    #[error("{0}: {1}")]
    Time(&'static str, String),
    #[error("to: must be after from")]
    Range,
    #[error("from, to: a report spans at most {max} buckets of its step, asked {0}", max = SpendQuery::MAX_BUCKETS)]
    TooLong(u64),
    #[error("limit: must be between 1 and {max}, got {0}", max = SpendQuery::MAX_LIMIT)]
    Limit(usize),
    #[error("cursor: not a cursor this server returned (expected the next_cursor of a page)")]
    Cursor,
}

/// One report request: rows grouped `by`, per `step` bucket whose start is in
/// `[from, to)`, a page of at most `limit` rows after `cursor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpendQuery {
    pub by: By,
    pub step: Step,
    pub from_ms: u64,
    pub to_ms: u64,
    cursor: Option<Cursor>,
    pub limit: usize,
}

/// Where a page starts: after this user (by user), or after this row (any
/// other grouping).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cursor {
    User(UserId),
    Row(String, u64),
}

impl SpendQuery {
    pub const DEFAULT_LIMIT: usize = 1000;
    pub const MAX_LIMIT: usize = 10_000;
    /// The widest report: about 400 days of days, or 16 days of hours.
    pub const MAX_BUCKETS: u64 = 400;

    /// Checks a request's parameters: `from`, `to` as RFC 3339 times or
    /// dates (`2026-12-07`: its UTC midnight), rounded down to the step;
    /// `to` defaults to now, `from` to `to` less a day (1h) or 30 days (1d).
    pub fn new(
        by: &str,
        step: Option<&str>,
        from: Option<&str>,
        to: Option<&str>,
        cursor: Option<&str>,
        limit: Option<usize>,
        now_ms: u64,
    ) -> Result<Self, SpendQueryError> {
        let by = By::parse(by)?;
        let step = step.map_or(Ok(Step::Day), Step::parse)?;
        let to_ms = match to {
            Some(t) => parse_time("to", t)?,
            None => now_ms - now_ms % step.ms() + step.ms(),
        };
        let from_ms = match from {
            Some(f) => parse_time("from", f)?,
            None => to_ms.saturating_sub(match step {
                Step::Hour => DAY_MS,
                Step::Day => 30 * DAY_MS,
            }),
        };
        let from_ms = from_ms - from_ms % step.ms();
        if to_ms <= from_ms {
            return Err(SpendQueryError::Range);
        }
        let buckets = (to_ms - from_ms).div_ceil(step.ms());
        if buckets > Self::MAX_BUCKETS {
            return Err(SpendQueryError::TooLong(buckets));
        }
        let limit = limit.unwrap_or(Self::DEFAULT_LIMIT);
        if limit == 0 || limit > Self::MAX_LIMIT {
            return Err(SpendQueryError::Limit(limit));
        }
        let cursor = cursor
            .filter(|c| !c.is_empty())
            .map(|c| parse_cursor(by, c))
            .transpose()?;
        Ok(Self {
            by,
            step,
            from_ms,
            to_ms,
            cursor,
            limit,
        })
    }
}

fn parse_time(name: &'static str, s: &str) -> Result<u64, SpendQueryError> {
    let bad = |m: String| SpendQueryError::Time(name, m);
    let ts = if s.len() == 10 {
        let date: jiff::civil::Date = s.parse().map_err(|e: jiff::Error| bad(e.to_string()))?;
        date.to_zoned(jiff::tz::TimeZone::UTC)
            .map_err(|e| bad(e.to_string()))?
            .timestamp()
    } else {
        s.parse::<jiff::Timestamp>().map_err(|e| {
            bad(format!(
                "not an RFC 3339 time (2026-12-07T10:00:00Z) or a date (2026-12-07): {e}"
            ))
        })?
    };
    u64::try_from(ts.as_millisecond()).map_err(|_| bad("before 1970".into()))
}

/// A cursor is `u:<user>` (by user) or `r:<start_ms>:<key>`.
fn parse_cursor(by: By, c: &str) -> Result<Cursor, SpendQueryError> {
    match (by, c.split_once(':')) {
        (By::User, Some(("u", user))) => UserId::new(user)
            .map(Cursor::User)
            .map_err(|_| SpendQueryError::Cursor),
        (By::User, _) => Err(SpendQueryError::Cursor),
        (_, Some(("r", rest))) => {
            let (start, key) = rest.split_once(':').ok_or(SpendQueryError::Cursor)?;
            let start = start.parse().map_err(|_| SpendQueryError::Cursor)?;
            Ok(Cursor::Row(key.to_owned(), start))
        }
        _ => Err(SpendQueryError::Cursor),
    }
}

/// One row of a report: what the charges grouped under `key` made in the
/// bucket starting at `start_ms` came to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpendRow {
    /// The user, organisation, operation, provider or sheet entry ("" for
    /// charges that have none: no organisation, an unpriced call).
    pub key: String,
    /// The bucket's start, RFC 3339 (ms).
    pub start: String,
    pub start_ms: u64,
    /// In minor units of the currency (the answers: [`SpendPage::to_json`]).
    pub amount: u64,
}

/// One page of a report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpendPage {
    pub by: String,
    pub step: String,
    pub from: String,
    pub to: String,
    pub currency: String,
    pub rows: Vec<SpendRow>,
    /// The sum of this page's rows.
    pub total: u64,
    /// Pass as `cursor` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub next_cursor: Option<String>,
}

impl SpendPage {
    /// The page as the answers write it: amounts of `currency` as
    /// [`Amount`] does (tokens: integers; money: exact decimal strings).
    pub fn to_json(&self, currency: Currency) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(rows) = v.get_mut("rows").and_then(|r| r.as_array_mut()) {
            for (row, r) in rows.iter_mut().zip(&self.rows) {
                row["amount"] = Amount::new(currency, r.amount).to_json();
            }
        }
        v["total"] = Amount::new(currency, self.total).to_json();
        v
    }

    /// The page as CSV: a header, then `key,start,amount` per row, amounts
    /// of `currency` as [`SpendPage::to_json`] writes them.
    pub fn to_csv(&self, currency: Currency) -> String {
        let mut out = format!("{},start,amount\n", self.by);
        for r in &self.rows {
            out.push_str(&csv_field(&r.key));
            out.push(',');
            out.push_str(&r.start);
            out.push(',');
            out.push_str(
                &Amount::new(currency, r.amount)
                    .to_json()
                    .to_string()
                    .replace('"', ""),
            );
            out.push('\n');
        }
        out
    }
}

/// A CSV field, quoted when it must be (RFC 4180); a leading `=`, `+`, `-`
/// or `@` is prefixed with `'` so that no spreadsheet runs it as a formula.
fn csv_field(s: &str) -> String {
    let s = if s.starts_with(['=', '+', '-', '@']) {
        format!("'{s}")
    } else {
        s.to_owned()
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SpendError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Keys(#[from] KeyStoreError),
    #[error(transparent)]
    Users(#[from] UserQueryError),
}

/// Users read from the users index per step of a report.
const USERS_PER_READ: usize = UserQuery::MAX_LIMIT;

/// Makes one page of a report. By user: a page of the users index (as many
/// users as fit `limit` rows, at least one), each user's rollup read once.
/// Any other grouping: every user of the index, a page of users at a time,
/// each user's rollup read once (one bounded read each: no command reads
/// more than one user's rollup), summed, then the rows after the cursor.
/// Users are those of the users index (issued a key).
pub async fn report(
    ledger: &dyn Ledger,
    keys: &dyn KeyStore,
    query: &SpendQuery,
    currency: &str,
) -> Result<SpendPage, SpendError> {
    let mut rows: BTreeMap<(String, u64), u64> = BTreeMap::new();
    let mut next_cursor = None;
    let mut after = match &query.cursor {
        Some(Cursor::User(u)) => Some(u.as_str().to_owned()),
        _ => None,
    };
    loop {
        let q = UserQuery::new("", after.as_deref(), USERS_PER_READ)?;
        let page = keys.users(&q).await?;
        let mut stopped = false;
        for user in &page.users {
            let buckets = ledger
                .spend(user, query.step, query.from_ms, query.to_ms)
                .await?;
            let before = rows.len();
            for b in buckets {
                let key = query.by.key(user, &b.dims).to_owned();
                *rows.entry((key, b.start_ms)).or_default() += b.amount;
            }
            after = Some(user.as_str().to_owned());
            if query.by == By::User && rows.len() >= query.limit && rows.len() > before {
                // This page ends with this user: the next starts after it.
                stopped = true;
                break;
            }
        }
        if stopped {
            let more = page.next_cursor.is_some()
                || page.users.last().map(UserId::as_str) != after.as_deref();
            if more {
                next_cursor = after.map(|u| format!("u:{u}"));
            }
            break;
        }
        match page.next_cursor {
            Some(c) => after = Some(c.as_str().to_owned()),
            None => break,
        }
    }
    let mut rows: Vec<SpendRow> = rows
        .into_iter()
        .map(|((key, start_ms), amount)| SpendRow {
            key,
            start: crate::clock::rfc3339(start_ms),
            start_ms,
            amount,
        })
        .collect();
    if query.by != By::User {
        // Rows in (key, start) order; the page starts after the cursor's.
        if let Some(Cursor::Row(key, start)) = &query.cursor {
            rows.retain(|r| (r.key.as_str(), r.start_ms) > (key.as_str(), *start));
        }
        if rows.len() > query.limit {
            rows.truncate(query.limit);
            next_cursor = rows.last().map(|r| format!("r:{}:{}", r.start_ms, r.key));
        }
    }
    Ok(SpendPage {
        by: query.by.as_str().to_owned(),
        step: query.step.as_str().to_owned(),
        from: crate::clock::rfc3339(query.from_ms),
        to: crate::clock::rfc3339(query.to_ms),
        currency: currency.to_owned(),
        total: rows.iter().map(|r| r.amount).sum(),
        rows,
        next_cursor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_round_trip_and_refuse_other_text() {
        let d = Dims {
            org: "acme".into(),
            operation: "openai.chat".into(),
            provider: "openai".into(),
            model: "gpt-4o-mini*".into(),
        };
        assert_eq!(Dims::parse(&d.to_text()), Some(d));
        assert_eq!(Dims::parse("a\tb\tc"), None);
        assert_eq!(Dims::parse("a\tb\tc\td\te"), None);
    }

    #[test]
    fn queries_check_their_parameters() {
        let now = 1_796_029_200_000; // 2026-11-30T09:00Z
        let q = SpendQuery::new("model", Some("1h"), None, None, None, None, now).unwrap();
        assert_eq!(q.to_ms, now + HOUR_MS);
        assert_eq!(q.from_ms, now + HOUR_MS - DAY_MS);
        let q = SpendQuery::new(
            "user",
            Some("1d"),
            Some("2026-11-01"),
            Some("2026-11-30T00:00:00Z"),
            None,
            None,
            now,
        )
        .unwrap();
        assert_eq!((q.to_ms - q.from_ms) / DAY_MS, 29);
        let bad = |by, step, from, to, cursor, limit| {
            SpendQuery::new(by, step, from, to, cursor, limit, now).unwrap_err()
        };
        assert_eq!(
            bad("team", None, None, None, None, None),
            SpendQueryError::By("team".into())
        );
        assert_eq!(
            bad("user", Some("5m"), None, None, None, None),
            SpendQueryError::Step("5m".into())
        );
        assert!(matches!(
            bad("user", None, Some("yesterday"), None, None, None),
            SpendQueryError::Time("from", _)
        ));
        assert_eq!(
            bad(
                "user",
                None,
                Some("2026-11-30"),
                Some("2026-11-01"),
                None,
                None
            ),
            SpendQueryError::Range
        );
        assert_eq!(
            bad("user", Some("1h"), Some("2026-01-01"), None, None, None),
            SpendQueryError::TooLong(8002)
        );
        assert_eq!(
            bad("user", None, None, None, None, Some(0)),
            SpendQueryError::Limit(0)
        );
        assert_eq!(
            bad("user", None, None, None, Some("r:1:x"), None),
            SpendQueryError::Cursor
        );
        assert_eq!(
            bad("model", None, None, None, Some("r:x:y"), None),
            SpendQueryError::Cursor
        );
    }

    #[test]
    fn csv_quotes_and_defuses_formulas() {
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("=1+1"), "'=1+1");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("gpt-4o"), "gpt-4o");
    }

    #[test]
    fn keep_counts_buckets() {
        let k = Keep::default();
        assert_eq!(k.buckets(Step::Hour), 48);
        assert_eq!(k.buckets(Step::Day), 400);
        let now = 100 * DAY_MS + 5;
        assert!(k.kept(Step::Hour, now - 47 * HOUR_MS, now));
        assert!(!k.kept(Step::Hour, now - 48 * HOUR_MS, now));
    }
}
