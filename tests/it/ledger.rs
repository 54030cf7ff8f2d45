//! The ledger conformance suite: every semantic case, written once, run against
//! both backends. Memory moves a manual clock; Redis runs on a short window and
//! really waits, because its clock is Redis `TIME`.

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    clock::ManualClock,
    config::Config,
    id::{RequestId, UserId},
    ledger::{
        ClaimRequest, EventCursor, EventPage, Ledger, LedgerError, PageError, RefundOutcome,
        ReserveOutcome, SettleOutcome, SettleRequest,
    },
};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_redis::ledger::RedisLedger;
use tollgate_tests::{random_prefix, RedisServer, TestCluster};

/// The window of every plan in the suite: long enough that a loaded CI machine
/// finishes a case's calls well inside it, short enough for Redis to really wait.
pub const WINDOW: Duration = Duration::from_millis(1500);

pub const CONFIG: &str = r#"
default_plan = "small"
[export]
maxlen = 10000
[plans.small]
limit = 10
window = "1500ms"
[plans.big]
limit = 100
window = "1500ms"
[plans.thousand]
limit = 1000
window = "12h"
[plans.multi]
limits = [{ limit = 12, window = "3s" }, { limit = 8, window = "1s" }]
"#;

/// The windows of plan `multi`: 12 tokens per 3 s and 8 per 1 s.
pub const LONG: u64 = 3000;
pub const SHORT: u64 = 1000;

pub fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "conformance").expect("test config"))
}

pub fn user(s: &str) -> UserId {
    UserId::new(s).expect("valid user id")
}

pub fn rid(s: &str) -> RequestId {
    RequestId::new(s).expect("valid request id")
}

/// A ledger under test, and how time passes for it.
pub trait Backend: Send + Sync {
    fn ledger(&self) -> Arc<dyn Ledger>;
    /// Lets `d` pass on the ledger's clock.
    fn pass(&self, d: Duration) -> impl std::future::Future<Output = ()> + Send;
    /// True when `pass` is exact (a manual clock), so boundaries can be probed to the ms.
    fn exact_clock(&self) -> bool;
}

pub struct MemoryBackend {
    clock: Arc<ManualClock>,
    ledger: Arc<MemoryLedger<Arc<ManualClock>>>,
}

impl MemoryBackend {
    pub fn new() -> Self {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let ledger = Arc::new(MemoryLedger::with_clock(config(), Arc::clone(&clock)));
        Self { clock, ledger }
    }
}

impl Backend for MemoryBackend {
    fn ledger(&self) -> Arc<dyn Ledger> {
        self.ledger.clone()
    }
    async fn pass(&self, d: Duration) {
        self.clock.advance(d);
    }
    fn exact_clock(&self) -> bool {
        true
    }
}

pub struct RedisBackend {
    /// Kept alive for the test; stopped on drop.
    _server: Option<RedisServer>,
    _cluster: Option<TestCluster>,
    pub ledger: Arc<RedisLedger>,
}

impl RedisBackend {
    pub async fn start() -> Self {
        let server = RedisServer::start();
        let ledger = Arc::new(redis_ledger(&server.url(), &random_prefix()).await);
        Self {
            _server: Some(server),
            _cluster: None,
            ledger,
        }
    }

    /// The same ledger on a Redis Cluster (3 primaries, 3 replicas).
    pub async fn cluster() -> Self {
        let cluster = TestCluster::get();
        let ledger = Arc::new(redis_ledger(&cluster.url(), &random_prefix()).await);
        Self {
            _server: None,
            _cluster: Some(cluster),
            ledger,
        }
    }
}

pub async fn redis_ledger(url: &str, prefix: &str) -> RedisLedger {
    tollgate_tests::redis_ledger(url, prefix, config()).await
}

impl Backend for RedisBackend {
    fn ledger(&self) -> Arc<dyn Ledger> {
        self.ledger.clone()
    }
    async fn pass(&self, d: Duration) {
        // Redis TIME has millisecond resolution here; one extra ms keeps a wait
        // of exactly `retry_after` from landing a hair early.
        tokio::time::sleep(d + Duration::from_millis(2)).await;
    }
    fn exact_clock(&self) -> bool {
        false
    }
}

pub fn allowed(o: ReserveOutcome) -> tollgate_core::ledger::Allowed {
    match o {
        ReserveOutcome::Allowed(a) => a,
        ReserveOutcome::Denied(d) => panic!("expected allowed, got {d:?}"),
    }
}

pub fn denied(o: ReserveOutcome) -> tollgate_core::ledger::Denied {
    match o {
        ReserveOutcome::Denied(d) => d,
        ReserveOutcome::Allowed(a) => panic!("expected denied, got {a:?}"),
    }
}

// ---- the cases -------------------------------------------------------------

async fn allows_up_to_the_limit_and_denies_past_it(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("alice"));
    let a = allowed(l.reserve(&u, &rid("r1"), 4).await.unwrap());
    assert_eq!(
        (a.used, a.limit, a.remaining, a.duplicate),
        (4, 10, 6, false)
    );
    assert_eq!(a.at_ms, a.now_ms);
    assert_eq!(allowed(l.reserve(&u, &rid("r2"), 4).await.unwrap()).used, 8);
    let d = denied(l.reserve(&u, &rid("r3"), 3).await.unwrap());
    assert_eq!((d.used, d.limit, d.remaining), (8, 10, 2));
    assert!(d.retry_after_ms > 0 && d.retry_after_ms <= WINDOW.as_millis() as u64);
    // Exactly at the edge: used + cost == limit is allowed.
    let a = allowed(l.reserve(&u, &rid("r4"), 2).await.unwrap());
    assert_eq!((a.used, a.remaining), (10, 0));
    denied(l.reserve(&u, &rid("r5"), 1).await.unwrap());
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.used, 10);
    let ids: Vec<_> = usage.events.iter().map(|e| e.request_id.as_str()).collect();
    assert_eq!(
        ids,
        ["r1", "r2", "r4"],
        "denied reservations leave no event"
    );
}

