//! Provider clients behind one trait, [`Client`], each wrapped by the
//! provider's throttle ([`ThrottledClient`]): every attempt, retries included,
//! first takes a throttle grant, so a retry after a 429 never adds calls beyond
//! the shared bucket.
//!
//! - [`http::HttpTransport`]: POSTs the job's input JSON to the provider's `url`
//!   (+ the operation's `path`) with reqwest; what is retried (after the
//!   upstream's `Retry-After`, or an exponential backoff) and who pays is the
//!   [`outcome`] policy's decision.
//! - [`mock::BuiltinMock`]: answers in-process; used for providers without `url`.
//!
//! A call is given a deadline (the job's): no attempt is sent after it, and an
//! attempt already sent is never abandoned for it (bounded by the provider's
//! `timeout`), since the upstream may be doing the work.
//!
//! Every wait for a slot and every attempt is observed in the process's
//! [`Metrics`]: the wait (granted, timed out, cancelled), each attempt's time
//! and outcome, the upstream's 429s and 5xx, the retries.

pub mod http;
pub mod mock;
pub mod outcome;
pub mod pool;
pub mod shares;
pub mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::time::Instant;
use tollgate_core::{
    config::{Config, Operation},
    head::Head,
    job::{Charge, FailureCause, Job},
    ledger::Ledger,
    metrics::{CallOutcome, Metrics},
    stream::{StreamEvent, StreamWriter},
    throttle::{Grant, Throttle, ThrottleError, Waiter},
};

pub use shares::Shares;

/// Why a provider call failed for good.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// No throttle grant (timeout), or the throttle's backend failed.
    #[error(transparent)]
    Throttle(#[from] ThrottleError),
    /// The upstream answered an error, after the configured retries. Its
    /// body (`message`) is for the logs: it is not in the error's text,
    /// which becomes the job's message and reaches the client.
    #[error("{provider} answered {status}{}", retried(*.attempts))]
    Upstream {
        provider: String,
        status: u16,
        attempts: u32,
        message: String,
    },
    /// The upstream rejected the input (400, 413, 414, 415, 422): released,
    /// not retried. `body`: its answer, kept only for an operation with
    /// `expose_upstream_errors`.
    #[error("{provider} rejected the input ({status})")]
    Rejected {
        provider: String,
        status: u16,
        body: Option<String>,
    },
    /// The upstream could not be reached (no connection), after the retries.
    #[error("{provider} unreachable{}: {message}", retried(*.attempts))]
    Transport {
        provider: String,
        attempts: u32,
        message: String,
    },
    /// The request was sent and no whole answer came back.
    #[error("{provider} did not answer{}: {message}; charged, since the upstream may have done the work", retried(*.attempts))]
    Unanswered {
        provider: String,
        attempts: u32,
        message: String,
    },
    /// The upstream answered 2xx with a body that is not JSON.
    #[error("{provider} answered {status} with a body that is not JSON ({message}); charged, since the upstream did the work")]
    BadResponse {
        provider: String,
        status: u16,
        message: String,
    },
    /// The call's output bound (its operation's `weight.from`) could not be
    /// written into its input: not sent, released.
    #[error("{provider}: {error}; not sent")]
    Unbounded {
        provider: String,
        error: tollgate_core::config::BoundError,
    },
    /// The job's deadline passed before an attempt could be sent.
    #[error("the job's deadline passed before its call to {provider} could be sent{}", retried(*.attempts))]
    Expired { provider: String, attempts: u32 },
}

impl ProviderError {
    fn of_attempt(provider: &str, attempts: u32, e: AttemptError) -> Self {
        let provider = provider.to_owned();
        match e {
            AttemptError::NotSent { message } => Self::Transport {
                provider,
                attempts,
                message,
            },
            AttemptError::Late { by } => Self::Transport {
                provider,
                attempts,
                message: format!("not sent: its grant went stale ({by:?} late)"),
            },
            AttemptError::Unanswered { message } => Self::Unanswered {
                provider,
                attempts,
                message,
            },
            AttemptError::Status {
                status, message, ..
            } => Self::Upstream {
                provider,
                status,
                attempts,
                message,
            },
            AttemptError::BadBody { status, message } => Self::BadResponse {
                provider,
                status,
                message,
            },
        }
    }
}

/// A call that failed for good, with what the [`outcome`] policy decided:
/// the job's cause and what becomes of its charge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct CallError {
    pub error: ProviderError,
    /// Agrees with `charge` ([`FailureCause::charged`]).
    pub cause: FailureCause,
    pub charge: Charge,
}

