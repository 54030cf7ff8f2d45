//! A property test of charge ownership: random interleavings of submits,
//! retries with a shared key (same or another operation or body), submissions
//! that die after their charge, workers whose call the upstream answers,
//! refuses (4xx), fails (5xx), leaves unanswered, answers unparsably, or
//! answers after the job's deadline, workers that die holding a lease
//! (maybe mid-call), maintenance, and time passing. The workers decide each
//! failure with the outcome policy (`tollgate_providers::outcome`). Whatever
//! happened, once the jobs have drained and every hold has ended: each user's
//! live charges plus what was absorbed add up to the cost of the jobs whose
//! upstream may have worked (one charge covers a job's runs), every such job
//! not absorbed is paid by a live charge, and no charge paid for two
//! successful calls. Operators refund (a queued job's refund cancels it: it
//! never reaches the upstream; a running job's is refused; a final job's is a
//! credit, counted like an absorbed cost), plans change, and jobs of an
//! operation with `settle` settle down to what the upstream reported: while a
//! user keeps its plan, no window ever holds more than its limit.
//!
//! proptest over the memory backend (a manual clock), and a shorter run on
//! Redis (real time, short deadlines). `TOLLGATE_MODEL_CASES=20000` is the
//! long form (the Redis run gets a fortieth of it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;
use tollgate_core::job::{Failure, JobOptions, Taker};
use tollgate_core::{
    clock::ManualClock,
    config::Config,
    id::{RequestId, UserId},
    job::{Charge, FailureCause, Finish, JobQueue, JobRequest, JobSource, JobStatus},
    ledger::{ChargeRequest, Ledger, RefundOutcome},
};
use tollgate_memory::jobs::MemoryJobQueue;
use tollgate_memory::ledger::MemoryLedger;
use tollgate_providers::outcome;
use tollgate_tests::RedisServer;

const CONFIG: &str = r#"
hold_grace = "300ms"
default_plan = "free"
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
max_runs = 2
[operations.b]
cost = 3
provider = "p"
deadline = "1s"
max_runs = 2
[operations.s]
cost = 4
provider = "p"
deadline = "1s"
max_runs = 2
settle = { from = "/tokens", max = 15 }
[plans.brief]
limit = 30
window = "600ms"
"#;

const OPS: [&str; 3] = ["a", "b", "s"];
const PLANS: [&str; 2] = ["free", "brief"];
const USERS: [&str; 2] = ["u0", "u1"];

fn options() -> JobOptions {
    JobOptions {
        result_ttl: Duration::from_secs(3600),
        poll: Duration::from_millis(20),
        release_grace: Duration::ZERO,
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// A request: user, Idempotency-Key, operation, body.
    Submit(usize, u8, usize, u8),
    /// The same, but the api pod dies right after the charge.
    Crash(usize, u8, usize, u8),
    /// A worker takes a job of the operation and calls; the upstream does
    /// what the outcome says (and, answering a job of `s`, reports the tokens
    /// used, if any).
    Work(usize, Outcome, Option<u8>),
    /// An operator refunds a user's request.
    Refund(usize, u8),
    /// A user's plan changes.
    Plan(usize, usize),
    /// A worker takes a job, starts its call and dies holding it (the
    /// upstream may have got the call).
    Die(usize),
    Maintain,
    Advance(u16),
}

/// What the upstream does with a worker's call.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// 200 with JSON.
    Answered,
    /// 400: refused before work.
    Refused,
    /// 500: failed, maybe after work (released, absorbed).
    ServerError,
    /// A timeout after the request was written.
    Unanswered,
    /// 200 with a body that is not JSON.
    Unparsable,
    /// 200 with JSON, after the job's deadline passed mid-call.
    LateAnswer,
}

