//! Reservation leases in Redis: one sorted set per deployment
//! (`<prefix>:v1:reservations`), member `"<user> <request id>"` (neither id can
//! hold a space), score the end of the lease in ms. Plain commands: a lease
//! decides no budget, it only tells the reconciler where to look.

use async_trait::async_trait;
use tollgate_core::{LeaseError, RequestId, ReservationLeases, UserId};

use crate::call::{self, CallError};
use crate::keys::KeySpace;
use crate::pool::{Pool, DEFAULT_TIMEOUT};

/// The distributed [`ReservationLeases`].
#[derive(Debug)]
pub struct RedisLeases {
    pool: Pool,
    key: String,
}

impl From<CallError> for LeaseError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Unavailable(m) => Self::Unavailable(m),
            CallError::Backend(m) => Self::Backend(m),
        }
    }
}

fn member(user: &UserId, request: &RequestId) -> String {
    format!("{user} {request}")
}

impl RedisLeases {
    pub fn new(pool: Pool, keys: &KeySpace) -> Self {
        Self {
            pool,
            key: keys.reservation_leases(),
        }
    }
}

#[async_trait]
impl ReservationLeases for RedisLeases {
    async fn open(
        &self,
        user: &UserId,
        request: &RequestId,
        until_ms: u64,
    ) -> Result<(), LeaseError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD")
            .arg(&self.key)
            .arg(until_ms)
            .arg(member(user, request))
            .ignore();
        call::pipeline::<()>(&self.pool, DEFAULT_TIMEOUT, "lease_open", &pipe)
            .await
            .map_err(LeaseError::from)
    }

    async fn close(&self, user: &UserId, request: &RequestId) -> Result<(), LeaseError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZREM")
            .arg(&self.key)
            .arg(member(user, request))
            .ignore();
        call::pipeline::<()>(&self.pool, DEFAULT_TIMEOUT, "lease_close", &pipe)
            .await
            .map_err(LeaseError::from)
    }

    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<(UserId, RequestId)>, LeaseError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZRANGE")
            .arg(&self.key)
            .arg("-inf")
            .arg(now_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit);
        let (members,): (Vec<String>,) =
            call::pipeline(&self.pool, DEFAULT_TIMEOUT, "lease_due", &pipe)
                .await
                .map_err(LeaseError::from)?;
        Ok(members
            .iter()
            .filter_map(|m| {
                let (u, r) = m.split_once(' ')?;
                Some((UserId::new(u).ok()?, RequestId::new(r).ok()?))
            })
            .collect())
    }
}
