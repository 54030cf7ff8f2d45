//! Per-user limits (an admin's custom plan for one user) and the admin
//! surface (users listed and searched by pages, a user's keys and usage), on
//! the in-memory backends, a real Redis and the suite's Redis Cluster.
//!
//! The ledger cases run through the conformance suite's backends; the HTTP
//! cases through the api's router, on Redis with a second "pod" (another
//! `ApiState`, its own connections and key cache) on the same keys.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tollgate_api::problem::ProblemType;
use tollgate_core::config::Limit;
use tollgate_core::ledger::{check_custom_limits, EventPage, Ledger, ReserveOutcome};
use tollgate_memory::keystore::MemoryKeyStore;
use tollgate_redis::ledger::RedisLedger;
use tower::ServiceExt;

use crate::api::{redis_state, settings, state_prefix, Harness, ADMIN};
use crate::ledger::{config, rid, user, Backend, MemoryBackend, RedisBackend};

fn limit(limit: u64, window_ms: u64) -> Limit {
    Limit::window(limit, Duration::from_millis(window_ms))
}

fn allowed(r: &ReserveOutcome) -> bool {
    r.is_allowed()
}

/// The sum of the costs of the live events spent after `since_ms`, read page
/// by page from the audit trail.
async fn events_after(l: &dyn Ledger, u: &tollgate_core::id::UserId, since_ms: u64) -> u64 {
    let mut page = EventPage::new(None, EventPage::MAX_LIMIT).unwrap();
    let mut sum = 0;
    loop {
        let usage = l.usage_page(u, page).await.unwrap();
        sum += usage
            .events
            .iter()
            .filter(|e| e.at_ms > since_ms)
            .map(|e| e.cost)
            .sum::<u64>();
        match usage.next_cursor {
            Some(c) => page = page.next(c),
            None => return sum,
        }
    }
}

// ---------------------------------------------------------------- ledger

/// Custom limits replace the plan's from the next call on (lower: refuses
/// until the window frees; higher: admits what the plan could not), show as
/// `custom` in usage, and go when cleared or when a named plan is set.
async fn custom_limits_replace_the_plan_until_cleared(b: &impl Backend) {
    let l = b.ledger();
    let u = user("cl-ann");
    // Plan small: 10 per 1.5 s.
    assert!(allowed(&l.reserve(&u, &rid("a1"), 8).await.unwrap()));
    assert_eq!(l.custom_limits(&u).await.unwrap(), None);

    l.set_limits(&u, &[limit(4, 1500)]).await.unwrap();
    assert_eq!(
        l.custom_limits(&u).await.unwrap(),
        Some(vec![limit(4, 1500)])
    );
    // Lowered below what is spent: refused until the window frees.
    assert!(!allowed(&l.reserve(&u, &rid("a2"), 1).await.unwrap()));
    let usage = l.usage(&u).await.unwrap();
    assert_eq!((usage.plan.as_str(), usage.custom_limits), ("custom", true));
    assert_eq!(usage.windows.len(), 1);
    assert_eq!(
        (usage.windows[0].limit, usage.windows[0].used),
        (4, 8),
        "{usage:?}"
    );
    // The named plan stays: it is what the user returns to.
    assert_eq!(l.plan(&u).await.unwrap(), "small");

    // Raised past the plan's: a cost the plan could never admit fits.
    l.set_limits(&u, &[limit(100, 1500)]).await.unwrap();
    assert!(allowed(&l.reserve(&u, &rid("a3"), 50).await.unwrap()));
    assert_eq!(l.usage(&u).await.unwrap().used, 58);

    // Cleared: the plan's 10 again (58 spent: refused), once.
    assert!(l.clear_limits(&u).await.unwrap());
    assert!(!l.clear_limits(&u).await.unwrap());
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.plan.as_str(), usage.custom_limits, usage.limit),
        ("small", false, 10)
    );
    assert!(matches!(
        l.reserve(&u, &rid("a4"), 11).await,
        Err(tollgate_core::ledger::LedgerError::CostExceedsLimit { .. })
    ));

    // A named plan replaces custom limits.
    l.set_limits(&u, &[limit(7, 1500)]).await.unwrap();
    l.set_plan(&u, "big").await.unwrap();
    assert_eq!(l.custom_limits(&u).await.unwrap(), None);
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.plan.as_str(), usage.custom_limits, usage.limit),
        ("big", false, 100)
    );

    // Past the window everything frees, under custom limits too.
    l.set_limits(&u, &[limit(5, 1500)]).await.unwrap();
    b.pass(Duration::from_millis(1600)).await;
    assert!(allowed(&l.reserve(&u, &rid("a5"), 5).await.unwrap()));
    assert!(!allowed(&l.reserve(&u, &rid("a6"), 1).await.unwrap()));
    // A malformed list never reaches the store.
    assert!(l
        .set_limits(&u, &[limit(5, 1000), limit(6, 2000)])
        .await
        .is_err());
    assert!(l.set_limits(&u, &[]).await.is_err());
    assert!(l.set_limits(&u, &[limit(0, 1000)]).await.is_err());
}

