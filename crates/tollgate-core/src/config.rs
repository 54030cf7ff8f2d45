//! The TOML config: plans, providers (and, as roles arrive, operations).
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
pub const BUILTIN: &str = include_str!("default.toml");

/// Largest limit or cost accepted: budgets are summed in Lua numbers (doubles),
/// which are exact integers up to 2^53.
pub const MAX_TOKENS: u64 = (1 << 53) - 1;

/// A budget plan: at most `limit` tokens spent in any trailing `window`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub name: String,
    pub limit: u64,
    pub window: Duration,
}

impl Plan {
    pub fn window_ms(&self) -> u64 {
        u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX)
    }
}

/// Largest accepted provider `rate` (tokens per second) and `burst`.
pub const MAX_RATE: f64 = 1_000_000.0;
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
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    default_plan: String,
    plans: BTreeMap<String, Plan>,
    providers: BTreeMap<String, Provider>,
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
    #[serde(default)]
    plans: BTreeMap<String, RawPlan>,
    #[serde(default)]
    providers: BTreeMap<String, RawProvider>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    rate: f64,
    burst: i64,
    max_wait: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
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
            if p.limit <= 0 {
                return Err(invalid(
                    format!("{key}.limit"),
                    format!("must be > 0, got {}", p.limit),
                ));
            }
            let limit = p.limit as u64;
            if limit > MAX_TOKENS {
                return Err(invalid(
                    format!("{key}.limit"),
                    format!("must be <= {MAX_TOKENS}"),
                ));
            }
            let window =
                duration::parse(&p.window).map_err(|m| invalid(format!("{key}.window"), m))?;
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
            plans.insert(
                name.clone(),
                Plan {
                    name,
                    limit,
                    window,
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
        let providers = parse_providers(raw.providers, &invalid)?;
        Ok(Self {
            default_plan,
            plans,
            providers,
        })
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

    /// The provider called `name`, if configured.
    pub fn provider(&self, name: &str) -> Option<&Provider> {
        self.providers.get(name)
    }

    /// Every configured provider, by name.
    pub fn providers(&self) -> impl Iterator<Item = &Provider> {
        self.providers.values()
    }
}

fn parse_providers(
    raw: BTreeMap<String, RawProvider>,
    invalid: &impl Fn(String, String) -> ConfigError,
) -> Result<BTreeMap<String, Provider>, ConfigError> {
    let mut providers = BTreeMap::new();
    for (name, p) in raw {
        let key = format!("providers.{name}");
        // Provider names end up in Redis key names: the id charset keeps them
        // from opening a hash tag or forging a key part.
        if let Err(e) = crate::id::UserId::new(name.as_str()) {
            return Err(invalid(key, format!("bad provider name: {e}")));
        }
        if !(p.rate.is_finite() && p.rate > 0.0) {
            return Err(invalid(
                format!("{key}.rate"),
                format!("must be > 0 (tokens per second), got {}", p.rate),
            ));
        }
        if p.rate > MAX_RATE {
            return Err(invalid(
                format!("{key}.rate"),
                format!("must be <= {MAX_RATE}"),
            ));
        }
        if p.burst < 1 {
            return Err(invalid(
                format!("{key}.burst"),
                format!("must be >= 1 (the bucket capacity), got {}", p.burst),
            ));
        }
        let burst = p.burst as u64;
        if burst > MAX_BURST {
            return Err(invalid(
                format!("{key}.burst"),
                format!("must be <= {MAX_BURST}"),
            ));
        }
        let max_wait =
            duration::parse(&p.max_wait).map_err(|m| invalid(format!("{key}.max_wait"), m))?;
        if max_wait < Duration::from_millis(1) || max_wait > MAX_WAIT_LIMIT {
            return Err(invalid(
                format!("{key}.max_wait"),
                "must be between 1ms and 1h".into(),
            ));
        }
        providers.insert(
            name.clone(),
            Provider {
                name,
                rate: p.rate,
                burst,
                max_wait,
            },
        );
    }
    Ok(providers)
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
        assert_eq!(c.default_plan().limit, 1000);
        assert_eq!(c.plan("pro").unwrap().limit, 20000);
        assert_eq!(
            c.plan("pro").unwrap().window,
            Duration::from_secs(12 * 3600)
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
        ] {
            let e = err(&PROVIDERS.replacen(from, to, 1));
            assert!(e.contains(key), "{to}: {e}");
        }
        let e = err(&PROVIDERS.replacen("rate = 50", "rate = \"fast\"", 1));
        assert!(e.contains("rate"), "{e}");
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = Config::load(Some(Path::new("/nonexistent/tollgate.toml"))).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tollgate.toml"));
    }
}
