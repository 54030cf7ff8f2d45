//! Errors at the HTTP edge: one [`ApiError`] enum, one `IntoResponse` that turns
//! each variant into an `application/problem+json` body (RFC 9457) with a stable
//! `type`. Internal details are logged here and never sent to the client.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tollgate_core::{
    config::PriceError,
    error::StoreError,
    id::RequestId,
    job::{FailureCause, JobError, Rejection},
    keystore::KeyStoreError,
    ledger::{Denied, LedgerError},
};

/// Media type of every error body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The most characters of one piece of client input that an error repeats.
pub const ECHO_LIMIT: usize = 64;
/// The most characters of a whole `detail`.
const DETAIL_LIMIT: usize = 512;

/// `input` as an error message may repeat it: at most [`ECHO_LIMIT`]
/// characters, then `…`. Use it wherever a detail quotes what the client sent.
pub fn echo(input: &str) -> String {
    cut(input, ECHO_LIMIT)
}

fn cut(s: &str, limit: usize) -> String {
    match s.char_indices().nth(limit) {
        Some((end, _)) => format!("{}…", &s[..end]),
        None => s.to_owned(),
    }
}

/// The last net under every `detail` and `field` that leaves the api, for the
/// messages built outside this crate's control (serde's, a store's): no run of
/// non-blank characters longer than [`ECHO_LIMIT`], nothing past
/// [`DETAIL_LIMIT`], so a client that sends 10 KB never reads them back.
fn bounded(detail: &str) -> String {
    let mut out = String::with_capacity(detail.len().min(DETAIL_LIMIT + 8));
    let mut run = 0;
    for c in detail.chars() {
        run = if c.is_whitespace() { 0 } else { run + 1 };
        if run == ECHO_LIMIT + 1 {
            out.push('…');
        }
        if run <= ECHO_LIMIT {
            out.push(c);
        }
    }
    cut(&out, DETAIL_LIMIT)
}

/// Problem types are relative URI references (RFC 9457 §3.1.1): stable names
/// that never change meaning. Every type the api can answer with is listed in
/// [`ProblemType::ALL`] (and in the OpenAPI document).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemType {
    Unauthorized,
    TooManyFailedAuthentications,
    AdminDisabled,
    NotFound,
    UnknownOperation,
    MethodNotAllowed,
    MalformedRequest,
    InvalidField,
    UnsupportedMediaType,
    PayloadTooLarge,
    QuotaExceeded,
    CostExceedsLimit,
    IdempotencyConflict,
    IdempotencyKeyReused,
    ResultExpired,
    ProviderFailure,
    UpstreamUnanswered,
    BadUpstreamResponse,
    ThrottleTimeout,
    JobExpired,
    JobAbandoned,
    BackendUnavailable,
    NotReady,
    Internal,
    JobCancelled,
    ChargeOwnedByJob,
    Overloaded,
    ReadOnlyCredential,
    CrossSiteRequest,
    StoredBytesExceeded,
    UserRequired,
    ActingForAnotherUser,
    PlanNotAllowed,
    UpstreamRejected,
    TooManyStreams,
    CreditsExhausted,
}

impl ProblemType {
    pub const ALL: [ProblemType; 36] = [
        Self::Unauthorized,
        Self::TooManyFailedAuthentications,
        Self::AdminDisabled,
        Self::NotFound,
        Self::UnknownOperation,
        Self::MethodNotAllowed,
        Self::MalformedRequest,
        Self::InvalidField,
        Self::UnsupportedMediaType,
        Self::PayloadTooLarge,
        Self::QuotaExceeded,
        Self::CostExceedsLimit,
        Self::IdempotencyConflict,
        Self::IdempotencyKeyReused,
        Self::ResultExpired,
        Self::ProviderFailure,
        Self::UpstreamUnanswered,
        Self::BadUpstreamResponse,
        Self::ThrottleTimeout,
        Self::JobExpired,
        Self::JobAbandoned,
        Self::BackendUnavailable,
        Self::NotReady,
        Self::Internal,
        Self::JobCancelled,
        Self::ChargeOwnedByJob,
        Self::Overloaded,
        Self::ReadOnlyCredential,
        Self::CrossSiteRequest,
        Self::StoredBytesExceeded,
        Self::UserRequired,
        Self::ActingForAnotherUser,
        Self::PlanNotAllowed,
        Self::UpstreamRejected,
        Self::TooManyStreams,
        Self::CreditsExhausted,
    ];

