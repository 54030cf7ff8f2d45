//! The HTTP api benchmark: `POST /v1/ops/<op>` through real HTTP on 127.0.0.1
//! against a `tollgate all` process, embedded and on Redis, side by side. Sync
//! call latency, concurrent calls/s, async submits/s, 429 latency, and (on Redis)
//! the round trips of one call counted with MONITOR.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use tollgate_client::Outcome;
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::stats::{us, Samples};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sequential calls per latency measurement (sync calls, and 429s).
    #[arg(long, default_value_t = 1000)]
    calls: usize,
    /// Concurrent clients of the throughput runs.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Calls shared by the clients of each throughput run.
    #[arg(long, default_value_t = 4000)]
    total: usize,
    /// The in-process worker's --concurrency.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Sequential calls watched with MONITOR to count Redis round trips.
    #[arg(long, default_value_t = 100)]
    counted: usize,
    /// Another `tollgate` binary (e.g. an earlier build) to measure side by
    /// side with this one in the same run: each mode runs the baseline, then
    /// this build, on the same machine minutes apart.
    #[arg(long)]
    baseline: Option<std::path::PathBuf>,
}

/// Plan `bench` (the default: the dev user's) never runs out; plan `tiny` holds
/// one token, so its second call and every one after it is a 429. The provider
/// has no `url` (the built-in mock) and a bucket that never runs dry.
pub(crate) const CONFIG: &str = r#"
default_plan = "bench"
[plans.bench]
limit = 1000000000
window = "12h"
# Every call carries an Idempotency-Key, so its job record stays for the
# result_ttl: room for every run's jobs.
max_stored_bytes = 1073741824
[plans.tiny]
limit = 1
window = "12h"
[providers.bench]
rate = 1000000
burst = 1000000
max_wait = "30s"
[operations.bench]
cost = 1
provider = "bench"
"#;

pub(crate) const ADMIN: &str = "bench-admin-token-0123456789";

/// A `tollgate all` process, killed (and reaped) on drop.
pub(crate) struct All {
    child: Child,
    pub(crate) base: String,
    pub(crate) key: String,
}

impl Drop for All {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl All {
    /// The process id (the scale bench reads its CPU time).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts `tollgate all` on a free port and reads its banner.
    pub(crate) fn start(
        bin: &Path,
        config: &Path,
        concurrency: usize,
        redis: Option<(&str, &str)>,
    ) -> anyhow::Result<Self> {
        Self::start_with_env(bin, config, concurrency, redis, &[])
    }

    /// [`All::start`] with `env` set for the process (e.g. `TOLLGATE_DURABILITY`).
    pub(crate) fn start_with_env(
        bin: &Path,
        config: &Path,
        concurrency: usize,
        redis: Option<(&str, &str)>,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.envs(env.iter().copied());
        cmd.args(["all", "--listen", "127.0.0.1:0", "--admin-token", ADMIN])
            .arg("--config")
            .arg(config)
            .args(["--concurrency", &concurrency.to_string()]);
        if let Some((url, prefix)) = redis {
            cmd.args(["--redis-url", url, "--key-prefix", prefix]);
        }
        let mut child = cmd
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("spawn tollgate all")?;
        let mut reader = BufReader::new(child.stdout.take().context("stdout")?);
        let (mut base, mut key) = (None, None);
        let mut lines = Vec::new();
        while base.is_none() || key.is_none() {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                let _ = child.kill();
                anyhow::bail!("tollgate all exited after printing {lines:?}");
            }
            if let Some(b) = line.trim().strip_prefix("listening on ") {
                base = Some(b.to_owned());
            }
            if let Some(i) = line.find("Bearer ") {
                key = line[i + 7..].split('\'').next().map(str::to_owned);
            }
            lines.push(line);
        }
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in reader.lines() {});
        Ok(Self {
            child,
            base: base.unwrap_or_default(),
            key: key.unwrap_or_default(),
        })
    }
}

/// The load path's client: tollgate's Rust client (`tollgate-client`) on one
/// shared connection pool, without retries, so that every answer counts as
/// it comes. Each call carries its own Idempotency-Key, as an application's would.
#[derive(Clone)]
pub(crate) struct Client {
    pub(crate) http: reqwest::Client,
    pub(crate) base: String,
}

