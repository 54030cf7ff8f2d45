//! `tollgate-bench durability`: what each `--durability` costs, in sync calls
//! per second through `tollgate all` on a Redis with AOF: `appendfsync
//! everysec` (mode none) against `always` (mode fsync) and a primary with one
//! replica (mode replica: WAIT 1 after the charge and the enqueue), with a
//! second everysec run as the A/A pair that shows the noise. Every mode runs
//! once per round on a fresh Redis and a fresh process, in an order that
//! alternates from round to round; the load average is printed before and
//! after, since the machine may be shared. With `--baseline <tollgate
//! binary>`, fsync mode also runs on that build, in the same rounds: what a
//! change to the fsync path costs, against the build before it.

use std::time::{Duration, Instant};

use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::api::{concurrent, sequential, All, Client, CONFIG};
use crate::stats::{median_f64, us};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rounds; each runs every mode once.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Concurrent clients of the throughput measurement.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Calls shared by the clients, per measurement.
    #[arg(long, default_value_t = 2000)]
    total: usize,
    /// Sequential calls of the latency measurement.
    #[arg(long, default_value_t = 300)]
    calls: usize,
    /// Another build's `tollgate` binary: fsync mode runs on it too, in the
    /// same rounds.
    #[arg(long)]
    baseline: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Everysec,
    EverysecAgain,
    Always,
    /// Fsync mode on the `--baseline` build.
    AlwaysBaseline,
    Replica,
}

const MODES: [Mode; 4] = [
    Mode::Everysec,
    Mode::Always,
    Mode::EverysecAgain,
    Mode::Replica,
];

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Self::Everysec => "everysec, --durability none (A)",
            Self::EverysecAgain => "everysec, --durability none (A')",
            Self::Always => "always, --durability fsync",
            Self::AlwaysBaseline => "always, --durability fsync (baseline build)",
            Self::Replica => "everysec + 1 replica, --durability replica",
        }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// One measurement: calls/s of `clients` concurrent sync calls, and the p50 of
/// sequential ones.
async fn one(mode: Mode, config: &std::path::Path, args: &Args) -> anyhow::Result<(f64, f64)> {
    let fsync = if matches!(mode, Mode::Always | Mode::AlwaysBaseline) {
        "always"
    } else {
        "everysec"
    };
    let primary = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", fsync]);
    let port = primary.port().to_string();
    let replica = (mode == Mode::Replica)
        .then(|| RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]));
    if replica.is_some() {
        online(&primary.url()).await?;
    }
    let durability = match mode {
        Mode::Always | Mode::AlwaysBaseline => "fsync",
        Mode::Replica => "replica",
        _ => "none",
    };
    let prefix = random_prefix();
    let bin = match (mode, &args.baseline) {
        (Mode::AlwaysBaseline, Some(baseline)) => baseline.clone(),
        _ => workspace_bin("tollgate"),
    };
    let all = All::start_with_env(
        &bin,
        config,
        64,
        Some((&primary.url(), &prefix)),
        &[("TOLLGATE_DURABILITY", durability)],
    )?;
    let c = Client::new(&all.base, args.clients)?;
    // Warm-up: connections, scripts, the worker's loops.
    concurrent(&c, &all.key, args.clients, 300, false, 200).await?;
    let (_, wall) = concurrent(&c, &all.key, args.clients, args.total, false, 200).await?;
    let per_s = args.total as f64 / wall.as_secs_f64();
    let p50 = us(sequential(&c, &all.key, args.calls, false, 200)
        .await?
        .median());
    drop(all);
    drop(replica);
    Ok((per_s, p50))
}

/// Until the primary at `url` has its replica online, at most 20 s.
async fn online(url: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await?;
        if info.contains("state=online") {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the replica never came online")
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let (dir, config) = crate::bench_config("durability", CONFIG)?;
    println!(
        "tollgate all on Redis with AOF (dir {}), POST /v1/ops/bench sync: {} clients x {} calls, then {} sequential; load average before: {}",
        std::env::temp_dir().display(),
        args.clients,
        args.total,
        args.calls,
        load_average()
    );
    let mut modes = MODES.to_vec();
    if let Some(baseline) = &args.baseline {
        anyhow::ensure!(baseline.is_file(), "no binary at {}", baseline.display());
        modes.insert(2, Mode::AlwaysBaseline);
    }
    let mut results: Vec<(Mode, Vec<f64>, Vec<f64>)> =
        modes.iter().map(|m| (*m, Vec::new(), Vec::new())).collect();
    for round in 0..args.rounds {
        // Alternate the order: forward on even rounds, backward on odd ones.
        let mut order = modes.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for mode in order {
            let (per_s, p50) = one(mode, &config, &args).await?;
            println!(
                "round {round}: {:<44} {per_s:>7.0} calls/s, sequential p50 {p50:>6.0} µs (load {})",
                mode.label(),
                load_average()
            );
            if let Some(r) = results.iter_mut().find(|r| r.0 == mode) {
                r.1.push(per_s);
                r.2.push(p50);
            }
        }
    }
    println!();
    println!(
        "| Redis, mode | calls/s (median of {}) | each round | sequential p50 |",
        args.rounds
    );
    println!("|---|---:|---|---:|");
    for (mode, mut per_s, mut p50) in results {
        let each = per_s
            .iter()
            .map(|v| format!("{v:.0}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {} | {:.0} | {each} | {:.0} µs |",
            mode.label(),
            median_f64(&mut per_s),
            median_f64(&mut p50)
        );
    }
    println!("load average after: {}", load_average());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
