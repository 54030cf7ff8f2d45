//! The activity log of one process, in memory ([`MemoryActivity`]): a ring per
//! kind, bounded like the Redis log's capped keys. What is noted and read (the
//! [`ActivityLog`] trait, its notes and views, the caps) is
//! `tollgate_core::activity`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use tollgate_core::activity::{
    slot_of, ActivityLog, ActivityView, Counters, DenialView, FailedView, Gauges, JobNote, Note,
    Sample, Sampled, Spend, DENIED_CAP, EVENTS_CAP, FAILED_CAP, HISTORY_MAX_SAMPLES, HISTORY_SPAN,
    PLAIN, STEPS_CAP, TIMELINES_CAP, WAITS_CAP,
};
use tollgate_core::clock::{Clock, SystemClock};
use tollgate_core::error::StoreError;
use tollgate_core::lock;

/// The activity log of one process, in memory (the embedded mode).
#[derive(Debug)]
pub struct MemoryActivity {
    state: Mutex<MemoryState>,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryActivity {
    fn default() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }
}

#[derive(Debug, Default)]
struct MemoryState {
    events: VecDeque<Spend>,
    refunded: VecDeque<String>,
    refunded_set: HashSet<String>,
    grants: BTreeMap<String, u64>,
    waits: BTreeMap<String, VecDeque<(u64, u64)>>,
    answers: BTreeMap<String, BTreeMap<String, u64>>,
    denials: BTreeMap<String, u64>,
    denied: VecDeque<DenialView>,
    calls: BTreeMap<String, u64>,
    history: VecDeque<Sample>,
    timelines: HashMap<String, Vec<JobNote>>,
    /// Timelines' ids, newest first: the oldest goes past [`TIMELINES_CAP`].
    timeline_order: VecDeque<String>,
    failed: VecDeque<FailedView>,
}

impl MemoryActivity {
    pub fn new() -> Self {
        Self::default()
    }

    /// A log whose stamps and history slots read `clock` (tests).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            state: Mutex::default(),
            clock,
        }
    }
}

#[async_trait]
impl ActivityLog for MemoryActivity {
    fn note(&self, note: Note) {
        let mut st = lock(&self.state);
        match note {
            Note::Spent(spend) => {
                let name = spend.operation.clone().unwrap_or_else(|| PLAIN.to_owned());
                *st.calls.entry(name).or_default() += 1;
                st.events.push_front(spend);
                st.events.truncate(EVENTS_CAP);
            }
            Note::Job(note) => {
                if let Some(failed) = note.failure() {
                    st.failed.push_front(failed);
                    st.failed.truncate(FAILED_CAP);
                }
                if let Some(steps) = st.timelines.get_mut(&note.id) {
                    if steps.len() < STEPS_CAP {
                        steps.push(note);
                    }
                } else {
                    st.timeline_order.push_front(note.id.clone());
                    st.timelines.insert(note.id.clone(), vec![note]);
                    while st.timeline_order.len() > TIMELINES_CAP {
                        if let Some(old) = st.timeline_order.pop_back() {
                            st.timelines.remove(&old);
                        }
                    }
                }
            }
            Note::Refunded { key } => {
                if st.refunded_set.insert(key.clone()) {
                    st.refunded.push_front(key);
                }
                while st.refunded.len() > EVENTS_CAP {
                    if let Some(old) = st.refunded.pop_back() {
                        st.refunded_set.remove(&old);
                    }
                }
            }
            Note::Granted {
                provider,
                at_ms,
                waited_us,
            } => {
                *st.grants.entry(provider.clone()).or_default() += 1;
                let waits = st.waits.entry(provider).or_default();
                waits.push_front((at_ms, waited_us));
                waits.truncate(WAITS_CAP);
            }
            Note::Denied { user, operation } => {
                let name = operation.clone().unwrap_or_else(|| PLAIN.to_owned());
                *st.denials.entry(name).or_default() += 1;
                st.denied.push_front(DenialView {
                    at_ms: self.clock.now_ms(),
                    user,
                    operation,
                });
                st.denied.truncate(DENIED_CAP);
            }
            Note::Answered { provider, class } => {
                *st.answers
                    .entry(provider)
                    .or_default()
                    .entry(class.to_owned())
                    .or_default() += 1;
            }
        }
    }

