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
    assert_eq!(all.len(), 4, "events, costs, plan, audit: {all:?}");
    assert!(all.iter().all(|k| k.contains("{u:idle}")), "{all:?}");
    for key in [&keys.events, &keys.costs] {
        let ttl: i64 = conn.pttl(key).await.unwrap();
        assert!(ttl > 0 && ttl <= WINDOW.as_millis() as i64, "{key}: {ttl}");
    }
    let plan_ttl: i64 = conn.pttl(&keys.plan).await.unwrap();
    assert_eq!(plan_ttl, -1, "a stored plan never expires");
    tokio::time::sleep(WINDOW + Duration::from_millis(50)).await;
    let mut left: Vec<String> = conn.keys(format!("{prefix}:*")).await.unwrap();
    left.sort();
    // The export outlives the window (bounded by its maxlen), as billing needs.
    assert_eq!(left, vec![keys.audit.clone(), keys.plan.clone()]);
}

/// What the README tells a billing job to do: find the users' export streams,
/// read them with a consumer group, acknowledge what it processed. Replaying
/// the entries rebuilds each user's live events exactly.
#[tokio::test]
async fn a_billing_job_consumes_the_export_with_a_consumer_group() {
    use tollgate_core::ledger::ExportEntry;
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger = redis_ledger(&server.url(), &prefix).await;
    let users = [user("bill-a"), user("bill-b")];
    for (n, u) in users.iter().enumerate() {
        for i in 0..4 {
            ledger.reserve(u, &rid(&format!("r{i}")), 2).await.unwrap();
        }
        ledger.refund(u, &rid("r1")).await.unwrap();
        ledger.settle(u, &rid("r2"), 1 + n as u64).await.unwrap();
    }
    let mut conn = raw(&server).await;
    let mut streams: Vec<String> = Vec::new();
    let mut iter: redis::AsyncIter<String> = conn
        .scan_match(format!("{prefix}:v1:{{u:*}}:audit"))
        .await
        .unwrap();
    while let Some(key) = iter.next_item().await {
        streams.push(key.unwrap());
    }
    drop(iter);
    streams.sort();
    assert_eq!(streams.len(), 2, "{streams:?}");
    for s in &streams {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(s)
            .arg("billing")
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let read = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg("billing")
            .arg("job-1")
            .arg("COUNT")
            .arg(100);
        cmd.arg("STREAMS").arg(&streams);
        for _ in &streams {
            cmd.arg(">");
        }
        let mut conn = conn.clone();
        async move { cmd.query_async::<redis::Value>(&mut conn).await.unwrap() }
    };
    let reply = read(&mut conn).await;
    let redis::Value::Array(per_stream) = reply else {
        panic!("{reply:?}")
    };
    for (stream, u) in per_stream.iter().zip(&users) {
        let redis::Value::Array(pair) = stream else {
            panic!("{stream:?}")
        };
        let redis::Value::Array(entries) = &pair[1] else {
            panic!("{pair:?}")
        };
        let export: Vec<ExportEntry> = entries
            .iter()
            .map(|e| tollgate_redis::ledger::parse_export(e).unwrap())
            .collect();
        assert_eq!(export, ledger.exported(u, 0, 100).await.unwrap());
        let usage = ledger.usage(u).await.unwrap();
        let live = crate::ledger::replay(&export, usage.now_ms, usage.window_ms);
        let expected: std::collections::BTreeMap<String, (u64, u64)> = usage
            .events
            .iter()
            .map(|e| (e.request_id.to_string(), (e.at_ms, e.cost)))
            .collect();
        assert_eq!(live, expected);
        let key = streams
            .iter()
            .find(|s| s.contains(&format!("{{u:{u}}}")))
            .unwrap();
        let ids: Vec<&str> = export.iter().map(|e| e.id.as_str()).collect();
        let acked: u64 = redis::cmd("XACK")
            .arg(key)
            .arg("billing")
            .arg(&ids)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(acked, 6);
    }
    // Everything was delivered and acknowledged: nothing new, nothing pending.
    assert_eq!(read(&mut conn).await, redis::Value::Nil);
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
