//! The usage bench: Redis time of one `usage.lua` call (from `SLOWLOG`) for a
//! user with 1,000 / 10,000 / 100,000 live events: the first page and a walk
//! of every page (pages of the largest size); with `--baseline-script`, the same calls of
//! a previous usage script on the same keys, side by side. Fails, listing
//! them, if any call of ours held Redis past `slowlog::LIMIT_US` (5 ms).

use std::sync::Arc;

use anyhow::{bail, Context};
use redis::aio::MultiplexedConnection;
use redis::Value;
use tollgate_core::{
    id::UserId,
    ledger::{EventPage, Ledger},
};
use tollgate_redis::{
    keys::{BudgetKeys, KeySpace},
    ledger::RedisLedger,
    pool::PoolOptions,
    scripts::{self, PlanArgs},
};
use tollgate_tests::slowlog;

use crate::stats::median_f64;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Use this Redis instead of starting a private redis-server.
    #[arg(long)]
    redis_url: Option<String>,
    /// Live events of each bench user.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000usize, 10_000, 100_000])]
    sizes: Vec<usize>,
    /// Calls per figure (interleaved over the sizes); medians and maxima are printed.
    #[arg(long, default_value_t = 15)]
    samples: usize,
    /// A previous usage script, whole (its budget/lib/state.lua prepended), called
    /// with KEYS and the export + plan ARGV: the "before" column. E.g.
    /// `{ git show main:lua/budget/lib/state.lua; echo; git show main:lua/budget/usage.lua; } > old.lua`
    #[arg(long)]
    baseline_script: Option<std::path::PathBuf>,
}

/// The Redis time (µs) of the script call `cmd` makes, from `INFO
/// commandstats` (reset before it): logging every command in SLOWLOG would
/// slow the script itself down.
async fn timed(conn: &mut MultiplexedConnection, cmd: &redis::Cmd) -> anyhow::Result<(u64, Value)> {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .exec_async(conn)
        .await?;
    let reply: Value = cmd.query_async(conn).await?;
    if let Value::ServerError(e) = &reply {
        bail!("script failed: {e:?}");
    }
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    // Ours is an FCALL, the baseline an EVALSHA: the one that ran.
    let usec = info
        .lines()
        .find_map(|l| {
            l.strip_prefix("cmdstat_evalsha:")
                .or_else(|| l.strip_prefix("cmdstat_fcall:"))
        })
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec=")))
        .and_then(|u| u.parse().ok())
        .context("no cmdstat_evalsha or cmdstat_fcall in INFO commandstats")?;
    Ok((usec, reply))
}

fn budget_keys(cmd: &mut redis::Cmd, keys: &BudgetKeys) {
    let ordered = keys.ordered();
    cmd.arg(ordered.len()).arg(&ordered[..]);
}

/// Our usage.lua, for one page.
fn ours(keys: &BudgetKeys, cursor: &str, limit: usize, plan: &[String]) -> redis::Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(scripts::BUDGET.function("usage"));
    budget_keys(&mut cmd, keys);
    cmd.arg(cursor).arg(limit).arg(plan);
    cmd
}

/// The next_cursor of a usage.lua reply ('' at the end).
fn next_cursor(reply: &Value) -> anyhow::Result<String> {
    let Value::Array(r) = reply else {
        bail!("usage reply: {reply:?}")
    };
    let windows = match r.get(2) {
        Some(Value::Int(n)) => usize::try_from(*n)?,
        other => bail!("usage reply windows: {other:?}"),
    };
    match r.get(3 + 5 * windows) {
        Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        other => bail!("usage reply next_cursor: {other:?}"),
    }
}

#[derive(Default)]
struct Figure {
    micros: Vec<f64>,
}