    pub fn slug(self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::TooManyFailedAuthentications => "too-many-failed-authentications",
            Self::AdminDisabled => "admin-disabled",
            Self::NotFound => "not-found",
            Self::UnknownOperation => "unknown-operation",
            Self::MethodNotAllowed => "method-not-allowed",
            Self::MalformedRequest => "malformed-request",
            Self::InvalidField => "invalid-field",
            Self::UnsupportedMediaType => "unsupported-media-type",
            Self::PayloadTooLarge => "payload-too-large",
            Self::QuotaExceeded => "quota-exceeded",
            Self::CostExceedsLimit => "cost-exceeds-limit",
            Self::IdempotencyConflict => "idempotency-conflict",
            Self::IdempotencyKeyReused => "idempotency-key-reused",
            Self::ResultExpired => "result-expired",
            Self::ProviderFailure => "provider-failure",
            Self::UpstreamUnanswered => "upstream-unanswered",
            Self::BadUpstreamResponse => "bad-upstream-response",
            Self::ThrottleTimeout => "throttle-timeout",
            Self::JobExpired => "job-expired",
            Self::JobAbandoned => "job-abandoned",
            Self::BackendUnavailable => "backend-unavailable",
            Self::NotReady => "not-ready",
            Self::Internal => "internal",
            Self::JobCancelled => "job-cancelled",
            Self::ChargeOwnedByJob => "charge-owned-by-job",
            Self::Overloaded => "overloaded",
            Self::ReadOnlyCredential => "read-only-credential",
            Self::CrossSiteRequest => "cross-site-request",
            Self::StoredBytesExceeded => "stored-bytes-exceeded",
            Self::UserRequired => "user-required",
            Self::ActingForAnotherUser => "acting-for-another-user",
            Self::PlanNotAllowed => "plan-not-allowed",
            Self::UpstreamRejected => "upstream-rejected",
            Self::TooManyStreams => "too-many-streams",
            Self::CreditsExhausted => "credits-exhausted",
        }
    }

    /// The `type` member: `/problems/<slug>`.
    pub fn uri(self) -> String {
        format!("/problems/{}", self.slug())
    }

    pub fn status(self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::AdminDisabled
            | Self::ReadOnlyCredential
            | Self::CrossSiteRequest
            | Self::ActingForAnotherUser
            | Self::PlanNotAllowed => StatusCode::FORBIDDEN,
            Self::NotFound | Self::UnknownOperation => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::MalformedRequest | Self::UserRequired => StatusCode::BAD_REQUEST,
            Self::InvalidField
            | Self::CostExceedsLimit
            | Self::IdempotencyKeyReused
            | Self::UpstreamRejected => StatusCode::UNPROCESSABLE_ENTITY,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::QuotaExceeded
            | Self::TooManyFailedAuthentications
            | Self::StoredBytesExceeded
            | Self::TooManyStreams => StatusCode::TOO_MANY_REQUESTS,
            Self::IdempotencyConflict | Self::JobCancelled | Self::ChargeOwnedByJob => {
                StatusCode::CONFLICT
            }
            Self::ResultExpired => StatusCode::GONE,
            Self::ProviderFailure | Self::BadUpstreamResponse => StatusCode::BAD_GATEWAY,
            Self::ThrottleTimeout | Self::JobExpired | Self::UpstreamUnanswered => {
                StatusCode::GATEWAY_TIMEOUT
            }
            Self::JobAbandoned | Self::BackendUnavailable | Self::NotReady | Self::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::CreditsExhausted => StatusCode::PAYMENT_REQUIRED,
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::Unauthorized => "Missing, unknown or revoked credentials",
            Self::TooManyFailedAuthentications => {
                "Too many unknown or revoked keys from this address: retry after Retry-After"
            }
            Self::AdminDisabled => "Admin routes are disabled (no admin token configured)",
            Self::NotFound => "Not found",
            Self::UnknownOperation => "Unknown operation",
            Self::MethodNotAllowed => "Method not allowed",
            Self::MalformedRequest => "Malformed request",
            Self::InvalidField => "Invalid field",
            Self::UnsupportedMediaType => "Unsupported media type",
            Self::PayloadTooLarge => "Request body too large",
            Self::QuotaExceeded => "Budget exhausted: do not retry before Retry-After",
            Self::CostExceedsLimit => "The operation costs more than the plan's whole budget",
            Self::IdempotencyConflict => "Idempotency key already used for another operation",
            Self::IdempotencyKeyReused => {
                "Idempotency key already used for another operation or request body"
            }
            Self::ResultExpired => {
                "The request with this Idempotency-Key ran and was charged; its result is no longer kept"
            }
            Self::ProviderFailure => "The upstream provider failed; its charge was released",
            Self::UpstreamUnanswered => {
                "The upstream did not answer; it may have done the work, so the budget stays charged"
            }
            Self::BadUpstreamResponse => {
                "The upstream answered with a body that is not JSON; the work was done, so the budget stays charged"
            }
            Self::ThrottleTimeout => {
                "The provider is saturated: no slot in time; its charge was released"
            }
            Self::JobExpired => "The job missed its deadline; its charge was released",
            Self::JobAbandoned => "The job was given up; its charge was released",
            Self::BackendUnavailable => "The backing store is unavailable; retry shortly",
            Self::NotReady => {
                "A loop of this process is stuck or stopped, it is shutting down, or its store does not keep the durability asked for"
            }
            Self::Internal => "Internal error",
            Self::JobCancelled => {
                "An operator refunded the job's charge before it ran: it was cancelled, never sent"
            }
            Self::ChargeOwnedByJob => {
                "The job owns this charge and may be calling the provider: refund it once the job is final"
            }
            Self::Overloaded => {
                "The api holds its most connections, or the request outlasted its time: retry after Retry-After"
            }
            Self::ReadOnlyCredential => {
                "This credential only reads (the viewer token, or a dashboard session): nothing changed"
            }
            Self::CrossSiteRequest => {
                "A cross-site request, or a form without its session's CSRF token: nothing changed"
            }
            Self::StoredBytesExceeded => {
                "Your jobs' stored inputs and results are at the plan's limit: retry once some finish or their results expire; nothing was charged"
            }
            Self::UserRequired => {
                "A service key must name the user it acts for: send Tollgate-User: <user id>"
            }
            Self::ActingForAnotherUser => {
                "A user's key acts only for its own user: Tollgate-User names someone else"
            }
            Self::PlanNotAllowed => {
                "Tollgate-Plan names a plan this key may not give (see the key's allowed_plans)"
            }
            Self::UpstreamRejected => {
                "The upstream rejected the input (upstream_status): change it before retrying; its charge was released"
            }
            Self::TooManyStreams => {
                "Your plan's most streamed answers are open on this server: retry once one ends; nothing was charged"
            }
            Self::CreditsExhausted => {
                "Your prepaid balance cannot cover this request: top up before retrying; nothing was charged"
            }
        }
    }
}

