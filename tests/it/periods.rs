//! Calendar periods (`period = "day" | "week" | "month"`), written once and
//! run on both ledgers with the ledger's own clock set to chosen instants:
//! the embedded ledger's a manual clock (exact), Redis's `TIME` offset by
//! libfaketime ([`ClockedRedis`]: it starts at the instant set and runs on,
//! so Redis reads a few milliseconds past it). The pod computing the
//! boundaries runs on the real clock, months away from the ledger's: its
//! first call is refused and it learns the ledger's clock (see
//! `lua/budget/lib/periods.lua`).

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    clock::{Clock, ManualClock},
    config::Config,
    id::OrgId,
    id::{RequestId, UserId},
    ledger::{Ledger, RefundOutcome, ReserveOutcome, Scope, SettleOutcome},
};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_redis::ledger::RedisLedger;
use tollgate_tests::clocked_redis::ClockedRedis;

const CONFIG: &str = r#"
default_plan = "berlin"
[plans.berlin]
limit = 10
period = "month"
tz = "Europe/Berlin"
[plans.feb31]
limit = 10
period = "month"
anchor = 31
[plans.ny14]
limit = 10
period = "month"
anchor = 14
tz = "America/New_York"
[plans.nyday]
limits = [{ limit = 10, period = "day", tz = "America/New_York" }, { limit = 50, window = "2h" }]
[plans.berlinbig]
limit = 20
period = "month"
tz = "Europe/Berlin"
[plans.berlinday]
limit = 10
period = "day"
tz = "Europe/Berlin"
[plans.utc]
limits = [{ limit = 10, period = "month" }, { limit = 1000, period = "week", week_start = "sunday" }]
[plans.million]
limit = 100000000
period = "month"
[plans.orgmonth]
limit = 15
period = "month"
"#;

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "periods").expect("test config"))
}

fn user(s: &str) -> UserId {
    UserId::new(s).expect("valid user id")
}

fn rid(s: &str) -> RequestId {
    RequestId::new(s).expect("valid request id")
}

/// Milliseconds of the local time `y-m-d h:mi:s.ms` in `tz`.
fn local(tz: &str, (y, m, d): (i16, i8, i8), (h, mi, s, ms): (i8, i8, i8, i32)) -> u64 {
    let dt = jiff::civil::date(y, m, d).at(h, mi, s, ms * 1_000_000);
    let z = dt
        .to_zoned(jiff::tz::db().get(tz).expect("a time zone"))
        .expect("a local time");
    u64::try_from(z.timestamp().as_millisecond()).expect("after 1970")
}

/// A ledger and its clock.
pub enum Clocked {
    Memory {
        clock: Arc<ManualClock>,
        ledger: Arc<MemoryLedger<Arc<ManualClock>>>,
    },
    Redis {
        clock: ClockedRedis,
        ledger: Arc<RedisLedger>,
    },
}

impl Clocked {
    fn ledger(&self) -> Arc<dyn Ledger> {
        match self {
            Clocked::Memory { ledger, .. } => ledger.clone(),
            Clocked::Redis { ledger, .. } => ledger.clone(),
        }
    }

    /// Whether the clock stays where it is set (else it runs on from there).
    fn exact(&self) -> bool {
        matches!(self, Clocked::Memory { .. })
    }

