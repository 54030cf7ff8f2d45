//! The activity family (`lua/activity/`): the dashboard's recent events,
//! counters and history.

use redis::Value;
use tollgate_core::activity::{ActivityView, DenialView, Sampled, Spend};

use crate::keys::ActivityKeys;

eval_scripts!(static ACTIVITY_EVAL in "activity" {
    ACTIVITY_RECORD = "activity_record" clock;
    ACTIVITY_READ = "activity_read" clock;
    ACTIVITY_SAMPLE = "activity_sample" clock;
});

fn activity_keys(inv: &mut redis::ScriptInvocation<'_>, keys: &ActivityKeys, providers: &[String]) {
    inv.key(&keys.events)
        .key(&keys.refunded)
        .key(&keys.grants)
        .key(&keys.answers)
        .key(&keys.denials)
        .key(&keys.denied);
    for p in providers {
        inv.key(keys.waits(p));
    }
}

/// The caps of the activity log (`activity_record.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivityCaps {
    pub events: usize,
    pub waits: usize,
    pub denied: usize,
    pub idle_ms: u64,
    pub timelines: usize,
    pub steps: usize,
    pub failed: usize,
}

/// `activity_sample.lua`: the history's sample of the current slot of
/// `interval_ms`, with `gauges` (JSON), unless a pod wrote it already.
pub fn activity_sample<'a>(
    keys: &ActivityKeys,
    interval_ms: u64,
    span_ms: u64,
    max_samples: usize,
    idle_ms: u64,
    gauges: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = ACTIVITY_SAMPLE.prepare_invoke();
    inv.key(&keys.history)
        .key(&keys.calls)
        .key(&keys.grants)
        .key(&keys.answers)
        .key(&keys.denials);
    inv.arg(interval_ms)
        .arg(span_ms)
        .arg(max_samples)
        .arg(idle_ms)
        .arg(gauges);
    inv
}

/// `activity_record.lua`: `notes` encoded as the script reads them; a grant's
/// index counts from 1 in `providers`.
pub fn activity_record<'a>(
    keys: &ActivityKeys,
    providers: &[String],
    caps: ActivityCaps,
    notes: &[String],
) -> redis::ScriptInvocation<'a> {
    let mut inv = ACTIVITY_RECORD.prepare_invoke();
    inv.key(&keys.events)
        .key(&keys.refunded)
        .key(&keys.grants)
        .key(&keys.answers)
        .key(&keys.denials)
        .key(&keys.denied)
        .key(&keys.calls)
        .key(&keys.timelines)
        .key(&keys.timeline_order)
        .key(&keys.failed);
    for p in providers {
        inv.key(keys.waits(p));
    }
    inv.arg(caps.events)
        .arg(caps.waits)
        .arg(caps.idle_ms)
        .arg(caps.denied)
        .arg(caps.timelines)
        .arg(caps.steps)
        .arg(caps.failed);
    for n in notes {
        inv.arg(n);
    }
    inv
}

/// `activity_read.lua`
pub fn activity_read<'a>(
    keys: &ActivityKeys,
    providers: &[String],
    limit: usize,
) -> redis::ScriptInvocation<'a> {
    let mut inv = ACTIVITY_READ.prepare_invoke();
    activity_keys(&mut inv, keys, providers);
    inv.arg(limit).arg(tollgate_core::activity::DENIED_CAP);
    inv
}

// The replies, read beside the calls that ask them.

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items
            .iter()
            .filter_map(|i| redis::from_redis_value_ref::<String>(i).ok())
            .collect(),
        _ => Vec::new(),
    }
}

/// The `(field, count)` pairs of a flat HGETALL reply.
fn counters(v: &Value) -> impl Iterator<Item = (String, u64)> {
    strings(v)
        .chunks_exact(2)
        .filter_map(|kv| Some((kv[0].clone(), kv[1].parse::<u64>().ok()?)))
        .collect::<Vec<_>>()
        .into_iter()
}

/// `activity_read.lua`'s answer, for `providers` (the order its keys were
/// given in); `Err` shows a reply of another shape.
pub fn decode_activity_read(reply: &[Value], providers: &[String]) -> Result<ActivityView, String> {
    if reply.len() != 7 + providers.len() {
        return Err(format!("{reply:?}"));
    }
    let now_ms: u64 = redis::from_redis_value_ref(&reply[0]).map_err(|e| e.to_string())?;
    let refunded: std::collections::HashSet<String> = strings(&reply[2]).into_iter().collect();
    let events = strings(&reply[1])
        .iter()
        .filter_map(|j| serde_json::from_str::<Spend>(j).ok())
        .map(|spend| spend.view(refunded.contains(&spend.key)))
        .collect();
    let grants = counters(&reply[3]).collect();
    let mut answers: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>> =
        Default::default();
    for (field, n) in counters(&reply[4]) {
        if let Some((provider, class)) = field.split_once(' ') {
            answers
                .entry(provider.to_owned())
                .or_default()
                .insert(class.to_owned(), n);
        }
    }
    let denials = counters(&reply[5]).collect();
    let denied = strings(&reply[6])
        .iter()
        .filter_map(|d| {
            let mut parts = d.splitn(3, ' ');
            let at_ms = parts.next()?.parse().ok()?;
            let user = parts.next()?.to_owned();
            let operation = parts.next().map(str::to_owned);
            Some(DenialView {
                at_ms,
                user,
                operation,
            })
        })
        .collect();
    let waits = providers
        .iter()
        .zip(&reply[7..])
        .map(|(p, v)| {
            let samples = strings(v)
                .iter()
                .filter_map(|w| {
                    let (at, waited) = w.split_once(' ')?;
                    Some((at.parse().ok()?, waited.parse().ok()?))
                })
                .collect();
            (p.clone(), samples)
        })
        .collect();
    Ok(ActivityView {
        now_ms,
        events,
        grants,
        waits,
        answers,
        denials,
        denied,
    })
}

/// `activity_sample.lua`'s answer: `[written, slot_ms, next_in_ms]`.
pub fn decode_activity_sample(reply: &[u64]) -> Option<Sampled> {
    match *reply {
        [written, slot_ms, next_in] => Some(Sampled {
            written: written == 1,
            slot_ms,
            next_in: std::time::Duration::from_millis(next_in),
        }),
        _ => None,
    }
}
