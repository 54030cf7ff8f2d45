//! What a sync call costs Redis and leaves in it: `tollgate all` on Redis (the
//! api, worker and throttler roles), N sync calls of POST /v1/ops/bench through
//! HTTP, then per call:
//! - the Redis commands run, by name, the scripts' own commands included, and
//!   Redis's time in them (`INFO commandstats` deltas), and Redis's CPU
//!   (`INFO cpu`, user + system: parsing, replies and networking too);
//! - Redis's `used_memory` delta (over every key, after a warm-up so one-time
//!   keys are not counted) and `MEMORY USAGE <key> SAMPLES 0` summed by kind of
//!   key.
//!
//! The deltas include the roles' background loops (liveness, blocking takes
//! that time out, activity flushes), as a deployment pays them. Side by side
//! with `--baseline <tollgate binary>` (measured first, each on a fresh Redis).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use serde_json::json;
use tollgate_tests::{random_prefix, redis_info, workspace_bin, RedisServer};

use crate::api::{All, CONFIG as API_CONFIG};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sync calls through the api.
    #[arg(long, default_value_t = 3_000)]
    calls: usize,
    /// Concurrent callers.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Length of the text field of each call's body (bytes).
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    /// Send each call with its own Idempotency-Key: a replay within the
    /// operation's `result_ttl` gets the same answer, so the job is kept.
    #[arg(long)]
    keyed: bool,
    /// Another `tollgate` binary measured the same way, before this build's.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Also count the instructions Redis executes per call (the server runs
    /// under valgrind's callgrind, collecting only during the measured calls):
    /// a figure that does not move with the machine's load, unlike µs.
    #[arg(long)]
    instructions: bool,
    /// Seconds of an idle stretch measured before the calls: the roles'
    /// background (liveness, blocking takes that time out, maintenance) per
    /// second, subtracted from the calls' figures for the per-call ones.
    #[arg(long, default_value_t = 3)]
    idle_seconds: u64,
}

/// Commands (by name: calls, µs), Redis CPU seconds and instructions counted
/// over one stretch.
struct Stretch {
    stats: BTreeMap<String, (u64, u64)>,
    cpu: f64,
    instructions: Option<u64>,
    wall: Duration,
}

/// Runs `work` and returns what Redis did meanwhile.
async fn stretch<F: std::future::Future<Output = anyhow::Result<()>>>(
    conn: &mut MultiplexedConnection,
    pid: Option<(u32, &std::path::Path)>,
    work: F,
) -> anyhow::Result<Stretch> {
    let (before, cpu_before) = command_stats(conn).await?;
    let instr_before = match pid {
        Some((pid, out)) => {
            let t = callgrind_total(pid, out)?;
            callgrind_collect(pid, true)?;
            t
        }
        None => 0,
    };
    let started = std::time::Instant::now();
    work.await?;
    let wall = started.elapsed();
    let instructions = match pid {
        Some((pid, out)) => {
            callgrind_collect(pid, false)?;
            Some(callgrind_total(pid, out)? - instr_before)
        }
        None => None,
    };
    let (after, cpu_after) = command_stats(conn).await?;
    let stats = after
        .iter()
        .map(|(name, &(calls, usec))| {
            let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
            (name.clone(), (calls - c0, usec - u0))
        })
        .filter(|(_, (calls, _))| *calls > 0)
        .collect();
    Ok(Stretch {
        stats,
        cpu: cpu_after - cpu_before,
        instructions,
        wall,
    })
}

/// Instructions callgrind counted in the process `pid` so far (collection
/// switched on and off around the measured calls): dumps and reads the total.
fn callgrind_total(pid: u32, out: &std::path::Path) -> anyhow::Result<u64> {
    let status = std::process::Command::new("callgrind_control")
        .arg("--dump")
        .arg(pid.to_string())
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "callgrind_control --dump {pid} failed");
    let mut total = 0;
    let dir = out.parent().unwrap_or(std::path::Path::new("."));
    let stem = out.file_name().and_then(|n| n.to_str()).unwrap_or("");
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.starts_with(stem) {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        if let Some(v) = text
            .lines()
            .find_map(|l| l.strip_prefix("totals:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
        {
            total += v;
        }
    }
    Ok(total)
}

fn callgrind_collect(pid: u32, on: bool) -> anyhow::Result<()> {
    let status = std::process::Command::new("callgrind_control")
        .arg(if on { "--instr=on" } else { "--instr=off" })
        .arg(pid.to_string())
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "callgrind_control --instr {pid} failed");
    Ok(())
}

