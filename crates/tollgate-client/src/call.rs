//! One logical call ([`Call`]) and the loops that drive it: send, retry with
//! the same Idempotency-Key, wait for a pending job, all within one deadline.

use std::time::Duration;

use reqwest::header::HeaderValue;
use serde_json::Value;
use tokio::time::Instant;

use crate::answer::{classify, JobView, Step};
use crate::outcome::Outcome;
use crate::{valid_id, Client, Error, Raw, USER_HEADER};

/// The most a job's status is polled apart.
const MAX_POLL: Duration = Duration::from_secs(1);
/// Below this much time left, a sync call polls its pending job instead of
/// asking the server to wait (in whole seconds) again.
const LONG_POLL_LEFT: Duration = Duration::from_millis(1500);
/// The most `Prefer: wait` an async submission asks for before polling.
const SUBMIT_WAIT: Duration = Duration::from_secs(10);

/// One call of an operation: its input, and its Idempotency-Key, made once
/// and sent with every attempt. Sending it again (a second
/// [`send`](Call::send)) is the same request too: charged once, the same job.
#[derive(Debug, Clone)]
pub struct Call {
    client: Client,
    operation: String,
    input: Value,
    key: String,
    user: Option<Result<HeaderValue, String>>,
    deadline: Option<Duration>,
}

/// How one logical call stands: its deadline, the requests sent, the retries used.
#[derive(Debug)]
pub(crate) struct Progress {
    deadline: Instant,
    attempts: u32,
    retries: u32,
}

impl Progress {
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            deadline: Instant::now() + budget,
            attempts: 0,
            retries: 0,
        }
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Wait for the result (`Prefer: wait=<what the deadline leaves>`).
    Sync,
    /// `Prefer: respond-async`, with `wait=<n>` when given.
    Async(Option<Duration>),
}

impl Call {
    pub(crate) fn new(client: Client, operation: &str, input: Value) -> Self {
        Self {
            client,
            operation: operation.to_owned(),
            input,
            key: format!("tgc-{}", uuid::Uuid::new_v4().simple()),
            user: None,
            deadline: None,
        }
    }

    /// Use `key` as the Idempotency-Key (e.g. an order id the application
    /// already has) instead of a fresh one.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// The Idempotency-Key every attempt of this call sends.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Act for `user` (a service key only), whatever the client's default.
    pub fn on_behalf_of(mut self, user: &str) -> Self {
        self.user = Some(crate::user_header(user).map_err(|e| e.to_string()));
        self
    }

