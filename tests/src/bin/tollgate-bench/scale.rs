//! The scaling curve: reserves/s and sync calls/s through 1, 2 and 4 pods on
//! one Redis and on a 3-primary Redis Cluster, over many users, with the Redis
//! commands and Redis CPU time each call costs (the figures that project to
//! other hardware).
//!
//! - **reserves/s**: `pods` processes of `tollgate-bench reserve-load`, each the
//!   api's own ledger client (`RedisLedger`, the code behind every charge),
//!   reserving for random users out of `--users`.
//! - **sync calls/s**: `pods` processes of `tollgate all` (each an api, a worker
//!   and a throttler), `--clients` HTTP clients spread over them round-robin, each
//!   call by one of `--http-users` users.
//!
//! Redis figures are deltas of `INFO commandstats` and `INFO cpu` summed over
//! the primaries, taken around the timed stretch (so the pods' background loops
//! are included: heartbeats, blocking takes that time out).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde_json::json;
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    ledger::Ledger,
};
use tollgate_redis::{keys::KeySpace, ledger::RedisLedger, pool::PoolOptions};
use tollgate_tests::{random_prefix, workspace_bin, RedisCluster, RedisServer};

use crate::api::{All, ADMIN, CONFIG};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Users the reserves are spread over (their keys spread over the slots).
    #[arg(long, default_value_t = 10_000)]
    users: usize,
    /// Users with an API key, for the sync calls.
    #[arg(long, default_value_t = 1_000)]
    http_users: usize,
    /// Seconds of each timed stretch.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Reserving tasks in each reserve-load process.
    #[arg(long, default_value_t = 32)]
    tasks: usize,
    /// HTTP clients of the sync-call runs (shared by the pods).
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Pod counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pods: Vec<usize>,
    /// Primaries of the cluster (each with one replica).
    #[arg(long, default_value_t = 3)]
    primaries: usize,
}

/// One process of reserves: what an api pod's ledger sends.
#[derive(Debug, clap::Args)]
pub struct ReserveLoadArgs {
    #[arg(long)]
    redis_url: String,
    #[arg(long)]
    prefix: String,
    #[arg(long)]
    users: usize,
    #[arg(long)]
    tasks: usize,
    #[arg(long)]
    seconds: u64,
    /// Unix time (ms) at which to start, so that the processes start together.
    #[arg(long)]
    start_at_ms: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Reserves cost 1 for random users until `seconds` have passed; prints
/// `{"reserves": n, "errors": e}`.
pub async fn reserve_load(args: ReserveLoadArgs) -> anyhow::Result<()> {
    let pool = tollgate_redis::pool::connect(&args.redis_url, &PoolOptions::default()).await?;
    let config = Config::parse(CONFIG, "the bench config")?;
    let ledger = Arc::new(RedisLedger::new(
        pool,
        KeySpace::new(&args.prefix)?,
        Arc::new(config),
    ));
    let users: Arc<Vec<UserId>> = Arc::new(
        (0..args.users)
            .map(|i| format!("user-{i}").parse())
            .collect::<Result<_, _>>()?,
    );
    // Warm the pool and the script cache before the clock starts.
    ledger.reserve(&users[0], &RequestId::generate(), 1).await?;
    tokio::time::sleep(Duration::from_millis(
        args.start_at_ms.saturating_sub(unix_ms()).min(30_000),
    ))
    .await;
    let stop = Instant::now() + Duration::from_secs(args.seconds);
    let mut set = tokio::task::JoinSet::new();
    for t in 0..args.tasks {
        let (ledger, users) = (Arc::clone(&ledger), Arc::clone(&users));
        set.spawn(async move {
            let (mut n, mut errors) = (0u64, 0u64);
            let mut i = t.wrapping_mul(7919);
            while Instant::now() < stop {
                i = i
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let user = &users[(i >> 33) % users.len()];
                match ledger.reserve(user, &RequestId::generate(), 1).await {
                    Ok(_) => n += 1,
                    Err(_) => errors += 1,
                }
            }
            (n, errors)
        });
    }
    let (mut n, mut errors) = (0, 0);
    while let Some(r) = set.join_next().await {
        let (a, b) = r?;
        n += a;
        errors += b;
    }
    println!("{}", json!({ "reserves": n, "errors": errors }));
    Ok(())
}

/// Where the bench's Redis runs: one server, or a cluster.
enum Store {
    Single(RedisServer),
    Cluster(RedisCluster),
}

impl Store {
    fn url(&self) -> String {
        match self {
            Self::Single(s) => s.url(),
            Self::Cluster(c) => c.url(),
        }
    }

