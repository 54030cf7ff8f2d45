//! The job queue conformance suite: every queue semantic, written once, run
//! against the in-memory queue and the Redis queue (real time on both: leases
//! are a few hundred ms). Plus what only Redis has: a submission that crashed
//! between its steps, and malformed entries.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tollgate_core::job::{Failure, JobOptions, Taker};
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::{
        Charge, FailureCause, Finish, JobError, JobQueue, JobRequest, JobSource, JobStatus, Lease,
        Maintenance, SubmitOutcome,
    },
    ledger::Ledger,
};
use tollgate_memory::jobs::MemoryJobQueue;
use tollgate_memory::ledger::MemoryLedger;
use tollgate_providers::{Answer, CallError, CallOptions, Client};
use tollgate_redis::{jobs::RedisJobQueue, keys::KeySpace, ledger::RedisLedger, pool::PoolOptions};
use tollgate_tests::{random_prefix, slowlog, RedisServer, TestCluster};

pub const CONFIG: &str = r#"
hold_grace = "200ms"
default_plan = "free"
[plans.free]
limit = 100
window = "1h"
max_stored_bytes = 20000
[plans.roomy]
limit = 100
window = "1h"
max_stored_bytes = 40000
[providers.p]
rate = 1000
burst = 100
max_wait = "5s"
[operations.work]
cost = 10
provider = "p"
max_runs = 2
[operations.metered]
cost = 10
provider = "p"
settle = { from = "/usage/total_tokens", per = 100, max = 30 }
[operations.other]
cost = 1
provider = "p"
[operations.huge]
cost = 200
provider = "p"
"#;

const LEASE: Duration = Duration::from_millis(300);

pub fn options() -> JobOptions {
    JobOptions {
        result_ttl: Duration::from_secs(60),
        poll: Duration::from_millis(100),
        release_grace: Duration::ZERO,
    }
}

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "job conformance").expect("test config"))
}

fn user(s: &str) -> UserId {
    UserId::new(s).unwrap()
}

fn rid(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn request(id: &str, who: &str, operation: &str) -> JobRequest {
    JobRequest {
        id: rid(id),
        user: user(who),
        operation: operation.into(),
        input: json!({ "prompt": id }),
        trace: None,
        service_key: None,
    }
}

/// A job queue under test, both sides, and its ledger.
pub struct Setup {
    pub queue: Arc<dyn JobQueue>,
    pub source: Arc<dyn JobSource>,
    pub ledger: Arc<dyn Ledger>,
    _server: Option<RedisServer>,
    _cluster: Option<TestCluster>,
}

impl Setup {
    pub fn memory() -> Self {
        let config = config();
        let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let q = Arc::new(MemoryJobQueue::with_clock(
            config,
            Arc::clone(&ledger),
            Arc::new(tollgate_core::clock::SystemClock),
            options(),
        ));
        Self {
            queue: q.clone(),
            source: q,
            ledger,
            _server: None,
            _cluster: None,
        }
    }

    pub async fn redis() -> Self {
        let server = RedisServer::start();
        let (q, ledger) = redis_queue(&server, &random_prefix(), config()).await;
        Self {
            queue: q.clone(),
            source: q,
            ledger,
            _server: Some(server),
            _cluster: None,
        }
    }

    /// The Redis queue on a Redis Cluster (3 primaries, 3 replicas).
    pub async fn cluster() -> Self {
        let cluster = TestCluster::get();
        let (q, ledger) =
            redis_queue_at(&cluster.url(), &random_prefix(), config(), options()).await;
        Self {
            queue: q.clone(),
            source: q,
            ledger,
            _server: None,
            _cluster: Some(cluster),
        }
    }

    async fn used(&self, who: &str) -> u64 {
        self.ledger.usage(&user(who)).await.unwrap().used
    }
}

pub async fn redis_queue(
    server: &RedisServer,
    prefix: &str,
    config: Arc<Config>,
) -> (Arc<RedisJobQueue>, Arc<dyn Ledger>) {
    redis_queue_with(server, prefix, config, options()).await
}

pub async fn redis_queue_with(
    server: &RedisServer,
    prefix: &str,
    config: Arc<Config>,
    options: JobOptions,
) -> (Arc<RedisJobQueue>, Arc<dyn Ledger>) {
    redis_queue_at(&server.url(), prefix, config, options).await
}

async fn redis_queue_at(
    url: &str,
    prefix: &str,
    config: Arc<Config>,
    options: JobOptions,
) -> (Arc<RedisJobQueue>, Arc<dyn Ledger>) {
    let keys = KeySpace::new(prefix).unwrap();
    let pool = tollgate_redis::pool::connect(url, &PoolOptions::default())
        .await
        .expect("connect to the test Redis");
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
    ));
    let q = RedisJobQueue::new(pool, keys, config, Arc::clone(&ledger), options);
    (Arc::new(q), ledger)
}

async fn take(s: &Setup, operation: &str, worker: &str) -> tollgate_core::job::Lease {
    let lease = s
        .source
        .take(operation, Taker::new(worker, Duration::from_secs(2), LEASE))
        .await
        .unwrap()
        .expect("a job within 2s");
    assert!(
        s.source.start(&lease).await.unwrap(),
        "the job owns its charge"
    );
    lease
}

/// A lease whose run never starts (no claim, no call).
async fn take_unstarted(s: &Setup, operation: &str, worker: &str) -> tollgate_core::job::Lease {
    lease_from(&*s.source, operation, worker).await
}

/// The next job of `operation` from `source`, leased to `worker` (within 2 s).
async fn lease_from(source: &dyn JobSource, operation: &str, worker: &str) -> Lease {
    source
        .take(operation, Taker::new(worker, Duration::from_secs(2), LEASE))
        .await
        .unwrap()
        .expect("a job within 2s")
}

async fn submit_ok(s: &Setup, id: &str, who: &str) -> tollgate_core::job::Job {
    match s.queue.submit(request(id, who, "work")).await.unwrap() {
        SubmitOutcome::Queued { job, allowed } => {
            assert!(!allowed.duplicate);
            job
        }
        other => panic!("not queued: {other:?}"),
    }
}

