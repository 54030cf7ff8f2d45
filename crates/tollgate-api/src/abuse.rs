//! Failed authentications per client address: an in-process limiter (governor,
//! GCRA) that answers 429 to an address that keeps presenting well-formed keys
//! that turn out unknown or revoked. A malformed key (no valid checksum) never
//! reaches it: [`crate::auth`] refuses it first, at no cost. Only an old-format
//! key is stopped before its lookup while its address is over budget; a key
//! with a checksum is always looked up, so a valid one always passes.
//!
//! The client address is the TCP peer's, or, behind a proxy, the last address
//! of the header the operator names (`--trusted-proxy-header`, e.g.
//! `X-Forwarded-For`: the last entry is the one the proxy itself added). No
//! header is trusted unless named: anyone can send one.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request};
use axum::http::HeaderName;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};

/// Failed authentications an address may make at once ...
pub const FAILURE_BURST: u32 = 20;
/// ... and then one per this interval.
pub const FAILURE_INTERVAL: Duration = Duration::from_secs(1);
/// Addresses tracked before idle ones are forgotten.
const MAX_TRACKED: usize = 10_000;

/// The limiter of failed authentications, one budget per client address.
#[derive(Debug)]
pub struct AuthFailures {
    limiter: DefaultKeyedRateLimiter<IpAddr>,
    clock: DefaultClock,
    /// Addresses over their budget, until when: checked before a lookup.
    blocked: Mutex<HashMap<IpAddr, Instant>>,
    trusted_header: Option<HeaderName>,
}

impl AuthFailures {
    /// `trusted_header`: where the client address comes from behind a proxy.
    pub fn new(trusted_header: Option<HeaderName>) -> Self {
        let burst = NonZeroU32::new(FAILURE_BURST).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::with_period(FAILURE_INTERVAL)
            .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
            .allow_burst(burst);
        Self {
            limiter: DefaultKeyedRateLimiter::keyed(quota),
            clock: DefaultClock::default(),
            blocked: Mutex::new(HashMap::new()),
            trusted_header,
        }
    }

    fn blocked(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Instant>> {
        self.blocked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The client's address: the trusted header's last entry when one is
    /// configured and parses, else the TCP peer (unspecified when unknown, as
    /// in tests that call the router directly).
    pub fn client(&self, req: &Request) -> IpAddr {
        let forwarded = self.trusted_header.as_ref().and_then(|name| {
            let value = req
                .headers()
                .get_all(name)
                .iter()
                .next_back()?
                .to_str()
                .ok()?;
            let last = value.rsplit(',').next()?.trim();
            last.parse::<IpAddr>()
                .ok()
                .or_else(|| last.parse::<SocketAddr>().ok().map(|a| a.ip()))
        });
        forwarded
            .or_else(|| {
                req.extensions()
                    .get::<ConnectInfo<SocketAddr>>()
                    .map(|c| c.0.ip())
            })
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }

    /// How long `client` must wait when it is over its budget of failures.
    pub fn wait(&self, client: IpAddr) -> Option<Duration> {
        let now = Instant::now();
        let mut blocked = self.blocked();
        match blocked.get(&client) {
            Some(until) if *until > now => Some(*until - now),
            Some(_) => {
                blocked.remove(&client);
                None
            }
            None => None,
        }
    }

    /// Counts one failed authentication of `client`; returns how long it must
    /// wait when this failure took it over its budget.
    pub fn failed(&self, client: IpAddr) -> Option<Duration> {
        if self.limiter.len() > MAX_TRACKED {
            self.limiter.retain_recent();
        }
        let not_until = self.limiter.check_key(&client).err()?;
        let wait = not_until.wait_time_from(self.clock.now());
        let now = Instant::now();
        let mut blocked = self.blocked();
        if blocked.len() > MAX_TRACKED {
            blocked.retain(|_, until| *until > now);
        }
        blocked.insert(client, now + wait);
        Some(wait)
    }
}