    fn name(&self) -> String {
        match self {
            Self::Single(_) => "one Redis".to_owned(),
            Self::Cluster(c) => format!("cluster, {} primaries", c.nodes.len() / 2),
        }
    }

    fn ports(&self) -> Vec<u16> {
        match self {
            Self::Single(s) => vec![s.port()],
            Self::Cluster(c) => c.nodes.iter().map(|n| n.port()).collect(),
        }
    }
}

/// Redis counters summed over the primaries.
#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    /// Commands executed, scripts' own commands included.
    commands: u64,
    /// Scripts run (EVALSHA and EVAL, FCALL of the budget functions).
    scripts: u64,
    /// Seconds of CPU (user + system) of the primaries.
    cpu: f64,
}

fn info_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

async fn counters(ports: &[u16]) -> anyhow::Result<Counters> {
    let mut total = Counters::default();
    for port in ports {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let info: String = redis::cmd("INFO")
            .arg("everything")
            .query_async(&mut conn)
            .await?;
        if info_field(&info, "role") != Some("master") {
            continue;
        }
        for line in info.lines() {
            let Some(rest) = line.strip_prefix("cmdstat_") else {
                continue;
            };
            let (name, stats) = rest.split_once(':').unwrap_or((rest, ""));
            let calls: u64 = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            // The probes of this bench are not the load's.
            if name == "info" {
                continue;
            }
            total.commands += calls;
            if name == "evalsha" || name == "eval" || name == "fcall" {
                total.scripts += calls;
            }
        }
        let cpu = |k| {
            info_field(&info, k)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        total.cpu += cpu("used_cpu_user") + cpu("used_cpu_sys");
    }
    Ok(total)
}

/// CPU seconds (user + system) the processes `pids` have used so far, from
/// /proc (clock ticks of 1/100 s); 0 for a process that is gone.
fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // The fields after the command name (which may hold spaces), from field 3.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
            Some(ticks as f64 / 100.0)
        })
        .sum()
}

/// One measured stretch: calls, wall time, and the CPU the pods used.
struct Stretch {
    calls: u64,
    wall: Duration,
    pods_cpu: f64,
}

/// One row: calls over the stretch, and the Redis and pod work they cost.
fn row(store: &str, what: &str, pods: usize, s: &Stretch, before: Counters, after: Counters) {
    let per = |x: f64| {
        if s.calls == 0 {
            0.0
        } else {
            x / s.calls as f64
        }
    };
    let rate = s.calls as f64 / s.wall.as_secs_f64();
    let cpu = after.cpu - before.cpu;
    println!(
        "| {store} | {what} | {pods} | {rate:.0} | {:.1} | {:.2} | {:.0} µs | {:.0}% | {:.0} µs |",
        per((after.commands - before.commands) as f64),
        per((after.scripts - before.scripts) as f64),
        per(cpu * 1e6),
        100.0 * cpu / s.wall.as_secs_f64(),
        per(s.pods_cpu * 1e6),
    );
}

