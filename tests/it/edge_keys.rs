//! No client can hurt another through the api's edge or its keys, on real
//! processes over HTTP: keys that cannot exist are refused without Redis, a
//! valid key is served while its address floods bad ones, connections over the
//! cap are shed with a 503, routes that do not wait for a job answer within the
//! request timeout, another user's job answers as a missing one does, and
//! settings that cannot work stop the process at start, naming the key.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tollgate_tests::process::{api_command, command, spawn_reading, Procs};
use tollgate_tests::redis_info::command_calls;
use tollgate_tests::{http, random_prefix, RedisServer};

const ADMIN: &str = "edge-keys-admin-token-0123456789";

/// A `tollgate api` process on a free port, killed when dropped.
struct Api {
    child: Child,
    addr: SocketAddr,
}

impl Api {
    async fn start(redis: &RedisServer, prefix: &str, env: &[(&str, &str)]) -> Self {
        let (mut api, addr) = api_command(&redis.url(), prefix);
        let child = api
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .env_remove("TOLLGATE_CONFIG")
            // No dashboard history sampler: these tests count Redis commands
            // (its sample, every 10 s, reads counters with HMGET).
            .env("TOLLGATE_HISTORY_INTERVAL_MS", "0")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .spawn()
            .expect("start tollgate api");
        http::wait_ready(addr, Instant::now() + Duration::from_secs(15)).await;
        Self { child, addr }
    }

    async fn user(&self, name: &str) -> String {
        http::user_key(self.addr, ADMIN, name, "free").await
    }