    /// Sets the ledger's clock to `at_ms` (the manual one only forward).
    async fn set(&self, at_ms: u64) {
        match self {
            Clocked::Memory { clock, .. } => {
                let now = clock.now_ms();
                assert!(at_ms >= now, "the manual clock only goes forward");
                clock.advance(Duration::from_millis(at_ms - now));
            }
            Clocked::Redis { clock, ledger } => {
                tokio::task::block_in_place(|| clock.set(at_ms));
                // The restart dropped the pool's connections: one call that
                // may fail on them before the case's calls.
                for _ in 0..20 {
                    if ledger.plan(&user("warm-up")).await.is_ok() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                panic!("the restarted Redis does not answer");
            }
        }
    }
}

/// Which backend a case runs on.
#[derive(Debug, Clone, Copy)]
pub enum On {
    Memory,
    Redis,
}

impl On {
    /// The ledger, its clock reading `at_ms`.
    async fn start(self, at_ms: u64) -> Clocked {
        match self {
            On::Memory => {
                let clock = Arc::new(ManualClock::new(at_ms));
                let ledger = Arc::new(MemoryLedger::with_clock(config(), Arc::clone(&clock)));
                Clocked::Memory { clock, ledger }
            }
            On::Redis => {
                let clock = ClockedRedis::start(at_ms);
                let ledger = tollgate_tests::redis_ledger(
                    &clock.url(),
                    &tollgate_tests::random_prefix(),
                    config(),
                )
                .await;
                Clocked::Redis {
                    clock,
                    ledger: Arc::new(ledger),
                }
            }
        }
    }
}

fn allowed(r: &ReserveOutcome) -> &tollgate_core::ledger::Allowed {
    match r {
        ReserveOutcome::Allowed(a) => a,
        ReserveOutcome::Denied(d) => panic!("denied: {d:?}"),
    }
}

fn denied(r: &ReserveOutcome) -> &tollgate_core::ledger::Denied {
    match r {
        ReserveOutcome::Denied(d) => d,
        ReserveOutcome::Allowed(a) => panic!("allowed: {a:?}"),
    }
}

/// A user of `plan` at 100 % of its period limit (a period ending at
/// `end_ms`, filled at `full_ms`) is refused just before the end (the
/// embedded ledger at exactly 23:59:59.900 local: 100 ms before; Redis in
/// the last second), told to come back exactly when the period ends, and
/// admitted at the end (exactly 00:00:00.000 local; Redis a few ms past it),
/// into a period starting there.
async fn refused_until_the_period_ends(on: On, plan: &str, full_ms: u64, end_ms: u64) {
    let b = on.start(full_ms).await;
    let l = b.ledger();
    let u = user("pat");
    l.set_plan(&u, plan).await.unwrap();
    let r = l.reserve(&u, &rid("fill"), 10).await.unwrap();
    let a = allowed(&r);
    let k = a.windows.iter().position(|w| w.period.is_some()).unwrap();
    let w = &a.windows[k];
    assert_eq!(w.period.map(|p| p.end_ms), Some(end_ms), "{plan}: {w:?}");
    assert_eq!((w.used, w.remaining), (10, 0));
    assert_eq!(w.reset_after_ms, Some(end_ms - a.now_ms));

    let before = if b.exact() { 100 } else { 1000 };
    b.set(end_ms - before).await;
    let r = l.reserve(&u, &rid("eve"), 1).await.unwrap();
    let d = denied(&r);
    assert!(d.now_ms < end_ms, "{plan}: {d:?}");
    assert_eq!(d.retry_after_ms, end_ms - d.now_ms, "{plan}: {d:?}");
    if b.exact() {
        assert_eq!(d.retry_after_ms, 100);
    }
    assert_eq!(d.windows[k].reset_after_ms, Some(end_ms - d.now_ms));
    assert_eq!(d.windows[k].period.map(|p| p.end_ms), Some(end_ms));
    assert_eq!((d.used, d.limit), (10, 10));

    b.set(end_ms).await;
    let r = l.reserve(&u, &rid("dawn"), 1).await.unwrap();
    let a = allowed(&r);
    let w = &a.windows[k];
    assert_eq!(w.period.map(|p| p.start_ms), Some(end_ms), "{plan}: {w:?}");
    assert_eq!(w.used, 1);
    assert!(a.now_ms >= end_ms && a.now_ms < end_ms + 5000, "{a:?}");
    if b.exact() {
        assert_eq!(a.now_ms, end_ms);
    }
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.windows[k].used, 1);
}

/// A month anchored on the 1st in Berlin: the month ends at local
/// midnight (22:00 UTC in summer time), in a month an hour short.
async fn a_month_ends_at_local_midnight(on: On) {
    let full = local("Europe/Berlin", (2027, 3, 20), (12, 0, 0, 0));
    let end = local("Europe/Berlin", (2027, 4, 1), (0, 0, 0, 0));
    refused_until_the_period_ends(on, "berlin", full, end).await;
}

/// A month anchored on the 31st ends on the 28th of February, and on the
/// 29th in a leap year.
async fn an_anchor_of_31_resets_at_the_end_of_february(on: On) {
    let full = local("UTC", (2027, 2, 10), (9, 0, 0, 0));
    let end = local("UTC", (2027, 2, 28), (0, 0, 0, 0));
    refused_until_the_period_ends(on, "feb31", full, end).await;
}

