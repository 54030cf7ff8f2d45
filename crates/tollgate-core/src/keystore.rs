//! API keys: how they are made, how they are stored (only as a SHA-256 hash), and
//! the [`KeyStore`] interface (its in-memory backend is `tollgate_memory::keystore`).
//!
//! A key is `tg_<kind>_` + 36 base62 characters (from the OS's generator, ~214
//! bits) + a 6-character base62 CRC32 of everything before it, e.g.
//! `tg_user_…` for a user's key, `tg_svc_…` for a service key (which acts for
//! the users it names, see [`KeyKind::Service`]). The checksum lets
//! [`KeyShape::of`] refuse a random or mistyped key in process, before any store
//! is asked, as GitHub's `ghp_` tokens do. Keys issued before this format,
//! `tg_` + 64 hex digits ([`KeyShape::Legacy`]), are still looked up.
//!
//! A key is shown once, when it is issued; the store keeps `sha256(key)` ->
//! [`KeyRecord`], so a leaked store reveals no usable key. Each key also has a
//! public id (`kid_...`) that names it in logs and in `DELETE /admin/keys/{key_id}`.

use std::fmt;

use async_trait::async_trait;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::StoreError;
use crate::id::UserId;

/// What every issued key starts with: makes leaked keys easy to grep for.
pub const KEY_PREFIX: &str = "tg_";
/// The prefix of a user's API key.
pub const USER_KEY_PREFIX: &str = "tg_user_";
/// The prefix of a service key.
pub const SERVICE_KEY_PREFIX: &str = "tg_svc_";
/// Random base62 characters in a key.
pub const KEY_RANDOM_LEN: usize = 36;
/// Base62 characters of a key's checksum (a CRC32: 62^6 > 2^32).
pub const KEY_CHECKSUM_LEN: usize = 6;
/// The base62 alphabet of a key's random part and checksum.
pub const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// What kind of key a well-formed key is, by its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyKind {
    /// A user's own key: every call is that user's.
    #[default]
    User,
    /// A service's key: each call names the user it acts for
    /// (`Tollgate-User`), whose budget pays; the audit trail records the key.
    Service,
}

impl KeyKind {
    /// The prefix of this kind's keys.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::User => USER_KEY_PREFIX,
            Self::Service => SERVICE_KEY_PREFIX,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Service => "service",
        }
    }

    /// The inverse of [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "user" => Some(Self::User),
            "service" => Some(Self::Service),
            _ => None,
        }
    }
}

/// The shape of a presented key, read without any store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyShape {
    /// `tg_<kind>_<random><checksum>` with a checksum that matches.
    Current(KeyKind),
    /// `tg_` + 64 lowercase hex digits: a key issued before checksums.
    Legacy,
}

/// Why a presented key was refused without a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MalformedKey {
    #[error("not a tollgate API key (expected tg_user_...)")]
    Shape,
    #[error("the API key's checksum does not match (mistyped or truncated?)")]
    Checksum,
}

impl KeyShape {
    /// Reads `presented`'s shape: a key of neither shape, or one whose checksum
    /// does not match, can name no stored key.
    pub fn of(presented: &str) -> Result<Self, MalformedKey> {
        let kinds = [
            (USER_KEY_PREFIX, KeyKind::User),
            (SERVICE_KEY_PREFIX, KeyKind::Service),
        ];
        for (prefix, kind) in kinds {
            let Some(rest) = presented.strip_prefix(prefix) else {
                continue;
            };
            if rest.len() != KEY_RANDOM_LEN + KEY_CHECKSUM_LEN
                || !rest.bytes().all(|b| b.is_ascii_alphanumeric())
            {
                return Err(MalformedKey::Shape);
            }
            let (body, sum) = presented.split_at(presented.len() - KEY_CHECKSUM_LEN);
            return if checksum(body) == sum {
                Ok(Self::Current(kind))
            } else {
                Err(MalformedKey::Checksum)
            };
        }
        match presented.strip_prefix(KEY_PREFIX) {
            Some(h)
                if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) =>
            {
                Ok(Self::Legacy)
            }
            _ => Err(MalformedKey::Shape),
        }
    }
}

/// The checksum of a key's `body` (prefix and random part): its CRC32
/// (IEEE) in base62, zero-padded to [`KEY_CHECKSUM_LEN`] characters.
pub fn checksum(body: &str) -> String {
    let mut n = u64::from(crc32(body.as_bytes()));
    let mut out = [b'0'; KEY_CHECKSUM_LEN];
    for slot in out.iter_mut().rev() {
        *slot = BASE62[(n % 62) as usize];
        n /= 62;
    }
    out.iter().map(|&b| char::from(b)).collect()
}

/// CRC-32/ISO-HDLC (zlib's, GitHub's token checksum), bit by bit: keys are short.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
/// What every public key id starts with.
pub const KEY_ID_PREFIX: &str = "kid_";

