//! Failover in a pool: three members, each its own recording upstream; b
//! answers one call 429 with `Retry-After: 5` while three pods keep the
//! pool saturated (on Redis, each pod its own throttle client, one
//! throttler role serving them). No call reaches b for those 5 s, from any
//! pod, a and c take its share, the refused call is granted another member
//! at once and answered there, and no call is sent twice.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::{config::Config, metrics::Metrics, throttle::Throttle};
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_providers::{pool::PoolTransport, CallOptions, Client, Retry, ThrottledClient};
use tollgate_redis::{
    keys::KeySpace,
    pool::PoolOptions,
    throttle::{RedisThrottle, RedisThrottleOptions},
};
use tollgate_tests::upstream::Upstream;

use crate::throttle::RedisSetup;

/// The conformance config (its throttler role serves `zz-failover` so) with
/// the members' upstreams in place.
pub(crate) fn config(upstreams: &[Upstream; 3]) -> Config {
    let mut text = crate::throttle::CONFIG.to_owned();
    for (u, name) in upstreams.iter().zip(["a", "b", "c"]) {
        text = text.replace(
            &format!("http://127.0.0.1:9/{name}\""),
            &format!("{}\"", u.url()),
        );
    }
    Config::parse(&text, "pool failover").expect("test config")
}

/// Calls in flight per pod: enough to keep the pool saturated.
const LOOPS: usize = 6;

/// Runs `LOOPS` calls at a time through each of `throttles` until `until`;
/// the ids of the calls answered.
async fn load(
    throttles: Vec<Arc<dyn Throttle>>,
    config: &Config,
    metrics: &Arc<Metrics>,
    until: Instant,
) -> Vec<String> {
    let p = config.provider("zz-failover").expect("provider").clone();
    let answered = Arc::new(Mutex::new(Vec::new()));
    let mut set = tokio::task::JoinSet::new();
    for (pod, throttle) in throttles.into_iter().enumerate() {
        let client = Arc::new(ThrottledClient::new(
            throttle,
            p.clone(),
            // One attempt only: the failover is none of them.
            Retry {
                retries: 0,
                ..Retry::default()
            },
            PoolTransport::new(&p, config).expect("pool transport"),
            Arc::clone(metrics),
        ));
        for l in 0..LOOPS {
            let client = Arc::clone(&client);
            let answered = Arc::clone(&answered);
            set.spawn(async move {
                let mut n = 0;
                while Instant::now() < until {
                    n += 1;
                    let id = format!("pod{pod}-l{l}-{n}");
                    let user = format!("u{}", (pod * LOOPS + l) % 5);
                    let job = tollgate_tests::jobs::job(
                        &id,
                        &user,
                        "fw",
                        "zz-failover",
                        json!({ "n": n }),
                    );
                    let opts = CallOptions {
                        deadline: Some(tokio::time::Instant::from_std(until)),
                        ..CallOptions::default()
                    };
                    match client.call(&job, opts).await {
                        Ok(_) => answered.lock().unwrap().push(id),
                        Err(e) => {
                            // Only the end of the run may cut a call short.
                            let end = Instant::now() + Duration::from_millis(300) >= until;
                            assert!(end, "{id} failed mid-run: {e:?}");
                        }
                    }
                }
            });
        }
    }
    while let Some(r) = set.join_next().await {
        r.expect("a load loop");
    }
    let out = answered.lock().unwrap().clone();
    out
}

