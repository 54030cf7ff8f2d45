//! Organisations: a member's charge must fit its own windows and its
//! organisation's, in one atomic step, and leaves both together; moving a
//! user between organisations moves its live events without losing or
//! doubling any. The same cases on the memory backend, one Redis and the
//! suite's Redis Cluster.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    clock::ManualClock,
    config::{Config, Limit},
    id::{OrgId, RequestId, UserId},
    ledger::{
        ChargeRequest, ClaimOutcome, ClaimRequest, Ledger, LedgerError, ReserveOutcome, Scope,
        SettleRequest,
    },
};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_redis::ledger::RedisLedger;
use tollgate_tests::{random_prefix, RedisServer, TestCluster};

use crate::ledger::{allowed, denied};

const WINDOW: Duration = Duration::from_millis(1500);

const CONFIG: &str = r#"
default_plan = "small"
[plans.small]
limit = 10
window = "1500ms"
[plans.team]
limit = 15
window = "1500ms"
[plans.wide]
limit = 1000
window = "1500ms"
[plans.multi]
limits = [{ limit = 12, window = "3s" }, { limit = 8, window = "1s" }]
[plans.user100]
limit = 100
window = "12h"
[plans.org300]
limit = 300
window = "12h"
[plans.huge]
limit = 100000000
window = "12h"
"#;

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "orgs").expect("test config"))
}

fn user(s: &str) -> UserId {
    UserId::new(s).expect("user id")
}

fn org(s: &str) -> OrgId {
    OrgId::new(s).expect("org id")
}

fn rid(s: &str) -> RequestId {
    RequestId::new(s).expect("request id")
}

trait Backend: Send + Sync {
    /// A ledger of one "pod": each Redis one has its own pool and its own
    /// cache of where users live.
    fn pod(&self) -> impl std::future::Future<Output = Arc<dyn Ledger>> + Send;
    fn pass(&self, d: Duration) -> impl std::future::Future<Output = ()> + Send;
}

struct Memory {
    clock: Arc<ManualClock>,
    ledger: Arc<MemoryLedger<Arc<ManualClock>>>,
}

impl Memory {
    fn new() -> Self {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let ledger = Arc::new(MemoryLedger::with_clock(config(), Arc::clone(&clock)));
        Self { clock, ledger }
    }
}

impl Backend for Memory {
    async fn pod(&self) -> Arc<dyn Ledger> {
        self.ledger.clone()
    }
    async fn pass(&self, d: Duration) {
        self.clock.advance(d);
    }
}

struct Redis {
    url: String,
    prefix: String,
    _server: Option<RedisServer>,
    _cluster: Option<TestCluster>,
}

impl Redis {
    fn start() -> Self {
        let server = RedisServer::start();
        Self {
            url: server.url(),
            prefix: random_prefix(),
            _server: Some(server),
            _cluster: None,
        }
    }

    fn cluster() -> Self {
        let cluster = TestCluster::get();
        Self {
            url: cluster.url(),
            prefix: random_prefix(),
            _server: None,
            _cluster: Some(cluster),
        }
    }

    async fn ledger(&self) -> RedisLedger {
        tollgate_tests::redis_ledger(&self.url, &self.prefix, config()).await
    }
}

impl Backend for Redis {
    async fn pod(&self) -> Arc<dyn Ledger> {
        Arc::new(self.ledger().await)
    }
    async fn pass(&self, d: Duration) {
        tokio::time::sleep(d + Duration::from_millis(5)).await;
    }
}

/// The organisation's tokens used in its longest window.
async fn org_used(l: &dyn Ledger, o: &OrgId) -> u64 {
    l.org_usage(o, None, 100).await.unwrap().windows[0].used
}

async fn used(l: &dyn Ledger, u: &UserId) -> u64 {
    l.usage(u).await.unwrap().windows[0].used
}

fn charge(cost: u64, nonce: &str) -> ChargeRequest<'_> {
    ChargeRequest {
        cost,
        nonce,
        operation: "llm.structured",
        model: "",
        service_key: None,
        fingerprint: "f00d",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(5),
        price: None,
    }
}

