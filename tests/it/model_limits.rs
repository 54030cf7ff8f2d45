//! Per-model limits in a plan (`model_limits`): checked in the same step as
//! the plan's other limits, on the embedded ledger, Redis and the cluster;
//! settles, refunds, releases and a hold's end land in the model's counter.

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    clock::ManualClock,
    config::Config,
    id::{RequestId, UserId},
    ledger::{ChargeOutcome, ChargeRequest, Ledger, SettleRequest, WindowUse},
};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_tests::{RedisServer, TestCluster};

const CONFIG: &str = r#"
currency = "USD"
default_plan = "pro"
[plans.pro]
limits = [{ limit = "50", period = "month" }]
model_limits = [{ model = "o1*", limit = "5", period = "day" }]
[plans.team]
limits = [{ limit = "500", period = "month" }]
"#;

const USD: u64 = 1_000_000;

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "model_limits").expect("test config"))
}

fn user(s: &str) -> UserId {
    UserId::new(s).expect("valid user id")
}

fn rid(s: &str) -> RequestId {
    RequestId::new(s).expect("valid request id")
}

/// A backend for one case, kept alive while it runs.
pub enum On {
    Memory,
    Redis,
    Cluster,
}

pub struct Case {
    ledger: Arc<dyn Ledger>,
    clock: Option<Arc<ManualClock>>,
    _server: Option<RedisServer>,
    _cluster: Option<TestCluster>,
}

impl On {
    async fn start(self) -> Case {
        match self {
            On::Memory => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("after 1970")
                    .as_millis() as u64;
                let clock = Arc::new(ManualClock::new(now));
                Case {
                    ledger: Arc::new(MemoryLedger::with_clock(config(), Arc::clone(&clock))),
                    clock: Some(clock),
                    _server: None,
                    _cluster: None,
                }
            }
            On::Redis => {
                let server = RedisServer::start();
                let ledger = tollgate_tests::redis_ledger(
                    &server.url(),
                    &tollgate_tests::random_prefix(),
                    config(),
                )
                .await;
                Case {
                    ledger: Arc::new(ledger),
                    clock: None,
                    _server: Some(server),
                    _cluster: None,
                }
            }
            On::Cluster => {
                let cluster = TestCluster::get();
                let ledger = tollgate_tests::redis_ledger(
                    &cluster.url(),
                    &tollgate_tests::random_prefix(),
                    config(),
                )
                .await;
                Case {
                    ledger: Arc::new(ledger),
                    clock: None,
                    _server: None,
                    _cluster: Some(cluster),
                }
            }
        }
    }
}

impl Case {
    /// Lets `d` pass on the ledger's clock.
    async fn pass(&self, d: Duration) {
        match &self.clock {
            Some(c) => c.advance(d),
            None => tokio::time::sleep(d).await,
        }
    }
}

/// The prices a call on `model` priced by the sheet entry `entry` was
/// reserved at (`price::Applied`'s text; the prices do not matter here).
fn price(model: &str, entry: &str) -> String {
    serde_json::json!({ "m": model, "k": entry, "p": [1, 1, 1, 1, 1, 0] }).to_string()
}

/// A job's charge of `cost` on `model` (priced by `entry`) under `nonce`.
fn charge<'a>(cost: u64, nonce: &'a str, entry: &'a str, price: &'a str) -> ChargeRequest<'a> {
    ChargeRequest {
        cost,
        nonce,
        operation: "chat",
        model: entry,
        fingerprint: "f1",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(1),
        service_key: None,
        price: Some(price),
    }
}

async fn charge_on(
    l: &dyn Ledger,
    u: &UserId,
    id: &str,
    cost: u64,
    model: &str,
    entry: &str,
) -> ChargeOutcome {
    let p = price(model, entry);
    l.charge(u, &rid(id), &charge(cost, id, entry, &p))
        .await
        .expect("charge")
}