    async fn usage(&self, key: &str) -> http::Response {
        let auth = format!("Bearer {key}");
        http::send(
            self.addr,
            "GET",
            "/v1/usage",
            &[("authorization", &auth)],
            b"",
        )
        .await
        .unwrap()
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Calls Redis has run of `command` (INFO commandstats).
fn calls(redis: &RedisServer, command: &str) -> u64 {
    command_calls(&redis.url())
        .get(command)
        .copied()
        .unwrap_or(0)
}

/// Commands Redis has run, INFO's own left out.
fn all_calls(redis: &RedisServer) -> u64 {
    command_calls(&redis.url())
        .iter()
        .filter(|(name, _)| *name != "info")
        .map(|(_, calls)| calls)
        .sum()
}

const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// A pseudo-random base62 string (xorshift: the test is repeatable).
fn base62(seed: &mut u64, len: usize) -> String {
    (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            BASE62[(*seed % 62) as usize] as char
        })
        .collect()
}

/// A key of the published format that was never issued: `tg_user_`, 36 base62
/// characters, and their CRC-32 (zlib's) in 6 base62 digits, computed here
/// independently of the api's code.
fn checksummed_unknown_key(seed: &mut u64) -> String {
    let body = format!("tg_user_{}", base62(seed, 36));
    let mut crc = !0u32;
    for &b in body.as_bytes() {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    let mut n = u64::from(!crc);
    let mut sum = [b'0'; 6];
    for slot in sum.iter_mut().rev() {
        *slot = BASE62[(n % 62) as usize];
        n /= 62;
    }
    body + std::str::from_utf8(&sum).unwrap()
}

/// Random and mistyped keys: none can name an issued key.
fn malformed_key(seed: &mut u64, i: usize) -> String {
    match i % 4 {
        0 => base62(seed, 40),
        1 => format!("tg_user_{}", base62(seed, 42)),
        2 => format!("sk_live_{}", base62(seed, 24)),
        _ => {
            // A real-looking key with one character mistyped.
            let mut k = checksummed_unknown_key(seed).into_bytes();
            let at = 8 + (i % 40);
            k[at] = if k[at] == b'x' { b'y' } else { b'x' };
            String::from_utf8(k).unwrap()
        }
    }
}

/// 1,000 malformed keys: each 401, none 429 (they do not count against the
/// address), and not one key lookup in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_refused_without_redis() {
    let redis = RedisServer::start();
    let api = Api::start(&redis, &random_prefix(), &[]).await;
    let valid = api.user("alice").await;
    let (lookups, total) = (calls(&redis, "hmget"), all_calls(&redis));
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let (mut statuses, mut said_malformed) = (std::collections::BTreeMap::new(), 0);
    for i in 0..1_000 {
        let r = api.usage(&malformed_key(&mut seed, i)).await;
        *statuses.entry(r.status).or_insert(0u32) += 1;
        said_malformed += u32::from(r.text().contains("malformed API key"));
    }
    let (lookups, total) = (calls(&redis, "hmget") - lookups, all_calls(&redis) - total);
    eprintln!(
        "1,000 malformed keys: {statuses:?}, {lookups} key lookups, {total} Redis commands in all"
    );
    assert_eq!(statuses.get(&401), Some(&1_000), "{statuses:?}");
    assert_eq!(
        said_malformed, 1_000,
        "answers that say the key is malformed"
    );
    assert_eq!(lookups, 0, "key lookups in Redis for malformed keys");
    // The address was not blocked: a valid key it never used is served.
    assert_eq!(api.usage(&valid).await.status, 200);
}

/// While one address floods random keys (malformed ones, and keys of the
/// right format with a valid checksum that were never issued, enough to put
/// the address over its budget), a valid key from that same address, looked
/// up for the first time during the flood, gets 200 on every call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_key_is_served_while_its_address_floods_bad_keys() {
    let redis = RedisServer::start();
    let api = Api::start(&redis, &random_prefix(), &[]).await;
    let valid = api.user("alice").await;
    let addr = api.addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut seed, mut sent, mut limited) = (7u64, 0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = if sent % 2 == 0 {
                    checksummed_unknown_key(&mut seed)
                } else {
                    malformed_key(&mut seed, sent as usize)
                };
                let auth = format!("Bearer {key}");
                let r = http::send(addr, "GET", "/v1/usage", &[("authorization", &auth)], b"")
                    .await
                    .unwrap();
                assert!(matches!(r.status, 401 | 429), "{}: {}", r.status, r.text());
                limited += u64::from(r.status == 429);
                sent += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (sent, limited)
        })
    };
    // The address is over its budget once the flood gets 429s.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seed = 99u64;
    loop {
        let r = api.usage(&checksummed_unknown_key(&mut seed)).await;
        if r.status == 429 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the flood never put the address over its budget"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut answers = Vec::new();
    for _ in 0..20 {
        answers.push(api.usage(&valid).await.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, limited) = flood.await.unwrap();
    eprintln!("flood: {sent} bad keys, {limited} x 429; valid key: {answers:?}");
    assert!(limited > 0);
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");
}

/// Another user's existing job and a missing one answer alike: the same status
/// and body (but for the id), and Redis sends the api the same bytes for each
/// (reading the record and dropping it in the api made the other user's job
/// measurably slower to answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_job_answers_as_a_missing_one() {
    let redis = RedisServer::start();
    let api = Api::start(&redis, &random_prefix(), &[]).await;
    let (alice, bob) = (api.user("alice").await, api.user("bob").await);
    let input = json!({"text": "x".repeat(4_000)}).to_string();
    let auth = format!("Bearer {alice}");
    let r = http::send(
        api.addr,
        "POST",
        "/v1/ops/embeddings",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
            ("prefer", "respond-async"),
            ("idempotency-key", "guessable-1"),
        ],
        input.as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    let job = r.json()["job_id"].as_str().unwrap().to_owned();
    // The same length, never used.
    let missing: String = job
        .chars()
        .map(|c| match c {
            '0'..='8' | 'a'..='e' => ((c as u8) + 1) as char,
            '9' => '0',
            'f' => 'a',
            other => other,
        })
        .collect();
    assert_ne!(job, missing);
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut sent_bytes = || -> u64 {
        let info: String = redis::cmd("INFO").arg("stats").query(&mut conn).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let bob_auth = format!("Bearer {bob}");
    let look = |id: &str| {
        let path = format!("/v1/jobs/{id}");
        let auth = bob_auth.clone();
        async move {
            http::send(api.addr, "GET", &path, &[("authorization", &auth)], b"")
                .await
                .unwrap()
        }
    };
    // Warm the key cache and the script cache first.
    look(&missing).await;
    look(&job).await;
    let mut deltas = (Vec::new(), Vec::new());
    let (mut theirs, mut none) = (None, None);
    for _ in 0..5 {
        let before = sent_bytes();
        let r = look(&job).await;
        let mid = sent_bytes();
        let m = look(&missing).await;
        let after = sent_bytes();
        deltas.0.push(mid - before);
        deltas.1.push(after - mid);
        theirs = Some(r);
        none = Some(m);
    }
    let (theirs, none) = (theirs.unwrap(), none.unwrap());
    assert_eq!(theirs.status, 404);
    assert_eq!(theirs.status, none.status);
    assert_eq!(
        theirs.text().replace(&job, "ID"),
        none.text().replace(&missing, "ID")
    );
    let skip = |h: &std::collections::BTreeMap<String, String>| {
        h.iter()
            // The trace id is each request's own (`traceresponse`).
            .filter(|(k, _)| !matches!(k.as_str(), "date" | "content-length" | "traceresponse"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(skip(&theirs.headers), skip(&none.headers));
    // INFO's own answer varies by a few bytes as its numbers grow; the record
    // alone is over 4,000.
    let (a, b) = (
        deltas.0.iter().min().copied().unwrap(),
        deltas.1.iter().min().copied().unwrap(),
    );
    eprintln!(
        "Redis bytes sent per lookup: another user's job {:?}, a missing one {:?}",
        deltas.0, deltas.1
    );
    assert!(
        a.abs_diff(b) < 64,
        "another user's job: {a} bytes from Redis, a missing one: {b}"
    );
}

/// A non-waiting route stalled on its store answers 503 `overloaded` at the
/// request timeout (here 300 ms, shorter than the store's own 3 s); an
/// operation call waits for its job past it, up to the sync timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_waiting_routes_answer_within_the_request_timeout() {
    let redis = RedisServer::start();
    let api = Api::start(
        &redis,
        &random_prefix(),
        &[
            ("TOLLGATE_REQUEST_TIMEOUT_MS", "300"),
            ("TOLLGATE_SYNC_TIMEOUT_MS", "1500"),
        ],
    )
    .await;
    let key = api.user("alice").await;
    assert_eq!(api.usage(&key).await.status, 200);

    // Paused (SIGSTOP): connections stay open, nothing answers.
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &redis.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    signal("-STOP");
    let started = Instant::now();
    let r = api.usage(&key).await;
    let took = started.elapsed();
    signal("-CONT");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["type"], "/problems/overloaded", "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    eprintln!("a usage read with Redis stopped: 503 overloaded after {took:?}");

    // No worker runs: the sync call waits its whole 1.5 s and answers 202.
    let auth = format!("Bearer {key}");
    let started = Instant::now();
    let r = http::send(
        api.addr,
        "POST",
        "/v1/ops/embeddings",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        br#"{"text": "hi"}"#,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(
        started.elapsed() >= Duration::from_millis(1_400),
        "{:?}",
        started.elapsed()
    );
}

/// A connection from `from` (any 127.0.0.x is the loopback).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// 800 connections that send half a request head, from one address, against
/// `tollgate all` with at most 200 connections (100 per address) and a 1 s
/// header timeout: the process's descriptors stay under 200 plus its own, the
/// connections over the caps are answered 503 with Retry-After, a user on
/// another address is served meanwhile, and the held ones are closed within the
/// header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_connections_are_shed_and_bounded() {
    let (child, lines) = spawn_reading(
        &[
            "all",
            "--listen",
            "127.0.0.1:0",
            "--max-connections",
            "200",
            "--max-connections-per-client",
            "100",
            "--header-timeout-ms",
            "1000",
        ],
        |l| l.iter().any(|l| l.contains("/v1/usage")),
    );
    let find = |needle: &str| tollgate_tests::process::banner_value(&lines, needle);
    let base = find("listening on ");
    let key = find("Bearer ");
    let pid = child.id();
    let _procs = Procs(vec![child]);
    let addr: SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle_fds = open_fds(pid);

    let opened = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..800 {
        let mut c = connect_from([127, 0, 0, 2], addr).await;
        let _ = c.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n").await;
        conns.push(c);
    }
    let peak_fds = open_fds(pid);
    // A user elsewhere is served while the 800 are held.
    let auth = format!("Bearer {key}");
    let served = http::send(addr, "GET", "/v1/usage", &[("authorization", &auth)], b"")
        .await
        .unwrap();
    assert_eq!(served.status, 200, "{}", served.text());

    let (mut shed, mut closed, mut late) = (0, 0, 0);
    let deadline = opened + Duration::from_millis(1_000) + Duration::from_secs(3);
    for c in &mut conns {
        let mut out = Vec::new();
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, c.read_to_end(&mut out)).await {
            Ok(_) => closed += 1,
            Err(_) => late += 1,
        }
        let text = String::from_utf8_lossy(&out);
        if text.starts_with("HTTP/1.1 503") {
            assert!(
                text.to_ascii_lowercase().contains("retry-after: 1"),
                "{text}"
            );
            shed += 1;
        }
    }
    let after_fds = open_fds(pid);
    eprintln!(
        "800 slow connections: fds {idle_fds} idle, {peak_fds} held, {after_fds} after; {shed} answered 503, {closed} closed, {late} still open after the header timeout + 3 s"
    );
    assert!(
        peak_fds <= idle_fds + 200,
        "{peak_fds} descriptors (idle {idle_fds}, at most 200 connections)"
    );
    assert_eq!(late, 0, "connections still open after the header timeout");
    assert!(shed > 0, "no connection over the cap was answered 503");
}

/// Settings that cannot work stop `tollgate api` at start, within seconds,
/// naming the setting; the compose file's public admin token is accepted with
/// a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_at_start() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("tollgate-settings-{}", random_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = |name: &str, from: &str, to: &str| {
        let path = dir.join(name);
        let text = tollgate_core::config::BUILTIN.replacen(from, to, 1);
        assert_ne!(text, tollgate_core::config::BUILTIN, "{from}");
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let tiny_rate = config("rate.toml", "rate = 50\n", "rate = 1e-300\n");
    let no_host = config(
        "url.toml",
        "[providers.llm]\n",
        "[providers.llm]\nurl = \"http://\"\n",
    );
    let standalone = format!("redis+cluster://127.0.0.1:{}", redis.port());
    let blank = " ".repeat(20);
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("TOLLGATE_ADMIN_TOKEN", &blank)],
            "TOLLGATE_ADMIN_TOKEN",
        ),
        (
            vec![("TOLLGATE_ADMIN_TOKEN", "short-token")],
            "TOLLGATE_ADMIN_TOKEN",
        ),
        (vec![("TOLLGATE_CONFIG", &tiny_rate)], "providers.llm.rate"),
        (vec![("TOLLGATE_CONFIG", &no_host)], "providers.llm.url"),
        (vec![("TOLLGATE_REDIS_URL", &standalone)], &standalone[16..]),
    ];
    for (env, named) in cases {
        let started = Instant::now();
        let mut child = command(&["api"])
            .env("TOLLGATE_LISTEN", "127.0.0.1:0")
            .env("TOLLGATE_REDIS_URL", redis.url())
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .env_remove("TOLLGATE_CONFIG")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if started.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        let status = status.unwrap_or_else(|| panic!("{env:?}: still running after 10 s: {err}"));
        assert_eq!(status.code(), Some(2), "{env:?}: {err}");
        assert!(err.contains(named), "{env:?}: {named:?} not named in {err}");
        eprintln!(
            "{env:?}: exit 2 after {:?}: {}",
            started.elapsed(),
            err.trim()
        );
    }

    // The compose file's default token: the api starts, and says so loudly.
    let mut child = command(&["api"])
        .env("TOLLGATE_LISTEN", "127.0.0.1:0")
        .env("TOLLGATE_REDIS_URL", redis.url())
        .env("TOLLGATE_ADMIN_TOKEN", "dev-admin-token-change-me")
        .env_remove("TOLLGATE_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut line = String::new();
        let mut r = std::io::BufReader::new(stderr);
        let _ = std::io::BufRead::read_line(&mut r, &mut line);
        line
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !reader.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    let line = reader.join().unwrap();
    assert!(still_running, "the api stopped: {line}");
    assert!(
        line.contains("WARN") && line.contains("docker-compose"),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A key issued before the checksum (`tg_` + 64 hex digits, its record written
/// as the previous release wrote it) keeps working; with `--legacy-keys false`
/// it is refused in the pod, without a lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_format_keys_keep_working_until_turned_off() {
    let redis = RedisServer::start();
    let prefix = random_prefix();
    let api = Api::start(&redis, &prefix, &[]).await;
    api.user("alice").await; // alice exists, with a plan
    let old = format!("tg_{}", "5e".repeat(32));
    let hash = tollgate_core::keystore::KeyHash::of(&old);
    let keys = tollgate_redis::keys::KeySpace::new(&prefix).unwrap();
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys.api_key(&hash))
        .arg(&[
            "user",
            "alice",
            "key_id",
            "kid_00000000000000aa",
            "created_ms",
            "1",
            "revoked",
            "0",
        ])
        .query(&mut conn)
        .unwrap();
    let r = api.usage(&old).await;
    assert_eq!(r.status, 200, "{}", r.text());

    let off = Api::start(&redis, &prefix, &[("TOLLGATE_LEGACY_KEYS", "false")]).await;
    let before = calls(&redis, "hmget");
    let r = off.usage(&old).await;
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(r.text().contains("old format"), "{}", r.text());
    assert_eq!(
        calls(&redis, "hmget"),
        before,
        "an old-format key was looked up"
    );
}