impl Client {
    /// A client of `base` for `clients` concurrent callers (60 s a call).
    pub(crate) fn new(base: &str, clients: usize) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(clients * 2)
            .build()?;
        Ok(Self {
            http,
            base: base.to_owned(),
        })
    }

    /// One operation call of `bench`; `Err` unless it answered `want` (200:
    /// done, 202: accepted, 429: over budget).
    pub(crate) async fn call(
        &self,
        key: &str,
        i: usize,
        asynchronous: bool,
        want: u16,
    ) -> anyhow::Result<()> {
        let api = tollgate_client::Client::builder(&self.base, key)
            .http_client(self.http.clone())
            .retry(tollgate_client::RetryPolicy::none())
            .build()?;
        let call = api.call("bench", json!({ "i": i }));
        let outcome = if asynchronous {
            call.submit().await?
        } else {
            call.send().await?
        };
        let got = match &outcome {
            Outcome::Done(_) => 200,
            Outcome::Pending(_) => 202,
            Outcome::BudgetExhausted { .. } => 429,
            _ => 0,
        };
        anyhow::ensure!(got == want, "wanted {want}, got {outcome:?}");
        Ok(())
    }
}

/// `n` calls one after another: per-call latencies.
pub(crate) async fn sequential(
    c: &Client,
    key: &str,
    n: usize,
    asynchronous: bool,
    want: u16,
) -> anyhow::Result<Samples> {
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        c.call(key, i, asynchronous, want).await?;
        v.push(t0.elapsed());
    }
    Ok(Samples::new(v))
}

/// `n` sequential `GET /healthz` (no auth, no store): the HTTP floor.
async fn healthz(c: &Client, base: &str, n: usize) -> anyhow::Result<Samples> {
    let url = format!("{base}/healthz");
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let resp = c.http.get(&url).send().await?.error_for_status()?;
        resp.bytes().await?;
        v.push(t0.elapsed());
    }
    Ok(Samples::new(v))
}

/// `clients` tasks share `total` calls, each task calling one after another on
/// its own keep-alive connection: per-call latencies and the wall time.
pub(crate) async fn concurrent(
    c: &Client,
    key: &str,
    clients: usize,
    total: usize,
    asynchronous: bool,
    want: u16,
) -> anyhow::Result<(Samples, Duration)> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    let started = Instant::now();
    for _ in 0..clients {
        let (c, key, next) = (c.clone(), key.to_owned(), Arc::clone(&next));
        set.spawn(async move {
            let mut v = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return anyhow::Ok(v);
                }
                let t0 = Instant::now();
                c.call(&key, i, asynchronous, want).await?;
                v.push(t0.elapsed());
            }
        });
    }
    let mut all = Vec::with_capacity(total);
    while let Some(r) = set.join_next().await {
        all.extend(r??);
    }
    Ok((Samples::new(all), started.elapsed()))
}

fn row(mode: &str, what: &str, clients: usize, s: &Samples, n: usize, wall: Duration) {
    println!(
        "| {mode} | {what} | {clients} | {n} | {:.0} µs | {:.0} µs | {:.0} |",
        us(s.median()),
        us(s.pct(99.0)),
        n as f64 / wall.as_secs_f64()
    );
}

/// Creates a user on plan `tiny` and spends its one token: every later call is a 429.
async fn exhausted_user(c: &Client, base: &str, user: &str) -> anyhow::Result<String> {
    let created: serde_json::Value = c
        .http
        .post(format!("{base}/admin/users"))
        .bearer_auth(ADMIN)
        .json(&json!({ "user": user, "plan": "tiny" }))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let key = created["api_key"]
        .as_str()
        .context("no api_key in /admin/users")?
        .to_owned();
    c.call(&key, 0, true, 202).await?;
    Ok(key)
}

/// Every measurement against one running `tollgate all`.
async fn measure(mode: &str, all: &All, args: &Args) -> anyhow::Result<(Client, String)> {
    let c = Client::new(&all.base, args.clients)?;
    let tiny = exhausted_user(&c, &all.base, "tiny").await?;
    // Warm-up: connections, scripts, the worker's loops.
    concurrent(&c, &all.key, args.clients, 500, false, 200).await?;
    sequential(&c, &tiny, 100, false, 429).await?;

    let t0 = Instant::now();
    let s = healthz(&c, &all.base, args.calls).await?;
    row(
        mode,
        "GET /healthz (HTTP floor)",
        1,
        &s,
        args.calls,
        t0.elapsed(),
    );
    let t0 = Instant::now();
    let s = sequential(&c, &all.key, args.calls, false, 200).await?;
    row(mode, "sync call", 1, &s, args.calls, t0.elapsed());
    let t0 = Instant::now();
    let s = sequential(&c, &tiny, args.calls, false, 429).await?;
    row(
        mode,
        "429 (budget exhausted)",
        1,
        &s,
        args.calls,
        t0.elapsed(),
    );
    let (s, wall) = concurrent(&c, &all.key, args.clients, args.total, false, 200).await?;
    row(mode, "sync call", args.clients, &s, args.total, wall);
    let (s, wall) = concurrent(&c, &tiny, args.clients, args.total, false, 429).await?;
    row(
        mode,
        "429 (budget exhausted)",
        args.clients,
        &s,
        args.total,
        wall,
    );
    let (s, wall) = concurrent(&c, &all.key, args.clients, args.total, true, 202).await?;
    row(
        mode,
        "async submit (202)",
        args.clients,
        &s,
        args.total,
        wall,
    );
    Ok((c, tiny))
}

