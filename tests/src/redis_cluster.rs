//! A private Redis Cluster for tests: `primaries` primaries with one replica
//! each, `redis-server --cluster-enabled yes` processes on free loopback ports
//! joined by `redis-cli --cluster create`, stopped (every process killed, its
//! directory removed) on drop. Like [`RedisServer`], it never skips: a missing
//! `redis-server` or `redis-cli` fails the test with the command to install it.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::redis_server::{free_port, RedisServer};

/// A running cluster; its nodes die with it.
#[derive(Debug)]
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    /// Ports of the nodes killed by [`RedisCluster::kill_node`].
    down: Vec<u16>,
}

/// A port whose cluster bus port (`port + 10000`) is free too.
fn cluster_port() -> u16 {
    for _ in 0..200 {
        let port = free_port();
        if port <= 55_535 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair (port, port + 10000) on 127.0.0.1 in 200 tries");
}

impl RedisCluster {
    /// Starts `primaries` primaries and as many replicas; returns once every
    /// node reports `cluster_state:ok`.
    pub fn start(primaries: usize) -> Self {
        Self::start_with(primaries, |_| Vec::new())
    }

    /// Like [`RedisCluster::start`], with `extra(port)` appended to each
    /// node's arguments (e.g. a TLS port of its own). The cluster is joined
    /// through the nodes' plain ports, which the harness also uses.
    pub fn start_with(primaries: usize, extra: impl Fn(u16) -> Vec<String>) -> Self {
        let mut nodes = Vec::with_capacity(primaries * 2);
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
            // A replica takes over however long it was out of touch (the
            // default refuses when node-timeout is this short).
            "--cluster-replica-validity-factor",
            "0",
            // Replicas sync at once (the default waits 5 s for more of them).
            "--repl-diskless-sync-delay",
            "0",
        ];
        while nodes.len() < primaries * 2 {
            // A port taken between the check and the start: try another.
            let port = cluster_port();
            let extra = extra(port);
            let mut all: Vec<&str> = args.to_vec();
            all.extend(extra.iter().map(String::as_str));
            if let Ok(node) = RedisServer::start_at(port, &all) {
                nodes.push(node);
            }
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run redis-cli ({e}): install it with `sudo apt-get install -y redis-tools` (scripts/test installs redis-server, which brings it)")
            });
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self {
            nodes,
            down: Vec::new(),
        };
        cluster.wait_ok(Duration::from_secs(30));
        cluster
    }

    /// Seeds for `redis+cluster://`: the first three nodes.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .take(3)
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// Kills (SIGKILL) the node on `port`; it stays down.
    pub fn kill_node(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no node on port {port}"));
        node.stop();
        self.down.push(port);
    }

    /// The port of the first node listed that is not on `port`: one to ask
    /// once the node on `port` was killed.
    pub fn node_other_than(&self, port: u16) -> u16 {
        self.nodes
            .iter()
            .map(|n| n.port())
            .find(|p| *p != port)
            .unwrap_or_else(|| panic!("no node but the one on {port}"))
    }

    /// Waits until every live node says `cluster_state:ok` and every live
    /// replica's link to its primary is up, at most `within`.
    pub fn wait_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let all_ok = self
                .nodes
                .iter()
                .filter(|n| !self.down.contains(&n.port()))
                .all(|n| {
                    let ask = |args: &[&str]| {
                        Command::new("redis-cli")
                            .arg("-p")
                            .arg(n.port().to_string())
                            .args(args)
                            .output()
                            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                            .unwrap_or_default()
                    };
                    let replication = ask(&["info", "replication"]);
                    ask(&["cluster", "info"]).contains("cluster_state:ok")
                        && (replication.contains("role:master")
                            || replication.contains("master_link_status:up"))
                });
            if all_ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach cluster_state:ok within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The cluster a test runs against: the one named by `TOLLGATE_TEST_CLUSTER`
/// (a `redis+cluster://` URL; `scripts/test` starts one for the whole suite,
/// with `scripts/redis-cluster`), or else a private one started for the test
/// and stopped after it. Tests share a cluster through random key prefixes.
#[derive(Debug)]
pub enum TestCluster {
    Shared(String),
    Owned(RedisCluster),
}

impl TestCluster {
    pub fn get() -> Self {
        match std::env::var("TOLLGATE_TEST_CLUSTER") {
            Ok(url) if !url.is_empty() => Self::Shared(url),
            _ => Self::Owned(RedisCluster::start(3)),
        }
    }

    pub fn url(&self) -> String {
        match self {
            Self::Shared(url) => url.clone(),
            Self::Owned(c) => c.url(),
        }
    }
}
