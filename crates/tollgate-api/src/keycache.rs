//! [`KeyCache`]: API key lookups remembered in process for a few seconds, found
//! or not, so that a valid caller's key costs Redis one lookup per
//! [`KEY_TTL`] instead of one per call, and a repeated bad key reaches Redis at
//! most once per [`KEY_TTL`].
//!
//! **Bound:** a key revoked through this process (`DELETE /admin/keys/{id}`)
//! stops working at once; revoked elsewhere (another api pod, `tollgate users
//! revoke`), it keeps working here for at most [`KEY_TTL`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tollgate_core::{
    id::UserId,
    keystore::{ApiKey, KeyHash, KeyRecord, KeyStore, KeyStoreError},
};

/// How long a lookup's answer (a record, or "no such key") is reused.
pub const KEY_TTL: Duration = Duration::from_secs(5);
/// Entries kept at most; past it expired ones are dropped, then all if need be.
const MAX_ENTRIES: usize = 100_000;

/// A [`KeyStore`] in front of another, remembering lookups for [`KEY_TTL`].
#[derive(Debug)]
pub struct KeyCache {
    inner: std::sync::Arc<dyn KeyStore>,
    entries: Mutex<HashMap<KeyHash, (Option<KeyRecord>, Instant)>>,
}

impl KeyCache {
    pub fn new(inner: std::sync::Arc<dyn KeyStore>) -> Self {
        Self {
            inner,
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<KeyHash, (Option<KeyRecord>, Instant)>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered answer for `hash`, without asking the store: `None` when
    /// nothing fresh is remembered, `Some(None)` for a key known not to exist.
    pub fn cached(&self, hash: &KeyHash) -> Option<Option<KeyRecord>> {
        let now = Instant::now();
        let mut entries = self.entries();
        match entries.get(hash) {
            Some((record, until)) if *until > now => Some(record.clone()),
            Some(_) => {
                entries.remove(hash);
                None
            }
            None => None,
        }
    }

    fn remember(&self, hash: &KeyHash, record: Option<KeyRecord>) {
        let now = Instant::now();
        let mut entries = self.entries();
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, (_, until)| *until > now);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(hash.clone(), (record, now + KEY_TTL));
    }
}

#[async_trait]
impl KeyStore for KeyCache {
    async fn insert(&self, key: &ApiKey, record: &KeyRecord) -> Result<(), KeyStoreError> {
        self.inner.insert(key, record).await?;
        self.entries().remove(&key.hash());
        Ok(())
    }

    async fn lookup(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, KeyStoreError> {
        if let Some(record) = self.cached(hash) {
            return Ok(record);
        }
        let record = self.inner.lookup(hash).await?;
        self.remember(hash, record.clone());
        Ok(record)
    }

    async fn revoke(&self, key_id: &str) -> Result<Option<KeyRecord>, KeyStoreError> {
        let revoked = self.inner.revoke(key_id).await?;
        self.entries()
            .retain(|_, (record, _)| record.as_ref().is_none_or(|r| r.key_id != key_id));
        Ok(revoked)
    }

    async fn has_user(&self, user: &UserId) -> Result<bool, KeyStoreError> {
        self.inner.has_user(user).await
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        self.inner.ping().await
    }

    async fn users(
        &self,
        query: &tollgate_core::keystore::UserQuery,
    ) -> Result<tollgate_core::keystore::UserPage, KeyStoreError> {
        self.inner.users(query).await
    }

    async fn user_keys(&self, user: &UserId) -> Result<Vec<KeyRecord>, KeyStoreError> {
        self.inner.user_keys(user).await
    }

    async fn reindex(&self) -> Result<u64, KeyStoreError> {
        self.inner.reindex().await
    }
}
