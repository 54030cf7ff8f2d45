//! `tollgate` processes for the end-to-end tests: spawned with their stdout
//! read until they say what a test needs, killed (and reaped) on drop.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::workspace_bin;

/// Children killed (and reaped) on drop.
#[derive(Debug, Default)]
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The word after `needle` in the first of `lines` that holds it (up to a
/// space or a quote): what `tollgate all`'s banner says after "listening on ",
/// "Bearer " or "admin token: ". Panics with the lines when none holds it.
pub fn banner_value(lines: &[String], needle: &str) -> String {
    let line = lines
        .iter()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no {needle:?} in {lines:?}"));
    let at = line.find(needle).unwrap_or(0) + needle.len();
    line[at..]
        .split(['\'', ' '])
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// `child`'s exit status once it exits (looking every 50 ms); none if it
/// still runs at `deadline`, when it is killed and reaped.
pub fn exit_by(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("try_wait: {e}")) {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `cmd` with no stdin, its stdout discarded and its stderr read, until
/// it exits or `deadline` passes (see [`exit_by`]): its exit status (none if
/// it was still running) and its stderr.
pub fn run_until(cmd: &mut Command, deadline: Instant) -> (Option<ExitStatus>, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let status = exit_by(&mut child, deadline);
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    (status, stderr)
}

/// Spawns `tollgate <args>` and reads stdout until `pick` finds what it wants
/// (within 30 s); returns the child and every line read.
pub fn spawn_reading(args: &[&str], pick: impl Fn(&[String]) -> bool) -> (Child, Vec<String>) {
    spawn_reading_with(args, &[], pick)
}

/// [`spawn_reading`] with environment variables `envs` set for the child.
pub fn spawn_reading_with(
    args: &[&str],
    envs: &[(&str, &str)],
    pick: impl Fn(&[String]) -> bool,
) -> (Child, Vec<String>) {
    let mut child = command(args)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn tollgate {args:?}: {e}"));
    let mut reader = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !pick(&lines) {
        assert!(
            Instant::now() < deadline,
            "tollgate {args:?} printed only {lines:?}"
        );
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("tollgate {args:?} exited after printing {lines:?}");
        }
        lines.push(line.trim_end().to_owned());
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in reader.lines() {});
    (child, lines)
}

/// `tollgate mock-provider` on a free loopback port with `args`: the child
/// and the mock's base URL.
pub fn spawn_mock(args: &[&str]) -> (Child, String) {
    let mut all = vec!["mock-provider", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let (child, lines) = spawn_reading(&all, |l| !l.is_empty());
    let addr = lines[0]
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("mock said {lines:?}"));
    (child, format!("http://{addr}"))
}

/// `tollgate all` with `config` on a free loopback port, embedded or (with
/// `url`) on that Redis under `prefix`, read until its banner lists
/// `/v1/usage`: the child and the banner (see [`banner_value`]).
pub fn spawn_all(config: &Path, url: Option<&str>, prefix: &str) -> (Child, Vec<String>) {
    let config = config.to_str().expect("a UTF-8 config path");
    let mut args = vec!["all", "--listen", "127.0.0.1:0", "--config", config];
    if let Some(url) = url {
        args.extend_from_slice(&["--redis-url", url, "--key-prefix", prefix]);
    }
    spawn_reading(&args, |l| l.iter().any(|l| l.contains("/v1/usage")))
}

/// Spawns `tollgate <args>` with its stdout discarded (a role that prints
/// nothing there: a worker, a throttler).
pub fn spawn(args: &[&str]) -> Child {
    command(args)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn tollgate {args:?}: {e}"))
}

/// `tollgate <args>` with `RUST_LOG=warn` and no stdin: a test sets its
/// outputs (and any other environment) and spawns it.
pub fn command<S: AsRef<OsStr>>(args: &[S]) -> Command {
    let mut cmd = Command::new(workspace_bin("tollgate"));
    cmd.args(args).env("RUST_LOG", "warn").stdin(Stdio::null());
    cmd
}

/// `tollgate api` (as [`command`] makes it) to listen on a free loopback
/// port, on the Redis at `url` under `prefix`; and that port's address.
pub fn api_command(url: &str, prefix: &str) -> (Command, SocketAddr) {
    let addr = SocketAddr::from(([127, 0, 0, 1], crate::redis_server::free_port()));
    let mut cmd = command(&["api"]);
    cmd.env("TOLLGATE_LISTEN", addr.to_string())
        .env("TOLLGATE_REDIS_URL", url)
        .env("TOLLGATE_KEY_PREFIX", prefix);
    (cmd, addr)
}

/// The role `args[0]` (`worker`, `throttler` …) on the Redis at `url` under
/// `prefix`, with `config` and then the rest of `args`; its output discarded.
pub fn spawn_role(url: &str, prefix: &str, config: &Path, args: &[&str]) -> Child {
    command(&[args[0], "--redis-url", url, "--key-prefix", prefix])
        .arg("--config")
        .arg(config)
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn tollgate {args:?}: {e}"))
}
