//! `tollgate all`: every role in one process.
//!
//! Without `--redis-url` it runs embedded, with zero dependencies: the memory
//! ledger, the in-process throttle and in-memory job queues, and (unless
//! `--provider-url` or the config's `url`s say otherwise) the built-in mock
//! provider. With `--redis-url` the same roles (api, worker, throttler) run
//! against Redis, exactly as separate pods would. Either way it creates a
//! development user and prints its API key with two curl lines to try.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use tollgate_api::state::{ApiState, Settings};
use tollgate_core::config::Config;
use tollgate_core::id::{RequestId, UserId};
use tollgate_throttler::ThrottlerConfig;

use crate::process::{exit, fail};
use crate::role::{self, Stop};
use crate::store::{Failure, StoreArgs, Wait};

#[derive(Debug, Args)]
pub struct AllArgs {
    /// Embedded (`memory`, the default) or against a Redis, exactly as
    /// separate pods would run.
    #[command(flatten)]
    store: StoreArgs,

    /// Where the api listens, and its bounds and request knobs.
    #[command(flatten)]
    edge: crate::edge::EdgeArgs,

    /// Send every provider's calls to this HTTP upstream (e.g. a `tollgate
    /// mock-provider`) instead of the built-in mock or the config's urls.
    #[arg(long, env = "TOLLGATE_PROVIDER_URL", hide_env_values = true)]
    provider_url: Option<String>,

    /// Token that guards /admin/* (default: a random one, printed at start).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,

    /// A read-only token: it opens the dashboard and its read-only data
    /// (`/admin/overview`), nothing else (the admin routes answer it 403). At
    /// least 16 characters, and not the admin token. Unset: only the admin
    /// token opens the dashboard.
    #[arg(long, env = "TOLLGATE_VIEWER_TOKEN", hide_env_values = true)]
    viewer_token: Option<String>,

    /// The development user created at start; its API key is printed.
    #[arg(long, env = "TOLLGATE_DEV_USER", default_value = "dev")]
    dev_user: UserId,

    /// Behind a reverse proxy: the header that carries the client's address
    /// (e.g. X-Forwarded-For; its last entry is used), for the limiter of
    /// failed authentications. Unset: the TCP peer's address; no header is
    /// trusted by default.
    #[arg(long, env = "TOLLGATE_TRUSTED_PROXY_HEADER")]
    trusted_proxy_header: Option<tollgate_api::HeaderName>,

    /// How long a synchronous operation call waits for its result, in ms,
    /// before answering 202 with the job's Location (a whole pass-through
    /// call waits for its job's end).
    #[arg(long, env = "TOLLGATE_SYNC_TIMEOUT_MS", default_value_t = 30_000)]
    sync_timeout_ms: u64,

    /// Jobs the in-process worker runs at once.
    #[arg(long, env = "TOLLGATE_WORKER_CONCURRENCY", default_value_t = 32)]
    concurrency: usize,

    /// The most of a worker's slots one user's jobs hold at once, as a
    /// fraction of --concurrency in (0, 1]: at most max(1, ceil(concurrency ×
    /// share)) of them, the rest of a user's jobs waiting in the queue behind
    /// other users' (a job taken past it goes back to the queue's tail). The
    /// default, 0.5: one user's flood of long calls (streams) never holds more
    /// than half of a worker, leaving the other half to everyone else. 1: no
    /// bound (a deployment with one heavy user); a plan's `max_in_flight`
    /// sets its users' cap instead.
    #[arg(long, env = "TOLLGATE_WORKER_USER_SHARE", default_value_t = tollgate_worker::USER_SHARE, value_parser = crate::worker::user_share)]
    user_share: f64,
}

/// What `tollgate all` adds to the built-in config when it runs with none
/// (and no `--provider-url`): OpenAI- and Anthropic-compatible providers on a
/// mock served in-process (`tollgate mock-provider`'s), so that the official
/// SDKs work at once through the pass-through routes.
const SDK_DEMO: &str = r#"
[providers.openai]
rate = 50
burst = 20
max_wait = "30s"
url = "{mock}/v1"
[providers.anthropic]
rate = 50
burst = 20
max_wait = "30s"
url = "{mock}"
[operations."openai.chat"]
cost = 2
provider = "openai"
path = "/chat/completions"
settle = { from = "/usage/total_tokens", per = 1, max = 200 }
[operations."openai.embeddings"]
cost = 1
provider = "openai"
path = "/embeddings"
settle = { from = "/usage/total_tokens", per = 1, max = 50 }
[operations."anthropic.messages"]
cost = 2
provider = "anthropic"
path = "/v1/messages"
settle = { from = "/usage/output_tokens", per = 1, max = 200 }
"#;

