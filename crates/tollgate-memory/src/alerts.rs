//! The embedded alert outbox ([`MemoryAlerts`]): the in-memory ledger queues a
//! budget step's crossings into it, the deliverer of the same process drains
//! it. The contract (the alert, the crossings, the [`AlertOutbox`] trait) is
//! `tollgate_core::alerts`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use tollgate_core::alerts::{
    failure_text, Alert, AlertOutbox, Crossing, Deliveries, Leased, OutboxDepth, Taken, OUTBOX_MAX,
};
use tollgate_core::clock::Clock;
use tollgate_core::error::StoreError;

#[derive(Debug)]
struct Entry {
    alert: Alert,
    due: u64,
    attempt: u32,
}

#[derive(Debug, Default)]
struct Outbox {
    entries: BTreeMap<String, Entry>,
    seq: u64,
    dropped: u64,
    deliveries: Deliveries,
}

/// The embedded outbox: the in-memory ledger queues into it, the deliverer
/// of the same process drains it. The same semantics as the Redis outbox,
/// for one process.
#[derive(Debug, Clone)]
pub struct MemoryAlerts {
    inner: Arc<Mutex<Outbox>>,
    clock: Arc<dyn Clock>,
}

impl MemoryAlerts {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Arc::default(),
            clock,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends the crossings of one budget step of `kind` `subject`.
    pub fn queue(&self, kind: &str, subject: &str, crossings: Vec<Crossing>) {
        let mut out = self.lock();
        for c in crossings {
            out.seq += 1;
            let id = format!("{kind}:{subject}:{}-{}", c.at_ms, out.seq);
            let same_subject = |e: &Entry| e.alert.kind == kind && e.alert.subject == subject;
            if out.entries.values().filter(|e| same_subject(e)).count() >= OUTBOX_MAX {
                let oldest = out
                    .entries
                    .iter()
                    .filter(|(_, e)| same_subject(e))
                    .min_by_key(|(_, e)| e.due)
                    .map(|(id, _)| id.clone());
                if let Some(oldest) = oldest {
                    out.entries.remove(&oldest);
                    out.dropped += 1;
                }
            }
            let alert = Alert {
                id: id.clone(),
                kind: kind.to_owned(),
                subject: subject.to_owned(),
                window_ms: c.window_ms,
                threshold_bp: c.threshold_bp,
                used: c.used,
                limit: c.limit,
                at_ms: c.at_ms,
            };
            out.entries.insert(
                id,
                Entry {
                    alert,
                    due: c.at_ms,
                    attempt: 0,
                },
            );
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[async_trait]
impl AlertOutbox for MemoryAlerts {
    async fn take(&self, max: usize, lease: Duration) -> Result<Taken, StoreError> {
        let now = self.clock.now_ms();
        let mut out = self.lock();
        let mut due: Vec<(u64, String)> = out
            .entries
            .iter()
            .filter(|(_, e)| e.due <= now)
            .map(|(id, e)| (e.due, id.clone()))
            .collect();
        due.sort();
        due.truncate(max);
        let mut alerts = Vec::with_capacity(due.len());
        for (_, id) in due {
            if let Some(e) = out.entries.get_mut(&id) {
                e.attempt += 1;
                e.due = now.saturating_add(ms(lease));
                alerts.push(Leased {
                    outbox: format!("{}:{}", e.alert.kind, e.alert.subject),
                    alert: e.alert.clone(),
                    attempt: e.attempt,
                    now_ms: now,
                });
            }
        }
        let dropped = std::mem::take(&mut out.dropped);
        Ok(Taken { alerts, dropped })
    }

    async fn ack(&self, alert: &Leased) -> Result<(), StoreError> {
        self.lock().entries.remove(&alert.alert.id);
        Ok(())
    }

    async fn retry(&self, alert: &Leased, after: Duration) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        if let Some(e) = self.lock().entries.get_mut(&alert.alert.id) {
            if e.attempt == alert.attempt {
                e.due = now.saturating_add(ms(after));
            }
        }
        Ok(())
    }

    async fn note(&self, result: &str, n: u64, detail: Option<&str>) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let mut out = self.lock();
        let d = &mut out.deliveries;
        match result {
            "delivered" => d.delivered += n,
            "retried" => d.retried += n,
            _ => d.failed += n,
        }
        if let Some(detail) = detail {
            d.last_failure_ms = Some(now);
            d.last_failure = Some(failure_text(detail));
        }
        Ok(())
    }

    async fn deliveries(&self) -> Result<Deliveries, StoreError> {
        Ok(self.lock().deliveries.clone())
    }

    async fn depth(&self) -> Result<OutboxDepth, StoreError> {
        let now = self.clock.now_ms();
        let out = self.lock();
        let mut subjects = std::collections::HashSet::new();
        let mut first_due = u64::MAX;
        for e in out.entries.values() {
            subjects.insert((&e.alert.kind, &e.alert.subject));
            first_due = first_due.min(e.due);
        }
        Ok(OutboxDepth {
            subjects: subjects.len() as u64,
            overdue_ms: now.saturating_sub(first_due.min(now)),
        })
    }
}