/// A window that custom limits add, which the running totals do not have
/// yet, counts exactly the live events inside it: the log is walked (on
/// Redis a slice per call: more events leave it than one call reads).
async fn a_window_added_by_custom_limits_counts_live_events(b: &impl Backend) {
    let l = b.ledger();
    let u = user("cl-bob");
    l.set_plan(&u, "thousand").await.unwrap(); // 1000 per 12 h
                                               // More events than one budget script reads (its slice: 100) will leave
                                               // the new window before it is first used.
    for i in 0..150 {
        assert!(allowed(
            &l.reserve(&u, &rid(&format!("old-{i}")), 1).await.unwrap()
        ));
    }
    b.pass(Duration::from_millis(1600)).await;
    for i in 0..3 {
        assert!(allowed(
            &l.reserve(&u, &rid(&format!("new-{i}")), 1).await.unwrap()
        ));
    }
    // 1000 per 12 h and 10 per 1.5 s: only the 3 recent events are in it.
    l.set_limits(&u, &[limit(1000, 12 * 3_600_000), limit(10, 1500)])
        .await
        .unwrap();
    assert!(!allowed(&l.reserve(&u, &rid("n8"), 8).await.unwrap()));
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(usage.windows.len(), 2, "{usage:?}");
    assert_eq!(usage.windows[0].used, 153);
    assert_eq!(usage.windows[1].used, 3, "{usage:?}");
    let in_short = events_after(l.as_ref(), &u, usage.now_ms - 1500).await;
    assert_eq!(usage.windows[1].used, in_short);
    assert!(allowed(&l.reserve(&u, &rid("n7"), 7).await.unwrap()));
    let usage = l.usage(&u).await.unwrap();
    assert_eq!(
        (usage.windows[0].used, usage.windows[1].used),
        (160, 10),
        "{usage:?}"
    );
    let in_short = events_after(l.as_ref(), &u, usage.now_ms - 1500).await;
    assert_eq!(usage.windows[1].used, in_short);
}

/// Custom limits are validated like a plan's, and held to the retention.
#[test]
fn custom_limits_are_validated_as_a_plans() {
    let c = config();
    let ok = c
        .override_limits(vec![(100, "1m".into()), (1000, "12h".into())])
        .unwrap();
    assert_eq!(ok, vec![limit(1000, 12 * 3_600_000), limit(100, 60_000)]);
    check_custom_limits(&ok).unwrap();
    let err = c.override_limits(vec![(10, "13h".into())]).unwrap_err();
    assert!(err.contains("retention"), "{err}");
    let err = c
        .override_limits(vec![(10, "1h".into()), (20, "60m".into())])
        .unwrap_err();
    assert!(err.contains("twice"), "{err}");
    let err = c.override_limits(vec![(0, "1h".into())]).unwrap_err();
    assert!(err.starts_with("limits[0].limit"), "{err}");
    let err = c
        .override_limits(vec![(10, "1h".into()), (10, "soon".into())])
        .unwrap_err();
    assert!(err.starts_with("limits[1].window"), "{err}");
    assert!(c.override_limits(vec![]).is_err());
    let nine = (1..=9).map(|i| (i, format!("{i}m"))).collect();
    assert!(c.override_limits(nine).is_err());
    assert!(check_custom_limits(&[limit(1, 10), limit(2, 20)]).is_err());
}

/// The ledger's side, on every backend.
mod ledger {
    use super::*;
    on_each_backend!(threads 4, [
        custom_limits_replace_the_plan_until_cleared,
        a_window_added_by_custom_limits_counts_live_events,
    ]
        memory => &super::MemoryBackend::new(),
        redis => &super::RedisBackend::start().await,
        cluster => &super::RedisBackend::cluster().await,
    );
}