/// A freshly issued secret key. Its `Debug` does not show the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// A user key: [`USER_KEY_PREFIX`], [`KEY_RANDOM_LEN`] base62 characters
    /// from the operating system's generator, and their [`checksum`].
    pub fn generate() -> Result<Self, KeyStoreError> {
        Self::generate_kind(KeyKind::User)
    }

    /// A key of `kind`: its prefix, then as [`ApiKey::generate`].
    pub fn generate_kind(kind: KeyKind) -> Result<Self, KeyStoreError> {
        let prefix = kind.prefix();
        let mut body = String::from(prefix);
        while body.len() < prefix.len() + KEY_RANDOM_LEN {
            // Bytes >= 248 are dropped so that each character is uniform
            // (248 = 4 * 62).
            for b in random_bytes::<32>()? {
                if b < 248 && body.len() < prefix.len() + KEY_RANDOM_LEN {
                    body.push(char::from(BASE62[usize::from(b % 62)]));
                }
            }
        }
        let sum = checksum(&body);
        Ok(Self(body + &sum))
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
    /// The user whose key it is; for a service key, the service's own name
    /// (it pays nothing: each call charges the user it names).
    pub user: UserId,
    pub created_ms: u64,
    pub revoked: bool,
    pub kind: KeyKind,
    /// A service key: the plans it may give a user with `Tollgate-Plan`
    /// (empty: none; users it names keep their plan, or the default).
    pub allowed_plans: Vec<String>,
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

/// A request for one page of the users index ([`KeyStore::users`]): the
/// users issued a key whose id starts with `prefix`, in byte order of their
/// ids, after `after` (from the first when `None`), at most `limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserQuery {
    prefix: String,
    after: Option<UserId>,
    limit: usize,
}

/// A bad [`UserQuery`] (the HTTP edge answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserQueryError {
    #[error("limit must be between 1 and {max}, got {0}", max = UserQuery::MAX_LIMIT)]
    BadLimit(usize),
    #[error("prefix: {0}")]
    BadPrefix(String),
    #[error("cursor: not a cursor this server returned (expected the next_cursor of a page)")]
    BadCursor,
}

impl UserQuery {
    /// Users per page when the caller names no limit.
    pub const DEFAULT_LIMIT: usize = 50;
    /// The most a page holds: each user of a page costs a few reads (its
    /// keys, its plan) besides the one range read of the index.
    pub const MAX_LIMIT: usize = 100;

