//! The api role on Redis as it is deployed: two `tollgate api` processes sharing
//! one budget, a Redis that stops answering and comes back, and clients that hang
//! up at random points while their requests are being charged.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tollgate_tests::api::ApiServer;
use tollgate_tests::http;
use tollgate_tests::process::{api_command, command, Procs};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::api::{redis_source, redis_state, settings, Harness, ADMIN};

/// A `tollgate` process, killed when dropped.
struct Process {
    _procs: Procs,
}

impl Process {
    fn start(args: &[&str], redis: &RedisServer, prefix: &str, config: &std::path::Path) -> Self {
        let child = command(args)
            .env("TOLLGATE_REDIS_URL", redis.url())
            .env("TOLLGATE_KEY_PREFIX", prefix)
            .env("TOLLGATE_CONFIG", config)
            .stdout(Stdio::null())
            .spawn()
            .expect("start tollgate");
        Self {
            _procs: Procs(vec![child]),
        }
    }
}

/// The roles behind the apis: a mock provider on `mock_addr`, a throttler
/// and a worker.
fn backend_roles(
    redis: &RedisServer,
    prefix: &str,
    config: &std::path::Path,
    mock_addr: &str,
) -> [Process; 3] {
    let mock = [
        "mock-provider",
        "--listen",
        mock_addr,
        "--rate",
        "1000",
        "--burst",
        "100",
    ];
    [
        Process::start(&mock, redis, prefix, config),
        Process::start(&["throttler"], redis, prefix, config),
        Process::start(&["worker"], redis, prefix, config),
    ]
}

/// A `tollgate api` process, killed when dropped.
struct ApiProcess {
    _procs: Procs,
    addr: SocketAddr,
}

impl ApiProcess {
    async fn start(redis: &RedisServer, prefix: &str, config: &std::path::Path) -> Self {
        let (mut api, addr) = api_command(&redis.url(), prefix);
        let child = api
            .env("TOLLGATE_CONFIG", config)
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .stdout(Stdio::null())
            .spawn()
            .expect("start tollgate api");
        http::wait_ready(addr, Instant::now() + Duration::from_secs(15)).await;
        Self {
            _procs: Procs(vec![child]),
            addr,
        }
    }
}

