//! The api's answers at its edges, on both backends: error bodies that must not
//! repeat what a client sent.

use serde_json::json;
use tollgate_api::ProblemType;

use crate::api::{settings, Harness, ADMIN};

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::memory(super::settings()).await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::redis(super::settings()).await).await;
                }
            )*
        }
    };
}

both_backends!(errors_do_not_echo_long_input);

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
        .call(
            "PUT",
            "/admin/users/alice/plan",
            Some(ADMIN),
            &[],
            Some(json!({"plan": long}).to_string()),
        )
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
