//! Validated identifiers: user ids and request ids.
//!
//! Both end up inside Redis key names and Lua arguments, so they are checked once,
//! at the edge, and carried as newtypes afterwards. The charset excludes everything
//! that has a meaning in a key (`{` `}` open a hash tag, `:` separates key parts,
//! `*` is a glob) and whitespace, so no input can address another tenant's keys.
//!
//! User and organisation ids are also path segments (`/admin/users/{user}/...`,
//! the dashboard's links and forms): `.` and `..` as a whole id are refused,
//! since a browser or HTTP client normalises such a segment away and the URL
//! then names another route. The alphabet: ASCII letters, digits and
//! `- _ . @ + = ~`, 1 to 128 bytes, not `.` nor `..`. Ids stored before that
//! rule are read back with [`UserId::existing`], so that such a user's keys,
//! jobs, usage and refunds keep working.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest accepted id, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// Why an id was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{kind} must not be empty")]
    Empty { kind: &'static str },
    #[error("{kind} is {len} bytes long; the limit is {MAX_ID_LEN}")]
    TooLong { kind: &'static str, len: usize },
    #[error("{kind} contains {found:?}; allowed are ASCII letters, digits and - _ . @ + = ~")]
    BadChar { kind: &'static str, found: char },
    #[error("{kind} must not be \".\" or \"..\" (a URL path drops such a segment)")]
    DotSegment { kind: &'static str },
}

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@' | '+' | '=' | '~')
}

/// `dots`: whether `.` and `..` are refused as a whole id.
fn validate(kind: &'static str, s: &str, dots: bool) -> Result<(), IdError> {
    if dots && (s == "." || s == "..") {
        return Err(IdError::DotSegment { kind });
    }
    if s.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if s.len() > MAX_ID_LEN {
        return Err(IdError::TooLong { kind, len: s.len() });
    }
    match s.chars().find(|c| !allowed(*c)) {
        Some(found) => Err(IdError::BadChar { kind, found }),
        None => Ok(()),
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal, dots: $dots:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates `s` and wraps it.
            pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                validate($kind, &s, $dots)?;
                Ok(Self(s))
            }

            /// An id already stored: validated as [`Self::new`] does but
            /// for the refusal of `.` and `..`, which came later. For what
            /// a store reads back, and for the routes that read or refund
            /// what such an id already has; never to create one.
            pub fn existing(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                validate($kind, &s, false)?;
                Ok(Self(s))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }
    };
}

id_type!(
    /// A user (tenant) of the service: owns one budget pool.
    UserId,
    "user id",
    dots: true
);
id_type!(
    /// Identifies one operation end to end: the spend event, the job and the
    /// throttle grant all carry it. Reserving twice with one id charges once.
    RequestId,
    "request id",
    dots: true
);

id_type!(
    /// An organisation: a budget over its plan that every member's charge
    /// must fit as well as the member's own.
    OrgId,
    "organisation id",
    dots: true
);

impl RequestId {
    /// A fresh random id (UUID v4, 122 random bits).
    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// The id back from the shared text a store keeps of it (it was validated
    /// as a `RequestId` when it went in).
    pub fn from_kept(kept: &str) -> Self {
        Self(kept.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_ids() {
        for ok in [
            "alice",
            "user-42",
            "a.b_c@d+e=f~g",
            "0",
            &"x".repeat(MAX_ID_LEN),
        ] {
            assert!(UserId::new(ok).is_ok(), "{ok}");
        }
        assert!(RequestId::new(RequestId::generate().as_str()).is_ok());
    }

    #[test]
    fn dot_segments_are_refused_as_new_ids_but_existing_ones_stay_addressable() {
        for dots in [".", ".."] {
            assert_eq!(
                RequestId::new(dots).unwrap_err(),
                IdError::DotSegment { kind: "request id" }
            );
            assert!(dots.parse::<RequestId>().is_err());
            assert!(serde_json::from_str::<RequestId>(&format!("\"{dots}\"")).is_err());
            assert_eq!(RequestId::existing(dots).unwrap().as_str(), dots);
        }
        for fine in ["...", ".a", "a.", "a..b"] {
            assert!(RequestId::new(fine).is_ok(), "{fine}");
        }
    }

    #[test]
    fn rejects_key_syntax_and_whitespace() {
        for bad in ["{alice}", "a}b", "a:b", "a*", "a b", "a\tb", "a\nb", "é"] {
            let err = UserId::new(bad).unwrap_err();
            assert!(matches!(err, IdError::BadChar { .. }), "{bad}: {err}");
        }
        assert_eq!(
            UserId::new("").unwrap_err(),
            IdError::Empty { kind: "user id" }
        );
        assert!(matches!(
            RequestId::new("x".repeat(MAX_ID_LEN + 1)),
            Err(IdError::TooLong { len: 129, .. })
        ));
    }

    #[test]
    fn dot_segments_are_refused_as_whole_user_and_org_ids() {
        for bad in [".", ".."] {
            assert_eq!(
                UserId::new(bad).unwrap_err(),
                IdError::DotSegment { kind: "user id" }
            );
            assert!(UserId::new(bad).unwrap_err().to_string().contains("\"..\""));
            assert_eq!(
                OrgId::new(bad).unwrap_err(),
                IdError::DotSegment {
                    kind: "organisation id"
                }
            );
            assert!(bad.parse::<UserId>().is_err());
            assert!(serde_json::from_str::<UserId>(&format!("\"{bad}\"")).is_err());
            // One stored before the rule is still read back.
            assert_eq!(UserId::existing(bad).unwrap().as_str(), bad);
        }
        for ok in ["...", ".a", "a.", "a..b", "..."] {
            assert!(UserId::new(ok).is_ok(), "{ok}");
        }
        assert!(UserId::existing("a:b").is_err(), "the alphabet still holds");
    }

    #[test]
    fn deserialization_validates() {
        let err = serde_json::from_str::<UserId>("\"a:b\"");
        assert!(err.is_err());
    }
}
