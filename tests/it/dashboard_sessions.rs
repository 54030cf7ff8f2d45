//! Dashboard sessions and admin credentials on real processes: two `tollgate
//! api` pods on one Redis, driven over HTTP. A logged-out cookie is refused by
//! every pod; logout and login refuse cross-site requests and logout needs the
//! session's CSRF token; wrong admin tokens (Bearer or login form) are limited
//! per address while the right token always passes; the cookie is `Secure`
//! behind a trusted proxy that says https; the viewer token opens the dashboard
//! and nothing else; bad viewer tokens stop the process at start. The session
//! stores keep the same rules on memory, Redis and a Redis Cluster.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::session::{NewSession, Role, SessionId, SessionLimits, SessionStore};
use tollgate_tests::http::{self, Response};
use tollgate_tests::process::{run_until, Procs};
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

use crate::api::ADMIN;

const VIEWER: &str = "viewer-token-for-tests-0123456789";

/// A `tollgate api` pod, killed on drop.
struct Pod {
    _procs: Procs,
    addr: SocketAddr,
}

async fn pod(redis: &RedisServer, prefix: &str, env: &[(&str, &str)]) -> Pod {
    let (mut cmd, addr) = tollgate_tests::process::api_command(&redis.url(), prefix);
    cmd.env("TOLLGATE_ADMIN_TOKEN", ADMIN)
        .env("TOLLGATE_VIEWER_TOKEN", VIEWER)
        .stdout(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("start tollgate api");
    let pod = Pod {
        _procs: Procs(vec![child]),
        addr,
    };
    http::wait_ready(addr, Instant::now() + Duration::from_secs(15)).await;
    pod
}

async fn two_pods(env_b: &[(&str, &str)]) -> (RedisServer, Pod, Pod) {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let a = pod(&redis, &prefix, &[]).await;
    let b = pod(&redis, &prefix, env_b).await;
    (redis, a, b)
}

async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    tokio::time::timeout(
        Duration::from_secs(30),
        http::send(addr, method, path, headers, body.as_bytes()),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {path}: no answer"))
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

const FORM: (&str, &str) = ("Content-Type", "application/x-www-form-urlencoded");

/// `POST /dashboard/login` with `token`, as a same-origin browser form would.
async fn login(addr: SocketAddr, token: &str, extra: &[(&str, &str)]) -> Response {
    let mut headers = vec![FORM];
    if !extra
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("sec-fetch-site"))
    {
        headers.push(("Sec-Fetch-Site", "same-origin"));
    }
    headers.extend_from_slice(extra);
    send(
        addr,
        "POST",
        "/dashboard/login",
        &headers,
        &format!("token={token}"),
    )
    .await
}

/// The `name=value` of a response's session cookie.
fn session_cookie(r: &Response) -> String {
    let set = r
        .header("set-cookie")
        .unwrap_or_else(|| panic!("no Set-Cookie: {} {:?}", r.status, r.headers));
    set.split(';').next().unwrap().trim().to_owned()
}

/// `GET /admin/overview` with `headers`.
async fn get_overview(addr: SocketAddr, headers: &[(&str, &str)]) -> Response {
    send(addr, "GET", "/admin/overview", headers, "").await
}

async fn overview(addr: SocketAddr, auth: (&str, &str)) -> u16 {
    get_overview(addr, &[auth]).await.status
}

/// The session's CSRF token, as the page reads it.
async fn csrf(addr: SocketAddr, cookie: &str) -> String {
    let r = send(addr, "GET", "/dashboard/session", &[("Cookie", cookie)], "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["csrf"].as_str().unwrap().to_owned()
}

async fn logout(addr: SocketAddr, cookie: &str, csrf: &str, site: &str) -> Response {
    send(
        addr,
        "POST",
        "/dashboard/logout",
        &[FORM, ("Cookie", cookie), ("Sec-Fetch-Site", site)],
        &format!("csrf={csrf}"),
    )
    .await
}

/// A session opened on one pod works on both; logged out on one, its cookie
/// is refused by both (before: 200 for 8 hours after logout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logged_out_cookie_is_refused_on_every_pod() {
    let (_redis, a, b) = two_pods(&[]).await;
    let r = login(a.addr, ADMIN, &[]).await;
    assert_eq!(r.status, 303);
    assert_eq!(r.header("location"), Some("/dashboard"));
    let cookie = session_cookie(&r);
    assert_eq!(overview(a.addr, ("Cookie", &cookie)).await, 200);
    assert_eq!(overview(b.addr, ("Cookie", &cookie)).await, 200);

    let token = csrf(b.addr, &cookie).await;
    let out = logout(a.addr, &cookie, &token, "same-origin").await;
    assert_eq!(out.status, 303, "{}", out.text());
    assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"));
    let (mut statuses_a, mut statuses_b) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        statuses_a.push(overview(a.addr, ("Cookie", &cookie)).await);
        statuses_b.push(overview(b.addr, ("Cookie", &cookie)).await);
    }
    eprintln!("after logout: pod A {statuses_a:?}, pod B {statuses_b:?}");
    assert_eq!(statuses_a, [401; 5]);
    assert_eq!(statuses_b, [401; 5]);
    // A second logout of the same cookie changes nothing and is no error.
    let again = logout(b.addr, &cookie, &token, "same-origin").await;
    assert_eq!(again.status, 303);
}

