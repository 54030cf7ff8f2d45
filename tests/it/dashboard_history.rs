//! The dashboard's history ring and job timelines, the same in memory, on
//! Redis and on a cluster: at most one sample per interval across two pods
//! sharing the store, gaps where nobody sampled, bounded in time and count;
//! a job's steps noted by the recording decorators.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate_core::activity::{Gauges, JobStep, Sampled, HISTORY_MAX_SAMPLES, HISTORY_SPAN, PLAIN};
use tollgate_core::backend::Backends;
use tollgate_core::config::Config;
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{Failure, JobRequest};
use tollgate_redis::keys::KeySpace;
use tollgate_redis::pool::PoolOptions;
use tollgate_tests::jobs::take_one;
use tollgate_tests::{random_prefix, RedisServer, TestCluster};

async fn redis_backends(url: &str, prefix: &str) -> Backends {
    let pool = tollgate_redis::pool::connect(url, &PoolOptions::default())
        .await
        .unwrap();
    tollgate_redis::backends(
        pool,
        KeySpace::new(prefix).unwrap(),
        Arc::new(Config::builtin()),
        "test".into(),
    )
}

/// The backends of two pods on `url`, under one new prefix.
async fn two_pods(url: &str) -> (Backends, Backends) {
    let prefix = random_prefix();
    let a = redis_backends(url, &prefix).await;
    (a, redis_backends(url, &prefix).await)
}

fn gauges(workers: u64) -> Gauges {
    Gauges {
        queued: BTreeMap::from([("llm.structured".to_owned(), 3)]),
        workers: Some(workers),
        ..Gauges::default()
    }
}

