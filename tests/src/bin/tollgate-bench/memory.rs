//! The memory bench: Redis bytes per live spend event, counted as `MEMORY USAGE
//! <key> SAMPLES 0` summed over every key of the user, divided by its live
//! events: events put through the ledger scripts; then calls through the api (`tollgate all` on Redis: charge, claim, settle of a
//! job per call), of this build and of an optional baseline binary.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use redis::aio::MultiplexedConnection;
use serde_json::json;
use tollgate_core::{
    id::{RequestId, UserId},
    ledger::{ChargeOutcome, ChargeRequest, ClaimOutcome, ClaimRequest, Ledger},
};
use tollgate_redis::{keys::KeySpace, ledger::RedisLedger, pool::PoolOptions};
use tollgate_tests::{random_prefix, redis_info, workspace_bin, RedisServer};

use crate::api::{All, CONFIG as API_CONFIG};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Live events put in one user's window through the ledger scripts.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Calls through the api.
    #[arg(long, default_value_t = 3_000)]
    calls: usize,
    /// Concurrent callers (ledger fills and api calls).
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Another `tollgate` binary (e.g. a build of main) whose api
    /// is measured the same way, before this build's.
    #[arg(long)]
    baseline: Option<PathBuf>,
}

const OP: &str = "llm.structured";

/// A charge as the api makes it: 16 hex of nonce, 24 of fingerprint.
fn charge_args(i: usize) -> (String, String) {
    (
        format!("{:016x}", i * 7919),
        format!("{:024x}", i * 104_729),
    )
}

/// `MEMORY USAGE ... SAMPLES 0` of every key matching `pattern`: (keys, bytes).
async fn bytes_of(conn: &mut MultiplexedConnection, pattern: &str) -> anyhow::Result<(usize, u64)> {
    let keys = redis_info::scan_keys(conn, pattern).await?;
    let mut total = 0;
    for k in &keys {
        let b: Option<u64> = redis_info::memory_usage(conn, k).await?;
        total += b.unwrap_or(0);
    }
    Ok((keys.len(), total))
}

/// `n` events for `user` through [`RedisLedger`]: plain reserves, or charges
/// claimed by their job.
async fn fill(
    ledger: &Arc<RedisLedger>,
    user: &UserId,
    n: usize,
    clients: usize,
    charges: bool,
) -> anyhow::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (ledger, user, next) = (Arc::clone(ledger), user.clone(), Arc::clone(&next));
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return anyhow::Ok(());
                }
                let id = RequestId::generate();
                if !charges {
                    ledger.reserve(&user, &id, 1).await?;
                    continue;
                }
                let (nonce, fp) = charge_args(i);
                let req = ChargeRequest {
                    cost: 1,
                    nonce: &nonce,
                    operation: OP,
                    model: "",
                    fingerprint: &fp,
                    deadline: Duration::from_secs(600),
                    grace: Duration::from_secs(1),
                    service_key: None,
                    price: None,
                };
                let ChargeOutcome::Charged { deadline_ms, .. } =
                    ledger.charge(&user, &id, &req).await?
                else {
                    bail!("bench charge not charged");
                };
                if ledger
                    .claim(&user, &id, &ClaimRequest::new(&nonce, deadline_ms + 1_000))
                    .await?
                    != ClaimOutcome::Claimed
                {
                    bail!("bench claim refused");
                }
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    crate::ensure_live(ledger.as_ref(), user, n, user.as_str()).await
}

fn row(what: &str, n: usize, keys: usize, bytes: u64) {
    println!(
        "| {what} | {n} | {keys} | {bytes} | {:.1} |",
        bytes as f64 / n as f64
    );
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    tollgate_providers::http::install_crypto_provider();
    let server = RedisServer::start();
    let url = server.url();
    let config = tollgate_tests::one_plan_config("bench", 1_000_000_000_000_000, "12h");
    let prefix = random_prefix();
    let space = KeySpace::new(&prefix)?;
    let pool = tollgate_redis::pool::connect(
        &url,
        &PoolOptions {
            max_size: 8,
            ..Default::default()
        },
    )
    .await?;
    let ledger = Arc::new(RedisLedger::new(pool, space.clone(), Arc::clone(&config)));
    let mut conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let version = redis_info::version(&mut conn).await?;
    println!(
        "## Redis memory per live spend event (redis {version}, MEMORY USAGE SAMPLES 0 of every key of the user, UUID request ids)"
    );
    println!("| events | live events | keys | bytes | bytes/event |");
    println!("|---|---:|---:|---:|---:|");
    for charges in [false, true] {
        let what = if charges {
            "charges (claimed, op llm.structured)"
        } else {
            "reserves"
        };
        let user = UserId::new(format!(
            "mem-{}",
            if charges { "charge" } else { "reserve" }
        ))?;
        fill(&ledger, &user, args.events, args.clients, charges).await?;
        let (n, bytes) = bytes_of(&mut conn, &format!("{prefix}:v1:{{u:{user}}}*")).await?;
        row(what, args.events, n, bytes);
    }
    drop(conn);
    drop(server);

    println!();
    println!(
        "## through the api: {} sync calls of POST /v1/ops/bench (a job each: charge, claim, settle), {} clients, tollgate all on Redis",
        args.calls, args.clients
    );
    println!("| build | calls | user keys | bytes | bytes/call |");
    println!("|---|---:|---:|---:|---:|");
    let (dir, config) = crate::bench_config("memory", API_CONFIG)?;
    let mut builds = Vec::new();
    if let Some(b) = &args.baseline {
        builds.push(b.clone());
    }
    builds.push(workspace_bin("tollgate"));
    for bin in &builds {
        let server = RedisServer::start();
        let prefix = random_prefix();
        let all = All::start(bin, &config, 64, Some((&server.url(), &prefix)))?;
        let http = reqwest::Client::new();
        let url = format!("{}/v1/ops/bench", all.base);
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..args.clients {
            let (http, url, key, next, calls) = (
                http.clone(),
                url.clone(),
                all.key.clone(),
                Arc::clone(&next),
                args.calls,
            );
            tasks.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= calls {
                        return anyhow::Ok(());
                    }
                    let resp = http
                        .post(&url)
                        .bearer_auth(&key)
                        .json(&json!({ "i": i }))
                        .send()
                        .await?;
                    crate::ensure_success(resp, &format!("call {i}")).await?;
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let mut conn = redis::Client::open(server.url().as_str())?
            .get_multiplexed_async_connection()
            .await?;
        let (n, bytes) = bytes_of(&mut conn, &format!("{prefix}:v1:{{u:*")).await?;
        println!(
            "| {} | {} | {n} | {bytes} | {:.1} |",
            bin.display(),
            args.calls,
            bytes as f64 / args.calls as f64
        );
        drop(all);
        drop(server);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
