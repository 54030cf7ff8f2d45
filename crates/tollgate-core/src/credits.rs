//! Prepaid credits: a user's balance, made of grants an admin adds
//! ([`Ledger::add_credits`](crate::ledger::Ledger::add_credits)), drawn by
//! the charges of a plan with `credits = "only"` in the same atomic step as
//! the window and period checks (docs/src/money.md, "Prepaid credits").
//!
//! Semantics both ledgers hold to: a charge draws its cost from the live
//! grants, earliest expiry first (a grant that never expires last; equal
//! expiries in the order they were granted); a charge the balance cannot
//! cover is refused before any upstream work ([`Denied::credits`], 402
//! `credits-exhausted`). The draw is recorded per charge (which grants, how
//! much), so a settle down, a refund or a release gives back to the grants
//! it came from (latest-expiring first), and a settle up draws more, as far
//! as the balance goes: the upstream did the work, so the charge keeps its
//! cost and what the balance could not cover is exported as
//! [`ChangeKind::CreditUncovered`]. A grant stops counting at its
//! `expires_at` (the ledger's clock); what it still held is exported as
//! [`ChangeKind::CreditExpire`] by the next step that reads the balance, and
//! a give-back to a grant that expired is lost with it. The balance never
//! goes below zero.
//!
//! [`Denied::credits`]: crate::ledger::Denied::credits
//! [`ChangeKind::CreditUncovered`]: crate::ledger::ChangeKind::CreditUncovered
//! [`ChangeKind::CreditExpire`]: crate::ledger::ChangeKind::CreditExpire

use serde::Serialize;

use crate::ledger::{ChangeKind, ExportEntry, LedgerError};

/// The most grants a user may hold at once (live, or spent and still
/// within the retention, when a refund may give back to them): a budget
/// step reads them all.
pub const MAX_GRANTS: usize = 64;

/// The longest idempotency key of a grant.
pub const MAX_KEY_LEN: usize = 64;

/// Whether a plan's users draw on credits (`[plans.X] credits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CreditMode {
    /// No: the plan's limits alone decide.
    #[default]
    Off,
    /// Every charge must also be covered by the balance, and draws from it.
    Only,
}

impl CreditMode {
    /// The config's spelling: `"only"` (absent: off).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "only" => Some(Self::Only),
            "off" => Some(Self::Off),
            _ => None,
        }
    }
}

/// A grant to add ([`Ledger::add_credits`](crate::ledger::Ledger::add_credits)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantRequest<'a> {
    /// In the deployment's unit (micro-units of the currency, or tokens), 1
    /// to [`MAX_TOKENS`](crate::config::MAX_TOKENS).
    pub amount: u64,
    /// When the grant stops counting (ms, the ledger's clock); `None`: never.
    pub expires_at_ms: Option<u64>,
    /// The same key again with the same amount and expiry is the same grant
    /// (nothing added); with another, [`LedgerError::CreditKeyReused`].
    pub idempotency_key: &'a str,
}

impl GrantRequest<'_> {
    /// What both ledgers check before touching state (the expiry against
    /// their clock, in the same step as the grant).
    pub fn check(&self) -> Result<(), LedgerError> {
        if self.amount == 0 || self.amount > crate::config::MAX_TOKENS {
            return Err(LedgerError::BadCredit {
                field: "amount",
                reason: format!(
                    "must be at least 1 and at most {}",
                    crate::config::MAX_TOKENS
                ),
            });
        }
        let k = self.idempotency_key;
        if k.is_empty()
            || k.len() > MAX_KEY_LEN
            || !k
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(LedgerError::BadCredit {
                field: "idempotency_key",
                reason: format!("1 to {MAX_KEY_LEN} of A-Z a-z 0-9 - _ ."),
            });
        }
        if self
            .expires_at_ms
            .is_some_and(|e| e == 0 || e > crate::config::MAX_TOKENS)
        {
            return Err(LedgerError::BadCredit {
                field: "expires_at",
                reason: "not a time the ledger can hold".into(),
            });
        }
        Ok(())
    }
}

/// One grant as it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Grant {
    /// Its number, from 1 in the order the user's grants were made.
    pub id: u64,
    /// What is left of it.
    pub remaining: u64,
    /// When it stops counting; `None`: never.
    pub expires_at_ms: Option<u64>,
}

/// A user's balance: the sum of its live grants' remainders.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CreditBalance {
    pub balance: u64,
    /// The live grants with something left, in the order they are drawn.
    pub grants: Vec<Grant>,
    pub now_ms: u64,
}

