//! The streaming bench: what relaying a stream through tollgate costs. One
//! `tollgate mock-provider` (its events stamped with their send time,
//! `--stamp-events`) serves four targets: itself directly (twice: the second
//! series is the A/A noise), `tollgate all` embedded and `tollgate all` on a
//! private redis-server, both through `/v1/passthrough/openai/chat/completions`.
//! Rounds run the targets in a rotating order, streams one after another.
//!
//! Per target: time to first token (request sent to first `data:` event read)
//! and each event's delay (read time minus the mock's stamp; one clock, one
//! machine), p50 and p99. Then Redis memory per open stream: many streams at
//! once, `MEMORY USAGE` of each stream key mid-way, and `used_memory` before
//! and during.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde_json::json;
use tollgate_tests::process::{banner_value, Procs};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::stats::Samples;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The `tollgate` binary to run (mock and `all`; e.g. a release build);
    /// default: the one built with the bench.
    #[arg(long)]
    bin: Option<PathBuf>,
    /// Rounds; each runs every target once, in a rotating order.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Streams per target and round, one after another.
    #[arg(long, default_value_t = 20)]
    streams: usize,
    /// Words of each prompt (the answer has 3 more tokens, one event each).
    #[arg(long, default_value_t = 30)]
    words: usize,
    /// The mock's pace: ms between two events.
    #[arg(long, default_value_t = 5)]
    token_interval_ms: u64,
    /// Streams open at once for the memory measure (on Redis).
    #[arg(long, default_value_t = 50)]
    open_streams: usize,
    /// Another `tollgate` binary (e.g. the release build of an earlier
    /// commit): its `all`, embedded and on Redis (the same redis-server,
    /// another key prefix), join the rounds as two more targets, so that both
    /// builds are measured in one session, in the same rotation.
    #[arg(long)]
    baseline: Option<PathBuf>,
}

const TARGETS: [&str; 6] = [
    "direct",
    "direct (A/A)",
    "embedded",
    "redis",
    "embedded (base)",
    "redis (base)",
];

fn config(mock: &str) -> String {
    format!(
        r#"
default_plan = "big"
[plans.big]
limit = 100000000
window = "1h"
[providers.openai]
rate = 100000
burst = 10000
max_wait = "10s"
url = "{mock}/v1"
retries = 0
[operations."openai.chat"]
cost = 1
provider = "openai"
path = "/chat/completions"
"#
    )
}

fn unix_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// One stream's time to its first event, and each event's delay.
struct Sample {
    ttft: Duration,
    delays: Vec<Duration>,
    events: usize,
}

async fn one_stream(
    http: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    words: usize,
) -> anyhow::Result<Sample> {
    let prompt = vec!["w"; words].join(" ");
    let body = json!({"model": "m", "stream": true,
                      "messages": [{"role": "user", "content": prompt}]});
    let mut req = http.post(url).json(&body);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let sent = Instant::now();
    let mut r = req.send().await?;
    if r.status() != 200 {
        bail!(
            "{url}: {} {}",
            r.status(),
            r.text().await.unwrap_or_default()
        );
    }
    let (mut buf, mut ttft, mut delays, mut events, mut done) =
        (String::new(), None, Vec::new(), 0, false);
    while let Some(chunk) = r.chunk().await? {
        let (now_us, at) = (unix_us(), Instant::now());
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            if !event.contains("data: ") {
                continue;
            }
            events += 1;
            ttft.get_or_insert(at - sent);
            done |= event.contains("data: [DONE]");
            if let Some(stamp) = event
                .lines()
                .find_map(|l| l.strip_prefix(": sent_us="))
                .and_then(|s| s.parse::<u128>().ok())
            {
                let us = u64::try_from(now_us.saturating_sub(stamp)).unwrap_or(u64::MAX);
                delays.push(Duration::from_micros(us));
            }
        }
    }
    if !done || delays.is_empty() {
        bail!("{url}: a stream without [DONE] or stamps: {events} events");
    }
    Ok(Sample {
        ttft: ttft.unwrap_or_default(),
        delays,
        events,
    })
}