impl Figure {
    fn push(&mut self, us: u64) {
        self.micros.push(us as f64);
    }
    fn text(&mut self) -> String {
        if self.micros.is_empty() {
            return "-".into();
        }
        let max = self.micros.iter().copied().fold(0.0, f64::max);
        format!(
            "{:.2} / {:.2} ms",
            median_f64(&mut self.micros) / 1000.0,
            max / 1000.0
        )
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let (server, url) = crate::redis_or_start(args.redis_url.as_deref());
    let config = tollgate_tests::one_plan_config("bench", 1_000_000_000_000_000, "12h");
    let plans = PlanArgs::new(&config);
    // The previous script's ARGV tail: export maxlen, then the plan table.
    let old_plan = [
        "0".to_string(),
        "bench".to_string(),
        PlanArgs::limits(config.default_plan()),
    ];
    let plan = plans.args().to_vec();
    let prefix = tollgate_tests::random_prefix();
    let space = KeySpace::new(&prefix)?;
    let pool = tollgate_redis::pool::connect(&url, &PoolOptions::default()).await?;
    let ledger = RedisLedger::new(pool, space.clone(), Arc::clone(&config));
    let mut conn = tollgate_tests::bulk_connection(&url).await?;
    let version = tollgate_tests::redis_info::version(&mut conn).await?;
    let baseline = match &args.baseline_script {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("read {}", path.display()))?;
            let sha: String = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(text)
                .query_async(&mut conn)
                .await?;
            Some(sha)
        }
        None => None,
    };
    scripts::BUDGET.load_async(&mut conn).await?;

    let users: Vec<UserId> = args
        .sizes
        .iter()
        .map(|n| UserId::new(format!("usage-{n}")))
        .collect::<Result<_, _>>()?;
    for (user, &n) in users.iter().zip(&args.sizes) {
        tollgate_tests::bulk_reserve(&mut conn, &space.budget(user), &plans, n, 1000).await?;
        let u = ledger.usage(user).await?;
        if u.used != n as u64 {
            bail!("{user}: used {} after {n} reserves", u.used);
        }
    }
    // Every command from here on slower than the limit is logged.
    slowlog::start(&mut conn, slowlog::LIMIT_US, 1024).await?;

    let n = args.sizes.len();
    let (mut before, mut first, mut walk_max, mut walk_total) = (
        (0..n).map(|_| Figure::default()).collect::<Vec<_>>(),
        (0..n).map(|_| Figure::default()).collect::<Vec<_>>(),
        (0..n).map(|_| Figure::default()).collect::<Vec<_>>(),
        (0..n).map(|_| Figure::default()).collect::<Vec<_>>(),
    );
    let mut over = Vec::new();
    let mut judge = |what: String, us: u64| {
        if us > slowlog::LIMIT_US {
            over.push(format!("{what}: {:.1} ms", us as f64 / 1000.0));
        }
        us
    };
    for sample in 0..args.samples {
        for (i, user) in users.iter().enumerate() {
            let keys = space.budget(user);
            let (us, _) =
                timed(&mut conn, &ours(&keys, "", EventPage::DEFAULT_LIMIT, &plan)).await?;
            first[i].push(judge(format!("{user} first page"), us));
            // A walk of every page is long for the big users: a few samples.
            if sample < 3 {
                let (mut cursor, mut total, mut max, mut pages) = (String::new(), 0, 0, 0);
                loop {
                    let cmd = ours(&keys, &cursor, EventPage::MAX_LIMIT, &plan);
                    let (us, reply) = timed(&mut conn, &cmd).await?;
                    let us = judge(format!("{user} walk page {pages}"), us);
                    (total, max, pages) = (total + us, max.max(us), pages + 1);
                    cursor = next_cursor(&reply)?;
                    if cursor.is_empty() {
                        break;
                    }
                }
                walk_max[i].push(max);
                walk_total[i].push(total);
            }
        }
    }

    // The baseline last: a walk of the whole log leaves the Lua heap full of
    // garbage that the next scripts' incremental GC steps pay for.
    if let Some(sha) = &baseline {
        for _ in 0..args.samples {
            for (i, user) in users.iter().enumerate() {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(sha);
                budget_keys(&mut cmd, &space.budget(user));
                cmd.arg(&old_plan[..]);
                before[i].push(timed(&mut conn, &cmd).await?.0);
            }
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "## usage.lua: Redis time per call (INFO commandstats), median / max of {} calls (walks: 3)",
        args.samples
    );
    println!(
        "redis {version}; load average {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "| live events | before: whole log | first page ({}) | walk, pages of {}: slowest | walk: all pages |",
        EventPage::DEFAULT_LIMIT,
        EventPage::MAX_LIMIT
    );
    println!("|---:|---:|---:|---:|---:|");
    for (i, size) in args.sizes.iter().enumerate() {
        println!(
            "| {size} | {} | {} | {} | {} |",
            before[i].text(),
            first[i].text(),
            walk_max[i].text(),
            walk_total[i].text()
        );
    }
    // SLOWLOG too: the baseline's calls and anything else that was slow.
    let (_, slow) = slowlog::over_limit(&mut conn).await?;
    if !slow.is_empty() {
        println!("SLOWLOG above {} ms: {slow}", slowlog::LIMIT_US / 1000);
    }
    if !over.is_empty() {
        bail!(
            "{} usage.lua calls held Redis past {} ms: {}",
            over.len(),
            slowlog::LIMIT_US / 1000,
            over.join("; ")
        );
    }
    println!(
        "no usage.lua call held Redis past {} ms",
        slowlog::LIMIT_US / 1000
    );
    drop(server);
    Ok(())
}
