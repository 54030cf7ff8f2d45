//! The TOML config: plans, providers (their throttle and, optionally, their HTTP
//! upstream) and operations (cost and provider of each job kind).
//!
//! Parsing is strict: unknown keys, a `default_plan` that names no plan, a zero
//! limit or an unparsable window fail at start with a message naming the key, so
//! a typo never silently becomes a default.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::duration;

/// The config compiled into the binary, used when no file is given.
pub const BUILTIN: &str = include_str!("../default.toml");

/// Largest limit or cost accepted: budgets are summed in Lua numbers (doubles),
/// which are exact integers up to 2^53.
pub const MAX_TOKENS: u64 = (1 << 53) - 1;

/// One limit of a plan: at most `limit` tokens spent in any trailing `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub limit: u64,
    pub window: Duration,
}

impl Limit {
    pub fn window_ms(&self) -> u64 {
        u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX)
    }
}

/// Largest `[export] maxlen`.
pub const MAX_EXPORT: u64 = 100_000_000;

/// Most limits one plan may set.
pub const MAX_LIMITS: usize = 8;

/// A budget plan: one or several [`Limit`]s (distinct windows, longest first). A
/// reservation is recorded only if it fits every one of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub name: String,
    /// Never empty; windows distinct, longest first.
    pub limits: Vec<Limit>,
    /// The plan's weight in a saturated provider's fair queue (`share`,
    /// default 1): while users of two plans both wait, grants go to them in
    /// the ratio of their shares.
    pub share: u32,
    /// At most this many of a user's calls hold a slot of one provider at
    /// once (`max_in_flight`, at each provider; fair queuing only). The rest
    /// wait in the user's own queue.
    pub max_in_flight: Option<u32>,
    /// At most this many bytes of a user's jobs are stored in one operation's
    /// queue at once (`max_stored_bytes`, default [`DEFAULT_MAX_STORED_BYTES`]):
    /// inputs of jobs not finished, results and errors still kept, each job
    /// counted with [`JOB_RECORD_BYTES`] more. Checked when a job is submitted.
    pub max_stored_bytes: u64,
    /// At most this many of a user's streamed answers are open at once on
    /// one api pod (`max_open_streams`, default [`DEFAULT_MAX_OPEN_STREAMS`]):
    /// one more is refused before anything is charged (429
    /// `too-many-streams`).
    pub max_open_streams: u32,
    /// Usage alerts (`alerts = [0.8, 1.0]`): the fractions of each limit
    /// whose crossing queues a webhook (with `[alerts]` configured), in basis
    /// points (1/10000), ascending, each in 1..=10000.
    pub alerts: Vec<u32>,
}

/// The most thresholds a plan's `alerts` may list.
pub const MAX_ALERT_THRESHOLDS: usize = 8;

/// The token count at or above which `bp` basis points of `limit` are
/// reached: `ceil(limit * bp / 10000)`, in integers (exact for every limit).
pub fn threshold_tokens(limit: u64, bp: u32) -> u64 {
    let n = u128::from(limit) * u128::from(bp);
    u64::try_from(n.div_ceil(10_000)).unwrap_or(u64::MAX)
}

/// A threshold in basis points as the fraction it was written as (`0.8`, `1`).
pub fn threshold_text(bp: u32) -> String {
    let whole = bp / 10_000;
    let frac = bp % 10_000;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:04}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// `[alerts]`: where usage alerts are sent (see `docs/src/alerts.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alerts {
    /// The webhook's URL (`http://` or `https://`).
    pub url: String,
    /// The environment variable holding the HMAC-SHA256 secret the
    /// `Tollgate-Signature` header is made with (read at start-up).
    pub secret_env: String,
    /// How long one delivery attempt may take (`timeout`, default 10 s).
    pub timeout: Duration,
    /// How long an alert is retried before it is dropped and counted as
    /// failed (`keep`, default 24 h, at most [`MAX_ALERT_KEEP`]).
    pub keep: Duration,
}

/// Default `[alerts] timeout` and `keep`, and the most `keep` may be (the
/// Redis outbox keys expire a little after it).
pub const DEFAULT_ALERT_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_ALERT_KEEP: Duration = Duration::from_secs(24 * 3600);
pub const MAX_ALERT_KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// Default `max_open_streams` of a plan: more streams at once than an
/// application serving one person opens, few enough that one user's
/// streams hold a small part of a pod's stream readers.
pub const DEFAULT_MAX_OPEN_STREAMS: u32 = 32;
/// The most `max_open_streams` may be.
pub const MAX_OPEN_STREAMS: u32 = 100_000;

/// Default `max_stored_bytes` of a plan: 8 MiB per operation queue.
pub const DEFAULT_MAX_STORED_BYTES: u64 = 8 << 20;
/// The most `max_stored_bytes` may be: 1 GiB.
pub const MAX_STORED_BYTES: u64 = 1 << 30;
/// What one job counts towards `max_stored_bytes` besides its input and
/// result: its record's own fields and keys.
pub const JOB_RECORD_BYTES: u64 = 256;

impl Plan {
    /// The plan's longest window (the log keeps events for
    /// [`Config::retention_ms`], which is at least this).
    pub fn window_ms(&self) -> u64 {
        self.limits.first().map_or(0, Limit::window_ms)
    }

    /// The smallest limit: the largest cost the plan could ever admit.
    pub fn max_cost(&self) -> u64 {
        self.limits.iter().map(|l| l.limit).min().unwrap_or(0)
    }

    /// `1000 tokens / 12h` or `1000 tokens / 12h + 100 tokens / 1m`.
    pub fn describe(&self) -> String {
        self.limits
            .iter()
            .map(|l| format!("{} tokens / {}", l.limit, duration::format(l.window)))
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// Largest accepted plan `share` and `max_in_flight`.
pub const MAX_SHARE: u32 = 1000;
pub const MAX_IN_FLIGHT: u32 = 100_000;

/// How a saturated provider orders its waiters (`[providers.X] fairness`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fairness {
    /// One queue in arrival order, whoever waits.
    Fifo,
    /// One queue per user, served in weighted round robin (start-time fair
    /// queuing; see `throttle`): one user's flood never starves the others.
    #[default]
    Fair,
}

/// Largest accepted provider `rate` (tokens per second) and `burst`.
pub const MAX_RATE: f64 = 1_000_000.0;
/// Smallest accepted provider `rate`: one call a day. Below it a rate is a
/// typo (`1e-300` would leave a caller waiting for ages), not a throttle.
pub const MIN_RATE: f64 = 1.0 / 86_400.0;
pub const MAX_BURST: u64 = 1_000_000;
/// Longest accepted provider `max_wait`.
pub const MAX_WAIT_LIMIT: Duration = Duration::from_secs(3600);

/// An upstream provider's throttle: a token bucket of `burst` tokens refilled at
/// `rate` per second, shared by every pod; a call waits at most `max_wait` for a
/// token. Over any interval `t` the provider sees at most `burst + rate * t` calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Provider {
    pub name: String,
    /// Tokens per second, > 0 (fractions allowed: `0.5` is one call per 2 s).
    pub rate: f64,
    /// Bucket capacity, >= 1.
    pub burst: u64,
    pub max_wait: Duration,
    /// How waiters share the provider when it is saturated.
    pub fairness: Fairness,
    /// The longest pause of the bucket after an upstream refusal (a 429, or
    /// a 503 with `Retry-After`): the upstream's `Retry-After`, or the
    /// exponential back-off from [`FIRST_BACKOFF`] when it names none, is
    /// cut to this.
    pub max_pause: Duration,
    /// How long a grant stays usable after it is made (`late_allowance`);
    /// `None`: one token's time, 1/rate (see `throttle::late_of`). Longer,
    /// the bucket grants from a burst reduced to keep the upstream's bound
    /// ([`Provider::bucket_burst`]).
    pub late_allowance: Option<Duration>,
    /// Most calls in flight at the upstream at once, across every pod
    /// (`max_concurrent`); `None`: no cap. A slot is held from the grant to
    /// the end of the call, and frees itself [`SLOT_LEASE`] after its holder
    /// stopped renewing it (the process died).
    pub max_concurrent: Option<u32>,
    /// AIMD (`adaptive = true`): each refusal that pauses the bucket also
    /// halves the rate it refills at (at least 1% of `rate`), which then
    /// grows back by `rate / 10` per second up to `rate`.
    pub adaptive: bool,
    /// The entry of `limits` that `rate` and `burst` come from, when the
    /// provider sets no `rate` and `burst` of its own (its first request
    /// limit): the bucket then holds `burst` and refills at `rate` so that
    /// the upstream sees at most its `amount` in any `per`.
    pub rate_limit: Option<ProviderLimit>,
    /// Its other `limits`: buckets of their own, each taken from by the same
    /// grant as the request bucket (one request, or the call's weight), in
    /// one atomic step.
    pub limits: Vec<ProviderLimit>,
    /// Where an answer reports the tokens a call used (`usage`, a JSON
    /// pointer; operations may set their own): the difference from its
    /// weight goes back to (or is taken from) the token limits.
    pub usage: Option<String>,
}

/// What one of a provider's `limits` counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// Calls (`{ rate = N, per = "1m" }`): each grant takes one.
    Requests,
    /// Tokens of weight (`{ tokens = N, per = "1m" }`): each grant takes its
    /// call's weight (the operation's `weight`).
    Tokens,
}

/// One of a provider's `limits`: at most `amount` calls (or tokens of weight)
/// reach the upstream in any window of `per`. A bucket of `burst` refilled at
/// `rate` per second, `rate` chosen so that `burst + rate * (per + d)` is
/// `amount`, where `d` is how late a grant may be used (its provider's
/// `late_allowance`, or one token's time of its request bucket).
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderLimit {
    pub kind: LimitKind,
    pub amount: u64,
    pub per: Duration,
    /// The bucket's capacity (`burst`, default a tenth of `amount`, at least
    /// 1): the most one burst takes, and for tokens the heaviest call.
    pub burst: u64,
    /// Refill per second.
    pub rate: f64,
}

impl ProviderLimit {
    /// `requests/1m`, `tokens/1m`: the limit's name in metrics and errors.
    pub fn name(&self) -> String {
        let kind = match self.kind {
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
        };
        format!("{kind}/{}", duration::format(self.per))
    }

    pub fn per_ms(&self) -> u64 {
        u64::try_from(self.per.as_millis()).unwrap_or(u64::MAX)
    }

    /// What a grant of a call of `weight` takes from this limit.
    pub fn take(&self, weight: u64) -> u64 {
        match self.kind {
            LimitKind::Requests => 1,
            LimitKind::Tokens => weight,
        }
    }
}

/// Most `limits` one provider may set.
pub const MAX_PROVIDER_LIMITS: usize = 8;

/// How long a slot of a provider's `max_concurrent` outlives its holder's
/// last renewal (renewed every third of it while the call runs).
pub const SLOT_LEASE: Duration = Duration::from_secs(3);