/// On Redis, a second ledger (another pod) on the same keys sees custom
/// limits on its very next call.
async fn two_redis_ledgers(b: RedisBackend) {
    let a = Arc::clone(&b.ledger);
    let other = RedisLedger::new(a.pool().clone(), a.keys().clone(), config());
    let u = user("cl-pods");
    assert!(allowed(&a.reserve(&u, &rid("p1"), 6).await.unwrap()));
    a.set_limits(&u, &[limit(6, 1500)]).await.unwrap();
    assert!(!allowed(&other.reserve(&u, &rid("p2"), 1).await.unwrap()));
    other.clear_limits(&u).await.unwrap();
    assert!(allowed(&a.reserve(&u, &rid("p3"), 1).await.unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn custom_limits_reach_another_redis_ledger() {
    two_redis_ledgers(RedisBackend::start().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn custom_limits_reach_another_cluster_ledger() {
    two_redis_ledgers(RedisBackend::cluster().await).await;
}

// ---------------------------------------------------------------- HTTP

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {token}"));
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(30), app.clone().oneshot(req))
        .await
        .expect("answer within 30s")
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
}

#[track_caller]
fn problem(r: &(StatusCode, Value), kind: ProblemType) {
    assert_eq!(r.1["type"], kind.uri(), "{}", r.1);
    assert_eq!(r.0, kind.status(), "{}", r.1);
}

/// The api of another pod on the same store (on memory: the same one).
async fn other_pod(h: &Harness) -> (Router, Arc<dyn Ledger>) {
    let url = match (&h.redis, &h._cluster) {
        (Some(server), _) => server.url(),
        (None, Some(cluster)) => cluster.url(),
        (None, None) => return (h.app.clone(), Arc::clone(&h.state.ledger)),
    };
    let state = redis_state(&url, &state_prefix(&h.state), settings()).await;
    (tollgate_api::router(state.clone()), state.ledger)
}

/// `PUT /admin/users/{user}/limits` on one pod: the other pod's next call
/// is held to them; `DELETE` returns the user to its plan; bad lists are
/// 400s that change nothing.
async fn limits_routes_apply_on_every_pod(h: Harness) {
    let key = h.user("lim-ann", "tiny").await; // 5 per hour
    let (b, ledger_b) = other_pod(&h).await;
    let u = user("lim-ann");
    let path = "/admin/users/lim-ann/limits";

    let r = call(
        &h.app,
        "PUT",
        path,
        ADMIN,
        Some(json!({"limits": [{"limit": 20, "window": "1h"}]})),
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert_eq!(
        (&r.1["plan"], &r.1["base_plan"], &r.1["custom_limits"]),
        (&json!("custom"), &json!("tiny"), &json!(true))
    );
    assert_eq!(
        r.1["limits"],
        json!([{"limit": 20, "window": "1h", "window_ms": 3_600_000}])
    );
    // Tiny could never admit 6 tokens; the other pod admits them at once.
    assert!(allowed(&ledger_b.reserve(&u, &rid("h1"), 6).await.unwrap()));
    let usage = call(&b, "GET", "/v1/usage", &key, None).await;
    assert_eq!(usage.0, StatusCode::OK, "{}", usage.1);
    assert_eq!(
        (
            &usage.1["plan"],
            &usage.1["custom_limits"],
            &usage.1["limit"],
            &usage.1["used"]
        ),
        (&json!("custom"), &json!(true), &json!(20), &json!(6))
    );

    // A shorter window added on this pod: the other refuses at once.
    let r = call(
        &h.app,
        "PUT",
        path,
        ADMIN,
        Some(json!({"limits": [{"limit": 7, "window": "1m"}, {"limit": 20, "window": "1h"}]})),
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert_eq!(r.1["limits"][0]["window"], "1h", "longest first: {}", r.1);
    assert!(!allowed(
        &ledger_b.reserve(&u, &rid("h2"), 2).await.unwrap()
    ));
    let usage = call(&b, "GET", "/admin/users/lim-ann/usage", ADMIN, None).await;
    assert_eq!(usage.0, StatusCode::OK, "{}", usage.1);
    assert_eq!(usage.1["base_plan"], "tiny");
    assert_eq!(
        usage.1["windows"].as_array().unwrap().len(),
        2,
        "{}",
        usage.1
    );
    assert_eq!(usage.1["windows"][1]["used"], 6, "{}", usage.1);
    assert_eq!(
        usage.1["events"].as_array().unwrap().len(),
        1,
        "{}",
        usage.1
    );

    // Bad lists: 400, naming why; nothing changes.
    for (body, needle) in [
        (
            json!({"limits": [{"limit": 10, "window": "13h"}]}),
            "retention",
        ),
        (
            json!({"limits": [{"limit": 10, "window": "1h"}, {"limit": 5, "window": "60m"}]}),
            "twice",
        ),
        (
            json!({"limits": [{"limit": 0, "window": "1h"}]}),
            "limits[0].limit",
        ),
        (json!({"limits": []}), "limits"),
    ] {
        let r = call(&h.app, "PUT", path, ADMIN, Some(body.clone())).await;
        problem(&r, ProblemType::InvalidField);
        assert!(
            r.1["detail"].as_str().unwrap().contains(needle),
            "{body}: {}",
            r.1
        );
    }
    let r = call(
        &h.app,
        "PUT",
        path,
        ADMIN,
        Some(json!({"limits": [{"limit": 1, "window": "1h", "x": 1}]})),
    )
    .await;
    assert!(r.0.is_client_error(), "{}", r.1);
    // A user's own limits are trailing windows: a calendar period is refused
    // by name (periods are set by plans).
    let r = call(
        &h.app,
        "PUT",
        path,
        ADMIN,
        Some(json!({"limits": [{"limit": 1, "period": "month"}]})),
    )
    .await;
    assert!(r.0.is_client_error(), "{}", r.1);
    assert!(r.1.to_string().contains("period"), "{}", r.1);
    let r = call(
        &h.app,
        "PUT",
        "/admin/users/nobody-here/limits",
        ADMIN,
        Some(json!({"limits": [{"limit": 1, "window": "1h"}]})),
    )
    .await;
    problem(&r, ProblemType::NotFound);
    let r = call(
        &h.app,
        "PUT",
        path,
        &key,
        Some(json!({"limits": [{"limit": 1, "window": "1h"}]})),
    )
    .await;
    assert_eq!(r.0, StatusCode::UNAUTHORIZED, "{}", r.1);
    assert_eq!(
        ledger_b.custom_limits(&u).await.unwrap().map(|l| l.len()),
        Some(2)
    );

    // Cleared on the other pod: tiny again here (6 spent: nothing fits).
    let r = call(&b, "DELETE", path, ADMIN, None).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert_eq!(
        (&r.1["plan"], &r.1["custom_limits"]),
        (&json!("tiny"), &json!(false))
    );
    let usage = call(&h.app, "GET", "/v1/usage", &key, None).await;
    assert_eq!(
        (
            &usage.1["plan"],
            &usage.1["custom_limits"],
            &usage.1["limit"]
        ),
        (&json!("tiny"), &json!(false), &json!(5))
    );
    assert!(!allowed(
        &h.state.ledger.reserve(&u, &rid("h3"), 1).await.unwrap()
    ));
    // A second DELETE is no error.
    assert_eq!(
        call(&h.app, "DELETE", path, ADMIN, None).await.0,
        StatusCode::OK
    );

    // Setting a named plan replaces custom limits.
    call(
        &h.app,
        "PUT",
        path,
        ADMIN,
        Some(json!({"limits": [{"limit": 9, "window": "1h"}]})),
    )
    .await;
    let r = call(
        &b,
        "PUT",
        "/admin/users/lim-ann/plan",
        ADMIN,
        Some(json!({"plan": "pro"})),
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let usage = call(&h.app, "GET", "/v1/usage", &key, None).await;
    assert_eq!(
        (&usage.1["plan"], &usage.1["custom_limits"]),
        (&json!("pro"), &json!(false))
    );
}

/// 250 users, listed by pages of 100: every user exactly once, in order;
/// a prefix search pages too; each row shows the plan or custom limits,
/// the kind and the keys.
async fn users_are_listed_by_pages_and_searched_by_prefix(h: Harness) {
    let names: Vec<String> = (0..250).map(|i| format!("lst-{i:03}")).collect();
    let creates = names.iter().map(|n| h.user(n, "tiny"));
    futures_util::future::join_all(creates).await;
    h.post(
        "/admin/users",
        ADMIN,
        json!({"user": "other-svc", "kind": "service"}),
    )
    .await;
    call(
        &h.app,
        "PUT",
        "/admin/users/lst-007/limits",
        ADMIN,
        Some(json!({"limits": [{"limit": 3, "window": "1m"}]})),
    )
    .await;

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            Some(c) => format!("/admin/users?prefix=lst-&limit=100&cursor={c}"),
            None => "/admin/users?prefix=lst-&limit=100".to_owned(),
        };
        let r = call(&h.app, "GET", &path, ADMIN, None).await;
        assert_eq!(r.0, StatusCode::OK, "{}", r.1);
        pages += 1;
        let users = r.1["users"].as_array().unwrap();
        assert!(users.len() <= 100);
        for u in users {
            seen.push(u["user"].as_str().unwrap().to_owned());
            assert_eq!(
                (&u["kind"], &u["live_keys"], &u["keys"]),
                (&json!("user"), &json!(1), &json!(1)),
                "{u}"
            );
            assert!(u["created"].is_string(), "{u}");
            if u["user"] == "lst-007" {
                assert_eq!(
                    (&u["plan"], &u["custom_limits"], &u["base_plan"]),
                    (&json!("custom"), &json!(true), &json!("tiny")),
                    "{u}"
                );
                assert_eq!(u["limits"][0]["limit"], 3);
            } else {
                assert_eq!(
                    (&u["plan"], &u["custom_limits"]),
                    (&json!("tiny"), &json!(false)),
                    "{u}"
                );
            }
        }
        match r.1["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, names, "every user once, in order");

    // Everyone (no prefix): the service too, by id.
    let r = call(&h.app, "GET", "/admin/users?prefix=oth", ADMIN, None).await;
    assert_eq!(r.1["users"][0]["user"], "other-svc", "{}", r.1);
    assert_eq!(r.1["users"][0]["kind"], "service", "{}", r.1);
    assert_eq!(r.1["next_cursor"], Value::Null);

    // A prefix, by pages of 60: lst-100..lst-199.
    let r = call(
        &h.app,
        "GET",
        "/admin/users?prefix=lst-1&limit=60",
        ADMIN,
        None,
    )
    .await;
    let first: Vec<&str> = r.1["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["user"].as_str().unwrap())
        .collect();
    let c = r.1["next_cursor"].as_str().unwrap().to_owned();
    let r2 = call(
        &h.app,
        "GET",
        &format!("/admin/users?prefix=lst-1&limit=60&cursor={c}"),
        ADMIN,
        None,
    )
    .await;
    let second: Vec<&str> = r2.1["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["user"].as_str().unwrap())
        .collect();
    assert_eq!(r2.1["next_cursor"], Value::Null, "{}", r2.1);
    let all: Vec<&str> = first.into_iter().chain(second).collect();
    assert_eq!(
        all,
        names[100..200]
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    );

    // Bad queries: 400 naming the parameter.
    for (q, field) in [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("prefix=a%7Bb", "prefix"),
        ("cursor=a:b", "cursor"),
    ] {
        let r = call(&h.app, "GET", &format!("/admin/users?{q}"), ADMIN, None).await;
        problem(&r, ProblemType::MalformedRequest);
        assert_eq!(r.1["field"], field, "{q}: {}", r.1);
    }
    let r = call(&h.app, "GET", "/admin/users?limit=x", ADMIN, None).await;
    problem(&r, ProblemType::MalformedRequest);
}

/// A user's keys: ids, kinds, times, revoked or not; never the secret or
/// its hash. A user's usage through the admin route.
async fn a_users_keys_never_show_their_secrets(h: Harness) {
    let first = h.user("keys-ann", "tiny").await;
    let second = h.user("keys-ann", "tiny").await;
    let r = call(&h.app, "GET", "/admin/users/keys-ann/keys", ADMIN, None).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let keys = r.1["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{}", r.1);
    let kid = keys[0]["key_id"].as_str().unwrap().to_owned();
    assert!(kid.starts_with("kid_"));
    let text = r.1.to_string();
    for secret in [&first, &second] {
        assert!(!text.contains(secret.as_str()), "{text}");
        let hash = tollgate_core::keystore::KeyHash::of(secret);
        assert!(!text.contains(hash.as_str()), "{text}");
    }
    let r = call(&h.app, "DELETE", &format!("/admin/keys/{kid}"), ADMIN, None).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let r = call(&h.app, "GET", "/admin/users/keys-ann/keys", ADMIN, None).await;
    let revoked: Vec<bool> = r.1["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["revoked"].as_bool().unwrap())
        .collect();
    assert_eq!(revoked.iter().filter(|r| **r).count(), 1, "{}", r.1);
    let r = call(&h.app, "GET", "/admin/users?prefix=keys-ann", ADMIN, None).await;
    assert_eq!(
        (&r.1["users"][0]["live_keys"], &r.1["users"][0]["keys"]),
        (&json!(1), &json!(2)),
        "{}",
        r.1
    );

    // Every key, by user: this user's two, then the next page's user.
    h.user("keys-bob", "tiny").await;
    let r = call(
        &h.app,
        "GET",
        "/admin/keys?prefix=keys-&limit=1",
        ADMIN,
        None,
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let rows = r.1["keys"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{}", r.1);
    assert!(rows.iter().all(|k| k["user"] == "keys-ann"), "{}", r.1);
    assert_eq!(r.1["next_cursor"], "keys-ann");
    let r = call(
        &h.app,
        "GET",
        "/admin/keys?prefix=keys-&limit=1&cursor=keys-ann",
        ADMIN,
        None,
    )
    .await;
    assert_eq!(r.1["keys"].as_array().unwrap().len(), 1, "{}", r.1);
    assert_eq!(
        (&r.1["keys"][0]["user"], &r.1["next_cursor"]),
        (&json!("keys-bob"), &Value::Null)
    );
    assert!(!r.1.to_string().contains("tg_user_"), "{}", r.1);
    let r = call(&h.app, "GET", "/admin/keys?limit=0", ADMIN, None).await;
    problem(&r, ProblemType::MalformedRequest);

    let r = call(&h.app, "GET", "/admin/users/nobody-here/keys", ADMIN, None).await;
    problem(&r, ProblemType::NotFound);
    let r = call(&h.app, "GET", "/admin/users/nobody-here/usage", ADMIN, None).await;
    problem(&r, ProblemType::NotFound);
    let r = call(
        &h.app,
        "GET",
        "/admin/users/keys-ann/usage?cursor=nope",
        ADMIN,
        None,
    )
    .await;
    problem(&r, ProblemType::MalformedRequest);
    let u = user("keys-ann");
    for i in 0..3 {
        h.state
            .ledger
            .reserve(&u, &rid(&format!("k{i}")), 1)
            .await
            .unwrap();
    }
    let r = call(
        &h.app,
        "GET",
        "/admin/users/keys-ann/usage?limit=2",
        ADMIN,
        None,
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert_eq!(
        (&r.1["plan"], &r.1["base_plan"], &r.1["used"]),
        (&json!("tiny"), &json!("tiny"), &json!(3))
    );
    assert_eq!(r.1["events"].as_array().unwrap().len(), 2);
    let c = r.1["next_cursor"].as_str().unwrap();
    let r = call(
        &h.app,
        "GET",
        &format!("/admin/users/keys-ann/usage?limit=2&cursor={c}"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(r.1["events"].as_array().unwrap().len(), 1, "{}", r.1);
    assert_eq!(r.1["events"][0]["request_id"], "k2");
    // The admin routes need the admin token.
    let r = call(&h.app, "GET", "/admin/users", &first, None).await;
    assert_eq!(r.0, StatusCode::UNAUTHORIZED);
}

/// The HTTP side, on every backend.
mod http {
    use super::*;
    on_each_backend!([
        limits_routes_apply_on_every_pod,
        users_are_listed_by_pages_and_searched_by_prefix,
        a_users_keys_never_show_their_secrets,
    ]
        memory => crate::api::Harness::memory(crate::api::settings()).await,
        redis => crate::api::Harness::redis(crate::api::settings()).await,
        cluster => crate::api::Harness::cluster(crate::api::settings()).await,
    );
}

// ---------------------------------------------------------------- reindex

/// Users whose keys were issued before the users index existed (their keys
/// written the old way: record, id and user set, no index entry) are found
/// by `reindex`, on a single Redis and on every primary of a cluster.
async fn reindex_finds_users_issued_keys_before_the_index(url: String) {
    use tollgate_core::keystore::{ApiKey, KeyKind, KeyRecord, KeyStore, UserQuery};
    use tollgate_redis::{keys::KeySpace, keystore::RedisKeyStore, pool::PoolOptions};
    let prefix = tollgate_tests::random_prefix();
    let keys = KeySpace::new(&prefix).unwrap();
    let pool = tollgate_redis::pool::connect(&url, &PoolOptions::default())
        .await
        .unwrap();
    let store = RedisKeyStore::new(pool.clone(), keys.clone());
    // Enough users that they land on every primary of the cluster.
    let names: Vec<String> = (0..40).map(|i| format!("old-{i:02}")).collect();
    for n in &names {
        let record = KeyRecord {
            key_id: tollgate_core::keystore::generate_key_id().unwrap(),
            user: user(n),
            created_ms: 1_700_000_000_000,
            revoked: false,
            kind: KeyKind::User,
            allowed_plans: Vec::new(),
        };
        let key = ApiKey::generate().unwrap();
        // The old way: the three keys of a key, no index entry.
        let cmds = [
            redis::cmd("SET")
                .arg(keys.api_key_id(&record.key_id))
                .arg(key.hash().as_str())
                .to_owned(),
            redis::cmd("SADD")
                .arg(keys.api_key_user(&record.user))
                .arg(&record.key_id)
                .to_owned(),
            redis::cmd("HSET")
                .arg(keys.api_key(&key.hash()))
                .arg("user")
                .arg(n)
                .arg("key_id")
                .arg(&record.key_id)
                .arg("created_ms")
                .arg(record.created_ms)
                .arg("revoked")
                .arg("0")
                .to_owned(),
        ];
        for cmd in &cmds {
            let _: redis::Value =
                tollgate_redis::call::command(&pool, Duration::from_secs(2), "test", cmd)
                    .await
                    .unwrap();
        }
    }
    // One issued the new way is indexed already.
    let key = ApiKey::generate().unwrap();
    store
        .insert(
            &key,
            &KeyRecord {
                key_id: tollgate_core::keystore::generate_key_id().unwrap(),
                user: user("new-one"),
                created_ms: 1_700_000_000_000,
                revoked: false,
                kind: KeyKind::User,
                allowed_plans: Vec::new(),
            },
        )
        .await
        .unwrap();
    let all = UserQuery::new("", None, 100).unwrap();
    let before = store.users(&all).await.unwrap();
    assert_eq!(before.users, vec![user("new-one")]);

    let seen = store.reindex().await.unwrap();
    assert_eq!(seen, 41);
    let after = store.users(&all).await.unwrap();
    // By id: "new-one" sorts first.
    let expected: Vec<_> = std::iter::once(user("new-one"))
        .chain(names.iter().map(|n| user(n)))
        .collect();
    assert_eq!(after.users, expected);
    // Old keys read back through the index: kind user (no kind field).
    let records = store.user_keys(&user("old-07")).await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].kind, KeyKind::User);
    // Again: nothing changes.
    assert_eq!(store.reindex().await.unwrap(), 41);
    assert_eq!(store.users(&all).await.unwrap().users.len(), 41);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reindex_on_redis() {
    let server = tollgate_tests::RedisServer::start();
    reindex_finds_users_issued_keys_before_the_index(server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reindex_on_the_cluster() {
    let cluster = tollgate_tests::TestCluster::get();
    reindex_finds_users_issued_keys_before_the_index(cluster.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_key_store_lists_users_by_pages() {
    use tollgate_core::keystore::{ApiKey, KeyKind, KeyRecord, KeyStore, UserQuery};
    let store = MemoryKeyStore::new();
    for n in ["b", "a", "ab", "c"] {
        store
            .insert(
                &ApiKey::generate().unwrap(),
                &KeyRecord {
                    key_id: tollgate_core::keystore::generate_key_id().unwrap(),
                    user: user(n),
                    created_ms: 1,
                    revoked: false,
                    kind: KeyKind::User,
                    allowed_plans: Vec::new(),
                },
            )
            .await
            .unwrap();
    }
    let page = store
        .users(&UserQuery::new("a", None, 1).unwrap())
        .await
        .unwrap();
    assert_eq!(page.users, vec![user("a")]);
    let c = page.next_cursor.unwrap();
    let page = store
        .users(&UserQuery::new("a", Some(c.as_str()), 1).unwrap())
        .await
        .unwrap();
    assert_eq!((page.users, page.next_cursor), (vec![user("ab")], None));
    // A cursor before the prefix starts at the prefix.
    let page = store
        .users(&UserQuery::new("b", Some("a"), 5).unwrap())
        .await
        .unwrap();
    assert_eq!(page.users, vec![user("b")]);
}