async fn retry_after_is_exact(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("bob"));
    let first = allowed(l.reserve(&u, &rid("a"), 4).await.unwrap());
    b.pass(Duration::from_millis(300)).await;
    let second = allowed(l.reserve(&u, &rid("b"), 4).await.unwrap());
    assert!(second.at_ms >= first.at_ms + 300);
    let w = WINDOW.as_millis() as u64;

    // Needs 2 tokens freed: the oldest event (4) is enough.
    let d = denied(l.reserve(&u, &rid("c"), 4).await.unwrap());
    assert_eq!(d.retry_after_ms, first.at_ms + w - d.now_ms);
    // Needs 8 freed: both events must leave, so the second one decides.
    let d10 = denied(l.reserve(&u, &rid("c"), 10).await.unwrap());
    assert_eq!(d10.retry_after_ms, second.at_ms + w - d10.now_ms);

    if b.exact_clock() {
        b.pass(Duration::from_millis(d.retry_after_ms - 1)).await;
        denied(l.reserve(&u, &rid("c"), 4).await.unwrap());
        b.pass(Duration::from_millis(1)).await;
    } else {
        b.pass(Duration::from_millis(d.retry_after_ms)).await;
    }
    // Waiting exactly retry_after is enough.
    let a = allowed(l.reserve(&u, &rid("c"), 4).await.unwrap());
    assert_eq!(a.used, 8, "the first event expired, the second is live");
    assert!(a.reset_after_ms <= w);
}

/// A retry_after that needs more events to leave than one call reads (a
/// slice of the log: 100) is still exact: the walk goes on a slice per call.
async fn retry_after_is_exact_past_a_slice(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("many"));
    l.set_plan(&u, "thousand").await.unwrap();
    let mut last = None;
    for i in 0..250 {
        last = Some(allowed(
            l.reserve(&u, &rid(&format!("e{i}")), 1).await.unwrap(),
        ));
    }
    let last = last.unwrap();
    let w = 12 * 3_600_000;
    // 250 tokens must leave for 1000 to fit: the 250th event decides.
    let d = denied(l.reserve(&u, &rid("big"), 1000).await.unwrap());
    assert_eq!(d.retry_after_ms, last.at_ms + w - d.now_ms);
    assert_eq!(d.used, 250);
}

async fn events_expire_as_time_passes(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("carol"));
    allowed(l.reserve(&u, &rid("x1"), 6).await.unwrap());
    b.pass(WINDOW / 2).await;
    allowed(l.reserve(&u, &rid("x2"), 4).await.unwrap());
    denied(l.reserve(&u, &rid("x3"), 1).await.unwrap());
    b.pass(WINDOW / 2).await;
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.used, 4, "x1 left the window, x2 did not: {usage:?}");
    assert_eq!(usage.events.len(), 1);
    assert_eq!(usage.events[0].request_id.as_str(), "x2");
    allowed(l.reserve(&u, &rid("x3"), 6).await.unwrap());
    b.pass(WINDOW).await;
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.used, usage.events.len(), usage.reset_after_ms),
        (0, 0, None)
    );
    assert_eq!(
        allowed(l.reserve(&u, &rid("x4"), 10).await.unwrap()).used,
        10
    );
}

async fn reserve_is_idempotent_per_request_id(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("dave"));
    let first = allowed(l.reserve(&u, &rid("same"), 7).await.unwrap());
    b.pass(Duration::from_millis(5)).await;
    let again = allowed(l.reserve(&u, &rid("same"), 7).await.unwrap());
    assert!(again.duplicate);
    assert_eq!(
        (again.used, again.at_ms),
        (7, first.at_ms),
        "charged once, original time"
    );
    // A retry is recognised even when the pool could not take the cost again.
    allowed(l.reserve(&u, &rid("other"), 3).await.unwrap());
    assert!(allowed(l.reserve(&u, &rid("same"), 7).await.unwrap()).duplicate);
    assert_eq!(l.usage(&u).await.unwrap().used, 10);
}

async fn refund_once_twice_and_unknown(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("erin"));
    allowed(l.reserve(&u, &rid("r1"), 4).await.unwrap());
    allowed(l.reserve(&u, &rid("r2"), 5).await.unwrap());
    assert_eq!(
        l.refund(&u, &rid("r1")).await.unwrap(),
        RefundOutcome::Refunded { cost: 4, used: 5 }
    );
    assert_eq!(
        l.refund(&u, &rid("r1")).await.unwrap(),
        RefundOutcome::NotFound { used: 5 }
    );
    assert_eq!(
        l.refund(&u, &rid("never")).await.unwrap(),
        RefundOutcome::NotFound { used: 5 }
    );
    // Another user cannot refund erin's request, even knowing its id.
    let mallory = user("mallory");
    assert_eq!(
        l.refund(&mallory, &rid("r2")).await.unwrap(),
        RefundOutcome::NotFound { used: 0 }
    );
    assert_eq!(l.usage(&u).await.unwrap().used, 5);
    assert_eq!(
        l.refund(&u, &rid("r2")).await.unwrap(),
        RefundOutcome::Refunded { cost: 5, used: 0 }
    );
    assert_eq!(
        l.refund(&u, &rid("r2")).await.unwrap(),
        RefundOutcome::NotFound { used: 0 }
    );
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.used, usage.events.len()),
        (0, 0),
        "usage never goes negative"
    );
    // A refunded id may be reserved again: it is a new attempt.
    assert!(!allowed(l.reserve(&u, &rid("r1"), 4).await.unwrap()).duplicate);
}

async fn zero_and_oversized_costs_are_errors(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("frank"));
    assert_eq!(
        l.reserve(&u, &rid("z"), 0).await.unwrap_err(),
        LedgerError::ZeroCost
    );
    assert_eq!(
        l.reserve(&u, &rid("z"), 11).await.unwrap_err(),
        LedgerError::CostExceedsLimit {
            cost: 11,
            limit: 10
        }
    );
    assert!(matches!(
        l.reserve(&u, &rid("z"), u64::MAX).await,
        Err(LedgerError::CostTooLarge { .. })
    ));
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.used, usage.events.len()),
        (0, 0),
        "errors record nothing"
    );
}

