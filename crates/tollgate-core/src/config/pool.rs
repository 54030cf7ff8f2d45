//! `[providers.X] members`: a provider's pool of upstream accounts (API
//! keys, organisations, deployments), each with its own url, secrets,
//! limits and concurrency. A provider without `members` is a pool of one:
//! itself, configured as today.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::provider::{
    parse_provider_limits, request_bucket, LimitKind, ProviderLimit, RawProviderLimit,
};
use super::upstream::{parse_upstream, Upstream, UpstreamFields};
use super::{ConfigError, MAX_IN_FLIGHT};

/// Most `members` one provider may list.
pub const MAX_MEMBERS: usize = 32;
/// Largest member `weight`.
pub const MAX_MEMBER_WEIGHT: u32 = 1000;
/// Longest member `model`.
pub const MAX_MODEL_LEN: usize = 256;

/// One upstream account of a provider's pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolMember {
    /// Unique in its provider; the id charset (it names the member in
    /// metrics, the job timeline and Redis keys).
    pub name: String,
    /// Its share of the pool's new users (1 to [`MAX_MEMBER_WEIGHT`],
    /// default 1).
    pub weight: u32,
    /// The model name sent in place of the request's (the same model under
    /// this deployment's name); also in `upstream.model`.
    pub model: Option<String>,
    /// Its request bucket (its first request limit, as for a provider that
    /// sets `limits` without `rate` and `burst`).
    pub rate: f64,
    pub burst: u64,
    pub rate_limit: Option<ProviderLimit>,
    /// Its other limits.
    pub limits: Vec<ProviderLimit>,
    /// Most of its calls in flight at once, across every pod.
    pub max_concurrent: Option<u32>,
    /// Where its calls go: its `url`, `headers`, `secret_headers`, `model`,
    /// with its provider's `timeout` and `retries`.
    pub upstream: Upstream,
}

