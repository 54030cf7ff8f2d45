//! Jobs end to end with real processes: `tollgate mock-provider`, `tollgate
//! throttler` and `tollgate worker` against one redis-server; jobs submitted
//! through the library (`RedisJobQueue::submit`, what the api role calls).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::{FailureCause, JobQueue, JobRequest, JobStatus, SubmitOutcome},
    ledger::Ledger,
};
use tollgate_redis::jobs::RedisJobQueue;
use tollgate_tests::process::{command, Procs};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::jobs::{inject_malformed, redis_queue};

const OP: &str = "llm.structured";
const COST: u64 = 8;

struct Env {
    server: RedisServer,
    prefix: String,
    dir: PathBuf,
    config_path: PathBuf,
    config: Arc<Config>,
    mock: String,
    procs: Procs,
}

/// Starts redis-server and a mock provider; writes a config whose `llm`
/// provider (throttled at `throttle_rate`) points at the mock.
fn start(mock_args: &[&str], throttle_rate: u32, retries: u32) -> Env {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let dir = std::env::temp_dir().join(format!("tollgate-it-{prefix}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut mock = Command::new(workspace_bin("tollgate"))
        .args(["mock-provider", "--listen", "127.0.0.1:0"])
        .args(mock_args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn tollgate mock-provider");
    let mut line = String::new();
    BufReader::new(mock.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("mock-provider said {line:?}"))
        .to_owned();
    let text = format!(
        r#"
[plans.free]
limit = 1000000
window = "1h"
[providers.llm]
rate = {throttle_rate}
burst = 5
max_wait = "60s"
url = "http://{addr}"
timeout = "10s"
retries = {retries}
[operations."{OP}"]
cost = {COST}
provider = "llm"
path = "/v1/structured"
"#
    );
    let config_path = dir.join("jobs.toml");
    std::fs::write(&config_path, &text).unwrap();
    let config = Arc::new(Config::parse(&text, "jobs test").unwrap());
    Env {
        server,
        prefix,
        dir,
        config_path,
        config,
        mock: format!("http://{addr}"),
        procs: Procs(vec![mock]),
    }
}

impl Env {
    fn role(&self, role: &str, extra: &[&str], stderr: Stdio) -> Child {
        Command::new(workspace_bin("tollgate"))
            .args([role, "--redis-url", &self.server.url()])
            .args(["--key-prefix", &self.prefix])
            .arg("--config")
            .arg(&self.config_path)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn tollgate {role}: {e}"))
    }

    fn spawn(&mut self, role: &str, extra: &[&str]) -> usize {
        let child = self.role(role, extra, Stdio::null());
        self.procs.0.push(child);
        self.procs.0.len() - 1
    }

    async fn queue(&self) -> (Arc<RedisJobQueue>, Arc<dyn Ledger>) {
        redis_queue(&self.server, &self.prefix, Arc::clone(&self.config)).await
    }

    async fn stats(&self) -> tollgate_mock_provider::Stats {
        tollgate_providers::http::install_crypto_provider();
        reqwest::get(format!("{}/stats", self.mock))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

fn user() -> UserId {
    UserId::new("pat").unwrap()
}

async fn submit_all(q: &Arc<RedisJobQueue>, n: usize) -> Vec<RequestId> {
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let q = Arc::clone(q);
        set.spawn(async move {
            let id = RequestId::new(format!("job-{i}")).unwrap();
            let out = q
                .submit(JobRequest {
                    id: id.clone(),
                    user: user(),
                    operation: OP.into(),
                    input: json!({ "n": i }),
                    trace: None,
                    service_key: None,
                })
                .await
                .unwrap();
            assert!(matches!(out, SubmitOutcome::Queued { .. }), "{out:?}");
            id
        });
    }
    let mut ids = Vec::new();
    while let Some(id) = set.join_next().await {
        ids.push(id.unwrap());
    }
    ids
}

/// Waits (at most `within`) until every job is final; returns (succeeded, failed).
async fn wait_all(
    q: &Arc<RedisJobQueue>,
    ids: &[RequestId],
    within: Duration,
) -> (Vec<RequestId>, Vec<(RequestId, FailureCause)>) {
    tollgate_tests::jobs::wait_final(&**q, &user(), ids, within).await
}

async fn used(ledger: &Arc<dyn Ledger>) -> u64 {
    ledger.usage(&user()).await.unwrap().used
}

/// A job shows as failed as soon as it is marked so; its refund follows (from
/// the worker, or from maintenance after a crash): waits up to 15s for the
/// usage to reach `expected`, then compares.
async fn settled_usage(ledger: &Arc<dyn Ledger>, expected: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let u = used(ledger).await;
        if u == expected || Instant::now() >= deadline {
            return u;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 500 jobs, 3 worker processes, 2 throttlers, an upstream limited to 50/s
/// (burst 20), the throttle at 45/s (burst 5), configured below the upstream's
/// limit as one would in production, so that scheduling jitter between the
/// grant and the request's arrival cannot add up to a 429: every job completes
/// and the upstream never answers 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_500_jobs_3_workers_2_throttlers_no_429() {
    let mut env = start(&["--rate", "50", "--burst", "20"], 45, 2);
    for _ in 0..2 {
        env.spawn("throttler", &["--liveness-ms", "1000"]);
    }
    for _ in 0..3 {
        env.spawn("worker", &["--concurrency", "64"]);
    }
    let (q, ledger) = env.queue().await;
    let started = Instant::now();
    let ids = submit_all(&q, 500).await;
    let (ok, failed) = wait_all(&q, &ids, Duration::from_secs(90)).await;
    let took = started.elapsed();
    assert_eq!(failed, vec![], "no job fails");
    assert_eq!(ok.len(), 500);
    let stats = env.stats().await;
    assert_eq!(stats.rate_limited, 0, "{stats:?}");
    assert_eq!(stats.failed, 0, "{stats:?}");
    // At least once: a job whose lease expired under load may run twice.
    assert!(stats.ok >= 500, "{stats:?}");
    assert_eq!(used(&ledger).await, 500 * COST);
    eprintln!("500 jobs in {took:?}; mock {stats:?}");
}

/// Every upstream call fails: every job ends failed (provider) and the user's
/// usage returns to exactly 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_fail_rate_one_refunds_everything() {
    let mut env = start(
        &["--rate", "200", "--burst", "20", "--fail-rate", "1.0"],
        150,
        1,
    );
    env.spawn("throttler", &[]);
    let (q, ledger) = env.queue().await;
    let ids = submit_all(&q, 60).await;
    // Every submission charged; the workers start after, so that none of
    // the jobs has failed and released its charge yet (with workers running,
    // the first jobs could fail before the last were submitted).
    assert_eq!(used(&ledger).await, 60 * COST);
    env.spawn("worker", &[]);
    env.spawn("worker", &[]);
    let (ok, failed) = wait_all(&q, &ids, Duration::from_secs(60)).await;
    assert!(ok.is_empty());
    assert_eq!(failed.len(), 60);
    assert!(failed.iter().all(|(_, c)| *c == FailureCause::Provider));
    assert_eq!(settled_usage(&ledger, 0).await, 0);
    let stats = env.stats().await;
    assert_eq!(stats.failed, 120, "one retry each: {stats:?}");
    let info = q.status(&user(), &ids[0]).await.unwrap().unwrap();
    match info.status {
        JobStatus::Failed { message, .. } => assert!(message.contains("500"), "{message}"),
        other => panic!("{other:?}"),
    }
}

/// kill -9 one of three workers mid-run: every job still ends exactly once,
/// and the usage equals the cost of the completed jobs plus the failed ones a
/// killed run had started (their call may have reached the upstream: the
/// charge stands, failed `unanswered`): no refund missing, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_kill_9_worker_every_job_ends_once() {
    let mut env = start(
        &[
            "--rate",
            "400",
            "--burst",
            "40",
            "--fail-rate",
            "0.2",
            "--latency-ms",
            "200",
        ],
        300,
        0,
    );
    env.spawn("throttler", &[]);
    let lease = ["--lease-ms", "1500", "--concurrency", "8"];
    let victim = env.spawn("worker", &lease);
    env.spawn("worker", &lease);
    env.spawn("worker", &lease);
    let (q, ledger) = env.queue().await;
    let ids = submit_all(&q, 200).await;
    // 200 jobs, 24 at a time, ~200ms each: about 1.7s. Kill in the middle.
    tokio::time::sleep(Duration::from_millis(600)).await;
    signal(&env.procs.0[victim], "-9");
    let _ = env.procs.0[victim].wait();
    let (ok, failed) = wait_all(&q, &ids, Duration::from_secs(60)).await;
    assert_eq!(ok.len() + failed.len(), 200);
    assert!(!failed.is_empty() && !ok.is_empty(), "both outcomes occur");
    let kept = failed.iter().filter(|(_, c)| c.charged()).count();
    assert!(
        failed
            .iter()
            .all(|(_, c)| matches!(c, FailureCause::Provider | FailureCause::Unanswered)),
        "{failed:?}"
    );
    let expected = (ok.len() + kept) as u64 * COST;
    assert_eq!(settled_usage(&ledger, expected).await, expected);
    // The killed worker held jobs: they ran again once its leases ended.
    let mut rerun = 0;
    for id in &ids {
        if q.status(&user(), id).await.unwrap().unwrap().job.run >= 2 {
            rerun += 1;
        }
    }
    assert!(rerun >= 1, "no job was taken over from the killed worker");
    // At least once: the killed worker's calls may have reached the upstream.
    let stats = env.stats().await;
    assert!(stats.ok >= ok.len() as u64, "{stats:?}");
}

/// SIGSTOP a worker in the middle of a call, past its lease; another worker
/// finishes the job; SIGCONT: the stopped worker's late result is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_sigstopped_worker_cannot_record_late() {
    let mut env = start(&["--latency-ms", "1500"], 100, 0);
    env.spawn("throttler", &[]);
    let log = env.dir.join("stopped-worker.log");
    let mut stopped = env.role(
        "worker",
        &["--lease-ms", "1000"],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let (q, ledger) = env.queue().await;
    let ids = submit_all(&q, 1).await;
    let id = &ids[0];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = q.status(&user(), id).await.unwrap().unwrap();
        if info.status == JobStatus::Running {
            break;
        }
        assert!(Instant::now() < deadline, "never running: {info:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The call is in flight (1.5s at the mock): stop the worker past its lease.
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&stopped, "-STOP");
    env.spawn("worker", &["--lease-ms", "1000"]);
    let (ok, _) = wait_all(&q, &ids, Duration::from_secs(30)).await;
    assert_eq!(ok.len(), 1);
    let info = q.status(&user(), id).await.unwrap().unwrap();
    assert_eq!(info.job.run, 2, "run again by the other worker");
    signal(&stopped, "-CONT");
    // Its answer is buffered: it tries to record, and is refused.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("lease lost") {
            break;
        }
        assert!(Instant::now() < deadline, "no refusal logged: {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal(&stopped, "-TERM");
    let _ = stopped.wait();
    let after = q.status(&user(), id).await.unwrap().unwrap();
    assert_eq!(after.status, info.status, "the job ended once");
    assert_eq!(after.finished_at_ms, info.finished_at_ms);
    assert_eq!(used(&ledger).await, COST, "charged once, never refunded");
}

/// Malformed entries in the queue are moved aside with a logged error; the
/// worker process keeps running and serves the next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_malformed_jobs_do_not_stop_the_worker() {
    let mut env = start(&[], 100, 0);
    env.spawn("throttler", &[]);
    let log = env.dir.join("worker.log");
    let worker = env.role(
        "worker",
        &[],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    env.procs.0.push(worker);
    let mut conn = redis::Client::open(env.server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    inject_malformed(&mut conn, &env.prefix, OP).await;
    let (q, ledger) = env.queue().await;
    let ids = submit_all(&q, 1).await;
    let (ok, _) = wait_all(&q, &ids, Duration::from_secs(30)).await;
    assert_eq!(ok.len(), 1);
    assert_eq!(q.dead_letters(OP).await.unwrap().len(), 3);
    let worker = env.procs.0.last_mut().unwrap();
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker still runs"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("malformed job moved aside"), "{text}");
    assert_eq!(used(&ledger).await, COST);
}

/// SIGTERM: the worker stops taking jobs, hands back the ones still running
/// after its grace period (the attempt not counted), and exits; another
/// worker then runs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_sigterm_hands_back_jobs_in_flight() {
    let mut env = start(&["--latency-ms", "3000"], 100, 0);
    env.spawn("throttler", &[]);
    let mut first = env.role("worker", &["--grace-ms", "200"], Stdio::null());
    let (q, ledger) = env.queue().await;
    let ids = submit_all(&q, 2).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    for id in &ids {
        while q.status(&user(), id).await.unwrap().unwrap().status != JobStatus::Running {
            assert!(Instant::now() < deadline, "never running");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    signal(&first, "-TERM");
    let exit = tokio::task::spawn_blocking(move || first.wait().unwrap())
        .await
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    for id in &ids {
        let info = q.status(&user(), id).await.unwrap().unwrap();
        assert_eq!(info.status, JobStatus::Queued, "handed back");
        assert_eq!(info.job.run, 0, "the attempt is not counted");
    }
    assert_eq!(q.queued_len(OP).await.unwrap(), 2);
    env.spawn("worker", &[]);
    let (ok, _) = wait_all(&q, &ids, Duration::from_secs(30)).await;
    assert_eq!(ok.len(), 2);
    assert_eq!(used(&ledger).await, 2 * COST);
}

/// `tollgate worker` refuses a config whose operation names no provider, naming
/// the key, with the bad-input exit code, before it touches Redis.
#[test]
fn job_cli_worker_rejects_a_bad_config() {
    let bad =
        "[plans.free]\nlimit = 10\nwindow = \"1h\"\n[operations.x]\ncost = 1\nprovider = \"gpt\"\n";
    let (dir, path) = tollgate_tests::temp_file("it", "bad.toml", bad).unwrap();
    let out = Command::new(workspace_bin("tollgate"))
        .args(["worker", "--redis-url", "redis://127.0.0.1:1/"])
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("operations.x.provider"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A role that starts while its Redis is down waits for it instead of exiting
/// (pods and their Redis restart in any order): `tollgate worker` started
/// against a stopped Redis is still running a second later, and once Redis is
/// back it registers its liveness on its own. (Found by the chaos suite: a
/// worker killed during a Redis outage never came back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_processes_a_worker_started_without_redis_waits_for_it() {
    let mut redis = RedisServer::start();
    let prefix = random_prefix();
    redis.stop();
    let mut worker = command(&[
        "worker",
        "--redis-url",
        &redis.url(),
        "--key-prefix",
        &prefix,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker exited while Redis was down"
    );
    redis.resume();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let workers = format!("{prefix}:v1:{{q:embeddings}}:workers");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let n: i64 = redis::cmd("HLEN")
            .arg(&workers)
            .query_async(&mut conn)
            .await
            .unwrap();
        if n == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the worker never came up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = worker.kill();
    let _ = worker.wait();
}
