//! The embedded key store ([`MemoryKeyStore`]): key records by hash, by id and
//! by user, in this process's memory. Keys themselves (their shape, hashing,
//! ids) and the [`KeyStore`] trait are `tollgate_core::keystore`.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;

use tollgate_core::id::UserId;
use tollgate_core::keystore::{
    ApiKey, KeyHash, KeyRecord, KeyStore, KeyStoreError, UserPage, UserQuery,
};

/// The embedded key store.
#[derive(Debug, Default)]
pub struct MemoryKeyStore {
    inner: Mutex<MemoryKeys>,
}

#[derive(Debug, Default)]
struct MemoryKeys {
    by_hash: HashMap<KeyHash, KeyRecord>,
    by_id: HashMap<String, KeyHash>,
    /// The users index: user -> its key ids, in issue order.
    by_user: std::collections::BTreeMap<String, Vec<String>>,
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
        keys.by_user
            .entry(record.user.as_str().to_owned())
            .or_default()
            .push(record.key_id.clone());
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
        Ok(self.lock().by_user.contains_key(user.as_str()))
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        Ok(())
    }

    async fn users(&self, query: &UserQuery) -> Result<UserPage, KeyStoreError> {
        let keys = self.lock();
        let (exclusive, start) = query.start();
        let from = if exclusive {
            std::ops::Bound::Excluded(start)
        } else {
            std::ops::Bound::Included(start)
        };
        let users: Vec<UserId> = keys
            .by_user
            .range::<str, _>((from, std::ops::Bound::Unbounded))
            .map(|(u, _)| u)
            .take_while(|u| u.starts_with(query.prefix()))
            .take(query.limit() + 1)
            .filter_map(|u| UserId::existing(u.as_str()).ok())
            .collect();
        Ok(UserPage::read(query, users))
    }

    async fn user_keys(&self, user: &UserId) -> Result<Vec<KeyRecord>, KeyStoreError> {
        let keys = self.lock();
        let mut records: Vec<KeyRecord> = keys
            .by_user
            .get(user.as_str())
            .into_iter()
            .flatten()
            .filter_map(|id| keys.by_hash.get(keys.by_id.get(id)?).cloned())
            .collect();
        records.sort_by(|a, b| (a.created_ms, &a.key_id).cmp(&(b.created_ms, &b.key_id)));
        Ok(records)
    }

    async fn reindex(&self) -> Result<u64, KeyStoreError> {
        // Indexed as each key is inserted.
        Ok(self.lock().by_user.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::keystore::{generate_key_id, KeyKind};

    #[tokio::test]
    async fn memory_store_revokes() {
        let store = MemoryKeyStore::new();
        let key = ApiKey::generate().unwrap();
        let record = KeyRecord {
            key_id: generate_key_id().unwrap(),
            user: UserId::new("alice").unwrap(),
            created_ms: 1,
            revoked: false,
            kind: KeyKind::User,
            allowed_plans: Vec::new(),
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