impl CallError {
    /// The failed job's record message: the [`Rejection`](tollgate_core::job::Rejection)
    /// (JSON) of a rejected input, else the error's text.
    pub fn record_message(&self) -> String {
        match &self.error {
            ProviderError::Rejected { status, body, .. }
                if self.cause == FailureCause::Rejected =>
            {
                tollgate_core::job::Rejection {
                    upstream_status: *status,
                    upstream_body: body.clone(),
                }
                .message()
            }
            _ => self.error.to_string(),
        }
    }

    /// The upstream's answer, for the logs (never the client's, unless
    /// exposed as a rejection's body).
    pub fn upstream_body(&self) -> Option<&str> {
        match &self.error {
            ProviderError::Upstream { message, .. } => Some(message),
            ProviderError::Rejected { body, .. } => body.as_deref(),
            _ => None,
        }
    }

    /// Whether the job may be handed back to run again instead of failing:
    /// the throttle's store failed, and no attempt may have made the
    /// upstream work.
    pub fn may_hand_back(&self) -> bool {
        matches!(self.error, ProviderError::Throttle(_))
            && !self.error.is_throttle_timeout()
            && !matches!(
                self.error,
                ProviderError::Throttle(ThrottleError::TooHeavy { .. })
            )
            && self.charge == Charge::RELEASE
    }
}

fn retried(attempts: u32) -> String {
    if attempts > 1 {
        format!(" (after {attempts} attempts)")
    } else {
        String::new()
    }
}

impl ProviderError {
    /// True when the throttle gave no slot in time (as opposed to an upstream failure).
    pub fn is_throttle_timeout(&self) -> bool {
        matches!(self, Self::Throttle(ThrottleError::Timeout { .. }))
    }
}

/// A successful call's answer: its body (the job's result, what settles its
/// charge) and its head (status and safe headers), when the transport saw one.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub body: Value,
    pub head: Option<Head>,
}

impl Answer {
    /// A body without a head.
    pub fn body(body: Value) -> Self {
        Self { body, head: None }
    }
}

/// How a [`Client::call`] is made. `CallOptions::default()`: no deadline, a
/// whole answer, the call's slots all taken by the call itself.
#[derive(Default)]
pub struct CallOptions<'a> {
    /// No attempt is sent after it; an attempt sent before it runs to its
    /// end (bounded by the provider's `timeout`). `None`: no deadline.
    pub deadline: Option<Instant>,
    /// The job asked to stream: each upstream event goes to `sink` as it
    /// arrives, and the answer is the usage the stream reported
    /// (`{"usage": {...}}`, see [`stream::Usage`]). `None`: a whole answer.
    pub sink: Option<&'a dyn StreamWriter>,
    /// The wait for the first attempt's slot, begun ahead of the call
    /// ([`Client::first_slot`]): the first attempt goes on it. A call that
    /// does not use the slot it was given (it ends before its first attempt)
    /// ends it with [`Client::unused_slot`].
    pub first: Option<FirstSlot<'a>>,
}

impl fmt::Debug for CallOptions<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallOptions")
            .field("deadline", &self.deadline)
            .field("sink", &self.sink)
            .field("first", &self.first.as_ref().map(|_| "FirstSlot"))
            .finish()
    }
}

/// One provider call, throttled and retried.
#[async_trait]
pub trait Client: Send + Sync + fmt::Debug {
    /// The call, as `opts` say (see [`CallOptions`]): no attempt sent after
    /// the deadline, the answer streamed to a sink, the first attempt on a
    /// slot asked for ahead. The answer carries its head when the transport
    /// reports one.
    async fn call(&self, job: &Job, opts: CallOptions<'_>) -> Result<Answer, CallError>;

    /// The wait for the first attempt's slot, to begin ahead of the call
    /// (the worker waits for it while its job claims its charge: one round
    /// trip instead of two), then given to the call ([`CallOptions::first`]).
    /// `None` (this default): the call takes its slots itself. The slot's
    /// wait ends by `deadline` and the provider's `max_wait`, as the call's
    /// own would.
    fn first_slot<'a>(&'a self, job: &'a Job, deadline: Option<Instant>) -> Option<FirstSlot<'a>> {
        let _ = (job, deadline);
        None
    }

    /// Ends a slot of [`Self::first_slot`] that no call will use (its job
    /// does not run, or its call ends before its first attempt): its token
    /// is spent (never given back: see [`ThrottledClient`]), its place in
    /// the caps freed.
    async fn unused_slot(&self, grant: &Grant) {
        let _ = grant;
    }
}

/// The wait for a call's first slot, begun ahead of it ([`Client::first_slot`]).
pub type FirstSlot<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Grant, ThrottleError>> + Send + 'a>>;

/// How one attempt failed: what the transport saw. What it means for the
/// charge and the retries is the [`outcome`] policy's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptError {
    /// Provably nothing was written: no connection could be made (refused,
    /// DNS, connect timeout).
    NotSent { message: String },
    /// The request was (or may have been) sent and no whole answer came back:
    /// a timeout after the write, a connection cut mid-reply, a body read
    /// that failed.
    Unanswered { message: String },
    /// The upstream answered `status`, not 2xx; `retry_after` is its wish,
    /// when it said one.
    Status {
        status: u16,
        retry_after: Option<Duration>,
        message: String,
    },
    /// The upstream answered 2xx with a body that is not a JSON document
    /// (text, empty, 204, a number out of range, nesting too deep).
    BadBody { status: u16, message: String },
    /// Not sent: the attempt's grant went stale before the request could go
    /// out (a pause after the grant), `by` past its [`Grant::use_by`]. Nothing
    /// reached the upstream; the caller waits for a fresh grant.
    Late { by: Duration },
}

