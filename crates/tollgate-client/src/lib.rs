//! A client of tollgate's HTTP api, for applications that call operations for
//! their users.
//!
//! One [`Call`] is one logical call: it gets an `Idempotency-Key` when it is
//! made and sends that key on every attempt, so a retry after a lost answer,
//! a `503` or a refunded failure is the same request, charged at most once.
//! Each call ends in an [`Outcome`] that says what to do next, or an
//! [`Error`] when the call could not be made or tollgate refused it as it is.
//!
//! Which answers are retried (within the [`RetryPolicy`]'s deadline, after
//! the server's `Retry-After` or an exponential backoff, with jitter):
//!
//! | answer | retried with the same key | else the call ends in |
//! |---|---|---|
//! | no answer (connect refused, cut, timeout) | yes | [`Error::Transport`] |
//! | `503` (store unreachable, overloaded) | yes, after `Retry-After` | [`Error::Unavailable`] |
//! | `502`/`504` with `"charged": false` (refunded) | yes: a new attempt | [`Outcome::ProviderBusy`] (throttle timeout) or [`Outcome::Failed`] |
//! | `502`/`504` with `"charged": true` | no | [`Outcome::Failed`] |
//! | `429` budget | no (unless [`RetryPolicy::wait_for_budget`]) | [`Outcome::BudgetExhausted`] with the exact `retry_after` |
//! | `4xx` upstream rejected the input | no | [`Outcome::Rejected`] |
//! | `401`/`403`, other `4xx` | no | [`Error::Auth`], [`Error::Invalid`] |
//!
//! A service key acts for one of its application's users by naming it
//! ([`ClientBuilder::on_behalf_of`], [`Client::for_user`],
//! [`Call::on_behalf_of`]): the `Tollgate-User` header.
//!
//! ```no_run
//! use std::time::Duration;
//! use tollgate_client::{Client, Outcome};
//!
//! # async fn demo() -> Result<(), tollgate_client::Error> {
//! let tollgate = Client::builder("http://127.0.0.1:8080", "tg_svc_...")
//!     .deadline(Duration::from_secs(30))
//!     .build()?;
//! let call = tollgate
//!     .for_user("alice")?
//!     .call("llm.structured", serde_json::json!({"prompt": "Summarize ..."}));
//! match call.send().await? {
//!     Outcome::Done(done) => println!("{}", done.result),
//!     Outcome::BudgetExhausted { retry_after, .. } => {
//!         println!("out of budget for {} s", retry_after.as_secs())
//!     }
//!     Outcome::ProviderBusy { retry_after, .. } => {
//!         println!("provider busy: try again in {retry_after:?}")
//!     }
//!     Outcome::Pending(p) => println!("still running: job {}", p.job_id),
//!     other => println!("{}: {other:?}", other.name()),
//! }
//! # Ok(())
//! # }
//! ```

pub mod amount;
mod answer;
mod call;
mod error;
mod outcome;
mod retry;
mod usage;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::Value;

pub use call::Call;
pub use error::Error;
pub use outcome::{Done, Failure, Outcome, Pending, Problem, Window};
pub use retry::RetryPolicy;
pub use usage::{SpendEvent, Usage, UsageWindow};

/// The header naming the user a service key acts for.
pub const USER_HEADER: &str = "Tollgate-User";

/// A tollgate api with one credential. Cheap to clone (one connection pool).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    /// The user calls act for by default (a service key's `Tollgate-User`).
    user: Option<HeaderValue>,
}

struct Inner {
    http: reqwest::Client,
    base: String,
    auth: HeaderValue,
    retry: RetryPolicy,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("Client")
            .field("base", &self.inner.base)
            .field("user", &self.user)
            .field("retry", &self.inner.retry)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    base: String,
    key: String,
    user: Option<String>,
    retry: RetryPolicy,
    http: Option<reqwest::Client>,
}

impl ClientBuilder {
    /// Every call acts for `user` unless it names another (a service key only;
    /// tollgate refuses a user key that names someone else).
    pub fn on_behalf_of(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// The most one logical call may take, retries and waits included.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.retry.deadline = deadline;
        self
    }

