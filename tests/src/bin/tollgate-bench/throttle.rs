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
    metrics::Metrics,
    throttle::{
        Grant, Pause, Position, ProviderStats, Share, Throttle, ThrottleError, Usage, Waiter,
    },
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

/// Acquires as a worker's call is sent (`ThrottledClient`): a grant found past
/// its use-by is re-dated when its bucket allows, else ended unused (its token
/// lost, counted as late) and the wait starts over; the grant it returns is
/// fresh when its waiter resumes (its record's `resumed_at_us`: the send).
#[derive(Debug)]
struct AsSent {
    inner: Arc<dyn Throttle>,
    metrics: Arc<Metrics>,
}

fn fresh(grant: &Grant) -> bool {
    grant
        .use_by
        .is_none_or(|by| tokio::time::Instant::now() < by)
}

#[async_trait::async_trait]
impl Throttle for AsSent {
    async fn acquire_as(
        &self,
        provider: &str,
        waiter: &Waiter,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError> {
        let deadline = tokio::time::Instant::now() + max_wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let mut grant = self.inner.acquire_as(provider, waiter, left).await?;
            let made = grant.granted_at_us;
            let mut redated = 0;
            for _ in 0..3 {
                if fresh(&grant) {
                    return Ok(grant);
                }
                match self.inner.redate(&grant).await? {
                    Some(r) => {
                        grant = r;
                        redated += 1;
                    }
                    None => break,
                }
            }
            if fresh(&grant) {
                return Ok(grant);
            }
            // On stderr, for a look at a run: when the lost grant was
            // made, and how often it was re-dated first.
            eprintln!("stale_at_send {made} {redated}");
            self.inner.done(&grant).await?;
            self.metrics.late_grant(provider);
        }
    }

    async fn redate(&self, grant: &Grant) -> Result<Option<Grant>, ThrottleError> {
        self.inner.redate(grant).await
    }

    async fn done(&self, grant: &Grant) -> Result<(), ThrottleError> {
        self.inner.done(grant).await
    }

    async fn position(
        &self,
        provider: &str,
        user: &str,
        request_id: &RequestId,
    ) -> Result<Option<Position>, ThrottleError> {
        self.inner.position(provider, user, request_id).await
    }

    async fn stats(&self) -> Result<Vec<ProviderStats>, ThrottleError> {
        self.inner.stats().await
    }

    async fn pause(
        &self,
        provider: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        self.inner.pause(provider, retry_after).await
    }

    async fn pause_member(
        &self,
        provider: &str,
        member: &str,
        retry_after: Option<Duration>,
    ) -> Result<Pause, ThrottleError> {
        self.inner.pause_member(provider, member, retry_after).await
    }

    async fn usage(&self, grant: &Grant, used: u64) -> Result<Usage, ThrottleError> {
        self.inner.usage(grant, used).await
    }
}

