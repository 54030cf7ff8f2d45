//! What only the Redis backend has: key layout and expiry, prefixes, script
//! reloading, self-repair of the running total, failing closed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use tollgate_core::config::Config;
use tollgate_core::ledger::{ClaimRequest, Ledger, LedgerError, ReserveOutcome};
use tollgate_redis::keys::KeySpace;
use tollgate_tests::{random_prefix, RedisServer};

use crate::ledger::{config, redis_ledger, rid, user, CONFIG, WINDOW};

/// A connection for direct pokes and pipelines of thousands of scripts (a
/// loaded test machine may take seconds to answer those).
async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    tollgate_tests::bulk_connection(&server.url())
        .await
        .unwrap()
}

#[tokio::test]
async fn keys_share_a_hash_tag_and_expire_when_idle() {
    let server = RedisServer::start();
    // Keys live as long as the retention: the longest window of any plan.
    let prefix = random_prefix();
    let ledger = redis_ledger(&server.url(), &prefix).await;
    ledger.reserve(&user("long"), &rid("r1"), 3).await.unwrap();
    let keys = KeySpace::new(&prefix).unwrap().budget(&user("long"));
    let ttl: i64 = raw(&server).await.pttl(&keys.log).await.unwrap();
    // A write sets the expiry a retention and a slack (an eighth) on, and only
    // when less than a retention is left: most writes leave it alone.
    let retention = config().retention_ms() as i64;
    assert!(
        ttl > retention - 60_000 && ttl <= retention + retention / 8,
        "{ttl}"
    );
    // With short plans only, the keys go within a short retention.
    let text = CONFIG.replace("[plans.thousand]\nlimit = 1000\nwindow = \"12h\"\n", "");
    let text = text.split("[plans.multi]").next().unwrap().to_owned();
    let short = Arc::new(Config::parse(&text, "short").unwrap());
    assert_eq!(short.retention_ms(), WINDOW.as_millis() as u64);
    let prefix = random_prefix();
    let ledger = tollgate_tests::redis_ledger(&server.url(), &prefix, short).await;
    let u = user("idle");
    ledger.reserve(&u, &rid("r1"), 3).await.unwrap();
    ledger.set_plan(&u, "small").await.unwrap();
    let keys = KeySpace::new(&prefix).unwrap().budget(&u);
    let mut conn = raw(&server).await;
    let all: Vec<String> = conn.keys(format!("{prefix}:*")).await.unwrap();
    assert_eq!(
        all.len(),
        7,
        "log, meta, one index bucket, plan, audit, the hourly and daily spend rollups: {all:?}"
    );
    // The spend rollups expire the daily keep after their latest day (the
    // hours too: they fold into the days with the user's next charge).
    let keep = tollgate_core::spend::Keep::default();
    for (key, most) in [
        (
            keys.spend_hourly(),
            keep.daily + Duration::from_secs(86_400),
        ),
        (keys.spend_daily(), keep.daily + Duration::from_secs(86_400)),
    ] {
        let ttl: i64 = conn.pttl(&key).await.unwrap();
        assert!(ttl > 0 && ttl as u128 <= most.as_millis(), "{key}: {ttl}");
    }
    assert!(all.iter().all(|k| k.contains("{u:idle}")), "{all:?}");
    let window = WINDOW.as_millis() as i64;
    for key in [&keys.log, &keys.meta] {
        let ttl: i64 = conn.pttl(key).await.unwrap();
        assert!(ttl > 0 && ttl <= window + window / 8, "{key}: {ttl}");
    }
    // An index bucket lives two windows (see keep_bucket in lua/budget/lib/index.lua).
    let ttl: i64 = conn.pttl(keys.bucket(0)).await.unwrap();
    assert!(
        ttl > window && ttl <= 2 * window + window / 8,
        "bucket: {ttl}"
    );
    let plan_ttl: i64 = conn.pttl(&keys.plan).await.unwrap();
    assert_eq!(plan_ttl, -1, "a stored plan never expires");
    tokio::time::sleep(WINDOW + WINDOW / 8 + Duration::from_millis(50)).await;
    let left: Vec<String> = conn.keys(format!("{prefix}:*")).await.unwrap();
    assert!(
        !left.contains(&keys.log) && !left.contains(&keys.meta),
        "{left:?}"
    );
    tokio::time::sleep(WINDOW).await;
    let mut left: Vec<String> = conn.keys(format!("{prefix}:*")).await.unwrap();
    left.sort();
    // The export outlives the window (bounded by its maxlen), as billing
    // needs, and the spend rollups (bounded by their keeps).
    let mut kept = vec![
        keys.audit.clone(),
        keys.plan.clone(),
        keys.spend_daily(),
        keys.spend_hourly(),
    ];
    kept.sort();
    assert_eq!(left, kept);
}

/// What docs/src/budgets.md tells a billing job to do: find the users' export streams,
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