/// The last step before an attempt's request is sent: `Err(Late)` once
/// `use_by` has passed ([`Grant::use_by`]). Synchronous, so that nothing can
/// come between it and the send.
pub fn send_check(use_by: Option<Instant>) -> Result<(), AttemptError> {
    match late_by(use_by) {
        Some(by) => Err(AttemptError::Late { by }),
        None => Ok(()),
    }
}

/// How long past `use_by` it is now (`None`: not past it, or no bound).
pub fn late_by(use_by: Option<Instant>) -> Option<Duration> {
    let now = Instant::now();
    use_by
        .filter(|by| now > *by)
        .map(|by| now.saturating_duration_since(by))
}

/// How one [`Transport::attempt`] is made. `AttemptOptions::default()`: no
/// bound on the send, a whole answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttemptOptions<'a> {
    /// The attempt's grant is usable until then ([`Grant::use_by`], the
    /// call's deadline included): [`send_check`] must be the last step
    /// before the request is sent, with no `await` between (a pause anywhere
    /// before it is then caught). `None`: no bound.
    pub use_by: Option<Instant>,
    /// The answer is streamed to `sink` event by event, and the attempt's
    /// answer is the usage the stream reported. Once an event has gone to
    /// `sink` a failure is [`AttemptError::Unanswered`]: the client has part
    /// of an answer, the upstream did work. `None`: a whole answer.
    pub sink: Option<&'a dyn StreamWriter>,
    /// The pool member the attempt's grant took from ([`Grant::member`]):
    /// where a [`pool::PoolTransport`] sends it. `None`: a provider served
    /// as one upstream.
    pub member: Option<&'a str>,
}

impl AttemptOptions<'_> {
    /// The attempt's answer when it came whole (`body`, no head): with a
    /// sink, passed on to it as one event ([`pass_on`]). For a transport
    /// that cannot stream.
    pub async fn whole(&self, body: Value) -> Result<Answer, AttemptError> {
        if let Some(sink) = self.sink {
            pass_on(sink, StreamEvent::Data(format!("data: {body}"))).await?;
        }
        Ok(Answer::body(body))
    }
}

/// Passes `event` to `sink`: a refusal (the reader left) or a failure after
/// the answer began is [`AttemptError::Unanswered`].
pub async fn pass_on(sink: &dyn StreamWriter, event: StreamEvent) -> Result<(), AttemptError> {
    match sink.push(event).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(AttemptError::Unanswered {
            message: stream::CLIENT_GONE.into(),
        }),
        Err(e) => Err(AttemptError::Unanswered {
            message: format!("{}: {e}", stream::SINK_FAILED),
        }),
    }
}

/// One unthrottled attempt at a provider call: what [`ThrottledClient`] wraps.
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug {
    /// One attempt, as `opts` say (see [`AttemptOptions`]): sent only while
    /// its grant is fresh ([`send_check`] the last step before the send), its
    /// answer streamed to a sink. The answer carries its head when the
    /// transport sees one.
    async fn attempt(&self, job: &Job, opts: AttemptOptions<'_>) -> Result<Answer, AttemptError>;
}

/// Retry policy of a [`ThrottledClient`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// Attempts after the first.
    pub retries: u32,
    /// First backoff when the upstream gives no `Retry-After`; doubles each time.
    pub backoff: Duration,
    /// Longest wait between attempts, `Retry-After` included.
    pub max_backoff: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            retries: tollgate_core::config::DEFAULT_RETRIES,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
        }
    }
}

