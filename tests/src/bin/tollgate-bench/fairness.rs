//! `tollgate-bench fairness`: issue 12's scenario on the full chain, in real
//! processes (2 `tollgate api`, 2 `tollgate throttler`, 2 `tollgate worker`
//! on one `redis-server`, and a recording upstream in this process), for
//! `fairness = "fifo"` and `"fair"`; then shares 4:1 at the throttle.
//!
//! User A submits `--flood` async jobs at once through the api; 1 s later B, C
//! and D submit `--each` each. A job's wait is from its submission (this
//! process's clock, just before the POST) to its call's arrival at the
//! upstream (the same clock). The upstream also checks the provider's bound:
//! every arrival is held to burst + rate·t (+1, what a grant's delivery may
//! bunch).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::Client;
use serde_json::{json, Value};
use tollgate_tests::process::Procs;
use tollgate_tests::throttle::{max_excess, now_us};
use tollgate_tests::upstream::{Limit, Upstream};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::throttle;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Jobs of user A, all at once.
    #[arg(long, default_value_t = 1000)]
    flood: usize,
    /// Jobs of each of B, C and D, 1 s later.
    #[arg(long, default_value_t = 10)]
    each: usize,
    /// Each mode gives up after this many seconds.
    #[arg(long, default_value_t = 180)]
    within: u64,
    /// Calls of each user in the shares 4:1 run (at the throttle).
    #[arg(long, default_value_t = 400)]
    shares_calls: usize,
    /// Only the shares run.
    #[arg(long)]
    shares_only: bool,
    /// The chain's modes, in order.
    #[arg(long, value_delimiter = ',', default_value = "fifo,fair")]
    modes: Vec<String>,
    /// Write each mode's submissions and upstream arrivals here as JSON.
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
}

const ADMIN: &str = "fairness-bench-admin-token-0123456789";
const RATE: f64 = 20.0;
const BURST: u64 = 5;

fn config(upstream: &str, mode: &str) -> String {
    format!(
        r#"default_plan = "free"
[plans.free]
limit = 100000000
window = "1h"
[providers.llm]
rate = {RATE}
burst = {BURST}
max_wait = "300s"
url = "{upstream}"
timeout = "10s"
retries = 0
fairness = "{mode}"
[operations."bench.call"]
cost = 1
provider = "llm"
path = "/llm"
deadline = "600s"
"#
    )
}

fn role(dir: &Path, url: &str, prefix: &str, name: &str, args: &[&str]) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    Command::new(workspace_bin("tollgate"))
        .args(args)
        .env("TOLLGATE_REDIS_URL", url)
        .env("TOLLGATE_KEY_PREFIX", prefix)
        .env("TOLLGATE_CONFIG", dir.join("fairness.toml"))
        .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawn {name}"))
}

async fn up(http: &Client, api: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match http.get(format!("http://{api}/readyz")).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            other if Instant::now() >= deadline => bail!("{api} not ready: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn create_user(http: &Client, api: SocketAddr, user: &str) -> anyhow::Result<String> {
    let r = http
        .post(format!("http://{api}/admin/users"))
        .bearer_auth(ADMIN)
        .json(&json!({"user": user, "plan": "free"}))
        .send()
        .await?;
    let status = r.status();
    let v: Value = r.json().await?;
    if !status.is_success() {
        bail!("create user {user}: {status} {v}");
    }
    Ok(v["api_key"].as_str().context("api_key")?.to_owned())
}

/// Submits `n` async jobs of the user of `key` through `apis` in turn (64 at
/// a time), starting at `at`; returns (job id, submitted at µs).
async fn submit(
    http: Client,
    apis: Vec<SocketAddr>,
    key: String,
    n: usize,
    at: tokio::time::Instant,
) -> anyhow::Result<Vec<(String, u64)>> {
    tokio::time::sleep_until(at).await;
    let gate = Arc::new(tokio::sync::Semaphore::new(64));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let (http, key, gate) = (http.clone(), key.clone(), Arc::clone(&gate));
        let api = apis[i % apis.len()];
        set.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            let sent = now_us();
            let r = http
                .post(format!("http://{api}/v1/ops/bench.call"))
                .bearer_auth(&key)
                .header("prefer", "respond-async")
                .json(&json!({"n": i}))
                .send()
                .await?;
            let status = r.status();
            let v: Value = r.json().await?;
            if status.as_u16() != 202 {
                bail!("submit: {status} {v}");
            }
            anyhow::Ok((v["job_id"].as_str().context("job_id")?.to_owned(), sent))
        });
    }
    let mut out = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        out.push(r??);
    }
    Ok(out)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// What one mode measured.