async fn reserves(bench: &Path, store: &Store, args: &Args, pods: usize) -> anyhow::Result<()> {
    let prefix = random_prefix();
    let start_at = unix_ms() + 3_000;
    let children: Vec<Child> = (0..pods)
        .map(|_| {
            Command::new(bench)
                .args([
                    "reserve-load",
                    "--redis-url",
                    &store.url(),
                    "--prefix",
                    &prefix,
                ])
                .args(["--users", &args.users.to_string()])
                .args(["--tasks", &args.tasks.to_string()])
                .args(["--seconds", &args.seconds.to_string()])
                .args(["--start-at-ms", &start_at.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .context("spawn tollgate-bench reserve-load")
        })
        .collect::<anyhow::Result<_>>()?;
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    tokio::time::sleep(Duration::from_millis(start_at.saturating_sub(unix_ms()))).await;
    let before = counters(&store.ports()).await?;
    let cpu0 = cpu_of(&pids);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    let after = counters(&store.ports()).await?;
    let pods_cpu = cpu_of(&pids) - cpu0;
    let wall = t0.elapsed();
    let mut total = 0u64;
    for child in children {
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
        anyhow::ensure!(out.status.success(), "a reserve-load process failed");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        anyhow::ensure!(v["errors"].as_u64() == Some(0), "reserve errors: {v}");
        total += v["reserves"].as_u64().unwrap_or(0);
    }
    let stretch = Stretch {
        calls: total,
        wall,
        pods_cpu,
    };
    row(&store.name(), "reserve", pods, &stretch, before, after);
    Ok(())
}

async fn sync_calls(config: &Path, store: &Store, args: &Args, pods: usize) -> anyhow::Result<()> {
    let prefix = random_prefix();
    let bin = workspace_bin("tollgate");
    let all: Vec<All> = (0..pods)
        .map(|_| All::start(&bin, config, 64, Some((&store.url(), &prefix))))
        .collect::<anyhow::Result<_>>()?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(args.clients * 2)
        .build()?;
    // Users with keys, made through the first pod's admin api.
    let mut keys = Vec::with_capacity(args.http_users);
    let mut set = tokio::task::JoinSet::new();
    for i in 0..args.http_users {
        let (http, base) = (http.clone(), all[0].base.clone());
        set.spawn(async move {
            let v: serde_json::Value = http
                .post(format!("{base}/admin/users"))
                .bearer_auth(ADMIN)
                .json(&json!({ "user": format!("user-{i}") }))
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            v["api_key"]
                .as_str()
                .map(str::to_owned)
                .context("no api_key in /admin/users")
        });
        if set.len() >= 32 {
            if let Some(r) = set.join_next().await {
                keys.push(r??);
            }
        }
    }
    while let Some(r) = set.join_next().await {
        keys.push(r??);
    }
    let keys = Arc::new(keys);
    let bases: Arc<Vec<String>> = Arc::new(all.iter().map(|a| a.base.clone()).collect());
    let run = |seconds: f64| {
        let (http, keys, bases) = (http.clone(), Arc::clone(&keys), Arc::clone(&bases));
        let clients = args.clients;
        async move {
            let stop = Arc::new(AtomicBool::new(false));
            let done = Arc::new(AtomicU64::new(0));
            let mut set = tokio::task::JoinSet::new();
            for c in 0..clients {
                let (http, keys, bases, stop, done) = (
                    http.clone(),
                    Arc::clone(&keys),
                    Arc::clone(&bases),
                    Arc::clone(&stop),
                    Arc::clone(&done),
                );
                set.spawn(async move {
                    let url = format!("{}/v1/ops/bench", bases[c % bases.len()]);
                    let mut i = c;
                    while !stop.load(Ordering::Relaxed) {
                        i += clients;
                        let resp = http
                            .post(&url)
                            .bearer_auth(&keys[i % keys.len()])
                            .json(&json!({ "i": i }))
                            .send()
                            .await?;
                        let status = resp.status();
                        resp.bytes().await?;
                        anyhow::ensure!(status.as_u16() == 200, "sync call answered {status}");
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    anyhow::Ok(())
                });
            }
            tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
            stop.store(true, Ordering::Relaxed);
            while let Some(r) = set.join_next().await {
                r??;
            }
            anyhow::Ok(done.load(Ordering::Relaxed))
        }
    };
    // Warm-up: connections, scripts, every pod's loops.
    run(1.0).await?;
    let pids: Vec<u32> = all.iter().map(All::pid).collect();
    let before = counters(&store.ports()).await?;
    let cpu0 = cpu_of(&pids);
    let t0 = Instant::now();
    let n = run(args.seconds as f64).await?;
    let wall = t0.elapsed();
    let pods_cpu = cpu_of(&pids) - cpu0;
    let after = counters(&store.ports()).await?;
    let stretch = Stretch {
        calls: n,
        wall,
        pods_cpu,
    };
    row(&store.name(), "sync call", pods, &stretch, before, after);
    drop(all);
    Ok(())
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let (dir, config) = crate::bench_config("scale", CONFIG)?;
    let bench: PathBuf = std::env::current_exe()?;
    println!(
        "{} users for reserves, {} with keys for sync calls, {} s per point, {} reserving tasks per process, {} HTTP clients",
        args.users, args.http_users, args.seconds, args.tasks, args.clients
    );
    println!("| store | call | pods | calls/s | Redis commands per call | scripts per call | primaries' CPU per call | primaries' CPU busy (sum) | pods' CPU per call |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for cluster in [false, true] {
        let store = if cluster {
            Store::Cluster(RedisCluster::start(args.primaries))
        } else {
            Store::Single(RedisServer::start())
        };
        for &pods in &args.pods {
            reserves(&bench, &store, &args, pods).await?;
        }
        for &pods in &args.pods {
            sync_calls(&config, &store, &args, pods).await?;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