/// A [`Transport`] whose every attempt first takes a slot of the
/// provider's throttle, in the job's user's queue, and reports the end of the
/// attempt to it (a user's `max_in_flight` counts the attempts under way).
#[derive(Debug)]
pub struct ThrottledClient<C> {
    throttle: Arc<dyn Throttle>,
    provider: tollgate_core::config::Provider,
    retry: Retry,
    client: C,
    metrics: Arc<Metrics>,
    shares: Arc<Shares>,
    /// How long a slot counts as in flight when its end is never reported
    /// (the process died): longer than one attempt may take.
    slot_lease: Duration,
    /// Operations whose unanswered calls may be sent again (`retry_unanswered`).
    retry_unanswered: BTreeSet<String>,
    /// Operations whose rejections carry the upstream's body to the client
    /// (`expose_upstream_errors`).
    exposed: BTreeSet<String>,
    /// What a call of each operation weighs in the provider's token limits.
    weights: BTreeMap<String, tollgate_core::config::Weight>,
    /// Where each operation's answers report the tokens a call used.
    usage: BTreeMap<String, String>,
}

impl<C: Transport> ThrottledClient<C> {
    pub fn new(
        throttle: Arc<dyn Throttle>,
        provider: tollgate_core::config::Provider,
        retry: Retry,
        client: C,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            throttle,
            provider,
            retry,
            client,
            metrics,
            shares: Arc::new(Shares::default_plan(Arc::new(Config::builtin()))),
            slot_lease: tollgate_core::fair::DEFAULT_SLOT_LEASE,
            retry_unanswered: BTreeSet::new(),
            exposed: BTreeSet::new(),
            weights: BTreeMap::new(),
            usage: BTreeMap::new(),
        }
    }

    /// The `weight` and `usage` of the operations of `config` on this
    /// provider: each call takes its weight from the token limits, and an
    /// answer that reports its usage settles the difference.
    pub fn with_weights(mut self, config: &Config) -> Self {
        let ours = || {
            config
                .operations()
                .filter(|o| o.provider == self.provider.name)
        };
        self.weights = ours()
            .filter_map(|o| Some((o.name.clone(), o.weight.clone()?)))
            .collect();
        self.usage = ours()
            .filter_map(|o| Some((o.name.clone(), o.usage.clone()?)))
            .collect();
        self
    }

    /// What the answer `answer` of `job`'s call reported it used goes to
    /// the provider's token limits ([`Throttle::usage`]); an answer that
    /// reports nothing leaves the weight standing.
    async fn settle_usage(&self, job: &Job, grant: &Grant, answer: &Value) {
        let Some(pointer) = self.usage.get(&job.operation) else {
            return;
        };
        let name = &self.provider.name;
        let Some(used) = tollgate_core::config::reported_usage(pointer, answer) else {
            tracing::debug!(provider = %name, request_id = %job.id, pointer, "the answer reports no usage: its weight stands");
            return;
        };
        match self.throttle.usage(grant, used).await {
            Ok(usage) => self.metrics.usage_adjusted(name, usage),
            Err(e) => {
                tracing::warn!(error = %e, provider = %name, "settling a call's usage failed: its weight stands")
            }
        }
    }

    /// The operations of `config` on this provider whose rejected inputs
    /// show the upstream's body to the client (`expose_upstream_errors`).
    pub fn with_exposed_errors(mut self, config: &Config) -> Self {
        self.exposed = self.operations_where(config, |o| o.expose_upstream_errors);
        self
    }

    /// The operations of `config` on this provider whose unanswered calls
    /// may be sent again (`retry_unanswered = true`).
    pub fn with_retry_unanswered(mut self, config: &Config) -> Self {
        self.retry_unanswered = self.operations_where(config, |o| o.retry_unanswered);
        self
    }

    /// The names of the operations of `config` on this provider that `flag`
    /// picks: each per-operation setting is kept as such a set.
    fn operations_where(
        &self,
        config: &Config,
        flag: impl Fn(&Operation) -> bool,
    ) -> BTreeSet<String> {
        config
            .operations()
            .filter(|o| o.provider == self.provider.name && flag(o))
            .map(|o| o.name.clone())
            .collect()
    }

    /// Users' shares from `shares`; a slot frees itself `slot_lease` after its grant
    /// if its end is never reported.
    pub fn with_shares(mut self, shares: Arc<Shares>, slot_lease: Duration) -> Self {
        self.shares = shares;
        self.slot_lease = slot_lease;
        self
    }

    /// Waits for a slot, at most what is `left` of the provider's
    /// `max_wait`, observing the wait (a dropped future counts as cancelled).
    async fn slot(&self, job: &Job, left: Duration) -> Result<Grant, ThrottleError> {
        let wait = self.metrics.acquiring(&self.provider.name);
        let mut traced = WaitTrace::begin(&self.provider.name, job, left);
        // The whole wait is bounded by `left`, the plan look-up included (a
        // stalled store falls back to the default plan's share).
        let deadline = Instant::now() + left;
        let share = self.shares.share(&job.user, self.slot_lease, left).await;
        let weight = self
            .weights
            .get(&job.operation)
            .map_or(1, |w| w.of(&job.input));
        let waiter = Waiter::of(&job.id, job.user.as_str(), share).weighing(weight);
        let left = deadline.saturating_duration_since(Instant::now());
        let r = self
            .throttle
            .acquire_as(&self.provider.name, &waiter, left)
            .await;
        traced.end(match &r {
            Ok(_) => "granted",
            Err(ThrottleError::Timeout { .. }) => "timeout",
            Err(_) => "error",
        });
        match r {
            Ok(grant) => {
                wait.granted();
                if let Some(member) = &grant.member {
                    self.metrics.member_granted(&self.provider.name, member);
                }
                Ok(grant)
            }
            Err(ThrottleError::Timeout { provider, .. }) => {
                wait.timed_out();
                Err(ThrottleError::Timeout {
                    provider,
                    max_wait: self.provider.max_wait,
                })
            }
            Err(e) => {
                wait.failed();
                Err(e)
            }
        }
    }

    /// An upstream refusal pauses the provider for every caller of every pod
    /// ([`Throttle::pause`]): a 429 for its `Retry-After` (a back-off when it
    /// names none), a 503 only when it names one. A pool's member (`member`)
    /// is paused alone ([`Throttle::pause_member`]), and backed off too when
    /// it could not be reached ([`AttemptError::NotSent`]): the other members
    /// take its calls. A failed pause is logged: this call's own retry still
    /// waits for the `Retry-After`. Returns whether it paused (or tried to).
    async fn refused(&self, err: &AttemptError, member: Option<&str>) -> bool {
        let (status, retry_after) = match (err, member) {
            (
                AttemptError::Status {
                    status,
                    retry_after,
                    ..
                },
                _,
            ) => (*status, *retry_after),
            (AttemptError::NotSent { .. }, Some(_)) => (0, None),
            _ => return false,
        };
        if !(status == 0 || status == 429 || (status == 503 && retry_after.is_some())) {
            return false;
        }
        let name = &self.provider.name;
        let paused = match member {
            Some(member) => self.throttle.pause_member(name, member, retry_after).await,
            None => self.throttle.pause(name, retry_after).await,
        };
        match paused {
            Ok(pause) => {
                self.metrics.paused(name);
                if let Some(member) = member {
                    self.metrics.member_paused(name, member);
                }
                tracing::info!(
                    provider = %name, status, ?retry_after, left = ?pause.left,
                    strikes = pause.strikes, "the upstream refused a call: provider paused"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, provider = %name, "pausing the provider after a refusal failed")
            }
        }
        true
    }

    /// One attempt, sent only before `use_by`, observed: its time and how it
    /// ended (an attempt not sent, its grant late, is no call).
    async fn try_once(
        &self,
        job: &Job,
        use_by: Option<Instant>,
        sink: Option<&dyn StreamWriter>,
        member: Option<&str>,
    ) -> Result<Answer, AttemptError> {
        let started = Instant::now();
        let r = self
            .client
            .attempt(
                job,
                AttemptOptions {
                    use_by,
                    sink,
                    member,
                },
            )
            .await;
        let outcome = match &r {
            Err(AttemptError::Late { .. }) => return r,
            Ok(_) => CallOutcome::Ok,
            Err(AttemptError::NotSent { .. } | AttemptError::Unanswered { .. }) => {
                CallOutcome::Transport
            }
            Err(AttemptError::Status { status, .. }) => CallOutcome::of_status(Some(*status)),
            Err(AttemptError::BadBody { .. }) => CallOutcome::BadResponse,
        };
        self.metrics
            .provider_call(&self.provider.name, outcome, started.elapsed());
        if let Some(member) = member {
            self.metrics
                .member_call(&self.provider.name, member, outcome);
        }
        r
    }
}