/// A member's charge must fit its organisation too: a refusal by the
/// organisation's limit while the user's has room says so (scope), with the
/// exact wait; usage shows both levels.
async fn the_organisation_binds_its_members(b: &impl Backend) {
    let l = b.pod().await;
    let (a, bb, o) = (user("alice"), user("bob"), org("acme"));
    l.set_org_plan(&o, "team").await.unwrap();
    l.set_user_org(&a, Some(&o)).await.unwrap();
    l.set_user_org(&bb, Some(&o)).await.unwrap();
    assert_eq!(l.user_org(&a).await.unwrap(), Some(o.clone()));
    allowed(l.reserve(&a, &rid("a1"), 10).await.unwrap());
    // Bob has room (0 of 10), the organisation has 5 of 15 left.
    let d = denied(l.reserve(&bb, &rid("b1"), 8).await.unwrap());
    assert_eq!(d.scope, Scope::Organisation);
    assert_eq!((d.used, d.limit, d.remaining), (10, 15, 5));
    assert!(d.retry_after_ms > 0 && d.retry_after_ms <= 1500, "{d:?}");
    let org_view = d.organisation.expect("the organisation's windows");
    assert_eq!(org_view.org, o);
    assert_eq!(d.windows[0].used, 0, "bob's own window");
    // A denial by the user's own limit says `user`.
    let d = denied(l.reserve(&a, &rid("a2"), 1).await.unwrap());
    assert_eq!(d.scope, Scope::User);
    allowed(l.reserve(&bb, &rid("b2"), 5).await.unwrap());
    // Idempotent: the same id charges neither level again.
    assert!(allowed(l.reserve(&bb, &rid("b2"), 5).await.unwrap()).duplicate);
    let u = l.usage(&bb).await.unwrap();
    assert_eq!(u.windows[0].used, 5);
    let ou = u
        .organisation
        .expect("a member's usage shows its organisation");
    assert_eq!(
        (ou.org.as_str(), ou.plan.as_str(), ou.windows[0].used),
        ("acme", "team", 15)
    );
    assert_eq!(org_used(l.as_ref(), &o).await, 15);
    // A cost above the organisation's smallest limit can never fit.
    l.set_plan(&a, "wide").await.unwrap();
    assert!(matches!(
        l.reserve(&a, &rid("a3"), 16).await,
        Err(LedgerError::CostExceedsLimit {
            cost: 16,
            limit: 15
        })
    ));
    b.pass(WINDOW).await;
    assert_eq!(org_used(l.as_ref(), &o).await, 0);
    allowed(l.reserve(&bb, &rid("b3"), 8).await.unwrap());
    assert_eq!(org_used(l.as_ref(), &o).await, 8);
}

