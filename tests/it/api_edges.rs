//! The api's answers at its edges, on both backends: admin routes on users that
//! do not exist, and error bodies that must not repeat what a client sent.

use axum::http::StatusCode;
use serde_json::json;
use tollgate_api::problem::ProblemType;

use crate::api::{settings, Harness, ADMIN};

on_each_backend!(
    [
        setting_the_plan_of_an_unknown_user_is_404,
        errors_do_not_echo_long_input,
    ]
    memory => super::Harness::memory(super::settings()).await,
    redis => super::Harness::redis(super::settings()).await,
);

/// A user exists once a key was issued to it; a plan for a typo is a 404, and
/// nothing is stored for it.
async fn setting_the_plan_of_an_unknown_user_is_404(h: Harness) {
    let put = |user: &'static str| {
        let h = &h;
        async move {
            h.put(
                &format!("/admin/users/{user}/plan"),
                ADMIN,
                json!({"plan": "pro"}),
            )
            .await
        }
    };
    let r = put("nobody").await;
    r.problem(ProblemType::NotFound);
    let user = tollgate_core::id::UserId::new("nobody").unwrap();
    assert_eq!(h.state.ledger.plan(&user).await.unwrap(), "free");

    let key = h.user("alice", "free").await;
    let r = put("alice").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.usage(&key).await["plan"], "pro");
    // A revoked key still makes its user known (its plan can be managed).
    let r = h
        .post("/admin/users", ADMIN, json!({"user": "carol"}))
        .await;
    let key_id = r.body["key_id"].as_str().unwrap().to_owned();
    let r = h
        .call(
            "DELETE",
            &format!("/admin/keys/{key_id}"),
            Some(ADMIN),
            &[],
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = put("carol").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

/// A 10 KB operation name (or key id, or query flag) is not sent back whole.
async fn errors_do_not_echo_long_input(h: Harness) {
    let key = h.user("alice", "free").await;
    let long = "a".repeat(10_000);
    let probes = [
        ("POST", format!("/v1/ops/{long}"), Some(key.as_str())),
        ("DELETE", format!("/admin/keys/{long}"), Some(ADMIN)),
        ("GET", format!("/v1/jobs/{long}"), Some(key.as_str())),
        (
            "POST",
            format!("/v1/ops/embeddings?async={long}"),
            Some(key.as_str()),
        ),
    ];
    for (method, path, token) in probes {
        let r = h.call(method, &path, token, &[], Some("{}".into())).await;
        assert!(
            r.status.is_client_error(),
            "{method} {}: {}",
            &path[..40],
            r.body
        );
        let text = r.body.to_string();
        assert!(
            text.len() < 1024,
            "{method} {}: {} bytes of error body",
            &path[..40],
            text.len()
        );
        assert!(
            !text.contains(&"a".repeat(65)),
            "{method}: echoes the input: {text}"
        );
    }
    // The body's own values are bounded too (the test body limit is 4 KiB).
    let long = "a".repeat(1_000);
    let r = h
        .put("/admin/users/alice/plan", ADMIN, json!({"plan": long}))
        .await;
    r.problem(ProblemType::InvalidField);
    assert!(!r.body.to_string().contains(&"a".repeat(65)), "{}", r.body);
    // Headers are never echoed.
    let secret = format!("Bearer tg_{}", "b".repeat(64));
    let r = h
        .call(
            "GET",
            "/v1/usage",
            None,
            &[("authorization", secret.as_str())],
            None,
        )
        .await;
    r.problem(ProblemType::Unauthorized);
    assert!(!r.body.to_string().contains("bbbbbbbb"), "{}", r.body);
}
