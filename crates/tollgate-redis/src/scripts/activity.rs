//! The activity family (`lua/activity/`): the dashboard's recent events,
//! counters and history.

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