/// Refund, settle (down and up), a job's charge, claim and release apply to
/// both levels together.
async fn every_step_applies_to_both_levels(b: &impl Backend) {
    let l = b.pod().await;
    let (a, o) = (user("carol"), org("globex"));
    l.set_org_plan(&o, "team").await.unwrap();
    l.set_user_org(&a, Some(&o)).await.unwrap();
    allowed(l.reserve(&a, &rid("r1"), 4).await.unwrap());
    assert_eq!(org_used(l.as_ref(), &o).await, 4);
    l.settle(&a, &rid("r1"), 2).await.unwrap();
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o).await),
        (2, 2)
    );
    l.settle(&a, &rid("r1"), 3).await.unwrap();
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o).await),
        (3, 3)
    );
    l.refund(&a, &rid("r1")).await.unwrap();
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o).await),
        (0, 0)
    );
    // A job's charge: held, claimed, settled, released.
    // It answers the member's own plan (the default), not its organisation's.
    let c = l.charge(&a, &rid("j1"), &charge(6, "n1")).await.unwrap();
    assert!(
        matches!(c, tollgate_core::ledger::ChargeOutcome::Charged { ref plan, .. } if plan == "small"),
        "{c:?}"
    );
    assert_eq!(org_used(l.as_ref(), &o).await, 6);
    let hold = u64::MAX / 2;
    assert_eq!(
        l.claim(&a, &rid("j1"), &ClaimRequest::new("n1", hold))
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    l.settle_charge(&a, &rid("j1"), &SettleRequest::new("n1", 5, false))
        .await
        .unwrap();
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o).await),
        (5, 5)
    );
    l.release(&a, &rid("j1"), "n1").await.unwrap();
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o).await),
        (0, 0)
    );
    // A charge the organisation cannot take is refused whole.
    let other = user("dave");
    l.set_user_org(&other, Some(&o)).await.unwrap();
    allowed(l.reserve(&other, &rid("d1"), 10).await.unwrap());
    let c = l.charge(&a, &rid("j2"), &charge(6, "n2")).await.unwrap();
    match c {
        tollgate_core::ledger::ChargeOutcome::Denied(d) => assert_eq!(d.scope, Scope::Organisation),
        other => panic!("expected a denial, got {other:?}"),
    }
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o).await),
        (0, 10)
    );
    // Several windows: the organisation's shorter one binds too.
    let (m, om) = (user("erin"), org("multi-co"));
    l.set_org_plan(&om, "multi").await.unwrap();
    l.set_plan(&m, "wide").await.unwrap();
    l.set_user_org(&m, Some(&om)).await.unwrap();
    allowed(l.reserve(&m, &rid("m1"), 8).await.unwrap());
    let d = denied(l.reserve(&m, &rid("m2"), 1).await.unwrap());
    assert_eq!((d.scope, d.window_ms), (Scope::Organisation, 1000));
}

/// Bad names: an organisation never created, a plan not configured.
async fn unknown_organisations_and_plans_are_errors(b: &impl Backend) {
    let l = b.pod().await;
    let (a, o) = (user("frank"), org("nowhere"));
    assert!(matches!(
        l.set_user_org(&a, Some(&o)).await,
        Err(LedgerError::UnknownOrg(_))
    ));
    assert!(matches!(
        l.org_usage(&o, None, 10).await,
        Err(LedgerError::UnknownOrg(_))
    ));
    assert!(matches!(
        l.set_org_plan(&o, "platinum").await,
        Err(LedgerError::UnknownPlan { .. })
    ));
    assert_eq!(l.user_org(&a).await.unwrap(), None);
    // Leaving no organisation is a no-op.
    assert_eq!(l.set_user_org(&a, None).await.unwrap().org, None);
}

/// Moving a user takes its live events (and held charges) with it: the old
/// organisation gives them back, the new one counts them, each still
/// leaving each window at the time it was spent.
async fn moving_a_user_moves_its_events(b: &impl Backend) {
    let l = b.pod().await;
    let (a, other, o1, o2) = (user("gina"), user("hank"), org("one"), org("two"));
    l.set_org_plan(&o1, "wide").await.unwrap();
    l.set_org_plan(&o2, "wide").await.unwrap();
    l.set_plan(&a, "wide").await.unwrap();
    l.set_user_org(&other, Some(&o2)).await.unwrap();
    for i in 0..3 {
        allowed(l.reserve(&a, &rid(&format!("g{i}")), 2).await.unwrap());
    }
    let c = l.charge(&a, &rid("gj"), &charge(4, "gn")).await.unwrap();
    assert!(matches!(
        c,
        tollgate_core::ledger::ChargeOutcome::Charged { .. }
    ));
    let m = l.set_user_org(&a, Some(&o1)).await.unwrap();
    assert_eq!((m.org.as_ref(), m.events), (Some(&o1), 4));
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o1).await),
        (10, 10)
    );
    // Again: nothing more moves.
    assert_eq!(l.set_user_org(&a, Some(&o1)).await.unwrap().events, 0);
    b.pass(Duration::from_millis(700)).await;
    // The other organisation spends after gina's events: they move in
    // behind its later one.
    allowed(l.reserve(&other, &rid("h1"), 1).await.unwrap());
    let m = l.set_user_org(&a, Some(&o2)).await.unwrap();
    assert_eq!(m.events, 4);
    assert_eq!(org_used(l.as_ref(), &o1).await, 0);
    assert_eq!(org_used(l.as_ref(), &o2).await, 11);
    // The job's charge moved with its owner record: its claim finds it.
    assert_eq!(
        l.claim(&a, &rid("gj"), &ClaimRequest::new("gn", u64::MAX / 2))
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    let ids: HashSet<String> = tollgate_tests::all_events(l.as_ref(), &a)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.request_id.to_string())
        .collect();
    assert_eq!(ids, ["g0", "g1", "g2", "gj"].map(String::from).into());
    // Gina's events leave the window when they were spent, not when they
    // moved: only hank's is left in the organisation's window.
    b.pass(Duration::from_millis(850)).await;
    assert_eq!(org_used(l.as_ref(), &o2).await, 1);
    assert_eq!(used(l.as_ref(), &a).await, 0);
    // Out of every organisation, and the plan moved along.
    allowed(l.reserve(&a, &rid("g9"), 600).await.unwrap());
    // Every live event moves, those only the retention still keeps too.
    assert_eq!(l.set_user_org(&a, None).await.unwrap().events, 5);
    assert_eq!(l.user_org(&a).await.unwrap(), None);
    assert_eq!(l.plan(&a).await.unwrap(), "wide");
    assert_eq!(
        (used(l.as_ref(), &a).await, org_used(l.as_ref(), &o2).await),
        (600, 1)
    );
    assert!(l.usage(&a).await.unwrap().organisation.is_none());
}