    /// Use this reqwest client (its pool, its timeouts) instead of a default one.
    pub fn http_client(mut self, http: reqwest::Client) -> Self {
        self.http = Some(http);
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        let base = self.base.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Error::Config(format!(
                "the base URL must start with http:// or https:// (got {base:?})"
            )));
        }
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", self.key.trim()))
            .map_err(|_| Error::Config("the API key is not a valid header value".into()))?;
        auth.set_sensitive(true);
        let user = self.user.as_deref().map(user_header).transpose()?;
        let http = match self.http {
            Some(h) => h,
            None => {
                // reqwest is built without a crypto provider of its own.
                let _ = rustls::crypto::ring::default_provider().install_default();
                reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .build()
                    .map_err(|e| Error::Config(format!("cannot build the HTTP client: {e}")))?
            }
        };
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                base,
                auth,
                retry: self.retry,
            }),
            user,
        })
    }
}

fn user_header(user: &str) -> Result<HeaderValue, Error> {
    HeaderValue::from_str(user)
        .ok()
        .filter(|_| valid_id(user))
        .ok_or_else(|| Error::Config(format!("{user:?} is not a valid user id")))
}

/// What tollgate accepts as a user, job or operation id in a path or header.
fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@+=~-".contains(&b))
}

/// An answer read to its end.
#[derive(Debug)]
struct Raw {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Client {
    /// A client of the api at `base` (e.g. `http://127.0.0.1:8080`) with
    /// `api_key`, and the default [`RetryPolicy`].
    pub fn new(base: impl Into<String>, api_key: impl Into<String>) -> Result<Self, Error> {
        Self::builder(base, api_key).build()
    }

    pub fn builder(base: impl Into<String>, api_key: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base: base.into(),
            key: api_key.into(),
            user: None,
            retry: RetryPolicy::default(),
            http: None,
        }
    }

    /// The same client acting for `user` (a service key's end user), sharing
    /// the connection pool.
    pub fn for_user(&self, user: &str) -> Result<Self, Error> {
        Ok(Self {
            inner: Arc::clone(&self.inner),
            user: Some(user_header(user)?),
        })
    }

    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.inner.retry
    }

    /// A call of `operation` with `input` (a JSON object), with a fresh
    /// Idempotency-Key. Nothing is sent until [`Call::send`],
    /// [`Call::submit`] or [`Call::submit_and_wait`].
    pub fn call(&self, operation: &str, input: Value) -> Call {
        Call::new(self.clone(), operation, input)
    }

    /// The job `job_id` as it stands (`Pending` unless final), read once
    /// (with retries on `503` and transport errors).
    pub async fn job(&self, job_id: &str) -> Result<Outcome, Error> {
        let mut progress = call::Progress::new(self.inner.retry.deadline);
        call::read_job(self, self.user.as_ref(), job_id, &mut progress).await
    }

    /// Waits for the job `job_id` to end (polling `GET /v1/jobs/{id}`), at
    /// most `timeout`: then it is still [`Outcome::Pending`].
    pub async fn wait(&self, job_id: &str, timeout: Duration) -> Result<Outcome, Error> {
        let mut progress = call::Progress::new(timeout);
        call::wait_job(self, self.user.as_ref(), job_id, &mut progress).await
    }

    /// The budget and the first page of the audit trail.
    pub async fn usage(&self) -> Result<Usage, Error> {
        self.usage_page(None, None).await
    }

    /// A page of the audit trail: at most `limit` events (tollgate's bound
    /// when `None`) after `cursor` (a previous page's `next_cursor`).
    pub async fn usage_page(
        &self,
        cursor: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Usage, Error> {
        let mut query = Vec::new();
        if let Some(c) = cursor {
            query.push(("cursor", c.to_owned()));
        }
        if let Some(l) = limit {
            query.push(("limit", l.to_string()));
        }
        let mut progress = call::Progress::new(self.inner.retry.deadline);
        let raw = call::read(self, self.user.as_ref(), "/v1/usage", &query, &mut progress).await?;
        serde_json::from_slice(&raw.body)
            .map_err(|e| Error::Protocol(format!("a usage body that does not parse: {e}")))
    }
}