/// Starts `bin <args>` and reads its stdout until `pick` finds what it
/// wants (within 30 s); its stdout is drained after.
fn spawn_reading(
    bin: &std::path::Path,
    args: &[&str],
    pick: impl Fn(&[String]) -> bool,
) -> anyhow::Result<(Child, Vec<String>)> {
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let mut reader = BufReader::new(child.stdout.take().context("stdout")?);
    let (mut lines, deadline) = (Vec::new(), Instant::now() + Duration::from_secs(30));
    while !pick(&lines) {
        let mut line = String::new();
        if Instant::now() > deadline || reader.read_line(&mut line)? == 0 {
            let _ = child.kill();
            bail!("{} {args:?} printed only {lines:?}", bin.display());
        }
        lines.push(line.trim_end().to_owned());
    }
    std::thread::spawn(move || for _ in reader.lines() {});
    Ok((child, lines))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    tollgate_providers::http::install_crypto_provider();
    let interval = args.token_interval_ms.to_string();
    let bin = args
        .bin
        .clone()
        .unwrap_or_else(|| workspace_bin("tollgate"));
    let (mock_child, lines) = spawn_reading(
        &bin,
        &[
            "mock-provider",
            "--listen",
            "127.0.0.1:0",
            "--rate",
            "100000",
            "--burst",
            "10000",
            "--token-interval-ms",
            &interval,
            "--stamp-events",
        ],
        |l| !l.is_empty(),
    )?;
    let mock = format!(
        "http://{}",
        lines[0]
            .strip_prefix("listening on ")
            .context("the mock's address")?
    );
    let dir = std::env::temp_dir().join(format!("tollgate-bench-stream-{}", random_prefix()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("stream.toml");
    std::fs::write(&path, config(&mock))?;
    let path = path.to_str().context("config path")?.to_owned();
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let all = |bin: &std::path::Path, extra: &[&str]| {
        let mut a = vec!["all", "--listen", "127.0.0.1:0", "--config", &path];
        a.extend_from_slice(extra);
        let (child, lines) = spawn_reading(bin, &a, |l| l.iter().any(|l| l.contains("/v1/usage")))?;
        let base = banner_value(&lines, "listening on ");
        let key = banner_value(&lines, "Bearer ");
        let admin = banner_value(&lines, "admin token: ");
        anyhow::Ok((child, base, key, admin))
    };
    let (emb_child, emb, emb_key, _) = all(&bin, &[])?;
    let redis_url = redis.url();
    let (red_child, red, red_key, red_admin) =
        all(&bin, &["--redis-url", &redis_url, "--key-prefix", &prefix])?;
    let mut procs = vec![mock_child, emb_child, red_child];
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let direct = format!("{mock}/v1/chat/completions");
    let through = |base: &str| format!("{base}/v1/passthrough/openai/chat/completions");
    let mut targets: Vec<(String, Option<String>)> = vec![
        (direct.clone(), None),
        (direct.clone(), None),
        (through(&emb), Some(emb_key.clone())),
        (through(&red), Some(red_key.clone())),
    ];
    if let Some(baseline) = &args.baseline {
        let base_prefix = random_prefix();
        let (c, url, key, _) = all(baseline, &[])?;
        procs.push(c);
        targets.push((through(&url), Some(key)));
        let (c, url, key, _) = all(
            baseline,
            &["--redis-url", &redis_url, "--key-prefix", &base_prefix],
        )?;
        procs.push(c);
        targets.push((through(&url), Some(key)));
        println!("baseline: {}", baseline.display());
    }
    let _procs = Procs(procs);
    let n = targets.len();
    println!(
        "stream bench ({}): {} rounds x {} streams per target, {} events per stream, {} ms apart; load average {}",
        bin.display(),
        args.rounds,
        args.streams,
        args.words + 3 + 3,
        args.token_interval_ms,
        load_average()
    );
    // Warm-up: connections, script loads, first jobs.
    for (url, key) in &targets {
        for _ in 0..3 {
            one_stream(&http, url, key.as_deref(), args.words).await?;
        }
    }
    let mut ttfts: Vec<Vec<Duration>> = vec![Vec::new(); n];
    let mut delays: Vec<Vec<Duration>> = vec![Vec::new(); n];
    let mut events = 0;
    for round in 0..args.rounds {
        for k in 0..n {
            let t = (round + k) % n;
            let (url, key) = &targets[t];
            for _ in 0..args.streams {
                let s = one_stream(&http, url, key.as_deref(), args.words).await?;
                ttfts[t].push(s.ttft);
                delays[t].extend(s.delays);
                events = s.events;
            }
        }
    }
    println!("{events} data events per stream (tokens, the role and stop chunks, [DONE])");
    println!(
        "{:<16} {:>10} {:>10} {:>14} {:>14} {:>10}",
        "target", "ttft p50", "ttft p99", "event p50", "event p99", "events"
    );
    let mut p50s = vec![(0.0, 0.0); n];
    for t in 0..n {
        let ttft = Samples::new(ttfts[t].clone());
        let n = delays[t].len();
        let delay = Samples::new(delays[t].clone());
        p50s[t] = (ms(ttft.median()), ms(delay.median()));
        println!(
            "{:<16} {:>8.2}ms {:>8.2}ms {:>12.3}ms {:>12.3}ms {:>10}",
            TARGETS[t],
            ms(ttft.median()),
            ms(ttft.pct(99.0)),
            ms(delay.median()),
            ms(delay.pct(99.0)),
            n
        );
    }
    let base = p50s[0];
    for t in 1..n {
        println!(
            "added over direct at p50, {:<16} first token {:+.2} ms, per event {:+.3} ms",
            TARGETS[t],
            p50s[t].0 - base.0,
            p50s[t].1 - base.1
        );
    }
    // A user may have 32 streams open on a pod (the default plan's
    // `max_open_streams`): the streams are spread over enough users.
    let mut keys = vec![red_key.clone()];
    for i in 1..args.open_streams.div_ceil(32) {
        let r = http
            .post(format!("{red}/admin/users"))
            .bearer_auth(&red_admin)
            .json(&json!({"user": format!("bench-stream-{i}")}))
            .send()
            .await?;
        let v: serde_json::Value = r.error_for_status()?.json().await?;
        keys.push(v["api_key"].as_str().context("an api key")?.to_owned());
    }
    memory(&args, &http, &through(&red), &keys, &redis, &prefix).await?;
    println!("load average at the end: {}", load_average());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Redis memory per open stream: `open_streams` at once on Redis, each
/// stream key's `MEMORY USAGE` and length mid-way, `used_memory` before and
/// then.
async fn memory(
    args: &Args,
    http: &reqwest::Client,
    url: &str,
    keys: &[String],
    redis: &RedisServer,
    prefix: &str,
) -> anyhow::Result<()> {
    let client = redis::Client::open(redis.url())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let used = |info: String| {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse::<i64>().ok())
            .unwrap_or(0)
    };
    let before: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await?;
    let before = used(before);
    let words = args.words;
    let tasks: Vec<_> = (0..args.open_streams)
        .map(|i| {
            let key = keys[i % keys.len()].clone();
            let (http, url) = (http.clone(), url.to_owned());
            tokio::spawn(async move { one_stream(&http, &url, Some(&key), words).await })
        })
        .collect();
    // Mid-way through the streams.
    let events = u64::try_from(args.words + 6).unwrap_or(u64::MAX);
    tokio::time::sleep(Duration::from_millis(
        args.token_interval_ms * events / 2 + 50,
    ))
    .await;
    let during: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await?;
    let during = used(during);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*:stream:*"))
        .query_async(&mut conn)
        .await?;
    let (mut bytes, mut entries) = (Vec::new(), Vec::new());
    for k in &keys {
        let b: Option<i64> = tollgate_tests::redis_info::memory_usage(&mut conn, k).await?;
        let n: i64 = redis::cmd("XLEN").arg(k).query_async(&mut conn).await?;
        if let Some(b) = b {
            bytes.push(b);
            entries.push(n);
        }
    }
    for t in tasks {
        t.await??;
    }
    let avg = |v: &[i64]| v.iter().sum::<i64>() as f64 / v.len().max(1) as f64;
    println!(
        "memory: {} streams open at once, {} stream keys seen mid-way: {:.0} bytes and {:.1} entries per stream key on average (max {} bytes); used_memory {:+} bytes ({:+.0} per open stream, job records included)",
        args.open_streams,
        keys.len(),
        avg(&bytes),
        avg(&entries),
        bytes.iter().max().copied().unwrap_or(0),
        during - before,
        (during - before) as f64 / args.open_streams.max(1) as f64,
    );
    if let (Some(&b), Some(&n)) = (bytes.iter().max(), entries.iter().max()) {
        if n > 0 {
            println!(
                "  bound: MAXLEN {} entries, about {:.0} KB per stream of such events ({:.0} bytes per entry)",
                tollgate_core::stream::STREAM_CAPACITY,
                b as f64 / n as f64 * tollgate_core::stream::STREAM_CAPACITY as f64 / 1024.0,
                b as f64 / n as f64
            );
        }
    }
    Ok(())
}
