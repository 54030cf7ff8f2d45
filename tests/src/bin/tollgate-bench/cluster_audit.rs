//! The cluster audit, run by `scripts/test` after the suite: every Lua script
//! of `lua/` must have run on the suite's Redis Cluster (its SHA is in a
//! primary's script cache: the conformance suites' cluster variants loaded it
//! there), and no node of the cluster may have answered CROSSSLOT (a script or
//! a command that reached keys of two hash slots). A script that no cluster test
//! runs, or one that builds a key of another slot, fails the suite.

use anyhow::Context;
use redis::aio::MultiplexedConnection;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The cluster: redis+cluster://host:port[,host:port...].
    #[arg(long)]
    url: String,
}

fn info_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

async fn connect(addr: &str) -> anyhow::Result<MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://{addr}"))?;
    Ok(client.get_multiplexed_async_connection().await?)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let seed = args
        .url
        .strip_prefix("redis+cluster://")
        .and_then(|s| s.split(',').next())
        .context("expected redis+cluster://host:port[,...]")?;
    let mut conn = connect(seed).await?;
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await?;
    // `<id> <ip:port@bus> <flags> ...`, one line per node.
    let mut addrs = Vec::new();
    for line in nodes.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_), Some(addr), Some(flags)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if flags.contains("fail") || flags.contains("noaddr") {
            continue;
        }
        addrs.push(addr.split('@').next().unwrap_or(addr).to_owned());
    }
    anyhow::ensure!(!addrs.is_empty(), "no node in CLUSTER NODES: {nodes}");

    let scripts = tollgate_redis::scripts::all();
    let mut ran = vec![false; scripts.len()];
    let mut crossslot = Vec::new();
    // The budget, job and throttle scripts are function libraries: each is
    // loaded on every primary.
    let libraries = [
        tollgate_redis::scripts::BUDGET.name(),
        tollgate_redis::scripts::JOBS.name(),
        tollgate_redis::scripts::THROTTLE.name(),
    ];
    let mut without_library = Vec::new();
    for addr in &addrs {
        let mut conn = connect(addr).await?;
        let info: String = redis::cmd("INFO")
            .arg("everything")
            .query_async(&mut conn)
            .await?;
        if let Some(stat) = info_field(&info, "errorstat_CROSSSLOT") {
            crossslot.push(format!("{addr}: {stat}"));
        }
        if info_field(&info, "role") != Some("master") {
            continue;
        }
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("EXISTS");
        for (_, script) in &scripts {
            cmd.arg(script.get_hash());
        }
        let exists: Vec<i64> = cmd.query_async(&mut conn).await?;
        for library in libraries {
            let listed: Vec<redis::Value> = redis::cmd("FUNCTION")
                .arg("LIST")
                .arg("LIBRARYNAME")
                .arg(library)
                .query_async(&mut conn)
                .await?;
            if listed.is_empty() {
                without_library.push(format!("{addr} ({library})"));
            }
        }
        for (r, e) in ran.iter_mut().zip(exists) {
            *r |= e == 1;
        }
    }
    let never: Vec<&str> = scripts
        .iter()
        .zip(&ran)
        .filter(|(_, r)| !**r)
        .map(|((name, _), _)| *name)
        .collect();
    println!(
        "cluster audit: {} nodes; {} of {} scripts ran on the cluster; CROSSSLOT answers: {}",
        addrs.len(),
        ran.iter().filter(|r| **r).count(),
        scripts.len(),
        if crossslot.is_empty() {
            "none".to_owned()
        } else {
            crossslot.join("; ")
        }
    );
    anyhow::ensure!(
        without_library.is_empty(),
        "primaries without a function library: {without_library:?}"
    );
    anyhow::ensure!(
        never.is_empty(),
        "scripts that no test ran on the cluster: {never:?} (add a cluster variant of the test that covers them)"
    );
    anyhow::ensure!(
        crossslot.is_empty(),
        "the cluster answered CROSSSLOT: {crossslot:?}"
    );
    Ok(())
}