/// `INFO commandstats` (`INFO` itself left out: it is this bench's probe):
/// command -> (calls, µs), and Redis's CPU seconds so far (user + system).
async fn command_stats(
    conn: &mut MultiplexedConnection,
) -> anyhow::Result<(BTreeMap<String, (u64, u64)>, f64)> {
    let info: String = redis::cmd("INFO")
        .arg("everything")
        .query_async(conn)
        .await?;
    let mut out = BTreeMap::new();
    let mut cpu = 0.0;
    for line in info.lines() {
        if let Some(rest) = line.strip_prefix("cmdstat_") {
            let (name, stats) = rest.split_once(':').unwrap_or((rest, ""));
            let field = |k: &str| -> u64 {
                stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(k))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            if name != "info" {
                out.insert(name.to_owned(), (field("calls="), field("usec=")));
            }
        } else if let Some(v) = line
            .strip_prefix("used_cpu_user:")
            .or_else(|| line.strip_prefix("used_cpu_sys:"))
        {
            cpu += v.trim().parse::<f64>().unwrap_or(0.0);
        }
    }
    Ok((out, cpu))
}

async fn used_memory(conn: &mut MultiplexedConnection) -> anyhow::Result<i64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no used_memory in INFO"))
}

/// The kind of a key: its name after the prefix with hash-tag contents, ids
/// and numbers taken out (`{q:bench}:job:<id>` -> `{q}:job`).
fn kind(prefix: &str, key: &str) -> String {
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    let rest = rest.strip_prefix(":v1:").unwrap_or(rest);
    let mut out = Vec::new();
    for (i, part) in rest.split(':').enumerate() {
        if part.starts_with('{') {
            out.push(format!(
                "{{{}}}",
                part.trim_start_matches('{').chars().next().unwrap_or('?')
            ));
        } else if part.ends_with('}') {
            continue;
        } else if i > 0 && (part.len() > 12 || part.chars().any(|c| c.is_ascii_digit())) {
            out.push("<id>".to_owned());
            break;
        } else {
            out.push(part.to_owned());
        }
    }
    out.join(":")
}

async fn by_kind(
    conn: &mut MultiplexedConnection,
    prefix: &str,
) -> anyhow::Result<BTreeMap<String, (usize, u64)>> {
    let keys = redis_info::scan_keys(conn, "*").await?;
    let mut out: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for k in &keys {
        let b: Option<u64> = redis_info::memory_usage(conn, k).await?;
        let e = out.entry(kind(prefix, k)).or_default();
        e.0 += 1;
        e.1 += b.unwrap_or(0);
    }
    Ok(out)
}

