//! The HTTP provider client: POSTs a job's input JSON to the provider's `url`
//! (plus the operation's `path`) and takes the JSON answer as the result.
//!
//! Built on reqwest with rustls on the `ring` crypto provider (it builds with a
//! C compiler alone, where aws-lc needs cmake) and the platform's root
//! certificates; one client per provider, reusing connections.
//! The credential header's value is read from an environment variable once, at
//! start, and never logged.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use serde_json::Value;
use tollgate_core::config::Upstream;
use tollgate_core::{config::Config, job::Job};

use tokio::time::Instant;

use crate::{send_check, AttemptError, SetupError, Transport};

/// Installs rustls' `ring` crypto provider as the process default, once (reqwest
/// is built without a provider of its own). Idempotent; call before building
/// any reqwest client.
pub fn install_crypto_provider() {
    // Err means a provider is installed already: fine either way.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// One provider's HTTP upstream.
pub struct HttpClient {
    provider: String,
    url: String,
    /// Operation name -> path appended to `url`.
    paths: BTreeMap<String, String>,
    auth: Option<(HeaderName, HeaderValue)>,
    client: reqwest::Client,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("provider", &self.provider)
            .field("url", &self.url)
            .field("auth", &self.auth.as_ref().map(|(h, _)| h))
            .finish_non_exhaustive()
    }
}

impl HttpClient {
    /// Reads the credential from `upstream.auth_env` now: a missing variable
    /// fails at start, naming it.
    pub fn new(provider: &str, upstream: &Upstream, config: &Config) -> Result<Self, SetupError> {
        let client_err = |message: String| SetupError::Client {
            provider: provider.to_owned(),
            message,
        };
        let auth = match (&upstream.auth_header, &upstream.auth_env) {
            (Some(header), Some(var)) => {
                let value = std::env::var(var).map_err(|_| SetupError::MissingSecret {
                    provider: provider.to_owned(),
                    var: var.clone(),
                })?;
                let name = HeaderName::from_bytes(header.as_bytes())
                    .map_err(|e| client_err(format!("auth_header: {e}")))?;
                let mut value = HeaderValue::from_str(&value)
                    .map_err(|_| client_err(format!("{var} is not a valid header value")))?;
                value.set_sensitive(true);
                Some((name, value))
            }
            _ => None,
        };
        install_crypto_provider();
        let client = reqwest::Client::builder()
            .timeout(upstream.timeout)
            .connect_timeout(upstream.timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| client_err(e.to_string()))?;
        let paths = config
            .operations()
            .filter(|o| o.provider == provider)
            .filter_map(|o| Some((o.name.clone(), o.path.clone()?)))
            .collect();
        Ok(Self {
            provider: provider.to_owned(),
            url: upstream.url.clone(),
            paths,
            auth,
            client,
        })
    }
}

/// `Retry-After` in seconds (integer or decimal); HTTP dates are ignored.
fn retry_after(h: Option<&HeaderValue>) -> Option<Duration> {
    let secs: f64 = h?.to_str().ok()?.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(3600.0)))
}

#[async_trait]
impl Transport for HttpClient {
    async fn attempt(&self, job: &Job) -> Result<Value, AttemptError> {
        self.attempt_by(job, None).await
    }

    /// The request is built, then checked against `use_by`, then sent: the
    /// check is the last step before the send future is first polled.
    async fn attempt_by(&self, job: &Job, use_by: Option<Instant>) -> Result<Value, AttemptError> {
        let path = self.paths.get(&job.operation).map_or("", String::as_str);
        let mut req = self
            .client
            .post(format!("{}{path}", self.url))
            .header(CONTENT_TYPE, "application/json")
            .header("idempotency-key", job.id.as_str())
            .body(job.input.to_string());
        // The call's trace continues upstream: same trace id, this hop's id.
        if let Some(trace) = &job.trace {
            req = req.header("traceparent", trace.child().to_string());
        }
        if let Some((name, value)) = &self.auth {
            req = req.header(name.clone(), value.clone());
        }
        send_check(use_by)?;
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                return Err(AttemptError::Retryable {
                    status: None,
                    retry_after: None,
                    message: e.to_string(),
                })
            }
        };
        let status = resp.status();
        let wait = retry_after(resp.headers().get(RETRY_AFTER));
        let body = resp.bytes().await.map_err(|e| AttemptError::Retryable {
            status: Some(status.as_u16()),
            retry_after: wait,
            message: format!("reading the body: {e}"),
        })?;
        let snippet = || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| AttemptError::Fatal {
                status: Some(200),
                message: e.to_string(),
            });
        }
        if status.as_u16() == 429 || status.is_server_error() {
            return Err(AttemptError::Retryable {
                status: Some(status.as_u16()),
                retry_after: wait,
                message: snippet(),
            });
        }
        Err(AttemptError::Fatal {
            status: Some(status.as_u16()),
            message: snippet(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_retry_after_seconds() {
        let h = |s: &str| HeaderValue::from_str(s).ok();
        assert_eq!(retry_after(h("2").as_ref()), Some(Duration::from_secs(2)));
        assert_eq!(
            retry_after(h("0.25").as_ref()),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            retry_after(h("Wed, 21 Oct 2015 07:28:00 GMT").as_ref()),
            None
        );
        assert_eq!(retry_after(None), None);
    }

    #[test]
    fn builds_https_clients_and_names_a_missing_secret() {
        let text = r#"
[plans.free]
limit = 1
window = "1h"
[providers.llm]
rate = 1
burst = 1
max_wait = "1s"
url = "https://api.example.com/"
auth_header = "Authorization"
auth_env = "TOLLGATE_TEST_SURELY_UNSET_KEY"
[operations.x]
cost = 1
provider = "llm"
path = "/v1/x"
"#;
        let config = Config::parse(text, "t").unwrap();
        let upstream = config.upstream("llm").unwrap();
        let e = HttpClient::new("llm", upstream, &config).unwrap_err();
        assert!(
            e.to_string().contains("TOLLGATE_TEST_SURELY_UNSET_KEY"),
            "{e}"
        );
        let mut open = upstream.clone();
        open.auth_header = None;
        open.auth_env = None;
        let client = HttpClient::new("llm", &open, &config).unwrap();
        assert_eq!(client.url, "https://api.example.com");
        assert_eq!(client.paths.get("x").map(String::as_str), Some("/v1/x"));
    }
}
