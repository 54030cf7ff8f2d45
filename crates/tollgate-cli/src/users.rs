//! `tollgate users ...`: create users (printing their API key once) and revoke
//! keys, against the Redis the api pods share.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use serde_json::json;
use tollgate_core::{Config, KeyStore, UserId};
use tollgate_redis::{KeySpace, PoolOptions, RedisKeyStore, RedisLedger};

use crate::exit;
use crate::throttler::fail;

#[derive(Debug, Args)]
pub struct UsersArgs {
    /// Redis to operate on, e.g. redis://127.0.0.1:6379/0.
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_REDIS_URL",
        hide_env_values = true
    )]
    redis_url: Option<String>,

    /// TOML config with the plans (default: the built-in config).
    #[arg(long, global = true, env = "TOLLGATE_CONFIG")]
    config: Option<PathBuf>,

    /// Prefix of every Redis key.
    #[arg(long, global = true, env = "TOLLGATE_KEY_PREFIX", default_value = tollgate_redis::keys::DEFAULT_PREFIX)]
    key_prefix: String,

    /// Print the result as one JSON object on stdout.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: UsersCommand,
}

#[derive(Debug, Subcommand)]
enum UsersCommand {
    /// Create a user on a plan and issue an API key (printed once; stored hashed).
    Create {
        #[arg(long)]
        user: UserId,
        /// A configured plan (default: the config's default plan).
        #[arg(long)]
        plan: Option<String>,
    },
    /// Revoke an API key by its public id (`kid_...`).
    Revoke {
        #[arg(long)]
        key_id: String,
    },
}

pub async fn run(args: UsersArgs) -> ExitCode {
    let config = match Config::load(args.config.as_deref()) {
        Ok(c) => Arc::new(c),
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let Some(url) = args.redis_url.as_deref() else {
        return fail(
            exit::BAD_INPUT,
            "users commands need a Redis: pass --redis-url or set TOLLGATE_REDIS_URL",
        );
    };
    let keys = match KeySpace::new(&args.key_prefix) {
        Ok(k) => k,
        Err(e) => return fail(exit::BAD_INPUT, e),
    };
    let options = PoolOptions {
        max_size: 2,
        ..Default::default()
    };
    let pool = match tollgate_redis::connect(url, &options).await {
        Ok(p) => p,
        Err(e) => return fail(exit::FAILURE, e),
    };
    let store = RedisKeyStore::new(pool.clone(), keys.clone());
    match args.command {
        UsersCommand::Create { user, plan } => {
            let ledger = RedisLedger::new(pool, keys, Arc::clone(&config));
            match tollgate_api::admin::create_user(&config, &ledger, &store, user, plan).await {
                Ok(created) => {
                    if args.json {
                        println!("{}", json!(created));
                    } else {
                        println!(
                            "created {} on plan {} (key id {})\napi key (shown once, keep it safe): {}",
                            created.user, created.plan, created.key_id, created.api_key
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) if e.status().is_client_error() => fail(exit::BAD_INPUT, e),
                Err(e) => fail(exit::FAILURE, e),
            }
        }
        UsersCommand::Revoke { key_id } => match store.revoke(&key_id).await {
            Ok(Some(record)) => {
                if args.json {
                    println!(
                        "{}",
                        json!({"key_id": record.key_id, "user": record.user, "revoked": true})
                    );
                } else {
                    println!("revoked {} of {}", record.key_id, record.user);
                }
                ExitCode::SUCCESS
            }
            Ok(None) => fail(exit::BAD_INPUT, format!("no key {key_id:?}")),
            Err(e) => fail(exit::FAILURE, e),
        },
    }
}
