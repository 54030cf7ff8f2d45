//! The ledger under its jobs, both backends, through the queue's contract (the
//! api submits, a worker takes, claims, settles, completes): a settle never
//! takes a window past its limit, a plan round trip keeps every event and a
//! queued job paid, and an operator's refund of a queued job cancels it (it
//! never reaches the provider) while a running job's is a conflict.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tollgate_core::job::Taker;
use tollgate_core::{
    clock::ManualClock,
    config::Config,
    id::{RequestId, UserId},
    job::{FailureCause, JobOptions, JobQueue, JobRequest, JobSource, JobStatus, SubmitOutcome},
    ledger::{ChangeKind, Ledger, OperatorSettleOutcome, RefundOutcome},
};
use tollgate_memory::jobs::MemoryJobQueue;
use tollgate_memory::ledger::MemoryLedger;
use tollgate_tests::{random_prefix, RedisServer};

const CONFIG: &str = r#"
default_plan = "thousand"
hold_grace = "60s"
[export]
maxlen = 10000
[plans.thousand]
limit = 1000
window = "1d"
[plans.thirty]
limit = 30
window = "1d"
[plans.quick]
limit = 10
window = "1s"
[providers.p]
rate = 100000
burst = 100000
max_wait = "5s"
[operations.llm]
cost = 8
provider = "p"
settle = { from = "/usage/total_tokens", per = 100, max = 40 }
[operations.research]
cost = 20
provider = "p"
"#;

/// The queue, its worker side and its ledger, and how time passes for them.
struct Setup {
    queue: Arc<dyn JobQueue>,
    source: Arc<dyn JobSource>,
    ledger: Arc<dyn Ledger>,
    clock: Option<Arc<ManualClock>>,
    _redis: Option<RedisServer>,
}

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "ledger_jobs").expect("test config"))
}

fn options() -> JobOptions {
    JobOptions {
        result_ttl: Duration::from_secs(3600),
        poll: Duration::from_millis(20),
        release_grace: Duration::ZERO,
    }
}

impl Setup {
    fn memory() -> Self {
        let config = config();
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let ledger = Arc::new(MemoryLedger::with_clock(
            Arc::clone(&config),
            Arc::clone(&clock),
        ));
        let queue = Arc::new(MemoryJobQueue::with_clock(
            config,
            ledger.clone(),
            clock.clone(),
            options(),
        ));
        Self {
            queue: queue.clone(),
            source: queue,
            ledger,
            clock: Some(clock),
            _redis: None,
        }
    }

    async fn redis() -> Self {
        let server = RedisServer::start();
        let (queue, ledger) =
            crate::jobs::redis_queue_with(&server, &random_prefix(), config(), options()).await;
        Self {
            queue: queue.clone(),
            source: queue,
            ledger,
            clock: None,
            _redis: Some(server),
        }
    }

    async fn pass(&self, d: Duration) {
        match &self.clock {
            Some(c) => c.advance(d),
            None => tokio::time::sleep(d).await,
        }
    }

    async fn submit(&self, user: &UserId, id: &str, operation: &str) -> SubmitOutcome {
        let request = JobRequest {
            id: RequestId::new(id).unwrap(),
            user: user.clone(),
            operation: operation.into(),
            input: json!({ "prompt": id }),
            trace: None,
            service_key: None,
        };
        self.queue.submit(request).await.unwrap()
    }

    /// A worker takes the next job of `operation` and claims its charge: the
    /// lease, and whether it may call the provider.
    async fn take(&self, operation: &str) -> Option<(tollgate_core::job::Lease, bool)> {
        let lease = self
            .source
            .take(
                operation,
                Taker::new("w", Duration::from_millis(50), Duration::from_secs(30)),
            )
            .await
            .unwrap()?;
        let claimed = self.source.start(&lease).await.unwrap();
        Some((lease, claimed))
    }

    async fn used(&self, user: &UserId) -> u64 {
        self.ledger.usage(user).await.unwrap().used
    }

    async fn status(&self, user: &UserId, id: &str) -> JobStatus {
        let id = RequestId::new(id).unwrap();
        self.queue.status(user, &id).await.unwrap().unwrap().status
    }
}

/// The answer of a provider that reports `tokens` used.
fn answer(tokens: u64) -> Value {
    json!({ "usage": { "total_tokens": tokens } })
}

