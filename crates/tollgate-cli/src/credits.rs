//! `tollgate credits add|show|history`: a user's prepaid balance, against
//! the store the api pods share (as `POST` and `GET
//! /admin/users/{user}/credits` do).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::json;
use tollgate_api::credits::{self, CreditsView, GrantBody};
use tollgate_api::problem::ApiError;
use tollgate_core::id::UserId;

use crate::process::{exit, fail};
use crate::store::StoreArgs;

#[derive(Debug, Args)]
pub struct CreditsArgs {
    #[command(flatten)]
    store: StoreArgs,

    /// Print the result as one JSON object on stdout.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: CreditsCommand,
}

#[derive(Debug, Subcommand)]
enum CreditsCommand {
    /// Add a grant to a user's balance (idempotent per --key).
    Add {
        #[arg(long)]
        user: UserId,
        /// An amount of the deployment's currency: tokens, or a decimal of
        /// money (`10.00`).
        #[arg(long)]
        amount: String,
        /// When it stops counting: an RFC 3339 instant (`2027-01-31T23:00:00Z`);
        /// absent: never.
        #[arg(long)]
        expires_at: Option<String>,
        /// The grant's idempotency key: the same key and grant again adds
        /// nothing; another grant under it is refused.
        #[arg(long)]
        key: String,
    },
    /// A user's balance and live grants, in the order charges draw them.
    Show {
        #[arg(long)]
        user: UserId,
    },
    /// Every grant, draw, return and expiry of a user's balance (from the
    /// export: `[export]` must be configured).
    History {
        #[arg(long)]
        user: UserId,
    },
}

fn print_balance(v: &CreditsView) {
    let amount = |a: &tollgate_core::money::Amount| a.to_json().to_string().replace('"', "");
    let unit = v.currency.as_deref().unwrap_or("tokens");
    println!("{}: balance {} {unit}", v.user, amount(&v.balance));
    for g in &v.grants {
        println!(
            "  grant {}: {} left, expires {}",
            g.id,
            amount(&g.remaining),
            g.expires_at.as_deref().unwrap_or("never")
        );
    }
}

fn failed(e: ApiError) -> ExitCode {
    if e.status().is_client_error() {
        fail(exit::BAD_INPUT, e)
    } else {
        fail(exit::FAILURE, e)
    }
}

pub async fn run(args: CreditsArgs) -> ExitCode {
    let (config, backends) = match args.store.operator("credits commands", 2).await {
        Ok(opened) => opened,
        Err(f) => return f.exit(),
    };
    let ledger = backends.ledger.as_ref();
    match args.command {
        CreditsCommand::Add {
            user,
            amount,
            expires_at,
            key,
        } => {
            // As the route reads it: tokens as an integer, money as a string.
            let amount = match (config.currency(), amount.parse::<i64>()) {
                (tollgate_core::money::Currency::Tokens, Ok(n)) => json!(n),
                _ => json!(amount),
            };
            let body = GrantBody {
                amount,
                expires_at,
                idempotency_key: key,
            };
            match credits::add(&config, ledger, backends.keys.as_ref(), &user, body).await {
                Ok((_, v)) => {
                    if args.json {
                        println!("{}", json!(v));
                    } else {
                        println!("grant {} {}", v.grant, v.outcome);
                        print_balance(&v.credits);
                    }
                    ExitCode::SUCCESS
                }
                Err(e) if e.kind() == tollgate_api::problem::ProblemType::IdempotencyConflict => {
                    fail(exit::CONFLICT, e)
                }
                Err(e) => failed(e),
            }
        }
        CreditsCommand::Show { user } => match ledger.credits(&user).await {
            Ok(b) => {
                let v = CreditsView::of(&user, &b, &config);
                if args.json {
                    println!("{}", json!(v));
                } else {
                    print_balance(&v);
                }
                ExitCode::SUCCESS
            }
            Err(e) => failed(e.into()),
        },
        CreditsCommand::History { user } => match credits::history(&config, ledger, &user).await {
            Ok(v) => {
                if args.json {
                    println!("{}", json!(v));
                } else {
                    for e in &v.entries {
                        println!(
                            "{} {} grant {} {} {}",
                            e.id,
                            json!(e.kind).as_str().unwrap_or(""),
                            e.grant,
                            e.amount.to_json().to_string().replace('"', ""),
                            e.request_id
                        );
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => failed(e),
        },
    }
}