    /// This call's deadline instead of the client's.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    fn progress(&self) -> Progress {
        Progress::new(self.deadline.unwrap_or(self.client.inner.retry.deadline))
    }

    fn user(&self) -> Result<Option<&HeaderValue>, Error> {
        match &self.user {
            Some(Ok(u)) => Ok(Some(u)),
            Some(Err(e)) => Err(Error::Config(e.clone())),
            None => Ok(self.client.user.as_ref()),
        }
    }

    /// Calls and waits for the result: retries as the crate docs say, and
    /// while the job runs past the server's sync wait, asks again with the
    /// same key (which waits for the same job) until the deadline; then the
    /// outcome is [`Outcome::Pending`].
    pub async fn send(&self) -> Result<Outcome, Error> {
        let mut progress = self.progress();
        self.drive(Mode::Sync, &mut progress).await
    }

    /// Submits without waiting (`Prefer: respond-async`): [`Outcome::Pending`]
    /// with the job's id once it is accepted (or a budget refusal, ...).
    pub async fn submit(&self) -> Result<Outcome, Error> {
        let mut progress = self.progress();
        self.drive(Mode::Async(None), &mut progress).await
    }

    /// Submits asynchronously, then waits for the job to end (`Prefer:
    /// wait` on the submission, then polling `GET /v1/jobs/{id}`) within the
    /// deadline. A job that failed and whose charge was released is submitted again with
    /// the same key while the retry policy allows.
    pub async fn submit_and_wait(&self) -> Result<Outcome, Error> {
        let mut progress = self.progress();
        let user = self.user()?.cloned();
        loop {
            let wait = progress.left().saturating_sub(Duration::from_secs(1));
            let outcome = self
                .drive(Mode::Async(Some(wait.min(SUBMIT_WAIT))), &mut progress)
                .await?;
            let outcome = match outcome {
                Outcome::Pending(p) => {
                    wait_job(&self.client, user.as_ref(), &p.job_id, &mut progress).await?
                }
                other => other,
            };
            if !released(&outcome) {
                return Ok(outcome);
            }
            let policy = &self.client.inner.retry;
            progress.retries += 1;
            let pause = policy.backoff(progress.retries, None);
            if progress.retries > policy.max_retries || pause >= progress.left() {
                return Ok(stamp(outcome, &progress, &self.client));
            }
            tracing::debug!(key = %self.key, retry = progress.retries, ?pause, "the job failed and its charge was released: submitting it again");
            tokio::time::sleep(pause).await;
        }
    }

    async fn post(&self, mode: Mode, left: Duration) -> Result<Result<Raw, reqwest::Error>, Error> {
        if !valid_id(&self.operation) {
            return Err(Error::Config(format!(
                "{:?} is not an operation name",
                self.operation
            )));
        }
        let key = HeaderValue::from_str(&self.key)
            .ok()
            .filter(|_| !self.key.trim().is_empty() && self.key.len() <= 255)
            .ok_or_else(|| {
                Error::Config(
                    "the Idempotency-Key must be 1 to 255 visible ASCII characters".into(),
                )
            })?;
        let prefer = match mode {
            // Answer (202 at worst) a second before the deadline.
            Mode::Sync => format!("wait={}", left.as_secs().saturating_sub(1)),
            Mode::Async(None) => "respond-async".to_owned(),
            Mode::Async(Some(w)) => format!("respond-async, wait={}", w.as_secs()),
        };
        let inner = &self.client.inner;
        let mut req = inner
            .http
            .post(format!("{}/v1/ops/{}", inner.base, self.operation))
            .header(reqwest::header::AUTHORIZATION, inner.auth.clone())
            .header("Idempotency-Key", key)
            .header("Prefer", prefer)
            .json(&self.input)
            .timeout(left.max(Duration::from_millis(100)));
        if let Some(user) = self.user()? {
            req = req.header(USER_HEADER, user.clone());
        }
        Ok(fetch(req).await)
    }

    async fn drive(&self, mode: Mode, progress: &mut Progress) -> Result<Outcome, Error> {
        let policy = &self.client.inner.retry;
        let mut poll = Duration::from_millis(50);
        loop {
            progress.attempts += 1;
            let sent = Instant::now();
            let step = match self.post(mode, progress.left()).await? {
                Ok(raw) => classify(raw.status, &raw.headers, &raw.body, false),
                Err(e) => Step::Retry {
                    hint: None,
                    otherwise: Err(Error::Transport(e)),
                },
            };
            let (hint, otherwise) = match step {
                // The job outlived the server's wait: ask again with the same
                // key, which waits for the same job, while time is left.
                Step::Final(Ok(Outcome::Pending(p))) if mode == Mode::Sync => {
                    if progress.left() >= LONG_POLL_LEFT {
                        if sent.elapsed() < Duration::from_millis(200) {
                            tokio::time::sleep(poll).await;
                            poll = (poll * 2).min(MAX_POLL);
                        }
                        continue;
                    }
                    // Too little time left for a server-side wait (whole
                    // seconds): poll the job until the deadline instead.
                    let user = self.user()?.cloned();
                    let outcome =
                        wait_job(&self.client, user.as_ref(), &p.job_id, progress).await?;
                    if !released(&outcome) {
                        return Ok(stamp(outcome, progress, &self.client));
                    }
                    (None, Ok(outcome))
                }
                Step::Final(Ok(o @ Outcome::BudgetExhausted { .. }))
                    if budget_wait(&o, policy.wait_for_budget).is_some() =>
                {
                    (budget_wait(&o, policy.wait_for_budget), Ok(o))
                }
                Step::Final(r) => return r.map(|o| stamp(o, progress, &self.client)),
                Step::Retry { hint, otherwise } => (hint, otherwise),
            };
            progress.retries += 1;
            let pause = policy.backoff(progress.retries, hint);
            if progress.retries > policy.max_retries || pause >= progress.left() {
                return otherwise.map(|o| stamp(o, progress, &self.client));
            }
            tracing::debug!(key = %self.key, retry = progress.retries, ?pause, "retrying with the same Idempotency-Key");
            tokio::time::sleep(pause).await;
        }
    }
}

/// A job that failed and gave its charge back, so its key is free again: a
/// retry is a new attempt.
fn released(outcome: &Outcome) -> bool {
    match outcome {
        Outcome::ProviderBusy { .. } => true,
        Outcome::Failed(f) => f.charged == Some(false) && f.status != 503,
        _ => false,
    }
}

