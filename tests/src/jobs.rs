//! Job support shared by the integration tests: a job as a provider client is
//! handed one, and a lease taken from a job source.

use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{
    FailureCause, Job, JobQueue, JobRequest, JobSource, JobStatus, Lease, SubmitOutcome, Taker,
};

/// The job id the api derives from `user`'s Idempotency-Key `key`
/// (`cost::request_id`), written out apart from the product's: known here
/// even for a call that never got an answer.
pub fn idempotent_job_id(user: &str, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(user.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let hex: String = h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("idem-{hex}")
}

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
        run: 1,
        nonce: "n".into(),
        trace: None,
        price: None,
        charged: None,
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
        .take(
            operation,
            Taker::new(worker, block, Duration::from_secs(30)),
        )
        .await
        .unwrap_or_else(|e| panic!("take {operation}: {e}"))
        .unwrap_or_else(|| panic!("no job of {operation} within {block:?}"))
}

/// Submits a job of `user` for `operation` per input, the `i`-th as
/// `job-<i>`, one after another; panics unless each is queued. Their ids,
/// in order.
pub async fn submit_queued(
    q: &(impl JobQueue + ?Sized),
    user: &UserId,
    operation: &str,
    inputs: impl IntoIterator<Item = Value>,
) -> Vec<RequestId> {
    let mut ids = Vec::new();
    for (i, input) in inputs.into_iter().enumerate() {
        let id = RequestId::new(format!("job-{i}")).unwrap_or_else(|e| panic!("job-{i}: {e}"));
        let out = q
            .submit(JobRequest {
                id: id.clone(),
                user: user.clone(),
                operation: operation.into(),
                input,
                trace: None,
                service_key: None,
            })
            .await
            .unwrap_or_else(|e| panic!("submit {id}: {e}"));
        assert!(matches!(out, SubmitOutcome::Queued { .. }), "{out:?}");
        ids.push(id);
    }
    ids
}

/// Waits (at most `within`, looking every 200 ms) until every job of `user`
/// in `ids` is final; returns (succeeded, failed with their causes).
pub async fn wait_final(
    q: &(impl JobQueue + ?Sized),
    user: &UserId,
    ids: &[RequestId],
    within: Duration,
) -> (Vec<RequestId>, Vec<(RequestId, FailureCause)>) {
    let deadline = Instant::now() + within;
    loop {
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        let mut open = 0;
        for id in ids {
            let status = q
                .status(user, id)
                .await
                .unwrap_or_else(|e| panic!("status of {id}: {e}"));
            match status.map(|i| i.status) {
                Some(JobStatus::Succeeded { .. }) => ok.push(id.clone()),
                Some(JobStatus::Failed { cause, .. }) => failed.push((id.clone(), cause)),
                _ => open += 1,
            }
        }
        if open == 0 {
            return (ok, failed);
        }
        assert!(
            Instant::now() < deadline,
            "{open} of {} jobs not final within {within:?}",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
