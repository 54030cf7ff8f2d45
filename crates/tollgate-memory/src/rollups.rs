//! The embedded ledger's spend rollups: per user, what its charges came to
//! per hour and per UTC day, by dimensions ([`Dims`]), the counterpart of
//! `lua/budget/lib/rollups.lua`. The ledger applies each change of a charge
//! here before the call that made it returns, under the user's lock; the
//! rollups outlive the user's log (an idle user's log is swept, its spend
//! stays until its buckets pass their keep).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tollgate_core::id::UserId;
use tollgate_core::spend::{Bucket, Dims, Keep, Step};

/// Every user's rollups, and the dimensions' dictionary (codes from 1; an
/// event with code 0 counts in none).
#[derive(Default)]
pub(crate) struct Rollups {
    names: Vec<Arc<Dims>>,
    codes: HashMap<Arc<Dims>, u32>,
    users: HashMap<UserId, UserRollup>,
}

/// One user's buckets: (bucket number, code) -> amount, hours and days.
#[derive(Default)]
struct UserRollup {
    hours: BTreeMap<(u64, u32), u64>,
    days: BTreeMap<(u64, u32), u64>,
}

/// A change of a charge, to count: the time it was spent, its code, the
/// change of its cost.
pub(crate) type Change = (u64, u32, i64);

impl Rollups {
    /// The code of `dims` (given when new).
    pub(crate) fn code(&mut self, dims: Dims) -> u32 {
        if let Some(&c) = self.codes.get(&dims) {
            return c;
        }
        let dims = Arc::new(dims);
        self.names.push(Arc::clone(&dims));
        let c = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
        self.codes.insert(dims, c);
        c
    }

    /// Counts `changes` of `user`'s charges at `now`.
    pub(crate) fn apply(
        &mut self,
        user: &UserId,
        changes: impl Iterator<Item = Change>,
        keep: &Keep,
        now: u64,
    ) {
        let mut changes = changes.filter(|c| c.1 != 0 && c.2 != 0).peekable();
        if changes.peek().is_none() {
            return;
        }
        let r = self.users.entry(user.clone()).or_default();
        for (at, code, delta) in changes {
            bump(&mut r.hours, Step::Hour, keep, at, code, delta, now);
            bump(&mut r.days, Step::Day, keep, at, code, delta, now);
        }
    }

    /// `user`'s buckets of `step` starting in `[from_ms, to_ms)`, still kept.
    pub(crate) fn buckets(
        &self,
        user: &UserId,
        step: Step,
        from_ms: u64,
        to_ms: u64,
        keep: &Keep,
        now: u64,
    ) -> Vec<Bucket> {
        let Some(r) = self.users.get(user) else {
            return Vec::new();
        };
        let map = match step {
            Step::Hour => &r.hours,
            Step::Day => &r.days,
        };
        let lo = from_ms.div_ceil(step.ms());
        map.range((lo, 0)..)
            .take_while(|((n, _), _)| n.saturating_mul(step.ms()) < to_ms)
            .filter(|((n, _), _)| keep.kept(step, n * step.ms(), now))
            .filter_map(|(&(n, code), &amount)| {
                let dims = self.names.get(code.checked_sub(1)? as usize)?;
                Some(Bucket {
                    start_ms: n * step.ms(),
                    dims: Dims::clone(dims),
                    amount,
                })
            })
            .collect()
    }

    /// Drops every bucket past its keep, and users left with none.
    pub(crate) fn sweep(&mut self, keep: &Keep, now: u64) {
        self.users.retain(|_, r| {
            prune(&mut r.hours, Step::Hour, keep, now);
            prune(&mut r.days, Step::Day, keep, now);
            !r.days.is_empty() || !r.hours.is_empty()
        });
        if self.users.capacity() > 4 * self.users.len().max(16) {
            self.users.shrink_to_fit();
        }
    }
}

/// Adds `delta` to the bucket of `at`; a bucket at 0 goes, and a new bucket
/// of a new step drops those past their keep (as the Redis rollups do).
fn bump(
    map: &mut BTreeMap<(u64, u32), u64>,
    step: Step,
    keep: &Keep,
    at: u64,
    code: u32,
    delta: i64,
    now: u64,
) {
    if !keep.kept(step, at - at % step.ms(), now) {
        return;
    }
    let n = at / step.ms();
    let v = map.entry((n, code)).or_default();
    let fresh = *v == 0;
    *v = v.saturating_add_signed(delta);
    if *v == 0 {
        map.remove(&(n, code));
    } else if fresh {
        let first = (now / step.ms() + 1).saturating_sub(keep.buckets(step));
        if map.first_key_value().is_some_and(|(k, _)| k.0 < first) {
            prune(map, step, keep, now);
        }
    }
}

fn prune(map: &mut BTreeMap<(u64, u32), u64>, step: Step, keep: &Keep, now: u64) {
    let cur = now / step.ms();
    let first = (cur + 1).saturating_sub(keep.buckets(step));
    *map = map.split_off(&(first, 0));
}
