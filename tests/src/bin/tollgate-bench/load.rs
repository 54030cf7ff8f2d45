//! A reserve load from one process: `--tasks` tasks each reserving `--count` times.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    ledger::Ledger,
};
use tollgate_redis::{keys::KeySpace, ledger::RedisLedger, pool::PoolOptions};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    redis_url: String,
    #[arg(long)]
    prefix: String,
    #[arg(long)]
    user: UserId,
    #[arg(long)]
    cost: u64,
    #[arg(long, default_value_t = 4)]
    tasks: usize,
    #[arg(long, default_value_t = 200)]
    count: usize,
    /// Wait until this Unix time (ms) before the first reserve, so that several
    /// processes start together.
    #[arg(long)]
    start_at_ms: Option<u64>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let pool = tollgate_redis::pool::connect(&args.redis_url, &PoolOptions::default()).await?;
    let ledger = Arc::new(RedisLedger::new(
        pool,
        KeySpace::new(&args.prefix)?,
        Arc::new(Config::builtin()),
    ));
    if let Some(at) = args.start_at_ms {
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
        tokio::time::sleep(
            Duration::from_millis(at.saturating_sub(now)).min(Duration::from_secs(30)),
        )
        .await;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.tasks {
        let (ledger, user, cost, count) = (
            Arc::clone(&ledger),
            args.user.clone(),
            args.cost,
            args.count,
        );
        tasks.spawn(async move {
            let mut allowed = 0u64;
            for _ in 0..count {
                if ledger
                    .reserve(&user, &RequestId::generate(), cost)
                    .await?
                    .is_allowed()
                {
                    allowed += 1;
                }
            }
            anyhow::Ok(allowed)
        });
    }
    let mut allowed = 0;
    while let Some(r) = tasks.join_next().await {
        allowed += r??;
    }
    let total = (args.tasks * args.count) as u64;
    println!(
        "{}",
        serde_json::json!({"allowed": allowed, "denied": total - allowed})
    );
    Ok(())
}
