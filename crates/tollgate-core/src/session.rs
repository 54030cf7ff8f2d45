//! Dashboard sessions: the [`SessionStore`] interface (its in-memory backend
//! is `tollgate_memory::sessions`).
//!
//! A login opens a session in the store and sets a cookie holding only its
//! [`SessionId`] (32 random bytes); the store keeps the session under the id's
//! SHA-256 ([`SessionHash`]), so a read of the store reveals no usable cookie.
//! A session ends at the first of: logout ([`SessionStore::close`], seen at
//! once by every process that shares the store), its lifetime since login, or
//! an idle time without a request. The store's clock decides both expiries
//! (Redis `TIME` on Redis), never a pod's.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use crate::error::StoreError;

/// What a session may do: both read the dashboard; neither changes anything
/// (the admin routes take only the admin token itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opened with the admin token.
    Admin,
    /// Opened with the read-only viewer token.
    Viewer,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Viewer => "viewer",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "admin" => Some(Self::Admin),
            "viewer" => Some(Self::Viewer),
            _ => None,
        }
    }
}

/// The secret a session cookie carries: 64 hex digits. Its `Debug` hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionId(String);

impl SessionId {
    /// 32 random bytes from the operating system's generator.
    pub fn generate() -> Result<Self, StoreError> {
        Ok(Self(hex(&random::<32>()?)))
    }

    /// A presented cookie value, when it has the shape of an id.
    pub fn parse(value: &str) -> Option<Self> {
        (value.len() == 64
            && value
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then(|| Self(value.to_owned()))
    }

    /// The cookie's value.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What the store is keyed by.
    pub fn hash(&self) -> SessionHash {
        SessionHash(hex(&Sha256::digest(self.0.as_bytes())))
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionId(***)")
    }
}

/// `sha256(session id)` in lowercase hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionHash(String);

impl SessionHash {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A fresh CSRF token: 16 random bytes, hex.
pub fn csrf_token() -> Result<String, StoreError> {
    Ok(hex(&random::<16>()?))
}

/// The digest of the token that opened a session, kept with it so a session
/// ends when its token is changed: never the token itself.
pub fn credential_digest(token: &str) -> String {
    hex(&Sha256::new()
        .chain_update(b"tollgate dashboard credential v1\n")
        .chain_update(token.as_bytes())
        .finalize())
}

fn random<const N: usize>() -> Result<[u8; N], StoreError> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf)
        .map_err(|e| StoreError::backend(format!("the system's random generator failed: {e}")))?;
    Ok(buf)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One live session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub role: Role,
    /// The token a state-changing form of this session must carry.
    pub csrf: String,
    /// [`credential_digest`] of the token that opened it.
    pub credential: String,
    /// When its lifetime ends (ms since the epoch, the store's clock).
    pub expires_ms: u64,
}

/// How long a session lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// From login: the session ends then, however active.
    pub lifetime: Duration,
    /// Without a request: the session ends after this long.
    pub idle: Duration,
}

/// What a login stores.
#[derive(Debug, Clone)]
pub struct NewSession {
    pub role: Role,
    pub csrf: String,
    pub credential: String,
}

/// Where dashboard sessions live: Redis for pods (every pod sees a logout at
/// once), memory for the embedded mode.
#[async_trait]
pub trait SessionStore: Send + Sync + fmt::Debug {
    /// Stores a new session under `id`; returns it with its expiry. An id
    /// already in use is an error (ids are random: it does not happen).
    async fn open(
        &self,
        id: &SessionHash,
        session: &NewSession,
        limits: SessionLimits,
    ) -> Result<Session, StoreError>;

    /// The live session under `id`, its idle time restarted (never past its
    /// lifetime); `None` when there is none, it was closed, or it expired.
    async fn touch(&self, id: &SessionHash, idle: Duration) -> Result<Option<Session>, StoreError>;

    /// Ends the session under `id` (nothing when there is none).
    async fn close(&self, id: &SessionHash) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_only_their_own_shape() {
        let id = SessionId::generate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(SessionId::parse(id.expose()), Some(id.clone()));
        assert_eq!(SessionId::parse("abc"), None);
        assert_eq!(SessionId::parse(&"G".repeat(64)), None);
        assert_eq!(SessionId::parse(&"A".repeat(64)), None);
        assert_ne!(id.hash().as_str(), id.expose());
        assert_eq!(format!("{id:?}"), "SessionId(***)");
    }
}
