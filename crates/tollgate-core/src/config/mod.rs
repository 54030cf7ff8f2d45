//! The TOML config: plans, providers (their throttle and, optionally, their HTTP
//! upstream) and operations (cost and provider of each job kind).
//!
//! Parsing is strict: unknown keys, a `default_plan` that names no plan, a zero
//! limit or an unparsable window fail at start with a message naming the key, so
//! a typo never silently becomes a default.
//!
//! This file holds [`Config`]: its entry points ([`Config::parse`],
//! [`Config::load`]), the top-level table, `[export]`, the checks across
//! sections and the accessors. Each section's types and parsing are in a file
//! of their own, re-exported here: every item is `config::X`.

mod alerts;
mod error;
mod model_limit;
mod operation;
mod plan;
mod pool;
mod pricing;
mod provider;
mod upstream;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

pub use alerts::{Alerts, DEFAULT_ALERT_KEEP, DEFAULT_ALERT_TIMEOUT, MAX_ALERT_KEEP};
pub use error::ConfigError;
pub use model_limit::{pattern_of, ModelLimit, MAX_MODEL_LIMITS};
pub use operation::{
    BoundError, InputBound, Operation, RequestShape, Settle, SettleReserve, StreamUsage, Weight,
    DEFAULT_JOB_DEADLINE, DEFAULT_MAX_RUNS, DEFAULT_RESULT_TTL,
};
pub use plan::{
    threshold_text, threshold_tokens, Limit, Plan, DEFAULT_MAX_OPEN_STREAMS,
    DEFAULT_MAX_STORED_BYTES, JOB_RECORD_BYTES, MAX_ALERT_THRESHOLDS, MAX_IN_FLIGHT, MAX_LIMITS,
    MAX_OPEN_STREAMS, MAX_SHARE, MAX_STORED_BYTES,
};
pub use pool::{PoolMember, MAX_MEMBERS, MAX_MEMBER_WEIGHT, MAX_MODEL_LEN};
pub use pricing::{ModelSource, PriceError, Prices, Pricing, Quote};
pub use provider::{
    reported_usage, Fairness, LimitKind, Provider, ProviderLimit, DEFAULT_MAX_PAUSE, FIRST_BACKOFF,
    MAX_BURST, MAX_PROVIDER_LIMITS, MAX_RATE, MAX_WAIT_LIMIT, MIN_RATE, SLOT_LEASE,
};
pub use upstream::{
    http_url_with_host, Upstream, DEFAULT_RETRIES, DEFAULT_UPSTREAM_TIMEOUT, RESERVED_HEADERS,
};

use crate::duration;
use crate::money::Currency;
use alerts::{parse_alerts, RawAlerts};
use operation::{parse_operations, RawOperation};
use plan::{parse_limits, parse_plans, RawLimit, RawPlan};
use provider::{parse_providers, RawProvider};

/// The config compiled into the binary, used when no file is given.
pub const BUILTIN: &str = include_str!("../default.toml");

/// Largest limit or cost accepted: budgets are summed in Lua numbers (doubles),
/// which are exact integers up to 2^53.
pub const MAX_TOKENS: u64 = (1 << 53) - 1;

/// Largest `[export] maxlen`.
pub const MAX_EXPORT: u64 = 100_000_000;

