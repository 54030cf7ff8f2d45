//! `tollgate-bench utilisation`: how much of one provider's rate reaches its
//! upstream when it is saturated, on the full chain in real processes (1
//! `tollgate api`, 3 `tollgate throttler`, 2 `tollgate worker` on one
//! `redis-server`, a recording upstream in this process), optionally beside
//! CPU-burning loops; builds side by side (`--bin`, repeated: give one twice
//! for an A/A pair), in alternating order each round.
//!
//! One user submits `--jobs` async jobs at once to provider `llm` (rate 50,
//! burst 10, the default config otherwise). Per run:
//!   utilisation  (jobs - burst) / rate over the span from the first arrival
//!                at the upstream to the last (1.0: every token used)
//!   excess       the largest excess of arrivals over burst + rate·t in any
//!                interval: the upstream's bound is excess <= 1
//!   late         grants the workers logged as too old to use, on delivery
//!                and at the send (tokens lost), and those re-dated instead

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::Client;
use serde_json::{json, Value};
use tollgate_tests::process::Procs;
use tollgate_tests::throttle::max_excess;
use tollgate_tests::upstream::{Limit, Upstream};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Jobs submitted at once per run.
    #[arg(long, default_value_t = 400)]
    jobs: usize,
    /// Rounds; each runs every build once, in alternating order.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// CPU-burning loops beside the chain.
    #[arg(long, default_value_t = 0)]
    burn: usize,
    /// `late_allowance` of the provider (none by default).
    #[arg(long)]
    late_allowance: Option<String>,
    /// A `tollgate` binary to run the chain with (repeat for builds side by
    /// side; the same one twice for an A/A pair). Default: this build's.
    #[arg(long)]
    bin: Vec<PathBuf>,
    /// Throttler processes.
    #[arg(long, default_value_t = 3)]
    throttlers: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Each worker's `--concurrency` (default: the worker's own default).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Keep each run's role logs (their folder is printed).
    #[arg(long)]
    keep_logs: bool,
    /// Users the jobs are spread over (in turn).
    #[arg(long, default_value_t = 1)]
    users: usize,
}

const ADMIN: &str = "utilisation-bench-admin-token-0123456789";
const RATE: f64 = 50.0;
const BURST: u64 = 10;

fn config(upstream: &str, allowance: Option<&str>) -> String {
    let allowance = allowance.map_or(String::new(), |a| format!("late_allowance = \"{a}\"\n"));
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
{allowance}[operations."bench.call"]
cost = 1
provider = "llm"
path = "/llm"
deadline = "600s"
"#
    )
}

fn role(
    bin: &Path,
    dir: &Path,
    url: &str,
    prefix: &str,
    name: &str,
    args: &[&str],
) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    Command::new(bin)
        .args(args)
        .env("TOLLGATE_REDIS_URL", url)
        .env("TOLLGATE_KEY_PREFIX", prefix)
        .env("TOLLGATE_CONFIG", dir.join("utilisation.toml"))
        .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
        // Re-dated grants are logged at debug.
        .env("RUST_LOG", "warn,tollgate_redis::throttle=debug")
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

/// What one run measured.
struct Outcome {
    utilisation: f64,
    excess: f64,
    late_delivered: usize,
    late_at_send: usize,
    redated: usize,
    /// Calls the upstream refused (past burst + rate·t + 1 on its clock).
    refused: usize,
    span_s: f64,
}

