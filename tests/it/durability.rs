//! What an accepted call survives, on real Redis servers: `/readyz` reports
//! Redis's `appendonly`/`appendfsync` in every mode; `--durability fsync`
//! refuses a Redis that does not fsync every write (at start, on a new
//! connection, on `/readyz`) and fails closed when CONFIG is hidden;
//! `--durability replica` answers 202 only once a replica acknowledged the
//! accepting writes (WAIT), else 503 — on a primary with a replica and on the
//! test cluster.

use std::process::Command;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::json;
use tollgate_api::problem::ProblemType;
use tollgate_core::durability::Durability;
use tollgate_redis::keys::KeySpace;
use tollgate_redis::pool::{PoolOptions, RedisBackendError};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer, TestCluster};

use crate::api::{settings, test_config, Harness};

const EVERYSEC: [&str; 4] = ["--appendonly", "yes", "--appendfsync", "everysec"];
const ALWAYS: [&str; 4] = ["--appendonly", "yes", "--appendfsync", "always"];

fn options(durability: Durability) -> PoolOptions {
    PoolOptions {
        durability,
        timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

/// The api on `url` with `durability`; the stand-in worker is never started.
async fn api(url: &str, durability: Durability) -> Result<Harness, RedisBackendError> {
    let pool = tollgate_redis::pool::connect(url, &options(durability)).await?;
    let backends = tollgate_redis::backends(
        pool,
        KeySpace::new(&random_prefix()).unwrap(),
        test_config(),
        "test".into(),
    );
    let state = tollgate_api::state::ApiState::new(&backends, settings());
    Ok(Harness {
        app: tollgate_api::router(state.clone()),
        state,
        source: backends.source,
        redis: None,
        _cluster: None,
    })
}

async fn redis_cmd<T: redis::FromRedisValue>(url: &str, cmd: &redis::Cmd) -> T {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    cmd.query_async(&mut conn).await.unwrap()
}

fn config_set(name: &str, value: &str) -> redis::Cmd {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_what_redis_promises_in_every_mode() {
    let server = RedisServer::start_with(&EVERYSEC);
    let h = api(&server.url(), Durability::None).await.unwrap();
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let d = &r.body["durability"];
    assert_eq!(d["mode"], "none", "{d}");
    assert_eq!(d["appendonly"], "yes", "{d}");
    assert_eq!(d["appendfsync"], "everysec", "{d}");
    assert!(d["loss_window"].as_str().unwrap().starts_with("1s"), "{d}");

    // Read now, not at start: the same role sees a change.
    redis_cmd::<()>(&server.url(), &config_set("appendfsync", "always")).await;
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.body["durability"]["appendfsync"], "always", "{}", r.body);
    assert!(r.body["durability"]["loss_window"]
        .as_str()
        .unwrap()
        .starts_with('0'));

    // The in-memory store says so too.
    let memory = Harness::memory(settings()).await;
    let r = memory.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["durability"]["appendfsync"], "n/a", "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_mode_refuses_a_redis_that_fsyncs_every_second() {
    let server = RedisServer::start_with(&EVERYSEC);
    match api(&server.url(), Durability::Fsync).await {
        Err(e @ RedisBackendError::NotDurable { .. }) => {
            let message = e.to_string();
            assert!(message.contains("appendfsync everysec"), "{message}");
            assert!(message.contains("appendfsync always"), "{message}");
        }
        Err(e) => panic!("expected NotDurable, got {e}"),
        Ok(_) => panic!("fsync mode accepted a Redis with appendfsync everysec"),
    }
    // No AOF at all is refused as well.
    let bare = RedisServer::start();
    assert!(matches!(
        api(&bare.url(), Durability::Fsync).await,
        Err(RedisBackendError::NotDurable { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_mode_is_ready_on_always_and_fails_closed_once_redis_stops_fsyncing() {
    let server = RedisServer::start_with(&ALWAYS);
    let h = api(&server.url(), Durability::Fsync).await.unwrap();
    let key = h.user("dora", "free").await;
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["durability"]["mode"], "fsync", "{}", r.body);
    assert_eq!(r.body["durability"]["appendfsync"], "always", "{}", r.body);
    let r = h
        .post(
            "/v1/ops/embeddings?async=true",
            &key,
            json!({"text": "kept"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);

    // Redis stops fsyncing every write: not ready, saying why ...
    redis_cmd::<()>(&server.url(), &config_set("appendfsync", "everysec")).await;
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    let detail = r.problem(ProblemType::NotReady)["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(detail.contains("appendfsync everysec"), "{detail}");

    // ... and once its connections are gone (a restart looks the same), no
    // new one is trusted: a call fails closed rather than being accepted.
    redis_cmd::<i64>(
        &server.url(),
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"),
    )
    .await;
    let mut last = None;
    for _ in 0..3 {
        let r = h
            .post(
                "/v1/ops/embeddings?async=true",
                &key,
                json!({"text": "lost?"}),
            )
            .await;
        assert_ne!(r.status, StatusCode::ACCEPTED, "{}", r.body);
        last = Some(r);
    }
    let r = last.unwrap();
    r.problem(ProblemType::BackendUnavailable);
    // No connection at all now: /readyz still says why.
    let r = h.call("GET", "/readyz", None, &[], None).await;
    let detail = r.problem(ProblemType::NotReady)["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(detail.contains("appendfsync everysec"), "{detail}");

    // Fixed: ready again, and calls are accepted.
    redis_cmd::<()>(&server.url(), &config_set("appendfsync", "always")).await;
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = h
        .post(
            "/v1/ops/embeddings?async=true",
            &key,
            json!({"text": "kept"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
}

/// A Redis reconfigured at runtime stops accepting new calls on pooled
/// connections too, on every pod, within the recheck bound: before, calls
/// went on answering 202 for as long as the pool kept its connections
/// (/readyz alone said not ready). A retry of a call accepted before still
/// finds its job (202, the same job, nothing charged again): a 503 there
/// would tell its client "not accepted" of a job that runs and is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_mode_stops_accepting_on_pooled_connections_once_redis_stops_fsyncing() {
    async fn accept(h: &Harness, key: &str, text: &str, id: &str) -> crate::api::Resp {
        let body = json!({ "text": text }).to_string();
        h.call(
            "POST",
            "/v1/ops/embeddings?async=true",
            Some(key),
            &[("idempotency-key", id)],
            Some(body),
        )
        .await
    }
    let server = RedisServer::start_with(&ALWAYS);
    let pods = [
        api(&server.url(), Durability::Fsync).await.unwrap(),
        api(&server.url(), Durability::Fsync).await.unwrap(),
    ];
    let mut keys = Vec::new();
    for (i, h) in pods.iter().enumerate() {
        keys.push(h.user(&format!("pod{i}"), "free").await);
    }
    let mut first = Vec::new();
    for (h, key) in pods.iter().zip(&keys) {
        let r = accept(h, key, "kept", "first").await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
        first.push(r.body["job_id"].clone());
    }
    let used = |v: serde_json::Value| v["used"].as_u64().unwrap();
    let recheck = tollgate_redis::durability::FSYNC_RECHECK + Duration::from_millis(200);
    for (round, (setting, value)) in [("appendfsync", "everysec"), ("appendonly", "no")]
        .into_iter()
        .enumerate()
    {
        let mut before = Vec::new();
        for (h, key) in pods.iter().zip(&keys) {
            before.push(used(h.usage(key).await));
        }
        redis_cmd::<()>(&server.url(), &config_set(setting, value)).await;
        tokio::time::sleep(recheck).await;
        // The pools' connections are the same ones that accepted above.
        for ((h, key), job) in pods.iter().zip(&keys).zip(&first) {
            let r = accept(h, key, "lost?", &format!("new-{round}")).await;
            assert_eq!(
                r.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{setting}: {}",
                r.body
            );
            r.problem(ProblemType::BackendUnavailable);
            let again = accept(h, key, "kept", "first").await;
            assert_eq!(
                again.status,
                StatusCode::ACCEPTED,
                "{setting}: a retry: {}",
                again.body
            );
            assert_eq!(&again.body["job_id"], job, "{}", again.body);
        }
        for ((h, key), was) in pods.iter().zip(&keys).zip(&before) {
            assert_eq!(used(h.usage(key).await), *was, "{setting}: nothing charged");
        }
        redis_cmd::<()>(&server.url(), &config_set("appendonly", "yes")).await;
        redis_cmd::<()>(&server.url(), &config_set("appendfsync", "always")).await;
        tokio::time::sleep(recheck).await;
        for (h, key) in pods.iter().zip(&keys) {
            let r = accept(h, key, "kept again", &format!("new-{round}")).await;
            assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hidden_config_command_is_unknown_and_fails_closed_in_fsync_mode() {
    let server = RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--rename-command",
        "CONFIG",
        "tollgate-test-hidden-config",
    ]);
    let h = api(&server.url(), Durability::None).await.unwrap();
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["durability"]["appendfsync"], "unknown", "{}", r.body);
    assert_eq!(r.body["durability"]["loss_window"], "unknown", "{}", r.body);
    match api(&server.url(), Durability::Fsync).await {
        Err(e @ RedisBackendError::NotDurable { .. }) => {
            assert!(e.to_string().contains("failing closed"), "{e}");
        }
        Err(e) => panic!("expected NotDurable, got {e}"),
        Ok(_) => panic!("fsync mode trusted a Redis whose setting it cannot read"),
    }
}

/// The binary: a role in fsync mode on an everysec Redis exits at once with
/// the reason (it does not wait as for a Redis that is down).
#[test]
fn a_role_in_fsync_mode_refuses_to_start_on_everysec() {
    let server = RedisServer::start_with(&EVERYSEC);
    let mut cmd = Command::new(workspace_bin("tollgate"));
    cmd.args(["worker", "--durability", "fsync"])
        .env("TOLLGATE_REDIS_URL", server.url())
        .env("TOLLGATE_KEY_PREFIX", random_prefix())
        .env_remove("TOLLGATE_CONFIG");
    // Bounded so that a role that waits instead fails the test, not hangs it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (status, err) = tollgate_tests::process::run_until(&mut cmd, deadline);
    let status = status.expect("the worker kept waiting instead of refusing to start");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("appendfsync everysec"), "{err}");
    assert!(err.contains("--durability none"), "{err}");
}

/// Until `url`'s Redis has `n` replicas online (their first sync done), at
/// most 20 s.
async fn until_replicas(url: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info: String = redis_cmd(url, redis::cmd("INFO").arg("replication")).await;
        if info.matches("state=online").count() == n {
            return;
        }
        assert!(Instant::now() < deadline, "replicas never {n}: {info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_mode_accepts_only_what_a_replica_acknowledged() {
    let primary = RedisServer::start_with(&EVERYSEC);
    let port = primary.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    until_replicas(&primary.url(), 1).await;
    // Room for a loaded machine: the first call also loads the budget
    // function library, which the replica compiles before it acknowledges.
    let mode = Durability::Replica {
        replicas: 1,
        timeout: Duration::from_secs(2),
    };
    let h = api(&primary.url(), mode).await.unwrap();
    let plain = api(&primary.url(), Durability::None).await.unwrap();
    let key = h.user("ria", "free").await;
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["durability"]["replicas"], 1, "{}", r.body);
    let r = h
        .post(
            "/v1/ops/embeddings?async=true",
            &key,
            json!({"text": "both"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let id = r.body["job_id"].as_str().unwrap().to_owned();
    // The replica holds the job it was told about.
    let on_replica: Vec<String> =
        redis_cmd(&replica.url(), redis::cmd("KEYS").arg(format!("*{id}*"))).await;
    assert!(!on_replica.is_empty(), "job {id} not on the replica");

    // The replica is gone: no call is accepted, and the role says why.
    drop(replica);
    until_replicas(&primary.url(), 0).await;
    let r = h
        .post(
            "/v1/ops/embeddings?async=true",
            &key,
            json!({"text": "alone"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    r.problem(ProblemType::BackendUnavailable);
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    let detail = r.problem(ProblemType::NotReady)["detail"].as_str().unwrap();
    assert!(detail.contains("connected replica"), "{detail}");
    // Mode none would have accepted it (what a failover then loses).
    let plain_key = plain.user("ria", "free").await;
    let r = plain
        .post(
            "/v1/ops/embeddings?async=true",
            &plain_key,
            json!({"text": "alone"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_mode_on_the_cluster_waits_for_each_primarys_replica() {
    let cluster = TestCluster::get();
    let mode = Durability::Replica {
        replicas: 1,
        timeout: Duration::from_secs(1),
    };
    let h = api(&cluster.url(), mode).await.unwrap();
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["durability"]["replicas"], 1, "{}", r.body);
    // Users (and so their charges) and operations hash to different primaries.
    for (user, op) in [
        ("cl-a", "embeddings"),
        ("cl-b", "salary.lookup"),
        ("cl-c", "jobs.extract"),
    ] {
        let key = h.user(user, "free").await;
        let r = h
            .post(
                &format!("/v1/ops/{op}?async=true"),
                &key,
                json!({"text": user}),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{user} {op}: {}", r.body);
    }
    // Asking for more replicas than any primary has: WAIT falls short, 503.
    let greedy = Durability::Replica {
        replicas: 2,
        timeout: Duration::from_millis(200),
    };
    let g = api(&cluster.url(), greedy).await.unwrap();
    let key = g.user("cl-d", "free").await;
    let r = g
        .post("/v1/ops/embeddings?async=true", &key, json!({"text": "d"}))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    let r = g.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
}
