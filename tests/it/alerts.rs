//! Budget alerts, end to end: crossings detected in the budget step, queued
//! in the outbox, delivered by the deliverer as signed webhooks to a real
//! HTTP receiver in this test (which checks every signature with its own
//! HMAC-SHA256, not the product's). The same cases on memory, on one Redis
//! with two "pods" (two ledgers and two deliverers, each on its own
//! connection pool) and on the suite's Redis Cluster; and `tollgate all`
//! (embedded) as a process.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tollgate_alerts::Deliverer;
use tollgate_core::alerts::AlertOutbox;
use tollgate_core::clock::SystemClock;
use tollgate_core::config::Config;
use tollgate_core::id::{OrgId, RequestId, UserId};
use tollgate_core::ledger::{ChargeOutcome, ChargeRequest, Ledger, RefundOutcome, ReserveOutcome};
use tollgate_core::metrics::Metrics;
use tollgate_memory::alerts::MemoryAlerts;
use tollgate_memory::ledger::MemoryLedger;
use tollgate_redis::alerts::RedisAlerts;
use tollgate_redis::keys::KeySpace;
use tollgate_redis::ledger::RedisLedger;
use tollgate_redis::pool::PoolOptions;
use tollgate_tests::http::FetchJson;
use tollgate_tests::{random_prefix, RedisServer, TestCluster};

const SECRET: &[u8] = b"whsec_test_0123456789";

