//! What a waiter brings to a provider's fair queue: its user's [`Share`] (the
//! plan's `share` and `max_in_flight`), looked up through the [`Ledger`] and
//! kept for a few seconds per user.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::{config::Config, id::UserId, ledger::Ledger, throttle::Share};

/// How long a user's looked-up share is used before it is asked again: a plan
/// change reaches the fair queue within this.
pub const SHARE_TTL: Duration = Duration::from_secs(10);

/// Users' shares from their plans.
pub struct Shares {
    config: Arc<Config>,
    ledger: Option<Arc<dyn Ledger>>,
    cache: Mutex<HashMap<UserId, (Instant, Share)>>,
}

impl std::fmt::Debug for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shares")
            .field("ledger", &self.ledger.is_some())
            .finish_non_exhaustive()
    }
}

impl Shares {
    /// Shares from each user's plan in `ledger`. When every plan has the same
    /// share and no cap, the ledger is never asked.
    pub fn new(config: Arc<Config>, ledger: Arc<dyn Ledger>) -> Self {
        let uniform = config
            .plans()
            .all(|p| p.share == 1 && p.max_in_flight.is_none());
        Self {
            config,
            ledger: (!uniform).then_some(ledger),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Shares whose only use is their `max_in_flight` (the worker's bound of
    /// a user's jobs): the ledger is asked only when some plan sets one.
    pub fn for_caps(config: Arc<Config>, ledger: Arc<dyn Ledger>) -> Self {
        let uncapped = config.plans().all(|p| p.max_in_flight.is_none());
        Self {
            config,
            ledger: (!uncapped).then_some(ledger),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Everyone on the default plan (no ledger at hand).
    pub fn default_plan(config: Arc<Config>) -> Self {
        Self {
            config,
            ledger: None,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn of_plan(&self, plan: Option<&str>, slot_lease: Duration) -> Share {
        let plan = self.config.plan_or_default(plan);
        Share {
            weight: plan.share,
            max_in_flight: plan.max_in_flight,
            slot_lease,
        }
    }

    /// `user`'s share; a slot it holds frees itself after `slot_lease`. A failed
    /// look-up, or one slower than `within` (the caller's wait), counts as the
    /// default plan (and is not kept).
    pub async fn share(&self, user: &UserId, slot_lease: Duration, within: Duration) -> Share {
        let Some(ledger) = &self.ledger else {
            return self.of_plan(None, slot_lease);
        };
        let now = Instant::now();
        {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, share)) = cache.get(user) {
                if now.duration_since(*at) < SHARE_TTL {
                    return Share {
                        slot_lease,
                        ..*share
                    };
                }
            }
        }
        let plan = match tokio::time::timeout(within, ledger.plan(user)).await {
            Ok(plan) => plan,
            Err(_) => {
                tracing::warn!(user = %user, ?within, "plan look-up too slow; the default plan's share is used");
                return self.of_plan(None, slot_lease);
            }
        };
        match plan {
            Ok(plan) => {
                let share = self.of_plan(Some(&plan), slot_lease);
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                if cache.len() > 100_000 {
                    cache.retain(|_, (at, _)| now.duration_since(*at) < SHARE_TTL);
                }
                cache.insert(user.clone(), (now, share));
                share
            }
            Err(e) => {
                tracing::warn!(error = %e, user = %user, "plan look-up failed; the default plan's share is used");
                self.of_plan(None, slot_lease)
            }
        }
    }
}
