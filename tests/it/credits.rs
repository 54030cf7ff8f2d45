//! Prepaid credits (`credits = "only"`, docs/src/money.md "Prepaid
//! credits"), written once and run on both ledgers: a charge draws from the
//! balance in the step that checks the windows, earliest expiry first; a
//! refund or settle gives back to the grants it came from; a cost the
//! balance cannot cover is refused; every change is in the export, which
//! alone rebuilds the balance. The clock: the embedded ledger's a manual
//! one, Redis's `TIME` offset by libfaketime (`ClockedRedis`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    clock::{Clock, ManualClock},
    config::Config,
    credits::{self, CreditBalance, GrantOutcome, GrantRequest},
    id::{RequestId, UserId},
    ledger::{
        ChangeKind, ChargeOutcome, ChargeRequest, ExportEntry, Ledger, LedgerError, ReserveOutcome,
    },
};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_redis::ledger::RedisLedger;
use tollgate_tests::clocked_redis::ClockedRedis;
use tollgate_tests::redis_cluster::TestCluster;

const CONFIG: &str = r#"
default_plan = "prepaid"
[export]
maxlen = 1000000
[plans.prepaid]
limit = 1000000
window = "1h"
credits = "only"
[plans.free]
limit = 1000000
window = "1h"
"#;

const HOUR: u64 = 3_600_000;
/// 2027-01-01T00:00:00Z: where every case's ledger clock starts (the
/// cluster's runs on the real clock: its cases' expiries are far ahead).
const T0: u64 = 1_798_761_600_000;

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "credits").expect("test config"))
}

fn user(s: &str) -> UserId {
    UserId::new(s).expect("valid user id")
}

fn rid(s: &str) -> RequestId {
    RequestId::new(s).expect("valid request id")
}

fn grant(amount: u64, key: &str, expires_at_ms: Option<u64>) -> GrantRequest<'_> {
    GrantRequest {
        amount,
        expires_at_ms,
        idempotency_key: key,
    }
}

/// A ledger and its clock; `pods` handles on the same store (the embedded
/// ledger has one).
enum Clocked {
    Memory {
        clock: Arc<ManualClock>,
        ledger: Arc<MemoryLedger<Arc<ManualClock>>>,
    },
    Redis {
        clock: ClockedRedis,
        pods: Vec<Arc<RedisLedger>>,
    },
    /// A Redis Cluster on the real clock (the cases that set no clock).
    Cluster {
        _cluster: TestCluster,
        pods: Vec<Arc<RedisLedger>>,
    },
}

#[derive(Debug, Clone, Copy)]
enum On {
    Memory,
    Redis,
    Cluster,
}

async fn pods(url: &str) -> Vec<Arc<RedisLedger>> {
    let prefix = tollgate_tests::random_prefix();
    let mut pods = Vec::new();
    for _ in 0..2 {
        pods.push(Arc::new(
            tollgate_tests::redis_ledger(url, &prefix, config()).await,
        ));
    }
    pods
}

impl On {
    async fn start(self) -> Clocked {
        match self {
            On::Memory => {
                let clock = Arc::new(ManualClock::new(T0));
                let ledger = Arc::new(MemoryLedger::with_clock(config(), Arc::clone(&clock)));
                Clocked::Memory { clock, ledger }
            }
            On::Redis => {
                let clock = ClockedRedis::start(T0);
                let pods = pods(&clock.url()).await;
                Clocked::Redis { clock, pods }
            }
            On::Cluster => {
                let cluster = TestCluster::get();
                let pods = pods(&cluster.url()).await;
                Clocked::Cluster {
                    _cluster: cluster,
                    pods,
                }
            }
        }
    }
}

impl Clocked {
    fn ledger(&self) -> Arc<dyn Ledger> {
        self.pod(0)
    }

    /// Pod `i`'s ledger (the embedded one: the only one).
    fn pod(&self, i: usize) -> Arc<dyn Ledger> {
        match self {
            Clocked::Memory { ledger, .. } => ledger.clone(),
            Clocked::Redis { pods, .. } | Clocked::Cluster { pods, .. } => {
                pods[i % pods.len()].clone()
            }
        }
    }

