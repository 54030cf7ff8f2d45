//! Starts a private `redis-server` on a free loopback port and stops it on drop.
//!
//! Tests never mock Redis and never skip: when `redis-server` is not installed the
//! test fails with the command that installs it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`, killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

const INSTALL_HINT: &str = "redis-server (Redis 7) is required by the Redis tests and was not found on PATH. \
Install it with `sudo apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS), \
or run `scripts/test`, which installs it where apt-get is available.";

impl RedisServer {
    /// Starts a server; panics with a clear message if that is impossible.
    pub fn start() -> Self {
        let mut last_error = String::new();
        for _ in 0..5 {
            match Self::try_start() {
                Ok(server) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    fn try_start() -> Result<Self, String> {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--loglevel", "warning"])
            .arg("--dir")
            .arg(&dir)
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
        let mut server = Self { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!(
                    "redis-server exited at start ({status}); port {port} taken?"
                ));
            }
            if ping(port) {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        server.kill();
        Err("redis-server did not answer PING within 10s".into())
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

/// A port that was free a moment ago (bind to :0, read it, release it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
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