    async fn read(&self) -> Result<ActivityView, StoreError> {
        let st = lock(&self.state);
        Ok(ActivityView {
            now_ms: self.clock.now_ms(),
            events: st
                .events
                .iter()
                .map(|s| s.view(st.refunded_set.contains(&s.key)))
                .collect(),
            grants: st.grants.clone(),
            waits: st
                .waits
                .iter()
                .map(|(p, w)| (p.clone(), w.iter().copied().collect()))
                .collect(),
            answers: st.answers.clone(),
            denials: st.denials.clone(),
            denied: st.denied.iter().cloned().collect(),
        })
    }

    async fn sample(&self, interval: Duration, gauges: &Gauges) -> Result<Sampled, StoreError> {
        let now = self.clock.now_ms();
        let (slot_ms, next_in) = slot_of(now, millis(interval));
        let mut st = lock(&self.state);
        let written = !st.history.iter().any(|s| s.at_ms == slot_ms);
        if written {
            let counters = Counters {
                calls: st.calls.clone(),
                grants: st.grants.clone(),
                answers: st
                    .answers
                    .iter()
                    .flat_map(|(p, by)| by.iter().map(move |(c, n)| (format!("{p} {c}"), *n)))
                    .collect(),
                denials: st.denials.clone(),
            };
            let at = st.history.partition_point(|s| s.at_ms < slot_ms);
            st.history.insert(
                at,
                Sample {
                    at_ms: slot_ms,
                    gauges: gauges.clone(),
                    counters,
                },
            );
        }
        let horizon = now.saturating_sub(millis(HISTORY_SPAN));
        while st
            .history
            .front()
            .is_some_and(|s| s.at_ms < horizon || st.history.len() > HISTORY_MAX_SAMPLES)
        {
            st.history.pop_front();
        }
        Ok(Sampled {
            written,
            slot_ms,
            next_in,
        })
    }

    async fn history(&self, after_ms: Option<u64>) -> Result<Vec<Sample>, StoreError> {
        let st = lock(&self.state);
        Ok(st
            .history
            .iter()
            .filter(|s| after_ms.is_none_or(|a| s.at_ms > a))
            .cloned()
            .collect())
    }

    async fn timelines(&self, ids: &[String]) -> Result<Vec<Vec<JobNote>>, StoreError> {
        let st = lock(&self.state);
        Ok(ids
            .iter()
            .map(|id| st.timelines.get(id).cloned().unwrap_or_default())
            .collect())
    }

