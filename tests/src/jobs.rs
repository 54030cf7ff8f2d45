//! Job support shared by the integration tests: a job as a provider client is
//! handed one, and a lease taken from a job source.

use std::time::Duration;

use serde_json::Value;
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{Job, JobSource, Lease};

/// A job of `user` for `operation` on `provider`, as a provider client is
/// handed one: cost 1, first attempt, no deadline, nonce `"n"`, no trace.
pub fn job(id: &str, user: &str, operation: &str, provider: &str, input: Value) -> Job {
    Job {
        id: RequestId::new(id).unwrap_or_else(|e| panic!("request id {id:?}: {e}")),
        user: UserId::new(user).unwrap_or_else(|e| panic!("user {user:?}: {e}")),
        operation: operation.into(),
        provider: provider.into(),
        input,
        cost: 1,
        enqueued_at_ms: 0,
        deadline_ms: u64::MAX,
        attempt: 1,
        nonce: "n".into(),
        trace: None,
    }
}

/// The next job of `operation`, taken by `worker` within `block` and leased
/// for 30 s; panics when the source fails or has none.
pub async fn take_one(
    source: &(impl JobSource + ?Sized),
    operation: &str,
    worker: &str,
    block: Duration,
) -> Lease {
    source
        .take(operation, worker, block, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("take {operation}: {e}"))
        .unwrap_or_else(|| panic!("no job of {operation} within {block:?}"))
}
