//! The throttle benchmark and the waiter-process mode of the throttle tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tollgate_core::{
    config::Config,
    duration,
    id::RequestId,
    throttle::{Share, Throttle, Waiter},
};
use tollgate_redis::{
    keys::KeySpace,
    pool::PoolOptions,
    throttle::{RedisThrottle, RedisThrottleOptions},
};
use tollgate_tests::throttle::{now_us, run_waiters_as, run_waiters_of, GrantRecord};
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
    /// Spread the waiters over this many users (`u0`, `u1`, ...); 0: the
    /// anonymous queue.
    #[arg(long, default_value_t = 0)]
    users: usize,
    /// Every waiter queues as this user (overrides --users).
    #[arg(long)]
    user: Option<String>,
    /// The share of --user.
    #[arg(long, default_value_t = 1)]
    share: u32,
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
    let records = match &args.user {
        Some(user) => {
            let share = Share {
                weight: args.share,
                ..Share::default()
            };
            run_waiters_as(
                Arc::new(throttle),
                &args.provider,
                &args.tag,
                args.count,
                max_wait,
                user,
                share,
            )
            .await
        }
        None => {
            run_waiters_of(
                Arc::new(throttle),
                &args.provider,
                &args.tag,
                args.count,
                max_wait,
                args.users,
            )
            .await
        }
    };
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
    throughput_of(throttle, in_flight, secs, 0).await
}

