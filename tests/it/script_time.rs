//! No budget script holds Redis for long, whatever a user's log holds: every
//! walk of the log (events leaving a window, a plan change rebuilding a
//! window's total, totals lost and rebuilt, the exact `retry_after` of a cost
//! that needs many events to leave) is done a slice per call, and `SLOWLOG`
//! logs no call that a walk of the whole log would take ([`slowlog::WALK_US`];
//! the 5 ms target is the benches'). The answers stay exact.

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    ledger::{EventPage, Ledger, ReserveOutcome},
};
use tollgate_redis::{keys::KeySpace, ledger::RedisLedger, pool::PoolOptions, scripts::PlanArgs};
use tollgate_tests::{random_prefix, slowlog, RedisServer};

/// Events one test puts in a user's log: a walk of them all in one call
/// (the code before slicing) takes tens of milliseconds.
const EVENTS: usize = 10_000;

const CONFIG: &str = r#"
default_plan = "short"
[plans.short]
limit = 1000000000
window = "6s"
[plans.two]
limits = [{ limit = 1000000000, window = "6s" }, { limit = 1000000000, window = "1h" }]
[plans.full]
limit = 10000
window = "1h"
"#;

struct Fixture {
    _server: RedisServer,
    ledger: Arc<RedisLedger>,
    space: KeySpace,
    plans: PlanArgs,
    conn: redis::aio::MultiplexedConnection,
}

async fn fixture() -> Fixture {
    let server = RedisServer::start();
    let config = Arc::new(Config::parse(CONFIG, "script-time").unwrap());
    let space = KeySpace::new(&random_prefix()).unwrap();
    let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
        .await
        .unwrap();
    let ledger = Arc::new(RedisLedger::new(pool, space.clone(), Arc::clone(&config)));
    let conn = tollgate_tests::bulk_connection(&server.url())
        .await
        .unwrap();
    Fixture {
        _server: server,
        ledger,
        space,
        plans: PlanArgs::new(&config),
        conn,
    }
}

impl Fixture {
    /// `EVENTS` reserves of cost 1 for `user` on `plan`, pipelined.
    async fn fill(&mut self, user: &UserId, plan: &str) {
        self.ledger.set_plan(user, plan).await.unwrap();
        tollgate_tests::bulk_reserve(
            &mut self.conn,
            &self.space.budget(user),
            &self.plans,
            EVENTS,
            1000,
        )
        .await
        .unwrap();
    }

    /// Logs every command above [`slowlog::WALK_US`] from now on.
    async fn watch(&mut self) {
        slowlog::start(&mut self.conn, slowlog::WALK_US, 1024)
            .await
            .unwrap();
    }

    /// What SLOWLOG logged above [`slowlog::WALK_US`] since `watch` ("" when
    /// nothing).
    async fn slow(&mut self) -> String {
        slowlog::over(&mut self.conn, slowlog::WALK_US)
            .await
            .unwrap()
            .1
    }
}

/// Runs `scenario` (fill a fresh user, then the calls under watch) up to
/// three times until SLOWLOG logged nothing above [`slowlog::WALK_US`] during its calls, then
/// returns its result; fails naming what was logged. A walk of a whole log in
/// one call is slow every time; a call that only lost the CPU to another
/// process on a loaded test machine is not slow again.
async fn quick<T>(
    f: &mut Fixture,
    what: &str,
    mut scenario: impl AsyncFnMut(&mut Fixture, usize) -> (T, String),
) -> T {
    slowlog::quick_in_three_tries(what, async |attempt| scenario(f, attempt).await).await
}

/// A log entry as XRANGE answers it: its ID and its fields.
type LogEntry = (String, Vec<(String, Vec<u8>)>);

fn user(name: &str) -> UserId {
    UserId::new(name).unwrap()
}

