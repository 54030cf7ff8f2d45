//! Dashboard sessions in Redis: one hash per session, `session:<sha256 of its
//! id>`, written by `session_open.lua` and read by `session_touch.lua` (both on
//! Redis `TIME`, so every pod agrees on when a session ends), deleted by
//! logout. The key's own expiry is the idle timeout, restarted by each read and
//! never past the lifetime: an abandoned session leaves nothing behind.

use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use tollgate_core::error::StoreError;
use tollgate_core::session::{NewSession, Role, Session, SessionHash, SessionLimits, SessionStore};

use crate::call;
use crate::keys::KeySpace;
use crate::pool::{Pool, DEFAULT_TIMEOUT};
use crate::scripts::reply::text;

/// The distributed [`SessionStore`].
pub struct RedisSessions {
    pool: Pool,
    keys: KeySpace,
    timeout: Duration,
}

impl std::fmt::Debug for RedisSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.keys.debug_store(f, "RedisSessions")
    }
}

impl RedisSessions {
    pub fn new(pool: Pool, keys: KeySpace) -> Self {
        Self {
            pool,
            keys,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[async_trait]
impl SessionStore for RedisSessions {
    async fn open(
        &self,
        id: &SessionHash,
        session: &NewSession,
        limits: SessionLimits,
    ) -> Result<Session, StoreError> {
        let inv = crate::scripts::session_open(
            &self.keys.session(id),
            session,
            ms(limits.lifetime),
            ms(limits.idle),
        );
        let expires_ms: u64 = call::script(&self.pool, self.timeout, "session_open", &inv).await?;
        Ok(Session {
            role: session.role,
            csrf: session.csrf.clone(),
            credential: session.credential.clone(),
            expires_ms,
        })
    }

    async fn touch(&self, id: &SessionHash, idle: Duration) -> Result<Option<Session>, StoreError> {
        let inv = crate::scripts::session_touch(&self.keys.session(id), ms(idle));
        let reply: Value = call::script(&self.pool, self.timeout, "session_touch", &inv).await?;
        let fields = match &reply {
            Value::Nil | Value::Boolean(false) => return Ok(None),
            Value::Array(fields) => fields,
            other => return Err(call::bad_reply("session_touch", other)),
        };
        let parsed = match fields.as_slice() {
            [role, csrf, credential, expires] => (|| {
                Some(Session {
                    role: Role::parse(&text(role)?)?,
                    csrf: text(csrf)?,
                    credential: text(credential)?,
                    expires_ms: text(expires)?.parse().ok()?,
                })
            })(),
            _ => None,
        };
        parsed
            .map(Some)
            .ok_or_else(|| call::bad_reply("session_touch", &reply))
    }

    async fn close(&self, id: &SessionHash) -> Result<(), StoreError> {
        let cmd = redis::cmd("DEL").arg(self.keys.session(id)).to_owned();
        call::command::<()>(&self.pool, self.timeout, "session_close", &cmd).await
    }
}