/// Lines of the logs in `dir` of roles named `worker-*` that hold `needle`.
fn count_in_worker_logs(dir: &Path, needle: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("worker-"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .map(|text| text.lines().filter(|l| l.contains(needle)).count())
        .sum()
}

async fn chain(args: &Args, bin: &Path, server: &RedisServer) -> anyhow::Result<Outcome> {
    let prefix = random_prefix();
    let dir = std::env::temp_dir().join(format!("tollgate-utilisation-{prefix}"));
    std::fs::create_dir_all(&dir)?;
    // The upstream refuses (and records) a call past burst + rate·t + 1.
    let limits = HashMap::from([(
        "llm".to_owned(),
        Limit {
            rate: RATE,
            burst: BURST as f64 + 1.0,
        },
    )]);
    let upstream = Upstream::start(limits, Duration::ZERO).await?;
    std::fs::write(
        dir.join("utilisation.toml"),
        config(&upstream.url(), args.late_allowance.as_deref()),
    )?;
    let url = server.url();
    let mut procs = Procs(Vec::new());
    let port = tollgate_tests::redis_server::free_port();
    let api: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let listen = api.to_string();
    procs.0.push(role(
        bin,
        &dir,
        &url,
        &prefix,
        "api",
        &["api", "--listen", &listen],
    )?);
    for i in 0..args.throttlers {
        procs.0.push(role(
            bin,
            &dir,
            &url,
            &prefix,
            &format!("throttler-{i}"),
            &["throttler"],
        )?);
    }
    let concurrency = args.concurrency.map(|c| c.to_string());
    for i in 0..args.workers {
        let mut worker = vec!["worker"];
        if let Some(c) = &concurrency {
            worker.extend(["--concurrency", c]);
        }
        procs.0.push(role(
            bin,
            &dir,
            &url,
            &prefix,
            &format!("worker-{i}"),
            &worker,
        )?);
    }
    let http = Client::builder().timeout(Duration::from_secs(30)).build()?;
    up(&http, api).await?;
    let mut keys = Vec::new();
    for u in 0..args.users.max(1) {
        let r = http
            .post(format!("http://{api}/admin/users"))
            .bearer_auth(ADMIN)
            .json(&json!({"user": format!("u{u}"), "plan": "free"}))
            .send()
            .await?;
        let v: Value = r.json().await?;
        keys.push(v["api_key"].as_str().context("api_key")?.to_owned());
    }
    // The workers and throttlers settle; the bucket is full.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..args.jobs {
        let key = keys[i % keys.len()].clone();
        let (http, gate) = (http.clone(), std::sync::Arc::clone(&gate));
        set.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            let r = http
                .post(format!("http://{api}/v1/ops/bench.call"))
                .bearer_auth(&key)
                .header("prefer", "respond-async")
                .json(&json!({"n": i}))
                .send()
                .await?;
            let status = r.status();
            if status.as_u16() != 202 {
                bail!("submit: {status} {}", r.text().await.unwrap_or_default());
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    let give_up = Instant::now() + Duration::from_secs(20 + args.jobs as u64 / 10);
    let arrivals = loop {
        let arrivals = upstream.arrivals();
        if arrivals.len() >= args.jobs {
            break arrivals;
        }
        if Instant::now() >= give_up {
            bail!(
                "{} of {} calls reached the upstream (logs in {})",
                arrivals.len(),
                args.jobs,
                dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    drop(procs);
    let times: Vec<u64> = arrivals.iter().map(|a| a.at_us).collect();
    let (first, last) = (
        times.iter().min().copied().unwrap_or(0),
        times.iter().max().copied().unwrap_or(0),
    );
    let span_s = last.saturating_sub(first) as f64 / 1e6;
    let out = Outcome {
        utilisation: (times.len() as f64 - BURST as f64) / RATE / span_s.max(1e-9),
        excess: max_excess(&times, RATE, BURST),
        late_delivered: count_in_worker_logs(&dir, "a grant arrived late"),
        late_at_send: count_in_worker_logs(&dir, "went stale before its call was sent"),
        redated: count_in_worker_logs(&dir, "a late grant re-dated"),
        refused: arrivals.iter().filter(|a| a.status != 200).count(),
        span_s,
    };
    if args.keep_logs {
        println!("logs in {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split(' ').next().map(str::to_owned))
        .unwrap_or_default()
}

/// Prints one line per run, then each build's median.
pub async fn run(args: Args) -> anyhow::Result<()> {
    tollgate_providers::http::install_crypto_provider();
    let bins = if args.bin.is_empty() {
        vec![workspace_bin("tollgate")]
    } else {
        args.bin.clone()
    };
    let server = RedisServer::start();
    let mut burners = Procs(Vec::new());
    for _ in 0..args.burn {
        burners.0.push(
            Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .stdin(Stdio::null())
                .spawn()?,
        );
    }
    let mut by_bin: Vec<Vec<f64>> = vec![Vec::new(); bins.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..bins.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let load = load();
            let o = chain(&args, &bins[i], &server).await?;
            println!(
                "round {round} bin {i} ({}): load {load} utilisation {:.3} span {:.2}s excess {:.2} \
                 ({} refused) late {} delivered + {} at send, {} re-dated",
                bins[i].display(),
                o.utilisation,
                o.span_s,
                o.excess,
                o.refused,
                o.late_delivered,
                o.late_at_send,
                o.redated
            );
            by_bin[i].push(o.utilisation);
        }
    }
    drop(burners);
    for (i, mut u) in by_bin.into_iter().enumerate() {
        u.sort_by(f64::total_cmp);
        let median = u.get(u.len() / 2).copied().unwrap_or(f64::NAN);
        println!(
            "bin {i} ({}): median utilisation {median:.3} of {:?}",
            bins[i].display(),
            u
        );
    }
    Ok(())
}
