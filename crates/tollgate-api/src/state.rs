//! [`ApiState`]: the backends and settings every handler shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    backend::Backends, config::Config, durability::DurabilityCheck, job::JobQueue,
    keystore::KeyStore, ledger::Ledger, metrics::Metrics, stream::JobStreams, throttle::Throttle,
};

use crate::cost::{Budget, InFlight};
use crate::dashboard::Dashboard;
use crate::health::Probes;

/// Default largest request body, in bytes.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// Default longest wait of a synchronous operation call.
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// Default longest time a request to a route that does not wait for a job may
/// take (its answer is then 503).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Knobs of the api role.
#[derive(Clone)]
pub struct Settings {
    /// Guards `/admin/*`; `None` disables those routes and the dashboard (403).
    pub admin_token: Option<String>,
    /// Opens the dashboard and its read-only routes, nothing else; `None`:
    /// only the admin token does. See [`crate::auth::check_viewer_token`].
    pub viewer_token: Option<String>,
    /// Largest accepted request body (larger: 413).
    pub body_limit: usize,
    /// How long a synchronous call waits for its job before answering 202.
    pub sync_timeout: Duration,
    /// Behind a proxy: the header that carries the client's address (its last
    /// entry), for the limiter of failed authentications. None: the TCP peer.
    pub trusted_proxy_header: Option<axum::http::HeaderName>,
    /// Whether user keys of the old format (`tg_` + 64 hex digits, issued
    /// before keys had a checksum) are still looked up.
    pub legacy_keys: bool,
    /// The longest a request may take on a route that does not wait for a
    /// job (every route but the operation calls); then 503.
    pub request_timeout: Duration,
    /// Whether each finished request writes its line to the log
    /// ([`crate::access_log`]).
    pub access_log: bool,
    /// How often this process samples the dashboard's history
    /// ([`crate::dashboard::history`]); `None`: it samples nothing (the
    /// dashboard shows what other pods sampled).
    pub history_interval: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            admin_token: None,
            viewer_token: None,
            body_limit: DEFAULT_BODY_LIMIT,
            sync_timeout: DEFAULT_SYNC_TIMEOUT,
            trusted_proxy_header: None,
            legacy_keys: true,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            access_log: false,
            history_interval: None,
        }
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("admin_token", &self.admin_token.as_ref().map(|_| "***"))
            .field("viewer_token", &self.viewer_token.as_ref().map(|_| "***"))
            .field("body_limit", &self.body_limit)
            .field("sync_timeout", &self.sync_timeout)
            .field("trusted_proxy_header", &self.trusted_proxy_header)
            .field("legacy_keys", &self.legacy_keys)
            .field("request_timeout", &self.request_timeout)
            .field("access_log", &self.access_log)
            .field("history_interval", &self.history_interval)
            .finish()
    }
}

/// Everything a handler needs. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ApiState {
    pub config: Arc<Config>,
    pub ledger: Arc<dyn Ledger>,
    pub jobs: Arc<dyn JobQueue>,
    pub keys: Arc<dyn KeyStore>,
    /// Read at scrape time for the throttle's gauges; the api never waits on it.
    pub throttle: Arc<dyn Throttle>,
    /// The process's registry (shared with the worker and throttler of `tollgate all`).
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    /// Metered requests still running (a submission, a plain charge and its
    /// refund); [`run`](crate::run) waits for them on shutdown.
    pub in_flight: InFlight,
    /// The operations dashboard: its sessions, the limiter of wrong admin
    /// and viewer tokens, the activity log it reads, its last overview and
    /// chart history.
    pub dashboard: Arc<Dashboard>,
    /// What the store promises an accepted call (`/readyz`).
    pub durability: Arc<dyn DurabilityCheck>,
    /// Streamed answers' readers (the pass-through routes).
    pub streams: Arc<dyn JobStreams>,
    /// Each user's streamed answers open on this pod, within its plan's
    /// `max_open_streams`.
    pub open_streams: Arc<crate::open_streams::OpenStreams>,
    /// The budget alerts' outbox: the dashboard shows its depth and what
    /// every deliverer noted.
    pub alerts: Arc<dyn tollgate_core::alerts::AlertOutbox>,
}

impl ApiState {
    /// The api on `backends` (memory or Redis: it does not know which).
    /// Starts the dashboard's history sampler when `settings` ask for one.
    pub fn new(backends: &Backends, settings: Settings) -> Self {
        let state = Self {
            config: Arc::clone(&backends.config),
            ledger: Arc::clone(&backends.ledger),
            jobs: Arc::clone(&backends.jobs),
            keys: Arc::clone(&backends.keys),
            throttle: Arc::clone(&backends.throttle),
            metrics: Arc::clone(&backends.metrics),
            durability: Arc::clone(&backends.durability),
            streams: Arc::clone(&backends.streams),
            open_streams: Arc::default(),
            alerts: Arc::clone(&backends.alerts),
            dashboard: Arc::new(Dashboard::new(
                Arc::clone(&backends.activity),
                Arc::clone(&backends.sessions),
                settings.trusted_proxy_header.clone(),
            )),
            settings,
            in_flight: InFlight::default(),
        };
        if let Some(interval) = state.settings.history_interval {
            crate::dashboard::history::spawn(
                Arc::downgrade(&state.dashboard),
                Arc::clone(&state.jobs),
                Arc::clone(&state.throttle),
                interval,
            );
        }
        state
    }

    /// What `/readyz` and `/metrics` read.
    pub fn probes(&self) -> Probes {
        Probes {
            keys: Arc::clone(&self.keys),
            jobs: Arc::clone(&self.jobs),
            throttle: Arc::clone(&self.throttle),
            metrics: Arc::clone(&self.metrics),
            durability: Arc::clone(&self.durability),
        }
    }

    /// What the [`Cost`](crate::cost::Cost) layer charges with.
    pub fn budget(&self) -> Budget {
        Budget::new(Arc::clone(&self.ledger), Arc::clone(&self.config))
            .with_metrics(Arc::clone(&self.metrics))
            .with_in_flight(self.in_flight.clone())
    }
}
