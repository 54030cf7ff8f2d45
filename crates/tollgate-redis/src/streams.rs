//! [`RedisStreams`]: streamed answers through Redis. One Redis Stream per
//! job (`{q:<operation>}:stream:<id>`, the queue's hash tag): the worker
//! appends each upstream event with `stream_push.lua` (expiring
//! [`STREAM_TTL`] after the last append, refused once the reader marked the
//! stream cancelled, and refused once [`STREAM_BACKLOG_BYTES`] are unread:
//! `stream-bytes:<id>` counts what was appended and not yet released by the
//! reader). The api pod holding the client reads it from the stream's start
//! (`0`), so nothing appended before its first read is missed.
//!
//! **The stream hub.** An api pod does not spend a connection per open
//! stream: per operation (one hash tag), a *hub connection* (a task and one
//! blocking connection, never the pool's multiplexed ones) reads up to
//! [`STREAMS_PER_CONNECTION`] open streams with one multi-key
//! `XREAD COUNT 32 BLOCK 1000 STREAMS <wake> <stream>... <id>...` (all keys
//! of one hash tag: cluster-safe), and hands each stream's entries to its
//! [`StreamReader`] through a small buffer. More open streams of the
//! operation open another hub connection. So a pod's stream connections are
//! **at most `sum over operations of ceil(n_op / 128)`**, `n_op` the most
//! streams of that operation open at once since its oldest hub connection
//! opened (a connection is closed only once it has no stream), and a hub
//! connection left without streams is closed within [`HUB_IDLE`] (plus one
//! block, 1 s): no connection outlives its streams for longer. On a Redis
//! Cluster a hub connection is a cluster connection of its own (a socket per
//! node it talks to).
//!
//! A stream opened (or resumed, below) while its hub connection blocks in
//! `XREAD` is read at once, not after the block: the opener `XADD`s to the
//! connection's wake stream (`stream-wake:<hub>`, `MAXLEN 1`, expiring),
//! which the blocked `XREAD` includes, so it returns and the next one reads
//! the new stream.
//!
//! **A slow reader.** Each reader's buffer holds at most 64 entries or
//! 128 KiB (plus one read: 32 entries); once full, the hub stops reading that
//! stream (its entries wait in Redis, bounded by [`STREAM_BACKLOG_BYTES`])
//! and goes on with the others, until the reader drained half of it. The hub
//! never waits for a reader.
//!
//! **Releasing what was read.** The hub trims what it read from each stream
//! (`stream_trim.lua`: `XTRIM MINID` and the unread bytes lowered), in
//! batches: one script call for all the streams of a hub connection due, a
//! stream being due after 32 entries, 64 KiB or 1 s; never a command per
//! event. The counted bytes are each entry's text and head plus
//! [`ENTRY_OVERHEAD`] ([`entry_bytes`]).
//!
//! **Failures.** A failed read is reported (a warning) and made again on a
//! new connection, from each stream's last entry read: a Redis restarted
//! within [`REREAD_FOR`] with its streams (AOF) loses nothing; a stream it
//! lost shows a gap, which ends the client's stream. A hub connection that
//! fails for longer ends each of its readers with the error.
//!
//! A reader dropped (the client went away, or the answer was read whole) marks
//! the stream cancelled and deletes it and its count, in one pipeline: the
//! worker's next append answers 0 and the upstream call is cut. An append
//! refused as full ends the call the same way (the writer sees `Ok(false)`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tollgate_core::config::Config;
use tollgate_core::error::StoreError;
use tollgate_core::id::RequestId;
use tollgate_core::job::Job;
use tollgate_core::lock;
use tollgate_core::stream::{
    Continuity, JobStreams, Read, StreamEntry, StreamEvent, StreamReader, StreamWriter,
    STREAM_BACKLOG_BYTES, STREAM_TTL,
};

use crate::call;
use crate::keys::{JobKeys, KeySpace};
use crate::pool::{blocking_connection, Blocking, Pool, DEFAULT_TIMEOUT};
use crate::scripts::reply::text;
use crate::scripts::{
    self, StreamPush, StreamTrim, STREAM_APPENDED, STREAM_CANCELLED, STREAM_FULL,
};

