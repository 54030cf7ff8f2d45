//! A property test of charge ownership: random interleavings of submits,
//! retries with a shared key (same or another operation or body), submissions
//! that die after their charge, workers that succeed, fail, or die holding a
//! lease, maintenance, and time passing. Whatever happened, once the jobs have
//! drained and every hold has ended: each user's live charges add up to the
//! cost of the jobs that succeeded, every successful provider call was paid by
//! exactly one live charge, and no charge paid for two calls.
//!
//! proptest over the memory backend (a manual clock), and a shorter run on
//! Redis (real time, short deadlines). `TOLLGATE_MODEL_CASES=20000` is the
//! long form (the Redis run gets a fortieth of it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;
use tollgate_core::job::JobOptions;
use tollgate_core::{
    clock::ManualClock,
    config::Config,
    id::{RequestId, UserId},
    job::{JobQueue, JobRequest, JobSource, JobStatus},
    job_memory::MemoryJobQueue,
    ledger::{ChargeRequest, Ledger},
    memory::MemoryLedger,
};
use tollgate_tests::RedisServer;

const CONFIG: &str = r#"
hold_grace = "300ms"
[plans.free]
limit = 60
window = "1d"
[providers.p]
rate = 1000
burst = 100
max_wait = "5s"
[operations.a]
cost = 10
provider = "p"
deadline = "1s"
max_attempts = 2
[operations.b]
cost = 3
provider = "p"
deadline = "1s"
max_attempts = 2
"#;

const OPS: [&str; 2] = ["a", "b"];
const USERS: [&str; 2] = ["u0", "u1"];

fn options() -> JobOptions {
    JobOptions {
        result_ttl: Duration::from_secs(3600),
        poll: Duration::from_millis(20),
        refund_grace: Duration::ZERO,
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// A request: user, Idempotency-Key, operation, body.
    Submit(usize, u8, usize, u8),
    /// The same, but the api pod dies right after the charge.
    Crash(usize, u8, usize, u8),
    /// A worker takes a job of the operation and finishes it.
    Work(usize, bool),
    /// A worker takes a job and dies holding it.
    Die(usize),
    Maintain,
    Advance(u16),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..2usize, 0..4u8, 0..2usize, 0..2u8).prop_map(|(u, k, o, b)| Step::Submit(u, k, o, b)),
        1 => (0..2usize, 0..4u8, 0..2usize, 0..2u8).prop_map(|(u, k, o, b)| Step::Crash(u, k, o, b)),
        4 => (0..2usize, any::<bool>()).prop_map(|(o, ok)| Step::Work(o, ok)),
        1 => (0..2usize).prop_map(Step::Die),
        1 => Just(Step::Maintain),
        2 => (0..1500u16).prop_map(Step::Advance),
    ]
}

fn request(user: usize, key: u8, op: usize, body: u8) -> JobRequest {
    JobRequest {
        id: RequestId::new(format!("k{key}")).unwrap(),
        user: UserId::new(USERS[user]).unwrap(),
        operation: OPS[op].into(),
        input: json!({ "body": body }),
        trace: None,
    }
}

/// What the fake provider saw: successful calls by (user, id, nonce), with cost.
#[derive(Default)]
struct Upstream {
    calls: BTreeMap<(String, String, String), (u32, u64)>,
}

