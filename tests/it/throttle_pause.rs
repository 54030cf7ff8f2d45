//! Shared back-off: the recording upstream answers one call 429 with
//! `Retry-After: 2` at a moment the test picks, while three pods (each its
//! own throttle client: on Redis, its own connection and subscription, one
//! throttler role serving them all) keep the provider saturated. No call
//! reaches the upstream during those 2 s, from any pod, and the rate is back
//! afterwards. In process, three clients share the one bucket.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::{config::Config, metrics::Metrics, throttle::Throttle};
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_providers::{http::HttpTransport, CallOptions, Client, Retry, ThrottledClient};
use tollgate_redis::{
    keys::KeySpace,
    pool::PoolOptions,
    throttle::{RedisThrottle, RedisThrottleOptions},
};
use tollgate_tests::throttle::max_excess;
use tollgate_tests::upstream::Upstream;

use crate::throttle::RedisSetup;

/// `steady` as the conformance config has it (20/s, burst 5: the throttler
/// role of [`RedisSetup`] serves it so), calling the recording upstream.
fn config(url: &str) -> Config {
    let text = format!(
        r#"
[plans.free]
limit = 1
window = "1h"
[providers.steady]
rate = 20
burst = 5
max_wait = "10s"
url = "{url}"
[operations.w]
cost = 1
provider = "steady"
path = "/steady"
"#
    );
    Config::parse(&text, "pause").expect("test config")
}

const RATE: f64 = 20.0;
const BURST: u64 = 5;
/// Calls in flight per pod: enough to keep the provider saturated.
const LOOPS: usize = 4;

/// Runs `LOOPS` calls at a time through each of `throttles` until `until`.
async fn load(
    throttles: Vec<Arc<dyn Throttle>>,
    config: &Config,
    metrics: &Arc<Metrics>,
    until: Instant,
) {
    let p = config.provider("steady").expect("provider").clone();
    let mut set = tokio::task::JoinSet::new();
    for (pod, throttle) in throttles.into_iter().enumerate() {
        let client = Arc::new(ThrottledClient::new(
            throttle,
            p.clone(),
            Retry::default(),
            HttpTransport::new("steady", config.upstream("steady").expect("url"), config)
                .expect("http client"),
            Arc::clone(metrics),
        ));
        for l in 0..LOOPS {
            let client = Arc::clone(&client);
            set.spawn(async move {
                let mut n = 0;
                while Instant::now() < until {
                    n += 1;
                    let id = format!("pod{pod}-l{l}-{n}");
                    let job = tollgate_tests::jobs::job(&id, "u", "w", "steady", json!({ "n": n }));
                    let deadline = tokio::time::Instant::from_std(until);
                    // A throttle timeout or an expiry at the end is no failure here.
                    let opts = CallOptions {
                        deadline: Some(deadline),
                        ..CallOptions::default()
                    };
                    let _ = client.call(&job, opts).await;
                }
            });
        }
    }
    while set.join_next().await.is_some() {}
}

/// Runs the load, refusing one call 1 s in; checks the upstream's arrivals.
async fn refused_once_pauses_every_pod(
    throttles: Vec<Arc<dyn Throttle>>,
    probe: Arc<dyn Throttle>,
    upstream: &Upstream,
    config: &Config,
) {
    let metrics = Arc::new(Metrics::new(config));
    let start = Instant::now();
    upstream.refuse_at(start + Duration::from_secs(1), "2");
    let until = start + Duration::from_millis(4400);
    let running = load(throttles, config, &metrics, until);
    let watch = async {
        // Halfway through the pause, the bucket says it is paused.
        tokio::time::sleep(Duration::from_millis(2000)).await;
        probe.stats().await.expect("stats")[0].clone()
    };
    let ((), during) = tokio::join!(running, watch);
    let arrivals = upstream.arrivals();
    let refused: Vec<_> = arrivals.iter().filter(|a| a.status == 429).collect();
    assert_eq!(refused.len(), 1, "one refusal: {refused:?}");
    let t429 = refused[0].at_us;
    // The calls granted before the pause was recorded may still be sent
    // within their grant's use-by (1/rate = 50 ms), and the refusal takes a
    // few ms to reach its pod: 100 ms of grace.
    let grace = 100_000;
    let inside: Vec<u64> = arrivals
        .iter()
        .map(|a| a.at_us)
        .filter(|&at| at > t429 + grace && at < t429 + 2_000_000)
        .map(|at| at - t429)
        .collect();
    assert!(
        inside.is_empty(),
        "calls reached the upstream during its 2 s Retry-After (µs after the 429): {inside:?}"
    );
    let before = arrivals.iter().filter(|a| a.at_us < t429).count();
    let after = arrivals
        .iter()
        .filter(|a| a.at_us >= t429 + 2_000_000 && a.at_us < t429 + 3_000_000)
        .count();
    assert!(before >= 15, "saturated before the refusal: {before} calls");
    // From an empty bucket: 20 tokens in that second; a loaded machine gets
    // most of them.
    assert!(
        after >= 12,
        "the rate is back after the pause: {after} calls in 1 s"
    );
    let times: Vec<u64> = arrivals.iter().map(|a| a.at_us).collect();
    let excess = max_excess(&times, RATE, BURST);
    assert!(
        excess <= 1.0 + 1e-6,
        "upstream saw more than burst + rate·t + 1: {excess}"
    );
    assert!(
        (500..=2000).contains(&during.paused_ms),
        "the pause shows in the stats: {during:?}"
    );
    let text = metrics.render();
    assert!(
        text.contains("tollgate_throttle_pauses_total{provider=\"steady\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_pause_a_refusal_pauses_every_pod_memory() {
    let upstream = Upstream::unlimited(Duration::ZERO).await;
    let config = config(&upstream.url());
    let throttle: Arc<dyn Throttle> = Arc::new(MemoryThrottle::new(&config));
    let throttles = vec![Arc::clone(&throttle); 3];
    refused_once_pauses_every_pod(throttles, throttle, &upstream, &config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_pause_a_refusal_pauses_every_pod_redis() {
    let upstream = Upstream::unlimited(Duration::ZERO).await;
    let config = config(&upstream.url());
    let setup = RedisSetup::start(true, RedisThrottleOptions::default()).await;
    let mut throttles: Vec<Arc<dyn Throttle>> = Vec::new();
    for _ in 0..3 {
        let pool = tollgate_redis::pool::connect(&setup.server().url(), &PoolOptions::default())
            .await
            .expect("connect");
        let pod = RedisThrottle::start(
            pool,
            KeySpace::new(&setup.prefix).expect("prefix"),
            &config,
            RedisThrottleOptions::default(),
        );
        assert!(pod.subscribed(Duration::from_secs(5)).await, "subscribed");
        throttles.push(Arc::new(pod));
    }
    let probe = Arc::clone(&throttles[0]);
    refused_once_pauses_every_pod(throttles, probe, &upstream, &config).await;
    setup.stop().await;
}