async fn plans_default_and_per_user(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("grace"));
    assert_eq!(l.plan(&u).await.unwrap(), "small");
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.plan.as_str(), usage.limit, usage.window_ms),
        ("small", 10, 1500)
    );
    assert_eq!(
        l.reserve(&u, &rid("p1"), 50).await.unwrap_err(),
        LedgerError::CostExceedsLimit {
            cost: 50,
            limit: 10
        }
    );
    l.set_plan(&u, "big").await.unwrap();
    assert_eq!(l.plan(&u).await.unwrap(), "big");
    let a = allowed(l.reserve(&u, &rid("p1"), 50).await.unwrap());
    assert_eq!((a.used, a.limit), (50, 100));
    assert!(matches!(
        l.set_plan(&u, "gold").await,
        Err(LedgerError::UnknownPlan { .. })
    ));
    assert_eq!(
        l.plan(&u).await.unwrap(),
        "big",
        "a failed set_plan changes nothing"
    );
    // Other users keep the default.
    assert_eq!(l.plan(&user("heidi")).await.unwrap(), "small");
    // Downgrading keeps the log: 50 used of a limit of 10 denies until it drains.
    l.set_plan(&u, "small").await.unwrap();
    let d = denied(l.reserve(&u, &rid("p2"), 1).await.unwrap());
    assert_eq!((d.used, d.limit, d.remaining), (50, 10, 0));
}

async fn settle_corrects_a_reservation(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("ivan"));
    let a = allowed(l.reserve(&u, &rid("llm"), 8).await.unwrap());
    let s = l.settle(&u, &rid("llm"), 3).await.unwrap();
    assert_eq!(
        s,
        SettleOutcome::Settled {
            previous_cost: 8,
            cost: 3,
            used: 3
        }
    );
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.events[0].cost, usage.events[0].at_ms),
        (3, a.at_ms),
        "keeps its time"
    );
    allowed(l.reserve(&u, &rid("next"), 7).await.unwrap());
    // Settling up records the truth, even past the limit.
    let s = l.settle(&u, &rid("llm"), 9).await.unwrap();
    assert_eq!(
        s,
        SettleOutcome::Settled {
            previous_cost: 3,
            cost: 9,
            used: 16
        }
    );
    let s = l.settle(&u, &rid("llm"), 0).await.unwrap();
    assert_eq!(
        s,
        SettleOutcome::Settled {
            previous_cost: 9,
            cost: 0,
            used: 7
        }
    );
    assert_eq!(
        l.settle(&u, &rid("llm"), 2).await.unwrap(),
        SettleOutcome::NotFound { used: 7 }
    );
    assert_eq!(l.usage(&u).await.unwrap().events.len(), 1);
}

async fn same_millisecond_requests_are_separate_events(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("judy"));
    l.set_plan(&u, "big").await.unwrap();
    let mut ats = Vec::new();
    for i in 0..20 {
        ats.push(allowed(l.reserve(&u, &rid(&format!("m{i}")), 1).await.unwrap()).at_ms);
    }
    let usage = l.usage(&u).await.unwrap();
    assert_eq!((usage.used, usage.events.len()), (20, 20));
    let order: Vec<_> = usage
        .events
        .iter()
        .map(|e| e.request_id.to_string())
        .collect();
    assert!(
        usage.events.windows(2).all(|w| w[0].at_ms <= w[1].at_ms),
        "oldest first: {order:?}"
    );
    if b.exact_clock() {
        assert!(
            ats.iter().all(|a| *a == ats[0]),
            "the manual clock did not move"
        );
    }
}

async fn users_are_independent(b: &impl Backend) {
    let l = b.ledger();
    allowed(l.reserve(&user("u1"), &rid("r"), 10).await.unwrap());
    allowed(l.reserve(&user("u2"), &rid("r"), 10).await.unwrap());
    assert_eq!(l.usage(&user("u1")).await.unwrap().used, 10);
    assert_eq!(
        l.refund(&user("u2"), &rid("r")).await.unwrap(),
        RefundOutcome::Refunded { cost: 10, used: 0 }
    );
    assert_eq!(l.usage(&user("u1")).await.unwrap().used, 10);
}

