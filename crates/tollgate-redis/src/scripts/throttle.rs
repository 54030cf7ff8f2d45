//! The throttle family (`lua/throttle/`): a provider's buckets, its FIFO
//! and fair queues, grants, slots, pauses and usage.

use super::FunctionCall;
use crate::keys::ThrottleKeys;

library! {
    /// The throttle scripts, one function each of one library: the bucket
    /// and the fair queue are its prelude.
    static THROTTLE, const THROTTLE_SCRIPTS = "throttle" in "throttle" {
        prelude: ["bucket", "fair", "pool"],
        scripts: [
            "throttle_enqueue", "throttle_grant", "throttle_cancel", "throttle_enqueue_fair",
            "throttle_done", "throttle_position", "throttle_slot", "throttle_pause",
            "throttle_usage", "throttle_redate",
        ],
    }
}

fn fair_keys(inv: &mut FunctionCall, keys: &ThrottleKeys) {
    inv.key(&keys.tickets).key(&keys.capped).key(&keys.tags);
}

/// A provider's bucket parameters as the throttle scripts read them.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketArgs {
    pub rate: f64,
    /// The capacity the bucket grants from (`Provider::bucket_burst`).
    pub burst: f64,
    /// `max_concurrent`, 0 for none.
    pub slots: u32,
    /// The provider's other limits as `lua/throttle/lib/bucket.lua` reads them
    /// ([`limits_spec`]); empty for none.
    pub limits: String,
    /// The provider's pool as `lua/throttle/lib/pool.lua` reads it
    /// ([`pool_spec`]); empty for a provider served as one upstream.
    pub pool: String,
}

impl From<&tollgate_core::config::Provider> for BucketArgs {
    fn from(p: &tollgate_core::config::Provider) -> Self {
        Self {
            rate: p.rate,
            burst: p.bucket_burst(),
            slots: p.max_concurrent.unwrap_or(0),
            limits: limits_spec(&p.limits),
            pool: pool_spec(p),
        }
    }
}