    /// `prefix` is empty or the start of a user id (its characters);
    /// `cursor` the `next_cursor` of the page before (a user id).
    pub fn new(prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Self, UserQueryError> {
        if limit == 0 || limit > Self::MAX_LIMIT {
            return Err(UserQueryError::BadLimit(limit));
        }
        if !prefix.is_empty() {
            UserId::new(prefix).map_err(|e| UserQueryError::BadPrefix(e.to_string()))?;
        }
        let after = cursor
            .map(|c| UserId::new(c).map_err(|_| UserQueryError::BadCursor))
            .transpose()?;
        Ok(Self {
            prefix: prefix.to_owned(),
            after,
            limit,
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn after(&self) -> Option<&UserId> {
        self.after.as_ref()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Where the page starts: after `after`, or at `prefix` when `after` is
    /// before it. `(true, s)`: after `s`; `(false, s)`: at `s` (inclusive).
    pub fn start(&self) -> (bool, &str) {
        match &self.after {
            Some(a) if a.as_str() >= self.prefix.as_str() => (true, a.as_str()),
            _ => (false, self.prefix.as_str()),
        }
    }

    /// Whether `user` belongs to this query's range (prefix and cursor).
    pub fn matches(&self, user: &UserId) -> bool {
        let (exclusive, start) = self.start();
        user.as_str().starts_with(&self.prefix)
            && if exclusive {
                user.as_str() > start
            } else {
                user.as_str() >= start
            }
    }
}

/// One page of users ([`KeyStore::users`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UserPage {
    pub users: Vec<UserId>,
    /// Pass as the next query's cursor; `None`: the last page.
    pub next_cursor: Option<UserId>,
}

impl UserPage {
    /// The page `query` asked for, from the users read in order after its
    /// start, up to `query.limit() + 1`: one past the limit only says that
    /// there is a next page.
    pub fn read(query: &UserQuery, mut users: Vec<UserId>) -> Self {
        let more = users.len() > query.limit();
        users.truncate(query.limit());
        Self {
            next_cursor: users.last().filter(|_| more).cloned(),
            users,
        }
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

    /// One page of the users issued a key (the users index): O(page).
    async fn users(&self, query: &UserQuery) -> Result<UserPage, KeyStoreError>;

    /// Every key issued to `user` (revoked ones too), oldest first.
    async fn user_keys(&self, user: &UserId) -> Result<Vec<KeyRecord>, KeyStoreError>;

    /// Adds to the users index every user with a key that is missing from
    /// it (keys issued before the index existed); returns how many users it
    /// saw. Idempotent; safe while keys are issued.
    async fn reindex(&self) -> Result<u64, KeyStoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_long_random_and_hashed() {
        let (a, b) = (ApiKey::generate().unwrap(), ApiKey::generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(
            a.expose().len(),
            USER_KEY_PREFIX.len() + KEY_RANDOM_LEN + KEY_CHECKSUM_LEN
        );
        assert!(a.expose().starts_with(USER_KEY_PREFIX));
        assert_eq!(
            KeyShape::of(a.expose()),
            Ok(KeyShape::Current(KeyKind::User))
        );
        assert_eq!(a.hash().as_str().len(), 64);
        assert_ne!(a.hash().as_str(), a.expose());
        assert_eq!(format!("{a:?}"), "ApiKey(***)");
        assert!(is_key_id(&generate_key_id().unwrap()));
        assert!(!is_key_id("kid_xyz") && !is_key_id("kid_0123456789abcdef:"));
    }

    #[test]
    fn service_keys_have_their_prefix() {
        let key = ApiKey::generate_kind(KeyKind::Service).unwrap();
        assert!(key.expose().starts_with(SERVICE_KEY_PREFIX));
        assert_eq!(
            key.expose().len(),
            SERVICE_KEY_PREFIX.len() + KEY_RANDOM_LEN + KEY_CHECKSUM_LEN
        );
        assert_eq!(
            KeyShape::of(key.expose()),
            Ok(KeyShape::Current(KeyKind::Service))
        );
        for kind in [KeyKind::User, KeyKind::Service] {
            assert_eq!(KeyKind::parse(kind.as_str()), Some(kind));
        }
    }

    #[test]
    fn crc32_is_zlibs() {
        // The standard check value of CRC-32/ISO-HDLC.
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(checksum(""), "000000");
    }

    /// Every issued key round-trips, and every single-character change of it
    /// (each position, each character of the alphabet) is refused without a
    /// lookup: a checksum mismatch, or a shape that names no key.
    #[test]
    fn any_single_character_change_is_refused() {
        let alphabet: Vec<char> = BASE62
            .iter()
            .copied()
            .chain(*b"_-.+/= ")
            .map(char::from)
            .collect();
        for _ in 0..8 {
            let key = ApiKey::generate().unwrap();
            let key = key.expose();
            assert_eq!(KeyShape::of(key), Ok(KeyShape::Current(KeyKind::User)));
            let chars: Vec<char> = key.chars().collect();
            for i in 0..chars.len() {
                for &c in &alphabet {
                    if c == chars[i] {
                        continue;
                    }
                    let mut changed = chars.clone();
                    changed[i] = c;
                    let changed: String = changed.into_iter().collect();
                    assert!(KeyShape::of(&changed).is_err(), "{changed} accepted");
                }
                let mut dropped = chars.clone();
                dropped.remove(i);
                let dropped: String = dropped.into_iter().collect();
                assert!(KeyShape::of(&dropped).is_err(), "{dropped} accepted");
            }
        }
    }

    #[test]
    fn shapes() {
        let legacy = format!("tg_{}", "0a".repeat(32));
        assert_eq!(KeyShape::of(&legacy), Ok(KeyShape::Legacy));
        assert_eq!(
            KeyShape::of(&legacy.to_uppercase()),
            Err(MalformedKey::Shape)
        );
        assert_eq!(KeyShape::of(&legacy[..66]), Err(MalformedKey::Shape));
        for bad in [
            "",
            "tg_",
            "tg_user_",
            "sk_live_abc",
            "tg_user_\u{e9}",
            "Bearer",
        ] {
            assert_eq!(KeyShape::of(bad), Err(MalformedKey::Shape), "{bad}");
        }
        let body = format!("{SERVICE_KEY_PREFIX}{}", "a".repeat(KEY_RANDOM_LEN));
        let svc = format!("{body}{}", checksum(&body));
        assert_eq!(KeyShape::of(&svc), Ok(KeyShape::Current(KeyKind::Service)));
        // A user key's body under another kind's checksum.
        let user = format!("{USER_KEY_PREFIX}{}", "a".repeat(KEY_RANDOM_LEN));
        assert_eq!(
            KeyShape::of(&format!("{user}{}", checksum(&body))),
            Err(MalformedKey::Checksum)
        );
    }

    #[test]
    fn secrets_compare() {
        assert!(secrets_equal("s3cret", "s3cret"));
        assert!(!secrets_equal("s3cret", "s3creT"));
        assert!(!secrets_equal("s3cret", ""));
    }
}