/// How long to wait out a budget refusal, when the policy waits that long.
fn budget_wait(outcome: &Outcome, most: Option<Duration>) -> Option<Duration> {
    match outcome {
        Outcome::BudgetExhausted { retry_after, .. } if most.is_some_and(|m| *retry_after <= m) => {
            Some(*retry_after)
        }
        _ => None,
    }
}

/// Sends `req` and reads the whole answer.
async fn fetch(req: reqwest::RequestBuilder) -> Result<Raw, reqwest::Error> {
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.bytes().await?.to_vec();
    Ok(Raw {
        status,
        headers,
        body,
    })
}

/// Puts the attempts into the outcome, and a provider-busy's advice when the
/// server gave none.
fn stamp(mut outcome: Outcome, progress: &Progress, client: &Client) -> Outcome {
    let attempts = progress.attempts;
    match &mut outcome {
        Outcome::Done(d) => d.attempts = attempts,
        Outcome::Pending(p) => p.attempts = attempts,
        Outcome::Failed(f) => f.attempts = attempts,
        Outcome::ProviderBusy { retry_after, .. } if retry_after.is_zero() => {
            *retry_after = client.inner.retry.ceiling(progress.retries + 1);
        }
        _ => {}
    }
    outcome
}

/// A `GET` of `path` answered 200, retried on `503` and transport errors
/// within `progress`'s deadline; any other answer is its error.
pub(crate) async fn read(
    client: &Client,
    user: Option<&HeaderValue>,
    path: &str,
    query: &[(&str, String)],
    progress: &mut Progress,
) -> Result<Raw, Error> {
    let inner = &client.inner;
    let policy = &inner.retry;
    loop {
        progress.attempts += 1;
        let mut req = inner
            .http
            .get(format!("{}{path}{}", inner.base, query_string(query)))
            .header(reqwest::header::AUTHORIZATION, inner.auth.clone())
            .timeout(
                progress
                    .left()
                    .clamp(Duration::from_millis(100), Duration::from_secs(30)),
            );
        if let Some(user) = user {
            req = req.header(USER_HEADER, user.clone());
        }
        let (hint, otherwise) = match fetch(req).await {
            Ok(raw) if raw.status == 200 => return Ok(raw),
            Ok(raw) => match classify(raw.status, &raw.headers, &raw.body, true) {
                Step::Final(Err(e)) => return Err(e),
                Step::Final(Ok(_)) => {
                    return Err(Error::Protocol(format!(
                        "GET {path} answered {}",
                        raw.status
                    )))
                }
                // Only a 503 or a gateway's error: a read charges nothing.
                Step::Retry { hint, otherwise } => (hint, otherwise),
            },
            Err(e) => (None, Err(Error::Transport(e))),
        };
        progress.retries += 1;
        let pause = policy.backoff(progress.retries, hint);
        if progress.retries > policy.max_retries || pause >= progress.left() {
            return Err(otherwise
                .err()
                .unwrap_or_else(|| Error::Protocol(format!("GET {path}: no usable answer"))));
        }
        tokio::time::sleep(pause).await;
    }
}

/// `?k=v&...`, percent-encoded (empty for no pairs).
fn query_string(query: &[(&str, String)]) -> String {
    let encode = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let pairs: Vec<String> = query
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect();
    if pairs.is_empty() {
        String::new()
    } else {
        format!("?{}", pairs.join("&"))
    }
}

/// `GET /v1/jobs/{id}` once (with retries) as an outcome.
pub(crate) async fn read_job(
    client: &Client,
    user: Option<&HeaderValue>,
    job_id: &str,
    progress: &mut Progress,
) -> Result<Outcome, Error> {
    if !valid_id(job_id) {
        return Err(Error::Config(format!("{job_id:?} is not a job id")));
    }
    let raw = read(client, user, &format!("/v1/jobs/{job_id}"), &[], progress).await?;
    let view: JobView = serde_json::from_slice(&raw.body)
        .map_err(|e| Error::Protocol(format!("a job body that does not parse: {e}")))?;
    Ok(stamp(view.outcome(), progress, client))
}

/// Polls the job until it is final or the deadline passes.
pub(crate) async fn wait_job(
    client: &Client,
    user: Option<&HeaderValue>,
    job_id: &str,
    progress: &mut Progress,
) -> Result<Outcome, Error> {
    let mut poll = Duration::from_millis(50);
    loop {
        let outcome = read_job(client, user, job_id, progress).await?;
        if !matches!(outcome, Outcome::Pending(_)) || poll >= progress.left() {
            return Ok(outcome);
        }
        tokio::time::sleep(poll).await;
        poll = (poll * 3 / 2).min(MAX_POLL);
    }
}