    /// Moves the ledger's clock forward to `at_ms`.
    async fn set(&self, at_ms: u64) {
        match self {
            Clocked::Memory { clock, .. } => {
                clock.advance(Duration::from_millis(at_ms.saturating_sub(clock.now_ms())));
            }
            Clocked::Redis { clock, pods } => {
                tokio::task::block_in_place(|| clock.set(at_ms));
                for _ in 0..20 {
                    if pods[0].plan(&user("warm-up")).await.is_ok() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                panic!("the restarted Redis does not answer");
            }
            Clocked::Cluster { .. } => panic!("the cluster runs on the real clock"),
        }
    }
}

fn allowed(r: &ReserveOutcome) {
    assert!(r.is_allowed(), "denied: {r:?}");
}

/// The balance a refusal tells (a credits refusal), or panics.
fn refused_with(r: &ReserveOutcome) -> u64 {
    match r {
        ReserveOutcome::Denied(d) => d.credits.unwrap_or_else(|| panic!("not credits: {d:?}")),
        ReserveOutcome::Allowed(a) => panic!("allowed: {a:?}"),
    }
}

async fn export(l: &dyn Ledger, u: &UserId) -> Vec<ExportEntry> {
    l.exported(u, 0, 1_000_000).await.unwrap()
}

/// The balance from the export alone.
fn rebuilt(entries: &[ExportEntry]) -> i128 {
    credits::rebuild(entries).values().sum()
}

fn remaining(b: &CreditBalance) -> Vec<(u64, u64)> {
    b.grants.iter().map(|g| (g.id, g.remaining)).collect()
}

/// No balance, no call; a grant is drawn by each charge, a cost past the
/// balance is refused with the balance and charges nothing, a retried
/// request draws once, a refund gives back; a plan without credits draws
/// nothing.
async fn a_charge_draws_and_a_refund_gives_back(on: On) {
    let b = on.start().await;
    let l = b.ledger();
    let u = user("ada");
    let r = l.reserve(&u, &rid("r0"), 3).await.unwrap();
    assert_eq!(refused_with(&r), 0);
    l.add_credits(&u, &grant(10, "top-up-1", None))
        .await
        .unwrap();
    allowed(&l.reserve(&u, &rid("r1"), 4).await.unwrap());
    allowed(&l.reserve(&u, &rid("r1"), 4).await.unwrap());
    assert_eq!(l.credits(&u).await.unwrap().balance, 6);
    let r = l.reserve(&u, &rid("r2"), 7).await.unwrap();
    assert_eq!(refused_with(&r), 6);
    if let ReserveOutcome::Denied(d) = &r {
        assert_eq!(d.needed, 7);
    }
    assert_eq!(l.usage(&u).await.unwrap().used, 4, "nothing charged");
    l.refund(&u, &rid("r1")).await.unwrap();
    assert_eq!(l.credits(&u).await.unwrap().balance, 10);
    allowed(&l.reserve(&u, &rid("r2"), 10).await.unwrap());
    assert_eq!(l.credits(&u).await.unwrap().balance, 0);
    let r = l.reserve(&u, &rid("r3"), 1).await.unwrap();
    assert_eq!(refused_with(&r), 0);

    // A job's charge draws the same way; its release gives back.
    l.add_credits(&u, &grant(6, "top-up-2", None))
        .await
        .unwrap();
    let charge = ChargeRequest {
        cost: 5,
        nonce: "n1",
        operation: "chat",
        model: "",
        service_key: None,
        fingerprint: "f1",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(5),
        price: None,
    };
    let c = l.charge(&u, &rid("job1"), &charge).await.unwrap();
    assert!(matches!(c, ChargeOutcome::Charged { .. }), "{c:?}");
    assert_eq!(l.credits(&u).await.unwrap().balance, 1);
    let c = l.charge(&u, &rid("job2"), &charge).await.unwrap();
    assert!(
        matches!(&c, ChargeOutcome::Denied(d) if d.credits == Some(1)),
        "{c:?}"
    );
    l.release(&u, &rid("job1"), "n1").await.unwrap();
    assert_eq!(l.credits(&u).await.unwrap().balance, 6);
    allowed(&l.reserve(&u, &rid("r4"), 6).await.unwrap());

    let free = user("bea");
    l.set_plan(&free, "free").await.unwrap();
    l.add_credits(&free, &grant(5, "k", None)).await.unwrap();
    allowed(&l.reserve(&free, &rid("f1"), 50).await.unwrap());
    assert_eq!(l.credits(&free).await.unwrap().balance, 5);

    let e = export(&*l, &u).await;
    assert_eq!(rebuilt(&e), 0);
    let kinds: Vec<ChangeKind> = e
        .iter()
        .filter(|e| credits::is_credit(e.kind))
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        vec![
            ChangeKind::CreditGrant,
            ChangeKind::CreditDraw,
            ChangeKind::CreditReturn,
            ChangeKind::CreditDraw,
            ChangeKind::CreditGrant,
            ChangeKind::CreditDraw,
            ChangeKind::CreditReturn,
            ChangeKind::CreditDraw,
        ]
    );
}

