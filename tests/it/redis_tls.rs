//! Redis over TLS (`rediss://`) with an ACL user: the certificates come from
//! `--redis-ca-cert` (and `--redis-client-cert`/`--redis-client-key` for a
//! Redis that authenticates clients), every role connects through them, and a
//! wrong CA, a wrong password or a missing client certificate is a clear error
//! rather than a hang or a silent plain-text fallback.
//!
//! The certificates are made for each test with the `openssl` command line
//! (Debian's `openssl` package; `scripts/test` installs it where missing).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tollgate_tests::http::FetchJson;
use tollgate_tests::process::{spawn_reading, Procs};
use tollgate_tests::{random_prefix, RedisCluster, RedisServer};

/// A CA, a server certificate for 127.0.0.1 and localhost signed by it, a
/// client certificate signed by it, and a second CA that signed nothing here.
struct Certs {
    dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run openssl ({e}): the TLS tests make their certificates with it; install it with `sudo apt-get install -y openssl` (scripts/test does)")
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Certs {
    fn make() -> Self {
        let dir = std::env::temp_dir().join(format!("tollgate-tls-{}", random_prefix()));
        std::fs::create_dir_all(&dir).unwrap();
        for ca in ["ca", "rogue"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "2",
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.crt"),
                    "-subj",
                    &format!("/CN=tollgate test {ca}"),
                ],
            );
        }
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
        )
        .unwrap();
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for who in ["server", "client"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &format!("{who}.key"),
                    "-out",
                    &format!("{who}.csr"),
                    "-subj",
                    &format!("/CN=tollgate {who}"),
                ],
            );
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{who}.csr"),
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &format!("{who}.crt"),
                    "-extfile",
                    &format!("{who}.ext"),
                ],
            );
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const USER: &str = "tollgate";
const PASSWORD: &str = "tls-test-secret";

/// A node's TLS arguments: `tls_port` serving clients with the server
/// certificate (clients authenticated by certificate when `auth_clients`), and
/// the ACL user the tests connect as.
fn tls_server_args(certs: &Certs, tls_port: u16, auth_clients: bool) -> Vec<String> {
    strings(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &certs.path("server.crt"),
        "--tls-key-file",
        &certs.path("server.key"),
        "--tls-ca-cert-file",
        &certs.path("ca.crt"),
        "--tls-auth-clients",
        if auth_clients { "yes" } else { "no" },
        "--user",
        USER,
        "on",
        &format!(">{PASSWORD}"),
        "~*",
        "&*",
        "+@all",
    ])
}

/// A Redis with a TLS port and an ACL user; its plain port stays for the harness.
fn tls_redis(certs: &Certs, auth_clients: bool) -> (RedisServer, u16) {
    let tls_port = tollgate_tests::redis_server::free_port();
    let args = tls_server_args(certs, tls_port, auth_clients);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (RedisServer::start_with(&args), tls_port)
}

/// `tollgate budget usage --user u` on `url`, trusting the CA in `ca`.
fn usage_of_u(url: &str, ca: &str) -> Vec<String> {
    strings(&[
        "budget",
        "usage",
        "--user",
        "u",
        "--redis-url",
        url,
        "--redis-ca-cert",
        ca,
    ])
}

/// `tollgate <args>` run to its end: exit code and stderr.
fn run(args: &[String]) -> (Option<i32>, String) {
    let mut child = tollgate_tests::process::command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a TLS failure must not hang the command.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    if tollgate_tests::process::exit_by(&mut child, deadline).is_none() {
        panic!("tollgate {args:?} did not end within 15 s");
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}

/// Runs `tollgate all` (api, worker and throttler roles on one TLS pool:
/// shared connections, blocking takes and pub/sub alike) and a second worker
/// and throttler as processes of their own, all on `url`; one user makes one
/// sync call, and `budget usage` reads it back. Returns the key prefix used.
fn one_call_over(url: &str, ca: &str) -> String {
    let prefix = random_prefix();
    let common = [
        "--redis-url",
        url,
        "--redis-ca-cert",
        ca,
        "--key-prefix",
        prefix.as_str(),
    ];
    let mut args = vec![
        "all",
        "--listen",
        "127.0.0.1:0",
        "--admin-token",
        "tls-admin-token-0123456789",
    ];
    args.extend(common);
    let (all, lines) = spawn_reading(&args, |l| l.iter().any(|l| l.contains("listening on")));
    let base = lines
        .iter()
        .find_map(|l| l.trim().strip_prefix("listening on "))
        .unwrap()
        .to_owned();
    let mut procs = Procs(vec![all]);
    for role in ["throttler", "worker"] {
        let mut args = vec![role];
        args.extend(common);
        procs.0.push(tollgate_tests::process::spawn(&args));
    }

    tollgate_providers::http::install_crypto_provider();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let http = reqwest::Client::new();
        let created: serde_json::Value = http
            .post(format!("{base}/admin/users"))
            .bearer_auth("tls-admin-token-0123456789")
            .json(&serde_json::json!({ "user": "tls-user" }))
            .fetch_json()
            .await;
        let key = created["api_key"].as_str().unwrap().to_owned();
        let resp = http
            .post(format!("{base}/v1/ops/embeddings"))
            .bearer_auth(&key)
            .json(&serde_json::json!({ "text": "over tls" }))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.text().await.unwrap();
        assert_eq!(status, 200, "a sync call through the TLS roles: {body}");
    });

    // The operator commands connect the same way, and see the spend.
    let mut usage = strings(&["budget", "usage", "--user", "tls-user"]);
    usage.extend(strings(&common));
    let (code, out) = run(&usage);
    assert_eq!(code, Some(0), "budget usage over TLS: {out}");
    drop(procs);
    prefix
}