/// Commands sent to Redis by clients (not those scripts run), by command; an
/// EVALSHA is named by the kind and suffix of its first key
/// (`{u:dev}:events` -> `EVALSHA u:*:events`), FCALL by its script
/// (`tollgate_job_<version>_job_lease` -> `FCALL job job_lease`).
#[derive(Default)]
struct Tally(BTreeMap<String, u64>);

fn command_of(line: &str) -> Option<String> {
    // 1700000000.123456 [0 127.0.0.1:53422] "EVALSHA" "sha" "2" "key" ...
    let rest = &line[line.find('[')?..];
    if rest.starts_with("[0 lua]") || rest.contains(" lua]") {
        return None;
    }
    let args: Vec<&str> = rest[rest.find(']')? + 1..]
        .split('"')
        .skip(1)
        .step_by(2)
        .collect();
    let cmd = args.first()?.to_ascii_uppercase();
    if cmd == "FCALL" {
        // tollgate_<library>_<version>_<script>; the script's name may hold '_'.
        let name = args.get(1).copied().unwrap_or("?");
        let mut parts = name
            .strip_prefix("tollgate_")
            .unwrap_or(name)
            .splitn(3, '_');
        let library = parts.next().unwrap_or("?");
        let script = parts.nth(1).unwrap_or(name);
        return Some(format!("FCALL {library} {script}"));
    }
    if cmd == "EVALSHA" {
        let key = args.get(3).copied().unwrap_or("");
        let kind = key
            .find('{')
            .and_then(|i| key[i + 1..].split(':').next())
            .unwrap_or("?");
        let suffix = key
            .find("}:")
            .map(|i| key[i + 2..].split(':').next().unwrap_or(""))
            .unwrap_or("");
        return Some(format!("EVALSHA {kind}:*:{suffix}"));
    }
    Some(cmd)
}

/// Watches Redis with `redis-cli monitor` while `work` runs; returns the client
/// commands seen, by command.
async fn monitored<F, Fut>(url: &str, work: F) -> anyhow::Result<Tally>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut mon = Command::new("redis-cli")
        .args(["-u", url, "monitor"])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .context("spawn redis-cli monitor")?;
    let reader = BufReader::new(mon.stdout.take().context("stdout")?);
    let (seen_ok, ok) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let mut t = Tally::default();
        for line in reader.lines().map_while(Result::ok) {
            if line == "OK" {
                let _ = seen_ok.send(());
                continue;
            }
            if let Some(cmd) = command_of(&line) {
                *t.0.entry(cmd).or_default() += 1;
            }
        }
        t
    });
    ok.recv_timeout(Duration::from_secs(10))
        .context("redis-cli monitor did not start")?;
    let result = work().await;
    // Let the last commands' lines arrive before the count is taken.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = mon.kill();
    let _ = mon.wait();
    let tally = thread
        .join()
        .map_err(|_| anyhow::anyhow!("the MONITOR reader panicked"))?;
    result?;
    Ok(tally)
}

