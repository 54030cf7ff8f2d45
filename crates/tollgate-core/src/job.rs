//! Jobs: what the api role submits and a worker runs, their states and outcomes,
//! and the two interfaces every job backend implements: [`JobQueue`] (the api
//! side: submit, status, wait) and [`JobSource`] (the worker side: take, renew,
//! complete, fail, hand back, maintain).
//!
//! Semantics: a job's id is its budget request id. Delivery is at least once;
//! every lease carries a fencing token, and only the holder of the current token
//! can record a result or a failure. A job ends once: succeeded (charged once)
//! or failed (released at most once).
//!
//! **One owner per charge.** [`JobQueue::submit`] is the one sequence that
//! charges a job, written once for every backend:
//! 1. [`Ledger::charge`] checks the id against the request it was first used for
//!    (operation and a fingerprint of the body: another one is
//!    [`JobError::KeyReused`]), reserves the cost and records the charge under a
//!    fresh nonce, *held* for its job until the job's deadline plus
//!    [`Config::hold_grace`]: the submission owns it. It answers the user's
//!    plan too, read in the same step.
//! 2. [`JobQueue::enqueue`] creates the job carrying that nonce (or finds it: a
//!    retry, or a second request with the same key, gets the same job), within
//!    that plan's `max_stored_bytes`: no round trip between the two steps.
//! 3. A worker, before the provider call, [`claim`]s the charge: the job owns it
//!    from then on, and [`Ledger::release`]s it if it fails, at most once.
//!
//! No step decides from what a process saw: a submission that dies between 1
//! and 2, or whose reply was lost, leaves a held charge that its job claims if
//! it exists, or that the ledger itself releases once no job can claim it. A
//! job whose claim is refused (the charge was released, or the id charged anew)
//! never calls the provider and owns nothing to release.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

use crate::config::Config;
use crate::error::StoreError;
use crate::id::{RequestId, UserId};
use crate::ledger::{
    Allowed, ChargeOutcome, ChargeRequest, ClaimOutcome, ClaimRequest, Denied, Ledger, LedgerError,
    SettleRequest,
};
use crate::trace::TraceParent;

/// One unit of work: a provider call paid for by `user`'s budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// The budget request id: the spend event, the job and the throttle grant share it.
    pub id: RequestId,
    pub user: UserId,
    /// The operation's name in the config (`[operations."llm.structured"]`).
    pub operation: String,
    /// The provider the operation calls (its throttle bucket).
    pub provider: String,
    /// The input posted to the provider, as the client sent it.
    pub input: Value,
    /// What was reserved from the user's budget, in minor units (tokens, or
    /// micro-units of money).
    pub cost: u64,
    /// When the job was queued (ms since the epoch, on the backend's clock).
    pub enqueued_at_ms: u64,
    /// A job not finished by then fails as [`FailureCause::Expired`] (and its charge is released).
    pub deadline_ms: u64,
    /// How many times a worker has taken the job (1 on the first run).
    pub run: u32,
    /// The charge that pays for the job ([`Ledger::charge`]'s nonce).
    pub nonce: String,
    /// The trace of the call that submitted it: its logs and its provider
    /// call carry it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceParent>,
    /// The prices a priced operation's call was reserved at
    /// ([`crate::price::Applied::to_text`]): its settle prices the reported
    /// usage at them, whatever the sheet says by then. `None`: not priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<String>,
    /// What its charge settled to, recorded with its result
    /// ([`JobSource::complete_with`]); `None`: the reservation, `cost`, stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charged: Option<u64>,
}

/// What a caller asks for; the backend fills in provider, cost and times from
/// the config's `[operations.*]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRequest {
    pub id: RequestId,
    pub user: UserId,
    pub operation: String,
    pub input: Value,
    /// The caller's trace (the api continues or starts one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceParent>,
    /// The id of the service key that acts for `user` (`Tollgate-User`), if
    /// one does: recorded with the charge, in the audit trail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_key: Option<String>,
}

/// Why a job failed. Each cause maps to the HTTP status the api role answers
/// with (see [`FailureCause::http_status`]), and says whether the user was
/// charged ([`FailureCause::charged`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCause {
    /// The provider refused or failed (after retries), or could not be
    /// reached: released.
    Provider,
    /// The request was sent and no whole answer came back (a timeout after
    /// the write, a reply cut midway, a worker lost mid-call): the upstream
    /// may have done the work, so the charge stands.
    Unanswered,
    /// The upstream answered 2xx with a body that is not a JSON document: the
    /// work was done, so the charge stands.
    BadResponse,
    /// No throttle grant within the provider's `max_wait`.
    ThrottleTimeout,
    /// The job was not finished before its deadline.
    Expired,
    /// The job was given up: its submission never completed, or it exhausted
    /// its attempts (workers died while running it).
    Abandoned,
    /// An operator refunded its charge before it ran (`budget refund`): it
    /// never reached the provider.
    Cancelled,
    /// The upstream rejected the input (400, 413, 414, 415, 422): it did no
    /// work, so the charge is released; the client's input must change. The
    /// record's message is the [`Rejection`].
    Rejected,
}

