//! Redis' `SLOWLOG`: how long each command (a script call included) held the
//! server. The bench and the tests read it after a run to prove that no script
//! holds Redis for long, whatever the size of a user's log.

use redis::aio::MultiplexedConnection;
use redis::Value;

/// The longest a command may hold Redis: every script is O(1), amortised, or
/// bounded by a page. The benches (`tollgate-bench ledger`, `usage`) hold
/// every call to it.
pub const LIMIT_US: u64 = 5_000;

/// What the tests hold a call to: time a whole walk would take, never a
/// slice's. A call walking a test's log of 10,000 events in one go holds
/// Redis 100-200 ms; a slice, about 1 ms on a quiet core. The tests assert
/// the slicing, not a speed (a speed is a bench's to measure): 5 ms failed
/// slices that only waited for a core on a loaded CI machine (5.6-9.5 ms in
/// three tries in a row), 20 ms keeps a 5x margin below the walk.
pub const WALK_US: u64 = 20_000;

/// One slow command: how long it ran (µs) and what it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlowEntry {
    pub micros: u64,
    /// The command and its first arguments, as Redis logged them.
    pub command: String,
}

impl std::fmt::Display for SlowEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} ms: {}", self.micros as f64 / 1000.0, self.command)
    }
}

/// Logs every command slower than `above_us` from now on (up to `keep`
/// entries), forgetting what was logged before.
pub async fn start(
    conn: &mut MultiplexedConnection,
    above_us: u64,
    keep: usize,
) -> redis::RedisResult<()> {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(above_us)
        .arg("slowlog-max-len")
        .arg(keep)
        .exec_async(conn)
        .await?;
    redis::cmd("SLOWLOG").arg("RESET").exec_async(conn).await
}

/// Every logged entry, newest first.
pub async fn entries(conn: &mut MultiplexedConnection) -> redis::RedisResult<Vec<SlowEntry>> {
    let reply: Vec<Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(conn)
        .await?;
    Ok(reply.iter().filter_map(parse).collect())
}

/// The logged entries above [`LIMIT_US`], and a line naming each.
pub async fn over_limit(
    conn: &mut MultiplexedConnection,
) -> redis::RedisResult<(Vec<SlowEntry>, String)> {
    over(conn, LIMIT_US).await
}

/// The logged entries above `limit_us`, and a line naming each.
pub async fn over(
    conn: &mut MultiplexedConnection,
    limit_us: u64,
) -> redis::RedisResult<(Vec<SlowEntry>, String)> {
    let slow: Vec<SlowEntry> = entries(conn)
        .await?
        .into_iter()
        .filter(|e| e.micros > limit_us)
        .collect();
    let text = slow
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    Ok((slow, text))
}

/// Runs `attempt` (given its number, from 0; answering its result and what
/// SLOWLOG logged past the limit during it, empty if nothing) up to three
/// times until it logs nothing, and returns that result; fails naming `what`
/// and every try's log. A slow call (the walk of a whole log) is slow every
/// time; one that only lost the CPU on a loaded test machine is not slow again.
pub async fn quick_in_three_tries<T>(
    what: &str,
    mut attempt: impl AsyncFnMut(usize) -> (T, String),
) -> T {
    let mut seen = Vec::new();
    for n in 0..3 {
        let (out, slow) = attempt(n).await;
        if slow.is_empty() {
            return out;
        }
        seen.push(slow);
    }
    panic!(
        "{what} held Redis past the limit in three tries: {}",
        seen.join(" | ")
    );
}

