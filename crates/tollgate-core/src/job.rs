//! Jobs: what the api role submits and a worker runs, their states and outcomes,
//! and the two interfaces every job backend implements: [`JobQueue`] (the api
//! side: submit, status, wait) and [`JobSource`] (the worker side: take, renew,
//! complete, fail, hand back, maintain).
//!
//! Semantics (DESIGN.md, "Jobs and failures"): a job's id is its budget request
//! id. Submitting reserves the budget and enqueues the job, idempotently by id,
//! and never leaves a reservation without a job. Delivery is at least once; every
//! lease carries a fencing token, and only the holder of the current token can
//! record a result or a failure. A job ends once: succeeded (charged once) or
//! failed (refunded at most once).

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::id::{RequestId, UserId};
use crate::ledger::{Allowed, Denied, LedgerError};

/// One unit of work: a provider call paid for by `user`'s budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// The budget request id: the spend event, the job and the throttle slot share it.
    pub id: RequestId,
    pub user: UserId,
    /// The operation's name in the config (`[operations."llm.structured"]`).
    pub operation: String,
    /// The provider the operation calls (its throttle bucket).
    pub provider: String,
    /// The input posted to the provider, as the client sent it.
    pub input: Value,
    /// Tokens reserved from the user's budget.
    pub cost: u64,
    /// When the job was queued (ms since the epoch, on the backend's clock).
    pub enqueued_at_ms: u64,
    /// A job not finished by then fails as [`FailureCause::Expired`] (and is refunded).
    pub deadline_ms: u64,
    /// How many times a worker has taken the job (1 on the first run).
    pub attempt: u32,
}

/// What a caller asks for; the backend fills in provider, cost and times from
/// the config's `[operations.*]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRequest {
    pub id: RequestId,
    pub user: UserId,
    pub operation: String,
    pub input: Value,
}

/// Why a job failed. Each cause maps to the HTTP status the api role answers
/// with (see [`FailureCause::http_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCause {
    /// The provider answered an error (after retries), or could not be reached.
    Provider,
    /// No throttle slot within the provider's `max_wait`.
    ThrottleTimeout,
    /// The job was not finished before its deadline.
    Expired,
    /// The job was given up: its submission never completed, or it exhausted
    /// its attempts (workers died while running it).
    Abandoned,
}

impl FailureCause {
    /// 502 (provider), 504 (throttle timeout, expired), 503 (abandoned).
    pub fn http_status(self) -> u16 {
        match self {
            Self::Provider => 502,
            Self::ThrottleTimeout | Self::Expired => 504,
            Self::Abandoned => 503,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Provider => "provider",
            Self::ThrottleTimeout => "throttle_timeout",
            Self::Expired => "expired",
            Self::Abandoned => "abandoned",
        }
    }

    /// The inverse of [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "provider" => Self::Provider,
            "throttle_timeout" => Self::ThrottleTimeout,
            "expired" => Self::Expired,
            "abandoned" => Self::Abandoned,
            _ => return None,
        })
    }
}

/// The wait loop both queues share: `look` reads the job until it is final or
/// `timeout` passes. `notify` is woken when a job finishes; the notification is
/// armed before each look, so one that fires in between is not lost, and the
/// job is re-read every `poll` anyway, so waking never depends on it alone.
pub async fn wait_until_final<F, Fut>(
    notify: &tokio::sync::Notify,
    timeout: Duration,
    poll: Duration,
    mut look: F,
) -> Result<Option<JobInfo>, JobError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<JobInfo>, JobError>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let info = look().await?;
        match &info {
            Some(i) if !i.status.is_final() => {}
            _ => return Ok(info),
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Ok(info);
        }
        let nap = (deadline - now).min(poll);
        let _ = tokio::time::timeout(nap, notified).await;
    }
}

/// Where a job is, as the api role shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum JobStatus {
    /// Submitted, waiting for a worker.
    Queued,
    /// A worker holds it.
    Running,
    /// Done; the budget stays charged.
    Succeeded { result: Value },
    /// Done; the budget was (or is being) refunded.
    Failed {
        cause: FailureCause,
        message: String,
    },
}

impl JobStatus {
    /// Succeeded or failed: nothing will change any more.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Succeeded { .. } | Self::Failed { .. })
    }
}

/// A job and its status, as returned to its owner.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobInfo {
    pub job: Job,
    #[serde(flatten)]
    pub status: JobStatus,
    /// When it finished (ms since the epoch), once final.
    pub finished_at_ms: Option<u64>,
}

/// The answer to [`JobQueue::submit`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SubmitOutcome {
    /// The budget is reserved and the job queued.
    Queued { job: Job, allowed: Allowed },
    /// The budget does not allow it: nothing queued, nothing charged.
    Denied { denied: Denied },
    /// A job with this id exists already (for this user): nothing charged again.
    Duplicate { info: JobInfo },
}

/// Why a job call failed. Outcomes (denied, duplicate, failed jobs) are not errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("unknown operation {name:?} (operations: {known})")]
    UnknownOperation { name: String, known: String },
    /// The id belongs to another user's job, or to a job of another operation.
    #[error("request id {0} is already used by another job")]
    IdInUse(RequestId),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The store cannot be reached; retrying later may succeed.
    #[error("job store unavailable: {0}")]
    Unavailable(String),
    /// The store answered something unexpected.
    #[error("job store error: {0}")]
    Backend(String),
}