async fn a_refused_member_is_passed_over(
    throttles: Vec<Arc<dyn Throttle>>,
    upstreams: &[Upstream; 3],
    config: &Config,
) {
    let metrics = Arc::new(Metrics::new(config));
    let start = Instant::now();
    upstreams[1].refuse_at(start + Duration::from_secs(1), "5");
    let answered = load(
        throttles,
        config,
        &metrics,
        start + Duration::from_millis(7500),
    )
    .await;
    let arrivals: Vec<_> = upstreams.iter().map(Upstream::arrivals).collect();
    let refused: Vec<_> = arrivals[1].iter().filter(|a| a.status == 429).collect();
    assert_eq!(refused.len(), 1, "one refusal: {refused:?}");
    let t429 = refused[0].at_us;
    // Calls granted b before the pause was recorded may still go out
    // within their use-by, and the refusal takes a few ms to reach its pod.
    let grace = 100_000;
    let inside: Vec<u64> = arrivals[1]
        .iter()
        .map(|a| a.at_us)
        .filter(|&at| at > t429 + grace && at < t429 + 5_000_000)
        .map(|at| at - t429)
        .collect();
    assert!(
        inside.is_empty(),
        "calls reached b during its 5 s Retry-After (µs after): {inside:?}"
    );
    // a and c took its share meanwhile, and b is back after.
    for (i, name) in [(0, "a"), (2, "c")] {
        let during = arrivals[i]
            .iter()
            .filter(|a| a.at_us > t429 + 1_000_000 && a.at_us < t429 + 4_000_000)
            .count();
        // 3 s at ~8/s each: its own rate, whatever b does.
        assert!(
            during >= 12,
            "{name} took {during} calls in 3 s of b's pause"
        );
    }
    let back = arrivals[1]
        .iter()
        .filter(|a| a.at_us >= t429 + 5_000_000)
        .count();
    assert!(back >= 2, "b is back after its pause: {back} calls");
    // Every answered call reached exactly one upstream with a 200, the
    // refused one included (granted another member at once): none twice.
    let mut sent: BTreeMap<String, usize> = BTreeMap::new();
    for a in arrivals.iter().flatten().filter(|a| a.status == 200) {
        *sent.entry(a.job.clone().expect("the job id")).or_default() += 1;
    }
    let twice: Vec<_> = sent.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "calls sent twice: {twice:?}");
    assert_eq!(
        sent.len(),
        answered.len(),
        "one answered upstream call per answered job"
    );
    let refused_job = refused[0].job.clone().expect("the refused call's job");
    assert!(
        answered.contains(&refused_job),
        "the refused call was answered by another member"
    );
    let again = arrivals
        .iter()
        .flatten()
        .find(|a| a.job.as_ref() == Some(&refused_job) && a.status == 200)
        .expect("sent again");
    assert!(
        again.at_us - t429 < 2_500_000,
        "granted another member, not after the Retry-After: {} µs",
        again.at_us - t429
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_pool_a_refused_member_is_passed_over_memory() {
    let upstreams = [
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
    ];
    let config = config(&upstreams);
    let throttle: Arc<dyn Throttle> = Arc::new(MemoryThrottle::new(&config));
    a_refused_member_is_passed_over(vec![Arc::clone(&throttle); 3], &upstreams, &config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_pool_a_refused_member_is_passed_over_redis() {
    let upstreams = [
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
    ];
    let config = config(&upstreams);
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
    a_refused_member_is_passed_over(throttles, &upstreams, &config).await;
    setup.stop().await;
}

/// The clients a worker builds (`from_config`): a pool's calls go to the
/// member granted, with its `model` in place of the request's, each
/// answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_pool_calls_go_to_the_member_granted() {
    let upstreams = [
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
    ];
    let config = config(&upstreams);
    let throttle: Arc<dyn Throttle> = Arc::new(MemoryThrottle::new(&config));
    let metrics = Arc::new(Metrics::new(&config));
    let clients = tollgate_providers::from_config(&config, throttle, &metrics).expect("clients");
    let client = &clients["zz-failover"];
    // Nine users, one call each: spread over the members by their grants.
    for i in 0..9 {
        let job = tollgate_tests::jobs::job(
            &format!("j{i}"),
            &format!("v{i}"),
            "fw",
            "zz-failover",
            json!({ "model": "asked" }),
        );
        client
            .call(&job, CallOptions::default())
            .await
            .expect("answered");
    }
    let mut total = 0;
    for (u, name) in upstreams.iter().zip(["a", "b", "c"]) {
        let arrivals = u.arrivals();
        assert!(!arrivals.is_empty(), "member {name} got no call");
        for a in &arrivals {
            let body: serde_json::Value = serde_json::from_slice(&a.body).expect("a JSON body");
            let want = if name == "a" { "model-a" } else { "asked" };
            assert_eq!(body["model"], want, "member {name}: {body}");
        }
        total += arrivals.len();
    }
    assert_eq!(total, 9, "each call sent once");
}
