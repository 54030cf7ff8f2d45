//! Shared test support: a real `redis-server` per test, random key prefixes, and
//! the path of the project's binaries. Used by the integration tests in `it/` and
//! by the `tollgate-bench` binary.

pub mod api;
pub mod clocked_redis;
pub mod http;
pub mod jobs;
pub mod money;
pub mod process;
pub mod proxy;
pub mod redis_cluster;
pub mod redis_info;
pub mod redis_server;
pub mod slowlog;
pub mod throttle;
pub mod upstream;

pub use redis_cluster::{RedisCluster, TestCluster};
pub use redis_server::RedisServer;

use std::path::PathBuf;

use tollgate_core::config::Config;

/// A key prefix no other test uses: tests share nothing through Redis keys.
pub fn random_prefix() -> String {
    format!("t{}", &uuid_like()[..12])
}

fn uuid_like() -> String {
    tollgate_core::id::RequestId::generate()
        .as_str()
        .replace('-', "")
}

/// A new folder `tollgate-{tag}-<random prefix>` under the temp dir,
/// removed with everything in it when dropped.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tollgate-{tag}-{}", random_prefix()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `text` to a file `name` in a new folder `tollgate-{tag}-<random
/// prefix>` under the temp dir; returns the folder and the file's path.
pub fn temp_file(tag: &str, name: &str, text: &str) -> std::io::Result<(PathBuf, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("tollgate-{tag}-{}", random_prefix()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok((dir, path))
}

/// A config of one plan, `name`, the default: `limit` per `window` (as
/// "12h"), and nothing else.
pub fn one_plan_config(name: &str, limit: u64, window: &str) -> std::sync::Arc<Config> {
    let text = format!(
        "default_plan = \"{name}\"\n[plans.{name}]\nlimit = {limit}\nwindow = \"{window}\"\n"
    );
    let config = Config::parse(&text, name).unwrap_or_else(|e| panic!("{text}: {e}"));
    std::sync::Arc::new(config)
}

/// The path of a binary built from this workspace (`tollgate`, `tollgate-bench`),
/// next to the running test executable's `deps/` folder. Panics with the build
/// command to run when it is missing: the test command builds the binaries first.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first with `cargo build --workspace --bins` \
         (scripts/test does this before running the tests)",
        path.display()
    );
    path
}

/// Every live event of `user`, oldest first, read a page of
/// [`EventPage::MAX_LIMIT`](tollgate_core::ledger::EventPage::MAX_LIMIT) at a time
/// by following `next_cursor` (each page one short ledger call).
pub async fn all_events(
    ledger: &dyn tollgate_core::ledger::Ledger,
    user: &tollgate_core::id::UserId,
) -> Result<Vec<tollgate_core::ledger::SpendEvent>, tollgate_core::ledger::LedgerError> {
    use tollgate_core::ledger::EventPage;
    let page = EventPage::new(None, EventPage::MAX_LIMIT).expect("the largest page is valid");
    let mut usage = ledger.usage_page(user, page).await?;
    let mut events = std::mem::take(&mut usage.events);
    while let Some(next) = usage.next_cursor {
        usage = ledger.usage_page(user, page.next(next)).await?;
        events.append(&mut usage.events);
    }
    Ok(events)
}

/// A Redis ledger on the Redis at `url` under `prefix`, pooled with the
/// default options.
pub async fn redis_ledger(
    url: &str,
    prefix: &str,
    config: std::sync::Arc<Config>,
) -> tollgate_redis::ledger::RedisLedger {
    let options = tollgate_redis::pool::PoolOptions::default();
    let pool = tollgate_redis::pool::connect(url, &options)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    let keys = tollgate_redis::keys::KeySpace::new(prefix)
        .unwrap_or_else(|e| panic!("key prefix {prefix:?}: {e}"));
    tollgate_redis::ledger::RedisLedger::new(pool, keys, config)
}

/// Records `n` reserves of cost 1 (fresh UUID request ids) for the user of
/// `keys`, through `reserve.lua` with its typed wrapper's KEYS and ARGV,
/// pipelined `batch` at a time: a quick way to fill a large window that still
/// runs the product's script for every event.
pub async fn bulk_reserve(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &tollgate_redis::keys::BudgetKeys,
    plans: &tollgate_redis::scripts::PlanArgs,
    n: usize,
    batch: usize,
) -> redis::RedisResult<()> {
    use tollgate_redis::scripts;
    scripts::BUDGET.load_async(conn).await?;
    let mut left = n;
    while left > 0 {
        let ids: Vec<_> = (0..left.min(batch.max(1)))
            .map(|_| tollgate_core::id::RequestId::generate())
            .collect();
        // A batch that took longer than a short window of the plan finds
        // events leaving it: a reserve then keeps its progress and answers
        // TOLLGATE_AGAIN (the pipeline fails). The batch is sent again with
        // the same ids: those already recorded are idempotent repeats.
        let mut tries = 0;
        loop {
            let mut pipe = redis::pipe();
            for id in &ids {
                pipe.add_command(scripts::reserve_cmd(keys, id.as_str(), 1, plans))
                    .ignore();
            }
            match pipe.exec_async(conn).await {
                Err(e) if tries < 1000 && e.to_string().contains("TOLLGATE_AGAIN") => tries += 1,
                r => break r?,
            }
        }
        left -= ids.len();
    }
    Ok(())
}

/// A connection for bulk work (pipelines of thousands of script calls, a
/// loaded machine): replies may take far longer than the client's default
/// response timeout.
pub async fn bulk_connection(url: &str) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(120)));
    redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}