async fn run(
    steps: &[Step],
    queue: &dyn JobQueue,
    source: &dyn JobSource,
    ledger: &dyn Ledger,
    advance: &(dyn Fn(Duration) + Sync),
    block: Duration,
) -> Result<(), TestCaseError> {
    let config = queue.config().clone();
    let mut upstream = Upstream::default();
    let lease = Duration::from_millis(400);
    let take = |op: usize| source.take(OPS[op], "w", block, lease);
    for s in steps {
        match *s {
            Step::Submit(u, k, o, b) => {
                // Outcomes and errors are all allowed; the invariant is checked at the end.
                let _ = queue.submit(request(u, k, o, b)).await;
            }
            Step::Crash(u, k, o, b) => {
                let r = request(u, k, o, b);
                let op = config.operation(OPS[o]).unwrap();
                let nonce = tollgate_core::job::nonce();
                let fp = tollgate_core::job::fingerprint(&r.input);
                let charge = ChargeRequest {
                    cost: op.cost,
                    nonce: &nonce,
                    operation: &op.name,
                    fingerprint: &fp,
                    deadline: op.deadline,
                    grace: config.hold_grace(),
                };
                let _ = ledger.charge(&r.user, &r.id, &charge).await;
            }
            Step::Work(o, ok) => {
                if let Ok(Some(l)) = take(o).await {
                    if !source.start(&l).await.unwrap() {
                        continue;
                    }
                    if ok {
                        if source.complete(&l, json!({})).await.unwrap()
                            == tollgate_core::job::Finish::Recorded
                        {
                            let e = upstream
                                .calls
                                .entry((
                                    l.job.user.to_string(),
                                    l.job.id.to_string(),
                                    l.job.nonce.clone(),
                                ))
                                .or_insert((0, l.job.cost));
                            e.0 += 1;
                        }
                    } else {
                        source
                            .fail(
                                &l,
                                tollgate_core::job::FailureCause::Provider,
                                tollgate_core::job::Charge::RELEASE,
                                "boom",
                            )
                            .await
                            .unwrap();
                    }
                }
            }
            Step::Die(o) => {
                if let Ok(Some(l)) = take(o).await {
                    let _ = source.start(&l).await;
                }
            }
            Step::Maintain => {
                source.maintain("w", lease).await.unwrap();
            }
            Step::Advance(ms) => advance(Duration::from_millis(u64::from(ms))),
        }
    }
    // Drain: let every lease, deadline and hold end, then take what is left
    // (expired jobs fail and release their charges).
    advance(Duration::from_millis(2500));
    for _ in 0..3 {
        source.maintain("w", lease).await.unwrap();
        for o in 0..OPS.len() {
            while take(o).await.unwrap().is_some() {}
        }
    }
    for (u, name) in USERS.iter().enumerate() {
        let user = UserId::new(*name).unwrap();
        let usage = ledger.usage(&user).await.unwrap();
        let live: BTreeSet<String> = usage
            .events
            .iter()
            .map(|e| e.request_id.to_string())
            .collect();
        let mut succeeded = 0;
        for k in 0..4u8 {
            let id = RequestId::new(format!("k{k}")).unwrap();
            if let Some(info) = queue.status(&user, &id).await.unwrap() {
                prop_assert!(
                    info.status.is_final(),
                    "{info:?} still open after the drain"
                );
                if matches!(info.status, JobStatus::Succeeded { .. }) {
                    succeeded += info.job.cost;
                    prop_assert!(
                        live.contains(id.as_str()),
                        "{id} succeeded unpaid (user {u})"
                    );
                }
            }
        }
        prop_assert_eq!(
            usage.used,
            succeeded,
            "user {}: live charges vs succeeded jobs",
            name
        );
        let paid: u64 = upstream
            .calls
            .iter()
            .filter(|((who, id, _), _)| who == name && live.contains(id))
            .map(|(_, (n, cost))| u64::from(*n) * cost)
            .sum();
        prop_assert_eq!(
            usage.used,
            paid,
            "user {}: provider calls vs live charges",
            name
        );
        for ((who, id, nonce), (n, _)) in &upstream.calls {
            prop_assert!(*n == 1, "{who}/{id}/{nonce} ran {n} times");
        }
    }
    Ok(())
}

/// Cases per run: `TOLLGATE_MODEL_CASES` (the long form: e.g. 20000), else `short`.
fn cases(short: u32) -> u32 {
    std::env::var("TOLLGATE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(short)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(512), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn memory_charges_always_match_the_work_they_paid_for(steps in proptest::collection::vec(step(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let config = Arc::new(Config::parse(CONFIG, "model").unwrap());
            let clock = Arc::new(ManualClock::new(1_000_000));
            let ledger = Arc::new(MemoryLedger::with_clock(Arc::clone(&config), Arc::clone(&clock)));
            let queue = MemoryJobQueue::with_clock(config, ledger.clone(), clock.clone(), options());
            let advance = move |d: Duration| clock.advance(d);
            run(&steps, &queue, &queue, &*ledger, &advance, Duration::ZERO).await
        })?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(6) / 40 + 6, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn redis_charges_always_match_the_work_they_paid_for(steps in proptest::collection::vec(step(), 1..25)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let server = RedisServer::start();
            let config = Arc::new(Config::parse(CONFIG, "model").unwrap());
            let (queue, ledger) = crate::jobs::redis_queue_with(
                &server,
                &tollgate_tests::random_prefix(),
                config,
                options(),
            )
            .await;
            // Real time; the steps' pauses a fifth as long, to keep it short.
            let advance = |d: Duration| std::thread::sleep(d);
            let steps: Vec<Step> = steps
                .into_iter()
                .map(|s| match s {
                    Step::Advance(ms) => Step::Advance(ms / 5),
                    other => other,
                })
                .collect();
            run(&steps, &*queue, &*queue, &*ledger, &advance, Duration::from_millis(10)).await
        })?;
    }
}
