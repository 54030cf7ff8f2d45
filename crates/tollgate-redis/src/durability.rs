//! What Redis promises an accepted call: its persistence read with `CONFIG GET
//! appendonly appendfsync` (on every primary of a cluster) and, in replica
//! mode, its connected replicas (`INFO replication`), judged against the
//! [`Durability`] the pool was built with ([`RedisDurability`], `/readyz`).
//! The pool also judges each new connection of a standalone Redis in fsync mode
//! (a Redis restarted with another setting is refused, not trusted), and
//! [`crate::call`] sends the `WAIT` of replica mode.
//!
//! CONFIG may be renamed or refused (managed Redis): the setting is then
//! `unknown`, which fsync mode takes as a failure (fail closed).

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{FromRedisValue, Value};
use tollgate_core::durability::{Durability, DurabilityCheck, DurabilityReport};

use crate::call;
use crate::pool::{ClusterPool, Pool};

/// What one Redis node said of its persistence; `Err`: why it could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Persistence {
    pub appendonly: String,
    pub appendfsync: String,
}

/// The `/readyz` and startup report of a pool's Redis.
#[derive(Debug, Clone)]
pub struct RedisDurability {
    pool: Pool,
    timeout: Duration,
}

impl RedisDurability {
    pub fn new(pool: Pool, timeout: Duration) -> Self {
        Self { pool, timeout }
    }
}

#[async_trait]
impl DurabilityCheck for RedisDurability {
    async fn check(&self) -> DurabilityReport {
        let mode = self.pool.durability();
        let persistence = read(&self.pool, self.timeout).await;
        let replicas = match mode {
            Durability::Replica { .. } => Some(replicas(&self.pool, self.timeout).await),
            _ => None,
        };
        judge(mode, persistence, replicas)
    }

    fn refused(&self) -> Option<String> {
        self.pool.refusal()
    }
}

/// How long fsync mode trusts its last reading of Redis's AOF setting where
/// a call is accepted: a Redis that stops fsyncing every write (`CONFIG SET
/// appendfsync everysec`, `appendonly no`) turns the next call's charge into
/// a 503 within this, on every pod.
pub const FSYNC_RECHECK: Duration = Duration::from_secs(1);

/// A verdict this old is read again in the background, while calls go on
/// using it: under steady traffic no call waits for a reading.
const FSYNC_REFRESH: Duration = Duration::from_millis(500);

/// Fsync mode's check where a call is accepted: the AOF setting read again at
/// most every [`FSYNC_REFRESH`] (one `CONFIG GET` pair per half second per
/// pod, whatever the load). A verdict younger than [`FSYNC_REFRESH`] is used
/// as it is; one younger than [`FSYNC_RECHECK`] too, while one task reads the
/// setting again; an older one (a quiet pod, or an unreachable Redis) is read
/// again by the call, one caller reading while the others wait for its
/// verdict. A connection is checked when it is made, but a pooled one lives
/// on: without this, a Redis reconfigured at runtime kept accepting calls.
#[derive(Debug, Default)]
pub struct FsyncGate {
    /// When the setting was last read, and what was wrong with it.
    last: std::sync::Mutex<Option<(std::time::Instant, Option<String>)>>,
    /// A reading in flight (the background one, or a caller's).
    reading: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl FsyncGate {
    /// The last verdict and its age.
    fn last(&self) -> Option<(Duration, Option<String>)> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref()
            .map(|(at, problem)| (at.elapsed(), problem.clone()))
    }

    fn set(&self, problem: Option<String>) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now(), problem));
    }
}

/// Reads the setting and keeps the verdict (unreadable counts as not
/// durable: fail closed).
async fn reread(pool: &Pool, timeout: Duration) -> Option<String> {
    let problem = judge(Durability::Fsync, read(pool, timeout).await, None).problem;
    pool.fsync_gate().set(problem.clone());
    problem
}

/// Why `pool`'s Redis may not accept a call in fsync mode now (`None`: it
/// fsyncs every write, as read within [`FSYNC_RECHECK`]).
pub(crate) async fn fsync_problem(pool: &Pool, timeout: Duration) -> Option<String> {
    let gate = pool.fsync_gate();
    if let Some((age, problem)) = gate.last() {
        if age < FSYNC_RECHECK {
            if age >= FSYNC_REFRESH {
                // Read ahead of the bound, off the call's path; one reading
                // at a time (a held lock means one is under way).
                if let Ok(guard) = std::sync::Arc::clone(&gate.reading).try_lock_owned() {
                    let pool = pool.clone();
                    tokio::spawn(async move {
                        let _guard = guard;
                        reread(&pool, timeout).await;
                    });
                }
            }
            return problem;
        }
    }
    let _reading = gate.reading.lock().await;
    match gate.last() {
        Some((age, problem)) if age < FSYNC_RECHECK => problem,
        _ => reread(pool, timeout).await,
    }
}