/// Reproduction 6: 100 concurrent calls of an operation with `settle`
/// (estimate 8, max 40) under a limit of 1,000, each answered with the most.
async fn concurrent_settled_calls_never_pass_the_limit(s: Setup) {
    let user = UserId::new("settler").unwrap();
    let mut submits = tokio::task::JoinSet::new();
    for i in 0..100 {
        let queue = Arc::clone(&s.queue);
        let request = JobRequest {
            id: RequestId::new(format!("call-{i}")).unwrap(),
            user: user.clone(),
            operation: "llm".into(),
            input: json!({ "prompt": i }),
            trace: None,
            service_key: None,
        };
        submits.spawn(async move { queue.submit(request).await.unwrap() });
    }
    let mut queued = 0;
    while let Some(outcome) = submits.join_next().await {
        queued += usize::from(matches!(outcome.unwrap(), SubmitOutcome::Queued { .. }));
    }
    assert!(s.used(&user).await <= 1000);
    let mut ran = 0;
    while let Some((lease, claimed)) = s.take("llm").await {
        assert!(claimed);
        // The provider reports 4,000 tokens: 40 at 100 per token.
        s.source.settle(&lease, &answer(4000)).await.unwrap();
        s.source.complete(&lease, json!({})).await.unwrap();
        ran += 1;
        let usage = s.ledger.usage(&user).await.unwrap();
        for w in &usage.windows {
            assert!(w.used <= w.limit, "{ran} calls settled: {usage:?}");
        }
    }
    assert_eq!(ran, queued);
    let used = s.used(&user).await;
    assert!(
        used <= 1000,
        "used {used} of 1000 after {ran} settled calls"
    );
    assert_eq!(
        used,
        40 * ran as u64,
        "every call is charged what it reported"
    );
}

/// A settle comes down to what the provider reported; an answer that
/// reports nothing keeps what was reserved (the most it may have used, never
/// the estimate); the settled event keeps what was reserved.
async fn a_settle_comes_down_to_the_reported_cost(s: Setup) {
    let user = UserId::new("down").unwrap();
    let SubmitOutcome::Queued { job, allowed } = s.submit(&user, "small", "llm").await else {
        panic!("queued")
    };
    assert_eq!((job.cost, allowed.used), (40, 40), "the most is reserved");
    let (lease, _) = s.take("llm").await.unwrap();
    s.source.settle(&lease, &answer(250)).await.unwrap();
    s.source.complete(&lease, json!({})).await.unwrap();
    assert_eq!(s.used(&user).await, 3);
    s.submit(&user, "silent", "llm").await;
    let (lease, _) = s.take("llm").await.unwrap();
    s.source.settle(&lease, &json!({})).await.unwrap();
    s.source.complete(&lease, json!({})).await.unwrap();
    let usage = s.ledger.usage(&user).await.unwrap();
    assert_eq!(
        usage.used,
        3 + 40,
        "no usage reported: the reservation stands"
    );
    let figures: Vec<_> = usage.events.iter().map(|e| (e.cost, e.estimate)).collect();
    assert_eq!(figures, [(3, Some(40)), (40, None)]);
}

/// Reproduction 5: thirty per day → a one-second plan → back; a queued job
/// charged 20 on the way still runs paid.
async fn a_plan_round_trip_keeps_the_record(s: Setup) {
    let user = UserId::new("tripper").unwrap();
    s.ledger.set_plan(&user, "thirty").await.unwrap();
    let plain = RequestId::new("plain").unwrap();
    assert!(s
        .ledger
        .reserve(&user, &plain, 10)
        .await
        .unwrap()
        .is_allowed());
    let queued = s.submit(&user, "queued", "research").await;
    assert!(matches!(queued, SubmitOutcome::Queued { .. }), "{queued:?}");
    assert_eq!(s.used(&user).await, 30);
    s.ledger.set_plan(&user, "quick").await.unwrap();
    s.pass(Duration::from_millis(1300)).await;
    assert_eq!(s.used(&user).await, 0, "nothing in the quick plan's window");
    s.ledger.set_plan(&user, "thirty").await.unwrap();
    assert_eq!(s.used(&user).await, 30, "the round trip erased nothing");
    let more = RequestId::new("more").unwrap();
    assert!(!s
        .ledger
        .reserve(&user, &more, 1)
        .await
        .unwrap()
        .is_allowed());
    let (lease, claimed) = s.take("research").await.unwrap();
    assert!(claimed);
    s.source.complete(&lease, json!({})).await.unwrap();
    let usage = s.ledger.usage(&user).await.unwrap();
    assert_eq!(usage.used, 30, "{usage:?}");
    assert!(
        usage
            .events
            .iter()
            .any(|e| e.request_id.as_str() == "queued"),
        "the job that ran is paid by a live charge: {usage:?}"
    );
}

async fn refund(s: &Setup, user: &UserId, id: &str) -> RefundOutcome {
    let id = RequestId::new(id).unwrap();
    tollgate_core::refund::operator_refund(&*s.ledger, &*s.queue, user, &id)
        .await
        .unwrap()
}

