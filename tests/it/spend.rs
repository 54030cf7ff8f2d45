//! Spend reports (`GET /admin/spend`) from the rollups the ledgers keep as
//! charges change: over 10,000 charges by 100 users on 5 models, with
//! releases, refunds and settles mixed in, every grouping and step equals
//! what the charges cost as they stand (the live events' sum, and the
//! outcomes the ledger answered), on memory, Redis and the cluster; on Redis
//! no command of the report holds the server past [`slowlog::WALK_US`].
//! A settle or refund lands in the hour its charge was made in (the embedded
//! ledger's clock moved hours on); bad parameters are 400s or 422s naming them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tollgate_api::state::ApiState;
use tollgate_core::clock::ManualClock;
use tollgate_core::config::Config;
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::ledger::{
    ChargeOutcome, ChargeRequest, EventPage, Ledger, RefundOutcome, SettleOutcome, SettleRequest,
};
use tollgate_core::spend::{Bucket, Dims, Step, DAY_MS, HOUR_MS};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_tests::clocked_redis::ClockedRedis;
use tollgate_tests::{random_prefix, slowlog, RedisServer, TestCluster};
use tower::ServiceExt;

use crate::api::{redis_state_with, settings, test_config_with, ADMIN};

const USERS: usize = 100;
const CALLS: usize = 10_000;
const MODELS: [&str; 5] = [
    "gpt-4o-mini*",
    "gpt-4o",
    "o1*",
    "claude-3-5-haiku*",
    "text-embedding-3-small",
];
const OPS: [&str; 3] = ["llm.structured", "embeddings", "company.research"];

fn config() -> Arc<Config> {
    test_config_with("[plans.spend]\nlimit = 1000000000\nwindow = \"1d\"\n")
}

struct Api {
    app: Router,
    state: ApiState,
    /// SLOWLOG's server (a plain Redis only).
    redis: Option<RedisServer>,
    _cluster: Option<TestCluster>,
}

impl Api {
    async fn memory() -> Self {
        let backends = tollgate_memory::backends(config());
        let state = ApiState::new(&backends, settings());
        Self::of(state, None, None)
    }

    async fn redis() -> Self {
        let server = RedisServer::start();
        let state = redis_state_with(&server.url(), &random_prefix(), settings(), config()).await;
        Self::of(state, Some(server), None)
    }

    async fn cluster() -> Self {
        let cluster = TestCluster::get();
        let state = redis_state_with(&cluster.url(), &random_prefix(), settings(), config()).await;
        Self::of(state, None, Some(cluster))
    }

    fn of(state: ApiState, redis: Option<RedisServer>, cluster: Option<TestCluster>) -> Self {
        Self {
            app: tollgate_api::router(state.clone()),
            state,
            redis,
            _cluster: cluster,
        }
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> (StatusCode, Value, String) {
        let mut req = Request::builder()
            .method("GET")
            .uri(path)
            .header("authorization", format!("Bearer {ADMIN}"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let response = tokio::time::timeout(
            Duration::from_secs(60),
            self.app.clone().oneshot(req.body(Body::empty()).unwrap()),
        )
        .await
        .expect("answer within 60s")
        .unwrap();
        let status = response.status();
        let kind = response
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, body, kind)
    }

    async fn create(&self, user: &str) {
        let req = Request::builder()
            .method("POST")
            .uri("/admin/users")
            .header("authorization", format!("Bearer {ADMIN}"))
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"user": user, "plan": "spend"}).to_string(),
            ))
            .unwrap();
        let r = self.app.clone().oneshot(req).await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }

    /// Every row of a report, following `next_cursor`: (key, start_ms) -> amount.
    async fn report(&self, query: &str) -> BTreeMap<(String, u64), u64> {
        let mut rows = BTreeMap::new();
        let mut cursor = String::new();
        loop {
            let path = format!("/admin/spend?{query}&cursor={}", urlencode(&cursor));
            let (status, body, _) = self.get(&path, &[]).await;
            assert_eq!(status, StatusCode::OK, "{path}: {body}");
            for r in body["rows"].as_array().unwrap() {
                let key = (
                    r["key"].as_str().unwrap().to_owned(),
                    r["start_ms"].as_u64().unwrap(),
                );
                assert!(
                    rows.insert(key, r["amount"].as_u64().unwrap()).is_none(),
                    "a row twice: {r}"
                );
            }
            match body["next_cursor"].as_str() {
                Some(c) => cursor = c.to_owned(),
                None => return rows,
            }
        }
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One charge as it stands: its user, dimensions, time, cost now.
#[derive(Debug, Clone)]
struct Charged {
    user: usize,
    model: &'static str,
    op: &'static str,
    at_ms: u64,
    cost: u64,
}

fn uid(i: usize) -> UserId {
    UserId::new(format!("sp-{i:03}")).unwrap()
}

fn charge_of(i: usize, nonce: &str) -> ChargeRequest<'_> {
    ChargeRequest {
        cost: 1 + (i as u64 * 7919) % 1000,
        nonce,
        operation: OPS[i % OPS.len()],
        model: MODELS[(i / USERS) % MODELS.len()],
        service_key: None,
        price: None,
        fingerprint: "f00d",
        deadline: Duration::from_secs(86_400),
        grace: Duration::from_secs(60),
    }
}