async fn calls(
    all: &All,
    from: usize,
    n: usize,
    clients: usize,
    body_bytes: usize,
    keyed: bool,
) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let url = format!("{}/v1/ops/bench", all.base);
    let next = Arc::new(AtomicUsize::new(from));
    let text = "x".repeat(body_bytes);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (http, url, key, next, text) = (
            http.clone(),
            url.clone(),
            all.key.clone(),
            Arc::clone(&next),
            text.clone(),
        );
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= from + n {
                    return anyhow::Ok(());
                }
                let mut req = http
                    .post(&url)
                    .bearer_auth(&key)
                    .json(&json!({ "i": i, "text": text }));
                if keyed {
                    req = req.header("Idempotency-Key", format!("bench-{i}"));
                }
                crate::ensure_success(req.send().await?, &format!("call {i}")).await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let (dir, config) = crate::bench_config("call-bytes", API_CONFIG)?;
    let mut builds = Vec::new();
    if let Some(b) = &args.baseline {
        builds.push(b.clone());
    }
    builds.push(workspace_bin("tollgate"));
    println!(
        "## What a sync call leaves in Redis: {} sync calls of POST /v1/ops/bench ({} B of text in each body{}), {} clients, tollgate all on Redis",
        args.calls,
        args.body_bytes,
        if args.keyed { ", each with its own Idempotency-Key" } else { "" },
        args.clients
    );
    for bin in &builds {
        let callgrind_out = dir.join(format!("callgrind.{}.out", random_prefix()));
        let server = if args.instructions {
            RedisServer::start_under(
                &[
                    "valgrind".to_owned(),
                    "--tool=callgrind".to_owned(),
                    "--instr-atstart=no".to_owned(),
                    format!("--callgrind-out-file={}", callgrind_out.display()),
                ],
                &[],
            )
        } else {
            RedisServer::start()
        };
        let prefix = random_prefix();
        let all = All::start(bin, &config, 64, Some((&server.url(), &prefix)))?;
        let mut conn = redis::Client::open(server.url().as_str())?
            .get_multiplexed_async_connection()
            .await?;
        // Warm-up: the one-time keys (queues, liveness, activity lists) exist.
        calls(&all, 0, 50, 4, args.body_bytes, args.keyed).await?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let before_kinds = by_kind(&mut conn, &prefix).await?;
        let before = used_memory(&mut conn).await?;
        let pid = args
            .instructions
            .then(|| (server.pid(), callgrind_out.as_path()));
        let idle = stretch(&mut conn, pid, async {
            tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
            Ok(())
        })
        .await?;
        let load = stretch(
            &mut conn,
            pid,
            calls(
                &all,
                50,
                args.calls,
                args.clients,
                args.body_bytes,
                args.keyed,
            ),
        )
        .await?;
        // The pods' buffered activity notes are flushed.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let after = used_memory(&mut conn).await?;
        let kinds = by_kind(&mut conn, &prefix).await?;
        println!();
        println!("build `{}`", bin.display());
        println!(
            "- used_memory delta: {} B over {} calls = **{:.0} B per call**",
            after - before,
            args.calls,
            (after - before) as f64 / args.calls as f64
        );
        let n = args.calls as f64;
        // The idle stretch's rate over the calls' wall time: what the roles'
        // background would have cost anyway.
        let scale = load.wall.as_secs_f64() / idle.wall.as_secs_f64();
        let background = |name: &str| idle.stats.get(name).map_or(0.0, |s| s.0 as f64 * scale);
        let mut rows: Vec<(String, u64, u64, f64)> = load
            .stats
            .iter()
            .map(|(name, &(calls, usec))| {
                let net = (calls as f64 - background(name)).max(0.0);
                (name.clone(), calls, usec, net)
            })
            .collect();
        rows.sort_by(|a, b| b.3.total_cmp(&a.3));
        let total: u64 = rows.iter().map(|r| r.1).sum();
        let net_total: f64 = rows.iter().map(|r| r.3).sum();
        let is_script = |name: &str| matches!(name, "evalsha" | "eval" | "fcall" | "fcall_ro");
        let net_scripts: f64 = rows.iter().filter(|r| is_script(&r.0)).map(|r| r.3).sum();
        println!(
            "- {:.0} calls/s; per call, all roles, the roles' idle background ({:.0} commands/s) subtracted: **{:.1} Redis commands** ({:.2} scripts; the scripts' own commands included; {:.1} with the background), **{:.0} µs of Redis CPU** (INFO cpu, user + system, background included)",
            n / load.wall.as_secs_f64(),
            idle.stats.values().map(|s| s.0).sum::<u64>() as f64 / idle.wall.as_secs_f64(),
            net_total / n,
            net_scripts / n,
            total as f64 / n,
            load.cpu * 1e6 / n,
        );
        if let (Some(i), Some(b)) = (load.instructions, idle.instructions) {
            println!(
                "- **{:.0} instructions Redis executed per call** (callgrind; {:.0} with the background, which ran {:.0} per second idle)",
                (i as f64 - b as f64 * scale) / n,
                i as f64 / n,
                b as f64 / idle.wall.as_secs_f64()
            );
        }
        println!(
            "| command | per call, background subtracted | with it | µs per call (commandstats) |"
        );
        println!("|---|---:|---:|---:|");
        for (name, calls, usec, net) in &rows {
            println!(
                "| {name} | {:.2} | {:.2} | {:.1} |",
                net / n,
                *calls as f64 / n,
                *usec as f64 / n
            );
        }
        println!("| kind of key | keys | MEMORY USAGE bytes | added per call |");
        println!("|---|---:|---:|---:|");
        for (k, (n, bytes)) in &kinds {
            let was = before_kinds.get(k).map(|e| e.1).unwrap_or(0);
            println!(
                "| `{k}` | {n} | {bytes} | {:.1} |",
                (*bytes as f64 - was as f64) / args.calls as f64
            );
        }
        drop(all);
        drop(server);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
