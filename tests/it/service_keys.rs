//! Service keys acting for end users, on both backends: a service key names
//! the user each call is for (`Tollgate-User`); that user's budget pays,
//! exactly, under a race across two api pods; the audit trail (usage events
//! and the export stream) names the user and the acting key; a user's key can
//! never act for another user.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tollgate_api::problem::ProblemType;
use tollgate_api::state::ApiState;
use tollgate_core::id::UserId;
use tollgate_tests::{random_prefix, RedisServer};

use tollgate_redis::{keys::KeySpace, pool::PoolOptions};

use crate::api::{redis_source, settings, test_config_with, Harness, ADMIN};

on_each_backend!(
    [
        a_service_key_charges_each_end_user_exactly_across_two_pods,
        a_user_key_never_acts_for_another_user,
        service_keys_are_created_checked_and_revoked,
        dot_segment_user_ids_are_refused_wherever_an_id_enters,
    ]
    memory => super::Pods::memory().await,
    redis => super::Pods::redis().await,
);

/// Two api pods over one backend (on Redis: two pools, two key caches).
struct Pods {
    a: Harness,
    b: Harness,
}

impl Pods {
    fn config() -> Arc<tollgate_core::config::Config> {
        test_config_with("\n[export]\nmaxlen = 1000\n")
    }

    async fn memory() -> Self {
        let backends = tollgate_memory::backends(Self::config());
        let state = ApiState::new(&backends, settings());
        let pod = |state: ApiState| Harness {
            app: tollgate_api::router(state.clone()),
            state,
            source: Arc::clone(&backends.source),
            redis: None,
            _cluster: None,
        };
        Self {
            a: pod(state.clone()),
            b: pod(state),
        }
    }

    async fn redis() -> Self {
        let server = RedisServer::start();
        let prefix = random_prefix();
        let pod = |state: ApiState, source, redis| Harness {
            app: tollgate_api::router(state.clone()),
            state,
            source,
            redis,
            _cluster: None,
        };
        // Each pod as `tollgate api` builds it: its own pool, the store's
        // backends (the dashboard's activity log included).
        let state = || async {
            let pool = tollgate_redis::pool::connect(&server.url(), &PoolOptions::default())
                .await
                .unwrap();
            let keys = KeySpace::new(&prefix).unwrap();
            let backends = tollgate_redis::backends(pool, keys, Self::config(), "test".into());
            ApiState::new(&backends, settings())
        };
        let (sa, sb) = (state().await, state().await);
        let source = redis_source(&server.url(), &sa).await;
        Self {
            b: pod(sb, Arc::clone(&source), None),
            a: pod(sa, source, Some(server)),
        }
    }