impl JobError {
    /// True for failures of the store rather than of the request.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unavailable(_) => true,
            Self::Ledger(e) => e.is_transient(),
            _ => false,
        }
    }

    /// The error for an operation missing from `config`.
    pub fn unknown_operation(config: &crate::Config, name: &str) -> Self {
        Self::UnknownOperation {
            name: name.to_owned(),
            known: config
                .operations()
                .map(|o| o.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// The api side of a job backend.
///
/// `submit` runs several steps (hold the job, reserve the budget, release the
/// job to the queue); callers run it in a spawned task, so that a dropped HTTP
/// request cannot interrupt it half way. A crash between the steps leaks
/// nothing: the maintenance of [`JobSource::maintain`] refunds held jobs whose
/// submission never completed.
#[async_trait]
pub trait JobQueue: Send + Sync + std::fmt::Debug {
    /// Reserves `cost` of the operation from the user's budget and queues the
    /// job. Idempotent by `request.id`: a second submit returns
    /// [`SubmitOutcome::Duplicate`] with the first job, charging nothing.
    async fn submit(&self, request: JobRequest) -> Result<SubmitOutcome, JobError>;

    /// The job `id` of `user`; `None` when it does not exist, expired, or
    /// belongs to someone else (a user never sees another user's job).
    async fn status(&self, user: &UserId, id: &RequestId) -> Result<Option<JobInfo>, JobError>;

    /// Waits until the job is final, at most `timeout`, and returns its info
    /// (still queued or running when the timeout came first). Wake-ups do not
    /// depend on pub/sub alone: the status is re-read periodically.
    async fn wait(
        &self,
        user: &UserId,
        id: &RequestId,
        timeout: Duration,
    ) -> Result<Option<JobInfo>, JobError>;
}

/// A job leased to a worker. Only the holder of the current `token` can finish it.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub job: Job,
    /// The fencing token: incremented on every lease of the job.
    pub token: u64,
    pub worker: String,
}

/// What a finishing call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Recorded (for a failure: and refunded).
    Recorded,
    /// Refused: the lease was lost (expired and handed to another worker, or the
    /// job already ended). Nothing was recorded or refunded.
    LeaseLost,
}

/// What one [`JobSource::maintain`] round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintenance {
    /// Jobs whose lease expired (or whose worker died), put back in the queue.
    pub requeued: u64,
    /// Jobs that used up their attempts, or whose submission never completed:
    /// failed and refunded.
    pub abandoned: u64,
    /// Pending refunds finished.
    pub refunded: u64,
}

/// The worker side of a job backend.
#[async_trait]
pub trait JobSource: Send + Sync + std::fmt::Debug {
    /// Waits at most `block` for a job of `operation` and leases it to `worker`
    /// for `lease`. Malformed entries (unreadable, unknown operation) are moved
    /// aside and logged, never returned. A job past its deadline, or past its
    /// attempts, is failed and refunded here and not returned.
    async fn take(
        &self,
        operation: &str,
        worker: &str,
        block: Duration,
        lease: Duration,
    ) -> Result<Option<Lease>, JobError>;

    /// Extends the lease; `Finish::LeaseLost` when it is not ours any more.
    async fn renew(&self, lease: &Lease, by: Duration) -> Result<Finish, JobError>;

    /// Records the result (kept for the result TTL) and wakes the waiters.
    async fn complete(&self, lease: &Lease, result: Value) -> Result<Finish, JobError>;

    /// Records a final failure, refunds the budget once, wakes the waiters.
    async fn fail(
        &self,
        lease: &Lease,
        cause: FailureCause,
        message: &str,
    ) -> Result<Finish, JobError>;

    /// Puts the job back at the head of its queue without counting the attempt
    /// (a worker shutting down).
    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError>;

    /// Housekeeping that any worker runs periodically: renews `worker`'s
    /// liveness for `lease`, requeues jobs whose lease expired or whose worker
    /// died (failing those past their attempts), abandons held jobs whose
    /// submission never completed, finishes pending refunds.
    async fn maintain(&self, worker: &str, lease: Duration) -> Result<Maintenance, JobError>;

    /// The worker stops: jobs it moved but never leased go back to the queue,
    /// its liveness ends.
    async fn retire(&self, worker: &str) -> Result<(), JobError>;
}

/// Timings shared by both job backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobOptions {
    /// How long a submission may hold a job (between creating it and queueing
    /// it) before maintenance gives it up and refunds it.
    pub hold: Duration,
    /// How long a finished job (its result or error) stays readable.
    pub result_ttl: Duration,
    /// How often a waiter re-reads the status besides being woken.
    pub poll: Duration,
    /// A failed job's refund left pending this long is finished by maintenance.
    pub refund_grace: Duration,
}

impl Default for JobOptions {
    fn default() -> Self {
        Self {
            hold: Duration::from_secs(60),
            result_ttl: Duration::from_secs(3600),
            poll: Duration::from_millis(500),
            refund_grace: Duration::from_secs(5),
        }
    }
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