impl Provider {
    /// The capacity the bucket grants from: `burst`, less `rate * d - 1`
    /// when grants stay usable for `d = late_allowance` longer than one
    /// token's time. Calls reach the upstream at most `d` after their grant,
    /// so over any `t` it sees at most the grants of `t + d`:
    /// `burst - (rate * d - 1) + rate * (t + d) = burst + rate * t + 1`, the
    /// bound a grant used within 1/rate keeps. At least 1 (the parser
    /// refuses an allowance that would leave less).
    pub fn bucket_burst(&self) -> f64 {
        if self.rate_limit.is_some() {
            // Its rate already leaves room for the lateness.
            return self.burst as f64;
        }
        let carved = self
            .late_allowance
            .map_or(0.0, |d| (self.rate * d.as_secs_f64() - 1.0).max(0.0));
        (self.burst as f64 - carved).max(1.0)
    }
}

impl Provider {
    /// The heaviest call a grant can ever be made for: the smallest capacity
    /// of its token limits (`None`: it has none, weight counts nothing).
    pub fn max_weight(&self) -> Option<u64> {
        self.limits
            .iter()
            .filter(|l| l.kind == LimitKind::Tokens)
            .map(|l| l.burst)
            .min()
    }

    /// The bucket that `rate` and `burst` describe, named as in metrics:
    /// `rate` for the simple form, else its `limits` entry's name.
    pub fn rate_name(&self) -> String {
        self.rate_limit
            .as_ref()
            .map_or_else(|| "rate".to_owned(), ProviderLimit::name)
    }

    /// The most a grant may be used late by: `late_allowance`, or one
    /// token's time of the request bucket (never below 2 ms, the throttle's
    /// `MIN_LATE_GRANT`). What the `limits` leave room for.
    pub fn late_most(&self) -> Duration {
        self.late_allowance
            .unwrap_or_else(|| Duration::from_secs_f64((1.0 / self.rate).min(3600.0)))
            .max(Duration::from_millis(2))
    }
}

/// How much of a provider's token limits one call weighs (an operation's
/// `weight`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Weight {
    /// `weight = 500`: every call weighs this.
    Fixed(u64),
    /// `weight = { from = "/max_tokens", default = 1000 }`: a number in the
    /// call's input at `from` (a JSON pointer; a fraction counts up, a value
    /// past [`MAX_TOKENS`] as that), or `default` when there is none there,
    /// it is not a number or it is negative.
    From { from: String, default: u64 },
}

impl Weight {
    /// The weight of a call whose input is `input`: at least 1.
    pub fn of(&self, input: &serde_json::Value) -> u64 {
        let (from, default) = match self {
            Self::Fixed(n) => return (*n).max(1),
            Self::From { from, default } => (from, *default),
        };
        let Some(v) = input.pointer(from) else {
            return default;
        };
        let n = match (v.as_u64(), v.as_f64()) {
            (Some(n), _) => n,
            (None, Some(f)) if f.is_finite() && f >= 0.0 => f.ceil().min(MAX_TOKENS as f64) as u64,
            _ => return default,
        };
        n.clamp(1, MAX_TOKENS)
    }
}

/// The tokens an answer reports at `pointer` (a provider's or an
/// operation's `usage`): a whole number of at least 0 (a fraction counts
/// up); `None` when there is none there, or it is negative or not a number.
pub fn reported_usage(pointer: &str, answer: &serde_json::Value) -> Option<u64> {
    let v = answer.pointer(pointer)?;
    match (v.as_u64(), v.as_f64()) {
        (Some(n), _) => Some(n.min(MAX_TOKENS)),
        (None, Some(f)) if f.is_finite() && f >= 0.0 => {
            Some(f.ceil().min(MAX_TOKENS as f64) as u64)
        }
        _ => None,
    }
}

/// Default `max_pause` of a provider.
pub const DEFAULT_MAX_PAUSE: Duration = Duration::from_secs(60);
/// The first back-off of a provider refused without a `Retry-After`; it
/// doubles for each refusal in a row, up to `max_pause`.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// Where a provider's calls go. Without one, workers use the built-in
/// in-process mock provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `http://host[:port][/base]`: jobs' input JSON is POSTed here (plus the
    /// operation's `path`).
    pub url: String,
    /// Header that carries the credential, e.g. `Authorization`.
    pub auth_header: Option<String>,
    /// Environment variable holding the header's value (read when the worker
    /// starts; never stored in the config).
    pub auth_env: Option<String>,
    /// Static headers sent with every call (`headers = { "anthropic-version"
    /// = "2023-06-01" }`).
    pub headers: BTreeMap<String, String>,
    /// Secret headers: header name -> the environment variable holding its
    /// value (read when the worker starts, which refuses to start without it;
    /// never logged), e.g. `secret_headers = { "x-api-key" = "ANTHROPIC_API_KEY" }`.
    pub secret_headers: BTreeMap<String, String>,
    /// Bounds one HTTP call.
    pub timeout: Duration,
    /// Retries after a 429 or 5xx (each after the upstream's `Retry-After`, or
    /// an exponential backoff, and a new throttle grant).
    pub retries: u32,
}

/// Default `timeout` of an upstream call.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `retries` of an upstream.
pub const DEFAULT_RETRIES: u32 = 2;
/// Default `deadline` of an operation's jobs.
pub const DEFAULT_JOB_DEADLINE: Duration = Duration::from_secs(300);
/// Default `hold_grace` (see [`Config::hold_grace`]).
pub const DEFAULT_HOLD_GRACE: Duration = Duration::from_secs(60);
/// Default `max_attempts` of an operation's jobs.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// A kind of job: what it costs, which provider runs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub name: String,
    /// Tokens reserved from the user's budget per job, >= 1.
    pub cost: u64,
    /// A configured provider.
    pub provider: String,
    /// Appended to the provider's `url` (e.g. `/v1/structured`).
    pub path: Option<String>,
    /// A job not finished this long after it was queued fails as expired.
    pub deadline: Duration,
    /// Times a job is taken before it is given up (workers died running it).
    pub max_attempts: u32,
    /// Settle the charge to what the provider reported (`None`: `cost` stays).
    pub settle: Option<Settle>,
    /// A call sent and not answered (a timeout after the write, a reply cut
    /// midway) may be sent again within the provider's `retries`: the
    /// operation is safe to repeat (idempotent upstream). Default false: the
    /// upstream may have done the work, so the job fails with its charge kept.
    pub retry_unanswered: bool,
    /// How long a finished job (its result or error) stays readable
    /// (`result_ttl`, default [`DEFAULT_RESULT_TTL`]).
    pub result_ttl: Duration,
    /// When the upstream rejects a call's input (400, 413, 414, 415, 422), the
    /// client gets the upstream's body (`upstream_body`, at most 1 KiB). Default
    /// false: only the status, since the body may say more than the end user
    /// should read (the operator's account, the upstream's internals).
    pub expose_upstream_errors: bool,
    /// How the input goes upstream (`method`, `body`): a JSON POST by default.
    pub request: RequestShape,
    /// What one call weighs in its provider's token limits (`weight`); set
    /// exactly when the provider has one.
    pub weight: Option<Weight>,
    /// How a streamed call's usage is had (`stream_usage`).
    pub stream_usage: StreamUsage,
    /// Where its answers report the tokens a call used: its own `usage`, or
    /// its provider's.
    pub usage: Option<String>,
}

/// How a streamed call's usage is had from its upstream (`stream_usage`): a
/// stream is charged what it used only when its usage is seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamUsage {
    /// `"ask"`: the upstream reports usage only when asked (OpenAI's chat and
    /// completions APIs: `stream_options.include_usage`): the worker asks on
    /// the client's behalf, and a client that did not ask is relayed the
    /// stream it would have had (no usage chunk, no `"usage": null`). The
    /// default of an operation whose `path` ends in `/chat/completions` or
    /// `/completions`.
    Ask,
    /// `"reported"`: the upstream reports usage unasked (Anthropic's
    /// `message_start`/`message_delta`, OpenAI's Responses API): the request
    /// goes as sent. The default of every other operation.
    #[default]
    Reported,
}

impl StreamUsage {
    /// The default for an operation at `path`.
    pub fn for_path(path: Option<&str>) -> Self {
        match path {
            Some(p) if p.ends_with("/chat/completions") || p.ends_with("/completions") => Self::Ask,
            _ => Self::Reported,
        }
    }
}

/// How an operation's input (a JSON object) is sent to its upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RequestShape {
    /// `POST` with the input as a JSON body (the default).
    #[default]
    Json,
    /// `POST` with the input's members as an `application/x-www-form-urlencoded`
    /// body (`body = "form"`).
    Form,
    /// `GET` with no body, the input's members as the query string
    /// (`method = "GET"`).
    Query,
}

/// Default `result_ttl` of an operation's finished jobs: long enough for an
/// async caller's polls and for a retry with the same Idempotency-Key after a
/// lost answer; a sync call answered without a key keeps nothing.
pub const DEFAULT_RESULT_TTL: Duration = Duration::from_secs(15 * 60);

/// How a job's charge is settled to its actual cost: read a number at `from`
/// (a JSON pointer, RFC 6901) in the provider's answer; the cost is
/// `ceil(value / per)` tokens, clamped to `1..=max`. `cost` is the estimate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settle {
    pub from: String,
    pub per: u64,
    pub max: u64,
    /// What the submission reserves up front.
    pub reserve: SettleReserve,
}

/// What an operation with `settle` reserves up front (`settle.reserve`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleReserve {
    /// `max` (the default): authorise the most, settle down to the actual; a
    /// window never passes its limit.
    Max,
    /// `cost` (the estimate), settled up or down: cheaper to admit, but
    /// concurrent jobs can take a window past its limit by up to
    /// `concurrency × (max − cost)`.
    Estimate,
}

impl Settle {
    /// The actual cost of a job that answered `answer`; `None` when the answer
    /// has no number at `from` (the call is then charged the most: [`crate::job::settle`]).
    pub fn cost(&self, answer: &serde_json::Value) -> Option<u64> {
        let v = answer.pointer(&self.from)?;
        let units = match (v.as_u64(), v.as_f64()) {
            (Some(n), _) => n.div_ceil(self.per),
            (None, Some(f)) if f.is_finite() => {
                // Negative and fractional amounts: a call costs at least 1.
                (f.max(0.0) / self.per as f64).ceil().min(MAX_TOKENS as f64) as u64
            }
            _ => return None,
        };
        Some(units.clamp(1, self.max))
    }
}

impl Operation {
    /// The tokens a job of this operation is charged up front: `settle.max`
    /// when it settles down from the most (`reserve = "max"`), else `cost`.
    pub fn charged_cost(&self) -> u64 {
        match &self.settle {
            Some(s) if s.reserve == SettleReserve::Max => s.max.max(self.cost),
            _ => self.cost,
        }
    }