impl FailureCause {
    /// 502 (provider, bad response), 504 (unanswered, throttle timeout,
    /// expired), 503 (abandoned), 409 (cancelled), 422 (rejected).
    pub fn http_status(self) -> u16 {
        match self {
            Self::Rejected => 422,
            Self::Provider | Self::BadResponse => 502,
            Self::Unanswered | Self::ThrottleTimeout | Self::Expired => 504,
            Self::Abandoned => 503,
            Self::Cancelled => 409,
        }
    }

    /// Whether a job failed for this cause keeps its charge: only when the
    /// upstream may have done the work ([`Charge::Keep`]).
    pub fn charged(self) -> bool {
        matches!(self, Self::Unanswered | Self::BadResponse)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Provider => "provider",
            Self::Unanswered => "unanswered",
            Self::BadResponse => "bad_response",
            Self::ThrottleTimeout => "throttle_timeout",
            Self::Expired => "expired",
            Self::Abandoned => "abandoned",
            Self::Cancelled => "cancelled",
            Self::Rejected => "rejected",
        }
    }

    /// The inverse of [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "provider" => Self::Provider,
            "unanswered" => Self::Unanswered,
            "bad_response" => Self::BadResponse,
            "throttle_timeout" => Self::ThrottleTimeout,
            "expired" => Self::Expired,
            "abandoned" => Self::Abandoned,
            "cancelled" => Self::Cancelled,
            "rejected" => Self::Rejected,
            _ => return None,
        })
    }
}

/// What the upstream answered when it rejected a job's input
/// ([`FailureCause::Rejected`]); the job record's message holds it as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// The upstream's status code.
    pub upstream_status: u16,
    /// The upstream's body, at most [`Rejection::BODY_LIMIT`] bytes, only for
    /// an operation with `expose_upstream_errors = true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_body: Option<String>,
}

impl Rejection {
    /// The most bytes of an upstream's body a rejection keeps.
    pub const BODY_LIMIT: usize = 1024;

    /// `body` cut to [`Self::BODY_LIMIT`] bytes, on a character boundary.
    pub fn bounded(body: &str) -> String {
        let mut end = body.len().min(Self::BODY_LIMIT);
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body[..end].to_owned()
    }

    /// The job record's message.
    pub fn message(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A rejected job's record message, read back.
    pub fn parse(message: &str) -> Option<Self> {
        serde_json::from_str(message).ok()
    }
}

/// What a failed job does with its charge, as the outcome policy decided
/// from what the upstream may have done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// The upstream may have done the work: the charge stands.
    Keep,
    /// Nothing was done, or the provider failed: the charge goes back to the
    /// user. `absorbed` names why when the upstream may have worked all the
    /// same (a 5xx): the operator pays for it.
    Release { absorbed: Option<&'static str> },
}

impl Charge {
    /// Released, nothing absorbed.
    pub const RELEASE: Self = Self::Release { absorbed: None };

    /// The charge of a job failed for `cause` with nothing absorbed.
    pub fn of(cause: FailureCause) -> Self {
        if cause.charged() {
            Self::Keep
        } else {
            Self::RELEASE
        }
    }
}

/// Watchers by job id, woken when a job finishes: both queues use it (the memory
/// queue when it records an outcome, the Redis queue from its one subscription).
#[derive(Debug, Default)]
pub struct Watchers {
    by_id: Mutex<HashMap<String, Arc<Bell>>>,
}

/// One job's wake-ups: a ring counter, so that a ring between two looks is
/// never lost, and a [`Notify`] to sleep on; with the final record when the
/// store sent it along ([`Watchers::deliver`]).
#[derive(Debug, Default)]
struct Bell {
    rings: AtomicU64,
    notify: Notify,
    delivered: Mutex<Option<JobInfo>>,
}

impl Bell {
    fn ring(&self) {
        self.rings.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

impl Watchers {
    /// Registers interest in job `id`: every later ring of it is seen by the
    /// returned [`Watch`]. Register before the job can finish.
    pub fn watch(self: &Arc<Self>, id: &RequestId) -> Watch {
        let bell = Arc::clone(
            crate::lock(&self.by_id)
                .entry(id.as_str().to_owned())
                .or_default(),
        );
        Watch {
            seen: bell.rings.load(Ordering::SeqCst),
            bell,
            watchers: Arc::clone(self),
            id: id.as_str().to_owned(),
        }
    }

    /// Job `id` finished (or may have): its watchers look again.
    pub fn ring(&self, id: &str) {
        if let Some(bell) = crate::lock(&self.by_id).get(id) {
            bell.ring();
        }
    }

    /// Job `id` is final and the store sent its record along (the Redis
    /// queue's message to the pod that submitted it): its watchers take it
    /// instead of reading it back, when it is the attempt they wait for (the
    /// same charge: [`Job::nonce`]). Nobody watching: nothing is kept.
    pub fn deliver(&self, id: &str, info: JobInfo) {
        if let Some(bell) = crate::lock(&self.by_id).get(id) {
            if info.status.is_final() {
                *crate::lock(&bell.delivered) = Some(info);
            }
            bell.ring();
        }
    }

    /// Every watcher looks again (after a lost subscription came back).
    pub fn ring_all(&self) {
        for bell in crate::lock(&self.by_id).values() {
            bell.ring();
        }
    }
}

/// Interest in one job's outcome; see [`Watchers::watch`].
#[derive(Debug)]
pub struct Watch {
    watchers: Arc<Watchers>,
    bell: Arc<Bell>,
    id: String,
    seen: u64,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut map = crate::lock(&self.watchers.by_id);
        // Two references left: the map's and this watch's.
        if map.get(&self.id).is_some_and(|b| Arc::strong_count(b) <= 2) {
            map.remove(&self.id);
        }
    }
}

impl Watch {
    /// The final record delivered for the attempt `known` is (same user, same
    /// charge), if one was.
    fn delivered(&self, known: Option<&JobInfo>) -> Option<JobInfo> {
        let known = known?;
        crate::lock(&self.bell.delivered)
            .as_ref()
            .filter(|d| d.job.nonce == known.job.nonce && d.job.user == known.job.user)
            .cloned()
    }