async fn an_anchor_of_31_in_a_leap_february(on: On) {
    let full = local("UTC", (2028, 2, 10), (9, 0, 0, 0));
    let end = local("UTC", (2028, 2, 29), (0, 0, 0, 0));
    refused_until_the_period_ends(on, "feb31", full, end).await;
}

/// A New York month anchored on the 14th ends where the 23-hour day of
/// 2027-03-14 begins; that day, as a daily period, ends 23 hours later.
async fn a_23_hour_day(on: On) {
    let full = local("America/New_York", (2027, 3, 1), (12, 0, 0, 0));
    let end = local("America/New_York", (2027, 3, 14), (0, 0, 0, 0));
    refused_until_the_period_ends(on, "ny14", full, end).await;
    let start = local("America/New_York", (2027, 3, 14), (0, 0, 0, 0));
    let end = local("America/New_York", (2027, 3, 15), (0, 0, 0, 0));
    assert_eq!(end - start, 23 * 3_600_000);
    refused_until_the_period_ends(on, "nyday", start + 3_600_000, end).await;
}

/// Berlin's 2027-10-31 is 25 hours long.
async fn a_25_hour_day(on: On) {
    let start = local("Europe/Berlin", (2027, 10, 31), (0, 0, 0, 0));
    let end = local("Europe/Berlin", (2027, 11, 1), (0, 0, 0, 0));
    assert_eq!(end - start, 25 * 3_600_000);
    refused_until_the_period_ends(on, "berlinday", start + 1000, end).await;
}

/// A refund, a settle or a release of a charge made in a period that ended
/// changes nothing in the current one; in the current one, it gives back.
async fn refunds_land_in_the_period_of_their_charge(on: On) {
    let eve = local("UTC", (2027, 2, 28), (23, 59, 59, 0));
    let b = on.start(eve).await;
    let l = b.ledger();
    let u = user("rue");
    l.set_plan(&u, "utc").await.unwrap();
    allowed(&l.reserve(&u, &rid("old-a"), 4).await.unwrap());
    allowed(&l.reserve(&u, &rid("old-b"), 3).await.unwrap());

    b.set(local("UTC", (2027, 3, 1), (0, 0, 0, 500))).await;
    let a = l.reserve(&u, &rid("new"), 9).await.unwrap();
    assert_eq!(allowed(&a).windows[0].used, 9, "a new month starts empty");
    // The week (from Sunday 2027-02-28) holds all three.
    assert_eq!(allowed(&a).windows[1].used, 16);
    denied(&l.reserve(&u, &rid("more"), 2).await.unwrap());

    let r = l.refund(&u, &rid("old-a")).await.unwrap();
    assert!(
        matches!(r, RefundOutcome::Refunded { cost: 4, .. }),
        "{r:?}"
    );
    let s = l.settle(&u, &rid("old-b"), 1).await.unwrap();
    assert!(
        matches!(
            s,
            SettleOutcome::Settled {
                previous_cost: 3,
                cost: 1,
                ..
            }
        ),
        "{s:?}"
    );
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.windows[0].used, 9, "the month's spend stands");
    assert_eq!(usage.windows[1].used, 10, "the week gave back 4 and 2");
    denied(&l.reserve(&u, &rid("more"), 2).await.unwrap());

    // In its own period a settle and a refund give back.
    let s = l.settle(&u, &rid("new"), 5).await.unwrap();
    assert!(matches!(s, SettleOutcome::Settled { cost: 5, .. }), "{s:?}");
    assert_eq!(
        allowed(&l.reserve(&u, &rid("more"), 2).await.unwrap()).windows[0].used,
        7
    );
    l.refund(&u, &rid("new")).await.unwrap();
    let a = l.reserve(&u, &rid("most"), 8).await.unwrap();
    assert_eq!(allowed(&a).windows[0].used, 10);
}