impl PoolMember {
    /// The heaviest call it can ever grant: its smallest token burst (`None`:
    /// it has no token limit).
    pub fn max_weight(&self) -> Option<u64> {
        super::provider::max_token_burst(&self.limits)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPoolMember {
    name: Option<String>,
    url: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    secret_headers: Option<BTreeMap<String, String>>,
    limits: Option<Vec<RawProviderLimit>>,
    max_concurrent: Option<i64>,
    weight: Option<i64>,
    model: Option<String>,
}

/// What a provider's members take from the provider: how late its grants
/// may be used, and its calls' `timeout` and `retries` (already checked).
pub(super) struct Inherited {
    pub late_allowance: Option<Duration>,
    pub timeout: Duration,
    pub retries: u32,
}

/// The members of provider `key` (`providers.X`), each checked, in order.
pub(super) fn parse_members(
    key: &str,
    raw: &[RawPoolMember],
    inherited: &Inherited,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<Vec<PoolMember>, ConfigError> {
    if raw.is_empty() || raw.len() > MAX_MEMBERS {
        return Err(invalid(
            format!("{key}.members"),
            format!(
                "must list between 1 and {MAX_MEMBERS} members (or be left out: a pool of one), got {}",
                raw.len()
            ),
        ));
    }
    let mut out: Vec<PoolMember> = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let at = format!("{key}.members[{i}]");
        let Some(name) = &m.name else {
            return Err(invalid(format!("{at}.name"), "is required".into()));
        };
        // Member names end up in Redis key names, like provider names.
        if let Err(e) = crate::id::UserId::new(name.as_str()) {
            return Err(invalid(
                format!("{at}.name"),
                format!("bad member name: {e}"),
            ));
        }
        if let Some(j) = out.iter().position(|o| o.name == *name) {
            return Err(invalid(
                format!("{at}.name"),
                format!("{name:?} is already the name of {key}.members[{j}]"),
            ));
        }
        if m.url.is_none() {
            return Err(invalid(
                format!("{at}.url"),
                "is required: where this member's calls go".into(),
            ));
        }
        let weight = match m.weight {
            None => 1,
            Some(w) if (1..=i64::from(MAX_MEMBER_WEIGHT)).contains(&w) => w as u32,
            Some(w) => {
                return Err(invalid(
                    format!("{at}.weight"),
                    format!(
                        "must be between 1 and {MAX_MEMBER_WEIGHT} (its share of the pool), got {w}"
                    ),
                ))
            }
        };
        let model = match &m.model {
            None => None,
            Some(model)
                if !model.is_empty()
                    && model.len() <= MAX_MODEL_LEN
                    && model.bytes().all(|b| (b'!'..=b'~').contains(&b)) =>
            {
                Some(model.clone())
            }
            Some(model) => {
                return Err(invalid(
                    format!("{at}.model"),
                    format!("must be 1 to {MAX_MODEL_LEN} visible ASCII characters, got {model:?}"),
                ))
            }
        };
        let Some(raw_limits) = m.limits.as_deref() else {
            return Err(invalid(
                format!("{at}.limits"),
                "is required: a member's own request limit (`[{ rate = N, per = \"1m\" }]`)".into(),
            ));
        };
        let raw_limits = parse_provider_limits(&at, raw_limits, invalid)?;
        // The provider's `late_allowance` applies to each member's request
        // bucket: named where it is set.
        let first_per = raw_limits
            .iter()
            .find(|l| l.0 == LimitKind::Requests)
            .map(|l| l.2);
        if let (Some(d), Some(per)) = (inherited.late_allowance, first_per) {
            if d < Duration::from_millis(1) || d > per {
                return Err(invalid(
                    format!("{key}.late_allowance"),
                    format!(
                        "must be between 1ms and the per of {at}'s request limit ({})",
                        crate::duration::format(per)
                    ),
                ));
            }
        }
        let (rate, burst, rate_limit, limits) =
            request_bucket(&at, None, raw_limits, inherited.late_allowance, invalid)?;
        let max_concurrent = match m.max_concurrent {
            None => None,
            Some(n) if (1..=i64::from(MAX_IN_FLIGHT)).contains(&n) => Some(n as u32),
            Some(n) => {
                return Err(invalid(
                    format!("{at}.max_concurrent"),
                    format!("must be between 1 and {MAX_IN_FLIGHT}, got {n}"),
                ))
            }
        };
        let fields = UpstreamFields {
            url: m.url.as_ref(),
            auth_header: None,
            auth_env: None,
            headers: m.headers.as_ref(),
            secret_headers: m.secret_headers.as_ref(),
            timeout: None,
            retries: None,
        };
        let mut upstream =
            parse_upstream(&at, &fields, invalid)?.expect("a member with a url has an upstream");
        upstream.timeout = inherited.timeout;
        upstream.retries = inherited.retries;
        upstream.model.clone_from(&model);
        out.push(PoolMember {
            name: name.clone(),
            weight,
            model,
            rate,
            burst,
            rate_limit,
            limits,
            max_concurrent,
            upstream,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::Duration;
    use crate::config::tests::err;
    use crate::config::{Config, LimitKind};

    /// A pool of one member: an account with its own key, limits and model.
    const POOL: &str = r#"
[plans.free]
limit = 100
window = "1h"
[providers.llm]
max_wait = "30s"
timeout = "20s"
retries = 1
members = [
  { name = "eu", url = "http://127.0.0.1:9101/v1", secret_headers = { "api-key" = "EU_KEY" }, headers = { "x-region" = "eu" }, limits = [{ rate = 60, per = "1m", burst = 5 }, { tokens = 9000, per = "1m", burst = 900 }], max_concurrent = 4, weight = 3, model = "gpt-4o-eu" },
]
[operations.chat]
cost = 8
provider = "llm"
weight = { from = "/max_tokens", default = 500 }
"#;

    /// `POOL` with a second member `tail` (TOML: a line of the array).
    fn with_member(tail: &str) -> String {
        POOL.replacen(
            "model = \"gpt-4o-eu\" },\n",
            &format!("model = \"gpt-4o-eu\" }},\n  {tail},\n"),
            1,
        )
    }

    #[test]
    fn a_pool_of_one_member_is_served_as_that_member() {
        let c = Config::parse(POOL, "t.toml").unwrap();
        let llm = c.provider("llm").unwrap();
        let eu = &llm.members[0];
        assert_eq!(
            (eu.name.as_str(), eu.weight, eu.model.as_deref()),
            ("eu", 3, Some("gpt-4o-eu"))
        );
        // Its limits are the provider's: the first request limit is the
        // request bucket (5 + rate * 60 s + 1 = 60), tokens beside it.
        assert_eq!((llm.burst, llm.rate_name()), (5, "requests/1m".to_owned()));
        assert!((llm.rate - 54.0 / 60.0).abs() < 1e-12, "{}", llm.rate);
        assert_eq!(
            (llm.limits.len(), llm.limits[0].kind, llm.max_weight()),
            (1, LimitKind::Tokens, Some(900))
        );
        assert_eq!((llm.max_concurrent, eu.max_concurrent), (Some(4), Some(4)));
        // Its upstream is the provider's, with the provider's timeout and
        // retries, and the model it sends.
        let up = c.upstream("llm").unwrap();
        assert_eq!(up, &eu.upstream);
        assert_eq!(up.url, "http://127.0.0.1:9101/v1");
        assert_eq!(up.secret_headers["api-key"], "EU_KEY");
        assert_eq!(up.headers["x-region"], "eu");
        assert_eq!(
            (up.timeout, up.retries, up.model.as_deref()),
            (Duration::from_secs(20), 1, Some("gpt-4o-eu"))
        );
        // A provider without members is a pool of one: itself, as before.
        let plain = Config::parse(super::super::tests::OPERATIONS, "t.toml").unwrap();
        assert!(plain.provider("llm").unwrap().members.is_empty());
        assert_eq!(plain.upstream("llm").unwrap().model, None);
    }

    #[test]
    fn a_pool_of_two_members_grants_per_member() {
        let ok = "name = \"us\", url = \"http://127.0.0.1:9102\", limits = [{ rate = 120, per = \"1m\", burst = 10 }, { tokens = 9000, per = \"1m\", burst = 900 }]";
        let c = Config::parse(&with_member(&format!("{{ {ok} }}")), "t.toml").unwrap();
        let llm = c.provider("llm").unwrap();
        let names: Vec<&str> = llm.pool().iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["eu", "us"]);
        // The provider stands for the whole: the sum of its members' rates
        // and bursts; its limits, slots and upstream are its members'.
        let sum = llm.members[0].rate + llm.members[1].rate;
        assert!((llm.rate - sum).abs() < 1e-12, "{}", llm.rate);
        assert_eq!(
            (llm.burst, llm.limits.len(), llm.max_concurrent),
            (15, 0, None)
        );
        assert!(c.upstream("llm").is_none());
        let urls: Vec<&str> = c.upstreams("llm").iter().map(|u| u.url.as_str()).collect();
        assert_eq!(urls, ["http://127.0.0.1:9101/v1", "http://127.0.0.1:9102"]);
        // Each member, as a provider of its own, has its own buckets.
        let us = llm.as_member(llm.pool_member("us").unwrap());
        assert_eq!(
            (us.burst, us.limits[0].burst, us.max_concurrent),
            (10, 900, None)
        );
        assert!(us.pool().is_empty());
        // A pool of one is not a pool: served as its member.
        assert!(Config::parse(POOL, "t.toml")
            .unwrap()
            .provider("llm")
            .unwrap()
            .pool()
            .is_empty());
    }

    #[test]
    fn a_call_too_heavy_for_every_member_is_refused_before_it_waits() {
        use crate::throttle::ThrottleError;
        let us = "name = \"us\", url = \"http://127.0.0.1:9102\", limits = [{ rate = 60, per = \"1m\" }, { tokens = 9000, per = \"1m\", burst = 600 }]";
        let c = Config::parse(&with_member(&format!("{{ {us} }}")), "t.toml").unwrap();
        let llm = c.provider("llm").unwrap();
        // The heaviest call one of them holds (eu: 900; us: 600).
        assert_eq!(llm.max_weight(), Some(900));
        // Too heavy for us, not for eu: eu takes it.
        assert!(ThrottleError::check_weight(llm, 700).is_ok());
        let e = ThrottleError::check_weight(llm, 901).unwrap_err();
        assert!(
            matches!(e, ThrottleError::TooHeavy { weight: 901, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn bad_pools_are_refused_naming_the_key() {
        let second = |tail: &str| with_member(tail);
        let ok = "name = \"us\", url = \"http://127.0.0.1:9102\", limits = [{ rate = 60, per = \"1m\" }, { tokens = 9000, per = \"1m\", burst = 900 }]";
        for (text, key, says) in [
            // A member without url.
            (
                POOL.replacen("url = \"http://127.0.0.1:9101/v1\", ", "", 1),
                "providers.llm.members[0].url",
                "is required",
            ),
            (
                second(&format!("{{ {} }}", ok.replacen("url = \"http://127.0.0.1:9102\", ", "", 1))),
                "providers.llm.members[1].url",
                "is required",
            ),
            // Duplicate names.
            (
                second(&format!("{{ {} }}", ok.replacen("\"us\"", "\"eu\"", 1))),
                "providers.llm.members[1].name",
                "already the name of providers.llm.members[0]",
            ),
            // A weight of 0, or too much.
            (
                POOL.replacen("weight = 3", "weight = 0", 1),
                "providers.llm.members[0].weight",
                "between 1 and 1000",
            ),
            (
                second(&format!("{{ {ok}, weight = 1001 }}")),
                "providers.llm.members[1].weight",
                "between 1 and 1000",
            ),
            // Limits that can never grant a declared weight.
            (
                POOL.replacen("default = 500", "default = 901", 1),
                "providers.llm.members[0].limits",
                "could never grant a call of operations.chat.weight (default 901)",
            ),
            (
                POOL.replacen("default = 500 }", "default = 500 }\n[operations.big]\ncost = 1\nprovider = \"llm\"\nweight = 950", 1),
                "providers.llm.members[0].limits",
                "could never grant a call of operations.big.weight (weight 950)",
            ),
            // No name, a bad name, no limits, bad limits, no request limit.
            (
                POOL.replacen("name = \"eu\", ", "", 1),
                "providers.llm.members[0].name",
                "is required",
            ),
            (
                POOL.replacen("name = \"eu\"", "name = \"e{u}\"", 1),
                "providers.llm.members[0].name",
                "bad member name",
            ),
            (
                POOL.replacen("limits = [{ rate = 60, per = \"1m\", burst = 5 }, { tokens = 9000, per = \"1m\", burst = 900 }], ", "", 1),
                "providers.llm.members[0].limits",
                "is required",
            ),
            (
                POOL.replacen("burst = 900", "burst = 9000", 1),
                "providers.llm.members[0].limits[1].burst",
                "must be between 1 and 8999",
            ),
            (
                POOL.replacen("{ rate = 60, per = \"1m\", burst = 5 }, ", "", 1),
                "providers.llm.members[0]",
                "request",
            ),
            (
                POOL.replacen("max_concurrent = 4", "max_concurrent = 0", 1),
                "providers.llm.members[0].max_concurrent",
                "must be between 1",
            ),
            (
                POOL.replacen("\"gpt-4o-eu\"", "\"gpt 4o\"", 1),
                "providers.llm.members[0].model",
                "visible ASCII",
            ),
            (
                POOL.replacen("\"api-key\" = \"EU_KEY\"", "\"api-key\" = \"not a var\"", 1),
                "providers.llm.members[0].secret_headers.api-key",
                "environment variable",
            ),
            (
                POOL.replacen("weight = 3", "wieght = 3", 1),
                "wieght",
                "unknown field",
            ),
            // What members set is not set on the provider too.
            (
                POOL.replacen("max_wait = \"30s\"", "max_wait = \"30s\"\nurl = \"http://x\"", 1),
                "providers.llm.url",
                "is set per member",
            ),
            (
                POOL.replacen("max_wait = \"30s\"", "max_wait = \"30s\"\nrate = 2\nburst = 2", 1),
                "providers.llm.rate",
                "is set per member",
            ),
            (
                POOL.replacen("max_wait = \"30s\"", "max_wait = \"30s\"\nsecret_headers = { k = \"K\" }", 1),
                "providers.llm.secret_headers",
                "is set per member",
            ),
            (
                POOL.replacen("timeout = \"20s\"", "timeout = \"20s\"\nlate_allowance = \"2m\"", 1),
                "providers.llm.late_allowance",
                "request limit (1m)",
            ),
            (
                POOL.replacen("timeout = \"20s\"", "timeout = \"20h\"", 1),
                "providers.llm.timeout",
                "between 1ms and 10m",
            ),
            (
                POOL.replacen("members = [", "members_ = [", 1),
                "members_",
                "unknown field",
            ),
            (
                format!(
                    "{}members = []\n[operations.chat]{}",
                    POOL.split("members = [").next().unwrap(),
                    POOL.split("[operations.chat]").nth(1).unwrap()
                ),
                "providers.llm.members",
                "between 1 and 32",
            ),
        ] {
            assert_ne!(text, POOL, "{key}");
            let e = err(&text);
            assert!(e.contains(key) && e.contains(says), "{key} / {says}: {e}");
        }
    }
}