impl Outcome {
    /// The attempt as the outcome policy sees it (`None`: answered).
    fn class(self) -> Option<outcome::Class> {
        match self {
            Self::Answered | Self::LateAnswer => None,
            Self::Refused => Some(outcome::Class::Refused { overload: false }),
            Self::ServerError => Some(outcome::Class::ServerError),
            Self::Unanswered => Some(outcome::Class::Unanswered),
            Self::Unparsable => Some(outcome::Class::BadAnswer),
        }
    }
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        3 => Just(Outcome::Answered),
        1 => Just(Outcome::Refused),
        1 => Just(Outcome::ServerError),
        1 => Just(Outcome::Unanswered),
        1 => Just(Outcome::Unparsable),
        1 => Just(Outcome::LateAnswer),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..2usize, 0..4u8, 0..3usize, 0..2u8).prop_map(|(u, k, o, b)| Step::Submit(u, k, o, b)),
        1 => (0..2usize, 0..4u8, 0..3usize, 0..2u8).prop_map(|(u, k, o, b)| Step::Crash(u, k, o, b)),
        4 => (0..3usize, outcome(), proptest::option::of(0..30u8)).prop_map(|(o, out, t)| Step::Work(o, out, t)),
        1 => (0..3usize).prop_map(Step::Die),
        1 => (0..2usize, 0..4u8).prop_map(|(u, k)| Step::Refund(u, k)),
        1 => (0..2usize, 0..2usize).prop_map(|(u, p)| Step::Plan(u, p)),
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
        service_key: None,
    }
}

/// A job's charge: (user, id, nonce).
type ChargeKey = (String, String, String);

/// What the fake provider saw: successful calls by charge, with cost; and
/// the charges whose upstream may have worked (a call answered, unanswered,
/// failed with a 5xx, or sent by a worker that died), with their cost and
/// whether the operator absorbed them.
///
/// Also: every charge whose job reached the upstream, the held charges an
/// operator cancelled (their jobs must never reach it), the final jobs'
/// charges an operator credited, and the users whose plan changed.
#[derive(Default)]
struct Upstream {
    calls: BTreeMap<ChargeKey, (u32, u64)>,
    worked: BTreeMap<ChargeKey, (u64, bool)>,
    arrivals: BTreeSet<ChargeKey>,
    cancelled: BTreeSet<ChargeKey>,
    credited: BTreeSet<ChargeKey>,
    replanned: BTreeSet<usize>,
}

impl Upstream {
    fn worked(&mut self, l: &tollgate_core::job::Lease, absorbed: bool) {
        let e = self.worked.entry(key(l)).or_insert((l.job.cost, absorbed));
        e.1 &= absorbed;
    }
}