/// The built-in config with [`SDK_DEMO`]'s providers on a mock this process
/// serves on a free loopback port; returns it and the mock's address.
async fn builtin_with_sdk_mock() -> Result<(Config, SocketAddr), Failure> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Failure::other(format!("cannot start the built-in SDK mock: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::other(e.to_string()))?;
    let options = tollgate_mock_provider::MockOptions {
        rate: 1000.0,
        burst: 100,
        ..Default::default()
    };
    tokio::spawn(tollgate_mock_provider::run(
        listener,
        options,
        std::future::pending(),
    ));
    let text = format!(
        "{}\n{}",
        tollgate_core::config::BUILTIN,
        SDK_DEMO.replace("{mock}", &format!("http://{addr}"))
    );
    let config = Config::parse(&text, "<built-in>").map_err(|e| Failure::other(e.to_string()))?;
    Ok((config, addr))
}

pub async fn run(args: AllArgs) -> ExitCode {
    let sdk_mock = args.store.config.is_none() && args.provider_url.is_none();
    let mut config = if sdk_mock {
        match builtin_with_sdk_mock().await {
            Ok((c, _)) => c,
            Err(f) => return f.exit(),
        }
    } else {
        match args.store.load_config() {
            Ok(c) => c,
            Err(f) => return f.exit(),
        }
    };
    if let Some(url) = &args.provider_url {
        if let Err(e) = config.route_all_providers_to(url) {
            return fail(exit::BAD_INPUT, e);
        }
    }
    let config = Arc::new(config);
    let alert_secret = match crate::alerts::secret(&config) {
        Ok(s) => s,
        Err(f) => return f.exit(),
    };
    let requests = match args.edge.requests.settings() {
        Ok(s) => s,
        Err(f) => return f.exit(),
    };
    let admin_token = match &args.admin_token {
        Some(t) => match crate::edge::check_admin_token(t) {
            Ok(()) => t.clone(),
            Err(f) => return f.exit(),
        },
        None => format!(
            "dev-admin-{}",
            RequestId::generate().as_str().replace('-', "")
        ),
    };
    if let Some(viewer) = &args.viewer_token {
        if let Err(e) = tollgate_api::auth::check_viewer_token(viewer, Some(&admin_token)) {
            return Failure::bad_input(e).exit();
        }
    }
    let settings = Settings {
        admin_token: Some(admin_token.clone()),
        viewer_token: args.viewer_token.clone(),
        trusted_proxy_header: args.trusted_proxy_header.clone(),
        sync_timeout: std::time::Duration::from_millis(args.sync_timeout_ms),
        ..requests
    };

    let backends = match args
        .store
        .open(Arc::clone(&config), 16, Wait::UntilReachable)
        .await
    {
        Ok(b) => b,
        Err(f) => return f.exit(),
    };
    let providers = match role::providers(&config, &backends) {
        Ok(p) => p,
        Err(f) => return f.exit(),
    };
    let listener = match args.edge.bind().await {
        Ok(l) => l,
        Err(f) => return f.exit(),
    };
    let addr = listener.local_addr().unwrap_or(args.edge.listen);
    let created = match tollgate_api::admin::create_user(
        &config,
        backends.ledger.as_ref(),
        backends.keys.as_ref(),
        tollgate_api::admin::CreateUser::user(args.dev_user.clone()),
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            return fail(
                exit::FAILURE,
                format!("cannot create the development user: {e}"),
            )
        }
    };
    print_banner(
        &config,
        &backends.described,
        addr,
        &created.user,
        created.plan.as_deref().unwrap_or_default(),
        &created.api_key,
        &admin_token,
    );

    // One stop for every role.
    let stop = Stop::on_signal();

    // One registry for the whole process: the api's /metrics shows every role,
    // and its /readyz every role's loops.
    let mut worker_cfg = role::worker_config(&config, &backends);
    worker_cfg.concurrency = args.concurrency.max(1);
    worker_cfg.user_share = args.user_share;
    let worker = tokio::spawn(tollgate_worker::run(
        worker_cfg,
        Arc::clone(&backends.source),
        providers,
        stop.stopped(),
    ));
    // A throttle that does not grant by itself (Redis) gets its throttler here.
    let throttler = backends.dispatchers.clone().map(|dispatchers| {
        let mut cfg = ThrottlerConfig::new(Arc::clone(&config));
        cfg.metrics = Arc::clone(&backends.metrics);
        tokio::spawn(tollgate_throttler::run(cfg, dispatchers, stop.stopped()))
    });
    let deliverer = match crate::alerts::spawn(&config, alert_secret, &backends, stop.stopped()) {
        Ok(d) => d,
        Err(f) => return f.exit(),
    };
    let state = ApiState::new(&backends, settings);
    let api = tollgate_api::run(state, listener, stop.stopped()).await;

    let mut code = ExitCode::SUCCESS;
    if let Err(e) = api {
        code = fail(exit::FAILURE, format!("api: {e}"));
    }
    match worker.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => code = fail(exit::BAD_INPUT, format!("worker: {e}")),
        Err(e) => code = fail(exit::FAILURE, format!("worker task: {e}")),
    }
    if let Some(d) = deliverer {
        if let Err(e) = d.await {
            code = fail(exit::FAILURE, format!("alerts deliverer task: {e}"));
        }
    }
    let _ = backends
        .throttle
        .drain(std::time::Duration::from_secs(5))
        .await;
    if let Some(t) = throttler {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => code = fail(exit::BAD_INPUT, format!("throttler: {e}")),
            Err(e) => code = fail(exit::FAILURE, format!("throttler task: {e}")),
        }
    }
    code
}

