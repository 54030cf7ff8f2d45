//! `tollgate orgs ...`: create organisations on a plan, show one (its
//! windows and members), list them, against the Redis the api pods share.
//! Users join with `tollgate users set-org`.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::json;
use tollgate_core::id::{OrgId, UserId};
use tollgate_core::ledger::LedgerError;
use tollgate_core::money::Amount;

use crate::process::{exit, fail};
use crate::store::StoreArgs;

#[derive(Debug, Args)]
pub struct OrgsArgs {
    #[command(flatten)]
    store: StoreArgs,

    /// Print the result as one JSON object on stdout.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: OrgsCommand,
}

#[derive(Debug, Subcommand)]
enum OrgsCommand {
    /// Create an organisation on a configured plan, or change its plan.
    Set {
        org: OrgId,
        #[arg(long)]
        plan: String,
    },
    /// One organisation: its plan, its windows and a page of its members.
    Show {
        org: OrgId,
        /// Members after this one (the page before's last).
        #[arg(long)]
        after: Option<UserId>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// The organisations, by name, a page at a time.
    List {
        /// Organisations after this one (the page before's last).
        #[arg(long)]
        after: Option<OrgId>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
}

fn failed(e: LedgerError) -> ExitCode {
    match e {
        LedgerError::UnknownOrg(_) | LedgerError::UnknownPlan { .. } => fail(exit::BAD_INPUT, e),
        e => fail(exit::FAILURE, e),
    }
}

pub async fn run(args: OrgsArgs) -> ExitCode {
    let (config, backends) = match args.store.operator("orgs commands", 2).await {
        Ok(opened) => opened,
        Err(f) => return f.exit(),
    };
    let currency = config.currency();
    let ledger = backends.ledger.as_ref();
    match args.command {
        OrgsCommand::Set { org, plan } => match ledger.set_org_plan(&org, &plan).await {
            Ok(()) => {
                if args.json {
                    println!("{}", json!({"org": org, "plan": plan}));
                } else {
                    println!("organisation {org} is on plan {plan}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => failed(e),
        },
        OrgsCommand::Show { org, after, limit } => {
            match ledger
                .org_usage(&org, after.as_ref(), limit.clamp(1, 1000))
                .await
            {
                Ok(u) => {
                    if args.json {
                        let v = crate::budget::money_json(
                            json!(u),
                            currency,
                            &["used", "limit", "remaining"],
                        );
                        println!("{v}");
                    } else {
                        println!("organisation {} on plan {}", u.org, u.plan);
                        for w in &u.windows {
                            println!(
                                "  window {} ms: used {} of {} ({} left)",
                                w.window_ms,
                                Amount::new(currency, w.used),
                                Amount::new(currency, w.limit),
                                Amount::new(currency, w.remaining)
                            );
                        }
                        println!("members ({}):", u.members.len());
                        for m in &u.members {
                            println!("  {m}");
                        }
                        if let Some(next) = &u.next_member {
                            println!("more: --after {next}");
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => failed(e),
            }
        }
        OrgsCommand::List { after, limit } => {
            match ledger.orgs(after.as_ref(), limit.clamp(1, 1000)).await {
                Ok(list) => {
                    if args.json {
                        println!("{}", json!(list));
                    } else {
                        for o in &list.orgs {
                            println!("{o}");
                        }
                        if let Some(next) = &list.next {
                            println!("more: --after {next}");
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => failed(e),
            }
        }
    }
}
