//! Provider clients behind one trait, [`Client`], each wrapped by the
//! provider's throttle ([`ThrottledClient`]): every attempt, retries included,
//! first takes a throttle slot, so a retry after a 429 never adds calls beyond
//! the shared bucket.
//!
//! - [`http::HttpClient`]: POSTs the job's input JSON to the provider's `url`
//!   (+ the operation's `path`) with reqwest; 429 and 5xx are retried after the
//!   upstream's `Retry-After` (or an exponential backoff).
//! - [`mock::BuiltinMock`]: answers in-process; used for providers without `url`.
//!
//! Every wait for a slot and every attempt is observed in the process's
//! [`Metrics`]: the wait (granted, timed out, cancelled), each attempt's time
//! and outcome, the upstream's 429s and 5xx, the retries.

pub mod http;
pub mod mock;
pub mod shares;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::time::Instant;
use tollgate_core::{
    config::Config,
    job::Job,
    ledger::Ledger,
    metrics::{CallOutcome, Metrics},
    throttle::{Grant, Throttle, ThrottleError, Waiter},
};

pub use shares::Shares;

/// Why a provider call failed for good.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// No throttle slot (timeout), or the throttle's backend failed.
    #[error(transparent)]
    Throttle(#[from] ThrottleError),
    /// The upstream answered an error, after the configured retries.
    #[error("{provider} answered {status}{}: {message}", retried(*.attempts))]
    Upstream {
        provider: String,
        status: u16,
        attempts: u32,
        message: String,
    },
    /// The upstream could not be reached or timed out, after the retries.
    #[error("{provider} unreachable{}: {message}", retried(*.attempts))]
    Transport {
        provider: String,
        attempts: u32,
        message: String,
    },
    /// The upstream answered 2xx with a body that is not JSON.
    #[error("{provider} answered something that is not JSON: {message}")]
    BadResponse { provider: String, message: String },
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

/// One provider call, throttled and retried.
#[async_trait]
pub trait Client: Send + Sync + fmt::Debug {
    async fn call(&self, job: &Job) -> Result<Value, ProviderError>;
}

/// How one attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptError {
    /// Worth another attempt (429, 5xx, connection failure); `retry_after` is
    /// the upstream's wish, when it said one.
    Retryable {
        status: Option<u16>,
        retry_after: Option<Duration>,
        message: String,
    },
    /// Not worth retrying (4xx other than 429, a non-JSON body).
    Fatal {
        status: Option<u16>,
        message: String,
    },
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

/// One unthrottled attempt at a provider call: what [`ThrottledClient`] wraps.
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug {
    async fn attempt(&self, job: &Job) -> Result<Value, AttemptError>;

    /// One attempt on a grant usable until `use_by`: [`send_check`] must be
    /// the last step before the request is sent, with no `await` between (a
    /// pause anywhere before it is then caught). This default checks, then
    /// runs [`Transport::attempt`]: right for a transport that prepares
    /// nothing before it sends.
    async fn attempt_by(&self, job: &Job, use_by: Option<Instant>) -> Result<Value, AttemptError> {
        send_check(use_by)?;
        self.attempt(job).await
    }
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
    hold: Duration,
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
            hold: tollgate_core::fair::DEFAULT_HOLD,
        }
    }

    /// Users' shares from `shares`; a slot frees itself `hold` after its grant
    /// if its end is never reported.
    pub fn with_shares(mut self, shares: Arc<Shares>, hold: Duration) -> Self {
        self.shares = shares;
        self.hold = hold;
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
        let share = self.shares.share(&job.user, self.hold, left).await;
        let waiter = Waiter::of(&job.id, job.user.as_str(), share);
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

    /// One attempt on `grant`, observed: its time and how it ended (an
    /// attempt not sent, its grant late, is no call).
    async fn try_once(&self, job: &Job, grant: &Grant) -> Result<Value, AttemptError> {
        let started = Instant::now();
        let r = self.client.attempt_by(job, grant.use_by).await;
        let outcome = match &r {
            Err(AttemptError::Late { .. }) => return r,
            Ok(_) => CallOutcome::Ok,
            Err(AttemptError::Retryable { status, .. }) => CallOutcome::of_status(*status),
            Err(AttemptError::Fatal {
                status: Some(200) | None,
                ..
            }) => CallOutcome::BadResponse,
            Err(AttemptError::Fatal { status, .. }) => CallOutcome::of_status(*status),
        };
        self.metrics
            .provider_call(&self.provider.name, outcome, started.elapsed());
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
    async fn call(&self, job: &Job) -> Result<Value, ProviderError> {
        let name = &self.provider.name;
        let mut backoff = self.retry.backoff;
        let mut attempt = 0;
        // Each attempt waits for its slot at most `max_wait`, from here.
        let mut waiting_since = Instant::now();
        loop {
            let left = self
                .provider
                .max_wait
                .saturating_sub(waiting_since.elapsed());
            let grant = self.slot(job, left).await?;
            let r = self.try_once(job, &grant).await;
            if let Err(AttemptError::Late { by }) = r {
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
                if let Err(e) = self.throttle.done(&grant).await {
                    tracing::warn!(error = %e, provider = %name, "ending the slot of a late grant failed");
                }
                continue;
            }
            attempt += 1;
            if let Err(e) = self.throttle.done(&grant).await {
                // The slot frees itself at the end of its hold.
                tracing::warn!(error = %e, provider = %name, "reporting the end of a call failed");
            }
            let err = match r {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            match err {
                AttemptError::Retryable {
                    status,
                    retry_after,
                    message,
                } => {
                    if attempt > self.retry.retries {
                        return Err(match status {
                            Some(status) => ProviderError::Upstream {
                                provider: name.clone(),
                                status,
                                attempts: attempt,
                                message,
                            },
                            None => ProviderError::Transport {
                                provider: name.clone(),
                                attempts: attempt,
                                message,
                            },
                        });
                    }
                    let wait = retry_after.unwrap_or(backoff).min(self.retry.max_backoff);
                    tracing::debug!(provider = %name, request_id = %job.id, ?status, ?wait, "retrying");
                    self.metrics.retry(name);
                    tokio::time::sleep(wait).await;
                    backoff = (backoff * 2).min(self.retry.max_backoff);
                    waiting_since = Instant::now();
                }
                // Dealt with above, before the end of the slot.
                AttemptError::Late { .. } => continue,
                AttemptError::Fatal { status, message } => {
                    return Err(match status {
                        Some(status) if status != 200 => ProviderError::Upstream {
                            provider: name.clone(),
                            status,
                            attempts: attempt,
                            message,
                        },
                        _ => ProviderError::BadResponse {
                            provider: name.clone(),
                            message,
                        },
                    })
                }
            }
        }
    }
}

/// Why the providers of a config could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("providers.{provider}.auth_env: environment variable {var} is not set")]
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
        let provider: Arc<dyn Client> = match config.upstream(&p.name) {
            Some(upstream) => {
                let client = http::HttpClient::new(&p.name, upstream, config)?;
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
                    .with_shares(Arc::clone(&shares), upstream.timeout + HOLD_MARGIN),
                )
            }
            None => Arc::new(
                ThrottledClient::new(
                    Arc::clone(&throttle),
                    p.clone(),
                    Retry::default(),
                    mock::BuiltinMock,
                    Arc::clone(metrics),
                )
                .with_shares(Arc::clone(&shares), tollgate_core::fair::DEFAULT_HOLD),
            ),
        };
        out.insert(p.name.clone(), provider);
    }
    Ok(out)
}