/// The admin views: organisations and members, a page at a time.
async fn organisations_and_members_page(b: &impl Backend) {
    let l = b.pod().await;
    for name in ["o-a", "o-b", "o-c"] {
        l.set_org_plan(&org(name), "team").await.unwrap();
    }
    let first = l.orgs(None, 2).await.unwrap();
    assert_eq!(first.orgs, vec![org("o-a"), org("o-b")]);
    assert_eq!(first.next, Some(org("o-b")));
    let rest = l.orgs(first.next.as_ref(), 2).await.unwrap();
    assert_eq!((rest.orgs, rest.next), (vec![org("o-c")], None));
    for u in ["m1", "m2", "m3"] {
        l.set_user_org(&user(u), Some(&org("o-b"))).await.unwrap();
    }
    l.set_user_org(&user("m2"), Some(&org("o-c")))
        .await
        .unwrap();
    let v = l.org_usage(&org("o-b"), None, 1).await.unwrap();
    assert_eq!(
        (v.plan.as_str(), v.members.clone(), v.next_member.clone()),
        ("team", vec![user("m1")], Some(user("m1")))
    );
    let v = l
        .org_usage(&org("o-b"), v.next_member.as_ref(), 5)
        .await
        .unwrap();
    assert_eq!((v.members, v.next_member), (vec![user("m3")], None));
    assert_eq!(
        l.org_usage(&org("o-c"), None, 5).await.unwrap().members,
        vec![user("m2")]
    );
}

