//! The OpenAPI document checked by a real validator (openapi-spec-validator,
//! which scripts/test installs into target/test-tools), not only by our own
//! structural checks in `api.rs`.

use std::process::Command;
use std::sync::Arc;

use tollgate_api::state::{ApiState, Settings};
use tollgate_core::config::Config;

/// The Python that has openapi-spec-validator: `TOLLGATE_TEST_PYTHON` (set by
/// scripts/test), else `python3`.
fn python() -> String {
    std::env::var("TOLLGATE_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn openapi_document_passes_openapi_spec_validator() {
    let backends = tollgate_memory::backends(Arc::new(Config::builtin()));
    let state = ApiState::new(&backends, Settings::default());
    let doc = tollgate_api::openapi(&state);
    let path = std::env::temp_dir().join(format!(
        "tollgate-openapi-{}.json",
        tollgate_tests::random_prefix()
    ));
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    let script = "import json, sys\n\
                  from openapi_spec_validator import validate\n\
                  validate(json.load(open(sys.argv[1])))\n\
                  print('valid')";
    let out = Command::new(python())
        .args(["-c", script])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}; run scripts/test, which sets up a Python with openapi-spec-validator", python()));
    let _ = std::fs::remove_file(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openapi_spec_validator'"),
        "openapi-spec-validator is not installed for {}: run scripts/test (it installs it into \
         target/test-tools) or `pip install openapi-spec-validator`",
        python()
    );
    assert!(
        out.status.success(),
        "the OpenAPI document is invalid:\n{stderr}"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "valid");
}

/// Whether `doc` declares answer `r` (its status, and its problem type when
/// it is a problem) for `method path`.
fn declared(doc: &serde_json::Value, method: &str, path: &str, r: &crate::api::Resp) -> bool {
    let answer = &doc["paths"][path][method]["responses"][r.status.as_str()];
    match r.body["type"].as_str() {
        Some(ty) => answer["x-problem-types"]
            .as_array()
            .is_some_and(|types| types.iter().any(|t| t == ty)),
        None => answer.is_object(),
    }
}

/// Every answer an operation call gives, driven through the router on the
/// memory backend (each failure cause of its job, a key reused with another
/// body, a key taken by another operation), is declared for its route, the
/// named ones and `/v1/ops/{operation}` alike: status and problem type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_of_an_operation_call_is_declared() {
    use serde_json::json;
    use std::time::Duration;
    use tollgate_core::job::FailureCause;

    let h = crate::api::Harness::memory(crate::api::settings()).await;
    let doc = tollgate_api::openapi(&h.state);
    let key = h.user("contract", "pro").await;
    let mut answers = Vec::new();
    let check = |answers: &Vec<crate::api::Resp>| {
        for r in answers {
            for path in ["/v1/ops/jobs.extract", "/v1/ops/{operation}"] {
                assert!(
                    declared(&doc, "post", path, r),
                    "POST {path} does not declare {} {}",
                    r.status,
                    r.body
                );
            }
        }
    };
    let call = |id: String, body: serde_json::Value| {
        let key = key.clone();
        let h = &h;
        async move {
            h.post_with(
                "/v1/ops/jobs.extract",
                &key,
                &[("idempotency-key", id.as_str())],
                body,
            )
            .await
        }
    };
    for (i, cause) in [
        FailureCause::Provider,
        FailureCause::Unanswered,
        FailureCause::BadResponse,
        FailureCause::ThrottleTimeout,
        FailureCause::Expired,
        FailureCause::Abandoned,
        FailureCause::Cancelled,
        FailureCause::Rejected,
    ]
    .into_iter()
    .enumerate()
    {
        let worker = h.worker_failing(1.0, cause, Duration::ZERO);
        let r = call(format!("fail-{i}"), json!({"url": i})).await;
        assert!(
            r.status.as_u16() >= 400,
            "{cause:?}: {} {}",
            r.status,
            r.body
        );
        answers.push(r);
        worker.stop().await;
    }
    let worker = h.worker(0.0);
    let r = call("kept".into(), json!({"url": "a"})).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.body);
    answers.push(r);
    // The same key, another body: 422 idempotency-key-reused.
    let r = call("kept".into(), json!({"url": "b"})).await;
    assert_eq!(r.status.as_u16(), 422, "{}", r.body);
    answers.push(r);
    worker.stop().await;
    check(&answers);
}

/// The answers a Markdown table lists in its first column: each status
/// (`429`) with the problem types named after it (`quota-exceeded`), up to
/// the table's end. `start` is a line just before the table.
fn listed_answers(page: &str, start: &str) -> Vec<(u16, Option<String>)> {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(page),
    )
    .unwrap();
    let at = text
        .find(start)
        .unwrap_or_else(|| panic!("{page}: no {start:?}"));
    let mut out = Vec::new();
    for line in text[at..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
    {
        let first = line.split('|').nth(1).unwrap_or_default();
        // The pass-through's own answers: the providers' contract, not in
        // the document.
        if first.contains("pass-through") {
            continue;
        }
        let mut status = None;
        for (i, code) in first.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            if let Ok(s) = code.parse::<u16>() {
                status = Some(s);
                out.push((s, None));
            } else if code.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                let s = status.unwrap_or_else(|| panic!("{page}: {code} before any status"));
                out.push((s, Some(code.to_owned())));
            }
        }
    }
    assert!(out.len() >= 10, "{page}: read only {out:?}");
    out
}

/// Every status and problem type that README.md's "Calling tollgate" table
/// and the book's "Answers and what to do" list for an operation call is
/// declared by the OpenAPI document for `POST /v1/ops/{operation}` (issue 53:
/// a schemathesis positive check flagged a 422 the README listed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_the_readme_lists_is_declared() {
    let h = crate::api::Harness::memory(crate::api::settings()).await;
    let doc = tollgate_api::openapi(&h.state);
    let responses = &doc["paths"]["/v1/ops/{operation}"]["post"]["responses"];
    let mut missing = Vec::new();
    for (page, start) in [
        ("README.md", "## Calling tollgate"),
        ("docs/src/http.md", "## Answers and what to do"),
    ] {
        for (status, ty) in listed_answers(page, start) {
            let answer = &responses[status.to_string()];
            let ok = match &ty {
                None => answer.is_object(),
                Some(ty) => answer["x-problem-types"]
                    .as_array()
                    .is_some_and(|types| types.iter().any(|t| t == &format!("/problems/{ty}"))),
            };
            if !ok {
                missing.push(format!("{page}: {status} {}", ty.unwrap_or_default()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "POST /v1/ops/{{operation}} does not declare:\n{}",
        missing.join("\n")
    );
}