/// The tracing target of the waits for a slot: a `debug` event when one
/// begins and when it ends (granted, timeout, error, or cancelled when the
/// caller dropped it), with the request id, `limit_ms` and `waited_ms`.
/// Off by default; `RUST_LOG=info,tollgate::wait=debug` turns it on (the chaos
/// suite checks from it that every wait ended within its limit).
pub const WAIT_TARGET: &str = "tollgate::wait";

/// One wait for a slot, traced at [`WAIT_TARGET`].
struct WaitTrace<'a> {
    provider: &'a str,
    job: &'a Job,
    started: Instant,
    ended: bool,
}

impl<'a> WaitTrace<'a> {
    fn begin(provider: &'a str, job: &'a Job, limit: Duration) -> Self {
        tracing::debug!(
            target: WAIT_TARGET, provider, request_id = %job.id,
            limit_ms = limit.as_millis() as u64, "wait for a slot began"
        );
        Self {
            provider,
            job,
            started: Instant::now(),
            ended: false,
        }
    }

    fn end(&mut self, outcome: &'static str) {
        self.ended = true;
        tracing::debug!(
            target: WAIT_TARGET, provider = self.provider, request_id = %self.job.id,
            waited_ms = self.started.elapsed().as_millis() as u64, outcome,
            "wait for a slot ended"
        );
    }
}

