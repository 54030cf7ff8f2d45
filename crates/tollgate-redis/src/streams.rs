//! [`RedisStreams`]: streamed answers through Redis. One Redis Stream per
//! job (`{q:<operation>}:stream:<id>`, the queue's hash tag): the worker
//! appends each upstream event with `stream_push.lua` (bounded by `MAXLEN`,
//! expiring [`STREAM_TTL`] after the last append, refused once the reader
//! marked the stream cancelled); the api pod holding the client reads with
//! `XREAD BLOCK` on a connection of its own (a blocking command never runs on
//! the pool's multiplexed connections), from the stream's start, so nothing
//! appended before its first read is missed.
//!
//! A reader dropped (the client went away, or the answer was read whole) marks
//! the stream cancelled and deletes it, in one pipeline: the worker's next
//! append answers 0 and the upstream call is cut.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use tollgate_core::config::Config;
use tollgate_core::error::StoreError;
use tollgate_core::id::RequestId;
use tollgate_core::job::Job;
use tollgate_core::stream::{
    Continuity, JobStreams, Read, StreamEntry, StreamEvent, StreamReader, StreamWriter,
    STREAM_CAPACITY, STREAM_TTL,
};

use crate::call;
use crate::keys::{JobKeys, KeySpace};
use crate::pool::{blocking_connection, Blocking, Pool, DEFAULT_TIMEOUT};
use crate::scripts::{self, StreamPush};
use tollgate_core::lock;

/// The Redis side of [`JobStreams`].
#[derive(Debug)]
pub struct RedisStreams {
    pool: Pool,
    keys: KeySpace,
    config: Arc<Config>,
    /// Idle connections for `XREAD BLOCK`, one per open reader.
    idle: Arc<Mutex<Vec<Blocking>>>,
    timeout: Duration,
}

impl RedisStreams {
    pub fn new(pool: Pool, keys: KeySpace, config: Arc<Config>) -> Self {
        Self {
            pool,
            keys,
            config,
            idle: Arc::new(Mutex::new(Vec::new())),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    fn job_keys(&self, operation: &str) -> Result<JobKeys, StoreError> {
        let op = self
            .config
            .operation(operation)
            .ok_or_else(|| StoreError::backend(format!("no operation {operation:?} to stream")))?;
        Ok(self.keys.jobs(&op.name))
    }
}

/// The kind letter of an event in the stream and its text, and back (a
/// head rides with the next event: [`RedisWriter::push`]).
fn kind(event: &StreamEvent) -> (&'static str, &str) {
    match event {
        StreamEvent::Head(_) => ("", ""),
        StreamEvent::Data(t) => ("d", t),
        StreamEvent::End => ("x", ""),
        StreamEvent::Error(t) => ("e", t),
    }
}

#[derive(Debug)]
struct RedisWriter {
    pool: Pool,
    keys: JobKeys,
    id: String,
    attempt: u32,
    seq: std::sync::atomic::AtomicU64,
    /// A head held back to ride with the next event (one round trip less
    /// before the first token).
    head: Mutex<Option<String>>,
    timeout: Duration,
}

#[async_trait]
impl StreamWriter for RedisWriter {
    async fn push(&self, event: StreamEvent) -> Result<bool, StoreError> {
        if let StreamEvent::Head(h) = &event {
            let json = serde_json::to_string(h)
                .map_err(|e| StoreError::backend(format!("a stream's head as JSON: {e}")))?;
            *lock(&self.head) = Some(json);
            return Ok(true);
        }
        let head = lock(&self.head).take().unwrap_or_default();
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let (kind, text) = kind(&event);
        let inv = scripts::stream_push(
            &self.keys,
            &self.id,
            StreamPush {
                attempt: self.attempt,
                seq,
                kind,
                text,
                maxlen: STREAM_CAPACITY,
                ttl_ms: u64::try_from(STREAM_TTL.as_millis()).unwrap_or(u64::MAX),
                head: &head,
            },
        );
        let appended: i64 = call::script(&self.pool, self.timeout, "stream_push", &inv).await?;
        Ok(appended == 1)
    }
}

struct RedisReader {
    pool: Pool,
    keys: JobKeys,
    id: String,
    conn: Option<Blocking>,
    idle: Arc<Mutex<Vec<Blocking>>>,
    /// The id of the last entry read (`0`: from the start).
    last: String,
    buffered: VecDeque<StreamEntry>,
    continuity: Continuity,
    timeout: Duration,
}

impl std::fmt::Debug for RedisReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisReader")
            .field("stream", &self.keys.stream(&self.id))
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl Drop for RedisReader {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            lock(&self.idle).push(conn);
        }
        // Nobody reads any more: the writer's next append is refused, and the
        // stream goes now (its TTL would take it anyway).
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(self.keys.stream_cancel(&self.id))
            .arg(1)
            .arg("PX")
            .arg(u64::try_from(STREAM_TTL.as_millis()).unwrap_or(u64::MAX))
            .ignore()
            .cmd("DEL")
            .arg(self.keys.stream(&self.id))
            .ignore();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) =
                    call::pipeline::<()>(&pool, timeout, "stream_cancel", &pipe).await
                {
                    tracing::debug!(error = %e, "marking a stream cancelled failed; its TTL ends it");
                }
            });
        }
    }
}

