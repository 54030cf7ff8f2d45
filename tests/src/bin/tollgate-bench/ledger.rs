//! The ledger benchmark: reserve latency with 10 / 1,000 / 100,000 live events in
//! one user's window, and reserve throughput on both backends, with the Redis
//! figure measured side by side against `redis-benchmark` running EVALSHA of the
//! very same script on the same server (the ceiling a client can reach).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    ledger::Ledger,
};
use tollgate_memory::ledger::MemoryLedger;
use tollgate_redis::{keys::KeySpace, ledger::RedisLedger, pool::PoolOptions, scripts};
use tollgate_tests::slowlog;

use crate::stats::{median_f64, us, Samples};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Use this Redis instead of starting a private redis-server.
    #[arg(long)]
    redis_url: Option<String>,
    /// The plan every bench user is on: `bench` (one 12 h limit) or `monthly`
    /// (31 d and 1 min limits: two running totals).
    #[arg(long, default_value = "bench")]
    plan: String,
    /// Concurrent clients for the throughput runs (ours and redis-benchmark's -c).
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// Reserves per throughput run.
    #[arg(long, default_value_t = 100_000)]
    ops: usize,
    /// Throughput rounds; ours and the ceiling alternate, medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Timed reserves per latency point (Redis; memory runs 10x as many).
    #[arg(long, default_value_t = 3_000)]
    samples: usize,
    /// Connections in our pool (each is multiplexed).
    #[arg(long, default_value_t = 8)]
    pool_size: usize,
}

/// One plan big enough that nothing is ever denied, and a window that keeps every
/// event live for the whole run.
const CONFIG: &str = r#"
default_plan = "bench"
[plans.bench]
limit = 1000000000000000
window = "12h"
[plans.monthly]
limits = [{ limit = 1000000000000000, window = "31d" }, { limit = 1000000000000000, window = "1m" }]
"#;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let (server, url) = crate::redis_or_start(args.redis_url.as_deref());
    let text = CONFIG.replacen("\"bench\"", &format!("{:?}", args.plan), 1);
    let config = Arc::new(Config::parse(&text, "bench")?);
    println!(
        "plan: {}",
        config.default_plan().describe(config.currency())
    );
    let prefix = tollgate_tests::random_prefix();
    let pool = tollgate_redis::pool::connect(
        &url,
        &PoolOptions {
            max_size: args.pool_size,
            ..Default::default()
        },
    )
    .await?;
    let redis = Arc::new(RedisLedger::new(
        pool,
        KeySpace::new(&prefix)?,
        Arc::clone(&config),
    ));
    let memory = Arc::new(MemoryLedger::new(Arc::clone(&config)));
    // Every script call of the run is judged at the end: none may hold Redis
    // past slowlog::LIMIT_US, however large the user's log.
    let mut slow_conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    slowlog::start(&mut slow_conn, slowlog::LIMIT_US, 1024).await?;

    println!("## reserve latency by live events in the user's window (one caller, sequential)");
    println!("(3 passes over the sizes, interleaved; the median of the per-pass medians)");
    println!(
        "{:<8} {:>10} {:>12} {:>12}",
        "backend", "events", "median", "p99"
    );
    const SIZES: [usize; 3] = [10, 1_000, 100_000];
    for (name, ledger, samples) in [
        (
            "memory",
            memory.clone() as Arc<dyn Ledger>,
            args.samples * 10,
        ),
        ("redis", redis.clone() as Arc<dyn Ledger>, args.samples),
    ] {
        let warm = UserId::new(format!("warm-{name}"))?;
        latency(&ledger, &warm, samples).await?;
        let users: Vec<UserId> = SIZES
            .iter()
            .map(|n| UserId::new(format!("lat-{name}-{n}")))
            .collect::<Result<_, _>>()?;
        for (user, n) in users.iter().zip(SIZES) {
            prefill(&ledger, user, n).await?;
        }
        let mut medians = [Vec::new(), Vec::new(), Vec::new()];
        let mut p99s = [Vec::new(), Vec::new(), Vec::new()];
        for _pass in 0..3 {
            for (i, user) in users.iter().enumerate() {
                let s = latency(&ledger, user, samples).await?;
                medians[i].push(us(s.median()));
                p99s[i].push(us(s.pct(99.0)));
            }
        }
        let medians = medians.map(|mut m| median_f64(&mut m));
        for (i, n) in SIZES.iter().enumerate() {
            println!(
                "{name:<8} {n:>10} {:>10.2}us {:>10.2}us",
                medians[i],
                median_f64(&mut p99s[i])
            );
        }
        println!(
            "{name:<8} ratio median(100,000) / median(10) = {:.2} (target <= 1.5)",
            medians[2] / medians[0]
        );
    }

    println!("\n## reserve throughput");
    for (label, users) in [
        ("memory, 1 hot user", 1usize),
        ("memory, 10,000 users", 10_000),
    ] {
        let rps = throughput(memory.clone(), args.clients, args.ops * 5, users, "mt").await?;
        println!(
            "{label:<34} {rps:>12.0} reserves/s ({} tasks)",
            args.clients
        );
    }

    // The ceiling: redis-benchmark calling the same function, same key shape.
    let function = scripts::BUDGET.function("reserve");
    scripts::BUDGET
        .load_async(&mut tollgate_tests::bulk_connection(&url).await?)
        .await?;
    let plan_args = scripts::PlanArgs::new(&config).args().to_vec();
    let mut ours = Vec::new();
    let mut ceiling = Vec::new();
    for round in 0..args.rounds {
        let user = UserId::new(format!("ceiling-{round}"))?;
        let keys = KeySpace::new(&prefix)?.budget(&user);
        let rps = redis_benchmark(
            &url,
            &function,
            &keys.ordered(),
            &plan_args,
            args.clients,
            args.ops,
        )?;
        // Prove the ceiling did the same work: one live event per call (random ids
        // collide rarely), not fast error replies.
        let recorded = tollgate_tests::all_events(redis.as_ref(), &user)
            .await?
            .len();
        if (recorded as f64) < 0.99 * args.ops as f64 {
            bail!(
                "redis-benchmark recorded only {recorded} events for {} calls: did FCALL fail?",
                args.ops
            );
        }
        ceiling.push(rps);
        let rps = throughput(
            redis.clone(),
            args.clients,
            args.ops,
            1,
            &format!("ours-{round}"),
        )
        .await?;
        ours.push(rps);
        println!("round {round}: redis-benchmark EVALSHA {:>9.0}/s   tollgate RedisLedger::reserve {:>9.0}/s", ceiling[round], ours[round]);
    }
    let (o, c) = (median_f64(&mut ours), median_f64(&mut ceiling));
    println!(
        "redis median: tollgate {o:.0}/s vs redis-benchmark {c:.0}/s = {:.0}% of the ceiling (target >= 60%), {} clients, pool of {} multiplexed connections",
        100.0 * o / c,
        args.clients,
        args.pool_size
    );
    let (slow, text) = slowlog::over_limit(&mut slow_conn).await?;
    if !slow.is_empty() {
        bail!(
            "{} commands held Redis past {} ms (SLOWLOG): {text}",
            slow.len(),
            slowlog::LIMIT_US / 1000
        );
    }
    println!(
        "SLOWLOG: no command held Redis past {} ms",
        slowlog::LIMIT_US / 1000
    );
    drop(server);
    Ok(())
}

