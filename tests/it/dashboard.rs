//! The operations dashboard: in a real browser (headless Chromium driven over
//! WebDriver by chromedriver, both Debian packages that scripts/test installs)
//! against `tollgate all`; `/admin/overview` on Redis; and the activity log it
//! reads, the same on both backends.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use tollgate_core::activity::ActivityView;
use tollgate_core::backend::Backends;
use tollgate_core::config::Config;
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::ledger::{ChargeRequest, ReserveOutcome};
use tollgate_core::metrics::CallOutcome;
use tollgate_redis::keys::KeySpace;
use tollgate_redis::pool::PoolOptions;
use tollgate_tests::process::{spawn_reading, Procs};
use tollgate_tests::redis_server::free_port;
use tollgate_tests::{random_prefix, workspace_bin, RedisServer, TestCluster};

/// A running `tollgate all` and what its banner said.
struct All {
    base: String,
    key: String,
    admin: String,
    _procs: Procs,
}

fn start_all(redis: Option<&RedisServer>) -> All {
    start_all_on(redis, &random_prefix(), &[])
}

/// `tollgate all` on `redis` (under `prefix`) or in memory, with `extra` flags.
fn start_all_on(redis: Option<&RedisServer>, prefix: &str, extra: &[&str]) -> All {
    let url = redis.map(|r| r.url());
    let mut args = vec!["all", "--listen", "127.0.0.1:0"];
    if let Some(url) = &url {
        args.extend_from_slice(&["--redis-url", url, "--key-prefix", prefix]);
    }
    args.extend_from_slice(extra);
    let (child, lines) = spawn_reading(&args, |l| l.iter().any(|l| l.contains("/v1/usage")));
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    All {
        base: find("listening on "),
        key: find("Bearer "),
        admin: find("admin token: "),
        _procs: Procs(vec![child]),
    }
}

fn http() -> reqwest::Client {
    tollgate_providers::http::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// `n` synchronous calls of `llm.structured`; returns their job ids.
async fn calls(http: &reqwest::Client, all: &All, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let r = http
            .post(format!("{}/v1/ops/llm.structured", all.base))
            .bearer_auth(&all.key)
            .json(&json!({"prompt": format!("dashboard {i}")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        let body: Value = r.json().await.unwrap();
        ids.push(body["job_id"].as_str().unwrap().to_owned());
    }
    ids
}

/// chromedriver on a free port, killed on drop. It must be installed: a test
/// that cannot run fails and says why.
struct Driver {
    _procs: Procs,
    url: String,
    /// The browsers' own profile directory: on drop, every process whose
    /// command line names it (the Chromium a failed test never closed, which
    /// outlives chromedriver) is killed, and the directory removed.
    profile: tollgate_tests::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let needle = format!("--user-data-dir={}", self.profile.0.display());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == needle.as_bytes())
            {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}

fn chromedriver() -> Driver {
    let port = free_port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start chromedriver ({e}): install Debian's chromium and chromium-driver \
                 (scripts/test does: apt-get install chromium chromium-driver)"
            )
        });
    let driver = Driver {
        _procs: Procs(vec![child]),
        url: format!("http://127.0.0.1:{port}"),
        profile: tollgate_tests::TempDir::new("chromium-profile"),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "chromedriver did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    driver
}

async fn browser(driver: &Driver) -> Client {
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| {
            panic!("no chromium binary: install Debian's chromium (scripts/test does)")
        });
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1700",
                     format!("--user-data-dir={}", driver.profile.0.display())],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .unwrap_or_else(|e| panic!("chromedriver could not start chromium: {e}"))
}

/// Hooks `console.error` and `window.onerror` of the page just loaded into
/// `window.testErrors` (the page itself also keeps `window.tollgateErrors`).
async fn hook_errors(c: &Client) {
    js(
        c,
        "window.testErrors = window.testErrors || [];
         const original = console.error;
         console.error = function (...args) { window.testErrors.push(args.join(' ')); original.apply(console, args); };
         window.addEventListener('error', (e) => window.testErrors.push(String(e.message)));",
    )
    .await;
}

/// The page's JavaScript logged no error since it was loaded.
async fn assert_no_page_errors(c: &Client) {
    let errors = js(
        c,
        "return (window.tollgateErrors || []).concat(window.testErrors || []);",
    )
    .await;
    assert_eq!(errors, json!([]), "the page's JavaScript logged errors");
}

/// How many times the page has rendered an overview.
async fn renders(c: &Client) -> u64 {
    js(c, "return Number(document.body.dataset.renders);")
        .await
        .as_u64()
        .unwrap()
}

/// Runs `script` in the page; returns what it returns.
async fn js(c: &Client, script: &str) -> Value {
    c.execute(script, vec![]).await.unwrap()
}

