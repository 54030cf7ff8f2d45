//! The embedded ledger's memory: heap bytes per live spend event, for plain
//! reserves and for job charges (the api's path: an owner record each), and what
//! 10,000 users leave behind once their events have expired.
//!
//! Bytes are counted by this binary's global allocator (`alloc::Counting`):
//! what the ledger asked the allocator for, live, between two readings. The
//! allocator's own per-block overhead (8 to 16 bytes on glibc) comes on top;
//! the number of live blocks per event is printed so that it can be added.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tollgate_core::{
    clock::{Clock, ManualClock},
    id::{RequestId, UserId},
    ledger::{ChargeOutcome, ChargeRequest, ClaimRequest, Ledger, ReserveOutcome},
};
use tollgate_memory::ledger::MemoryLedger;

use crate::alloc;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Live events in the one user's window.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Users of one event each, for the idle figure.
    #[arg(long, default_value_t = 10_000)]
    idle_users: usize,
}

/// Request ids as the api makes them: a UUID, or `idem-` and 32 hex digits.
fn api_id(i: usize) -> anyhow::Result<RequestId> {
    Ok(RequestId::new(format!("idem-{i:032x}"))?)
}

fn ledger(clock: &Arc<ManualClock>) -> anyhow::Result<MemoryLedger<Arc<ManualClock>>> {
    let config = tollgate_tests::one_plan_config("bench", 1_000_000_000_000_000, "1h");
    Ok(MemoryLedger::with_clock(config, Arc::clone(clock)))
}

struct Figure {
    bytes: f64,
    blocks: f64,
}

impl std::fmt::Display for Figure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} B/event in {:.2} blocks/event",
            self.bytes, self.blocks
        )
    }
}

fn per(before: alloc::Reading, after: alloc::Reading, n: usize) -> Figure {
    Figure {
        bytes: (after.bytes as f64 - before.bytes as f64) / n as f64,
        blocks: (after.blocks as f64 - before.blocks as f64) / n as f64,
    }
}

/// Fills one user's window with `n` events, by reserve or by charge.
async fn fill(charges: bool, n: usize) -> anyhow::Result<Figure> {
    let clock = Arc::new(ManualClock::new(1_790_000_000_000));
    let ledger = ledger(&clock)?;
    let user = UserId::new("bench-user")?;
    // One event first, so that the user's entry itself is not counted.
    ledger.reserve(&user, &api_id(usize::MAX)?, 1).await?;
    let before = alloc::reading();
    for i in 0..n {
        let id = api_id(i)?;
        if charges {
            let nonce = format!("{:016x}", i as u64 ^ 0x9e37_79b9_7f4a_7c15);
            let fingerprint = format!("{:024x}", i as u128 * 7919);
            let charge = ChargeRequest {
                cost: 1,
                nonce: &nonce,
                operation: "llm.structured",
                model: "",
                fingerprint: &fingerprint,
                deadline: Duration::from_secs(300),
                grace: Duration::from_secs(60),
                service_key: None,
                price: None,
            };
            match ledger.charge(&user, &id, &charge).await? {
                ChargeOutcome::Charged { .. } => {}
                other => bail!("charge {i}: {other:?}"),
            }
            // The job claims it, as a worker does: the charge is no longer held.
            ledger
                .claim(
                    &user,
                    &id,
                    &ClaimRequest::new(&nonce, clock.now_ms() + 600_000),
                )
                .await
                .context("claim")?;
        } else {
            match ledger.reserve(&user, &id, 1).await? {
                ReserveOutcome::Allowed(_) => {}
                other => bail!("reserve {i}: {other:?}"),
            }
        }
        if i % 1000 == 999 {
            clock.advance(Duration::from_millis(1));
        }
    }
    let after = alloc::reading();
    let usage = ledger.usage(&user).await?;
    if usage.used != n as u64 + 1 {
        bail!("used {} after {} events", usage.used, n + 1);
    }
    Ok(per(before, after, n))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    if !alloc::counting() {
        alloc::start();
    }
    println!("embedded ledger, ids of 37 characters (`idem-` + 32 hex), plan: 1 h window");
    let reserves = fill(false, args.events).await?;
    println!(
        "{} live events of one user, plain reserve: {reserves}",
        args.events
    );
    let charges = fill(true, args.events).await?;
    println!(
        "{} live events of one user, charged and claimed (the api's path): {charges}",
        args.events
    );

    let clock = Arc::new(ManualClock::new(1_790_000_000_000));
    let ledger = ledger(&clock)?;
    let base = alloc::reading();
    for i in 0..args.idle_users {
        let user = UserId::new(format!("idle-{i}"))?;
        ledger.reserve(&user, &api_id(i)?, 1).await?;
    }
    let live = alloc::reading();
    clock.advance(Duration::from_secs(3601));
    let expired = alloc::reading();
    let resident = ledger.resident_users();
    ledger.sweep_expired();
    let swept = alloc::reading();
    println!(
        "{} users of one event each: {:.1} B/user while live; after their window: {:.1} B/user \
         ({} resident) before a sweep, {:.1} B/user ({} resident) after `sweep_expired`",
        args.idle_users,
        per(base, live, args.idle_users).bytes,
        per(base, expired, args.idle_users).bytes,
        resident,
        per(base, swept, args.idle_users).bytes,
        ledger.resident_users(),
    );
    Ok(())
}