fn model_window<'a>(windows: &'a [WindowUse], pattern: &str) -> Option<&'a WindowUse> {
    windows.iter().find(|w| w.model.as_deref() == Some(pattern))
}

/// What the user spent on `o1*` today, as `/v1/usage` shows it.
async fn o1_used(l: &dyn Ledger, u: &UserId) -> u64 {
    let usage = l.usage(u).await.expect("usage");
    model_window(&usage.windows, "o1*")
        .expect("usage shows the model limit")
        .used
}

async fn a_model_limit_refuses_and_names_itself(on: On) {
    let case = on.start().await;
    let l = case.ledger.as_ref();
    let u = user("alice");
    let ok = charge_on(l, &u, "c1", 3 * USD, "o1-preview", "o1*").await;
    let ChargeOutcome::Charged { allowed, .. } = ok else {
        panic!("charged: {ok:?}")
    };
    let w = model_window(&allowed.windows, "o1*").expect("the call counts under o1*");
    assert_eq!((w.used, w.limit), (3 * USD, 5 * USD));
    // 3 + 3 > 5: refused, naming the model limit, until the day ends.
    let no = charge_on(l, &u, "c2", 3 * USD, "o1-preview", "o1*").await;
    let ChargeOutcome::Denied(d) = no else {
        panic!("denied: {no:?}")
    };
    let w = model_window(&d.windows, "o1*").expect("the denial shows the model limit");
    assert_eq!(w.used, 3 * USD);
    assert_eq!((d.limit, d.remaining), (5 * USD, 2 * USD), "{d:?}");
    assert!(
        d.retry_after_ms > 0 && d.retry_after_ms <= 86_400_000,
        "{d:?}"
    );
    // Spelled otherwise, or priced by the sheet's default entry: the name
    // still counts under o1*.
    for (id, model, entry) in [
        ("c3", "O1-Mini", "default"),
        ("c4", " o1 ", "default"),
        ("c5", "my-alias", "o1*"),
    ] {
        let no = charge_on(l, &u, id, 3 * USD, model, entry).await;
        assert!(
            matches!(no, ChargeOutcome::Denied(_)),
            "{model} ({entry}): {no:?}"
        );
    }
    // Another model is not affected, and counts only in the overall month.
    let other = charge_on(l, &u, "c6", 10 * USD, "gpt-4o", "gpt-4o*").await;
    let ChargeOutcome::Charged { allowed, .. } = other else {
        panic!("charged: {other:?}")
    };
    assert!(model_window(&allowed.windows, "o1*").is_none());
    assert_eq!(allowed.windows[0].used, 13 * USD);
    assert_eq!(o1_used(l, &u).await, 3 * USD);
    // Another user has its own counter.
    let bob = charge_on(l, &user("bob"), "c1", 5 * USD, "o1", "o1*").await;
    assert!(matches!(bob, ChargeOutcome::Charged { .. }), "{bob:?}");
}