/// Waits (at most 10 s) until `b`'s log holds `n` spend events: a Redis log
/// is written every 250 ms.
async fn events_noted(b: &Backends, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.activity.read().await.unwrap().events.len() < n {
        assert!(Instant::now() < deadline, "the spend was never noted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two pods `a` and `b` on one store sample every slot: each slot is written
/// once, by the first; a spell nobody sampled is a gap; both read the same.
async fn one_sample_per_slot(a: Backends, b: Backends) {
    let user = UserId::new("hist").unwrap();
    a.ledger
        .reserve(&user, &RequestId::new("h-1").unwrap(), 2)
        .await
        .unwrap();
    events_noted(&a, 1).await;

    let interval = Duration::from_millis(400);
    let mut writes: BTreeMap<u64, u32> = BTreeMap::new();
    let mut count = |s: &Sampled| {
        *writes.entry(s.slot_ms).or_default() += u32::from(s.written);
    };
    for _ in 0..4 {
        let x = a.activity.sample(interval, &gauges(1)).await.unwrap();
        let y = b.activity.sample(interval, &gauges(2)).await.unwrap();
        count(&x);
        count(&y);
        assert!(y.next_in <= interval, "{y:?}");
        tokio::time::sleep(y.next_in + Duration::from_millis(40)).await;
    }
    // Three intervals nobody samples, then one sample: a gap before it.
    tokio::time::sleep(interval * 3).await;
    let last = b.activity.sample(interval, &gauges(2)).await.unwrap();
    assert!(last.written, "{last:?}");
    count(&last);
    assert!(
        writes.values().all(|n| *n == 1),
        "each slot written exactly once: {writes:?}"
    );

    let h = a.activity.history(None).await.unwrap();
    let slots: Vec<u64> = h.iter().map(|s| s.at_ms).collect();
    assert_eq!(slots, writes.keys().copied().collect::<Vec<_>>());
    assert!(slots.iter().all(|s| s % 400 == 0), "{slots:?}");
    let n = slots.len();
    assert!(n >= 5, "{slots:?}");
    assert!(
        slots[n - 1] - slots[n - 2] >= 3 * 400,
        "a gap before the last: {slots:?}"
    );
    assert!(
        slots.windows(2).take(n - 2).all(|w| w[1] - w[0] <= 800),
        "no gap while both sampled: {slots:?}"
    );
    assert!(h.iter().all(|s| s.gauges.queued["llm.structured"] == 3));
    assert!(h
        .iter()
        .all(|s| matches!(s.gauges.workers, Some(1) | Some(2))));
    assert_eq!(h[n - 1].counters.calls[PLAIN], 1, "{:?}", h[n - 1]);
    // The other pod reads the same ring, and a page reads only what is new.
    assert_eq!(b.activity.history(None).await.unwrap(), h);
    assert_eq!(
        a.activity.history(Some(slots[n - 2])).await.unwrap(),
        h[n - 1..].to_vec()
    );
}

#[tokio::test]
async fn history_in_memory_is_one_sample_per_slot() {
    // One process: its two samplers (say, two api states) share the log.
    let b = tollgate_memory::backends(Arc::new(Config::builtin()));
    one_sample_per_slot(b.clone(), b).await;
}

#[tokio::test]
async fn history_on_redis_is_one_sample_per_slot_across_pods() {
    let redis = RedisServer::start();
    let (a, b) = two_pods(&redis.url()).await;
    one_sample_per_slot(a, b).await;
}

#[tokio::test]
async fn history_on_a_cluster_is_one_sample_per_slot_across_pods() {
    let cluster = TestCluster::get();
    let (a, b) = two_pods(&cluster.url()).await;
    one_sample_per_slot(a, b).await;
}

/// On Redis the ring keeps [`HISTORY_SPAN`] and at most
/// [`HISTORY_MAX_SAMPLES`]: samples older, or past the count, go at the next
/// sample (the memory ring's bound is a unit test of `tollgate-core`).
#[tokio::test]
async fn history_on_redis_is_bounded() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let a = redis_backends(&redis.url(), &prefix).await;
    let key = KeySpace::new(&prefix).unwrap().activity().history;
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let span = HISTORY_SPAN.as_millis() as u64;
    // Ten samples from two hours ago, and the cap's worth plus ten within the span.
    let mut cmd = redis::cmd("ZADD");
    cmd.arg(&key);
    for i in 0..10u64 {
        let at = now_ms - 2 * 3_600_000 + i;
        cmd.arg(at)
            .arg(format!(r#"{{"at_ms":{at},"gauges":{{}},"counters":{{}}}}"#));
    }
    for i in 0..(HISTORY_MAX_SAMPLES as u64 + 10) {
        let at = now_ms - span / 2 + i;
        cmd.arg(at)
            .arg(format!(r#"{{"at_ms":{at},"gauges":{{}},"counters":{{}}}}"#));
    }
    let _: u64 = cmd.query_async(&mut conn).await.unwrap();
    let s = a
        .activity
        .sample(Duration::from_secs(10), &gauges(1))
        .await
        .unwrap();
    assert!(s.written);
    let n: usize = redis::cmd("ZCARD")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, HISTORY_MAX_SAMPLES);
    let oldest: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(0)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(oldest[0].1 as u64 >= now_ms - span, "{oldest:?}");
    // The newest is the sample just written, and it parses back.
    let h = a.activity.history(Some(s.slot_ms - 1)).await.unwrap();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].gauges.workers, Some(1));
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 0, "the ring expires when idle");
}

/// A job run end to end through the backends notes its timeline: charged,
/// started, granted (with its wait), failed with its cause and message, its
/// charge released; and the failure is listed.
async fn timelines_are_noted(b: Backends) {
    let user = UserId::new("tl-user").unwrap();
    let id = RequestId::new("tl-job-1").unwrap();
    let submitted = b
        .jobs
        .submit(JobRequest {
            id: id.clone(),
            user: user.clone(),
            operation: "llm.structured".into(),
            input: serde_json::json!({"prompt": "x"}),
            trace: None,
            service_key: None,
        })
        .await
        .unwrap();
    assert!(
        matches!(submitted, tollgate_core::job::SubmitOutcome::Queued { .. }),
        "{submitted:?}"
    );
    let lease = take_one(&*b.source, "llm.structured", "w-1", Duration::from_secs(5)).await;
    assert!(b.source.start(&lease).await.unwrap());
    let provider = lease.job.provider.clone();
    let waiter = tollgate_core::throttle::Waiter {
        request_id: id.clone(),
        user: user.to_string(),
        share: Default::default(),
        weight: 1,
    };
    let grant = b
        .throttle
        .acquire_as(&provider, &waiter, Duration::from_secs(5))
        .await
        .unwrap();
    b.throttle.done(&grant).await.unwrap();
    b.source
        .fail(
            &lease,
            Failure::new(
                tollgate_core::job::FailureCause::Provider,
                tollgate_core::job::Charge::RELEASE,
                "upstream answered 502\nbad gateway",
            ),
        )
        .await
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(10);
    let steps = loop {
        let steps = b
            .activity
            .timelines(&[id.to_string()])
            .await
            .unwrap()
            .remove(0);
        if steps.len() >= 5 {
            break steps;
        }
        assert!(
            Instant::now() < deadline,
            "timeline never complete: {steps:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let kinds: Vec<&str> = steps
        .iter()
        .map(|s| match s.step {
            JobStep::Charged { .. } => "charged",
            JobStep::Granted { .. } => "granted",
            JobStep::Started { .. } => "started",
            JobStep::Succeeded { .. } => "succeeded",
            JobStep::Failed { .. } => "failed",
            JobStep::Released => "released",
            JobStep::Refunded => "refunded",
        })
        .collect();
    // The failure released the charge (noted as the release lands, before
    // the failure is recorded). The slot is waited for while the job claims
    // its charge: granted and started come in either order.
    assert_eq!(kinds[0], "charged", "{steps:?}");
    let mut begun = kinds[1..3].to_vec();
    begun.sort_unstable();
    assert_eq!(begun, ["granted", "started"], "{steps:?}");
    let mut end = kinds[3..].to_vec();
    end.sort_unstable();
    assert_eq!(end, ["failed", "released"], "{steps:?}");
    assert!(steps
        .iter()
        .all(|s| s.user == "tl-user" && s.id == "tl-job-1"));
    let failure = steps
        .iter()
        .find(|s| matches!(s.step, JobStep::Failed { .. }))
        .unwrap();
    match &failure.step {
        JobStep::Failed {
            cause,
            charge_stands,
            message,
            ..
        } => {
            assert_eq!(cause, "provider");
            assert!(!charge_stands);
            assert_eq!(message, "upstream answered 502 bad gateway");
        }
        other => panic!("{other:?}"),
    }
    let failed = b.activity.failed(10).await.unwrap();
    assert_eq!(failed[0].id, "tl-job-1");
    assert_eq!(failed[0].operation, "llm.structured");
}

#[tokio::test]
async fn timelines_are_noted_in_memory() {
    timelines_are_noted(tollgate_memory::backends(Arc::new(Config::builtin()))).await;
}

#[tokio::test]
async fn timelines_are_noted_on_redis() {
    let redis = RedisServer::start();
    timelines_are_noted(redis_backends(&redis.url(), &random_prefix()).await).await;
}
