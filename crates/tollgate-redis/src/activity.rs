//! [`RedisActivity`]: the activity log ([`tollgate_core::activity`]) shared by
//! every pod. A note is buffered in the process and a task writes the buffer
//! every [`FLUSH_INTERVAL`] with one `activity_record.lua` call, so a budget
//! step or a grant never waits on it. A failed write is dropped (the log is
//! observational: a gap on the dashboard, never a wrong budget); the notes of
//! the last moments before a process exits may be lost the same way.
//!
//! The history is a sorted set of samples by their slot's start, written by
//! `activity_sample.lua` (the first pod to sample a slot writes it) and read
//! with `ZRANGEBYSCORE`; job timelines are one hash field per job, read with
//! `HMGET`, the failures a capped list.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use tollgate_core::activity::{
    ActivityLog, ActivityView, FailedView, Gauges, JobNote, Note, Sample, Sampled, DENIED_CAP,
    EVENTS_CAP, FAILED_CAP, FLUSH_INTERVAL, HISTORY_MAX_SAMPLES, HISTORY_SPAN, STEPS_CAP,
    TIMELINES_CAP, WAITS_CAP,
};
use tollgate_core::config::Config;
use tollgate_core::error::StoreError;

use crate::call::{self, bad_reply};
use crate::keys::{ActivityKeys, KeySpace};
use crate::pool::Pool;
use crate::scripts::{self, ActivityCaps};
use tollgate_core::lock;

/// Notes held at most between two writes; past it, new ones are dropped.
const BUFFER_CAP: usize = 10_000;
/// Notes written by one script call at most (the rest wait for the next).
const BATCH: usize = 1_000;
/// The activity keys live this long after their last write.
const IDLE: Duration = Duration::from_secs(24 * 3600);
/// How long a write or a read may take.
const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug)]
struct Shared {
    pool: Pool,
    keys: ActivityKeys,
    /// Config order: a grant note names its waits list by index here.
    providers: Vec<String>,
    buffer: Mutex<Vec<String>>,
}

/// The activity log on Redis; see the module docs.
#[derive(Debug)]
pub struct RedisActivity {
    shared: Arc<Shared>,
}

impl RedisActivity {
    /// The log of the deployment `keys` on `pool`; starts its writer task
    /// (which ends with the log). Needs a Tokio runtime.
    pub fn start(pool: Pool, keys: &KeySpace, config: &Config) -> Self {
        let shared = Arc::new(Shared {
            pool,
            keys: keys.activity(),
            providers: config.providers().map(|p| p.name.clone()).collect(),
            buffer: Mutex::new(Vec::new()),
        });
        tokio::spawn(write_loop(Arc::downgrade(&shared)));
        Self { shared }
    }

    /// Writes the buffered notes now (the writer task does it every
    /// [`FLUSH_INTERVAL`]).
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.shared.flush().await
    }
}

async fn write_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(FLUSH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(e) = shared.flush().await {
            tracing::debug!(error = %e, "activity notes dropped: the write failed");
        }
    }
}

impl Shared {
    async fn flush(&self) -> Result<(), StoreError> {
        loop {
            let notes: Vec<String> = {
                let mut buffer = lock(&self.buffer);
                let n = buffer.len().min(BATCH);
                buffer.drain(..n).collect()
            };
            if notes.is_empty() {
                return Ok(());
            }
            let caps = ActivityCaps {
                events: EVENTS_CAP,
                waits: WAITS_CAP,
                denied: DENIED_CAP,
                idle_ms: IDLE.as_millis() as u64,
                timelines: TIMELINES_CAP,
                steps: STEPS_CAP,
                failed: FAILED_CAP,
            };
            let inv = scripts::activity_record(&self.keys, &self.providers, caps, &notes);
            let _: u64 = call::script(&self.pool, TIMEOUT, "activity_record", &inv).await?;
        }
    }

