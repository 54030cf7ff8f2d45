//! The throttle benchmark and the waiter-process mode of the throttle tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tollgate_core::{config::Config, duration, id::RequestId, throttle::Throttle};
use tollgate_redis::{
    keys::KeySpace,
    pool::PoolOptions,
    throttle::{RedisThrottle, RedisThrottleOptions},
};
use tollgate_tests::throttle::{now_us, run_waiters};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

#[derive(Debug, clap::Args)]
pub struct WaiterArgs {
    #[arg(long)]
    redis_url: String,
    #[arg(long)]
    key_prefix: String,
    /// TOML config with the provider.
    #[arg(long)]
    config: PathBuf,
    #[arg(long)]
    provider: String,
    /// Waiters, all at once.
    #[arg(long)]
    count: usize,
    /// Each waiter's max_wait (default: the provider's).
    #[arg(long, value_parser = duration::parse)]
    max_wait: Option<Duration>,
    /// Request ids are `<tag>-<n>`.
    #[arg(long, default_value = "w")]
    tag: String,
    /// Start the waiters at this wall-clock time (µs since the epoch), so that
    /// several processes start together.
    #[arg(long)]
    start_at_us: Option<u64>,
}

/// Prints a JSON array of [`tollgate_tests::throttle::GrantRecord`] on stdout.
pub async fn waiters(args: WaiterArgs) -> anyhow::Result<()> {
    let config = Config::load(Some(&args.config))?;
    let provider = config
        .provider(&args.provider)
        .with_context(|| format!("no provider {:?} in the config", args.provider))?;
    let max_wait = args.max_wait.unwrap_or(provider.max_wait);
    let pool = tollgate_redis::pool::connect(&args.redis_url, &PoolOptions::default()).await?;
    let throttle = RedisThrottle::start(
        pool,
        KeySpace::new(&args.key_prefix)?,
        &config,
        RedisThrottleOptions::default(),
    );
    anyhow::ensure!(
        throttle.subscribed(Duration::from_secs(5)).await,
        "no subscription within 5s"
    );
    if let Some(at) = args.start_at_us {
        let now = now_us();
        if at > now {
            tokio::time::sleep(Duration::from_micros(at - now)).await;
        }
    }
    let records = run_waiters(
        Arc::new(throttle),
        &args.provider,
        &args.tag,
        args.count,
        max_wait,
    )
    .await;
    println!("{}", serde_json::to_string(&records)?);
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Sequential acquires for the latency figure.
    #[arg(long, default_value_t = 2000)]
    latency_samples: usize,
    /// Seconds of saturation per throughput figure.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Waiters in flight during the throughput figure.
    #[arg(long, default_value_t = 256)]
    in_flight: usize,
}

const BENCH_CONFIG: &str = r#"
[plans.free]
limit = 1
window = "1h"
[providers.fast]
rate = 1000000
burst = 1000000
max_wait = "10s"
"#;

struct Throttlers(Vec<Child>);

impl Drop for Throttlers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start_throttlers(
    n: usize,
    url: &str,
    prefix: &str,
    config: &PathBuf,
) -> anyhow::Result<Throttlers> {
    let bin = workspace_bin("tollgate");
    let mut children = Throttlers(Vec::new());
    for _ in 0..n {
        let child = Command::new(&bin)
            .args(["throttler", "--redis-url", url, "--key-prefix", prefix])
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        children.0.push(child);
    }
    Ok(children)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn latency(throttle: &dyn Throttle, samples: usize) -> anyhow::Result<(Duration, Duration)> {
    let mut lat = Vec::with_capacity(samples);
    for i in 0..samples {
        let id = RequestId::new(format!("lat-{i}"))?;
        let t = Instant::now();
        throttle
            .acquire("fast", &id, Duration::from_secs(10))
            .await?;
        lat.push(t.elapsed());
    }
    lat.sort_unstable();
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

async fn throughput(
    throttle: Arc<dyn Throttle>,
    in_flight: usize,
    secs: u64,
) -> anyhow::Result<f64> {
    let until = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for w in 0..in_flight {
        let throttle = Arc::clone(&throttle);
        set.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < until {
                let id = RequestId::new(format!("tp-{w}-{n}"))?;
                throttle
                    .acquire("fast", &id, Duration::from_secs(10))
                    .await?;
                n += 1;
            }
            anyhow::Ok(n)
        });
    }
    let mut total = 0;
    while let Some(r) = set.join_next().await {
        total += r??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// Prints the figures of BENCHMARKS.md, "Throttle".
pub async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let config = Config::parse(BENCH_CONFIG, "bench")?;
    let server = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("tollgate-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config_path = dir.join("throttle.toml");
    std::fs::write(&config_path, BENCH_CONFIG)?;

    let memory = Arc::new(tollgate_core::throttle::MemoryThrottle::new(&config));
    let (p50, p99) = latency(memory.as_ref(), args.latency_samples).await?;
    let rate = throughput(memory, args.in_flight, args.seconds).await?;
    println!(
        "in-process     grant latency p50 {p50:>9.1?}  p99 {p99:>9.1?}   max {rate:>9.0} grants/s"
    );

    for throttlers in [1, 3] {
        let prefix = random_prefix();
        let _procs = start_throttlers(throttlers, &server.url(), &prefix, &config_path)?;
        let pool = tollgate_redis::pool::connect(
            &server.url(),
            &PoolOptions {
                max_size: 32,
                ..PoolOptions::default()
            },
        )
        .await?;
        let throttle = Arc::new(RedisThrottle::start(
            pool,
            KeySpace::new(&prefix)?,
            &config,
            RedisThrottleOptions::default(),
        ));
        anyhow::ensure!(
            throttle.subscribed(Duration::from_secs(5)).await,
            "no subscription"
        );
        // Warm up: scripts loaded, throttlers blocked on the queue.
        latency(throttle.as_ref(), 50).await?;
        let (p50, p99) = latency(throttle.as_ref(), args.latency_samples).await?;
        let rate = throughput(throttle, args.in_flight, args.seconds).await?;
        println!(
            "redis, {throttlers} throttler{} grant latency p50 {p50:>9.1?}  p99 {p99:>9.1?}   max {rate:>9.0} grants/s",
            if throttlers == 1 { " " } else { "s" }
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