/// The body of every error response.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: &'static str,
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The offending field (400/422).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The job concerned (502/503/504 of an operation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    /// Why a job failed: `provider`, `unanswered`, `bad_response`,
    /// `throttle_timeout`, `expired`, `abandoned`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<&'static str>,
    /// A failed job: whether its charge stands (the upstream may have done
    /// the work) or was released.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charged: Option<bool>,
    /// 429: milliseconds until the request fits (exact).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// A failed job (502/503/504): from its submission to its end, in ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waited_ms: Option<u64>,
    /// 429 stored-bytes-exceeded: the bytes the user's jobs store in the
    /// operation's queue now, and the plan's `max_stored_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_stored_bytes: Option<u64>,
    /// 422 upstream-rejected: the upstream's status code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_status: Option<u16>,
    /// 422 upstream-rejected: the upstream's body (at most 1024 bytes), only
    /// when the operation sets `expose_upstream_errors = true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_body: Option<String>,
    /// 429 quota-exceeded: whose budget held the request back, `user` or
    /// `organisation` (the user's organisation's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<tollgate_core::ledger::Scope>,
    /// 402 credits-exhausted: the prepaid balance, and what the request
    /// needed (decimal strings in a money currency, else integers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub balance: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub needed: Option<serde_json::Value>,
}