/// 2 organisations x 4 users x 2 pods: 16 tasks reserving until denied.
/// No user passes its 100, no organisation its 300; each organisation ends
/// at exactly 300 (its limit binds: 4 x 100 > 300). One pod's cache of where
/// the users live is stale (read before they joined): its calls land at the
/// old place first, are told the user moved, and follow.
async fn sixteen_way_race_never_passes_either_level(b: &impl Backend) {
    let pods = [b.pod().await, b.pod().await];
    let orgs = [org("race-a"), org("race-b")];
    let users: Vec<(usize, UserId)> = (0..2)
        .flat_map(|o| (0..4).map(move |u| (o, user(&format!("racer-{o}-{u}")))))
        .collect();
    for (_, u) in &users {
        pods[1].set_plan(u, "user100").await.unwrap();
        pods[1].usage(u).await.unwrap();
    }
    for o in &orgs {
        pods[0].set_org_plan(o, "org300").await.unwrap();
    }
    for (o, u) in &users {
        pods[0].set_user_org(u, Some(&orgs[*o])).await.unwrap();
    }
    let mut tasks = Vec::new();
    for (o, u) in users.iter().cloned() {
        for (p, pod) in pods.iter().enumerate() {
            let pod = Arc::clone(pod);
            let u = u.clone();
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0u64;
                let mut i = 0;
                loop {
                    i += 1;
                    // Mixed costs first; then single tokens until refused,
                    // so the last refusal means this level is full.
                    let cost = if i < 40 { 1 + (i % 3) } else { 1 };
                    let id = rid(&format!("{u}-{p}-{i}"));
                    match pod.reserve(&u, &id, cost).await.unwrap() {
                        ReserveOutcome::Allowed(_) => admitted += cost,
                        ReserveOutcome::Denied(_) if cost == 1 => break,
                        ReserveOutcome::Denied(_) => {}
                    }
                }
                (o, u, admitted)
            }));
        }
    }
    let mut per_user: BTreeMap<UserId, u64> = BTreeMap::new();
    let mut per_org = [0u64; 2];
    for t in tasks {
        let (o, u, admitted) = t.await.unwrap();
        *per_user.entry(u).or_default() += admitted;
        per_org[o] += admitted;
    }
    for (o, name) in orgs.iter().enumerate() {
        assert_eq!(
            per_org[o], 300,
            "organisation {name} admitted exactly its limit"
        );
        assert_eq!(org_used(pods[0].as_ref(), name).await, 300);
    }
    for (u, admitted) in per_user {
        assert!(admitted <= 100, "{u} admitted {admitted}");
        assert_eq!(used(pods[1].as_ref(), &u).await, admitted);
        let events = tollgate_tests::all_events(pods[0].as_ref(), &u)
            .await
            .unwrap();
        assert_eq!(events.iter().map(|e| e.cost).sum::<u64>(), admitted);
    }
}

