//! `tollgate users ...`: create users (printing their API key once), revoke
//! keys, list users, show one, set or clear a user's own limits, put users
//! in organisations, and rebuild the users index, against the Redis the api
//! pods share.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::json;
use tollgate_api::admin::{self, LimitBody, LimitView, LimitsView};
use tollgate_api::problem::ApiError;
use tollgate_api::usage::UsageView;
use tollgate_core::id::{OrgId, UserId};
use tollgate_core::keystore::{KeyKind, UserQuery};
use tollgate_core::money::{Amount, Currency};

fn parse_kind(s: &str) -> Result<KeyKind, String> {
    KeyKind::parse(s).ok_or_else(|| format!("{s:?}: expected user or service"))
}

use crate::process::{exit, fail};
use crate::store::StoreArgs;

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
    /// List the users issued a key, by id, a page at a time (the users
    /// index; see `reindex`).
    List {
        /// Only users whose id starts with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Users per page (1 to 100).
        #[arg(long, default_value_t = UserQuery::DEFAULT_LIMIT)]
        limit: usize,
        /// The next page: the `next cursor` the previous page printed.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// One user: its plan or own limits, every window as it stands, its keys
    /// (ids only) and the first page of its spend events.
    Show { user: UserId },
    /// Set a user's own limits (a custom plan for one user): they replace its
    /// plan's from its next call on, until `clear-limits` or a plan is set.
    SetLimits {
        user: UserId,
        /// `<amount>/<window>`, e.g. `1000/1h` in tokens, `20/30d` or
        /// `0.50/1h` in money (repeat for several windows).
        #[arg(long = "limit", required = true, value_parser = parse_limit)]
        limits: Vec<LimitBody>,
    },
    /// Return a user to its plan's limits.
    ClearLimits { user: UserId },
    /// Add to the users index every user whose keys were issued before it
    /// existed (a SCAN of the key store, on a cluster of each primary, a
    /// thousand keys per step). Safe to run again, and while keys are issued.
    Reindex,
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

/// `1000/1h` -> limit 1000 over a window of 1h; `20/30d` -> 20 of the
/// config's currency (`"0.0025/1h"`: a decimal of money). The amount and the
/// window are checked with the rest, as a plan's.
fn parse_limit(s: &str) -> Result<LimitBody, String> {
    let (limit, window) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?}: expected <amount>/<window>, e.g. 1000/1h"))?;
    Ok(LimitBody {
        limit: serde_json::Value::String(limit.trim().to_owned()),
        window: window.trim().to_owned(),
    })
}

fn describe(limits: &[LimitView]) -> String {
    limits
        .iter()
        .map(|l| match l.limit.currency {
            Currency::Tokens => format!("{} tokens / {}", l.limit, l.window),
            // `20 USD / 30d`
            Currency::Money(_) => format!("{} / {}", l.limit, l.window),
        })
        .collect::<Vec<_>>()
        .join(" + ")
}

fn plan_line(v: &LimitsView) -> String {
    if v.custom_limits {
        format!(
            "custom limits {} (plan {} when cleared)",
            describe(&v.limits),
            v.base_plan
        )
    } else {
        format!("plan {} ({})", v.plan, describe(&v.limits))
    }
}

/// What `set-limits` and `clear-limits` print: the limits the user is held to
/// now.
fn limits_now(json: bool, user: &UserId, view: Result<LimitsView, ApiError>) -> ExitCode {
    match view {
        Ok(view) => {
            if json {
                println!("{}", json!(view));
            } else {
                println!("{user}: {}", plan_line(&view));
            }
            ExitCode::SUCCESS
        }
        Err(e) => client_error(e),
    }
}

fn client_error(e: ApiError) -> ExitCode {
    if e.status().is_client_error() {
        fail(exit::BAD_INPUT, e)
    } else {
        fail(exit::FAILURE, e)
    }
}