struct Outcome {
    late_p95_ms: f64,
    late_max_ms: f64,
    a_in_window: usize,
    window_s: f64,
    a_span_s: f64,
    a_rate: f64,
    arrivals: usize,
    refused: usize,
    excess: f64,
}

async fn chain(args: &Args, server: &RedisServer, mode: &str) -> anyhow::Result<Outcome> {
    let prefix = random_prefix();
    let dir = std::env::temp_dir().join(format!("tollgate-fairness-{prefix}"));
    std::fs::create_dir_all(&dir)?;
    // The upstream's own limit: the provider's, plus the one call a grant's
    // delivery may bunch; a call past it is answered 429 (and counted).
    let limits = HashMap::from([(
        "llm".to_owned(),
        Limit {
            rate: RATE,
            burst: BURST as f64 + 1.0,
        },
    )]);
    let upstream = Upstream::start(limits, Duration::ZERO).await?;
    std::fs::write(dir.join("fairness.toml"), config(&upstream.url(), mode))?;
    let url = server.url();
    let mut procs = Procs(Vec::new());
    let mut apis = Vec::new();
    for i in 0..2 {
        let port = tollgate_tests::redis_server::free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let listen = addr.to_string();
        procs.0.push(role(
            &dir,
            &url,
            &prefix,
            &format!("api-{i}"),
            &["api", "--listen", &listen],
        )?);
        apis.push(addr);
    }
    for i in 0..2 {
        procs.0.push(role(
            &dir,
            &url,
            &prefix,
            &format!("throttler-{i}"),
            &["throttler"],
        )?);
    }
    // Every job a worker holds waits at the throttle, in its user's queue:
    // the workers' concurrency covers the whole flood, or B-D's jobs would
    // wait in the job queue (FIFO) behind A's before reaching the throttle.
    let concurrency = (args.flood + 3 * args.each).div_ceil(2) + 64;
    for i in 0..2 {
        procs.0.push(role(
            &dir,
            &url,
            &prefix,
            &format!("worker-{i}"),
            &["worker", "--concurrency", &concurrency.to_string()],
        )?);
    }
    let http = Client::builder().timeout(Duration::from_secs(30)).build()?;
    for api in &apis {
        up(&http, *api).await?;
    }
    let mut keys = HashMap::new();
    for user in ["A", "B", "C", "D"] {
        keys.insert(user, create_user(&http, apis[0], user).await?);
    }
    // Let the workers and throttlers settle.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let t0 = tokio::time::Instant::now() + Duration::from_millis(200);
    let t0_us = now_us() + 200_000;
    let a = tokio::spawn(submit(
        http.clone(),
        apis.clone(),
        keys["A"].clone(),
        args.flood,
        t0,
    ));
    let late: Vec<_> = ["B", "C", "D"]
        .iter()
        .map(|u| {
            tokio::spawn(submit(
                http.clone(),
                apis.clone(),
                keys[u].clone(),
                args.each,
                t0 + Duration::from_secs(1),
            ))
        })
        .collect();
    let a_jobs = a.await??;
    let mut late_jobs = Vec::new();
    for l in late {
        late_jobs.extend(l.await??);
    }
    let total = a_jobs.len() + late_jobs.len();
    let give_up = Instant::now() + Duration::from_secs(args.within);
    let arrivals = loop {
        let arrivals = upstream.arrivals();
        if arrivals.len() >= total {
            break arrivals;
        }
        if Instant::now() >= give_up {
            bail!(
                "{mode}: {} of {total} calls reached the upstream within {} s (logs in {})",
                arrivals.len(),
                args.within,
                dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    drop(procs);
    let at: HashMap<&str, u64> = arrivals
        .iter()
        .filter_map(|a| Some((a.job.as_deref()?, a.at_us)))
        .collect();
    let mut late_waits: Vec<f64> = late_jobs
        .iter()
        .filter_map(|(id, sent)| Some(at.get(id.as_str())?.saturating_sub(*sent) as f64 / 1e3))
        .collect();
    late_waits.sort_by(f64::total_cmp);
    let late_first_sent = late_jobs.iter().map(|(_, s)| *s).min().unwrap_or(t0_us);
    let late_last = late_jobs
        .iter()
        .filter_map(|(id, _)| at.get(id.as_str()).copied())
        .max()
        .unwrap_or(late_first_sent);
    let a_times: Vec<u64> = a_jobs
        .iter()
        .filter_map(|(id, _)| at.get(id.as_str()).copied())
        .collect();
    let a_in_window = a_times
        .iter()
        .filter(|t| (late_first_sent..=late_last).contains(t))
        .count();
    let a_first = a_times.iter().min().copied().unwrap_or(0);
    let a_last = a_times.iter().max().copied().unwrap_or(0);
    let a_span_s = a_last.saturating_sub(a_first) as f64 / 1e6;
    let times: Vec<u64> = arrivals.iter().map(|a| a.at_us).collect();
    if let Some(to) = &args.dump {
        std::fs::create_dir_all(to)?;
        let arrived: Vec<Value> = arrivals
            .iter()
            .map(|a| json!({"at_us": a.at_us, "job": a.job, "status": a.status}))
            .collect();
        let dump = json!({"t0_us": t0_us, "a": a_jobs, "late": late_jobs, "arrivals": arrived});
        std::fs::write(to.join(format!("{mode}.json")), dump.to_string())?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Outcome {
        late_p95_ms: percentile(&late_waits, 0.95),
        late_max_ms: late_waits.last().copied().unwrap_or(f64::NAN),
        a_in_window,
        window_s: late_last.saturating_sub(late_first_sent) as f64 / 1e6,
        a_span_s,
        a_rate: a_times.len().saturating_sub(1) as f64 / a_span_s.max(1e-9),
        arrivals: arrivals.len(),
        refused: arrivals.iter().filter(|a| a.status != 200).count(),
        excess: max_excess(&times, RATE, BURST),
    })
}

/// Prints the figures of BENCHMARKS.md, "Fairness".
pub async fn run(args: Args) -> anyhow::Result<()> {
    tollgate_providers::http::install_crypto_provider();
    let server = RedisServer::start();
    if !args.shares_only {
        println!(
            "full chain: 2 api, 2 throttlers, 2 workers, upstream at rate {RATE}, burst {BURST}; \
             A submits {} jobs, 1 s later B, C, D {} each",
            args.flood, args.each
        );
        let target = 2.0 * (args.each as f64 * 4.0) / RATE;
        for mode in &args.modes {
            let mode = mode.as_str();
            let o = chain(&args, &server, mode).await?;
            println!(
                "{mode:<4}  B-D wait p95 {:>8.0} ms  max {:>8.0} ms (target {:.0} ms)   \
                 A: {} calls while B-D waited ({:.1} s), all {} in {:.1} s = {:.1}/s   \
                 upstream: {} calls, {} refused, bound excess {:.2}",
                o.late_p95_ms,
                o.late_max_ms,
                target * 1e3,
                o.a_in_window,
                o.window_s,
                args.flood,
                o.a_span_s,
                o.a_rate,
                o.arrivals,
                o.refused,
                o.excess,
            );
        }
    }
    throttle::shares(&server, args.shares_calls).await
}
