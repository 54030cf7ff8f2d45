//! What a Redis server says about itself, as the tests and benches read it:
//! calls per command (INFO commandstats), its version, the keys matching a
//! pattern and the bytes a key takes (MEMORY USAGE).

use std::collections::BTreeMap;

use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, RedisResult};

/// Calls per command name since the server started (INFO commandstats),
/// INFO's own among them (as `info`).
pub fn command_calls(url: &str) -> BTreeMap<String, u64> {
    let mut conn = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .unwrap_or_else(|e| panic!("INFO commandstats: {e}"));
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// The server's version (`redis_version` of INFO server), `?` when unsaid.
pub async fn version(conn: &mut MultiplexedConnection) -> RedisResult<String> {
    let info: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_owned())
}

/// Every key matching `pattern`, walked with SCAN (1,000 a step).
pub async fn scan_keys(
    conn: &mut MultiplexedConnection,
    pattern: &str,
) -> RedisResult<Vec<String>> {
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            return Ok(keys);
        }
    }
}

/// `MEMORY USAGE key SAMPLES 0`: the bytes `key` takes, none when it is gone.
pub async fn memory_usage<T: FromRedisValue>(
    conn: &mut MultiplexedConnection,
    key: &str,
) -> RedisResult<Option<T>> {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(conn)
        .await
}
