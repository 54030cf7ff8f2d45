//! The HTTP provider client: POSTs a job's input JSON to the provider's `url`
//! (plus the operation's `path`) and takes the JSON answer as the result; an
//! operation may instead send its input as a form body (`body = "form"`) or as
//! the query string of a GET (`method = "GET"`, [`RequestShape`]).
//!
//! Built on reqwest with rustls on the `ring` crypto provider (it builds with a
//! C compiler alone, where aws-lc needs cmake) and the platform's root
//! certificates; one client per provider, reusing connections.
//! Every call carries the provider's static `headers`, and its secret ones
//! (`secret_headers`, and the older single `auth_header`/`auth_env`), whose
//! values are read from environment variables once, at start (a missing one
//! refuses the start), marked sensitive and never logged.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{HeaderName, HeaderValue, ACCEPT, CONTENT_TYPE, RETRY_AFTER};
use serde_json::Value;
use tollgate_core::config::{RequestShape, StreamUsage, Upstream};
use tollgate_core::{
    config::Config,
    job::{Job, Rejection},
};

use tokio::time::Instant;

use crate::{
    late_by, pass_on, send_check, stream, Answer, AttemptError, AttemptOptions, SetupError,
    Transport,
};
use tollgate_core::head::Head;
use tollgate_core::stream::{StreamEvent, StreamWriter};

/// Installs rustls' `ring` crypto provider as the process default, once (reqwest
/// is built without a provider of its own). Idempotent; call before building
/// any reqwest client.
pub fn install_crypto_provider() {
    // Err means a provider is installed already: fine either way.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// One provider's HTTP upstream.
pub struct HttpTransport {
    provider: String,
    url: String,
    /// Operation name -> path appended to `url`.
    paths: BTreeMap<String, String>,
    /// Operation name -> how its input is sent (absent: a JSON POST).
    shapes: BTreeMap<String, RequestShape>,
    /// Operations whose upstream reports a stream's usage only when asked
    /// ([`StreamUsage::Ask`]).
    ask_usage: BTreeSet<String>,
    /// Sent with every call: static headers, then secret ones (sensitive).
    headers: Vec<(HeaderName, HeaderValue)>,
    /// Sent as the body's `model` in place of the request's (a pool
    /// member's `model`).
    model: Option<String>,
    client: reqwest::Client,
}

impl std::fmt::Debug for HttpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpTransport")
            .field("provider", &self.provider)
            .field("url", &self.url)
            .field(
                "headers",
                &self.headers.iter().map(|(h, _)| h).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl HttpTransport {
    /// Reads the secret headers' values from their environment variables
    /// now: a missing variable fails at start, naming it (never its value).
    pub fn new(provider: &str, upstream: &Upstream, config: &Config) -> Result<Self, SetupError> {
        let client_err = |message: String| SetupError::Client {
            provider: provider.to_owned(),
            message,
        };
        let name_of = |field: &str, header: &str| {
            HeaderName::from_bytes(header.as_bytes())
                .map_err(|e| client_err(format!("{field}.{header}: {e}")))
        };
        let mut headers = Vec::new();
        for (header, value) in &upstream.headers {
            let value = HeaderValue::from_str(value)
                .map_err(|_| client_err(format!("headers.{header}: not a valid header value")))?;
            headers.push((name_of("headers", header)?, value));
        }
        let secrets = upstream
            .secret_headers
            .iter()
            .map(|(h, v)| (h.as_str(), v.as_str()))
            .chain(
                upstream
                    .auth_header
                    .as_deref()
                    .zip(upstream.auth_env.as_deref()),
            );
        for (header, var) in secrets {
            let value = std::env::var(var).map_err(|_| SetupError::MissingSecret {
                provider: provider.to_owned(),
                var: var.to_owned(),
            })?;
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| client_err(format!("{var} is not a valid header value")))?;
            value.set_sensitive(true);
            headers.push((name_of("secret_headers", header)?, value));
        }
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
        let shapes = config
            .operations()
            .filter(|o| o.provider == provider && o.request != RequestShape::Json)
            .map(|o| (o.name.clone(), o.request))
            .collect();
        let ask_usage = config
            .operations()
            .filter(|o| o.provider == provider && o.stream_usage == StreamUsage::Ask)
            .map(|o| o.name.clone())
            .collect();
        Ok(Self {
            provider: provider.to_owned(),
            url: upstream.url.clone(),
            paths,
            shapes,
            ask_usage,
            headers,
            model: upstream.model.clone(),
            client,
        })
    }
}

/// `input` with its `model` set to `model` (a pool member's name for the
/// model), when it is an object and `model` is set; else `input` as it is.
fn with_model<'a>(input: &'a Value, model: Option<&str>) -> std::borrow::Cow<'a, Value> {
    match (input, model) {
        (Value::Object(o), Some(m)) => {
            let mut o = o.clone();
            o.insert("model".to_owned(), Value::String(m.to_owned()));
            std::borrow::Cow::Owned(Value::Object(o))
        }
        _ => std::borrow::Cow::Borrowed(input),
    }
}