/// Default `hold_grace` (see [`Config::hold_grace`]).
pub const DEFAULT_HOLD_GRACE: Duration = Duration::from_secs(60);

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    currency: Currency,
    default_plan: String,
    hold_grace: Duration,
    export: Option<u64>,
    spend: crate::spend::Keep,
    alerts: Option<Alerts>,
    plans: BTreeMap<String, Plan>,
    providers: BTreeMap<String, Provider>,
    upstreams: BTreeMap<String, Upstream>,
    operations: BTreeMap<String, Operation>,
    /// Every price sheet the operations use, by file.
    prices: BTreeMap<std::path::PathBuf, std::sync::Arc<Prices>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    currency: Option<String>,
    default_plan: Option<String>,
    hold_grace: Option<String>,
    export: Option<RawExport>,
    spend: Option<RawSpend>,
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
struct RawSpend {
    hourly_keep: Option<String>,
    daily_keep: Option<String>,
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
        Self::parse_in(&text, &path.display().to_string(), path.parent())
    }

    /// Parses and validates a TOML document; `origin` names it in errors.
    /// Relative `prices` files are read from the working directory.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse_in(text, origin, None)
    }

    /// [`parse`](Self::parse), reading relative `prices` files from `base`
    /// (the config file's folder).
    pub fn parse_in(text: &str, origin: &str, base: Option<&Path>) -> Result<Self, ConfigError> {
        let mut raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let invalid = |key: String, message: String| ConfigError::Invalid {
            origin: origin.to_owned(),
            key,
            message,
        };

        let currency = match &raw.currency {
            Some(c) => Currency::parse(c).map_err(|m| invalid("currency".into(), m))?,
            None => Currency::Tokens,
        };
        let plans = parse_plans(raw.plans, currency, &invalid)?;
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
        let spend = parse_spend(raw.spend, &invalid)?;
        let alerts = match raw.alerts {
            None => None,
            Some(a) => Some(parse_alerts(a, &invalid)?),
        };
        let mut sheets = pricing::Sheets {
            currency,
            base: base.filter(|b| !b.as_os_str().is_empty()),
            providers: raw
                .providers
                .iter_mut()
                .filter_map(|(name, p)| Some((name.clone(), p.prices.take()?)))
                .collect(),
            loaded: BTreeMap::new(),
        };
        let (providers, upstreams) = parse_providers(raw.providers, &invalid)?;
        let operations = parse_operations(raw.operations, &providers, &mut sheets, &invalid)?;
        Ok(Self {
            currency,
            prices: sheets.loaded,
            default_plan,
            hold_grace,
            export,
            spend,
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

    /// What budgets, costs and prices are counted in (`currency`, default
    /// tokens); amounts are integers of its minor unit.
    pub fn currency(&self) -> Currency {
        self.currency
    }

    /// Every price sheet the operations use: [`Prices::reload`] each to pick
    /// up an operator's new prices.
    pub fn price_sheets(&self) -> impl Iterator<Item = &std::sync::Arc<Prices>> {
        self.prices.values()
    }

    /// `[export] maxlen`: every spend, refund and settle is also appended to the
    /// user's export stream, kept to about this many entries (`None`: no export).
    pub fn export_maxlen(&self) -> Option<u64> {
        self.export
    }

    /// `[spend]`: how long the spend rollups keep their hourly and daily
    /// buckets (`crate::spend`).
    pub fn spend_keep(&self) -> crate::spend::Keep {
        self.spend
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
        self.plans().map(Plan::log_ms).max().unwrap_or(0)
    }

    /// Validates a user's own limits (an admin's override of its plan's,
    /// `PUT /admin/users/{user}/limits`) as a `[plans.X] limits` list: 1 to
    /// [`MAX_LIMITS`] limits, each `limit` 1 to [`MAX_TOKENS`], windows
    /// distinct; and no window longer than the retention
    /// ([`retention_ms`](Self::retention_ms)): the log keeps no event longer,
    /// so such a window could never count what it claims to. Returns them
    /// longest window first; the error is `limits[i].<field>: why`.
    pub fn override_limits(&self, raw: Vec<(u64, String)>) -> Result<Vec<Limit>, String> {
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
        // The limits are minor units (the api read the body's amounts with
        // `money::parse_json`): spelled as the decimal amount they are, read
        // as a plan's.
        let currency = self.currency;
        let raw = raw
            .into_iter()
            .map(|(limit, window)| {
                RawLimit::window(
                    toml::Value::String(crate::money::format_amount(currency, limit)),
                    window,
                )
            })
            .collect::<Vec<_>>();
        let single = raw.len() == 1;
        // parse_limits names its keys after a plan's (`<plan>.limits[i].limit`,
        // `<plan>.limit` for a single one): here they are the body's.
        let limits = parse_limits("", raw, currency, &invalid).map_err(|e| match e {
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

    /// The HTTP upstream of provider `name`; `None`: the built-in mock, or
    /// a pool ([`Provider::pool`]), whose calls go to its members' (see
    /// [`Config::upstreams`]).
    pub fn upstream(&self, name: &str) -> Option<&Upstream> {
        self.upstreams.get(name)
    }

    /// Every upstream provider `name`'s calls may go to: its own, or its
    /// pool members', in order; none for the built-in mock.
    pub fn upstreams(&self, name: &str) -> Vec<&Upstream> {
        match self.providers.get(name) {
            Some(p) if !p.pool().is_empty() => p.pool().iter().map(|m| &m.upstream).collect(),
            _ => self.upstreams.get(name).into_iter().collect(),
        }
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
        for p in self.providers.values_mut() {
            for m in &mut p.members {
                m.upstream.url.clone_from(&url);
            }
        }
        for name in self
            .providers
            .keys()
            .filter(|n| self.providers[*n].pool().is_empty())
        {
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
                    model: None,
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

/// `[spend] hourly_keep`, `daily_keep`: each a duration, a whole number of
/// its step, from one step to its maximum.
fn parse_spend(
    raw: Option<RawSpend>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<crate::spend::Keep, ConfigError> {
    use crate::spend::{Keep, Step, MAX_DAILY_KEEP, MAX_HOURLY_KEEP};
    let mut keep = Keep::default();
    let Some(raw) = raw else {
        return Ok(keep);
    };
    let one = |key: &str, text: Option<String>, step: Step, max: Duration, default: Duration| {
        let Some(text) = text else {
            return Ok(default);
        };
        let d = duration::parse(&text).map_err(|m| invalid(format!("spend.{key}"), m))?;
        let ms = d.as_millis();
        if ms == 0 || ms % u128::from(step.ms()) != 0 || d > max {
            return Err(invalid(
                format!("spend.{key}"),
                format!(
                    "must be a whole number of {} from {} to {}, got {text:?}",
                    if step == Step::Hour { "hours" } else { "days" },
                    step.as_str(),
                    if step == Step::Hour { "31d" } else { "1098d" },
                ),
            ));
        }
        Ok(d)
    };
    keep.hourly = one(
        "hourly_keep",
        raw.hourly_keep,
        Step::Hour,
        MAX_HOURLY_KEEP,
        keep.hourly,
    )?;
    keep.daily = one(
        "daily_keep",
        raw.daily_keep,
        Step::Day,
        MAX_DAILY_KEEP,
        keep.daily,
    )?;
    Ok(keep)
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

    /// The error of parsing `text` (the tests of every section's file use it).
    pub(super) fn err(text: &str) -> String {
        Config::parse(text, "t.toml").unwrap_err().to_string()
    }

    /// A provider with an upstream and one operation (for `operation.rs` and
    /// `upstream.rs`).
    pub(super) const OPERATIONS: &str = r#"
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
    fn reads_the_documented_shape() {
        let c = Config::parse(ISSUE_SHAPE, "t.toml").unwrap();
        assert_eq!(c.default_plan().name, "free");
        assert_eq!(c.default_plan().max_cost(), 1000);
        assert_eq!(
            c.plan("pro").unwrap().limits,
            vec![Limit::window(20000, Duration::from_secs(12 * 3600))]
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

    #[test]
    fn missing_file_names_the_path() {
        let e = Config::load(Some(Path::new("/nonexistent/tollgate.toml"))).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tollgate.toml"));
    }

    #[test]
    fn spend_keeps_are_whole_steps_within_bounds() {
        let base = "[plans.p]\nlimit = 5\nwindow = \"1h\"\n";
        let keep =
            |extra: &str| Config::parse(&format!("{base}{extra}"), "t").map(|c| c.spend_keep());
        assert_eq!(keep("").unwrap(), crate::spend::Keep::default());
        let k = keep("[spend]\nhourly_keep = \"72h\"\ndaily_keep = \"30d\"\n").unwrap();
        assert_eq!(k.hourly, Duration::from_secs(72 * 3600));
        assert_eq!(k.daily, Duration::from_secs(30 * 86_400));
        for bad in [
            "hourly_keep = \"90m\"",
            "hourly_keep = \"0h\"",
            "hourly_keep = \"32d\"",
            "daily_keep = \"36h\"",
            "daily_keep = \"2000d\"",
        ] {
            let e = keep(&format!("[spend]\n{bad}\n")).unwrap_err().to_string();
            assert!(e.contains("spend."), "{bad}: {e}");
        }
        assert!(keep("[spend]\nweekly_keep = \"1d\"\n").is_err());
    }
}