/// HMAC-SHA256 (RFC 2104) on sha2: the receiver's own check.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let inner = Sha256::new()
        .chain_update(&ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(&opad)
        .chain_update(inner)
        .finalize()
        .to_vec()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `t=<unix seconds>,v1=<64 lowercase hex>` and nothing else; the HMAC of
/// `"<t>.<body>"` under `secret`, t within 5 minutes of now.
fn signature_ok(secret: &[u8], header: &str, body: &str) -> bool {
    let Some((t, v1)) = header
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
    else {
        return false;
    };
    let Ok(t_secs) = t.parse::<u64>() else {
        return false;
    };
    if !t.bytes().all(|b| b.is_ascii_digit())
        || v1.len() != 64
        || !v1
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return false;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    if now.abs_diff(t_secs) > 300 {
        return false;
    }
    hex(&hmac_sha256(secret, format!("{t}.{body}").as_bytes())) == v1
}

#[test]
fn the_receivers_hmac_is_rfc_4231() {
    assert_eq!(
        hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
}

#[derive(Debug, Clone)]
struct Arrival {
    id: String,
    signature: String,
    body: String,
    answered: u16,
}

#[derive(Debug)]
struct Hook {
    status: AtomicU16,
    arrivals: Mutex<Vec<Arrival>>,
}

/// A webhook receiver on 127.0.0.1: records every arrival, answers
/// `status` (200 unless a test says otherwise).
struct Receiver {
    url: String,
    hook: Arc<Hook>,
    _task: tokio::task::JoinHandle<()>,
}

async fn receive(State(hook): State<Arc<Hook>>, headers: HeaderMap, body: String) -> StatusCode {
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let answered = hook.status.load(Ordering::SeqCst);
    // A bad signature is refused, as a real receiver would.
    let answered = if signature_ok(SECRET, &header("tollgate-signature"), &body) {
        answered
    } else {
        401
    };
    hook.arrivals.lock().unwrap().push(Arrival {
        id: header("tollgate-alert-id"),
        signature: header("tollgate-signature"),
        body,
        answered,
    });
    StatusCode::from_u16(answered).unwrap()
}

impl Receiver {
    async fn start() -> Self {
        let hook = Arc::new(Hook {
            status: AtomicU16::new(200),
            arrivals: Mutex::default(),
        });
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(receive))
            .with_state(Arc::clone(&hook));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            hook,
            _task: task,
        }
    }

    fn arrivals(&self) -> Vec<Arrival> {
        self.hook.arrivals.lock().unwrap().clone()
    }

    /// The arrivals answered 2xx, their bodies parsed.
    fn delivered(&self) -> Vec<(Arrival, Value)> {
        self.arrivals()
            .into_iter()
            .filter(|a| (200..300).contains(&a.answered))
            .map(|a| {
                let v = serde_json::from_str(&a.body).unwrap();
                (a, v)
            })
            .collect()
    }

    /// Waits (up to `within`) until `n` alerts were delivered.
    async fn wait_for(&self, n: usize, within: Duration) -> Vec<(Arrival, Value)> {
        let deadline = Instant::now() + within;
        loop {
            let d = self.delivered();
            if d.len() >= n || Instant::now() > deadline {
                return d;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn config(url: &str, alerts: bool) -> Arc<Config> {
    let section = if alerts {
        format!(
            "[alerts]\nurl = \"{url}\"\nsecret_env = \"TOLLGATE_TEST_ALERT_SECRET\"\ntimeout = \"2s\"\n"
        )
    } else {
        String::new()
    };
    let text = format!(
        r#"
default_plan = "p"
{section}
[plans.p]
limit = 100
window = "1h"
alerts = [0.8, 1.0]
[plans.short]
limit = 10
window = "1500ms"
alerts = [0.8]
[plans.quiet]
limit = 1000
window = "1h"
[plans.monthly]
limits = [{{ limit = 100, period = "month", tz = "Europe/Berlin" }}, {{ limit = 1000, window = "1h" }}]
alerts = [0.8]
"#
    );
    Arc::new(Config::parse(&text, "alerts test").unwrap())
}

/// The ledgers and outboxes of the pods under test, their deliverers.
struct Pods {
    ledgers: Vec<Arc<dyn Ledger>>,
    outboxes: Vec<Arc<dyn AlertOutbox>>,
    metrics: Vec<Arc<Metrics>>,
    stop: watch::Sender<bool>,
    deliverers: Vec<tokio::task::JoinHandle<()>>,
    _server: Option<RedisServer>,
    _cluster: Option<TestCluster>,
}

type Stores = (Vec<Arc<dyn Ledger>>, Vec<Arc<dyn AlertOutbox>>);

#[derive(Clone, Copy)]
enum Store {
    Memory,
    Redis,
    Cluster,
}

impl Pods {
    async fn start(store: Store, config: Arc<Config>) -> Self {
        let (mut server, mut cluster) = (None, None);
        let (ledgers, outboxes): Stores = match store {
            Store::Memory => {
                let alerts = MemoryAlerts::new(Arc::new(SystemClock));
                let ledger: Arc<dyn Ledger> =
                    Arc::new(MemoryLedger::new(Arc::clone(&config)).with_alerts(alerts.clone()));
                let outbox: Arc<dyn AlertOutbox> = Arc::new(alerts);
                // One process: its tasks share the ledger; two deliverers race.
                (vec![ledger.clone(), ledger], vec![outbox.clone(), outbox])
            }
            Store::Redis | Store::Cluster => {
                let url = if matches!(store, Store::Redis) {
                    let s = RedisServer::start();
                    let url = s.url();
                    server = Some(s);
                    url
                } else {
                    let c = TestCluster::get();
                    let url = c.url();
                    cluster = Some(c);
                    url
                };
                let prefix = random_prefix();
                let mut ledgers: Vec<Arc<dyn Ledger>> = Vec::new();
                let mut outboxes: Vec<Arc<dyn AlertOutbox>> = Vec::new();
                for _ in 0..2 {
                    let pool = tollgate_redis::pool::connect(&url, &PoolOptions::default())
                        .await
                        .unwrap();
                    let keys = KeySpace::new(&prefix).unwrap();
                    ledgers.push(Arc::new(RedisLedger::new(
                        pool.clone(),
                        keys.clone(),
                        Arc::clone(&config),
                    )));
                    outboxes.push(Arc::new(RedisAlerts::new(pool, keys)));
                }
                (ledgers, outboxes)
            }
        };
        let (stop, rx) = watch::channel(false);
        let mut deliverers = Vec::new();
        let mut metrics = Vec::new();
        if let Some(alerts) = config.alerts() {
            for outbox in &outboxes {
                let m = Arc::new(Metrics::new(&config));
                let mut d =
                    Deliverer::new(alerts, SECRET.to_vec(), Arc::clone(outbox), Arc::clone(&m))
                        .unwrap();
                d.poll = Duration::from_millis(100);
                d.first_backoff = Duration::from_millis(500);
                d.max_backoff = Duration::from_secs(2);
                let mut rx = rx.clone();
                deliverers.push(tokio::spawn(d.run(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })));
                metrics.push(m);
            }
        }
        Self {
            ledgers,
            outboxes,
            metrics,
            stop,
            deliverers,
            _server: server,
            _cluster: cluster,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        for d in self.deliverers {
            tokio::time::timeout(Duration::from_secs(10), d)
                .await
                .expect("the deliverer stops")
                .unwrap();
        }
    }

    /// `result`'s count across the pods' metrics.
    fn counted(&self, result: &str) -> u64 {
        let needle = format!("tollgate_alert_deliveries_total{{result=\"{result}\"}} ");
        self.metrics
            .iter()
            .map(|m| {
                m.render()
                    .lines()
                    .find_map(|l| l.strip_prefix(needle.as_str()))
                    .map_or(0, |v| v.trim().parse::<u64>().unwrap())
            })
            .sum()
    }
}

fn user(prefix: &str) -> UserId {
    UserId::new(format!("{prefix}-{}", random_prefix())).unwrap()
}

fn rid() -> RequestId {
    RequestId::generate()
}

async fn reserve(ledger: &dyn Ledger, user: &UserId, cost: u64) -> bool {
    matches!(
        ledger.reserve(user, &rid(), cost).await.unwrap(),
        ReserveOutcome::Allowed(_)
    )
}

/// What every delivered alert must hold: its header format, a signature
/// only the right secret makes, the id in its header and body.
fn check_delivery(a: &Arrival, v: &Value) {
    assert!(signature_ok(SECRET, &a.signature, &a.body), "{a:?}");
    assert!(
        !signature_ok(b"another secret", &a.signature, &a.body),
        "a receiver with another secret must reject it"
    );
    assert_eq!(v["id"], a.id.as_str(), "{v}");
    assert_eq!(v["type"], "budget.threshold_crossed");
    assert_eq!(v["subject"]["kind"], "user");
    assert!(a.id.starts_with("user:"), "{}", a.id);
}

/// 240 reserves of 1 token from two pods at once on a 100-token plan with
/// alerts at 80 % and 100 %: each threshold crossed once, delivered once,
/// though two deliverers race for the outbox.
async fn crossings_are_delivered_exactly_once(store: Store) {
    let receiver = Receiver::start().await;
    let pods = Pods::start(store, config(&receiver.url, true)).await;
    let u = user("load");
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..240 {
        let ledger = Arc::clone(&pods.ledgers[i % 2]);
        let u = u.clone();
        calls.spawn(async move { reserve(ledger.as_ref(), &u, 1).await });
    }
    let mut allowed = 0;
    while let Some(ok) = calls.join_next().await {
        allowed += usize::from(ok.unwrap());
    }
    assert_eq!(allowed, 100);
    receiver.wait_for(2, Duration::from_secs(30)).await;
    // Time for a duplicate to show, if any could.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 2, "{:?}", receiver.arrivals());
    assert_eq!(receiver.arrivals().len(), 2, "no failed attempt either");
    let mut seen = BTreeSet::new();
    for (a, v) in &delivered {
        check_delivery(a, v);
        assert_eq!(v["user"], u.as_str());
        assert_eq!(v["window_ms"], 3_600_000);
        assert_eq!(v["limit"], 100);
        seen.insert((v["threshold"].to_string(), v["used"].as_u64().unwrap()));
    }
    assert_eq!(
        seen,
        BTreeSet::from([("0.8".to_owned(), 80), ("1".to_owned(), 100)])
    );
    assert_ne!(delivered[0].0.id, delivered[1].0.id);
    assert_eq!(pods.counted("delivered"), 2);
    // What the dashboard reads, the same from either pod: both deliverers'
    // attempts, counted where they share the store.
    for outbox in &pods.outboxes {
        let d = outbox.deliveries().await.unwrap();
        assert_eq!((d.delivered, d.retried, d.failed), (2, 0, 0), "{d:?}");
    }
    // Everything acked: the outbox is empty.
    let depth = pods.outboxes[0].depth().await.unwrap();
    assert_eq!(depth.subjects, 0, "{depth:?}");
    pods.stop().await;
}

/// The receiver answers 500 for 10 s: the alert is retried with back-off,
/// and delivered once after it recovers.
async fn a_receiver_down_gets_the_alert_once_it_is_back(store: Store) {
    let receiver = Receiver::start().await;
    receiver.hook.status.store(500, Ordering::SeqCst);
    let pods = Pods::start(store, config(&receiver.url, true)).await;
    let u = user("down");
    assert!(reserve(pods.ledgers[0].as_ref(), &u, 85).await);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let failed = receiver.arrivals();
    assert!(failed.len() >= 3, "retried while down: {failed:?}");
    assert!(failed
        .iter()
        .all(|a| a.answered == 500 && a.id == failed[0].id));
    assert!(receiver.delivered().is_empty());
    receiver.hook.status.store(200, Ordering::SeqCst);
    let delivered = receiver.wait_for(1, Duration::from_secs(15)).await;
    assert_eq!(delivered.len(), 1, "{:?}", receiver.arrivals());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 1, "{:?}", receiver.arrivals());
    let (a, v) = &delivered[0];
    check_delivery(a, v);
    assert_eq!(a.id, failed[0].id, "the same alert, retried");
    assert_eq!(
        (v["threshold"].as_f64(), v["used"].as_u64()),
        (Some(0.8), Some(85))
    );
    assert!(pods.counted("retried") >= 3);
    assert_eq!(pods.counted("delivered"), 1);
    assert_eq!(pods.counted("failed"), 0);
    // The dashboard's panel: the retries and why, then the delivery.
    let d = pods.outboxes[1].deliveries().await.unwrap();
    assert_eq!(d.delivered, 1, "{d:?}");
    assert!(d.retried >= 3, "{d:?}");
    assert_eq!(d.last_failure.as_deref(), Some("answered 500"), "{d:?}");
    assert!(d.last_failure_ms.is_some(), "{d:?}");
    pods.stop().await;
}

/// A window's usage that falls back below a threshold by a refund or a
/// settle down and rises to it again crosses nothing new: the threshold
/// stays crossed; only the window sliding (events leaving it) re-arms it.
/// Rising further above crosses nothing either.
async fn falling_below_and_rising_again_is_a_new_crossing_only_once_the_window_slid(store: Store) {
    let receiver = Receiver::start().await;
    let pods = Pods::start(store, config(&receiver.url, true)).await;
    let ledger = pods.ledgers[0].as_ref();
    let u = user("again");
    ledger.set_plan(&u, "short").await.unwrap();
    // 8 of 10: crosses 80 %.
    let first = rid();
    assert!(ledger.reserve(&u, &first, 8).await.unwrap().is_allowed());
    assert!(reserve(ledger, &u, 1).await, "9: no new crossing");
    // A refund takes it below; a raised settle takes it back up: the same
    // crossing, no new alert.
    ledger.refund(&u, &first).await.unwrap();
    let settled = rid();
    assert!(ledger.reserve(&u, &settled, 2).await.unwrap().is_allowed());
    ledger.settle(&u, &settled, 7).await.unwrap();
    // Down by a settle, up again by a reserve: still the same crossing.
    ledger.settle(&u, &settled, 1).await.unwrap();
    assert!(reserve(ledger, &u, 6).await);
    // Events leave the 1.5 s window; 8 more cross again.
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert!(reserve(ledger, &u, 8).await);
    receiver.wait_for(2, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 2, "{:?}", receiver.arrivals());
    let mut used: Vec<u64> = Vec::new();
    let mut ids = BTreeSet::new();
    for (a, v) in &delivered {
        check_delivery(a, v);
        assert_eq!(v["window_ms"], 1500);
        assert_eq!(v["threshold"].as_f64(), Some(0.8));
        used.push(v["used"].as_u64().unwrap());
        ids.insert(a.id.clone());
    }
    used.sort_unstable();
    assert_eq!(used, [8, 8]);
    assert_eq!(ids.len(), 2);
    pods.stop().await;
}

fn job_charge(nonce: &str, cost: u64) -> ChargeRequest<'_> {
    ChargeRequest {
        cost,
        nonce,
        operation: "op",
        model: "",
        service_key: None,
        fingerprint: "f",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(5),
        price: None,
    }
}

/// A job charged (and admitted), then released because it failed: `n`
/// times, each a charge that crosses `u`'s threshold at admission.
async fn failing_calls(ledger: &dyn Ledger, u: &UserId, n: usize, cost: u64) {
    for i in 0..n {
        let (request, nonce) = (rid(), format!("n{i}"));
        let charged = ledger
            .charge(u, &request, &job_charge(&nonce, cost))
            .await
            .unwrap();
        assert!(
            matches!(charged, ChargeOutcome::Charged { .. }),
            "{charged:?}"
        );
        let released = ledger.release(u, &request, &nonce).await.unwrap();
        assert!(
            matches!(released, RefundOutcome::Refunded { .. }),
            "{released:?}"
        );
    }
}

/// A user on `plan` (the default when `None`) parked at 79 of 100 whose 50
/// calls each cross 80 % at admission and are released (the job failed):
/// nothing spent, and exactly one alert delivered, at 0.8 with `used` 80.
/// Returns the pods and that alert's payload.
async fn park_and_fail(store: Store, name: &str, plan: Option<&str>) -> (Pods, Value) {
    let receiver = Receiver::start().await;
    let pods = Pods::start(store, config(&receiver.url, true)).await;
    let ledger = pods.ledgers[0].as_ref();
    let u = user(name);
    if let Some(plan) = plan {
        ledger.set_plan(&u, plan).await.unwrap();
    }
    assert!(reserve(ledger, &u, 79).await);
    failing_calls(ledger, &u, 50, 1).await;
    assert_eq!(ledger.usage(&u).await.unwrap().used, 79, "used unchanged");
    receiver.wait_for(1, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 1, "{:?}", receiver.arrivals());
    let (a, v) = &delivered[0];
    check_delivery(a, v);
    assert_eq!(v["threshold"].as_f64(), Some(0.8), "{v}");
    assert_eq!(v["used"], 80, "{v}");
    (pods, v.clone())
}

/// A user parked just below 80 % whose 50 calls each cross it at admission
/// and are released (the job failed): one crossing, one alert; nothing
/// spent.
async fn free_failing_calls_cross_once(store: Store) {
    let (pods, _) = park_and_fail(store, "free", None).await;
    let depth = pods.outboxes[0].depth().await.unwrap();
    assert_eq!(depth.subjects, 0, "nothing else queued: {depth:?}");
    pods.stop().await;
}

/// Free failing calls cross once; once the user's old events left the
/// window, crossing again (the same way) is a new crossing: one alert per
/// window.
async fn the_window_sliding_re_arms_a_threshold(store: Store) {
    let receiver = Receiver::start().await;
    let pods = Pods::start(store, config(&receiver.url, true)).await;
    let ledger = pods.ledgers[0].as_ref();
    let u = user("slide");
    ledger.set_plan(&u, "short").await.unwrap();
    assert!(reserve(ledger, &u, 7).await);
    failing_calls(ledger, &u, 4, 1).await;
    // The 7 leave the 1.5 s window (and so do the released calls).
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert!(reserve(ledger, &u, 7).await);
    failing_calls(ledger, &u, 4, 1).await;
    receiver.wait_for(2, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 2, "{:?}", receiver.arrivals());
    for (a, v) in &delivered {
        check_delivery(a, v);
        assert_eq!(v["window_ms"], 1500);
        assert_eq!(v["used"], 8);
    }
    pods.stop().await;
}

/// A calendar period's threshold counts once per crossing per period, on the
/// period's own counter: a user parked just below 80 % of its month whose 50
/// calls each cross it at admission and are released sends one alert, whose
/// span is the month's, and its hourly window (not near 80 %) sends none.
async fn a_periods_free_failing_calls_cross_once(store: Store) {
    let (pods, v) = park_and_fail(store, "month", Some("monthly")).await;
    assert_eq!(v["limit"], 100, "the month's limit: {v}");
    // A month in Berlin is 28 to 31 days, give or take a DST hour.
    let span = v["window_ms"].as_u64().unwrap();
    assert!(
        (28 * 86_400_000 - 3_600_000..=31 * 86_400_000 + 3_600_000).contains(&span),
        "the month's span: {v}"
    );
    pods.stop().await;
}

/// Two members of one organisation on two pods spend 120 tokens at once on
/// plans that never alert; the organisation's plan (100, alerts at 80 % and
/// 100 %) binds: its two crossings are the organisation's alerts, each
/// delivered once, and no user alert is queued.
async fn an_organisations_crossings_are_its_own_alerts(store: Store) {
    let receiver = Receiver::start().await;
    let pods = Pods::start(store, config(&receiver.url, true)).await;
    let org = OrgId::new(format!("acme-{}", random_prefix())).unwrap();
    let first = pods.ledgers[0].as_ref();
    first.set_org_plan(&org, "p").await.unwrap();
    let members = [user("orga"), user("orgb")];
    for u in &members {
        first.set_plan(u, "quiet").await.unwrap();
        first.set_user_org(u, Some(&org)).await.unwrap();
    }
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..120 {
        let ledger = Arc::clone(&pods.ledgers[i % 2]);
        let u = members[(i / 2) % 2].clone();
        calls.spawn(async move { reserve(ledger.as_ref(), &u, 1).await });
    }
    let mut allowed = 0;
    while let Some(ok) = calls.join_next().await {
        allowed += usize::from(ok.unwrap());
    }
    assert_eq!(allowed, 100, "the organisation's limit binds");
    receiver.wait_for(2, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 2, "{:?}", receiver.arrivals());
    let mut seen = BTreeSet::new();
    for (a, v) in &delivered {
        assert!(signature_ok(SECRET, &a.signature, &a.body), "{a:?}");
        assert_eq!(v["subject"]["kind"], "org", "{v}");
        assert_eq!(v["subject"]["id"], org.as_str(), "{v}");
        assert_eq!(v["org"], org.as_str(), "{v}");
        assert!(v.get("user").is_none(), "{v}");
        assert!(a.id.starts_with("org:"), "{}", a.id);
        assert_eq!(v["limit"], 100);
        seen.insert((v["threshold"].to_string(), v["used"].as_u64().unwrap()));
    }
    assert_eq!(
        seen,
        BTreeSet::from([("0.8".to_owned(), 80), ("1".to_owned(), 100)])
    );
    pods.stop().await;
}

on_each_backend!(
    threads 4,
    [
        crossings_are_delivered_exactly_once,
        a_receiver_down_gets_the_alert_once_it_is_back,
        falling_below_and_rising_again_is_a_new_crossing_only_once_the_window_slid,
        free_failing_calls_cross_once,
        the_window_sliding_re_arms_a_threshold,
        a_periods_free_failing_calls_cross_once,
        an_organisations_crossings_are_its_own_alerts,
    ]
    memory => super::Store::Memory,
    redis => super::Store::Redis,
    cluster => super::Store::Cluster,
);

/// Without `[alerts]` a plan's thresholds queue nothing: no outbox key is
/// ever written, and the memory outbox stays empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_alerts_nothing_is_queued() {
    let config = config("http://127.0.0.1:9/unused", false);
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger = tollgate_tests::redis_ledger(&server.url(), &prefix, Arc::clone(&config)).await;
    let u = user("quiet");
    assert!(reserve(&ledger, &u, 100).await);
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = ::redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!keys.is_empty());
    assert!(
        keys.iter().all(|k| !k.contains("alert")),
        "no outbox without [alerts]: {keys:?}"
    );
    let meta: Vec<String> = ::redis::cmd("HKEYS")
        .arg(keys.iter().find(|k| k.ends_with(":meta")).unwrap())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!meta.contains(&"a".to_owned()), "{meta:?}");

    let alerts = MemoryAlerts::new(Arc::new(SystemClock));
    let memory = MemoryLedger::new(Arc::clone(&config)).with_alerts(alerts.clone());
    assert!(reserve(&memory, &u, 100).await);
    let taken = alerts.take(10, Duration::from_secs(1)).await.unwrap();
    assert!(taken.alerts.is_empty());
}

