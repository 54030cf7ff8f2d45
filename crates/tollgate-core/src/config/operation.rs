//! `[operations.X]`: a kind of job: its cost, provider, deadline, how its
//! input is sent, how its charge settles and what a call weighs.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::pricing::{Pricing, Sheets};
use super::provider::{usage_pointer, Provider};
use super::{ConfigError, MAX_TOKENS};
use crate::duration;
use crate::money::Currency;

/// How much of a provider's token limits one call weighs (an operation's
/// `weight`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Weight {
    /// `weight = 500`: every call weighs this.
    Fixed(u64),
    /// `weight = { from = "/max_tokens", default = 1000, input = "bytes" }`:
    /// the call's output bound, a number in its input at `from` (a JSON
    /// pointer; a fraction counts up, a value past [`MAX_TOKENS`] as that), or
    /// `default` when there is none there, it is not a number or it is
    /// negative; plus, with `input = "bytes"`, a bound of its input (see
    /// [`InputBound`]). The call goes upstream with that output bound written
    /// at `from` ([`Weight::bounded`]), so an upstream that honours it cannot
    /// use more than the weight.
    From {
        from: String,
        default: u64,
        input: InputBound,
    },
}

/// What a weight read `from` the input counts of the input itself (`input`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum InputBound {
    /// Nothing (no `input`): the weight is the output bound alone, which
    /// bounds what the upstream counts only when its limit counts output
    /// tokens alone.
    #[default]
    None,
    /// `input = "bytes"`: the length of the input as JSON, in bytes. A BPE
    /// token is at least one byte of text, so it bounds the prompt's tokens
    /// (overstating them about 4×: the usage an answer reports gives the rest
    /// back), as a price sheet's worst case counts it.
    Bytes,
}

/// Why a call's output bound cannot be written into its input at the
/// weight's `from` (a member on the way is not an object).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the input has no object at {at:?} to hold its output bound ({from})")]
pub struct BoundError {
    pub from: String,
    pub at: String,
}

impl Weight {
    /// The output bound of a call whose input is `input`, as it goes
    /// upstream (`None` for a fixed weight, which writes nothing).
    pub fn output_bound(&self, input: &serde_json::Value) -> Option<u64> {
        let Self::From { from, default, .. } = self else {
            return None;
        };
        let Some(v) = input.pointer(from) else {
            return Some(*default);
        };
        Some(match (v.as_u64(), v.as_f64()) {
            (Some(n), _) => n.min(MAX_TOKENS),
            (None, Some(f)) if f.is_finite() && f >= 0.0 => f.ceil().min(MAX_TOKENS as f64) as u64,
            _ => *default,
        })
    }

    /// The weight of a call whose input is `input`: at least 1. For a weight
    /// read `from` the input, its output bound plus its input bound.
    pub fn of(&self, input: &serde_json::Value) -> u64 {
        let bound = match self {
            Self::Fixed(n) => return (*n).max(1),
            Self::From { input, .. } => *input,
        };
        let out = self.output_bound(input).unwrap_or(0);
        let inp = match bound {
            InputBound::None => 0,
            InputBound::Bytes => u64::try_from(input.to_string().len()).unwrap_or(MAX_TOKENS),
        };
        out.saturating_add(inp).clamp(1, MAX_TOKENS)
    }

    /// `input` as it goes upstream: with its output bound
    /// ([`Weight::output_bound`]) written at `from` when it does not hold
    /// that whole number already (missing, `null`, a string, a negative
    /// number, a fraction, past [`MAX_TOKENS`]); `None` when it goes as it
    /// is. Missing objects on the way are made; a member on the way that is
    /// not an object (nor an array holding the index) is an error.
    pub fn bounded(
        &self,
        input: &serde_json::Value,
    ) -> Result<Option<serde_json::Value>, BoundError> {
        let Some(out) = self.output_bound(input) else {
            return Ok(None);
        };
        let Self::From { from, .. } = self else {
            return Ok(None);
        };
        if input.pointer(from).and_then(serde_json::Value::as_u64) == Some(out) {
            return Ok(None);
        }
        let mut sent = input.clone();
        let tokens: Vec<String> = from
            .split('/')
            .skip(1)
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        let mut at = &mut sent;
        let mut path = String::new();
        for (i, token) in tokens.iter().enumerate() {
            let last = i + 1 == tokens.len();
            let err = |path: &str| BoundError {
                from: from.clone(),
                at: if path.is_empty() {
                    "/".into()
                } else {
                    path.to_owned()
                },
            };
            at = match at {
                serde_json::Value::Object(members) => {
                    if last {
                        members.insert(token.clone(), serde_json::Value::from(out));
                        return Ok(Some(sent));
                    }
                    members
                        .entry(token.clone())
                        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()))
                }
                serde_json::Value::Array(items) => {
                    let item = token.parse::<usize>().ok().and_then(|n| items.get_mut(n));
                    match (item, last) {
                        (Some(item), true) => {
                            *item = serde_json::Value::from(out);
                            return Ok(Some(sent));
                        }
                        (Some(item), false) => item,
                        (None, _) => return Err(err(&path)),
                    }
                }
                _ => return Err(err(&path)),
            };
            path.push('/');
            path.push_str(from.split('/').nth(i + 1).unwrap_or_default());
        }
        // `from` is "/": the input itself is no place for a number.
        Err(BoundError {
            from: from.clone(),
            at: "/".into(),
        })
    }
}