    /// Waits until the job is final, at most `timeout`, and returns what `look`
    /// read last. `known` is the job as the caller last saw it (`None`: look
    /// first). `look` runs when the job was rung, and every `poll` anyway, so
    /// waking never depends on a notification alone; a ring that brought the
    /// final record of the attempt `known` names (its nonce) needs no look.
    pub async fn until_final<F, Fut>(
        mut self,
        known: Option<JobInfo>,
        timeout: Duration,
        poll: Duration,
        mut look: F,
    ) -> Result<Option<JobInfo>, JobError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<JobInfo>, JobError>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut info = known;
        let mut stale = info.is_none();
        loop {
            let notified = self.bell.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let rings = self.bell.rings.load(Ordering::SeqCst);
            if stale || rings != self.seen {
                self.seen = rings;
                info = match self.delivered(info.as_ref()) {
                    Some(delivered) => Some(delivered),
                    None => look().await?,
                };
            }
            match &info {
                Some(i) if !i.status.is_final() => {}
                _ => return Ok(info),
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(info);
            }
            let nap = (deadline - now).min(poll);
            stale = tokio::time::timeout(nap, notified).await.is_err();
        }
    }
}

/// What a job counts towards its user's `max_stored_bytes`: the bytes of its
/// input (while it can still run) or of its result or error message (once
/// final), as JSON text, plus [`JOB_RECORD_BYTES`](crate::config::JOB_RECORD_BYTES).
/// `lua/jobs/lib/job.lua` counts the same way.
pub fn stored_bytes(text_len: usize) -> u64 {
    text_len as u64 + crate::config::JOB_RECORD_BYTES
}

/// A digest of a request body: two requests with one id must agree on it.
pub fn fingerprint(input: &Value) -> String {
    let digest = Sha256::digest(input.to_string().as_bytes());
    digest[..12].iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh charge nonce: 16 hex digits.
pub fn nonce() -> String {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    bytes[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Where a job is, as the api role shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum JobStatus {
    /// Submitted, waiting for a worker.
    Queued,
    /// A worker holds it.
    Running,
    /// Done; the budget stays charged. `head`: the upstream answer's status
    /// and safe headers, when they were not a plain 200 (a pass-through
    /// answer carries them; the job's own answer does not show them).
    Succeeded {
        result: Value,
        #[serde(skip)]
        head: Option<crate::head::Head>,
    },
    /// Done; the charge was (or is being) released, unless the cause says the
    /// charge stands ([`FailureCause::charged`]).
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
    /// The budget is charged and the job queued.
    Queued { job: Job, allowed: Allowed },
    /// The budget does not allow it: nothing queued, nothing charged.
    Denied { denied: Denied },
    /// The same request (id, operation, body) is charged already: its job,
    /// nothing charged again.
    Duplicate { info: JobInfo, allowed: Allowed },
}

/// The answer to [`JobQueue::enqueue`].
#[derive(Debug, Clone, PartialEq)]
pub enum Enqueued {
    /// Created and queued.
    Created,
    /// The job of this charge (same nonce) exists already.
    Existing(Box<JobInfo>),
    /// Not found, and not created (`create` was false).
    Missing,
    /// The id is another user's job.
    IdInUse,
    /// Not created: the user's stored bytes in the queue (`stored`, this job
    /// not included) and this job's would pass the plan's `limit`.
    Full { stored: u64, limit: u64 },
}

/// Why a job call failed. Outcomes (denied, duplicate, failed jobs) are not errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("unknown operation {name:?} (operations: {known})")]
    UnknownOperation { name: String, known: String },
    /// The id belongs to another user's job, or to a plain (jobless) charge.
    #[error("request id {0} is already used by another job")]
    IdInUse(RequestId),
    /// The id is charged for another request: another operation or body.
    #[error("request id {id} is already used for another request{}", operation.as_deref().map(|o| format!(" (operation {o})")).unwrap_or_default())]
    KeyReused {
        id: RequestId,
        operation: Option<String>,
    },
    /// The job of this id ran and is still charged, but its record is gone:
    /// it is not run again.
    #[error("job {0} ran and its result is no longer kept")]
    ResultExpired(RequestId),
    /// The user's stored job bytes (inputs of unfinished jobs, results kept)
    /// would pass the plan's `max_stored_bytes` with this job: nothing was
    /// charged, no job was made.
    #[error("stored job bytes would pass the plan's limit ({stored} of {limit} bytes stored)")]
    StoredBytesExceeded { stored: u64, limit: u64 },
    /// A priced operation's call that cannot be priced (no model, a model the
    /// sheet does not price, no bound on its output): nothing was charged.
    #[error(transparent)]
    Unpriced(#[from] crate::config::PriceError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The job store failed.
    #[error("job store: {0}")]
    Store(#[from] StoreError),
}

impl JobError {
    /// Worth retrying: the same call may succeed later (see [`StoreError`]).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Store(e) => e.is_transient(),
            Self::Ledger(e) => e.is_transient(),
            _ => false,
        }
    }

    /// The error for an operation missing from `config`.
    pub fn unknown_operation(config: &crate::config::Config, name: &str) -> Self {
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

/// One operation's queue as it stands: for metrics and the operations view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    pub operation: String,
    /// Jobs waiting for a worker.
    pub queued: u64,
    /// Jobs a worker holds now.
    pub running: u64,
    /// Malformed entries moved aside (the dead list).
    pub dead: u64,
    /// Workers alive on this queue; `None` in process (the embedded worker).
    pub workers: Option<u64>,
}

/// How long a refusal for stored bytes ([`Enqueued::Full`]) answers the
/// same user and operation in process, before any charge, for a job that
/// would not fit beside the bytes the refusal counted: a flood of
/// submissions into a full queue then charges (and releases) about one a
/// second per pod, not one per call. A released charge's entry stays in the
/// budget log (a stream marks a deleted entry and frees it with its node),
/// so a refusal answered before the charge is one that leaves nothing.
pub const FULL_MARK_TTL: Duration = Duration::from_secs(1);

/// The most (user, operation) pairs marked full at once in one process; past
/// it a refusal is not remembered (the queue's own check still refuses).
pub const FULL_MARKS_MAX: usize = 10_000;

/// The (user, operation) pairs whose queue refused a job for stored bytes
/// within [`FULL_MARK_TTL`], with what it said: see [`JobQueue::submit`].
#[derive(Debug, Default)]
pub struct FullMarks {
    marks: Mutex<HashMap<(UserId, String), FullMark>>,
}

/// Until when a refusal holds, and its stored bytes and limit.
type FullMark = (Instant, u64, u64);

impl FullMarks {
    /// `(stored, limit)` of a refusal of `user`'s jobs in `operation` still
    /// fresh, if any.
    pub fn get(&self, user: &UserId, operation: &str) -> Option<(u64, u64)> {
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        let key = (user.clone(), operation.to_string());
        match marks.get(&key) {
            Some(&(until, stored, limit)) if Instant::now() < until => Some((stored, limit)),
            _ => None,
        }
    }

    /// Remembers a refusal for [`FULL_MARK_TTL`].
    pub fn mark(&self, user: &UserId, operation: &str, stored: u64, limit: u64) {
        let now = Instant::now();
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        if marks.len() >= FULL_MARKS_MAX {
            marks.retain(|_, (until, _, _)| now < *until);
            if marks.len() >= FULL_MARKS_MAX {
                return;
            }
        }
        marks.insert(
            (user.clone(), operation.to_string()),
            (now + FULL_MARK_TTL, stored, limit),
        );
    }
}

/// The api side of a job backend. Each backend supplies the primitive steps
/// ([`enqueue`](Self::enqueue), [`read`](Self::read), ...); the sequences that
/// decide ownership ([`submit`](Self::submit), [`wait`](Self::wait)) are
/// written once, here.
#[async_trait]
pub trait JobQueue: Send + Sync + std::fmt::Debug {
    /// The ledger that charges this queue's jobs.
    fn ledger(&self) -> &Arc<dyn Ledger>;

    /// The operations (cost, provider, deadline) jobs are made of.
    fn config(&self) -> &Config;

    /// The refusals for stored bytes this process remembers ([`FullMarks`]).
    fn full_marks(&self) -> &FullMarks;

    /// Creates `job` (queued) unless a job with its id exists: the same
    /// charge's job (same nonce) is returned; one of an earlier attempt of the
    /// same user is replaced when `create`; another user's is refused. A new
    /// job is refused ([`Enqueued::Full`]) when the user's stored bytes in
    /// the queue with its own ([`stored_bytes`]) would pass `max_stored`.
    async fn enqueue(&self, job: &Job, create: bool, max_stored: u64)
        -> Result<Enqueued, JobError>;

    /// A sync call was answered with job `info`'s final outcome, and its id
    /// was no Idempotency-Key: no one can ask for the job again, so its record
    /// goes now instead of at the end of its `result_ttl` (a record still
    /// owing a release stays until the release is confirmed, and goes then).
    async fn answered(&self, info: &JobInfo) -> Result<(), JobError>;

    /// Remembers for `ttl` that a call of `operation` whose request has the
    /// retry key `key` ([`retry_key`]) runs as job `id`, its client not
    /// answered (it left, or the wait ended first): the client's retry of the
    /// same request finds that job ([`Self::retry_target`]) instead of
    /// starting the work again.
    async fn remember_retry_target(
        &self,
        operation: &str,
        key: &str,
        id: &RequestId,
        ttl: Duration,
    ) -> Result<(), JobError>;

    /// The job a retry with key `key` joins, remembered by
    /// [`Self::remember_retry_target`] and not expired.
    async fn retry_target(&self, operation: &str, key: &str)
        -> Result<Option<RequestId>, JobError>;

    /// One read of job `id` of `operation`, when `user` owns it.
    async fn read(
        &self,
        user: &UserId,
        operation: &str,
        id: &RequestId,
    ) -> Result<Option<JobInfo>, JobError>;

    /// The job `id` of `user`; `None` when it does not exist, expired, or
    /// belongs to someone else (a user never sees another user's job).
    async fn status(&self, user: &UserId, id: &RequestId) -> Result<Option<JobInfo>, JobError>;

    /// Registers interest in job `id` (before it can finish).
    fn watch(&self, id: &RequestId) -> Watch;

    /// How often a watcher re-reads a job besides being woken.
    fn poll(&self) -> Duration;

    /// Every configured operation's queue, by operation name.
    async fn stats(&self) -> Result<Vec<QueueStats>, JobError>;

    /// The newest `limit` entries of `operation`'s dead list, newest first:
    /// entries moved aside as malformed (`"<entry> <reason>"`: a record
    /// missing or unreadable), which no worker can run (the job browser).
    async fn dead_page(&self, operation: &str, limit: usize) -> Result<Vec<String>, JobError>;

    /// Charges the operation to the user's budget and queues the job: see the
    /// module docs. Idempotent by `request.id`: the same request again returns
    /// [`SubmitOutcome::Duplicate`] with the first one's job, charging nothing;
    /// the same id with another operation or body is [`JobError::KeyReused`].
    /// An error may leave a charge held (the outcome was not observed); it is
    /// never refunded here: its job claims it, or the ledger releases it.
    async fn submit(&self, request: JobRequest) -> Result<SubmitOutcome, JobError> {
        let op = self
            .config()
            .operation(&request.operation)
            .ok_or_else(|| JobError::unknown_operation(self.config(), &request.operation))?;
        // A queue that refused this user's jobs for stored bytes a moment ago
        // refuses again before anything is charged (see FULL_MARK_TTL).
        if let Some((stored, limit)) = self.full_marks().get(&request.user, &op.name) {
            if stored + stored_bytes(request.input.to_string().len()) > limit {
                return Err(JobError::StoredBytesExceeded { stored, limit });
            }
        }
        // A priced call reserves its worst case at today's prices, and keeps
        // them for its settle; nothing is charged for one that cannot be priced.
        let (cost, price, entry) = match &op.pricing {
            Some(pricing) => {
                let quote = pricing.quote(&request.input)?;
                let entry = quote.applied.entry.label();
                (quote.reserve, Some(quote.applied.to_text()), entry)
            }
            None => (op.charged_cost(), None, String::new()),
        };
        let fingerprint = fingerprint(&request.input);
        let fresh = nonce();
        let charge = ChargeRequest {
            cost,
            nonce: &fresh,
            operation: &op.name,
            model: &entry,
            service_key: request.service_key.as_deref(),
            fingerprint: &fingerprint,
            deadline: op.deadline,
            grace: self.config().hold_grace(),
            price: price.as_deref(),
        };
        let (allowed, nonce, deadline_ms, create, charged, plan) = match self
            .ledger()
            .charge(&request.user, &request.id, &charge)
            .await?
        {
            ChargeOutcome::Charged {
                allowed,
                deadline_ms,
                plan,
            } => (allowed, fresh, deadline_ms, true, true, plan),
            ChargeOutcome::Existing {
                allowed,
                nonce,
                deadline_ms,
                claimed,
                plan,
            } => (allowed, nonce, deadline_ms, !claimed, false, plan),
            ChargeOutcome::Denied(mut denied) => {
                // The refusal says what the request needed, in the budgets' unit.
                denied.needed = cost;
                denied.currency = self.config().currency();
                return Ok(SubmitOutcome::Denied { denied });
            }
            ChargeOutcome::Conflict {
                operation: Some(operation),
            } => {
                return Err(JobError::KeyReused {
                    id: request.id,
                    operation: (operation != op.name).then_some(operation),
                })
            }
            ChargeOutcome::Conflict { operation: None } => {
                return Err(JobError::IdInUse(request.id))
            }
        };
        // The plan came with the charge: its bound needs no read of its own.
        let max_stored = self.config().plan_or_default(Some(&plan)).max_stored_bytes;
        let job = Job {
            id: request.id,
            user: request.user,
            operation: op.name.clone(),
            provider: op.provider.clone(),
            input: request.input,
            cost,
            enqueued_at_ms: allowed.now_ms,
            deadline_ms,
            run: 0,
            nonce,
            trace: request.trace,
            price,
            charged: None,
        };
        match self.enqueue(&job, create, max_stored).await? {
            Enqueued::Created if charged => Ok(SubmitOutcome::Queued { job, allowed }),
            Enqueued::Created => Ok(SubmitOutcome::Duplicate {
                info: JobInfo {
                    job,
                    status: JobStatus::Queued,
                    finished_at_ms: None,
                },
                allowed,
            }),
            Enqueued::Existing(info) => Ok(SubmitOutcome::Duplicate {
                info: *info,
                allowed,
            }),
            Enqueued::Missing => Err(JobError::ResultExpired(job.id)),
            Enqueued::IdInUse => {
                if charged {
                    // A definite refusal: no job will ever carry this nonce.
                    self.ledger()
                        .release(&job.user, &job.id, &job.nonce)
                        .await?;
                }
                Err(JobError::IdInUse(job.id))
            }
            Enqueued::Full { stored, limit } => {
                self.full_marks()
                    .mark(&job.user, &job.operation, stored, limit);
                if charged {
                    // A definite refusal too: no job carries this nonce.
                    self.ledger()
                        .release(&job.user, &job.id, &job.nonce)
                        .await?;
                }
                Err(JobError::StoredBytesExceeded { stored, limit })
            }
        }
    }

    /// Waits until the job is final, at most `timeout`, and returns its info
    /// (still queued or running when the timeout came first).
    async fn wait(
        &self,
        user: &UserId,
        id: &RequestId,
        timeout: Duration,
    ) -> Result<Option<JobInfo>, JobError> {
        let watch = self.watch(id);
        let Some(info) = self.status(user, id).await? else {
            return Ok(None);
        };
        let operation = info.job.operation.clone();
        watch
            .until_final(None, timeout, self.poll(), || {
                self.read(user, &operation, id)
            })
            .await
    }
}

/// The cause of a job given up at its take for `cause` (past its deadline,
/// or past its attempts). When a run of it had `started` (claimed its charge,
/// about to call the provider) and its worker was lost, the call may have
/// been sent and the upstream may have done the work: it fails
/// [`FailureCause::Unanswered`] and keeps its charge. Otherwise it is given
/// up for `cause`, and released. (Before then such a job runs again under the
/// same charge: at least once, paid once.)
pub fn given_up(cause: FailureCause, started: bool) -> FailureCause {
    if started {
        FailureCause::Unanswered
    } else {
        cause
    }
}

/// Why a job given up after a lost run that had started failed (see [`given_up`]).
pub const LOST_MID_RUN: &str = "a run of the job started and its worker was lost (the upstream may have done the work): the charge stands, and the job is not run again";

/// Why a job whose claim was refused failed.
pub const UNPAID: &str = "the job's charge is not its own any more (released after its hold, or the id was charged again): not run";

/// Why a job whose charge an operator refunded before it ran failed.
pub const CANCELLED: &str =
    "cancelled by an operator: its charge was refunded before it ran; not run";

/// The worker's step between a lease and the provider call: the job claims its
/// charge ([`Ledger::claim`]), held until its deadline plus `grace`. Anything
/// but `Claimed`: the job must not run ([`unrun`] says how it fails).
pub async fn claim(
    ledger: &dyn Ledger,
    job: &Job,
    grace: Duration,
) -> Result<ClaimOutcome, JobError> {
    let claim = ClaimRequest {
        nonce: &job.nonce,
        hold_until_ms: job.deadline_ms.saturating_add(millis(grace)),
    };
    Ok(ledger.claim(&job.user, &job.id, &claim).await?)
}

/// How a job whose claim was not granted fails (unpaid: it owns no charge to
/// release); `None` when it was claimed.
pub fn unrun(claim: ClaimOutcome) -> Option<(FailureCause, &'static str)> {
    match claim {
        ClaimOutcome::Claimed => None,
        ClaimOutcome::Refused => Some((FailureCause::Abandoned, UNPAID)),
        ClaimOutcome::Cancelled => Some((FailureCause::Cancelled, CANCELLED)),
    }
}

/// What [`settle`] did with a job's charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// The operation has no `settle` rule: the estimate is the cost.
    Fixed,
    /// The answer has no number where the rule reads one (or there is no
    /// answer: the call was cut): the call is charged what it may have used,
    /// never the small estimate. A charge of the most stays the most; one of
    /// the estimate (`reserve = "estimate"`) rises to `settle.max`.
    NoUsage,
    /// The charge now costs `cost` (it was charged at `estimate`).
    To { estimate: u64, cost: u64 },
    /// The charge is not this job's any more (released, or left the window).
    NotOwned,
}

/// The retry key of a request without an Idempotency-Key: its user, its
/// operation and its body ([`fingerprint`]), hashed. A client's retry of the
/// same request has the same key.
pub fn retry_key(user: &UserId, operation: &str, input: &Value) -> String {
    let mut h = Sha256::new();
    for part in [user.as_str(), operation, &fingerprint(input)] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The worker's step after a successful call, before the result is recorded:
/// the job settles its charge to the cost the provider reported, by its nonce
/// ([`Ledger::settle_charge`]). Recorded before the result, so a worker that
/// dies in between leaves a job that runs again and settles again (to the
/// cost its new answer reports; the estimate is kept from the first).
pub async fn settle(
    ledger: &dyn Ledger,
    config: &crate::config::Config,
    job: &Job,
    answer: &Value,
) -> Result<Settled, JobError> {
    if let Some(applied) = job.price.as_deref().and_then(crate::price::Applied::parse) {
        return settle_priced(ledger, job, &applied, answer).await;
    }
    let Some((op, rule)) = config
        .operation(&job.operation)
        .and_then(|o| Some((o, o.settle.as_ref()?)))
    else {
        return Ok(Settled::Fixed);
    };
    let may_raise = op.settle_may_raise();
    // No usage in the answer (none reported, a stream cut before its usage,
    // no answer at all): the user may have had the most, so the charge is the
    // most. Who decides whether usage is reported (a client closing a stream
    // early, a request shaped to leave it out) must not decide the price. A
    // charge of the most stays as it is; one of the estimate rises to it.
    let (cost, reported) = match rule.cost(answer) {
        Some(cost) => (cost, true),
        None if !may_raise => return Ok(Settled::NoUsage),
        None => (rule.max.max(op.cost), false),
    };
    let settle = SettleRequest {
        nonce: &job.nonce,
        actual_cost: cost,
        may_raise,
    };
    let outcome = ledger.settle_charge(&job.user, &job.id, &settle).await?;
    Ok(match outcome {
        crate::ledger::SettleOutcome::Settled { .. } if !reported => Settled::NoUsage,
        crate::ledger::SettleOutcome::Settled { cost, .. } => Settled::To {
            estimate: job.cost,
            cost,
        },
        crate::ledger::SettleOutcome::NotFound { .. } => Settled::NotOwned,
    })
}

/// [`settle`] of a priced call: its usage at the prices it was reserved at,
/// never above the reservation (its worst case); no usage reported keeps the
/// reservation, as for any call whose usage is not seen.
async fn settle_priced(
    ledger: &dyn Ledger,
    job: &Job,
    applied: &crate::price::Applied,
    answer: &Value,
) -> Result<Settled, JobError> {
    let Some(cost) = applied.cost_of(answer) else {
        return Ok(Settled::NoUsage);
    };
    let settle = SettleRequest {
        nonce: &job.nonce,
        actual_cost: cost,
        may_raise: false,
    };
    Ok(
        match ledger.settle_charge(&job.user, &job.id, &settle).await? {
            crate::ledger::SettleOutcome::Settled { cost, .. } => Settled::To {
                estimate: job.cost,
                cost,
            },
            crate::ledger::SettleOutcome::NotFound { .. } => Settled::NotOwned,
        },
    )
}

/// A job leased to a worker. Only the holder of the current `token` can finish it.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub job: Job,
    /// The fencing token: incremented on every lease of the job.
    pub token: u64,
    pub worker: String,
    /// Until the job's deadline, as the backend's clock said when leasing: the
    /// worker times the call with it, never with its own wall clock.
    pub time_left: Duration,
    /// An earlier run started (claimed the charge, about to call the
    /// provider) and was lost: the upstream may have done the work, so this
    /// run's failure keeps the charge.
    pub ran_before: bool,
}

/// What a finishing call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Recorded (for a failure: and its charge released).
    Recorded,
    /// Refused: the lease was lost (expired and handed to another worker, or the
    /// job already ended). Nothing was recorded or released.
    LeaseLost,
}

/// What one [`JobSource::maintain`] round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintenance {
    /// Jobs whose lease expired (or whose worker died), put back in the queue.
    pub requeued: u64,
    /// Jobs that used up their runs: failed and released.
    pub abandoned: u64,
    /// Pending releases finished.
    pub released: u64,
}

/// How many livenesses a lapsed member of a queue (a worker, a throttler)
/// stays known after its liveness ended: its processing list is reclaimed
/// again by the others all that time, since a pop of its may still land
/// (a slow link, a pause, a process that dies right after a reclaim).
pub const LAPSED_KEPT: u32 = 10;

/// Whether a member whose last heartbeat round began `since` ago may still
/// pop into its processing list: only while it is surely listed, half the
/// time a lapsed member is kept (so a pop sent now lands long before it is
/// forgotten). A member that never heartbeat pops nothing.
pub fn may_pop(since: Option<Duration>, liveness: Duration) -> bool {
    since.is_some_and(|s| s < liveness * LAPSED_KEPT / 2)
}

/// A job's final failure as [`JobSource::fail`] records it: its cause, what
/// happens to its charge (which must agree with the cause:
/// [`FailureCause::charged`]), and the message the caller sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure<'a> {
    pub cause: FailureCause,
    pub charge: Charge,
    pub message: &'a str,
}