/// 16 tasks x 200 reserves of cost 8 against a limit of 1000: exactly 125.
async fn concurrent_reserves_never_overspend(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("hot"));
    l.set_plan(&u, "thousand").await.unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (l, u) = (Arc::clone(&l), u.clone());
            tokio::spawn(async move {
                let mut admitted = 0u32;
                for i in 0..200 {
                    if l.reserve(&u, &rid(&format!("t{t}-{i}")), 8)
                        .await
                        .unwrap()
                        .is_allowed()
                    {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, 125);
    let usage = l.usage(&u).await.unwrap();
    let events = tollgate_tests::all_events(l.as_ref(), &u).await.unwrap();
    assert_eq!((usage.used, events.len()), (1000, 125));
}

fn ids(events: &[tollgate_core::ledger::SpendEvent]) -> Vec<String> {
    events.iter().map(|e| e.request_id.to_string()).collect()
}

/// The audit trail is read a page at a time: every live event exactly once, in
/// order, however events leave or arrive between pages (the one a cursor
/// names included); `next_cursor` is `None` exactly at the end.
async fn usage_pages_walk_every_live_event_once(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("pager"));
    let empty = l.usage(&u).await.unwrap();
    assert_eq!((empty.events.len(), empty.next_cursor), (0, None));
    l.set_plan(&u, "thousand").await.unwrap();
    let name = |i: usize| format!("p{i:03}");
    for i in 0..125 {
        allowed(l.reserve(&u, &rid(&name(i)), 1).await.unwrap());
    }
    let page = EventPage::new(None, 50).unwrap();
    let first = l.usage_page(&u, page).await.unwrap();
    assert_eq!(ids(&first.events), (0..50).map(name).collect::<Vec<_>>());
    assert_eq!(first.used, 125, "the totals are not paged");
    let cursor = first.next_cursor.expect("more pages");
    assert_eq!(cursor.to_string().parse::<EventCursor>(), Ok(cursor));
    // The cursor's own event and the next page's first leave; a new one comes.
    for gone in [49, 50] {
        let r = l.refund(&u, &rid(&name(gone))).await.unwrap();
        assert!(matches!(r, RefundOutcome::Refunded { .. }), "{r:?}");
    }
    allowed(l.reserve(&u, &rid(&name(125)), 1).await.unwrap());
    let second = l.usage_page(&u, page.next(cursor)).await.unwrap();
    assert_eq!(ids(&second.events), (51..101).map(name).collect::<Vec<_>>());
    let third = l
        .usage_page(&u, page.next(second.next_cursor.expect("a third page")))
        .await
        .unwrap();
    assert_eq!(ids(&third.events), (101..126).map(name).collect::<Vec<_>>());
    assert_eq!((third.used, third.next_cursor), (124, None));
    // One page of exactly what is left ends the walk: no empty page after it.
    let live: Vec<String> = (0..126)
        .filter(|i| ![49, 50].contains(i))
        .map(name)
        .collect();
    let exact = EventPage::new(second.next_cursor, 25).unwrap();
    let rest = l.usage_page(&u, exact).await.unwrap();
    assert_eq!(
        (ids(&rest.events), rest.next_cursor),
        (ids(&third.events), None)
    );
    let walked = tollgate_tests::all_events(l.as_ref(), &u).await.unwrap();
    assert_eq!(ids(&walked), live);
    // Pages of one follow the same order.
    let mut one = Vec::new();
    let mut p = EventPage::new(None, 1).unwrap();
    loop {
        let r = l.usage_page(&u, p).await.unwrap();
        assert!(r.events.len() <= 1);
        one.extend(ids(&r.events));
        match r.next_cursor {
            Some(c) => p = p.next(c),
            None => break,
        }
    }
    assert_eq!(one, live);
    // A cursor past the newest event: an empty last page.
    let past = EventCursor {
        at_ms: 999_999_999_999_999,
        seq: 0,
    };
    let r = l.usage_page(&u, page.next(past)).await.unwrap();
    assert_eq!((r.events.len(), r.next_cursor, r.used), (0, None, 124));
    // Pages hold 1 to MAX_LIMIT events; cursors are only what a page returns.
    assert_eq!(EventPage::new(None, 0), Err(PageError::BadLimit(0)));
    assert_eq!(
        EventPage::new(None, EventPage::MAX_LIMIT + 1),
        Err(PageError::BadLimit(EventPage::MAX_LIMIT + 1))
    );
    for bad in [
        "",
        "1",
        "-1",
        "1-",
        "a-1",
        "1-1-1",
        " 1-1",
        "+1-1",
        "1234567890123456-0",
    ] {
        assert_eq!(
            bad.parse::<EventCursor>(),
            Err(PageError::BadCursor),
            "{bad:?}"
        );
    }
}

/// (used, limit, window_ms) of every window, longest first.
fn shape(windows: &[tollgate_core::ledger::WindowUse]) -> Vec<(u64, u64, u64)> {
    windows
        .iter()
        .map(|w| (w.used, w.limit, w.window_ms))
        .collect()
}

async fn every_window_must_fit(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("multi-a"));
    l.set_plan(&u, "multi").await.unwrap();
    assert_eq!(
        l.reserve(&u, &rid("huge"), 9).await.unwrap_err(),
        LedgerError::CostExceedsLimit { cost: 9, limit: 8 },
        "the smallest limit bounds a cost"
    );
    let x = allowed(l.reserve(&u, &rid("x"), 8).await.unwrap());
    assert_eq!(shape(&x.windows), [(8, 12, LONG), (8, 8, SHORT)]);
    // The closest to exhaustion is the 1 s window (0 left).
    assert_eq!(
        (x.used, x.limit, x.window_ms, x.remaining),
        (8, 8, SHORT, 0)
    );
    // The short window denies; the long one would take it.
    let d = denied(l.reserve(&u, &rid("y"), 1).await.unwrap());
    assert_eq!((d.limit, d.window_ms, d.used), (8, SHORT, 8));
    assert_eq!(d.retry_after_ms, x.at_ms + SHORT - d.now_ms);
    assert_eq!(shape(&d.windows), [(8, 12, LONG), (8, 8, SHORT)]);
    b.pass(Duration::from_millis(d.retry_after_ms)).await;
    // x left the 1 s window, not the 3 s one.
    let y = allowed(l.reserve(&u, &rid("y"), 4).await.unwrap());
    assert_eq!(shape(&y.windows), [(12, 12, LONG), (4, 8, SHORT)]);
    // Now the long window denies, though the short one has room.
    let d = denied(l.reserve(&u, &rid("z"), 1).await.unwrap());
    assert_eq!((d.limit, d.window_ms), (12, LONG));
    assert_eq!(d.retry_after_ms, x.at_ms + LONG - d.now_ms);
    // Both deny: retry_after is when it fits both, the later of the two.
    let d = denied(l.reserve(&u, &rid("z"), 5).await.unwrap());
    assert_eq!(d.retry_after_ms, x.at_ms + LONG - d.now_ms);
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(shape(&usage.windows), [(12, 12, LONG), (4, 8, SHORT)]);
    assert_eq!(
        (usage.limit, usage.window_ms, usage.remaining),
        (12, LONG, 0)
    );
    assert_eq!(
        usage.windows[1].reset_after_ms,
        Some(y.at_ms + SHORT - usage.now_ms)
    );
    b.pass(Duration::from_millis(d.retry_after_ms)).await;
    let z = allowed(l.reserve(&u, &rid("z"), 4).await.unwrap());
    assert_eq!(shape(&z.windows)[0].0, 8, "x left the 3 s window: y + z");
}

