//! What a call ends in: [`Outcome`], one variant per answer an application
//! acts on differently, and the [`Problem`] body behind every error answer.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

/// How a logical call ended, once the client's retries are spent or not
/// needed. Transport failures, bad credentials and requests tollgate refuses
/// as they are are [`Error`](crate::Error)s instead.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The job succeeded: its result.
    Done(Done),
    /// The job is accepted and not finished yet (an async submission, or a
    /// call whose deadline passed while the job still ran): ask again with
    /// [`Client::wait`](crate::Client::wait), or resend the same call.
    Pending(Pending),
    /// Over budget (`429 /problems/quota-exceeded`), nothing charged. Do not
    /// retry before `retry_after`, which is exact (when the call's cost fits
    /// every window), not rounded up to seconds like `Retry-After`.
    BudgetExhausted {
        retry_after: Duration,
        /// Every limit of the user's plan (from `RateLimit-Policy` and `RateLimit`).
        windows: Vec<Window>,
        detail: Option<String>,
    },
    /// The provider is saturated (`504 /problems/throttle-timeout`, refunded)
    /// and stayed so through the client's retries: try again after `retry_after`.
    ProviderBusy {
        retry_after: Duration,
        job_id: Option<String>,
        detail: Option<String>,
    },
    /// The upstream rejected the input (`/problems/upstream-rejected`, a 4xx):
    /// resending it will not help. `body` is the upstream's answer when the
    /// operation exposes it.
    Rejected {
        upstream_status: u16,
        detail: Option<String>,
        body: Option<Value>,
        job_id: Option<String>,
    },
    /// The user's jobs store as many bytes as the plan allows (`429
    /// /problems/stored-bytes-exceeded`), nothing charged: retry once some
    /// finish or their results expire.
    StoredBytesExceeded {
        stored_bytes: u64,
        max_stored_bytes: u64,
    },
    /// The job failed for good (or kept failing until the deadline).
    Failed(Failure),
}

impl Outcome {
    /// The job's result, when it is [`Outcome::Done`].
    pub fn result(&self) -> Option<&Value> {
        match self {
            Self::Done(d) => Some(&d.result),
            _ => None,
        }
    }

    /// The id of the job the outcome is about, when tollgate named one.
    pub fn job_id(&self) -> Option<&str> {
        match self {
            Self::Done(d) => Some(&d.job_id),
            Self::Pending(p) => Some(&p.job_id),
            Self::ProviderBusy { job_id, .. } | Self::Rejected { job_id, .. } => job_id.as_deref(),
            Self::Failed(f) => f.job_id.as_deref(),
            Self::BudgetExhausted { .. } | Self::StoredBytesExceeded { .. } => None,
        }
    }

    /// A short name of the variant (`done`, `pending`, `budget_exhausted`,
    /// `provider_busy`, `rejected`, `stored_bytes_exceeded`, `failed`), for
    /// logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Done(_) => "done",
            Self::Pending(_) => "pending",
            Self::BudgetExhausted { .. } => "budget_exhausted",
            Self::ProviderBusy { .. } => "provider_busy",
            Self::Rejected { .. } => "rejected",
            Self::StoredBytesExceeded { .. } => "stored_bytes_exceeded",
            Self::Failed(_) => "failed",
        }
    }
}

/// A succeeded job.
#[derive(Debug, Clone, PartialEq)]
pub struct Done {
    pub job_id: String,
    pub operation: String,
    /// The provider's result.
    pub result: Value,
    /// What the job was charged, exactly, in minor units of `currency`:
    /// its settled charge once the upstream reported usage, else its
    /// reservation.
    pub cost: u64,
    /// What `cost` counts: `tokens`, or an ISO 4217 currency (`cost` is then
    /// in micro-units: 150 is 0.00015 USD).
    pub currency: String,
    /// HTTP requests this logical call took (1 without retries or waits).
    pub attempts: u32,
}

/// An accepted job that is not final yet.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    pub job_id: String,
    /// `queued`, `waiting_for_provider` or `running`.
    pub status: String,
    /// While `waiting_for_provider`: where the job stands (`position`,
    /// `others_ahead`, `estimated_wait_ms`, ...), as `GET /v1/jobs/{id}` says.
    pub provider_queue: Option<Value>,
    pub attempts: u32,
}

/// A job that failed, or an answer that ends the call without a result.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The HTTP status (for a failure read from `GET /v1/jobs/{id}`: the
    /// status the same failure answers an operation call with).
    pub status: u16,
    /// The problem type's last segment (`provider-failure`,
    /// `upstream-unanswered`, `result-expired`, ...).
    pub kind: String,
    /// Why the job failed: `provider`, `unanswered`, `bad_response`,
    /// `throttle_timeout`, `expired`, `abandoned`.
    pub cause: Option<String>,
    /// Whether the charge stands (the upstream may have done the work) or
    /// was released.
    pub charged: Option<bool>,
    pub job_id: Option<String>,
    pub detail: Option<String>,
    pub attempts: u32,
}

/// One limit of a plan: `limit` tokens per `window`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// The policy's name in the headers (`budget`, or `budget-<window>`).
    pub policy: String,
    pub limit: u64,
    pub window: Duration,
    /// Left in this window, for the window the `RateLimit` header names (the
    /// one closest to exhaustion).
    pub remaining: Option<u64>,
    /// When more frees up in that window (seconds, rounded up).
    pub reset_after: Option<Duration>,
}

/// The `application/problem+json` body (RFC 9457) of an error answer.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Problem {
    /// `/problems/<slug>`.
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub title: String,
    #[serde(default)]
    pub status: u16,
    pub detail: Option<String>,
    pub field: Option<String>,
    pub job_id: Option<String>,
    pub cause: Option<String>,
    pub charged: Option<bool>,
    pub retry_after_ms: Option<u64>,
    pub waited_ms: Option<u64>,
    pub stored_bytes: Option<u64>,
    pub max_stored_bytes: Option<u64>,
    pub upstream_status: Option<u16>,
    pub upstream_body: Option<Value>,
}

impl Problem {
    /// The type's last segment: `quota-exceeded` of `/problems/quota-exceeded`.
    pub fn slug(&self) -> &str {
        self.kind.rsplit('/').next().unwrap_or_default()
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.kind.is_empty() {
            "(no problem type)"
        } else {
            &self.kind
        };
        match &self.detail {
            Some(d) => write!(f, "{} {kind}: {d}", self.status),
            None => write!(f, "{} {kind}: {}", self.status, self.title),
        }
    }
}