/// The members of a job's input as name/value pairs, for a form body or a
/// query string: strings as they are, numbers and booleans as JSON writes
/// them, each element of an array as a pair of its own, objects as JSON text;
/// `null` members are left out.
fn pairs(input: &Value) -> Vec<(String, String)> {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out = Vec::new();
    for (name, value) in input.as_object().into_iter().flatten() {
        match value {
            Value::Null => {}
            Value::Array(items) => out.extend(items.iter().map(|v| (name.clone(), text(v)))),
            v => out.push((name.clone(), text(v))),
        }
    }
    out
}

/// `Retry-After` in seconds (integer or decimal), or an HTTP-date (RFC 9110):
/// the time until it, none when it has passed; at most an hour either way.
fn retry_after(h: Option<&HeaderValue>) -> Option<Duration> {
    let text = h?.to_str().ok()?.trim();
    if let Ok(secs) = text.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::from_secs_f64(secs.min(3600.0)));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    let wait = at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or(Duration::ZERO);
    Some(wait.min(Duration::from_secs(3600)))
}

#[async_trait]
impl Transport for HttpTransport {
    /// The request is built, then checked against `use_by`, then sent; and
    /// checked again when the connection asks for the body, just before the
    /// request is written (see [`checked_body`]).
    async fn attempt(
        &self,
        job: &Job,
        AttemptOptions { use_by, sink, .. }: AttemptOptions<'_>,
    ) -> Result<Answer, AttemptError> {
        match sink {
            Some(sink) => self.streamed(job, use_by, sink).await,
            None => {
                let late = Arc::new(OnceLock::new());
                let req = self.request(job, &job.input, use_by, &late)?;
                let resp = self.send(req, use_by, &late).await?;
                let head = head_of(&resp);
                let (status, body) = self.read_whole(resp).await?;
                Ok(Answer {
                    body: json_answer(status, &body)?,
                    head: Some(head),
                })
            }
        }
    }
}

/// The status and safe headers of `resp` ([`Head::safe`]).
fn head_of(resp: &reqwest::Response) -> Head {
    Head::safe(
        resp.status().as_u16(),
        resp.headers()
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes())),
    )
}