async fn refund_and_settle_move_every_window(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("multi-b"));
    l.set_plan(&u, "multi").await.unwrap();
    allowed(l.reserve(&u, &rid("old"), 3).await.unwrap());
    b.pass(Duration::from_millis(SHORT + 50)).await;
    allowed(l.reserve(&u, &rid("new"), 4).await.unwrap());
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(shape(&usage.windows), [(7, 12, LONG), (4, 8, SHORT)]);
    // Refunding an event outside the short window leaves that window alone.
    assert_eq!(
        l.refund(&u, &rid("old")).await.unwrap(),
        RefundOutcome::Refunded { cost: 3, used: 4 }
    );
    assert_eq!(
        shape(&l.usage(&u).await.unwrap().windows),
        [(4, 12, LONG), (4, 8, SHORT)]
    );
    // Settling past a limit is recorded: used shows more than the limit...
    assert!(matches!(
        l.settle(&u, &rid("new"), 11).await.unwrap(),
        SettleOutcome::Settled {
            previous_cost: 4,
            cost: 11,
            used: 11
        }
    ));
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(shape(&usage.windows), [(11, 12, LONG), (11, 8, SHORT)]);
    assert_eq!((usage.used, usage.remaining), (11, 0));
    // ...and the next reserve waits until it fits again.
    let d = denied(l.reserve(&u, &rid("next"), 1).await.unwrap());
    let new_at = usage.events[0].at_ms;
    assert_eq!(d.retry_after_ms, new_at + SHORT - d.now_ms);
    assert_eq!(
        l.refund(&u, &rid("new")).await.unwrap(),
        RefundOutcome::Refunded { cost: 11, used: 0 }
    );
    assert_eq!(
        shape(&l.usage(&u).await.unwrap().windows),
        [(0, 12, LONG), (0, 8, SHORT)]
    );
    allowed(l.reserve(&u, &rid("next"), 8).await.unwrap());
}

async fn plan_changes_keep_the_log(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("multi-c"));
    l.set_plan(&u, "big").await.unwrap();
    allowed(l.reserve(&u, &rid("a"), 30).await.unwrap());
    b.pass(Duration::from_millis(SHORT + 50)).await;
    allowed(l.reserve(&u, &rid("b"), 5).await.unwrap());
    // Onto several windows: the events already in the log count in each.
    l.set_plan(&u, "multi").await.unwrap();
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(shape(&usage.windows), [(35, 12, LONG), (5, 8, SHORT)]);
    let d = denied(l.reserve(&u, &rid("c"), 1).await.unwrap());
    assert_eq!((d.limit, d.window_ms), (12, LONG), "nothing refunded");
    // Back to one window, and to several again: the totals stay exact.
    l.set_plan(&u, "big").await.unwrap();
    assert_eq!(
        l.refund(&u, &rid("b")).await.unwrap(),
        RefundOutcome::Refunded { cost: 5, used: 30 }
    );
    l.set_plan(&u, "multi").await.unwrap();
    assert_eq!(
        shape(&l.usage(&u).await.unwrap().windows),
        [(30, 12, LONG), (0, 8, SHORT)]
    );
}

/// A job's charge of `cost` for `llm.structured` under `nonce` (fingerprint
/// `f1`, a 60 s deadline, 1 s of grace, no service key).
fn job_charge(cost: u64, nonce: &str) -> tollgate_core::ledger::ChargeRequest<'_> {
    tollgate_core::ledger::ChargeRequest {
        cost,
        nonce,
        operation: "llm.structured",
        model: "",
        fingerprint: "f1",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(1),
        service_key: None,
        price: None,
    }
}

async fn released_holds_leave_every_window(b: &impl Backend) {
    use tollgate_core::ledger::{ChargeOutcome, ChargeRequest};
    let (l, u) = (b.ledger(), user("multi-d"));
    l.set_plan(&u, "multi").await.unwrap();
    let charge = ChargeRequest {
        deadline: Duration::from_millis(100),
        grace: Duration::from_millis(100),
        ..job_charge(5, "n1")
    };
    let c = l.charge(&u, &rid("job"), &charge).await.unwrap();
    let ChargeOutcome::Charged { allowed, .. } = c else {
        panic!("expected charged, got {c:?}")
    };
    assert_eq!(shape(&allowed.windows), [(5, 12, LONG), (5, 8, SHORT)]);
    let d = l
        .charge(&u, &rid("job2"), &ChargeRequest { cost: 4, ..charge })
        .await
        .unwrap();
    assert!(
        matches!(d, ChargeOutcome::Denied(ref d) if d.window_ms == SHORT),
        "{d:?}"
    );
    // No job claimed it by its deadline plus the grace: released, in both windows.
    b.pass(Duration::from_millis(250)).await;
    assert_eq!(
        shape(&l.usage(&u).await.unwrap().windows),
        [(0, 12, LONG), (0, 8, SHORT)]
    );
}