/// Grants/s of `in_flight` waiters in a loop; with `users` > 0 each acquire
/// is made for one of that many users, in turn.
async fn throughput_of(
    throttle: Arc<dyn Throttle>,
    in_flight: usize,
    secs: u64,
    users: usize,
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
                if users == 0 {
                    throttle
                        .acquire("fast", &id, Duration::from_secs(10))
                        .await?;
                } else {
                    let user = format!("u{}", (w + n as usize * in_flight) % users);
                    let waiter = Waiter::of(&id, &user, Share::default());
                    throttle
                        .acquire_as("fast", &waiter, Duration::from_secs(10))
                        .await?;
                }
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
    fairness_cost(&server, &dir, &args).await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The waiters' side of the grant-path figures: a bucket of one token, so
/// that nearly every acquire queues for the throttler (whose config below
/// refills it at 1,000,000/s): the grant script does the work.
const QUEUED_CONFIG: &str = r#"
[plans.free]
limit = 1
window = "1h"
[providers.fast]
rate = 1
burst = 1
max_wait = "10s"
"#;

/// Grants/s with `fairness = "fifo"` and `"fair"`, waiters over 1 and 1,000
/// users, through the free-token path and through the throttler.
async fn fairness_cost(
    server: &RedisServer,
    dir: &std::path::Path,
    args: &BenchArgs,
) -> anyhow::Result<()> {
    println!("fairness cost: {} waiters, 1 throttler", args.in_flight);
    for (path, waiter_config) in [("free token", BENCH_CONFIG), ("queued", QUEUED_CONFIG)] {
        for fairness in ["fifo", "fair"] {
            let with = |c: &str| {
                c.replace(
                    "max_wait = \"10s\"",
                    &format!("max_wait = \"10s\"\nfairness = \"{fairness}\""),
                )
            };
            let throttler_config = dir.join(format!("throttler-{fairness}.toml"));
            std::fs::write(&throttler_config, with(BENCH_CONFIG))?;
            let config = Config::parse(&with(waiter_config), "bench")?;
            for users in [1, 1000] {
                let prefix = random_prefix();
                let _procs = start_throttlers(1, &server.url(), &prefix, &throttler_config)?;
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
                latency(throttle.as_ref(), 50).await?;
                let rate = throughput_of(throttle, args.in_flight, args.seconds, users).await?;
                println!(
                    "  {path:<10} {fairness:<4} {users:>5} user{} {rate:>9.0} grants/s",
                    if users == 1 { " " } else { "s" }
                );
            }
        }
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct FairnessArgs {
    /// Calls of user A, all at once.
    #[arg(long, default_value_t = 1000)]
    flood: usize,
    /// Calls of each of B, C and D, 1 s later.
    #[arg(long, default_value_t = 10)]
    each: usize,
}

const FAIRNESS_CONFIG: &str = r#"
[plans.free]
limit = 1
window = "1h"
[providers.llm]
rate = 20
burst = 5
max_wait = "600s"
"#;

/// One waiter process: `count` calls of `user` (share `share`) starting at
/// `start_at_us`.
fn waiter_process(
    url: &str,
    prefix: &str,
    config: &std::path::Path,
    user: &str,
    share: u32,
    count: usize,
    start_at_us: u64,
) -> anyhow::Result<tokio::process::Child> {
    Ok(
        tokio::process::Command::new(workspace_bin("tollgate-bench"))
            .args([
                "throttle-waiters",
                "--redis-url",
                url,
                "--key-prefix",
                prefix,
            ])
            .args(["--provider", "llm", "--count", &count.to_string()])
            .args(["--tag", user, "--user", user, "--share", &share.to_string()])
            .args(["--start-at-us", &start_at_us.to_string()])
            .arg("--config")
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?,
    )
}

async fn records_of(child: tokio::process::Child) -> anyhow::Result<Vec<GrantRecord>> {
    let out = child.wait_with_output().await?;
    anyhow::ensure!(out.status.success(), "waiters: {:?}", out.status);
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn p95_ms(records: &[GrantRecord]) -> f64 {
    let mut w: Vec<u64> = records.iter().map(|r| r.waited_ms).collect();
    w.sort_unstable();
    w.get(((w.len().max(1) - 1) as f64 * 0.95).round() as usize)
        .copied()
        .unwrap_or(0) as f64
}

/// Prints the figures of BENCHMARKS.md, "Fairness".
pub async fn fairness(args: FairnessArgs) -> anyhow::Result<()> {
    let server = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("tollgate-fairness-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for mode in ["fifo", "fair"] {
        let config = dir.join(format!("{mode}.toml"));
        std::fs::write(&config, format!("{FAIRNESS_CONFIG}fairness = \"{mode}\"\n"))?;
        let prefix = random_prefix();
        let _procs = start_throttlers(2, &server.url(), &prefix, &config)?;
        let t0 = now_us() + 2_000_000;
        let a = waiter_process(&server.url(), &prefix, &config, "A", 1, args.flood, t0)?;
        let late: Vec<_> = ["B", "C", "D"]
            .iter()
            .map(|u| {
                waiter_process(
                    &server.url(),
                    &prefix,
                    &config,
                    u,
                    1,
                    args.each,
                    t0 + 1_000_000,
                )
            })
            .collect::<anyhow::Result<_>>()?;
        let mut others = Vec::new();
        let mut last_other = 0;
        for child in late {
            let r = records_of(child).await?;
            last_other =
                last_other.max(r.iter().filter_map(|r| r.granted_at_us).max().unwrap_or(0));
            others.extend(r);
        }
        let a = records_of(a).await?;
        let mut all: Vec<u64> = a
            .iter()
            .chain(&others)
            .filter_map(|r| r.granted_at_us)
            .collect();
        all.sort_unstable();
        let excess = tollgate_tests::throttle::max_excess(&all, 20.0, 5);
        let a_by = a
            .iter()
            .filter(|r| r.granted_at_us.is_some_and(|t| t <= last_other))
            .count();
        let span = (last_other.saturating_sub(t0)) as f64 / 1e6;
        println!(
            "{mode:<4}  B-D p95 wait {:>7.0} ms  max {:>7} ms   A granted {a_by:>4} by B-D's last grant ({span:.1} s)   bound excess {excess:.2}",
            p95_ms(&others),
            others.iter().map(|r| r.waited_ms).max().unwrap_or(0),
        );
    }
    // Shares 4:1, both flooding: grants while both wait.
    let config = dir.join("weights.toml");
    std::fs::write(&config, format!("{FAIRNESS_CONFIG}fairness = \"fair\"\n"))?;
    let prefix = random_prefix();
    let _procs = start_throttlers(2, &server.url(), &prefix, &config)?;
    let t0 = now_us() + 2_000_000;
    let pro = waiter_process(&server.url(), &prefix, &config, "pro", 4, 400, t0)?;
    let free = waiter_process(&server.url(), &prefix, &config, "free", 1, 400, t0)?;
    let pro = records_of(pro).await?;
    let free = records_of(free).await?;
    // The window where both wait: until the first of them is served out.
    let end = pro
        .iter()
        .chain(&free)
        .filter_map(|r| r.granted_at_us)
        .max()
        .unwrap_or(0)
        .min(
            pro.iter()
                .filter_map(|r| r.granted_at_us)
                .max()
                .unwrap_or(0),
        );
    let count = |rs: &[GrantRecord]| {
        rs.iter()
            .filter(|r| r.granted_at_us.is_some_and(|t| t <= end))
            .count()
    };
    let (p, f) = (count(&pro), count(&free));
    println!(
        "shares 4:1 while both wait: pro {p}, free {f}, ratio {:.2}",
        p as f64 / f.max(1) as f64
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
