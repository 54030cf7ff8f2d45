//! `max_concurrent` with real processes: one `tollgate throttler`, three
//! `tollgate worker`s, the recording upstream (each call takes 400 ms). The
//! first worker alone fills the provider's 3 slots, the two others start, and
//! the first is SIGKILLed with its 3 calls in flight: the upstream never has
//! more than 3 calls in flight, nobody else calls while the dead worker's
//! slots are leased, and they come back within their lease (3 s after the last
//! renewal), then every job ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::{
    config::{Config, SLOT_LEASE},
    id::UserId,
};
use tollgate_tests::jobs::{submit_queued, wait_final};
use tollgate_tests::process::{spawn_role, Procs};
use tollgate_tests::throttle::now_us;
use tollgate_tests::upstream::Upstream;
use tollgate_tests::{random_prefix, temp_file, RedisServer};

use crate::jobs::redis_queue;

const SLOTS: usize = 3;
const JOBS: usize = 24;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_slots_a_killed_worker_gives_its_slots_back_within_their_lease() {
    let upstream = Upstream::unlimited(Duration::from_millis(400)).await;
    let server = RedisServer::start();
    let prefix = random_prefix();
    let text = format!(
        r#"
[plans.free]
limit = 1000000
window = "1h"
[providers.llm]
rate = 100
burst = 10
max_wait = "60s"
max_concurrent = {SLOTS}
url = "{}"
timeout = "10s"
retries = 0
[operations.call]
cost = 1
provider = "llm"
path = "/llm"
"#,
        upstream.url()
    );
    let (dir, config_path) = temp_file("it", "slots.toml", &text).unwrap();
    let config = Arc::new(Config::parse(&text, "slots test").unwrap());
    // One user: no share of the worker held back for others (the first
    // worker alone must fill the provider's 3 slots).
    let worker = [
        "worker",
        "--lease-ms",
        "1500",
        "--concurrency",
        "4",
        "--user-share",
        "1",
    ];
    let mut procs = Procs(vec![
        spawn_role(&server.url(), &prefix, &config_path, &["throttler"]),
        spawn_role(&server.url(), &prefix, &config_path, &worker),
    ]);
    let (q, _ledger) = redis_queue(&server, &prefix, Arc::clone(&config)).await;
    let user = UserId::new("pat").unwrap();
    let inputs = (0..JOBS).map(|i| json!({ "n": i }));
    let ids = submit_queued(&*q, &user, "call", inputs).await;
    // The first worker alone: it takes the 3 slots.
    let started = Instant::now();
    while upstream.arrivals().len() < SLOTS {
        assert!(started.elapsed() < Duration::from_secs(20), "no calls");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    procs
        .0
        .push(spawn_role(&server.url(), &prefix, &config_path, &worker));
    procs
        .0
        .push(spawn_role(&server.url(), &prefix, &config_path, &worker));
    let _ = procs.0[1].kill(); // SIGKILL, its 3 calls in flight
    let _ = procs.0[1].wait();
    let killed_us = now_us();
    wait_final(&*q, &user, &ids, Duration::from_secs(60)).await;
    let arrivals = upstream.arrivals();
    let most = arrivals.iter().map(|a| a.in_flight).max().unwrap_or(0);
    assert!(
        most <= SLOTS,
        "{most} calls in flight at the upstream (max_concurrent {SLOTS})"
    );
    let after: Vec<u64> = arrivals
        .iter()
        .filter(|a| a.at_us > killed_us)
        .map(|a| (a.at_us - killed_us) / 1000)
        .collect();
    let first_ms = *after.first().expect("calls after the kill");
    let lease_ms = SLOT_LEASE.as_millis() as u64;
    // Renewed every third of the lease: they end 2 to 3 s after the kill.
    assert!(
        first_ms >= lease_ms * 2 / 3 - 100,
        "a call went out {first_ms} ms after the kill, the dead worker's slots still leased"
    );
    assert!(
        first_ms <= lease_ms + 1000,
        "the dead worker's slots came back only {first_ms} ms after the kill"
    );
    assert!(
        arrivals.len() >= JOBS,
        "every job called: {}",
        arrivals.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