impl HttpTransport {
    /// As a whole attempt, asking for `text/event-stream`: a 2xx answer's
    /// head (when not a plain 200) goes to `sink` first, then its events one
    /// by one as they arrive, and the attempt's answer is the usage it
    /// reported ([`crate::stream::Usage`]). A body cut, an over-long event, or
    /// a sink that refuses (the client went away: dropping the response
    /// closes the upstream connection) after the answer began is
    /// [`AttemptError::Unanswered`], unless the stream's final usage was seen
    /// already: the work is done and paid what it used.
    ///
    /// An upstream that reports usage only when asked ([`StreamUsage::Ask`])
    /// is asked ([`stream::asking_usage`]) when the client did not; the
    /// client is then relayed the stream it asked for ([`stream::as_unasked`]).
    async fn streamed(
        &self,
        job: &Job,
        use_by: Option<Instant>,
        sink: &dyn StreamWriter,
    ) -> Result<Answer, AttemptError> {
        let late = Arc::new(OnceLock::new());
        let asked = self
            .ask_usage
            .contains(&job.operation)
            .then(|| stream::asking_usage(&job.input))
            .flatten();
        let req = self
            .request(job, asked.as_ref().unwrap_or(&job.input), use_by, &late)?
            .header(ACCEPT, "text/event-stream");
        let mut resp = self.send(req, use_by, &late).await?;
        let is_stream = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let head = head_of(&resp);
        if !resp.status().is_success() || !is_stream {
            // An error, or a whole answer: as a plain call, passed on as one event.
            let (status, body) = self.read_whole(resp).await?;
            let v = json_answer(status, &body)?;
            if !head.is_plain() {
                pass_on(sink, StreamEvent::Head(head.clone())).await?;
            }
            pass_on(sink, StreamEvent::Data(format!("data: {v}"))).await?;
            return Ok(Answer {
                body: v,
                head: Some(head),
            });
        }
        if !head.is_plain() {
            pass_on(sink, StreamEvent::Head(head.clone())).await?;
        }
        let status = resp.status();
        let mut events = stream::Events::default();
        let mut usage = stream::Usage::default();
        let cut = |message: String| AttemptError::Unanswered { message };
        loop {
            let chunk = resp
                .chunk()
                .await
                .map_err(|e| cut(format!("{status}, then the stream broke: {}", chain(&e))))?;
            let (done, found) = match chunk {
                Some(bytes) => (
                    false,
                    events
                        .feed(&bytes)
                        .map_err(|e| cut(format!("{status}, then {e}")))?,
                ),
                None => (true, events.rest().into_iter().collect()),
            };
            for event in found {
                usage.see(&event);
                let relayed = match asked {
                    Some(_) => stream::as_unasked(&event).map(std::borrow::Cow::into_owned),
                    None => Some(event),
                };
                let Some(relayed) = relayed else { continue };
                if let Err(e) = pass_on(sink, StreamEvent::Data(relayed)).await {
                    if usage.is_complete() {
                        // Only the stream's end was left: the call did
                        // its work and reported it.
                        return Ok(Answer {
                            body: usage.answer(),
                            head: Some(head),
                        });
                    }
                    return Err(e);
                }
            }
            if done {
                return Ok(Answer {
                    body: usage.answer(),
                    head: Some(head),
                });
            }
        }
    }
}

impl HttpTransport {
    /// The request of one attempt at `job` sending `input` (its own, or as
    /// asked for on its behalf), its body checked against `use_by` as it is
    /// written.
    fn request(
        &self,
        job: &Job,
        input: &Value,
        use_by: Option<Instant>,
        late: &Arc<OnceLock<Duration>>,
    ) -> Result<reqwest::RequestBuilder, AttemptError> {
        let path = self.paths.get(&job.operation).map_or("", String::as_str);
        let url = format!("{}{path}", self.url);
        let input = &with_model(input, self.model.as_deref());
        let shape = self.shapes.get(&job.operation).copied().unwrap_or_default();
        let req = match shape {
            RequestShape::Json => self
                .client
                .post(url)
                .header(CONTENT_TYPE, "application/json")
                .body(checked_body(input.to_string(), use_by, Arc::clone(late))),
            RequestShape::Form => {
                let form = form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(pairs(input))
                    .finish();
                self.client
                    .post(url)
                    .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
                    .body(checked_body(form, use_by, Arc::clone(late)))
            }
            // No body to check as it is written: the grant is checked at
            // the send (`send_check`), as for any request.
            RequestShape::Query => {
                let mut url = reqwest::Url::parse(&url).map_err(|e| AttemptError::NotSent {
                    message: format!("bad url {url:?}: {e}"),
                })?;
                let pairs = pairs(input);
                if !pairs.is_empty() {
                    url.query_pairs_mut().extend_pairs(pairs);
                }
                self.client.get(url)
            }
        };
        let mut req = req.header("idempotency-key", job.id.as_str());
        // The call's trace continues upstream: same trace id, this hop's id.
        if let Some(trace) = &job.trace {
            req = req.header("traceparent", trace.child().to_string());
        }
        for (name, value) in &self.headers {
            req = req.header(name.clone(), value.clone());
        }
        Ok(req)
    }