#[test]
fn every_role_runs_over_tls_with_an_acl_user() {
    let certs = Certs::make();
    let (server, tls_port) = tls_redis(&certs, false);
    let url = format!("rediss://{USER}:{PASSWORD}@127.0.0.1:{tls_port}");
    let prefix = one_call_over(&url, &certs.path("ca.crt"));
    // The state is in that Redis (read over its plain port): the user's spend.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*tls-user*"))
        .query(&mut conn)
        .unwrap();
    assert!(!keys.is_empty(), "no key of tls-user under {prefix}");
}

#[test]
fn every_role_runs_on_a_cluster_over_tls_with_an_acl_user() {
    let certs = Certs::make();
    let tls_ports = std::cell::RefCell::new(Vec::new());
    // Clients reach the nodes over TLS only (the cluster bus and replication
    // too); the plain ports serve the harness's checks.
    let cluster = RedisCluster::start_with(3, |_| {
        let tls_port = tollgate_tests::redis_server::free_port();
        tls_ports.borrow_mut().push(tls_port);
        let mut args = tls_server_args(&certs, tls_port, false);
        args.extend(strings(&[
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
        ]));
        args
    });
    let seeds: Vec<String> = tls_ports
        .borrow()
        .iter()
        .take(2)
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let url = format!("rediss+cluster://{USER}:{PASSWORD}@{}", seeds.join(","));
    one_call_over(&url, &certs.path("ca.crt"));
    drop(cluster);
}

#[test]
fn a_wrong_ca_a_wrong_password_or_plain_text_is_refused_clearly() {
    let certs = Certs::make();
    let (server, tls_port) = tls_redis(&certs, false);
    let ca = certs.path("ca.crt");
    let rogue = certs.path("rogue.crt");
    let good = format!("rediss://{USER}:{PASSWORD}@127.0.0.1:{tls_port}");
    let bad_password = format!("rediss://{USER}:wrong@127.0.0.1:{tls_port}");
    let cases = [
        (good.clone(), rogue.clone(), "certificate"),
        (bad_password, ca.clone(), "password"),
    ];
    for (url, ca, says) in cases {
        let args = usage_of_u(&url, &ca);
        let (code, stderr) = run(&args);
        assert_ne!(code, Some(0), "{url} with {ca} connected");
        assert!(
            stderr.to_lowercase().contains(says),
            "the error should say what failed ({says}): {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            !stderr.contains(PASSWORD) && !stderr.contains(":wrong@"),
            "a password in: {stderr}"
        );
    }
    // Certificates with a plain redis:// URL: refused, not silently ignored.
    let args = usage_of_u(&server.url(), &ca);
    let (code, stderr) = run(&args);
    assert_eq!(code, Some(2), "plain URL with a CA: {stderr}");
    assert!(stderr.contains("rediss://"), "{stderr}");
    // A CA file that is not there.
    let args = usage_of_u(&good, "/nonexistent/ca.pem");
    let (code, stderr) = run(&args);
    assert_eq!(code, Some(2), "a missing CA file: {stderr}");
    assert!(stderr.contains("/nonexistent/ca.pem"), "{stderr}");
}

#[test]
fn a_redis_that_authenticates_clients_needs_the_client_certificate() {
    let certs = Certs::make();
    let (_server, tls_port) = tls_redis(&certs, true);
    let url = format!("rediss://{USER}:{PASSWORD}@127.0.0.1:{tls_port}");
    let ca = certs.path("ca.crt");
    let without = usage_of_u(&url, &ca);
    let (code, stderr) = run(&without);
    assert_ne!(
        code,
        Some(0),
        "connected without a client certificate: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let mut with = without.clone();
    with.extend(strings(&[
        "--redis-client-cert",
        &certs.path("client.crt"),
        "--redis-client-key",
        &certs.path("client.key"),
    ]));
    let (code, stderr) = run(&with);
    assert_eq!(code, Some(0), "with the client certificate: {stderr}");
}