/// Round trips per call: MONITOR over `n` sequential calls, minus the same
/// stretch of an idle system (the worker's and throttler's background loops).
async fn count_round_trips(
    url: &str,
    c: &Client,
    key: &str,
    tiny: &str,
    n: usize,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let sync = monitored(url, || async {
        sequential(c, key, n, false, 200).await.map(|_| ())
    })
    .await?;
    let took = t0.elapsed();
    let idle = monitored(url, || async {
        tokio::time::sleep(took.saturating_sub(Duration::from_millis(300))).await;
        Ok(())
    })
    .await?;
    let denied = monitored(url, || async {
        sequential(c, tiny, n, false, 429).await.map(|_| ())
    })
    .await?;
    let per = |t: &Tally, sub: Option<&Tally>| {
        let mut out = BTreeMap::new();
        for (k, v) in &t.0 {
            let idle = sub.and_then(|s| s.0.get(k)).copied().unwrap_or(0);
            let d = *v as f64 - idle as f64;
            if d / n as f64 >= 0.05 {
                out.insert(k.clone(), d / n as f64);
            }
        }
        out
    };
    let print = |what: &str, m: BTreeMap<String, f64>| {
        let total: f64 = m.values().sum();
        println!("{what}: {total:.1} client commands per call");
        for (k, v) in m {
            println!("  {v:>5.2}  {k}");
        }
    };
    println!();
    println!("Redis round trips ({n} sequential calls under MONITOR; idle background subtracted from the sync calls):");
    print("sync call (200)", per(&sync, Some(&idle)));
    let idle_total: u64 = idle.0.values().sum();
    println!(
        "  (idle background over the same {:.1} s: {idle_total} commands)",
        took.as_secs_f64()
    );
    print("429 (budget exhausted)", per(&denied, None));
    // Async submits: the api's commands answer the 202; the jobs then run in
    // the background (their worker and throttle commands are counted too,
    // under their own names).
    let submitted = monitored(url, || async {
        sequential(c, key, n, true, 202).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(())
    })
    .await?;
    print(
        "async submit (202) and its job",
        per(&submitted, Some(&idle)),
    );
    Ok(())
}

/// Waits (at most 120 s) until the bench operation's queue has been empty for
/// a second: the jobs of the async submits have run.
async fn drained(url: &str, prefix: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let queue = format!("{prefix}:v1:{{q:bench}}:queue");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut empty_since: Option<Instant> = None;
    while Instant::now() < deadline {
        let n: u64 = redis::cmd("LLEN")
            .arg(&queue)
            .query_async(&mut conn)
            .await?;
        match (n, empty_since) {
            (0, Some(t)) if t.elapsed() >= Duration::from_secs(1) => return Ok(()),
            (0, None) => empty_since = Some(Instant::now()),
            (0, Some(_)) => {}
            _ => empty_since = None,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("the bench queue did not drain within 120 s")
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let (dir, config) = crate::bench_config("api", CONFIG)?;
    println!(
        "tollgate all, POST /v1/ops/bench (cost 1, built-in mock provider, throttle never dry), \
         tollgate-client (no retries, an Idempotency-Key per call) on keep-alive connections to 127.0.0.1, worker --concurrency {}",
        args.concurrency
    );
    println!("| mode | call | clients | calls | p50 | p99 | calls/s |");
    println!("|---|---|---:|---:|---:|---:|---:|");

    let current = workspace_bin("tollgate");
    let mut builds = Vec::new();
    if let Some(b) = &args.baseline {
        builds.push(("baseline ", b.clone()));
    }
    builds.push(("", current));
    for (label, bin) in &builds {
        let all = All::start(bin, &config, args.concurrency, None)?;
        measure(&format!("{label}embedded"), &all, &args).await?;
    }
    for (label, bin) in &builds {
        let server = RedisServer::start();
        let prefix = random_prefix();
        let all = All::start(
            bin,
            &config,
            args.concurrency,
            Some((&server.url(), &prefix)),
        )?;
        let (c, tiny) = measure(&format!("{label}Redis"), &all, &args).await?;
        // The async jobs finish before the round trips are counted.
        drained(&server.url(), &prefix).await?;
        println!();
        println!("{label}{}:", bin.display());
        count_round_trips(&server.url(), &c, &all.key, &tiny, args.counted).await?;
        println!();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::command_of;

    #[test]
    fn monitor_lines_are_named_by_library_and_script() {
        let line = |args: &str| format!("1700000000.123456 [0 127.0.0.1:53422] {args}");
        assert_eq!(
            command_of(&line(
                r#""FCALL" "tollgate_job_0123456789abcdef_job_enqueue" "3" "k""#
            )),
            Some("FCALL job job_enqueue".into())
        );
        assert_eq!(
            command_of(&line(
                r#""FCALL" "tollgate_budget_0123456789abcdef_charge" "9""#
            )),
            Some("FCALL budget charge".into())
        );
        assert_eq!(
            command_of(&line(r#""EVALSHA" "abc" "1" "{u:dev}:events""#)),
            Some("EVALSHA u:*:events".into())
        );
        assert_eq!(
            command_of("1700000000.1 [0 lua] \"HGET\" \"k\" \"f\""),
            None
        );
        assert_eq!(
            command_of(&line(r#""blmove" "a" "b""#)),
            Some("BLMOVE".into())
        );
    }
}
