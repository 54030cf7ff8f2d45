//! The api and the pool when Redis goes away and comes back: a restart under an
//! idle pool (the first calls succeed, on fresh connections), and a Redis that
//! is still loading its data (503 with Retry-After, never 500).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::json;
use tollgate_api::problem::ProblemType;
use tollgate_core::id::{RequestId, UserId};
use tollgate_tests::{random_prefix, RedisServer};

use crate::api::{redis_source, redis_state, settings, Harness, ADMIN};

async fn harness(server: RedisServer) -> Harness {
    let state = redis_state(&server.url(), &random_prefix(), settings()).await;
    let source = redis_source(&server.url(), &state).await;
    Harness {
        app: tollgate_api::router(state.clone()),
        state,
        source,
        redis: Some(server),
        _cluster: None,
    }
}

/// Before the fix the pool handed out its idle connections as they were after a
/// restart, and each answered "broken pipe" once (a 503) while /readyz said ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_calls_after_a_redis_restart_succeed() {
    let mut h = harness(RedisServer::start()).await;
    let key = h.user("alice", "free").await;
    let user = UserId::new("alice").unwrap();
    // Several connections in the pool, all idle afterwards.
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..12 {
        let ledger = Arc::clone(&h.state.ledger);
        let user = user.clone();
        calls.spawn(async move { ledger.usage(&user).await });
    }
    while let Some(done) = calls.join_next().await {
        done.unwrap().unwrap();
    }

    let mut server = h.redis.take().unwrap();
    let server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    h.redis = Some(server);

    // The restarted Redis is empty: recreate the user, then the first call of
    // each kind (readiness, a script, a plain read) must succeed.
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let key2 = h.user("bob", "free").await;
    let reserved = h
        .state
        .ledger
        .reserve(&user, &RequestId::generate(), 1)
        .await;
    assert!(reserved.is_ok(), "{reserved:?}");
    let r = h.call("GET", "/v1/usage", Some(&key2), &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // alice's key lived in the old Redis only.
    let r = h.call("GET", "/v1/usage", Some(&key), &[], None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{}", r.body);
}

/// While Redis loads its dataset it answers `LOADING`: that is "not now", a 503
/// with Retry-After like an unreachable Redis, not a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loading_redis_is_503_with_retry_after() {
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let url = server.url();
    let h = harness(server).await;
    let key = h.user("alice", "free").await;

    // Make loading slow and observable: a delay per key, and client events
    // served every KB while loading.
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_connection().unwrap();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("key-load-delay")
        .arg(5000)
        .arg("loading-process-events-interval-bytes")
        .arg(1024)
        .query::<()>(&mut conn)
        .unwrap();
    redis::Script::new(
        "for i = 1, 800 do redis.call('SET', KEYS[1] .. i, string.rep('x', 1024)) end",
    )
    .key(format!("{}filler:", random_prefix()))
    .invoke::<()>(&mut conn)
    .unwrap();
    let reload = std::thread::spawn(move || {
        redis::cmd("DEBUG")
            .arg("RELOAD")
            .query::<()>(&mut conn)
            .map_err(|e| e.to_string())
    });
    let mut probe = client.get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match redis::cmd("PING").query::<String>(&mut probe) {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading) => {
                break
            }
            _ if Instant::now() > deadline => panic!("Redis never reported LOADING"),
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }

    let r = h
        .post(
            "/admin/users",
            ADMIN,
            json!({"user": "bob", "plan": "free"}),
        )
        .await;
    r.problem(ProblemType::BackendUnavailable);
    assert_eq!(r.header("retry-after"), "1");
    let r = h.call("GET", "/v1/usage", Some(&key), &[], None).await;
    r.problem(ProblemType::BackendUnavailable);
    assert_eq!(r.header("retry-after"), "1");
    let r = h.call("GET", "/readyz", None, &[], None).await;
    r.problem(ProblemType::BackendUnavailable);

    reload.join().unwrap().unwrap();
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.usage(&key).await["used"], 0);
}