/// A budget step's caller that dies before it adds the outbox's pointer
/// loses no alert: the subject's next budget step, 10 s on, has its caller add
/// it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_pointer_is_added_again_by_the_next_step() {
    let receiver = Receiver::start().await;
    let config = config(&receiver.url, true);
    let server = RedisServer::start();
    let prefix = random_prefix();
    let keys = KeySpace::new(&prefix).unwrap();
    let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
        .await
        .unwrap();
    let ledger = RedisLedger::new(pool.clone(), keys.clone(), Arc::clone(&config));
    let u = user("lost");
    assert!(reserve(&ledger, &u, 80).await);
    // The pointer the caller added (in the background) is lost, as if the
    // caller had died first.
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n: u64 = ::redis::cmd("ZCARD")
            .arg(keys.alert_due())
            .query_async(&mut conn)
            .await
            .unwrap();
        if n == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the caller adds the pointer");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _: () = ::redis::cmd("DEL")
        .arg(keys.alert_due())
        .query_async(&mut conn)
        .await
        .unwrap();
    let crossed = Instant::now();
    let metrics = Arc::new(Metrics::new(&config));
    let mut d = Deliverer::new(
        config.alerts().unwrap(),
        SECRET.to_vec(),
        Arc::new(RedisAlerts::new(pool, keys)),
        metrics,
    )
    .unwrap();
    d.poll = Duration::from_millis(100);
    let (stop, mut rx) = watch::channel(false);
    let task = tokio::spawn(d.run(async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    // A step of the user within 10 s does not add it (a deliverer may be
    // on it): nothing is delivered.
    assert!(reserve(&ledger, &u, 1).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(receiver.arrivals().is_empty());
    // Past 10 s the next step's caller adds it again.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(crossed.elapsed())).await;
    assert!(reserve(&ledger, &u, 1).await);
    let delivered = receiver.wait_for(1, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(receiver.arrivals().len(), 1, "{:?}", receiver.arrivals());
    let (a, v) = &delivered[0];
    check_delivery(a, v);
    assert_eq!(v["used"], 80);
    let _ = stop.send(true);
    task.await.unwrap();
}

fn all_config(dir: &std::path::Path, url: &str) -> std::path::PathBuf {
    let path = dir.join("alerts.toml");
    std::fs::write(
        &path,
        format!(
            r#"
default_plan = "p"
[alerts]
url = "{url}"
secret_env = "TOLLGATE_TEST_ALERT_SECRET"
[plans.p]
limit = 10
window = "1h"
alerts = [0.5, 1.0]
[providers.mock]
rate = 1000
burst = 100
max_wait = "10s"
[operations.op]
cost = 1
provider = "mock"
"#
        ),
    )
    .unwrap();
    path
}

/// `tollgate all` (embedded): calls over HTTP cross 50 % and 100 % of the
/// development user's budget; its deliverer sends each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tollgate_all_delivers_its_crossings_once() {
    let receiver = Receiver::start().await;
    let dir = std::env::temp_dir().join(format!("tollgate-alerts-{}", random_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = all_config(&dir, &receiver.url);
    let secret = std::str::from_utf8(SECRET).unwrap();
    let (child, lines) = tollgate_tests::process::spawn_reading_with(
        &[
            "all",
            "--listen",
            "127.0.0.1:0",
            "--config",
            path.to_str().unwrap(),
        ],
        &[("TOLLGATE_TEST_ALERT_SECRET", secret)],
        |l| l.iter().any(|l| l.contains("/v1/usage")),
    );
    let _procs = tollgate_tests::process::Procs(vec![child]);
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    let (base, key, admin) = (
        find("listening on "),
        find("Bearer "),
        find("admin token: "),
    );
    tollgate_providers::http::install_crypto_provider();
    let http = reqwest::Client::new();
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..15 {
        let (http, base, key) = (http.clone(), base.clone(), key.clone());
        calls.spawn(async move {
            http.post(format!("{base}/v1/ops/op"))
                .bearer_auth(&key)
                .header("Prefer", "respond-async")
                .json(&serde_json::json!({"q": 1}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        });
    }
    let mut accepted = 0;
    while let Some(status) = calls.join_next().await {
        let status = status.unwrap();
        assert!(matches!(status, 200 | 202 | 429), "{status}");
        accepted += usize::from(status != 429);
    }
    assert_eq!(accepted, 10);
    receiver.wait_for(2, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let delivered = receiver.delivered();
    assert_eq!(delivered.len(), 2, "{:?}", receiver.arrivals());
    let mut seen = BTreeSet::new();
    for (a, v) in &delivered {
        check_delivery(a, v);
        seen.insert((v["threshold"].to_string(), v["used"].as_u64().unwrap()));
    }
    assert_eq!(
        seen,
        BTreeSet::from([("0.5".to_owned(), 5), ("1".to_owned(), 10)])
    );
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("tollgate_alert_deliveries_total{result=\"delivered\"} 2"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("alert"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The dashboard's alerts panel: the deliveries, nothing waiting.
    let overview: Value = http
        .get(format!("{base}/admin/overview"))
        .bearer_auth(&admin)
        .fetch_json()
        .await;
    let panel = &overview["alerts"];
    assert_eq!(panel["delivered"], 2, "{overview}");
    assert_eq!(panel["failed"], 0, "{overview}");
    assert_eq!(panel["waiting_subjects"], 0, "{overview}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `[alerts] secret_env` naming a variable that is not set: `tollgate all`
/// and `tollgate worker` refuse to start, naming it.
#[test]
fn a_missing_secret_is_a_start_up_error() {
    let dir = std::env::temp_dir().join(format!("tollgate-alerts-{}", random_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = all_config(&dir, "http://127.0.0.1:9/hook");
    for role in ["all", "worker"] {
        let out = std::process::Command::new(tollgate_tests::workspace_bin("tollgate"))
            .args([role, "--config", path.to_str().unwrap()])
            .args(if role == "all" {
                &["--listen", "127.0.0.1:0"][..]
            } else {
                &["--redis-url", "redis://127.0.0.1:9"][..]
            })
            .env_remove("TOLLGATE_TEST_ALERT_SECRET")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{role}: {stderr}");
        assert!(
            stderr.contains("TOLLGATE_TEST_ALERT_SECRET"),
            "{role}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