/// Everything the api can answer with other than success.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthorized(&'static str),
    /// The client's address presented too many bad keys: 429 with Retry-After.
    #[error("too many failed authentications; retry in {0:?}")]
    AuthFailures(std::time::Duration),
    #[error("admin routes are disabled: set TOLLGATE_ADMIN_TOKEN")]
    AdminDisabled,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    UnknownOperation(String),
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("{detail}")]
    Malformed {
        detail: String,
        field: Option<String>,
    },
    #[error("{detail}")]
    InvalidField { field: String, detail: String },
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("the request body is larger than this server accepts")]
    PayloadTooLarge,
    #[error("budget exhausted")]
    QuotaExceeded(Box<Denied>),
    #[error("{0}")]
    CostExceedsLimit(String),
    #[error("{0}")]
    IdempotencyConflict(String),
    #[error("this Idempotency-Key was already used for another operation or body (job {job_id})")]
    IdempotencyKeyReused { job_id: RequestId },
    #[error("job {0} ran and was charged; its result is no longer kept: use a new Idempotency-Key to run it again")]
    ResultExpired(RequestId),
    /// An operator's refund of a charge its running job owns: nothing changed.
    #[error("{0}")]
    ChargeOwnedByJob(String),
    /// The viewer token or a dashboard session on a route that changes things.
    #[error("{0}")]
    ReadOnly(&'static str),
    /// A dashboard form sent cross-site, or without its session's CSRF token.
    #[error("{0}")]
    CrossSite(&'static str),
    /// The user's stored job bytes and this job's would pass the plan's bound.
    #[error("your jobs store {stored} bytes in this operation's queue; with this request's they would pass the plan's max_stored_bytes of {limit}")]
    StoredBytesExceeded { stored: u64, limit: u64 },
    /// The user has its plan's `max_open_streams` open on this pod.
    #[error("you have {open} streamed answers open on this server, your plan's max_open_streams of {limit}; retry once one ends")]
    TooManyStreams { open: u32, limit: u32 },
    /// A service key called without `Tollgate-User`.
    #[error("a service key must name the user it acts for: send Tollgate-User: <user id>")]
    UserRequired,
    /// A user's key named another user in `Tollgate-User`.
    #[error("Tollgate-User names another user: a user's key acts only for its own user")]
    ActingForAnotherUser,
    /// `Tollgate-User` with a plan the key may not give.
    #[error("{0}")]
    PlanNotAllowed(String),
    #[error("job {job_id} failed: {message}")]
    JobFailed {
        job_id: RequestId,
        cause: FailureCause,
        message: String,
        /// From its submission to its end, on the backend's clock.
        waited_ms: Option<u64>,
    },
    /// A store failed: 503 when it is worth retrying (unreachable, restarting),
    /// else 500; logged with its source, never described to the client.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `/readyz`: a role's loop is overdue or ended (the loops, by name).
    #[error("not ready: {0}")]
    NotReady(String),
    /// The request outlasted the request timeout of its route: 503 with
    /// Retry-After.
    #[error("the request took longer than {0:?}; retry shortly")]
    RequestTimeout(std::time::Duration),
    /// Anything else: 500, logged, never described to the client.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn kind(&self) -> ProblemType {
        match self {
            Self::Unauthorized(_) => ProblemType::Unauthorized,
            Self::AuthFailures(_) => ProblemType::TooManyFailedAuthentications,
            Self::RequestTimeout(_) => ProblemType::Overloaded,
            Self::AdminDisabled => ProblemType::AdminDisabled,
            Self::NotFound(_) => ProblemType::NotFound,
            Self::UnknownOperation(_) => ProblemType::UnknownOperation,
            Self::MethodNotAllowed => ProblemType::MethodNotAllowed,
            Self::Malformed { .. } => ProblemType::MalformedRequest,
            Self::InvalidField { .. } => ProblemType::InvalidField,
            Self::UnsupportedMediaType(_) => ProblemType::UnsupportedMediaType,
            Self::PayloadTooLarge => ProblemType::PayloadTooLarge,
            Self::QuotaExceeded(d) if d.credits.is_some() => ProblemType::CreditsExhausted,
            Self::QuotaExceeded(_) => ProblemType::QuotaExceeded,
            Self::CostExceedsLimit(_) => ProblemType::CostExceedsLimit,
            Self::IdempotencyConflict(_) => ProblemType::IdempotencyConflict,
            Self::IdempotencyKeyReused { .. } => ProblemType::IdempotencyKeyReused,
            Self::ResultExpired(_) => ProblemType::ResultExpired,
            Self::UserRequired => ProblemType::UserRequired,
            Self::ActingForAnotherUser => ProblemType::ActingForAnotherUser,
            Self::PlanNotAllowed(_) => ProblemType::PlanNotAllowed,
            Self::JobFailed { cause, .. } => match cause {
                FailureCause::Rejected => ProblemType::UpstreamRejected,
                FailureCause::Provider => ProblemType::ProviderFailure,
                FailureCause::Unanswered => ProblemType::UpstreamUnanswered,
                FailureCause::BadResponse => ProblemType::BadUpstreamResponse,
                FailureCause::ThrottleTimeout => ProblemType::ThrottleTimeout,
                FailureCause::Expired => ProblemType::JobExpired,
                FailureCause::Abandoned => ProblemType::JobAbandoned,
                FailureCause::Cancelled => ProblemType::JobCancelled,
            },
            Self::ChargeOwnedByJob(_) => ProblemType::ChargeOwnedByJob,
            Self::ReadOnly(_) => ProblemType::ReadOnlyCredential,
            Self::CrossSite(_) => ProblemType::CrossSiteRequest,
            Self::StoredBytesExceeded { .. } => ProblemType::StoredBytesExceeded,
            Self::TooManyStreams { .. } => ProblemType::TooManyStreams,
            Self::Store(e) if e.is_transient() => ProblemType::BackendUnavailable,
            Self::NotReady(_) => ProblemType::NotReady,
            Self::Store(_) | Self::Internal(_) => ProblemType::Internal,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.kind().status()
    }

    /// The body sent to the client: no internal detail for 5xx store errors.
    pub fn problem(&self) -> Problem {
        let kind = self.kind();
        let mut p = Problem {
            kind: kind.uri(),
            title: kind.title(),
            status: kind.status().as_u16(),
            detail: None,
            field: None,
            job_id: None,
            cause: None,
            charged: None,
            retry_after_ms: None,
            waited_ms: None,
            stored_bytes: None,
            max_stored_bytes: None,
            upstream_status: None,
            upstream_body: None,
            scope: None,
            balance: None,
            needed: None,
        };
        match self {
            Self::Store(e) if e.is_transient() => {
                p.detail = Some("the budget or job store cannot be reached; retry shortly".into())
            }
            Self::Store(_) | Self::Internal(_) => {}
            Self::Malformed { field, .. } => {
                p.detail = Some(self.to_string());
                p.field = field.clone();
            }
            Self::InvalidField { field, .. } => {
                p.detail = Some(self.to_string());
                p.field = Some(field.clone());
            }
            Self::QuotaExceeded(denied) if denied.credits.is_some() => {
                let amount = |n: u64| tollgate_core::money::Amount::new(denied.currency, n);
                let text = |n: u64| match denied.currency {
                    tollgate_core::money::Currency::Tokens => format!("{n} tokens"),
                    c => format!("{} {c}", tollgate_core::money::format_amount(c, n)),
                };
                let balance = denied.credits.unwrap_or(0);
                p.detail = Some(format!(
                    "your prepaid balance is {}; this request needs {}",
                    text(balance),
                    text(denied.needed)
                ));
                p.balance = Some(amount(balance).to_json());
                p.needed = Some(amount(denied.needed).to_json());
            }
            Self::QuotaExceeded(denied) => {
                // The binding limit's window (`12h`) or period (`month`).
                let window = denied
                    .windows
                    .iter()
                    .chain(denied.organisation.iter().flat_map(|o| o.windows.iter()))
                    .find(|w| {
                        w.window_ms == denied.window_ms
                            && w.limit == denied.limit
                            && w.remaining == denied.remaining
                    })
                    .map(tollgate_core::ledger::WindowUse::label)
                    .unwrap_or_else(|| {
                        tollgate_core::duration::format(std::time::Duration::from_millis(
                            denied.window_ms,
                        ))
                    });
                let whose = match denied.scope {
                    tollgate_core::ledger::Scope::User => "",
                    tollgate_core::ledger::Scope::Organisation => "your organisation ",
                };
                let amount = |n: u64| match denied.currency {
                    tollgate_core::money::Currency::Tokens => format!("{n} tokens"),
                    c => format!("{} {c}", tollgate_core::money::format_amount(c, n)),
                };
                let needs = match denied.needed {
                    0 => String::new(),
                    n => format!("; this request needs {}", amount(n)),
                };
                p.detail = Some(format!(
                    "{whose}used {} of {} per {window}{needs}; it fits in {} ms",
                    amount(denied.used),
                    amount(denied.limit),
                    denied.retry_after_ms
                ));
                p.retry_after_ms = Some(denied.retry_after_ms);
                p.scope = Some(denied.scope);
            }
            Self::StoredBytesExceeded { stored, limit } => {
                p.detail = Some(self.to_string());
                p.stored_bytes = Some(*stored);
                p.max_stored_bytes = Some(*limit);
            }
            Self::IdempotencyKeyReused { job_id } | Self::ResultExpired(job_id) => {
                p.detail = Some(self.to_string());
                p.field = Some("Idempotency-Key".into());
                p.job_id = Some(job_id.to_string());
            }
            Self::JobFailed {
                job_id,
                cause: cause @ FailureCause::Rejected,
                message,
                waited_ms,
            } => {
                // The message is the rejection (JSON): its body reaches the
                // client only as `upstream_body`, never inside the detail.
                let rejection = Rejection::parse(message);
                p.detail = Some(match &rejection {
                    Some(r) => format!(
                        "rejected: the upstream answered {} to the input",
                        r.upstream_status
                    ),
                    None => "rejected: the upstream rejected the input".into(),
                });
                p.job_id = Some(job_id.to_string());
                p.cause = Some(cause.as_str());
                p.charged = Some(cause.charged());
                p.waited_ms = *waited_ms;
                if let Some(r) = rejection {
                    p.upstream_status = Some(r.upstream_status);
                    p.upstream_body = r.upstream_body;
                }
            }
            Self::JobFailed {
                job_id,
                cause,
                message,
                waited_ms,
            } => {
                p.detail = Some(match waited_ms {
                    Some(ms) if cause.http_status() == 504 => {
                        format!("{}: {message} (waited {ms} ms)", cause.as_str())
                    }
                    _ => format!("{}: {message}", cause.as_str()),
                });
                p.job_id = Some(job_id.to_string());
                p.cause = Some(cause.as_str());
                p.charged = Some(cause.charged());
                p.waited_ms = *waited_ms;
            }
            other => p.detail = Some(other.to_string()),
        }
        p.detail = p.detail.as_deref().map(bounded);
        p.field = p.field.as_deref().map(echo);
        p
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        match &self {
            Self::Internal(m) => tracing::error!(error = %m, "internal error"),
            Self::Store(e) if e.is_transient() => {
                tracing::warn!(error = %e, source = ?std::error::Error::source(e), "backend unavailable")
            }
            Self::Store(e) => {
                tracing::error!(error = %e, source = ?std::error::Error::source(e), "backend error")
            }
            _ => tracing::debug!(status = status.as_u16(), error = %self, "request failed"),
        }
        let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        match &self {
            Self::Unauthorized(_) => {
                headers.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"tollgate\""),
                );
            }
            // A balance refills by a top-up, not with time: no Retry-After.
            Self::QuotaExceeded(denied) if denied.credits.is_some() => {}
            Self::QuotaExceeded(denied) => {
                crate::ratelimit::denied(denied).apply(headers);
            }
            Self::AuthFailures(wait) => {
                let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
            }
            // Temporary unavailability: worth a retry soon. A provider failure
            // or a saturated provider gets no hint, so clients back off on their
            // own instead of retrying in step.
            Self::Store(e) if e.is_transient() => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::RequestTimeout(_) | Self::TooManyStreams { .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::JobFailed {
                cause: FailureCause::Abandoned,
                ..
            } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::CostExceedsLimit { .. } => Self::CostExceedsLimit(e.to_string()),
            LedgerError::ZeroCost | LedgerError::CostTooLarge { .. } => {
                Self::Internal(format!("a route declares an invalid cost: {e}"))
            }
            LedgerError::UnknownPlan { .. } => Self::InvalidField {
                field: "plan".into(),
                detail: e.to_string(),
            },
            LedgerError::BadLimits(_) => Self::InvalidField {
                field: "limits".into(),
                detail: e.to_string(),
            },
            LedgerError::UnknownOrg(_) => Self::NotFound(e.to_string()),
            LedgerError::BadCredit { field, .. } => Self::InvalidField {
                field: field.into(),
                detail: e.to_string(),
            },
            LedgerError::CreditKeyReused { .. } => Self::IdempotencyConflict(e.to_string()),
            LedgerError::Store(e) => Self::Store(e),
        }
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::UnknownOperation { .. } => Self::UnknownOperation(e.to_string()),
            JobError::IdInUse(_) => {
                Self::IdempotencyConflict("this request id is already used by another job".into())
            }
            JobError::KeyReused { id, .. } => Self::IdempotencyKeyReused { job_id: id },
            JobError::ResultExpired(id) => Self::ResultExpired(id),
            JobError::StoredBytesExceeded { stored, limit } => {
                Self::StoredBytesExceeded { stored, limit }
            }
            // A call its operation's price sheet cannot price: 422 naming
            // what is missing, nothing charged.
            JobError::Unpriced(p) => Self::InvalidField {
                field: match &p {
                    PriceError::Reserve(_) => "max_tokens".into(),
                    PriceError::Model(_) | PriceError::Unpriced(_) => "model".into(),
                },
                detail: p.to_string(),
            },
            JobError::Ledger(l) => l.into(),
            JobError::Store(e) => Self::Store(e),
        }
    }
}

impl From<KeyStoreError> for ApiError {
    fn from(e: KeyStoreError) -> Self {
        match e {
            KeyStoreError::Store(e) => Self::Store(e),
            KeyStoreError::Random(m) => Self::Internal(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoes_are_bounded() {
        assert_eq!(echo("short"), "short");
        let long = "x".repeat(10_000);
        assert_eq!(echo(&long).chars().count(), ECHO_LIMIT + 1);
        assert!(echo(&long).ends_with('…'));
        let e =
            ApiError::UnknownOperation(format!("unknown operation {long:?} (operations: a, b)"));
        let detail = e.problem().detail.unwrap_or_default();
        assert!(detail.len() < 200, "{detail}");
        assert!(detail.ends_with("(operations: a, b)"), "{detail}");
        let spaced = "y ".repeat(5_000);
        let e = ApiError::NotFound(spaced);
        assert!(e.problem().detail.unwrap_or_default().chars().count() <= DETAIL_LIMIT + 1);
        // Multi-byte input is cut on a character boundary.
        assert_eq!(echo(&"é".repeat(100)).chars().count(), ECHO_LIMIT + 1);
    }
}
