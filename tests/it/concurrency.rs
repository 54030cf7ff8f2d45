//! Concurrency across OS processes: several processes reserving at one user on
//! one Redis admit exactly what fits, as the in-process tests show for tasks.

use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use tollgate_core::{config::Config, ledger::Ledger};
use tollgate_tests::{random_prefix, RedisServer};

use crate::ledger::user;

/// 4 processes x 4 tasks x 200 reserves of cost 8 (16 x 200 in all) against the
/// default plan's limit of 1000: exactly 125 are admitted.
#[tokio::test]
async fn processes_sharing_one_redis_admit_exactly_125() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    // All processes start firing at the same instant, well after they connected.
    let start_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 1500;
    let children: Vec<_> = (0..4)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_tollgate-bench"))
                .args(["load", "--redis-url", &server.url(), "--prefix", &prefix])
                .args([
                    "--user", "hot", "--cost", "8", "--tasks", "4", "--count", "200",
                ])
                .args(["--start-at-ms", &start_at.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn tollgate-bench load")
        })
        .collect();
    let (mut allowed, mut denied) = (0, 0);
    for child in children {
        let out = child
            .wait_with_output()
            .expect("wait for tollgate-bench load");
        assert!(out.status.success(), "load process failed: {:?}", out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("load prints JSON");
        allowed += v["allowed"].as_u64().expect("allowed");
        denied += v["denied"].as_u64().expect("denied");
    }
    assert_eq!((allowed, denied), (125, 3200 - 125));
    // The ledger agrees: exactly the limit, one event per admitted reserve.
    // (With the built-in config the load processes used: free = 1000 / 12h.)
    let config = Arc::new(Config::builtin());
    let ledger = tollgate_tests::redis_ledger(&server.url(), &prefix, config).await;
    let usage = ledger.usage(&user("hot")).await.unwrap();
    let events = tollgate_tests::all_events(&ledger, &user("hot"))
        .await
        .unwrap();
    assert_eq!((usage.used, usage.limit, events.len()), (1000, 1000, 125));
}