impl CreditBalance {
    /// The balance of `grants` (live ones; drawing order is made here).
    pub fn new(mut grants: Vec<Grant>, now_ms: u64) -> Self {
        grants.retain(|g| g.remaining > 0);
        grants.sort_by_key(draw_order);
        Self {
            balance: grants.iter().map(|g| g.remaining).sum(),
            grants,
            now_ms,
        }
    }
}

/// The order grants are drawn in: earliest expiry first, a grant that never
/// expires last, then the older first.
pub fn draw_order(g: &Grant) -> (u64, u64) {
    (g.expires_at_ms.unwrap_or(u64::MAX), g.id)
}

/// The answer to [`Ledger::add_credits`](crate::ledger::Ledger::add_credits).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum GrantOutcome {
    /// Added now as grant `grant`.
    Granted { grant: u64, credits: CreditBalance },
    /// The key was used already for this very grant: nothing added.
    Existing { grant: u64, credits: CreditBalance },
}

impl GrantOutcome {
    pub fn credits(&self) -> &CreditBalance {
        match self {
            Self::Granted { credits, .. } | Self::Existing { credits, .. } => credits,
        }
    }
}

/// Whether an export entry is one of the credits' history.
pub fn is_credit(kind: ChangeKind) -> bool {
    matches!(
        kind,
        ChangeKind::CreditGrant
            | ChangeKind::CreditDraw
            | ChangeKind::CreditReturn
            | ChangeKind::CreditExpire
            | ChangeKind::CreditUncovered
    )
}

/// The balance the export alone tells, per grant: grants add, draws and
/// expiries take, returns give back (an uncovered cost changes nothing).
/// Equals [`CreditBalance::balance`] when the export holds the user's whole
/// history (its `maxlen` not reached) and was read after the step that read
/// the balance.
pub fn rebuild(entries: &[ExportEntry]) -> std::collections::BTreeMap<u64, i128> {
    let mut grants = std::collections::BTreeMap::new();
    for e in entries {
        let (Some(g), true) = (e.grant, is_credit(e.kind)) else {
            continue;
        };
        let sign: i128 = match e.kind {
            ChangeKind::CreditGrant | ChangeKind::CreditReturn => 1,
            ChangeKind::CreditDraw | ChangeKind::CreditExpire => -1,
            _ => 0,
        };
        *grants.entry(g).or_insert(0) += sign * i128::from(e.cost);
    }
    grants
}

/// A grant's `expires_at` as the admin routes and the CLI read it: an RFC
/// 3339 instant with its offset (`2027-01-31T23:00:00Z`), to the ms.
pub fn parse_expires_at(s: &str) -> Result<u64, LedgerError> {
    let bad = |reason: String| LedgerError::BadCredit {
        field: "expires_at",
        reason,
    };
    let t: jiff::Timestamp = s
        .parse()
        .map_err(|e: jiff::Error| bad(format!("not an RFC 3339 instant with an offset: {e}")))?;
    u64::try_from(t.as_millisecond())
        .ok()
        .filter(|&ms| ms > 0 && ms <= crate::config::MAX_TOKENS)
        .ok_or_else(|| bad("not a time the ledger can hold".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(amount: u64, key: &str, expires: Option<u64>) -> GrantRequest<'_> {
        GrantRequest {
            amount,
            expires_at_ms: expires,
            idempotency_key: key,
        }
    }

    #[test]
    fn bad_grants_name_their_field() {
        let field = |r: GrantRequest<'_>| match r.check() {
            Err(LedgerError::BadCredit { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(req(0, "k", None)), "amount");
        assert_eq!(field(req(1 << 60, "k", None)), "amount");
        assert_eq!(field(req(1, "", None)), "idempotency_key");
        assert_eq!(field(req(1, "a b", None)), "idempotency_key");
        assert_eq!(field(req(1, &"k".repeat(65), None)), "idempotency_key");
        assert_eq!(field(req(1, "k", Some(0))), "expires_at");
        assert!(req(1, "top-up_1.a", Some(5)).check().is_ok());
    }

    #[test]
    fn earliest_expiry_is_drawn_first() {
        let g = |id, remaining, exp| Grant {
            id,
            remaining,
            expires_at_ms: exp,
        };
        let b = CreditBalance::new(
            vec![
                g(1, 5, None),
                g(2, 3, Some(50)),
                g(3, 0, Some(10)),
                g(4, 2, Some(20)),
            ],
            0,
        );
        assert_eq!(b.balance, 10);
        assert_eq!(
            b.grants.iter().map(|g| g.id).collect::<Vec<_>>(),
            vec![4, 2, 1]
        );
    }
}