/// The built-in config with the `llm` provider pointing at `upstream`.
fn write_config(dir_tag: &str, upstream: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("tollgate-api-{dir_tag}.toml"));
    let text = tollgate_core::config::BUILTIN.replace(
        "[providers.llm]\n",
        &format!("[providers.llm]\nurl = \"{upstream}\"\nretries = 0\n"),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The deployment in processes: two `tollgate api`, a `tollgate worker`, a
/// `tollgate throttler` and a `tollgate mock-provider`. One user on 1000 tokens
/// / 12 h sends 400 concurrent calls of cost 5 across both apis: exactly 200 are
/// admitted, the other 200 get a 429 whose Retry-After is the exact retry_after
/// rounded up; the 200 jobs then run through worker, throttle and provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_api_processes_admit_exactly_the_budget() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let mock_port = tollgate_tests::redis_server::free_port();
    let mock_addr = format!("127.0.0.1:{mock_port}");
    let config = write_config(&prefix, &format!("http://{mock_addr}"));
    let _roles = backend_roles(&redis, &prefix, &config, &mock_addr);
    let a = ApiProcess::start(&redis, &prefix, &config).await;
    let b = ApiProcess::start(&redis, &prefix, &config).await;
    let key = http::user_key(a.addr, ADMIN, "load", "free").await;

    let mut calls = tokio::task::JoinSet::new();
    for i in 0..400 {
        let (addr, key) = (if i % 2 == 0 { a.addr } else { b.addr }, key.clone());
        calls.spawn(async move {
            http::json(
                addr,
                "POST",
                "/v1/ops/jobs.extract?async=true",
                Some(&key),
                Some(&json!({"i": i})),
            )
            .await
        });
    }
    let (mut accepted, mut denied) = (0, 0);
    let mut jobs = Vec::new();
    while let Some(r) = calls.join_next().await {
        let r = r.unwrap();
        match r.status {
            202 => {
                accepted += 1;
                jobs.push(r.header("location").unwrap().to_owned());
            }
            429 => {
                denied += 1;
                let body = r.json();
                assert_eq!(body["type"], "/problems/quota-exceeded");
                let ms = body["retry_after_ms"].as_u64().unwrap();
                let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
                assert_eq!(secs, ms.div_ceil(1000), "{body}");
                assert!(secs > 43_000 && secs <= 43_200, "{secs}");
                assert!(r
                    .header("ratelimit")
                    .unwrap()
                    .starts_with("\"budget\";r=0;"));
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!((accepted, denied), (200, 200));
    let usage = http::usage_all(b.addr, &key).await;
    assert_eq!(usage["used"], 1000, "{usage}");
    assert_eq!(usage["events"].as_array().unwrap().len(), 200);

    // Every admitted job runs through worker, throttle (llm: 50/s) and provider.
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, location) in jobs.iter().enumerate() {
        let addr = if i % 2 == 0 { a.addr } else { b.addr };
        loop {
            let job = http::json(addr, "GET", location, Some(&key), None)
                .await
                .json();
            if job["status"] == "succeeded" {
                break;
            }
            assert_ne!(job["status"], "failed", "{job}");
            assert!(Instant::now() < deadline, "{job}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let usage = http::json(a.addr, "GET", "/v1/usage", Some(&key), None).await;
    assert_eq!(usage.json()["used"], 1000, "{}", usage.text());
    let _ = std::fs::remove_file(config);
}

/// Redis stops answering: 503 problems (and a 503 readiness); when it answers
/// again, the same api serves again with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_is_503_and_the_api_recovers() {
    let h = Harness::redis(settings()).await;
    let key = h.user("olga", "free").await;
    let pid = h.redis.as_ref().unwrap().pid().to_string();
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let r = h.get("/v1/usage", &key, &[]).await;
    let p = r
        .problem(tollgate_api::problem::ProblemType::BackendUnavailable)
        .clone();
    assert!(!p.to_string().contains("redis://"), "no internals: {p}");
    let r = h.call("GET", "/readyz", None, &[], None).await;
    r.problem(tollgate_api::problem::ProblemType::BackendUnavailable);
    signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = h.get("/v1/usage", &key, &[]).await;
        if r.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {}", r.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _worker = h.worker(0.0);
    let r = h
        .post("/v1/ops/embeddings", &key, json!({"text": "back"}))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Clients hang up at random points (mid-request, right after sending, while
/// waiting for the result) under load. Afterwards the user's usage is exactly
/// the cost of the jobs that succeeded: no reservation outlived its request
/// without a job to settle it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnects_leak_no_reservation() {
    let redis = RedisServer::start();
    let mut s = settings();
    s.sync_timeout = Duration::from_secs(5);
    let state = redis_state(&redis.url(), &random_prefix(), s).await;
    let source = redis_source(&redis.url(), &state).await;
    let server = ApiServer::start(state.clone()).await;
    let addr = server.addr;
    let created = http::create_user(addr, ADMIN, "flaky", "pro").await;
    let key = created.json()["api_key"].as_str().unwrap().to_owned();
    let worker = tollgate_tests::api::StandInWorker::start(
        Arc::clone(&source),
        &["jobs.extract"],
        0.25,
        Duration::from_millis(15),
    );

    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(std::process::id());
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..240u64 {
        let (mode, cut, delay) = (next() % 4, next(), next() % 80);
        let key = key.clone();
        clients.spawn(async move {
            let auth = format!("Bearer {key}");
            let idem = format!("req-{}", i % 200); // some retries reuse a key
            let headers = [
                ("Authorization", auth.as_str()),
                ("Content-Type", "application/json"),
                ("Idempotency-Key", idem.as_str()),
            ];
            let body = json!({"i": i}).to_string();
            let bytes = http::encode("POST", "/v1/ops/jobs.extract", &headers, body.as_bytes());
            let Ok(mut stream) = TcpStream::connect(addr).await else {
                return;
            };
            match mode {
                // Hang up part-way through the request.
                0 => {
                    let n = (cut as usize) % bytes.len();
                    let _ = stream.write_all(&bytes[..n]).await;
                }
                // Send it all and hang up at once.
                1 => {
                    let _ = stream.write_all(&bytes).await;
                }
                // Send it all and hang up while the job runs.
                2 => {
                    let _ = stream.write_all(&bytes).await;
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                // Wait for the answer.
                _ => {
                    let _ = stream.write_all(&bytes).await;
                    let mut sink = Vec::new();
                    let _ = tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut sink).await;
                }
            }
            drop(stream);
        });
        if i % 40 == 0 {
            tokio::task::yield_now().await;
        }
    }
    while clients.join_next().await.is_some() {}

    // Let every submitted job finish, then compare.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stable_since = Instant::now();
    let mut last = (u64::MAX, usize::MAX);
    loop {
        let usage = http::usage_all(addr, &key).await;
        let used = usage["used"].as_u64().unwrap();
        let done = worker.succeeded().len();
        if (used, done) != last {
            last = (used, done);
            stable_since = Instant::now();
        }
        if used == 5 * done as u64 && stable_since.elapsed() > Duration::from_millis(1500) {
            let events: BTreeSet<String> = usage["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["request_id"].as_str().unwrap().to_owned())
                .collect();
            let succeeded: BTreeSet<String> =
                worker.succeeded().iter().map(|id| id.to_string()).collect();
            assert_eq!(events, succeeded);
            assert!(done > 0, "some jobs ran");
            // Every metered task reached its job.
            assert_eq!(state.in_flight.drain(Duration::from_secs(10)).await, 0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "usage {used} != 5 x {done} succeeded jobs: a reservation leaked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.stop().await;
}

/// `tollgate users create` prints a key once; the api accepts it; `tollgate
/// users revoke` turns it off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_cli_creates_a_working_key_and_revokes_it() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let cli = |args: &[&str]| {
        let out = Command::new(workspace_bin("tollgate"))
            .arg("users")
            .args(args)
            .env("TOLLGATE_REDIS_URL", redis.url())
            .env("TOLLGATE_KEY_PREFIX", &prefix)
            .env_remove("TOLLGATE_CONFIG")
            .output()
            .expect("run tollgate users");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = cli(&["create", "--user", "pat", "--plan", "pro", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let created: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let key = created["api_key"].as_str().unwrap().to_owned();
    let key_id = created["key_id"].as_str().unwrap().to_owned();
    let (code, _, stderr) = cli(&["create", "--user", "pat", "--plan", "gold"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains("gold"),
        "{stderr}"
    );

    // A service key, which may give its users the free plan.
    let (code, stdout, stderr) = cli(&[
        "create",
        "--user",
        "shop",
        "--kind",
        "service",
        "--allowed-plan",
        "free",
        "--json",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let service: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(service["kind"], "service", "{stdout}");
    assert_eq!(service["allowed_plans"], json!(["free"]), "{stdout}");
    let svc = service["api_key"].as_str().unwrap().to_owned();
    assert!(svc.starts_with("tg_svc_"), "{svc}");
    let (code, _, stderr) = cli(&["create", "--user", "s2", "--kind", "robot"]);
    assert_eq!(code, Some(2), "{stderr}");

    let state = redis_state(&redis.url(), &prefix, settings()).await;
    let server = ApiServer::start(state).await;
    let usage = http::json(server.addr, "GET", "/v1/usage", Some(&key), None).await;
    assert_eq!(usage.status, 200, "{}", usage.text());
    assert_eq!(usage.json()["limit"], 20000);
    let bearer = format!("Bearer {svc}");
    let headers = [("authorization", bearer.as_str()), ("tollgate-user", "zed")];
    let usage = http::send(server.addr, "GET", "/v1/usage", &headers, b"")
        .await
        .unwrap();
    assert_eq!(usage.status, 200, "{}", usage.text());
    assert_eq!(usage.json()["user"], "zed");
    let (code, stdout, stderr) = cli(&["revoke", "--key-id", &key_id]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains(&key_id));
    // The api remembers a valid key for KEY_TTL: a revocation made elsewhere
    // (here, the CLI) is honoured within that bound.
    let deadline =
        std::time::Instant::now() + tollgate_api::keycache::KEY_TTL + Duration::from_secs(2);
    let usage = loop {
        let usage = http::json(server.addr, "GET", "/v1/usage", Some(&key), None).await;
        if usage.status == 401 || std::time::Instant::now() > deadline {
            break usage;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(usage.status, 401);
    assert_eq!(
        usage.header("content-type"),
        Some("application/problem+json")
    );
}

/// An api pod is killed (SIGKILL) while 200 calls are in flight across two pods.
/// Whatever it was doing, once the jobs have run and the holds of charges whose
/// job was never created have ended (deadline 5 s + hold grace 1 s here), every
/// remaining spend event belongs to a job that succeeded: nothing is charged for
/// work that will never happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_api_pod_leaves_no_charge_without_a_job() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let mock_port = tollgate_tests::redis_server::free_port();
    let mock_addr = format!("127.0.0.1:{mock_port}");
    let config = write_config(&prefix, &format!("http://{mock_addr}"));
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "[operations.\"llm.structured\"]\n",
        "[operations.\"llm.structured\"]\ndeadline = \"5s\"\n",
    );
    std::fs::write(&config, format!("hold_grace = \"1s\"\n{text}")).unwrap();
    let _roles = backend_roles(&redis, &prefix, &config, &mock_addr);
    let doomed = ApiProcess::start(&redis, &prefix, &config).await;
    let survivor = ApiProcess::start(&redis, &prefix, &config).await;
    let created = http::create_user(survivor.addr, ADMIN, "kim", "pro").await;
    let key = created.json()["api_key"].as_str().unwrap().to_owned();

    let mut calls = tokio::task::JoinSet::new();
    for i in 0..200 {
        let addr = if i % 2 == 0 {
            doomed.addr
        } else {
            survivor.addr
        };
        let key = key.clone();
        calls.spawn(async move {
            let auth = format!("Bearer {key}");
            let body = json!({"i": i}).to_string();
            // Keyed, so that every job stays readable for the check below (a
            // sync call answered without a key leaves no job record).
            let idem = format!("kill-{i}");
            let headers = [
                ("Authorization", auth.as_str()),
                ("Content-Type", "application/json"),
                ("Idempotency-Key", idem.as_str()),
            ];
            let _ = tokio::time::timeout(
                Duration::from_secs(30),
                http::send(
                    addr,
                    "POST",
                    "/v1/ops/llm.structured",
                    &headers,
                    body.as_bytes(),
                ),
            )
            .await;
        });
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    drop(doomed); // SIGKILL
    while calls.join_next().await.is_some() {}

    // Jobs finish (3 s of llm throttle at most); a charge the dead pod took
    // but never queued a job for is released at its hold's end (6 s).
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let usage = http::usage_all(survivor.addr, &key).await;
        let events = usage["events"].as_array().unwrap().clone();
        let mut settled = true;
        for e in &events {
            let id = e["request_id"].as_str().unwrap();
            let job = http::json(
                survivor.addr,
                "GET",
                &format!("/v1/jobs/{id}"),
                Some(&key),
                None,
            )
            .await;
            if job.status != 200 || job.json()["status"] != "succeeded" {
                settled = false;
                break;
            }
        }
        if settled {
            // Read again: a job that finished between the first read and its
            // status settled its charge (40 reserved, 8 reported) meanwhile.
            let usage = http::usage_all(survivor.addr, &key).await;
            let events = usage["events"].as_array().unwrap().clone();
            assert_eq!(usage["used"].as_u64().unwrap(), 8 * events.len() as u64);
            assert!(!events.is_empty(), "the survivor's calls ran");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a charge without a succeeded job remains: {usage}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let _ = std::fs::remove_file(config);
}
