//! API keys in Redis: `apikey:<sha256>` hashes (the record) and `apikey-id:<id>`
//! strings (id -> hash, for revoking). Neither decides a budget, so plain
//! commands suffice; a key and its id are written in one MULTI.

use std::time::Duration;

use async_trait::async_trait;
use redis::{FromRedisValue, Pipeline};
use tollgate_core::keystore::is_key_id;
use tollgate_core::{
    id::UserId,
    keystore::{ApiKey, KeyHash, KeyKind, KeyRecord, KeyStore, KeyStoreError},
};

use crate::call;
use crate::keys::KeySpace;
use crate::pool::{Pool, DEFAULT_TIMEOUT};
use tollgate_core::error::StoreError;

/// The distributed [`KeyStore`].
pub struct RedisKeyStore {
    pool: Pool,
    keys: KeySpace,
    timeout: Duration,
}

impl std::fmt::Debug for RedisKeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisKeyStore")
            .field("prefix", &self.keys.prefix())
            .finish_non_exhaustive()
    }
}

impl RedisKeyStore {
    pub fn new(pool: Pool, keys: KeySpace) -> Self {
        Self {
            pool,
            keys,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    async fn pipe<T: FromRedisValue>(
        &self,
        op: &'static str,
        pipe: &Pipeline,
    ) -> Result<T, KeyStoreError> {
        call::pipeline(&self.pool, self.timeout, op, pipe)
            .await
            .map_err(KeyStoreError::from)
    }

    /// A pipeline that only reads: sent again once after a connection failure.
    async fn read<T: FromRedisValue>(
        &self,
        op: &'static str,
        pipe: &Pipeline,
    ) -> Result<T, KeyStoreError> {
        call::read(&self.pool, self.timeout, op, pipe)
            .await
            .map_err(KeyStoreError::from)
    }

    async fn record(&self, key: &str) -> Result<Option<KeyRecord>, KeyStoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET").arg(key).arg(&[
            "user",
            "key_id",
            "created_ms",
            "revoked",
            "kind",
            "allowed_plans",
        ]);
        let (fields,): (Vec<Option<String>>,) = self.read("apikey_get", &pipe).await?;
        let bad =
            || KeyStoreError::from(StoreError::backend(format!("malformed key record {key}")));
        match fields.as_slice() {
            [None, ..] => Ok(None),
            [Some(user), Some(key_id), Some(created), revoked, kind, plans] => {
                Ok(Some(KeyRecord {
                    user: UserId::new(user.as_str()).map_err(|_| bad())?,
                    key_id: key_id.clone(),
                    created_ms: created.parse().map_err(|_| bad())?,
                    revoked: revoked.as_deref() == Some("1"),
                    // Records written before service keys have no kind: users'.
                    kind: match kind {
                        None => KeyKind::User,
                        Some(k) => KeyKind::parse(k).ok_or_else(bad)?,
                    },
                    allowed_plans: plans
                        .as_deref()
                        .unwrap_or("")
                        .split(',')
                        .filter(|p| !p.is_empty())
                        .map(str::to_owned)
                        .collect(),
                }))
            }
            _ => Err(bad()),
        }
    }
}

#[async_trait]
impl KeyStore for RedisKeyStore {
    async fn insert(&self, key: &ApiKey, record: &KeyRecord) -> Result<(), KeyStoreError> {
        if !is_key_id(&record.key_id) {
            return Err(
                StoreError::backend(format!("malformed key id {:?}", record.key_id)).into(),
            );
        }
        let hash = key.hash();
        // The three keys live in different hash slots (on a cluster, on
        // different nodes), so no transaction spans them. The indexes go first
        // and the record that makes the key work last: a crash in between
        // leaves an index to nothing (revoking it finds no key), never a
        // working key that cannot be revoked by its id.
        let indexes = [
            redis::cmd("SET")
                .arg(self.keys.api_key_id(&record.key_id))
                .arg(hash.as_str())
                .to_owned(),
            redis::cmd("SADD")
                .arg(self.keys.api_key_user(&record.user))
                .arg(&record.key_id)
                .to_owned(),
        ];
        call::gather::<()>(&self.pool, self.timeout, "apikey_index", &indexes).await?;
        let mut pipe = redis::pipe();
        pipe.cmd("HSET")
            .arg(self.keys.api_key(&hash))
            .arg("user")
            .arg(record.user.as_str())
            .arg("key_id")
            .arg(&record.key_id)
            .arg("created_ms")
            .arg(record.created_ms)
            .arg("revoked")
            .arg(if record.revoked { "1" } else { "0" })
            .arg("kind")
            .arg(record.kind.as_str())
            .arg("allowed_plans")
            .arg(record.allowed_plans.join(","))
            .ignore();
        self.pipe::<()>("apikey_insert", &pipe).await
    }

    async fn lookup(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, KeyStoreError> {
        self.record(&self.keys.api_key(hash)).await
    }

    async fn revoke(&self, key_id: &str) -> Result<Option<KeyRecord>, KeyStoreError> {
        if !is_key_id(key_id) {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(self.keys.api_key_id(key_id));
        let (hash,): (Option<String>,) = self.pipe("apikey_id", &pipe).await?;
        let Some(hash) = hash else {
            return Ok(None);
        };
        let key = self.keys.api_key(&KeyHash::from_hex(hash));
        let mut pipe = redis::pipe();
        // HSET only on an existing record (a hash with a `user` field).
        pipe.cmd("HEXISTS").arg(&key).arg("user");
        let (exists,): (bool,) = self.pipe("apikey_exists", &pipe).await?;
        if !exists {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        pipe.cmd("HSET").arg(&key).arg("revoked").arg("1").ignore();
        self.pipe::<()>("apikey_revoke", &pipe).await?;
        self.record(&key).await
    }

    async fn has_user(&self, user: &UserId) -> Result<bool, KeyStoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("EXISTS").arg(self.keys.api_key_user(user));
        let (exists,): (bool,) = self.read("apikey_user", &pipe).await?;
        Ok(exists)
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("PING");
        // Not `read`: readiness reports what one attempt finds.
        let (_,): (String,) = self.pipe("ping", &pipe).await?;
        Ok(())
    }
}
