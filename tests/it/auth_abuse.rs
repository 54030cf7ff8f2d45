//! Abuse before authentication, on a real Redis: unknown keys from one address
//! are answered 429 by an in-process limiter after a small burst, a repeated bad
//! key reaches Redis once per cache period, the client address comes from a
//! proxy header only when the operator names one, and valid keys are looked up
//! once per cache period.

use std::time::{Duration, Instant};

use axum::http::{HeaderName, StatusCode};
use tollgate_api::abuse::{FAILURE_BURST, FAILURE_INTERVAL};
use tollgate_api::keycache::KEY_TTL;
use tollgate_api::{problem::ProblemType, state::Settings};

use crate::api::{settings, Harness};

async fn harness(settings: Settings) -> Harness {
    Harness::redis(settings).await
}

fn behind_proxy() -> Settings {
    Settings {
        trusted_proxy_header: Some(HeaderName::from_static("x-forwarded-for")),
        ..settings()
    }
}

/// Commands Redis has run, per command name (INFO commandstats), INFO excluded.
fn commands(h: &Harness) -> std::collections::BTreeMap<String, u64> {
    let mut calls = tollgate_tests::redis_info::command_calls(&h.redis.as_ref().unwrap().url());
    calls.remove("info");
    calls
}

fn total(stats: &std::collections::BTreeMap<String, u64>) -> u64 {
    stats.values().sum()
}

fn random_key(i: u64) -> String {
    format!("Bearer tg_{i:064x}")
}