impl Drop for WaitTrace<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.end("cancelled");
        }
    }
}

#[async_trait]
impl<C: Transport> Client for ThrottledClient<C> {
    async fn call(&self, job: &Job, opts: CallOptions<'_>) -> Result<Answer, CallError> {
        self.call_with(job, opts).await
    }

    fn first_slot<'a>(&'a self, job: &'a Job, deadline: Option<Instant>) -> Option<FirstSlot<'a>> {
        let to_deadline = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let left = to_deadline.map_or(self.provider.max_wait, |d| d.min(self.provider.max_wait));
        Some(Box::pin(self.slot(job, left)))
    }

    async fn unused_slot(&self, grant: &Grant) {
        if let Err(e) = self.throttle.done(grant).await {
            tracing::warn!(error = %e, provider = %self.provider.name, "ending an unused slot failed; it frees itself at the end of its hold");
        }
    }
}

impl<C: Transport> ThrottledClient<C> {
    /// The call, its attempts throttled and retried per the outcome policy;
    /// with a `sink`, each attempt's answer is streamed to it; the first
    /// attempt on `first`'s slot when given ([`Client::first_slot`]).
    async fn call_with(
        &self,
        job: &Job,
        CallOptions {
            deadline,
            sink,
            mut first,
        }: CallOptions<'_>,
    ) -> Result<Answer, CallError> {
        let name = &self.provider.name;
        let retry_unanswered = self.retry_unanswered.contains(&job.operation);
        let mut tally = outcome::Tally::default();
        let fail = |tally: &outcome::Tally, error: ProviderError, cause: FailureCause| {
            let (cause, charge) = tally.failure(cause);
            CallError {
                error,
                cause,
                charge,
            }
        };
        let expired = |attempts: u32| ProviderError::Expired {
            provider: name.clone(),
            attempts,
        };
        let past = |d: Option<Instant>| d.is_some_and(|d| Instant::now() >= d);
        // The call goes upstream with the output bound its weight counts
        // (`weight.from`, written when the input does not hold it): an
        // upstream that honours it uses no more than the weight. The stored
        // job, its input and its fingerprint stay as the client sent them.
        let bounded = match self
            .weights
            .get(&job.operation)
            .map(|w| w.bounded(&job.input))
        {
            Some(Ok(Some(input))) => Some(Job {
                input,
                ..job.clone()
            }),
            Some(Err(error)) => {
                if let Some(Ok(grant)) = match first.take() {
                    Some(first) => Some(first.await),
                    None => None,
                } {
                    self.unused_slot(&grant).await;
                }
                let error = ProviderError::Unbounded {
                    provider: name.clone(),
                    error,
                };
                return Err(fail(&tally, error, FailureCause::Provider));
            }
            _ => None,
        };
        let sent = bounded.as_ref().unwrap_or(job);
        let mut backoff = self.retry.backoff;
        let mut attempt = 0;
        // Each attempt waits for its slot at most `max_wait`, from here, and
        // never past the deadline.
        let mut waiting_since = Instant::now();
        // Calls granted another pool member after one refused them.
        let mut failovers = 0;
        loop {
            if past(deadline) {
                // A slot asked for ahead is ended unused (its wait is
                // bounded by the deadline: it ends at once).
                if let Some(Ok(grant)) = match first.take() {
                    Some(first) => Some(first.await),
                    None => None,
                } {
                    self.unused_slot(&grant).await;
                }
                return Err(fail(&tally, expired(attempt), FailureCause::Expired));
            }
            let max_wait = self
                .provider
                .max_wait
                .saturating_sub(waiting_since.elapsed());
            let to_deadline = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let left = to_deadline.map_or(max_wait, |d| d.min(max_wait));
            let slot = match first.take() {
                Some(first) => first.await,
                None => self.slot(job, left).await,
            };
            let mut grant = match slot {
                Ok(grant) => grant,
                Err(ThrottleError::Timeout { .. }) if past(deadline) => {
                    return Err(fail(&tally, expired(attempt), FailureCause::Expired))
                }
                Err(e) => {
                    let cause = if matches!(e, ThrottleError::Timeout { .. }) {
                        FailureCause::ThrottleTimeout
                    } else {
                        FailureCause::Provider
                    };
                    return Err(fail(&tally, ProviderError::Throttle(e), cause));
                }
            };
            // The deadline is checked where the grant's freshness is: as the
            // request is about to be written, and not after.
            let use_by = |grant: &Grant| match (grant.use_by, deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let mut r = self
                .try_once(sent, use_by(&grant), sink, grant.member.as_deref())
                .await;
            // Stale before it was sent (a slow process): re-dated when its
            // bucket allows, it is used at once, its token not lost.
            for _ in 0..MAX_REDATES {
                if !matches!(r, Err(AttemptError::Late { .. })) || past(deadline) {
                    break;
                }
                match self.throttle.redate(&grant).await {
                    Ok(Some(fresh)) => {
                        tracing::debug!(provider = %name, request_id = %job.id, "a stale grant re-dated before its send");
                        grant = fresh;
                        r = self
                            .try_once(sent, use_by(&grant), sink, grant.member.as_deref())
                            .await;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, provider = %name, "re-dating a stale grant failed");
                        break;
                    }
                }
            }
            if let Err(AttemptError::Late { by }) = r {
                if let Err(e) = self.throttle.done(&grant).await {
                    tracing::warn!(error = %e, provider = %name, "ending the slot of an unsent call failed");
                }
                if past(deadline) {
                    return Err(fail(&tally, expired(attempt), FailureCause::Expired));
                }
                // Not sent: calls granted after this one may have gone out
                // while it was held up. Its token is lost, neither returned
                // to the bucket nor kept for later: a token taken before the
                // bucket refilled to its cap, given back (or used) now, is one
                // more than the bucket allows (burst + rate·t); the long chaos
                // run saw 13 calls within 7 ms (burst 8) when tokens came back
                // at the end of a slow link. The slot of the user's cap ends,
                // and this call waits at the back of its queue for a fresh
                // grant, within what is left of its max_wait.
                tracing::warn!(
                    provider = %name, request_id = %job.id, ?by,
                    "a grant went stale before its call was sent (a pause): not used, waiting for a fresh one"
                );
                self.metrics.late_grant(name);
                continue;
            }
            attempt += 1;
            if let Err(e) = self.throttle.done(&grant).await {
                // The slot frees itself at the end of its hold.
                tracing::warn!(error = %e, provider = %name, "reporting the end of a call failed");
            }
            let err = match r {
                Ok(v) => {
                    self.settle_usage(job, &grant, &v.body).await;
                    return Ok(v);
                }
                Err(e) => e,
            };
            let Some(class) = outcome::Class::of(&err) else {
                continue; // Late: dealt with above.
            };
            tally.record(class);
            // A pool's member that refused the call, or could not be
            // reached, is backed off for every pod, and the call is granted
            // another member at once: no wait, not one of its retries, the
            // same charge. An unanswered call is not (outcome rules).
            if self.refused(&err, grant.member.as_deref()).await
                && grant.member.is_some()
                && failovers < self.provider.pool().len()
            {
                failovers += 1;
                attempt -= 1;
                tracing::info!(
                    provider = %name, request_id = %job.id, member = grant.member.as_deref(),
                    "a pool member refused the call: granted another"
                );
                waiting_since = Instant::now();
                continue;
            }
            let wait = match &err {
                AttemptError::Status {
                    retry_after: Some(w),
                    ..
                } => *w,
                _ => backoff,
            }
            .min(self.retry.max_backoff);
            // A streamed answer cut midway is never sent again: the client
            // has its first part already.
            let again = class.retry(retry_unanswered && sink.is_none())
                && attempt <= self.retry.retries
                // A retry that could only start after the deadline is none.
                && deadline.is_none_or(|d| Instant::now() + wait < d);
            if !again {
                if let (
                    outcome::Class::Rejected,
                    AttemptError::Status {
                        status, message, ..
                    },
                ) = (class, &err)
                {
                    let error = ProviderError::Rejected {
                        provider: name.clone(),
                        status: *status,
                        body: self
                            .exposed
                            .contains(&job.operation)
                            .then(|| message.clone()),
                    };
                    return Err(fail(&tally, error, FailureCause::Rejected));
                }
                let error = ProviderError::of_attempt(name, attempt, err);
                return Err(fail(&tally, error, FailureCause::Provider));
            }
            tracing::debug!(provider = %name, request_id = %job.id, ?class, ?wait, "retrying");
            self.metrics.retry(name);
            tokio::time::sleep(wait).await;
            backoff = (backoff * 2).min(self.retry.max_backoff);
            waiting_since = Instant::now();
        }
    }
}

