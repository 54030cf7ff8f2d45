//! `tollgate api`: serves the HTTP api against Redis until SIGINT or SIGTERM,
//! then finishes the requests in flight. It listens from its start: while it
//! waits for Redis, `/healthz` answers and the rest is 503 (`health::Starting`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate_api::health::Starting;
use tollgate_api::state::{ApiState, Settings};

use crate::process::{exit, fail, shutdown_signal};
use crate::store::{Failure, StoreArgs, Wait};

#[derive(Debug, Args)]
pub struct ApiArgs {
    #[command(flatten)]
    store: StoreArgs,

    /// Where the api listens, and its bounds and request knobs.
    #[command(flatten)]
    edge: crate::edge::EdgeArgs,

    /// Token that guards /admin/* (unset: the admin routes answer 403).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,

    /// A read-only token: it opens the dashboard and its read-only data
    /// (`/admin/overview`), nothing else (the admin routes answer it 403). At
    /// least 16 characters, and not the admin token. Unset: only the admin
    /// token opens the dashboard.
    #[arg(long, env = "TOLLGATE_VIEWER_TOKEN", hide_env_values = true)]
    viewer_token: Option<String>,

    /// Largest accepted request body, in bytes (larger: 413).
    #[arg(long, env = "TOLLGATE_BODY_LIMIT", default_value_t = tollgate_api::state::DEFAULT_BODY_LIMIT)]
    body_limit: usize,

    /// How long a synchronous operation call waits for its result, in ms,
    /// before answering 202 with the job's Location (a whole pass-through
    /// call waits for its job's end).
    #[arg(long, env = "TOLLGATE_SYNC_TIMEOUT_MS", default_value_t = 30_000)]
    sync_timeout_ms: u64,

    /// Behind a reverse proxy: the header that carries the client's address
    /// (e.g. X-Forwarded-For; its last entry is used), for the limiter of
    /// failed authentications. Unset: the TCP peer's address; no header is
    /// trusted by default.
    #[arg(long, env = "TOLLGATE_TRUSTED_PROXY_HEADER")]
    trusted_proxy_header: Option<tollgate_api::HeaderName>,

    /// Redis connections in the pool. Each is multiplexed: calls share them
    /// (a call never waits for a free one); more connections spread the load
    /// over more sockets.
    #[arg(long, env = "TOLLGATE_REDIS_POOL", default_value_t = 16)]
    redis_pool: usize,
}

pub async fn run(args: ApiArgs) -> ExitCode {
    if let Some(viewer) = &args.viewer_token {
        if let Err(e) = tollgate_api::auth::check_viewer_token(viewer, args.admin_token.as_deref())
        {
            return Failure::bad_input(e).exit();
        }
    }
    let config = match args.store.load_config() {
        Ok(c) => Arc::new(c),
        Err(f) => return f.exit(),
    };
    if let Some(token) = &args.admin_token {
        if let Err(f) = crate::edge::check_admin_token(token) {
            return f.exit();
        }
    }
    let requests = match args.edge.requests.settings() {
        Ok(s) => s,
        Err(f) => return f.exit(),
    };
    // Listening before the store answers: a role started while Redis is down
    // is alive (`/healthz`) and says it is not ready yet.
    let listener = match args.edge.bind().await {
        Ok(l) => l,
        Err(f) => return f.exit(),
    };
    let starting = Starting::default();
    let server = tokio::spawn(tollgate_api::serve(
        starting.router(),
        listener,
        shutdown_signal(),
    ));
    let backends = match args
        .store
        .shared(
            "the api role",
            config,
            args.redis_pool,
            Wait::UntilReachable,
        )
        .await
    {
        Ok(b) => b,
        Err(f) => {
            server.abort();
            return f.exit();
        }
    };
    let settings = Settings {
        admin_token: args.admin_token,
        viewer_token: args.viewer_token,
        body_limit: args.body_limit,
        sync_timeout: Duration::from_millis(args.sync_timeout_ms),
        trusted_proxy_header: args.trusted_proxy_header,
        ..requests
    };
    tracing::info!(
        store = %backends.described, admin = settings.admin_token.is_some(), "api starting"
    );
    let state = ApiState::new(&backends, settings);
    starting.ready(tollgate_api::router(state.clone()));
    let served = match server.await {
        Ok(served) => served,
        Err(e) => Err(std::io::Error::other(format!(
            "the api server task failed: {e}"
        ))),
    };
    tollgate_api::drain(&state).await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::FAILURE, e),
    }
}