/// Grants are drawn earliest expiry first (one that never expires last); a
/// settle down gives back to the grants the charge drew, the last drawn
/// first; a grant stops counting at its expiry (exported with what it
/// held), and what a refund would give back to it is lost with it. The
/// export alone rebuilds every grant.
async fn the_earliest_expiring_grant_is_drawn_first(on: On) {
    let b = on.start().await;
    let l = b.ledger();
    let u = user("cy");
    let late = Some(T0 + 10 * HOUR);
    let soon = Some(T0 + HOUR);
    l.add_credits(&u, &grant(5, "late", late)).await.unwrap();
    l.add_credits(&u, &grant(5, "never", None)).await.unwrap();
    let g = l.add_credits(&u, &grant(5, "soon", soon)).await.unwrap();
    assert_eq!(remaining(g.credits()), vec![(3, 5), (1, 5), (2, 5)]);
    allowed(&l.reserve(&u, &rid("big"), 7).await.unwrap());
    assert_eq!(
        remaining(&l.credits(&u).await.unwrap()),
        vec![(1, 3), (2, 5)]
    );
    l.settle(&u, &rid("big"), 3).await.unwrap();
    // 4 back: 2 to "late" (drawn last), 2 to "soon".
    assert_eq!(
        remaining(&l.credits(&u).await.unwrap()),
        vec![(3, 2), (1, 5), (2, 5)]
    );
    b.set(T0 + HOUR + 1000).await;
    let c = l.credits(&u).await.unwrap();
    assert_eq!(remaining(&c), vec![(1, 5), (2, 5)]);
    assert_eq!(c.balance, 10);
    // Its 3 would go back to "soon", which expired.
    l.refund(&u, &rid("big")).await.unwrap();
    assert_eq!(l.credits(&u).await.unwrap().balance, 10);
    let e = export(&*l, &u).await;
    let expired: Vec<_> = e
        .iter()
        .filter(|e| e.kind == ChangeKind::CreditExpire)
        .map(|e| (e.grant, e.cost, e.request_id.as_str().to_owned()))
        .collect();
    assert_eq!(expired, vec![(Some(3), 2, "soon".to_owned())]);
    let per_grant = credits::rebuild(&e);
    assert_eq!(per_grant.get(&1), Some(&5));
    assert_eq!(per_grant.get(&2), Some(&5));
    assert_eq!(per_grant.get(&3), Some(&0));
    assert_eq!(rebuilt(&e), 10);
}

/// A settle up draws the difference; what the balance cannot cover is
/// recorded (the upstream did the work: the charge keeps its cost) and
/// exported as uncovered; the balance stays at zero, never below.
async fn a_settle_up_past_the_balance_is_recorded_uncovered(on: On) {
    let b = on.start().await;
    let l = b.ledger();
    let u = user("dee");
    l.add_credits(&u, &grant(5, "k1", None)).await.unwrap();
    allowed(&l.reserve(&u, &rid("a"), 3).await.unwrap());
    l.settle(&u, &rid("a"), 9).await.unwrap();
    assert_eq!(l.usage(&u).await.unwrap().used, 9);
    assert_eq!(l.credits(&u).await.unwrap().balance, 0);
    let e = export(&*l, &u).await;
    let uncovered: Vec<u64> = e
        .iter()
        .filter(|e| e.kind == ChangeKind::CreditUncovered)
        .map(|e| e.cost)
        .collect();
    assert_eq!(uncovered, vec![4]);
    assert_eq!(rebuilt(&e), 0);
    // Settled down, it gives back only what it drew.
    l.settle(&u, &rid("a"), 1).await.unwrap();
    assert_eq!(l.credits(&u).await.unwrap().balance, 4);
    l.refund(&u, &rid("a")).await.unwrap();
    assert_eq!(l.credits(&u).await.unwrap().balance, 5);
    assert_eq!(rebuilt(&export(&*l, &u).await), 5);
}

