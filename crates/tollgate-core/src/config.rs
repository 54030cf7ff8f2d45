//! The TOML config: plans (and, as roles arrive, providers and operations).
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

/// A validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    default_plan: String,
    plans: BTreeMap<String, Plan>,
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
        Ok(Self {
            default_plan,
            plans,
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
        assert_eq!(Config::builtin(), c);
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
}
