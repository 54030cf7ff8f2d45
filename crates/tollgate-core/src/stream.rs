//! Streamed answers: a job whose input asks to stream (`"stream": true`)
//! has its upstream's Server-Sent Events forwarded, as they arrive, from the
//! worker that runs it to the api pod that holds its client ([`JobStreams`]).
//!
//! The api opens the job's [`StreamReader`] before it submits the job (no
//! event can be missed); the worker appends through a [`StreamWriter`]. Each
//! event carries the run (`attempt`) that wrote it and its place in that run
//! (`seq`, from 1): a reader that sees a second run, or a gap (it fell behind
//! a bounded stream), ends the client's stream with an error instead of
//! presenting a repeated or truncated answer as whole. A writer learns that
//! the reader went away (the client disconnected) from its next append, and
//! the upstream call is cut.
//!
//! A stream nobody reads is bounded: the writer's append is refused, like a
//! reader gone (`Ok(false)`: the upstream call is cut), once the reader is
//! [`STREAM_FULL_WAIT`] behind (memory) or [`STREAM_BACKLOG_BYTES`] behind
//! (Redis).
//!
//! Memory: a bounded channel per stream, a slow reader holds the writer back
//! for at most [`STREAM_FULL_WAIT`] (`tollgate-memory`).
//! Redis: a Redis Stream per job, its unread backlog bounded in bytes and
//! expiring; an api pod reads its open streams through a hub of few
//! connections (`tollgate-redis`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::StoreError;
use crate::id::RequestId;
use crate::job::Job;

/// One entry of a job's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// The upstream answer's status and safe headers, before its first
    /// event (only when not a plain 200). It takes no place in the run
    /// (`seq`): a writer may hold it back and send it with the next event.
    Head(crate::head::Head),
    /// One upstream event, its text as received (`event:`/`data:` lines,
    /// without the blank line that ended it).
    Data(String),
    /// The upstream's stream ended whole; the charge is settled.
    End,
    /// The stream cannot go on (the text says why): what came before is not
    /// the whole answer.
    Error(String),
}

/// A [`StreamEvent`] with the run that wrote it and its place in that run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntry {
    pub run: u32,
    /// 1 for a run's first event, then +1 for each.
    pub seq: u64,
    pub event: StreamEvent,
}

/// The most events a stream holds unread in memory (the channel's capacity).
pub const STREAM_CAPACITY: usize = 1024;
/// How long a memory writer waits for room in a full channel (its reader
/// is slow, or nobody reads) before its append is refused (`Ok(false)`, as
/// for a reader gone): a stream nobody reads does not hold a worker slot
/// for the whole upstream call.
pub const STREAM_FULL_WAIT: Duration = Duration::from_secs(5);
/// The most unread bytes of a Redis stream: an append finding this many
/// (or more) not yet read is refused (`Ok(false)`, as for a reader gone),
/// so an unread stream holds at most this plus one event
/// ([`MAX_EVENT_BYTES`]). What counts is each entry's text and head plus a
/// fixed overhead per entry; the reader releases what it read in batches,
/// so a reader that keeps up stays far below.
pub const STREAM_BACKLOG_BYTES: u64 = 256 * 1024;
/// The most bytes of one upstream event; a longer one fails the stream.
pub const MAX_EVENT_BYTES: usize = 1 << 20;
/// How long a Redis stream outlives its last append (nobody read it, or the
/// reader went away).
pub const STREAM_TTL: Duration = Duration::from_secs(60);

/// What reading a stream came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    Event(StreamEvent),
    /// Nothing within the wait.
    Idle,
}

/// Checks each entry read: one run, no gap.
#[derive(Debug, Default, Clone)]
pub struct Continuity {
    run: Option<u32>,
    seq: u64,
}

impl Continuity {
    /// The event of `entry`, or an error event when it is of another run or
    /// out of order.
    pub fn accept(&mut self, entry: StreamEntry) -> StreamEvent {
        let first = *self.run.get_or_insert(entry.run);
        if entry.run != first {
            return StreamEvent::Error(
                "the worker streaming this answer stopped mid-stream; the answer is incomplete"
                    .into(),
            );
        }
        if let StreamEvent::Head(_) = entry.event {
            return entry.event; // No place in the run.
        }
        if entry.seq != self.seq + 1 {
            return StreamEvent::Error(format!(
                "the stream lost events (expected event {}, got {}): the reader fell behind; the answer is incomplete",
                self.seq + 1,
                entry.seq
            ));
        }
        self.seq = entry.seq;
        entry.event
    }
}

