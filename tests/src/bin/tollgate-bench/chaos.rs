//! `tollgate-bench chaos`: a deployment in processes (2 api, 2 throttlers, 3
//! workers on one Redis with AOF, a recording upstream served from here) under
//! a steady, bounded load while faults drawn from a seed hit it: kill -9 and
//! restart of any role, SIGSTOP past a lease, killed Redis connections, a
//! flushed script cache, Redis down and back from its AOF, and on the proxy
//! through which every role reaches Redis: latency added each way, or every
//! connection cut and new ones refused for a while. Part of the load is
//! streamed pass-through calls ([`STREAMS`]) whose clients read them whole or
//! go away mid-stream. Then the load stops,
//! the deployment drains, and the invariants are checked and printed with their
//! figures; the run fails (naming its seed) if one does not hold.
//!
//! Redis runs with AOF as production would (`appendonly yes`), fsynced every
//! second (Redis's default) or, with `--durable`, on every write
//! (`appendfsync always`, every role with `--durability fsync`): only then must
//! no call answered 200/202 vanish when Redis is SIGKILLed. (A SIGKILL loses
//! only what Redis had not yet written to the kernel, which `everysec` may
//! postpone while an fsync is slow; a power cut loses the page cache too.)
//!
//! The same seed gives the same fault schedule and the same calls; what the
//! processes do in between is up to the machine, so a failure is a lead to
//! replay, not a guaranteed reproduction.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::Client;
use serde_json::{json, Value};
use tollgate_tests::jobs::idempotent_job_id as job_id;
use tollgate_tests::proxy::FaultProxy;
use tollgate_tests::upstream::{Limit, Upstream};
use tollgate_tests::{random_prefix, slowlog, workspace_bin, RedisServer};

use crate::waits;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long the load runs, in seconds; faults fall inside it.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seeds of the runs, comma-separated (one fresh deployment each), or
    /// `random`.
    #[arg(long, default_value = "1", value_delimiter = ',')]
    seed: Vec<String>,
    /// Calls per second the load offers, across its users.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Keep each run's directory (config, role logs, Redis AOF) even when it passes.
    #[arg(long)]
    keep: bool,
    /// Redis with `appendfsync always` and every role with `--durability
    /// fsync`: no accepted call may vanish when Redis is killed.
    #[arg(long)]
    durable: bool,
}

const ADMIN: &str = "chaos-admin-token-0123456789";
const USERS: usize = 4;
/// The user of a prepaid plan (`credits = "only"`): every charge draws on
/// its credit grants ([`GRANTS`]), which hold more than the load spends.
const PREPAID: usize = 3;
/// Its grants: amount, and expiry (seconds from the start; 0: none).
const GRANTS: [(u64, u64); 3] = [(4_000_000, 0), (3_000_000, 7200), (3_000_000, 3600)];
/// The worker's job lease; SIGSTOP lasts longer than this.
const WORKER_LEASE_MS: u64 = 3000;
/// How long a throttler's popped tickets stay its own once it stops renewing
/// its liveness (its default).
const THROTTLER_LIVENESS_MS: u64 = 3000;
/// How long calls keep being retried, and jobs awaited, after the load stops.
const DRAIN: Duration = Duration::from_secs(60);

/// A provider of the generated config: its throttle, and the upstream's own
/// limit on its path, looser than the throttle by a margin for network jitter.
struct Provider {
    name: &'static str,
    rate: f64,
    burst: u64,
}

const PROVIDERS: [Provider; 2] = [
    Provider {
        name: "llm",
        rate: 8.0,
        burst: 4,
    },
    Provider {
        name: "emb",
        rate: 16.0,
        burst: 8,
    },
];

/// The provider of the generated config with several limits: a request
/// limit and a token limit over one window of `per`, and a cap on the calls in
/// flight. Its calls weigh their `max_tokens` (or `DEFAULT_WEIGHT`), the
/// upstream reports half to all of it as their usage, and takes 100 to 500 ms
/// over each, so that the cap binds.
struct Limited {
    name: &'static str,
    /// Calls in any window of `per`.
    requests: u64,
    /// Reported tokens in any window of `per`.
    tokens: u64,
    /// The token limit's burst: the most it grants at once.
    token_burst: u64,
    per_s: u64,
    max_concurrent: usize,
}

const LIMITED: Limited = Limited {
    name: "tok",
    requests: 14,
    tokens: 1000,
    token_burst: 300,
    per_s: 2,
    max_concurrent: 2,
};

/// A `tok.call` without `max_tokens` weighs this (its operation's `weight.default`).
const DEFAULT_WEIGHT: u64 = 100;
/// The heaviest `max_tokens` the load sends.
const MAX_WEIGHT: u64 = 250;

impl Limited {
    /// The request bucket these limits make (config.rs, `request_bucket`):
    /// a tenth of the limit as its burst, refilled so that
    /// `burst + rate * per + 1 = requests` (a grant used at most 1/rate late).
    fn request_bucket(&self) -> (f64, u64) {
        let burst = (self.requests / 10).max(1);
        let rate = (self.requests - burst - 1) as f64 / self.per_s as f64;
        (rate, burst)
    }
}

/// An operation of the generated config.
struct Op {
    name: &'static str,
    provider: &'static str,
    cost: u64,
}

const OPS: [Op; 4] = [
    Op {
        name: "llm.call",
        provider: "llm",
        cost: 8,
    },
    Op {
        name: "llm.cheap",
        provider: "llm",
        cost: 2,
    },
    Op {
        name: "emb.call",
        provider: "emb",
        cost: 1,
    },
    Op {
        name: "tok.call",
        provider: "tok",
        cost: 3,
    },
];

/// The streamed pass-through calls: an operation at `/chat/completions` (an
/// OpenAI-style upstream that reports a stream's usage only when asked: the
/// worker asks on the client's behalf) of their own provider, settled to the
/// usage the stream reports, reserving `max` up front.
struct Streams {
    provider: &'static str,
    operation: &'static str,
    /// The operation's estimate (`cost`): what a stream whose usage was
    /// never seen was charged before it stood at its reservation.
    cost: u64,
    /// `settle.max`: the reservation.
    max: u64,
    /// The usage the upstream reports for a stream: from `usage.0` to `usage.1`.
    usage: (u64, u64),
    /// Percent of the load's calls that are streamed.
    percent: u64,
}

const STREAMS: Streams = Streams {
    provider: "sse",
    operation: "sse.chat",
    cost: 2,
    max: 400,
    usage: (20, 300),
    percent: 15,
};

fn config(upstream: &str) -> String {
    let mut out = String::from(
        "default_plan = \"chaos\"\nhold_grace = \"2s\"\n\
         [export]\nmaxlen = 1000000\n\
         [plans.chaos]\nlimit = 100000000\nwindow = \"1h\"\n\
         [plans.prepaid]\nlimit = 100000000\nwindow = \"1h\"\ncredits = \"only\"\n",
    );
    for p in &PROVIDERS {
        let _ = write!(
            out,
            "[providers.{n}]\nrate = {r}\nburst = {b}\nmax_wait = \"8s\"\n\
             url = \"{upstream}\"\ntimeout = \"3s\"\nretries = 1\n",
            n = p.name,
            r = p.rate,
            b = p.burst,
        );
    }
    let l = &LIMITED;
    let _ = write!(
        out,
        "[providers.{n}]\nlimits = [{{ rate = {r}, per = \"{p}s\" }}, \
         {{ tokens = {t}, per = \"{p}s\", burst = {b} }}]\nmax_concurrent = {c}\n\
         usage = \"/usage/total_tokens\"\nmax_wait = \"8s\"\n\
         url = \"{upstream}\"\ntimeout = \"3s\"\nretries = 1\n",
        n = l.name,
        r = l.requests,
        t = l.tokens,
        b = l.token_burst,
        p = l.per_s,
        c = l.max_concurrent,
    );
    for o in &OPS {
        let _ = write!(
            out,
            "[operations.\"{n}\"]\ncost = {c}\nprovider = \"{p}\"\npath = \"/{p}\"\n\
             deadline = \"10s\"\nmax_attempts = 3\n",
            n = o.name,
            c = o.cost,
            p = o.provider,
        );
        if o.provider == LIMITED.name {
            let _ = writeln!(
                out,
                "weight = {{ from = \"/max_tokens\", default = {DEFAULT_WEIGHT} }}"
            );
        }
    }
    // The streams' provider: no limit of its own at the upstream; a timeout
    // that holds a whole stream (it bounds the body as well).
    let s = &STREAMS;
    let _ = write!(
        out,
        "[providers.{p}]\nrate = 4\nburst = 4\nmax_wait = \"8s\"\n\
         url = \"{upstream}/{p}\"\ntimeout = \"10s\"\nretries = 1\n\
         [operations.\"{n}\"]\ncost = {c}\nprovider = \"{p}\"\npath = \"/chat/completions\"\n\
         settle = {{ from = \"/usage/total_tokens\", per = 1, max = {m} }}\n\
         deadline = \"10s\"\nmax_attempts = 3\n",
        p = s.provider,
        n = s.operation,
        c = s.cost,
        m = s.max,
    );
    out
}

/// splitmix64: small, seedable, and enough to draw a schedule.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Fault {
    KillApi,
    KillThrottler,
    KillWorker,
    StopThrottler,
    StopWorker,
    KillPubsubClients,
    KillNormalClients,
    ScriptFlush,
    RedisDown,
    ProxyLatency,
    ProxyDrop,
}

const FAULTS: [Fault; 11] = [
    Fault::KillApi,
    Fault::KillThrottler,
    Fault::KillWorker,
    Fault::StopThrottler,
    Fault::StopWorker,
    Fault::KillPubsubClients,
    Fault::KillNormalClients,
    Fault::ScriptFlush,
    Fault::RedisDown,
    Fault::ProxyLatency,
    Fault::ProxyDrop,
];

/// One fault of the schedule: when, what, on which process of its role, for
/// how long, and the latency it adds (`ProxyLatency` only).
#[derive(Debug, Clone)]
struct Planned {
    at: Duration,
    fault: Fault,
    target: u64,
    length: Duration,
    latency: Duration,
}