    /// Whether a settle may raise the charge above what was charged up front
    /// (`reserve = "estimate"`); with `max` it only ever settles down.
    pub fn settle_may_raise(&self) -> bool {
        self.settle
            .as_ref()
            .is_some_and(|s| s.reserve == SettleReserve::Estimate)
    }

    pub fn deadline_ms(&self) -> u64 {
        u64::try_from(self.deadline.as_millis()).unwrap_or(u64::MAX)
    }
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    default_plan: String,
    hold_grace: Duration,
    export: Option<u64>,
    alerts: Option<Alerts>,
    plans: BTreeMap<String, Plan>,
    providers: BTreeMap<String, Provider>,
    upstreams: BTreeMap<String, Upstream>,
    operations: BTreeMap<String, Operation>,
}

/// Why a config could not be loaded. Messages name the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("config {origin}: {key}: {message}")]
    Invalid {
        origin: String,
        key: String,
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    default_plan: Option<String>,
    hold_grace: Option<String>,
    export: Option<RawExport>,
    alerts: Option<RawAlerts>,
    #[serde(default)]
    plans: BTreeMap<String, RawPlan>,
    #[serde(default)]
    providers: BTreeMap<String, RawProvider>,
    #[serde(default)]
    operations: BTreeMap<String, RawOperation>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExport {
    maxlen: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAlerts {
    url: String,
    secret_env: String,
    timeout: Option<String>,
    keep: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    rate: Option<f64>,
    burst: Option<i64>,
    limits: Option<Vec<RawProviderLimit>>,
    usage: Option<String>,
    max_wait: String,
    url: Option<String>,
    auth_header: Option<String>,
    auth_env: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    secret_headers: Option<BTreeMap<String, String>>,
    timeout: Option<String>,
    retries: Option<i64>,
    fairness: Option<String>,
    max_pause: Option<String>,
    late_allowance: Option<String>,
    max_concurrent: Option<i64>,
    adaptive: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProviderLimit {
    rate: Option<i64>,
    tokens: Option<i64>,
    per: String,
    burst: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOperation {
    weight: Option<toml::Value>,
    usage: Option<String>,
    cost: i64,
    provider: String,
    path: Option<String>,
    deadline: Option<String>,
    max_attempts: Option<i64>,
    settle: Option<RawSettle>,
    retry_unanswered: Option<bool>,
    result_ttl: Option<String>,
    expose_upstream_errors: Option<bool>,
    method: Option<String>,
    body: Option<String>,
    stream_usage: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSettle {
    from: String,
    per: Option<i64>,
    max: i64,
    reserve: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    limit: Option<i64>,
    window: Option<String>,
    limits: Option<Vec<RawLimit>>,
    share: Option<i64>,
    max_in_flight: Option<i64>,
    max_stored_bytes: Option<i64>,
    max_open_streams: Option<i64>,
    alerts: Option<Vec<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    limit: i64,
    window: String,
}

impl Config {
    /// The built-in config (`default.toml` in this crate).
    pub fn builtin() -> Self {
        Self::parse(BUILTIN, "<built-in>").expect("the built-in config is valid")
    }

    /// Reads `path`, or returns the built-in config when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::builtin());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates a TOML document; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let invalid = |key: String, message: String| ConfigError::Invalid {
            origin: origin.to_owned(),
            key,
            message,
        };

        let mut plans = BTreeMap::new();
        for (name, p) in raw.plans {
            let key = format!("plans.{name}");
            if let Err(e) = crate::id::UserId::new(name.as_str()) {
                return Err(invalid(key, format!("bad plan name: {e}")));
            }
            let raw_limits =
                match (p.limit, p.window, p.limits) {
                    (Some(limit), Some(window), None) => vec![RawLimit { limit, window }],
                    (None, None, Some(limits)) => limits,
                    _ => return Err(invalid(
                        key,
                        "set either `limit` and `window`, or `limits = [{ limit, window }, ...]`"
                            .into(),
                    )),
                };
            let limits = parse_limits(&key, raw_limits, &invalid)?;
            let share = p.share.unwrap_or(1);
            if !(1..=i64::from(MAX_SHARE)).contains(&share) {
                return Err(invalid(
                    format!("{key}.share"),
                    format!("must be between 1 and {MAX_SHARE}, got {share}"),
                ));
            }
            let max_in_flight = match p.max_in_flight {
                None => None,
                Some(n) if (1..=i64::from(MAX_IN_FLIGHT)).contains(&n) => Some(n as u32),
                Some(n) => {
                    return Err(invalid(
                        format!("{key}.max_in_flight"),
                        format!("must be between 1 and {MAX_IN_FLIGHT}, got {n}"),
                    ))
                }
            };
            let max_stored_bytes = match p.max_stored_bytes {
                None => DEFAULT_MAX_STORED_BYTES,
                Some(n) if (1024..=MAX_STORED_BYTES as i64).contains(&n) => n as u64,
                Some(n) => {
                    return Err(invalid(
                        format!("{key}.max_stored_bytes"),
                        format!("must be between 1024 and {MAX_STORED_BYTES}, got {n}"),
                    ))
                }
            };
            let max_open_streams = match p.max_open_streams {
                None => DEFAULT_MAX_OPEN_STREAMS,
                Some(n) if (1..=i64::from(MAX_OPEN_STREAMS)).contains(&n) => n as u32,
                Some(n) => {
                    return Err(invalid(
                        format!("{key}.max_open_streams"),
                        format!("must be between 1 and {MAX_OPEN_STREAMS}, got {n}"),
                    ))
                }
            };
            let alerts = parse_thresholds(&key, p.alerts.unwrap_or_default(), &invalid)?;
            plans.insert(
                name.clone(),
                Plan {
                    name,
                    limits,
                    share: share as u32,
                    max_in_flight,
                    max_stored_bytes,
                    max_open_streams,
                    alerts,
                },
            );
        }
        if plans.is_empty() {
            return Err(invalid(
                "plans".into(),
                "at least one plan is required".into(),
            ));
        }
        let default_plan = match raw.default_plan {
            Some(name) => name,
            None if plans.len() == 1 => plans.keys().next().cloned().unwrap_or_default(),
            None => {
                return Err(invalid(
                    "default_plan".into(),
                    "is required when several plans are defined".into(),
                ))
            }
        };
        if !plans.contains_key(&default_plan) {
            let known = plans.keys().cloned().collect::<Vec<_>>().join(", ");
            return Err(invalid(
                "default_plan".into(),
                format!("{default_plan:?} is not a plan (plans: {known})"),
            ));
        }
        let hold_grace = match &raw.hold_grace {
            Some(d) => duration::parse(d).map_err(|m| invalid("hold_grace".into(), m))?,
            None => DEFAULT_HOLD_GRACE,
        };
        if hold_grace < Duration::from_millis(100) || hold_grace > Duration::from_secs(3600) {
            return Err(invalid(
                "hold_grace".into(),
                "must be between 100ms and 1h".into(),
            ));
        }
        let export = match raw.export {
            None => None,
            Some(e) if (1..=MAX_EXPORT as i64).contains(&e.maxlen) => Some(e.maxlen as u64),
            Some(e) => {
                return Err(invalid(
                    "export.maxlen".into(),
                    format!("must be between 1 and {MAX_EXPORT}, got {}", e.maxlen),
                ))
            }
        };
        let alerts = match raw.alerts {
            None => None,
            Some(a) => Some(parse_alerts(a, &invalid)?),
        };
        let (providers, upstreams) = parse_providers(raw.providers, &invalid)?;
        let operations = parse_operations(raw.operations, &providers, &invalid)?;
        Ok(Self {
            default_plan,
            hold_grace,
            export,
            alerts,
            plans,
            providers,
            upstreams,
            operations,
        })
    }

    /// How long past its job's deadline a job's charge stays held for the job
    /// (`hold_grace`, default 60 s): then the ledger releases a charge no job
    /// claimed. A job past its deadline never starts, so this only has to cover
    /// a worker's pause between leasing a job and claiming its charge. Every
    /// pod must read the same value.
    pub fn hold_grace(&self) -> Duration {
        self.hold_grace
    }

    /// `[export] maxlen`: every spend, refund and settle is also appended to the
    /// user's export stream, kept to about this many entries (`None`: no export).
    pub fn export_maxlen(&self) -> Option<u64> {
        self.export
    }

    /// `[alerts]`: where usage alerts go (`None`: no alert is ever queued,
    /// whatever the plans' `alerts` say).
    pub fn alerts(&self) -> Option<&Alerts> {
        self.alerts.as_ref()
    }

    /// The thresholds (basis points) of `plan` that queue alerts: its
    /// `alerts`, or none without `[alerts]`.
    pub fn alert_thresholds<'a>(&self, plan: &'a Plan) -> &'a [u32] {
        if self.alerts.is_some() {
            &plan.alerts
        } else {
            &[]
        }
    }

    /// The plan of users who have none stored.
    pub fn default_plan(&self) -> &Plan {
        &self.plans[&self.default_plan]
    }

    pub fn plan(&self, name: &str) -> Option<&Plan> {
        self.plans.get(name)
    }

    /// The plan called `name`, or the default plan when `name` is unknown (a plan
    /// removed from the config after it was assigned to a user).
    pub fn plan_or_default(&self, name: Option<&str>) -> &Plan {
        name.and_then(|n| self.plans.get(n))
            .unwrap_or_else(|| self.default_plan())
    }

    pub fn plans(&self) -> impl Iterator<Item = &Plan> {
        self.plans.values()
    }

    /// How long a user's log keeps a spend event: the longest window of any
    /// plan, so that a plan change never erases spend a plan could count.
    pub fn retention_ms(&self) -> u64 {
        self.plans().map(Plan::window_ms).max().unwrap_or(0)
    }

    /// Validates a user's own limits (an admin's override of its plan's,
    /// `PUT /admin/users/{user}/limits`) as a `[plans.X] limits` list: 1 to
    /// [`MAX_LIMITS`] limits, each `limit` 1 to [`MAX_TOKENS`], windows
    /// distinct; and no window longer than the retention
    /// ([`retention_ms`](Self::retention_ms)): the log keeps no event longer,
    /// so such a window could never count what it claims to. Returns them
    /// longest window first; the error is `limits[i].<field>: why`.
    pub fn override_limits(&self, raw: Vec<(i64, String)>) -> Result<Vec<Limit>, String> {
        let invalid = |key: String, message: String| ConfigError::Invalid {
            origin: String::new(),
            key,
            message,
        };
        // Errors name a window as it was written: keep that short.
        if let Some(i) = raw.iter().position(|(_, w)| w.len() > 32) {
            return Err(format!(
                "limits[{i}].window: not a duration (at most 32 characters, e.g. 90s, 15m, 1h, 7d)"
            ));
        }
        let raw = raw
            .into_iter()
            .map(|(limit, window)| RawLimit { limit, window })
            .collect::<Vec<_>>();
        let single = raw.len() == 1;
        // parse_limits names its keys after a plan's (`<plan>.limits[i].limit`,
        // `<plan>.limit` for a single one): here they are the body's.
        let limits = parse_limits("", raw, &invalid).map_err(|e| match e {
            ConfigError::Invalid { key, message, .. } => {
                let key = key.trim_start_matches('.');
                if single && !key.starts_with("limits") {
                    format!("limits[0].{key}: {message}")
                } else {
                    format!("{key}: {message}")
                }
            }
            other => other.to_string(),
        })?;
        let retention = self.retention_ms();
        if let Some(l) = limits.iter().find(|l| l.window_ms() > retention) {
            return Err(format!(
                "limits: window {} is longer than the retention, {} (the longest window of any configured plan): the log keeps no event longer, so that window could not count its spend",
                duration::format(l.window),
                duration::format(Duration::from_millis(retention)),
            ));
        }
        Ok(limits)
    }

    /// The provider called `name`, if configured.
    pub fn provider(&self, name: &str) -> Option<&Provider> {
        self.providers.get(name)
    }

    /// Every configured provider, by name.
    pub fn providers(&self) -> impl Iterator<Item = &Provider> {
        self.providers.values()
    }

    /// The HTTP upstream of provider `name`; `None`: the built-in mock.
    pub fn upstream(&self, name: &str) -> Option<&Upstream> {
        self.upstreams.get(name)
    }

    /// Sends every provider's calls to `url` (`tollgate all --provider-url`): an
    /// upstream the config has keeps its auth, timeout and retries; a provider
    /// without one gets the defaults.
    pub fn route_all_providers_to(&mut self, url: &str) -> Result<(), ConfigError> {
        let ok = http_url_with_host(url);
        if !ok {
            return Err(ConfigError::Invalid {
                origin: "--provider-url".into(),
                key: "url".into(),
                message: format!("must be an http:// or https:// URL with a host, got {url:?}"),
            });
        }
        let url = url.trim_end_matches('/').to_owned();
        for name in self.providers.keys() {
            self.upstreams
                .entry(name.clone())
                .and_modify(|u| u.url.clone_from(&url))
                .or_insert_with(|| Upstream {
                    url: url.clone(),
                    auth_header: None,
                    auth_env: None,
                    headers: BTreeMap::new(),
                    secret_headers: BTreeMap::new(),
                    timeout: DEFAULT_UPSTREAM_TIMEOUT,
                    retries: DEFAULT_RETRIES,
                });
        }
        Ok(())
    }

    /// The operation called `name`, if configured.
    pub fn operation(&self, name: &str) -> Option<&Operation> {
        self.operations.get(name)
    }

    /// The operation a pass-through call of `provider` at `path` runs: the
    /// provider's operation whose `path` is `path` (a trailing `/` aside; the
    /// first by name when several share it).
    pub fn passthrough(&self, provider: &str, path: &str) -> Option<&Operation> {
        let path = path.trim_end_matches('/');
        self.operations.values().find(|o| {
            o.provider == provider
                && o.path
                    .as_deref()
                    .is_some_and(|p| p.trim_end_matches('/') == path)
        })
    }

    /// Every configured operation, by name.
    pub fn operations(&self) -> impl Iterator<Item = &Operation> {
        self.operations.values()
    }
}

/// A plan's `alerts`: fractions of each limit in (0, 1] with at most 4
/// decimals, distinct; returned in basis points, ascending.
fn parse_thresholds(
    key: &str,
    raw: Vec<f64>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<u32>, ConfigError> {
    let key = format!("{key}.alerts");
    if raw.len() > MAX_ALERT_THRESHOLDS {
        return Err(invalid(
            key,
            format!(
                "at most {MAX_ALERT_THRESHOLDS} thresholds, got {}",
                raw.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(raw.len());
    for t in raw {
        if !(t.is_finite() && t > 0.0 && t <= 1.0) {
            return Err(invalid(
                key,
                format!("each threshold must be a fraction of the limit in (0, 1], got {t}"),
            ));
        }
        let bp = (t * 10_000.0).round();
        if (bp - t * 10_000.0).abs() > 1e-6 || bp < 1.0 {
            return Err(invalid(
                key,
                format!("thresholds have at most 4 decimals (0.0001 steps), got {t}"),
            ));
        }
        let bp = bp as u32;
        if out.contains(&bp) {
            return Err(invalid(key, format!("{t} is listed twice")));
        }
        out.push(bp);
    }
    out.sort_unstable();
    Ok(out)
}

fn parse_alerts(
    raw: RawAlerts,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Alerts, ConfigError> {
    let url = raw.url.trim().to_owned();
    let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
    if !scheme_ok || url.len() > 2048 || url.chars().any(char::is_whitespace) {
        return Err(invalid(
            "alerts.url".into(),
            format!("must be an http:// or https:// URL, got {url:?}"),
        ));
    }
    let env_ok = !raw.secret_env.is_empty()
        && raw.secret_env.len() <= 128
        && raw
            .secret_env
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !env_ok {
        return Err(invalid(
            "alerts.secret_env".into(),
            format!(
                "must name an environment variable (ASCII letters, digits, _), got {:?}",
                raw.secret_env
            ),
        ));
    }
    let timeout = match &raw.timeout {
        Some(d) => duration::parse(d).map_err(|m| invalid("alerts.timeout".into(), m))?,
        None => DEFAULT_ALERT_TIMEOUT,
    };
    if timeout < Duration::from_millis(100) || timeout > Duration::from_secs(300) {
        return Err(invalid(
            "alerts.timeout".into(),
            "must be between 100ms and 5m".into(),
        ));
    }
    let keep = match &raw.keep {
        Some(d) => duration::parse(d).map_err(|m| invalid("alerts.keep".into(), m))?,
        None => DEFAULT_ALERT_KEEP,
    };
    if keep < Duration::from_secs(1) || keep > MAX_ALERT_KEEP {
        return Err(invalid(
            "alerts.keep".into(),
            "must be between 1s and 7d".into(),
        ));
    }
    Ok(Alerts {
        url,
        secret_env: raw.secret_env,
        timeout,
        keep,
    })
}

fn parse_limits(
    key: &str,
    raw: Vec<RawLimit>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<Limit>, ConfigError> {
    if raw.is_empty() || raw.len() > MAX_LIMITS {
        return Err(invalid(
            format!("{key}.limits"),
            format!("must hold 1 to {MAX_LIMITS} limits, got {}", raw.len()),
        ));
    }
    let single = raw.len() == 1;
    let mut limits: Vec<Limit> = Vec::with_capacity(raw.len());
    for (i, l) in raw.into_iter().enumerate() {
        let key = if single {
            key.to_owned()
        } else {
            format!("{key}.limits[{i}]")
        };
        if l.limit <= 0 {
            return Err(invalid(
                format!("{key}.limit"),
                format!("must be > 0, got {}", l.limit),
            ));
        }
        let limit = l.limit as u64;
        if limit > MAX_TOKENS {
            return Err(invalid(
                format!("{key}.limit"),
                format!("must be <= {MAX_TOKENS}"),
            ));
        }
        let window = duration::parse(&l.window).map_err(|m| invalid(format!("{key}.window"), m))?;
        if window < Duration::from_millis(1) {
            return Err(invalid(
                format!("{key}.window"),
                "must be at least 1ms".into(),
            ));
        }
        if window > Duration::from_secs(366 * 86_400) {
            return Err(invalid(
                format!("{key}.window"),
                "must be at most 366d".into(),
            ));
        }
        // Milliseconds are what the ledger counts in: two windows equal there are one.
        let ms = Limit { limit, window }.window_ms();
        if limits.iter().any(|o| o.window_ms() == ms) {
            return Err(invalid(
                format!("{key}.window"),
                format!("{} is set twice in one plan", l.window),
            ));
        }
        limits.push(Limit { limit, window });
    }
    limits.sort_by_key(|l| std::cmp::Reverse(l.window));
    Ok(limits)
}

fn parse_operations(
    raw: BTreeMap<String, RawOperation>,
    providers: &BTreeMap<String, Provider>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<BTreeMap<String, Operation>, ConfigError> {
    let mut operations = BTreeMap::new();
    for (name, o) in raw {
        let key = format!("operations.{name}");
        // Operation names end up in Redis key names, like provider names.
        if let Err(e) = crate::id::UserId::new(name.as_str()) {
            return Err(invalid(key, format!("bad operation name: {e}")));
        }
        if o.cost < 1 || o.cost as u64 > MAX_TOKENS {
            return Err(invalid(
                format!("{key}.cost"),
                format!("must be between 1 and {MAX_TOKENS} tokens, got {}", o.cost),
            ));
        }
        if !providers.contains_key(&o.provider) {
            let known = providers.keys().cloned().collect::<Vec<_>>().join(", ");
            return Err(invalid(
                format!("{key}.provider"),
                format!("{:?} is not a provider (providers: {known})", o.provider),
            ));
        }
        if let Some(path) = &o.path {
            if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace()) {
                return Err(invalid(
                    format!("{key}.path"),
                    format!("must start with / and contain no whitespace, got {path:?}"),
                ));
            }
        }
        let deadline = match &o.deadline {
            Some(d) => duration::parse(d).map_err(|m| invalid(format!("{key}.deadline"), m))?,
            None => DEFAULT_JOB_DEADLINE,
        };
        if deadline < Duration::from_millis(100) || deadline > Duration::from_secs(7 * 86_400) {
            return Err(invalid(
                format!("{key}.deadline"),
                "must be between 100ms and 7d".into(),
            ));
        }
        let max_attempts = o.max_attempts.unwrap_or(i64::from(DEFAULT_MAX_ATTEMPTS));
        if !(1..=100).contains(&max_attempts) {
            return Err(invalid(
                format!("{key}.max_attempts"),
                format!("must be between 1 and 100, got {max_attempts}"),
            ));
        }
        let settle = match o.settle {
            None => None,
            Some(r) => Some(parse_settle(&format!("{key}.settle"), r, invalid)?),
        };
        let result_ttl = match &o.result_ttl {
            Some(d) => duration::parse(d).map_err(|m| invalid(format!("{key}.result_ttl"), m))?,
            None => DEFAULT_RESULT_TTL,
        };
        if result_ttl < Duration::from_millis(100) || result_ttl > Duration::from_secs(7 * 86_400) {
            return Err(invalid(
                format!("{key}.result_ttl"),
                "must be between 100ms and 7d".into(),
            ));
        }
        let request = match (o.method.as_deref(), o.body.as_deref()) {
            (None | Some("POST"), None | Some("json")) => RequestShape::Json,
            (None | Some("POST"), Some("form")) => RequestShape::Form,
            (Some("GET"), None) => RequestShape::Query,
            (Some("GET"), Some(_)) => {
                return Err(invalid(
                    format!("{key}.body"),
                    "a GET sends no body: its input goes in the query string".into(),
                ))
            }
            (None | Some("POST"), Some(b)) => {
                return Err(invalid(
                    format!("{key}.body"),
                    format!("must be \"json\" or \"form\", got {b:?}"),
                ))
            }
            (Some(m), _) => {
                return Err(invalid(
                    format!("{key}.method"),
                    format!("must be \"POST\" or \"GET\", got {m:?}"),
                ))
            }
        };
        let stream_usage = match o.stream_usage.as_deref() {
            None => StreamUsage::for_path(o.path.as_deref()),
            Some("ask") => StreamUsage::Ask,
            Some("reported") => StreamUsage::Reported,
            Some(other) => {
                return Err(invalid(
                    format!("{key}.stream_usage"),
                    format!("must be \"ask\" or \"reported\", got {other:?}"),
                ))
            }
        };
        let provider = &providers[&o.provider];
        let weighed = provider.max_weight().is_some();
        let weight = match (&o.weight, weighed) {
            (Some(w), true) => Some(parse_weight(
                &format!("{key}.weight"),
                w,
                provider,
                invalid,
            )?),
            (None, false) => None,
            (Some(_), false) => {
                return Err(invalid(
                    format!("{key}.weight"),
                    format!(
                        "provider {} has no token limit to weigh calls against",
                        o.provider
                    ),
                ))
            }
            (None, true) => {
                return Err(invalid(
                    format!("{key}.weight"),
                    format!(
                        "is required: provider {} has a token limit (`weight = 500`, or \
                         `weight = {{ from = \"/max_tokens\", default = 1000 }}`)",
                        o.provider
                    ),
                ))
            }
        };
        let usage = match o.usage {
            Some(u) => Some(usage_pointer(
                &format!("{key}.usage"),
                u,
                &provider.limits,
                invalid,
            )?),
            None => provider.usage.clone(),
        };
        operations.insert(
            name.clone(),
            Operation {
                weight,
                usage,
                name,
                cost: o.cost as u64,
                provider: o.provider,
                path: o.path,
                deadline,
                max_attempts: max_attempts as u32,
                settle,
                retry_unanswered: o.retry_unanswered.unwrap_or(false),
                result_ttl,
                expose_upstream_errors: o.expose_upstream_errors.unwrap_or(false),
                request,
                stream_usage,
            },
        );
    }
    Ok(operations)
}

fn parse_settle(
    key: &str,
    r: RawSettle,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Settle, ConfigError> {
    if !(r.from.is_empty() || r.from.starts_with('/')) {
        return Err(invalid(
            format!("{key}.from"),
            format!(
                "must be a JSON pointer (\"\" or starting with /), got {:?}",
                r.from
            ),
        ));
    }
    let per = r.per.unwrap_or(1);
    if per < 1 || per as u64 > MAX_TOKENS {
        return Err(invalid(
            format!("{key}.per"),
            format!("must be between 1 and {MAX_TOKENS}, got {per}"),
        ));
    }
    if r.max < 1 || r.max as u64 > MAX_TOKENS {
        return Err(invalid(
            format!("{key}.max"),
            format!("must be between 1 and {MAX_TOKENS} tokens, got {}", r.max),
        ));
    }
    let reserve = match r.reserve.as_deref() {
        None | Some("max") => SettleReserve::Max,
        Some("estimate") => SettleReserve::Estimate,
        Some(other) => {
            return Err(invalid(
                format!("{key}.reserve"),
                format!("must be \"max\" or \"estimate\", got {other:?}"),
            ))
        }
    };
    Ok(Settle {
        from: r.from,
        per: per as u64,
        max: r.max as u64,
        reserve,
    })
}

/// `http://` or `https://`, then a host (a name, an IPv4 address or a
/// bracketed IPv6 one), an optional numeric port, and no blank anywhere:
/// `http://`, `http://:80` and `http:///x` have no host.
pub fn http_url_with_host(url: &str) -> bool {
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return false;
    };
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = if let Some(v6) = host_port.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, p)) if !h.is_empty() => (h, p.strip_prefix(':')),
            _ => return false,
        }
    } else {
        match host_port.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        }
    };
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
    !host.is_empty() && port_ok
}
/// Headers of an upstream call that tollgate sets itself: no provider's
/// `headers` or `secret_headers` may name them.
pub const RESERVED_HEADERS: [&str; 7] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "idempotency-key",
    "traceparent",
    "content-type",
];

/// An HTTP header name (an RFC 9110 token).
fn header_name(h: &str) -> bool {
    !h.is_empty()
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c))
}