/// `[id, time, micros, [args...], ...]`: the script's SHA and first key name it.
fn parse(v: &Value) -> Option<SlowEntry> {
    let Value::Array(e) = v else { return None };
    let micros = match e.get(2)? {
        Value::Int(n) => u64::try_from(*n).ok()?,
        _ => return None,
    };
    let scripts = tollgate_redis::scripts::all();
    let args = match e.get(3)? {
        Value::Array(a) => a
            .iter()
            .take(4)
            .map(|a| match a {
                Value::BulkString(b) => {
                    let arg = String::from_utf8_lossy(b).into_owned();
                    match scripts.iter().find(|(_, s)| s.get_hash() == arg) {
                        Some((name, _)) => (*name).to_owned(),
                        None => arg,
                    }
                }
                Value::SimpleString(s) => s.clone(),
                Value::Int(n) => n.to_string(),
                _ => "?".into(),
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    Some(SlowEntry {
        micros,
        command: args,
    })
}

/// What one script (or command) cost at its slowest over a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slowest {
    /// Calls logged (each at or above the watch's threshold).
    pub logged: u64,
    /// Calls above [`LIMIT_US`].
    pub over_limit: u64,
    /// Calls above ten times [`LIMIT_US`] (50 ms).
    pub over_hold: u64,
    /// The slowest call (µs).
    pub max_us: u64,
}

/// The script or command an entry is: `reserve.lua` for a budget function
/// (`FCALL tollgate_budget_<version>_reserve ...`), the script's file for an
/// `EVALSHA` of one of ours, else the command's name.
pub fn name_of(entry: &SlowEntry) -> String {
    let mut words = entry.command.split(' ');
    let first = words.next().unwrap_or("").to_ascii_uppercase();
    let second = words.next().unwrap_or("");
    match first.as_str() {
        "FCALL" | "FCALL_RO" => match second.rsplit_once('_') {
            Some((_, script)) => format!("{script}.lua"),
            None => second.to_owned(),
        },
        "EVALSHA" if second.ends_with(".lua") => second.to_owned(),
        _ => first,
    }
}

/// Watches a Redis' SLOWLOG for a whole run: every `every`, reads what was
/// logged and resets it (a Redis restarted by the run starts an empty log, so
/// nothing is lost but what a restart wiped between two reads). Errors (Redis
/// down) are skipped: the next read goes on.
#[derive(Debug)]
pub struct Watch {
    seen: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Slowest>>>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// Starts watching `url`, whose redis-server must log commands at or
    /// above the threshold it was started with (`--slowlog-log-slower-than`).
    pub fn start(url: String, every: std::time::Duration) -> Self {
        let seen: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Slowest>>> =
            std::sync::Arc::default();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let into = std::sync::Arc::clone(&seen);
        let task = tokio::spawn(async move {
            let mut conn = None;
            loop {
                let done = *stopped.borrow();
                if conn.is_none() {
                    conn = match redis::Client::open(url.as_str()) {
                        Ok(c) => c.get_multiplexed_async_connection().await.ok(),
                        Err(_) => None,
                    };
                }
                if let Some(c) = conn.as_mut() {
                    match drain(c).await {
                        Ok(entries) => {
                            let mut seen = into.lock().unwrap_or_else(|e| e.into_inner());
                            for e in entries {
                                let s: &mut Slowest = seen.entry(name_of(&e)).or_default();
                                s.logged += 1;
                                s.over_limit += u64::from(e.micros > LIMIT_US);
                                s.over_hold += u64::from(e.micros > 10 * LIMIT_US);
                                s.max_us = s.max_us.max(e.micros);
                            }
                        }
                        Err(_) => conn = None,
                    }
                }
                if done {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stopped.changed() => {}
                }
            }
        });
        Self { seen, stop, task }
    }

    /// Reads what is left and stops: the slowest call per script or command.
    pub async fn finish(self) -> std::collections::BTreeMap<String, Slowest> {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.clone()
    }
}

/// Every entry logged since the last drain, then the log reset.
async fn drain(conn: &mut MultiplexedConnection) -> redis::RedisResult<Vec<SlowEntry>> {
    let (reply, ()): (Vec<Value>, ()) = redis::pipe()
        .cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .cmd("SLOWLOG")
        .arg("RESET")
        .query_async(conn)
        .await?;
    Ok(reply.iter().filter_map(parse).collect())
}
