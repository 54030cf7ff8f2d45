//! Readiness signals on a Redis Cluster are sharded pub/sub: a grant is
//! SPUBLISHed on the primary that owns its provider, a finished job on the one
//! that owns its queue, and nothing is PUBLISHed (a PUBLISH goes to every node
//! over the cluster bus). A waiter still gets its grant when its provider's
//! primary fails over: its subscription moves to the promoted replica, and the
//! re-check that follows finds a grant published while it moved.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::{JobOptions, JobQueue, JobRequest, JobSource, JobStatus},
    ledger::Ledger,
    throttle::{Dispatch, Throttle},
};
use tollgate_redis::{
    jobs::RedisJobQueue,
    keys::KeySpace,
    ledger::RedisLedger,
    pool::{Pool, PoolOptions},
    throttle::{Dispatcher, RedisThrottle, RedisThrottleOptions},
};
use tollgate_tests::jobs::take_one;
use tollgate_tests::{random_prefix, RedisCluster};

use crate::cluster_failover::{primary_of, redis_cli, replicated};

const CONFIG: &str = r#"
[plans.free]
limit = 1000
window = "1h"
[providers.llm]
rate = 0.5
burst = 1
max_wait = "60s"
[operations.work]
cost = 1
provider = "llm"
"#;

fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "sharded pub/sub").expect("test config"))
}