async fn job_submit_reserves_once_and_only_the_owner_sees_it(s: &Setup) {
    let job = submit_ok(s, "j1", "alice").await;
    assert_eq!((job.cost, job.provider.as_str(), job.run), (10, "p", 0));
    assert!(job.deadline_ms > job.enqueued_at_ms);
    assert_eq!(s.used("alice").await, 10);
    // Idempotent by id: the same job back, nothing charged again.
    match s
        .queue
        .submit(request("j1", "alice", "work"))
        .await
        .unwrap()
    {
        SubmitOutcome::Duplicate { info, allowed } => {
            assert_eq!(info.job.id, job.id);
            assert_eq!(info.status, JobStatus::Queued);
            assert!(allowed.duplicate);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.used("alice").await, 10);
    // Another user cannot take the id (and keeps no charge for trying);
    // another operation or body under the same id is refused, charging nothing.
    let e = s.queue.submit(request("j1", "bob", "work")).await;
    assert!(matches!(e, Err(JobError::IdInUse(_))), "{e:?}");
    let e = s.queue.submit(request("j1", "alice", "other")).await;
    assert!(matches!(e, Err(JobError::KeyReused { .. })), "{e:?}");
    let mut other_body = request("j1", "alice", "work");
    other_body.input = json!({ "prompt": "something else" });
    let e = s.queue.submit(other_body).await;
    assert!(matches!(e, Err(JobError::KeyReused { .. })), "{e:?}");
    assert_eq!(s.used("bob").await, 0);
    assert_eq!(s.used("alice").await, 10);
    // A user never sees another user's job.
    assert!(s
        .queue
        .status(&user("bob"), &rid("j1"))
        .await
        .unwrap()
        .is_none());
    let info = s.queue.status(&user("alice"), &rid("j1")).await.unwrap();
    assert_eq!(info.unwrap().job.input, json!({ "prompt": "j1" }));
    assert!(s
        .queue
        .status(&user("alice"), &rid("nope"))
        .await
        .unwrap()
        .is_none());
    let e = s.queue.submit(request("j2", "alice", "nope")).await;
    assert!(matches!(e, Err(JobError::UnknownOperation { .. })), "{e:?}");
}

async fn job_denied_submission_leaves_nothing(s: &Setup) {
    for i in 0..10 {
        submit_ok(s, &format!("d{i}"), "carol").await;
    }
    match s
        .queue
        .submit(request("d10", "carol", "work"))
        .await
        .unwrap()
    {
        SubmitOutcome::Denied { denied } => assert_eq!(denied.used, 100),
        other => panic!("{other:?}"),
    }
    assert!(s
        .queue
        .status(&user("carol"), &rid("d10"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(s.used("carol").await, 100);
    // The id is free again once the budget allows.
    let lease = take(s, "work", "w").await;
    s.source
        .fail(
            &lease,
            Failure::new(FailureCause::Provider, Charge::RELEASE, "boom"),
        )
        .await
        .unwrap();
    submit_ok(s, "d10", "carol").await;
}

async fn job_cost_over_the_plan_is_an_error_and_leaves_nothing(s: &Setup) {
    let e = s.queue.submit(request("x1", "lena", "huge")).await;
    assert!(
        matches!(
            e,
            Err(JobError::Ledger(
                tollgate_core::ledger::LedgerError::CostExceedsLimit { .. }
            ))
        ),
        "{e:?}"
    );
    assert!(s
        .queue
        .status(&user("lena"), &rid("x1"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(s.used("lena").await, 0);
    s.source.maintain("w", LEASE).await.unwrap();
    assert_eq!(s.used("lena").await, 0);
}

async fn job_complete_wakes_the_waiter_and_keeps_the_charge(s: &Setup) {
    submit_ok(s, "c1", "dave").await;
    let waiter = {
        let q = Arc::clone(&s.queue);
        tokio::spawn(async move {
            q.wait(&user("dave"), &rid("c1"), Duration::from_secs(10))
                .await
        })
    };
    let lease = take(s, "work", "w1").await;
    assert_eq!(lease.job.run, 1);
    let running = s.queue.status(&user("dave"), &rid("c1")).await.unwrap();
    assert_eq!(running.unwrap().status, JobStatus::Running);
    assert_eq!(
        s.source.renew(&lease, LEASE).await.unwrap(),
        Finish::Recorded
    );
    let started = std::time::Instant::now();
    assert_eq!(
        s.source
            .complete(&lease, json!({ "answer": 42 }))
            .await
            .unwrap(),
        Finish::Recorded
    );
    let info = waiter.await.unwrap().unwrap().expect("the job");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        info.status,
        JobStatus::Succeeded {
            result: json!({ "answer": 42 }),
            head: None,
        }
    );
    assert!(info.finished_at_ms.is_some());
    assert_eq!(s.used("dave").await, 10);
    // Finished: the lease is spent.
    assert_eq!(
        s.source.complete(&lease, json!(1)).await.unwrap(),
        Finish::LeaseLost
    );
    assert_eq!(
        s.source
            .fail(
                &lease,
                Failure::new(FailureCause::Provider, Charge::RELEASE, "late")
            )
            .await
            .unwrap(),
        Finish::LeaseLost
    );
    assert_eq!(s.used("dave").await, 10, "a late failure refunds nothing");
    // A wait on an unfinished job returns it unfinished at the timeout.
    submit_ok(s, "c2", "dave").await;
    let info = s
        .queue
        .wait(&user("dave"), &rid("c2"), Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(info.unwrap().status, JobStatus::Queued);
}

async fn job_failure_refunds_exactly_once(s: &Setup) {
    submit_ok(s, "f1", "erin").await;
    let lease = take(s, "work", "w1").await;
    assert_eq!(
        s.source
            .fail(
                &lease,
                Failure::new(FailureCause::ThrottleTimeout, Charge::RELEASE, "no slot")
            )
            .await
            .unwrap(),
        Finish::Recorded
    );
    assert_eq!(s.used("erin").await, 0);
    let info = s.queue.status(&user("erin"), &rid("f1")).await.unwrap();
    match info.unwrap().status {
        JobStatus::Failed { cause, message } => {
            assert_eq!(cause, FailureCause::ThrottleTimeout);
            assert_eq!(cause.http_status(), 504);
            assert_eq!(message, "no slot");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        s.source
            .fail(
                &lease,
                Failure::new(FailureCause::Provider, Charge::RELEASE, "again")
            )
            .await
            .unwrap(),
        Finish::LeaseLost
    );
    // Maintenance finds nothing left to refund.
    s.source.maintain("w1", LEASE).await.unwrap();
    assert_eq!(s.used("erin").await, 0);
}

/// A finished job keeps no input, and a user's stored bytes (inputs and
/// results still kept) are bounded at submit by the plan's
/// `max_stored_bytes`: the refused submission is released (nothing charged,
/// no job), and the bytes come back once the jobs finish.
async fn job_finished_records_drop_inputs_and_stored_bytes_are_bounded(s: &Setup) {
    let big = |id: &str| JobRequest {
        input: json!({ "prompt": id, "pad": "x".repeat(5000) }),
        ..request(id, "gina", "other")
    };
    for id in ["sb1", "sb2", "sb3"] {
        match s.queue.submit(big(id)).await.unwrap() {
            SubmitOutcome::Queued { .. } => {}
            other => panic!("{id} not queued: {other:?}"),
        }
    }
    assert_eq!(s.used("gina").await, 3);
    // 3 x ~5.3 kB are stored; a 4th does not fit in 20,000 bytes.
    match s.queue.submit(big("sb4")).await {
        Err(JobError::StoredBytesExceeded { stored, limit }) => {
            assert_eq!(limit, 20000);
            assert!(stored > 15000 && stored <= 20000, "stored {stored}");
        }
        other => panic!("not refused: {other:?}"),
    }
    assert_eq!(
        s.used("gina").await,
        3,
        "the refused submission is released"
    );
    // The bound is the user's plan's: 7 such jobs fit a roomy user's 40,000
    // bytes. Limits of a user's own replace its plan's limits only: its
    // plan's bound still holds.
    let limits = [tollgate_core::config::Limit::window(
        1000,
        Duration::from_secs(3600),
    )];
    for (who, plan, custom, fit, bound) in [
        ("ruth", "roomy", false, 7, 40000),
        ("cole", "free", true, 3, 20000),
        ("rhea", "roomy", true, 7, 40000),
    ] {
        s.ledger.set_plan(&user(who), plan).await.unwrap();
        if custom {
            s.ledger.set_limits(&user(who), &limits).await.unwrap();
        }
        for i in 0..fit {
            let r = JobRequest {
                user: user(who),
                ..big(&format!("{who}{i}"))
            };
            match s.queue.submit(r).await.unwrap() {
                SubmitOutcome::Queued { .. } => {}
                other => panic!("{who}'s job {i} not queued: {other:?}"),
            }
        }
        let r = JobRequest {
            user: user(who),
            ..big(&format!("{who}{fit}"))
        };
        match s.queue.submit(r).await {
            Err(JobError::StoredBytesExceeded { limit, .. }) => assert_eq!(limit, bound, "{who}"),
            other => panic!("{who} not refused: {other:?}"),
        }
        assert_eq!(s.used(who).await, fit, "{who}");
    }
    // For FULL_MARK_TTL the queue's refusal is answered in process, before any
    // charge, to a job that would not fit beside what it counted; a job that
    // fits still goes to the queue.
    match s.queue.submit(big("sb4")).await {
        Err(JobError::StoredBytesExceeded { limit, .. }) => assert_eq!(limit, 20000),
        other => panic!("not refused again: {other:?}"),
    }
    match s
        .queue
        .submit(request("sb5", "gina", "other"))
        .await
        .unwrap()
    {
        SubmitOutcome::Queued { .. } => {}
        other => panic!("sb5 (small) not queued: {other:?}"),
    }
    assert_eq!(s.used("gina").await, 4);
    assert!(s
        .queue
        .status(&user("gina"), &rid("sb4"))
        .await
        .unwrap()
        .is_none());
    // The first two end (one succeeds, one fails): their inputs go.
    let a = take(s, "other", "w1").await;
    assert_eq!(
        s.source.complete(&a, json!({ "ok": 1 })).await.unwrap(),
        Finish::Recorded
    );
    let b = take(s, "other", "w1").await;
    assert_eq!(
        s.source
            .fail(
                &b,
                Failure::new(FailureCause::Provider, Charge::RELEASE, "refused upstream")
            )
            .await
            .unwrap(),
        Finish::Recorded
    );
    for lease in [&a, &b] {
        let info = s
            .queue
            .status(&user("gina"), &lease.job.id)
            .await
            .unwrap()
            .expect("the finished job");
        assert!(info.status.is_final());
        assert_eq!(info.job.input, Value::Null, "a finished job keeps no input");
    }
    // Room again: the 4th fits now, once the refusal's mark is over.
    tokio::time::sleep(tollgate_core::job::FULL_MARK_TTL).await;
    match s.queue.submit(big("sb4")).await.unwrap() {
        SubmitOutcome::Queued { .. } => {}
        other => panic!("sb4 not queued: {other:?}"),
    }
}

/// A sync call answered in full without an Idempotency-Key leaves no record
/// (`answered`): nobody can ask for its job again. Only a final record of that
/// user and that attempt goes; a job still queued stays.
async fn job_answered_without_a_key_leaves_no_record(s: &Setup) {
    submit_ok(s, "an1", "hana").await;
    let lease = take(s, "work", "w1").await;
    assert_eq!(
        s.source.complete(&lease, json!({ "ok": 1 })).await.unwrap(),
        Finish::Recorded
    );
    let info = s
        .queue
        .status(&user("hana"), &rid("an1"))
        .await
        .unwrap()
        .expect("the finished job");
    let mut other = info.clone();
    other.job.user = user("ivan");
    s.queue.answered(&other).await.unwrap();
    let mut earlier = info.clone();
    earlier.job.nonce = "0000000000000000".into();
    s.queue.answered(&earlier).await.unwrap();
    assert!(
        s.queue
            .status(&user("hana"), &rid("an1"))
            .await
            .unwrap()
            .is_some(),
        "another user's or another attempt's answer removes nothing"
    );
    s.queue.answered(&info).await.unwrap();
    assert!(s
        .queue
        .status(&user("hana"), &rid("an1"))
        .await
        .unwrap()
        .is_none());
    let queued = submit_ok(s, "an2", "hana").await;
    let queued = s
        .queue
        .status(&user("hana"), &queued.id)
        .await
        .unwrap()
        .expect("queued");
    s.queue.answered(&queued).await.unwrap();
    assert_eq!(
        s.queue
            .status(&user("hana"), &rid("an2"))
            .await
            .unwrap()
            .map(|i| i.status),
        Some(JobStatus::Queued)
    );
}

/// A final record stores its long values in pieces (Redis: `jobs/lib/job.lua`,
/// compact_final); results and messages of any length and script read back
/// whole, and a new attempt of the id starts from a clean record.
async fn job_long_results_and_messages_read_back_whole(s: &Setup) {
    let result = json!({
        "text": "é".repeat(100) + &"日本語".repeat(40) + "🦀",
        "n": 1.5,
        "big": "x".repeat(10_000),
    });
    submit_ok(s, "lr1", "jo").await;
    let lease = take(s, "work", "w1").await;
    s.source.complete(&lease, result.clone()).await.unwrap();
    let info = s
        .queue
        .status(&user("jo"), &rid("lr1"))
        .await
        .unwrap()
        .expect("the job");
    assert_eq!(info.status, JobStatus::Succeeded { result, head: None });
    let message = format!("refused: {}", "ü".repeat(90));
    submit_ok(s, "lr2", "jo").await;
    let lease = take(s, "work", "w1").await;
    s.source
        .fail(
            &lease,
            Failure::new(FailureCause::Provider, Charge::RELEASE, &message),
        )
        .await
        .unwrap();
    let info = s
        .queue
        .status(&user("jo"), &rid("lr2"))
        .await
        .unwrap()
        .expect("the job");
    assert_eq!(
        info.status,
        JobStatus::Failed {
            cause: FailureCause::Provider,
            message
        }
    );
    // Released: the same id is a new attempt, which reads as a fresh job.
    submit_ok(s, "lr2", "jo").await;
    let info = s
        .queue
        .status(&user("jo"), &rid("lr2"))
        .await
        .unwrap()
        .expect("the new attempt");
    assert_eq!(info.status, JobStatus::Queued);
    let lease = take(s, "work", "w1").await;
    s.source.complete(&lease, json!({ "ok": 2 })).await.unwrap();
    let info = s
        .queue
        .status(&user("jo"), &rid("lr2"))
        .await
        .unwrap()
        .expect("the job");
    assert_eq!(
        info.status,
        JobStatus::Succeeded {
            result: json!({ "ok": 2 }),
            head: None,
        }
    );
}

async fn job_expired_lease_goes_back_and_the_old_token_is_refused(s: &Setup) {
    submit_ok(s, "l1", "frank").await;
    let old = take(s, "work", "w1").await;
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
    let m = s
        .source
        .maintain("w2", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(m.requeued >= 1, "{m:?}");
    let new = take(s, "work", "w2").await;
    assert_eq!(new.job.run, 2);
    assert!(new.token > old.token);
    // The paused worker wakes up: nothing it does counts.
    assert_eq!(
        s.source.renew(&old, LEASE).await.unwrap(),
        Finish::LeaseLost
    );
    assert_eq!(
        s.source.complete(&old, json!("late")).await.unwrap(),
        Finish::LeaseLost
    );
    assert_eq!(
        s.source
            .fail(
                &old,
                Failure::new(FailureCause::Provider, Charge::RELEASE, "late")
            )
            .await
            .unwrap(),
        Finish::LeaseLost
    );
    assert_eq!(s.source.hand_back(&old).await.unwrap(), Finish::LeaseLost);
    assert_eq!(s.used("frank").await, 10, "the late refund was refused");
    assert_eq!(
        s.source.complete(&new, json!("on time")).await.unwrap(),
        Finish::Recorded
    );
    let info = s.queue.status(&user("frank"), &rid("l1")).await.unwrap();
    assert_eq!(
        info.unwrap().status,
        JobStatus::Succeeded {
            result: json!("on time"),
            head: None,
        }
    );
}

/// A job taken without ever starting its call (its workers died before the
/// claim), past its attempts: abandoned, and released (nothing reached the
/// upstream).
async fn job_past_max_attempts_is_abandoned_and_refunded(s: &Setup) {
    submit_ok(s, "a1", "gina").await;
    for attempt in 1..=2 {
        let lease = take_unstarted(s, "work", "w1").await;
        assert_eq!(lease.job.run, attempt);
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        s.source
            .maintain("w2", Duration::from_secs(5))
            .await
            .unwrap();
    }
    // The third take gives the job up instead of running it.
    let third = s
        .source
        .take("work", Taker::new("w1", Duration::from_millis(300), LEASE))
        .await
        .unwrap();
    assert!(third.is_none(), "{third:?}");
    let info = s.queue.status(&user("gina"), &rid("a1")).await.unwrap();
    match info.unwrap().status {
        JobStatus::Failed { cause, .. } => assert_eq!(cause, FailureCause::Abandoned),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.used("gina").await, 0);
}

/// One take that meets jobs it must give up (past their attempts) fails them
/// and goes on to the next job: `None` means nothing was left to run within
/// the block, never "an entry was dealt with". (Redis returned `None` after
/// each one given up, so a drain with `while take(..).is_some()` stopped with
/// jobs still queued: the charge-ownership model test found it.)
async fn job_take_gives_up_what_it_must_and_returns_the_next(s: &Setup) {
    submit_ok(s, "g1", "ivy").await;
    submit_ok(s, "g2", "ivy").await;
    for _ in 1..=2 {
        take_unstarted(s, "work", "w1").await;
        take_unstarted(s, "work", "w1").await;
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        s.source
            .maintain("w2", Duration::from_secs(5))
            .await
            .unwrap();
    }
    submit_ok(s, "g3", "ivy").await;
    let next = s
        .source
        .take("work", Taker::new("w1", Duration::from_millis(300), LEASE))
        .await
        .unwrap();
    assert_eq!(next.map(|l| l.job.id), Some(rid("g3")));
    for id in ["g1", "g2"] {
        let info = s.queue.status(&user("ivy"), &rid(id)).await.unwrap();
        match info.unwrap().status {
            JobStatus::Failed { cause, .. } => assert_eq!(cause, FailureCause::Abandoned, "{id}"),
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(s.used("ivy").await, 10, "only g3 is charged");
}

/// The same, but each run started its call before its worker died: the
/// upstream may have done the work, so the job is given up `unanswered` with
/// its charge kept, never released (before: abandoned and refunded).
async fn job_whose_started_runs_were_lost_is_given_up_charged(s: &Setup) {
    submit_ok(s, "s1", "gina").await;
    for attempt in 1..=2 {
        let lease = take(s, "work", "w1").await;
        assert_eq!(lease.job.run, attempt);
        assert_eq!(lease.ran_before, attempt > 1, "attempt {attempt}");
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        s.source
            .maintain("w2", Duration::from_secs(5))
            .await
            .unwrap();
    }
    let third = s
        .source
        .take("work", Taker::new("w1", Duration::from_millis(300), LEASE))
        .await
        .unwrap();
    assert!(third.is_none(), "{third:?}");
    let info = s.queue.status(&user("gina"), &rid("s1")).await.unwrap();
    match info.unwrap().status {
        JobStatus::Failed { cause, message } => {
            assert_eq!(cause, FailureCause::Unanswered);
            assert_eq!(message, tollgate_core::job::LOST_MID_RUN);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.used("gina").await, 10);
}

async fn job_hand_back_requeues_without_counting_the_attempt(s: &Setup) {
    submit_ok(s, "h1", "hank").await;
    submit_ok(s, "h2", "hank").await;
    let first = take(s, "work", "w1").await;
    assert_eq!(first.job.id, rid("h1"), "oldest first");
    assert_eq!(s.source.hand_back(&first).await.unwrap(), Finish::Recorded);
    let again = take(s, "work", "w2").await;
    assert_eq!(again.job.id, rid("h1"), "handed back to the head");
    assert_eq!(again.job.run, 1);
    assert_eq!(
        s.source.complete(&first, json!(0)).await.unwrap(),
        Finish::LeaseLost
    );
    s.source.retire("w1").await.unwrap();
}

/// A deferred job (taken, not started: its user holds its share of the
/// worker) goes to the tail of its queue, its attempt not counted, its charge
/// untouched (still held for it); the deferring lease is over.
async fn job_defer_puts_the_job_at_the_tail_uncounted(s: &Setup) {
    submit_ok(s, "d1", "dora").await;
    submit_ok(s, "d2", "dora").await;
    let first = take_unstarted(s, "work", "w1").await;
    assert_eq!(first.job.id, rid("d1"), "oldest first");
    assert_eq!(s.source.defer(&first).await.unwrap(), Finish::Recorded);
    let next = take(s, "work", "w2").await;
    assert_eq!(next.job.id, rid("d2"), "the deferred job went to the tail");
    let again = take(s, "work", "w2").await;
    assert_eq!((again.job.id.clone(), again.job.run), (rid("d1"), 1));
    assert_eq!(s.source.defer(&first).await.unwrap(), Finish::LeaseLost);
    assert_eq!(
        s.source.complete(&first, json!(0)).await.unwrap(),
        Finish::LeaseLost
    );
    assert_eq!(s.used("dora").await, 20, "both charges stand, once each");
    for lease in [next, again] {
        assert_eq!(
            s.source.complete(&lease, json!(1)).await.unwrap(),
            Finish::Recorded
        );
    }
    assert_eq!(s.used("dora").await, 20);
    s.source.retire("w1").await.unwrap();
    s.source.retire("w2").await.unwrap();
}

async fn job_stats_count_queued_and_running_jobs(s: &Setup) {
    let stats = s.queue.stats().await.unwrap();
    let names: Vec<&str> = stats.iter().map(|q| q.operation.as_str()).collect();
    assert_eq!(
        names,
        ["huge", "metered", "other", "work"],
        "every operation, by name"
    );
    submit_ok(s, "s1", "alice").await;
    submit_ok(s, "s2", "alice").await;
    let lease = take(s, "work", "w1").await;
    let work = s.queue.stats().await.unwrap().remove(3);
    assert_eq!(
        (work.queued, work.running, work.dead),
        (1, 1, 0),
        "{work:?}"
    );
    s.source.complete(&lease, json!(1)).await.unwrap();
    let work = s.queue.stats().await.unwrap().remove(3);
    assert_eq!((work.queued, work.running), (1, 0), "{work:?}");
    s.source.retire("w1").await.unwrap();
}

on_each_backend!(
    [
        job_submit_reserves_once_and_only_the_owner_sees_it,
        job_denied_submission_leaves_nothing,
        job_cost_over_the_plan_is_an_error_and_leaves_nothing,
        job_complete_wakes_the_waiter_and_keeps_the_charge,
        job_failure_refunds_exactly_once,
        job_expired_lease_goes_back_and_the_old_token_is_refused,
        job_past_max_attempts_is_abandoned_and_refunded,
        job_whose_started_runs_were_lost_is_given_up_charged,
        job_take_gives_up_what_it_must_and_returns_the_next,
        job_hand_back_requeues_without_counting_the_attempt,
        job_defer_puts_the_job_at_the_tail_uncounted,
        job_stats_count_queued_and_running_jobs,
        job_finished_records_drop_inputs_and_stored_bytes_are_bounded,
        job_answered_without_a_key_leaves_no_record,
        job_long_results_and_messages_read_back_whole,
    ]
    memory => &super::Setup::memory(),
    redis => &super::Setup::redis().await,
    cluster => &super::Setup::cluster().await,
);

/// What a worker's BLMOVE does, without the lease that follows it: the oldest
/// queued id moves into `worker`'s processing list.
async fn blmove_without_lease(
    conn: &mut impl ::redis::aio::ConnectionLike,
    keys: &tollgate_redis::keys::JobKeys,
    worker: &str,
) -> Option<String> {
    ::redis::cmd("LMOVE")
        .arg(&keys.queue)
        .arg(keys.processing(worker))
        .arg("RIGHT")
        .arg("LEFT")
        .query_async(conn)
        .await
        .unwrap()
}

/// `LLEN key`.
async fn llen(conn: &mut impl ::redis::aio::ConnectionLike, key: &str) -> i64 {
    ::redis::cmd("LLEN")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

async fn raw(server: &RedisServer) -> ::redis::aio::MultiplexedConnection {
    ::redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A submission that died after its charge, before its job existed: the charge
/// is held for the job until the job's deadline plus the hold grace, then the
/// ledger releases it by itself on the user's next budget step. A job that
/// turns up after that (a paused api pod) is refused its charge and never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_charge_of_a_dead_submission_is_released_after_its_hold() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let config = Arc::new(
        Config::parse(
            &CONFIG.replace("max_runs = 2", "max_runs = 2\ndeadline = \"300ms\""),
            "short deadline",
        )
        .unwrap(),
    );
    let (q, ledger) = redis_queue(&server, &prefix, config).await;
    let ivan = user("ivan");
    let charge = tollgate_core::ledger::ChargeRequest {
        cost: 10,
        nonce: "0123456789abcdef",
        operation: "work",
        model: "",
        fingerprint: "feed",
        deadline: Duration::from_millis(300),
        grace: Duration::from_millis(200),
        service_key: None,
        price: None,
    };
    // Step 1 of a submission, then nothing (the api pod died).
    let charged = ledger.charge(&ivan, &rid("crash1"), &charge).await.unwrap();
    let tollgate_core::ledger::ChargeOutcome::Charged { deadline_ms, .. } = charged else {
        panic!("{charged:?}")
    };
    assert_eq!(ledger.usage(&ivan).await.unwrap().used, 10);
    // Held: the same request again finds it, unclaimed, and gets its job made.
    let r = q.submit(request("crash2", "ivan", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let usage = ledger.usage(&ivan).await.unwrap();
    assert_eq!(usage.used, 0, "both holds ended unclaimed: {usage:?}");
    // The late job of crash1 (its pod paused, then enqueued) is refused.
    let job = tollgate_core::job::Job {
        id: rid("crash1"),
        user: ivan.clone(),
        operation: "work".into(),
        provider: "p".into(),
        input: json!({}),
        cost: 10,
        enqueued_at_ms: deadline_ms - 300,
        deadline_ms,
        run: 0,
        nonce: charge.nonce.into(),
        trace: None,
        price: None,
        charged: None,
    };
    assert_eq!(
        tollgate_core::job::claim(&*ledger, &job, Duration::from_millis(200))
            .await
            .unwrap(),
        tollgate_core::ledger::ClaimOutcome::Refused
    );
    assert_eq!(ledger.usage(&ivan).await.unwrap().used, 0);
    // crash2's job, past its deadline, is failed by the lease script, unrun.
    assert!(q
        .take("work", Taker::new("w", Duration::from_millis(200), LEASE))
        .await
        .unwrap()
        .is_none());
    let info = q.status(&ivan, &rid("crash2")).await.unwrap().unwrap();
    assert!(
        matches!(
            info.status,
            JobStatus::Failed {
                cause: FailureCause::Expired,
                ..
            }
        ),
        "{info:?}"
    );
    assert_eq!(ledger.usage(&ivan).await.unwrap().used, 0);
}

/// A submission's only round trips are its charge and its enqueue: the
/// user's plan, whose `max_stored_bytes` bounds the enqueue (the suite's
/// plans differ in it), comes back with the charge, so Redis runs no `GET`
/// (before, one `GET` of the plan key per submission, in sequence between
/// the two). Counted on the test's own server (INFO commandstats), for a new
/// charge, a duplicate and a user with limits of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_submit_takes_the_plan_from_its_charge() {
    let server = RedisServer::start();
    let (q, ledger) = redis_queue(&server, &random_prefix(), config()).await;
    let gets = || {
        tollgate_tests::redis_info::command_calls(&server.url())
            .get("get")
            .copied()
            .unwrap_or(0)
    };
    // Where each user lives is read once (a `GET` of its `at` pointer) and
    // kept by the ledger: setting a plan or reading usage reads it.
    ledger.set_plan(&user("paul"), "roomy").await.unwrap();
    ledger.set_plan(&user("cara"), "roomy").await.unwrap();
    let limits = [tollgate_core::config::Limit::window(
        1000,
        Duration::from_secs(3600),
    )];
    ledger.set_limits(&user("cara"), &limits).await.unwrap();
    ledger.usage(&user("walt")).await.unwrap();
    let before = gets();
    for (id, who) in [
        ("g1", "paul"),
        ("g2", "paul"),
        ("g3", "cara"),
        ("g4", "walt"),
    ] {
        let r = q.submit(request(id, who, "work")).await.unwrap();
        assert!(matches!(r, SubmitOutcome::Queued { .. }), "{id}: {r:?}");
    }
    let r = q.submit(request("g1", "paul", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Duplicate { .. }), "{r:?}");
    assert_eq!(gets() - before, 0, "GETs during 5 submissions");
}

/// Garbage in a queue (an id without a record, unreadable JSON, a job of another
/// operation) is moved aside; the queue goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_malformed_entries_are_moved_aside() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let (q, ledger) = redis_queue(&server, &prefix, config()).await;
    let mut conn = raw(&server).await;
    inject_malformed(&mut conn, &prefix, "work").await;
    let s = Setup {
        queue: q.clone(),
        source: q.clone(),
        ledger,
        _server: None,
        _cluster: None,
    };
    submit_ok(&s, "good", "judy").await;
    let lease = loop {
        if let Some(l) = s
            .source
            .take("work", Taker::new("w", Duration::from_millis(500), LEASE))
            .await
            .unwrap()
        {
            break l;
        }
    };
    assert_eq!(lease.job.id, rid("good"));
    let dead = q.dead_letters("work").await.unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert_eq!(s.used("judy").await, 10);
}

/// Pushes three malformed entries onto `operation`'s queue.
pub async fn inject_malformed(
    conn: &mut ::redis::aio::MultiplexedConnection,
    prefix: &str,
    operation: &str,
) {
    let keys = KeySpace::new(prefix).unwrap().jobs(operation);
    let record = |input: &str, op: &str| {
        vec![
            ("state", "queued".to_owned()),
            ("user", "mallory".to_owned()),
            ("op", op.to_owned()),
            ("provider", "p".to_owned()),
            ("input", input.to_owned()),
            ("cost", "1".to_owned()),
            ("enq", "1".to_owned()),
            ("deadline", "99999999999999".to_owned()),
            ("attempt", "0".to_owned()),
            ("seq", "0".to_owned()),
        ]
    };
    let _: () = ::redis::cmd("HSET")
        .arg(keys.job("badjson"))
        .arg(record("{not json", operation))
        .query_async(conn)
        .await
        .unwrap();
    let _: () = ::redis::cmd("HSET")
        .arg(keys.job("wrongop"))
        .arg(record("{}", "nope"))
        .query_async(conn)
        .await
        .unwrap();
    let _: () = ::redis::cmd("LPUSH")
        .arg(&keys.queue)
        .arg("no-such-job")
        .arg("badjson")
        .arg("wrongop")
        .query_async(conn)
        .await
        .unwrap();
}

/// The HTTP provider against the mock server (in-process, 1 request/s): the
/// second call is answered 429 with Retry-After, and the retry, after a new
/// throttle slot, succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_http_provider_retries_a_429_after_retry_after() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let options = tollgate_mock_provider::MockOptions {
        rate: 1.0,
        burst: 1,
        ..Default::default()
    };
    let server = tokio::spawn(tollgate_mock_provider::run(
        listener,
        options,
        std::future::pending(),
    ));
    let text = format!(
        r#"
[plans.free]
limit = 100
window = "1h"
[providers.p]
rate = 100
burst = 10
max_wait = "5s"
url = "http://{addr}"
retries = 2
[operations.work]
cost = 1
provider = "p"
path = "/v1/work"
"#
    );
    let config = Config::parse(&text, "http test").unwrap();
    let throttle: Arc<dyn tollgate_core::throttle::Throttle> =
        Arc::new(tollgate_memory::throttle::MemoryThrottle::new(&config));
    let metrics = Arc::new(tollgate_core::metrics::Metrics::new(&config));
    let providers = tollgate_providers::from_config(&config, throttle, &metrics).unwrap();
    let p = &providers["p"];
    let job = |id: &str| tollgate_tests::jobs::job(id, "u", "work", "p", json!({ "q": id }));
    let first = p
        .call(&job("h1"), CallOptions::default())
        .await
        .unwrap()
        .body;
    assert_eq!(first["echo"], json!({ "q": "h1" }));
    assert_eq!(first["path"], json!("/v1/work"));
    let started = std::time::Instant::now();
    let second = p
        .call(&job("h2"), CallOptions::default())
        .await
        .unwrap()
        .body;
    assert_eq!(second["echo"], json!({ "q": "h2" }));
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "waited for Retry-After: {:?}",
        started.elapsed()
    );
    tollgate_providers::http::install_crypto_provider();
    let stats: tollgate_mock_provider::Stats = reqwest::get(format!("http://{addr}/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((stats.requests, stats.ok, stats.rate_limited), (3, 2, 1));
    // The client saw the same: one 429, retried, three attempts, three slots.
    let text = metrics.render();
    for line in [
        "tollgate_upstream_errors_total{provider=\"p\",class=\"429\"} 1",
        "tollgate_upstream_errors_total{provider=\"p\",class=\"5xx\"} 0",
        "tollgate_provider_retries_total{provider=\"p\"} 1",
        "tollgate_provider_call_duration_seconds_count{provider=\"p\",outcome=\"ok\"} 2",
        "tollgate_provider_call_duration_seconds_count{provider=\"p\",outcome=\"429\"} 1",
        "tollgate_throttle_acquires_total{provider=\"p\",outcome=\"granted\"} 3",
        "tollgate_throttle_wait_seconds_count{provider=\"p\"} 3",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
    server.abort();
}

/// The embedded mode end to end: the worker role on `MemoryJobQueue`, the
/// in-process throttle and the built-in mock provider.
/// The worker role on `source`, the config's providers throttled in
/// process, 100 ms takes: it runs until the returned [`Worker`] is stopped.
fn worker_role(config: &Arc<Config>, source: Arc<dyn JobSource>, concurrency: usize) -> Worker {
    let throttle: Arc<dyn tollgate_core::throttle::Throttle> =
        Arc::new(tollgate_memory::throttle::MemoryThrottle::new(config));
    let mut cfg = tollgate_worker::WorkerConfig::new(Arc::clone(config));
    let providers = tollgate_providers::from_config(config, throttle, &cfg.metrics).unwrap();
    cfg.concurrency = concurrency;
    cfg.block = Duration::from_millis(100);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let role = tokio::spawn(tollgate_worker::run(cfg, source, providers, async {
        let _ = stopped.await;
    }));
    Worker { stop, role }
}

/// A worker role of [`worker_role`].
struct Worker {
    stop: tokio::sync::oneshot::Sender<()>,
    role: tokio::task::JoinHandle<Result<(), tollgate_worker::WorkerError>>,
}

impl Worker {
    /// Stops the role and waits until it ended cleanly.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.role.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_embedded_worker_runs_jobs_on_memory() {
    let s = Setup::memory();
    let worker = worker_role(&config(), Arc::clone(&s.source), 4);
    for i in 0..10 {
        submit_ok(&s, &format!("e{i}"), "kim").await;
    }
    for i in 0..10 {
        let info = s
            .queue
            .wait(
                &user("kim"),
                &rid(&format!("e{i}")),
                Duration::from_secs(10),
            )
            .await
            .unwrap()
            .unwrap();
        match info.status {
            JobStatus::Succeeded { result, .. } => {
                assert_eq!(result["mock"], json!(true));
                assert_eq!(result["echo"], json!({ "prompt": format!("e{i}") }));
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(s.used("kim").await, 100);
    worker.stop().await;
}

/// The worker role settles a job's charge to what the provider reported (the
/// built-in mock reports the input's `mock_total_tokens`), clamped to the
/// rule's `max`, and the event keeps the estimate.
async fn worker_settles_charges_to_the_reported_usage(s: &Setup) {
    let worker = worker_role(&config(), Arc::clone(&s.source), 32);
    for (id, tokens) in [
        ("s1", json!(2550)),
        ("s2", json!(99_999)),
        ("s3", json!("n/a")),
    ] {
        let mut r = request(id, "sam", "metered");
        r.input = json!({ "mock_total_tokens": tokens });
        assert!(matches!(
            s.queue.submit(r).await.unwrap(),
            SubmitOutcome::Queued { .. }
        ));
        let info = s
            .queue
            .wait(&user("sam"), &rid(id), Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(info.status, JobStatus::Succeeded { .. }),
            "{info:?}"
        );
    }
    let usage = s.ledger.usage(&user("sam")).await.unwrap();
    let events: Vec<_> = usage
        .events
        .iter()
        .map(|e| (e.request_id.to_string(), e.cost, e.estimate))
        .collect();
    assert_eq!(
        events,
        // Each reserved the most (30) up front and settled down.
        [
            ("s1".to_owned(), 26, Some(30)),
            ("s2".to_owned(), 30, Some(30)),
            // No number asked for: the mock reports 100 per token of the estimate.
            ("s3".to_owned(), 10, Some(30)),
        ]
    );
    assert_eq!(usage.used, 66);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_worker_settles_charges_on_memory() {
    worker_settles_charges_to_the_reported_usage(&Setup::memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_worker_settles_charges_on_redis() {
    worker_settles_charges_to_the_reported_usage(&Setup::redis().await).await;
}

/// A job source whose store can be cut off: then every call fails as
/// unavailable, as over connections cut while the worker was paused.
#[derive(Debug)]
struct Cuttable {
    inner: Arc<dyn JobSource>,
    cut: AtomicBool,
}

impl Cuttable {
    fn reach(&self) -> Result<&dyn JobSource, JobError> {
        if self.cut.load(Ordering::SeqCst) {
            Err(tollgate_core::error::StoreError::unavailable("connection cut").into())
        } else {
            Ok(&*self.inner)
        }
    }
}

#[async_trait::async_trait]
impl JobSource for Cuttable {
    async fn take(&self, operation: &str, taker: Taker<'_>) -> Result<Option<Lease>, JobError> {
        self.reach()?.take(operation, taker).await
    }
    async fn settle(
        &self,
        lease: &Lease,
        answer: &serde_json::Value,
    ) -> Result<tollgate_core::job::Settled, JobError> {
        self.reach()?.settle(lease, answer).await
    }

    async fn start(&self, lease: &Lease) -> Result<bool, JobError> {
        self.reach()?.start(lease).await
    }
    async fn renew(&self, lease: &Lease, by: Duration) -> Result<Finish, JobError> {
        self.reach()?.renew(lease, by).await
    }
    async fn complete(&self, lease: &Lease, result: Value) -> Result<Finish, JobError> {
        self.reach()?.complete(lease, result).await
    }
    async fn fail(&self, lease: &Lease, failure: Failure<'_>) -> Result<Finish, JobError> {
        self.reach()?.fail(lease, failure).await
    }
    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError> {
        self.reach()?.hand_back(lease).await
    }
    async fn defer(&self, lease: &Lease) -> Result<Finish, JobError> {
        self.reach()?.defer(lease).await
    }
    async fn maintain(&self, worker: &str, lease: Duration) -> Result<Maintenance, JobError> {
        self.reach()?.maintain(worker, lease).await
    }
    async fn retire(&self, worker: &str) -> Result<(), JobError> {
        self.reach()?.retire(worker).await
    }
}

/// A provider whose calls wait at a gate that the test opens, counting those
/// that went through.
#[derive(Debug, Default)]
struct Gated {
    entered: tokio::sync::Notify,
    open: tokio::sync::Notify,
    calls: AtomicU32,
}

#[async_trait::async_trait]
impl Client for Gated {
    /// Asks for no slot ahead and streams nothing: `_opts` unused.
    async fn call(
        &self,
        _job: &tollgate_core::job::Job,
        _opts: CallOptions<'_>,
    ) -> Result<Answer, CallError> {
        self.entered.notify_one();
        self.open.notified().await;
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(Answer::body(json!({})))
    }
}

/// A worker paused past its job's lease (SIGSTOP, a stalled VM), its store
/// connections cut meanwhile, resumes with its provider call ready to go (a
/// throttle grant that came during the pause). The lease lapsed: another
/// worker may be running the job. The call is abandoned, not made. (Before:
/// the run went on until a renewal said "lost", and a failed renewal says
/// nothing, so the call went out: the job ran twice, at once with every other
/// call the pause held back; the chaos suite saw the upstream's limit passed.)
#[tokio::test(start_paused = true)]
async fn job_a_worker_paused_past_its_lease_does_not_make_the_call() {
    let s = Setup::memory();
    let source = Arc::new(Cuttable {
        inner: Arc::clone(&s.source),
        cut: AtomicBool::new(false),
    });
    let provider = Arc::new(Gated::default());
    let mut cfg = tollgate_worker::WorkerConfig::new(config());
    cfg.lease = Duration::from_secs(3);
    cfg.operations = vec!["work".into()];
    let providers = BTreeMap::from([("p".to_owned(), Arc::clone(&provider) as Arc<dyn Client>)]);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let role = tokio::spawn(tollgate_worker::run(
        cfg,
        Arc::clone(&source) as Arc<dyn JobSource>,
        providers,
        async {
            let _ = stopped.await;
        },
    ));
    submit_ok(&s, "paused", "pia").await;
    provider.entered.notified().await;
    // The pause: connections cut, the call free to go, the clock a lease and
    // more ahead, all before the worker runs again.
    source.cut.store(true, Ordering::SeqCst);
    provider.open.notify_one();
    tokio::time::advance(Duration::from_secs(10)).await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        provider.calls.load(Ordering::SeqCst),
        0,
        "the call went out on a lapsed lease"
    );
    source.cut.store(false, Ordering::SeqCst);
    let _ = stop.send(());
    role.await.unwrap().unwrap();
}

/// A worker's BLMOVE took a job, then its lease script failed (a broken
/// connection after a Redis restart): the id sat in the live worker's
/// processing list, in no queue, never leased, never refunded. Maintenance
/// moves it back once it has seen it unleased in two rounds in a row, and the
/// job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_a_taken_but_never_leased_job_goes_back_to_its_queue() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let (q, ledger) = redis_queue(&server, &prefix, config()).await;
    let keys = KeySpace::new(&prefix).unwrap().jobs("work");
    a_taken_but_never_leased_job_goes_back(&q, &*ledger, &keys, &mut raw(&server).await).await;
}

/// The same on a Redis Cluster (the unstick script's keys share the queue's slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_cluster_a_taken_but_never_leased_job_goes_back_to_its_queue() {
    let cluster = TestCluster::get();
    let prefix = random_prefix();
    let (q, ledger) = redis_queue_at(&cluster.url(), &prefix, config(), options()).await;
    let keys = KeySpace::new(&prefix).unwrap().jobs("work");
    let seeds: Vec<String> = cluster
        .url()
        .trim_start_matches("redis+cluster://")
        .split(',')
        .map(|s| format!("redis://{s}"))
        .collect();
    let mut conn = ::redis::cluster::ClusterClient::new(seeds)
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    a_taken_but_never_leased_job_goes_back(&q, &*ledger, &keys, &mut conn).await;
}

async fn a_taken_but_never_leased_job_goes_back(
    q: &RedisJobQueue,
    ledger: &dyn Ledger,
    keys: &tollgate_redis::keys::JobKeys,
    conn: &mut impl ::redis::aio::ConnectionLike,
) {
    let r = q.submit(request("s1", "ursula", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    let moved = blmove_without_lease(conn, keys, "w1").await;
    assert_eq!(moved.as_deref(), Some("s1"));
    let first = q.maintain("w1", Duration::from_secs(5)).await.unwrap();
    assert_eq!(first.requeued, 0, "one round only marks it");
    let second = q.maintain("w1", Duration::from_secs(5)).await.unwrap();
    assert_eq!(second.requeued, 1, "{second:?}");
    let lease = q
        .take("work", Taker::new("w1", Duration::from_secs(2), LEASE))
        .await
        .unwrap()
        .expect("the job is back");
    assert!(q.start(&lease).await.unwrap());
    q.complete(&lease, json!({})).await.unwrap();
    assert_eq!(
        ledger.usage(&user("ursula")).await.unwrap().used,
        10,
        "ran and charged once"
    );
    let left = llen(conn, &keys.processing("w1")).await;
    assert_eq!(left, 0);
}

/// Every worker was down long enough for the liveness hash to expire. The
/// processing list a dead worker left is still found (the `lists` set does not
/// expire) and a new worker's maintenance puts its ids back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_dead_workers_are_found_after_their_liveness_expired() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let (q, _ledger) = redis_queue(&server, &prefix, config()).await;
    let keys = KeySpace::new(&prefix).unwrap().jobs("work");
    let mut conn = raw(&server).await;
    q.maintain("old", Duration::from_millis(200)).await.unwrap();
    let r = q.submit(request("s2", "victor", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    // `old` took it and died; then its liveness record expired with the hash.
    let _ = blmove_without_lease(&mut conn, &keys, "old").await;
    let _: i64 = ::redis::cmd("DEL")
        .arg(&keys.workers)
        .query_async(&mut conn)
        .await
        .unwrap();
    let m = q.maintain("new", Duration::from_secs(5)).await.unwrap();
    assert_eq!(m.requeued, 1, "{m:?}");
    let queued = llen(&mut conn, &keys.queue).await;
    assert_eq!(queued, 1);
    let listed: i64 = ::redis::cmd("SISMEMBER")
        .arg(&keys.lists)
        .arg("old")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(listed, 0, "a reclaimed worker leaves the set");
}

/// A worker lapsed (a slow link, a pause) and another worker reclaimed its
/// list; then the worker's BLMOVE, still on its way, lands, and the worker
/// dies before its next heartbeat. The lapsed worker stays listed for a while
/// (`job::LAPSED_KEPT` livenesses), so the next maintenance of any worker puts
/// the id back; only long after its lapse is it forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_a_blmove_landing_after_a_lapsed_worker_was_reclaimed_goes_back() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let (q, _ledger) = redis_queue(&server, &prefix, config()).await;
    let keys = KeySpace::new(&prefix).unwrap().jobs("work");
    let mut conn = raw(&server).await;
    let liveness = Duration::from_millis(100);
    q.maintain("slow", liveness).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // `slow` lapsed: reclaimed (nothing in its list yet).
    let m = q.maintain("other", liveness).await.unwrap();
    assert_eq!(m.requeued, 0, "{m:?}");
    let r = q.submit(request("s4", "xena", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    // Its BLMOVE lands now; it dies before heartbeating again.
    let _ = blmove_without_lease(&mut conn, &keys, "slow").await;
    let m = q.maintain("other", liveness).await.unwrap();
    assert_eq!(m.requeued, 1, "the late pop goes back: {m:?}");
    assert_eq!(llen(&mut conn, &keys.queue).await, 1);
    let listed = ::redis::cmd("SISMEMBER")
        .arg(&keys.lists)
        .arg("slow")
        .to_owned();
    let known: i64 = listed.query_async(&mut conn).await.unwrap();
    assert_eq!(known, 1, "still known after its reclaim");
    // Lapsed for longer than LAPSED_KEPT livenesses: forgotten.
    tokio::time::sleep(liveness * tollgate_core::job::LAPSED_KEPT + liveness).await;
    q.maintain("other", liveness).await.unwrap();
    let known: i64 = listed.query_async(&mut conn).await.unwrap();
    assert_eq!(known, 0, "forgotten at last");
}

/// A worker retires (SIGTERM) while its BLMOVE is still in flight: the id
/// lands in its processing list after `retire` handed everything back. The
/// retired worker stays listed without liveness, so the next maintenance of
/// any worker puts the id back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_a_blmove_landing_after_retire_is_reclaimed() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let (q, _ledger) = redis_queue(&server, &prefix, config()).await;
    let keys = KeySpace::new(&prefix).unwrap().jobs("work");
    let mut conn = raw(&server).await;
    q.maintain("leaving", Duration::from_secs(5)).await.unwrap();
    let r = q.submit(request("s3", "wendy", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    q.retire("leaving").await.unwrap();
    let _ = blmove_without_lease(&mut conn, &keys, "leaving").await;
    let m = q.maintain("staying", Duration::from_secs(5)).await.unwrap();
    assert_eq!(m.requeued, 1, "{m:?}");
    let queued = llen(&mut conn, &keys.queue).await;
    assert_eq!(queued, 1);
}

/// The pod that submitted a job gets its final record in the message that
/// says it finished (`publish_done`): its waiting call answers without reading
/// the record back (no `look`). Another pod waiting for the same job still
/// wakes on the id and reads it; a result too large to send along is read
/// too, whole; a failure comes along like a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_the_submitting_pod_gets_the_final_record_without_a_read() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    finals_reach_the_submitting_pod(|| redis_queue(&server, &prefix, config())).await;
}

/// The same on a Redis Cluster: the pods' own channels are sharded, in the
/// queue's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_cluster_the_submitting_pod_gets_the_final_record_without_a_read() {
    let cluster = TestCluster::get();
    let (url, prefix) = (cluster.url(), random_prefix());
    finals_reach_the_submitting_pod(|| redis_queue_at(&url, &prefix, config(), options())).await;
}

async fn finals_reach_the_submitting_pod<F, Fut>(pod: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = (Arc<RedisJobQueue>, Arc<dyn Ledger>)>,
{
    // Three processes' queues on one store: the api pod that submits, another
    // api pod, and a worker.
    let (api, _) = pod().await;
    let (other, _) = pod().await;
    let (worker, _) = pod().await;
    for q in [&api, &other] {
        assert!(q.subscribed(Duration::from_secs(10)).await, "subscribed");
    }
    // A look every 60 s at most: within the test only a ring makes one.
    let (timeout, poll) = (Duration::from_secs(20), Duration::from_secs(60));
    let looks = |q: &Arc<RedisJobQueue>, id: &'static str, counter: &Arc<AtomicU32>| {
        let (q, counter) = (Arc::clone(q), Arc::clone(counter));
        move || {
            let (q, counter) = (Arc::clone(&q), Arc::clone(&counter));
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                q.read(&user("pia"), "work", &rid(id)).await
            }
        }
    };
    let big = "x".repeat(20_000);
    let cases: [(&'static str, Option<Value>); 3] = [
        ("f1", Some(json!({ "answer": 42 }))),
        ("f2", None),
        ("f3", Some(json!({ "text": big }))),
    ];
    for (id, result) in cases {
        let (mine, theirs) = (api.watch(&rid(id)), other.watch(&rid(id)));
        let job = submit_on(&api, id).await;
        let queued = tollgate_core::job::JobInfo {
            job,
            status: JobStatus::Queued,
            finished_at_ms: None,
        };
        let (my_looks, their_looks) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let mine = tokio::spawn(mine.until_final(
            Some(queued.clone()),
            timeout,
            poll,
            looks(&api, id, &my_looks),
        ));
        let theirs = tokio::spawn(theirs.until_final(
            Some(queued),
            timeout,
            poll,
            looks(&other, id, &their_looks),
        ));
        let lease = lease_from(&*worker, "work", "w1").await;
        assert!(worker.start(&lease).await.unwrap());
        let recorded = match &result {
            Some(r) => worker.complete(&lease, r.clone()).await.unwrap(),
            None => worker
                .fail(
                    &lease,
                    Failure::new(FailureCause::Unanswered, Charge::Keep, "no answer"),
                )
                .await
                .unwrap(),
        };
        assert_eq!(recorded, Finish::Recorded);
        for (label, waiter, counter) in
            [("mine", mine, &my_looks), ("theirs", theirs, &their_looks)]
        {
            let info = waiter.await.unwrap().unwrap().expect("the job");
            match &result {
                Some(r) => assert_eq!(
                    info.status,
                    JobStatus::Succeeded {
                        result: r.clone(),
                        head: None
                    },
                    "{id} {label}"
                ),
                None => assert!(
                    matches!(
                        info.status,
                        JobStatus::Failed {
                            cause: FailureCause::Unanswered,
                            ..
                        }
                    ),
                    "{id} {label}: {:?}",
                    info.status
                ),
            }
            assert_eq!(
                info.job.provider, "p",
                "{id} {label}: the provider from the config"
            );
            let read = counter.load(Ordering::SeqCst);
            if label == "mine" && id != "f3" {
                assert_eq!(read, 0, "{id}: the submitting pod read the record back");
            } else {
                assert!(
                    read >= 1,
                    "{id} {label}: woken by the id, it reads ({read})"
                );
            }
        }
    }
}

async fn submit_on(q: &RedisJobQueue, id: &str) -> tollgate_core::job::Job {
    match q.submit(request(id, "pia", "work")).await.unwrap() {
        SubmitOutcome::Queued { job, .. } => job,
        other => panic!("not queued: {other:?}"),
    }
}

/// A worker sends its claim and its run's start mark together. When the
/// claim's answer is not known (here Redis refuses it: the worker's ACL
/// reaches the queue's keys, not the user's budget), the run never called
/// the provider: the mark is taken
/// back and the job handed back, so its next run does not count this one as
/// started (a failure of that run then releases the charge, as for a run that
/// never started).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_a_claim_that_failed_takes_its_start_mark_back() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let mut conn = raw(&server).await;
    let _: () = ::redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "claimless",
                "on",
                "nopass",
                "~*{q:*",
                "&*",
                "+@all",
            ][..],
        )
        .query_async(&mut conn)
        .await
        .unwrap();
    let (api, _) = redis_queue(&server, &prefix, config()).await;
    let claimless = format!("redis://claimless:any@127.0.0.1:{}/", server.port());
    let (cut, _) = redis_queue_at(&claimless, &prefix, config(), options()).await;
    submit_on(&api, "m1").await;
    let lease = lease_from(&*cut, "work", "w1").await;
    assert!(!lease.ran_before);
    let err = cut.start(&lease).await.expect_err("the claim cannot run");
    assert!(err.to_string().contains("no permissions"), "{err}");
    let job = KeySpace::new(&prefix).unwrap().jobs("work").job("m1");
    let started = |mut conn: ::redis::aio::MultiplexedConnection| {
        let job = job.clone();
        async move {
            let mark: Option<String> = ::redis::cmd("HGET")
                .arg(&job)
                .arg("started")
                .query_async(&mut conn)
                .await
                .unwrap();
            mark
        }
    };
    assert_eq!(
        started(conn.clone()).await,
        None,
        "the start mark was taken back"
    );
    assert_eq!(cut.hand_back(&lease).await.unwrap(), Finish::Recorded);
    let again = lease_from(&*api, "work", "w2").await;
    assert!(!again.ran_before, "the failed start did not count as a run");
    assert!(api.start(&again).await.unwrap());
    assert_eq!(
        started(conn).await.as_deref(),
        Some("1"),
        "a claimed run is marked"
    );
}

/// A worker asks for its job's first slot while the job claims its charge.
/// A job that then does not run (an operator cancelled its charge before the
/// claim) ends the slot it was granted: the provider's only slot
/// (`max_concurrent = 1`) goes to the next job at once, not at the end of
/// the slot's hold (10 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_a_slot_granted_to_a_job_that_does_not_run_is_ended() {
    let toml = CONFIG.replace("max_wait = \"5s\"", "max_wait = \"5s\"\nmax_concurrent = 1");
    let config = Arc::new(Config::parse(&toml, "one slot").unwrap());
    // A job queue on Redis, whose claim takes a round trip: the slot (an
    // in-process throttle's, granted at once) is granted meanwhile.
    let server = RedisServer::start();
    let (queue, ledger) = redis_queue(&server, &random_prefix(), Arc::clone(&config)).await;
    let r = queue.submit(request("x1", "uma", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    let refund =
        tollgate_core::refund::operator_refund(&*ledger, &*queue, &user("uma"), &rid("x1"))
            .await
            .unwrap();
    assert!(
        matches!(
            refund,
            tollgate_core::ledger::RefundOutcome::Cancelled { .. }
        ),
        "{refund:?}"
    );
    let worker = worker_role(&config, queue.clone(), 32);
    let cancelled = queue
        .wait(&user("uma"), &rid("x1"), Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(
            cancelled.status,
            JobStatus::Failed {
                cause: FailureCause::Cancelled,
                ..
            }
        ),
        "{:?}",
        cancelled.status
    );
    let r = queue.submit(request("x2", "uma", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    let next = queue
        .wait(&user("uma"), &rid("x2"), Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(next.status, JobStatus::Succeeded { .. }),
        "the only slot was not given back: {:?}",
        next.status
    );
    worker.stop().await;
}

/// A job's input is never parsed by a script. A large one (~1 MB of small
/// JSON objects) is submitted, leased and finished without holding Redis:
/// `SLOWLOG` logs nothing above 5 ms (the lease decoded it in Lua before,
/// ~18 ms here). One that is not JSON (a record damaged in Redis) is failed
/// by the worker that leased it, and its charge released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_inputs_are_parsed_by_the_worker_not_in_redis() {
    let toml = CONFIG.replace("max_stored_bytes = 20000", "max_stored_bytes = 40000000");
    let config = Arc::new(Config::parse(&toml, "large inputs").unwrap());
    let server = RedisServer::start();
    let prefix = random_prefix();
    let (q, ledger) = redis_queue(&server, &prefix, config).await;
    let mut conn = raw(&server).await;
    let messages: Vec<Value> = (0..20_000)
        .map(|i| json!({ "role": "user", "content": format!("hello world number {i}") }))
        .collect();
    let input = json!({ "messages": messages });
    assert!(input.to_string().len() > 1_000_000);
    slowlog::quick_in_three_tries("a job with a 1 MB input", async |attempt| {
        slowlog::start(&mut conn, slowlog::LIMIT_US, 128)
            .await
            .unwrap();
        let id = format!("big{attempt}");
        let mut call = request(&id, "omar", "work");
        call.input = input.clone();
        let r = q.submit(call).await.unwrap();
        assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
        let lease = lease_from(&*q, "work", "w1").await;
        assert_eq!(lease.job.input, input);
        assert!(q.start(&lease).await.unwrap());
        let done = q.complete(&lease, json!({ "ok": true })).await.unwrap();
        assert_eq!(done, Finish::Recorded);
        ((), slowlog::over_limit(&mut conn).await.unwrap().1)
    })
    .await;
    let used = ledger.usage(&user("omar")).await.unwrap().used;
    let r = q.submit(request("damaged", "omar", "work")).await.unwrap();
    assert!(matches!(r, SubmitOutcome::Queued { .. }), "{r:?}");
    let key = KeySpace::new(&prefix).unwrap().jobs("work").job("damaged");
    let _: () = ::redis::cmd("HSET")
        .arg(&key)
        .arg("input")
        .arg("{not json")
        .query_async(&mut conn)
        .await
        .unwrap();
    let none = q
        .take("work", Taker::new("w1", Duration::from_millis(300), LEASE))
        .await
        .unwrap();
    assert!(none.is_none(), "a damaged job is not run: {none:?}");
    let info = q.status(&user("omar"), &rid("damaged")).await.unwrap();
    match info.expect("the damaged job").status {
        JobStatus::Failed { cause, message } => {
            assert_eq!(cause, FailureCause::Abandoned);
            assert!(message.contains("malformed"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        ledger.usage(&user("omar")).await.unwrap().used,
        used,
        "the damaged job's charge was released"
    );
}

/// The job scripts are one function library (`FCALL`; its shared prelude runs
/// once per load, not per call), loaded by the first call a Redis answers
/// "Function not found": a flushed server loads it again, and no step of a
/// job runs a script by `EVALSHA`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_the_job_scripts_are_one_library_loaded_again_after_a_flush() {
    let server = RedisServer::start();
    let (queue, _) = redis_queue(&server, &random_prefix(), config()).await;
    let conn = raw(&server).await;
    let listed = || {
        let mut conn = conn.clone();
        async move {
            ::redis::cmd("FUNCTION")
                .arg("LIST")
                .arg("LIBRARYNAME")
                .arg(tollgate_redis::scripts::JOBS.name())
                .query_async::<Vec<::redis::Value>>(&mut conn)
                .await
                .unwrap()
                .len()
        }
    };
    let evalsha = || {
        tollgate_tests::redis_info::command_calls(&server.url())
            .get("evalsha")
            .copied()
            .unwrap_or(0)
    };
    let before = evalsha();
    submit_on(&queue, "f1").await;
    assert_eq!(listed().await, 1, "the job library is loaded");
    ::redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async::<()>(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(listed().await, 0);
    let lease = lease_from(&*queue, "work", "w1").await;
    assert_eq!(listed().await, 1, "loaded again");
    assert!(queue.start(&lease).await.unwrap());
    assert_eq!(
        queue.complete(&lease, json!({"ok": true})).await.unwrap(),
        Finish::Recorded
    );
    assert_eq!(evalsha(), before, "no job step ran a script by EVALSHA");
}

/// A library is loaded without `REPLACE`: a second load of a version Redis
/// has answers "already exists" (and compiles nothing) and counts as done, so
/// that pods which all found a flushed library missing compile it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_a_library_redis_has_is_not_compiled_again() {
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    for library in [
        &*tollgate_redis::scripts::JOBS,
        &*tollgate_redis::scripts::BUDGET,
    ] {
        library.load_async(&mut conn).await.expect("loaded");
        library
            .load_async(&mut conn)
            .await
            .expect("already there: done");
    }
    let info: String = ::redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let loads = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_function|load:"))
        .unwrap_or_else(|| panic!("no FUNCTION LOAD in {info}"));
    let stat = |name: &str| -> u64 {
        loads
            .split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {loads}"))
    };
    assert_eq!(stat("calls"), 4, "{loads}");
    assert_eq!(
        stat("failed_calls"),
        2,
        "each second load was refused: {loads}"
    );
}

/// A process loads the budget, job and throttle libraries as it connects, so
/// that no call pays for compiling one (a grant's use-by would shrink by it):
/// the libraries are there before any `FCALL`, a second process finds them
/// and connects all the same, and a Redis user that may not run `FUNCTION`
/// connects too (its first call loads them, as before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_redis_a_process_loads_the_libraries_as_it_connects() {
    use tollgate_redis::scripts::{BUDGET, JOBS, THROTTLE};
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    let libraries = |mut conn: ::redis::aio::MultiplexedConnection| async move {
        let mut names = Vec::new();
        for lib in [&*BUDGET, &*JOBS, &*THROTTLE] {
            let listed: Vec<::redis::Value> = ::redis::cmd("FUNCTION")
                .arg("LIST")
                .arg("LIBRARYNAME")
                .arg(lib.name())
                .query_async(&mut conn)
                .await
                .unwrap();
            if !listed.is_empty() {
                names.push(lib.name().to_owned());
            }
        }
        names
    };
    let fcalls = || {
        tollgate_tests::redis_info::command_calls(&server.url())
            .get("fcall")
            .copied()
            .unwrap_or(0)
    };
    assert!(
        libraries(conn.clone()).await.is_empty(),
        "a new Redis has none"
    );
    let _first = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
        .await
        .unwrap();
    assert_eq!(
        libraries(conn.clone()).await.len(),
        3,
        "all three are loaded"
    );
    assert_eq!(fcalls(), 0, "before any call");
    let _second = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
        .await
        .expect("a process connects to a Redis that has the libraries");
    assert_eq!(libraries(conn.clone()).await.len(), 3);

    let _: () = ::redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = ::redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "nofunction",
                "on",
                "nopass",
                "~*",
                "&*",
                "+@all",
                "-function",
            ][..],
        )
        .query_async(&mut conn)
        .await
        .unwrap();
    let url = format!("redis://nofunction:any@127.0.0.1:{}/", server.port());
    let _limited = tollgate_redis::pool::connect(&url, &PoolOptions::default())
        .await
        .expect("a Redis user without FUNCTION connects all the same");
    assert!(
        libraries(conn.clone()).await.is_empty(),
        "that user could not load them"
    );
}

/// Workers shared fairly between users (`WorkerConfig::user_share`).
mod fair {
    use super::*;

    /// A provider whose calls wait until the test opens its gate, counting the
    /// calls of each user under way (and the most at once).
    #[derive(Debug)]
    struct Held {
        open: tokio::sync::watch::Sender<bool>,
        running: std::sync::Mutex<std::collections::HashMap<String, (u32, u32)>>,
    }

    impl Held {
        fn new() -> Self {
            Self {
                open: tokio::sync::watch::channel(false).0,
                running: std::sync::Mutex::default(),
            }
        }

        /// (under way now, most at once) of `who`.
        fn of(&self, who: &str) -> (u32, u32) {
            self.running
                .lock()
                .unwrap()
                .get(who)
                .copied()
                .unwrap_or_default()
        }

        /// Waits (at most `within`) until `who` has `n` calls under way.
        async fn until_running(&self, who: &str, n: u32, within: Duration) -> bool {
            let deadline = tokio::time::Instant::now() + within;
            while self.of(who).0 < n {
                if tokio::time::Instant::now() >= deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            true
        }
    }

    #[async_trait::async_trait]
    impl Client for Held {
        /// Asks for no slot ahead and streams nothing: `_opts` unused.
        async fn call(
            &self,
            job: &tollgate_core::job::Job,
            _opts: CallOptions<'_>,
        ) -> Result<Answer, CallError> {
            {
                let mut running = self.running.lock().unwrap();
                let (now, most) = running.entry(job.user.to_string()).or_default();
                *now += 1;
                *most = (*most).max(*now);
            }
            let mut open = self.open.subscribe();
            let _ = open.wait_for(|o| *o).await;
            if let Some((now, _)) = self.running.lock().unwrap().get_mut(job.user.as_str()) {
                *now -= 1;
            }
            Ok(Answer::body(json!({})))
        }
    }

    /// Workers shared fairly: one user's jobs hold at most half of a worker's
    /// slots (the default `user_share`), and a worker with a free slot takes
    /// another user's job past that user's backlog (the taken jobs of a user at
    /// its cap go back to the tail of the queue, their attempt not counted).
    /// Before: user A's 10 blocked calls held all 4 slots and B's job waited
    /// behind them.
    async fn job_a_users_jobs_hold_at_most_its_share_of_a_worker(s: &Setup) {
        let provider = Arc::new(Held::new());
        let mut cfg = tollgate_worker::WorkerConfig::new(config());
        cfg.concurrency = 4;
        cfg.block = Duration::from_millis(100);
        cfg.operations = vec!["other".into()];
        let metrics = Arc::clone(&cfg.metrics);
        let providers =
            BTreeMap::from([("p".to_owned(), Arc::clone(&provider) as Arc<dyn Client>)]);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let role = tokio::spawn(tollgate_worker::run(
            cfg,
            Arc::clone(&s.source),
            providers,
            async {
                let _ = stopped.await;
            },
        ));
        let mut ids = Vec::new();
        for i in 0..10 {
            let id = format!("a{i}");
            let out = s.queue.submit(request(&id, "ann", "other")).await.unwrap();
            assert!(matches!(out, SubmitOutcome::Queued { .. }), "{out:?}");
            ids.push(rid(&id));
        }
        assert!(
            provider
                .until_running("ann", 2, Duration::from_secs(5))
                .await,
            "ann's calls did not start"
        );
        let out = s.queue.submit(request("b0", "bob", "other")).await.unwrap();
        assert!(matches!(out, SubmitOutcome::Queued { .. }), "{out:?}");
        assert!(
            provider
                .until_running("bob", 1, Duration::from_secs(3))
                .await,
            "bob's job did not start while ann's held the worker: {:?}",
            provider.of("ann")
        );
        // A while longer: ann never holds more than her share (2 of 4).
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            provider.of("ann"),
            (2, 2),
            "ann's calls under way, most at once"
        );
        assert!(
            metrics.render().lines().any(|l| l
                .starts_with("tollgate_worker_jobs_deferred_total{operation=\"other\"}")
                && !l.ends_with(" 0")),
            "deferred takes are counted"
        );
        provider.open.send_replace(true);
        ids.push(rid("b0"));
        let (ok, failed) = tollgate_tests::jobs::wait_final(
            &*s.queue,
            &user("ann"),
            &ids[..10],
            Duration::from_secs(10),
        )
        .await;
        assert_eq!((ok.len(), failed), (10, vec![]));
        let info = s
            .queue
            .wait(&user("bob"), &rid("b0"), Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(info.status, JobStatus::Succeeded { .. }),
            "{info:?}"
        );
        // Each charged once, whatever went round the queue.
        assert_eq!((s.used("ann").await, s.used("bob").await), (10, 1));
        for id in &ids[..10] {
            let info = s.queue.status(&user("ann"), id).await.unwrap().unwrap();
            assert_eq!(info.job.run, 1, "a deferred take counts no attempt");
        }
        let _ = stop.send(());
        role.await.unwrap().unwrap();
    }

    /// What deferral costs Redis: one worker (4 slots), one user at its cap
    /// (2 calls held) with 98 more of its jobs queued (its whole budget); the
    /// worker takes and defers them round after round, waiting between rounds
    /// (50 ms doubling to 1 s). Measured over 6 s once the waits reached 1 s:
    /// each round is ~98 x (BLMOVE + job_lease + job_hand_back), about one a
    /// second.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn job_redis_a_backlog_of_capped_jobs_is_not_spun_on() {
        let s = Setup::redis().await;
        let url = s._server.as_ref().unwrap().url();
        s.ledger.set_plan(&user("ann"), "roomy").await.unwrap();
        let provider = Arc::new(Held::new());
        let mut cfg = tollgate_worker::WorkerConfig::new(config());
        cfg.concurrency = 4;
        cfg.operations = vec!["other".into()];
        let metrics = Arc::clone(&cfg.metrics);
        let providers =
            BTreeMap::from([("p".to_owned(), Arc::clone(&provider) as Arc<dyn Client>)]);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let role = tokio::spawn(tollgate_worker::run(
            cfg,
            Arc::clone(&s.source),
            providers,
            async {
                let _ = stopped.await;
            },
        ));
        for i in 0..100 {
            let out = s
                .queue
                .submit(request(&format!("a{i}"), "ann", "other"))
                .await
                .unwrap();
            assert!(matches!(out, SubmitOutcome::Queued { .. }), "{out:?}");
        }
        assert!(
            provider
                .until_running("ann", 2, Duration::from_secs(5))
                .await
        );
        // The waits reach their longest (1 s) within 50+100+...+1000 ms.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let deferred = |m: &tollgate_core::metrics::Metrics| -> u64 {
            m.render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("tollgate_worker_jobs_deferred_total{operation=\"other\"} ")
                })
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        let (before, d0) = (
            tollgate_tests::redis_info::command_calls(&url),
            deferred(&metrics),
        );
        let window = Duration::from_secs(6);
        tokio::time::sleep(window).await;
        let (after, d1) = (
            tollgate_tests::redis_info::command_calls(&url),
            deferred(&metrics),
        );
        let total: u64 = after
            .iter()
            .map(|(k, n)| n - before.get(k).copied().unwrap_or(0))
            .sum();
        let per_second = total as f64 / window.as_secs_f64();
        let deferrals = (d1 - d0) as f64 / window.as_secs_f64();
        eprintln!(
            "deferral cost: {per_second:.0} Redis commands/s, {deferrals:.0} deferrals/s, {:?}",
            after
                .iter()
                .map(|(k, n)| (k.as_str(), n - before.get(k).copied().unwrap_or(0)))
                .filter(|(_, n)| *n > 0)
                .collect::<Vec<_>>()
        );
        assert_eq!(provider.of("ann"), (2, 2));
        // Spinning: thousands of deferrals a second (3 round trips each).
        assert!(deferrals < 300.0, "{deferrals} deferrals/s");
        provider.open.send_replace(true);
        let ids: Vec<RequestId> = (0..100).map(|i| rid(&format!("a{i}"))).collect();
        let (ok, failed) = tollgate_tests::jobs::wait_final(
            &*s.queue,
            &user("ann"),
            &ids,
            Duration::from_secs(20),
        )
        .await;
        assert_eq!((ok.len(), failed), (100, vec![]));
        assert_eq!(s.used("ann").await, 100);
        let _ = stop.send(());
        role.await.unwrap().unwrap();
    }

    on_each_backend!(
        [job_a_users_jobs_hold_at_most_its_share_of_a_worker]
        memory => &super::Setup::memory(),
        redis => &super::Setup::redis().await,
    );
}
