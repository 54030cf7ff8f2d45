//! The scenario `tests/compose/run.sh` drives against the docker-compose demo:
//! load through every api pod, a worker killed mid-load, then the checks —
//! the budget held across pods, the upstream never rate-limited us, every job
//! ended once, and usage equals exactly the cost of the jobs that succeeded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of an api pod (repeat for each).
    #[arg(long = "api", required = true)]
    apis: Vec<String>,
    /// Base URL of the mock provider (for GET /stats).
    #[arg(long)]
    mock: String,
    #[arg(long)]
    admin_token: String,
    /// Shell command run mid-load to kill one worker (e.g. `docker kill <id>`).
    #[arg(long)]
    kill_worker: Option<String>,
    /// Give up waiting for jobs to finish after this many seconds.
    #[arg(long, default_value_t = 150)]
    timeout_secs: u64,
}

/// One accepted job: who owns it, what it costs.
#[derive(Debug, Clone)]
struct Accepted {
    id: String,
    key: Arc<String>,
    user: String,
    cost: u64,
}

const MIX: [(&str, u64); 3] = [
    ("embeddings", 1),
    ("salary.lookup", 3),
    ("llm.structured", 8),
];

pub async fn run(args: Args) -> anyhow::Result<()> {
    tollgate_providers::http::install_crypto_provider();
    let http = Client::builder().timeout(Duration::from_secs(30)).build()?;
    for api in &args.apis {
        wait_ok(&http, &format!("{api}/readyz"), Duration::from_secs(90)).await?;
    }
    wait_ok(
        &http,
        &format!("{}/stats", args.mock),
        Duration::from_secs(30),
    )
    .await?;
    let run_id = tollgate_core::id::RequestId::generate().as_str()[..8].to_owned();

    // 1. One user, limit 1000, 300 concurrent requests of cost 8 spread over
    //    every api pod: exactly 125 fit, whichever pod took them.
    let (capped, capped_key) =
        create_user(&http, &args, &format!("capped-{run_id}"), "free").await?;
    let capped_key = Arc::new(capped_key);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..300usize {
        let (http, api, key) = (
            http.clone(),
            args.apis[i % args.apis.len()].clone(),
            Arc::clone(&capped_key),
        );
        tasks.spawn(async move { submit(&http, &api, &key, "llm.structured").await });
    }
    let mut accepted = Vec::new();
    let mut denied = 0;
    while let Some(r) = tasks.join_next().await {
        match r?? {
            Some(id) => accepted.push(Accepted {
                id,
                key: Arc::clone(&capped_key),
                user: capped.clone(),
                cost: 8,
            }),
            None => denied += 1,
        }
    }
    println!(
        "budget across {} api pods: {} accepted, {denied} denied (429)",
        args.apis.len(),
        accepted.len()
    );
    ensure!(
        accepted.len() as u64 * 8 <= 1000,
        "the budget was overspent across pods: {} x 8 > 1000",
        accepted.len()
    );
    ensure!(
        accepted.len() == 125,
        "expected exactly 125 accepted, got {}",
        accepted.len()
    );

    // 2. A pro user offers several times the mock's rate, mixed operations; a
    //    worker is killed while the jobs run.
    let (busy, busy_key) = create_user(&http, &args, &format!("busy-{run_id}"), "pro").await?;
    let busy_key = Arc::new(busy_key);
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for i in 0..360usize {
        let (op, cost) = MIX[i % MIX.len()];
        let (http, api, key) = (
            http.clone(),
            args.apis[i % args.apis.len()].clone(),
            Arc::clone(&busy_key),
        );
        tasks.spawn(async move {
            submit(&http, &api, &key, op)
                .await
                .map(|id| id.map(|id| (id, cost)))
        });
    }
    while let Some(r) = tasks.join_next().await {
        let (id, cost) = r??.context("the pro user was denied")?;
        accepted.push(Accepted {
            id,
            key: Arc::clone(&busy_key),
            user: busy.clone(),
            cost,
        });
    }
    println!(
        "offered {} jobs in {:.1}s (the mock allows 50/s)",
        300 + 360,
        started.elapsed().as_secs_f64()
    );
    if let Some(cmd) = &args.kill_worker {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let status = tokio::process::Command::new("sh")
            .args(["-c", cmd])
            .status()
            .await?;
        ensure!(status.success(), "kill command failed: {cmd}");
        println!("killed a worker mid-load: {cmd}");
    }

    // 3. Every job ends exactly once: succeeded, or failed with its refund.
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut finished: HashMap<String, (String, Value)> = HashMap::new();
    while finished.len() < accepted.len() {
        ensure!(
            Instant::now() < deadline,
            "{} of {} jobs still unfinished after {}s",
            accepted.len() - finished.len(),
            accepted.len(),
            args.timeout_secs
        );
        for (i, job) in accepted.iter().enumerate() {
            if finished.contains_key(&job.id) {
                continue;
            }
            let api = &args.apis[i % args.apis.len()];
            let v = get_json(&http, &format!("{api}/v1/jobs/{}", job.id), &job.key).await?;
            let status = v["status"].as_str().unwrap_or_default().to_owned();
            if status == "succeeded" || status == "failed" {
                finished.insert(job.id.clone(), (status, v));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // What each user pays: its succeeded jobs, and its failed jobs whose
    // charge stands (a run whose worker was killed after the call may have
    // gone out: the upstream may have done the work).
    let mut paid: HashMap<&str, u64> = HashMap::new();
    let (mut failures, mut charged_failures) = (0, 0);
    for job in &accepted {
        let (status, v) = &finished[&job.id];
        let charged = status == "succeeded" || v["error"]["charged"].as_bool() == Some(true);
        if status != "succeeded" {
            failures += 1;
            charged_failures += usize::from(charged);
        }
        if charged {
            *paid.entry(job.user.as_str()).or_default() += job.cost;
        }
    }
    println!(
        "{} jobs finished: {} succeeded, {failures} failed ({charged_failures} of them charged: the upstream may have worked)",
        accepted.len(),
        accepted.len() - failures
    );

    // 4. Usage is exactly the cost of the jobs that succeeded or failed
    //    charged: charged once, refunded at most once, even with a worker
    //    killed mid-job.
    for (user, key) in [(&capped, &capped_key), (&busy, &busy_key)] {
        let usage = get_json(&http, &format!("{}/v1/usage", args.apis[0]), key).await?;
        let used = usage["used"].as_u64().context("usage.used")?;
        let expected = paid.get(user.as_str()).copied().unwrap_or(0);
        ensure!(
            used == expected,
            "{user}: usage {used} != cost of its jobs that succeeded or failed charged {expected}"
        );
        println!("{user}: used {used} == cost of its jobs that succeeded or failed charged");
    }

    // 5. The throttle kept the upstream under its own limit.
    let stats: Value = http
        .get(format!("{}/stats", args.mock))
        .send()
        .await?
        .json()
        .await?;
    println!("mock provider: {stats}");
    ensure!(
        stats["rate_limited"].as_u64() == Some(0),
        "the mock provider rate-limited us: {stats}"
    );
    println!(
        "{}",
        json!({"accepted": accepted.len(), "failed": failures, "mock": stats})
    );
    Ok(())
}

async fn wait_ok(http: &Client, url: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        match http.get(url).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            other if Instant::now() >= deadline => {
                bail!("{url} not ready within {within:?}: {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

async fn create_user(
    http: &Client,
    args: &Args,
    user: &str,
    plan: &str,
) -> anyhow::Result<(String, String)> {
    let r = http
        .post(format!("{}/admin/users", args.apis[0]))
        .bearer_auth(&args.admin_token)
        .json(&json!({"user": user, "plan": plan}))
        .send()
        .await?;
    let status = r.status();
    let v: Value = r.json().await?;
    ensure!(status.is_success(), "create user {user}: {status} {v}");
    let key = v["api_key"]
        .as_str()
        .context("api_key in the answer")?
        .to_owned();
    Ok((user.to_owned(), key))
}

/// Submits one async operation; `Some(job id)` when accepted, `None` on 429.
async fn submit(http: &Client, api: &str, key: &str, op: &str) -> anyhow::Result<Option<String>> {
    let r = http
        .post(format!("{api}/v1/ops/{op}"))
        .bearer_auth(key)
        .header("Prefer", "respond-async")
        .json(&json!({"text": "compose scenario"}))
        .send()
        .await?;
    match r.status() {
        StatusCode::ACCEPTED | StatusCode::OK => {
            let v: Value = r.json().await?;
            Ok(Some(v["job_id"].as_str().context("job_id")?.to_owned()))
        }
        StatusCode::TOO_MANY_REQUESTS => {
            ensure!(
                r.headers().contains_key("retry-after"),
                "429 without Retry-After"
            );
            Ok(None)
        }
        other => bail!(
            "POST {api}/v1/ops/{op}: {other} {}",
            r.text().await.unwrap_or_default()
        ),
    }
}

async fn get_json(http: &Client, url: &str, key: &str) -> anyhow::Result<Value> {
    let r = http.get(url).bearer_auth(key).send().await?;
    let status = r.status();
    let v: Value = r
        .json()
        .await
        .with_context(|| format!("GET {url}: not JSON"))?;
    ensure!(status.is_success(), "GET {url}: {status} {v}");
    Ok(v)
}
