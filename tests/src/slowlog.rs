//! Redis' `SLOWLOG`: how long each command (a script call included) held the
//! server. The bench and the tests read it after a run to prove that no script
//! holds Redis for long, whatever the size of a user's log.

use redis::aio::MultiplexedConnection;
use redis::Value;

/// The longest a command may hold Redis: every script is O(1), amortised, or
/// bounded by a page.
pub const LIMIT_US: u64 = 5_000;

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
    let slow: Vec<SlowEntry> = entries(conn)
        .await?
        .into_iter()
        .filter(|e| e.micros > LIMIT_US)
        .collect();
    let text = slow
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    Ok((slow, text))
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