/// Users move between organisations while 8 tasks reserve and refund for
/// them: afterwards every admitted, unrefunded request id is live exactly
/// once, at the user's place, and every organisation's total is its
/// members' sum.
async fn moving_users_mid_load_loses_and_doubles_nothing(b: &impl Backend) {
    let pods = [b.pod().await, b.pod().await];
    let orgs = [org("mv-a"), org("mv-b")];
    for o in &orgs {
        pods[0].set_org_plan(o, "huge").await.unwrap();
    }
    let users: Vec<UserId> = (0..4).map(|i| user(&format!("mover-{i}"))).collect();
    for u in &users {
        pods[0].set_plan(u, "huge").await.unwrap();
        pods[0].set_user_org(u, Some(&orgs[0])).await.unwrap();
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (k, u) in users.iter().cloned().enumerate() {
        for (p, pod) in pods.iter().enumerate() {
            let pod = Arc::clone(pod);
            let (u, stop) = (u.clone(), Arc::clone(&stop));
            tasks.push(tokio::spawn(async move {
                let mut live: BTreeMap<String, u64> = BTreeMap::new();
                let mut i = 0u64;
                while (!stop.load(std::sync::atomic::Ordering::Relaxed) || i < 20) && i < 3000 {
                    i += 1;
                    let id = format!("{u}-{p}-{i}");
                    let cost = 1 + (i + k as u64) % 4;
                    if i.is_multiple_of(3) {
                        let nonce = format!("n{p}x{i}");
                        let c = pod
                            .charge(&u, &rid(&id), &charge(cost, &nonce))
                            .await
                            .unwrap();
                        assert!(
                            matches!(c, tollgate_core::ledger::ChargeOutcome::Charged { .. }),
                            "{c:?}"
                        );
                        live.insert(id.clone(), cost);
                        if i.is_multiple_of(2) {
                            pod.release(&u, &rid(&id), &nonce).await.unwrap();
                            live.remove(&id);
                        }
                    } else {
                        allowed(pod.reserve(&u, &rid(&id), cost).await.unwrap());
                        live.insert(id.clone(), cost);
                        if i.is_multiple_of(5) {
                            pod.refund(&u, &rid(&id)).await.unwrap();
                            live.remove(&id);
                        }
                    }
                }
                (u, live)
            }));
        }
    }
    // The moves: each user round the two organisations and out, twice.
    let targets = [
        Some(&orgs[1]),
        None,
        Some(&orgs[0]),
        Some(&orgs[1]),
        Some(&orgs[0]),
    ];
    for t in targets {
        for u in &users {
            pods[0].set_user_org(u, t).await.unwrap();
        }
        b.pass(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut expected: BTreeMap<UserId, BTreeMap<String, u64>> = BTreeMap::new();
    for t in tasks {
        let (u, live) = t.await.unwrap();
        expected.entry(u).or_default().extend(live);
    }
    let mut org_sum = 0;
    for (u, live) in &expected {
        let events = tollgate_tests::all_events(pods[1].as_ref(), u)
            .await
            .unwrap();
        let got: BTreeMap<String, u64> = events
            .iter()
            .map(|e| (e.request_id.to_string(), e.cost))
            .collect();
        assert_eq!(got.len(), events.len(), "{u}: a request id twice");
        assert_eq!(&got, live, "{u}: the live events");
        assert_eq!(used(pods[1].as_ref(), u).await, live.values().sum::<u64>());
        org_sum += live.values().sum::<u64>();
    }
    assert_eq!(org_used(pods[0].as_ref(), &orgs[0]).await, org_sum);
    assert_eq!(org_used(pods[0].as_ref(), &orgs[1]).await, 0);
}

/// A move stopped between its steps (the mover died after the destination
/// took a batch, before the source dropped it): meanwhile the user's calls
/// wait (the source is frozen) and the batch counts at both organisations
/// (never an overspend); the next call of the same move finishes it, adding
/// nothing twice, and the waiting call then lands at the new place.
async fn an_interrupted_move_finishes_on_the_next_call(b: &Redis) {
    use tollgate_redis::{call, scripts};
    let l = b.ledger().await;
    let other_pod = b.pod().await;
    let (u, v, o1, o2) = (user("ivy"), user("jack"), org("from"), org("to"));
    for o in [&o1, &o2] {
        l.set_org_plan(o, "wide").await.unwrap();
    }
    l.set_plan(&u, "wide").await.unwrap();
    l.set_user_org(&u, Some(&o1)).await.unwrap();
    l.set_user_org(&v, Some(&o1)).await.unwrap();
    for i in 0..5 {
        allowed(
            other_pod
                .reserve(&u, &rid(&format!("i{i}")), 2)
                .await
                .unwrap(),
        );
    }
    allowed(l.reserve(&v, &rid("j0"), 2).await.unwrap());
    let plans = scripts::PlanArgs::new(&config()).without_export();
    let (from, to) = (
        l.keys().location(&u, Some(&o1)),
        l.keys().location(&u, Some(&o2)),
    );
    let t = Duration::from_secs(5);
    let step = |inv: tollgate_redis::scripts::FunctionCall| {
        let pool = l.pool().clone();
        async move {
            call::function::<::redis::Value>(&pool, t, "move_out", &inv)
                .await
                .unwrap()
        }
    };
    step(scripts::move_freeze(&from, "o:to", &plans)).await;
    // Frozen: the user's calls wait for the move.
    let waiting = {
        let pod = Arc::clone(&other_pod);
        let u = u.clone();
        tokio::spawn(async move { pod.reserve(&u, &rid("i5"), 2).await })
    };
    let batch = step(scripts::move_batch(&from, 50, &plans)).await;
    let ::redis::Value::Array(parts) = batch else {
        panic!("batch: {batch:?}")
    };
    let fields: Vec<Vec<u8>> = parts[3..]
        .iter()
        .map(|v| match v {
            ::redis::Value::Int(i) => i.to_string().into_bytes(),
            ::redis::Value::BulkString(s) => s.clone(),
            other => panic!("field {other:?}"),
        })
        .collect();
    assert_eq!(fields.len(), 50, "five events of ten fields");
    let plan = match &parts[0] {
        ::redis::Value::BulkString(s) => String::from_utf8(s.clone()).unwrap(),
        other => panic!("plan {other:?}"),
    };
    step(scripts::move_in(&to, &plan, "", &fields, &plans)).await;
    // The mover dies here. The batch counts at both (conservative).
    assert_eq!(org_used(&l, &o1).await, 12);
    assert_eq!(org_used(&l, &o2).await, 10);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "a call at a frozen location waits");
    // The same move, again: it finishes what is under way.
    let m = l.set_user_org(&u, Some(&o2)).await.unwrap();
    assert_eq!(m.org, Some(o2.clone()));
    allowed(waiting.await.unwrap().unwrap());
    assert_eq!(org_used(&l, &o1).await, 2);
    assert_eq!(org_used(&l, &o2).await, 12);
    let events = tollgate_tests::all_events(&l, &u).await.unwrap();
    let ids: Vec<String> = events.iter().map(|e| e.request_id.to_string()).collect();
    assert_eq!(ids, ["i0", "i1", "i2", "i3", "i4", "i5"]);
    assert_eq!(l.plan(&u).await.unwrap(), "wide");
    assert_eq!(
        l.org_usage(&o1, None, 10).await.unwrap().members,
        vec![v.clone()]
    );
    assert_eq!(l.org_usage(&o2, None, 10).await.unwrap().members, vec![u]);
}

mod interrupted {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn redis() {
        super::an_interrupted_move_finishes_on_the_next_call(&super::Redis::start()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cluster() {
        super::an_interrupted_move_finishes_on_the_next_call(&super::Redis::cluster()).await
    }
}

/// A member's own limits (an admin's custom plan for one user) live where
/// the user does: set while it is a member, they bind there (with its
/// organisation's), travel with it when it moves to another organisation and
/// out of any, and a named plan clears them everywhere.
async fn a_members_own_limits_bind_and_move_with_it(b: &impl Backend) {
    let l = b.pod().await;
    let (u, o1, o2) = (user("ivy"), org("limits-one"), org("limits-two"));
    l.set_org_plan(&o1, "wide").await.unwrap();
    l.set_org_plan(&o2, "wide").await.unwrap();
    l.set_plan(&u, "wide").await.unwrap();
    l.set_user_org(&u, Some(&o1)).await.unwrap();
    let own = [Limit::window(3, Duration::from_millis(1500))];
    l.set_limits(&u, &own).await.unwrap();
    // Another pod, whose cache has never seen the user, is held to them too.
    let other = b.pod().await;
    allowed(other.reserve(&u, &rid("iv1"), 3).await.unwrap());
    denied(other.reserve(&u, &rid("iv2"), 1).await.unwrap());
    let moved = l.set_user_org(&u, Some(&o2)).await.unwrap();
    assert_eq!(moved.events, 1);
    assert_eq!(
        l.custom_limits(&u).await.unwrap().as_deref(),
        Some(&own[..])
    );
    denied(other.reserve(&u, &rid("iv3"), 1).await.unwrap());
    assert_eq!(org_used(l.as_ref(), &o2).await, 3);
    l.set_user_org(&u, None).await.unwrap();
    assert_eq!(
        l.custom_limits(&u).await.unwrap().as_deref(),
        Some(&own[..])
    );
    denied(other.reserve(&u, &rid("iv4"), 1).await.unwrap());
    // Back in an organisation, then a named plan: the limits are gone.
    l.set_user_org(&u, Some(&o1)).await.unwrap();
    l.set_plan(&u, "wide").await.unwrap();
    assert_eq!(l.custom_limits(&u).await.unwrap(), None);
    allowed(other.reserve(&u, &rid("iv5"), 5).await.unwrap());
}

on_each_backend!(threads 4, [
    the_organisation_binds_its_members,
    every_step_applies_to_both_levels,
    unknown_organisations_and_plans_are_errors,
    moving_a_user_moves_its_events,
    organisations_and_members_page,
    sixteen_way_race_never_passes_either_level,
    moving_users_mid_load_loses_and_doubles_nothing,
    a_members_own_limits_bind_and_move_with_it,
]
    memory => &super::Memory::new(),
    redis => &super::Redis::start(),
    cluster => &super::Redis::cluster(),
);

/// The race through the HTTP api: 2 organisations x 4 users x 2 api pods (two
/// api states, each with its own pool and cache of where users live) on one
/// Redis, or on the cluster; 16 tasks submit jobs of cost 2 until refused.
/// No user passes its 20, no organisation its 60, and each organisation ends
/// at exactly 60 (its limit binds: 4 x 20 > 60).
async fn sixteen_way_race_over_two_api_pods(url: &str) {
    use crate::api::{redis_source, redis_state_with, settings, test_config_with, Harness, ADMIN};
    use axum::http::StatusCode;
    use serde_json::json;
    let config = test_config_with(
        "[plans.u20]\nlimit = 20\nwindow = \"1h\"\n\n[plans.o60]\nlimit = 60\nwindow = \"1h\"\n",
    );
    let prefix = random_prefix();
    let mut pods = Vec::new();
    for _ in 0..2 {
        let state = redis_state_with(url, &prefix, settings(), Arc::clone(&config)).await;
        let source = redis_source(url, &state).await;
        pods.push(Arc::new(Harness {
            app: tollgate_api::router(state.clone()),
            state,
            source,
            redis: None,
            _cluster: None,
        }));
    }
    let mut users = Vec::new();
    for o in 0..2 {
        for u in 0..4 {
            let name = format!("pod-racer-{o}-{u}");
            let key = pods[0].user(&name, "u20").await;
            // The second pod learns where the user lives before it joins.
            pods[1].usage(&key).await;
            users.push((o, name, key));
        }
    }
    for o in 0..2 {
        let r = pods[0]
            .call(
                "PUT",
                &format!("/admin/orgs/team-{o}"),
                Some(ADMIN),
                &[],
                Some(json!({"plan": "o60"}).to_string()),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
    for (o, name, _) in &users {
        let body = json!({"org": format!("team-{o}")}).to_string();
        let r = pods[0]
            .call(
                "PUT",
                &format!("/admin/users/{name}/org"),
                Some(ADMIN),
                &[],
                Some(body),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
    let mut tasks = Vec::new();
    for (o, name, key) in users.iter().cloned() {
        for (p, pod) in pods.iter().enumerate() {
            let (pod, name, key) = (Arc::clone(pod), name.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0u64;
                for i in 0.. {
                    let idem = format!("{name}-{p}-{i}");
                    let r = pod
                        .call(
                            "POST",
                            "/v1/ops/echo.custom?async=true",
                            Some(&key),
                            &[("idempotency-key", &idem)],
                            Some(json!({"i": i}).to_string()),
                        )
                        .await;
                    match r.status {
                        StatusCode::ACCEPTED => admitted += 2,
                        StatusCode::TOO_MANY_REQUESTS => break,
                        other => panic!("{other}: {}", r.body),
                    }
                }
                (o, name, key, admitted)
            }));
        }
    }
    let mut per_org = [0u64; 2];
    let mut per_user: BTreeMap<String, (String, u64)> = BTreeMap::new();
    for t in tasks {
        let (o, name, key, admitted) = t.await.unwrap();
        per_org[o] += admitted;
        per_user.entry(name).or_insert((key, 0)).1 += admitted;
    }
    assert_eq!(per_org, [60, 60]);
    for o in 0..2 {
        let r = pods[1]
            .call(
                "GET",
                &format!("/admin/orgs/team-{o}"),
                Some(ADMIN),
                &[],
                None,
            )
            .await;
        assert_eq!(r.body["windows"][0]["used"], 60, "{}", r.body);
    }
    for (name, (key, admitted)) in per_user {
        assert!(admitted <= 20, "{name}: {admitted}");
        assert_eq!(pods[1].usage(&key).await["used"], admitted, "{name}");
    }
}

mod api_pods {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn redis() {
        let server = tollgate_tests::RedisServer::start();
        super::sixteen_way_race_over_two_api_pods(&server.url()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cluster() {
        let cluster = tollgate_tests::TestCluster::get();
        super::sixteen_way_race_over_two_api_pods(&cluster.url()).await
    }
}