/// A field of an entry's `[field, value, ...]` list.
fn field<'a>(fields: &'a [Value], name: &str) -> Option<&'a [u8]> {
    fields.chunks(2).find_map(|kv| match kv {
        [Value::BulkString(k), Value::BulkString(v)] if k == name.as_bytes() => Some(v.as_slice()),
        _ => None,
    })
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// The entries of an `XREAD` reply of one stream (RESP2 array or RESP3 map),
/// with the id of the last.
fn entries(reply: Value) -> Result<Vec<(String, StreamEntry)>, StoreError> {
    let bad = || StoreError::backend("unexpected XREAD reply");
    let per_stream: Vec<Value> = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .map(|s| match s {
                Value::Array(mut kv) if kv.len() == 2 => Ok(kv.remove(1)),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        Value::Map(streams) => streams.into_iter().map(|(_, v)| v).collect(),
        _ => return Err(bad()),
    };
    let mut out = Vec::new();
    for list in per_stream {
        let Value::Array(items) = list else {
            return Err(bad());
        };
        for item in items {
            let Value::Array(parts) = item else {
                return Err(bad());
            };
            let [id, Value::Array(fields)] = parts.as_slice() else {
                return Err(bad());
            };
            let id = text(id).ok_or_else(bad)?;
            let num = |name| {
                field(fields, name)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| v.parse::<u64>().ok())
            };
            let body = field(fields, "t").map(|t| String::from_utf8_lossy(t).into_owned());
            let event = match (field(fields, "k"), body) {
                (Some(b"d"), Some(t)) => StreamEvent::Data(t),
                (Some(b"x"), _) => StreamEvent::End,
                (Some(b"e"), t) => StreamEvent::Error(t.unwrap_or_default()),
                _ => return Err(bad()),
            };
            let (Some(attempt), Some(seq)) = (num("a"), num("s")) else {
                return Err(bad());
            };
            let attempt = u32::try_from(attempt).unwrap_or(u32::MAX);
            if let Some(head) = field(fields, "h") {
                let head = serde_json::from_slice(head).map_err(|_| bad())?;
                out.push((
                    id.clone(),
                    StreamEntry {
                        attempt,
                        seq,
                        event: StreamEvent::Head(head),
                    },
                ));
            }
            out.push((
                id,
                StreamEntry {
                    attempt,
                    seq,
                    event,
                },
            ));
        }
    }
    Ok(out)
}

/// How long a reader keeps trying to read again after its connection failed
/// (Redis restarting): a stream that survived (AOF) is read on from where it
/// was; one that did not shows a gap, which ends the client's stream.
const REREAD_FOR: Duration = Duration::from_secs(3);
const REREAD_PAUSE: Duration = Duration::from_millis(100);

#[async_trait]
impl StreamReader for RedisReader {
    async fn next(&mut self, wait: Duration) -> Result<Read, StoreError> {
        if let Some(entry) = self.buffered.pop_front() {
            return Ok(Read::Event(self.continuity.accept(entry)));
        }
        let failed_since = tokio::time::Instant::now();
        loop {
            match self.read(wait).await {
                Ok(read) => return Ok(read),
                Err(e) if failed_since.elapsed() < REREAD_FOR => {
                    tracing::debug!(error = %e, "reading a stream failed; reading again from where it was");
                    tokio::time::sleep(REREAD_PAUSE).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl RedisReader {
    /// One `XREAD BLOCK` from the last entry read.
    async fn read(&mut self, wait: Duration) -> Result<Read, StoreError> {
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => {
                let idle = lock(&self.idle).pop();
                match idle {
                    Some(c) => c,
                    None => blocking_connection(&self.pool).await?,
                }
            }
        };
        let block_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(64)
            .arg("BLOCK")
            .arg(block_ms)
            .arg("STREAMS")
            .arg(self.keys.stream(&self.id))
            .arg(&self.last);
        // A failed connection is dropped, never reused: it may still block.
        let reply: Value = call::dedicated(&mut conn, wait + self.timeout, "xread", &cmd).await?;
        self.conn = Some(conn);
        for (id, entry) in entries(reply)? {
            self.last = id;
            self.buffered.push_back(entry);
        }
        Ok(match self.buffered.pop_front() {
            Some(entry) => Read::Event(self.continuity.accept(entry)),
            None => Read::Idle,
        })
    }
}

#[async_trait]
impl JobStreams for RedisStreams {
    async fn open(
        &self,
        operation: &str,
        id: &RequestId,
    ) -> Result<Box<dyn StreamReader>, StoreError> {
        let keys = self.job_keys(operation)?;
        // A connection now, so that the first read does not wait for one.
        let idle = lock(&self.idle).pop();
        let conn = match idle {
            Some(c) => c,
            None => blocking_connection(&self.pool).await?,
        };
        Ok(Box::new(RedisReader {
            pool: self.pool.clone(),
            keys,
            id: id.as_str().to_owned(),
            conn: Some(conn),
            idle: Arc::clone(&self.idle),
            last: "0".into(),
            buffered: VecDeque::new(),
            continuity: Continuity::default(),
            timeout: self.timeout,
        }))
    }

    fn writer(&self, job: &Job) -> Arc<dyn StreamWriter> {
        Arc::new(RedisWriter {
            pool: self.pool.clone(),
            keys: self.keys.jobs(&job.operation),
            id: job.id.as_str().to_owned(),
            attempt: job.attempt,
            seq: std::sync::atomic::AtomicU64::new(0),
            head: Mutex::new(None),
            timeout: self.timeout,
        })
    }
}
