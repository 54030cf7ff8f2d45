//! `tollgate users ...`: create users (printing their API key once), revoke
//! keys and put users in organisations, against the Redis the api pods share.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use serde_json::json;
use tollgate_core::id::{OrgId, UserId};
use tollgate_core::keystore::KeyKind;

fn parse_kind(s: &str) -> Result<KeyKind, String> {
    KeyKind::parse(s).ok_or_else(|| format!("{s:?}: expected user or service"))
}

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
    /// Create a user on a plan and issue an API key (printed once; stored
    /// hashed), or with `--kind service` a service key, which acts for the
    /// users each call names in `Tollgate-User`.
    Create {
        /// The user (for a service key: the service's own name).
        #[arg(long)]
        user: UserId,
        /// A configured plan (default: the config's default plan); not for a
        /// service key.
        #[arg(long)]
        plan: Option<String>,
        /// `user` (default) or `service`.
        #[arg(long, default_value = "user", value_parser = parse_kind)]
        kind: KeyKind,
        /// A service key: a plan it may give users with `Tollgate-Plan`
        /// (repeat for several).
        #[arg(long = "allowed-plan")]
        allowed_plans: Vec<String>,
    },
    /// Revoke an API key by its public id (`kid_...`).
    Revoke {
        #[arg(long)]
        key_id: String,
    },
    /// Put a user in an organisation (created with `tollgate orgs set`), or
    /// with `--none` in none, moving its live spend events with it. Run it
    /// again after an interruption: it finishes the move.
    SetOrg {
        user: UserId,
        /// The organisation.
        #[arg(required_unless_present = "none", conflicts_with = "none")]
        org: Option<OrgId>,
        /// In no organisation.
        #[arg(long)]
        none: bool,
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
        UsersCommand::Create {
            user,
            plan,
            kind,
            allowed_plans,
        } => {
            let ledger = backends.ledger.as_ref();
            let body = tollgate_api::admin::CreateUser {
                user,
                plan,
                kind,
                allowed_plans,
            };
            match tollgate_api::admin::create_user(&config, ledger, store, body).await {
                Ok(created) => {
                    if args.json {
                        println!("{}", json!(created));
                    } else {
                        let what = match &created.plan {
                            Some(plan) => format!("on plan {plan}"),
                            None => format!(
                                "as a service key (plans it may give: [{}])",
                                created.allowed_plans.join(", ")
                            ),
                        };
                        println!(
                            "created {} {what} (key id {})\napi key (shown once, keep it safe): {}",
                            created.user, created.key_id, created.api_key
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) if e.status().is_client_error() => fail(exit::BAD_INPUT, e),
                Err(e) => fail(exit::FAILURE, e),
            }
        }
        UsersCommand::SetOrg { user, org, none: _ } => {
            match backends.ledger.set_user_org(&user, org.as_ref()).await {
                Ok(moved) => {
                    let org = moved.org.map(|o| o.to_string());
                    if args.json {
                        println!(
                            "{}",
                            json!({"user": user, "org": org, "moved_events": moved.events})
                        );
                    } else {
                        println!(
                            "{user} is in {} ({} live events moved)",
                            org.as_deref().unwrap_or("no organisation"),
                            moved.events
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e @ tollgate_core::ledger::LedgerError::UnknownOrg(_)) => {
                    fail(exit::BAD_INPUT, e)
                }
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