/// The most streams one hub connection reads.
pub const STREAMS_PER_CONNECTION: usize = 128;
/// How long a hub connection without streams stays open for the next one.
pub const HUB_IDLE: Duration = Duration::from_secs(5);
/// How long one hub `XREAD` blocks (what it waits for otherwise is a trim
/// due by time, and a stream resumed whose wake-up was lost).
const HUB_BLOCK: Duration = Duration::from_secs(1);
/// The most entries one `XREAD` takes of each stream.
const READ_COUNT: usize = 32;
/// A reader's buffer: the hub stops reading a stream whose reader holds this
/// many entries or bytes, and reads it again once half of them were taken.
const BUFFER_ENTRIES: usize = 64;
const BUFFER_BYTES: u64 = 128 * 1024;
/// A stream's entries read are released (`stream_trim.lua`) after this many
/// entries, bytes, or this long.
const TRIM_ENTRIES: u32 = 32;
const TRIM_BYTES: u64 = STREAM_BACKLOG_BYTES / 4;
const TRIM_AFTER: Duration = Duration::from_secs(1);
/// What an entry counts for beyond its text and head (its id and fields in
/// Redis), so that a flood of empty events is bounded too.
pub const ENTRY_OVERHEAD: u64 = 64;

/// How long a hub connection keeps trying to read again after a failure
/// (Redis restarting) before its readers end with the error.
const REREAD_FOR: Duration = Duration::from_secs(3);
const REREAD_PAUSE: Duration = Duration::from_millis(100);
const REREAD_PAUSE_MAX: Duration = Duration::from_secs(1);

/// The bytes an entry counts for in a stream's unread backlog, as
/// `stream_push.lua` adds them and `stream_trim.lua` takes them away.
pub fn entry_bytes(text: usize, head: usize) -> u64 {
    u64::try_from(text.saturating_add(head))
        .unwrap_or(u64::MAX)
        .saturating_add(ENTRY_OVERHEAD)
}

fn ttl_ms() -> u64 {
    u64::try_from(STREAM_TTL.as_millis()).unwrap_or(u64::MAX)
}

/// The Redis side of [`JobStreams`].
#[derive(Debug)]
pub struct RedisStreams {
    pool: Pool,
    keys: KeySpace,
    config: Arc<Config>,
    hub: Arc<Hub>,
    timeout: Duration,
}