/// Call `i` of the load: charged; then one in ten released (its job failed),
/// one in ten refunded by an operator (held: cancelled), one in ten settled
/// down to a third, one in ten settled up (an estimate's operation).
async fn one_call(ledger: &dyn Ledger, i: usize) -> Charged {
    let user = uid(i % USERS);
    let nonce = format!("n{i}");
    let req = charge_of(i, &nonce);
    let request = RequestId::new(format!("call-{i}")).unwrap();
    let at_ms = match ledger.charge(&user, &request, &req).await.unwrap() {
        ChargeOutcome::Charged { allowed, .. } => allowed.at_ms,
        other => panic!("call {i}: {other:?}"),
    };
    let mut cost = req.cost;
    match i % 10 {
        0 => {
            let r = ledger.release(&user, &request, &nonce).await.unwrap();
            assert!(matches!(r, RefundOutcome::Refunded { .. }), "{r:?}");
            cost = 0;
        }
        1 => {
            let r = ledger.refund(&user, &request).await.unwrap();
            assert!(matches!(r, RefundOutcome::Cancelled { .. }), "{r:?}");
            cost = 0;
        }
        2 => {
            let to = (cost / 3).max(1);
            let r = ledger
                .settle_charge(&user, &request, &SettleRequest::new(&nonce, to, false))
                .await
                .unwrap();
            assert!(matches!(r, SettleOutcome::Settled { .. }), "{r:?}");
            cost = to;
        }
        3 => {
            let to = cost + 17;
            let r = ledger
                .settle_charge(&user, &request, &SettleRequest::new(&nonce, to, true))
                .await
                .unwrap();
            assert!(matches!(r, SettleOutcome::Settled { .. }), "{r:?}");
            cost = to;
        }
        _ => {}
    }
    Charged {
        user: i % USERS,
        model: MODELS[(i / USERS) % MODELS.len()],
        op: OPS[i % OPS.len()],
        at_ms,
        cost,
    }
}

/// The sum of the costs of the user's live events, page by page.
async fn live_sum(l: &dyn Ledger, u: &UserId) -> u64 {
    let mut page = EventPage::new(None, EventPage::MAX_LIMIT).unwrap();
    let mut sum = 0;
    loop {
        let usage = l.usage_page(u, page).await.unwrap();
        sum += usage.events.iter().map(|e| e.cost).sum::<u64>();
        match usage.next_cursor {
            Some(c) => page = page.next(c),
            None => return sum,
        }
    }
}

/// The expected rows of a grouping: (key, bucket start) -> amount.
fn expected(
    calls: &[Charged],
    step: u64,
    key: impl Fn(&Charged) -> String,
) -> BTreeMap<(String, u64), u64> {
    let mut out = BTreeMap::new();
    for c in calls.iter().filter(|c| c.cost > 0) {
        *out.entry((key(c), c.at_ms - c.at_ms % step)).or_default() += c.cost;
    }
    out
}