/// Puts `n` live events in `user`'s window (concurrently, to be quick).
async fn prefill(ledger: &Arc<dyn Ledger>, user: &UserId, n: usize) -> anyhow::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let (ledger, user, next) = (Arc::clone(ledger), user.clone(), Arc::clone(&next));
        tasks.spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < n {
                ledger.reserve(&user, &RequestId::generate(), 1).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    crate::ensure_live(ledger.as_ref(), user, n, &format!("prefill of {user}")).await
}

async fn latency(
    ledger: &Arc<dyn Ledger>,
    user: &UserId,
    samples: usize,
) -> anyhow::Result<Samples> {
    let ids: Vec<_> = (0..samples + samples / 10)
        .map(|_| RequestId::generate())
        .collect();
    let mut out = Vec::with_capacity(samples);
    for (i, id) in ids.iter().enumerate() {
        let t = Instant::now();
        let outcome = ledger.reserve(user, id, 1).await?;
        let d = t.elapsed();
        if !outcome.is_allowed() {
            bail!("bench reserve denied");
        }
        if i >= samples / 10 {
            out.push(d); // the first 10% warm up
        }
    }
    Ok(Samples::new(out))
}

/// `clients` tasks share `ops` reserves over `users` users; returns reserves/s.
async fn throughput<L: Ledger + 'static>(
    ledger: Arc<L>,
    clients: usize,
    ops: usize,
    users: usize,
    tag: &str,
) -> anyhow::Result<f64> {
    let users: Arc<Vec<UserId>> = Arc::new(
        (0..users)
            .map(|u| UserId::new(format!("tp-{tag}-{u}")))
            .collect::<Result<_, _>>()?,
    );
    let ids: Arc<Vec<RequestId>> = Arc::new((0..ops).map(|_| RequestId::generate()).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (ledger, users, ids, next) = (
            Arc::clone(&ledger),
            Arc::clone(&users),
            Arc::clone(&ids),
            Arc::clone(&next),
        );
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= ids.len() {
                    return anyhow::Ok(());
                }
                ledger.reserve(&users[i % users.len()], &ids[i], 1).await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(ops as f64 / started.elapsed().as_secs_f64())
}

/// Runs `redis-benchmark` with EVALSHA of the reserve script; returns requests/s.
fn redis_benchmark(
    url: &str,
    function: &str,
    keys: &[&str],
    plan: &[String],
    clients: usize,
    ops: usize,
) -> anyhow::Result<f64> {
    let port = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .context("port in the Redis URL")?
        .to_owned();
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-c",
            &clients.to_string(),
            "-n",
            &ops.to_string(),
        ])
        .args(["-r", "100000000", "--csv", "FCALL", function])
        .arg(keys.len().to_string())
        .args(keys)
        .args(["__rand_int__", "1"])
        .args(plan)
        .output()
        .context("run redis-benchmark (Debian package redis-tools)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().nth(1).with_context(|| {
        format!(
            "redis-benchmark printed no result: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    // Counted from the end: the first column (the command line) may hold commas.
    let rps = line
        .rsplit(',')
        .nth(6)
        .map(|f| f.trim_matches('"'))
        .context("rps column")?;
    let rps: f64 = rps.parse().with_context(|| format!("parse {rps:?}"))?;
    // Make sure the calls really ran the script (a wrong SHA would be fast and empty).
    if text.contains("NOSCRIPT") || rps <= 0.0 {
        bail!("redis-benchmark did not run the script: {text}");
    }
    Ok(rps)
}
