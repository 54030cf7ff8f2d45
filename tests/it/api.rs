//! The api role over both backends: admin and auth, metered operations (sync,
//! async, idempotent, failing), budget responses, bad requests, OpenAPI and
//! metrics. Each case runs on the in-memory stores and on a real Redis, driven
//! through `tower::ServiceExt::oneshot`, with a stand-in worker taking the jobs
//! through the `JobSource` contract.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tollgate_api::{
    problem::ProblemType,
    state::{ApiState, Settings},
};
use tollgate_core::job::{JobOptions, Taker};
use tollgate_core::{
    config::Config,
    job::{FailureCause, JobSource},
    ledger::Ledger,
    throttle::{Share, Waiter},
};
use tollgate_redis::{jobs::RedisJobQueue, keys::KeySpace, ledger::RedisLedger, pool::PoolOptions};
use tollgate_tests::api::StandInWorker;
use tollgate_tests::jobs::take_one;
use tollgate_tests::{random_prefix, RedisServer, TestCluster};
use tower::ServiceExt;

pub const ADMIN: &str = "admin-token-for-tests-0123456789";

/// The built-in config plus a tiny plan, an operation reachable only through
/// the generic route, and one on a provider that grants a slot every 100 s
/// (nothing moves in its queue while a test looks).
pub fn test_config() -> Arc<Config> {
    test_config_with("")
}

/// [`test_config`] with `extra` appended.
pub fn test_config_with(extra: &str) -> Arc<Config> {
    let text = format!(
        "{}\n[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n\n[plans.metered]\nlimits = [{{ limit = 50, window = \"1h\" }}, {{ limit = 10, window = \"1m\" }}]\n\n[operations.\"echo.custom\"]\ncost = 2\nprovider = \"llm\"\n\n\
         [operations.\"llm.fixed\"]\ncost = 8\nprovider = \"llm\"\n\n\
         [providers.glacier]\nrate = 0.01\nburst = 1\nmax_wait = \"60s\"\n\n\
         [operations.\"glacier.call\"]\ncost = 1\nprovider = \"glacier\"\n{extra}",
        tollgate_core::config::BUILTIN
    );
    Arc::new(Config::parse(&text, "test").expect("test config"))
}

pub struct Harness {
    pub state: ApiState,
    pub app: Router,
    pub source: Arc<dyn JobSource>,
    pub redis: Option<RedisServer>,
    pub _cluster: Option<TestCluster>,
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Resp {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// Asserts a problem+json body of `kind` and returns it.
    #[track_caller]
    pub fn problem(&self, kind: ProblemType) -> &Value {
        assert_eq!(
            self.header("content-type"),
            "application/problem+json",
            "{:?}",
            self.body
        );
        assert_eq!(self.body["type"], kind.uri(), "{}", self.body);
        assert_eq!(self.status, kind.status(), "{}", self.body);
        assert_eq!(self.body["status"], kind.status().as_u16());
        &self.body
    }
}

pub fn settings() -> Settings {
    Settings {
        admin_token: Some(ADMIN.into()),
        body_limit: 4096,
        sync_timeout: Duration::from_secs(10),
        ..Settings::default()
    }
}

impl Harness {
    pub async fn memory(settings: Settings) -> Self {
        Self::memory_with(settings, test_config()).await
    }

    /// The api and its backends in process, on `config`.
    pub async fn memory_with(settings: Settings, config: Arc<Config>) -> Self {
        let backends = tollgate_memory::backends(config);
        let state = ApiState::new(&backends, settings);
        Self {
            app: tollgate_api::router(state.clone()),
            state,
            source: backends.source,
            redis: None,
            _cluster: None,
        }
    }

    pub async fn redis(settings: Settings) -> Self {
        let server = RedisServer::start();
        Self::redis_via(&server.url(), server, settings).await
    }

    /// The api on a Redis of its own, on `config`.
    pub async fn redis_with(settings: Settings, config: Arc<Config>) -> Self {
        let server = RedisServer::start();
        let state = redis_state_with(&server.url(), &random_prefix(), settings, config).await;
        let source = redis_source(&server.url(), &state).await;
        Self {
            app: tollgate_api::router(state.clone()),
            state,
            source,
            redis: Some(server),
            _cluster: None,
        }
    }

    /// The api reaching `server` at `url` (a proxy's, say); the worker side
    /// reaching it directly.
    pub async fn redis_via(url: &str, server: RedisServer, settings: Settings) -> Self {
        let state = redis_state(url, &random_prefix(), settings).await;
        let source = redis_source(&server.url(), &state).await;
        Self {
            app: tollgate_api::router(state.clone()),
            state,
            source,
            redis: Some(server),
            _cluster: None,
        }
    }

    /// The api on a Redis Cluster (3 primaries, 3 replicas).
    pub async fn cluster(settings: Settings) -> Self {
        let cluster = TestCluster::get();
        let state = redis_state(&cluster.url(), &random_prefix(), settings).await;
        let source = redis_source(&cluster.url(), &state).await;
        Self {
            app: tollgate_api::router(state.clone()),
            state,
            source,
            redis: None,
            _cluster: Some(cluster),
        }
    }

    pub fn worker(&self, fail_rate: f64) -> StandInWorker {
        self.worker_failing(fail_rate, FailureCause::Provider, Duration::from_millis(5))
    }

    pub fn worker_failing(
        &self,
        fail_rate: f64,
        cause: FailureCause,
        delay: Duration,
    ) -> StandInWorker {
        let ops: Vec<&str> = vec![
            "embeddings",
            "salary.lookup",
            "jobs.extract",
            "llm.structured",
            "company.research",
            "echo.custom",
            "llm.fixed",
        ];
        StandInWorker::failing_with(Arc::clone(&self.source), &ops, fail_rate, cause, delay)
    }