/// Clicks the element with id `id`.
async fn click(c: &Client, id: &str) {
    c.find(Locator::Id(id))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// Types `token` into the login form and submits it.
async fn submit_token(c: &Client, token: &str) {
    let input = c.find(Locator::Id("token")).await.unwrap();
    input.send_keys(token).await.unwrap();
    click(c, "login-submit").await;
}

/// Evaluates `expr` in the page until it is truthy (at most `secs` seconds);
/// returns its value.
async fn until(c: &Client, expr: &str, secs: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let v = js(c, &format!("return ({expr});")).await;
        let truthy =
            !matches!(&v, Value::Null | Value::Bool(false)) && v != json!(0) && v != json!("");
        if truthy {
            return v;
        }
        assert!(Instant::now() < deadline, "the page never had {expr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The target directory (where the screenshot goes): two levels above the
/// `tollgate` binary (`<target>/debug/tollgate`).
fn target_dir() -> PathBuf {
    let bin = workspace_bin("tollgate");
    bin.parent()
        .and_then(|d| d.parent())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"))
}

/// Logs in (a wrong token first), runs calls, and watches the page show them
/// without a reload; the page's JavaScript logs no error; a screenshot is
/// saved at `target/dashboard.png`. Then logs out through the page: a forged
/// logout without the CSRF token is refused, the real one ends the session,
/// and the old cookie gets 401.
#[tokio::test(flavor = "multi_thread")]
async fn dashboard_in_a_real_browser() {
    let all = start_all(None);
    let http = http();
    let driver = chromedriver();
    let c = browser(&driver).await;

    // `/` leads to the dashboard, which shows only the login form.
    c.goto(&format!("{}/", all.base)).await.unwrap();
    assert_eq!(c.current_url().await.unwrap().path(), "/dashboard");
    hook_errors(&c).await;
    until(&c, "!document.getElementById('login').hidden", 10).await;
    assert_eq!(
        js(&c, "return document.getElementById('app').hidden;").await,
        json!(true)
    );

    // A wrong token is refused, and nothing is shown.
    submit_token(&c, "not-the-admin-token").await;
    until(&c, "location.search === '?login=failed'", 10).await;
    hook_errors(&c).await;
    let message = until(
        &c,
        "!document.getElementById('login-error').hidden && document.getElementById('login-error').textContent",
        10,
    )
    .await;
    assert_eq!(message, json!("Wrong token."));
    assert_eq!(
        js(
            &c,
            "return [document.getElementById('app').hidden, document.querySelectorAll('#events tbody tr').length];",
        )
        .await,
        json!([true, 0])
    );
    // Over HTTP too: no token, a wrong one, a forged cookie.
    for (name, value) in [
        ("x-none", String::new()),
        ("authorization", "Bearer wrong".to_owned()),
        ("cookie", "tollgate_dashboard=99999999999.00".to_owned()),
    ] {
        let r = http
            .get(format!("{}/admin/overview", all.base))
            .header(name, value)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{name}");
    }

    // The admin token opens it.
    submit_token(&c, &all.admin).await;
    until(&c, "!document.getElementById('app').hidden", 10).await;
    hook_errors(&c).await;
    let cookie = c.get_named_cookie("tollgate_dashboard").await.unwrap();
    assert_eq!(cookie.http_only(), Some(true));
    assert_eq!(format!("{:?}", cookie.same_site()), "Some(Strict)");
    until(&c, "document.body.dataset.renders", 10).await;
    assert_eq!(
        js(
            &c,
            "return document.querySelectorAll('#events tbody tr[data-request-id]').length;"
        )
        .await,
        json!(0)
    );

    // Calls show up on the page that is already open: no reload.
    js(&c, "window.sameDocument = true;").await;
    let ids = calls(&http, &all, 3).await;
    let done = Instant::now();
    let renders_before = renders(&c).await;
    let shown = ids
        .iter()
        .map(|id| format!("document.querySelector('#events tr[data-request-id=\"{id}\"]')"))
        .collect::<Vec<_>>()
        .join(" && ");
    let grants = "[...document.querySelectorAll('#providers tr[data-provider]')]\
                  .reduce((n, tr) => n + Number(tr.dataset.grantsMinute), 0) >= 3";
    until(&c, &format!("({shown}) && ({grants})"), 20).await;
    let seen_after = done.elapsed();
    let renders_after = renders(&c).await;
    println!(
        "dashboard: calls visible {seen_after:?} after they finished, {} render(s) later",
        renders_after - renders_before
    );
    // Within 2 s by construction: the page polls every second and an overview
    // is at most a second old, so the second render after the calls has them.
    // Counted in renders, not wall-clock, so a loaded machine cannot flake it.
    assert!(
        renders_after - renders_before <= 2,
        "the calls appeared only {} renders later",
        renders_after - renders_before
    );
    assert_eq!(
        js(&c, "return window.sameDocument === true;").await,
        json!(true),
        "the page was reloaded"
    );
    // The rest of the panel: the development user's spend, the queues, the roles.
    let text = js(&c, "return document.getElementById('app').innerText;").await;
    let text = text.as_str().unwrap();
    for needle in ["llm.structured", "embedded"] {
        assert!(text.contains(needle), "no {needle:?} on the page:\n{text}");
    }
    until(&c, "document.querySelector('#top-users tr[data-user]')", 10).await;

    assert_no_page_errors(&c).await;

    // Paging: more calls than a page; opened again, the page lists the
    // first 25 at once (no List pressed), Show more brings the rest, and
    // hides itself once nothing more matches.
    calls(&http, &all, 24).await;
    c.refresh().await.unwrap();
    hook_errors(&c).await;
    until(
        &c,
        "Number(document.body.dataset.jobRows) === 25 && !document.getElementById('job-more').hidden",
        10,
    )
    .await;
    click(&c, "job-more").await;
    until(
        &c,
        "Number(document.body.dataset.jobRows) >= 27 && document.getElementById('job-more').hidden",
        10,
    )
    .await;
    assert_eq!(
        js(
            &c,
            "return document.querySelectorAll('#job-list tbody tr[data-id]').length;"
        )
        .await,
        json!(27),
        "the rows shown after Show more"
    );
    assert_no_page_errors(&c).await;
    let png = c.screenshot().await.unwrap();
    let path = target_dir().join("dashboard.png");
    std::fs::write(&path, &png).unwrap();
    println!("dashboard: screenshot at {}", path.display());
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");

    // Logging out ends the session in the store: the old cookie is refused
    // afterwards. A logout without the session's CSRF token (what a forged
    // cross-site form could send) is refused and ends nothing.
    let old = format!("tollgate_dashboard={}", cookie.value());
    let overview_with = |cookie: String| {
        let http = http.clone();
        let url = format!("{}/admin/overview", all.base);
        async move {
            let r = http.get(url).header("cookie", cookie).send().await.unwrap();
            r.status().as_u16()
        }
    };
    let forged = http
        .post(format!("{}/dashboard/logout", all.base))
        .header("cookie", &old)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("csrf=")
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);
    assert_eq!(overview_with(old.clone()).await, 200);
    assert_eq!(
        until(
            &c,
            "document.getElementById('csrf').value.length === 32 && document.body.dataset.role",
            10
        )
        .await,
        json!("admin")
    );
    click(&c, "logout-submit").await;
    until(&c, "!document.getElementById('login').hidden", 10).await;
    assert!(
        c.get_named_cookie("tollgate_dashboard").await.is_err(),
        "the browser kept the cookie"
    );
    assert_eq!(
        overview_with(old).await,
        401,
        "the logged-out cookie still opens the overview"
    );
    c.close().await.unwrap();
}

/// `/admin/overview` on Redis, from `tollgate all --redis-url`: the calls'
/// spend events, grants and waits, the user's used/limit, the live roles; the
/// login form's cookie opens it as the Bearer token does.
#[tokio::test(flavor = "multi_thread")]
async fn overview_on_redis() {
    let redis = RedisServer::start();
    let all = start_all(Some(&redis));
    let http = http();

    let login = |token: &str| {
        http.post(format!("{}/dashboard/login", all.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}"))
            .send()
    };
    let wrong = login("wrong").await.unwrap();
    assert_eq!(wrong.status(), 303);
    assert_eq!(wrong.headers()["location"], "/dashboard?login=failed");
    assert!(wrong.headers().get("set-cookie").is_none());
    let ok = login(&all.admin).await.unwrap();
    assert_eq!(ok.headers()["location"], "/dashboard");
    let set_cookie = ok.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=28800"] {
        assert!(set_cookie.contains(attribute), "{set_cookie}");
    }
    let cookie = set_cookie.split(';').next().unwrap().to_owned();

    let ids = calls(&http, &all, 3).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let overview = loop {
        let r = http
            .get(format!("{}/admin/overview", all.base))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let o: Value = r.json().await.unwrap();
        let events: Vec<&str> = o["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["request_id"].as_str())
            .collect();
        let grants: u64 = o["providers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["grants_last_minute"].as_u64().unwrap())
            .sum();
        let live = o["roles"]["workers"].as_u64() >= Some(1)
            && o["roles"]["throttlers"].as_u64() >= Some(1);
        if ids.iter().all(|id| events.contains(&id.as_str())) && grants >= 3 && live {
            break o;
        }
        assert!(
            Instant::now() < deadline,
            "the overview never showed the calls: {o}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(overview["roles"]["embedded"], false);
    let event = overview["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["request_id"] == ids[0].as_str())
        .unwrap();
    assert_eq!(event["operation"], "llm.structured");
    assert_eq!(event["refunded"], false);
    // The spend event shows what was charged: llm.structured reserves its
    // most, 40, and the built-in mock reports the estimate's usage, so each
    // call settled down to 8; the reservation beside it.
    assert_eq!(event["cost"].as_u64().unwrap(), 8, "{overview}");
    assert_eq!(event["reserved"].as_u64().unwrap(), 40, "{overview}");
    let top = &overview["top_users"][0];
    assert_eq!(top["used"].as_u64().unwrap(), 3 * 8, "{overview}");
    assert!(top["limit"].as_u64().unwrap() >= 3 * 40);
    let provider = overview["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["grants_last_minute"].as_u64() >= Some(3))
        .unwrap();
    assert!(provider["p95_wait_ms"].is_number(), "{provider}");
    assert!(provider["throttlers"].as_u64() >= Some(1));

    // The Bearer admin token reads the same; an api key does not.
    let by_token = http
        .get(format!("{}/admin/overview", all.base))
        .bearer_auth(&all.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(by_token.status(), 200);
    let by_key = http
        .get(format!("{}/admin/overview", all.base))
        .bearer_auth(&all.key)
        .send()
        .await
        .unwrap();
    assert_eq!(by_key.status(), 401);
}

async fn redis_backends(url: &str, config: Arc<Config>) -> Backends {
    let pool = tollgate_redis::pool::connect(url, &PoolOptions::default())
        .await
        .unwrap();
    tollgate_redis::backends(
        pool,
        KeySpace::new(&random_prefix()).unwrap(),
        config,
        "test".into(),
    )
}

/// Reads the activity log until `ready` holds (a Redis log is written every
/// 250 ms), at most 10 s.
async fn read_until(b: &Backends, ready: impl Fn(&ActivityView) -> bool) -> ActivityView {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view = b.activity.read().await.unwrap();
        if ready(&view) {
            return view;
        }
        assert!(
            Instant::now() < deadline,
            "the activity log never got there: {view:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Charges, reserves, refunds, releases and grants are noted alike by both
/// backends: the newest first, refunds marked on the right charge (a retried
/// attempt under a new nonce is another charge), grants counted with waits.
async fn activity_is_noted(b: Backends) {
    let user = UserId::new("alice").unwrap();
    let plain = RequestId::new("plain-1").unwrap();
    let job = RequestId::new("job-1").unwrap();
    b.ledger.reserve(&user, &plain, 2).await.unwrap();
    b.ledger.reserve(&user, &plain, 2).await.unwrap(); // a duplicate: not noted
    b.ledger.refund(&user, &plain).await.unwrap();
    let charge = |nonce| ChargeRequest {
        cost: 5,
        nonce,
        operation: "llm.structured",
        model: "",
        fingerprint: "f",
        deadline: Duration::from_secs(60),
        grace: Duration::from_secs(5),
        service_key: None,
        price: None,
    };
    b.ledger.charge(&user, &job, &charge("n1")).await.unwrap();
    b.ledger.release(&user, &job, "n1").await.unwrap();
    b.ledger.charge(&user, &job, &charge("n2")).await.unwrap();
    let provider = b
        .config
        .operation("llm.structured")
        .unwrap()
        .provider
        .clone();
    b.throttle
        .acquire(
            &provider,
            &RequestId::new("t-1").unwrap(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();

    // A denial (5 used of 1000), and two upstream answers.
    let denied = b
        .ledger
        .reserve(&user, &RequestId::new("too-much").unwrap(), 996)
        .await
        .unwrap();
    assert!(matches!(denied, ReserveOutcome::Denied(_)), "{denied:?}");
    for outcome in [CallOutcome::ServerError, CallOutcome::Ok] {
        b.metrics
            .provider_call(&provider, outcome, Duration::from_millis(1));
    }

    let view = read_until(&b, |v| {
        v.events.len() == 3 && !v.grants.is_empty() && !v.denied.is_empty() && !v.answers.is_empty()
    })
    .await;
    assert_eq!(view.denials[tollgate_core::activity::PLAIN], 1);
    assert_eq!(view.denied[0].user, "alice");
    assert_eq!(view.denied[0].operation, None);
    assert!(view.denied[0].at_ms <= view.now_ms);
    assert_eq!(view.answers[&provider]["5xx"], 1);
    assert_eq!(view.answers[&provider]["2xx"], 1);
    let events: Vec<_> = view
        .events
        .iter()
        .map(|e| {
            (
                e.request_id.as_str(),
                e.operation.as_deref(),
                e.cost,
                e.refunded,
            )
        })
        .collect();
    assert_eq!(
        events,
        vec![
            ("job-1", Some("llm.structured"), 5, false),
            ("job-1", Some("llm.structured"), 5, true),
            ("plain-1", None, 2, true),
        ]
    );
    assert!(view.events.iter().all(|e| e.user == "alice"));
    assert_eq!(view.grants[&provider], 1);
    assert_eq!(view.waits[&provider].len(), 1);
    assert!(view.waits[&provider][0].0 <= view.now_ms);
}

#[tokio::test]
async fn activity_is_noted_in_memory() {
    activity_is_noted(tollgate_memory::backends(Arc::new(Config::builtin()))).await;
}

#[tokio::test]
async fn activity_is_noted_on_redis() {
    let redis = RedisServer::start();
    activity_is_noted(redis_backends(&redis.url(), Arc::new(Config::builtin())).await).await;
}

/// On a Redis Cluster: the log's keys share the `{activity}` slot, so its
/// scripts run there as they do on one Redis.
#[tokio::test]
async fn activity_is_noted_on_a_cluster() {
    let cluster = TestCluster::get();
    activity_is_noted(redis_backends(&cluster.url(), Arc::new(Config::builtin())).await).await;
}

/// Logs the page in with `token` through its form and waits for the app.
async fn log_in(c: &Client, base: &str, token: &str) {
    c.goto(&format!("{base}/dashboard")).await.unwrap();
    until(c, "!document.getElementById('login').hidden", 10).await;
    submit_token(c, token).await;
    until(c, "!document.getElementById('app').hidden", 10).await;
    hook_errors(c).await;
}

/// One call of `llm.call` as `key` with `input`; returns its status.
async fn call_status(http: &reqwest::Client, base: &str, key: &str, input: Value) -> u16 {
    http.post(format!("{base}/v1/ops/llm.call"))
        .bearer_auth(key)
        .json(&input)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The operator's view of trouble, in a real browser, on `tollgate all` with
/// a recording upstream: a call the upstream fails (503 after its retries)
/// shows in the provider's answers by class and as a refunded row that says
/// why; a user at its limit shows in the operation's denials, among the users
/// most denied, and stays among the top users although it spends nothing new.
#[tokio::test(flavor = "multi_thread")]
async fn dashboard_shows_a_failing_upstream_and_a_user_at_its_limit() {
    let upstream =
        tollgate_tests::upstream::Upstream::start(std::collections::HashMap::new(), Duration::ZERO)
            .await
            .expect("start the upstream");
    let config = std::env::temp_dir().join(format!("tollgate-dash-{}.toml", random_prefix()));
    std::fs::write(
        &config,
        format!(
            "default_plan = \"free\"\n[plans.free]\nlimit = 1000\nwindow = \"1h\"\n\
             [plans.tiny]\nlimit = 2\nwindow = \"1h\"\n\
             [providers.llm]\nrate = 50\nburst = 10\nmax_wait = \"10s\"\nurl = \"{}\"\nretries = 1\n\
             [operations.\"llm.call\"]\ncost = 1\nprovider = \"llm\"\npath = \"/llm\"\n",
            upstream.url()
        ),
    )
    .unwrap();
    let config_arg = config.to_string_lossy().into_owned();
    let (child, lines) = spawn_reading(
        &["all", "--listen", "127.0.0.1:0", "--config", &config_arg],
        |l| l.iter().any(|l| l.contains("/v1/usage")),
    );
    let _procs = Procs(vec![child]);
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    let (base, dev_key, admin) = (
        find("listening on "),
        find("Bearer "),
        find("admin token: "),
    );
    let http = http();

    // A user on a plan of 2 tokens: two calls pass, the next three are denied.
    let created = http
        .post(format!("{base}/admin/users"))
        .bearer_auth(&admin)
        .json(&json!({"user": "capped", "plan": "tiny"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let capped: Value = created.json().await.unwrap();
    let capped_key = capped["api_key"].as_str().unwrap().to_owned();
    for (i, expected) in [200, 200, 429, 429, 429].into_iter().enumerate() {
        let status = call_status(&http, &base, &capped_key, json!({"n": i})).await;
        assert_eq!(status, expected, "call {i} of the capped user");
    }
    // The upstream answers two calls, and fails one (503, then 503 on its retry).
    for i in 0..2 {
        assert_eq!(
            call_status(&http, &base, &dev_key, json!({"ok": i})).await,
            200
        );
    }
    // With an Idempotency-Key, so its record (and so its reason) is kept: a
    // sync call without one has its record forgotten once answered.
    let failed = http
        .post(format!("{base}/v1/ops/llm.call"))
        .bearer_auth(&dev_key)
        .header("idempotency-key", "fails-upstream")
        .json(&json!({"upstream": {"answer": "503"}}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    assert_eq!(failed, 502, "a provider failure");
    let fails = upstream
        .arrivals()
        .iter()
        .filter(|a| a.status == 503)
        .count();
    assert!(fails >= 1, "the upstream never failed a call");

    let driver = chromedriver();
    let c = browser(&driver).await;
    log_in(&c, &base, &admin).await;

    // The provider's answers by class.
    let answers = "document.querySelector('#answers tr[data-provider=\"llm\"]')";
    until(
        &c,
        &format!("{answers} && Number({answers}.dataset.a2xx) >= 4 && Number({answers}.dataset.a5xx) >= 1"),
        20,
    )
    .await;
    // The refunded job's row says why: the provider failed.
    let reason = until(
        &c,
        "(document.querySelector('#events tr.refunded[data-reason]') || {dataset: {}}).dataset.reason",
        20,
    )
    .await;
    assert!(
        reason.as_str().unwrap().starts_with("provider: "),
        "{reason}"
    );
    // The operation's denials, the user most denied, and that user among the
    // top users (its window is full).
    let denials = "document.querySelector('#denials tr[data-operation=\"llm.call\"]')";
    until(
        &c,
        &format!("{denials} && Number({denials}.dataset.recent) === 3"),
        20,
    )
    .await;
    let most = until(
        &c,
        "(document.querySelector('#most-denied tr[data-user]') || {dataset: {}}).dataset.user",
        20,
    )
    .await;
    assert_eq!(most, json!("capped"));
    assert_eq!(
        js(
            &c,
            "return document.querySelector('#most-denied tr[data-user=\"capped\"]').dataset.denials;",
        )
        .await,
        json!("3")
    );
    until(
        &c,
        "document.querySelector('#top-users tr[data-user=\"capped\"]')",
        20,
    )
    .await;
    let text = js(&c, "return document.getElementById('app').innerText;").await;
    assert!(
        text.as_str().unwrap().contains("2 / 2"),
        "the capped user's used/limit is not shown:\n{text}"
    );
    assert_no_page_errors(&c).await;
    let png = c.screenshot().await.unwrap();
    std::fs::write(target_dir().join("dashboard-trouble.png"), &png).unwrap();
    c.close().await.unwrap();
    let _ = std::fs::remove_file(&config);
}

/// Whether the page fits its window: it does not scroll sideways.
const TABLES_FIT: &str = "document.documentElement.scrollWidth <= window.innerWidth";

/// The ids (or first header) of the shown tables wider than their panel: a
/// panel scrolls sideways rather than the page, so this is what a reader sees
/// cut off.
const WIDE_TABLES: &str = "[...document.querySelectorAll('#app table')]
    .filter((t) => { const p = t.parentElement, cs = getComputedStyle(p);
      return t.offsetParent !== null
        && t.offsetWidth > p.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) + 1; })
    .map((t) => t.id || t.rows[0].textContent)";

/// Looks job `id` up in the page's job browser and waits for its card.
async fn find_job(c: &Client, id: &str) {
    let input = c.find(Locator::Id("job-id")).await.unwrap();
    input.clear().await.unwrap();
    input.send_keys(id).await.unwrap();
    click(c, "job-find").await;
    until_job_card(c, id).await;
}

/// Waits for the page to show job `id`'s card.
async fn until_job_card(c: &Client, id: &str) {
    let expr = format!(
        "document.getElementById('job-detail').dataset.id === {}",
        json!(id)
    );
    until(c, &expr, 10).await;
}

/// The steps of the job card shown, comma-separated.
const STEPS: &str = "[...document.querySelectorAll('#job-detail-body tr[data-step]')].map((r) => r.dataset.step).join(',')";

/// The job browser and the history, in a real browser, on Redis: a job
/// found by its id shows its timeline (queued, started, waited for the
/// provider, succeeded) and its charge; a keyless sync call's job, forgotten
/// once answered, says so; the recent list shows the calls. The charts hold
/// the server-side history: the same points after a page reload, and after
/// the pod is restarted, with the restart drawn as a gap.
#[tokio::test(flavor = "multi_thread")]
async fn job_browser_and_history_survive_a_reload_and_a_restart() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let flags = ["--history-interval-ms", "500"];
    let all = start_all_on(Some(&redis), &prefix, &flags);
    let http = http();
    let keyless = calls(&http, &all, 2).await;
    let r = http
        .post(format!("{}/v1/ops/llm.structured", all.base))
        .bearer_auth(&all.key)
        .header("Idempotency-Key", "browse-me-1")
        .json(&json!({"prompt": "kept"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let kept = r.json::<Value>().await.unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let driver = chromedriver();
    let c = browser(&driver).await;
    log_in(&c, &all.base, &all.admin).await;

    // The list loads on open, without pressing List; each id links to its
    // card, and the link opens it (a reload of a shared link too).
    until(&c, "Number(document.body.dataset.jobRows || 0) >= 3", 10).await;
    let href = c
        .execute(
            &format!(
                "const a = [...document.querySelectorAll('#job-list tbody td.mono a')]
                   .find((a) => a.textContent === {});
                 return a ? a.getAttribute('href') : null;",
                json!(kept)
            ),
            vec![],
        )
        .await
        .unwrap();
    let href = href
        .as_str()
        .expect("the kept job's id is a link")
        .to_owned();
    assert!(href.starts_with("#job="), "{href}");
    // Clicked, the link opens the card.
    c.find(Locator::LinkText(&kept))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    until_job_card(&c, &kept).await;
    // Shared, it opens the card on load.
    c.goto(&format!("{}/dashboard{href}", all.base))
        .await
        .unwrap();
    c.refresh().await.unwrap();
    until_job_card(&c, &kept).await;
    until(&c, "Number(document.body.dataset.jobRows || 0) >= 3", 10).await;
    until(
        &c,
        "document.querySelector('#events tr[data-request-id]')",
        10,
    )
    .await;
    // Every table fits an 820 px window and a 1,400 px one, with rows in
    // them: the page never scrolls sideways, nor does a table inside its
    // panel.
    for width in [820u32, 1400] {
        c.set_window_size(width, 1700).await.unwrap();
        let fits = until(
            &c,
            &format!(
                "window.innerWidth <= {width} && window.innerWidth > {width} - 40 && {TABLES_FIT}"
            ),
            5,
        )
        .await;
        assert_eq!(fits, json!(true), "{width} px");
        let wide = js(&c, &format!("return {WIDE_TABLES};")).await;
        assert_eq!(wide, json!([]), "{width} px: tables wider than their panel");
    }

    // By id: the record's job with its whole timeline and its charge.
    find_job(&c, &kept).await;
    let steps = until(&c, &format!("{STEPS}.includes('succeeded') && {STEPS}"), 10).await;
    let steps = steps.as_str().unwrap().to_owned();
    for step in ["queued", "started", "granted", "succeeded"] {
        assert!(steps.split(',').any(|s| s == step), "{step} in {steps}");
    }
    let card = js(
        &c,
        "const card = document.querySelector('#job-detail-body .job-card');
         return [card.dataset.state, card.querySelector('.charge').textContent];",
    )
    .await;
    assert_eq!(card[0], "succeeded", "{card}");
    assert!(
        card[1]
            .as_str()
            .unwrap()
            .contains("charged: the job succeeded"),
        "{card}"
    );
    // A keyless sync call's record is gone: the card says why, and the
    // timeline the activity log kept is still there.
    find_job(&c, &keyless[0]).await;
    let gone = until(
        &c,
        "document.querySelector('#job-detail-body .note') && document.querySelector('#job-detail-body .note').textContent",
        10,
    )
    .await;
    assert!(
        gone.as_str().unwrap().contains("forgotten once answered"),
        "{gone}"
    );
    let steps = until(&c, STEPS, 5).await;
    assert!(steps.as_str().unwrap().contains("succeeded"), "{steps}");
    // The recent list holds the three calls.
    click(&c, "job-list-submit").await;
    until(&c, "Number(document.body.dataset.jobRows) >= 3", 10).await;
    let listed = js(
        &c,
        "return [...document.querySelectorAll('#job-list tbody tr[data-id]')].map((r) => r.dataset.id);",
    )
    .await;
    for id in keyless.iter().chain([&kept]) {
        assert!(
            listed.as_array().unwrap().contains(&json!(id)),
            "{id} in {listed}"
        );
    }

    // The history: a few samples, the same after a reload.
    until(&c, "Number(document.body.dataset.historyPoints) >= 4", 20).await;
    let oldest = until(&c, "document.body.dataset.historyOldest", 1).await;
    c.refresh().await.unwrap();
    until(
        &c,
        "!document.getElementById('app').hidden && Number(document.body.dataset.historyPoints) >= 4",
        20,
    )
    .await;
    let after_reload = until(&c, "document.body.dataset.historyOldest", 1).await;
    assert_eq!(after_reload, oldest, "a reload shows the same history");
    // The charts' time axis is scaled to the samples there are (from the
    // oldest, at least a minute), not to the whole hour, and has ticks.
    let axis = until(
        &c,
        "(() => { const c = document.querySelector('[data-chart=\"all\"]'); \
         return c && Number(c.dataset.ticks) >= 2 && [Number(c.dataset.fromMs), Number(c.dataset.ticks)]; })()",
        5,
    )
    .await;
    let from = axis[0].as_u64().unwrap();
    // The tick labels under the axis, read as text: times of day, a few
    // seconds apart (the axis spans about a minute, not the hour), within it.
    let ticks = js(
        &c,
        "const c = document.querySelector('[data-chart=\"all\"]');
         return [...c.querySelectorAll('.axis span')].map((s) => [s.textContent, Number(s.dataset.atMs),
           String(new Date(Number(s.dataset.atMs)).getMinutes()).padStart(2, '0')]);",
    )
    .await;
    let ticks = ticks.as_array().unwrap();
    assert!(ticks.len() >= 2, "{ticks:?}");
    let mut last = 0;
    for t in ticks {
        let (label, at, minutes) = (
            t[0].as_str().unwrap(),
            t[1].as_u64().unwrap(),
            t[2].as_str().unwrap(),
        );
        assert!(
            label.contains(&format!(":{minutes}")),
            "tick {label} at {at}"
        );
        assert!(at >= from, "tick {label} before the axis starts ({from})");
        if last > 0 {
            assert!(
                at - last <= 30_000,
                "ticks {}s apart: {ticks:?}",
                (at - last) / 1000
            );
        }
        last = at;
    }
    let oldest_ms: u64 = oldest.as_str().unwrap().parse().unwrap();
    assert!(
        from <= oldest_ms && oldest_ms - from <= 61_000,
        "the axis starts at the oldest sample or a minute back: {axis} (oldest {oldest_ms})"
    );
    // The labels say what they count: per interval of the sampler (0.5 s
    // here), the denials budget denials; the lists their window.
    let labels = js(
        &c,
        "return [document.querySelector('[data-chart=\"all\"] h3').textContent,
                 document.querySelector('[data-chart=\"queues\"] h3').textContent,
                 document.getElementById('most-denied').previousElementSibling.textContent,
                 document.getElementById('answers').previousElementSibling.textContent,
                 document.getElementById('top-users').previousElementSibling.textContent];",
    )
    .await;
    let labels: Vec<&str> = labels
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert_eq!(
        labels[0],
        "calls and budget denials (429), per 0.5 s interval"
    );
    assert!(
        labels[1].contains("queued") && labels[1].contains("workers alive"),
        "{}",
        labels[1]
    );
    assert!(
        labels[2].contains("at most 1,000") && labels[2].contains("last hour"),
        "{}",
        labels[2]
    );
    assert!(labels[3].contains("last 5 min"), "{}", labels[3]);
    assert!(labels[4].contains("in their window"), "{}", labels[4]);
    let newest: u64 = until(&c, "document.body.dataset.historyNewest", 1)
        .await
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_no_page_errors(&c).await;

    // A restart of the pod (nothing samples meanwhile): the history before it
    // is still there, and the spell is a gap.
    drop(all);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = start_all_on(Some(&redis), &prefix, &flags);
    log_in(&c, &all.base, &all.admin).await;
    let probe = format!(
        "Number(document.body.dataset.historyNewest) > {newest} + 1000 && document.body.dataset.historyOldest"
    );
    let oldest_now = until(&c, &probe, 20).await;
    assert_eq!(oldest_now, oldest, "the history survived the restart");
    let gaps = until(
        &c,
        "Number(document.querySelector('[data-chart=\"all\"]').dataset.gaps)",
        5,
    )
    .await;
    assert!(gaps.as_u64().unwrap() >= 1, "the restart is a gap: {gaps}");
    assert_no_page_errors(&c).await;
    c.close().await.unwrap();
}

/// One flush of a pod's activity notes writes each key once (a counter once
/// per field), however many notes it holds, and keeps every cap: the newest
/// events, waits, denials and failures; a job's steps up to its cap; the
/// newest jobs' timelines, an evicted job's steps deleted with it.
#[tokio::test]
async fn activity_flush_writes_each_key_once() {
    let server = RedisServer::start();
    let keys = KeySpace::new(&random_prefix()).unwrap().activity();
    let providers = vec!["p1".to_owned(), "p2".to_owned()];
    let caps = tollgate_redis::scripts::ActivityCaps {
        events: 5,
        waits: 3,
        denied: 2,
        idle_ms: 60_000,
        timelines: 3,
        steps: 2,
        failed: 2,
    };
    let conn = ::redis::Client::open(server.url().as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let flush = |notes: Vec<String>| {
        let inv = tollgate_redis::scripts::activity_record(&keys, &providers, caps, &notes);
        let mut conn = conn.clone();
        async move { inv.invoke_async::<u64>(&mut conn).await.unwrap() }
    };
    let mut notes = Vec::new();
    for i in 1..=8 {
        let op = if i % 2 == 0 { "a" } else { "b" };
        notes.push(format!(
            "e {}",
            json!({"operation": op, "user": "u", "i": i})
        ));
    }
    for i in 1..=6 {
        notes.push(format!("g 1 p1 {i} {}", i * 10));
    }
    notes.extend((0..4).map(|_| "a p1 2xx".to_owned()));
    notes.extend((1..=3).map(|i| format!("d u{i} a")));
    for j in 1..=5 {
        for s in 1..=3 {
            notes.push(format!("j j{j} {s} u charged a {s}"));
        }
    }
    notes.push("j j5 9 u failed a upstream boom".to_owned());
    notes.push("r spend-1".to_owned());
    notes.push("r spend-2".to_owned());
    let before = tollgate_tests::redis_info::command_calls(&server.url());
    let n = notes.len() as u64;
    assert_eq!(flush(notes).await, n, "every note is written");
    let after = tollgate_tests::redis_info::command_calls(&server.url());
    let ran = |c: &str| after.get(c).copied().unwrap_or(0) - before.get(c).copied().unwrap_or(0);
    // events, p1's waits, denied, timeline order, failed: one LPUSH each.
    assert_eq!(ran("lpush"), 5, "one LPUSH per list");
    // calls a and b, grants p1, answers "p1 2xx", denials a.
    assert_eq!(ran("hincrby"), 5, "one HINCRBY per counter");
    assert_eq!(ran("hset"), 1, "the timelines in one write");
    assert_eq!(ran("zadd"), 1, "the refunds in one write");

    let list = |key: String| {
        let mut conn = conn.clone();
        async move {
            ::redis::cmd("LRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .query_async::<Vec<String>>(&mut conn)
                .await
                .unwrap()
        }
    };
    let hash = |key: String| {
        let mut conn = conn.clone();
        async move {
            ::redis::cmd("HGETALL")
                .arg(key)
                .query_async::<std::collections::BTreeMap<String, String>>(&mut conn)
                .await
                .unwrap()
        }
    };
    let events: Vec<i64> = list(keys.events.clone())
        .await
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["i"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(events, [8, 7, 6, 5, 4], "the newest events, newest first");
    let calls = hash(keys.calls.clone()).await;
    assert_eq!((calls["a"].as_str(), calls["b"].as_str()), ("4", "4"));
    assert_eq!(hash(keys.grants.clone()).await["p1"], "6");
    assert_eq!(list(keys.waits("p1")).await, ["6 60", "5 50", "4 40"]);
    assert_eq!(hash(keys.answers.clone()).await["p1 2xx"], "4");
    assert_eq!(hash(keys.denials.clone()).await["a"], "3");
    assert_eq!(list(keys.denied.clone()).await.len(), 2);
    assert_eq!(list(keys.failed.clone()).await.len(), 1);
    assert_eq!(list(keys.timeline_order.clone()).await, ["j5", "j4", "j3"]);
    let timelines = hash(keys.timelines.clone()).await;
    assert_eq!(
        timelines.keys().collect::<Vec<_>>(),
        ["j3", "j4", "j5"],
        "the oldest jobs' steps go with them"
    );
    assert_eq!(
        timelines["j4"], "1 u charged a 1\n2 u charged a 2",
        "steps capped"
    );

    // A later flush: a known job's steps stay capped, a new job evicts the
    // oldest, the counters add up.
    let later = vec![
        "j j3 10 u charged a 10".to_owned(),
        "j j6 11 u charged a 11".to_owned(),
        format!("e {}", json!({"operation": "a", "i": 9})),
    ];
    assert_eq!(flush(later).await, 3);
    assert_eq!(list(keys.timeline_order.clone()).await, ["j6", "j5", "j4"]);
    let timelines = hash(keys.timelines.clone()).await;
    assert_eq!(timelines.keys().collect::<Vec<_>>(), ["j4", "j5", "j6"]);
    assert_eq!(hash(keys.calls.clone()).await["a"], "5");
}

/// An amount the api writes in money (`"0.0021"`) in micro-units.
fn micro(amount: &str) -> u64 {
    let (whole, frac) = amount.split_once('.').unwrap_or((amount, ""));
    assert!(frac.len() <= 6, "{amount}");
    whole.parse::<u64>().unwrap() * 1_000_000 + format!("{frac:0<6}").parse::<u64>().unwrap()
}

/// Today's rows (`[key, amount]`, nothing spent left out, the largest first)
/// of the spend report by `by`, read over HTTP as a script would.
async fn spend_today(
    http: &reqwest::Client,
    base: &str,
    admin: &str,
    by: &str,
) -> Vec<(String, String)> {
    let page: Value = http
        .get(format!("{base}/admin/spend?by={by}&step=1d"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["currency"], "USD", "{page}");
    assert!(page.get("next_cursor").is_none(), "{page}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let today = now_ms - now_ms % 86_400_000;
    let mut rows: Vec<(String, String)> = page["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["start_ms"].as_u64().unwrap() >= today)
        .map(|r| {
            let amount = r["amount"]
                .as_str()
                .expect("money amounts are decimal strings");
            (r["key"].as_str().unwrap().to_owned(), amount.to_owned())
        })
        .filter(|(_, a)| micro(a) > 0)
        .collect();
    rows.sort_by(|a, b| micro(&b.1).cmp(&micro(&a.1)).then(a.0.cmp(&b.0)));
    rows
}

/// The rows a spend table of the page shows: `[key, amount cell]`.
async fn spend_table(c: &Client, table: &str, attr: &str) -> Vec<(String, String)> {
    let rows = js(
        c,
        &format!(
            "return [...document.querySelectorAll('#{table} tbody tr[data-{attr}]')]
               .map((tr) => [tr.dataset.{attr}, tr.cells[1].textContent]);"
        ),
    )
    .await;
    serde_json::from_value(rows).unwrap()
}

/// In money mode (USD, a price sheet of two models), after a few priced
/// calls through the pass-through: the dashboard's spend by model and top
/// spenders show what the spend report says, each amount the exact decimal
/// string the server wrote, in USD, the largest first; the models' total is
/// the report's; users and models add up to the same micro-dollars.
async fn spend_in_money(redis: Option<&RedisServer>) {
    let (mock_child, mock_url) =
        tollgate_tests::process::spawn_mock(&["--rate", "1000", "--burst", "100"]);
    let dir = tollgate_tests::TempDir::new("dash-money");
    // Prices per million tokens: micro-dollars per token.
    std::fs::write(
        dir.0.join("prices.toml"),
        "currency = \"USD\"\n\
         [models.\"m*\"]\ninput = \"100\"\noutput = \"300\"\nmax_output = 4096\n\
         [models.\"c*\"]\ninput = \"7\"\noutput = \"21\"\nmax_output = 4096\n",
    )
    .unwrap();
    let config = dir.0.join("tollgate.toml");
    std::fs::write(
        &config,
        format!(
            "currency = \"USD\"\ndefault_plan = \"free\"\n\
             [plans.free]\nlimit = \"5\"\nwindow = \"12h\"\n\
             [providers.openai]\nrate = 100\nburst = 20\nmax_wait = \"10s\"\nurl = \"{mock_url}/v1\"\n\
             retries = 0\nprices = \"prices.toml\"\n\
             [operations.\"openai.chat\"]\nprovider = \"openai\"\npath = \"/chat/completions\"\n"
        ),
    )
    .unwrap();
    let url = redis.map(|r| r.url());
    let (child, lines) =
        tollgate_tests::process::spawn_all(&config, url.as_deref(), &random_prefix());
    let _procs = Procs(vec![child, mock_child]);
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    let (base, admin) = (find("listening on "), find("admin token: "));
    let http = http();

    // ann: three calls of an m model; bob: one of a c model; cid: two.
    let mut keys = std::collections::HashMap::new();
    for user in ["ann", "bob", "cid"] {
        let r = http
            .post(format!("{base}/admin/users"))
            .bearer_auth(&admin)
            .json(&json!({"user": user, "plan": "free"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let body: Value = r.json().await.unwrap();
        keys.insert(user, body["api_key"].as_str().unwrap().to_owned());
    }
    for (user, model, n) in [
        ("ann", "m-large", 3),
        ("bob", "c-small", 1),
        ("cid", "c-small", 2),
    ] {
        for i in 0..n {
            let r = http
                .post(format!("{base}/v1/passthrough/openai/chat/completions"))
                .bearer_auth(&keys[user])
                .json(&json!({"model": model, "max_tokens": 40,
                    "messages": [{"role": "user", "content": format!("spend {i} of {user}: one two three four")}]}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{user}: {:?}", r.text().await);
        }
    }
    let models = spend_today(&http, &base, &admin, "model").await;
    let users = spend_today(&http, &base, &admin, "user").await;
    assert_eq!(models.len(), 2, "{models:?}");
    assert_eq!(
        users.iter().map(|(u, _)| u.as_str()).collect::<Vec<_>>(),
        ["ann", "cid", "bob"],
        "{users:?}"
    );
    let sum = |rows: &[(String, String)]| rows.iter().map(|(_, a)| micro(a)).sum::<u64>();
    assert_eq!(sum(&models), sum(&users), "{models:?} {users:?}");
    assert!(
        models.iter().any(|(_, a)| a.contains('.')),
        "amounts of less than a dollar: {models:?}"
    );

    let driver = chromedriver();
    let c = browser(&driver).await;
    log_in(&c, &base, &admin).await;
    hook_errors(&c).await;
    until(&c, "Number(document.body.dataset.spendRead || 0) >= 1", 20).await;
    let usd = |rows: &[(String, String)]| {
        rows.iter()
            .map(|(k, a)| (k.clone(), format!("{a} USD")))
            .collect::<Vec<_>>()
    };
    assert_eq!(spend_table(&c, "spend-models", "model").await, usd(&models));
    assert_eq!(spend_table(&c, "spend-users", "user").await, usd(&users));
    let total = js(
        &c,
        "return document.querySelector('#spend-models tr.total').cells[1].textContent;",
    )
    .await;
    let total = total.as_str().unwrap();
    assert_eq!(
        micro(total.strip_suffix(" USD").unwrap()),
        sum(&models),
        "{total}"
    );
    // The job list and the newest events say what each call was charged (its
    // settle, from the usage), the reservation beside it: ann's rows add up
    // to what the spend report says she spent.
    let ann = micro(&users.iter().find(|(u, _)| u == "ann").unwrap().1);
    for (table, cell) in [("job-list", 4), ("events", 3)] {
        until(
            &c,
            &format!("document.querySelectorAll('#{table} tbody tr').length >= 6"),
            20,
        )
        .await;
        let rows = js(
            &c,
            &format!(
                "return [...document.querySelectorAll('#{table} tbody tr')]
                   .filter((r) => r.cells[{user}].textContent === 'ann')
                   .map((r) => [r.cells[{cell}].firstChild.textContent, r.cells[{cell}].title]);",
                user = if table == "events" { 1 } else { 2 },
            ),
        )
        .await;
        let rows: Vec<(String, String)> = serde_json::from_value(rows).unwrap();
        assert_eq!(rows.len(), 3, "{table}: {rows:?}");
        let charged: u64 = rows
            .iter()
            .map(|(a, _)| micro(a.strip_suffix(" USD").unwrap()))
            .sum();
        assert_eq!(charged, ann, "{table}: {rows:?}");
        for (a, reserved) in &rows {
            let r = reserved
                .strip_prefix("reserved ")
                .unwrap_or_else(|| panic!("{table}: {a} shows no reservation beside it: {rows:?}"));
            assert!(
                micro(r.strip_suffix(" USD").unwrap()) > micro(a.strip_suffix(" USD").unwrap()),
                "{table}: the worst case reserved is above the charge: {rows:?}"
            );
        }
    }
    let heads = js(
        &c,
        "return [...document.querySelectorAll('#spend h3, #spend th')].map((h) => h.textContent);",
    )
    .await;
    let heads = heads.to_string();
    for needle in [
        "Spend today by model",
        "Top spenders today",
        "spent today (USD)",
    ] {
        assert!(heads.contains(needle), "{needle} in {heads}");
    }
    // With money amounts in them, every table still fits at both widths.
    for width in [820u32, 1400] {
        c.set_window_size(width, 1700).await.unwrap();
        until(
            &c,
            &format!("window.innerWidth <= {width} && {TABLES_FIT}"),
            5,
        )
        .await;
        let wide = js(&c, &format!("return {WIDE_TABLES};")).await;
        assert_eq!(wide, json!([]), "{width} px: tables wider than their panel");
    }
    assert_no_page_errors(&c).await;
    js(&c, "document.getElementById('spend').scrollIntoView();").await;
    let png = c.screenshot().await.unwrap();
    let name = if redis.is_some() {
        "dashboard-money-redis.png"
    } else {
        "dashboard-money.png"
    };
    std::fs::write(target_dir().join(name), &png).unwrap();
    c.close().await.unwrap();
}

/// [`spend_in_money`] on the embedded backend.
#[tokio::test(flavor = "multi_thread")]
async fn dashboard_shows_spend_by_model_and_top_spenders_in_money() {
    spend_in_money(None).await;
}

/// [`spend_in_money`] on Redis (the rollups in Redis hashes).
#[tokio::test(flavor = "multi_thread")]
async fn dashboard_shows_spend_by_model_and_top_spenders_in_money_on_redis() {
    let redis = RedisServer::start();
    spend_in_money(Some(&redis)).await;
}

/// A pool's members as sub-rows of the providers table, in a real browser
/// against `tollgate all`: each named, with its own bucket; its secret is
/// nowhere on the page (issue 50 item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_pool_members_as_sub_rows() {
    let dir = std::env::temp_dir().join(format!("tollgate-pool-seen-{}", random_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tollgate.toml");
    let text = format!(
        "{}\n[providers.seen]\nmax_wait = \"10s\"\nmembers = [\n  \
         {{ name = \"east\", url = \"http://127.0.0.1:9\", limits = [{{ rate = 10, per = \"1s\", burst = 2 }}], secret_headers = {{ \"api-key\" = \"TOLLGATE_TEST_SEEN_KEY\" }} }},\n  \
         {{ name = \"west\", url = \"http://127.0.0.1:9\", limits = [{{ rate = 20, per = \"1s\", burst = 4 }}] }},\n  \
         {{ name = \"north\", url = \"http://127.0.0.1:9\", limits = [{{ rate = 5, per = \"1s\", burst = 1 }}] }},\n]\n",
        tollgate_core::config::BUILTIN
    );
    std::fs::write(&path, text).unwrap();
    let secret = "sk-seen-0123456789-never-shown";
    let (child, lines) = tollgate_tests::process::spawn_reading_with(
        &[
            "all",
            "--listen",
            "127.0.0.1:0",
            "--config",
            path.to_str().unwrap(),
        ],
        &[("TOLLGATE_TEST_SEEN_KEY", secret)],
        |l| l.iter().any(|l| l.contains("/v1/usage")),
    );
    let _procs = Procs(vec![child]);
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    let (base, admin) = (find("listening on "), find("admin token: "));
    let driver = chromedriver();
    let c = browser(&driver).await;
    c.goto(&format!("{base}/dashboard")).await.unwrap();
    hook_errors(&c).await;
    until(&c, "!document.getElementById('login').hidden", 10).await;
    submit_token(&c, &admin).await;
    let members = "[...document.querySelectorAll('#providers tr[data-pool=\"seen\"]')]";
    until(&c, &format!("{members}.length === 3"), 20).await;
    let shown = js(
        &c,
        &format!(
            "return {members}.map((tr) => [tr.dataset.member, tr.cells[0].textContent, \
             tr.cells[2].textContent, tr.dataset.paused]);"
        ),
    )
    .await;
    assert_eq!(
        shown,
        json!([
            ["east", "↳ east", "2", "false"],
            ["west", "↳ west", "4", "false"],
            ["north", "↳ north", "1", "false"],
        ])
    );
    // The sub-rows follow their pool's row; its burst is theirs summed.
    let order = js(
        &c,
        "const rows = [...document.querySelectorAll('#providers tbody tr')];\
         const i = rows.findIndex((tr) => tr.dataset.provider === 'seen');\
         return [rows[i].cells[2].textContent, rows.slice(i + 1, i + 4).map((tr) => tr.dataset.member)];",
    )
    .await;
    assert_eq!(order, json!(["7", ["east", "west", "north"]]));
    let page = js(&c, "return document.body.innerHTML;").await;
    assert!(
        !page.as_str().unwrap().contains(secret),
        "the member's secret is on the page"
    );
    assert_no_page_errors(&c).await;
    let _ = c.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