pub async fn run(args: UsersArgs) -> ExitCode {
    let (config, backends) = match args.store.operator("users commands", 2).await {
        Ok(opened) => opened,
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
        UsersCommand::List {
            prefix,
            limit,
            cursor,
        } => {
            let query = match UserQuery::new(&prefix, cursor.as_deref(), limit) {
                Ok(q) => q,
                Err(e) => return fail(exit::BAD_INPUT, e),
            };
            let ledger = backends.ledger.as_ref();
            match admin::list_users(&config, ledger, store, &query).await {
                Ok(list) => {
                    if args.json {
                        println!("{}", json!(list));
                    } else {
                        for u in &list.users {
                            let plan = if u.custom_limits {
                                format!("custom ({})", describe(&u.limits))
                            } else {
                                u.plan.clone()
                            };
                            println!(
                                "{}\t{}\t{}\t{} live key(s) of {}\tcreated {}",
                                u.user,
                                u.kind.as_str(),
                                plan,
                                u.live_keys,
                                u.keys,
                                u.created.as_deref().unwrap_or("-")
                            );
                        }
                        match &list.next_cursor {
                            Some(c) => println!("next cursor: {c}"),
                            None => println!("({} user(s), last page)", list.users.len()),
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => client_error(e),
            }
        }
        UsersCommand::Show { user } => {
            let ledger = backends.ledger.as_ref();
            let shown = async {
                let summary = admin::user_summary(&config, ledger, store, &user).await?;
                let limits = admin::limits_view(&config, ledger, &user).await?;
                let keys = store.user_keys(&user).await?;
                let usage = ledger.usage(&user).await?;
                Ok::<_, ApiError>((summary, limits, keys, usage))
            };
            match shown.await {
                Ok((summary, limits, keys, usage)) => {
                    if summary.keys == 0 && usage.events.is_empty() && !limits.custom_limits {
                        return fail(exit::BAD_INPUT, format!("no user {user:?}"));
                    }
                    let keys: Vec<_> = keys.iter().map(admin::KeyView::of).collect();
                    if args.json {
                        println!(
                            "{}",
                            json!({
                                "user": user,
                                "plan": limits.plan,
                                "base_plan": limits.base_plan,
                                "custom_limits": limits.custom_limits,
                                "limits": limits.limits,
                                "kind": summary.kind,
                                "keys": keys,
                                "usage": UsageView::of(&user, &usage, config.currency()),
                            })
                        );
                    } else {
                        println!("{user}: {}", plan_line(&limits));
                        for w in &usage.windows {
                            // A calendar period says when it resets.
                            let resets = w
                                .period
                                .map(|p| {
                                    format!(", resets {}", tollgate_core::clock::rfc3339(p.end_ms))
                                })
                                .unwrap_or_default();
                            println!(
                                "  window {}: {} of {} used, {} left{resets}",
                                w.label(),
                                Amount::new(config.currency(), w.used),
                                Amount::new(config.currency(), w.limit),
                                Amount::new(config.currency(), w.remaining)
                            );
                        }
                        for k in &keys {
                            println!(
                                "  key {} ({}, created {}{})",
                                k.key_id,
                                k.kind.as_str(),
                                k.created,
                                if k.revoked { ", revoked" } else { "" }
                            );
                        }
                        println!(
                            "  {} live spend event(s) on this page{}",
                            usage.events.len(),
                            if usage.next_cursor.is_some() {
                                " (more: GET /admin/users/{user}/usage)"
                            } else {
                                ""
                            }
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => client_error(e),
            }
        }
        UsersCommand::SetLimits { user, limits } => {
            let ledger = backends.ledger.as_ref();
            let set = admin::set_user_limits(&config, ledger, store, &user, limits).await;
            limits_now(args.json, &user, set)
        }
        UsersCommand::ClearLimits { user } => {
            let ledger = backends.ledger.as_ref();
            let cleared = admin::clear_user_limits(&config, ledger, store, &user).await;
            limits_now(args.json, &user, cleared)
        }
        UsersCommand::Reindex => match store.reindex().await {
            Ok(seen) => {
                if args.json {
                    println!("{}", json!({"users_seen": seen}));
                } else {
                    println!("users index: {seen} user(s) with keys found and indexed");
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(exit::FAILURE, e),
        },
    }
}
