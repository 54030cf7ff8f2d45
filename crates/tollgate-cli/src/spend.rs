//! `tollgate spend`: a spend report by user, organisation, model, operation
//! or provider, per hour or day, from the rollups on the Redis the api pods
//! share (what `GET /admin/spend` answers), as a table, JSON or CSV.

use std::process::ExitCode;

use clap::{Args, ValueEnum};
use tollgate_core::spend::{report, SpendPage, SpendQuery};

use crate::process::{exit, fail};
use crate::store::StoreArgs;

#[derive(Debug, Args)]
pub struct SpendArgs {
    #[command(flatten)]
    store: StoreArgs,

    /// What the rows are grouped by: user, org, model (the price sheet
    /// entry), operation or provider.
    #[arg(long)]
    by: String,

    /// The first bucket: an RFC 3339 time or a date (its UTC midnight);
    /// default `--to` less a day (1h) or 30 days (1d).
    #[arg(long)]
    from: Option<String>,

    /// Buckets starting before this (RFC 3339 or a date); default the end of
    /// the current step.
    #[arg(long)]
    to: Option<String>,

    /// 1h or 1d.
    #[arg(long, default_value = "1d")]
    step: String,

    /// The next_cursor of the page before.
    #[arg(long)]
    cursor: Option<String>,

    /// Rows per page.
    #[arg(long, default_value_t = SpendQuery::DEFAULT_LIMIT)]
    limit: usize,

    /// table (default), json or csv.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Table,
    Json,
    Csv,
}

pub async fn run(args: SpendArgs) -> ExitCode {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let query = match SpendQuery::new(
        &args.by,
        Some(&args.step),
        args.from.as_deref(),
        args.to.as_deref(),
        args.cursor.as_deref(),
        Some(args.limit),
        now,
    ) {
        Ok(q) => q,
        Err(e) => return fail(exit::BAD_INPUT, format!("--{e}")),
    };
    let (config, backends) = match args.store.operator("spend", 2).await {
        Ok(opened) => opened,
        Err(f) => return f.exit(),
    };
    let currency = config.currency();
    let page = match report(
        backends.ledger.as_ref(),
        backends.keys.as_ref(),
        &query,
        &currency.to_string(),
    )
    .await
    {
        Ok(p) => p,
        Err(e) => return fail(exit::FAILURE, e),
    };
    match args.format {
        Format::Json => match serde_json::to_string(&page.to_json(currency)) {
            Ok(s) => println!("{s}"),
            Err(e) => return fail(exit::FAILURE, e),
        },
        Format::Csv => {
            print!("{}", page.to_csv(currency));
            if let Some(next) = &page.next_cursor {
                eprintln!("more: --cursor '{next}'");
            }
        }
        Format::Table => print!("{}", table(&page, currency)),
    }
    ExitCode::SUCCESS
}

/// The page as aligned columns, amounts as the answers write them (money:
/// decimal strings of the currency), then the total.
fn table(page: &SpendPage, currency: tollgate_core::money::Currency) -> String {
    let amount = |minor: u64| tollgate_core::money::Amount::new(currency, minor).to_string();
    let key_w = page
        .rows
        .iter()
        .map(|r| r.key.chars().count().max(1))
        .max()
        .unwrap_or(0)
        .max(page.by.len());
    let amount_w = amount(page.total).len().max("amount".len());
    let mut out = format!(
        "{:<key_w$}  {:<24}  {:>amount_w$}\n",
        page.by, "start", "amount"
    );
    for r in &page.rows {
        let key = if r.key.is_empty() { "-" } else { &r.key };
        out.push_str(&format!(
            "{key:<key_w$}  {:<24}  {:>amount_w$}\n",
            r.start,
            amount(r.amount)
        ));
    }
    out.push_str(&format!(
        "{:<key_w$}  {:<24}  {:>amount_w$}\n",
        "total",
        "",
        amount(page.total)
    ));
    if let Some(next) = &page.next_cursor {
        out.push_str(&format!("more: --cursor '{next}'\n"));
    }
    out
}