/// The first call after a whole log has left the window drops it a slice
/// per call; the reserve still answers, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_log_leaving_at_once_is_dropped_a_slice_per_call() {
    let mut f = fixture().await;
    let (used, events) = quick(
        &mut f,
        "the first reserve after the log left",
        async |f, attempt| {
            let u = user(&format!("leaving-{attempt}"));
            let ledger = Arc::clone(&f.ledger);
            {
                f.fill(&u, "short").await;
                tokio::time::sleep(Duration::from_millis(6_200)).await;
                f.watch().await;
                let outcome = ledger.reserve(&u, &RequestId::generate(), 7).await.unwrap();
                let slow = f.slow().await;
                let ReserveOutcome::Allowed(a) = outcome else {
                    panic!("denied: {outcome:?}")
                };
                let usage = ledger.usage_page(&u, EventPage::first()).await.unwrap();
                ((a.used, usage.events.len()), slow)
            }
        },
    )
    .await;
    assert_eq!(used, 7, "only the new event is in the window");
    assert_eq!(events, 1);
}

/// A plan change that adds a shorter window rebuilds its total from the
/// log a slice per call, and the total is exact; then the short window
/// empties as its events leave, a slice per call too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_change_rebuilds_a_window_a_slice_per_call() {
    let mut f = fixture().await;
    let (rebuilt, emptied) = quick(&mut f, "a plan change", async |f, attempt| {
        let u = user(&format!("replanned-{attempt}"));
        let ledger = Arc::clone(&f.ledger);
        {
            f.fill(&u, "full").await;
            ledger.set_plan(&u, "two").await.unwrap();
            f.watch().await;
            let rebuilt = ledger.usage_page(&u, EventPage::first()).await.unwrap();
            let mut slow = f.slow().await;
            tokio::time::sleep(Duration::from_millis(6_200)).await;
            f.watch().await;
            let emptied = ledger.usage_page(&u, EventPage::first()).await.unwrap();
            slow.push_str(&f.slow().await);
            let used = |u: &tollgate_core::ledger::Usage| -> Vec<u64> {
                u.windows.iter().map(|w| w.used).collect()
            };
            ((used(&rebuilt), used(&emptied)), slow)
        }
    })
    .await;
    // Longest window first: the hour's, then the 6 s one.
    assert_eq!(rebuilt, vec![EVENTS as u64, EVENTS as u64]);
    assert_eq!(emptied, vec![EVENTS as u64, 0]);
}

/// Totals lost (an evicted or deleted meta key) are rebuilt from the log a
/// slice per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_totals_are_rebuilt_a_slice_per_call() {
    let mut f = fixture().await;
    let used = quick(
        &mut f,
        "the first read after the totals were lost",
        async |f, attempt| {
            let u = user(&format!("evicted-{attempt}"));
            let ledger = Arc::clone(&f.ledger);
            {
                f.fill(&u, "full").await;
                let keys = f.space.budget(&u);
                redis::cmd("HDEL")
                    .arg(&keys.meta)
                    .arg("t")
                    .exec_async(&mut f.conn)
                    .await
                    .unwrap();
                f.watch().await;
                let usage = ledger.usage_page(&u, EventPage::first()).await.unwrap();
                (usage.used, f.slow().await)
            }
        },
    )
    .await;
    assert_eq!(used, EVENTS as u64);
}

/// A cost that fits only once every event of a full window has left: its
/// exact retry_after needs a walk of the whole log, done a slice per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_retry_after_over_a_whole_log_is_walked_a_slice_per_call() {
    let mut f = fixture().await;
    let (retry_after, expected) = quick(
        &mut f,
        "a denial needing the whole log",
        async |f, attempt| {
            let u = user(&format!("full-{attempt}"));
            let ledger = Arc::clone(&f.ledger);
            {
                f.fill(&u, "full").await;
                // The cost fits once the newest event has left the window.
                let keys = f.space.budget(&u);
                let newest: Vec<LogEntry> = redis::cmd("XREVRANGE")
                    .arg(&keys.log)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(1)
                    .query_async(&mut f.conn)
                    .await
                    .unwrap();
                let newest_ms: u64 = newest[0].0.split('-').next().unwrap().parse().unwrap();
                f.watch().await;
                let outcome = ledger
                    .reserve(&u, &RequestId::generate(), EVENTS as u64)
                    .await
                    .unwrap();
                let slow = f.slow().await;
                let ReserveOutcome::Denied(d) = outcome else {
                    panic!("allowed: {outcome:?}")
                };
                ((d.retry_after_ms, newest_ms + 3_600_000 - d.now_ms), slow)
            }
        },
    )
    .await;
    assert_eq!(
        retry_after, expected,
        "retry_after is exact: the newest event leaves"
    );
}