fn parse_upstream(
    key: &str,
    p: &RawProvider,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Option<Upstream>, ConfigError> {
    let Some(url) = &p.url else {
        for (field, set) in [
            ("auth_header", p.auth_header.is_some()),
            ("auth_env", p.auth_env.is_some()),
            ("headers", p.headers.is_some()),
            ("secret_headers", p.secret_headers.is_some()),
            ("timeout", p.timeout.is_some()),
            ("retries", p.retries.is_some()),
        ] {
            if set {
                return Err(invalid(
                    format!("{key}.{field}"),
                    "needs `url` (without url the built-in mock runs the calls)".into(),
                ));
            }
        }
        return Ok(None);
    };
    if !http_url_with_host(url) {
        return Err(invalid(
            format!("{key}.url"),
            format!("must be an http:// or https:// URL with a host, got {url:?}"),
        ));
    }
    if p.auth_header.is_some() != p.auth_env.is_some() {
        return Err(invalid(
            format!("{key}.auth_env"),
            "auth_header and auth_env go together (the header's value is read from the variable)"
                .into(),
        ));
    }
    if let Some(h) = &p.auth_header {
        if !header_name(h) {
            return Err(invalid(
                format!("{key}.auth_header"),
                format!("is not a valid header name: {h:?}"),
            ));
        }
    }
    let headers = p.headers.clone().unwrap_or_default();
    let secret_headers = p.secret_headers.clone().unwrap_or_default();
    let mut seen: Vec<String> = p
        .auth_header
        .iter()
        .map(|h| h.to_ascii_lowercase())
        .collect();
    for (field, map) in [("headers", &headers), ("secret_headers", &secret_headers)] {
        for (name, value) in map {
            let at = || format!("{key}.{field}.{name}");
            if !header_name(name) {
                return Err(invalid(at(), "is not a valid header name".into()));
            }
            let lower = name.to_ascii_lowercase();
            if RESERVED_HEADERS.contains(&lower.as_str()) {
                return Err(invalid(
                    at(),
                    format!(
                        "tollgate sets this header itself (reserved: {})",
                        RESERVED_HEADERS.join(", ")
                    ),
                ));
            }
            if seen.contains(&lower) {
                return Err(invalid(
                    at(),
                    "is set twice (headers, secret_headers and auth_header name each header once)"
                        .into(),
                ));
            }
            seen.push(lower);
            let ok = if field == "headers" {
                value
                    .bytes()
                    .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
            } else {
                !value.is_empty()
                    && !value.starts_with(|c: char| c.is_ascii_digit())
                    && value
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_')
            };
            if !ok {
                return Err(invalid(
                    at(),
                    if field == "headers" {
                        "must be visible ASCII (spaces and tabs allowed)".into()
                    } else {
                        format!(
                            "must name an environment variable (letters, digits, _), got {value:?}"
                        )
                    },
                ));
            }
        }
    }
    let timeout = match &p.timeout {
        Some(t) => duration::parse(t).map_err(|m| invalid(format!("{key}.timeout"), m))?,
        None => DEFAULT_UPSTREAM_TIMEOUT,
    };
    if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(600) {
        return Err(invalid(
            format!("{key}.timeout"),
            "must be between 1ms and 10m".into(),
        ));
    }
    let retries = p.retries.unwrap_or(i64::from(DEFAULT_RETRIES));
    if !(0..=10).contains(&retries) {
        return Err(invalid(
            format!("{key}.retries"),
            format!("must be between 0 and 10, got {retries}"),
        ));
    }
    Ok(Some(Upstream {
        url: url.trim_end_matches('/').to_owned(),
        auth_header: p.auth_header.clone(),
        auth_env: p.auth_env.clone(),
        headers,
        secret_headers,
        timeout,
        retries: retries as u32,
    }))
}

type Providers = (BTreeMap<String, Provider>, BTreeMap<String, Upstream>);

/// A `limits` entry as read: kind, amount, per, burst.
type RawLimitOf = (LimitKind, u64, Duration, u64);

fn parse_provider_limits(
    key: &str,
    raw: &[RawProviderLimit],
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<RawLimitOf>, ConfigError> {
    if raw.len() > MAX_PROVIDER_LIMITS {
        return Err(invalid(
            format!("{key}.limits"),
            format!(
                "must hold at most {MAX_PROVIDER_LIMITS} limits, got {}",
                raw.len()
            ),
        ));
    }
    let mut out: Vec<RawLimitOf> = Vec::with_capacity(raw.len());
    for (i, l) in raw.iter().enumerate() {
        let key = format!("{key}.limits[{i}]");
        let (kind, amount, field) = match (l.rate, l.tokens) {
            (Some(n), None) => (LimitKind::Requests, n, "rate"),
            (None, Some(n)) => (LimitKind::Tokens, n, "tokens"),
            _ => {
                return Err(invalid(
                    key,
                    "set either `rate` (calls) or `tokens` (weight), with `per`".into(),
                ))
            }
        };
        if amount < 2 || amount as u64 > MAX_TOKENS {
            return Err(invalid(
                format!("{key}.{field}"),
                format!("must be between 2 and {MAX_TOKENS}, got {amount}"),
            ));
        }
        let amount = amount as u64;
        let per = duration::parse(&l.per).map_err(|m| invalid(format!("{key}.per"), m))?;
        if per < Duration::from_millis(1) || per > Duration::from_secs(366 * 86_400) {
            return Err(invalid(
                format!("{key}.per"),
                "must be between 1ms and 366d".into(),
            ));
        }
        let burst = match l.burst {
            None => (amount / 10).max(1),
            Some(b) if b >= 1 && (b as u64) < amount => b as u64,
            Some(b) => {
                return Err(invalid(
                    format!("{key}.burst"),
                    format!(
                    "must be between 1 and {} (less than the limit: the rest is its rate), got {b}",
                    amount - 1
                ),
                ))
            }
        };
        let per_ms = per.as_millis();
        if out
            .iter()
            .any(|(k, _, p, _)| *k == kind && p.as_millis() == per_ms)
        {
            return Err(invalid(
                format!("{key}.per"),
                format!("a {field} limit per {} is set twice", l.per),
            ));
        }
        out.push((kind, amount, per, burst));
    }
    Ok(out)
}

/// A limit of `amount` per `per` from a bucket of `burst`, its grants used
/// at most `late` late: refilled at `(amount - burst) / (per + late)` per
/// second, the upstream sees at most `amount` in any `per`.
fn limit_of((kind, amount, per, burst): RawLimitOf, late: Duration) -> ProviderLimit {
    ProviderLimit {
        kind,
        amount,
        per,
        burst,
        rate: (amount - burst) as f64 / (per + late).as_secs_f64(),
    }
}

/// The provider's request bucket (`rate`, `burst`: the simple form, or its
/// first request limit) and its other limits, each with its rate.
fn request_bucket(
    key: &str,
    simple: Option<(f64, i64)>,
    mut raw: Vec<RawLimitOf>,
    late_allowance: Option<Duration>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<(f64, u64, Option<ProviderLimit>, Vec<ProviderLimit>), ConfigError> {
    let (rate, burst, rate_limit) = match simple {
        Some((rate, burst)) => {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(invalid(
                    format!("{key}.rate"),
                    format!("must be > 0 (tokens per second), got {rate}"),
                ));
            }
            if !(MIN_RATE..=MAX_RATE).contains(&rate) {
                return Err(invalid(
                    format!("{key}.rate"),
                    format!(
                        "must be between {MIN_RATE:.3e} (one call a day) and {MAX_RATE} tokens per second, got {rate:?}"
                    ),
                ));
            }
            if burst < 1 {
                return Err(invalid(
                    format!("{key}.burst"),
                    format!("must be >= 1 (the bucket capacity), got {burst}"),
                ));
            }
            let burst = burst as u64;
            if burst > MAX_BURST {
                return Err(invalid(
                    format!("{key}.burst"),
                    format!("must be <= {MAX_BURST}"),
                ));
            }
            if let Some(d) = late_allowance {
                // The bucket grants from burst - (rate * d - 1): it must keep one.
                let most = Duration::from_secs_f64(burst as f64 / rate);
                if d < Duration::from_millis(1) || d > most {
                    return Err(invalid(
                        format!("{key}.late_allowance"),
                        format!(
                            "must be between 1ms and burst / rate = {} (the bucket grants \
                             from burst - (rate * late_allowance - 1), at least 1)",
                            duration::format(most)
                        ),
                    ));
                }
            }
            (rate, burst, None)
        }
        None => {
            let Some(i) = raw.iter().position(|l| l.0 == LimitKind::Requests) else {
                return Err(invalid(
                    key.to_owned(),
                    "needs a request limit: `rate` and `burst`, or `{ rate = N, per = \"1m\" }` \
                     in `limits`"
                        .into(),
                ));
            };
            let first = raw.remove(i);
            let (_, amount, per, burst) = first;
            if let Some(d) = late_allowance {
                if d < Duration::from_millis(1) || d > per {
                    return Err(invalid(
                        format!("{key}.late_allowance"),
                        format!(
                            "must be between 1ms and the request limit's per ({})",
                            duration::format(per)
                        ),
                    ));
                }
            }
            // Used at most 1/rate late (or 2 ms, the least late bound): burst
            // + rate * per + 1 = amount, unless an allowance says longer.
            let mut limit = limit_of(first, late_allowance.unwrap_or(Duration::ZERO));
            if late_allowance.is_none() {
                limit.rate = (amount - burst).saturating_sub(1) as f64 / per.as_secs_f64();
                if limit.rate <= 0.0 || 1.0 / limit.rate < 0.002 {
                    limit = limit_of(first, Duration::from_millis(2));
                }
            }
            if !(MIN_RATE..=MAX_RATE).contains(&limit.rate) || burst > MAX_BURST {
                return Err(invalid(
                    format!("{key}.limits"),
                    format!(
                        "{}: {amount} per {} with a burst of {burst} refills at {:.3e} per second \
                         (must be between {MIN_RATE:.3e} and {MAX_RATE}, burst <= {MAX_BURST})",
                        limit.name(),
                        duration::format(per),
                        limit.rate
                    ),
                ));
            }
            (limit.rate, burst, Some(limit))
        }
    };
    let late = late_allowance
        .unwrap_or_else(|| Duration::from_secs_f64((1.0 / rate).min(3600.0)))
        .max(Duration::from_millis(2));
    let limits = raw.into_iter().map(|l| limit_of(l, late)).collect();
    Ok((rate, burst, rate_limit, limits))
}

/// A `usage` pointer, valid only where there is a token limit to adjust.
fn usage_pointer(
    key: &str,
    pointer: String,
    limits: &[ProviderLimit],
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<String, ConfigError> {
    if !pointer.starts_with('/') {
        return Err(invalid(
            key.to_owned(),
            format!("must be a JSON pointer starting with /, got {pointer:?}"),
        ));
    }
    if !limits.iter().any(|l| l.kind == LimitKind::Tokens) {
        return Err(invalid(
            key.to_owned(),
            "needs a token limit (`{ tokens = N, per = \"1m\" }` in the provider's `limits`)"
                .into(),
        ));
    }
    Ok(pointer)
}

/// An operation's `weight`: a whole number, or `{ from, default }`.
fn parse_weight(
    key: &str,
    raw: &toml::Value,
    provider: &Provider,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Weight, ConfigError> {
    let shape = || {
        invalid(
            key.to_owned(),
            "must be a whole number >= 1, or `{ from = \"/max_tokens\", default = 1000 }`".into(),
        )
    };
    let weight = match raw {
        toml::Value::Integer(n) if *n >= 1 => Weight::Fixed(*n as u64),
        toml::Value::Table(t) => {
            let from = t
                .get("from")
                .and_then(toml::Value::as_str)
                .ok_or_else(shape)?;
            let default = t
                .get("default")
                .and_then(toml::Value::as_integer)
                .filter(|n| *n >= 1)
                .ok_or_else(shape)?;
            if t.keys().any(|k| k != "from" && k != "default") || !from.starts_with('/') {
                return Err(shape());
            }
            Weight::From {
                from: from.to_owned(),
                default: default as u64,
            }
        }
        _ => return Err(shape()),
    };
    let most = provider.max_weight().unwrap_or(0);
    let (n, what) = match &weight {
        Weight::Fixed(n) => (*n, "weight"),
        Weight::From { default, .. } => (*default, "default"),
    };
    if n > most {
        return Err(invalid(
            key.to_owned(),
            format!(
                "{what} {n} is more than provider {}'s smallest token burst ({most}): \
                 such a call could never be granted",
                provider.name
            ),
        ));
    }
    Ok(weight)
}

fn parse_providers(
    raw: BTreeMap<String, RawProvider>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Providers, ConfigError> {
    let mut providers = BTreeMap::new();
    let mut upstreams = BTreeMap::new();
    for (name, p) in raw {
        let key = format!("providers.{name}");
        // Provider names end up in Redis key names: the id charset keeps them
        // from opening a hash tag or forging a key part.
        if let Err(e) = crate::id::UserId::new(name.as_str()) {
            return Err(invalid(key, format!("bad provider name: {e}")));
        }
        let raw_limits = parse_provider_limits(&key, p.limits.as_deref().unwrap_or(&[]), invalid)?;
        // The request bucket: `rate` and `burst`, or the first request limit.
        let simple = match (p.rate, p.burst) {
            (Some(rate), Some(burst)) => Some((rate, burst)),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    key,
                    "`rate` and `burst` go together (or set a request limit in `limits`)".into(),
                ))
            }
        };
        let max_wait =
            duration::parse(&p.max_wait).map_err(|m| invalid(format!("{key}.max_wait"), m))?;
        if max_wait < Duration::from_millis(1) || max_wait > MAX_WAIT_LIMIT {
            return Err(invalid(
                format!("{key}.max_wait"),
                "must be between 1ms and 1h".into(),
            ));
        }
        let fairness = match p.fairness.as_deref() {
            None | Some("fair") => Fairness::Fair,
            Some("fifo") => Fairness::Fifo,
            Some(other) => {
                return Err(invalid(
                    format!("{key}.fairness"),
                    format!("must be \"fair\" or \"fifo\", got {other:?}"),
                ))
            }
        };
        let max_pause = match &p.max_pause {
            None => DEFAULT_MAX_PAUSE,
            Some(text) => {
                let d =
                    duration::parse(text).map_err(|m| invalid(format!("{key}.max_pause"), m))?;
                if d < FIRST_BACKOFF || d > MAX_WAIT_LIMIT {
                    return Err(invalid(
                        format!("{key}.max_pause"),
                        format!(
                            "must be between {} (the first back-off) and 1h",
                            duration::format(FIRST_BACKOFF)
                        ),
                    ));
                }
                d
            }
        };
        let late_allowance = match &p.late_allowance {
            None => None,
            Some(text) => {
                let field = format!("{key}.late_allowance");
                Some(duration::parse(text).map_err(|m| invalid(field, m))?)
            }
        };
        let (rate, burst, rate_limit, limits) =
            request_bucket(&key, simple, raw_limits, late_allowance, invalid)?;
        let max_concurrent = match p.max_concurrent {
            None => None,
            Some(n) if (1..=i64::from(MAX_IN_FLIGHT)).contains(&n) => Some(n as u32),
            Some(n) => {
                return Err(invalid(
                    format!("{key}.max_concurrent"),
                    format!("must be between 1 and {MAX_IN_FLIGHT}, got {n}"),
                ))
            }
        };
        if let Some(upstream) = parse_upstream(&key, &p, invalid)? {
            upstreams.insert(name.clone(), upstream);
        }
        let usage = match p.usage {
            None => None,
            Some(u) => Some(usage_pointer(&format!("{key}.usage"), u, &limits, invalid)?),
        };
        providers.insert(
            name.clone(),
            Provider {
                name,
                rate,
                burst,
                max_wait,
                fairness,
                max_pause,
                late_allowance,
                max_concurrent,
                adaptive: p.adaptive.unwrap_or(false),
                rate_limit,
                limits,
                usage,
            },
        );
    }
    Ok((providers, upstreams))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ISSUE_SHAPE: &str = r#"
default_plan = "free"
[plans.free]
limit = 1000
window = "12h"
[plans.pro]
limit = 20000
window = "12h"
"#;

    fn err(text: &str) -> String {
        Config::parse(text, "t.toml").unwrap_err().to_string()
    }

    #[test]
    fn reads_the_documented_shape() {
        let c = Config::parse(ISSUE_SHAPE, "t.toml").unwrap();
        assert_eq!(c.default_plan().name, "free");
        assert_eq!(c.default_plan().max_cost(), 1000);
        assert_eq!(
            c.plan("pro").unwrap().limits,
            vec![Limit {
                limit: 20000,
                window: Duration::from_secs(12 * 3600)
            }]
        );
        assert_eq!(c.plan_or_default(Some("gone")).name, "free");
        // The built-in config has the same plans, plus providers.
        let builtin = Config::builtin();
        assert_eq!(
            builtin.plans().collect::<Vec<_>>(),
            c.plans().collect::<Vec<_>>()
        );
        assert!(builtin.provider("llm").is_some());
        assert_eq!(c.providers().count(), 0);
    }

    #[test]
    fn errors_name_the_key() {
        let e = err(&ISSUE_SHAPE.replace("default_plan = \"free\"", "default_plan = \"gold\""));
        assert!(e.contains("default_plan") && e.contains("gold"), "{e}");
        let e = err(&ISSUE_SHAPE.replace("limit = 1000", "limit = 0"));
        assert!(e.contains("plans.free.limit") && e.contains("> 0"), "{e}");
        let e = err(&ISSUE_SHAPE.replace("limit = 1000", "limit = -5"));
        assert!(e.contains("plans.free.limit"), "{e}");
        let e = err(&ISSUE_SHAPE.replace(
            "window = \"12h\"\n[plans.pro]",
            "window = \"soon\"\n[plans.pro]",
        ));
        assert!(e.contains("plans.free.window") && e.contains("soon"), "{e}");
        let e = err(&ISSUE_SHAPE.replace("limit = 20000", "limit = 20000\nlimmit = 3"));
        assert!(e.contains("limmit"), "{e}");
        let e = err("default_plan = \"x\"");
        assert!(e.contains("plans"), "{e}");
    }

    const WINDOWS: &str = r#"
[plans.free]
limits = [{ limit = 100, window = "1m" }, { limit = 1000, window = "12h" }, { limit = 5, window = "1s" }]
"#;

    #[test]
    fn reads_several_limits_longest_window_first() {
        let c = Config::parse(WINDOWS, "t.toml").unwrap();
        let p = c.default_plan();
        let shape: Vec<(u64, u64)> = p.limits.iter().map(|l| (l.limit, l.window_ms())).collect();
        assert_eq!(shape, vec![(1000, 43_200_000), (100, 60_000), (5, 1000)]);
        assert_eq!(p.window_ms(), 43_200_000);
        assert_eq!(p.max_cost(), 5);
        assert_eq!(
            p.describe(),
            "1000 tokens / 12h + 100 tokens / 1m + 5 tokens / 1s"
        );
    }

    #[test]
    fn limits_errors_name_the_key() {
        for (from, to, key) in [
            ("limit = 100,", "limit = 0,", "plans.free.limits[0].limit"),
            ("\"1s\"", "\"1m\"", "plans.free.limits[2].window"),
            (
                "window = \"12h\"",
                "window = \"later\"",
                "plans.free.limits[1].window",
            ),
            ("limits = [", "limit = 3\nlimits = [", "plans.free"),
        ] {
            let e = err(&WINDOWS.replacen(from, to, 1));
            assert!(e.contains(key), "{to}: {e}");
        }
        let e = err("[plans.free]\nlimits = []");
        assert!(
            e.contains("plans.free.limits") && e.contains("1 to 8"),
            "{e}"
        );
        let nine = (1..=9)
            .map(|i| format!("{{ limit = 1, window = \"{i}s\" }}"))
            .collect::<Vec<_>>()
            .join(", ");
        let e = err(&format!("[plans.free]\nlimits = [{nine}]"));
        assert!(e.contains("1 to 8"), "{e}");
        let e = err("[plans.free]\nwindow = \"1h\"");
        assert!(e.contains("plans.free") && e.contains("either"), "{e}");
    }

    const PROVIDERS: &str = r#"
[plans.free]
limit = 1
window = "1h"
[providers.llm]
rate = 50
burst = 10
max_wait = "30s"
[providers.slow]
rate = 0.5
burst = 1
max_wait = "500ms"
"#;

    #[test]
    fn reads_providers() {
        let c = Config::parse(PROVIDERS, "t.toml").unwrap();
        let llm = c.provider("llm").unwrap();
        assert_eq!((llm.rate, llm.burst), (50.0, 10));
        assert_eq!(llm.max_wait, Duration::from_secs(30));
        assert_eq!(c.provider("slow").unwrap().rate, 0.5);
        assert_eq!(c.providers().count(), 2);
        assert!(c.provider("nope").is_none());
    }

    #[test]
    fn provider_errors_name_the_key() {
        for (from, to, key) in [
            ("rate = 50", "rate = 0", "providers.llm.rate"),
            ("rate = 50", "rate = -3", "providers.llm.rate"),
            ("rate = 50", "rate = nan", "providers.llm.rate"),
            ("rate = 50", "rate = 1e-300", "providers.llm.rate"),
            ("rate = 50", "rate = inf", "providers.llm.rate"),
            ("rate = 50", "rate = 2e6", "providers.llm.rate"),
            ("burst = 10", "burst = 0", "providers.llm.burst"),
            (
                "max_wait = \"30s\"",
                "max_wait = \"soon\"",
                "providers.llm.max_wait",
            ),
            (
                "max_wait = \"30s\"",
                "max_wait = \"0s\"",
                "providers.llm.max_wait",
            ),
            ("[providers.llm]", "[providers.\"a:b\"]", "providers.a:b"),
            ("burst = 10", "burst = 10\nbrust = 3", "brust"),
            // burst 10 at 50/s: at most 200 ms (the bucket keeps one token).
            (
                "burst = 10",
                "burst = 10\nlate_allowance = \"201ms\"",
                "providers.llm.late_allowance",
            ),
            (
                "burst = 10",
                "burst = 10\nmax_pause = \"10ms\"",
                "providers.llm.max_pause",
            ),
        ] {
            let e = err(&PROVIDERS.replacen(from, to, 1));
            assert!(e.contains(key), "{to}: {e}");
        }
        let lenient = PROVIDERS.replacen("burst = 10", "burst = 10\nlate_allowance = \"100ms\"", 1);
        let c = Config::parse(&lenient, "test").unwrap();
        let llm = c.provider("llm").unwrap();
        // 10 - (50 * 0.1 - 1): the upstream still sees <= burst + rate·t + 1.
        assert_eq!(
            (llm.late_allowance, llm.bucket_burst()),
            (Some(Duration::from_millis(100)), 6.0)
        );
        assert_eq!(c.provider("slow").unwrap().bucket_burst(), 1.0);
        let e = err(&PROVIDERS.replacen("rate = 50", "rate = \"fast\"", 1));
        assert!(e.contains("rate"), "{e}");
    }

    const LIMITS: &str = r#"
[plans.free]
limit = 1
window = "1h"
[providers.llm]
max_wait = "30s"
limits = [{ tokens = 9000, per = "1m", burst = 900 }, { rate = 60, per = "1m", burst = 5 }]
usage = "/usage/total_tokens"
[operations.chat]
cost = 1
provider = "llm"
weight = { from = "/max_tokens", default = 500 }
"#;

    #[test]
    fn reads_several_provider_limits() {
        let c = Config::parse(LIMITS, "t.toml").unwrap();
        let llm = c.provider("llm").unwrap();
        // The request limit is the request bucket: 5 + rate * 60 s + 1 = 60.
        assert_eq!(llm.burst, 5);
        assert!((llm.rate - 54.0 / 60.0).abs() < 1e-12, "{}", llm.rate);
        assert_eq!(llm.bucket_burst(), 5.0);
        assert_eq!(llm.rate_name(), "requests/1m");
        // The token limit: 900 + rate * (60 s + 1/rate of requests) = 9000.
        let tokens = &llm.limits[0];
        assert_eq!(
            (tokens.kind, tokens.burst, tokens.name()),
            (LimitKind::Tokens, 900, "tokens/1m".into())
        );
        let d = 60.0 / 54.0;
        assert!(
            (tokens.rate - 8100.0 / (60.0 + d)).abs() < 1e-9,
            "{}",
            tokens.rate
        );
        assert_eq!(llm.max_weight(), Some(900));
        let chat = c.operation("chat").unwrap();
        assert_eq!(chat.usage.as_deref(), Some("/usage/total_tokens"));
        let w = chat.weight.clone().unwrap();
        assert_eq!(w.of(&serde_json::json!({"max_tokens": 120})), 120);
        assert_eq!(w.of(&serde_json::json!({"max_tokens": 12.2})), 13);
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"max_tokens": -3}),
            serde_json::json!({"max_tokens": "120"}),
            serde_json::json!({"max_tokens": null}),
            serde_json::json!([1, 2]),
        ] {
            assert_eq!(w.of(&bad), 500, "{bad}");
        }
        assert_eq!(w.of(&serde_json::json!({"max_tokens": 0})), 1);
        assert_eq!(w.of(&serde_json::json!({"max_tokens": 1e300})), MAX_TOKENS);
        assert_eq!(Weight::Fixed(7).of(&serde_json::Value::Null), 7);
        assert_eq!(
            reported_usage("/u", &serde_json::json!({"u": 3.5})),
            Some(4)
        );
        assert_eq!(reported_usage("/u", &serde_json::json!({"u": -1})), None);
        assert_eq!(reported_usage("/u", &serde_json::json!({})), None);
        // The simple form with a token limit beside it.
        let both = LIMITS.replace(
            "max_wait = \"30s\"",
            "max_wait = \"30s\"\nrate = 2\nburst = 4",
        );
        let c = Config::parse(&both, "t.toml").unwrap();
        let llm = c.provider("llm").unwrap();
        assert_eq!(
            (llm.rate, llm.burst, llm.rate_name()),
            (2.0, 4, "rate".to_owned())
        );
        assert_eq!(llm.limits.len(), 2, "both entries are extra buckets");
    }

    #[test]
    fn provider_limit_errors_name_the_key() {
        for (from, to, key) in [
            (
                "{ rate = 60,",
                "{ rate = 60, tokens = 3,",
                "providers.llm.limits[1]",
            ),
            (
                "burst = 900",
                "burst = 9000",
                "providers.llm.limits[0].burst",
            ),
            (
                "tokens = 9000",
                "tokens = 1",
                "providers.llm.limits[0].tokens",
            ),
            (
                "per = \"1m\", burst = 5",
                "per = \"soon\", burst = 5",
                "providers.llm.limits[1].per",
            ),
            (
                "{ rate = 60, per = \"1m\"",
                "{ tokens = 60, per = \"1m\"",
                "providers.llm.limits[1].per",
            ),
            (
                "{ rate = 60, per = \"1m\", burst = 5 }",
                "{ tokens = 60, per = \"1s\", burst = 5 }",
                "providers.llm",
            ),
            (
                "max_wait = \"30s\"",
                "max_wait = \"30s\"\nrate = 3",
                "providers.llm",
            ),
            (
                "usage = \"/usage/total_tokens\"",
                "usage = \"usage\"",
                "providers.llm.usage",
            ),
            ("default = 500", "default = 901", "operations.chat.weight"),
            (
                "weight = { from = \"/max_tokens\", default = 500 }",
                "weight = 0",
                "operations.chat.weight",
            ),
            (
                "weight = { from = \"/max_tokens\", default = 500 }",
                "weight = \"big\"",
                "operations.chat.weight",
            ),
            (
                "weight = { from = \"/max_tokens\", default = 500 }",
                "",
                "operations.chat.weight",
            ),
            (
                "default = 500",
                "default = 500, max = 3",
                "operations.chat.weight",
            ),
        ] {
            let text = LIMITS.replacen(from, to, 1);
            assert_ne!(text, LIMITS, "{from}");
            let e = err(&text);
            assert!(e.contains(key), "{to}: {e}");
        }
        // A weight, or a usage, without a token limit to weigh against.
        let plain = "[plans.free]\nlimit = 1\nwindow = \"1h\"\n[providers.p]\nrate = 1\nburst = 1\nmax_wait = \"1s\"\n";
        let e = err(&format!(
            "{plain}[operations.o]\ncost = 1\nprovider = \"p\"\nweight = 3\n"
        ));
        assert!(
            e.contains("operations.o.weight") && e.contains("no token limit"),
            "{e}"
        );
        let e = err(&format!("{plain}usage = \"/u\"\n"));
        assert!(e.contains("providers.p.usage"), "{e}");
    }

    const OPERATIONS: &str = r#"