/// A zero or too large amount, a bad key, an expiry not after now, a key
/// used for another grant: each a clear error naming its field, nothing
/// changed; the same key and grant again is that one grant.
async fn bad_grants_change_nothing(on: On) {
    let b = on.start().await;
    let l = b.ledger();
    let u = user("eve");
    let field = |r: Result<GrantOutcome, LedgerError>| match r {
        Err(LedgerError::BadCredit { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        field(l.add_credits(&u, &grant(0, "k", None)).await),
        "amount"
    );
    assert_eq!(
        field(l.add_credits(&u, &grant(1 << 60, "k", None)).await),
        "amount"
    );
    assert_eq!(
        field(l.add_credits(&u, &grant(5, "a b", None)).await),
        "idempotency_key"
    );
    assert_eq!(
        field(l.add_credits(&u, &grant(5, "k", Some(T0 - 1))).await),
        "expires_at"
    );
    assert_eq!(
        field(l.add_credits(&u, &grant(5, "k", Some(1 << 60))).await),
        "expires_at"
    );
    assert!(export(&*l, &u).await.is_empty(), "nothing changed");
    let first = l.add_credits(&u, &grant(5, "k", None)).await.unwrap();
    assert!(matches!(first, GrantOutcome::Granted { grant: 1, .. }));
    let again = l.add_credits(&u, &grant(5, "k", None)).await.unwrap();
    assert!(
        matches!(again, GrantOutcome::Existing { grant: 1, .. }),
        "{again:?}"
    );
    let other = l.add_credits(&u, &grant(6, "k", None)).await;
    assert!(
        matches!(other, Err(LedgerError::CreditKeyReused { amount: 5, .. })),
        "{other:?}"
    );
    let other = l.add_credits(&u, &grant(5, "k", Some(T0 + HOUR))).await;
    assert!(
        matches!(other, Err(LedgerError::CreditKeyReused { .. })),
        "{other:?}"
    );
    let c = l.credits(&u).await.unwrap();
    assert_eq!((c.balance, c.grants.len()), (5, 1));
    let grants = export(&*l, &u)
        .await
        .iter()
        .filter(|e| e.kind == ChangeKind::CreditGrant)
        .count();
    assert_eq!(grants, 1);
}

/// A member of an organisation holds no credits of its own (its budget
/// lives under the organisation's tag): a credits plan refuses its calls
/// with a balance of 0, its balance reads 0, a grant to it names `user`;
/// back out of the organisation, its grants are there again.
async fn a_member_holds_no_credits(on: On) {
    let b = on.start().await;
    let l = b.ledger();
    let u = user("gus");
    l.add_credits(&u, &grant(9, "k", None)).await.unwrap();
    let org = tollgate_core::id::OrgId::new("acme").unwrap();
    l.set_org_plan(&org, "free").await.unwrap();
    l.set_user_org(&u, Some(&org)).await.unwrap();
    let r = l.reserve(&u, &rid("m1"), 1).await.unwrap();
    assert_eq!(refused_with(&r), 0);
    assert_eq!(l.credits(&u).await.unwrap().balance, 0);
    let g = l.add_credits(&u, &grant(5, "k2", None)).await;
    assert!(
        matches!(g, Err(LedgerError::BadCredit { field: "user", .. })),
        "{g:?}"
    );
    l.set_user_org(&u, None).await.unwrap();
    assert_eq!(l.credits(&u).await.unwrap().balance, 9);
    allowed(&l.reserve(&u, &rid("m2"), 9).await.unwrap());
    assert_eq!(l.credits(&u).await.unwrap().balance, 0);
}

/// 16 callers on 2 pods (two ledger handles on one Redis; the embedded
/// ledger: one) draw on one balance of three grants of different expiry
/// with random costs, settles (down, and sometimes up) and refunds. At the
/// end the balance is the grants less what the charges cost as they stand,
/// exactly; replaying the export, no grant ever goes below zero and every
/// draw took the earliest-expiring grant with something left; the export
/// alone rebuilds the balance.
async fn sixteen_callers_on_two_pods_share_one_balance(on: On) {
    let b = Arc::new(on.start().await);
    let l = b.ledger();
    let u = user("fay");
    let grants = [
        (3000, Some(T0 + 2 * HOUR)),
        (2000, Some(T0 + HOUR)),
        (4000, None),
    ];
    for (i, (amount, exp)) in grants.iter().enumerate() {
        let key = format!("g{i}");
        l.add_credits(&u, &grant(*amount, &key, *exp))
            .await
            .unwrap();
    }
    let total: u64 = grants.iter().map(|g| g.0).sum();
    let spent = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for caller in 0..16u64 {
        let l = b.pod(caller as usize);
        let u = u.clone();
        let spent = Arc::clone(&spent);
        tasks.push(tokio::spawn(async move {
            let mut seed = caller.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move |n: u64| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed % n
            };
            let mut refused = 0;
            for i in 0..60 {
                let id = rid(&format!("c{caller}-{i}"));
                let cost = 1 + next(150);
                match l.reserve(&u, &id, cost).await.unwrap() {
                    ReserveOutcome::Allowed(_) => {}
                    ReserveOutcome::Denied(d) => {
                        assert!(d.credits.is_some_and(|b| b < cost), "{d:?}");
                        refused += 1;
                        continue;
                    }
                }
                let cost = match next(10) {
                    0 => {
                        l.refund(&u, &id).await.unwrap();
                        0
                    }
                    1 => {
                        // Up: what the balance cannot cover stays charged.
                        let up = cost + next(20);
                        l.settle(&u, &id, up).await.unwrap();
                        up
                    }
                    _ => {
                        let down = 1 + next(cost);
                        l.settle(&u, &id, down).await.unwrap();
                        down
                    }
                };
                spent.fetch_add(cost, Ordering::Relaxed);
            }
            refused
        }));
    }
    let mut refused = 0;
    for t in tasks {
        refused += t.await.unwrap();
    }
    assert!(refused > 0, "the balance ran out at some point");
    let c = l.credits(&u).await.unwrap();
    let e = export(&*l, &u).await;
    let uncovered: u64 = e
        .iter()
        .filter(|e| e.kind == ChangeKind::CreditUncovered)
        .map(|e| e.cost)
        .sum();
    // Every cost was drawn from the grants, but for what was uncovered.
    let spent = spent.load(Ordering::Relaxed);
    assert_eq!(c.balance + spent - uncovered, total, "{c:?}");
    assert_eq!(rebuilt(&e), i128::from(c.balance));

    // Replay: no grant below zero; each draw from the earliest-expiring
    // grant left.
    let order: BTreeMap<u64, u64> = [(1, T0 + 2 * HOUR), (2, T0 + HOUR), (3, u64::MAX)].into();
    let mut left: BTreeMap<u64, i128> = BTreeMap::new();
    for x in e.iter().filter(|e| credits::is_credit(e.kind)) {
        let g = x.grant.unwrap();
        let amount = i128::from(x.cost);
        match x.kind {
            ChangeKind::CreditGrant | ChangeKind::CreditReturn => {
                *left.entry(g).or_default() += amount;
            }
            ChangeKind::CreditDraw => {
                for (other, rem) in &left {
                    assert!(
                        order[other] >= order[&g] || *rem == 0,
                        "drew grant {g} while grant {other} held {rem}"
                    );
                }
                *left.entry(g).or_default() -= amount;
            }
            _ => {}
        }
        assert!(left.values().all(|&v| v >= 0), "{left:?}");
    }
}

on_each_backend!(
    threads 4,
    [
        a_charge_draws_and_a_refund_gives_back,
        the_earliest_expiring_grant_is_drawn_first,
        a_settle_up_past_the_balance_is_recorded_uncovered,
        bad_grants_change_nothing,
        sixteen_callers_on_two_pods_share_one_balance,
        a_member_holds_no_credits,
    ]
    memory => super::On::Memory,
    redis => super::On::Redis,
);

mod cluster {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_charge_draws_and_a_refund_gives_back() {
        super::a_charge_draws_and_a_refund_gives_back(super::On::Cluster).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_settle_up_past_the_balance_is_recorded_uncovered() {
        super::a_settle_up_past_the_balance_is_recorded_uncovered(super::On::Cluster).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixteen_callers_on_two_pods_share_one_balance() {
        super::sixteen_callers_on_two_pods_share_one_balance(super::On::Cluster).await;
    }
}