/// The most times one attempt's grant is re-dated ([`Throttle::redate`])
/// before it is given up as late: a process that keeps being too slow to send
/// waits for a fresh grant instead.
const MAX_REDATES: u32 = 3;

/// Why the providers of a config could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(
        "providers.{provider}: environment variable {var} (a secret header's value) is not set"
    )]
    MissingSecret { provider: String, var: String },
    #[error("providers.{provider}: cannot build the HTTP client: {message}")]
    Client { provider: String, message: String },
}

/// One throttled [`Client`] per configured provider: HTTP where the config
/// gives a `url`, the built-in mock otherwise; each observed in `metrics`.
/// Every user counts as on the default plan in the fair queues (see
/// [`from_config_with_plans`]).
pub fn from_config(
    config: &Config,
    throttle: Arc<dyn Throttle>,
    metrics: &Arc<Metrics>,
) -> Result<BTreeMap<String, Arc<dyn Client>>, SetupError> {
    let shares = Arc::new(Shares::default_plan(Arc::new(config.clone())));
    build(config, throttle, metrics, shares)
}

/// The same, each user queueing with its plan's `share` and `max_in_flight`
/// as `ledger` has it.
pub fn from_config_with_plans(
    config: &Config,
    throttle: Arc<dyn Throttle>,
    metrics: &Arc<Metrics>,
    ledger: Arc<dyn Ledger>,
) -> Result<BTreeMap<String, Arc<dyn Client>>, SetupError> {
    let shares = Arc::new(Shares::new(Arc::new(config.clone()), ledger));
    build(config, throttle, metrics, shares)
}