    /// Sends `req` if `use_by` has not passed (the last step before it).
    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        use_by: Option<Instant>,
        late: &Arc<OnceLock<Duration>>,
    ) -> Result<reqwest::Response, AttemptError> {
        send_check(use_by)?;
        match req.send().await {
            Ok(r) => Ok(r),
            Err(_) if late.get().is_some() => Err(AttemptError::Late {
                by: late.get().copied().unwrap_or_default(),
            }),
            Err(e) => Err(unanswered_unless_unsent(&e)),
        }
    }

    /// The status and whole body of `resp`; a non-2xx status is
    /// [`AttemptError::Status`] (with the upstream's `Retry-After`).
    async fn read_whole(
        &self,
        resp: reqwest::Response,
    ) -> Result<(reqwest::StatusCode, bytes::Bytes), AttemptError> {
        let status = resp.status();
        let wait = retry_after(resp.headers().get(RETRY_AFTER));
        let body = resp.bytes().await.map_err(|e| AttemptError::Unanswered {
            message: format!("{status}, then reading the body failed: {}", chain(&e)),
        })?;
        if status.is_success() {
            return Ok((status, body));
        }
        // What an error keeps of the body: for the logs, and for the client
        // when the operation exposes a rejection's body.
        let snippet = Rejection::bounded(&String::from_utf8_lossy(
            &body[..body.len().min(Rejection::BODY_LIMIT)],
        ));
        Err(AttemptError::Status {
            status: status.as_u16(),
            retry_after: wait,
            message: snippet,
        })
    }
}

/// A 2xx answer's body as JSON ([`AttemptError::BadBody`] when it is not).
fn json_answer(status: reqwest::StatusCode, body: &[u8]) -> Result<Value, AttemptError> {
    serde_json::from_slice(body).map_err(|e| AttemptError::BadBody {
        status: status.as_u16(),
        message: e.to_string(),
    })
}

/// A send that failed: [`AttemptError::NotSent`] only when reqwest says no
/// connection was made (or the request could not be built), which proves
/// nothing was written; anything else (a timeout, a reset, a cut) may have
/// reached the upstream, and is [`AttemptError::Unanswered`].
fn unanswered_unless_unsent(e: &reqwest::Error) -> AttemptError {
    let message = chain(e);
    if e.is_connect() || e.is_builder() {
        AttemptError::NotSent { message }
    } else {
        AttemptError::Unanswered { message }
    }
}

/// An error with its sources: reqwest's own message ("error sending request")
/// says little without them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The request's body, checked against `use_by` when the connection first
/// asks for it. That is after a connection is at hand (making a new one can
/// take long, and the process can pause meanwhile) and just before anything of
/// the request is written: hyper buffers the head and polls the body before it
/// flushes either, and drops both when the body fails. A late grant then sends
/// nothing; `late` says how late it was.
struct CheckedBody {
    input: Option<bytes::Bytes>,
    len: u64,
    use_by: Option<Instant>,
    late: Arc<OnceLock<Duration>>,
}

