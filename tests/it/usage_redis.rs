//! Reading usage never holds Redis for long: with 100,000 live events in one
//! user's window, the first page and a walk of every page each stay under
//! [`slowlog::WALK_US`] in `SLOWLOG` (the whole log used to be walked in one
//! script: seconds; the 5 ms target is `tollgate-bench usage`'s).

use std::sync::Arc;

use tollgate_core::{
    id::UserId,
    ledger::{EventPage, Ledger},
};
use tollgate_redis::{keys::KeySpace, ledger::RedisLedger, pool::PoolOptions, scripts::PlanArgs};
use tollgate_tests::{random_prefix, slowlog, RedisServer};

const EVENTS: usize = 100_000;

static USER: std::sync::LazyLock<UserId> =
    std::sync::LazyLock::new(|| UserId::new("heavy").unwrap());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_of_100k_live_events_never_holds_redis_past_5ms() {
    let server = RedisServer::start();
    let config = tollgate_tests::one_plan_config("huge", 1_000_000_000, "12h");
    let prefix = random_prefix();
    let space = KeySpace::new(&prefix).unwrap();
    let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
        .await
        .unwrap();
    let ledger = RedisLedger::new(pool, space.clone(), Arc::clone(&config));
    let user = USER.clone();
    let mut conn = tollgate_tests::bulk_connection(&server.url())
        .await
        .unwrap();
    tollgate_tests::bulk_reserve(
        &mut conn,
        &space.budget(&user),
        &PlanArgs::new(&config),
        EVENTS,
        1000,
    )
    .await
    .unwrap();

    // Only the reads are judged: a fill on a busy machine may be preempted.
    slowlog::start(&mut conn, slowlog::WALK_US, 1024)
        .await
        .unwrap();
    let first = quick(&ledger, &mut conn, EventPage::first(), "the first page").await;
    assert_eq!(first.used, EVENTS as u64, "the totals are not paged");
    assert_eq!(first.events.len(), EventPage::DEFAULT_LIMIT);
    assert!(first.next_cursor.is_some());
    // Every page of the largest size, each its own call.
    let page = EventPage::new(None, EventPage::MAX_LIMIT).unwrap();
    let (mut events, mut next, mut pages) = (Vec::new(), Some(page), 0);
    while let Some(p) = next {
        let u = quick(&ledger, &mut conn, p, &format!("page {pages}")).await;
        events.extend(u.events);
        next = u.next_cursor.map(|c| page.next(c));
        pages += 1;
    }
    assert_eq!(events.len(), EVENTS);
    assert!(
        events.windows(2).all(|w| w[0].at_ms <= w[1].at_ms),
        "oldest first"
    );
    assert_eq!(pages, EVENTS.div_ceil(EventPage::MAX_LIMIT));
}

/// Reads `page`; fails naming what SLOWLOG logged above the limit if every one of
/// three tries of the same call did. A walk of the log (seconds at 100,000
/// events) is slow every time; a call that only lost the CPU to another
/// process on a loaded test machine is not slow again.
async fn quick(
    ledger: &RedisLedger,
    conn: &mut redis::aio::MultiplexedConnection,
    page: EventPage,
    what: &str,
) -> tollgate_core::ledger::Usage {
    slowlog::quick_in_three_tries(what, async |_| {
        redis::cmd("SLOWLOG")
            .arg("RESET")
            .exec_async(&mut *conn)
            .await
            .unwrap();
        let usage = ledger.usage_page(&USER, page).await.unwrap();
        let (slow, text) = slowlog::over(&mut *conn, slowlog::WALK_US).await.unwrap();
        (usage, if slow.is_empty() { String::new() } else { text })
    })
    .await
}
