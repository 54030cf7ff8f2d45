//! The whole request path on Redis, in-process but over real HTTP and TCP:
//! api -> job queue -> worker role -> throttler role -> mock provider (HTTP),
//! and back. One provider answers, another fails every call (fail rate 1.0).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::watch;
use tollgate_core::job::JobOptions;
use tollgate_core::{config::Config, job::JobSource, ledger::Ledger, throttle::Throttle};
use tollgate_mock_provider::MockOptions;
use tollgate_redis::{
    jobs::RedisJobQueue,
    keys::KeySpace,
    ledger::RedisLedger,
    pool::PoolOptions,
    throttle::{RedisDispatchers, RedisThrottle},
};
use tollgate_tests::api::ApiServer;
use tollgate_tests::{http, random_prefix, RedisServer};

use crate::api::{redis_state, settings, ADMIN};

/// Starts a mock provider on port 0; returns its URL.
async fn mock(fail_rate: f64, stop: &watch::Receiver<bool>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let options = MockOptions {
        rate: 1000.0,
        burst: 100,
        fail_rate,
        latency: Duration::from_millis(2),
        ..Default::default()
    };
    let mut stop = stop.clone();
    tokio::spawn(tollgate_mock_provider::run(listener, options, async move {
        let _ = stop.wait_for(|s| *s).await;
    }));
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_path_answers_results_and_refunds_provider_failures() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let (stop_tx, stop) = watch::channel(false);
    let ok_url = mock(0.0, &stop).await;
    let failing_url = mock(1.0, &stop).await;
    let text = tollgate_core::config::BUILTIN
        .replace(
            "[providers.llm]\n",
            &format!("[providers.llm]\nurl = \"{ok_url}\"\nretries = 0\n"),
        )
        .replace(
            "[providers.salary]\n",
            &format!("[providers.salary]\nurl = \"{failing_url}\"\nretries = 0\n"),
        );
    let config = Arc::new(Config::parse(&text, "full-path").unwrap());
    let keys = KeySpace::new(&prefix).unwrap();
    let pool = tollgate_redis::pool::connect(&redis.url(), &PoolOptions::default())
        .await
        .unwrap();

    // The throttler role.
    let throttler_cfg = tollgate_throttler::ThrottlerConfig::new(Arc::clone(&config));
    let mut s = stop.clone();
    let throttler = tokio::spawn(tollgate_throttler::run(
        throttler_cfg,
        Arc::new(RedisDispatchers {
            pool: pool.clone(),
            keys: keys.clone(),
        }),
        async move {
            let _ = s.wait_for(|v| *v).await;
        },
    ));
    // The worker role.
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
    ));
    let source: Arc<dyn JobSource> = Arc::new(RedisJobQueue::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
        ledger,
        JobOptions::default(),
    ));
    let throttle: Arc<dyn Throttle> = Arc::new(RedisThrottle::start(
        pool.clone(),
        keys.clone(),
        &config,
        Default::default(),
    ));
    let mut worker_cfg = tollgate_worker::WorkerConfig::new(Arc::clone(&config));
    let providers =
        tollgate_providers::from_config(&config, throttle, &worker_cfg.metrics).unwrap();
    worker_cfg.shutdown_grace = Duration::from_millis(200);
    let mut s = stop.clone();
    let worker = tokio::spawn(tollgate_worker::run(
        worker_cfg,
        source,
        providers,
        async move {
            let _ = s.wait_for(|v| *v).await;
        },
    ));

    // The api, on the same keys, with the config above.
    let mut state = redis_state(&redis.url(), &prefix, settings()).await;
    state.config = Arc::clone(&config);
    let api = ApiServer::start(state).await;
    let key = http::user_key(api.addr, ADMIN, "zoe", "free").await;

    for i in 0..3 {
        let r = http::json(
            api.addr,
            "POST",
            "/v1/ops/llm.structured",
            Some(&key),
            Some(&json!({"prompt": i})),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let body = r.json();
        assert_eq!(body["status"], "succeeded");
        assert!(!body["result"].is_null(), "{body}");
        assert_eq!(
            r.header("ratelimit"),
            // 40 reserved up front, the earlier calls settled to the 8 the
            // mock reports.
            Some(format!("\"budget\";r={};t=43200", 1000 - 8 * i - 40).as_str())
        );
    }
    for _ in 0..3 {
        let r = http::json(
            api.addr,
            "POST",
            "/v1/ops/salary.lookup",
            Some(&key),
            Some(&json!({"role": "dev"})),
        )
        .await;
        assert_eq!(r.status, 502, "{}", r.text());
        let body = r.json();
        assert_eq!(body["type"], "/problems/provider-failure");
        assert_eq!(body["cause"], "provider");
    }
    // The failures were refunded by the worker: only the three LLM calls remain.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let usage = http::json(api.addr, "GET", "/v1/usage", Some(&key), None)
            .await
            .json();
        if usage["used"] == 24 {
            let ops: Vec<_> = usage["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["operation"].as_str().unwrap_or("?").to_owned())
                .collect();
            assert_eq!(ops, ["llm.structured"; 3]);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{usage}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Reproduction 6 over HTTP: 100 concurrent calls (estimate 8, max 40), each
    // answered with the most (4,000 tokens), under a limit of 1,000.
    let created = http::create_user(api.addr, ADMIN, "burst", "free").await;
    let burst = created.json()["api_key"].as_str().unwrap().to_owned();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..100 {
        let (addr, key) = (api.addr, burst.clone());
        calls.spawn(async move {
            let body = json!({ "prompt": i, "mock_total_tokens": 4000 });
            http::json(
                addr,
                "POST",
                "/v1/ops/llm.structured",
                Some(&key),
                Some(&body),
            )
            .await
        });
    }
    let mut succeeded = 0u64;
    while let Some(r) = calls.join_next().await {
        let r = r.unwrap();
        match r.status {
            200 => succeeded += 1,
            429 => {}
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    let usage = http::json(api.addr, "GET", "/v1/usage", Some(&burst), None)
        .await
        .json();
    assert!(succeeded > 0);
    assert!(usage["used"].as_u64().unwrap() <= 1000, "{usage}");
    assert_eq!(usage["used"], 40 * succeeded, "{usage}");
    let _ = stop_tx.send(true);
    drop(api);
    let _ = tokio::time::timeout(Duration::from_secs(5), worker).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), throttler).await;
}
