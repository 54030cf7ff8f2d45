//! Shared test support: a real `redis-server` per test, random key prefixes, and
//! the path of the project's binaries. Used by the integration tests in `it/` and
//! by the `tollgate-bench` binary.

pub mod api;
pub mod http;
pub mod process;
pub mod proxy;
pub mod redis_cluster;
pub mod redis_server;
pub mod throttle;
pub mod upstream;

pub use redis_cluster::{RedisCluster, TestCluster};
pub use redis_server::RedisServer;

use std::path::PathBuf;

/// A key prefix no other test uses: tests share nothing through Redis keys.
pub fn random_prefix() -> String {
    format!("t{}", &uuid_like()[..12])
}

fn uuid_like() -> String {
    tollgate_core::id::RequestId::generate()
        .as_str()
        .replace('-', "")
}

/// The path of a binary built from this workspace (`tollgate`, `tollgate-bench`),
/// next to the running test executable's `deps/` folder. Panics with the build
/// command to run when it is missing: the test command builds the binaries first.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first with `cargo build --workspace --bins` \
         (scripts/test does this before running the tests)",
        path.display()
    );
    path
}
