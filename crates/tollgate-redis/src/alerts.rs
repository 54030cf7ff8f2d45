//! The budget alerts' outbox on Redis ([`RedisAlerts`]).
//!
//! A budget step that crosses a threshold appends the alert to its subject's
//! outbox, in the subject's slot (`lua/budget/lib/alerts.lua`'s `queue_alert`), and
//! its caller adds the outbox's pointer to one due set
//! ([`KeySpace::alert_due`]; `RedisLedger` does, after the step). A
//! deliverer leases pointers that are due (`alert_take.lua`), then each
//! outbox's due alerts (`alert_lease.lua`), and after each attempt acks or
//! reschedules the alert (`alert_done.lua`) and moves the pointer to when the
//! outbox is next due, or removes it when it is empty (`alert_point.lua`). Each
//! step is one script; a deliverer that dies anywhere leaves leases that end,
//! and the alerts are due again.
//!
//! No alert is lost: the pointer is removed only by a deliverer that found
//! the outbox empty, and only when no budget step added it since (those set it
//! to minus their time). A caller that died between its budget step and adding the pointer
//! leaves meta's `a`: the subject's next budget step finds no deliverer has
//! looked for 10 s and its caller adds the pointer again.

use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use tollgate_core::alerts::{
    failure_text, Alert, AlertOutbox, Deliveries, Leased, OutboxDepth, Taken,
};
use tollgate_core::error::StoreError;

use crate::call::{self, bad_reply};
use crate::keys::KeySpace;
use crate::pool::{Pool, DEFAULT_TIMEOUT};
use crate::scripts;

/// Pointers one [`AlertOutbox::take`] leases at most.
const POINTERS: usize = 16;

#[derive(Debug, Clone)]
pub struct RedisAlerts {
    pool: Pool,
    keys: KeySpace,
    timeout: Duration,
}