/// Logout needs the session's CSRF token and a same-origin request; login
/// refuses cross-site forms. A refused logout leaves the session working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logout_and_login_refuse_cross_site_requests() {
    let (_redis, a, b) = two_pods(&[]).await;
    let cookie = session_cookie(&login(a.addr, ADMIN, &[]).await);
    let token = csrf(a.addr, &cookie).await;

    // No token, a wrong one, another session's, or the right one cross-site.
    let other = session_cookie(&login(b.addr, ADMIN, &[]).await);
    let other_token = csrf(b.addr, &other).await;
    assert_ne!(token, other_token);
    for (csrf, site) in [
        ("", "same-origin"),
        ("0123", "same-origin"),
        (other_token.as_str(), "same-origin"),
        (token.as_str(), "cross-site"),
        (token.as_str(), "same-site"),
    ] {
        let r = logout(b.addr, &cookie, csrf, site).await;
        assert_eq!(r.status, 403, "csrf {csrf:?} from {site}: {}", r.text());
        assert!(r.header("set-cookie").is_none());
        assert_eq!(overview(a.addr, ("Cookie", &cookie)).await, 200);
    }
    // A browser that sends no Sec-Fetch-Site but an Origin of another site.
    let r = send(
        a.addr,
        "POST",
        "/dashboard/logout",
        &[
            FORM,
            ("Cookie", &cookie),
            ("Origin", "https://evil.example"),
        ],
        &format!("csrf={token}"),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(overview(a.addr, ("Cookie", &cookie)).await, 200);

    // A cross-site login form cannot log a browser in.
    let r = login(a.addr, ADMIN, &[("Sec-Fetch-Site", "cross-site")]).await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.header("set-cookie").is_none());
    let r = send(
        a.addr,
        "POST",
        "/dashboard/login",
        &[FORM, ("Origin", "https://evil.example")],
        &format!("token={ADMIN}"),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());

    // The right request logs out.
    assert_eq!(
        logout(a.addr, &cookie, &token, "same-origin").await.status,
        303
    );
    assert_eq!(overview(b.addr, ("Cookie", &cookie)).await, 401);
    // The session route needs a session.
    let r = send(
        a.addr,
        "GET",
        "/dashboard/session",
        &[("Cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(r.status, 401);
}

/// 600 wrong admin Bearer tokens from one address: a burst of 401s, then 429
/// (before: 600 x 401); the right token from that same address still passes,
/// and another address is not limited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_admin_tokens_are_limited_and_the_right_one_always_passes() {
    let (_redis, a, b) = two_pods(&[("TOLLGATE_TRUSTED_PROXY_HEADER", "X-Forwarded-For")]).await;
    let started = Instant::now();
    let mut counts = std::collections::BTreeMap::<u16, u32>::new();
    for i in 0..600 {
        let bearer = format!("Bearer wrong-admin-token-{i:04}");
        let r = get_overview(a.addr, &[("Authorization", &bearer)]).await;
        if r.status == 429 {
            assert_eq!(
                r.json()["type"],
                "/problems/too-many-failed-authentications"
            );
            assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
        }
        *counts.entry(r.status).or_default() += 1;
        // Every 100 wrong guesses, the right token from the same address.
        if i % 100 == 99 {
            let bearer = format!("Bearer {ADMIN}");
            let ok = get_overview(a.addr, &[("Authorization", &bearer)]).await;
            assert_eq!(
                ok.status, 200,
                "the admin was locked out after {i} wrong tokens"
            );
        }
    }
    let elapsed = started.elapsed().as_secs();
    eprintln!("600 wrong admin Bearer tokens in {elapsed} s: {counts:?}");
    let unauthorized = counts.get(&401).copied().unwrap_or(0);
    assert!(
        unauthorized <= 20 + elapsed as u32 + 1,
        "{unauthorized} x 401 in {elapsed} s: {counts:?}"
    );
    assert_eq!(unauthorized + counts.get(&429).copied().unwrap_or(0), 600);

    // The admin routes that change things are guarded alike.
    let r = http::json(
        a.addr,
        "POST",
        "/admin/users",
        Some("wrong-admin-token-x"),
        Some(&json!({"user": "x"})),
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.text());
    let r = http::json(
        a.addr,
        "POST",
        "/admin/users",
        Some(ADMIN),
        Some(&json!({"user": "limited-ok"})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());

    // Behind the trusted proxy: the limit is per client address.
    let mut limited = 0;
    for i in 0..40 {
        let bearer = format!("Bearer wrong-{i}");
        let r = get_overview(
            b.addr,
            &[
                ("Authorization", &bearer),
                ("X-Forwarded-For", "203.0.113.9"),
            ],
        )
        .await;
        limited += u32::from(r.status == 429);
    }
    assert!(
        limited > 0,
        "40 wrong tokens from one address were never limited"
    );
    let r = get_overview(
        b.addr,
        &[
            ("Authorization", "Bearer wrong"),
            ("X-Forwarded-For", "198.51.100.4"),
        ],
    )
    .await;
    assert_eq!(r.status, 401, "another address was limited");
}

/// 30 wrong logins from one address are limited, and the admin logs in from
/// that same address all the same (before: `?login=limited`, no cookie).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_cannot_lock_the_admin_out() {
    let (_redis, a, _b) = two_pods(&[]).await;
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    for i in 0..30 {
        let r = login(a.addr, &format!("wrong-{i}"), &[]).await;
        assert_eq!(r.status, 303);
        assert!(r.header("set-cookie").is_none());
        *outcomes
            .entry(r.header("location").unwrap().to_owned())
            .or_default() += 1;
    }
    eprintln!("30 wrong logins: {outcomes:?}");
    assert!(
        outcomes
            .get("/dashboard?login=limited")
            .copied()
            .unwrap_or(0)
            >= 5,
        "{outcomes:?}"
    );
    let r = login(a.addr, ADMIN, &[]).await;
    assert_eq!(
        r.header("location"),
        Some("/dashboard"),
        "the admin was locked out"
    );
    let cookie = session_cookie(&r);
    assert_eq!(overview(a.addr, ("Cookie", &cookie)).await, 200);
    // A blank token never logs in.
    let r = login(a.addr, "%20%20%20", &[]).await;
    assert!(r.header("set-cookie").is_none());
}

/// The cookie is `HttpOnly; SameSite=Strict; Path=/`, and `Secure` when the
/// request came through the trusted proxy over https; a proxy header is
/// ignored where no proxy is trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cookie_is_secure_behind_a_trusted_https_proxy() {
    let (_redis, a, b) = two_pods(&[("TOLLGATE_TRUSTED_PROXY_HEADER", "X-Forwarded-For")]).await;
    let https = [
        ("X-Forwarded-For", "192.0.2.1"),
        ("X-Forwarded-Proto", "https"),
    ];
    let attributes = |r: &Response| {
        r.header("set-cookie")
            .unwrap()
            .split(';')
            .skip(1)
            .map(|a| a.trim().to_owned())
            .collect::<Vec<_>>()
    };
    let secure = attributes(&login(b.addr, ADMIN, &https).await);
    let plain = attributes(&login(b.addr, ADMIN, &[]).await);
    let untrusted = attributes(&login(a.addr, ADMIN, &https).await);
    eprintln!("behind https proxy: {secure:?}; plain: {plain:?}; untrusted header: {untrusted:?}");
    for attrs in [&secure, &plain, &untrusted] {
        for want in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=28800"] {
            assert!(attrs.iter().any(|a| a == want), "{want} missing: {attrs:?}");
        }
    }
    assert!(secure.iter().any(|a| a == "Secure"), "{secure:?}");
    assert!(!plain.iter().any(|a| a == "Secure"), "{plain:?}");
    assert!(!untrusted.iter().any(|a| a == "Secure"), "{untrusted:?}");
}