fn rid(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

struct Throttled {
    pool: Pool,
    keys: KeySpace,
    throttle: Arc<RedisThrottle>,
    dispatcher: Dispatcher,
}

async fn throttled(cluster: &RedisCluster, options: RedisThrottleOptions) -> Throttled {
    let keys = KeySpace::new(&random_prefix()).unwrap();
    let pool = tollgate_redis::pool::connect(&cluster.url(), &PoolOptions::default())
        .await
        .expect("connect to the cluster");
    let config = config();
    let throttle = Arc::new(RedisThrottle::start(
        pool.clone(),
        keys.clone(),
        &config,
        options,
    ));
    let provider = config.providers().next().unwrap();
    let dispatcher = Dispatcher::new(pool.clone(), &keys, provider, "t1");
    Throttled {
        pool,
        keys,
        throttle,
        dispatcher,
    }
}

impl Throttled {
    /// A wait for a slot of `llm`, in the background.
    fn wait(&self, id: &str) -> tokio::task::JoinHandle<bool> {
        let throttle = Arc::clone(&self.throttle);
        let id = rid(id);
        tokio::spawn(async move {
            throttle
                .acquire("llm", &id, Duration::from_secs(60))
                .await
                .is_ok()
        })
    }

    /// Serves the queue (through failures: a primary may be failing over)
    /// until `waits` all ended; true when each got its slot.
    async fn serve(&self, waits: Vec<tokio::task::JoinHandle<bool>>) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !waits.iter().all(|w| w.is_finished()) {
            assert!(
                Instant::now() < deadline,
                "waiters still waiting after 60 s"
            );
            let _ = self.dispatcher.pump(64).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut all = true;
        for w in waits {
            all &= w.await.unwrap();
        }
        all
    }

    /// Waits until `n` tickets are queued.
    async fn queued(&self, via: u16, n: usize) {
        let queue = self.keys.throttle("llm").queue;
        let primary = primary_of(via, &queue).expect("a primary");
        let deadline = Instant::now() + Duration::from_secs(20);
        while redis_cli(primary, &["llen", &queue]) != n.to_string() {
            assert!(Instant::now() < deadline, "{n} tickets never queued");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `calls` of `command` in the `INFO commandstats` of the node on `port`.
fn calls(port: u16, command: &str) -> u64 {
    let stats = redis_cli(port, &["info", "commandstats"]);
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a count"))
}

fn is_primary(port: u16) -> bool {
    redis_cli(port, &["info", "replication"]).contains("role:master")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_readiness_signals_are_sharded_on_the_owning_primaries() {
    let cluster = RedisCluster::start(3);
    let via = cluster.nodes[0].port();
    for n in &cluster.nodes {
        assert_eq!(redis_cli(n.port(), &["config", "resetstat"]), "OK");
    }
    let t = throttled(&cluster, RedisThrottleOptions::default()).await;

    // Grants: the first waiter takes the bucket's token on its way in; the
    // second queues and is granted by the throttler (a published grant).
    let first = t.wait("g1");
    assert!(t.serve(vec![first]).await);
    let second = t.wait("g2");
    t.queued(via, 1).await;
    assert!(
        t.serve(vec![second]).await,
        "the queued waiter got its slot"
    );

    // A finished job wakes its waiter.
    let config = config();
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        t.pool.clone(),
        t.keys.clone(),
        Arc::clone(&config),
    ));
    let options = JobOptions {
        result_ttl: Duration::from_secs(60),
        // Woken by the message, not by polling.
        poll: Duration::from_secs(60),
        release_grace: Duration::ZERO,
    };
    let q = Arc::new(RedisJobQueue::new(
        t.pool.clone(),
        t.keys.clone(),
        config,
        ledger,
        options,
    ));
    let dave = UserId::new("dave").unwrap();
    q.submit(JobRequest {
        id: rid("j1"),
        user: dave.clone(),
        operation: "work".into(),
        input: json!({}),
        trace: None,
        service_key: None,
    })
    .await
    .unwrap();
    let waiter = {
        let q = Arc::clone(&q);
        let dave = dave.clone();
        tokio::spawn(async move { q.wait(&dave, &rid("j1"), Duration::from_secs(30)).await })
    };
    // The waiter is subscribed before the job ends.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lease = take_one(&*q, "work", "w1", Duration::from_secs(5)).await;
    assert!(q.start(&lease).await.unwrap());
    q.complete(&lease, json!({"ok": true})).await.unwrap();
    let info = waiter.await.unwrap().unwrap().expect("the job");
    assert!(
        matches!(info.status, JobStatus::Succeeded { .. }),
        "{:?}",
        info.status
    );

    // Where the signals went.
    let bucket = primary_of(via, &t.keys.throttle("llm").bucket).expect("a primary");
    let queue = primary_of(via, &t.keys.jobs("work").queue).expect("a primary");
    let mut report = Vec::new();
    for n in &cluster.nodes {
        let port = n.port();
        let (publish, spublish) = (calls(port, "publish"), calls(port, "spublish"));
        report.push(format!(
            "{port} primary={} publish={publish} spublish={spublish}",
            is_primary(port)
        ));
        assert_eq!(publish, 0, "a PUBLISH, broadcast to every node: {report:?}");
        if is_primary(port) && port != bucket && port != queue {
            assert_eq!(
                spublish, 0,
                "an SPUBLISH on a primary that owns neither: {report:?}"
            );
        }
    }
    let expected = if bucket == queue { 2 } else { 1 };
    assert!(calls(bucket, "spublish") >= expected, "{report:?}");
    assert!(calls(queue, "spublish") >= 1, "{report:?}");
    // The inbox is a shard channel of the provider's primary.
    let inbox = t.keys.throttle("llm").inbox("");
    let channels = redis_cli(bucket, &["pubsub", "shardchannels", &format!("{inbox}*")]);
    assert!(channels.starts_with(&inbox), "{channels:?} {report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_waiter_gets_its_grant_after_its_providers_primary_fails_over() {
    let mut cluster = RedisCluster::start(3);
    let via = cluster.nodes[0].port();
    let t = throttled(&cluster, RedisThrottleOptions::default()).await;
    let bucket_key = t.keys.throttle("llm").bucket;

    // The bucket's token taken; the next waiter queues (one token per 2 s).
    assert!(t.serve(vec![t.wait("f1")]).await);
    let waiting = t.wait("f2");
    t.queued(via, 1).await;
    let inbox = redis_cli(
        primary_of(via, &bucket_key).unwrap(),
        &[
            "pubsub",
            "shardchannels",
            &format!("{}*", t.keys.throttle("llm").inbox("")),
        ],
    );
    assert!(
        !inbox.is_empty(),
        "the waiter's process listens on the provider's primary"
    );
    // Replicated before the kill (replication is asynchronous): a ticket the
    // replica never saw is lost with its primary, and its waiter waits out
    // its max_wait (a 300 ms sleep here failed once in CI).
    let victim = primary_of(via, &bucket_key).expect("a primary");
    replicated(victim).await;
    cluster.kill_node(victim);
    let live = cluster.node_other_than(victim);
    let promoted = Instant::now() + Duration::from_secs(30);
    let new_primary = loop {
        match primary_of(live, &bucket_key) {
            Some(p) if p != victim => break p,
            _ => {
                assert!(Instant::now() < promoted, "no replica promoted in 30 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };

    // Granted on the promoted replica as soon as the throttler reaches it:
    // heard through the subscription moved there, or found by the re-check
    // that follows its move.
    assert!(t.serve(vec![waiting]).await, "the waiter got its slot");
    // The subscription lives on the new owner.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let numsub = redis_cli(new_primary, &["pubsub", "shardnumsub", &inbox]);
        if numsub.lines().nth(1) == Some("1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no subscription on the promoted replica: {numsub:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And it hears the next grant.
    let next = t.wait("f3");
    assert!(t.serve(vec![next]).await);
}
