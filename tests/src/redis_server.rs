//! Starts a private `redis-server` on a free loopback port and stops it on drop.
//!
//! Tests never mock Redis and never skip: when `redis-server` is not installed the
//! test fails with the command that installs it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`, killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
    /// Arguments beyond the defaults, kept for [`RedisServer::restart`].
    extra: Vec<String>,
    /// A command the server runs under (e.g. valgrind), or empty.
    wrapper: Vec<String>,
}

const INSTALL_HINT: &str = "redis-server (Redis 7) is required by the Redis tests and was not found on PATH. \
Install it with `sudo apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS), \
or run `scripts/test`, which installs it where apt-get is available.";

impl RedisServer {
    /// Starts a server; panics with a clear message if that is impossible.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with `extra` arguments after the defaults (e.g.
    /// `["--enable-debug-command", "yes"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_under(&[], extra)
    }

    /// Starts a server run by `wrapper` (e.g. `["valgrind",
    /// "--tool=callgrind", ...]`: the server's pid is then the wrapper's),
    /// with `extra` arguments after the defaults.
    pub fn start_under(wrapper: &[String], extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
            match spawn(wrapper, port, &dir, &extra) {
                Ok(child) => {
                    return Self {
                        child,
                        port,
                        dir,
                        extra,
                        wrapper: wrapper.to_vec(),
                    }
                }
                Err(e) => last_error = e,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    /// Starts a server on `port` with `extra` arguments (a cluster node, whose
    /// bus port is `port + 10000`).
    pub fn start_at(port: u16, extra: &[&str]) -> Result<Self, String> {
        let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
        let child = spawn(&[], port, &dir, &extra)?;
        Ok(Self {
            child,
            port,
            dir,
            extra,
            wrapper: Vec::new(),
        })
    }

    /// Kills the server (SIGKILL: no goodbye on its sockets beyond the kernel's)
    /// and starts a new one on the same port, with the same arguments.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut last_error = String::new();
        // The port was ours a moment ago; give the kernel a few tries.
        for _ in 0..50 {
            match spawn(&self.wrapper, self.port, &self.dir, &self.extra) {
                Ok(child) => {
                    self.child = child;
                    return;
                }
                Err(e) => last_error = e,
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("could not restart redis-server: {last_error}");
    }

    /// [`restart`](Self::restart)s the server in `slot` off the async
    /// runtime's threads (a restart blocks until the server answers).
    pub async fn restart_in(slot: &mut Option<Self>) {
        let mut server = slot.take().expect("a server to restart");
        let server = tokio::task::spawn_blocking(move || {
            server.restart();
            server
        })
        .await
        .expect("the restart ran");
        *slot = Some(server);
    }

    /// Kills the server (SIGKILL) and leaves it down, its data directory (and
    /// so its AOF, when started with `--appendonly yes`) kept for
    /// [`RedisServer::resume`].
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a stopped server again on the same port, directory and arguments;
    /// returns once it answers PING (after loading its AOF).
    pub fn resume(&mut self) {
        self.restart();
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's OS process id (tests that pause or kill it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `redis-server` (run by `wrapper` when not empty) on `port` and
/// waits until it answers PING.
fn spawn(wrapper: &[String], port: u16, dir: &Path, extra: &[String]) -> Result<Child, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg("redis-server");
            c
        }
        None => Command::new("redis-server"),
    };
    let mut child = command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(["--loglevel", "warning"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                panic!("{INSTALL_HINT}");
            }
            format!("spawn redis-server: {e}")
        })?;
    // A wrapper such as valgrind starts the server tens of times slower.
    let wait = if wrapper.is_empty() { 10 } else { 60 };
    let deadline = Instant::now() + Duration::from_secs(wait);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "redis-server exited at start ({status}); port {port} taken?"
            ));
        }
        if ping(port) {
            return Ok(child);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    Err(format!("redis-server did not answer PING within {wait}s"))
}

/// A port that was free a moment ago, below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`) when there is room for it.
///
/// A port from the ephemeral range (what binding to :0 gives) can be handed
/// out as the source port of an outgoing connection while the process that
/// listens on it is down: a role or a Redis that the harness kills and starts
/// again on the same port then cannot listen until that connection closes (a
/// pooled one may stay open for the rest of the run). Chaos saw it: a killed
/// api restarted 123 times on "Address already in use".
pub fn free_port() -> u16 {
    let (low, _) = ephemeral_range();
    if low > FIXED_PORTS_FROM + 1_000 {
        let span = u32::from(low - FIXED_PORTS_FROM);
        for _ in 0..200 {
            let port = FIXED_PORTS_FROM + (random_u32() % span) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// The lowest port [`free_port`] picks (a Redis Cluster node's bus port,
/// `port + 10000`, stays under 65536).
const FIXED_PORTS_FROM: u16 = 20_000;

/// The kernel's range of ephemeral ports (Linux's default when unreadable).
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut it = text.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

fn random_u32() -> u32 {
    u32::from_str_radix(&crate::uuid_like()[..8], 16).unwrap_or(0)
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

#[cfg(test)]
mod tests {
    use super::{ephemeral_range, free_port, FIXED_PORTS_FROM};

    #[test]
    fn free_ports_are_outside_the_ephemeral_range() {
        let (low, high) = ephemeral_range();
        assert!(low <= high, "{low}..{high}");
        for _ in 0..50 {
            let port = free_port();
            if low > FIXED_PORTS_FROM + 1_000 {
                assert!(
                    (FIXED_PORTS_FROM..low).contains(&port),
                    "{port} is not in {FIXED_PORTS_FROM}..{low}"
                );
            }
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }
}