    /// Issues a service key; returns (key, key id).
    async fn service(&self, name: &str, allowed: &[&str]) -> (String, String) {
        let r = self
            .a
            .post(
                "/admin/users",
                ADMIN,
                json!({"user": name, "kind": "service", "allowed_plans": allowed}),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        assert_eq!(r.body["kind"], "service", "{}", r.body);
        assert!(r.body.get("plan").is_none(), "{}", r.body);
        let key = r.body["api_key"].as_str().unwrap().to_owned();
        assert!(key.starts_with("tg_svc_"), "{key}");
        (key, r.body["key_id"].as_str().unwrap().to_owned())
    }
}

/// A service key with `Tollgate-Plan: tiny` allowed (5 tokens / 1 h) acts for
/// two users first seen in this call; 16 concurrent calls of cost 2 per user,
/// half on each pod: each user is given the tiny plan and exactly 2 of its 16
/// calls are admitted (4 of 5 tokens), the other 14 get a 429. Usage, job
/// records and the export stream are the end user's, and name the service key.
async fn a_service_key_charges_each_end_user_exactly_across_two_pods(pods: Pods) {
    let (key, kid) = pods.service("billing-app", &["tiny"]).await;
    let pods = Arc::new(pods);
    let users = ["ana-svc", "ben-svc"];
    let mut calls = Vec::new();
    for user in users {
        for i in 0..16 {
            let (pods, key) = (Arc::clone(&pods), key.clone());
            calls.push(tokio::spawn(async move {
                let pod = if i % 2 == 0 { &pods.a } else { &pods.b };
                let body = json!({"text": format!("call {i}")}).to_string();
                let r = pod
                    .call(
                        "POST",
                        "/v1/ops/echo.custom",
                        Some(&key),
                        &[
                            ("tollgate-user", user),
                            ("tollgate-plan", "tiny"),
                            ("prefer", "respond-async"),
                        ],
                        Some(body),
                    )
                    .await;
                (user, r.status.as_u16(), r.body)
            }));
        }
    }
    let mut admitted = std::collections::BTreeMap::<&str, Vec<String>>::new();
    for call in calls {
        let (user, status, body) = call.await.unwrap();
        match status {
            202 => admitted
                .entry(user)
                .or_default()
                .push(body["job_id"].as_str().unwrap().to_owned()),
            429 => assert_eq!(body["type"], "/problems/quota-exceeded", "{body}"),
            other => panic!("{user}: {other} {body}"),
        }
    }
    let service = |user: &'static str| [("tollgate-user", user)];
    for user in users {
        let jobs = &admitted[user];
        assert_eq!(jobs.len(), 2, "{user}: {jobs:?}");
        for pod in [&pods.a, &pods.b] {
            let u = pod.get("/v1/usage", &key, &service(user)).await;
            assert_eq!(u.status, StatusCode::OK, "{}", u.body);
            assert_eq!(u.body["user"], user, "{}", u.body);
            assert_eq!(u.body["plan"], "tiny", "{}", u.body);
            assert_eq!(u.body["used"], 4, "{}", u.body);
            let events = u.body["events"].as_array().unwrap();
            assert_eq!(events.len(), 2, "{}", u.body);
            for e in events {
                assert_eq!(e["service_key"], kid.as_str(), "{e}");
                assert_eq!(e["operation"], "echo.custom", "{e}");
            }
        }
        // The jobs are the end user's: readable for it, not for the other.
        let other = if user == users[0] { users[1] } else { users[0] };
        for id in jobs {
            let path = format!("/v1/jobs/{id}");
            let r = pods
                .b
                .call("GET", &path, Some(&key), &service(user), None)
                .await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
            let r = pods
                .a
                .call("GET", &path, Some(&key), &service(other), None)
                .await;
            r.problem(ProblemType::NotFound);
        }
        // The export stream names both: the user (its stream) and the key.
        let exported = pods
            .a
            .state
            .ledger
            .exported(&UserId::new(user).unwrap(), 0, 100)
            .await
            .unwrap();
        let spends: Vec<_> = exported
            .iter()
            .filter(|e| e.kind == tollgate_core::ledger::ChangeKind::Spend)
            .collect();
        assert_eq!(spends.len(), 2, "{exported:?}");
        for e in spends {
            assert_eq!(e.service_key.as_deref(), Some(kid.as_str()), "{e:?}");
            assert_eq!(e.operation.as_deref(), Some("echo.custom"), "{e:?}");
        }
    }
    // The dashboard's newest spend events show the end users, via the key.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = pods
            .b
            .call("GET", "/admin/overview", Some(ADMIN), &[], None)
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        let events = r.body["events"].as_array().cloned().unwrap_or_default();
        let ours: Vec<_> = events
            .iter()
            .filter(|e| users.contains(&e["user"].as_str().unwrap_or("")))
            .collect();
        if ours.len() == 4 {
            assert!(
                ours.iter().all(|e| e["service_key"] == kid.as_str()),
                "{events:?}"
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", r.body);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // An admin manages such a user's plan like any other's; a user nobody
    // issued a key to or called for is still unknown.
    let r = pods
        .a
        .put("/admin/users/ana-svc/plan", ADMIN, json!({"plan": "pro"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let u = pods
        .b
        .call("GET", "/v1/usage", Some(&key), &service("ana-svc"), None)
        .await;
    assert_eq!(u.body["plan"], "pro", "{}", u.body);
    let r = pods
        .a
        .put(
            "/admin/users/nobody-svc/plan",
            ADMIN,
            json!({"plan": "pro"}),
        )
        .await;
    r.problem(ProblemType::NotFound);
    // The service itself was charged nothing: it is no user of the budget.
    let u = pods
        .a
        .state
        .ledger
        .usage(&UserId::new("billing-app").unwrap())
        .await
        .unwrap();
    assert_eq!(u.used, 0);
}

/// A user's key names only its own user; a service key must name one, in a
/// valid id; `Tollgate-Plan` is a service's, within its allowed plans, and a
/// plan an admin set outside them stays.
async fn a_user_key_never_acts_for_another_user(pods: Pods) {
    let h = &pods.a;
    let carol = h.user("carol", "free").await;
    let own = h
        .get("/v1/usage", &carol, &[("tollgate-user", "carol")])
        .await;
    assert_eq!(own.status, StatusCode::OK, "{}", own.body);
    assert_eq!(own.body["user"], "carol");
    // Another user's budget, jobs or usage: refused, on every user route.
    h.user("dave", "free").await;
    let body = json!({"text": "x"}).to_string();
    for (method, path, body) in [
        ("GET", "/v1/usage", None),
        ("POST", "/v1/ops/echo.custom", Some(body.clone())),
        ("GET", "/v1/jobs/some-job", None),
    ] {
        let r = pods
            .b
            .call(
                method,
                path,
                Some(&carol),
                &[("tollgate-user", "dave")],
                body,
            )
            .await;
        r.problem(ProblemType::ActingForAnotherUser);
    }
    let r = h
        .get("/v1/usage", &carol, &[("tollgate-plan", "tiny")])
        .await;
    r.problem(ProblemType::PlanNotAllowed);
    assert_eq!(h.usage(&carol).await["used"], 0);

    let (svc, _) = pods.service("svc-rules", &["tiny"]).await;
    let r = h.get("/v1/usage", &svc, &[]).await;
    r.problem(ProblemType::UserRequired);
    let r = h
        .call(
            "POST",
            "/v1/ops/echo.custom",
            Some(&svc),
            &[],
            Some(body.clone()),
        )
        .await;
    r.problem(ProblemType::UserRequired);
    for bad in ["not a user", "a:b", "{x}"] {
        let r = h.get("/v1/usage", &svc, &[("tollgate-user", bad)]).await;
        let p = r.problem(ProblemType::MalformedRequest);
        assert_eq!(p["field"], "tollgate-user", "{p}");
    }
    let r = h
        .get(
            "/v1/usage",
            &svc,
            &[("tollgate-user", "erin"), ("tollgate-plan", "pro")],
        )
        .await;
    r.problem(ProblemType::PlanNotAllowed);
    // An admin put erin on pro: a service's tiny does not take it away.
    h.user("erin", "pro").await;
    let r = h
        .get(
            "/v1/usage",
            &svc,
            &[("tollgate-user", "erin"), ("tollgate-plan", "tiny")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["plan"], "pro", "{}", r.body);
    // A user first seen without Tollgate-Plan is on the default plan.
    let r = h.get("/v1/usage", &svc, &[("tollgate-user", "fay")]).await;
    assert_eq!(r.body["plan"], "free", "{}", r.body);
}

/// What the admin route accepts for a service key, and a revoked one.
async fn service_keys_are_created_checked_and_revoked(pods: Pods) {
    let h = &pods.a;
    for (body, field) in [
        (
            json!({"user": "s1", "kind": "service", "plan": "free"}),
            "plan",
        ),
        (
            json!({"user": "s1", "kind": "service", "allowed_plans": ["nope"]}),
            "allowed_plans",
        ),
        (
            json!({"user": "s1", "allowed_plans": ["free"]}),
            "allowed_plans",
        ),
    ] {
        let r = h.post("/admin/users", ADMIN, body).await;
        let p: &Value = r.problem(ProblemType::InvalidField);
        assert_eq!(p["field"], field, "{p}");
    }
    let r = h
        .post(
            "/admin/users",
            ADMIN,
            json!({"user": "s1", "kind": "robot"}),
        )
        .await;
    assert!(r.status.is_client_error(), "{}", r.body);
    let (svc, kid) = pods.service("s1", &[]).await;
    let ok = pods
        .b
        .call(
            "GET",
            "/v1/usage",
            Some(&svc),
            &[("tollgate-user", "gus")],
            None,
        )
        .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    let r = h
        .call(
            "DELETE",
            &format!("/admin/keys/{kid}"),
            Some(ADMIN),
            &[],
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = h.get("/v1/usage", &svc, &[("tollgate-user", "gus")]).await;
    r.problem(ProblemType::Unauthorized);
}

/// `.` and `..` are no user ids (a URL path drops such a segment: the
/// dashboard's links and forms would name another route): refused, with an
/// error that says so, by the admin's create (user or service key), by a
/// service key's `Tollgate-User`, and in every admin route's `{user}`; an
/// organisation too. Nothing is charged or created. (Before: each was a valid
/// id, and a user named so was created.) A user stored so before the rule
/// stays readable and refundable; so does a request id (no new one may be
/// `.` or `..` either).
async fn dot_segment_user_ids_are_refused_wherever_an_id_enters(pods: Pods) {
    let h = &pods.a;
    let refused = |r: &crate::api::Resp, what: &str| {
        assert!(
            matches!(r.status.as_u16(), 400 | 422),
            "{what}: {} {}",
            r.status,
            r.body
        );
        let text = r.body.to_string();
        assert!(
            text.contains("\\\"..\\\""),
            "{what}: the error says why: {text}"
        );
    };
    for bad in [".", ".."] {
        for kind in ["user", "service"] {
            let r = h
                .post("/admin/users", ADMIN, json!({"user": bad, "kind": kind}))
                .await;
            refused(&r, &format!("create {kind} {bad:?}"));
        }
    }
    let (key, _) = pods.service("dots-app", &[]).await;
    for bad in [".", ".."] {
        let r = h
            .post_with(
                "/v1/ops/echo.custom",
                &key,
                &[("tollgate-user", bad)],
                json!({"text": "x"}),
            )
            .await;
        refused(&r, &format!("Tollgate-User {bad:?}"));
        let r = h.get("/v1/usage", &key, &[("tollgate-user", bad)]).await;
        refused(&r, &format!("Tollgate-User {bad:?} (usage)"));
    }
    for bad in [".", ".."] {
        for (method, path, body) in [
            (
                "PUT",
                format!("/admin/users/{bad}/plan"),
                Some(json!({"plan": "free"})),
            ),
            (
                "PUT",
                format!("/admin/users/{bad}/limits"),
                Some(json!({"limits": [{"limit": 10, "window": "1h"}]})),
            ),
            ("DELETE", format!("/admin/users/{bad}/limits"), None),
            (
                "PUT",
                format!("/admin/users/{bad}/org"),
                Some(json!({"org": null})),
            ),
            (
                "PUT",
                format!("/admin/orgs/{bad}"),
                Some(json!({"plan": "free"})),
            ),
        ] {
            let r = h
                .call(method, &path, Some(ADMIN), &[], body.map(|b| b.to_string()))
                .await;
            refused(&r, &format!("{method} {path}"));
        }
    }
    let r = h.get("/admin/users?limit=100", ADMIN, &[]).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.body);
    let users = r.body["users"].as_array().unwrap();
    assert!(
        users.iter().all(|u| u["user"] != "." && u["user"] != ".."),
        "{users:?}"
    );

    // A user stored as `..` before the rule: its usage reads, its spend
    // refunds.
    let old = tollgate_core::id::UserId::existing("..").unwrap();
    let rid = tollgate_core::id::RequestId::new("before-the-rule").unwrap();
    let reserved = h.state.ledger.reserve(&old, &rid, 3).await.unwrap();
    assert!(reserved.is_allowed());
    // The admin's view of a stored id: its usage reads (`used`, the events),
    // its spend refunds to 0.
    let admin = |method: &'static str, path: String| async move {
        let r = h.call(method, &path, Some(ADMIN), &[], None).await;
        assert_eq!(r.status.as_u16(), 200, "{method} {path}: {}", r.body);
        r.body
    };
    let usage = admin("GET", "/admin/users/../usage".into()).await;
    assert_eq!(usage["used"], 3, "{usage}");
    let refund = admin("POST", "/admin/users/../refunds/before-the-rule".into()).await;
    assert_eq!(refund["used"], 0, "{refund}");

    // Request ids too: no new one may be `.` or `..`; one stored before the
    // rule lists in the usage and refunds by its id.
    for bad in [".", ".."] {
        assert!(tollgate_core::id::RequestId::new(bad).is_err(), "{bad:?}");
    }
    let user = tollgate_core::id::UserId::new("dots-request").unwrap();
    let rid = tollgate_core::id::RequestId::existing("..").unwrap();
    let reserved = h.state.ledger.reserve(&user, &rid, 2).await.unwrap();
    assert!(reserved.is_allowed());
    let usage = admin("GET", "/admin/users/dots-request/usage".into()).await;
    assert_eq!(usage["events"][0]["request_id"], "..", "{usage}");
    let refund = admin("POST", "/admin/users/dots-request/refunds/..".into()).await;
    assert_eq!(refund["used"], 0, "{refund}");
}
