//! The alerts family (`lua/alerts/`): the due set and each subject's outbox
//! (see each script's header and `tollgate_redis::alerts`).

use redis::Value;

use super::reply::{signed, text};
use crate::keys::OutboxKeys;

eval_scripts!(static ALERT_EVAL in "alerts" {
    ALERT_TAKE = "alert_take" clock;
    ALERT_LEASE = "alert_lease" clock;
    ALERT_DONE = "alert_done" clock;
    ALERT_POINT = "alert_point";
});

/// `alert_take.lua`: leases up to `pointers` due outbox pointers of the due set
/// `due` for `lease_ms`.
pub fn alert_take<'a>(due: &str, pointers: usize, lease_ms: u64) -> redis::ScriptInvocation<'a> {
    let mut inv = ALERT_TAKE.prepare_invoke();
    inv.key(due).arg(pointers).arg(lease_ms);
    inv
}

/// `alert_take.lua`'s answer: the pointers leased (after two counts).
pub fn decode_alert_take(reply: &[Value]) -> Result<Vec<String>, String> {
    reply
        .iter()
        .skip(2)
        .map(|p| text(p).ok_or_else(|| format!("{p:?}")))
        .collect()
}

/// `alert_lease.lua`: leases up to `max` of an outbox's due alerts for `lease_ms`.
pub fn alert_lease<'a>(
    keys: &OutboxKeys,
    max: usize,
    lease_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = ALERT_LEASE.prepare_invoke();
    inv.key(&keys.alerts)
        .key(&keys.alertq)
        .key(&keys.meta)
        .arg(max)
        .arg(lease_ms);
    inv
}

/// `alert_lease.lua`'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertsLeased {
    /// Redis `TIME` (ms).
    pub now_ms: u64,
    /// When the outbox is next due (ms; -1: empty).
    pub next_due: i64,
    /// Alerts dropped as past their keep.
    pub dropped: u64,
    /// `(id, record, attempt)` of each alert leased.
    pub leased: Vec<(String, String, u64)>,
}

impl AlertsLeased {
    /// Reads the reply; `Err` shows one of another shape.
    pub fn decode(r: &[Value]) -> Result<Self, String> {
        let bad = || format!("{r:?}");
        let num = |i: usize| r.get(i).and_then(signed).ok_or_else(bad);
        let (now, next_due, dropped) = (num(0)?, num(1)?, num(2)?);
        let rest = r.get(3..).unwrap_or_default();
        if !rest.len().is_multiple_of(3) {
            return Err(bad());
        }
        let leased = rest
            .chunks_exact(3)
            .map(|e| {
                let attempt = signed(&e[2]).and_then(|a| u64::try_from(a).ok());
                Some((text(&e[0])?, text(&e[1])?, attempt?))
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?;
        Ok(Self {
            now_ms: u64::try_from(now).unwrap_or(0),
            next_due,
            dropped: u64::try_from(dropped).unwrap_or(0),
            leased,
        })
    }
}

/// `alert_done.lua`: acks (`what` = "ack") or reschedules ("retry", after
/// `delay_ms`) attempt `attempt` of alert `id`; answers when the outbox is next due.
pub fn alert_done<'a>(
    keys: &OutboxKeys,
    id: &str,
    attempt: u32,
    what: &str,
    delay_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = ALERT_DONE.prepare_invoke();
    inv.key(&keys.alerts)
        .key(&keys.alertq)
        .arg(id)
        .arg(attempt)
        .arg(what)
        .arg(delay_ms);
    inv
}

/// `alert_point.lua`: moves `pointer` in the due set `due` to `next_due` (ms;
/// -1: its outbox is empty, the pointer goes unless a budget step added it since).
pub fn alert_point<'a>(due: &str, pointer: &str, next_due: i64) -> redis::ScriptInvocation<'a> {
    let mut inv = ALERT_POINT.prepare_invoke();
    inv.key(due).arg(pointer).arg(next_due);
    inv
}
