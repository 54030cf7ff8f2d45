//! The dashboard's login sessions in this process's memory
//! ([`MemorySessions`]). Sessions, their ids and the [`SessionStore`] trait
//! are `tollgate_core::session`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use tollgate_core::clock::{Clock, SystemClock};
use tollgate_core::error::StoreError;
use tollgate_core::session::{NewSession, Session, SessionHash, SessionLimits, SessionStore};

/// Sessions in this process's memory (`tollgate all` without Redis).
#[derive(Debug, Default)]
pub struct MemorySessions {
    sessions: Mutex<HashMap<SessionHash, (Session, Instant)>>,
}

impl MemorySessions {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl SessionStore for MemorySessions {
    async fn open(
        &self,
        id: &SessionHash,
        session: &NewSession,
        limits: SessionLimits,
    ) -> Result<Session, StoreError> {
        let now = SystemClock.now_ms();
        let lifetime = u64::try_from(limits.lifetime.as_millis()).unwrap_or(u64::MAX);
        let stored = Session {
            role: session.role,
            csrf: session.csrf.clone(),
            credential: session.credential.clone(),
            expires_ms: now.saturating_add(lifetime),
        };
        let idle_until = Instant::now() + limits.idle.min(limits.lifetime);
        let mut sessions = tollgate_core::lock(&self.sessions);
        // Forget the expired ones: the map holds only live sessions.
        sessions.retain(|_, (s, idle)| s.expires_ms > now && *idle > Instant::now());
        if sessions.contains_key(id) {
            return Err(StoreError::backend("session id already in use"));
        }
        sessions.insert(id.clone(), (stored.clone(), idle_until));
        Ok(stored)
    }

    async fn touch(&self, id: &SessionHash, idle: Duration) -> Result<Option<Session>, StoreError> {
        let now_ms = SystemClock.now_ms();
        let now = Instant::now();
        let mut sessions = tollgate_core::lock(&self.sessions);
        let Some((session, idle_until)) = sessions.get_mut(id) else {
            return Ok(None);
        };
        if session.expires_ms <= now_ms || *idle_until <= now {
            sessions.remove(id);
            return Ok(None);
        }
        let left = Duration::from_millis(session.expires_ms - now_ms);
        *idle_until = now + idle.min(left);
        Ok(Some(session.clone()))
    }

    async fn close(&self, id: &SessionHash) -> Result<(), StoreError> {
        tollgate_core::lock(&self.sessions).remove(id);
        Ok(())
    }
}
