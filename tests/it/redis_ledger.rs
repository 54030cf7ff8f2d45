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
        5,
        "log, meta, one index bucket, plan, audit: {all:?}"
    );
    assert!(all.iter().all(|k| k.contains("{u:idle}")), "{all:?}");
    let window = WINDOW.as_millis() as i64;
    for key in [&keys.log, &keys.meta] {
        let ttl: i64 = conn.pttl(key).await.unwrap();
        assert!(ttl > 0 && ttl <= window + window / 8, "{key}: {ttl}");
    }
    // An index bucket lives two windows (see keep_bucket in lua/lib/budget.lua).
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
    // The export outlives the window (bounded by its maxlen), as billing needs.
    assert_eq!(left, vec![keys.audit.clone(), keys.plan.clone()]);
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

/// The budget scripts of the previous key layout (a sorted set of events, a
/// hash of costs, a hash of charge owners), as they were before the layout
/// changed: they write the data an upgraded deployment finds.
mod legacy {
    pub const LIB: &str = include_str!("legacy/budget.lua");
    pub const RESERVE: &str = include_str!("legacy/reserve.lua");
    pub const CHARGE: &str = include_str!("legacy/charge.lua");
}

/// Data written by the previous version keeps working: the first call for the
/// user moves its events (2,000 per script call, so this user takes two) into
/// the current layout, with their times, costs, operations, owners and
/// estimates, and both windows' totals.
#[tokio::test]
async fn events_of_the_previous_layout_are_moved_on_first_touch() {
    use std::sync::Arc;
    use tollgate_core::{
        config::Config,
        ledger::{ChargeOutcome, ChargeRequest, ClaimOutcome, RefundOutcome},
    };
    use tollgate_redis::scripts::PlanArgs;
    const CONF: &str = r#"
default_plan = "two"
[plans.two]
limits = [{ limit = 1000000, window = "12h" }, { limit = 1000000, window = "1h" }]
"#;
    let config = Arc::new(Config::parse(CONF, "legacy").unwrap());
    let server = RedisServer::start();
    let prefix = random_prefix();
    let u = user("upgraded");
    let keys = KeySpace::new(&prefix).unwrap().budget(&u);
    let mut conn = raw(&server).await;
    // The ARGV tail as the scripts read it: no export, the one plan.
    let two = config.default_plan();
    let plan_args: Vec<String> = vec!["0".into(), two.name.clone(), PlanArgs::limits(two)];
    let old_keys = tollgate_tests::previous_layout_keys(&keys);
    let reserve = redis::Script::new(&format!("{}\n{}", legacy::LIB, legacy::RESERVE));
    let charge = redis::Script::new(&format!("{}\n{}", legacy::LIB, legacy::CHARGE));
    // 2,100 plain reserves of cost 2, pipelined.
    let mut pipe = redis::pipe();
    let sha = reserve.get_hash().to_owned();
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(format!("{}\n{}", legacy::LIB, legacy::RESERVE))
        .query_async(&mut conn)
        .await
        .unwrap();
    for i in 0..2100 {
        pipe.cmd("EVALSHA")
            .arg(&sha)
            .arg(6)
            .arg(&old_keys[..])
            .arg(format!("old-{i}"))
            .arg(2)
            .arg(&plan_args)
            .ignore();
    }
    let () = pipe.query_async(&mut conn).await.unwrap();
    // Two charges of the api's id shapes: one held, one claimed by its job
    // and settled (its owner record as claim.lua and settle.lua left it).
    let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
    let idem = "idem-0123456789abcdef0123456789abcdef";
    for (id, nonce) in [(uuid, "00112233445566aa"), (idem, "n1")] {
        let r: Vec<redis::Value> = charge
            .prepare_invoke()
            .key(&old_keys[..])
            .arg(id)
            .arg(5)
            .arg(nonce)
            .arg("llm.structured")
            .arg("abcdef0123456789abcdef01")
            .arg(60_000)
            .arg(1_000)
            .arg(&plan_args)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(r.first(), Some(&redis::Value::Int(1)), "{r:?}");
    }
    let owner: String = conn.hget(&keys.owners, idem).await.unwrap();
    let claimed = format!("j{} 5", &owner[1..]);
    let _: () = conn.hset(&keys.owners, idem, &claimed).await.unwrap();
    let _: () = conn.hset(&keys.costs, idem, 3).await.unwrap();
    let total: String = conn.hget(&keys.costs, ":total").await.unwrap();
    let _: () = conn
        .hset(&keys.costs, ":total", total.replacen("4210", "4208", 2))
        .await
        .unwrap();
    let times: Vec<(String, u64)> = conn.zrange_withscores(&keys.events, 0, -1).await.unwrap();
    assert_eq!(times.len(), 2102);

    let ledger = tollgate_tests::redis_ledger(&server.url(), &prefix, Arc::clone(&config)).await;
    let usage = ledger.usage(&u).await.unwrap();
    assert_eq!(usage.used, 4208, "{:?}", usage.windows);
    assert_eq!(
        usage.windows[1].used, 4208,
        "the shorter window's total is rebuilt"
    );
    let events = tollgate_tests::all_events(&ledger, &u).await.unwrap();
    let listed: Vec<(String, u64)> = events
        .iter()
        .map(|e| (e.request_id.as_str().to_owned(), e.at_ms))
        .collect();
    assert_eq!(listed, times, "every event, with its time, oldest first");
    let held = events
        .iter()
        .find(|e| e.request_id.as_str() == uuid)
        .unwrap();
    assert_eq!(
        (held.cost, held.operation.as_deref(), held.estimate),
        (5, Some("llm.structured"), None)
    );
    let settled = events
        .iter()
        .find(|e| e.request_id.as_str() == idem)
        .unwrap();
    assert_eq!(
        (settled.cost, settled.operation.as_deref(), settled.estimate),
        (3, Some("llm.structured"), Some(5))
    );
    let left: i64 = redis::cmd("EXISTS")
        .arg(&keys.events)
        .arg(&keys.costs)
        .arg(&keys.owners)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "the previous layout's keys are gone");

    // The moved events behave as live ones.
    let again = ledger.reserve(&u, &rid("old-5"), 2).await.unwrap();
    match again {
        ReserveOutcome::Allowed(a) => assert!(a.duplicate && a.at_ms == times[5].1, "{a:?}"),
        other => panic!("{other:?}"),
    }
    let req = |nonce| ChargeRequest {
        cost: 5,
        nonce,
        operation: "llm.structured",
        fingerprint: "abcdef0123456789abcdef01",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(1),
        service_key: None,
    };
    match ledger.charge(&u, &rid(uuid), &req("other")).await.unwrap() {
        ChargeOutcome::Existing { nonce, claimed, .. } => {
            assert_eq!((nonce.as_str(), claimed), ("00112233445566aa", false))
        }
        other => panic!("{other:?}"),
    }
    match ledger.charge(&u, &rid(idem), &req("other")).await.unwrap() {
        ChargeOutcome::Existing { nonce, claimed, .. } => {
            assert_eq!((nonce.as_str(), claimed), ("n1", true))
        }
        other => panic!("{other:?}"),
    }
    let hold_until = usage.now_ms + 120_000;
    assert_eq!(
        ledger
            .claim(
                &u,
                &rid(uuid),
                &ClaimRequest::new("00112233445566aa", hold_until)
            )
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    assert_eq!(
        ledger.refund(&u, &rid("old-7")).await.unwrap(),
        RefundOutcome::Refunded {
            cost: 2,
            used: 4206
        }
    );
    assert_eq!(
        ledger.release(&u, &rid(idem), "n1").await.unwrap(),
        RefundOutcome::Refunded {
            cost: 3,
            used: 4203
        }
    );
    let after = ledger.usage(&u).await.unwrap();
    let live = tollgate_tests::all_events(&ledger, &u).await.unwrap();
    assert_eq!(
        (after.used, after.windows[1].used, live.len()),
        (4203, 4203, 2100)
    );

    // A pod still on the previous version (a rolling upgrade) writes the old
    // keys again: the next call moves that event too, and counts it.
    let r: Vec<redis::Value> = reserve
        .prepare_invoke()
        .key(&old_keys[..])
        .arg("late")
        .arg(4)
        .arg(&plan_args)
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(r.first(), Some(&redis::Value::Int(1)), "{r:?}");
    let after = ledger.usage(&u).await.unwrap();
    let live = tollgate_tests::all_events(&ledger, &u).await.unwrap();
    assert_eq!(
        (after.used, after.windows[1].used, live.len()),
        (4207, 4207, 2101)
    );
    assert_eq!(live.last().unwrap().request_id.as_str(), "late");
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
                fingerprint: &fp,
                deadline: Duration::from_secs(600),
                grace: Duration::from_secs(1),
                service_key: None,
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