/// Margin over an upstream's call timeout before a slot whose end was never
/// reported frees itself.
const HOLD_MARGIN: Duration = Duration::from_secs(5);

fn build(
    config: &Config,
    throttle: Arc<dyn Throttle>,
    metrics: &Arc<Metrics>,
    shares: Arc<Shares>,
) -> Result<BTreeMap<String, Arc<dyn Client>>, SetupError> {
    let mut out: BTreeMap<String, Arc<dyn Client>> = BTreeMap::new();
    for p in config.providers() {
        // A pool: each call goes to the member its grant took from.
        if let Some(first) = p.pool().first() {
            let client = pool::PoolTransport::new(p, config)?;
            let upstream = &first.upstream;
            let retry = Retry {
                retries: upstream.retries,
                ..Retry::default()
            };
            let client: Arc<dyn Client> = Arc::new(
                ThrottledClient::new(
                    Arc::clone(&throttle),
                    p.clone(),
                    retry,
                    client,
                    Arc::clone(metrics),
                )
                .with_shares(Arc::clone(&shares), upstream.timeout + HOLD_MARGIN)
                .with_weights(config)
                .with_retry_unanswered(config)
                .with_exposed_errors(config),
            );
            out.insert(p.name.clone(), client);
            continue;
        }
        let provider: Arc<dyn Client> = match config.upstream(&p.name) {
            Some(upstream) => {
                let client = http::HttpTransport::new(&p.name, upstream, config)?;
                let retry = Retry {
                    retries: upstream.retries,
                    ..Retry::default()
                };
                Arc::new(
                    ThrottledClient::new(
                        Arc::clone(&throttle),
                        p.clone(),
                        retry,
                        client,
                        Arc::clone(metrics),
                    )
                    .with_shares(Arc::clone(&shares), upstream.timeout + HOLD_MARGIN)
                    .with_weights(config)
                    .with_retry_unanswered(config)
                    .with_exposed_errors(config),
                )
            }
            None => Arc::new(
                ThrottledClient::new(
                    Arc::clone(&throttle),
                    p.clone(),
                    Retry::default(),
                    mock::BuiltinMock::new(config),
                    Arc::clone(metrics),
                )
                .with_shares(Arc::clone(&shares), tollgate_core::fair::DEFAULT_SLOT_LEASE)
                .with_weights(config),
            ),
        };
        out.insert(p.name.clone(), provider);
    }
    Ok(out)
}