async fn reports_equal_the_charges(api: Api) {
    for u in 0..USERS {
        api.create(uid(u).as_str()).await;
    }
    let ledger = Arc::clone(&api.state.ledger);
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let calls: Vec<Charged> = futures_util::stream::iter(0..CALLS)
        .map(|i| {
            let ledger = Arc::clone(&ledger);
            async move { one_call(ledger.as_ref(), i).await }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let from = start - start % HOUR_MS - HOUR_MS;
    let to = from + 4 * HOUR_MS;
    let range = format!(
        "from={}&to={}",
        urlencode(&tollgate_core::clock::rfc3339(from)),
        urlencode(&tollgate_core::clock::rfc3339(to))
    );
    let day = format!(
        "from={}&step=1d",
        urlencode(&tollgate_core::clock::rfc3339(from - from % 86_400_000))
    );

    // The rows equal the charges as the ledger answered them.
    let provider = |op: &str| api.state.config.operation(op).unwrap().provider.clone();
    let watch = async |api: &Api| {
        if let Some(server) = &api.redis {
            let mut conn = tollgate_tests::bulk_connection(&server.url())
                .await
                .unwrap();
            slowlog::start(&mut conn, slowlog::WALK_US, 1024)
                .await
                .unwrap();
            Some(conn)
        } else {
            None
        }
    };
    let mut conn = watch(&api).await;
    let by_user = api
        .report(&format!("by=user&step=1h&limit=150&{range}"))
        .await;
    assert_eq!(
        by_user,
        expected(&calls, HOUR_MS, |c| uid(c.user).to_string())
    );
    let by_model = api
        .report(&format!("by=model&step=1h&limit=3&{range}"))
        .await;
    assert_eq!(by_model, expected(&calls, HOUR_MS, |c| c.model.to_owned()));
    let by_op = api.report(&format!("by=operation&{day}")).await;
    assert_eq!(by_op, expected(&calls, 86_400_000, |c| c.op.to_owned()));
    let by_provider = api.report(&format!("by=provider&step=1h&{range}")).await;
    assert_eq!(by_provider, expected(&calls, HOUR_MS, |c| provider(c.op)));
    let by_org = api.report(&format!("by=org&{day}")).await;
    assert_eq!(by_org, expected(&calls, 86_400_000, |_| String::new()));
    if let Some(conn) = conn.as_mut() {
        let (_, slow) = slowlog::over(conn, slowlog::WALK_US).await.unwrap();
        assert!(slow.is_empty(), "the reports held Redis: {slow}");
    }

    // ... and the live events' sum, user by user.
    let mut per_user: BTreeMap<String, u64> = BTreeMap::new();
    for ((u, _), amount) in &by_user {
        *per_user.entry(u.clone()).or_default() += amount;
    }
    for u in 0..USERS {
        let user = uid(u);
        let live = live_sum(ledger.as_ref(), &user).await;
        assert_eq!(
            per_user.get(user.as_str()).copied().unwrap_or(0),
            live,
            "{user}"
        );
    }

    // CSV, by format or Accept.
    let (status, body, kind) = api
        .get(&format!("/admin/spend?by=model&format=csv&{day}"), &[])
        .await;
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::OK, "text/csv; charset=utf-8")
    );
    let text = body.as_str().unwrap();
    assert!(text.starts_with("model,start,amount\n"), "{text}");
    assert_eq!(text.lines().count(), 1 + MODELS.len(), "{text}");
    let (_, _, kind) = api
        .get(
            &format!("/admin/spend?by=model&{day}"),
            &[("accept", "text/csv")],
        )
        .await;
    assert_eq!(kind, "text/csv; charset=utf-8");
}

