//! A grant that goes stale between its waiter's wake-up and the send of its
//! call (the process paused while the call was being prepared) never reaches
//! the upstream: the client drops it (its token is lost) and sends on a fresh
//! grant, within its `max_wait`. In process and on Redis, for a grant taken on
//! the way in (the bucket had a token) and for one a throttler made (queued
//! first).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use tollgate_core::{
    activity::{ActivityLog, RecordingThrottle},
    config::Config,
    job::Job,
    metrics::Metrics,
    throttle::{late_bound, Throttle, LATE_GRANT},
};
use tollgate_memory::activity::MemoryActivity;
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_providers::{
    http::HttpTransport, Answer, AttemptError, AttemptOptions, CallOptions, Client, Retry,
    ThrottledClient, Transport,
};
use tollgate_redis::throttle::RedisThrottleOptions;
use tollgate_tests::throttle::late_grants;
use tollgate_tests::upstream::Upstream;

use crate::throttle::{rid, RedisSetup};

/// `tempo` (5/s) and `slow` (2/s) as in the conformance config, each calling
/// the recording upstream at `url`.
fn config(url: &str) -> Config {
    let text = format!(
        r#"
[plans.free]
limit = 1
window = "1h"
[providers.tempo]
rate = 5
burst = 1
max_wait = "10s"
url = "{url}"
[providers.slow]
rate = 2
burst = 1
max_wait = "10s"
url = "{url}"
[operations.w]
cost = 1
provider = "tempo"
path = "/tempo"
[operations.s]
cost = 1
provider = "slow"
path = "/slow"
"#
    );
    Config::parse(&text, "late at send").expect("test config")
}

/// The HTTP transport, held up for `stall` once, after the grant and before
/// the request is built: what a pause of the process there does.
#[derive(Debug)]
struct Stalls {
    inner: HttpTransport,
    stall: Duration,
    stalled: AtomicBool,
}

#[async_trait]
impl Transport for Stalls {
    async fn attempt(&self, job: &Job, opts: AttemptOptions<'_>) -> Result<Answer, AttemptError> {
        if !self.stalled.swap(true, Ordering::SeqCst) {
            tokio::time::sleep(self.stall).await;
        }
        self.inner.attempt(job, opts).await
    }
}

/// `queued`: the bucket's one token goes to another call first, so the
/// stalled call's grant comes from a throttler (Redis) or the bucket's driver.
async fn stale_grant_is_handed_back(
    throttle: Arc<dyn Throttle>,
    metrics: Arc<Metrics>,
    config: &Config,
    upstream: &Upstream,
    provider: &str,
    queued: bool,
) {
    let log = Arc::new(MemoryActivity::new());
    let recording: Arc<dyn Throttle> = Arc::new(RecordingThrottle::new(
        throttle,
        Arc::clone(&log) as Arc<dyn ActivityLog>,
    ));
    let p = config.provider(provider).expect("provider").clone();
    if queued {
        recording
            .acquire(provider, &rid("first"), Duration::from_secs(5))
            .await
            .expect("the bucket's token");
    }
    let late = late_bound(p.rate, LATE_GRANT);
    let transport = Stalls {
        inner: HttpTransport::new(provider, config.upstream(provider).expect("url"), config)
            .expect("http client"),
        stall: late + Duration::from_millis(300),
        stalled: AtomicBool::new(false),
    };
    let client = ThrottledClient::new(
        Arc::clone(&recording),
        p.clone(),
        Retry::default(),
        transport,
        Arc::clone(&metrics),
    );
    let operation = if provider == "tempo" { "w" } else { "s" };
    let id = format!("stale-{provider}");
    let job = tollgate_tests::jobs::job(&id, "u", operation, provider, json!({ "q": 1 }));
    let answer = client
        .call(&job, CallOptions::default())
        .await
        .expect("sent on a fresh grant, within max_wait");
    assert_eq!(answer.body["echo"], json!({ "q": 1 }));
    let arrivals: Vec<_> = upstream
        .arrivals()
        .into_iter()
        .filter(|a| a.path == provider)
        .collect();
    assert_eq!(arrivals.len(), 1, "one call reached the upstream");
    let view = log.read().await.expect("activity");
    let grants = view.grants.get(provider).copied().unwrap_or(0);
    assert_eq!(
        grants,
        2 + u64::from(queued),
        "the stale grant was not used: the call waited for a fresh one"
    );
    let (last_ms, _) = view.waits[provider][0];
    let age_ms = (arrivals[0].at_us / 1000).saturating_sub(last_ms);
    assert!(
        age_ms <= late.as_millis() as u64,
        "the upstream got a call on a grant {age_ms} ms old (late past {late:?})"
    );
    let text = metrics.render();
    let line = format!("tollgate_throttle_late_grants_total{{provider=\"{provider}\"}} 1");
    assert!(text.contains(&line), "{line}\n{text}");
}

