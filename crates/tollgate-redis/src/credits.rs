//! Prepaid credits on Redis: decoding `lua/budget/credits.lua`'s replies
//! and the credits' entries of the export (the scripts keep the grants:
//! `lua/budget/lib/credits.lua`).

use redis::Value;
use tollgate_core::credits::{CreditBalance, Grant, GrantOutcome, GrantRequest};
use tollgate_core::ledger::{ChangeKind, LedgerError};

use crate::call::bad_reply;
use crate::scripts::reply::{int, signed};

/// The export's kind of a credits entry (`export` in budget/lib/credits.lua).
pub fn change_kind(kind: &str) -> Option<ChangeKind> {
    Some(match kind {
        "credit_grant" => ChangeKind::CreditGrant,
        "credit_draw" => ChangeKind::CreditDraw,
        "credit_return" => ChangeKind::CreditReturn,
        "credit_expire" => ChangeKind::CreditExpire,
        "credit_uncovered" => ChangeKind::CreditUncovered,
        _ => return None,
    })
}

/// The balance at `r[at..]`: balance, count, then (number, remaining,
/// expiry or 0) per grant.
fn balance(r: &[Value], at: usize, now_ms: u64) -> Option<CreditBalance> {
    let count = usize::try_from(int(r.get(at + 1)?)?).ok()?;
    let mut grants = Vec::with_capacity(count.min(tollgate_core::credits::MAX_GRANTS));
    for g in r.get(at + 2..)?.chunks_exact(3).take(count) {
        let exp = int(&g[2])?;
        grants.push(Grant {
            id: int(&g[0])?,
            remaining: int(&g[1])?,
            expires_at_ms: (exp != 0).then_some(exp),
        });
    }
    (grants.len() == count).then(|| CreditBalance::new(grants, now_ms))
}

/// `credits.lua`'s reply to a grant (or, with `grant` `None`, a read).
pub fn parse(r: &[Value], grant: Option<&GrantRequest<'_>>) -> Result<GrantOutcome, LedgerError> {
    let bad = || bad_reply::<LedgerError>("credits", r);
    let n = |i: usize| r.get(i).and_then(int).ok_or_else(bad);
    match r.first().and_then(signed) {
        Some(s @ (1 | 2)) => {
            let credits = balance(r, 3, n(2)?).ok_or_else(bad)?;
            let grant = n(1)?;
            Ok(if s == 1 {
                GrantOutcome::Granted { grant, credits }
            } else {
                GrantOutcome::Existing { grant, credits }
            })
        }
        Some(3) => Err(LedgerError::CreditKeyReused {
            key: grant
                .map(|g| g.idempotency_key.to_owned())
                .unwrap_or_default(),
            amount: n(1)?,
            expires_at_ms: Some(n(2)?).filter(|&e| e != 0),
        }),
        Some(4) => Err(LedgerError::BadCredit {
            field: "expires_at",
            reason: format!("must be after now ({} ms on the ledger's clock)", n(1)?),
        }),
        Some(5) => Err(LedgerError::BadCredit {
            field: "user",
            reason: format!("holds {} grants already, the most", n(1)?),
        }),
        Some(-2) => Err(LedgerError::BadCredit {
            field: "user",
            reason: "a member of an organisation holds no credits of its own".into(),
        }),
        _ => Err(bad()),
    }
}