fn key(l: &tollgate_core::job::Lease) -> ChargeKey {
    (
        l.job.user.to_string(),
        l.job.id.to_string(),
        l.job.nonce.clone(),
    )
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
    let take = |op: usize| source.take(OPS[op], Taker::new("w", block, lease));
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
                    cost: op.charged_cost(),
                    nonce: &nonce,
                    operation: &op.name,
                    model: "",
                    fingerprint: &fp,
                    deadline: op.deadline,
                    grace: config.hold_grace(),
                    service_key: None,
                    price: None,
                };
                let _ = ledger.charge(&r.user, &r.id, &charge).await;
            }
            Step::Work(o, out, tokens) => {
                if let Ok(Some(l)) = take(o).await {
                    if !source.start(&l).await.unwrap() {
                        continue;
                    }
                    upstream.arrivals.insert(key(&l));
                    if let Outcome::LateAnswer = out {
                        // The deadline passes while the call is in flight; the
                        // lease is renewed meanwhile, and the answer decides.
                        advance(l.time_left + Duration::from_millis(20));
                        source.renew(&l, lease).await.unwrap();
                    }
                    let Some(class) = out.class() else {
                        let answer = match tokens {
                            Some(t) => json!({ "tokens": t }),
                            None => json!({}),
                        };
                        // Settled down to what was reported; nothing
                        // reported keeps the reservation.
                        let op = config.operation(&l.job.operation).unwrap();
                        let cost = match &op.settle {
                            Some(rule) => rule.cost(&answer).unwrap_or(l.job.cost).min(l.job.cost),
                            None => l.job.cost,
                        };
                        source.settle(&l, &answer).await.unwrap();
                        if source.complete(&l, answer).await.unwrap() == Finish::Recorded {
                            upstream.calls.entry(key(&l)).or_insert((0, cost)).0 += 1;
                            upstream.worked(&l, false);
                            // One charge covers the job's runs: it costs what it settled to.
                            if let Some(e) = upstream.worked.get_mut(&key(&l)) {
                                e.0 = cost;
                            }
                        }
                        continue;
                    };
                    // The worker's decision: the policy's, as in the worker.
                    let mut tally = outcome::Tally::default();
                    tally.record(class);
                    let (mut cause, mut charge) = tally.failure(FailureCause::Provider);
                    if l.ran_before {
                        (cause, charge) = outcome::after_lost_run(cause, charge);
                    }
                    let recorded = source
                        .fail(&l, Failure::new(cause, charge, "boom"))
                        .await
                        .unwrap();
                    let may_have_worked = !matches!(class, outcome::Class::Refused { .. });
                    if recorded == Finish::Recorded && may_have_worked {
                        let absorbed = matches!(charge, Charge::Release { absorbed: Some(_) });
                        upstream.worked(&l, absorbed);
                    }
                }
            }
            Step::Die(o) => {
                if let Ok(Some(l)) = take(o).await {
                    if source.start(&l).await.unwrap_or(false) {
                        // The call may have gone out before the worker died.
                        upstream.arrivals.insert(key(&l));
                        upstream.worked(&l, false);
                    }
                }
            }
            Step::Maintain => {
                source.maintain("w", lease).await.unwrap();
            }
            Step::Refund(u, k) => {
                let user = UserId::new(USERS[u]).unwrap();
                let id = RequestId::new(format!("k{k}")).unwrap();
                let job = queue.status(&user, &id).await.unwrap();
                let out = tollgate_core::refund::operator_refund(ledger, queue, &user, &id)
                    .await
                    .unwrap();
                let charge = |info: &tollgate_core::job::JobInfo| {
                    (USERS[u].to_string(), id.to_string(), info.job.nonce.clone())
                };
                match (out, job) {
                    // A final job's charge: the operator's credit, counted like
                    // an absorbed cost.
                    (RefundOutcome::Refunded { .. }, Some(info)) if info.status.is_final() => {
                        if let Some(e) = upstream.worked.get_mut(&charge(&info)) {
                            e.1 = true;
                        }
                        upstream.credited.insert(charge(&info));
                    }
                    // (A final job's id whose charge was cancelled: another
                    // attempt's held charge, whose job was never made.)
                    (RefundOutcome::Cancelled { .. }, Some(info)) if !info.status.is_final() => {
                        upstream.cancelled.insert(charge(&info));
                    }
                    _ => {}
                }
            }
            Step::Plan(u, p) => {
                let user = UserId::new(USERS[u]).unwrap();
                ledger.set_plan(&user, PLANS[p]).await.unwrap();
                upstream.replanned.insert(u);
            }
            Step::Advance(ms) => advance(Duration::from_millis(u64::from(ms))),
        }
        // While a user keeps its plan, no window ever passes its limit.
        for (u, name) in USERS.iter().enumerate() {
            if upstream.replanned.contains(&u) {
                continue;
            }
            let usage = ledger.usage(&UserId::new(*name).unwrap()).await.unwrap();
            for w in &usage.windows {
                prop_assert!(w.used <= w.limit, "{name} after {s:?}: {usage:?}");
            }
        }
    }
    // Every user back on the plan of the longest window: every charge counts.
    for name in USERS {
        let user = UserId::new(name).unwrap();
        ledger.set_plan(&user, "free").await.unwrap();
    }
    for who in &upstream.cancelled {
        prop_assert!(
            !upstream.arrivals.contains(who),
            "{who:?} was cancelled, yet reached the upstream"
        );
    }
    // Drain: let every lease, deadline and hold end, then take what is left
    // (expired jobs fail and release their charges; those a dead worker had
    // started fail unanswered and keep them).
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
        for k in 0..4u8 {
            let id = RequestId::new(format!("k{k}")).unwrap();
            if let Some(info) = queue.status(&user, &id).await.unwrap() {
                prop_assert!(
                    info.status.is_final(),
                    "{info:?} still open after the drain"
                );
                let charge = (name.to_string(), id.to_string(), info.job.nonce.clone());
                if matches!(info.status, JobStatus::Succeeded { .. })
                    && !upstream.credited.contains(&charge)
                {
                    prop_assert!(
                        live.contains(id.as_str()),
                        "{id} succeeded unpaid (user {u})"
                    );
                }
            }
        }
        // Σ live charges + Σ absorbed = Σ jobs whose upstream may have worked.
        let mine = || upstream.worked.iter().filter(|((who, ..), _)| who == name);
        let worked: u64 = mine().map(|(_, (cost, _))| cost).sum();
        let absorbed: u64 = mine().filter(|(_, (_, a))| *a).map(|(_, (c, _))| c).sum();
        prop_assert_eq!(
            usage.used + absorbed,
            worked,
            "user {}: live charges + absorbed vs jobs whose upstream may have worked",
            name
        );
        for ((_, id, nonce), _) in mine().filter(|(_, (_, a))| !*a) {
            prop_assert!(
                live.contains(id),
                "{id}/{nonce} may have worked, unpaid (user {u})"
            );
        }
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
