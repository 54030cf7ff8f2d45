//! `[providers.X]`: a provider's throttle (its request bucket and other
//! `limits`, `fairness`, pauses, slots) and where answers report usage.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::pool::{parse_members, Inherited, PoolMember, RawPoolMember};
use super::upstream::{parse_call_policy, parse_upstream, Upstream, UpstreamFields};
use super::{ConfigError, MAX_IN_FLIGHT, MAX_TOKENS};
use crate::duration;

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
    /// Its pool's members (`members`), in order; empty: a pool of one, the
    /// provider itself. A pool of one member is served as that member: its
    /// limits, `max_concurrent` and upstream are the provider's.
    pub members: Vec<PoolMember>,
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
    /// of its token limits (`None`: it has none, weight counts nothing). A
    /// pool's: the heaviest one of its members can (each member's own is
    /// checked against its operations' weights).
    pub fn max_weight(&self) -> Option<u64> {
        if !self.pool().is_empty() {
            return self.pool().iter().filter_map(PoolMember::max_weight).max();
        }
        max_token_burst(&self.limits)
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

    /// The members a grant chooses between: `members` when it lists two or
    /// more; empty for a provider served as one upstream (no members, or a
    /// pool of one: its member's limits are the provider's own).
    pub fn pool(&self) -> &[PoolMember] {
        if self.members.len() >= 2 {
            &self.members
        } else {
            &[]
        }
    }

    /// The member `name` of its pool ([`Provider::pool`]).
    pub fn pool_member(&self, name: &str) -> Option<&PoolMember> {
        self.pool().iter().find(|m| m.name == name)
    }

    /// Member `m`'s buckets as a provider of their own: its request bucket,
    /// other limits and `max_concurrent`, with this provider's name, wait,
    /// pause and lateness rules, and no members.
    pub fn as_member(&self, m: &PoolMember) -> Provider {
        Provider {
            rate: m.rate,
            burst: m.burst,
            max_concurrent: m.max_concurrent,
            rate_limit: m.rate_limit.clone(),
            limits: m.limits.clone(),
            members: Vec::new(),
            ..self.clone()
        }
    }
}