    pub async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Option<String>,
    ) -> Resp {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(body.map_or_else(Body::empty, Body::from)).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), self.app.clone().oneshot(req))
            .await
            .expect("answer within 30s")
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Resp {
            status,
            headers,
            body,
        }
    }

    /// `GET path` as `token`, with `headers`.
    pub async fn get(&self, path: &str, token: &str, headers: &[(&str, &str)]) -> Resp {
        self.call("GET", path, Some(token), headers, None).await
    }

    /// `POST path` of the JSON `body` as `token`, with `headers`.
    pub async fn post_with(
        &self,
        path: &str,
        token: &str,
        headers: &[(&str, &str)],
        body: Value,
    ) -> Resp {
        self.call("POST", path, Some(token), headers, Some(body.to_string()))
            .await
    }

    pub async fn post(&self, path: &str, token: &str, body: Value) -> Resp {
        self.post_with(path, token, &[], body).await
    }

    pub async fn put(&self, path: &str, token: &str, body: Value) -> Resp {
        self.call("PUT", path, Some(token), &[], Some(body.to_string()))
            .await
    }

    /// Creates `user` on `plan` through the admin route; returns the API key.
    pub async fn user(&self, user: &str, plan: &str) -> String {
        let r = self
            .post("/admin/users", ADMIN, json!({"user": user, "plan": plan}))
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        r.body["api_key"].as_str().unwrap().to_owned()
    }

    pub async fn usage(&self, key: &str) -> Value {
        let r = self.get("/v1/usage", key, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        r.body
    }

    /// Waits (at most 10 s) until the user's usage is `used`.
    pub async fn wait_used(&self, key: &str, used: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let u = self.usage(key).await;
            if u["used"] == used || Instant::now() > deadline {
                assert_eq!(u["used"], used, "{u}");
                return u;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub async fn redis_state(url: &str, prefix: &str, settings: Settings) -> ApiState {
    redis_state_with(url, prefix, settings, test_config()).await
}

/// [`redis_state`] over `config`.
pub async fn redis_state_with(
    url: &str,
    prefix: &str,
    settings: Settings,
    config: Arc<Config>,
) -> ApiState {
    let keys = KeySpace::new(prefix).unwrap();
    let pool = tollgate_redis::pool::connect(
        url,
        &PoolOptions {
            max_size: 16,
            timeout: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let ledger: Arc<dyn Ledger> = Arc::new(
        RedisLedger::new(pool.clone(), keys.clone(), Arc::clone(&config))
            .with_timeout(Duration::from_secs(1)),
    );
    let mut backends = tollgate_redis::backends(
        pool.clone(),
        keys.clone(),
        Arc::clone(&config),
        "test".into(),
    );
    backends.jobs = Arc::new(RedisJobQueue::new(
        pool,
        keys,
        config,
        Arc::clone(&ledger),
        JobOptions::default(),
    ));
    backends.ledger = ledger;
    ApiState::new(&backends, settings)
}

/// A separate queue object (its own waiters) on the same keys: the worker side.
pub async fn redis_source(url: &str, state: &ApiState) -> Arc<dyn JobSource> {
    let prefix = state_prefix(state);
    let keys = KeySpace::new(&prefix).unwrap();
    let pool = tollgate_redis::pool::connect(url, &PoolOptions::default())
        .await
        .unwrap();
    let ledger: Arc<dyn Ledger> = Arc::new(RedisLedger::new(
        pool.clone(),
        keys.clone(),
        Arc::clone(&state.config),
    ));
    Arc::new(RedisJobQueue::new(
        pool,
        keys,
        Arc::clone(&state.config),
        ledger,
        JobOptions::default(),
    ))
}

pub fn state_prefix(state: &ApiState) -> String {
    // RedisLedger's Debug shows its prefix: `RedisLedger { prefix: "t..", .. }`.
    let debug = format!("{:?}", state.ledger);
    debug
        .split('"')
        .nth(1)
        .expect("a RedisLedger with a prefix")
        .to_owned()
}

on_each_backend!(
    [
        admin_creates_users_changes_plans_and_revokes_keys,
        missing_unknown_and_revoked_keys_are_401,
        sync_call_returns_the_result_with_ratelimit_headers,
        async_call_is_202_and_jobs_are_private,
        idempotency_key_charges_once_and_returns_the_same_job,
        provider_failure_is_502_and_refunded,
        an_operator_refund_cancels_a_queued_job,
        over_budget_is_429_with_exact_retry_after,
        several_windows_name_every_policy_and_the_closest_to_exhaustion,
        bad_requests_are_problems_naming_the_field,
        health_metrics_and_openapi,
        throttle_timeout_is_504_and_a_slow_job_is_202,
        a_job_waiting_for_its_provider_shows_where_it_stands,
        usage_pages_follow_next_cursor_and_bad_pages_are_400,
        prefer_wait_on_an_async_call_waits_for_the_result_then_202,
        organisations_over_the_admin_api,
    ]
    memory => super::Harness::memory(super::settings()).await,
    redis => super::Harness::redis(super::settings()).await,
    cluster => super::Harness::cluster(super::settings()).await,
);

/// Organisations through the admin routes: created on a plan, users put in
/// and taken out (their spend moves along); a member refused by its
/// organisation's budget gets a 429 saying so (`scope`), and its usage shows
/// the organisation; bad names and pages are problems.
async fn organisations_over_the_admin_api(h: Harness) {
    let put = |path: String, body: Value| {
        let h = &h;
        async move {
            h.call("PUT", &path, Some(ADMIN), &[], Some(body.to_string()))
                .await
        }
    };
    let alice = h.user("alice", "tiny").await;
    let bob = h.user("bob", "tiny").await;
    let r = put("/admin/orgs/acme".into(), json!({"plan": "tiny"})).await;
    assert_eq!(
        (r.status, &r.body),
        (StatusCode::OK, &json!({"org": "acme", "plan": "tiny"}))
    );
    let r = put("/admin/orgs/acme".into(), json!({"plan": "gold"})).await;
    assert_eq!(r.problem(ProblemType::InvalidField)["field"], "plan");
    for u in ["alice", "bob"] {
        let r = put(format!("/admin/users/{u}/org"), json!({"org": "acme"})).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["org"], "acme");
    }
    let r = put("/admin/users/alice/org".into(), json!({})).await;
    assert_eq!(r.problem(ProblemType::InvalidField)["field"], "org");
    r.problem(ProblemType::InvalidField);
    let r = put("/admin/users/alice/org".into(), json!({"org": "nowhere"})).await;
    r.problem(ProblemType::NotFound);
    let r = put("/admin/users/ghost/org".into(), json!({"org": "acme"})).await;
    r.problem(ProblemType::NotFound);
    for i in 0..2 {
        let r = h
            .post_with(
                "/v1/ops/echo.custom?async=true",
                &alice,
                &[("idempotency-key", &format!("a{i}"))],
                json!({"i": i}),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    }
    // Bob has 5 of his own left; the organisation has 1.
    let r = h
        .post("/v1/ops/echo.custom?async=true", &bob, json!({}))
        .await;
    let p = r.problem(ProblemType::QuotaExceeded);
    assert_eq!(p["scope"], "organisation", "{p}");
    assert!(
        p["detail"].as_str().unwrap().contains("organisation"),
        "{p}"
    );
    // It says what the request needed, not only what is used.
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("this request needs 2 tokens"),
        "{p}"
    );
    let u = h.usage(&bob).await;
    assert_eq!(u["used"], 0, "{u}");
    assert_eq!(u["organisation"]["org"], "acme", "{u}");
    assert_eq!(u["organisation"]["windows"][0]["used"], 4, "{u}");
    let r = h.get("/admin/orgs", ADMIN, &[]).await;
    assert_eq!(r.body, json!({"orgs": ["acme"], "next": null}));
    let r = h.get("/admin/orgs/acme?limit=1", ADMIN, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (&r.body["members"], &r.body["next_member"]),
        (&json!(["alice"]), &json!("alice"))
    );
    assert_eq!(r.body["windows"][0]["used"], 4);
    let r = h.get("/admin/orgs/acme?after=alice", ADMIN, &[]).await;
    assert_eq!(r.body["members"], json!(["bob"]));
    let r = h.get("/admin/orgs/acme?limit=0", ADMIN, &[]).await;
    r.problem(ProblemType::InvalidField);
    let r = h.get("/admin/orgs/nowhere", ADMIN, &[]).await;
    r.problem(ProblemType::NotFound);
    let r = h.get("/admin/orgs", &alice, &[]).await;
    r.problem(ProblemType::Unauthorized);
    let r = put("/admin/users/alice/org".into(), json!({"org": null})).await;
    assert_eq!(
        r.body,
        json!({"user": "alice", "org": null, "moved_events": 2})
    );
    assert!(h.usage(&alice).await.get("organisation").is_none());
    let r = h.get("/admin/orgs/acme", ADMIN, &[]).await;
    assert_eq!(
        (&r.body["members"], &r.body["windows"][0]["used"]),
        (&json!(["bob"]), &json!(0))
    );
}

/// `Prefer: respond-async, wait=N` waits up to N s for the job: the result
/// when it ends in time, else 202 as without the wait. (Before: 202 at once,
/// the wait ignored.)
async fn prefer_wait_on_an_async_call_waits_for_the_result_then_202(h: Harness) {
    let key = h.user("wendy", "free").await;
    let worker = h.worker(0.0);
    // The answer to `path` with `Prefer: prefer`, and how long it took.
    let call = |path: &'static str, prefer: &'static str, text: &'static str| {
        let (h, key) = (&h, &key);
        async move {
            let started = Instant::now();
            let r = h
                .post_with(path, key, &[("prefer", prefer)], json!({ "text": text }))
                .await;
            (r, started.elapsed())
        }
    };
    let (r, took) = call("/v1/ops/embeddings", "respond-async, wait=5", "soon").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["status"], "succeeded", "{}", r.body);
    assert_eq!(r.body["result"]["echo"]["text"], "soon", "{}", r.body);
    assert!(took < Duration::from_secs(5));
    // Nobody runs it: 202 once the wait (1 s) is over, not before.
    worker.stop().await;
    let (r, waited) = call("/v1/ops/embeddings?async=true", "wait=1", "later").await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    assert_eq!(r.body["status"], "queued", "{}", r.body);
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // wait=0: at once.
    let (r, took) = call("/v1/ops/embeddings", "respond-async, wait=0", "now").await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    assert!(took < Duration::from_millis(900));
}

/// `GET /v1/usage?limit=&cursor=`: the totals on every page, the events a page
/// at a time (default 50), `next_cursor` null at the end; a bad limit or
/// cursor is a 400 problem naming the parameter.
async fn usage_pages_follow_next_cursor_and_bad_pages_are_400(h: Harness) {
    let key = h.user("paula", "free").await;
    let paula = tollgate_core::id::UserId::new("paula").unwrap();
    for i in 0..130 {
        let id = tollgate_core::id::RequestId::new(format!("e{i:03}")).unwrap();
        assert!(h
            .state
            .ledger
            .reserve(&paula, &id, 1)
            .await
            .unwrap()
            .is_allowed());
    }
    let first = h.usage(&key).await;
    assert_eq!(
        first["events"].as_array().unwrap().len(),
        50,
        "the default page"
    );
    assert_eq!(first["used"], 130);
    let mut seen = Vec::new();
    let mut path = "/v1/usage?limit=40".to_owned();
    loop {
        let r = h.get(&path, &key, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["used"], 130, "{}", r.body);
        let events = r.body["events"].as_array().unwrap();
        assert!(events.len() <= 40);
        seen.extend(
            events
                .iter()
                .map(|e| e["request_id"].as_str().unwrap().to_owned()),
        );
        match r.body["next_cursor"].as_str() {
            Some(c) => path = format!("/v1/usage?cursor={c}&limit=40"),
            None => {
                assert!(r.body["next_cursor"].is_null(), "{}", r.body);
                break;
            }
        }
    }
    assert_eq!(
        seen,
        (0..130).map(|i| format!("e{i:03}")).collect::<Vec<_>>()
    );
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=51", "limit"),
        ("limit=-1", "limit"),
        ("limit=abc", "limit"),
        ("limit=", "limit"),
        ("limit=%2B5", "limit"),
        ("limit=99999999999999999999999", "limit"),
        ("cursor=", "cursor"),
        ("cursor=x", "cursor"),
        ("cursor=1-", "cursor"),
        ("cursor=1-2-3", "cursor"),
        ("cursor=1234567890123456-0", "cursor"),
        ("cursor=1-99999999999999999999", "cursor"),
        ("cursor=%00", "cursor"),
    ] {
        let r = h.get(&format!("/v1/usage?{query}"), &key, &[]).await;
        let body = r.problem(ProblemType::MalformedRequest);
        assert_eq!(body["field"], field, "{query}: {body}");
    }
    // Auth comes first: no key, no page.
    let r = h.call("GET", "/v1/usage?limit=0", None, &[], None).await;
    r.problem(ProblemType::Unauthorized);
}

async fn admin_creates_users_changes_plans_and_revokes_keys(h: Harness) {
    let r = h
        .post(
            "/admin/users",
            ADMIN,
            json!({"user": "alice", "plan": "free"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let key = r.body["api_key"].as_str().unwrap().to_owned();
    let key_id = r.body["key_id"].as_str().unwrap().to_owned();
    assert!(key.starts_with("tg_user_") && key.len() == 50, "{key}");
    assert!(key_id.starts_with("kid_"));
    assert_eq!(h.usage(&key).await["limit"], 1000);

    let r = h
        .put("/admin/users/alice/plan", ADMIN, json!({"plan": "pro"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.usage(&key).await["limit"], 20000);

    let r = h
        .put("/admin/users/alice/plan", ADMIN, json!({"plan": "gold"}))
        .await;
    assert_eq!(r.problem(ProblemType::InvalidField)["field"], "plan");
    let r = h.post("/admin/users", ADMIN, json!({"plan": "pro"})).await;
    assert_eq!(r.problem(ProblemType::InvalidField)["field"], "user");
    let r = h
        .post("/admin/users", ADMIN, json!({"user": "a:b", "plan": "pro"}))
        .await;
    assert_eq!(r.problem(ProblemType::InvalidField)["field"], "user");

    let r = h
        .post("/admin/users", "wrong-token", json!({"user": "x"}))
        .await;
    r.problem(ProblemType::Unauthorized);
    let r = h
        .call("POST", "/admin/users", None, &[], Some("{}".into()))
        .await;
    r.problem(ProblemType::Unauthorized);

    let path = format!("/admin/keys/{key_id}");
    let r = h.call("DELETE", &path, Some(ADMIN), &[], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["revoked"], true);
    let r = h.get("/v1/usage", &key, &[]).await;
    r.problem(ProblemType::Unauthorized);
    let r = h
        .call(
            "DELETE",
            "/admin/keys/kid_0000000000000000",
            Some(ADMIN),
            &[],
            None,
        )
        .await;
    r.problem(ProblemType::NotFound);
}

async fn missing_unknown_and_revoked_keys_are_401(h: Harness) {
    for auth in [
        None,
        Some("Basic dXNlcjpwYXNz"),
        Some("Bearer"),
        Some("Bearer tg_0000000000000000000000000000000000000000000000000000000000000000"),
    ] {
        let headers: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
        let r = h.call("GET", "/v1/usage", None, &headers, None).await;
        r.problem(ProblemType::Unauthorized);
        assert!(r.header("www-authenticate").starts_with("Bearer"));
        let r = h
            .call(
                "POST",
                "/v1/ops/llm.structured",
                None,
                &headers,
                Some("{}".into()),
            )
            .await;
        r.problem(ProblemType::Unauthorized);
    }
    // Admin routes are closed when no admin token is configured.
    let closed = Harness::memory(Settings {
        admin_token: None,
        ..settings()
    })
    .await;
    let r = closed
        .post("/admin/users", "anything", json!({"user": "x"}))
        .await;
    r.problem(ProblemType::AdminDisabled);
}

async fn sync_call_returns_the_result_with_ratelimit_headers(h: Harness) {
    let _worker = h.worker(0.0);
    let key = h.user("bob", "free").await;
    let r = h
        .post("/v1/ops/llm.structured", &key, json!({"prompt": "hi"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["status"], "succeeded");
    assert_eq!(r.body["result"]["echo"]["prompt"], "hi");
    // It settles to what the provider reports: the most is reserved, and the
    // client sees what was (the stand-in reports no usage: nothing settles).
    assert_eq!(r.body["cost"], 40);
    assert!(r.body["job_id"].is_string());
    assert_eq!(r.header("ratelimit-policy"), "\"budget\";q=1000;w=43200");
    assert_eq!(r.header("ratelimit"), "\"budget\";r=960;t=43200");

    // The generic route prices from the config.
    let r = h.post("/v1/ops/echo.custom", &key, json!({"x": 1})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["cost"], 2);

    let u = h.usage(&key).await;
    assert_eq!(
        (u["used"].as_u64(), u["remaining"].as_u64()),
        (Some(42), Some(958))
    );
    assert_eq!(u["window_secs"], 43200);
    assert!(u["reset_at"].as_str().unwrap().ends_with('Z'));
    let events = u["events"].as_array().unwrap();
    let ops: Vec<_> = events.iter().map(|e| e["operation"].as_str()).collect();
    assert_eq!(ops, [Some("llm.structured"), Some("echo.custom")]);
    assert_eq!(events[0]["cost"], 40);
    assert!(events[0]["request_id"].is_string() && events[0]["at"].is_string());
}

async fn async_call_is_202_and_jobs_are_private(h: Harness) {
    let key = h.user("carol", "free").await;
    let other = h.user("dave", "free").await;
    let r = h
        .post_with(
            "/v1/ops/embeddings",
            &key,
            &[("prefer", "respond-async")],
            json!({"text": "x"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let location = r.header("location").to_owned();
    let id = r.body["job_id"].as_str().unwrap().to_owned();
    assert_eq!(location, format!("/v1/jobs/{id}"));
    assert_eq!(r.body["status"], "queued");
    assert!(r.header("ratelimit").starts_with("\"budget\";r=999"));

    // Nobody runs it yet: still queued; then a worker does.
    let r = h.get(&location, &key, &[]).await;
    assert_eq!(
        (r.status, r.body["status"].as_str()),
        (StatusCode::OK, Some("queued"))
    );
    let _worker = h.worker(0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = h.get(&location, &key, &[]).await;
        if r.body["status"] == "succeeded" {
            assert_eq!(r.body["result"]["echo"]["text"], "x");
            break;
        }
        assert!(Instant::now() < deadline, "{}", r.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ?async=true is the same as the header.
    let r = h
        .post("/v1/ops/embeddings?async=true", &key, json!({}))
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);

    let r = h.get(&location, &other, &[]).await;
    r.problem(ProblemType::NotFound);
    for bad in ["/v1/jobs/nope", "/v1/jobs/a:b", "/v1/jobs/%7Bx%7D"] {
        let r = h.get(bad, &key, &[]).await;
        r.problem(ProblemType::NotFound);
    }
}

async fn idempotency_key_charges_once_and_returns_the_same_job(h: Harness) {
    let _worker = h.worker(0.0);
    let key = h.user("erin", "free").await;
    let other = h.user("frank", "free").await;
    let call = |k: String| {
        let h = &h;
        async move {
            h.post_with(
                "/v1/ops/llm.structured",
                &k,
                &[("idempotency-key", "order-42")],
                json!({"n": 1}),
            )
            .await
        }
    };
    let first = call(key.clone()).await;
    let again = call(key.clone()).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(first.body["job_id"], again.body["job_id"]);
    assert_eq!(first.body["result"], again.body["result"]);
    let u = h.usage(&key).await;
    assert_eq!(u["used"], 40, "{u}");
    assert_eq!(u["events"].as_array().unwrap().len(), 1);
    // The same key with another body is refused, charging nothing more.
    let r = h
        .post_with(
            "/v1/ops/llm.structured",
            &key,
            &[("idempotency-key", "order-42")],
            json!({"n": 2}),
        )
        .await;
    let p = r.problem(ProblemType::IdempotencyKeyReused);
    assert_eq!(p["job_id"], first.body["job_id"]);
    assert_eq!(h.usage(&key).await["used"], 40);
    // Another user's identical key is another request.
    let theirs = call(other.clone()).await;
    assert_eq!(theirs.status, StatusCode::OK, "{}", theirs.body);
    assert_ne!(theirs.body["job_id"], first.body["job_id"]);
    assert_eq!(h.usage(&other).await["used"], 40);
}

async fn provider_failure_is_502_and_refunded(h: Harness) {
    let _worker = h.worker(1.0);
    let key = h.user("grace", "free").await;
    for _ in 0..5 {
        let r = h
            .post("/v1/ops/salary.lookup", &key, json!({"role": "dev"}))
            .await;
        let p = r.problem(ProblemType::ProviderFailure);
        assert_eq!(p["cause"], "provider", "{p}");
        assert!(p["job_id"].is_string());
        assert!(p["detail"].as_str().unwrap().contains("provider"));
    }
    let u = h.wait_used(&key, 0).await;
    assert_eq!(u["events"], json!([]));
    let metrics = h.call("GET", "/metrics", None, &[], None).await;
    let text = metrics.body.as_str().unwrap().to_owned();
    assert!(
        text.contains(
            "tollgate_job_outcomes_total{operation=\"salary.lookup\",outcome=\"provider\"} 5"
        ),
        "{text}"
    );
}

/// `POST /admin/users/{user}/refunds/{request_id}`: a queued job's refund
/// cancels it (its claim is refused: it never reaches the provider), a running
/// job's is a 409 problem, a succeeded job's a credit.
async fn an_operator_refund_cancels_a_queued_job(h: Harness) {
    let key = h.user("olga", "free").await;
    let submit = || h.post("/v1/ops/company.research?async=true", &key, json!({}));
    let h = &h;
    let refund = |id: String| async move {
        let path = format!("/admin/users/olga/refunds/{id}");
        h.call("POST", &path, Some(ADMIN), &[], None).await
    };
    let take = || async {
        let wait = Duration::from_millis(200);
        let lease = take_one(&*h.source, "company.research", "w", wait).await;
        let claimed = h.source.start(&lease).await.unwrap();
        (lease, claimed)
    };
    let r = submit().await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let queued = r.body["job_id"].as_str().unwrap().to_owned();
    let r = refund(queued.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (&r.body["outcome"], &r.body["cost"], &r.body["used"]),
        (&json!("cancelled"), &json!(20), &json!(0)),
        "{}",
        r.body
    );
    let (_, claimed) = take().await;
    assert!(!claimed, "a cancelled job must never reach the provider");
    let r = h.get(&format!("/v1/jobs/{queued}"), &key, &[]).await;
    assert_eq!(r.body["status"], "failed", "{}", r.body);
    assert_eq!(r.body["error"]["cause"], "cancelled", "{}", r.body);
    h.wait_used(&key, 0).await;

    let r = submit().await;
    let running = r.body["job_id"].as_str().unwrap().to_owned();
    let (lease, claimed) = take().await;
    assert!(claimed);
    let r = refund(running.clone()).await;
    r.problem(ProblemType::ChargeOwnedByJob);
    h.wait_used(&key, 20).await;
    h.source.complete(&lease, json!({})).await.unwrap();
    let r = refund(running.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["outcome"], "refunded", "{}", r.body);
    h.wait_used(&key, 0).await;
    let r = refund(running).await;
    assert_eq!(r.body["outcome"], "not_found", "{}", r.body);
    // Guarded like every admin route.
    let r = h
        .call("POST", "/admin/users/olga/refunds/x", Some(&key), &[], None)
        .await;
    r.problem(ProblemType::Unauthorized);
}

async fn over_budget_is_429_with_exact_retry_after(h: Harness) {
    let key = h.user("heidi", "free").await;
    for i in 0..50 {
        let r = h
            .post("/v1/ops/company.research?async=true", &key, json!({"i": i}))
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{i}: {}", r.body);
    }
    let r = h
        .post("/v1/ops/company.research?async=true", &key, json!({}))
        .await;
    let p = r.problem(ProblemType::QuotaExceeded).clone();
    let retry_ms = p["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry_ms > 43_190_000 && retry_ms <= 43_200_000,
        "{retry_ms}"
    );
    let retry_after: u64 = r.header("retry-after").parse().unwrap();
    assert_eq!(retry_after, retry_ms.div_ceil(1000));
    assert_eq!(r.header("ratelimit-policy"), "\"budget\";q=1000;w=43200");
    assert_eq!(
        r.header("ratelimit"),
        format!("\"budget\";r=0;t={retry_after}")
    );
    // A cheaper call does not fit either; the denial cost nothing.
    let r = h
        .post("/v1/ops/embeddings?async=true", &key, json!({}))
        .await;
    r.problem(ProblemType::QuotaExceeded);
    assert_eq!(h.usage(&key).await["used"], 1000);

    // A cost the plan can never afford is not a 429 that never clears.
    let tiny = h.user("ivan", "tiny").await;
    let r = h.post("/v1/ops/llm.structured", &tiny, json!({})).await;
    r.problem(ProblemType::CostExceedsLimit);
}

async fn several_windows_name_every_policy_and_the_closest_to_exhaustion(h: Harness) {
    let key = h.user("mona", "metered").await;
    let r = h
        .post("/v1/ops/llm.fixed?async=true", &key, json!({}))
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let policy = "\"budget-1h\";q=50;w=3600, \"budget-1m\";q=10;w=60";
    assert_eq!(r.header("ratelimit-policy"), policy);
    assert_eq!(r.header("ratelimit"), "\"budget-1m\";r=2;t=60");
    // 8 more do not fit the minute, though the hour has 42 left.
    let r = h
        .post("/v1/ops/llm.fixed?async=true", &key, json!({"n": 2}))
        .await;
    let p = r.problem(ProblemType::QuotaExceeded).clone();
    let retry_ms = p["retry_after_ms"].as_u64().unwrap();
    assert!(retry_ms > 50_000 && retry_ms <= 60_000, "{retry_ms}");
    assert_eq!(r.header("ratelimit-policy"), policy);
    let retry_after: u64 = r.header("retry-after").parse().unwrap();
    assert_eq!(
        r.header("ratelimit"),
        format!("\"budget-1m\";r=2;t={retry_after}")
    );
    let u = h.usage(&key).await;
    assert_eq!(
        (u["used"].as_u64(), u["limit"].as_u64()),
        (Some(8), Some(10))
    );
    let windows: Vec<_> = u["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["policy"].as_str().unwrap().to_owned(),
                w["used"].as_u64().unwrap(),
                w["remaining"].as_u64().unwrap(),
                w["window_secs"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        windows,
        [
            ("budget-1h".to_owned(), 8, 42, 3600),
            ("budget-1m".to_owned(), 8, 2, 60)
        ]
    );
    // The cost of an operation is bounded by the smallest limit.
    let r = h.post("/v1/ops/company.research", &key, json!({})).await;
    r.problem(ProblemType::CostExceedsLimit);
}

async fn bad_requests_are_problems_naming_the_field(h: Harness) {
    let key = h.user("judy", "free").await;
    // 413: over the body limit (4096 in these tests).
    let big = json!({"text": "x".repeat(5000)});
    let r = h.post("/v1/ops/embeddings", &key, big).await;
    r.problem(ProblemType::PayloadTooLarge);
    // A call of `embeddings` with `headers` and this body, as it is.
    let (harness, token) = (&h, key.as_str());
    let raw = move |headers: &'static [(&'static str, &'static str)], body: Option<String>| {
        harness.call("POST", "/v1/ops/embeddings", Some(token), headers, body)
    };
    // 400: not JSON.
    let r = raw(&[], Some("{\"text\": ".into())).await;
    r.problem(ProblemType::MalformedRequest);
    // 415: no JSON content type.
    let r = raw(&[("content-type", "text/plain")], None).await;
    r.problem(ProblemType::UnsupportedMediaType);
    // 422: the input must be an object.
    let r = raw(&[], Some("[1, 2]".into())).await;
    assert_eq!(r.problem(ProblemType::InvalidField)["field"], "$");
    // 404: unknown operation, never charged; 400: not even UTF-8.
    let r = h.post("/v1/ops/no.such.op", &key, json!({})).await;
    r.problem(ProblemType::UnknownOperation);
    let r = h.post("/v1/ops/%FF", &key, json!({})).await;
    assert_eq!(
        r.problem(ProblemType::MalformedRequest)["field"],
        "operation"
    );
    let r = h
        .call(
            "PUT",
            "/admin/users/%FF/plan",
            Some(ADMIN),
            &[],
            Some("{\"plan\":\"pro\"}".into()),
        )
        .await;
    r.problem(ProblemType::MalformedRequest);
    // Deeply nested JSON is refused, not a stack overflow.
    let deep = format!("{{\"d\":{}{}}}", "[".repeat(5000), "]".repeat(5000));
    let r = raw(&[], Some(deep)).await;
    assert!(r.status == 400 || r.status == 413, "{}", r.body);
    // 400: a bad Idempotency-Key.
    let r = raw(&[("idempotency-key", "   ")], Some("{}".into())).await;
    assert_eq!(
        r.problem(ProblemType::MalformedRequest)["field"],
        "Idempotency-Key"
    );
    // 404 and 405 for routes.
    let r = h.get("/v2/nothing", &key, &[]).await;
    r.problem(ProblemType::NotFound);
    let r = h.get("/v1/ops/embeddings", &key, &[]).await;
    r.problem(ProblemType::MethodNotAllowed);
    // None of the requests above was charged: a job's charge is taken only
    // once its body has been read and checked, so nothing needed a refund.
    let u = h.usage(&key).await;
    assert_eq!(u["used"], 0, "{u}");
    let text = h.call("GET", "/metrics", None, &[], None).await.body;
    let text = text.as_str().unwrap();
    assert!(!text.contains("tollgate_reservations_total{"), "{text}");
}

async fn health_metrics_and_openapi(h: Harness) {
    let r = h.call("GET", "/healthz", None, &[], None).await;
    assert_eq!(
        (r.status, r.body["status"].as_str()),
        (StatusCode::OK, Some("ok"))
    );
    let r = h.call("GET", "/readyz", None, &[], None).await;
    assert_eq!(
        (r.status, r.body["status"].as_str()),
        (StatusCode::OK, Some("ready"))
    );

    let r = h.call("GET", "/openapi.json", None, &[], None).await;
    assert_eq!(r.status, StatusCode::OK);
    check_openapi(&r.body);
    assert_eq!(r.body, tollgate_api::openapi(&h.state));

    let _ = h.user("ken", "free").await;
    let r = h.call("GET", "/metrics", None, &[], None).await;
    assert!(r.header("content-type").starts_with("text/plain"));
    let text = r.body.as_str().unwrap();
    // A family shows once it has a series: the request above made one.
    assert!(
        text.contains("# TYPE tollgate_http_requests_total counter"),
        "{text}"
    );
    assert!(
        text.contains(
            "tollgate_http_requests_total{route=\"/admin/users\",method=\"POST\",status=\"201\"} 1"
        ),
        "{text}"
    );
}

/// Every route is documented with its responses; every problem type is listed;
/// every `$ref` resolves.
pub fn check_openapi(doc: &Value) {
    assert_eq!(doc["openapi"], "3.1.0");
    let expected = [
        ("post", "/v1/ops/{operation}"),
        ("post", "/v1/ops/embeddings"),
        ("post", "/v1/ops/salary.lookup"),
        ("post", "/v1/ops/jobs.extract"),
        ("post", "/v1/ops/llm.structured"),
        ("post", "/v1/ops/company.research"),
        ("get", "/v1/jobs/{id}"),
        ("get", "/v1/usage"),
        ("post", "/admin/users"),
        ("put", "/admin/users/{user}/plan"),
        ("put", "/admin/users/{user}/limits"),
        ("delete", "/admin/users/{user}/limits"),
        ("post", "/admin/users/{user}/credits"),
        ("get", "/admin/users/{user}/credits"),
        ("get", "/admin/users/{user}/credits/history"),
        ("get", "/admin/users"),
        ("get", "/admin/users/{user}/keys"),
        ("get", "/admin/keys"),
        ("get", "/admin/users/{user}/usage"),
        ("put", "/admin/users/{user}/org"),
        ("put", "/admin/orgs/{org}"),
        ("get", "/admin/orgs"),
        ("get", "/admin/orgs/{org}"),
        ("delete", "/admin/keys/{key_id}"),
        ("post", "/admin/users/{user}/refunds/{request_id}"),
        ("get", "/admin/overview"),
        ("get", "/admin/history"),
        ("get", "/admin/spend"),
        ("get", "/admin/jobs"),
        ("get", "/admin/jobs/{id}"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
    ];
    let paths = doc["paths"].as_object().unwrap();
    let mut count = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            count += 1;
            assert!(
                expected.contains(&(method.as_str(), path.as_str())),
                "undocumented in the test: {method} {path}"
            );
            let responses = op["responses"].as_object().unwrap();
            assert!(
                responses.keys().any(|s| s.starts_with('2')),
                "{method} {path}"
            );
            assert!(responses.contains_key("500"), "{method} {path}");
            for param in path.split('/').filter(|s| s.starts_with('{')) {
                let name = param.trim_matches(['{', '}']);
                assert!(
                    op["parameters"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|p| p["name"] == name),
                    "{method} {path}: parameter {name}"
                );
            }
        }
    }
    assert_eq!(count, expected.len());
    let metered = &doc["paths"]["/v1/ops/llm.structured"]["post"];
    // What a call reserves up front: the most, for an operation that settles.
    assert_eq!(metered["x-tollgate-cost"], 40);
    assert!(metered["responses"]["429"]["headers"]["Retry-After"].is_object());
    for status in [
        "400", "401", "404", "413", "415", "422", "429", "502", "503", "504",
    ] {
        assert!(
            doc["paths"]["/v1/ops/{operation}"]["post"]["responses"][status].is_object(),
            "{status}"
        );
    }
    let types = doc["x-problem-types"].as_array().unwrap();
    assert_eq!(types.len(), ProblemType::ALL.len());
    // Every reference points at a schema that exists.
    let text = doc.to_string();
    for piece in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
        let name = piece.split('"').next().unwrap();
        assert!(doc["components"]["schemas"][name].is_object(), "{name}");
    }
}

async fn throttle_timeout_is_504_and_a_slow_job_is_202(h: Harness) {
    let key = h.user("mallory", "free").await;
    // No worker yet: the sync wait (shortened by `Prefer: wait=1`) ends with a
    // 202 and the job's Location; the job keeps its charge.
    let r = h
        .post_with(
            "/v1/ops/jobs.extract",
            &key,
            &[("prefer", "wait=1")],
            json!({"url": "x"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    assert!(r.header("location").starts_with("/v1/jobs/"));
    assert_eq!(h.usage(&key).await["used"], 5);
    // Provider saturated: the throttle gave no slot in time.
    let worker = h.worker_failing(1.0, FailureCause::ThrottleTimeout, Duration::ZERO);
    let r = h
        .post("/v1/ops/jobs.extract", &key, json!({"url": "y"}))
        .await;
    let p = r.problem(ProblemType::ThrottleTimeout);
    assert_eq!(p["cause"], "throttle_timeout");
    // How long the call waited, from its submission to its failure.
    let waited = p["waited_ms"].as_u64().unwrap_or_else(|| panic!("{p}"));
    assert!(
        p["detail"]
            .as_str()
            .is_some_and(|d| d.ends_with(&format!("(waited {waited} ms)"))),
        "{p}"
    );
    assert_ne!(p["type"], ProblemType::QuotaExceeded.uri());
    // Both jobs failed and were refunded (the first was queued before the worker).
    h.wait_used(&key, 0).await;
    worker.stop().await;
    // A bad query flag is a 400 naming it.
    let r = h
        .post("/v1/ops/jobs.extract?async=maybe", &key, json!({}))
        .await;
    assert_eq!(r.problem(ProblemType::MalformedRequest)["field"], "async");
}

/// A job a worker holds while it waits for its provider's slot shows
/// `waiting_for_provider`, its place in its user's queue and an estimated
/// start; once it stops waiting, `running` again.
async fn a_job_waiting_for_its_provider_shows_where_it_stands(h: Harness) {
    let key = h.user("walter", "free").await;
    let r = h
        .post("/v1/ops/glacier.call?async=true", &key, json!({"n": 1}))
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let location = r.header("location").to_owned();
    // The worker role's steps, by hand: take, claim, then wait for a slot
    // of `glacier` after its one token went to someone else.
    let lease = loop {
        let taken = h
            .source
            .take(
                "glacier.call",
                Taker::new("w1", Duration::from_secs(1), Duration::from_secs(30)),
            )
            .await
            .unwrap();
        if let Some(lease) = taken {
            break lease;
        }
    };
    assert!(h.source.start(&lease).await.unwrap());
    let r = h.get(&location, &key, &[]).await;
    assert_eq!(r.body["status"], "running", "{}", r.body);
    let throttle = Arc::clone(&h.state.throttle);
    throttle
        .acquire("glacier", &"other".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    let job = lease.job.clone();
    let waiting = tokio::spawn(async move {
        let waiter = Waiter::of(&job.id, job.user.as_str(), Share::default());
        throttle
            .acquire_as("glacier", &waiter, Duration::from_secs(60))
            .await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let view = loop {
        let r = h.get(&location, &key, &[]).await;
        if r.body["status"] == "waiting_for_provider" {
            break r.body;
        }
        assert!(Instant::now() < deadline, "never waiting: {}", r.body);
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let queue = &view["provider_queue"];
    assert_eq!(queue["provider"], "glacier", "{view}");
    assert_eq!(queue["position"], 1, "{view}");
    assert_eq!(queue["others_ahead"], 0, "{view}");
    assert_eq!(queue["users_waiting"], 1, "{view}");
    // (0 grants ahead + 1) / 0.01 per s.
    assert_eq!(queue["estimated_wait_ms"], 100_000, "{view}");
    assert!(queue["estimated_start"].is_string(), "{view}");
    waiting.abort();
    let _ = waiting.await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = h.get(&location, &key, &[]).await;
        if r.body["status"] == "running" {
            assert!(r.body.get("provider_queue").is_none(), "{}", r.body);
            break;
        }
        assert!(Instant::now() < deadline, "still waiting: {}", r.body);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.source
        .complete(&lease, json!({"ok": true}))
        .await
        .unwrap();
    let r = h.get(&location, &key, &[]).await;
    assert_eq!(r.body["status"], "succeeded", "{}", r.body);
}