impl http_body::Body for CheckedBody {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        let Some(input) = this.input.take() else {
            return std::task::Poll::Ready(None);
        };
        std::task::Poll::Ready(Some(match late_by(this.use_by) {
            None => Ok(http_body::Frame::data(input)),
            Some(by) => {
                let _ = this.late.set(by);
                Err(std::io::Error::other(
                    "not sent: the call's grant went stale before the request was written",
                ))
            }
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.input.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        // An exact size: the request carries a Content-Length, not chunks.
        http_body::SizeHint::with_exact(self.len)
    }
}

fn checked_body(
    input: String,
    use_by: Option<Instant>,
    late: Arc<OnceLock<Duration>>,
) -> reqwest::Body {
    reqwest::Body::wrap(CheckedBody {
        len: input.len() as u64,
        input: Some(bytes::Bytes::from(input)),
        use_by,
        late,
    })
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
        // An HTTP-date: the time until it; one past means now.
        assert_eq!(
            retry_after(h("Wed, 21 Oct 2015 07:28:00 GMT").as_ref()),
            Some(Duration::ZERO)
        );
        let soon = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
        let wait = retry_after(h(&soon).as_ref()).unwrap_or_default();
        assert!(
            wait > Duration::from_secs(28) && wait <= Duration::from_secs(30),
            "{soon}: {wait:?}"
        );
        let far =
            httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(86_400));
        assert_eq!(
            retry_after(h(&far).as_ref()),
            Some(Duration::from_secs(3600))
        );
        assert_eq!(retry_after(h("soon").as_ref()), None);
        assert_eq!(retry_after(None), None);
    }

    /// A config of one provider `llm` at https://api.example.com/, with
    /// `provider`'s further lines, and one operation `x` on it, with
    /// `operation`'s.
    fn example_config(provider: &str, operation: &str) -> Config {
        let text = format!(
            r#"
[plans.free]
limit = 1
window = "1h"
[providers.llm]
rate = 1
burst = 1
max_wait = "1s"
url = "https://api.example.com/"
{provider}
[operations.x]
cost = 1
provider = "llm"
{operation}
"#
        );
        Config::parse(&text, "t").unwrap()
    }

    #[test]
    fn builds_https_clients_and_names_a_missing_secret() {
        let config = example_config(
            r#"auth_header = "Authorization"
auth_env = "TOLLGATE_TEST_SURELY_UNSET_KEY""#,
            r#"path = "/v1/x""#,
        );
        let upstream = config.upstream("llm").unwrap();
        let e = HttpTransport::new("llm", upstream, &config).unwrap_err();
        assert!(
            e.to_string().contains("TOLLGATE_TEST_SURELY_UNSET_KEY"),
            "{e}"
        );
        let mut open = upstream.clone();
        open.auth_header = None;
        open.auth_env = None;
        let client = HttpTransport::new("llm", &open, &config).unwrap();
        assert_eq!(client.url, "https://api.example.com");
        assert_eq!(client.paths.get("x").map(String::as_str), Some("/v1/x"));
    }

