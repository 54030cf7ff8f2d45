//! Every Redis key tollgate uses is built here, and only here.
//!
//! Layout: `<prefix>:v1:{u:<user>}:<part>`. The prefix lets several deployments
//! (and parallel tests) share one Redis; `v1` is the schema version, bumped when a
//! layout changes so old and new pods never misread each other; the hash tag puts
//! all keys of one user in one Redis Cluster slot, as multi-key scripts require.
//! User ids cannot contain `{`, `}` or `:` ([`tollgate_core::id`]), so a user id
//! can neither widen the hash tag nor forge another part of the name.

use tollgate_core::UserId;

/// Key schema version: part of every key.
pub const SCHEMA: &str = "v1";

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "key prefix must be 1 to 64 characters of ASCII letters, digits, or - _ . : (got {0:?})"
    )]
    BadPrefix(String),
}

/// A deployment's key namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpace {
    prefix: String,
}

/// The keys of one user's budget, in the order the budget scripts take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetKeys {
    /// Sorted set: request id -> time the tokens were spent (ms).
    pub events: String,
    /// Hash: request id -> cost, and `:total`, the running sum.
    pub costs: String,
    /// String: the user's plan name; never expires.
    pub plan: String,
}

impl KeySpace {
    pub fn new(prefix: &str) -> Result<Self, KeyError> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 64
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
        if !ok {
            return Err(KeyError::BadPrefix(prefix.to_owned()));
        }
        Ok(Self {
            prefix: prefix.to_owned(),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `<prefix>:v1:{u:<user>}:events|costs|plan`
    pub fn budget(&self, user: &UserId) -> BudgetKeys {
        let base = format!("{}:{SCHEMA}:{{u:{}}}", self.prefix, user);
        BudgetKeys {
            events: format!("{base}:events"),
            costs: format!("{base}:costs"),
            plan: format!("{base}:plan"),
        }
    }
}

impl Default for KeySpace {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_keys_share_the_user_hash_tag() {
        let k = KeySpace::new("tg")
            .unwrap()
            .budget(&UserId::new("alice").unwrap());
        assert_eq!(k.events, "tg:v1:{u:alice}:events");
        assert_eq!(k.costs, "tg:v1:{u:alice}:costs");
        assert_eq!(k.plan, "tg:v1:{u:alice}:plan");
    }

    #[test]
    fn prefixes_cannot_open_a_hash_tag() {
        for bad in ["", "a{b", "a}b", "a b", "a*", &"p".repeat(65)] {
            assert!(KeySpace::new(bad).is_err(), "{bad:?}");
        }
        assert!(KeySpace::new("team-a:tollgate").is_ok());
    }
}