async fn memory_case(provider: &str, queued: bool) {
    let upstream = Upstream::unlimited(Duration::ZERO).await;
    let config = config(&upstream.url());
    let metrics = Arc::new(Metrics::new(&config));
    let throttle: Arc<dyn Throttle> =
        Arc::new(MemoryThrottle::metered(&config, Arc::clone(&metrics)));
    stale_grant_is_handed_back(throttle, metrics, &config, &upstream, provider, queued).await;
}

async fn redis_case(provider: &str, queued: bool) {
    let upstream = Upstream::unlimited(Duration::ZERO).await;
    let config = config(&upstream.url());
    let metrics = Arc::new(Metrics::new(&config));
    let setup = RedisSetup::start(
        true,
        RedisThrottleOptions {
            metrics: Some(Arc::clone(&metrics)),
            ..Default::default()
        },
    )
    .await;
    let throttle: Arc<dyn Throttle> = setup.throttle.clone();
    stale_grant_is_handed_back(throttle, metrics, &config, &upstream, provider, queued).await;
    setup.stop().await;
}

/// Taken on the way in (the bucket had its token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_late_at_send_memory_direct() {
    memory_case("tempo", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_late_at_send_memory_queued() {
    memory_case("slow", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_late_at_send_redis_direct() {
    redis_case("tempo", false).await;
}

/// Granted by the throttler (the bucket's token went to another call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_late_at_send_redis_queued() {
    redis_case("slow", true).await;
}

/// A grant is as old as Redis's clock says, not as old as the enqueue that
/// asked for it took to run. An enqueue that waited behind other traffic on
/// its connection (here a BLPOP on the process's one connection; in a flood,
/// hundreds of waiters enqueueing at once over a few connections) made its
/// grant look that much older: a fresh grant was thrown away as late (its
/// token lost), or taken with its send deadline already past.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_a_slow_enqueue_does_not_age_its_grant() {
    use tollgate_redis::{keys::KeySpace, pool::PoolOptions, throttle::RedisThrottle};
    let setup = RedisSetup::start(true, Default::default()).await;
    let options = PoolOptions {
        max_size: 1,
        ..Default::default()
    };
    let pool = tollgate_redis::pool::connect(&setup.server().url(), &options)
        .await
        .expect("connect");
    let tollgate_redis::pool::Pool::Single(single) = pool.clone() else {
        panic!("a standalone Redis")
    };
    let config = crate::throttle::config();
    let metrics = Arc::new(Metrics::new(&config));
    // `slow`: 2/s, burst 1; its grants are late past 200 ms.
    let throttle = RedisThrottle::start(
        pool,
        KeySpace::new(&setup.prefix).expect("prefix"),
        &config,
        RedisThrottleOptions {
            late_grant: Duration::from_millis(200),
            metrics: Some(Arc::clone(&metrics)),
            ..Default::default()
        },
    );
    assert!(throttle.subscribed(Duration::from_secs(5)).await);
    let wait = Duration::from_secs(10);
    // Acquires `id` with the process's one connection held for `secs`,
    // from 50 ms before the acquire.
    let behind = |secs: f64, id: &'static str| {
        let (single, throttle) = (single.clone(), &throttle);
        async move {
            let blocker = tokio::spawn(async move {
                let mut c = tollgate_redis::pool::checkout(&single)
                    .await
                    .expect("a connection");
                let _: redis::Value = redis::cmd("BLPOP")
                    .arg("tollgate-test-nothing")
                    .arg(secs)
                    .query_async(&mut c.conn)
                    .await
                    .expect("BLPOP");
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            let grant = throttle.acquire("slow", &rid(id), wait).await.expect(id);
            blocker.await.expect("blocker");
            grant
        }
    };
    // On an idle connection, the bucket's token.
    throttle
        .acquire("slow", &rid("first"), wait)
        .await
        .expect("first");
    // Taken on the way in, its enqueue run 550 ms after it was sent (the
    // bucket refilled meanwhile): the grant is fresh, usable for its 200 ms.
    let second = behind(0.6, "second").await;
    assert!(
        tollgate_providers::late_by(second.use_by).is_none(),
        "a fresh grant taken on the way in was past its use-by: {:?}",
        tollgate_providers::late_by(second.use_by)
    );
    // Queued: its enqueue runs 350 ms after it was sent, and a throttler
    // grants it when the bucket refills, about 100 ms later.
    let third = behind(0.4, "third").await;
    assert_eq!(
        late_grants(&metrics.render(), Some("slow")),
        0.0,
        "a fresh grant was thrown away as late"
    );
    assert!(tollgate_providers::late_by(third.use_by).is_none());
    setup.stop().await;
}
