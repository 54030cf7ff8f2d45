//! API keys: how they are made, how they are stored (only as a SHA-256 hash), and
//! the [`KeyStore`] interface with its in-memory backend.
//!
//! A key is `tg_` + 64 hex digits (32 random bytes from the OS, 256 bits). It is
//! shown once, when it is issued; the store keeps `sha256(key)` -> [`KeyRecord`],
//! so a leaked store reveals no usable key. Each key also has a public id
//! (`kid_...`) that names it in logs and in `DELETE /admin/keys/{key_id}`.

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

use async_trait::async_trait;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::StoreError;
use crate::id::UserId;

/// What every issued key starts with: makes leaked keys easy to grep for.
pub const KEY_PREFIX: &str = "tg_";
/// What every public key id starts with.
pub const KEY_ID_PREFIX: &str = "kid_";

/// A freshly issued secret key. Its `Debug` does not show the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// 32 random bytes from the operating system's generator.
    pub fn generate() -> Result<Self, KeyStoreError> {
        Ok(Self(format!("{KEY_PREFIX}{}", hex(&random_bytes::<32>()?))))
    }

    /// The secret, to be shown to its owner once.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn hash(&self) -> KeyHash {
        KeyHash::of(&self.0)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(***)")
    }
}

/// `sha256(key)` in lowercase hex: what the store is keyed by.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct KeyHash(String);

impl KeyHash {
    /// Hashes a presented key (whatever its shape: an unknown key just finds
    /// nothing).
    pub fn of(presented: &str) -> Self {
        Self(hex(&Sha256::digest(presented.as_bytes())))
    }

    /// A hash read back from a store.
    pub fn from_hex(hex: String) -> Self {
        Self(hex)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A public key id, `kid_` + 16 hex digits.
pub fn generate_key_id() -> Result<String, KeyStoreError> {
    Ok(format!("{KEY_ID_PREFIX}{}", hex(&random_bytes::<8>()?)))
}

/// True when `s` has the shape of a key id (so it can go into a key name).
pub fn is_key_id(s: &str) -> bool {
    s.strip_prefix(KEY_ID_PREFIX)
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Compares two secrets in time independent of where they differ: both are
/// hashed first (fixed length), then every byte is compared.
pub fn secrets_equal(a: &str, b: &str) -> bool {
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    let diff = a
        .iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn random_bytes<const N: usize>() -> Result<[u8; N], KeyStoreError> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf).map_err(|e| KeyStoreError::Random(e.to_string()))?;
    Ok(buf)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// What the store knows about one key (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyRecord {
    pub key_id: String,
    pub user: UserId,
    pub created_ms: u64,
    pub revoked: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyStoreError {
    /// The key store failed.
    #[error("key store: {0}")]
    Store(#[from] StoreError),
    #[error("the system's random number generator failed: {0}")]
    Random(String),
}

impl KeyStoreError {
    /// Worth retrying: the same call may succeed later (see [`StoreError`]).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Store(e) if e.is_transient())
    }
}

/// Where API keys live: Redis for pods, memory for the embedded mode.
#[async_trait]
pub trait KeyStore: Send + Sync + fmt::Debug {
    /// Stores a new key for `user` and returns its record. The secret itself is
    /// not stored, only `key.hash()`.
    async fn insert(&self, key: &ApiKey, record: &KeyRecord) -> Result<(), KeyStoreError>;

    /// The record of the key hashing to `hash`, revoked or not.
    async fn lookup(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, KeyStoreError>;

    /// Marks the key revoked. Returns its record, or `None` for an unknown id.
    async fn revoke(&self, key_id: &str) -> Result<Option<KeyRecord>, KeyStoreError>;

    /// True when at least one key (revoked or not) was ever issued to `user`:
    /// what makes a user exist for the admin routes.
    async fn has_user(&self, user: &UserId) -> Result<bool, KeyStoreError>;

    /// Succeeds when the store can be reached (readiness checks).
    async fn ping(&self) -> Result<(), KeyStoreError>;
}

/// The embedded key store.
#[derive(Debug, Default)]
pub struct MemoryKeyStore {
    inner: Mutex<MemoryKeys>,
}

#[derive(Debug, Default)]
struct MemoryKeys {
    by_hash: HashMap<KeyHash, KeyRecord>,
    by_id: HashMap<String, KeyHash>,
}

impl MemoryKeyStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryKeys> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl KeyStore for MemoryKeyStore {
    async fn insert(&self, key: &ApiKey, record: &KeyRecord) -> Result<(), KeyStoreError> {
        let mut keys = self.lock();
        keys.by_id.insert(record.key_id.clone(), key.hash());
        keys.by_hash.insert(key.hash(), record.clone());
        Ok(())
    }

    async fn lookup(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, KeyStoreError> {
        Ok(self.lock().by_hash.get(hash).cloned())
    }

    async fn revoke(&self, key_id: &str) -> Result<Option<KeyRecord>, KeyStoreError> {
        let mut keys = self.lock();
        let Some(hash) = keys.by_id.get(key_id).cloned() else {
            return Ok(None);
        };
        Ok(keys.by_hash.get_mut(&hash).map(|r| {
            r.revoked = true;
            r.clone()
        }))
    }

    async fn has_user(&self, user: &UserId) -> Result<bool, KeyStoreError> {
        Ok(self.lock().by_hash.values().any(|r| &r.user == user))
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_long_random_and_hashed() {
        let (a, b) = (ApiKey::generate().unwrap(), ApiKey::generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 3 + 64);
        assert!(a.expose().starts_with(KEY_PREFIX));
        assert_eq!(a.hash().as_str().len(), 64);
        assert_ne!(a.hash().as_str(), a.expose());
        assert_eq!(format!("{a:?}"), "ApiKey(***)");
        assert!(is_key_id(&generate_key_id().unwrap()));
        assert!(!is_key_id("kid_xyz") && !is_key_id("kid_0123456789abcdef:"));
    }

    #[test]
    fn secrets_compare() {
        assert!(secrets_equal("s3cret", "s3cret"));
        assert!(!secrets_equal("s3cret", "s3creT"));
        assert!(!secrets_equal("s3cret", ""));
    }

    #[tokio::test]
    async fn memory_store_revokes() {
        let store = MemoryKeyStore::new();
        let key = ApiKey::generate().unwrap();
        let record = KeyRecord {
            key_id: generate_key_id().unwrap(),
            user: UserId::new("alice").unwrap(),
            created_ms: 1,
            revoked: false,
        };
        store.insert(&key, &record).await.unwrap();
        assert_eq!(
            store.lookup(&key.hash()).await.unwrap(),
            Some(record.clone())
        );
        assert!(store.revoke(&record.key_id).await.unwrap().unwrap().revoked);
        assert!(store.lookup(&key.hash()).await.unwrap().unwrap().revoked);
        assert_eq!(store.revoke("kid_0000000000000000").await.unwrap(), None);
    }
}
