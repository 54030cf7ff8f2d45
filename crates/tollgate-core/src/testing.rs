//! Fixtures for tests: this crate's, and (through the `test-support`
//! feature, which only dev-dependencies turn on) the backends' and the
//! providers', so that each builds its jobs the same way.

use serde_json::Value;

use crate::id::{RequestId, UserId};
use crate::job::Job;

/// Job `id` of user `u`: a call of `operation` on `provider` with `input`,
/// costing 1, in its first run, with no deadline and no trace.
///
/// # Panics
///
/// When `id` is not a request id (a test's own literal).
pub fn job(id: &str, operation: &str, provider: &str, input: Value) -> Job {
    Job {
        id: RequestId::new(id).expect("a test's request id"),
        user: UserId::new("u").expect("a test's user id"),
        operation: operation.into(),
        provider: provider.into(),
        input,
        cost: 1,
        enqueued_at_ms: 0,
        deadline_ms: u64::MAX,
        run: 1,
        nonce: "n".into(),
        trace: None,
        price: None,
        charged: None,
    }
}

/// xorshift64*: a deterministic stream of test values, no dependency.
pub fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}
