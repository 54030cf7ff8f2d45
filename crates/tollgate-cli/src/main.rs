//! The `tollgate` binary: parses flags, sets up logging, and hands over to a role
//! or an operator command. Everything of substance lives in the library crates.

mod alerts;
mod all;
mod api;
mod budget;
mod credits;
mod edge;
mod logging;
mod mock_provider;
mod orgs;
mod probes;
mod process;
mod role;
mod spend;
mod store;
mod throttler;
mod users;
mod worker;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::process::exit;

/// tollgate: user budgets and provider throttles for services that pay upstream APIs.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about, propagate_version = true)]
struct Cli {
    /// Log format on stderr: `text` for people, `json` for machines.
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: logging::Format,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every role in one process: embedded (in memory, zero dependencies) by
    /// default, or against Redis with --redis-url. Prints a development API key.
    All(all::AllArgs),
    /// The api role: the HTTP gateway (API keys, metered operations, jobs, usage).
    Api(api::ApiArgs),
    /// Operator commands on user budgets: reserve, refund, settle, usage, plans.
    Budget(budget::BudgetArgs),
    /// The throttler role: grants calls to providers from the shared token buckets.
    Throttler(throttler::ThrottlerArgs),
    /// The worker role: takes jobs, calls providers through the throttle, stores results or releases charges.
    Worker(worker::WorkerArgs),
    /// A mock upstream provider with its own rate limit, failures and /stats (demo and tests).
    MockProvider(mock_provider::MockProviderArgs),
    /// Operator commands on users: create (issues an API key), revoke a key.
    Users(users::UsersArgs),
    /// Operator commands on organisations: create one on a plan, show one
    /// (windows, members), list them.
    Orgs(orgs::OrgsArgs),
    /// Spend by user, organisation, model, operation or provider, per hour
    /// or day, from the rollups kept as charges change (table, JSON or CSV).
    Spend(spend::SpendArgs),
    /// Prepaid credits: add a grant to a user's balance, show the balance,
    /// its history.
    Credits(credits::CreditsArgs),
}

/// Help and version print as clap renders them; a bad or missing flag is one
/// line on stderr (clap's own message, which names the flag) and exit 2.
fn bad_flags(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(if e.use_stderr() { exit::BAD_INPUT } else { 0 })
        }
        _ => {
            // clap's first paragraph, on one line (a list of missing flags
            // follows its first line indented).
            let rendered = e.render().to_string();
            let first: Vec<&str> = rendered
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            eprintln!("{} (see --help)", first.join(" "));
            ExitCode::from(exit::BAD_INPUT)
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return bad_flags(e),
    };
    logging::init(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    runtime.block_on(async {
        match cli.command {
            Command::All(args) => all::run(args).await,
            Command::Budget(args) => budget::run(args).await,
            Command::Api(args) => api::run(args).await,
            Command::Throttler(args) => throttler::run(args).await,
            Command::Worker(args) => worker::run(args).await,
            Command::MockProvider(args) => mock_provider::run(args).await,
            Command::Users(args) => users::run(args).await,
            Command::Credits(args) => credits::run(args).await,
            Command::Orgs(args) => orgs::run(args).await,
            Command::Spend(args) => spend::run(args).await,
        }
    })
}