/// The log keeps a day of events for a plan of periods: a month's charges
/// older than that are gone from it, and still counted in the month.
async fn the_period_outlives_the_log(on: On) {
    let first = local("UTC", (2027, 5, 3), (10, 0, 0, 0));
    let b = on.start(first).await;
    let l = b.ledger();
    let u = user("lou");
    l.set_plan(&u, "utc").await.unwrap();
    for i in 0..4 {
        allowed(&l.reserve(&u, &rid(&format!("r{i}")), 2).await.unwrap());
    }
    b.set(first + 3 * 86_400_000).await;
    let usage = l.usage(&u).await.unwrap();
    assert!(usage.events.is_empty(), "{:?}", usage.events);
    assert_eq!(usage.windows[0].used, 8);
    let r = l.refund(&u, &rid("r0")).await.unwrap();
    assert!(matches!(r, RefundOutcome::NotFound { .. }), "{r:?}");
    allowed(&l.reserve(&u, &rid("r9"), 2).await.unwrap());
    denied(&l.reserve(&u, &rid("r10"), 1).await.unwrap());
}

/// An organisation's monthly limit binds its members (scope organisation,
/// back when the month ends), a refund in the month gives back to both
/// levels, and the next month starts empty.
async fn an_organisations_month_binds_its_members(on: On) {
    let start = local("UTC", (2027, 4, 30), (12, 0, 0, 0));
    let end = local("UTC", (2027, 5, 1), (0, 0, 0, 0));
    let b = on.start(start).await;
    let l = b.ledger();
    let (a, bb, o) = (user("ann"), user("ben"), OrgId::new("initech").unwrap());
    l.set_org_plan(&o, "orgmonth").await.unwrap();
    for u in [&a, &bb] {
        l.set_plan(u, "million").await.unwrap();
        l.set_user_org(u, Some(&o)).await.unwrap();
    }
    allowed(&l.reserve(&a, &rid("a1"), 10).await.unwrap());
    let r = l.reserve(&bb, &rid("b1"), 8).await.unwrap();
    let d = denied(&r);
    assert_eq!(d.scope, Scope::Organisation, "{d:?}");
    assert_eq!(d.retry_after_ms, end - d.now_ms);
    let org = d.organisation.as_ref().unwrap();
    assert_eq!(org.windows[0].period.map(|p| p.end_ms), Some(end));
    assert_eq!(org.windows[0].used, 10);
    l.refund(&a, &rid("a1")).await.unwrap();
    allowed(&l.reserve(&bb, &rid("b1"), 8).await.unwrap());
    let ou = l.org_usage(&o, None, 10).await.unwrap();
    assert_eq!(ou.windows[0].used, 8);
    b.set(end).await;
    let r = l.reserve(&a, &rid("a2"), 15).await.unwrap();
    assert_eq!(allowed(&r).windows[0].used, 15, "the member's own month");
    let ou = l.org_usage(&o, None, 10).await.unwrap();
    assert_eq!(ou.windows[0].used, 15);
    assert_eq!(ou.windows[0].period.map(|p| p.start_ms), Some(end));
}

/// A user's own limits (an admin's override) are trailing windows: a
/// period among them is refused, and nothing changes.
async fn a_users_own_limits_refuse_a_period(on: On) {
    let b = on.start(local("UTC", (2027, 7, 1), (0, 0, 0, 0))).await;
    let l = b.ledger();
    let u = user("own");
    let month = Config::parse(CONFIG, "periods")
        .unwrap()
        .plan("utc")
        .unwrap()
        .limits[0];
    assert!(month.is_period());
    let e = l.set_limits(&u, &[month]).await.unwrap_err();
    assert!(e.to_string().contains("period"), "{e}");
    assert_eq!(l.custom_limits(&u).await.unwrap(), None);
}

/// A user moving into an organisation and out again keeps its month's
/// total, though the log kept only the last day of the events it counts.
async fn a_move_keeps_the_users_month(on: On) {
    let start = local("UTC", (2027, 8, 2), (9, 0, 0, 0));
    let b = on.start(start).await;
    let l = b.ledger();
    let (u, o) = (user("mo"), OrgId::new("hooli").unwrap());
    l.set_org_plan(&o, "million").await.unwrap();
    l.set_plan(&u, "utc").await.unwrap();
    allowed(&l.reserve(&u, &rid("m1"), 6).await.unwrap());
    b.set(start + 3 * 86_400_000).await;
    allowed(&l.reserve(&u, &rid("m2"), 1).await.unwrap());
    l.set_user_org(&u, Some(&o)).await.unwrap();
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.windows[0].used, 7, "{usage:?}");
    // The organisation counts what moved in with its member: the last day.
    let ou = l.org_usage(&o, None, 10).await.unwrap();
    assert_eq!(ou.windows[0].used, 1);
    denied(&l.reserve(&u, &rid("m3"), 4).await.unwrap());
    allowed(&l.reserve(&u, &rid("m3"), 3).await.unwrap());
    l.set_user_org(&u, None).await.unwrap();
    assert_eq!(l.usage(&u).await.unwrap().windows[0].used, 10);
    denied(&l.reserve(&u, &rid("m4"), 1).await.unwrap());
}