/// The budget scripts are one function library, loaded by the first call a
/// Redis answers "Function not found" (a new or flushed server, a new cluster
/// node), as EVALSHA scripts are on NOSCRIPT.
#[tokio::test]
async fn scripts_reload_after_a_flush() {
    let server = RedisServer::start();
    let ledger = redis_ledger(&server.url(), &random_prefix()).await;
    let u = user("flushy");
    ledger.reserve(&u, &rid("a"), 1).await.unwrap();
    let mut conn = raw(&server).await;
    let library = tollgate_redis::scripts::BUDGET.name();
    let listed = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LIST").arg("LIBRARYNAME").arg(library);
        let mut conn = conn.clone();
        async move {
            cmd.query_async::<Vec<redis::Value>>(&mut conn)
                .await
                .unwrap()
                .len()
        }
    };
    assert_eq!(listed(&mut conn).await, 1, "the budget library is loaded");
    for what in ["SCRIPT", "FUNCTION"] {
        redis::cmd(what)
            .arg("FLUSH")
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
    }
    assert_eq!(listed(&mut conn).await, 0);
    assert!(ledger.reserve(&u, &rid("b"), 1).await.unwrap().is_allowed());
    assert_eq!(listed(&mut conn).await, 1, "loaded again");
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
    let _: i64 = conn.hdel(&keys.meta, "t").await.unwrap();
    match ledger.reserve(&u, &rid("c"), 2).await.unwrap() {
        ReserveOutcome::Denied(d) => assert_eq!(d.used, 9),
        other => panic!("the rebuilt total must still deny: {other:?}"),
    }
}

/// An index bucket written only early in the window must outlive the log's
/// entries that point into it: when those entries leave the window, their
/// costs come off the total although the user wrote only to other buckets since.
#[tokio::test]
async fn events_leave_the_total_though_their_bucket_was_not_written_since() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger = redis_ledger(&server.url(), &prefix).await;
    let u = user("buckets");
    ledger.set_plan(&u, "big").await.unwrap();
    // 99 events: more than one bucket's load, so the index splits.
    for i in 0..99 {
        ledger
            .reserve(&u, &rid(&format!("early-{i}")), 1)
            .await
            .unwrap();
    }
    let written = Instant::now();
    let keys = KeySpace::new(&prefix).unwrap().budget(&u);
    let mut conn = raw(&server).await;
    let buckets: Vec<String> = conn
        .keys(format!("{}*", keys.bucket(0).trim_end_matches('0')))
        .await
        .unwrap();
    assert!(buckets.len() >= 2, "the index split: {buckets:?}");
    // Late in the window, one event: it rewrites the log, the meta and one bucket.
    tokio::time::sleep_until((written + WINDOW * 2 / 3).into()).await;
    ledger.reserve(&u, &rid("late"), 1).await.unwrap();
    // The 99 have left the window, the late one has not.
    tokio::time::sleep_until((written + WINDOW + Duration::from_millis(200)).into()).await;
    let usage = ledger.usage(&u).await.unwrap();
    assert!(
        written.elapsed() < WINDOW * 2 / 3 + WINDOW,
        "too slow to tell: the late event may have left too"
    );
    assert_eq!(usage.used, 1, "only the late event is live: {usage:?}");
    assert_eq!(usage.events.len(), 1);
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

/// Ids whose digests collide cannot be made on purpose here, so the case
/// the collision path exists for is forced: a bucket entry under another id's
/// digest field. Both ids stay separate events.
#[tokio::test]
async fn an_id_whose_digest_field_is_taken_is_kept_apart() {
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger = redis_ledger(&server.url(), &prefix).await;
    let u = user("collide");
    ledger.reserve(&u, &rid("first"), 3).await.unwrap();
    let keys = KeySpace::new(&prefix).unwrap().budget(&u);
    let mut conn = raw(&server).await;
    // Copy first's index entry to the digest field of "second" (a new user has
    // one bucket), as if their digests were equal.
    // (Besides the bucket's '~' field: when its expiry was last set.)
    let fields: Vec<(Vec<u8>, Vec<u8>)> = conn.hgetall(keys.bucket(0)).await.unwrap();
    let fields: Vec<_> = fields.into_iter().filter(|(f, _)| f != b"~").collect();
    assert_eq!(fields.len(), 1);
    let hex: String = redis::cmd("EVAL")
        .arg("return redis.sha1hex(ARGV[1])")
        .arg(0)
        .arg("second")
        .query_async(&mut conn)
        .await
        .unwrap();
    let second: Vec<u8> = (0..6)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let _: () = conn
        .hset(keys.bucket(0), &second, &fields[0].1)
        .await
        .unwrap();
    // The id check in the log tells the two apart: "second" is recorded beside.
    assert!(ledger
        .reserve(&u, &rid("second"), 4)
        .await
        .unwrap()
        .is_allowed());
    let usage = ledger.usage(&u).await.unwrap();
    let ids: Vec<&str> = usage.events.iter().map(|e| e.request_id.as_str()).collect();
    assert_eq!(ids, ["first", "second"]);
    assert_eq!(usage.used, 7);
    assert_eq!(
        ledger.refund(&u, &rid("second")).await.unwrap(),
        tollgate_core::ledger::RefundOutcome::Refunded { cost: 4, used: 3 }
    );
}