/// Default `deadline` of an operation's jobs.
pub const DEFAULT_JOB_DEADLINE: Duration = Duration::from_secs(300);

/// Default `max_runs` of an operation's jobs.
pub const DEFAULT_MAX_RUNS: u32 = 3;

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
    pub max_runs: u32,
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
    /// Its price sheet and model (`prices`, `model`), when it is priced per
    /// model: then `cost` is 0 and each call reserves its own worst case.
    pub pricing: Option<Pricing>,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOperation {
    weight: Option<toml::Value>,
    usage: Option<String>,
    cost: Option<toml::Value>,
    /// A price sheet file (else its provider's, if any): the operation is
    /// priced per model.
    prices: Option<String>,
    /// Where a priced call's model comes from: a JSON pointer (default
    /// `/model`) or a fixed name.
    model: Option<String>,
    provider: String,
    path: Option<String>,
    deadline: Option<String>,
    // `max_attempts`: its name before the glossary's, still accepted.
    #[serde(alias = "max_attempts")]
    max_runs: Option<i64>,
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

pub(super) fn parse_operations(
    raw: BTreeMap<String, RawOperation>,
    providers: &BTreeMap<String, Provider>,
    money: &mut Sheets<'_>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<BTreeMap<String, Operation>, ConfigError> {
    let mut operations = BTreeMap::new();
    for (name, o) in raw {
        let key = format!("operations.{name}");
        // Operation names end up in Redis key names, like provider names.
        if let Err(e) = crate::id::UserId::new(name.as_str()) {
            return Err(invalid(key, format!("bad operation name: {e}")));
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
        let max_runs = o.max_runs.unwrap_or(i64::from(DEFAULT_MAX_RUNS));
        if !(1..=100).contains(&max_runs) {
            return Err(invalid(
                format!("{key}.max_runs"),
                format!("must be between 1 and 100, got {max_runs}"),
            ));
        }
        let settle = match o.settle {
            None => None,
            Some(r) => Some(parse_settle(&format!("{key}.settle"), r, invalid)?),
        };
        let pricing = money.pricing(
            &key,
            &o.provider,
            o.prices.as_deref(),
            o.model.as_deref(),
            invalid,
        )?;
        let cost = match (&pricing, &o.cost) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    format!("{key}.cost"),
                    "a priced operation reserves its request's worst case at its prices: \
                     remove `cost`"
                        .into(),
                ))
            }
            (Some(_), None) => 0,
            (None, None) => {
                return Err(invalid(
                    format!("{key}.cost"),
                    "is required (or `prices`: a price sheet)".into(),
                ))
            }
            (None, Some(v)) => {
                let c = crate::money::parse_toml(money.currency, v)
                    .map_err(|m| invalid(format!("{key}.cost"), m))?;
                if c == 0 || c > MAX_TOKENS {
                    return Err(invalid(
                        format!("{key}.cost"),
                        format!(
                            "must be more than 0 and at most {MAX_TOKENS} minor units, got {c}"
                        ),
                    ));
                }
                c
            }
        };
        // `max` is the most a call may cost and `cost` its estimate: a max
        // below the estimate would reserve more than any call can settle to
        // (`reserve = "estimate"`), or cap every call under its own price.
        if let Some(s) = settle
            .as_ref()
            .filter(|s| pricing.is_none() && s.max < cost)
        {
            return Err(invalid(
                format!("{key}.settle.max"),
                format!(
                    "must be at least the operation's cost ({cost}): it is the most a call may \
                     cost, got {}",
                    s.max
                ),
            ));
        }
        if settle.is_some() && (pricing.is_some() || money.currency != Currency::Tokens) {
            return Err(invalid(
                format!("{key}.settle"),
                "budgets in money settle at a price sheet's prices (`prices`): remove `settle`"
                    .into(),
            ));
        }
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
                cost,
                pricing,
                provider: o.provider,
                path: o.path,
                deadline,
                max_runs: max_runs as u32,
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
            "must be a whole number >= 1, or `{ from = \"/max_tokens\", default = 1000 }` \
             (optionally with `input = \"bytes\"`)"
                .into(),
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
            if t.keys()
                .any(|k| !["from", "default", "input"].contains(&k.as_str()))
                || !from.starts_with('/')
            {
                return Err(shape());
            }
            let input = match t.get("input") {
                None => InputBound::None,
                Some(v) if v.as_str() == Some("bytes") => InputBound::Bytes,
                Some(v) => {
                    return Err(invalid(
                        format!("{key}.input"),
                        format!(
                            "must be \"bytes\" (the input's length bounds its tokens), got {v:?}"
                        ),
                    ))
                }
            };
            Weight::From {
                from: from.to_owned(),
                default: default as u64,
                input,
            }
        }
        _ => return Err(shape()),
    };
    let most = provider.max_weight().unwrap_or(0);
    let (n, what) = match &weight {
        Weight::Fixed(n) => (*n, "weight"),
        Weight::From { default, .. } => (*default, "default"),
    };
    // A member that could never grant it: its limits are wrong for the
    // operation (a pool of one member has the provider's own).
    for (i, m) in provider.members.iter().enumerate() {
        if let Some(most) = m.max_weight().filter(|most| n > *most) {
            return Err(invalid(
                format!("providers.{}.members[{i}].limits", provider.name),
                format!(
                    "its smallest token burst ({most}) could never grant a call of {key} \
                     ({what} {n})"
                ),
            ));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{err, OPERATIONS};
    use crate::config::{Config, DEFAULT_RETRIES};

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
        assert_eq!(op.max_runs, DEFAULT_MAX_RUNS);
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
                "operations.llm.structured.max_runs",
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
    fn max_runs_is_also_read_under_its_former_name() {
        // `max_attempts`: the name before the glossary's.
        for key in ["max_runs", "max_attempts"] {
            let text = OPERATIONS.replacen(
                "provider = \"llm\"",
                &format!("provider = \"llm\"\n{key} = 5"),
                1,
            );
            let c = Config::parse(&text, "t.toml").unwrap();
            assert_eq!(c.operation("llm.structured").unwrap().max_runs, 5, "{key}");
        }
        // Both names (one of them before the glossary's) at once: refused.
        let both = OPERATIONS.replacen(
            "provider = \"llm\"",
            "provider = \"llm\"\nmax_runs = 5\nmax_attempts = 4",
            1,
        );
        let e = Config::parse(&both, "t.toml").unwrap_err().to_string();
        assert!(e.contains("max_runs"), "{e}");
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

    /// `settle.max` is the most a call may cost: below the operation's `cost`
    /// (the estimate) it would settle every call below what it was priced at,
    /// and with `reserve = "estimate"` reserve more than it may ever settle
    /// to. Refused at start, naming the key.
    #[test]
    fn settle_max_below_cost_is_refused() {
        let with = |settle: &str| {
            OPERATIONS.replacen(
                "provider = \"llm\"",
                &format!(
                    "provider = \"llm\"\nsettle = {{ from = \"/usage/total_tokens\", {settle} }}"
                ),
                1,
            )
        };
        // The operation's cost is 8.
        for settle in ["max = 7", "max = 1", "max = 7, reserve = \"estimate\""] {
            let e = err(&with(settle));
            assert!(
                e.contains("operations.llm.structured.settle.max"),
                "{settle}: {e}"
            );
            assert!(e.contains("cost"), "{settle}: {e}");
        }
        for settle in ["max = 8", "max = 9", "max = 8, reserve = \"estimate\""] {
            Config::parse(&with(settle), "t.toml").unwrap_or_else(|e| panic!("{settle}: {e}"));
        }
    }
}
