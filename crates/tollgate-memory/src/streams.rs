//! Streamed answers in one process ([`MemoryStreams`]): a bounded channel per
//! open reader, so a slow reader holds the writer back, for at most
//! [`STREAM_FULL_WAIT`] per event: a channel full for longer refuses the
//! append (`Ok(false)`, as for a reader gone), so a reader that stopped
//! reading does not hold a worker slot for the whole upstream call. What a
//! stream carries and the [`JobStreams`] trait are `tollgate_core::stream`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;

use tollgate_core::error::StoreError;
use tollgate_core::id::RequestId;
use tollgate_core::job::Job;
use tollgate_core::stream::{
    Continuity, JobStreams, Read, StreamEntry, StreamEvent, StreamReader, StreamWriter,
    STREAM_CAPACITY, STREAM_FULL_WAIT,
};

/// The in-process streams: a bounded channel per open reader.
#[derive(Debug, Default)]
pub struct MemoryStreams {
    open: Arc<Mutex<HashMap<String, mpsc::Sender<StreamEntry>>>>,
}

impl MemoryStreams {
    pub fn new() -> Self {
        Self::default()
    }

    /// Streams with a reader open now.
    pub fn open_streams(&self) -> usize {
        tollgate_core::lock(&self.open).len()
    }
}

#[derive(Debug)]
struct MemoryReader {
    id: String,
    rx: mpsc::Receiver<StreamEntry>,
    open: Arc<Mutex<HashMap<String, mpsc::Sender<StreamEntry>>>>,
    continuity: Continuity,
}

impl Drop for MemoryReader {
    fn drop(&mut self) {
        tollgate_core::lock(&self.open).remove(&self.id);
    }
}

#[async_trait]
impl StreamReader for MemoryReader {
    async fn next(&mut self, wait: Duration) -> Result<Read, StoreError> {
        match tokio::time::timeout(wait, self.rx.recv()).await {
            Err(_) => Ok(Read::Idle),
            Ok(Some(entry)) => Ok(Read::Event(self.continuity.accept(entry))),
            // Every writer dropped; the reader's map entry keeps a sender,
            // so this only happens once the entry was replaced.
            Ok(None) => Ok(Read::Event(StreamEvent::Error(
                "the stream was closed".into(),
            ))),
        }
    }
}

#[derive(Debug)]
struct MemoryWriter {
    tx: Option<mpsc::Sender<StreamEntry>>,
    run: u32,
    seq: std::sync::atomic::AtomicU64,
}

#[async_trait]
impl StreamWriter for MemoryWriter {
    async fn push(&self, event: StreamEvent) -> Result<bool, StoreError> {
        let Some(tx) = &self.tx else {
            // Nobody opened a reader (an operation call that asked to
            // stream): the events go nowhere, the call runs to its end.
            return Ok(true);
        };
        let seq = match event {
            StreamEvent::Head(_) => self.seq.load(std::sync::atomic::Ordering::SeqCst),
            _ => self.seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1,
        };
        let entry = StreamEntry {
            run: self.run,
            seq,
            event,
        };
        match tokio::time::timeout(STREAM_FULL_WAIT, tx.send(entry)).await {
            Ok(sent) => Ok(sent.is_ok()),
            // Full for the whole wait: the reader is that far behind.
            Err(_) => Ok(false),
        }
    }
}

#[async_trait]
impl JobStreams for MemoryStreams {
    async fn open(
        &self,
        _operation: &str,
        id: &RequestId,
    ) -> Result<Box<dyn StreamReader>, StoreError> {
        let (tx, rx) = mpsc::channel(STREAM_CAPACITY);
        tollgate_core::lock(&self.open).insert(id.as_str().to_owned(), tx);
        Ok(Box::new(MemoryReader {
            id: id.as_str().to_owned(),
            rx,
            open: Arc::clone(&self.open),
            continuity: Continuity::default(),
        }))
    }

    fn writer(&self, job: &Job) -> Arc<dyn StreamWriter> {
        Arc::new(MemoryWriter {
            tx: tollgate_core::lock(&self.open)
                .get(job.id.as_str())
                .cloned(),
            run: job.run,
            seq: std::sync::atomic::AtomicU64::new(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_job(id: &str) -> Job {
        tollgate_core::testing::job(id, "op", "p", serde_json::json!({"stream": true}))
    }

    #[tokio::test]
    async fn memory_streams_pass_events_and_tell_the_writer_when_the_reader_left() {
        let streams = MemoryStreams::new();
        let job = stream_job("r1");
        let id = job.id.clone();
        let mut reader = streams.open("op", &id).await.unwrap();
        let writer = streams.writer(&job);
        assert!(writer
            .push(StreamEvent::Data("data: a".into()))
            .await
            .unwrap());
        assert!(writer.push(StreamEvent::End).await.unwrap());
        let wait = Duration::from_secs(1);
        assert_eq!(
            reader.next(wait).await.unwrap(),
            Read::Event(StreamEvent::Data("data: a".into()))
        );
        assert_eq!(
            reader.next(wait).await.unwrap(),
            Read::Event(StreamEvent::End)
        );
        assert_eq!(
            reader.next(Duration::from_millis(10)).await.unwrap(),
            Read::Idle
        );
        drop(reader);
        assert_eq!(streams.open_streams(), 0);
        assert!(!writer
            .push(StreamEvent::Data("data: b".into()))
            .await
            .unwrap());
        // No reader at all: the events go nowhere, the call goes on.
        assert!(streams.writer(&job).push(StreamEvent::End).await.unwrap());
    }

    /// A reader that reads nothing holds its writer back for at most
    /// [`STREAM_FULL_WAIT`] once the channel is full: then the append is
    /// refused, as for a reader gone.
    #[tokio::test(start_paused = true)]
    async fn a_full_channel_refuses_the_append_after_its_wait() {
        let streams = MemoryStreams::new();
        let job = stream_job("r2");
        let id = job.id.clone();
        let _reader = streams.open("op", &id).await.unwrap();
        let writer = streams.writer(&job);
        for _ in 0..STREAM_CAPACITY {
            assert!(writer
                .push(StreamEvent::Data("data: x".into()))
                .await
                .unwrap());
        }
        let start = tokio::time::Instant::now();
        assert!(!writer
            .push(StreamEvent::Data("data: y".into()))
            .await
            .unwrap());
        assert_eq!(start.elapsed(), STREAM_FULL_WAIT);
    }
}