/// The memory target of a live spend event (<= 120 B of Redis over every key
/// of the user, with the api's id shapes), checked on 2,000 charges taken and
/// claimed as the api's jobs do, and on 2,000 plain reserves.
#[tokio::test]
async fn a_live_event_costs_at_most_120_bytes_of_redis() {
    use std::sync::Arc;
    use tollgate_core::{
        config::Config,
        id::RequestId,
        ledger::{ChargeOutcome, ChargeRequest, ClaimOutcome},
    };
    let config = Config::parse("[plans.big]\nlimit = 1000000\nwindow = \"12h\"\n", "mem");
    let server = RedisServer::start();
    let prefix = random_prefix();
    let ledger =
        tollgate_tests::redis_ledger(&server.url(), &prefix, Arc::new(config.unwrap())).await;
    let mut conn = raw(&server).await;
    const N: usize = 2_000;
    for (name, charges, most) in [("mem-r", false, 70.0), ("mem-c", true, 120.0)] {
        let u = user(name);
        for i in 0..N {
            let id = if i % 2 == 0 {
                RequestId::generate()
            } else {
                rid(&format!("idem-{:032x}", i * 7919))
            };
            if !charges {
                assert!(ledger.reserve(&u, &id, 1).await.unwrap().is_allowed());
                continue;
            }
            let (nonce, fp) = (format!("{:016x}", i), format!("{:024x}", i * 31));
            let req = ChargeRequest {
                cost: 1,
                nonce: &nonce,
                operation: "llm.structured",
                model: "",
                fingerprint: &fp,
                deadline: Duration::from_secs(600),
                grace: Duration::from_secs(1),
                service_key: None,
                price: None,
            };
            let ChargeOutcome::Charged { deadline_ms, .. } =
                ledger.charge(&u, &id, &req).await.unwrap()
            else {
                panic!("charge {i} not charged");
            };
            assert_eq!(
                ledger
                    .claim(&u, &id, &ClaimRequest::new(&nonce, deadline_ms + 1_000))
                    .await
                    .unwrap(),
                ClaimOutcome::Claimed
            );
        }
        let keys: Vec<String> = conn
            .keys(format!("{prefix}:v1:{{u:{name}}}*"))
            .await
            .unwrap();
        let mut bytes = 0u64;
        for k in &keys {
            let b: u64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(k)
                .arg("SAMPLES")
                .arg(0)
                .query_async(&mut conn)
                .await
                .unwrap();
            bytes += b;
        }
        let per = bytes as f64 / N as f64;
        assert!(
            per <= most,
            "{name}: {per:.1} B per live event over {keys:?}"
        );
    }
}

/// On a cluster, a primary without the budget library (a new node, a flushed
/// one) loads it at the first budget call routed there: the load goes to every
/// primary, and no call fails.
#[tokio::test]
async fn cluster_primaries_without_the_budget_library_load_it_again() {
    let cluster = tollgate_tests::redis_cluster::RedisCluster::start(3);
    let ledger = redis_ledger(&cluster.url(), &random_prefix()).await;
    let users: Vec<_> = (0..24).map(|i| user(&format!("lib{i}"))).collect();
    for u in &users {
        assert!(ledger.reserve(u, &rid("a"), 1).await.unwrap().is_allowed());
    }
    let library = tollgate_redis::scripts::BUDGET.name();
    let mut primaries = Vec::new();
    for node in &cluster.nodes {
        let mut conn = raw(node).await;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await.unwrap();
        if matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master") {
            primaries.push(conn);
        }
    }
    assert_eq!(primaries.len(), 3);
    let listed = |mut conn: redis::aio::MultiplexedConnection| async move {
        redis::cmd("FUNCTION")
            .arg("LIST")
            .arg("LIBRARYNAME")
            .arg(library)
            .query_async::<Vec<redis::Value>>(&mut conn)
            .await
            .unwrap()
            .len()
    };
    for conn in &primaries {
        assert_eq!(listed(conn.clone()).await, 1, "loaded on every primary");
        redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query_async::<()>(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(listed(conn.clone()).await, 0);
    }
    for u in &users {
        assert!(ledger.reserve(u, &rid("b"), 1).await.unwrap().is_allowed());
        assert_eq!(ledger.usage(u).await.unwrap().used, 2);
    }
    for conn in &primaries {
        assert_eq!(listed(conn.clone()).await, 1, "loaded again");
    }
}