/// Bad parameters are 400s (a value the OpenAPI schema refuses) or 422s (a
/// string the schema allows that names no time, a range backwards or too
/// long, a cursor not ours), naming the parameter; nothing is read.
async fn bad_parameters_are_400_naming_them(api: Api) {
    const BAD: StatusCode = StatusCode::BAD_REQUEST;
    const INVALID: StatusCode = StatusCode::UNPROCESSABLE_ENTITY;
    for (query, field, want) in [
        ("", "by", BAD),
        ("by=team", "by", BAD),
        ("by=user&step=5m", "step", BAD),
        ("by=user&from=yesterday", "from", INVALID),
        ("by=user&from=", "from", INVALID),
        ("by=user&to=2026-13-01", "to", INVALID),
        ("by=user&from=2026-02-01&to=2026-01-01", "to", INVALID),
        (
            "by=user&step=1h&from=2020-01-01&to=2026-01-01",
            "from",
            INVALID,
        ),
        ("by=user&limit=0", "limit", BAD),
        ("by=user&limit=1000000", "limit", BAD),
        ("by=user&cursor=r:1:x", "cursor", INVALID),
        ("by=model&cursor=garbage", "cursor", INVALID),
        ("by=model&format=xml", "format", BAD),
    ] {
        let (status, body, _) = api.get(&format!("/admin/spend?{query}"), &[]).await;
        assert_eq!(status, want, "{query}: {body}");
        assert_eq!(body["field"], field, "{query}: {body}");
    }
    let req = Request::builder()
        .uri("/admin/spend?by=user")
        .body(Body::empty())
        .unwrap();
    let r = api.app.clone().oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

/// A user moving into an organisation and out again keeps its report: the
/// rollups travel with its events (on Redis, from one hash tag to another),
/// and a refund of a charge made before a move still comes off the bucket
/// it was counted in.
async fn a_move_carries_the_rollups(api: Api) {
    let u = uid(7);
    api.create(u.as_str()).await;
    let ledger = Arc::clone(&api.state.ledger);
    let org = tollgate_core::id::OrgId::new("spend-org").unwrap();
    ledger.set_org_plan(&org, "spend").await.unwrap();
    // Calls 7, 107, ..: user 7's; one in ten of them released, refunded or
    // settled as `one_call` does.
    let mut calls = Vec::new();
    for k in 0..12 {
        calls.push(one_call(ledger.as_ref(), 7 + k * USERS).await);
    }
    let by_user = |rows: BTreeMap<(String, u64), u64>| -> u64 { rows.values().sum() };
    let q = "by=user&step=1d";
    let before = by_user(api.report(q).await);
    assert_eq!(before, calls.iter().map(|c| c.cost).sum::<u64>());
    assert_eq!(before, live_sum(ledger.as_ref(), &u).await);

    ledger.set_user_org(&u, Some(&org)).await.unwrap();
    assert_eq!(
        by_user(api.report(q).await),
        before,
        "the report after a move"
    );
    // Call 407 (k = 4: kept whole) was charged before the move: refunded
    // after it, it comes off the report.
    let k4 = RequestId::new(format!("call-{}", 7 + 4 * USERS)).unwrap();
    let r = ledger.refund(&u, &k4).await.unwrap();
    assert!(
        matches!(
            r,
            RefundOutcome::Cancelled { .. } | RefundOutcome::Refunded { .. }
        ),
        "{r:?}"
    );
    let after = before - calls[4].cost;
    assert_eq!(by_user(api.report(q).await), after);
    let more = one_call(ledger.as_ref(), 7 + 12 * USERS).await;
    ledger.set_user_org(&u, None).await.unwrap();
    assert_eq!(
        by_user(api.report(q).await),
        after + more.cost,
        "and out again"
    );
    assert_eq!(after + more.cost, live_sum(ledger.as_ref(), &u).await);
}

on_each_backend!(threads 4, [reports_equal_the_charges, bad_parameters_are_400_naming_them, a_move_carries_the_rollups]
    memory => super::Api::memory().await,
    redis => super::Api::redis().await,
    cluster => super::Api::cluster().await,
);

/// The embedded ledger on a clock moved hours on: a release, a settle and an
/// operator's correction of a charge land in the hour (and day) it was made
/// in, not the hour they come in; buckets past their keep are gone.
#[tokio::test]
async fn changes_land_in_the_hour_of_their_charge() {
    let t0 = 1_796_029_200_000; // 2026-11-30T09:00Z
    let clock = Arc::new(ManualClock::new(t0 + 60_000));
    let ledger = MemoryLedger::with_clock(config(), Arc::clone(&clock));
    let u = uid(1);
    ledger.set_plan(&u, "spend").await.unwrap();
    let hour = |h: u64| t0 + h * HOUR_MS;
    for (i, nonce) in [(1, "na"), (2, "nb"), (3, "nc")] {
        ledger
            .charge(
                &u,
                &RequestId::new(format!("r{i}")).unwrap(),
                &charge_of(i, nonce),
            )
            .await
            .unwrap();
    }
    let cost = |i| charge_of(i, "").cost;
    clock.advance(Duration::from_millis(2 * HOUR_MS));
    // Hour 11: a release, a settle down, an operator's correction up.
    ledger
        .release(&u, &RequestId::new("r1").unwrap(), "na")
        .await
        .unwrap();
    ledger
        .settle_charge(
            &u,
            &RequestId::new("r2").unwrap(),
            &SettleRequest::new("nb", 5, false),
        )
        .await
        .unwrap();
    ledger
        .settle(&u, &RequestId::new("r3").unwrap(), cost(3) + 100)
        .await
        .unwrap();
    let hours = ledger
        .spend(&u, Step::Hour, hour(0), hour(3))
        .await
        .unwrap();
    let total = |b: &[Bucket]| b.iter().map(|b| b.amount).sum::<u64>();
    assert!(hours.iter().all(|b| b.start_ms == hour(0)), "{hours:?}");
    assert_eq!(total(&hours), 5 + cost(3) + 100);
    let days = ledger
        .spend(&u, Step::Day, hour(0) - 9 * HOUR_MS, hour(24))
        .await
        .unwrap();
    assert_eq!(total(&days), 5 + cost(3) + 100);
    // Each charge under its operation, the operation's provider, its entry.
    let dims: Vec<&Dims> = hours.iter().map(|b| &b.dims).collect();
    assert!(
        dims.iter().all(|d| OPS.contains(&d.operation.as_str())
            && MODELS.contains(&d.model.as_str())
            && !d.provider.is_empty()
            && d.org.is_empty()),
        "{dims:?}"
    );
    // Past the 48 hours hourly buckets are kept: gone; the day stays.
    clock.advance(Duration::from_millis(48 * HOUR_MS));
    assert_eq!(
        ledger
            .spend(&u, Step::Hour, hour(0), hour(3))
            .await
            .unwrap(),
        vec![]
    );
    let days = ledger
        .spend(&u, Step::Day, hour(0) - 9 * HOUR_MS, hour(24))
        .await
        .unwrap();
    assert_eq!(total(&days), 5 + cost(3) + 100);
}

/// An idle user's last hours are still in its daily report long past the
/// hourly keep (on Redis a charge adds to its hour only, and the hours of a
/// day fold into the day with the user's next charge of a later day: they
/// must outlive the 48 hours until then), and the charge that folds them
/// counts nothing twice.
async fn idle_hours_stay_in_the_days(redis: bool) {
    let t0 = 1_796_076_000_000; // 2026-11-30T22:00Z
    let u = uid(7);
    let mut clock_redis = None;
    let mut manual = None;
    let ledger: Arc<dyn Ledger> = if redis {
        let clock = ClockedRedis::start(t0 + 60_000);
        let ledger = tollgate_tests::redis_ledger(&clock.url(), &random_prefix(), config()).await;
        clock_redis = Some(clock);
        Arc::new(ledger)
    } else {
        let clock = Arc::new(ManualClock::new(t0 + 60_000));
        manual = Some(Arc::clone(&clock));
        Arc::new(MemoryLedger::with_clock(config(), clock))
    };
    ledger.set_plan(&u, "spend").await.unwrap();
    let mut spent = 0;
    for i in 1..=3 {
        let req = charge_of(i, "idle");
        spent += req.cost;
        let request = RequestId::new(format!("idle-{i}")).unwrap();
        let r = ledger.charge(&u, &request, &req).await.unwrap();
        assert!(matches!(r, ChargeOutcome::Charged { .. }), "{r:?}");
    }
    let day0 = t0 - t0 % DAY_MS;
    let days = |l: Arc<dyn Ledger>| async move {
        let mut by_day = BTreeMap::new();
        for b in l
            .spend(&uid(7), Step::Day, day0, day0 + 4 * DAY_MS)
            .await
            .unwrap()
        {
            *by_day.entry(b.start_ms).or_insert(0) += b.amount;
        }
        by_day
    };
    assert_eq!(days(ledger.clone()).await, BTreeMap::from([(day0, spent)]));
    // 50 hours idle: past the hourly keep (48 h).
    let later = t0 + 50 * HOUR_MS;
    if let Some(clock) = &clock_redis {
        tokio::task::block_in_place(|| clock.set(later));
        for _ in 0..20 {
            if ledger.plan(&u).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    if let Some(clock) = &manual {
        clock.advance(Duration::from_millis(later - t0 - 60_000));
    }
    assert_eq!(days(ledger.clone()).await, BTreeMap::from([(day0, spent)]));
    // The next charge (a later day): the idle day is folded, counted once.
    let req = charge_of(4, "idle");
    let r = ledger
        .charge(&u, &RequestId::new("idle-4").unwrap(), &req)
        .await
        .unwrap();
    assert!(matches!(r, ChargeOutcome::Charged { .. }), "{r:?}");
    let day2 = later - later % DAY_MS;
    assert_eq!(
        days(ledger.clone()).await,
        BTreeMap::from([(day0, spent), (day2, req.cost)])
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_hours_stay_in_the_days_memory() {
    idle_hours_stay_in_the_days(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_hours_stay_in_the_days_redis() {
    idle_hours_stay_in_the_days(true).await;
}

/// Changes to a charge of a day before today land in that day, whether its
/// hours were folded into the day yet (a settle after the user's next
/// charge: the day's bucket and the hour's) or not (a release before it).
async fn changes_after_midnight_land_in_their_day(redis: bool) {
    // 22:50 UTC yesterday: the Redis report keeps hours by the real clock.
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let t0 = real - real % DAY_MS - DAY_MS + 22 * HOUR_MS + 50 * 60_000;
    let u = uid(8);
    let mut clock_redis = None;
    let mut manual = None;
    let ledger: Arc<dyn Ledger> = if redis {
        let clock = ClockedRedis::start(t0);
        let ledger = tollgate_tests::redis_ledger(&clock.url(), &random_prefix(), config()).await;
        clock_redis = Some(clock);
        Arc::new(ledger)
    } else {
        let clock = Arc::new(ManualClock::new(t0));
        manual = Some(Arc::clone(&clock));
        Arc::new(MemoryLedger::with_clock(config(), clock))
    };
    ledger.set_plan(&u, "spend").await.unwrap();
    let mut cost = BTreeMap::new();
    for i in 1..=2 {
        let req = charge_of(i, "mid");
        cost.insert(i, req.cost);
        let request = RequestId::new(format!("mid-{i}")).unwrap();
        let r = ledger.charge(&u, &request, &req).await.unwrap();
        assert!(matches!(r, ChargeOutcome::Charged { .. }), "{r:?}");
    }
    let day0 = t0 - t0 % DAY_MS;
    let day1 = day0 + DAY_MS;
    let report = |l: Arc<dyn Ledger>, step: Step, from: u64, to: u64| async move {
        let mut by = BTreeMap::new();
        for b in l.spend(&uid(8), step, from, to).await.unwrap() {
            *by.entry(b.start_ms).or_insert(0) += b.amount;
        }
        by
    };
    // 01:00 the next day: a release of call 1 before any charge of the day.
    let at = day1 + HOUR_MS;
    if let Some(clock) = &clock_redis {
        tokio::task::block_in_place(|| clock.set(at));
        for _ in 0..20 {
            if ledger.plan(&u).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    if let Some(clock) = &manual {
        clock.advance(Duration::from_millis(at - t0));
    }
    let r = ledger
        .release(&u, &RequestId::new("mid-1").unwrap(), "mid")
        .await
        .unwrap();
    assert!(matches!(r, RefundOutcome::Refunded { .. }), "{r:?}");
    // A charge of the new day (it folds day 0), then call 2 settled up.
    let req = charge_of(3, "mid");
    let r = ledger
        .charge(&u, &RequestId::new("mid-3").unwrap(), &req)
        .await
        .unwrap();
    assert!(matches!(r, ChargeOutcome::Charged { .. }), "{r:?}");
    let to = cost[&2] + 100;
    let r = ledger
        .settle_charge(
            &u,
            &RequestId::new("mid-2").unwrap(),
            &SettleRequest::new("mid", to, true),
        )
        .await
        .unwrap();
    assert!(matches!(r, SettleOutcome::Settled { .. }), "{r:?}");
    assert_eq!(
        report(ledger.clone(), Step::Day, day0, day1 + DAY_MS).await,
        BTreeMap::from([(day0, to), (day1, req.cost)])
    );
    let hours = report(
        ledger.clone(),
        Step::Hour,
        day0 + 22 * HOUR_MS,
        day1 + 2 * HOUR_MS,
    )
    .await;
    assert_eq!(
        hours,
        BTreeMap::from([(day0 + 22 * HOUR_MS, to), (day1 + HOUR_MS, req.cost)])
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn changes_after_midnight_land_in_their_day_memory() {
    changes_after_midnight_land_in_their_day(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn changes_after_midnight_land_in_their_day_redis() {
    changes_after_midnight_land_in_their_day(true).await;
}