impl RedisStreams {
    pub fn new(pool: Pool, keys: KeySpace, config: Arc<Config>) -> Self {
        Self {
            hub: Arc::new(Hub {
                pool: pool.clone(),
                timeout: DEFAULT_TIMEOUT,
                name: RequestId::generate().as_str().to_owned(),
                lanes: Mutex::new(HashMap::new()),
                serial: AtomicU64::new(0),
            }),
            pool,
            keys,
            config,
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

    /// The hub connections open now (each reads up to
    /// [`STREAMS_PER_CONNECTION`] streams).
    pub fn hub_connections(&self) -> usize {
        lock(&self.hub.lanes).values().map(Vec::len).sum()
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
    run: u32,
    seq: AtomicU64,
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
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let (kind, text) = kind(&event);
        let inv = scripts::stream_push(
            &self.keys,
            &self.id,
            StreamPush {
                run: self.run,
                seq,
                kind,
                text,
                backlog: STREAM_BACKLOG_BYTES,
                ttl_ms: ttl_ms(),
                head: &head,
                size: entry_bytes(text.len(), head.len()),
            },
        );
        let appended: i64 = call::script(&self.pool, self.timeout, "stream_push", &inv).await?;
        match appended {
            STREAM_APPENDED => Ok(true),
            STREAM_CANCELLED => Ok(false),
            STREAM_FULL => {
                tracing::info!(
                    stream = %self.keys.stream(&self.id),
                    bound = STREAM_BACKLOG_BYTES,
                    "a stream's reader is too far behind (or gone): its append was refused, the call stops"
                );
                Ok(false)
            }
            other => Err(call::bad_reply("stream_push", other)),
        }
    }
}

/// An entry id of a Redis Stream (`<ms>-<seq>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Sid {
    ms: u64,
    seq: u64,
}

impl Sid {
    fn parse(s: &str) -> Option<Self> {
        let (ms, seq) = s.split_once('-')?;
        Some(Self {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }

    /// The least id above this one (`XTRIM MINID` keeps it and what follows).
    fn next(self) -> Self {
        match self.seq.checked_add(1) {
            Some(seq) => Self { ms: self.ms, seq },
            None => Self {
                ms: self.ms.saturating_add(1),
                seq: 0,
            },
        }
    }
}

impl std::fmt::Display for Sid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// What passes from the hub to one reader.
#[derive(Debug, Default)]
struct Inbox {
    state: Mutex<InboxState>,
    ready: Notify,
}

#[derive(Debug, Default)]
struct InboxState {
    /// Entries read, each with the bytes it counted for.
    entries: VecDeque<(StreamEntry, u64)>,
    bytes: u64,
    /// The hub reads no more of this stream until the reader drained half.
    paused: bool,
    /// Why the stream cannot be read any more (after its entries).
    error: Option<String>,
}

impl Inbox {
    fn fail(&self, why: &str) {
        let mut st = lock(&self.state);
        if st.error.is_none() {
            st.error = Some(why.to_owned());
        }
        drop(st);
        self.ready.notify_one();
    }
}

/// The pod's stream hub: its hub connections ([`Lane`]s), by operation.
#[derive(Debug)]
struct Hub {
    pool: Pool,
    timeout: Duration,
    /// This pod's hub id, in its wake keys.
    name: String,
    lanes: Mutex<HashMap<String, Vec<Arc<Lane>>>>,
    /// Numbers the lanes and the readers.
    serial: AtomicU64,
}

/// One hub connection: a task reading up to [`STREAMS_PER_CONNECTION`]
/// streams of one operation on one blocking connection.
#[derive(Debug)]
struct Lane {
    keys: JobKeys,
    /// Its wake stream (`JobKeys::stream_wake`).
    wake: String,
    state: Mutex<LaneState>,
    /// A stream was added (wakes a lane that has none).
    opened: Notify,
}

#[derive(Debug, Default)]
struct LaneState {
    /// By job id.
    streams: HashMap<String, Slot>,
    /// An `XREAD` is on its way with the streams of its snapshot: a stream
    /// opened or resumed now needs a wake-up.
    reading: bool,
    /// The lane's task ended: no stream joins it any more.
    closed: bool,
}

#[derive(Debug)]
struct Slot {
    /// Which open of this id (a second open of one id replaces the first).
    serial: u64,
    inbox: Arc<Inbox>,
    key: String,
    /// The last entry read (`0-0`: from the start).
    last: Sid,
    /// Read and not yet released (`stream_trim.lua`).
    untrimmed_bytes: u64,
    untrimmed_entries: u32,
    trimmed_at: Instant,
}

/// A trim on its way, and what it released (to count again if it failed).
type Trimming = JoinHandle<Result<(), (Vec<(StreamTrim, u64)>, StoreError)>>;

impl Hub {
    /// Adds job `id`'s stream to a lane of `operation` with room (a new lane
    /// when none has): the lane, the slot's serial, whether the lane needs a
    /// wake-up to read it now.
    fn attach(
        self: &Arc<Self>,
        operation: &str,
        keys: &JobKeys,
        id: &str,
        inbox: &Arc<Inbox>,
    ) -> (Arc<Lane>, u64, bool) {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            serial,
            inbox: Arc::clone(inbox),
            key: keys.stream(id),
            last: Sid::default(),
            untrimmed_bytes: 0,
            untrimmed_entries: 0,
            trimmed_at: Instant::now(),
        };
        let mut lanes = lock(&self.lanes);
        let list = lanes.entry(operation.to_owned()).or_default();
        // A second open of one id replaces the first (whose reader ends).
        let mut pick = None;
        for lane in list.iter() {
            let st = lock(&lane.state);
            if st.closed {
                continue;
            }
            if st.streams.contains_key(id) {
                pick = Some(Arc::clone(lane));
                break;
            }
            if pick.is_none() && st.streams.len() < STREAMS_PER_CONNECTION {
                pick = Some(Arc::clone(lane));
            }
        }
        let lane = match pick {
            Some(lane) => lane,
            None => {
                let n = self.serial.fetch_add(1, Ordering::Relaxed);
                let lane = Arc::new(Lane {
                    keys: keys.clone(),
                    wake: keys.stream_wake(&format!("{}-{n}", self.name)),
                    state: Mutex::new(LaneState::default()),
                    opened: Notify::new(),
                });
                list.push(Arc::clone(&lane));
                tokio::spawn(Arc::clone(&lane).run(Arc::clone(self), operation.to_owned()));
                lane
            }
        };
        let mut st = lock(&lane.state);
        if let Some(old) = st.streams.insert(id.to_owned(), slot) {
            old.inbox
                .fail("another reader opened this stream; this one reads no more");
        }
        let reading = st.reading;
        drop(st);
        drop(lanes);
        lane.opened.notify_one();
        (lane, serial, reading)
    }
}

impl Lane {
    /// Makes the lane's blocked `XREAD` return, when one is on its way.
    async fn wake(&self, pool: &Pool, timeout: Duration) -> Result<(), StoreError> {
        if !lock(&self.state).reading {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.cmd("XADD")
            .arg(&self.wake)
            .arg("MAXLEN")
            .arg(1)
            .arg("*")
            .arg("w")
            .arg(1)
            .ignore()
            .cmd("PEXPIRE")
            .arg(&self.wake)
            .arg(ttl_ms())
            .ignore();
        call::pipeline::<()>(pool, timeout, "stream_wake", &pipe).await
    }

    /// Closes the lane if it has no stream (under the hub's lock, so that no
    /// stream joins it meanwhile).
    fn close(&self, hub: &Hub, operation: &str) -> bool {
        let mut lanes = lock(&hub.lanes);
        let mut st = lock(&self.state);
        if !st.streams.is_empty() {
            return false;
        }
        st.closed = true;
        if let Some(list) = lanes.get_mut(operation) {
            list.retain(|l| !std::ptr::eq(l.as_ref(), self));
            if list.is_empty() {
                lanes.remove(operation);
            }
        }
        true
    }

    /// The lane's task: reads its streams until it has had none for
    /// [`HUB_IDLE`].
    async fn run(self: Arc<Self>, hub: Arc<Hub>, operation: String) {
        let mut conn: Option<Blocking> = None;
        let mut wake_last = Sid::default();
        // Since when reads fail, and whether the readers were told.
        let mut failing: Option<(Instant, bool)> = None;
        let mut pause = REREAD_PAUSE;
        let mut trimming: Option<Trimming> = None;
        loop {
            self.trim(&hub, &mut trimming).await;
            let reads: Option<Vec<(String, u64, String, Sid)>> = {
                let mut st = lock(&self.state);
                if st.streams.is_empty() {
                    None
                } else {
                    st.reading = true;
                    Some(
                        st.streams
                            .iter()
                            .filter(|(_, s)| !lock(&s.inbox.state).paused)
                            .map(|(id, s)| (id.clone(), s.serial, s.key.clone(), s.last))
                            .collect(),
                    )
                }
            };
            let Some(reads) = reads else {
                failing = None;
                if tokio::time::timeout(HUB_IDLE, self.opened.notified())
                    .await
                    .is_err()
                    && self.close(&hub, &operation)
                {
                    if let Some(t) = trimming.take() {
                        let _ = t.await;
                    }
                    return; // The connection closes with `conn`.
                }
                continue;
            };
            let read = match conn.as_mut() {
                Some(c) => Ok(c),
                None => blocking_connection(&hub.pool)
                    .await
                    .map(|c| &mut *conn.insert(c)),
            };
            let reply = match read {
                Ok(c) => {
                    let mut cmd = redis::cmd("XREAD");
                    cmd.arg("COUNT")
                        .arg(READ_COUNT)
                        .arg("BLOCK")
                        .arg(u64::try_from(HUB_BLOCK.as_millis()).unwrap_or(1000))
                        .arg("STREAMS")
                        .arg(&self.wake);
                    for (_, _, key, _) in &reads {
                        cmd.arg(key);
                    }
                    cmd.arg(wake_last.to_string());
                    for (_, _, _, last) in &reads {
                        cmd.arg(last.to_string());
                    }
                    call::dedicated::<Value>(c, HUB_BLOCK + hub.timeout, "stream_hub_read", &cmd)
                        .await
                        .and_then(per_stream)
                }
                Err(e) => Err(e),
            };
            lock(&self.state).reading = false;
            match reply {
                Ok(streams) => {
                    if failing.take().is_some() {
                        tracing::info!(operation, "the stream hub reads again");
                    }
                    pause = REREAD_PAUSE;
                    self.dispatch(streams, &reads, &mut wake_last);
                }
                Err(e) => {
                    // A failed connection is dropped, never reused: it may still block.
                    conn = None;
                    let (since, told) = failing.get_or_insert((Instant::now(), false));
                    if since.elapsed() < REREAD_FOR {
                        tracing::warn!(operation, error = %e, "the stream hub's read failed; reading again from where each stream was");
                    } else if !*told {
                        *told = true;
                        let why = format!("reading the stream failed: {e}");
                        let st = lock(&self.state);
                        for slot in st.streams.values() {
                            slot.inbox.fail(&why);
                        }
                        tracing::warn!(operation, error = %e, streams = st.streams.len(), "the stream hub's reads keep failing; its streams end with the error");
                    } else {
                        tracing::debug!(operation, error = %e, "the stream hub's read failed again");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(REREAD_PAUSE_MAX);
                }
            }
        }
    }

    /// Hands each stream's entries to its reader.
    fn dispatch(
        &self,
        streams: Vec<(String, Vec<Value>)>,
        reads: &[(String, u64, String, Sid)],
        wake_last: &mut Sid,
    ) {
        let mut st = lock(&self.state);
        for (key, items) in streams {
            if key == self.wake {
                for item in &items {
                    if let Some(id) = item_id(item) {
                        *wake_last = (*wake_last).max(id);
                    }
                }
                continue;
            }
            let Some((id, serial, _, _)) = reads.iter().find(|r| r.2 == key) else {
                continue;
            };
            let Some(slot) = st.streams.get_mut(id).filter(|s| s.serial == *serial) else {
                continue; // Its reader left meanwhile.
            };
            let mut inbox = lock(&slot.inbox.state);
            for item in items {
                match entry(item) {
                    Ok((sid, _, _)) if sid <= slot.last => {}
                    Ok((sid, entries, bytes)) => {
                        slot.last = sid;
                        slot.untrimmed_bytes = slot.untrimmed_bytes.saturating_add(bytes);
                        slot.untrimmed_entries = slot.untrimmed_entries.saturating_add(1);
                        let n = entries.len();
                        for (i, e) in entries.into_iter().enumerate() {
                            inbox
                                .entries
                                .push_back((e, if i + 1 == n { bytes } else { 0 }));
                        }
                        inbox.bytes = inbox.bytes.saturating_add(bytes);
                    }
                    Err(e) => {
                        if inbox.error.is_none() {
                            inbox.error = Some(e.to_string());
                        }
                        break;
                    }
                }
            }
            if inbox.entries.len() >= BUFFER_ENTRIES || inbox.bytes >= BUFFER_BYTES {
                inbox.paused = true;
            }
            drop(inbox);
            slot.inbox.ready.notify_one();
        }
    }

    /// Releases what was read of the streams due (one script call for all,
    /// one at a time), after counting again what a failed one did not.
    async fn trim(&self, hub: &Hub, trimming: &mut Option<Trimming>) {
        if trimming.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        if let Some(done) = trimming.take() {
            if let Ok(Err((trims, e))) = done.await {
                tracing::warn!(error = %e, streams = trims.len(), "releasing what the stream hub read failed; it is released with the next");
                let mut st = lock(&self.state);
                for (t, serial) in trims {
                    if let Some(slot) = st.streams.get_mut(&t.id).filter(|s| s.serial == serial) {
                        slot.untrimmed_bytes = slot.untrimmed_bytes.saturating_add(t.bytes);
                        slot.untrimmed_entries = slot.untrimmed_entries.saturating_add(1);
                    }
                }
            }
        }
        let due: Vec<(StreamTrim, u64)> = {
            let mut st = lock(&self.state);
            let now = Instant::now();
            st.streams
                .iter_mut()
                .filter(|(_, s)| {
                    s.untrimmed_entries > 0
                        && (s.untrimmed_entries >= TRIM_ENTRIES
                            || s.untrimmed_bytes >= TRIM_BYTES
                            || now.duration_since(s.trimmed_at) >= TRIM_AFTER)
                })
                .map(|(id, s)| {
                    let t = StreamTrim {
                        id: id.clone(),
                        minid: s.last.next().to_string(),
                        bytes: s.untrimmed_bytes,
                    };
                    s.untrimmed_bytes = 0;
                    s.untrimmed_entries = 0;
                    s.trimmed_at = now;
                    (t, s.serial)
                })
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let (pool, timeout, keys) = (hub.pool.clone(), hub.timeout, self.keys.clone());
        *trimming = Some(tokio::spawn(async move {
            let trims: Vec<StreamTrim> = due.iter().map(|(t, _)| t.clone()).collect();
            let inv = scripts::stream_trim(&keys, &trims);
            match call::script::<i64>(&pool, timeout, "stream_trim", &inv).await {
                Ok(_) => Ok(()),
                Err(e) => Err((due, e)),
            }
        }));
    }
}

struct RedisReader {
    pool: Pool,
    keys: JobKeys,
    id: String,
    lane: Arc<Lane>,
    serial: u64,
    inbox: Arc<Inbox>,
    continuity: Continuity,
    timeout: Duration,
}

impl std::fmt::Debug for RedisReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisReader")
            .field("stream", &self.keys.stream(&self.id))
            .field("lane", &self.lane.wake)
            .finish_non_exhaustive()
    }
}

impl Drop for RedisReader {
    fn drop(&mut self) {
        {
            let mut st = lock(&self.lane.state);
            if st
                .streams
                .get(&self.id)
                .is_some_and(|s| s.serial == self.serial)
            {
                st.streams.remove(&self.id);
            }
        }
        // Nobody reads any more: the writer's next append is refused, and the
        // stream goes now (its TTL would take it anyway).
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(self.keys.stream_cancel(&self.id))
            .arg(1)
            .arg("PX")
            .arg(ttl_ms())
            .ignore()
            .cmd("DEL")
            .arg(self.keys.stream(&self.id))
            .arg(self.keys.stream_bytes(&self.id))
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

#[async_trait]
impl StreamReader for RedisReader {
    async fn next(&mut self, wait: Duration) -> Result<Read, StoreError> {
        let deadline = Instant::now() + wait;
        loop {
            let (entry, resume) = {
                let mut st = lock(&self.inbox.state);
                match st.entries.pop_front() {
                    Some((entry, bytes)) => {
                        st.bytes = st.bytes.saturating_sub(bytes);
                        let resume = st.paused
                            && st.entries.len() <= BUFFER_ENTRIES / 2
                            && st.bytes <= BUFFER_BYTES / 2;
                        if resume {
                            st.paused = false;
                        }
                        (Some(entry), resume)
                    }
                    None => match &st.error {
                        Some(why) => return Err(StoreError::unavailable(why.clone())),
                        None => (None, false),
                    },
                }
            };
            if resume {
                let (lane, pool, timeout) =
                    (Arc::clone(&self.lane), self.pool.clone(), self.timeout);
                tokio::spawn(async move {
                    if let Err(e) = lane.wake(&pool, timeout).await {
                        tracing::debug!(error = %e, "waking the stream hub failed; it reads the stream after its block");
                    }
                });
            }
            if let Some(entry) = entry {
                return Ok(Read::Event(self.continuity.accept(entry)));
            }
            if tokio::time::timeout_at(deadline, self.inbox.ready.notified())
                .await
                .is_err()
            {
                return Ok(Read::Idle);
            }
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

fn bad() -> StoreError {
    StoreError::backend("unexpected XREAD reply")
}

/// The entries of an `XREAD` reply (RESP2 array or RESP3 map), by stream key.
fn per_stream(reply: Value) -> Result<Vec<(String, Vec<Value>)>, StoreError> {
    let pairs: Vec<(Value, Value)> = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .map(|s| match s {
                Value::Array(kv) if kv.len() == 2 => {
                    let mut kv = kv.into_iter();
                    match (kv.next(), kv.next()) {
                        (Some(k), Some(v)) => Ok((k, v)),
                        _ => Err(bad()),
                    }
                }
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        Value::Map(streams) => streams,
        _ => return Err(bad()),
    };
    pairs
        .into_iter()
        .map(|(k, v)| match (text(&k), v) {
            (Some(k), Value::Array(items)) => Ok((k, items)),
            _ => Err(bad()),
        })
        .collect()
}

/// The id of one `[id, [field, value, ...]]` entry.
fn item_id(item: &Value) -> Option<Sid> {
    match item {
        Value::Array(parts) => parts.first().and_then(text).and_then(|s| Sid::parse(&s)),
        _ => None,
    }
}

/// One entry read: its id, its events (a head riding with it first) and the
/// bytes it counted for ([`entry_bytes`]).
fn entry(item: Value) -> Result<(Sid, Vec<StreamEntry>, u64), StoreError> {
    let id = item_id(&item).ok_or_else(bad)?;
    let Value::Array(parts) = item else {
        return Err(bad());
    };
    let Some(Value::Array(fields)) = parts.get(1) else {
        return Err(bad());
    };
    let num = |name| {
        field(fields, name)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    let raw_text = field(fields, "t");
    let raw_head = field(fields, "h");
    let bytes = entry_bytes(
        raw_text.map_or(0, <[u8]>::len),
        raw_head.map_or(0, <[u8]>::len),
    );
    let body = raw_text.map(|t| String::from_utf8_lossy(t).into_owned());
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
    let mut out = Vec::with_capacity(2);
    if let Some(head) = raw_head {
        let head = serde_json::from_slice(head).map_err(|_| bad())?;
        out.push(StreamEntry {
            run: attempt,
            seq,
            event: StreamEvent::Head(head),
        });
    }
    out.push(StreamEntry {
        run: attempt,
        seq,
        event,
    });
    Ok((id, out, bytes))
}

#[async_trait]
impl JobStreams for RedisStreams {
    async fn open(
        &self,
        operation: &str,
        id: &RequestId,
    ) -> Result<Box<dyn StreamReader>, StoreError> {
        let keys = self.job_keys(operation)?;
        let inbox = Arc::new(Inbox::default());
        let (lane, serial, reading) = self.hub.attach(operation, &keys, id.as_str(), &inbox);
        let reader = RedisReader {
            pool: self.pool.clone(),
            keys,
            id: id.as_str().to_owned(),
            lane,
            serial,
            inbox,
            continuity: Continuity::default(),
            timeout: self.timeout,
        };
        if reading {
            // A failure drops the reader (its stream is marked cancelled).
            reader.lane.wake(&self.pool, self.timeout).await?;
        }
        Ok(Box::new(reader))
    }

    fn writer(&self, job: &Job) -> Arc<dyn StreamWriter> {
        Arc::new(RedisWriter {
            pool: self.pool.clone(),
            keys: self.keys.jobs(&job.operation),
            id: job.id.as_str().to_owned(),
            run: job.run,
            seq: AtomicU64::new(0),
            head: Mutex::new(None),
            timeout: self.timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_order_and_step() {
        let a = Sid::parse("5-3").unwrap();
        assert_eq!(a.next().to_string(), "5-4");
        assert!(a < Sid::parse("5-10").unwrap());
        assert!(a < Sid::parse("6-0").unwrap());
        assert_eq!(
            Sid {
                ms: 7,
                seq: u64::MAX
            }
            .next()
            .to_string(),
            "8-0"
        );
        assert_eq!(Sid::parse("x"), None);
    }
}