impl RedisAlerts {
    pub fn new(pool: Pool, keys: KeySpace) -> Self {
        Self {
            pool,
            keys,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Moves `pointer` to `next_due` (ms; -1: its outbox is empty).
    async fn point(&self, pointer: &str, next_due: i64) -> Result<(), StoreError> {
        let inv = scripts::alert_point(&self.keys.alert_due(), pointer, next_due);
        call::script::<i64>(&self.pool, self.timeout, "alert_point", &inv).await?;
        Ok(())
    }

    async fn done(&self, alert: &Leased, what: &str, delay_ms: u64) -> Result<(), StoreError> {
        let keys = self
            .keys
            .outbox(&alert.outbox)
            .ok_or_else(|| bad_reply::<StoreError>("alert pointer", &alert.outbox))?;
        let inv = scripts::alert_done(&keys, &alert.alert.id, alert.attempt, what, delay_ms);
        let next: i64 = call::script(&self.pool, self.timeout, "alert_done", &inv).await?;
        self.point(&alert.outbox, next).await
    }
}

/// An outbox record: `<window_ms> <bp> <used> <limit> <at_ms> <kind> <name>`.
fn parse_record(id: String, rec: &str) -> Option<Alert> {
    let mut f = rec.splitn(7, ' ');
    let mut num = || f.next().and_then(|n| n.parse::<u64>().ok());
    let (window_ms, bp, used, limit, at_ms) = (num()?, num()?, num()?, num()?, num()?);
    let kind = f.next()?.to_owned();
    let subject = f.next()?.to_owned();
    Some(Alert {
        id,
        kind,
        subject,
        window_ms,
        threshold_bp: u32::try_from(bp).ok()?,
        used,
        limit,
        at_ms,
    })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[async_trait]
impl AlertOutbox for RedisAlerts {
    async fn take(&self, max: usize, lease: Duration) -> Result<Taken, StoreError> {
        let inv = scripts::alert_take(&self.keys.alert_due(), POINTERS.min(max.max(1)), ms(lease));
        let reply: Vec<Value> = call::script(&self.pool, self.timeout, "alert_take", &inv).await?;
        let pointers = scripts::decode_alert_take(&reply)
            .map_err(|r| bad_reply::<StoreError>("alert_take", r))?;
        let mut taken = Taken::default();
        for pointer in pointers {
            let Some(keys) = self.keys.outbox(&pointer) else {
                // Never written by tollgate: drop it.
                self.point(&pointer, -1).await?;
                continue;
            };
            let left = max.saturating_sub(taken.alerts.len()).max(1);
            let inv = scripts::alert_lease(&keys, left, ms(lease));
            let r: Vec<Value> = call::script(&self.pool, self.timeout, "alert_lease", &inv).await?;
            let bad = || bad_reply::<StoreError>("alert_lease", &r);
            let got = scripts::AlertsLeased::decode(&r).map_err(|_| bad())?;
            taken.dropped += got.dropped;
            for (id, rec, attempt) in got.leased {
                let alert = parse_record(id, &rec).ok_or_else(bad)?;
                taken.alerts.push(Leased {
                    alert,
                    attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
                    now_ms: got.now_ms,
                    outbox: pointer.clone(),
                });
            }
            // Alerts not leased (not due yet, or past `max`): look again when
            // the first is due; an empty outbox's pointer goes.
            self.point(&pointer, got.next_due).await?;
            if taken.alerts.len() >= max {
                break;
            }
        }
        Ok(taken)
    }

    async fn ack(&self, alert: &Leased) -> Result<(), StoreError> {
        self.done(alert, "ack", 0).await
    }

    async fn retry(&self, alert: &Leased, after: Duration) -> Result<(), StoreError> {
        self.done(alert, "retry", ms(after)).await
    }

    async fn note(&self, result: &str, n: u64, detail: Option<&str>) -> Result<(), StoreError> {
        // A count, and the last failure stamped with this pod's clock (a
        // dashboard line, not a decision): one round trip.
        let key = self.keys.alert_deliveries();
        let mut pipe = redis::pipe();
        pipe.cmd("HINCRBY").arg(&key).arg(result).arg(n).ignore();
        if let Some(detail) = detail {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            pipe.cmd("HSET")
                .arg(&key)
                .arg("last")
                .arg(format!("{now} {}", failure_text(detail)))
                .ignore();
        }
        let () = call::pipeline(&self.pool, self.timeout, "alert_note", &pipe).await?;
        Ok(())
    }

    async fn deliveries(&self) -> Result<Deliveries, StoreError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.keys.alert_deliveries())
            .arg("delivered")
            .arg("retried")
            .arg("failed")
            .arg("last");
        let mut pipe = redis::pipe();
        pipe.add_command(cmd);
        let ((delivered, retried, failed, last),): ((
            Option<u64>,
            Option<u64>,
            Option<u64>,
            Option<String>,
        ),) = call::read(&self.pool, self.timeout, "alert_deliveries", &pipe).await?;
        let (last_failure_ms, last_failure) = match last.as_deref().and_then(|l| l.split_once(' '))
        {
            Some((ms, why)) => (ms.parse().ok(), Some(why.to_owned())),
            None => (None, None),
        };
        Ok(Deliveries {
            delivered: delivered.unwrap_or(0),
            retried: retried.unwrap_or(0),
            failed: failed.unwrap_or(0),
            last_failure_ms,
            last_failure,
        })
    }

    async fn depth(&self) -> Result<OutboxDepth, StoreError> {
        let due = self.keys.alert_due();
        let mut pipe = redis::pipe();
        // The oldest pointer a budget step added (minus its time: the
        // greatest score <= 0) and the earliest time a deliverer set.
        pipe.cmd("ZCARD")
            .arg(&due)
            .cmd("ZRANGE")
            .arg(&due)
            .arg(0)
            .arg("-inf")
            .arg("BYSCORE")
            .arg("REV")
            .arg("LIMIT")
            .arg(0)
            .arg(1)
            .arg("WITHSCORES")
            .cmd("ZRANGE")
            .arg(&due)
            .arg("(0")
            .arg("+inf")
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(1)
            .arg("WITHSCORES")
            .cmd("TIME");
        type Reply = (u64, Vec<(String, f64)>, Vec<(String, f64)>, (u64, u64));
        let (subjects, queued, scheduled, time): Reply =
            call::read(&self.pool, self.timeout, "alert_depth", &pipe).await?;
        let now = time.0 * 1000 + time.1 / 1000;
        let since = |v: &[(String, f64)]| v.first().map(|(_, s)| s.abs() as u64);
        let overdue_ms = [since(&queued), since(&scheduled)]
            .into_iter()
            .flatten()
            .map(|t| now.saturating_sub(t))
            .max()
            .unwrap_or(0);
        Ok(OutboxDepth {
            subjects,
            overdue_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_with_the_name_last() {
        let a = parse_record("user:a:5-1".into(), "1000 8000 8 10 5 user a").expect("parses");
        assert_eq!(
            (a.window_ms, a.threshold_bp, a.used, a.limit),
            (1000, 8000, 8, 10)
        );
        assert_eq!((a.kind.as_str(), a.subject.as_str()), ("user", "a"));
        assert!(parse_record("x".into(), "1 2 3").is_none());
    }
}