/// A plan change keeps a period's spend when the new plan's period is the
/// same calendar span (an upgrade mid-month: what was spent still counts
/// against the larger limit); a plan whose month runs on another calendar
/// (another time zone or anchor day) counts its own span from zero, as a
/// new billing cycle; and going back finds the first counter where it was.
async fn a_plan_change_keeps_the_spend_of_the_same_calendar(on: On) {
    let start = local("Europe/Berlin", (2027, 6, 10), (12, 0, 0, 0));
    let b = on.start(start).await;
    let l = b.ledger();
    let u = user("pia");
    l.set_plan(&u, "berlin").await.unwrap();
    allowed(&l.reserve(&u, &rid("p1"), 6).await.unwrap());
    denied(&l.reserve(&u, &rid("p2"), 5).await.unwrap());

    l.set_plan(&u, "berlinbig").await.unwrap();
    let a = l.reserve(&u, &rid("p2"), 5).await.unwrap();
    let w = &allowed(&a).windows[0];
    assert_eq!((w.used, w.limit), (11, 20), "the month's 6 carried: {w:?}");
    let month = w.period.unwrap();
    assert_eq!(
        (month.start_ms, month.end_ms),
        (
            local("Europe/Berlin", (2027, 6, 1), (0, 0, 0, 0)),
            local("Europe/Berlin", (2027, 7, 1), (0, 0, 0, 0))
        )
    );

    // (A counter made in the millisecond of an event counts it: a second on.)
    b.set(start + 1000).await;
    l.set_plan(&u, "utc").await.unwrap();
    let a = l.reserve(&u, &rid("p3"), 1).await.unwrap();
    let w = &allowed(&a).windows[0];
    assert_eq!(
        w.used, 1,
        "another calendar's month counts from zero: {w:?}"
    );
    assert_eq!(
        w.period.unwrap().start_ms,
        local("UTC", (2027, 6, 1), (0, 0, 0, 0))
    );
    // A refund of a charge of the Berlin month gives back to its own
    // counter, never to the UTC month's.
    l.refund(&u, &rid("p2")).await.unwrap();
    assert_eq!(l.usage(&u).await.unwrap().windows[0].used, 1);

    b.set(start + 2000).await;
    l.set_plan(&u, "berlin").await.unwrap();
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.windows[0].used, 6, "the Berlin month kept 11 - 5");
    // A UTC month's charge is none of the Berlin month's: its refund gives
    // nothing back there.
    l.refund(&u, &rid("p3")).await.unwrap();
    assert_eq!(l.usage(&u).await.unwrap().windows[0].used, 6);
    allowed(&l.reserve(&u, &rid("p4"), 4).await.unwrap());
    denied(&l.reserve(&u, &rid("p5"), 1).await.unwrap());
}

on_each_backend!(
    [
        a_plan_change_keeps_the_spend_of_the_same_calendar,
        a_move_keeps_the_users_month,
        a_users_own_limits_refuse_a_period,
        an_organisations_month_binds_its_members,
        a_month_ends_at_local_midnight,
        an_anchor_of_31_resets_at_the_end_of_february,
        an_anchor_of_31_in_a_leap_february,
        a_23_hour_day,
        a_25_hour_day,
        refunds_land_in_the_period_of_their_charge,
        the_period_outlives_the_log,
    ]
    memory => super::On::Memory,
    redis => super::On::Redis,
);