/// The smallest burst of the token limits among `limits`: the heaviest call
/// they can ever grant (`None`: there is no token limit).
pub(super) fn max_token_burst(limits: &[ProviderLimit]) -> Option<u64> {
    limits
        .iter()
        .filter(|l| l.kind == LimitKind::Tokens)
        .map(|l| l.burst)
        .min()
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProvider {
    rate: Option<f64>,
    burst: Option<i64>,
    limits: Option<Vec<RawProviderLimit>>,
    usage: Option<String>,
    max_wait: String,
    /// A price sheet file for its operations (`prices`): taken out before
    /// the rest is read (`config/pricing.rs`).
    pub(super) prices: Option<String>,
    pub(super) url: Option<String>,
    pub(super) auth_header: Option<String>,
    pub(super) auth_env: Option<String>,
    pub(super) headers: Option<BTreeMap<String, String>>,
    pub(super) secret_headers: Option<BTreeMap<String, String>>,
    pub(super) timeout: Option<String>,
    pub(super) retries: Option<i64>,
    fairness: Option<String>,
    max_pause: Option<String>,
    late_allowance: Option<String>,
    max_concurrent: Option<i64>,
    adaptive: Option<bool>,
    members: Option<Vec<RawPoolMember>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProviderLimit {
    rate: Option<i64>,
    tokens: Option<i64>,
    per: String,
    burst: Option<i64>,
}

pub(super) type Providers = (BTreeMap<String, Provider>, BTreeMap<String, Upstream>);

/// A `limits` entry as read: kind, amount, per, burst.
type RawLimitOf = (LimitKind, u64, Duration, u64);

pub(super) fn parse_provider_limits(
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
pub(super) fn request_bucket(
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
pub(super) fn usage_pointer(
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

/// The upstream fields of a provider without members.
fn upstream_fields(p: &RawProvider) -> UpstreamFields<'_> {
    UpstreamFields {
        url: p.url.as_ref(),
        auth_header: p.auth_header.as_ref(),
        auth_env: p.auth_env.as_ref(),
        headers: p.headers.as_ref(),
        secret_headers: p.secret_headers.as_ref(),
        timeout: p.timeout.as_ref(),
        retries: p.retries,
    }
}

/// With `members`, what each member sets for itself is not set on the
/// provider: which one would a call use?
fn member_keys_only(
    key: &str,
    p: &RawProvider,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<(), ConfigError> {
    for (field, set) in [
        ("rate", p.rate.is_some()),
        ("burst", p.burst.is_some()),
        ("limits", p.limits.is_some()),
        ("max_concurrent", p.max_concurrent.is_some()),
        ("url", p.url.is_some()),
        ("auth_header", p.auth_header.is_some()),
        ("auth_env", p.auth_env.is_some()),
        ("headers", p.headers.is_some()),
        ("secret_headers", p.secret_headers.is_some()),
    ] {
        if set {
            return Err(invalid(
                format!("{key}.{field}"),
                "is set per member when the provider lists `members`".into(),
            ));
        }
    }
    Ok(())
}

pub(super) fn parse_providers(
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
        let (rate, burst, rate_limit, limits, max_concurrent, upstream, members) = match &p.members
        {
            None => {
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
                let upstream = parse_upstream(&key, &upstream_fields(&p), invalid)?;
                (
                    rate,
                    burst,
                    rate_limit,
                    limits,
                    max_concurrent,
                    upstream,
                    Vec::new(),
                )
            }
            Some(raw_members) => {
                member_keys_only(&key, &p, invalid)?;
                let (timeout, retries) =
                    parse_call_policy(&key, p.timeout.as_ref(), p.retries, invalid)?;
                let inherited = Inherited {
                    late_allowance,
                    timeout,
                    retries,
                };
                let members = parse_members(&key, raw_members, &inherited, invalid)?;
                match members.as_slice() {
                    [one] => (
                        one.rate,
                        one.burst,
                        one.rate_limit.clone(),
                        one.limits.clone(),
                        one.max_concurrent,
                        Some(one.upstream.clone()),
                        members,
                    ),
                    // A pool: each grant takes from one member's buckets
                    // (`Provider::pool`); the provider's own stand for the
                    // whole (what stats show, the late bound of its grants:
                    // one token's time of the sum, shorter than any
                    // member's), and its calls go to the member granted.
                    many => {
                        let rate = many.iter().map(|m| m.rate).sum();
                        let burst = many.iter().map(|m| m.burst).sum();
                        (rate, burst, None, Vec::new(), None, None, members)
                    }
                }
            }
        };
        if let Some(upstream) = upstream {
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
                members,
            },
        );
    }
    Ok((providers, upstreams))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::err;
    use crate::config::{reported_usage, Config, Weight};

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
        assert_eq!(Weight::Fixed(7).bounded(&serde_json::json!({})), Ok(None));
        // The call goes upstream with the bound its weight counted.
        let sent = |input: serde_json::Value| w.bounded(&input).unwrap();
        assert_eq!(sent(serde_json::json!({"max_tokens": 120})), None);
        assert_eq!(sent(serde_json::json!({"max_tokens": 0})), None);
        for (input, bound) in [
            (serde_json::json!({"m": "x"}), 500),
            (serde_json::json!({"m": "x", "max_tokens": null}), 500),
            (serde_json::json!({"m": "x", "max_tokens": "5000"}), 500),
            (serde_json::json!({"m": "x", "max_tokens": -3}), 500),
            (serde_json::json!({"m": "x", "max_tokens": 12.2}), 13),
            (
                serde_json::json!({"m": "x", "max_tokens": 1e300}),
                MAX_TOKENS,
            ),
        ] {
            let out = sent(input.clone()).unwrap_or_else(|| panic!("{input}"));
            assert_eq!(out["max_tokens"], serde_json::json!(bound), "{input}");
            assert_eq!(out["m"], "x");
            assert_eq!(w.of(&input), bound, "{input}");
        }
        // With `input = "bytes"`: the output bound plus the input's length.
        let c = Config::parse(
            &LIMITS.replace("default = 500 }", "default = 500, input = \"bytes\" }"),
            "t.toml",
        )
        .unwrap();
        let w = c.operation("chat").unwrap().weight.clone().unwrap();
        let input = serde_json::json!({"prompt": "four", "max_tokens": 0});
        assert_eq!(w.of(&input), input.to_string().len() as u64);
        let input = serde_json::json!({"prompt": "four"});
        assert_eq!(w.of(&input), 500 + input.to_string().len() as u64);
        // A nested pointer makes its objects, and refuses a non-object.
        let nested = Weight::From {
            from: "/options/num_predict".into(),
            default: 64,
            input: crate::config::InputBound::None,
        };
        assert_eq!(
            nested.bounded(&serde_json::json!({"a": 1})).unwrap(),
            Some(serde_json::json!({"a": 1, "options": {"num_predict": 64}}))
        );
        let e = nested
            .bounded(&serde_json::json!({"options": [1]}))
            .unwrap_err();
        assert_eq!(e.at, "/options", "{e}");
        assert!(nested
            .bounded(&serde_json::json!({"options": "x"}))
            .is_err());
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
            (
                "default = 500",
                "default = 500, input = \"tokens\"",
                "operations.chat.weight.input",
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
}
