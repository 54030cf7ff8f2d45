//! The job benchmark: submit latency and end-to-end jobs/s (submit, take, throttle
//! slot, built-in mock provider, complete, waiter woken), embedded and on Redis
//! with real `tollgate throttler` and `tollgate worker` processes.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::{JobQueue, JobRequest, JobSource, JobStatus, SubmitOutcome},
    ledger::Ledger,
    throttle::Throttle,
};
use tollgate_memory::jobs::MemoryJobQueue;
use tollgate_memory::ledger::MemoryLedger;
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_redis::{jobs::RedisJobQueue, keys::KeySpace, ledger::RedisLedger, pool::PoolOptions};
use tollgate_tests::process::Procs;
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::stats::{us, Samples};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Jobs per measurement.
    #[arg(long, default_value_t = 2000)]
    jobs: usize,
    /// Jobs submitted and awaited at once.
    #[arg(long, default_value_t = 128)]
    in_flight: usize,
    /// Worker processes on Redis.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Each worker's --concurrency.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
}

const CONFIG: &str = r#"
[plans.free]
limit = 1000000000
window = "1h"
[providers.bench]
rate = 1000000
burst = 1000000
max_wait = "30s"
[operations.bench]
cost = 1
provider = "bench"
"#;

/// Submits `n` jobs, `in_flight` at a time, each awaited to the end; returns
/// (per-job submit latencies, per-job end-to-end latencies, wall time).
async fn drive(
    queue: Arc<dyn JobQueue>,
    tag: &str,
    n: usize,
    in_flight: usize,
) -> anyhow::Result<(Samples, Samples, Duration)> {
    let user = UserId::new("bench")?;
    let sem = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let mut set = tokio::task::JoinSet::new();
    let started = Instant::now();
    for i in 0..n {
        let permit = Arc::clone(&sem).acquire_owned().await?;
        let (queue, user) = (Arc::clone(&queue), user.clone());
        let id = RequestId::new(format!("{tag}-{i}"))?;
        set.spawn(async move {
            let _permit = permit;
            let t0 = Instant::now();
            let out = queue
                .submit(JobRequest {
                    id: id.clone(),
                    user: user.clone(),
                    operation: "bench".into(),
                    input: serde_json::json!({ "i": i }),
                    trace: None,
                    service_key: None,
                })
                .await?;
            anyhow::ensure!(matches!(out, SubmitOutcome::Queued { .. }), "{out:?}");
            let submitted = t0.elapsed();
            let info = queue.wait(&user, &id, Duration::from_secs(60)).await?;
            let ok = matches!(info.map(|i| i.status), Some(JobStatus::Succeeded { .. }));
            anyhow::ensure!(ok, "job {id} did not succeed");
            Ok((submitted, t0.elapsed()))
        });
    }
    let (mut submit, mut total) = (Vec::new(), Vec::new());
    while let Some(r) = set.join_next().await {
        let (s, t) = r??;
        submit.push(s);
        total.push(t);
    }
    Ok((Samples::new(submit), Samples::new(total), started.elapsed()))
}

fn row(mode: &str, n: usize, r: &(Samples, Samples, Duration)) {
    println!(
        "| {mode} | {:.0} µs | {:.0} µs | {:.1} ms | {:.1} ms | {:.0} |",
        us(r.0.median()),
        us(r.0.pct(99.0)),
        r.1.median().as_secs_f64() * 1e3,
        r.1.pct(99.0).as_secs_f64() * 1e3,
        n as f64 / r.2.as_secs_f64()
    );
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = Arc::new(Config::parse(CONFIG, "bench")?);
    println!(
        "{} jobs, {} in flight, cost 1, built-in mock provider, throttle never dry",
        args.jobs, args.in_flight
    );
    println!("| mode | submit p50 | submit p99 | end-to-end p50 | end-to-end p99 | jobs/s |");
    println!("|---|---|---|---|---|---|");

    // Embedded: the worker role in-process on the memory queue.
    {
        let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let queue = Arc::new(MemoryJobQueue::new(Arc::clone(&config), ledger));
        let throttle: Arc<dyn Throttle> = Arc::new(MemoryThrottle::new(&config));
        let mut cfg = tollgate_worker::WorkerConfig::new(Arc::clone(&config));
        let providers = tollgate_providers::from_config(&config, throttle, &cfg.metrics)?;
        cfg.concurrency = args.concurrency;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let source: Arc<dyn JobSource> = queue.clone();
        let role = tokio::spawn(tollgate_worker::run(cfg, source, providers, async {
            let _ = stopped.await;
        }));
        let r = drive(queue, "m", args.jobs, args.in_flight).await?;
        row("embedded (memory)", args.jobs, &r);
        let _ = stop.send(());
        role.await??;
    }

    // Redis: one throttler and `workers` worker processes.
    let server = RedisServer::start();
    let prefix = random_prefix();
    let dir = std::env::temp_dir().join(format!("tollgate-bench-{prefix}"));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("bench.toml");
    std::fs::write(&path, CONFIG)?;
    let bin = workspace_bin("tollgate");
    let spawn = |role: &str, extra: &[String]| -> anyhow::Result<Child> {
        Command::new(&bin)
            .args([role, "--redis-url", &server.url(), "--key-prefix", &prefix])
            .arg("--config")
            .arg(&path)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn tollgate {role}"))
    };
    let mut procs = Procs(vec![spawn("throttler", &[])?]);
    for _ in 0..args.workers {
        procs.0.push(spawn(
            "worker",
            &["--concurrency".into(), args.concurrency.to_string()],
        )?);
    }
    let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default()).await?;
    let keys = KeySpace::new(&prefix)?;
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
    ));
    let queue = Arc::new(RedisJobQueue::new(
        pool,
        keys,
        Arc::clone(&config),
        ledger,
        Default::default(),
    ));
    // Warm-up: the processes connect and load their scripts.
    drive(queue.clone(), "warm", 50, 50).await?;
    let r = drive(queue, "r", args.jobs, args.in_flight).await?;
    row(
        &format!("Redis, 1 throttler, {} workers", args.workers),
        args.jobs,
        &r,
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