/// A month's total is one field, whatever the number of charges: the
/// period key's `MEMORY USAGE` after 10 charges and after 10,000 is the
/// same (BENCHMARKS.md), and once the log's day has passed the user holds
/// a few hundred bytes for a month of charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_is_one_counter_however_many_charges() {
    let start = local("UTC", (2027, 6, 2), (8, 0, 0, 0));
    let b = On::Redis.start(start).await;
    let Clocked::Redis { clock, ledger } = &b else {
        unreachable!()
    };
    let mut con = ::redis::Client::open(clock.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut sizes = Vec::new();
    for (name, n) in [("ten", 10u64), ("tenk", 10_000)] {
        let u = user(name);
        ledger.set_plan(&u, "million").await.unwrap();
        for i in 0..n {
            let r = ledger.reserve(&u, &rid(&format!("{name}-{i}")), 1).await;
            allowed(&r.unwrap());
        }
        let key = ledger.keys().budget(&u).periods();
        let fields: u64 = ::redis::cmd("HLEN")
            .arg(&key)
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(fields, 2, "one counter for the month, and its since");
        let bytes: u64 = ::redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .query_async(&mut con)
            .await
            .unwrap();
        sizes.push(bytes);
        let usage = ledger.usage(&u).await.unwrap();
        assert_eq!(usage.windows[0].used, n);
    }
    assert_eq!(sizes[0], sizes[1], "bytes of the period key: {sizes:?}");
    assert!(sizes[0] < 200, "{sizes:?}");
    // Six days on (the same month): the log's day and the index buckets' two
    // days past it are over; the month stands.
    b.set(start + 6 * 86_400_000).await;
    let mut con = ::redis::Client::open(clock.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let u = user("tenk");
    let usage = ledger.usage(&u).await.unwrap();
    assert_eq!(usage.windows[0].used, 10_000);
    let keys: Vec<String> = ::redis::cmd("KEYS")
        .arg(format!("*{{u:{u}}}*"))
        .query_async(&mut con)
        .await
        .unwrap();
    let mut total = 0u64;
    for k in &keys {
        let bytes: Option<u64> = ::redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(k)
            .query_async(&mut con)
            .await
            .unwrap();
        total += bytes.unwrap_or(0);
    }
    eprintln!(
        "period key: {} B after 10 and after 10000 charges; user after the log's day: {total} B in {} keys",
        sizes[0],
        keys.len()
    );
    assert!(total < 2000, "{total} B in {keys:?}");
}

/// The book's example (docs/src/money.md, "Calendar periods") is a config
/// that runs: its month from the 15th, Berlin time, ends where the page says.
#[tokio::test]
async fn the_books_monthly_plan_resets_on_its_anchor() {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/money.md"),
    )
    .unwrap();
    let section = page.split("## Calendar periods").nth(1).unwrap();
    let toml = section
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap();
    let config = Arc::new(Config::parse(toml, "money.md").unwrap());
    let start = local("Europe/Berlin", (2027, 3, 20), (10, 0, 0, 0));
    let clock = Arc::new(ManualClock::new(start));
    let l = MemoryLedger::with_clock(config, Arc::clone(&clock));
    let u = user("ada");
    // 2.50 a day, 0.50 a minute: eight days of five minutes reach 20 USD.
    for day in 0..8u64 {
        for minute in 0..5 {
            let r = l
                .reserve(&u, &rid(&format!("d{day}-{minute}")), 500_000)
                .await
                .unwrap();
            allowed(&r);
            clock.advance(Duration::from_millis(60_000));
        }
        let r = l
            .reserve(&u, &rid(&format!("d{day}-more")), 1)
            .await
            .unwrap();
        let day_window = &denied(&r).windows[2];
        assert_eq!(
            (day_window.label().as_str(), day_window.remaining),
            ("day", 0)
        );
        clock.advance(Duration::from_millis(86_400_000 - 5 * 60_000));
    }
    let r = l.reserve(&u, &rid("more"), 1).await.unwrap();
    let d = denied(&r);
    let month = d.windows.iter().find(|w| w.label() == "month").unwrap();
    let end = month.period.unwrap().end_ms;
    assert_eq!(end, local("Europe/Berlin", (2027, 4, 15), (0, 0, 0, 0)));
    assert_eq!(d.retry_after_ms, end - clock.now_ms());
    clock.advance(Duration::from_millis(end - clock.now_ms()));
    allowed(&l.reserve(&u, &rid("more"), 1).await.unwrap());
}