fn print_banner(
    config: &Config,
    described: &str,
    addr: SocketAddr,
    user: &str,
    plan: &str,
    key: &str,
    admin: &str,
) {
    let base = format!("http://{addr}");
    let limit = config
        .plan(plan)
        .map(|p| p.describe(config.currency()))
        .unwrap_or_default();
    let ops = config
        .operations()
        .map(|o| format!("{} ({})", o.name, o.cost))
        .collect::<Vec<_>>()
        .join(", ");
    let upstreams = config
        .providers()
        .map(|p| match config.upstreams(&p.name)[..] {
            [] => format!("{} -> built-in mock", p.name),
            ref ups => format!(
                "{} -> {}",
                p.name,
                ups.iter()
                    .map(|u| u.url.as_str())
                    .collect::<Vec<_>>()
                    .join(" | ")
            ),
        })
        .collect::<Vec<_>>()
        .join(", ");
    println!("tollgate all: api, worker and throttle in one process ({described})");
    println!("  listening on {base}");
    println!("  operations (cost in tokens): {ops}");
    println!("  providers: {upstreams}");
    println!("  development user {user:?} on plan {plan} ({limit})");
    println!("  admin token: {admin}");
    println!("  dashboard: {base}/dashboard (log in with the admin or viewer token)");
    println!();
    println!("Try:");
    println!(
        "  curl -s -X POST {base}/v1/ops/llm.structured -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' -d '{{\"prompt\": \"hello\"}}'"
    );
    println!("  curl -s {base}/v1/usage -H 'Authorization: Bearer {key}'");
    if config.provider("openai").is_some() && config.provider("anthropic").is_some() {
        println!();
        println!("The official SDKs, through the pass-through routes:");
        println!(
            "  python3 -c 'from openai import OpenAI; c = OpenAI(base_url=\"{base}/v1/passthrough/openai\", api_key=\"{key}\"); print(c.chat.completions.create(model=\"gpt-4o-mini\", messages=[{{\"role\": \"user\", \"content\": \"hello\"}}]).choices[0].message.content)'"
        );
        println!("  Anthropic(base_url=\"{base}/v1/passthrough/anthropic\", api_key=\"{key}\")");
    }
    println!();
}