/// 10,000 random keys from one address cost Redis a burst of lookups and then
/// one per interval; the rest are 429 with Retry-After. Another address, and a
/// valid key known to this process, still get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_keys_from_one_address_cost_redis_a_bounded_number_of_commands() {
    let h = harness(behind_proxy()).await;
    let key = h.user("alice", "free").await;
    assert_eq!(h.usage(&key).await["used"], 0);
    let before = commands(&h);
    let started = Instant::now();
    let (mut unauthorized, mut limited) = (0u64, 0u64);
    for i in 0..10_000u64 {
        let auth = random_key(i);
        let r = h
            .call(
                "GET",
                "/v1/usage",
                None,
                &[("authorization", &auth), ("x-forwarded-for", "203.0.113.7")],
                None,
            )
            .await;
        match r.status {
            StatusCode::UNAUTHORIZED => unauthorized += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                r.problem(ProblemType::TooManyFailedAuthentications);
                assert!(r.header("retry-after").parse::<u64>().unwrap() >= 1);
                limited += 1;
            }
            other => panic!("{other}: {}", r.body),
        }
    }
    let elapsed = started.elapsed();
    let after = commands(&h);
    let spent = total(&after) - total(&before);
    let by_command: Vec<String> = after
        .iter()
        .map(|(name, n)| (name, n - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .map(|(name, d)| format!("{name} {d}"))
        .collect();
    // The limiter's own arithmetic: the burst, then one 401 per interval. The
    // lookup that finds the budget spent starts a block, and costs one
    // command too: one per block, at most one block per interval (and the first).
    let intervals = elapsed.as_millis() as u64 / FAILURE_INTERVAL.as_millis() as u64;
    let bound = u64::from(FAILURE_BURST) + intervals + 1;
    assert!(
        spent <= bound + intervals + 1 && unauthorized <= bound,
        "{spent} Redis commands ({by_command:?}), {unauthorized} 401s for 10,000 bad keys in {elapsed:?} (bound {bound} 401s, {} commands)",
        bound + intervals + 1
    );
    assert_eq!(unauthorized + limited, 10_000);
    eprintln!("10,000 random keys: {spent} Redis commands, {unauthorized} x 401, {limited} x 429 in {elapsed:?}");

    // Another address is not affected ...
    let r = h
        .call(
            "GET",
            "/v1/usage",
            None,
            &[
                ("authorization", &random_key(1)),
                ("x-forwarded-for", "198.51.100.1"),
            ],
            None,
        )
        .await;
    r.problem(ProblemType::Unauthorized);
    // ... and a valid key this process knows passes even from the blocked one.
    let bearer = format!("Bearer {key}");
    let r = h
        .call(
            "GET",
            "/v1/usage",
            None,
            &[
                ("authorization", &bearer),
                ("x-forwarded-for", "203.0.113.7"),
            ],
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

/// The same unknown key twice within the cache period: one lookup in Redis.
/// A valid key's calls look the key up once per cache period too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_keys_reach_redis_once_per_cache_period() {
    let h = harness(behind_proxy()).await;
    let key = h.user("alice", "free").await;
    let before = commands(&h);
    for client in ["192.0.2.1", "192.0.2.2", "192.0.2.3"] {
        let r = h
            .call(
                "GET",
                "/v1/usage",
                None,
                &[
                    ("authorization", &random_key(7)),
                    ("x-forwarded-for", client),
                ],
                None,
            )
            .await;
        r.problem(ProblemType::Unauthorized);
    }
    let after = commands(&h);
    let hmget = |s: &std::collections::BTreeMap<String, u64>| s.get("hmget").copied().unwrap_or(0);
    assert_eq!(hmget(&after) - hmget(&before), 1, "{after:?}");

    for _ in 0..20 {
        h.usage(&key).await;
    }
    let later = commands(&h);
    // Each usage read is one FCALL that runs one HMGET of the user's totals
    // inside Redis (counted under hmget too): what is left is key lookups.
    let fcall = |s: &std::collections::BTreeMap<String, u64>| s.get("fcall").copied().unwrap_or(0);
    let lookups = (hmget(&later) - hmget(&after)) - (fcall(&later) - fcall(&after));
    assert!(lookups <= 1, "{later:?}");
}

/// No header is trusted unless the operator names one: a client cannot escape
/// the limiter by inventing X-Forwarded-For addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_headers_are_ignored_unless_trusted() {
    let h = harness(settings()).await;
    let mut limited = false;
    for i in 0..u64::from(FAILURE_BURST) * 3 {
        let forwarded = format!("10.0.{}.{}", i / 250, i % 250);
        let r = h
            .call(
                "GET",
                "/v1/usage",
                None,
                &[
                    ("authorization", &random_key(i)),
                    ("x-forwarded-for", &forwarded),
                ],
                None,
            )
            .await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            limited = true;
            break;
        }
    }
    assert!(
        limited,
        "invented X-Forwarded-For addresses escaped the limiter"
    );
}

/// A key revoked through this process stops at once; revoked elsewhere (another
/// pod, the CLI: here the store itself), within the cache period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_is_honoured_within_the_cache_period() {
    let h = harness(settings()).await;
    let r = h
        .post(
            "/admin/users",
            crate::api::ADMIN,
            serde_json::json!({"user": "alice"}),
        )
        .await;
    let key = r.body["api_key"].as_str().unwrap().to_owned();
    let key_id = r.body["key_id"].as_str().unwrap().to_owned();
    h.usage(&key).await;
    let r = h
        .call(
            "DELETE",
            &format!("/admin/keys/{key_id}"),
            Some(crate::api::ADMIN),
            &[],
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = h.get("/v1/usage", &key, &[]).await;
    r.problem(ProblemType::Unauthorized);

    let key2 = h.user("bob", "free").await;
    h.usage(&key2).await;
    let kid = {
        let hash = tollgate_core::keystore::KeyHash::of(&key2);
        h.state.keys.lookup(&hash).await.unwrap().unwrap().key_id
    };
    h.state.keys.revoke(&kid).await.unwrap();
    let deadline = Instant::now() + KEY_TTL + Duration::from_secs(2);
    loop {
        let r = h.get("/v1/usage", &key2, &[]).await;
        if r.status == StatusCode::UNAUTHORIZED {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still accepted after {KEY_TTL:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