    /// `note` as `activity_record.lua` reads it; `None` when it cannot be
    /// written (an unknown provider).
    fn encode(&self, note: Note) -> Option<String> {
        match note {
            Note::Spent(spend) => serde_json::to_string(&spend).ok().map(|j| format!("e {j}")),
            Note::Refunded { key } => Some(format!("r {key}")),
            Note::Granted {
                provider,
                at_ms,
                waited_us,
            } => {
                let i = self.providers.iter().position(|p| *p == provider)? + 1;
                Some(format!("g {i} {provider} {at_ms} {waited_us}"))
            }
            Note::Denied { user, operation } => Some(match operation {
                Some(op) if !op.contains(char::is_whitespace) => format!("d {user} {op}"),
                Some(_) => return None,
                None => format!("d {user}"),
            }),
            Note::Answered { provider, class } => self
                .providers
                .contains(&provider)
                .then(|| format!("a {provider} {class}")),
            Note::Job(note) => {
                let line = note.line();
                let plain = |s: &str| !s.is_empty() && !s.contains(char::is_whitespace);
                (plain(&note.id) && plain(&note.user)).then(|| format!("j {} {line}", note.id))
            }
        }
    }
}

#[async_trait]
impl ActivityLog for RedisActivity {
    fn note(&self, note: Note) {
        let Some(encoded) = self.shared.encode(note) else {
            return;
        };
        let mut buffer = lock(&self.shared.buffer);
        if buffer.len() < BUFFER_CAP {
            buffer.push(encoded);
        }
    }

    async fn read(&self) -> Result<ActivityView, StoreError> {
        let s = &self.shared;
        let inv = scripts::activity_read(&s.keys, &s.providers, EVENTS_CAP);
        let reply: Vec<Value> = call::script(&s.pool, TIMEOUT, "activity_read", &inv).await?;
        scripts::decode_activity_read(&reply, &s.providers)
            .map_err(|r| bad_reply::<StoreError>("activity_read", r))
    }

    async fn sample(&self, interval: Duration, gauges: &Gauges) -> Result<Sampled, StoreError> {
        let s = &self.shared;
        let gauges = serde_json::to_string(gauges)
            .map_err(|e| StoreError::backend(format!("gauges: {e}")))?;
        let inv = scripts::activity_sample(
            &s.keys,
            u64::try_from(interval.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            HISTORY_SPAN.as_millis() as u64,
            HISTORY_MAX_SAMPLES,
            IDLE.as_millis() as u64,
            &gauges,
        );
        let reply: Vec<u64> = call::script(&s.pool, TIMEOUT, "activity_sample", &inv).await?;
        scripts::decode_activity_sample(&reply)
            .ok_or_else(|| bad_reply::<StoreError>("activity_sample", reply))
    }

    async fn history(&self, after_ms: Option<u64>) -> Result<Vec<Sample>, StoreError> {
        let s = &self.shared;
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(&s.keys.history)
            .arg(after_ms.map_or("-inf".to_owned(), |a| format!("({a}")))
            .arg("+inf");
        let raw: Vec<String> = call::command(&s.pool, TIMEOUT, "activity_history", &cmd).await?;
        // A sample that does not parse (written by another version) is left
        // out: a gap, not an error.
        Ok(raw
            .iter()
            .filter_map(|j| serde_json::from_str::<Sample>(j).ok())
            .collect())
    }

    async fn timelines(&self, ids: &[String]) -> Result<Vec<Vec<JobNote>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.shared;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&s.keys.timelines).arg(ids);
        let raw: Vec<Option<String>> =
            call::command(&s.pool, TIMEOUT, "activity_timelines", &cmd).await?;
        Ok(ids
            .iter()
            .zip(raw)
            .map(|(id, lines)| {
                lines
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| JobNote::parse_line(id, l))
                    .collect()
            })
            .collect())
    }

    async fn failed(&self, limit: usize) -> Result<Vec<FailedView>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let s = &self.shared;
        let mut cmd = redis::cmd("LRANGE");
        cmd.arg(&s.keys.failed)
            .arg(0)
            .arg(limit.min(FAILED_CAP) - 1);
        let raw: Vec<String> = call::command(&s.pool, TIMEOUT, "activity_failed", &cmd).await?;
        Ok(raw
            .iter()
            .filter_map(|l| FailedView::parse_line(l))
            .collect())
    }
}