[plans.free]
limit = 100
window = "1h"
[providers.llm]
rate = 50
burst = 10
max_wait = "30s"
url = "http://127.0.0.1:9100"
[operations."llm.structured"]
cost = 8
provider = "llm"
"#;

    #[test]
    fn retry_unanswered_is_a_boolean() {
        let on = OPERATIONS.replace(
            "provider = \"llm\"\n",
            "provider = \"llm\"\nretry_unanswered = true\n",
        );
        let c = Config::parse(&on, "t.toml").unwrap();
        assert!(c.operation("llm.structured").unwrap().retry_unanswered);
        let e = err(&on.replace("retry_unanswered = true", "retry_unanswered = \"yes\""));
        assert!(e.contains("retry_unanswered") && e.contains("bool"), "{e}");
    }

    #[test]
    fn provider_headers_are_checked() {
        let with = |lines: &str| {
            OPERATIONS.replace(
                "url = \"http://127.0.0.1:9100\"\n",
                &format!("url = \"http://127.0.0.1:9100\"\n{lines}\n"),
            )
        };
        let c = Config::parse(
            &with("headers = { \"anthropic-version\" = \"2023-06-01\" }\nsecret_headers = { \"x-api-key\" = \"ANTHROPIC_API_KEY\" }"),
            "t.toml",
        )
        .unwrap();
        let up = c.upstream("llm").unwrap();
        assert_eq!(up.headers["anthropic-version"], "2023-06-01");
        assert_eq!(up.secret_headers["x-api-key"], "ANTHROPIC_API_KEY");
        for (lines, key) in [
            ("headers = { \"bad header\" = \"x\" }", "headers.bad header"),
            ("headers = { \"x-a\" = \"line\\nbreak\" }", "headers.x-a"),
            ("headers = { \"Content-Type\" = \"text/plain\" }", "reserved"),
            ("headers = { \"Idempotency-Key\" = \"x\" }", "reserved"),
            ("secret_headers = { \"x-api-key\" = \"NOT A VAR\" }", "secret_headers.x-api-key"),
            ("secret_headers = { \"x-api-key\" = \"\" }", "secret_headers.x-api-key"),
            (
                "headers = { \"X-Key\" = \"a\" }\nsecret_headers = { \"x-key\" = \"K\" }",
                "set twice",
            ),
            (
                "auth_header = \"X-Key\"\nauth_env = \"K\"\nsecret_headers = { \"x-key\" = \"K2\" }",
                "set twice",
            ),
        ] {
            let e = err(&with(lines));
            assert!(e.contains(key), "{lines}: {e}");
        }
        let no_url = OPERATIONS.replace(
            "url = \"http://127.0.0.1:9100\"\n",
            "headers = { \"a\" = \"b\" }\n",
        );
        assert!(err(&no_url).contains("needs `url`"), "{}", err(&no_url));
        let exposed = OPERATIONS.replace(
            "provider = \"llm\"\n",
            "provider = \"llm\"\nexpose_upstream_errors = true\n",
        );
        let c = Config::parse(&exposed, "t.toml").unwrap();
        assert!(
            c.operation("llm.structured")
                .unwrap()
                .expose_upstream_errors
        );
        let c = Config::parse(OPERATIONS, "t.toml").unwrap();
        assert!(
            !c.operation("llm.structured")
                .unwrap()
                .expose_upstream_errors
        );
    }

    #[test]
    fn operations_choose_how_their_input_is_sent() {
        let with = |lines: &str| {
            OPERATIONS.replace(
                "provider = \"llm\"\n",
                &format!("provider = \"llm\"\n{lines}\n"),
            )
        };
        let shape = |lines: &str| {
            Config::parse(&with(lines), "t.toml")
                .unwrap()
                .operation("llm.structured")
                .unwrap()
                .request
        };
        assert_eq!(shape(""), RequestShape::Json);
        assert_eq!(
            shape("method = \"POST\"\nbody = \"json\""),
            RequestShape::Json
        );
        assert_eq!(shape("body = \"form\""), RequestShape::Form);
        assert_eq!(shape("method = \"GET\""), RequestShape::Query);
        for (lines, key) in [
            ("method = \"GET\"\nbody = \"form\"", "body"),
            ("method = \"DELETE\"", "method"),
            ("body = \"xml\"", "body"),
        ] {
            let e = err(&with(lines));
            assert!(e.contains(&format!("llm.structured.{key}")), "{lines}: {e}");
        }
    }

    #[test]
    fn reads_operations_and_upstreams() {
        let c = Config::parse(OPERATIONS, "t.toml").unwrap();
        let op = c.operation("llm.structured").unwrap();
        assert_eq!((op.cost, op.provider.as_str()), (8, "llm"));
        assert_eq!(op.deadline, DEFAULT_JOB_DEADLINE);
        assert_eq!(op.max_attempts, DEFAULT_MAX_ATTEMPTS);
        assert!(
            !op.retry_unanswered,
            "an unanswered call is not resent by default"
        );
        let up = c.upstream("llm").unwrap();
        assert_eq!(up.url, "http://127.0.0.1:9100");
        assert_eq!(up.retries, DEFAULT_RETRIES);
        let builtin = Config::builtin();
        let costs: Vec<(&str, u64)> = builtin
            .operations()
            .map(|o| (o.name.as_str(), o.cost))
            .collect();
        assert_eq!(
            costs,
            vec![
                ("company.research", 20),
                ("embeddings", 1),
                ("jobs.extract", 5),
                ("llm.structured", 8),
                ("salary.lookup", 3),
            ]
        );
        assert!(builtin.upstream("llm").is_none(), "built-in: the mock");
    }

    #[test]
    fn operation_errors_name_the_key() {
        for (from, to, key) in [
            ("cost = 8", "cost = 0", "operations.llm.structured.cost"),
            (
                "provider = \"llm\"",
                "provider = \"gpt\"",
                "operations.llm.structured.provider",
            ),
            (
                "provider = \"llm\"",
                "provider = \"llm\"\npath = \"v1\"",
                "operations.llm.structured.path",
            ),
            (
                "provider = \"llm\"",
                "provider = \"llm\"\nmax_attempts = 0",
                "operations.llm.structured.max_attempts",
            ),
            (
                "url = \"http://127.0.0.1:9100\"",
                "url = \"ftp://x\"",
                "providers.llm.url",
            ),
            (
                "url = \"http://127.0.0.1:9100\"",
                "url = \"http://\"",
                "providers.llm.url",
            ),
            (
                "url = \"http://127.0.0.1:9100\"",
                "url = \"https://:443/v1\"",
                "providers.llm.url",
            ),
            (
                "url = \"http://127.0.0.1:9100\"",
                "url = \"http://x\"\nauth_header = \"X-Key\"",
                "providers.llm.auth_env",
            ),
            ("cost = 8", "cost = 8\ncots = 1", "cots"),
        ] {
            let e = err(&OPERATIONS.replacen(from, to, 1));
            assert!(e.contains(key), "{to}: {e}");
        }
        let e = err(&OPERATIONS.replacen("url = \"http://127.0.0.1:9100\"", "retries = 3", 1));
        assert!(
            e.contains("providers.llm.retries") && e.contains("url"),
            "{e}"
        );
    }

    #[test]
    fn settle_reads_the_answer_and_clamps() {
        let text = OPERATIONS.replacen(
            "provider = \"llm\"",
            "provider = \"llm\"\nsettle = { from = \"/usage/total_tokens\", per = 100, max = 40 }",
            1,
        );
        let c = Config::parse(&text, "t.toml").unwrap();
        let s = c
            .operation("llm.structured")
            .unwrap()
            .settle
            .clone()
            .unwrap();
        let at =
            |v: serde_json::Value| s.cost(&serde_json::json!({ "usage": { "total_tokens": v } }));
        assert_eq!(at(serde_json::json!(2501)), Some(26));
        assert_eq!(at(serde_json::json!(800)), Some(8));
        assert_eq!(at(serde_json::json!(0)), Some(1), "at least 1");
        assert_eq!(at(serde_json::json!(-5)), Some(1));
        assert_eq!(at(serde_json::json!(1e12)), Some(40), "at most max");
        assert_eq!(at(serde_json::json!(150.5)), Some(2));
        assert_eq!(at(serde_json::json!("lots")), None);
        assert_eq!(s.cost(&serde_json::json!({ "usage": {} })), None);
        for (from, to, k) in [
            ("per = 100", "per = 0", "settle.per"),
            ("max = 40", "max = 0", "settle.max"),
            ("\"/usage/total_tokens\"", "\"usage\"", "settle.from"),
            ("max = 40", "max = 40, maxx = 1", "maxx"),
            ("max = 40", "max = 40, reserve = \"most\"", "settle.reserve"),
        ] {
            let e = err(&text.replacen(from, to, 1));
            assert!(e.contains(k), "{to}: {e}");
        }
        // Reserve the most, settle down: the charge up front is `max`.
        let op = c.operation("llm.structured").unwrap();
        assert_eq!(
            (op.cost, op.charged_cost(), op.settle_may_raise()),
            (8, 40, false)
        );
        let estimate = text.replacen("max = 40", "max = 40, reserve = \"estimate\"", 1);
        let c = Config::parse(&estimate, "t.toml").unwrap();
        let op = c.operation("llm.structured").unwrap();
        assert_eq!((op.charged_cost(), op.settle_may_raise()), (8, true));
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = Config::load(Some(Path::new("/nonexistent/tollgate.toml"))).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tollgate.toml"));
    }

    #[test]
    fn urls_need_a_host() {
        for good in [
            "http://x",
            "https://api.example.com/v1",
            "http://127.0.0.1:9100",
            "http://[::1]:80/p",
            "https://user:pw@h.example:8443?q",
        ] {
            assert!(http_url_with_host(good), "{good}");
        }
        for bad in [
            "http://",
            "https://",
            "http:///x",
            "http://:80",
            "http://h:",
            "http://h:99999",
            "http://[]:1",
            "ftp://x",
            "http://a b",
            "http://u@/x",
        ] {
            assert!(!http_url_with_host(bad), "{bad}");
        }
    }
}
