//! Prepaid credits over HTTP, in a USD deployment: `POST
//! /admin/users/{user}/credits` reads decimal strings and refuses a bad
//! grant with a 422 naming its field (nothing changed), a reused key with
//! another grant with a 409; a call the balance cannot cover is a 402
//! `credits-exhausted` with the balance, before any upstream work; the
//! history is the export's credits entries. On memory and on Redis.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tollgate_api::problem::ProblemType;
use tollgate_core::config::Config;

use crate::api::{settings, Harness, ADMIN};

fn usd_config() -> Arc<Config> {
    tollgate_tests::money::usd_config(
        "credits api test",
        "default_plan = \"prepaid\"\n[export]\nmaxlen = 1000\n\
         [plans.prepaid]\nlimit = \"100\"\nwindow = \"1h\"\ncredits = \"only\"",
    )
}

async fn memory() -> Harness {
    Harness::memory_with(settings(), usd_config()).await
}

async fn redis() -> Harness {
    Harness::redis_with(settings(), usd_config()).await
}

async fn grants_over_http(h: Harness) {
    let key = h.user("ann", "prepaid").await;
    let grant = |body: Value| {
        let h = &h;
        async move { h.post("/admin/users/ann/credits", ADMIN, body).await }
    };
    for (body, field) in [
        (json!({"amount": "0", "idempotency_key": "k"}), "amount"),
        (json!({"amount": "-1", "idempotency_key": "k"}), "amount"),
        (json!({"amount": 5, "idempotency_key": "k"}), "amount"),
        (
            json!({"amount": "0.0000001", "idempotency_key": "k"}),
            "amount",
        ),
        (
            json!({"amount": "1", "idempotency_key": ""}),
            "idempotency_key",
        ),
        (
            json!({"amount": "1", "idempotency_key": "a/b"}),
            "idempotency_key",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_at": "tomorrow"}),
            "expires_at",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_at": "2020-01-01T00:00:00Z"}),
            "expires_at",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_at": "2999-01-01T00:00:00"}),
            "expires_at",
        ),
    ] {
        let r = grant(body.clone()).await;
        let p = r.problem(ProblemType::InvalidField);
        assert_eq!(p["field"], field, "{body}: {p}");
    }
    let r = h.get("/admin/users/ann/credits", ADMIN, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (&r.body["balance"], &r.body["currency"]),
        (&json!("0"), &json!("USD"))
    );
    assert_eq!(r.body["grants"], json!([]), "nothing changed");

    // Nothing to draw on: refused before any upstream work.
    let call = json!({"model": "gpt-4o-mini", "max_tokens": 100});
    let r = h.post("/v1/ops/chat", &key, call.clone()).await;
    assert_eq!(r.status, StatusCode::PAYMENT_REQUIRED, "{}", r.body);
    let p = r.problem(ProblemType::CreditsExhausted);
    assert_eq!(p["balance"], "0", "{p}");
    assert!(
        r.header("retry-after").is_empty(),
        "a top-up helps, not time"
    );

    let body = json!({"amount": "0.00001", "idempotency_key": "top-up-1", "expires_at": "2999-01-01T00:00:00Z"});
    let r = grant(body.clone()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["outcome"], "granted");
    assert_eq!(r.body["credits"]["balance"], "0.00001");
    assert_eq!(
        r.body["credits"]["grants"][0]["expires_at"],
        "2999-01-01T00:00:00.000Z"
    );
    let r = grant(body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["outcome"], "existing");
    let r = grant(json!({"amount": "0.00002", "idempotency_key": "top-up-1"})).await;
    r.problem(ProblemType::IdempotencyConflict);
    let r = h.get("/admin/users/ann/credits", ADMIN, &[]).await;
    assert_eq!(r.body["balance"], "0.00001", "{}", r.body);

    let r = h.post("/v1/ops/chat", &key, call).await;
    let p = r.problem(ProblemType::CreditsExhausted);
    assert_eq!(p["balance"], "0.00001", "{p}");
    assert!(p["needed"].as_str().is_some(), "{p}");
    let u = h.get("/admin/users/ann/usage", ADMIN, &[]).await;
    assert_eq!(u.body["used"], "0", "nothing charged: {}", u.body);

    let r = h.get("/admin/users/ann/credits/history", ADMIN, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let kinds: Vec<&Value> = r.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["kind"])
        .collect();
    assert_eq!(kinds, [&json!("credit_grant")], "{}", r.body);
    assert_eq!(r.body["entries"][0]["amount"], "0.00001");
}

mod on_memory {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grants_over_http() {
        super::grants_over_http(super::memory().await).await;
    }
}

mod on_redis {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grants_over_http() {
        super::grants_over_http(super::redis().await).await;
    }
}
