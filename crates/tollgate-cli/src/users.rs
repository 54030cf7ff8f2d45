//! `tollgate users ...`: create users (printing their API key once) and revoke
//! keys, against the Redis the api pods share.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use serde_json::json;
use tollgate_core::id::UserId;

use crate::process::{exit, fail};
use crate::store::{StoreArgs, Wait};

#[derive(Debug, Args)]
pub struct UsersArgs {
    #[command(flatten)]
    store: StoreArgs,

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
    let config = match args.store.load_config() {
        Ok(c) => Arc::new(c),
        Err(f) => return f.exit(),
    };
    let backends = match args
        .store
        .shared("users commands", Arc::clone(&config), 2, Wait::No)
        .await
    {
        Ok(b) => b,
        Err(f) => return f.exit(),
    };
    let store = backends.keys.as_ref();
    match args.command {
        UsersCommand::Create { user, plan } => {
            let ledger = backends.ledger.as_ref();
            match tollgate_api::admin::create_user(&config, ledger, store, user, plan).await {
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