/// `"<name> <rate> <burst> <max_concurrent> <weight>[ <limits>]"` per member
/// of `p`'s pool ([`Provider::pool`](tollgate_core::config::Provider::pool)),
/// `|` between: `lua/throttle/lib/pool.lua`; empty without a pool.
pub fn pool_spec(p: &tollgate_core::config::Provider) -> String {
    p.pool()
        .iter()
        .map(|m| {
            let own = p.as_member(m);
            let limits = limits_spec(&own.limits);
            let mut spec = format!(
                "{} {} {} {} {}",
                m.name,
                own.rate,
                own.bucket_burst(),
                own.max_concurrent.unwrap_or(0),
                m.weight
            );
            if !limits.is_empty() {
                spec.push(' ');
                spec.push_str(&limits);
            }
            spec
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// `"<field> <burst> <rate> ..."`, a limit's field of the provider's
/// `bucket` hash being its kind and window (`r:<per_ms>`, `t:<per_ms>`; the
/// config allows one limit per kind and window): `lua/throttle/lib/bucket.lua`.
pub fn limits_spec(limits: &[tollgate_core::config::ProviderLimit]) -> String {
    use tollgate_core::config::LimitKind;
    limits
        .iter()
        .map(|l| {
            let kind = match l.kind {
                LimitKind::Requests => 'r',
                LimitKind::Tokens => 't',
            };
            format!("{kind}:{} {} {}", l.per_ms(), l.burst, l.rate)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A ticket as the throttle scripts read its weight: `<ticket>*<weight>`
/// for a provider with other limits or a pool (`lua/throttle/lib/bucket.lua`),
/// else as it is.
pub fn weighted_ticket(ticket: String, bucket: &BucketArgs, weight: u64) -> String {
    if bucket.limits.is_empty() && bucket.pool.is_empty() {
        ticket
    } else {
        format!("{ticket}*{}", weight.max(1))
    }
}

/// `throttle_enqueue.lua`
pub fn throttle_enqueue(
    keys: &ThrottleKeys,
    ticket: &str,
    inbox: &str,
    max_wait_us: u64,
    idle_ms: u64,
    bucket: BucketArgs,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_enqueue");
    inv.key(&keys.queue)
        .key(&keys.waiting)
        .key(&keys.bucket)
        .key(&keys.inflight);
    inv.arg(ticket)
        .arg(inbox)
        .arg(max_wait_us)
        .arg(idle_ms)
        .arg(bucket.rate)
        .arg(bucket.burst)
        .arg(bucket.slots)
        .arg(SLOT_LEASE_US)
        .arg(&bucket.limits)
        .arg(pool_flag(&bucket));
    inv
}

/// `"1"` for a pool: its enqueues never grant (`throttle_enqueue[_fair].lua`).
fn pool_flag(bucket: &BucketArgs) -> &'static str {
    if bucket.pool.is_empty() {
        ""
    } else {
        "1"
    }
}

/// `throttle_grant.lua`
pub fn throttle_grant(
    keys: &ThrottleKeys,
    throttler: &str,
    bucket: BucketArgs,
    limit: u32,
    ready_ttl_us: u64,
    idle_ms: u64,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_grant");
    inv.key(&keys.queue)
        .key(keys.processing(throttler))
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.key(&keys.inflight);
    inv.arg(bucket.rate)
        .arg(bucket.burst)
        .arg(limit)
        .arg(ready_ttl_us)
        .arg(idle_ms)
        .arg(keys.base())
        .arg(bucket.slots)
        .arg(SLOT_LEASE_US)
        .arg(&bucket.limits)
        .arg(&bucket.pool);
    inv
}

/// `throttle_cancel.lua`; `user`: the fair queue the ticket is in, `None`
/// for a FIFO ticket.
pub fn throttle_cancel(
    keys: &ThrottleKeys,
    ticket: &str,
    bucket: BucketArgs,
    user: Option<&str>,
    late: std::time::Duration,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_cancel");
    inv.key(&keys.queue)
        .key(&keys.waiting)
        .key(&keys.granted)
        .key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.key(&keys.inflight);
    inv.arg(ticket).arg(bucket.rate).arg(bucket.burst);
    match user {
        Some(user) => inv.arg("fair").arg(user),
        None => inv.arg("fifo").arg(""),
    };
    inv.arg(keys.base())
        .arg(late.as_micros() as u64)
        .arg(&bucket.limits)
        .arg(&bucket.pool);
    inv
}

/// A waiter of the fair queue: its user and share (`throttle_enqueue_fair.lua`).
#[derive(Debug, Clone, Copy)]
pub struct FairArgs<'a> {
    pub user: &'a str,
    pub weight: u32,
    pub max_in_flight: u32,
    pub slot_lease_us: u64,
}

impl FairArgs<'_> {
    /// `"<weight> <max_in_flight> <slot lease µs> <user>"`: one argument of the
    /// script, and the tail of the ticket's `waiting` entry as it is (the
    /// script checks it with one pattern and copies it; `lua/throttle/lib/fair.lua`).
    fn share(&self) -> String {
        format!(
            "{} {} {} {}",
            self.weight.max(1),
            self.max_in_flight,
            self.slot_lease_us.max(1),
            self.user
        )
    }
}

/// `throttle_enqueue_fair.lua`
pub fn throttle_enqueue_fair(
    keys: &ThrottleKeys,
    ticket: &str,
    inbox: &str,
    max_wait_us: u64,
    idle_ms: u64,
    bucket: BucketArgs,
    fair: FairArgs<'_>,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_enqueue_fair");
    inv.key(&keys.queue).key(&keys.waiting).key(&keys.bucket);
    fair_keys(&mut inv, keys);
    inv.key(&keys.inflight);
    inv.arg(ticket)
        .arg(inbox)
        .arg(max_wait_us)
        .arg(idle_ms)
        .arg(bucket.rate)
        .arg(bucket.burst)
        .arg(fair.share())
        .arg(keys.base())
        .arg(bucket.slots)
        .arg(SLOT_LEASE_US)
        .arg(&bucket.limits)
        .arg(pool_flag(&bucket));
    inv
}

/// `throttle_done.lua`
pub fn throttle_done(keys: &ThrottleKeys, user: &str, ticket: &str) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_done");
    inv.key(&keys.queue).key(&keys.waiting);
    fair_keys(&mut inv, keys);
    inv.arg(user).arg(ticket).arg(keys.base());
    inv
}

/// `throttle_redate.lua`: re-dates `ticket`'s grant, made at
/// `granted_at_us`, to now when the bucket allows.
pub fn throttle_redate(
    keys: &ThrottleKeys,
    ticket: &str,
    granted_at_us: u64,
    bucket: &BucketArgs,
    idle_ms: u64,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_redate");
    inv.key(&keys.granted).key(&keys.bucket);
    inv.arg(ticket)
        .arg(granted_at_us)
        .arg(bucket.rate)
        .arg(bucket.burst)
        .arg(&bucket.limits)
        .arg(idle_ms);
    inv
}

/// A slot's lease, as the scripts take it (µs).
const SLOT_LEASE_US: u64 = tollgate_core::config::SLOT_LEASE.as_micros() as u64;

/// `throttle_slot.lua`: renews the slot of `ticket` for a lease from now, or
/// ends it (`renew` false).
pub fn throttle_slot(keys: &ThrottleKeys, ticket: &str, renew: bool) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_slot");
    inv.key(&keys.inflight).key(&keys.queue);
    inv.arg(ticket).arg(if renew { SLOT_LEASE_US } else { 0 });
    inv
}

/// How an upstream's refusal pauses a provider's bucket (`throttle_pause.lua`).
#[derive(Debug, Clone, Copy)]
pub struct PauseArgs {
    /// The pause the upstream named (`Retry-After`); `None`: back off.
    pub named: Option<std::time::Duration>,
    /// The first back-off, doubled for each refusal in a row.
    pub first: std::time::Duration,
    /// The longest pause, named or not.
    pub longest: std::time::Duration,
    /// AIMD: the refusal halves the effective rate too.
    pub adaptive: bool,
}

/// `throttle_pause.lua`
pub fn throttle_pause(keys: &ThrottleKeys, bucket: BucketArgs, pause: PauseArgs) -> FunctionCall {
    let us = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let mut inv = THROTTLE.prepare("throttle_pause");
    inv.key(&keys.bucket);
    inv.arg(bucket.rate).arg(bucket.burst);
    match pause.named {
        Some(d) => inv.arg(us(d)),
        None => inv.arg(-1),
    };
    inv.arg(us(pause.first).max(1))
        .arg(us(pause.longest).max(1))
        .arg(u8::from(pause.adaptive));
    inv
}

/// `throttle_usage.lua`: the call of a grant that took `weight` used `used`
/// (a provider with other limits: `bucket.limits` is not empty).
pub fn throttle_usage(
    keys: &ThrottleKeys,
    bucket: &BucketArgs,
    weight: u64,
    used: u64,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_usage");
    inv.key(&keys.bucket);
    inv.arg(&bucket.limits).arg(weight).arg(used);
    inv
}

/// How many tickets of a queue `throttle_position.lua` looks at, at most.
pub const POSITION_SCAN: u32 = 10_000;

/// `throttle_position.lua`; `user`: the fair queue to look in, `None` for a
/// FIFO provider's one queue.
pub fn throttle_position(
    keys: &ThrottleKeys,
    request_id: &str,
    user: Option<&str>,
) -> FunctionCall {
    let mut inv = THROTTLE.prepare("throttle_position");
    inv.key(&keys.queue).key(&keys.waiting);
    fair_keys(&mut inv, keys);
    inv.key(&keys.lists).key(&keys.bucket);
    inv.arg(request_id);
    match user {
        Some(user) => inv.arg("fair").arg(user),
        None => inv.arg("fifo").arg(""),
    };
    inv.arg(keys.base()).arg(POSITION_SCAN);
    inv
}