/// A charge made by a service key for a user records the key's id: in the
/// usage events; a retry of the same request through another key is the same
/// request (the first key stays recorded); another operation is a conflict
/// naming the first operation alone.
async fn a_charge_records_the_acting_service_key(b: &impl Backend) {
    use tollgate_core::ledger::{ChargeOutcome, ChargeRequest};
    let (l, u) = (b.ledger(), user("acted-for"));
    let charge = ChargeRequest {
        grace: Duration::from_secs(60),
        service_key: Some("kid_00000000000000aa"),
        ..job_charge(3, "n1")
    };
    let c = l.charge(&u, &rid("svc-job"), &charge).await.unwrap();
    assert!(matches!(c, ChargeOutcome::Charged { .. }), "{c:?}");
    let again = ChargeRequest {
        nonce: "n2",
        service_key: Some("kid_00000000000000bb"),
        ..charge
    };
    let c = l.charge(&u, &rid("svc-job"), &again).await.unwrap();
    assert!(
        matches!(c, ChargeOutcome::Existing { ref nonce, .. } if nonce == "n1"),
        "{c:?}"
    );
    let other = ChargeRequest {
        operation: "embeddings",
        model: "",
        ..again
    };
    let c = l.charge(&u, &rid("svc-job"), &other).await.unwrap();
    assert_eq!(
        c,
        ChargeOutcome::Conflict {
            operation: Some("llm.structured".into())
        }
    );
    let own = ChargeRequest {
        nonce: "n3",
        service_key: None,
        ..charge
    };
    let c = l.charge(&u, &rid("own-job"), &own).await.unwrap();
    assert!(matches!(c, ChargeOutcome::Charged { .. }), "{c:?}");
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.used, 6);
    let events: Vec<_> = usage
        .events
        .iter()
        .map(|e| {
            (
                e.request_id.as_str(),
                e.operation.as_deref(),
                e.service_key.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        events,
        [
            (
                "svc-job",
                Some("llm.structured"),
                Some("kid_00000000000000aa")
            ),
            ("own-job", Some("llm.structured"), None),
        ]
    );
}

/// A charge answers the user's plan, read in its atomic step, named as
/// `plan` names it: the default, a stored plan, the named plan of a user with
/// limits of its own (its plan's other settings still apply), and a member's
/// own plan (not its organisation's); the same for a request charged already.
async fn a_charge_answers_the_users_plan(b: &impl Backend) {
    use tollgate_core::config::Limit;
    use tollgate_core::id::OrgId;
    use tollgate_core::ledger::ChargeOutcome;
    let (l, u) = (b.ledger(), user("planned"));
    let charge = |nonce| job_charge(1, nonce);
    // (charged or found charged, the plan it answered)
    let plan_of = |c: ChargeOutcome| match c {
        ChargeOutcome::Charged { plan, .. } => (true, plan),
        ChargeOutcome::Existing { plan, .. } => (false, plan),
        other => panic!("expected a charge, got {other:?}"),
    };
    let c = l.charge(&u, &rid("p1"), &charge("n1")).await.unwrap();
    assert_eq!(plan_of(c), (true, "small".to_owned()), "the default");
    l.set_plan(&u, "big").await.unwrap();
    let c = l.charge(&u, &rid("p2"), &charge("n2")).await.unwrap();
    assert_eq!(plan_of(c), (true, "big".to_owned()));
    let c = l.charge(&u, &rid("p2"), &charge("n3")).await.unwrap();
    assert_eq!(plan_of(c), (false, "big".to_owned()), "charged already");
    let own = [Limit::window(50, WINDOW)];
    l.set_limits(&u, &own).await.unwrap();
    let c = l.charge(&u, &rid("p3"), &charge("n4")).await.unwrap();
    assert_eq!(plan_of(c), (true, "big".to_owned()), "limits of its own");
    assert_eq!(l.plan(&u).await.unwrap(), "big");
    let c = l.charge(&u, &rid("p3"), &charge("n5")).await.unwrap();
    assert_eq!(plan_of(c), (false, "big".to_owned()));
    // A member: its organisation's plan and windows come before it in the
    // Redis reply.
    let o = OrgId::new("planners").unwrap();
    l.set_org_plan(&o, "thousand").await.unwrap();
    l.set_user_org(&u, Some(&o)).await.unwrap();
    let c = l.charge(&u, &rid("p4"), &charge("n6")).await.unwrap();
    assert_eq!(plan_of(c), (true, "big".to_owned()), "a member");
    let c = l.charge(&u, &rid("p4"), &charge("n7")).await.unwrap();
    assert_eq!(plan_of(c), (false, "big".to_owned()));
    l.clear_limits(&u).await.unwrap();
    let c = l.charge(&u, &rid("p5"), &charge("n8")).await.unwrap();
    assert_eq!(plan_of(c), (true, "big".to_owned()));
}

async fn a_job_settles_its_charge_by_its_nonce(b: &impl Backend) {
    use tollgate_core::ledger::{ChargeOutcome, ChargeRequest, ClaimOutcome};
    let (l, u) = (b.ledger(), user("settler"));
    let charge = ChargeRequest {
        cost: 4,
        nonce: "n1",
        operation: "llm.structured",
        model: "",
        fingerprint: "f1",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(1),
        service_key: None,
        price: None,
    };
    let c = l.charge(&u, &rid("job"), &charge).await.unwrap();
    assert!(matches!(c, ChargeOutcome::Charged { .. }), "{c:?}");
    let hold = 1u64 << 50;
    assert_eq!(
        l.claim(&u, &rid("job"), &ClaimRequest::new("n1", hold))
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    // Another attempt's nonce, a plain reserve, a cost of 0: nothing settles.
    assert_eq!(
        l.settle_charge(&u, &rid("job"), &SettleRequest::new("n2", 7, true))
            .await
            .unwrap(),
        SettleOutcome::NotFound { used: 4 }
    );
    allowed(l.reserve(&u, &rid("plain"), 1).await.unwrap());
    assert_eq!(
        l.settle_charge(&u, &rid("plain"), &SettleRequest::new("n1", 3, true))
            .await
            .unwrap(),
        SettleOutcome::NotFound { used: 5 }
    );
    assert_eq!(
        l.settle_charge(&u, &rid("job"), &SettleRequest::new("n1", 0, true))
            .await
            .unwrap_err(),
        LedgerError::ZeroCost
    );
    let settled = SettleOutcome::Settled {
        previous_cost: 4,
        cost: 7,
        used: 8,
    };
    assert_eq!(
        l.settle_charge(&u, &rid("job"), &SettleRequest::new("n1", 7, true))
            .await
            .unwrap(),
        settled
    );
    // A retried settle sets the same cost: nothing more is charged.
    assert_eq!(
        l.settle_charge(&u, &rid("job"), &SettleRequest::new("n1", 7, true))
            .await
            .unwrap(),
        SettleOutcome::Settled {
            previous_cost: 7,
            cost: 7,
            used: 8
        }
    );
    let usage = l.usage(&u).await.unwrap();
    let job = usage
        .events
        .iter()
        .find(|e| e.request_id.as_str() == "job")
        .unwrap();
    assert_eq!(
        (job.cost, job.estimate),
        (7, Some(4)),
        "the event keeps both figures"
    );
    let plain = usage
        .events
        .iter()
        .find(|e| e.request_id.as_str() == "plain")
        .unwrap();
    assert_eq!(plain.estimate, None);
    // The job still owns its charge (a worker that died claims again).
    assert_eq!(
        l.claim(&u, &rid("job"), &ClaimRequest::new("n1", hold))
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    // Settling past the limit is recorded: used shows more than the limit, and
    // the next reserve waits until enough leaves the window.
    assert!(matches!(
        l.settle_charge(&u, &rid("job"), &SettleRequest::new("n1", 12, true))
            .await
            .unwrap(),
        SettleOutcome::Settled { used: 13, .. }
    ));
    let usage = l.usage(&u).await.unwrap();
    assert_eq!((usage.used, usage.limit, usage.remaining), (13, 10, 0));
    let d = denied(l.reserve(&u, &rid("next"), 1).await.unwrap());
    assert_eq!(d.used, 13);
    assert_eq!(
        d.retry_after_ms,
        job.at_ms + WINDOW.as_millis() as u64 - d.now_ms
    );
    // Released by its job, the charge is gone: a late settle finds nothing.
    assert_eq!(
        l.release(&u, &rid("job"), "n1").await.unwrap(),
        RefundOutcome::Refunded { cost: 12, used: 1 }
    );
    assert_eq!(
        l.settle_charge(&u, &rid("job"), &SettleRequest::new("n1", 5, true))
            .await
            .unwrap(),
        SettleOutcome::NotFound { used: 1 }
    );
}

/// A charge of the most settles only down: 100 concurrent jobs charged 40
/// under a limit of 1,000 never take it past the limit, whatever they report
/// and however often a job settles again (a worker died after a settle).
async fn settling_down_never_passes_a_limit(b: &impl Backend) {
    use tollgate_core::ledger::{ChargeOutcome, ChargeRequest, ClaimOutcome};
    let (l, u) = (b.ledger(), user("down"));
    l.set_plan(&u, "thousand").await.unwrap();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..100 {
        let (l, u) = (Arc::clone(&l), u.clone());
        calls.spawn(async move {
            let (id, nonce) = (rid(&format!("job-{i}")), format!("n{i}"));
            let charge = ChargeRequest {
                cost: 40,
                nonce: &nonce,
                operation: "llm.structured",
                model: "",
                fingerprint: "f",
                deadline: Duration::from_secs(60),
                grace: Duration::from_secs(1),
                service_key: None,
                price: None,
            };
            let c = l.charge(&u, &id, &charge).await.unwrap();
            if !matches!(c, ChargeOutcome::Charged { .. }) {
                return 0;
            }
            let hold = 1u64 << 50;
            assert_eq!(
                l.claim(&u, &id, &ClaimRequest::new(&nonce, hold))
                    .await
                    .unwrap(),
                ClaimOutcome::Claimed
            );
            // Down to 8, then a second settle reporting 40 leaves it at 8.
            l.settle_charge(&u, &id, &SettleRequest::new(&nonce, 8, false))
                .await
                .unwrap();
            let again = l
                .settle_charge(&u, &id, &SettleRequest::new(&nonce, 40, false))
                .await
                .unwrap();
            assert!(
                matches!(again, SettleOutcome::Settled { cost: 8, .. }),
                "{again:?}"
            );
            1
        });
    }
    let mut charged = 0;
    while let Some(n) = calls.join_next().await {
        charged += n.unwrap();
        let usage = l.usage(&u).await.unwrap();
        assert!(usage.used <= usage.limit, "{usage:?}");
    }
    assert!(charged >= 25, "{charged}");
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.used, 8 * charged);
    assert!(usage.events.iter().all(|e| e.estimate == Some(40)));
}

/// An operator's refund of a job's charge: held → released and the job
/// cancelled (its claim answers so, until the hold's end); claimed → a
/// conflict, nothing changed, unless the caller names the final job's nonce.
async fn an_operator_refund_cancels_a_held_charge(b: &impl Backend) {
    use tollgate_core::ledger::{ChargeRequest, ClaimOutcome};
    let (l, u) = (b.ledger(), user("operator"));
    let hold = 1u64 << 50;
    let charge = |nonce: &'static str| job_charge(4, nonce);
    l.charge(&u, &rid("held"), &charge("n1")).await.unwrap();
    assert_eq!(
        l.refund(&u, &rid("held")).await.unwrap(),
        RefundOutcome::Cancelled { cost: 4, used: 0 }
    );
    assert_eq!(
        l.claim(&u, &rid("held"), &ClaimRequest::new("n1", hold))
            .await
            .unwrap(),
        ClaimOutcome::Cancelled
    );
    assert_eq!(
        l.refund(&u, &rid("held")).await.unwrap(),
        RefundOutcome::NotFound { used: 0 }
    );
    // The same request charged anew (a retry) is another job: it may run.
    l.charge(&u, &rid("held"), &charge("n2")).await.unwrap();
    assert_eq!(
        l.claim(&u, &rid("held"), &ClaimRequest::new("n2", hold))
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    // Claimed: a conflict, unless the job is final (its nonce named).
    assert_eq!(
        l.refund(&u, &rid("held")).await.unwrap(),
        RefundOutcome::Running { used: 4 }
    );
    assert_eq!(
        l.refund_charge(&u, &rid("held"), Some("n1")).await.unwrap(),
        RefundOutcome::Running { used: 4 },
        "another attempt's nonce is not this job's"
    );
    assert_eq!(
        l.refund_charge(&u, &rid("held"), Some("n2")).await.unwrap(),
        RefundOutcome::Refunded { cost: 4, used: 0 }
    );
    // A plain reserve is refunded as ever.
    allowed(l.reserve(&u, &rid("plain"), 2).await.unwrap());
    assert_eq!(
        l.refund(&u, &rid("plain")).await.unwrap(),
        RefundOutcome::Refunded { cost: 2, used: 0 }
    );
    // A short hold: once it ended, the cancelled job's claim is refused.
    let short = ChargeRequest {
        deadline: Duration::from_millis(100),
        grace: Duration::from_millis(100),
        ..charge("n3")
    };
    let c = l.charge(&u, &rid("brief"), &short).await.unwrap();
    let tollgate_core::ledger::ChargeOutcome::Charged { deadline_ms, .. } = c else {
        panic!("{c:?}")
    };
    l.refund(&u, &rid("brief")).await.unwrap();
    b.pass(Duration::from_millis(300)).await;
    assert_eq!(
        l.claim(
            &u,
            &rid("brief"),
            &ClaimRequest::new("n3", deadline_ms + 100)
        )
        .await
        .unwrap(),
        ClaimOutcome::Refused
    );
}

/// The log keeps every event for the longest window of any plan: a short
/// plan and back again erases nothing, and the short plan counts only its
/// own window meanwhile.
async fn a_plan_round_trip_erases_nothing(b: &impl Backend) {
    let (l, u) = (b.ledger(), user("round-trip"));
    l.set_plan(&u, "thousand").await.unwrap();
    allowed(l.reserve(&u, &rid("a"), 30).await.unwrap());
    l.set_plan(&u, "small").await.unwrap();
    assert_eq!(
        l.usage(&u).await.unwrap().used,
        30,
        "denied until it drains"
    );
    b.pass(WINDOW + Duration::from_millis(100)).await;
    let usage = l.usage(&u).await.unwrap();
    assert_eq!((usage.used, usage.events.len()), (0, 0), "{usage:?}");
    allowed(l.reserve(&u, &rid("b"), 10).await.unwrap());
    l.set_plan(&u, "multi").await.unwrap();
    l.set_plan(&u, "thousand").await.unwrap();
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.used, 40, "{usage:?}");
    assert_eq!(usage.events.len(), 2);
    assert_eq!(
        l.refund(&u, &rid("a")).await.unwrap(),
        RefundOutcome::Refunded { cost: 30, used: 10 }
    );
}

/// A billing job's view: replays a user's export into the live events
/// (request id -> (spent at, cost)) as of `now_ms`, for a log of `window_ms`.
pub fn replay(
    export: &[tollgate_core::ledger::ExportEntry],
    now_ms: u64,
    window_ms: u64,
) -> std::collections::BTreeMap<String, (u64, u64)> {
    use tollgate_core::ledger::ChangeKind;
    let mut live = std::collections::BTreeMap::new();
    for e in export {
        let id = e.request_id.to_string();
        match e.kind {
            ChangeKind::Spend => {
                live.insert(id, (e.spent_at_ms, e.cost));
            }
            ChangeKind::Settle => {
                live.insert(id, (e.spent_at_ms, e.cost));
            }
            ChangeKind::Refund => {
                live.remove(&id);
            }
            // Prepaid credits: no spend event changes.
            _ => {}
        }
    }
    live.retain(|_, (at, _)| *at + window_ms > now_ms);
    live
}

async fn the_export_rebuilds_every_users_usage(b: &impl Backend) {
    use tollgate_core::ledger::{ChangeKind, ChargeRequest};
    let l = b.ledger();
    let users = [user("ex-a"), user("ex-b"), user("ex-c")];
    for (n, u) in users.iter().enumerate() {
        l.set_plan(u, "big").await.unwrap();
        allowed(l.reserve(u, &rid("early"), 5).await.unwrap());
        allowed(l.reserve(u, &rid("gone"), 7).await.unwrap());
        l.refund(u, &rid("gone")).await.unwrap();
        let charge = ChargeRequest {
            cost: 8,
            nonce: "n1",
            operation: "llm.structured",
            model: "",
            fingerprint: "f1",
            deadline: Duration::from_secs(60),
            grace: Duration::from_secs(1),
            service_key: None,
            price: None,
        };
        l.charge(u, &rid("job"), &charge).await.unwrap();
        l.settle_charge(
            u,
            &rid("job"),
            &SettleRequest::new("n1", 3 + n as u64, true),
        )
        .await
        .unwrap();
        // A charge no job claims: released when its hold ends (a refund).
        let held = ChargeRequest {
            deadline: Duration::from_millis(50),
            grace: Duration::from_millis(50),
            ..charge
        };
        l.charge(u, &rid("held"), &held).await.unwrap();
    }
    // "early" and "job" leave the window, "late" stays.
    b.pass(Duration::from_millis(700)).await;
    for u in &users {
        allowed(l.reserve(u, &rid("late"), 2).await.unwrap());
        l.settle(u, &rid("late"), 4).await.unwrap();
    }
    b.pass(Duration::from_millis(900)).await;
    for u in &users {
        let usage = l.usage(u).await.unwrap();
        let export = l.exported(u, 0, 100).await.unwrap();
        let kinds: Vec<_> = export.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                ChangeKind::Spend,
                ChangeKind::Spend,
                ChangeKind::Refund,
                ChangeKind::Spend,
                ChangeKind::Settle,
                ChangeKind::Spend,
                ChangeKind::Refund,
                ChangeKind::Spend,
                ChangeKind::Settle,
            ],
            "{export:?}"
        );
        assert!(export.windows(2).all(|w| w[0].at_ms() <= w[1].at_ms()));
        assert_eq!(export[3].operation.as_deref(), Some("llm.structured"));
        assert_eq!(
            (export[4].cost, export[4].previous_cost),
            (export[4].cost, Some(8))
        );
        let live = replay(&export, usage.now_ms, usage.window_ms);
        let expected: std::collections::BTreeMap<String, (u64, u64)> = usage
            .events
            .iter()
            .map(|e| (e.request_id.to_string(), (e.at_ms, e.cost)))
            .collect();
        assert_eq!(live, expected, "{u}");
        assert_eq!(live.values().map(|(_, c)| c).sum::<u64>(), usage.used);
        assert_eq!(usage.used, 4);
        // Read from a later time on: only the later changes.
        let since = export[7].at_ms();
        assert!(l.exported(u, since, 100).await.unwrap().len() >= 2);
    }
}

on_each_backend!(
    threads 4,
    [
        allows_up_to_the_limit_and_denies_past_it,
        retry_after_is_exact,
        retry_after_is_exact_past_a_slice,
        events_expire_as_time_passes,
        reserve_is_idempotent_per_request_id,
        refund_once_twice_and_unknown,
        zero_and_oversized_costs_are_errors,
        plans_default_and_per_user,
        settle_corrects_a_reservation,
        same_millisecond_requests_are_separate_events,
        users_are_independent,
        concurrent_reserves_never_overspend,
        usage_pages_walk_every_live_event_once,
        every_window_must_fit,
        refund_and_settle_move_every_window,
        plan_changes_keep_the_log,
        released_holds_leave_every_window,
        a_job_settles_its_charge_by_its_nonce,
        the_export_rebuilds_every_users_usage,
        settling_down_never_passes_a_limit,
        an_operator_refund_cancels_a_held_charge,
        a_plan_round_trip_erases_nothing,
        a_charge_records_the_acting_service_key,
        a_charge_answers_the_users_plan,
    ]
    memory => &super::MemoryBackend::new(),
    redis => &super::RedisBackend::start().await,
    cluster => &super::RedisBackend::cluster().await,
);
