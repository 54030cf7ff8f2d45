//! [`OpenStreams`]: how many streamed answers each user has open on this api
//! pod, bounded by the user's plan (`max_open_streams`). A stream is
//! admitted before its job is submitted (nothing is charged for a refusal)
//! and counted until its answer ends, whichever way ([`StreamSlot`] gives its
//! place back when dropped).
//!
//! The count is this pod's: a stream lives on the pod that holds its client,
//! and what it costs (a reader in the pod's stream hub, a buffer, a
//! connection) is that pod's. With several api pods a user may have
//! `max_open_streams` on each.
//!
//! The user's plan is looked up only when the plans set different bounds,
//! and then kept for [`PLAN_TTL`]: a plan change reaches the bound within it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::config::Config;
use tollgate_core::id::UserId;
use tollgate_core::ledger::Ledger;
use tollgate_core::lock;

use crate::problem::ApiError;

/// How long a user's looked-up bound is used before it is asked again.
pub const PLAN_TTL: Duration = Duration::from_secs(10);
/// The longest a plan look-up may take; past it the default plan's bound
/// applies (and is not kept).
const LOOKUP_WAIT: Duration = Duration::from_millis(500);

/// The users' open streams on this pod.
#[derive(Debug, Default)]
pub struct OpenStreams {
    counts: Arc<Mutex<HashMap<UserId, u32>>>,
    bounds: Mutex<HashMap<UserId, (Instant, u32)>>,
}

/// One admitted stream's place in its user's count, given back on drop.
#[derive(Debug)]
pub struct StreamSlot {
    user: UserId,
    counts: Arc<Mutex<HashMap<UserId, u32>>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut counts = lock(&self.counts);
        if let Some(n) = counts.get_mut(&self.user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.user);
            }
        }
    }
}

impl OpenStreams {
    /// Admits one more stream of `user`, or refuses it (429
    /// `too-many-streams`) when the user has its plan's `max_open_streams`
    /// open on this pod.
    pub async fn admit(
        &self,
        config: &Config,
        ledger: &dyn Ledger,
        user: &UserId,
    ) -> Result<StreamSlot, ApiError> {
        let limit = self.bound(config, ledger, user).await;
        let mut counts = lock(&self.counts);
        let open = counts.entry(user.clone()).or_insert(0);
        if *open >= limit {
            return Err(ApiError::TooManyStreams { open: *open, limit });
        }
        *open += 1;
        Ok(StreamSlot {
            user: user.clone(),
            counts: Arc::clone(&self.counts),
        })
    }

    /// Streams open on this pod now, of every user.
    pub fn open(&self) -> u64 {
        lock(&self.counts).values().map(|n| u64::from(*n)).sum()
    }

    /// `user`'s bound: the default plan's when every plan has the same.
    async fn bound(&self, config: &Config, ledger: &dyn Ledger, user: &UserId) -> u32 {
        let default = config.default_plan().max_open_streams;
        if config.plans().all(|p| p.max_open_streams == default) {
            return default;
        }
        let now = Instant::now();
        {
            let mut bounds = lock(&self.bounds);
            match bounds.get(user) {
                Some((at, bound)) if now.duration_since(*at) < PLAN_TTL => return *bound,
                Some(_) => {
                    bounds.remove(user);
                }
                None => {}
            }
        }
        match tokio::time::timeout(LOOKUP_WAIT, ledger.plan(user)).await {
            Ok(Ok(plan)) => {
                let bound = config.plan_or_default(Some(&plan)).max_open_streams;
                let mut bounds = lock(&self.bounds);
                // Bounded by the users seen within a TTL.
                bounds.retain(|_, (at, _)| now.duration_since(*at) < PLAN_TTL);
                bounds.insert(user.clone(), (now, bound));
                bound
            }
            _ => default,
        }
    }
}
