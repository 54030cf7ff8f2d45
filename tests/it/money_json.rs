//! Money over HTTP: with a currency, every amount of an answer (`/v1/usage`,
//! the job view, the admin views) is an exact decimal string of it, and the
//! admin routes read decimal strings; bad amounts are a 422 naming the field
//! that changes nothing. The RateLimit headers stay integers of the minor
//! unit. With tokens every answer stays as it was (integers, no currency),
//! on memory and on Redis.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tollgate_api::problem::ProblemType;
use tollgate_core::config::Config;
use tollgate_core::job::{JobSource, Settled, Taker};

use crate::api::{settings, Harness, ADMIN};

/// A USD deployment: a `chat` operation priced by
/// [`tollgate_tests::money::SHEET`], a plan of 0.50 USD an hour.
fn usd_config() -> Arc<Config> {
    tollgate_tests::money::usd_config(
        "money json test",
        "hold_grace = \"200ms\"\ndefault_plan = \"paid\"\n[export]\nmaxlen = 1000\n\
         [plans.paid]\nlimit = \"0.50\"\nwindow = \"1h\"",
    )
}

async fn memory() -> Harness {
    Harness::memory_with(settings(), usd_config()).await
}

async fn redis() -> Harness {
    Harness::redis_with(settings(), usd_config()).await
}

/// As a worker does: takes the next `chat` job, settles it to `answer`'s
/// usage and completes it.
async fn run_one(source: &Arc<dyn JobSource>, answer: Value) {
    let lease = source
        .take(
            "chat",
            Taker::new("w", Duration::from_secs(2), Duration::from_secs(5)),
        )
        .await
        .expect("take")
        .expect("a job within 2 s");
    assert!(source.start(&lease).await.expect("start"));
    let charged = match source.settle(&lease, &answer).await.expect("settle") {
        Settled::To { cost, .. } => Some(cost),
        _ => None,
    };
    source
        .complete_with(&lease, answer, None, charged)
        .await
        .expect("complete");
}