    #[test]
    fn secret_headers_come_from_the_environment_and_never_show() {
        let config = example_config(
            r#"headers = { "anthropic-version" = "2023-06-01" }
secret_headers = { "x-api-key" = "TOLLGATE_TEST_HTTP_SECRET_HEADER" }"#,
            "",
        );
        let upstream = config.upstream("llm").unwrap();
        std::env::remove_var("TOLLGATE_TEST_HTTP_SECRET_HEADER");
        let e = HttpTransport::new("llm", upstream, &config).unwrap_err();
        assert!(
            e.to_string().contains("TOLLGATE_TEST_HTTP_SECRET_HEADER"),
            "{e}"
        );
        std::env::set_var("TOLLGATE_TEST_HTTP_SECRET_HEADER", "sk-very-secret");
        let client = HttpTransport::new("llm", upstream, &config).unwrap();
        let shown = format!("{client:?}");
        assert!(!shown.contains("sk-very-secret"), "{shown}");
        assert!(shown.contains("x-api-key"), "{shown}");
        let sent: Vec<_> = client
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.is_sensitive()))
            .collect();
        assert_eq!(sent, [("anthropic-version", false), ("x-api-key", true)]);
    }

    /// Resolves every name to one address, after a delay: a connection that
    /// takes long to make, the way a pause of the process can make it.
    struct SlowDns(std::net::SocketAddr, Duration);

    impl reqwest::dns::Resolve for SlowDns {
        fn resolve(&self, _: reqwest::dns::Name) -> reqwest::dns::Resolving {
            let (addr, delay) = (self.0, self.1);
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                let addrs: reqwest::dns::Addrs = Box::new(std::iter::once(addr));
                Ok(addrs)
            })
        }
    }

    /// A one-shot upstream on a raw socket: the bytes each connection sent,
    /// and a 200 with `{}` to any request it received whole.
    fn raw_upstream() -> (std::net::SocketAddr, std::sync::mpsc::Receiver<Vec<u8>>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for conn in listener.incoming().take(4) {
                let Ok(mut conn) = conn else { return };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                    if got.windows(2).any(|w| w == b"{}") {
                        let _ = conn.write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                        );
                        break;
                    }
                }
                let _ = tx.send(got);
            }
        });
        (addr, rx)
    }

    fn slow_client(addr: std::net::SocketAddr, delay: Duration) -> HttpTransport {
        install_crypto_provider();
        HttpTransport {
            provider: "llm".into(),
            url: format!("http://upstream.test:{}", addr.port()),
            paths: BTreeMap::new(),
            shapes: BTreeMap::new(),
            ask_usage: BTreeSet::new(),
            headers: Vec::new(),
            model: None,
            client: reqwest::Client::builder()
                .dns_resolver(SlowDns(addr, delay))
                .build()
                .unwrap(),
        }
    }

    fn job() -> Job {
        tollgate_core::testing::job("r1", "x", "llm", serde_json::json!({}))
    }

    /// A whole attempt on a grant usable until `use_by`.
    fn by(use_by: Instant) -> AttemptOptions<'static> {
        AttemptOptions {
            use_by: Some(use_by),
            sink: None,
            member: None,
        }
    }

    /// The grant is fresh at the send but goes stale while the connection is
    /// made: nothing of the request reaches the upstream.
    #[tokio::test]
    async fn a_grant_gone_stale_while_connecting_sends_nothing() {
        let (addr, got) = raw_upstream();
        let client = slow_client(addr, Duration::from_millis(300));
        let use_by = Instant::now() + Duration::from_millis(100);
        let out = client.attempt(&job(), by(use_by)).await;
        assert!(
            matches!(out, Err(AttemptError::Late { by }) if by >= Duration::from_millis(150)),
            "{out:?}"
        );
        let bytes = got.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
        assert!(
            bytes.is_empty(),
            "the upstream got {:?}",
            String::from_utf8_lossy(&bytes)
        );
        // Still fresh once connected: the request goes out whole.
        let client = slow_client(addr, Duration::from_millis(10));
        let use_by = Instant::now() + Duration::from_secs(5);
        let out = client.attempt(&job(), by(use_by)).await;
        assert_eq!(out.ok().map(|a| a.body), Some(serde_json::json!({})));
        let bytes = got.recv_timeout(Duration::from_secs(5)).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.starts_with("POST / HTTP/1.1"), "{text}");
        assert!(text.contains("content-length: 2"), "{text}");
    }

    /// A pool member's `model` replaces the request's in the body sent; the
    /// rest of the body is as it came.
    #[tokio::test]
    async fn a_member_sends_its_own_model_name() {
        let (addr, got) = raw_upstream();
        let mut client = slow_client(addr, Duration::ZERO);
        client.model = Some("gpt-4o-eu".into());
        let job = tollgate_core::testing::job(
            "r1",
            "x",
            "llm",
            serde_json::json!({"model": "gpt-4o", "q": {}}),
        );
        let use_by = Instant::now() + Duration::from_secs(5);
        let out = client.attempt(&job, by(use_by)).await;
        assert_eq!(out.ok().map(|a| a.body), Some(serde_json::json!({})));
        let bytes = got.recv_timeout(Duration::from_secs(5)).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
        let sent: Value = serde_json::from_str(body).unwrap();
        assert_eq!(sent, serde_json::json!({"model": "gpt-4o-eu", "q": {}}));
        // Not an object: nothing to set, sent as it came.
        assert_eq!(
            with_model(&serde_json::json!([1]), Some("m")).into_owned(),
            serde_json::json!([1])
        );
        assert_eq!(
            with_model(&serde_json::json!({"a": 1}), None).into_owned(),
            serde_json::json!({"a": 1})
        );
    }
}
