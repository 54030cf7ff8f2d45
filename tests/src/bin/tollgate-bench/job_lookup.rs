//! The job-lookup bench: how long `GET /v1/jobs/{id}` takes for a job another
//! user owns, against one that does not exist, through a real `tollgate api`
//! on a private redis-server. The two lookups alternate request by request on
//! one keep-alive connection; a third series (another missing id) is the A/A
//! noise. `--bin` runs each given `tollgate` binary (e.g. a build of the
//! previous commit) in turn, alternating over `--rounds`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::stats::{us, Samples};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// `tollgate` binaries to compare (default: the one built with the bench).
    #[arg(long = "bin")]
    bins: Vec<std::path::PathBuf>,
    /// Rounds; each runs every binary once, in alternating order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Lookups of each kind per binary and round.
    #[arg(long, default_value_t = 2_000)]
    lookups: usize,
    /// Bytes of the job's input (the record another user's lookup used to read).
    #[arg(long, default_value_t = 4_000)]
    input_bytes: usize,
}

const ADMIN: &str = "bench-admin-token-0123456789";

struct Api(Child);

impl Drop for Api {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Medians and p90s (µs) of: another user's job, a missing job, another
/// missing job (A/A).
async fn one(bin: &std::path::Path, args: &Args) -> anyhow::Result<[(f64, f64); 3]> {
    let redis = RedisServer::start();
    let port = tollgate_tests::redis_server::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _api = Api(Command::new(bin)
        .arg("api")
        .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"))
        .env("TOLLGATE_REDIS_URL", redis.url())
        .env("TOLLGATE_KEY_PREFIX", random_prefix())
        .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
        .env_remove("TOLLGATE_CONFIG")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?);
    tollgate_providers::http::install_crypto_provider();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        if Instant::now() > deadline {
            bail!("{} did not come up", bin.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut keys = Vec::new();
    for user in ["alice", "bob"] {
        let r: serde_json::Value = http
            .post(format!("{base}/admin/users"))
            .bearer_auth(ADMIN)
            .json(&json!({"user": user, "plan": "pro"}))
            .send()
            .await?
            .json()
            .await?;
        keys.push(r["api_key"].as_str().context("api_key")?.to_owned());
    }
    let r: serde_json::Value = http
        .post(format!("{base}/v1/ops/embeddings"))
        .bearer_auth(&keys[0])
        .header("prefer", "respond-async")
        .header("idempotency-key", "guessable-1")
        .json(&json!({"text": "x".repeat(args.input_bytes)}))
        .send()
        .await?
        .json()
        .await?;
    let job = r["job_id"].as_str().context("job_id")?.to_owned();
    // Missing ids of the same shape and length: the job's with its last
    // character changed.
    let missing = |c: char| {
        let mut id = job.clone();
        let last = id.pop().unwrap_or('0');
        id.push(if last == c { 'z' } else { c });
        id
    };
    let ids = [job.clone(), missing('0'), missing('1')];
    let mut samples: [Vec<Duration>; 3] = Default::default();
    for i in 0..args.lookups + 100 {
        // Rotate which kind goes first, so that none always follows another.
        for k in 0..3 {
            let which = (i + k) % 3;
            let started = Instant::now();
            let r = http
                .get(format!("{base}/v1/jobs/{}", ids[which]))
                .bearer_auth(&keys[1])
                .send()
                .await?;
            let status = r.status();
            r.bytes().await?;
            let took = started.elapsed();
            if status != 404 {
                bail!("lookup {which}: {status}");
            }
            // The first 100 of each warm the caches.
            if i >= 100 {
                samples[which].push(took);
            }
        }
    }
    Ok(samples.map(|s| {
        let s = Samples::new(s);
        (us(s.median()), us(s.pct(90.0)))
    }))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let bins = if args.bins.is_empty() {
        vec![workspace_bin("tollgate")]
    } else {
        args.bins.clone()
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "job lookups by another user: {} per kind per run; load average {}",
        args.lookups,
        load.trim()
    );
    println!(
        "{:<40} {:>5} {:>22} {:>22} {:>22} {:>14}",
        "binary",
        "round",
        "other's job med/p90 µs",
        "missing med/p90 µs",
        "missing (A/A) med/p90",
        "other-missing"
    );
    for round in 0..args.rounds {
        let order: Vec<&std::path::PathBuf> = if round % 2 == 0 {
            bins.iter().collect()
        } else {
            bins.iter().rev().collect()
        };
        for bin in order {
            let [other, missing, aa] = one(bin, &args).await?;
            println!(
                "{:<40} {:>5} {:>10.0} / {:>9.0} {:>10.0} / {:>9.0} {:>10.0} / {:>9.0} {:>+14.0}",
                bin.display(),
                round + 1,
                other.0,
                other.1,
                missing.0,
                missing.1,
                aa.0,
                aa.1,
                other.0 - missing.0
            );
        }
    }
    Ok(())
}