/// Reserved: 100 bytes of body at 0.15 USD/M plus 100 output tokens at
/// 0.60 USD/M; settled: 60 input and 50 output tokens.
async fn answers_speak_decimal_strings(h: Harness) {
    let key = h.user("ann", "paid").await;
    let body = json!({"model": "gpt-4o-mini", "max_tokens": 100, "p": "x".repeat(60)});
    let bytes = body.to_string().len() as u64;
    let reserved = (bytes * 150_000 + 100 * 600_000).div_ceil(1_000_000);
    let r = h.post("/v1/ops/chat?async=true", &key, body).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let id = r.body["job_id"].as_str().unwrap().to_owned();
    let decimal =
        |minor: u64| tollgate_core::money::format_amount(h.state.config.currency(), minor);
    assert_eq!(r.body["reserved"], json!(decimal(reserved)), "{}", r.body);
    assert_eq!(r.body["cost"], json!(decimal(reserved)), "{}", r.body);
    assert_eq!(r.body["currency"], "USD");
    // The headers stay integers, of the micro-unit.
    let left = 500_000 - reserved;
    assert!(
        r.header("ratelimit").contains(&format!("r={left};")),
        "{}",
        r.header("ratelimit")
    );
    assert!(r.header("ratelimit-policy").contains("q=500000;"));

    // 60 input tokens at 0.15/M (9 micro-USD) + 50 output at 0.60/M (30).
    let usage = json!({"usage": {"prompt_tokens": 60, "completion_tokens": 50}});
    run_one(&h.source, usage).await;
    let job = h.get(&format!("/v1/jobs/{id}"), &key, &[]).await;
    assert_eq!(job.status, StatusCode::OK, "{}", job.body);
    assert_eq!(job.body["cost"], "0.000039", "{}", job.body);
    assert_eq!(job.body["reserved"], json!(decimal(reserved)));

    let u = h.usage(&key).await;
    assert_eq!(u["currency"], "USD");
    assert_eq!(u["used"], "0.000039", "{u}");
    assert_eq!(u["limit"], "0.5");
    assert_eq!(u["remaining"], "0.499961");
    assert_eq!(u["windows"][0]["limit"], "0.5");
    assert_eq!(u["windows"][0]["used"], "0.000039");
    assert_eq!(u["events"][0]["cost"], "0.000039");
    assert_eq!(u["events"][0]["estimate"], json!(decimal(reserved)));
    // The admin's view of the user says the same.
    let a = h.get("/admin/users/ann/usage", ADMIN, &[]).await;
    assert_eq!(a.body["used"], "0.000039", "{}", a.body);
    assert_eq!(a.body["windows"][0]["remaining"], "0.499961");
    // The spend report too, in JSON and CSV: the settled charge, under the
    // sheet entry that priced it.
    let spend = h.get("/admin/spend?by=model&step=1d", ADMIN, &[]).await;
    assert_eq!(spend.status, StatusCode::OK, "{}", spend.body);
    assert_eq!(spend.body["currency"], "USD");
    assert_eq!(
        spend.body["rows"][0]["key"], "gpt-4o-mini*",
        "{}",
        spend.body
    );
    assert_eq!(
        spend.body["rows"][0]["amount"], "0.000039",
        "{}",
        spend.body
    );
    assert_eq!(spend.body["total"], "0.000039");
    let csv = h
        .get("/admin/spend?by=model&step=1d&format=csv", ADMIN, &[])
        .await;
    let csv = csv.body.as_str().unwrap_or_default();
    assert!(
        csv.ends_with(",0.000039\n") && csv.starts_with("model,start,amount\n"),
        "{csv}"
    );
    // The export's spend carries the model, the sheet entry and the prices
    // that applied (per million tokens): with the settle, the charge is
    // rebuilt from the export alone. A plain reserve after it carries none.
    let ann = tollgate_core::id::UserId::new("ann").unwrap();
    let rid = tollgate_core::id::RequestId::existing("plain-1").unwrap();
    assert!(h
        .state
        .ledger
        .reserve(&ann, &rid, 1)
        .await
        .unwrap()
        .is_allowed());
    let export = h.state.ledger.exported(&ann, 0, 100).await.unwrap();
    let kinds: Vec<_> = export.iter().map(|e| format!("{:?}", e.kind)).collect();
    assert_eq!(kinds, ["Spend", "Settle", "Spend"], "{export:?}");
    let spend = &export[0];
    assert_eq!(spend.request_id.as_str(), id);
    assert_eq!(spend.cost, reserved);
    assert_eq!(spend.model.as_deref(), Some("gpt-4o-mini"));
    assert_eq!(spend.entry.as_deref(), Some("models.\"gpt-4o-mini*\""));
    let prices = spend.prices.as_ref().expect("prices");
    assert_eq!(
        (&prices["input"], &prices["output"]),
        (&json!("0.15"), &json!("0.6"))
    );
    assert_eq!(export[1].cost, 39, "60 × 0.15 + 50 × 0.60 per million");
    assert_eq!(
        (&export[2].model, &export[2].prices),
        (&None, &None),
        "a plain reserve is not priced: {:?}",
        export[2]
    );
    let v = serde_json::to_value(spend).unwrap();
    assert_eq!(v["prices"]["cached_input"], "0.15", "{v}");
    // An operator's refund answers in the currency too (of the job's charge).
    let r = h
        .post(&format!("/admin/users/ann/refunds/{id}"), ADMIN, json!({}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (
            &r.body["outcome"],
            &r.body["cost"],
            &r.body["used"],
            &r.body["currency"]
        ),
        (
            &json!("refunded"),
            &json!("0.000039"),
            &json!("0.000001"),
            &json!("USD")
        ),
        "{}",
        r.body
    );
    // The OpenAPI document of a money deployment says so.
    let doc = h.call("GET", "/openapi.json", None, &[], None).await.body;
    let usage = &doc["components"]["schemas"]["Usage"]["properties"];
    assert_eq!(usage["used"]["type"], "string", "{usage}");
    assert!(usage["used"]["pattern"].is_string(), "{usage}");
    let job = &doc["components"]["schemas"]["Job"]["properties"];
    assert_eq!(job["cost"]["allOf"][0]["type"], "string", "{job}");
}

/// A user's own limits in decimal strings; every bad amount a 400 naming it,
/// nothing changed.
async fn admin_limits_take_decimal_strings(h: Harness) {
    let key = h.user("bo", "paid").await;
    let set = |limits: Value| {
        let h = &h;
        async move {
            h.put("/admin/users/bo/limits", ADMIN, json!({"limits": limits}))
                .await
        }
    };
    let r = set(json!([
        {"limit": "20", "window": "1h"},
        {"limit": "0.0025", "window": "1m"}
    ]))
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["currency"], "USD");
    assert_eq!(r.body["limits"][0]["limit"], "20", "{}", r.body);
    assert_eq!(r.body["limits"][1]["limit"], "0.0025");
    for (bad, needle) in [
        (json!("0.0000001"), "at most 6 decimal places"),
        (json!("-1"), "negative"),
        (json!("ten"), "\"ten\""),
        (json!(20), "decimal string"),
        (json!(0.5), "decimal string"),
        (json!("1e3"), "exponent"),
        (json!(null), "null"),
        (json!("9007199255"), "2^53"),
    ] {
        let r = set(json!([
            {"limit": "30", "window": "2h"},
            {"limit": bad, "window": "1m"}
        ]))
        .await;
        let p = r.problem(ProblemType::InvalidField);
        assert_eq!(p["field"], "limits[1].limit", "{p}");
        let detail = p["detail"].as_str().unwrap();
        assert!(
            detail.starts_with("limits[1].limit: ") && detail.contains(needle),
            "{detail}"
        );
    }
    let now = h.get("/admin/users/bo/usage", ADMIN, &[]).await;
    let limits: Vec<&Value> = now.body["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["limit"])
        .collect();
    assert_eq!(limits, [&json!("20"), &json!("0.0025")], "{}", now.body);
    // A call whose worst case can never fit says so in the currency.
    let r = set(json!([{"limit": "0.00001", "window": "1h"}])).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let body = json!({"model": "gpt-4o-mini", "max_tokens": 100});
    let r = h.post("/v1/ops/chat", &key, body).await;
    let p = r.problem(ProblemType::CostExceedsLimit);
    let detail = p["detail"].as_str().unwrap();
    assert!(
        detail.contains(" USD exceeds the plan limit of 0.00001 USD"),
        "{detail}"
    );
}

/// The Rust client reads money exactly: `Done.cost` and every amount of
/// `Usage` in micro-units, beside the currency.
async fn the_rust_client_reads_money_exactly(h: Harness) {
    use tollgate_client::{Client, Outcome};
    let key = h.user("cli", "paid").await;
    let server = tollgate_tests::api::ApiServer::start(h.state.clone()).await;
    let client = Client::new(format!("http://{}", server.addr), &key).unwrap();
    let source = Arc::clone(&h.source);
    let worker = tokio::spawn(async move {
        let usage = json!({"usage": {"prompt_tokens": 60, "completion_tokens": 50}});
        run_one(&source, usage).await;
    });
    let body = json!({"model": "gpt-4o-mini", "max_tokens": 100});
    let outcome = client.call("chat", body).send().await.unwrap();
    worker.await.unwrap();
    let Outcome::Done(done) = outcome else {
        panic!("expected done, got {outcome:?}")
    };
    assert_eq!((done.cost, done.currency.as_str()), (39, "USD"));
    let u = client.usage().await.unwrap();
    assert_eq!(u.currency, "USD");
    assert_eq!((u.used, u.limit, u.remaining), (39, 500_000, 499_961));
    assert_eq!((u.windows[0].used, u.windows[0].limit), (39, 500_000));
    assert_eq!(u.events[0].cost, 39);
    assert!(
        u.events[0].estimate.is_some_and(|e| e > 39),
        "{:?}",
        u.events[0]
    );
}

mod usd {
    use super::*;
    on_each_backend!([
        answers_speak_decimal_strings,
        admin_limits_take_decimal_strings,
        the_rust_client_reads_money_exactly,
    ]
        memory => crate::money_json::memory().await,
        redis => crate::money_json::redis().await,
    );
}

/// With tokens, answers are what they always were: integers, no currency
/// beside the job's amounts; integer limits are read as before.
async fn tokens_answers_stay_integers(h: Harness) {
    let key = h.user("cy", "metered").await;
    let _w = h.worker(0.0);
    let r = h.post("/v1/ops/echo.custom", &key, json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (r.body["cost"].clone(), r.body["reserved"].clone()),
        (json!(2), json!(2))
    );
    assert!(r.body.get("currency").is_none(), "{}", r.body);
    let u = h.wait_used(&key, 2).await;
    assert_eq!(u["currency"], "tokens");
    assert_eq!(
        (u["limit"].clone(), u["events"][0]["cost"].clone()),
        (json!(10), json!(2))
    );
    let r = h
        .put(
            "/admin/users/cy/limits",
            ADMIN,
            json!({"limits": [{"limit": 30, "window": "1h"}]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["limits"][0]["limit"], 30);
    assert!(r.body.get("currency").is_none(), "{}", r.body);
    let r = h
        .put(
            "/admin/users/cy/limits",
            ADMIN,
            json!({"limits": [{"limit": 1.5, "window": "1h"}]}),
        )
        .await;
    let p = r.problem(ProblemType::InvalidField);
    assert_eq!(p["field"], "limits[0].limit");
}

mod tokens {
    use super::*;
    on_each_backend!([tokens_answers_stay_integers]
        memory => crate::api::Harness::memory(crate::api::settings()).await,
        redis => crate::api::Harness::redis(crate::api::settings()).await,
    );
}