/// The two CONFIG GETs, as one pipeline.
pub(crate) fn config_get() -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.cmd("CONFIG")
        .arg("GET")
        .arg("appendonly")
        .cmd("CONFIG")
        .arg("GET")
        .arg("appendfsync");
    pipe
}

/// The two CONFIG GET replies as a [`Persistence`].
pub(crate) fn parse(
    reply: (HashMap<String, String>, HashMap<String, String>),
) -> Result<Persistence, String> {
    let (only, fsync) = reply;
    match (only.get("appendonly"), fsync.get("appendfsync")) {
        (Some(a), Some(f)) => Ok(Persistence {
            appendonly: a.clone(),
            appendfsync: f.clone(),
        }),
        _ => Err("CONFIG GET answered without appendonly/appendfsync".into()),
    }
}

/// The persistence of the pool's Redis; on a cluster, of its weakest primary.
async fn read(pool: &Pool, timeout: Duration) -> Result<Persistence, String> {
    match pool {
        Pool::Single(_) => call::read(pool, timeout, "durability", &config_get())
            .await
            .map_err(|e| e.to_string())
            .and_then(parse),
        Pool::Cluster(c) => {
            let mut each = Vec::new();
            for name in ["appendonly", "appendfsync"] {
                let cmd = redis::cmd("CONFIG").arg("GET").arg(name).to_owned();
                let all = on_every_primary(c, cmd, timeout, "CONFIG GET").await?;
                each.push(per_node(name, all)?);
            }
            weakest(&each[0], &each[1])
        }
    }
}

/// `cmd` sent to every primary of the cluster: `{node: reply}`; `what` names
/// it when they do not all answer within `timeout`.
async fn on_every_primary(
    c: &ClusterPool,
    cmd: redis::Cmd,
    timeout: Duration,
    what: &str,
) -> Result<Value, String> {
    let mut conn = c.connection();
    tokio::time::timeout(
        timeout,
        conn.route_command(
            cmd,
            RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
        ),
    )
    .await
    .map_err(|_| format!("no answer to {what} within {timeout:?}"))?
    .map_err(|e| e.to_string())
}

/// `{node: {name: value}}` (a command sent to every primary) as the values of
/// `name`, one per node.
fn per_node(name: &str, all: Value) -> Result<Vec<String>, String> {
    let Value::Map(nodes) = all else {
        return Err(format!("CONFIG GET {name}: unexpected reply {all:?}"));
    };
    nodes
        .into_iter()
        .map(|(node, reply)| {
            let node = String::from_redis_value(node).unwrap_or_default();
            if let Value::ServerError(e) = reply {
                return Err(format!("{node}: {e:?}"));
            }
            HashMap::<String, String>::from_redis_value(reply)
                .ok()
                .and_then(|mut m| m.remove(name))
                .ok_or_else(|| format!("{node}: CONFIG GET {name} answered without it"))
        })
        .collect()
}

/// The weakest setting among the primaries: the promise is the weakest's.
fn weakest(only: &[String], fsync: &[String]) -> Result<Persistence, String> {
    let rank = |f: &str| match f {
        "always" => 0,
        "everysec" => 1,
        _ => 2,
    };
    let appendonly = if only.iter().all(|a| a == "yes") {
        "yes"
    } else {
        "no"
    };
    let appendfsync = fsync
        .iter()
        .max_by_key(|f| rank(f))
        .ok_or("no primary answered")?;
    Ok(Persistence {
        appendonly: appendonly.into(),
        appendfsync: appendfsync.clone(),
    })
}

/// Replicas online on the primary (on a cluster: the fewest of any primary);
/// `Err`: why they could not be counted.
async fn replicas(pool: &Pool, timeout: Duration) -> Result<u32, String> {
    let cmd = redis::cmd("INFO").arg("replication").to_owned();
    let infos: Vec<String> = match pool {
        Pool::Single(_) => {
            let mut pipe = redis::pipe();
            pipe.add_command(cmd);
            let (info,): (String,) = call::read(pool, timeout, "durability", &pipe)
                .await
                .map_err(|e| e.to_string())?;
            vec![info]
        }
        Pool::Cluster(c) => {
            let all = on_every_primary(c, cmd, timeout, "INFO").await?;
            let Value::Map(nodes) = all else {
                return Err(format!("INFO replication: unexpected reply {all:?}"));
            };
            nodes
                .into_iter()
                .map(|(_, v)| String::from_redis_value(v).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?
        }
    };
    // A replica still in its first sync is connected but acknowledges
    // nothing yet: only `state=online` ones count.
    infos
        .iter()
        .map(|info| {
            if !info.contains("role:master") {
                return Err("not a primary".to_owned());
            }
            Ok(info
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                .count() as u32)
        })
        .try_fold(u32::MAX, |min, n| n.map(|n| min.min(n)))
}

/// What a crash may lose, by the server's setting.
fn loss_window(p: &Persistence) -> &'static str {
    match (p.appendonly.as_str(), p.appendfsync.as_str()) {
        ("yes", "always") => "0: every write is fsynced before its reply",
        ("yes", "everysec") => "1s (up to ~2s while a disk stalls)",
        ("yes", _) => "the OS's write-back (~30s)",
        _ => "every write since the last RDB snapshot (no AOF)",
    }
}

