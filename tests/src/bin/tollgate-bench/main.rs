//! `tollgate-bench`: the project's benchmarks and load generators, as one binary.
//!
//! Benchmarks here measure what the issues set targets for, side by side in one
//! run (these machines are shared and noisy: compare medians and ratios, never
//! absolute numbers across runs). BENCHMARKS.md records the results.

mod alloc;
mod api;
mod call_bytes;
mod chaos;
mod cluster_audit;
mod compose;
mod durability;
mod fairness;
mod job_lookup;
mod jobs;
mod ledger;
mod load;
mod memory;
mod memory_embedded;
mod scale;
mod stats;
mod stream;
mod throttle;
mod usage;
mod utilisation;
mod waits;

use clap::{Parser, Subcommand};

// Counts live heap bytes only once `memory-embedded` turns it on.
#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

#[derive(Debug, Parser)]
#[command(name = "tollgate-bench", about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// HTTP api: sync call latency, concurrent calls/s, async submits/s and 429
    /// latency through `tollgate all`, embedded and on Redis, and the Redis round
    /// trips of one call.
    Api(api::Args),
    /// Budget ledger: reserve latency by live events, throughput on both backends,
    /// and the redis-benchmark ceiling for the same script.
    Ledger(ledger::Args),
    /// Redis memory per live spend event: 100,000 events of one user through the
    /// ledger scripts (previous and current key layout, side by side), then
    /// calls through the api; `MEMORY USAGE` of every key of the user.
    Memory(memory::Args),
    /// What a sync call leaves in Redis: used_memory per call over every key
    /// and MEMORY USAGE by kind of key, with an optional baseline binary.
    CallBytes(call_bytes::Args),
    /// Fire reserves at one user from this process and print the counts as JSON
    /// (the multi-process tests run several of these at once).
    Load(load::Args),
    /// Provider throttle: grant latency and the most grants per second, with 1
    /// and 3 throttler processes on one Redis.
    Throttle(throttle::BenchArgs),
    /// Run waiters on one provider from this process and print their grant
    /// records as JSON (the multi-process throttle tests run several at once).
    ThrottleWaiters(throttle::WaiterArgs),
    /// Fair queuing at a saturated provider, on the full chain (2 api, 2
    /// throttler, 2 worker processes, an upstream at rate 20): a flood of user
    /// A, then B, C and D; FIFO vs fair; then shares 4:1 at the throttle.
    Fairness(fairness::Args),
    /// Jobs: submit latency and end-to-end jobs/s, embedded and on Redis with
    /// real throttler and worker processes.
    Jobs(jobs::Args),
    /// What each `--durability` costs: sync calls/s on Redis with AOF,
    /// everysec vs always vs a replica (WAIT), with an A/A pair, rounds in
    /// alternating order.
    Durability(durability::Args),
    /// Faults from a seed (kill -9, SIGSTOP, Redis connections killed, script
    /// cache flushed, Redis down) against a deployment in processes under load;
    /// then the invariants, checked after a drain.
    Chaos(chaos::Args),
    /// The docker-compose demo's scenario (tests/compose/run.sh): load through
    /// every api pod, a worker killed mid-load, then the checks.
    ComposeScenario(compose::Args),
    /// The scaling curve: reserves/s and sync calls/s through 1, 2 and 4 pods,
    /// on one Redis and on a Redis Cluster, with Redis commands and CPU per call.
    Scale(scale::Args),
    /// Reserve for random users from this process for a while and print the
    /// count as JSON (`scale` runs one of these per pod).
    ReserveLoad(scale::ReserveLoadArgs),
    /// After the suite: every Lua script ran on the suite's Redis Cluster, and
    /// no node answered CROSSSLOT.
    ClusterAudit(cluster_audit::Args),
    /// The embedded ledger's memory: heap bytes per live spend event (reserve
    /// and charge), and what 10,000 expired users leave behind.
    MemoryEmbedded(memory_embedded::Args),
    /// Usage: Redis time of `usage.lua` (SLOWLOG) with 1,000 / 10,000 / 100,000
    /// live events, a page and a walk of every page, against a previous script
    /// side by side; fails if a call held Redis past 5 ms.
    Usage(usage::Args),
    /// Streaming: time to first token and each event's delay through tollgate
    /// (embedded, on Redis) against the mock directly (and an A/A pair),
    /// p50/p99 over rotating rounds; Redis memory per open stream.
    Stream(stream::Args),
    /// Job lookups across users: another user's job against a missing one,
    /// through `tollgate api` (`--bin` for builds side by side).
    JobLookup(job_lookup::Args),
    /// One saturated provider (rate 50, burst 10) on the full chain (1 api,
    /// 3 throttlers, 2 workers): the share of its rate that reaches the
    /// upstream, and the upstream's bound, builds side by side.
    Utilisation(utilisation::Args),
}

/// What a bench through `tollgate` processes does first: the TLS provider
/// installed, and `config` written to `bench.toml` in a new temp folder
/// `tollgate-bench-{name}-…`; returns the folder and the file.
fn bench_config(
    name: &str,
    config: &str,
) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
    tollgate_providers::http::install_crypto_provider();
    Ok(tollgate_tests::temp_file(
        &format!("bench-{name}"),
        "bench.toml",
        config,
    )?)
}

/// The Redis at `--redis-url` when given, else a private redis-server
/// started here (kept running by the returned handle): the handle and the URL.
fn redis_or_start(url: Option<&str>) -> (Option<tollgate_tests::RedisServer>, String) {
    match url {
        Some(url) => (None, url.to_owned()),
        None => {
            let server = tollgate_tests::RedisServer::start();
            let url = server.url();
            (Some(server), url)
        }
    }
}

/// An error unless `resp` is a success (its body read either way), named
/// `what` with the status and body.
async fn ensure_success(resp: reqwest::Response, what: &str) -> anyhow::Result<()> {
    let status = resp.status();
    let body = resp.text().await?;
    anyhow::ensure!(status.is_success(), "{what}: {status} {body}");
    Ok(())
}

/// An error named `what` unless `user` has exactly `n` live events.
async fn ensure_live(
    ledger: &dyn tollgate_core::ledger::Ledger,
    user: &tollgate_core::id::UserId,
    n: usize,
    what: &str,
) -> anyhow::Result<()> {
    let live = tollgate_tests::all_events(ledger, user).await?.len();
    anyhow::ensure!(live == n, "{what}: {live} live events, wanted {n}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.command {
            Command::Api(args) => api::run(args).await,
            Command::Ledger(args) => ledger::run(args).await,
            Command::Load(args) => load::run(args).await,
            Command::Memory(args) => memory::run(args).await,
            Command::CallBytes(args) => call_bytes::run(args).await,
            Command::Throttle(args) => throttle::bench(args).await,
            Command::ThrottleWaiters(args) => throttle::waiters(args).await,
            Command::Fairness(args) => fairness::run(args).await,
            Command::Jobs(args) => jobs::run(args).await,
            Command::Chaos(args) => chaos::run(args).await,
            Command::Durability(args) => durability::run(args).await,
            Command::ComposeScenario(args) => compose::run(args).await,
            Command::Scale(args) => scale::run(args).await,
            Command::ReserveLoad(args) => scale::reserve_load(args).await,
            Command::ClusterAudit(args) => cluster_audit::run(args).await,
            Command::MemoryEmbedded(args) => memory_embedded::run(args).await,
            Command::Usage(args) => usage::run(args).await,
            Command::JobLookup(args) => job_lookup::run(args).await,
            Command::Stream(args) => stream::run(args).await,
            Command::Utilisation(args) => utilisation::run(args).await,
        }
    })
}
