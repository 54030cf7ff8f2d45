//! API keys in Redis: `apikey:<sha256>` hashes (the record) and `apikey-id:<id>`
//! strings (id -> hash, for revoking). Neither decides a budget, so plain
//! commands suffice; a key and its id are written in one MULTI.

use std::time::Duration;

use async_trait::async_trait;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{FromRedisValue, Pipeline};
use tollgate_core::keystore::is_key_id;
use tollgate_core::{
    id::UserId,
    keystore::{ApiKey, KeyHash, KeyKind, KeyRecord, KeyStore, KeyStoreError, UserPage, UserQuery},
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
        self.keys.debug_store(f, "RedisKeyStore")
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
                    user: UserId::existing(user.as_str()).map_err(|_| bad())?,
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

/// Keys one `SCAN` step of [`KeyStore::reindex`] looks at: each step is one
/// short command, whatever the keyspace holds.
const REINDEX_SCAN_COUNT: u64 = 1000;

/// Where [`RedisKeyStore::reindex`] scans: the one server, or each primary
/// of a cluster (`host:port`).
enum ScanTarget {
    Single,
    Node { host: String, port: u16 },
}

impl RedisKeyStore {
    /// The servers whose keyspaces together hold every key.
    async fn scan_targets(&self) -> Result<Vec<ScanTarget>, KeyStoreError> {
        let Pool::Cluster(c) = &self.pool else {
            return Ok(vec![ScanTarget::Single]);
        };
        let mut conn = c.connection();
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("NODES");
        let reply = tokio::time::timeout(
            self.timeout,
            conn.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)),
        )
        .await
        .map_err(|_| StoreError::unavailable("Redis did not answer CLUSTER NODES in time"))?
        .map_err(crate::pool::store_error)?;
        let text: String = redis::from_redis_value(reply)
            .map_err(|e| call::bad_reply::<StoreError>("CLUSTER NODES", e))?;
        // `<id> <host:port@cport[,hostname]> <flags> ...`: the live primaries.
        let nodes = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split(' ');
                let (_, addr, flags) = (parts.next()?, parts.next()?, parts.next()?);
                let flags: Vec<&str> = flags.split(',').collect();
                if !flags.contains(&"master") || flags.iter().any(|f| f.starts_with("fail")) {
                    return None;
                }
                let addr = addr.split(['@', ',']).next()?;
                let (host, port) = addr.rsplit_once(':')?;
                Some(ScanTarget::Node {
                    host: host.to_owned(),
                    port: port.parse().ok()?,
                })
            })
            .collect::<Vec<_>>();
        if nodes.is_empty() {
            return Err(StoreError::backend("CLUSTER NODES lists no live primary").into());
        }
        Ok(nodes)
    }

    /// One read-only command on `node`.
    async fn on_node<T: FromRedisValue>(
        &self,
        node: &ScanTarget,
        cmd: redis::Cmd,
    ) -> Result<T, KeyStoreError> {
        match (node, &self.pool) {
            (ScanTarget::Node { host, port }, Pool::Cluster(c)) => {
                let mut conn = c.connection();
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let reply = tokio::time::timeout(self.timeout, conn.route_command(cmd, routing))
                    .await
                    .map_err(|_| StoreError::unavailable("Redis did not answer SCAN in time"))?
                    .map_err(crate::pool::store_error)?;
                Ok(redis::from_redis_value(reply)
                    .map_err(|e| call::bad_reply::<StoreError>("SCAN", e))?)
            }
            _ => {
                let mut pipe = redis::pipe();
                pipe.add_command(cmd);
                let (v,): (T,) = self.read("users_scan", &pipe).await?;
                Ok(v)
            }
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
            redis::cmd("ZADD")
                .arg(self.keys.user_index())
                .arg(0)
                .arg(record.user.as_str())
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

    async fn users(&self, query: &UserQuery) -> Result<UserPage, KeyStoreError> {
        let min = match query.start() {
            (true, after) => format!("({after}"),
            (false, "") => "-".to_owned(),
            (false, prefix) => format!("[{prefix}"),
        };
        // DEL (0x7f) sorts after every character a user id may have.
        let max = match query.prefix() {
            "" => "+".to_owned(),
            prefix => format!("[{prefix}\u{7f}"),
        };
        let mut pipe = redis::pipe();
        pipe.cmd("ZRANGE")
            .arg(self.keys.user_index())
            .arg(min)
            .arg(max)
            .arg("BYLEX")
            .arg("LIMIT")
            .arg(0)
            .arg(query.limit() + 1);
        let (found,): (Vec<String>,) = self.read("users_page", &pipe).await?;
        let bad = |u: &str| {
            KeyStoreError::from(StoreError::backend(format!(
                "malformed user {u:?} in the users index"
            )))
        };
        let users = found
            .iter()
            .map(|u| UserId::existing(u.as_str()).map_err(|_| bad(u)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(UserPage::read(query, users))
    }

    async fn user_keys(&self, user: &UserId) -> Result<Vec<KeyRecord>, KeyStoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("SMEMBERS").arg(self.keys.api_key_user(user));
        let (ids,): (Vec<String>,) = self.read("apikey_user_ids", &pipe).await?;
        let ids: Vec<String> = ids.into_iter().filter(|id| is_key_id(id)).collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // Each id's hash, then each record: the keys live in many slots.
        let gets: Vec<redis::Cmd> = ids
            .iter()
            .map(|id| redis::cmd("GET").arg(self.keys.api_key_id(id)).to_owned())
            .collect();
        let hashes: Vec<Option<String>> =
            call::gather(&self.pool, self.timeout, "apikey_user_hashes", &gets).await?;
        let mut records = Vec::with_capacity(ids.len());
        for hash in hashes.into_iter().flatten() {
            // An index written by an insert that died before its record
            // names no key (see `insert`).
            if let Some(r) = self
                .record(&self.keys.api_key(&KeyHash::from_hex(hash)))
                .await?
            {
                records.push(r);
            }
        }
        records.sort_by(|a, b| (a.created_ms, &a.key_id).cmp(&(b.created_ms, &b.key_id)));
        Ok(records)
    }

    async fn reindex(&self) -> Result<u64, KeyStoreError> {
        let (pattern, head) = self.keys.api_key_user_scan();
        let index = self.keys.user_index();
        let mut seen = 0u64;
        for node in self.scan_targets().await? {
            let mut cursor = 0u64;
            loop {
                let mut scan = redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(REINDEX_SCAN_COUNT);
                let (next, names): (u64, Vec<String>) = self.on_node(&node, scan).await?;
                let users: Vec<&str> = names
                    .iter()
                    .filter_map(|n| n.strip_prefix(head.as_str()))
                    .filter(|u| UserId::existing(*u).is_ok())
                    .collect();
                if !users.is_empty() {
                    let mut zadd = redis::cmd("ZADD");
                    zadd.arg(&index);
                    for u in &users {
                        zadd.arg(0).arg(*u);
                    }
                    let mut pipe = redis::pipe();
                    pipe.add_command(zadd).ignore();
                    self.pipe::<()>("users_reindex", &pipe).await?;
                    seen += users.len() as u64;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(seen)
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("PING");
        // Not `read`: readiness reports what one attempt finds.
        let (_,): (String,) = self.pipe("ping", &pipe).await?;
        Ok(())
    }
}