/// The api's end of one job's stream.
#[async_trait]
pub trait StreamReader: Send + fmt::Debug {
    /// The next event, waiting at most `wait` ([`Read::Idle`] then). Entries
    /// of another run or out of order come back as [`StreamEvent::Error`].
    async fn next(&mut self, wait: Duration) -> Result<Read, StoreError>;
}

/// The worker's end of one job's stream.
#[async_trait]
pub trait StreamWriter: Send + Sync + fmt::Debug {
    /// Appends `event`; `Ok(false)`: nobody reads it any more (the client
    /// went away), the call should stop.
    async fn push(&self, event: StreamEvent) -> Result<bool, StoreError>;
}

/// Where streamed jobs' events pass from worker to api.
#[async_trait]
pub trait JobStreams: Send + Sync + fmt::Debug {
    /// The reader of job `id` (of `operation`): open it before the job is
    /// submitted. Dropping it tells the writer nobody reads.
    async fn open(
        &self,
        operation: &str,
        id: &RequestId,
    ) -> Result<Box<dyn StreamReader>, StoreError>;

    /// The writer of `job`'s stream, for its current run.
    fn writer(&self, job: &Job) -> Arc<dyn StreamWriter>;
}

/// Streams nobody reads: each writer accepts every event and drops it
/// (`Ok(true)`: the call runs to its end), as a memory stream whose reader
/// was never opened does; no reader can be opened. The default of a worker
/// given no streams (`WorkerConfig::new`).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoReaders;

/// The writer of [`NoReaders`]: drops every event.
#[derive(Debug)]
struct Dropped;

#[async_trait]
impl StreamWriter for Dropped {
    async fn push(&self, _event: StreamEvent) -> Result<bool, StoreError> {
        Ok(true)
    }
}

#[async_trait]
impl JobStreams for NoReaders {
    async fn open(
        &self,
        _operation: &str,
        id: &RequestId,
    ) -> Result<Box<dyn StreamReader>, StoreError> {
        Err(StoreError::backend(format!(
            "the stream of {id} cannot be read: these streams have no readers"
        )))
    }

    fn writer(&self, _job: &Job) -> Arc<dyn StreamWriter> {
        Arc::new(Dropped)
    }
}

/// Whether a job's input asks for a streamed answer (`"stream": true`, the
/// OpenAI and Anthropic APIs' flag).
pub fn wants_stream(input: &serde_json::Value) -> bool {
    input.get("stream").and_then(serde_json::Value::as_bool) == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(run: u32, seq: u64) -> StreamEntry {
        StreamEntry {
            run,
            seq,
            event: StreamEvent::Data(format!("data: {seq}")),
        }
    }

    #[tokio::test]
    async fn no_readers_drops_every_event() {
        let job = crate::testing::job("r1", "op", "p", serde_json::json!({ "stream": true }));
        let writer = NoReaders.writer(&job);
        for event in [StreamEvent::Data("data: 1".into()), StreamEvent::End] {
            assert_eq!(writer.push(event).await, Ok(true));
        }
        assert!(NoReaders.open("op", &job.id).await.is_err());
    }

    #[test]
    fn a_second_run_or_a_gap_is_an_error() {
        let mut c = Continuity::default();
        assert_eq!(c.accept(entry(2, 1)), StreamEvent::Data("data: 1".into()));
        assert_eq!(c.accept(entry(2, 2)), StreamEvent::Data("data: 2".into()));
        // A head takes no place in the run.
        let head = crate::head::Head::safe(201, []);
        let e = StreamEntry {
            run: 2,
            seq: 2,
            event: StreamEvent::Head(head.clone()),
        };
        assert_eq!(c.accept(e), StreamEvent::Head(head));
        assert!(matches!(c.accept(entry(3, 1)), StreamEvent::Error(m) if m.contains("stopped")));
        assert!(matches!(c.accept(entry(2, 4)), StreamEvent::Error(m) if m.contains("lost")));
    }
}