    async fn failed(&self, limit: usize) -> Result<Vec<FailedView>, StoreError> {
        let st = lock(&self.state);
        Ok(st.failed.iter().take(limit).cloned().collect())
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tollgate_core::activity::JobStep;

    fn spend(i: u64, key: &str) -> Note {
        Note::Spent(Spend {
            at_ms: i,
            user: "u".into(),
            operation: None,
            service_key: None,
            cost: 1,
            request_id: format!("r{i}"),
            key: key.into(),
        })
    }

    /// One sample per slot however often it is asked, gaps where no one
    /// sampled, and never more than an hour and five minutes, nor more than
    /// [`HISTORY_MAX_SAMPLES`], kept.
    #[tokio::test]
    async fn memory_history_is_one_sample_per_slot_and_bounded() {
        let clock = Arc::new(tollgate_core::clock::ManualClock::new(1_000_000));
        let log = MemoryActivity::with_clock(clock.clone());
        let gauges = Gauges {
            workers: Some(2),
            ..Gauges::default()
        };
        let interval = Duration::from_secs(10);
        let first = log.sample(interval, &gauges).await.unwrap();
        assert!(first.written);
        assert_eq!(first.slot_ms, 1_000_000);
        assert_eq!(first.next_in, interval);
        // The same slot again (another pod): not written.
        clock.advance(Duration::from_secs(3));
        let again = log.sample(interval, &Gauges::default()).await.unwrap();
        assert!(!again.written);
        assert_eq!(again.slot_ms, first.slot_ms);
        assert_eq!(again.next_in, Duration::from_secs(7));
        log.note(spend(1, "k1"));
        // Two slots skipped: a gap.
        clock.advance(Duration::from_secs(30));
        assert!(log.sample(interval, &gauges).await.unwrap().written);
        let h = log.history(None).await.unwrap();
        assert_eq!(
            h.iter().map(|s| s.at_ms).collect::<Vec<_>>(),
            vec![1_000_000, 1_030_000]
        );
        assert_eq!(h[0].gauges.workers, Some(2), "the first pod's gauges");
        assert_eq!(h[0].counters.calls.get(PLAIN), None);
        assert_eq!(h[1].counters.calls[PLAIN], 1);
        assert_eq!(log.history(Some(1_000_000)).await.unwrap().len(), 1);

        // Two hours of samples: only the last 65 minutes stay.
        for _ in 0..720 {
            clock.advance(interval);
            log.sample(interval, &gauges).await.unwrap();
        }
        let h = log.history(None).await.unwrap();
        // The clock is 3 s into its slot: 390 slots of 10 s start within the span.
        assert_eq!(h.len() as u64, HISTORY_SPAN.as_secs() / 10);
        let horizon = clock.now_ms() - HISTORY_SPAN.as_millis() as u64;
        assert!(h[0].at_ms >= horizon && h[0].at_ms < horizon + 10_000);
        // A tiny interval: never more than the cap.
        let tiny = Duration::from_millis(100);
        for _ in 0..(HISTORY_MAX_SAMPLES + 50) {
            clock.advance(tiny);
            log.sample(tiny, &gauges).await.unwrap();
        }
        assert_eq!(log.history(None).await.unwrap().len(), HISTORY_MAX_SAMPLES);
    }

    /// Timelines: steps in order per job, capped per job and in number, and
    /// failures listed newest first.
    #[tokio::test]
    async fn memory_timelines_are_bounded() {
        let log = MemoryActivity::new();
        let step = |id: &str, step: JobStep| {
            Note::Job(JobNote {
                id: id.into(),
                user: "u".into(),
                at_ms: 5,
                step,
            })
        };
        log.note(step(
            "a",
            JobStep::Charged {
                operation: "op".into(),
                cost: 3,
            },
        ));
        for _ in 0..(STEPS_CAP + 4) {
            log.note(step("a", JobStep::Started { run: 1 }));
        }
        log.note(step(
            "a",
            JobStep::Failed {
                operation: "op".into(),
                cause: "provider".into(),
                charge_stands: false,
                message: "bad\ngateway".into(),
            },
        ));
        let t = log.timelines(&["a".into(), "b".into()]).await.unwrap();
        assert_eq!(t[0].len(), STEPS_CAP);
        assert!(t[1].is_empty());
        let failed = log.failed(10).await.unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(
            (failed[0].id.as_str(), failed[0].cause.as_str()),
            ("a", "provider")
        );
        for i in 0..(TIMELINES_CAP + 1) {
            log.note(step(&format!("j{i}"), JobStep::Succeeded { charged: None }));
        }
        let t = log.timelines(&["a".into(), "j1".into()]).await.unwrap();
        assert!(t[0].is_empty(), "the oldest timeline went past the cap");
        assert_eq!(t[1].len(), 1);
    }

    #[tokio::test]
    async fn memory_log_is_bounded_and_marks_refunds() {
        let log = MemoryActivity::new();
        for i in 0..(EVENTS_CAP as u64 + 5) {
            log.note(spend(i, &format!("k{i}")));
        }
        log.note(Note::Refunded {
            key: format!("k{}", EVENTS_CAP + 4),
        });
        for i in 0..(WAITS_CAP as u64 + 3) {
            log.note(Note::Granted {
                provider: "p".into(),
                at_ms: i,
                waited_us: i,
            });
        }
        let view = log.read().await.unwrap();
        assert_eq!(view.events.len(), EVENTS_CAP);
        assert_eq!(view.events[0].at_ms, EVENTS_CAP as u64 + 4);
        assert!(view.events[0].refunded);
        assert!(!view.events[1].refunded);
        assert_eq!(view.grants["p"], WAITS_CAP as u64 + 3);
        assert_eq!(view.waits["p"].len(), WAITS_CAP);
        assert_eq!(
            view.waits["p"][0],
            (WAITS_CAP as u64 + 2, WAITS_CAP as u64 + 2)
        );
    }
}