/// The report of a mode on what Redis said; `problem` when the mode's promise
/// does not hold.
pub fn judge(
    mode: Durability,
    persistence: Result<Persistence, String>,
    replicas: Option<Result<u32, String>>,
) -> DurabilityReport {
    let unknown = "unknown".to_owned();
    let (appendonly, appendfsync, mut loss, unreadable) = match &persistence {
        Ok(p) => (
            p.appendonly.clone(),
            p.appendfsync.clone(),
            loss_window(p).to_owned(),
            None,
        ),
        Err(why) => (unknown.clone(), unknown.clone(), unknown, Some(why)),
    };
    let mut problem = None;
    if mode == Durability::Fsync {
        if let Some(why) = unreadable {
            problem = Some(format!(
                "durability fsync: cannot read Redis's appendonly/appendfsync ({why}); \
                 CONFIG may be renamed or disabled (managed Redis): failing closed. \
                 Confirm the provider fsyncs every write and use --durability none, or use \
                 --durability replica"
            ));
        } else if appendonly != "yes" || appendfsync != "always" {
            problem = Some(format!(
                "durability fsync needs appendonly yes and appendfsync always, but Redis has \
                 appendonly {appendonly}, appendfsync {appendfsync} (a crash loses {loss}): \
                 set them in redis.conf (and CONFIG SET appendfsync always), or run with \
                 --durability none"
            ));
        }
    }
    let mut count = None;
    if let (Durability::Replica { replicas: n, .. }, Some(found)) = (mode, replicas) {
        match found {
            Ok(found) => {
                count = Some(found);
                if found < n {
                    problem = Some(format!(
                        "durability replica needs {n} connected replica(s) per primary, \
                         Redis has {found} online: calls would answer 503 (WAIT falls short)"
                    ));
                } else {
                    loss = format!("0 once {n} replica(s) acknowledged (WAIT); on disk: {loss}");
                }
            }
            Err(why) => {
                problem = Some(format!(
                    "durability replica: cannot count Redis's replicas ({why})"
                ));
            }
        }
    }
    DurabilityReport {
        mode: mode.name(),
        appendonly,
        appendfsync,
        replicas: count,
        loss_window: loss,
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(only: &str, fsync: &str) -> Result<Persistence, String> {
        Ok(Persistence {
            appendonly: only.into(),
            appendfsync: fsync.into(),
        })
    }

    #[test]
    fn fsync_needs_always_and_fails_closed_on_unknown() {
        assert!(judge(Durability::Fsync, p("yes", "always"), None)
            .problem
            .is_none());
        let everysec = judge(Durability::Fsync, p("yes", "everysec"), None);
        assert!(everysec.problem.unwrap().contains("appendfsync everysec"));
        assert!(judge(Durability::Fsync, p("no", "always"), None)
            .problem
            .is_some());
        let hidden = judge(Durability::Fsync, Err("ERR unknown command".into()), None);
        assert_eq!(hidden.appendfsync, "unknown");
        assert!(hidden.problem.unwrap().contains("failing closed"));
    }

    #[test]
    fn none_reports_the_window_without_a_problem() {
        let r = judge(Durability::None, p("yes", "everysec"), None);
        assert!(r.problem.is_none());
        assert!(r.loss_window.starts_with("1s"));
        let r = judge(Durability::None, Err("NOPERM".into()), None);
        assert!(r.problem.is_none());
        assert_eq!(r.loss_window, "unknown");
    }

    #[test]
    fn replica_needs_its_replicas() {
        let mode = Durability::Replica {
            replicas: 1,
            timeout: Duration::from_secs(1),
        };
        assert!(judge(mode, p("yes", "everysec"), Some(Ok(0)))
            .problem
            .is_some());
        let ok = judge(mode, p("yes", "everysec"), Some(Ok(1)));
        assert!(ok.problem.is_none());
        assert_eq!(ok.replicas, Some(1));
    }

    #[test]
    fn a_cluster_promises_what_its_weakest_primary_does() {
        let w = weakest(
            &["yes".into(), "yes".into()],
            &["always".into(), "everysec".into()],
        )
        .unwrap();
        assert_eq!(w.appendfsync, "everysec");
    }
}