/// Every kind once in a seeded order, 2.5 to 4.5 s apart (so that 60 s of load
/// holds them all), then seeded picks 2.5 to 5.5 s apart, from 4 s into the
/// load until 8 s before its end.
fn schedule(seed: u64, seconds: u64) -> Vec<Planned> {
    let mut rng = Rng(seed);
    let mut kinds = FAULTS.to_vec();
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let end = Duration::from_secs(seconds.saturating_sub(8));
    let mut at = Duration::from_secs(4);
    let mut out = Vec::new();
    while at < end {
        let fault = kinds
            .pop()
            .unwrap_or(FAULTS[rng.below(FAULTS.len() as u64) as usize]);
        let length = match fault {
            Fault::RedisDown => rng.ms(5_000, 15_000),
            Fault::StopWorker => rng.ms(WORKER_LEASE_MS + 1_000, WORKER_LEASE_MS + 4_000),
            Fault::StopThrottler => {
                rng.ms(THROTTLER_LIVENESS_MS + 1_000, THROTTLER_LIVENESS_MS + 4_000)
            }
            Fault::ProxyLatency => rng.ms(3_000, 10_000),
            // How long new connections are refused after the cut.
            Fault::ProxyDrop => rng.ms(500, 5_000),
            // How long a killed process stays down.
            _ => rng.ms(200, 2_000),
        };
        let latency = if fault == Fault::ProxyLatency {
            rng.ms(50, 400)
        } else {
            Duration::ZERO
        };
        out.push(Planned {
            at,
            fault,
            target: rng.next(),
            length,
            latency,
        });
        at += if kinds.is_empty() {
            rng.ms(2_500, 5_500)
        } else {
            rng.ms(2_500, 4_500)
        };
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Api,
    Throttler,
    Worker,
}

/// One `tollgate` process of the deployment. `busy` is held while the suite
/// acts on it, so that faults do not overlap on one process and the watchdog
/// does not mistake a kill of the suite's for a crash.
struct Proc {
    role: Role,
    name: String,
    args: Vec<String>,
    api: Option<SocketAddr>,
    child: Mutex<Option<Child>>,
    busy: tokio::sync::Mutex<()>,
    crashes: AtomicU32,
}

struct Deployment {
    dir: PathBuf,
    /// `--durability` of every role.
    durability: &'static str,
    prefix: String,
    /// Redis itself, for the suite's own commands and checks.
    redis_url: String,
    redis: Arc<Mutex<RedisServer>>,
    /// Held while Redis is down (and by faults that need it up).
    redis_busy: tokio::sync::Mutex<()>,
    /// Between every role and Redis.
    proxy: FaultProxy,
    /// Held while the proxy adds latency (one latency at a time).
    latency_busy: tokio::sync::Mutex<()>,
    procs: Vec<Proc>,
    /// Seconds each api took to answer /readyz after each Redis return.
    ready_after: Mutex<Vec<f64>>,
}

impl Deployment {
    fn spawn(&self, p: &Proc) -> anyhow::Result<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", p.name)))?;
        Command::new(workspace_bin("tollgate"))
            .args(&p.args)
            .env("TOLLGATE_REDIS_URL", self.proxy.url())
            .env("TOLLGATE_KEY_PREFIX", &self.prefix)
            .env("TOLLGATE_CONFIG", self.dir.join("chaos.toml"))
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .env("TOLLGATE_DURABILITY", self.durability)
            // JSON, with every wait for a slot traced: the waits' check reads them.
            .env("TOLLGATE_LOG_FORMAT", "json")
            .env(
                "RUST_LOG",
                format!("warn,{}=debug", tollgate_providers::WAIT_TARGET),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawn {}", p.name))
    }

    async fn start(&self, p: &Proc, http: &Client) -> anyhow::Result<()> {
        let child = self.spawn(p)?;
        if let Ok(mut slot) = p.child.lock() {
            *slot = Some(child);
        }
        if let Some(addr) = p.api {
            wait_status(
                http,
                &format!("http://{addr}/healthz"),
                Duration::from_secs(15),
            )
            .await
            .with_context(|| format!("{} did not come up", p.name))?;
        }
        Ok(())
    }

    fn pid(p: &Proc) -> Option<u32> {
        p.child.lock().ok()?.as_ref().map(Child::id)
    }

    fn kill9(p: &Proc) {
        if let Ok(mut slot) = p.child.lock() {
            if let Some(mut c) = slot.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    fn of(&self, role: Role) -> Vec<&Proc> {
        self.procs.iter().filter(|p| p.role == role).collect()
    }

    fn apis(&self) -> Vec<SocketAddr> {
        self.procs.iter().filter_map(|p| p.api).collect()
    }
}

impl Deployment {
    /// Kills every process (resumed first if stopped) and Redis.
    fn shutdown(&self) {
        for p in &self.procs {
            if let Some(pid) = Deployment::pid(p) {
                signal(pid, "-CONT");
            }
            Deployment::kill9(p);
        }
        if let Ok(mut r) = self.redis.lock() {
            r.stop();
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

async fn wait_status(http: &Client, url: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        match http.get(url).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            other if Instant::now() >= deadline => bail!("{url}: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// One Redis command on a fresh connection (the old ones may be gone with a
/// restarted server), bounded in time.
async fn redis_cmd<T: redis::FromRedisValue>(url: &str, cmd: &redis::Cmd) -> anyhow::Result<T> {
    let client = redis::Client::open(url)?;
    let work = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        cmd.query_async::<T>(&mut conn).await
    };
    Ok(tokio::time::timeout(Duration::from_secs(3), work).await??)
}

/// What the suite did, for the report.
#[derive(Default)]
struct FaultLog {
    done: BTreeMap<Fault, u32>,
    skipped: BTreeMap<Fault, u32>,
    lines: Vec<String>,
    /// (start, end) in µs of the faults that can come between a provider
    /// call and the record of its result (a worker killed or stopped, Redis
    /// down, connections cut, a slow link past a lease): a job run again after
    /// one of them is the at-least-once delivery the design accepts, paid by
    /// its one charge.
    interrupting: Vec<(u64, u64)>,
    /// When each latency the suite added to the link ended (µs), and how much
    /// it was: see [`worst_interval_net`].
    latency_ends: Vec<(u64, Duration)>,
    /// Per process: when the suite paused it, and when it was killed or
    /// found dead (the waits' excuses, see [`waits::judge`]).
    procs: HashMap<String, waits::Faults>,
}

/// Whether `fault` can come between a call and the record of its result.
fn interrupts_recording(fault: Fault) -> bool {
    matches!(
        fault,
        Fault::KillWorker
            | Fault::StopWorker
            | Fault::RedisDown
            | Fault::KillNormalClients
            | Fault::ProxyLatency
            | Fault::ProxyDrop
    )
}

/// Seconds each api takes to answer /readyz from now (Redis just came back, or
/// the link to it), recorded for the check. While the suite partitions the
/// link, Redis is not back for the roles: the clock starts again at its end.
async fn time_readiness(d: &Deployment, http: &Client) -> Vec<f64> {
    let mut back = Instant::now();
    let mut readiness = Vec::new();
    for p in d.of(Role::Api) {
        // An api being killed right now is not the one to time.
        let Ok(_busy) = p.busy.try_lock() else {
            continue;
        };
        let Some(addr) = p.api else { continue };
        let url = format!("http://{addr}/readyz");
        let give_up = Instant::now() + Duration::from_secs(20);
        let secs = loop {
            if d.proxy.partitioned() {
                back = Instant::now();
            }
            match http.get(&url).send().await {
                Ok(r) if r.status().is_success() => break back.elapsed().as_secs_f64(),
                _ if Instant::now() >= give_up => break f64::INFINITY,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        readiness.push(secs);
    }
    if let Ok(mut r) = d.ready_after.lock() {
        r.extend(&readiness);
    }
    readiness
}

/// The worst excess of calls at `times` (µs) over `burst + rate·t` in any
/// interval, then the worst net of what a drop of the link's latency explains,
/// with its interval's first and last call. When a latency `l` added by the
/// suite ends, the grants already on their way arrive together with the next
/// ones: up to `rate·l` more calls in an interval that meets
/// `[end, end + l + 0.5 s]`. (The bucket is in Redis; its grants cross the link
/// to the workers, and a drop of the link's delay compresses them.)
fn worst_interval_net(
    times: &[u64],
    rate: f64,
    burst: u64,
    latency_ends: &[(u64, Duration)],
) -> (f64, f64, u64, u64) {
    let mut t = times.to_vec();
    t.sort_unstable();
    let explained = |a: u64, b: u64| {
        latency_ends
            .iter()
            .filter(|&&(end, l)| b >= end && a <= end + l.as_micros() as u64 + 500_000)
            .map(|&(_, l)| rate * l.as_secs_f64())
            .fold(0.0, f64::max)
    };
    let (mut raw, mut net) = (0.0_f64, (0.0, 0, 0));
    for i in 0..t.len() {
        for j in i..t.len() {
            let span = (t[j] - t[i]) as f64 / 1e6;
            let excess = (j - i + 1) as f64 - (burst as f64 + rate * span);
            raw = raw.max(excess);
            let excess = if excess > 1.0 {
                excess - explained(t[i], t[j])
            } else {
                excess
            };
            if excess > net.0 {
                net = (excess, t[i], t[j]);
            }
        }
    }
    (raw, net.0, net.1, net.2)
}

fn rounded(secs: &[f64]) -> Vec<f64> {
    secs.iter().map(|s| (s * 10.0).round() / 10.0).collect()
}

async fn inject(d: Arc<Deployment>, http: Client, plan: Planned, log: Arc<Mutex<FaultLog>>) {
    let role = match plan.fault {
        Fault::KillApi => Some(Role::Api),
        Fault::KillThrottler | Fault::StopThrottler => Some(Role::Throttler),
        Fault::KillWorker | Fault::StopWorker => Some(Role::Worker),
        _ => None,
    };
    let began_us = tollgate_tests::throttle::now_us();
    let note = |done: bool, what: String| {
        if let Ok(mut l) = log.lock() {
            if done && interrupts_recording(plan.fault) {
                l.interrupting
                    .push((began_us, tollgate_tests::throttle::now_us()));
            }
            *if done { &mut l.done } else { &mut l.skipped }
                .entry(plan.fault)
                .or_default() += 1;
            l.lines.push(format!(
                "  {:>6.1}s {:?} {what}{}",
                plan.at.as_secs_f64(),
                plan.fault,
                if done { "" } else { " (skipped)" }
            ));
        }
    };
    let ms = plan.length.as_millis();
    if let Some(role) = role {
        let procs = d.of(role);
        let p = procs[(plan.target % procs.len() as u64) as usize];
        let Ok(_busy) = p.busy.try_lock() else {
            return note(false, format!("{}: busy with another fault", p.name));
        };
        let Some(pid) = Deployment::pid(p) else {
            return note(false, format!("{}: not running", p.name));
        };
        match plan.fault {
            Fault::StopThrottler | Fault::StopWorker => {
                let stopped = tollgate_tests::throttle::now_us();
                signal(pid, "-STOP");
                tokio::time::sleep(plan.length).await;
                signal(pid, "-CONT");
                if let Ok(mut l) = log.lock() {
                    let resumed = tollgate_tests::throttle::now_us();
                    let f = l.procs.entry(p.name.clone()).or_default();
                    f.paused.push((stopped, resumed));
                }
                note(true, format!("{} stopped {ms} ms", p.name));
            }
            _ => {
                Deployment::kill9(p);
                if let Ok(mut l) = log.lock() {
                    let f = l.procs.entry(p.name.clone()).or_default();
                    f.killed.push(tollgate_tests::throttle::now_us());
                }
                tokio::time::sleep(plan.length).await;
                match d.start(p, &http).await {
                    Ok(()) => note(true, format!("{} killed, restarted after {ms} ms", p.name)),
                    Err(e) => note(true, format!("{} killed; restart failed: {e:#}", p.name)),
                }
            }
        }
        return;
    }
    match plan.fault {
        Fault::ProxyLatency => {
            // A second latency planned meanwhile lands when this one ends.
            let _slow = d.latency_busy.lock().await;
            d.proxy.set_latency(plan.latency);
            tokio::time::sleep(plan.length).await;
            d.proxy.set_latency(Duration::ZERO);
            if let Ok(mut l) = log.lock() {
                l.latency_ends
                    .push((tollgate_tests::throttle::now_us(), plan.latency));
            }
            return note(
                true,
                format!("+{} ms each way for {ms} ms", plan.latency.as_millis()),
            );
        }
        Fault::ProxyDrop => {
            let open = d.proxy.cut_all(plan.length);
            tokio::time::sleep(plan.length).await;
            // The link's return is timed like Redis's, unless Redis is down
            // (or another Redis fault runs) or a later cut still partitions.
            let timed = match d.redis_busy.try_lock() {
                Ok(_redis) if !d.proxy.partitioned() => {
                    let secs = time_readiness(&d, &http).await;
                    format!("/readyz green after {:?} s", rounded(&secs))
                }
                _ => "readiness not timed (Redis busy or still partitioned)".into(),
            };
            return note(
                true,
                format!("{open} connections cut, new ones refused for {ms} ms; {timed}"),
            );
        }
        _ => {}
    }
    // A Redis fault planned while Redis is down lands as soon as it is back.
    let _redis = d.redis_busy.lock().await;
    let cmd = match plan.fault {
        Fault::KillPubsubClients => redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .to_owned(),
        Fault::KillNormalClients => redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .to_owned(),
        Fault::ScriptFlush => redis::cmd("SCRIPT").arg("FLUSH").to_owned(),
        _ => {
            let redis = Arc::clone(&d.redis);
            let stopped = tokio::task::spawn_blocking(move || {
                if let Ok(mut r) = redis.lock() {
                    r.stop();
                }
            })
            .await;
            tokio::time::sleep(plan.length).await;
            let redis = Arc::clone(&d.redis);
            let resumed = tokio::task::spawn_blocking(move || {
                if let Ok(mut r) = redis.lock() {
                    r.resume();
                }
            })
            .await;
            let readiness = time_readiness(&d, &http).await;
            let what = match (stopped, resumed) {
                (Ok(()), Ok(())) => format!(
                    "down {ms} ms; /readyz green after {:?} s",
                    rounded(&readiness)
                ),
                _ => "stop or resume panicked".into(),
            };
            return note(true, what);
        }
    };
    // The budget scripts are a function library: flushed with the scripts.
    if plan.fault == Fault::ScriptFlush {
        let functions = redis::cmd("FUNCTION").arg("FLUSH").to_owned();
        if let Err(e) = redis_cmd::<redis::Value>(&d.redis_url, &functions).await {
            return note(false, format!("FUNCTION FLUSH -> {e:#}"));
        }
    }
    match redis_cmd::<redis::Value>(&d.redis_url, &cmd).await {
        Ok(v) => note(true, format!("-> {v:?}")),
        Err(e) => note(false, format!("-> {e:#}")),
    }
}

/// Restarts, and counts, any process that exited while the suite was not acting on it.
async fn watchdog(d: Arc<Deployment>, http: Client, log: Arc<Mutex<FaultLog>>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        for p in &d.procs {
            let Ok(_busy) = p.busy.try_lock() else {
                continue;
            };
            let exited = p
                .child
                .lock()
                .ok()
                .and_then(|mut c| c.as_mut().map(|c| c.try_wait()))
                .is_some_and(|s| matches!(s, Ok(Some(_))));
            if exited {
                p.crashes.fetch_add(1, Ordering::SeqCst);
                if let Ok(mut l) = log.lock() {
                    let f = l.procs.entry(p.name.clone()).or_default();
                    f.killed.push(tollgate_tests::throttle::now_us());
                }
                eprintln!("chaos: {} exited on its own; restarting it", p.name);
                let _ = d.start(p, &http).await;
            }
        }
    }
}

/// One logical call of the load, retried with its Idempotency-Key until it has
/// an answer that is not a 503 or a timeout.
#[derive(Debug, Clone)]
struct Call {
    user: usize,
    op: usize,
    sync: bool,
    job_id: String,
    /// The final answer's status, or `None` if none came before the drain ended.
    status: Option<u16>,
    /// 503s, timeouts and connection errors retried.
    retries: u32,
    /// The api said another job id than the one the Idempotency-Key gives.
    id_mismatch: Option<String>,
    /// A streamed pass-through call ([`STREAMS`]): what its client read.
    stream: Option<StreamRead>,
}

impl Call {
    /// A call not answered yet, nor retried.
    fn new(user: usize, op: usize, sync: bool, job_id: String) -> Self {
        Self {
            user,
            op,
            sync,
            job_id,
            status: None,
            retries: 0,
            id_mismatch: None,
            stream: None,
        }
    }

    fn operation(&self) -> &'static str {
        match self.stream {
            Some(_) => STREAMS.operation,
            None => OPS[self.op].name,
        }
    }
}

/// A streamed call as its client read it.
#[derive(Debug, Clone, Default)]
struct StreamRead {
    /// The content chunks the upstream sends.
    chunks: u32,
    /// The client drops the connection after this many events (`None`: it
    /// reads to the end).
    drop_after: Option<u32>,
    /// `data:` events read.
    events: u32,
    /// It read `data: [DONE]`.
    done: bool,
    /// What it read was the whole answer (its text complete, `[DONE]` last).
    whole: bool,
    /// It read a usage chunk, or a `"usage"` member (it did not ask for either).
    saw_usage: bool,
    /// It dropped the connection mid-stream, as planned.
    dropped: bool,
    /// The stream ended with an error event.
    error: bool,
    /// The connection broke mid-stream (an api killed), or the stream stopped
    /// without an end.
    broke: bool,
    /// From the call's first attempt to the stream's end (µs since the epoch).
    span_us: (u64, u64),
}

struct User {
    name: String,
    key: String,
}

/// What every call of the load is sent with: the client, the api pods it
/// goes round, the users, the run's tag (the start of each Idempotency-Key)
/// and when to stop retrying.
#[derive(Clone)]
struct Load {
    http: Client,
    apis: Vec<SocketAddr>,
    users: Arc<Vec<User>>,
    run: String,
    give_up: Instant,
}

impl Load {
    /// Call `n`'s Idempotency-Key.
    fn key(&self, n: usize) -> String {
        format!("{}-{n}", self.run)
    }

    /// The api pod an attempt goes to: each in turn.
    fn api(&self, attempt: usize) -> SocketAddr {
        self.apis[attempt % self.apis.len()]
    }
}

async fn one_call(load: Load, n: usize, user: usize, op: usize, sync: bool, body: Value) -> Call {
    let key = load.key(n);
    let u = &load.users[user];
    let mut call = Call::new(user, op, sync, job_id(&u.name, &key));
    let mut attempt = n;
    while Instant::now() < load.give_up {
        let api = load.api(attempt);
        attempt += 1;
        let mut req = load
            .http
            .post(format!("http://{api}/v1/ops/{}", OPS[op].name))
            .bearer_auth(&u.key)
            .header("Idempotency-Key", &key)
            .json(&body)
            .timeout(Duration::from_secs(if sync { 15 } else { 5 }));
        if !sync {
            req = req.header("Prefer", "respond-async");
        }
        match req.send().await {
            Ok(r) if r.status().as_u16() != 503 => {
                let status = r.status().as_u16();
                let v: Value = r.json().await.unwrap_or(Value::Null);
                if let Some(id) = v["job_id"].as_str() {
                    if id != call.job_id {
                        call.id_mismatch = Some(id.to_owned());
                    }
                }
                call.status = Some(status);
                return call;
            }
            _ => {
                call.retries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    call
}

/// One streamed pass-through call of the load, `"stream": true` and no
/// `stream_options` (tollgate asks for the usage itself): retried with its
/// Idempotency-Key while no stream has begun (503, timeout, connection
/// error), then read to its end, or dropped after `drop_after` events.
async fn one_stream(load: Load, n: usize, user: usize, read: StreamRead, body: Value) -> Call {
    let key = load.key(n);
    let u = &load.users[user];
    let start = tollgate_tests::throttle::now_us();
    let mut call = Call::new(user, 0, true, job_id(&u.name, &key));
    let mut read = read;
    let mut attempt = n;
    while Instant::now() < load.give_up {
        let api = load.api(attempt);
        attempt += 1;
        let sent = load
            .http
            .post(format!(
                "http://{api}/v1/passthrough/{}/chat/completions",
                STREAMS.provider
            ))
            .bearer_auth(&u.key)
            .header("Idempotency-Key", &key)
            .json(&body)
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        let mut r = match sent {
            Ok(r) if r.status().as_u16() != 503 => r,
            _ => {
                call.retries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        call.status = Some(r.status().as_u16());
        let is_stream = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_stream {
            // An error before the stream began (a 502/504, a budget 429, or
            // a 409 for a retry of a stream given already).
            break;
        }
        let (mut buf, mut text) = (String::new(), String::new());
        'read: loop {
            match r.chunk().await {
                Ok(Some(bytes)) => buf.push_str(&String::from_utf8_lossy(&bytes)),
                Ok(None) => {
                    read.broke = !read.done && !read.error;
                    break;
                }
                Err(_) => {
                    read.broke = true;
                    break;
                }
            }
            while let Some(at) = buf.find("\n\n") {
                let event: String = buf.drain(..at + 2).collect();
                let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                    continue;
                };
                read.events += 1;
                if data == "[DONE]" {
                    read.done = true;
                    read.whole = text == tollgate_tests::upstream::streamed_text(read.chunks);
                    break 'read;
                }
                let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
                if v.get("error").is_some() {
                    read.error = true;
                    break 'read;
                }
                read.saw_usage |= v.get("usage").is_some();
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    text.push_str(t);
                }
                if read.drop_after.is_some_and(|k| read.events >= k) {
                    // Gone mid-stream: the connection closes with `r`.
                    read.dropped = true;
                    break 'read;
                }
            }
        }
        drop(r);
        break;
    }
    read.span_us = (start, tollgate_tests::throttle::now_us());
    call.stream = Some(read);
    call
}

/// The charges standing for a user: `used`, and the cost of each live
/// spend event by request id, every page of `/v1/usage`.
async fn charges(
    http: &Client,
    api: SocketAddr,
    key: &str,
) -> anyhow::Result<(u64, HashMap<String, u64>)> {
    let (mut used, mut costs, mut cursor) = (None, HashMap::new(), None::<String>);
    loop {
        let url = match &cursor {
            Some(c) => format!("http://{api}/v1/usage?limit=50&cursor={c}"),
            None => format!("http://{api}/v1/usage?limit=50"),
        };
        let v: Value = http.get(url).bearer_auth(key).send().await?.json().await?;
        used = used.or(v["used"].as_u64());
        for e in v["events"].as_array().into_iter().flatten() {
            if let (Some(id), Some(cost)) = (e["request_id"].as_str(), e["cost"].as_u64()) {
                *costs.entry(id.to_owned()).or_default() += cost;
            }
        }
        match v["next_cursor"].as_str() {
            Some(c) if Some(c) != cursor.as_deref() => cursor = Some(c.to_owned()),
            _ => break,
        }
    }
    Ok((used.unwrap_or(u64::MAX), costs))
}

/// A job's end as `GET /v1/jobs/{id}` says it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum JobEnd {
    Succeeded,
    /// The cause, and whether the charge stands (the upstream may have
    /// worked: the outcome policy keeps it).
    Failed(String, bool),
    Open(String),
    /// 404: never created (a call whose every answer was lost before the job existed).
    Missing,
}

async fn job_end(http: &Client, api: SocketAddr, key: &str, id: &str) -> Option<JobEnd> {
    let r = http
        .get(format!("http://{api}/v1/jobs/{id}"))
        .bearer_auth(key)
        .send()
        .await
        .ok()?;
    if r.status().as_u16() == 404 {
        return Some(JobEnd::Missing);
    }
    if !r.status().is_success() {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    Some(match v["status"].as_str()? {
        "succeeded" => JobEnd::Succeeded,
        "failed" => JobEnd::Failed(
            v["error"]["cause"].as_str().unwrap_or("?").to_owned(),
            v["error"]["charged"].as_bool().unwrap_or(false),
        ),
        other => JobEnd::Open(other.to_owned()),
    })
}

/// The prepaid user's balance after the run: what `GET .../credits` says
/// equals its grants less what it was charged (no charge left uncovered:
/// the grants hold more than the load spends), and equals the balance its
/// export alone rebuilds (`credits/history`: grants, draws, returns,
/// expiries, summed per grant).
async fn prepaid_check(
    http: &Client,
    api: SocketAddr,
    user: &str,
    used: u64,
) -> anyhow::Result<Check> {
    let get = |path: String| async move {
        let v: Value = http
            .get(format!("http://{api}/admin/users/{user}/credits{path}"))
            .bearer_auth(ADMIN)
            .send()
            .await?
            .json()
            .await?;
        anyhow::Ok(v)
    };
    let shown = get(String::new()).await?;
    let history = get("/history".into()).await?;
    let balance = shown["balance"].as_u64().context("balance")?;
    let mut rebuilt: BTreeMap<u64, i128> = BTreeMap::new();
    let mut uncovered = 0u64;
    for e in history["entries"].as_array().into_iter().flatten() {
        let amount = i128::from(e["amount"].as_u64().context("amount")?);
        let grant = e["grant"].as_u64().context("grant")?;
        let sign = match e["kind"].as_str() {
            Some("credit_grant" | "credit_return") => 1,
            Some("credit_draw" | "credit_expire") => -1,
            Some("credit_uncovered") => {
                uncovered += amount as u64;
                0
            }
            _ => 0,
        };
        *rebuilt.entry(grant).or_default() += sign * amount;
    }
    let granted: u64 = GRANTS.iter().map(|g| g.0).sum();
    let from_export: i128 = rebuilt.values().sum();
    let negative: Vec<_> = rebuilt.iter().filter(|(_, v)| **v < 0).collect();
    let ok = i128::from(balance) == from_export
        && negative.is_empty()
        && uncovered == 0
        && used != u64::MAX
        && balance == granted.saturating_sub(used);
    Ok(Check {
        name: "the prepaid user's balance = its grants - its charges = what its export rebuilds",
        ok,
        figure: format!(
            "balance {balance}, grants {granted} - used {used} = {}, rebuilt from {} history entries {from_export}; uncovered {uncovered}; grants below zero {negative:?}",
            granted.saturating_sub(used),
            history["entries"].as_array().map_or(0, Vec::len),
        ),
    })
}

/// Whether a job's end leaves its charge in the budget: it succeeded, or it
/// failed after the upstream may have worked.
fn paid(end: Option<&JobEnd>) -> bool {
    matches!(end, Some(JobEnd::Succeeded | JobEnd::Failed(_, true)))
}

/// The Redis keys of the deployment, each with its type, length and TTL.
struct KeyInfo {
    name: String,
    class: String,
    len: u64,
    ttl: i64,
}

/// `v1:{q:llm.call}:job:idem-..` -> `{q}:job`; `v1:apikey:..` -> `apikey`.
fn class_of(rest: &str) -> String {
    let rest = rest.strip_prefix("v1:").unwrap_or(rest);
    if let Some(tagged) = rest.strip_prefix('{') {
        let kind = tagged.chars().next().unwrap_or('?');
        let after = tagged.split_once("}:").map_or("", |(_, a)| a);
        let part = after.split(':').next().unwrap_or("");
        return format!("{{{kind}}}:{part}");
    }
    rest.split(':').next().unwrap_or("").to_owned()
}

async fn scan_keys(url: &str, prefix: &str) -> anyhow::Result<Vec<KeyInfo>> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    let mut names = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        names.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    let mut out = Vec::new();
    for name in names {
        let kind: String = redis::cmd("TYPE").arg(&name).query_async(&mut conn).await?;
        let len_cmd = match kind.as_str() {
            "list" => "LLEN",
            "hash" => "HLEN",
            "zset" => "ZCARD",
            "set" => "SCARD",
            "stream" => "XLEN",
            _ => "STRLEN",
        };
        let len: u64 = redis::cmd(len_cmd)
            .arg(&name)
            .query_async(&mut conn)
            .await?;
        let ttl: i64 = redis::cmd("PTTL").arg(&name).query_async(&mut conn).await?;
        let rest = name.strip_prefix(&format!("{prefix}:")).unwrap_or(&name);
        out.push(KeyInfo {
            class: class_of(rest),
            name: name.clone(),
            len,
            ttl,
        });
    }
    Ok(out)
}

/// Keys that hold ids only while something is in flight: empty after a drain.
const SHOULD_BE_EMPTY: [&str; 9] = [
    "{q}:queue",
    "{q}:processing",
    "{q}:leases",
    "{q}:refunds",
    "{q}:dead",
    "{p}:queue",
    "{p}:waiting",
    "{p}:processing",
    "{u}:holds",
];

/// Keys that are meant to live without a TTL: a user's plan and limits of
/// its own, API keys and the index of users issued one, the organisations'
/// index, the alert deliveries' counters, and the sets through which dead
/// workers' and throttlers' lists are found. (Each is bounded by users,
/// organisations or members, never by calls.)
const NO_TTL: [&str; 13] = [
    "{u}:plan",
    // A user's credit grants and their keys (a grant may never expire), and
    // its export (`[export]`: kept to its `maxlen` for its readers).
    "{u}:c",
    "{u}:ck",
    "{u}:audit",
    "{u}:limits",
    "apikey",
    "apikey-id",
    "apikey-user",
    "users",
    "orgs",
    "{alerts}:deliveries",
    "{q}:lists",
    "{p}:lists",
];

async fn used_memory(url: &str) -> anyhow::Result<u64> {
    let info: String = redis_cmd(url, redis::cmd("INFO").arg("memory")).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("used_memory in INFO memory")
}

/// Redis's clock in µs (worker and throttler leases are stamped with it).
async fn redis_now_us(url: &str) -> anyhow::Result<u64> {
    let (s, us): (u64, u64) = redis_cmd(url, &redis::cmd("TIME")).await?;
    Ok(s * 1_000_000 + us)
}

/// Entries of a liveness hash (id -> end of lease, in Redis time) whose lease
/// has not ended at `now` (same unit).
async fn live(url: &str, key: &str, now: u64) -> anyhow::Result<usize> {
    let all: HashMap<String, String> = redis_cmd(url, redis::cmd("HGETALL").arg(key)).await?;
    Ok(all
        .values()
        .filter(|end| end.parse::<f64>().is_ok_and(|e| e > now as f64))
        .count())
}

struct Check {
    name: &'static str,
    ok: bool,
    figure: String,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    tollgate_providers::http::install_crypto_provider();
    let mut failed = Vec::new();
    for seed in &args.seed {
        let seed = if seed == "random" {
            tollgate_tests::throttle::now_us() ^ u64::from(std::process::id())
        } else {
            seed.parse().with_context(|| format!("--seed {seed}"))?
        };
        if !run_seed(&args, seed).await? {
            failed.push(seed);
        }
    }
    if !failed.is_empty() {
        bail!("chaos: invariants broken with seed(s) {failed:?}");
    }
    Ok(())
}

async fn run_seed(args: &Args, seed: u64) -> anyhow::Result<bool> {
    let started = Instant::now();
    let (appendfsync, durability) = if args.durable {
        ("always", "fsync")
    } else {
        ("everysec", "none")
    };
    println!(
        "== chaos seed {seed}: {} s of load; Redis appendfsync {appendfsync}, roles --durability {durability}",
        args.seconds
    );
    let prefix = random_prefix();
    let dir = std::env::temp_dir().join(format!("tollgate-chaos-{prefix}"));
    std::fs::create_dir_all(&dir)?;
    // Every command of 1 ms or more is logged and read back by `slow` (a
    // restart keeps the arguments): at the end no script may have held Redis
    // past slowlog::LIMIT_US.
    let redis = RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        appendfsync,
        "--slowlog-log-slower-than",
        "1000",
        "--slowlog-max-len",
        "4096",
    ]);
    let redis_url = redis.url();
    let slow = slowlog::Watch::start(redis_url.clone(), Duration::from_millis(500));
    let limits = PROVIDERS
        .iter()
        .map(|p| {
            (
                p.name.to_owned(),
                Limit {
                    rate: p.rate * 1.25,
                    burst: p.burst as f64 + 2.0,
                },
            )
        })
        .collect();
    let upstream = Upstream::start(limits, Duration::from_millis(20)).await?;
    std::fs::write(dir.join("chaos.toml"), config(&upstream.url()))?;
    let http = Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()?;

    let mut procs = Vec::new();
    let proc = |role, name: String, args: Vec<String>, api| Proc {
        role,
        name,
        args,
        api,
        child: Mutex::new(None),
        busy: tokio::sync::Mutex::new(()),
        crashes: AtomicU32::new(0),
    };
    for i in 0..2 {
        let port = tollgate_tests::redis_server::free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let args = [
            "api",
            "--listen",
            &addr.to_string(),
            "--sync-timeout-ms",
            "12000",
        ];
        let args = args.iter().map(|a| (*a).to_owned()).collect();
        procs.push(proc(Role::Api, format!("api-{i}"), args, Some(addr)));
    }
    for i in 0..2 {
        let args = vec![
            "throttler".into(),
            "--liveness-ms".into(),
            THROTTLER_LIVENESS_MS.to_string(),
        ];
        procs.push(proc(Role::Throttler, format!("throttler-{i}"), args, None));
    }
    for i in 0..3 {
        let args = [
            "worker",
            "--concurrency",
            "16",
            "--grace-ms",
            "2000",
            "--lease-ms",
        ];
        let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        args.push(WORKER_LEASE_MS.to_string());
        procs.push(proc(Role::Worker, format!("worker-{i}"), args, None));
    }
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port()).into()).await;
    let d = Arc::new(Deployment {
        dir: dir.clone(),
        durability,
        prefix: prefix.clone(),
        redis_url: redis_url.clone(),
        redis: Arc::new(Mutex::new(redis)),
        redis_busy: tokio::sync::Mutex::new(()),
        proxy,
        latency_busy: tokio::sync::Mutex::new(()),
        procs,
        ready_after: Mutex::default(),
    });
    for p in &d.procs {
        d.start(p, &http).await?;
    }
    // Alive is not ready: an api listens before its store answers.
    for p in d.of(Role::Api) {
        if let Some(addr) = p.api {
            wait_status(
                &http,
                &format!("http://{addr}/readyz"),
                Duration::from_secs(15),
            )
            .await
            .with_context(|| format!("{} never ready", p.name))?;
        }
    }
    let apis = d.apis();

    let mut users = Vec::new();
    for i in 0..USERS {
        let name = format!("chaos-{i}");
        let r = http
            .post(format!("http://{}/admin/users", apis[i % apis.len()]))
            .bearer_auth(ADMIN)
            .json(&json!({"user": name, "plan": if i == PREPAID { "prepaid" } else { "chaos" }}))
            .send()
            .await?;
        let status = r.status();
        let v: Value = r.json().await?;
        if !status.is_success() {
            bail!("create user {name}: {status} {v}");
        }
        let key = v["api_key"].as_str().context("api_key")?.to_owned();
        if i == PREPAID {
            let now_s = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs();
            for (g, (amount, expires_in)) in GRANTS.iter().enumerate() {
                let expires_at = (*expires_in > 0).then(|| {
                    jiff::Timestamp::from_second((now_s + expires_in) as i64)
                        .map(|t| t.to_string())
                        .unwrap_or_default()
                });
                let r = http
                    .post(format!("http://{}/admin/users/{name}/credits", apis[0]))
                    .bearer_auth(ADMIN)
                    .json(&json!({"amount": amount, "expires_at": expires_at, "idempotency_key": format!("chaos-grant-{g}")}))
                    .send()
                    .await?;
                let status = r.status();
                if !status.is_success() {
                    bail!("grant credits to {name}: {status} {}", r.text().await?);
                }
            }
        }
        users.push(User { name, key });
    }
    let users = Arc::new(users);
    // Let every role subscribe and heartbeat before the baseline is taken.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let memory_before = used_memory(&redis_url).await?;

    // The load and the faults.
    let plan = schedule(seed, args.seconds);
    let log = Arc::new(Mutex::new(FaultLog::default()));
    let load_start = Instant::now();
    let load_start_us = tollgate_tests::throttle::now_us();
    let load_end = load_start + Duration::from_secs(args.seconds);
    let give_up = load_end + DRAIN;
    let watchdog = tokio::spawn(watchdog(Arc::clone(&d), http.clone(), Arc::clone(&log)));
    let mut faults = tokio::task::JoinSet::new();
    for p in plan {
        let (d, http, log) = (Arc::clone(&d), http.clone(), Arc::clone(&log));
        faults.spawn(async move {
            tokio::time::sleep_until((load_start + p.at).into()).await;
            inject(d, http, p, log).await;
        });
    }
    let mut rng = Rng(seed ^ 0x00c0_ffee);
    // The upstream refuses one call (429, Retry-After: 1) at seeded moments,
    // 6 to 12 s apart from 7 s in, until 8 s before the end (its own stream:
    // the faults' schedule and the calls stay those of the seed).
    let mut refusal_rng = Rng(seed ^ 0x0429);
    let last_refusal = load_end
        .checked_sub(Duration::from_secs(8))
        .unwrap_or(load_start);
    let mut next_refusal = load_start + Duration::from_secs(7);
    // Which calls are streamed, and how, on a stream of their own too.
    let mut stream_rng = Rng(seed ^ 0x55e0);
    let run_tag = &prefix[1..9];
    let load = Load {
        http: http.clone(),
        apis: apis.clone(),
        users: Arc::clone(&users),
        run: format!("c{run_tag}"),
        give_up,
    };
    let mut calls = tokio::task::JoinSet::new();
    let total = (args.rate * args.seconds as f64) as usize;
    for n in 0..total {
        let at = load_start + Duration::from_secs_f64(n as f64 / args.rate);
        tokio::time::sleep_until(at.into()).await;
        if Instant::now() >= next_refusal && next_refusal < last_refusal {
            upstream.refuse_at(Instant::now(), "1");
            next_refusal += refusal_rng.ms(6_000, 12_000);
        }
        if stream_rng.below(100) < STREAMS.percent {
            // A streamed chat: 4 to 12 content chunks 20 to 50 ms apart,
            // its usage seeded; half its clients read it to the end, half
            // go away after 1 to chunks + 2 events (the role chunk, some
            // content, at most the finish chunk: never its [DONE]).
            let user = stream_rng.below(USERS as u64) as usize;
            let chunks = 4 + stream_rng.below(9) as u32;
            let (lo, hi) = STREAMS.usage;
            let usage = lo + stream_rng.below(hi - lo + 1);
            let every = 20 + stream_rng.below(31);
            let drop_after = (stream_rng.below(2) == 0)
                .then(|| 1 + stream_rng.below(u64::from(chunks) + 2) as u32);
            let body = json!({
                "model": "m",
                "stream": true,
                "messages": [{"role": "user", "content": format!("c{run_tag}-{n}")}],
                "upstream": {"usage": usage, "chunks": chunks, "every_ms": every},
            });
            let read = StreamRead {
                chunks,
                drop_after,
                ..StreamRead::default()
            };
            calls.spawn(one_stream(load.clone(), n, user, read, body));
            continue;
        }
        let (user, op) = (
            rng.below(USERS as u64) as usize,
            rng.below(OPS.len() as u64) as usize,
        );
        let sync = rng.below(2) == 0;
        let marker = format!("c{run_tag}-{n}");
        let body = if OPS[op].provider == LIMITED.name {
            // Mixed weights, an eighth without max_tokens (the default
            // weight), each reporting half to all of its weight as used.
            let explicit = rng.below(8) != 0;
            let weight = if explicit {
                50 + rng.below(MAX_WEIGHT - 50 + 1)
            } else {
                DEFAULT_WEIGHT
            };
            let usage = weight / 2 + rng.below(weight - weight / 2 + 1);
            let upstream = json!({"usage": usage, "after_ms": 100 + rng.below(401)});
            if explicit {
                json!({"marker": marker, "max_tokens": weight, "upstream": upstream})
            } else {
                json!({"marker": marker, "upstream": upstream})
            }
        } else {
            json!({"marker": marker})
        };
        calls.spawn(one_call(load.clone(), n, user, op, sync, body));
    }
    while faults.join_next().await.is_some() {}
    let mut made = Vec::new();
    while let Some(c) = calls.join_next().await {
        made.push(c?);
    }
    let load_secs = load_start.elapsed().as_secs_f64();

    // The drain: every job final, every hold ended, every in-flight list empty.
    let drain_start = Instant::now();
    let drain_end = drain_start + DRAIN;
    let mut ends: HashMap<String, JobEnd> = HashMap::new();
    loop {
        for (i, c) in made.iter().enumerate() {
            let settled = matches!(
                ends.get(&c.job_id),
                Some(JobEnd::Succeeded | JobEnd::Failed(..))
            );
            if settled {
                continue;
            }
            if let Some(e) =
                job_end(&http, apis[i % apis.len()], &users[c.user].key, &c.job_id).await
            {
                ends.insert(c.job_id.clone(), e);
            }
        }
        let open = made
            .iter()
            .filter(|c| {
                !matches!(
                    ends.get(&c.job_id),
                    Some(JobEnd::Succeeded | JobEnd::Failed(..) | JobEnd::Missing)
                )
            })
            .count();
        let keys = scan_keys(&redis_url, &prefix).await.unwrap_or_default();
        let residue: u64 = keys
            .iter()
            .filter(|k| SHOULD_BE_EMPTY.contains(&k.class.as_str()))
            .map(|k| k.len)
            .sum();
        if (open == 0 && residue == 0) || Instant::now() >= drain_end {
            break;
        }
        // A budget step releases holds whose time has come.
        for u in users.iter() {
            let _ = http
                .get(format!("http://{}/v1/usage", apis[0]))
                .bearer_auth(&u.key)
                .send()
                .await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drain_secs = drain_start.elapsed().as_secs_f64();
    watchdog.abort();
    let _ = watchdog.await;

    // The checks.
    let mut checks = Vec::new();
    let answered = |s: u16| made.iter().filter(|c| c.status == Some(s)).count();
    let unanswered = made.iter().filter(|c| c.status.is_none()).count();
    let accepted: Vec<&Call> = made
        .iter()
        .filter(|c| !matches!(ends.get(&c.job_id), Some(JobEnd::Missing) | None))
        .collect();
    let succeeded = accepted
        .iter()
        .filter(|c| ends.get(&c.job_id) == Some(&JobEnd::Succeeded))
        .count();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for c in &accepted {
        if let Some(JobEnd::Failed(cause, _)) = ends.get(&c.job_id) {
            *failures.entry(cause.clone()).or_default() += 1;
        }
    }
    let still_open = accepted
        .iter()
        .filter(|c| matches!(ends.get(&c.job_id), Some(JobEnd::Open(_))))
        .count();
    let vanished = made
        .iter()
        .filter(|c| {
            matches!(c.status, Some(200 | 202))
                && matches!(ends.get(&c.job_id), Some(JobEnd::Missing))
        })
        .count();
    let unknown = made
        .iter()
        .filter(|c| !ends.contains_key(&c.job_id))
        .count();
    checks.push(Check {
        name: "every accepted call ended",
        ok: still_open == 0 && vanished == 0 && unknown == 0,
        figure: format!(
            "{} accepted: {succeeded} succeeded, {} failed {failures:?}; {still_open} still queued/running, \
             {vanished} answered 200/202 but gone, {unknown} never readable",
            accepted.len(),
            accepted.len() - succeeded - still_open,
        ),
    });
    // A fault is worth a 503 (retry) or a job's own 502/504, never a 500:
    // a 500 says the api took a fault for a bug.
    let internal = answered(500);
    checks.push(Check {
        name: "no call answered 500",
        ok: internal == 0,
        figure: format!("{internal} answered 500"),
    });
    let mismatched = made.iter().filter(|c| c.id_mismatch.is_some()).count();
    checks.push(Check {
        name: "job ids are the Idempotency-Key's",
        ok: mismatched == 0,
        figure: format!("{mismatched} answers named another job id"),
    });

    let keys = scan_keys(&redis_url, &prefix).await?;
    let mut residue: BTreeMap<&str, u64> = BTreeMap::new();
    let mut no_ttl: BTreeMap<&str, u64> = BTreeMap::new();
    for k in &keys {
        if SHOULD_BE_EMPTY.contains(&k.class.as_str()) && k.len > 0 {
            *residue.entry(k.class.as_str()).or_default() += k.len;
        }
        if k.ttl == -1 && !NO_TTL.contains(&k.class.as_str()) {
            *no_ttl.entry(k.class.as_str()).or_default() += 1;
        }
    }
    // For a failure's diagnosis: what is left, and the open jobs' records.
    let mut left = String::new();
    for k in keys
        .iter()
        .filter(|k| SHOULD_BE_EMPTY.contains(&k.class.as_str()) && k.len > 0)
    {
        let range = |cmd: &str| redis::cmd(cmd).arg(&k.name).arg(0).arg(20).to_owned();
        let members = match redis_cmd::<Vec<String>>(&redis_url, &range("LRANGE")).await {
            Ok(m) => m,
            Err(_) => redis_cmd(&redis_url, &range("ZRANGE"))
                .await
                .unwrap_or_default(),
        };
        let _ = writeln!(left, "{} ({} items): {members:?}", k.name, k.len);
    }
    for c in made
        .iter()
        .filter(|c| matches!(ends.get(&c.job_id), Some(JobEnd::Open(_))))
    {
        let key = format!("{prefix}:v1:{{q:{}}}:job:{}", c.operation(), c.job_id);
        let record: Vec<String> = redis_cmd(&redis_url, redis::cmd("HGETALL").arg(&key))
            .await
            .unwrap_or_default();
        let _ = writeln!(left, "open job {key}: {record:?}");
    }
    if !left.is_empty() {
        let _ = std::fs::write(dir.join("left.txt"), &left);
    }
    checks.push(Check {
        name: "no ids left in queues, processing lists, leases, refunds, holds",
        ok: residue.is_empty(),
        figure: format!("{residue:?}"),
    });

    // Each user's live charges by request id (a job's id is its request's).
    let mut usage_bad = Vec::new();
    let mut charged: HashMap<String, u64> = HashMap::new();
    let mut prepaid_used = None;
    for (i, u) in users.iter().enumerate() {
        let (used, costs) = charges(&http, apis[i % apis.len()], &u.key).await?;
        // A fixed operation's job costs its `cost`; a stream is settled to
        // what it used (judged below): its charge counts as it stands, but
        // only a paid job may have one, and a paid one must.
        let mut expected = 0;
        for c in accepted.iter().filter(|c| c.user == i) {
            let is_paid = paid(ends.get(&c.job_id));
            match (&c.stream, costs.get(&c.job_id)) {
                (None, _) if is_paid => expected += OPS[c.op].cost,
                (None, _) => {}
                (Some(_), Some(&cost)) if is_paid => expected += cost,
                (Some(_), None) if !is_paid => {}
                (Some(_), cost) => usage_bad.push(format!(
                    "{}: stream {} ended {:?} but its charge is {cost:?}",
                    u.name,
                    c.job_id,
                    ends.get(&c.job_id)
                )),
            }
        }
        if used != expected {
            usage_bad.push(format!("{}: used {used} != {expected}", u.name));
        }
        if i == PREPAID {
            prepaid_used = Some(used);
        }
        charged.extend(costs);
    }
    checks.push(Check {
        name: "per user, used = cost of its jobs that succeeded or failed charged (a stream's settled charge)",
        ok: usage_bad.is_empty(),
        figure: if usage_bad.is_empty() {
            format!("{USERS} users match")
        } else {
            usage_bad.join("; ")
        },
    });

    checks.push(
        prepaid_check(
            &http,
            apis[0],
            &users[PREPAID].name,
            prepaid_used.unwrap_or(u64::MAX),
        )
        .await?,
    );

    let arrivals = upstream.arrivals();
    // The upstream did the work of every call it answered 200: each such job
    // ends paid (succeeded, or failed with its charge kept), never released.
    // (This upstream answers only 200 or 429, so no release is absorbed.)
    let mut unpaid: Vec<&str> = Vec::new();
    let mut worked = std::collections::HashSet::new();
    for a in arrivals.iter().filter(|a| a.status == 200) {
        if let Some(job) = a.job.as_deref() {
            if worked.insert(job) && !paid(ends.get(job)) {
                unpaid.push(job);
            }
        }
    }
    checks.push(Check {
        name: "every upstream arrival that did work is paid by a live charge",
        ok: unpaid.is_empty(),
        figure: format!(
            "{} jobs answered 200 upstream; {} of them not paid{}",
            worked.len(),
            unpaid.len(),
            if unpaid.is_empty() {
                String::new()
            } else {
                format!(" (e.g. {:?})", &unpaid[..unpaid.len().min(3)])
            }
        ),
    });
    // Every call the upstream saw, kept with the logs for a failure's diagnosis.
    let mut calls_tsv = String::from("at_s\tpath\tjob\tstatus\tstream\n");
    for a in &arrivals {
        let _ = writeln!(
            calls_tsv,
            "{:.6}\t{}\t{}\t{}\t{}",
            a.at_us.saturating_sub(load_start_us) as f64 / 1e6,
            a.path,
            a.job.as_deref().unwrap_or("-"),
            a.status,
            a.stream.as_ref().map_or("-".to_owned(), |s| format!(
                "usage {} events {}{}",
                s.usage,
                s.events_sent,
                if s.whole {
                    " whole"
                } else if s.cut() {
                    " cut"
                } else {
                    " open"
                }
            )),
        );
    }
    let _ = std::fs::write(dir.join("upstream.tsv"), calls_tsv);
    let mut ok_by_job: HashMap<&str, Vec<u64>> = HashMap::new();
    for a in &arrivals {
        if a.status == 200 {
            if let Some(j) = &a.job {
                ok_by_job.entry(j.as_str()).or_default().push(a.at_us);
            }
        }
    }
    let (windows, latency_ends) = log
        .lock()
        .map(|l| (l.interrupting.clone(), l.latency_ends.clone()))
        .unwrap_or_default();
    // A job that succeeded upstream more than once must have had its first
    // success interrupted before it was recorded: by a fault of that kind
    // around that moment (2 s before, to a lease plus 2 s after).
    let explained = |first_us: u64| {
        windows
            .iter()
            .any(|&(start, end)| first_us + 2_000_000 >= start && first_us <= end + 5_000_000)
    };
    let mut rerun = Vec::new();
    let mut unexplained = Vec::new();
    for (job, times) in &ok_by_job {
        if times.len() > 1 {
            let first = times.iter().copied().min().unwrap_or(0);
            if explained(first) {
                rerun.push(*job);
            } else {
                unexplained.push(*job);
            }
        }
    }
    checks.push(Check {
        name: "no job ran twice to success upstream, except at-least-once re-runs after a fault",
        ok: unexplained.is_empty(),
        figure: format!(
            "{} jobs succeeded upstream; {} more than once right after a worker kill/stop, Redis outage, cut connection or slow link (re-run after an unrecorded result, paid by one charge); {} otherwise{}",
            ok_by_job.len(),
            rerun.len(),
            unexplained.len(),
            if unexplained.is_empty() {
                String::new()
            } else {
                format!(" (e.g. {:?})", &unexplained[..unexplained.len().min(3)])
            }
        ),
    });
    checks.extend(stream_checks(&made, &arrivals, &charged, &windows));
    let refusals = upstream.refusals();
    let rejected = arrivals.iter().filter(|a| a.status == 429).count() - refusals.len();
    let rejected_at: Vec<String> = arrivals
        .iter()
        .filter(|a| a.status == 429)
        .take(5)
        .map(|a| format!("{:.2}", a.at_us.saturating_sub(load_start_us) as f64 / 1e6))
        .collect();
    let mut bound = Vec::new();
    let mut bound_ok = rejected == 0;
    for p in &PROVIDERS {
        let times: Vec<u64> = arrivals
            .iter()
            .filter(|a| a.path == p.name)
            .map(|a| a.at_us)
            .collect();
        let (raw, net, from, to) = worst_interval_net(&times, p.rate, p.burst, &latency_ends);
        // No excuse for a latency drop: a grant delayed by a slow link looks
        // late to its waiter and goes back (RedisThrottleOptions::late_grant);
        // `net` only says how much of an excess a latency drop would explain.
        bound_ok &= raw <= 1.0;
        let into_load = |us: u64| us.saturating_sub(load_start_us) as f64 / 1e6;
        bound.push(format!(
            "{}: {} calls, max excess {raw:.2}{}{}",
            p.name,
            times.len(),
            if raw > 1.0 {
                format!(", {net:.2} net of latency drops")
            } else {
                String::new()
            },
            if raw > 1.0 {
                format!(
                    " ({:.2}–{:.2} s into the load)",
                    into_load(from),
                    into_load(to)
                )
            } else {
                String::new()
            }
        ));
    }
    checks.push(Check {
        name: "upstream: arrivals <= burst + rate*t + 1, no 429 but the suite's refusals",
        ok: bound_ok,
        figure: format!(
            "{}; {rejected} answered 429 besides the {} the suite asked for{}",
            bound.join(", "),
            refusals.len(),
            if rejected > 0 {
                format!(" (at {} s into the load)", rejected_at.join(", "))
            } else {
                String::new()
            }
        ),
    });

    checks.extend(limited_checks(&arrivals, load_start_us));

    // Each refusal paused its provider for every pod: no call of it reached
    // the upstream during its Retry-After (1 s), past a grace for the calls
    // granted before the pause was recorded (sent within their use-by, 1/rate
    // = 125 ms at most here). A fault in force around it (Redis down, a cut or
    // slow link, a worker stopped or killed) may hold the pause itself up: such
    // a refusal is counted, not judged.
    let (interrupting, latency_ends) = log
        .lock()
        .map(|l| (l.interrupting.clone(), l.latency_ends.clone()))
        .unwrap_or_default();
    const GRACE_US: u64 = 200_000;
    let (mut judged, mut excused, mut inside) = (0, 0, Vec::new());
    for (path, t) in &refusals {
        let (from, to) = (t.saturating_sub(1_000_000), t + 1_000_000);
        let faulted = interrupting.iter().any(|(s, e)| *s <= to && *e >= from)
            || latency_ends
                .iter()
                .any(|(e, _)| *e >= from && *e <= t + 11_000_000);
        if faulted {
            excused += 1;
            continue;
        }
        judged += 1;
        inside.extend(
            arrivals
                .iter()
                .filter(|a| a.path == *path && a.at_us > t + GRACE_US && a.at_us < t + 1_000_000)
                .map(|a| format!("{path} +{} ms", (a.at_us - t) / 1000)),
        );
    }
    checks.push(Check {
        name: "a refusal (429, Retry-After: 1) paused its provider for every pod",
        ok: inside.is_empty(),
        figure: format!(
            "{} refusals: {judged} judged, no call of their provider from 200 ms to 1 s after it{}; {excused} with a fault in force (not judged)",
            refusals.len(),
            if inside.is_empty() {
                String::new()
            } else {
                format!(" BUT {}: {:?}", inside.len(), &inside[..inside.len().min(5)])
            }
        ),
    });

    // Every wait for a slot, from the workers' traces.
    let faults_of = log.lock().map(|l| l.procs.clone()).unwrap_or_default();
    let mut traced = Vec::new();
    for p in d.of(Role::Worker) {
        let text = std::fs::read_to_string(dir.join(format!("{}.log", p.name)))
            .with_context(|| format!("read the log of {}", p.name))?;
        let faults = faults_of.get(&p.name).cloned().unwrap_or_default();
        traced.push((p.name.clone(), waits::events(&text), faults));
    }
    let verdict = waits::judge(&traced);
    checks.push(Check {
        name: "every waiter got its slot or its timeout error within its max_wait + 1 s",
        ok: verdict.ok() && verdict.waits > 0,
        figure: verdict.figure(),
    });

    let ready = d.ready_after.lock().map(|r| r.clone()).unwrap_or_default();
    let slowest = ready.iter().copied().fold(0.0, f64::max);
    checks.push(Check {
        name: "api /readyz green within 5 s of Redis's return",
        ok: slowest <= 5.0,
        figure: format!("{} readings, slowest {slowest:.1} s", ready.len()),
    });
    let crashes: Vec<String> = d
        .procs
        .iter()
        .filter(|p| p.crashes.load(Ordering::SeqCst) > 0)
        .map(|p| format!("{} x{}", p.name, p.crashes.load(Ordering::SeqCst)))
        .collect();
    let mut health = Vec::new();
    for addr in &apis {
        for path in ["healthz", "readyz"] {
            if wait_status(
                &http,
                &format!("http://{addr}/{path}"),
                Duration::from_secs(1),
            )
            .await
            .is_err()
            {
                health.push(format!("{addr}/{path} not green"));
            }
        }
    }
    let now = redis_now_us(&redis_url).await?;
    let mut liveness = Vec::new();
    for o in &OPS {
        // Liveness is in ms, workers' and throttlers' (liveness_heartbeat.lua).
        let key = format!("{prefix}:v1:{{q:{}}}:workers", o.name);
        let n = live(&redis_url, &key, now / 1000).await?;
        if n < 3 {
            health.push(format!("{}: {n} live workers", o.name));
        }
        liveness.push(format!("{} {n}w", o.name));
    }
    for p in &PROVIDERS {
        let n = live(
            &redis_url,
            &format!("{prefix}:v1:{{p:{}}}:throttlers", p.name),
            now / 1000,
        )
        .await?;
        if n < 2 {
            health.push(format!("{}: {n} live throttlers", p.name));
        }
        liveness.push(format!("{} {n}t", p.name));
    }
    for name in [LIMITED.name, STREAMS.provider] {
        let n = live(
            &redis_url,
            &format!("{prefix}:v1:{{p:{name}}}:throttlers"),
            now / 1000,
        )
        .await?;
        if n < 2 {
            health.push(format!("{name}: {n} live throttlers"));
        }
        liveness.push(format!("{name} {n}t"));
    }
    checks.push(Check {
        name: "every role recovered without a restart by the suite",
        ok: crashes.is_empty() && health.is_empty(),
        figure: format!(
            "exited on their own: {crashes:?}; health: {}; live: {}",
            if health.is_empty() {
                "all green".into()
            } else {
                health.join(", ")
            },
            liveness.join(", ")
        ),
    });

    let memory_after = used_memory(&redis_url).await?;
    // Job records stay for an hour (their results), budget events for the window.
    let allowance = 1_048_576 + 4_096 * made.len() as u64;
    checks.push(Check {
        name: "Redis memory bounded, no unexpected key without a TTL",
        ok: memory_after <= memory_before + allowance && no_ttl.is_empty(),
        figure: format!(
            "used_memory {memory_before} -> {memory_after} (bound +{allowance}); keys without TTL beyond {NO_TTL:?}: {no_ttl:?}"
        ),
    });

    let slowest = slow.finish().await;
    // A script that walks what grows (a log, a queue) holds Redis for tens or
    // hundreds of ms when it meets it. A Redis descheduled on a loaded 2-core
    // machine holds any command, an O(1) script or `SCRIPT LOAD`, for 5-20 ms
    // (a CI run logged 40 such calls of 16 scripts, and SCRIPT at 16.7 ms; one
    // at load average 6 logged one `claim.lua` of 77 ms among ~1,000): the
    // calls over 5 ms are counted and printed; a script fails with two calls
    // over 50 ms (a walk meets what it walks again on the next call) or one
    // over 500 ms. The bound itself is asserted without the machine's noise
    // by tests/it/script_time.rs (10,000 events, every path that walked).
    let scripts: Vec<String> = slowest
        .iter()
        .filter(|(name, _)| name.ends_with(".lua"))
        .map(|(name, s)| {
            format!(
                "{name} {} of 1 ms or more, {} over 5 ms, {} over 50 ms, max {:.1} ms",
                s.logged,
                s.over_limit,
                s.over_hold,
                s.max_us as f64 / 1000.0
            )
        })
        .collect();
    let plain = slowest
        .iter()
        .filter(|(name, _)| !name.ends_with(".lua"))
        .max_by_key(|(_, s)| s.max_us)
        .map_or("none".to_owned(), |(name, s)| {
            format!("{name} {:.1} ms", s.max_us as f64 / 1000.0)
        });
    checks.push(Check {
        name: "no script held Redis long (SLOWLOG: no script twice over 50 ms or once over 500 ms; calls over 5 ms counted)",
        ok: slowest.iter().all(|(name, s)| {
            !name.ends_with(".lua") || (s.over_hold < 2 && s.max_us <= 100 * slowlog::LIMIT_US)
        }),
        figure: format!(
            "{}; slowest plain command {plain}",
            if scripts.is_empty() {
                "no script call of 1 ms or more".to_owned()
            } else {
                scripts.join("; ")
            }
        ),
    });

    // The report.
    let log = log
        .lock()
        .map(|l| (l.done.clone(), l.skipped.clone(), l.lines.clone()));
    let (done, skipped, lines) = log.unwrap_or_default();
    println!("faults injected {done:?}, skipped {skipped:?}:");
    for l in &lines {
        println!("{l}");
    }
    let p = d.proxy.stats();
    println!(
        "proxy: {} connections from the roles; {} cut, {} refused in partitions, {} closed with Redis unreachable",
        p.accepted, p.cut, p.refused, p.unreachable
    );
    let retried: u32 = made.iter().map(|c| c.retries).sum();
    println!(
        "calls: {} made ({} sync), answers 200 {} / 202 {} / 502 {} / 504 {} / other {}, \
         {unanswered} unanswered; {retried} retries after 503, timeout or connection error",
        made.len(),
        made.iter().filter(|c| c.sync).count(),
        answered(200),
        answered(202),
        answered(502),
        answered(504),
        {
            let mut other: BTreeMap<u16, usize> = BTreeMap::new();
            for s in made.iter().filter_map(|c| c.status) {
                if ![200, 202, 502, 504].contains(&s) {
                    *other.entry(s).or_default() += 1;
                }
            }
            format!("{other:?}")
        },
    );
    println!(
        "load {load_secs:.1} s, drain {drain_secs:.1} s, total {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut all_ok = true;
    for c in &checks {
        all_ok &= c.ok;
        println!(
            "  [{}] {}: {}",
            if c.ok { "ok" } else { "FAIL" },
            c.name,
            c.figure
        );
    }
    if all_ok {
        println!("== chaos seed {seed}: every invariant holds");
    } else {
        println!(
            "== chaos seed {seed}: FAILED (replay with --seed {seed}{}; logs in {})",
            if args.durable { " --durable" } else { "" },
            dir.display()
        );
    }
    drop(upstream);
    let keep = args.keep || !all_ok;
    d.shutdown();
    drop(d);
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(all_ok)
}

/// The invariants of the streamed calls ([`STREAMS`]), from the upstream's
/// record of each stream (the usage it reported, sent whole or cut), what
/// each client read, and each job's standing charge (`charged`, by request
/// id, from the users' `/v1/usage` events):
/// - every stream that did work upstream (answered 200) is paid at least
///   the usage it reported: its usage when tollgate saw it, else its
///   reservation (`settle.max`, above any usage): a client that goes away,
///   a worker killed, a cut connection never lower the price;
/// - every stream its client read to `[DONE]` was the whole answer, carried
///   no usage (the client did not ask: tollgate asked for it), and is paid
///   exactly its reported usage, or at least it when a fault that can come
///   between the stream and its settle (`faults`, µs) hit it.
fn stream_checks(
    made: &[Call],
    arrivals: &[tollgate_tests::upstream::Arrival],
    charged: &HashMap<String, u64>,
    faults: &[(u64, u64)],
) -> Vec<Check> {
    let s = &STREAMS;
    // Per job the upstream streamed for: the usage it reported, whether a
    // run of it was sent whole, and whether one was cut.
    let mut worked: BTreeMap<&str, (u64, bool, bool)> = BTreeMap::new();
    for a in arrivals.iter().filter(|a| a.status == 200) {
        if let (Some(job), Some(st)) = (a.job.as_deref(), &a.stream) {
            let w = worked.entry(job).or_default();
            *w = (w.0.max(st.usage), w.1 || st.whole, w.2 || st.cut());
        }
    }
    let charge = |job: &str| charged.get(job).copied().unwrap_or(0);
    let (mut exact, mut reservation, mut between, mut over) = (0, 0, 0, 0);
    let mut under = Vec::new();
    for (job, &(usage, _, cut)) in &worked {
        let paid = charge(job);
        if paid < usage {
            under.push(format!(
                "{job}: reported {usage}, charged {paid} ({})",
                if cut { "cut" } else { "sent whole" }
            ));
        } else if paid == usage {
            exact += 1;
        } else if paid == s.max {
            reservation += 1;
        } else if paid > s.max {
            over += 1;
        } else {
            between += 1;
        }
    }
    let sent_whole = worked.values().filter(|w| w.1).count();
    let cut = worked.values().filter(|w| w.2).count();
    // The clients' side.
    let streams: Vec<(&Call, &StreamRead)> = made
        .iter()
        .filter_map(|c| Some((c, c.stream.as_ref()?)))
        .collect();
    let count = |f: &dyn Fn(&StreamRead) -> bool| streams.iter().filter(|(_, r)| f(r)).count();
    let began = |c: &Call, r: &StreamRead| c.status == Some(200) && r.events > 0;
    let mut not_begun: BTreeMap<String, usize> = BTreeMap::new();
    for (c, r) in &streams {
        if !began(c, r) {
            let status = c.status.map_or("none".to_owned(), |s| s.to_string());
            *not_begun.entry(status).or_default() += 1;
        }
    }
    let check1 = Check {
        name: "every stream that did work upstream is paid at least its usage or its reservation",
        ok: under.is_empty() && !worked.is_empty() && cut > 0,
        figure: format!(
            "{} streams made: {} read whole, {} dropped by their client mid-stream, {} ended by an error event, \
             {} broken off, not begun {not_begun:?}; upstream streamed {} jobs: {sent_whole} sent whole, {cut} cut; \
             paid exactly their usage {exact}, paid the reservation ({}) {reservation}, between {between}, \
             over the reservation {over}; under-paid {} (must be 0){}",
            streams.len(),
            count(&|r| r.done),
            count(&|r| r.dropped),
            count(&|r| r.error),
            count(&|r| r.broke),
            worked.len(),
            s.max,
            under.len(),
            if under.is_empty() {
                String::new()
            } else {
                format!(" (e.g. {:?})", &under[..under.len().min(3)])
            }
        ),
    };
    let faulted = |(from, to): (u64, u64)| {
        faults
            .iter()
            .any(|&(start, end)| start <= to + 5_000_000 && end + 2_000_000 >= from)
    };
    let (mut completed, mut settled, mut excused) = (0, 0, 0);
    let mut bad = Vec::new();
    for (c, r) in streams.iter().filter(|(_, r)| r.done) {
        completed += 1;
        let job = c.job_id.as_str();
        if !r.whole {
            bad.push(format!("{job}: [DONE] after a cut answer"));
        }
        if r.saw_usage {
            bad.push(format!("{job}: usage relayed to a client that did not ask"));
        }
        let Some(&(usage, _, _)) = worked.get(job) else {
            bad.push(format!("{job}: read whole, but no stream of it upstream"));
            continue;
        };
        let paid = charge(job);
        if paid == usage {
            settled += 1;
        } else if paid > usage && faulted(r.span_us) {
            excused += 1;
        } else {
            bad.push(format!("{job}: reported {usage}, charged {paid}"));
        }
    }
    let check2 = Check {
        name: "every stream read whole was the whole answer, without a usage it did not ask for, \
         and paid exactly its reported usage (at least it when a fault hit it)",
        ok: bad.is_empty() && completed > 0,
        figure: format!(
            "{completed} read to [DONE]: {settled} paid exactly their usage, {excused} more with a fault in force; \
             {} otherwise{}",
            bad.len(),
            if bad.is_empty() {
                String::new()
            } else {
                format!(" (e.g. {:?})", &bad[..bad.len().min(3)])
            }
        ),
    };
    vec![check1, check2]
}

/// The invariants of the provider with several limits ([`LIMITED`]), from the
/// upstream's own records, through every fault of the run:
/// - requests: over any interval `t`, at most `burst + rate*t + 1` calls of
///   its request bucket (so at most `requests` in any window of `per`), the
///   bound docs/src/throttling.md states for a grant used within its late bound;
/// - tokens: the usage the upstream reported for the calls it answered 200,
///   summed over any window of `per`, at most the token limit plus one call's
///   weight (the design keeps the limit for what the upstream counts; a grant
///   reaches the upstream a moment after it was made, the `+1` of the request
///   bound, which for tokens is one call's weight);
/// - calls in flight (from each call's arrival to its end as the upstream
///   saw them): never more than `max_concurrent`.
fn limited_checks(
    arrivals: &[tollgate_tests::upstream::Arrival],
    load_start_us: u64,
) -> Vec<Check> {
    let l = &LIMITED;
    let per_us = l.per_s * 1_000_000;
    let into_load = |us: u64| us.saturating_sub(load_start_us) as f64 / 1e6;
    let mine: Vec<&tollgate_tests::upstream::Arrival> =
        arrivals.iter().filter(|a| a.path == l.name).collect();
    let mut times: Vec<u64> = mine.iter().map(|a| a.at_us).collect();
    times.sort_unstable();
    let (rate, burst) = l.request_bucket();
    let (excess, _, _, _) = worst_interval_net(&times, rate, burst, &[]);
    let (mut most_calls, mut most_calls_at, mut j) = (0, 0, 0);
    for (i, &t) in times.iter().enumerate() {
        while j < times.len() && times[j] < t + per_us {
            j += 1;
        }
        if j - i > most_calls {
            (most_calls, most_calls_at) = (j - i, t);
        }
    }
    // Reported usage of the calls answered 200, in arrival order.
    let mut used: Vec<(u64, u64)> = mine
        .iter()
        .filter(|a| a.status == 200)
        .map(|a| {
            let input: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
            (a.at_us, input["upstream"]["usage"].as_u64().unwrap_or(0))
        })
        .collect();
    used.sort_unstable();
    let (mut most_tokens, mut most_tokens_at, mut sum, mut j) = (0, 0, 0, 0);
    for (i, &(t, _)) in used.iter().enumerate() {
        while j < used.len() && used[j].0 < t + per_us {
            sum += used[j].1;
            j += 1;
        }
        if sum > most_tokens {
            (most_tokens, most_tokens_at) = (sum, t);
        }
        sum -= used[i].1;
    }
    // Most calls in flight at once: ends before starts at the same moment
    // (the worker frees its slot only after it has the answer).
    let mut events: Vec<(u64, i64)> = Vec::new();
    for a in &mine {
        events.push((a.at_us, 1));
        events.push((a.end_us.unwrap_or(u64::MAX), -1));
    }
    events.sort_unstable();
    let (mut in_flight, mut most_in_flight, mut most_in_flight_at) = (0_i64, 0_i64, 0);
    for (t, d) in events {
        in_flight += d;
        if in_flight > most_in_flight {
            (most_in_flight, most_in_flight_at) = (in_flight, t);
        }
    }
    let token_bound = l.tokens + MAX_WEIGHT;
    vec![
        Check {
            name: "upstream (several limits): calls <= burst + rate*t + 1 of the request limit",
            ok: excess <= 1.0 && most_calls as u64 <= l.requests,
            figure: format!(
                "{}: {} calls, max excess {excess:.2} over {burst} + {rate:.1}*t; \
                 at most {most_calls} in a {} s window (limit {}, at {:.2} s into the load)",
                l.name,
                times.len(),
                l.per_s,
                l.requests,
                into_load(most_calls_at)
            ),
        },
        Check {
            name: "upstream (several limits): reported tokens per window <= limit + one call's weight",
            ok: most_tokens <= token_bound,
            figure: format!(
                "{}: {} calls answered 200, {} tokens reported; at most {most_tokens} in a {} s window \
                 (limit {}, bound {token_bound}; {:.2} of the limit; at {:.2} s into the load)",
                l.name,
                used.len(),
                used.iter().map(|u| u.1).sum::<u64>(),
                l.per_s,
                l.tokens,
                most_tokens as f64 / l.tokens as f64,
                into_load(most_tokens_at)
            ),
        },
        Check {
            name: "upstream (several limits): calls in flight <= max_concurrent",
            ok: most_in_flight as usize <= l.max_concurrent && !mine.is_empty(),
            figure: format!(
                "{}: at most {most_in_flight} in flight (max_concurrent {}, at {:.2} s into the load); \
                 {} calls never ended",
                l.name,
                l.max_concurrent,
                into_load(most_in_flight_at),
                mine.iter().filter(|a| a.end_us.is_none()).count()
            ),
        },
    ]
}