async fn settles_refunds_releases_and_hold_ends_give_back_to_the_model(on: On) {
    let case = on.start().await;
    let l = case.ledger.as_ref();
    let u = user("carol");
    // Settled down from 4 to 1: 4 more fit.
    charge_on(l, &u, "s1", 4 * USD, "o1", "o1*").await;
    let s = l
        .settle_charge(&u, &rid("s1"), &SettleRequest::new("s1", USD, false))
        .await
        .expect("settle");
    assert!(
        matches!(s, tollgate_core::ledger::SettleOutcome::Settled { .. }),
        "{s:?}"
    );
    assert_eq!(o1_used(l, &u).await, USD);
    let ok = charge_on(l, &u, "s2", 4 * USD, "o1", "o1*").await;
    assert!(matches!(ok, ChargeOutcome::Charged { .. }), "{ok:?}");
    assert_eq!(o1_used(l, &u).await, 5 * USD);
    // Released by its failed job: back to 1.
    l.release(&u, &rid("s2"), "s2").await.expect("release");
    assert_eq!(o1_used(l, &u).await, USD);
    // Refunded by an operator (held: its job is cancelled): back to 0.
    l.refund(&u, &rid("s1")).await.expect("refund");
    assert_eq!(o1_used(l, &u).await, 0);
    // A hold no job claims ends: its charge leaves the model's counter too.
    let p = price("o1", "o1*");
    let short = ChargeRequest {
        deadline: Duration::from_millis(50),
        grace: Duration::ZERO,
        ..charge(2 * USD, "s3", "o1*", &p)
    };
    let ok = l.charge(&u, &rid("s3"), &short).await.expect("charge");
    assert!(matches!(ok, ChargeOutcome::Charged { .. }), "{ok:?}");
    assert_eq!(o1_used(l, &u).await, 2 * USD);
    case.pass(Duration::from_millis(200)).await;
    assert_eq!(o1_used(l, &u).await, 0);
    // A settle up (an operation that reserved its estimate) counts too.
    charge_on(l, &u, "s4", USD, "o1", "o1*").await;
    l.settle_charge(&u, &rid("s4"), &SettleRequest::new("s4", 3 * USD, true))
        .await
        .expect("settle up");
    assert_eq!(o1_used(l, &u).await, 3 * USD);
    let no = charge_on(l, &u, "s5", 3 * USD, "o1", "o1*").await;
    assert!(matches!(no, ChargeOutcome::Denied(_)), "{no:?}");
}

async fn concurrent_charges_never_pass_a_model_limit(on: On) {
    let case = on.start().await;
    let l = Arc::clone(&case.ledger);
    let u = user("dave");
    // 50 charges of 0.3 USD against 5 USD a day: 16 fit (4.8), never 17.
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let (l, u) = (Arc::clone(&l), u.clone());
            tokio::spawn(async move {
                let id = format!("k{i}");
                charge_on(l.as_ref(), &u, &id, 300_000, "o1-mini", "o1*").await
            })
        })
        .collect();
    let mut charged = 0;
    for t in tasks {
        if matches!(t.await.expect("task"), ChargeOutcome::Charged { .. }) {
            charged += 1;
        }
    }
    assert_eq!(charged, 16);
    assert_eq!(o1_used(l.as_ref(), &u).await, 16 * 300_000);
    let usage = l.usage(&u).await.expect("usage");
    assert_eq!(usage.windows[0].used, 16 * 300_000);
    // The top-level figures are the plan's own limit's.
    assert_eq!(usage.limit, 50 * USD);
}

async fn a_move_between_organisations_keeps_the_model_counter(on: On) {
    let case = on.start().await;
    let l = case.ledger.as_ref();
    let u = user("erin");
    let org = tollgate_core::id::OrgId::new("acme").expect("org id");
    l.set_org_plan(&org, "team").await.expect("org plan");
    charge_on(l, &u, "m1", 3 * USD, "o1", "o1*").await;
    l.set_user_org(&u, Some(&org)).await.expect("move in");
    assert_eq!(o1_used(l, &u).await, 3 * USD);
    let no = charge_on(l, &u, "m2", 3 * USD, "o1", "o1*").await;
    assert!(matches!(no, ChargeOutcome::Denied(_)), "{no:?}");
    // A refund after the move lands in the counter that moved.
    l.refund(&u, &rid("m1")).await.expect("refund");
    assert_eq!(o1_used(l, &u).await, 0);
    let ok = charge_on(l, &u, "m3", 4 * USD, "o1", "o1*").await;
    assert!(matches!(ok, ChargeOutcome::Charged { .. }), "{ok:?}");
    l.set_user_org(&u, None).await.expect("move out");
    assert_eq!(o1_used(l, &u).await, 4 * USD);
    l.release(&u, &rid("m3"), "m3").await.expect("release");
    assert_eq!(o1_used(l, &u).await, 0);
}