/// Reproduction 4: an operator refunds a queued job's charge: the job is
/// cancelled and never reaches the provider; a running job's refund is a
/// conflict, a succeeded job's a plain credit.
async fn an_operator_refund_cancels_a_queued_job(s: Setup) {
    let user = UserId::new("refunded").unwrap();
    s.submit(&user, "queued", "research").await;
    assert_eq!(
        refund(&s, &user, "queued").await,
        RefundOutcome::Cancelled { cost: 20, used: 0 }
    );
    assert_eq!(
        refund(&s, &user, "queued").await,
        RefundOutcome::NotFound { used: 0 }
    );
    let (_, claimed) = s.take("research").await.unwrap();
    assert!(!claimed, "a cancelled job must not reach the provider");
    let status = s.status(&user, "queued").await;
    assert!(
        matches!(
            status,
            JobStatus::Failed {
                cause: FailureCause::Cancelled,
                ..
            }
        ),
        "{status:?}"
    );
    assert_eq!(s.used(&user).await, 0);

    // Running: its job owns the charge; nothing changes.
    s.submit(&user, "running", "research").await;
    let (lease, claimed) = s.take("research").await.unwrap();
    assert!(claimed);
    assert_eq!(
        refund(&s, &user, "running").await,
        RefundOutcome::Running { used: 20 }
    );
    s.source.complete(&lease, json!({})).await.unwrap();
    assert_eq!(s.used(&user).await, 20, "the job ran paid");
    // Final: the refund is a credit.
    assert_eq!(
        refund(&s, &user, "running").await,
        RefundOutcome::Refunded { cost: 20, used: 0 }
    );
    assert!(matches!(
        s.status(&user, "running").await,
        JobStatus::Succeeded { .. }
    ));
}

async fn settle(
    s: &Setup,
    user: &UserId,
    id: &str,
    cost: u64,
    force: bool,
) -> OperatorSettleOutcome {
    let id = RequestId::new(id).unwrap();
    tollgate_core::correction::operator_settle(&*s.ledger, &*s.queue, user, &id, cost, force)
        .await
        .unwrap()
}

/// Issue 51: an operator's settle to 0 of a running job's charge was accepted
/// (where a refund is refused), and the job then succeeded unpaid. A job's
/// charge is settled only once the job is final; to 0, when the job may have
/// run, only with force, and the export says so.
async fn an_operator_settle_waits_for_the_job_and_a_forced_one_is_exported(s: Setup) {
    let user = UserId::new("corrected").unwrap();
    // Queued (held) and running (owned): a conflict, nothing changes.
    s.submit(&user, "job", "research").await;
    assert_eq!(
        settle(&s, &user, "job", 0, false).await,
        OperatorSettleOutcome::Running { used: 20 }
    );
    let (lease, claimed) = s.take("research").await.unwrap();
    assert!(claimed, "the charge is still the job's");
    for (cost, force) in [(0, false), (0, true), (3, false)] {
        assert_eq!(
            settle(&s, &user, "job", cost, force).await,
            OperatorSettleOutcome::Running { used: 20 },
            "settle to {cost} (force: {force}) of a running job"
        );
    }
    s.source.complete(&lease, json!({})).await.unwrap();
    assert_eq!(s.used(&user).await, 20, "the job ran paid");
    // Final and it ran: to 0 only with force; another cost is a correction.
    assert_eq!(
        settle(&s, &user, "job", 0, false).await,
        OperatorSettleOutcome::MayHaveRun
    );
    assert_eq!(s.used(&user).await, 20);
    assert_eq!(
        settle(&s, &user, "job", 5, false).await,
        OperatorSettleOutcome::Settled {
            previous_cost: 20,
            cost: 5,
            used: 5
        }
    );
    assert_eq!(
        settle(&s, &user, "job", 0, true).await,
        OperatorSettleOutcome::Settled {
            previous_cost: 5,
            cost: 0,
            used: 0
        }
    );
    let export = s.ledger.exported(&user, 0, 100).await.unwrap();
    let kinds: Vec<_> = export.iter().map(|e| (e.kind, e.cost, e.forced)).collect();
    assert_eq!(
        kinds,
        [
            (ChangeKind::Spend, 20, false),
            (ChangeKind::Settle, 5, false),
            (ChangeKind::Refund, 5, true),
        ],
        "{export:?}"
    );
    // A plain reserve is settled to 0 without force, and not marked.
    let plain = RequestId::new("plain").unwrap();
    assert!(s
        .ledger
        .reserve(&user, &plain, 7)
        .await
        .unwrap()
        .is_allowed());
    assert_eq!(
        settle(&s, &user, "plain", 0, false).await,
        OperatorSettleOutcome::Settled {
            previous_cost: 7,
            cost: 0,
            used: 0
        }
    );
    let export = s.ledger.exported(&user, 0, 100).await.unwrap();
    assert!(
        export
            .last()
            .is_some_and(|e| e.kind == ChangeKind::Refund && !e.forced),
        "{export:?}"
    );
}

on_each_backend!(
    [
        concurrent_settled_calls_never_pass_the_limit,
        a_settle_comes_down_to_the_reported_cost,
        a_plan_round_trip_keeps_the_record,
        an_operator_refund_cancels_a_queued_job,
        an_operator_settle_waits_for_the_job_and_a_forced_one_is_exported,
    ]
    memory => super::Setup::memory(),
    redis => super::Setup::redis().await,
);
