//! What only the Redis backend has: key layout and expiry, prefixes, script
//! reloading, self-repair of the running total, failing closed.

use std::time::{Duration, Instant};

use redis::AsyncCommands;
use tollgate_core::ledger::{Ledger, LedgerError, ReserveOutcome};
use tollgate_redis::keys::KeySpace;
use tollgate_tests::{random_prefix, RedisServer};

use crate::ledger::{redis_ledger, rid, user, WINDOW};

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test]
async fn keys_share_a_hash_tag_and_expire_when_idle() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger = redis_ledger(&server.url(), &prefix).await;
    let u = user("idle");
    ledger.reserve(&u, &rid("r1"), 3).await.unwrap();
    ledger.set_plan(&u, "small").await.unwrap();
    let keys = KeySpace::new(&prefix).unwrap().budget(&u);
    let mut conn = raw(&server).await;
    let all: Vec<String> = conn.keys(format!("{prefix}:*")).await.unwrap();
    assert_eq!(all.len(), 3, "{all:?}");
    assert!(all.iter().all(|k| k.contains("{u:idle}")), "{all:?}");
    for key in [&keys.events, &keys.costs] {
        let ttl: i64 = conn.pttl(key).await.unwrap();
        assert!(ttl > 0 && ttl <= WINDOW.as_millis() as i64, "{key}: {ttl}");
    }
    let plan_ttl: i64 = conn.pttl(&keys.plan).await.unwrap();
    assert_eq!(plan_ttl, -1, "a stored plan never expires");
    tokio::time::sleep(WINDOW + Duration::from_millis(50)).await;
    let left: Vec<String> = conn.keys(format!("{prefix}:*")).await.unwrap();
    assert_eq!(left, vec![keys.plan.clone()]);
}

#[tokio::test]
async fn prefixes_isolate_deployments() {
    let server = RedisServer::start();
    let a = redis_ledger(&server.url(), "deploy-a").await;
    let b = redis_ledger(&server.url(), "deploy-b").await;
    let u = user("shared-name");
    a.reserve(&u, &rid("r"), 10).await.unwrap();
    assert!(b.reserve(&u, &rid("r"), 10).await.unwrap().is_allowed());
    assert_eq!(a.usage(&u).await.unwrap().used, 10);
    assert_eq!(b.usage(&u).await.unwrap().used, 10);
}

#[tokio::test]
async fn scripts_reload_after_a_flush() {
    let server = RedisServer::start();
    let ledger = redis_ledger(&server.url(), &random_prefix()).await;
    let u = user("flushy");
    ledger.reserve(&u, &rid("a"), 1).await.unwrap();
    let mut conn = raw(&server).await;
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    assert!(ledger.reserve(&u, &rid("b"), 1).await.unwrap().is_allowed());
    assert_eq!(ledger.usage(&u).await.unwrap().used, 2);
}

#[tokio::test]
async fn a_lost_running_total_is_rebuilt() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger = redis_ledger(&server.url(), &prefix).await;
    let u = user("repair");
    ledger.reserve(&u, &rid("a"), 4).await.unwrap();
    ledger.reserve(&u, &rid("b"), 5).await.unwrap();
    let keys = KeySpace::new(&prefix).unwrap().budget(&u);
    let mut conn = raw(&server).await;
    let _: i64 = conn.hdel(&keys.costs, ":total").await.unwrap();
    match ledger.reserve(&u, &rid("c"), 2).await.unwrap() {
        ReserveOutcome::Denied(d) => assert_eq!(d.used, 9),
        other => panic!("the rebuilt total must still deny: {other:?}"),
    }
}

#[tokio::test]
async fn an_unreachable_redis_fails_closed_and_fast() {
    let server = RedisServer::start();
    let ledger = redis_ledger(&server.url(), &random_prefix())
        .await
        .with_timeout(Duration::from_secs(1));
    let u = user("down");
    ledger.reserve(&u, &rid("a"), 1).await.unwrap();
    drop(server);
    let started = Instant::now();
    let err = ledger.reserve(&u, &rid("b"), 1).await.unwrap_err();
    assert!(matches!(err, LedgerError::Store(_)), "{err:?}");
    assert!(err.is_transient());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by the call timeout"
    );
}