/// The viewer token opens the dashboard (Bearer, or a login) and nothing else:
/// every admin route answers it, and its session, 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_viewer_token_opens_the_dashboard_and_nothing_else() {
    let (_redis, a, b) = two_pods(&[]).await;
    let bearer = format!("Bearer {VIEWER}");
    assert_eq!(overview(a.addr, ("Authorization", &bearer)).await, 200);
    let r = login(a.addr, VIEWER, &[]).await;
    assert_eq!(r.header("location"), Some("/dashboard"));
    let cookie = session_cookie(&r);
    assert_eq!(overview(b.addr, ("Cookie", &cookie)).await, 200);
    let session = send(
        b.addr,
        "GET",
        "/dashboard/session",
        &[("Cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(session.json()["role"], "viewer", "{}", session.text());

    let created = http::json(
        a.addr,
        "POST",
        "/admin/users",
        Some(ADMIN),
        Some(&json!({"user": "vic"})),
    )
    .await;
    assert_eq!(created.status, 201);
    let key_id = created.json()["key_id"].as_str().unwrap().to_owned();
    let routes = [
        (
            "POST",
            "/admin/users".to_owned(),
            json!({"user": "eve"}).to_string(),
        ),
        (
            "PUT",
            "/admin/users/vic/plan".to_owned(),
            json!({"plan": "pro"}).to_string(),
        ),
        ("DELETE", format!("/admin/keys/{key_id}"), String::new()),
        (
            "POST",
            "/admin/users/vic/refunds/req-1".to_owned(),
            String::new(),
        ),
    ];
    for (method, path, body) in &routes {
        for auth in [
            ("Authorization", bearer.as_str()),
            ("Cookie", cookie.as_str()),
        ] {
            let r = send(
                b.addr,
                method,
                path,
                &[("Content-Type", "application/json"), auth],
                body,
            )
            .await;
            assert_eq!(
                r.status,
                403,
                "{method} {path} with {}: {}",
                auth.0,
                r.text()
            );
            assert_eq!(
                r.json()["type"],
                "/problems/read-only-credential",
                "{}",
                r.text()
            );
        }
    }
    // Nothing changed: the key still works, no user "eve".
    let r = http::json(
        a.addr,
        "PUT",
        "/admin/users/eve/plan",
        Some(ADMIN),
        Some(&json!({"plan": "pro"})),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = http::json(
        a.addr,
        "DELETE",
        &format!("/admin/keys/{key_id}"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(r.json()["revoked"], true, "{}", r.text());
}

/// A viewer token shorter than 16 characters, blank, or equal to the admin
/// token stops `api` and `all` at start, naming the setting.
#[test]
fn bad_viewer_tokens_are_refused_at_start() {
    let blank = " ".repeat(20);
    for (role, viewer) in [
        ("api", "short-viewer"),
        ("api", ADMIN),
        ("api", blank.as_str()),
        ("all", ADMIN),
        ("all", "short"),
    ] {
        let mut cmd = Command::new(workspace_bin("tollgate"));
        cmd.args([role, "--listen", "127.0.0.1:0"])
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .env("TOLLGATE_VIEWER_TOKEN", viewer)
            .env("TOLLGATE_REDIS_URL", "redis://127.0.0.1:1/")
            .env_remove("TOLLGATE_CONFIG");
        let (status, stderr) = run_until(&mut cmd, Instant::now() + Duration::from_secs(10));
        let status = status
            .unwrap_or_else(|| panic!("tollgate {role} started with viewer token {viewer:?}"));
        assert!(!status.success(), "{role} {viewer:?}: {stderr}");
        assert!(
            stderr.contains("TOLLGATE_VIEWER_TOKEN"),
            "{role} {viewer:?}: {stderr}"
        );
    }
    // A viewer token with no admin token: the dashboard would be off.
    let out = Command::new(workspace_bin("tollgate"))
        .args(["api", "--listen", "127.0.0.1:0"])
        .env_remove("TOLLGATE_ADMIN_TOKEN")
        .env("TOLLGATE_VIEWER_TOKEN", VIEWER)
        .env("TOLLGATE_REDIS_URL", "redis://127.0.0.1:1/")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("needs TOLLGATE_ADMIN_TOKEN"), "{stderr}");
}

/// One suite, every backend: a session opens once per id, lives while used
/// (its idle time restarts) but never past its lifetime, idles out unused,
/// and ends at close (a second close is no error).
async fn sessions_end(store: std::sync::Arc<dyn SessionStore>) {
    let limits = SessionLimits {
        lifetime: Duration::from_secs(3),
        idle: Duration::from_secs(1),
    };
    let new = NewSession {
        role: Role::Viewer,
        csrf: "csrf-1".into(),
        credential: "digest-1".into(),
    };
    let now_ms = tollgate_core::clock::Clock::now_ms(&tollgate_core::clock::SystemClock);
    let used = SessionId::generate().unwrap().hash();
    let opened = store.open(&used, &new, limits).await.unwrap();
    assert_eq!(
        (opened.role, opened.csrf.as_str()),
        (Role::Viewer, "csrf-1")
    );
    let lifetime = opened.expires_ms.saturating_sub(now_ms);
    assert!(
        (2_000..=4_000).contains(&lifetime),
        "expires in {lifetime} ms"
    );
    assert!(
        store.open(&used, &new, limits).await.is_err(),
        "an id opened twice"
    );

    let idle = SessionId::generate().unwrap().hash();
    store.open(&idle, &new, limits).await.unwrap();
    let closed = SessionId::generate().unwrap().hash();
    store.open(&closed, &new, limits).await.unwrap();
    store.close(&closed).await.unwrap();
    assert_eq!(store.touch(&closed, limits.idle).await.unwrap(), None);
    store.close(&closed).await.unwrap();

    // Touched every 200 ms: alive past its idle time, until its lifetime.
    let started = Instant::now();
    let mut alive_for = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(6) {
        match store.touch(&used, limits.idle).await.unwrap() {
            Some(s) => {
                assert_eq!(s, opened);
                alive_for = started.elapsed();
            }
            None => break,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        alive_for >= Duration::from_millis(1_500) && alive_for < Duration::from_millis(3_500),
        "a used session lived {alive_for:?} (lifetime 3 s, idle 1 s)"
    );
    // Untouched for longer than its idle time: gone.
    assert_eq!(store.touch(&idle, limits.idle).await.unwrap(), None);
}

#[tokio::test]
async fn sessions_end_in_memory() {
    sessions_end(std::sync::Arc::new(
        tollgate_memory::sessions::MemorySessions::new(),
    ))
    .await;
}

async fn redis_sessions(url: &str) -> std::sync::Arc<dyn SessionStore> {
    let pool = tollgate_redis::pool::connect(url, &tollgate_redis::pool::PoolOptions::default())
        .await
        .unwrap();
    let keys = tollgate_redis::keys::KeySpace::new(&random_prefix()).unwrap();
    std::sync::Arc::new(tollgate_redis::sessions::RedisSessions::new(pool, keys))
}

#[tokio::test]
async fn sessions_end_on_redis() {
    let redis = RedisServer::start();
    sessions_end(redis_sessions(&redis.url()).await).await;
}

#[tokio::test]
async fn sessions_end_on_a_cluster() {
    let cluster = tollgate_tests::TestCluster::get();
    sessions_end(redis_sessions(&cluster.url()).await).await;
}