/// Prints a JSON array of [`tollgate_tests::throttle::GrantRecord`] on stdout,
/// and on stderr a line `late_grants <n>`: the grants its waiters found too
/// old to use, on delivery or as their call would be sent (their tokens are
/// lost; each waiter queued again). Each waiter resumes as its call would be
/// sent, on a fresh grant (`AsSent`).
pub async fn waiters(args: WaiterArgs) -> anyhow::Result<()> {
    let config = Config::load(Some(&args.config))?;
    let provider = config
        .provider(&args.provider)
        .with_context(|| format!("no provider {:?} in the config", args.provider))?;
    let max_wait = args.max_wait.unwrap_or(provider.max_wait);
    let pool = tollgate_redis::pool::connect(&args.redis_url, &PoolOptions::default()).await?;
    let metrics = Arc::new(Metrics::new(&config));
    let throttle = RedisThrottle::start(
        pool,
        KeySpace::new(&args.key_prefix)?,
        &config,
        RedisThrottleOptions {
            metrics: Some(Arc::clone(&metrics)),
            ..RedisThrottleOptions::default()
        },
    );
    anyhow::ensure!(
        throttle.subscribed(Duration::from_secs(5)).await,
        "no subscription within 5s"
    );
    let throttle = AsSent {
        inner: Arc::new(throttle),
        metrics: Arc::clone(&metrics),
    };
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
    let late = tollgate_tests::throttle::late_grants(&metrics.render(), None);
    eprintln!("late_grants {late}");
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
    /// Rounds of the fairness cost (each configuration once per round).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Only the fairness cost.
    #[arg(long)]
    fairness_only: bool,
    /// With the fairness cost: what Redis did per grant in each configuration
    /// (`INFO commandstats` around each run, summed over the rounds).
    #[arg(long)]
    commandstats: bool,
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

    if args.fairness_only {
        fairness_cost(&server, &dir, &args).await?;
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(());
    }
    let memory = Arc::new(tollgate_memory::throttle::MemoryThrottle::new(&config));
    let (p50, p99) = latency(memory.as_ref(), args.latency_samples).await?;
    let rate = throughput(memory, args.in_flight, args.seconds).await?;
    println!(
        "in-process     grant latency p50 {p50:>9.1?}  p99 {p99:>9.1?}   max {rate:>9.0} grants/s"
    );

    for throttlers in [1, 3] {
        let prefix = random_prefix();
        let _procs = start_throttlers(throttlers, &server.url(), &prefix, &config_path)?;
        let throttle = warm_redis_throttle(&server.url(), &prefix, &config).await?;
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

/// A Redis throttle (a pool of 32) on `url` under `prefix`, subscribed and
/// warmed up: its scripts loaded, the throttlers blocked on the queue.
async fn warm_redis_throttle(
    url: &str,
    prefix: &str,
    config: &Config,
) -> anyhow::Result<Arc<RedisThrottle>> {
    let options = PoolOptions {
        max_size: 32,
        ..PoolOptions::default()
    };
    let pool = tollgate_redis::pool::connect(url, &options).await?;
    let throttle = Arc::new(RedisThrottle::start(
        pool,
        KeySpace::new(prefix)?,
        config,
        RedisThrottleOptions::default(),
    ));
    anyhow::ensure!(
        throttle.subscribed(Duration::from_secs(5)).await,
        "no subscription"
    );
    latency(throttle.as_ref(), 50).await?;
    Ok(throttle)
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
/// users, through the free-token path and through the throttler: every
/// configuration once per round, `rounds` rounds interleaved (a shared,
/// noisy machine drifts between runs), then the median of each, the
/// fair/FIFO ratio of the medians, and the median of each round's ratio; and
/// the Redis main thread's CPU per grant of each (the cost itself, which the
/// other processes on a shared machine move far less than grants/s).
async fn fairness_cost(
    server: &RedisServer,
    dir: &std::path::Path,
    args: &BenchArgs,
) -> anyhow::Result<()> {
    println!(
        "fairness cost: {} waiters, 1 throttler, {} rounds of {} s each",
        args.in_flight, args.rounds, args.seconds
    );
    let mut runs: std::collections::BTreeMap<(usize, usize, usize), Vec<f64>> =
        std::collections::BTreeMap::new();
    // Redis's main thread CPU per grant: what the provider's one Redis spends
    // on each, however loaded the machine (grants/s move with the other
    // processes on it; this does not).
    let mut cpu_runs: std::collections::BTreeMap<(usize, usize, usize), Vec<f64>> =
        std::collections::BTreeMap::new();
    // Per configuration: command -> (calls, µs, grants), summed over the rounds.
    type Calls = std::collections::BTreeMap<String, (f64, f64, f64)>;
    let mut cmd_runs: std::collections::BTreeMap<(usize, usize, usize), Calls> =
        std::collections::BTreeMap::new();
    let mut info = redis::Client::open(server.url())?
        .get_multiplexed_async_connection()
        .await?;
    let paths = [("free token", BENCH_CONFIG), ("queued", QUEUED_CONFIG)];
    let modes = ["fifo", "fair"];
    for _ in 0..args.rounds {
        for (p, (_, waiter_config)) in paths.iter().enumerate() {
            for (m, fairness) in modes.iter().enumerate() {
                let with = |c: &str| {
                    c.replace(
                        "max_wait = \"10s\"",
                        &format!("max_wait = \"10s\"\nfairness = \"{fairness}\""),
                    )
                };
                let throttler_config = dir.join(format!("throttler-{fairness}.toml"));
                std::fs::write(&throttler_config, with(BENCH_CONFIG))?;
                let config = Config::parse(&with(waiter_config), "bench")?;
                for (u, users) in [1, 1000].into_iter().enumerate() {
                    let prefix = random_prefix();
                    let _procs = start_throttlers(1, &server.url(), &prefix, &throttler_config)?;
                    let throttle = warm_redis_throttle(&server.url(), &prefix, &config).await?;
                    let stats_before = if args.commandstats {
                        commandstats(&mut info).await?
                    } else {
                        Default::default()
                    };
                    let (cpu_before, started) = (redis_cpu(&mut info).await?, Instant::now());
                    let rate = throughput_of(throttle, args.in_flight, args.seconds, users).await?;
                    let grants = rate * started.elapsed().as_secs_f64();
                    let cpu = redis_cpu(&mut info).await? - cpu_before;
                    if args.commandstats {
                        let into = cmd_runs.entry((p, u, m)).or_default();
                        for (name, (calls, usec)) in commandstats(&mut info).await? {
                            let (c0, u0) = stats_before.get(&name).copied().unwrap_or((0, 0));
                            let e = into.entry(name).or_insert((0.0, 0.0, 0.0));
                            e.0 += (calls - c0) as f64;
                            e.1 += (usec - u0) as f64;
                        }
                        for e in into.values_mut() {
                            e.2 += grants;
                        }
                    }
                    runs.entry((p, u, m)).or_default().push(rate);
                    cpu_runs
                        .entry((p, u, m))
                        .or_default()
                        .push(cpu * 1e6 / grants.max(1.0));
                }
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (p, (path, _)) in paths.iter().enumerate() {
        for (u, users) in [1, 1000].into_iter().enumerate() {
            let fifo = &runs[&(p, u, 0)];
            let fair = &runs[&(p, u, 1)];
            let (a, b) = (median(fifo), median(fair));
            // Each round ran FIFO then fair back to back: their ratio per
            // round is less moved by the load of a shared machine drifting.
            let paired: Vec<f64> = fifo.iter().zip(fair).map(|(x, y)| y / x).collect();
            let show = |v: &[f64]| {
                v.iter()
                    .map(|x| format!("{x:.0}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            println!(
                "  {path:<10} {users:>5} user{}  fifo median {a:>7.0}  fair median {b:>7.0} grants/s  fair/fifo {:.2}  median of the rounds' fair/fifo {:.2}   (fifo: {}; fair: {})",
                if users == 1 { " " } else { "s" },
                b / a,
                median(&paired),
                show(fifo),
                show(fair),
            );
            let (cf, cr) = (median(&cpu_runs[&(p, u, 0)]), median(&cpu_runs[&(p, u, 1)]));
            println!(
                "  {:<10} {:>5}        Redis CPU per grant: fifo median {cf:>5.1} µs  fair median {cr:>5.1} µs  fifo/fair {:.2}",
                "",
                "",
                cf / cr,
            );
            if args.commandstats {
                for (m, fairness) in modes.iter().enumerate() {
                    let Some(cmds) = cmd_runs.get(&(p, u, m)) else {
                        continue;
                    };
                    let line = cmds
                        .iter()
                        .filter(|(name, (calls, _, grants))| {
                            name.as_str() != "info" && *calls >= 0.005 * grants.max(1.0)
                        })
                        .map(|(name, (calls, usec, grants))| {
                            let g = grants.max(1.0);
                            format!("{name} {:.2}x {:.2}µs", calls / g, usec / g)
                        })
                        .collect::<Vec<_>>()
                        .join(", ");
                    println!(
                        "  {:<10} {:>5}        per grant, {fairness}: {line}",
                        "", ""
                    );
                }
            }
        }
    }
    Ok(())
}

/// `INFO commandstats`: command -> (calls, µs).
async fn commandstats(
    conn: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<std::collections::BTreeMap<String, (u64, u64)>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut out = std::collections::BTreeMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |f: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('=')?.parse::<u64>().ok())
        };
        if let (Some(calls), Some(usec)) = (field("calls"), field("usec")) {
            out.insert(name.to_owned(), (calls, usec));
        }
    }
    Ok(out)
}

/// CPU seconds of the Redis server's main thread so far (`INFO cpu`).
async fn redis_cpu(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| {
        info.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(':')?
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    match (
        field("used_cpu_user_main_thread"),
        field("used_cpu_sys_main_thread"),
    ) {
        (Some(user), Some(sys)) => Ok(user + sys),
        _ => anyhow::bail!("INFO cpu has no main thread figures: {info}"),
    }
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

/// Shares 4:1 at a saturated provider (rate 20, 2 throttler processes, one
/// waiter process per user, `calls` each at once): the grants of each user
/// counted only while both have calls waiting, as sampled every 5 ms from
/// the provider's stats (`users` = 2: both in the rotation).
pub async fn shares(server: &RedisServer, calls: usize) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("tollgate-shares-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let text = format!("{FAIRNESS_CONFIG}fairness = \"fair\"\n");
    let config = dir.join("weights.toml");
    std::fs::write(&config, &text)?;
    let prefix = random_prefix();
    let _procs = start_throttlers(2, &server.url(), &prefix, &config)?;
    let watcher = RedisThrottle::start(
        tollgate_redis::pool::connect(&server.url(), &PoolOptions::default()).await?,
        KeySpace::new(&prefix)?,
        &Config::parse(&text, "shares")?,
        RedisThrottleOptions::default(),
    );
    let t0 = now_us() + 2_000_000;
    let pro = waiter_process(&server.url(), &prefix, &config, "pro", 4, calls, t0)?;
    let free = waiter_process(&server.url(), &prefix, &config, "free", 1, calls, t0)?;
    let pro = tokio::spawn(records_of(pro));
    let free = tokio::spawn(records_of(free));
    // (sampled from, to µs, both waiting) until both processes are done.
    let mut samples = Vec::new();
    while !(pro.is_finished() && free.is_finished()) {
        let before = now_us();
        let stats = watcher.stats().await?;
        let both = stats.iter().any(|p| p.provider == "llm" && p.users == 2);
        samples.push((before, now_us(), both));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (pro, free) = (pro.await??, free.await??);
    // Grants between two consecutive samples that both saw both users waiting.
    let windows: Vec<(u64, u64)> = samples
        .windows(2)
        .filter(|w| w[0].2 && w[1].2)
        .map(|w| (w[0].1, w[1].0))
        .collect();
    let inside = |t: u64| windows.iter().any(|(a, b)| (*a..=*b).contains(&t));
    let count = |rs: &[GrantRecord]| {
        rs.iter()
            .filter(|r| r.granted_at_us.is_some_and(inside))
            .count()
    };
    let (p, f) = (count(&pro), count(&free));
    let span: u64 = windows.iter().map(|(a, b)| b.saturating_sub(*a)).sum();
    println!(
        "shares 4:1 at the throttle, {calls} calls each: while both waited ({:.1} s): pro {p}, free {f}, ratio {:.2}",
        span as f64 / 1e6,
        p as f64 / f.max(1) as f64
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