/// Through the job queue, with a real price sheet: the model the request
/// names decides, whatever entry prices it.
const SHEET: &str = r#"
currency = "USD"
[models."o1*"]
input = "15"
output = "60"
max_output = 1000
[default]
input = "1"
output = "1"
max_output = 1000
"#;

fn priced_config() -> Arc<Config> {
    tollgate_tests::money::usd_config_with(
        "model limits",
        SHEET,
        "default_plan = \"pro\"\n[plans.pro]\n\
         limits = [{ limit = \"50\", period = \"month\" }]\n\
         model_limits = [{ model = \"o1*\", limit = \"0.1\", period = \"day\" }]",
    )
}

async fn a_priced_call_counts_under_its_models_limit(redis: bool) {
    use tollgate_core::job::{JobQueue, JobRequest, SubmitOutcome};
    let config = priced_config();
    let (_server, queue): (Option<RedisServer>, Arc<dyn JobQueue>) = if redis {
        let server = RedisServer::start();
        let (q, _) =
            crate::jobs::redis_queue(&server, &tollgate_tests::random_prefix(), config).await;
        (Some(server), q)
    } else {
        let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let q = tollgate_memory::jobs::MemoryJobQueue::with_clock(
            config,
            ledger,
            Arc::new(tollgate_core::clock::SystemClock),
            crate::jobs::options(),
        );
        (None, Arc::new(q))
    };
    let submit = |id: &str, model: &str| {
        let queue = Arc::clone(&queue);
        let request = JobRequest {
            id: rid(id),
            user: user("frank"),
            operation: "chat".into(),
            input: serde_json::json!({
                "model": model,
                "max_tokens": 1000,
                "messages": [{"role": "user", "content": "hello"}],
            }),
            trace: None,
            service_key: None,
        };
        async move { queue.submit(request).await.expect("submit") }
    };
    // About 0.062 USD reserved: one o1 call fits 0.1 USD a day, not two.
    let first = submit("p1", "o1-preview").await;
    assert!(matches!(first, SubmitOutcome::Queued { .. }), "{first:?}");
    let SubmitOutcome::Queued { job: first, .. } = first else {
        unreachable!()
    };
    match submit("p2", "o1-preview").await {
        SubmitOutcome::Denied { denied } => {
            let w = model_window(&denied.windows, "o1*").expect("names the model limit");
            assert_eq!((w.used, w.limit), (first.cost, 100_000));
            assert_eq!(denied.limit, 100_000, "{denied:?}");
        }
        other => panic!("{other:?}"),
    }
    // Spelled in capitals the sheet's look-up misses its entry and prices it
    // by the default (cheaply): it still counts under o1*, by its name.
    match submit("p3", "O1-PREVIEW").await {
        SubmitOutcome::Queued { job, allowed } => {
            let w = model_window(&allowed.windows, "o1*").expect("counts under o1*");
            assert_eq!(w.used, first.cost + job.cost);
        }
        other => panic!("{other:?}"),
    }
    // Another model (priced by the default entry) is not affected.
    match submit("p4", "gpt-4o").await {
        SubmitOutcome::Queued { allowed, .. } => {
            assert!(
                model_window(&allowed.windows, "o1*").is_none(),
                "{allowed:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_priced_call_counts_under_its_models_limit() {
    a_priced_call_counts_under_its_models_limit(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_priced_call_counts_under_its_models_limit() {
    a_priced_call_counts_under_its_models_limit(true).await;
}

on_each_backend!(
    threads 4,
    [
        a_model_limit_refuses_and_names_itself,
        settles_refunds_releases_and_hold_ends_give_back_to_the_model,
        concurrent_charges_never_pass_a_model_limit,
        a_move_between_organisations_keeps_the_model_counter,
    ]
    memory => super::On::Memory,
    redis => super::On::Redis,
    cluster => super::On::Cluster,
);
