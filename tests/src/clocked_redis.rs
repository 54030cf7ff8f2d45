//! A `redis-server` whose clock a test sets: run under libfaketime, its wall
//! clock offset to the instant the test asks for. Redis's `TIME` then runs on
//! from that instant (libfaketime's offsets take fractions of a second, so it
//! starts there to the millisecond); [`ClockedRedis::set`] saves the data,
//! restarts the server with a new offset and loads it back, so a test steps
//! Redis's clock to any instant, forward or back, a few milliseconds of real
//! time running on from each.
//!
//! Debian's redis-server allocates with jemalloc, whose start-up reads the
//! clock before libfaketime can initialise (libfaketime's start-up
//! allocates): a deadlock. Three things avoid it: the offset is given in
//! `FAKETIME` (no timestamp file to open), the semaphore libfaketime would
//! create for its shared state already exists (it then shares none), and a
//! small library defines the symbols libfaketime looks up that this glibc
//! lacks (`__ftime`, `timer_settime@GLIBC_2.2`, `timer_gettime@GLIBC_2.2`),
//! whose failed lookups would allocate. The library is compiled once per test
//! run with the system's C compiler.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::RedisServer;

/// Where Debian's `faketime` package puts the library.
pub const LIBFAKETIME: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
];

/// The installed libfaketime; panics, saying how to install it, when there
/// is none (a test that cannot run fails).
pub fn libfaketime() -> &'static str {
    LIBFAKETIME
        .iter()
        .copied()
        .find(|p| Path::new(p).is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is required to drive Redis's clock: \
                 `apt-get install faketime` (scripts/test installs it)"
            )
        })
}

const SHIM_C: &str = r#"
#include <errno.h>
int __ftime(void *tp) { (void)tp; errno = ENOSYS; return -1; }
int tollgate_timer_settime_22(void *t, int f, const void *n, void *o) {
  (void)t; (void)f; (void)n; (void)o; errno = ENOSYS; return -1;
}
int tollgate_timer_gettime_22(void *t, void *c) { (void)t; (void)c; errno = ENOSYS; return -1; }
__asm__(".symver tollgate_timer_settime_22,timer_settime@GLIBC_2.2");
__asm__(".symver tollgate_timer_gettime_22,timer_gettime@GLIBC_2.2");
"#;

/// The shim library (see the module's doc), built once.
fn shim() -> &'static Path {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tollgate-faketime-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a folder for the faketime shim");
        let (src, map, lib) = (
            dir.join("shim.c"),
            dir.join("shim.map"),
            dir.join("shim.so"),
        );
        std::fs::write(&src, SHIM_C).expect("write the shim");
        std::fs::write(&map, "GLIBC_2.2 { };\n").expect("write the shim's versions");
        let status = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(format!("-Wl,--version-script={}", map.display()))
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("a C compiler (cc) is needed for the faketime shim: {e}"));
        assert!(status.success(), "cc could not build the faketime shim");
        lib
    })
}

/// A `redis-server` on a clock the test sets, stopped on drop.
#[derive(Debug)]
pub struct ClockedRedis {
    server: Mutex<RedisServer>,
    url: String,
    /// The offset (`+<seconds>`) the next (re)start reads.
    offset: PathBuf,
}

impl ClockedRedis {
    /// Starts a server whose clock reads `at_ms` (ms since the epoch) now.
    pub fn start(at_ms: u64) -> Self {
        let offset = std::env::temp_dir().join(format!(
            "tollgate-faketime-offset-{}-{}",
            std::process::id(),
            crate::random_prefix()
        ));
        write_offset(&offset, at_ms);
        // `$$` is the server's pid once `exec` replaced the shell.
        let script = format!(
            "touch /dev/shm/sem.faketime_sem_$$; \
             FAKETIME=\"$(cat '{offset}')\" LD_PRELOAD='{lib} {shim}' \
             FAKETIME_DONT_FAKE_MONOTONIC=1 exec \"$@\"",
            offset = offset.display(),
            lib = libfaketime(),
            shim = shim().display(),
        );
        let wrapper = ["sh".to_owned(), "-c".to_owned(), script, "sh".to_owned()];
        let server = RedisServer::start_under(&wrapper, &[]);
        let url = server.url();
        Self {
            server: Mutex::new(server),
            url,
            offset,
        }
    }

    /// Sets Redis's clock to `at_ms`: the data is saved, the server restarted
    /// on the new clock, and the data loaded back. Blocks until it answers.
    pub fn set(&self, at_ms: u64) {
        let mut server = tollgate_core::lock(&self.server);
        save(server.port());
        let pid = server.pid();
        write_offset(&self.offset, at_ms);
        server.restart();
        let _ = std::fs::remove_file(format!("/dev/shm/sem.faketime_sem_{pid}"));
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }
}

impl Drop for ClockedRedis {
    fn drop(&mut self) {
        let server = tollgate_core::lock(&self.server);
        let _ = std::fs::remove_file(format!("/dev/shm/sem.faketime_sem_{}", server.pid()));
        let _ = std::fs::remove_file(&self.offset);
    }
}

/// `SAVE` on the server at `port` (a plain RESP exchange: no runtime here).
fn save(port: u16) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to save");
    s.write_all(b"*1\r\n$4\r\nSAVE\r\n").expect("send SAVE");
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).expect("read SAVE's answer");
    assert!(
        buf[..n].starts_with(b"+OK"),
        "SAVE answered {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
}

/// libfaketime's offset from the real clock to `at_ms`, `+<s>.<ms>`.
fn write_offset(file: &Path, at_ms: u64) {
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_millis()).unwrap_or(0));
    let ms = i128::from(at_ms) - real;
    let sign = if ms < 0 { '-' } else { '+' };
    let ms = ms.abs();
    std::fs::write(file, format!("{sign}{}.{:03}", ms / 1000, ms % 1000))
        .expect("write the faketime offset");
}