impl<'a> Failure<'a> {
    pub fn new(cause: FailureCause, charge: Charge, message: &'a str) -> Self {
        Self {
            cause,
            charge,
            message,
        }
    }
}

/// Who takes jobs, and on what terms: the worker's name, how long a take
/// waits for a job, and how long the lease it gets lasts. A worker makes one
/// and passes it to every [`JobSource::take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taker<'a> {
    pub worker: &'a str,
    pub block: Duration,
    pub lease: Duration,
}

impl<'a> Taker<'a> {
    pub fn new(worker: &'a str, block: Duration, lease: Duration) -> Self {
        Self {
            worker,
            block,
            lease,
        }
    }
}

/// The worker side of a job backend.
#[async_trait]
pub trait JobSource: Send + Sync + std::fmt::Debug {
    /// Waits at most `taker.block` for a job of `operation` and leases it to
    /// `taker.worker` for `taker.lease`; [`start`](Self::start) it before
    /// calling the provider. Malformed entries (unreadable, unknown operation)
    /// are moved aside and logged, never returned. A job past its deadline, or
    /// past its runs, is failed and released here and not returned.
    async fn take(&self, operation: &str, taker: Taker<'_>) -> Result<Option<Lease>, JobError>;

    /// The step between a lease and the provider call: the job claims its
    /// charge ([`Ledger::claim`]), and the record notes that a run started
    /// (see [`Lease::ran_before`]). `Ok(true)`: it owns it, call the provider.
    /// `Ok(false)`: refused (the charge was released, or the id charged anew):
    /// the job is recorded as failed, unpaid, and must not run. `Err`: whether
    /// the claim landed is unknown: hand the lease back (the next taker claims
    /// again; a claim is idempotent).
    async fn start(&self, lease: &Lease) -> Result<bool, JobError>;

    /// After a successful call, before [`complete`](Self::complete): settles
    /// the job's charge to the cost `answer` reports ([`settle`]).
    async fn settle(&self, lease: &Lease, answer: &Value) -> Result<Settled, JobError>;

    /// Extends the lease; `Finish::LeaseLost` when it is not ours any more.
    async fn renew(&self, lease: &Lease, by: Duration) -> Result<Finish, JobError>;

    /// Records the result (kept for the result TTL) and wakes the watchers.
    async fn complete(&self, lease: &Lease, result: Value) -> Result<Finish, JobError>;

    /// [`complete`](Self::complete), keeping the upstream answer's `head`
    /// (status, safe headers) with the result when it is not a plain 200, and
    /// what the job's charge settled to (`charged`, when its settle changed
    /// it: answers then say what was charged, not what was reserved). This
    /// default drops both.
    async fn complete_with(
        &self,
        lease: &Lease,
        result: Value,
        head: Option<crate::head::Head>,
        charged: Option<u64>,
    ) -> Result<Finish, JobError> {
        let _ = (head, charged);
        self.complete(lease, result).await
    }

    /// Records a final failure, wakes the watchers, and does with the job's
    /// charge what `charge` says: releases it once, or leaves it standing.
    /// `charge` must agree with `cause` ([`FailureCause::charged`]): the
    /// status says whether the user was charged from the cause.
    async fn fail(&self, lease: &Lease, failure: Failure<'_>) -> Result<Finish, JobError>;

    /// Puts the job back at the head of its queue without counting the attempt
    /// (a worker shutting down).
    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError>;

    /// Puts a job taken but not [`start`](Self::start)ed back at the *tail*
    /// of its queue, without counting the run: its worker will not run it
    /// now (its user holds its share of the worker: `tollgate_worker`), and
    /// the jobs queued behind it are taken first. The lease ends; nothing is
    /// claimed, charged or released: the charge stays held for the job, as
    /// it was before the take. Fenced like [`hand_back`](Self::hand_back):
    /// `Finish::LeaseLost` when the lease is not this token's any more.
    async fn defer(&self, lease: &Lease) -> Result<Finish, JobError>;

    /// Housekeeping that any worker runs periodically: renews `worker`'s
    /// liveness for `lease`, requeues jobs whose lease expired or whose worker
    /// died (failing those past their attempts), finishes pending releases.
    async fn maintain(&self, worker: &str, lease: Duration) -> Result<Maintenance, JobError>;

    /// The worker stops: jobs it moved but never leased go back to the queue,
    /// its liveness ends.
    async fn retire(&self, worker: &str) -> Result<(), JobError>;
}

/// Timings shared by both job backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobOptions {
    /// The most a finished job (its result or error) stays readable: an
    /// operation's own `result_ttl` applies up to this ([`Self::result_ttl`]).
    /// Default 7 days (the most `result_ttl` may be): the config decides.
    pub result_ttl: Duration,
    /// How often a watcher re-reads the status besides being woken.
    pub poll: Duration,
    /// A failed job's release left pending this long is finished by maintenance.
    pub release_grace: Duration,
}

impl Default for JobOptions {
    fn default() -> Self {
        Self {
            result_ttl: Duration::from_secs(7 * 86_400),
            poll: Duration::from_millis(500),
            release_grace: Duration::from_secs(5),
        }
    }
}

impl JobOptions {
    /// How long `operation`'s finished jobs stay readable: its `result_ttl`,
    /// at most [`JobOptions::result_ttl`].
    pub fn result_ttl(&self, config: &Config, operation: &str) -> Duration {
        config
            .operation(operation)
            .map_or(self.result_ttl, |o| o.result_ttl.min(self.result_ttl))
    }
}

/// `d` in whole milliseconds, saturating (a store's deadlines and TTLs are
/// counted in ms).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
