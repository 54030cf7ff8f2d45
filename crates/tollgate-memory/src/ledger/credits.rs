//! Prepaid credits in memory: a user's grants and what each charge drew,
//! with the semantics of `lua/budget/lib/credits.lua` (see
//! [`tollgate_core::credits`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tollgate_core::credits::{
    draw_order, CreditBalance, Grant, GrantOutcome, GrantRequest, MAX_GRANTS,
};
use tollgate_core::id::RequestId;
use tollgate_core::ledger::{ChangeKind, ExportEntry, LedgerError};

use super::UserLog;

/// Whether this call's charges draw on credits (the user's plan's
/// `credits`, set for each call).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum CreditCall {
    #[default]
    Off,
    Draw,
    /// A member of an organisation on a credits plan: holds none, so its
    /// charges are refused.
    Member,
}

/// One grant held.
struct Held {
    remaining: u64,
    expires: Option<u64>,
    /// The last time a charge drew from it: spent, it stays a retention
    /// after that (a refund may give back to it).
    last: u64,
    key: Arc<str>,
}

/// A user's grants.
#[derive(Default)]
pub(super) struct Credits {
    /// The last grant's number (0: none ever: the user may be swept).
    next: u64,
    held: BTreeMap<u64, Held>,
    /// Idempotency key -> (grant, amount, expiry).
    keys: HashMap<Arc<str>, (u64, u64, Option<u64>)>,
    /// Request -> (grant, amount) drawn, in drawing order.
    drawn: HashMap<Arc<str>, Vec<(u64, u64)>>,
}

impl Credits {
    pub(super) fn is_empty(&self) -> bool {
        self.next == 0
    }

    /// A charge that left the retention: what it drew stays drawn.
    pub(super) fn forget(&mut self, request: &str) {
        self.drawn.remove(request);
    }
}

/// A member of an organisation holds no credits of its own (as
/// `lua/budget/credits.lua` answers).
pub(super) fn member_refused() -> LedgerError {
    LedgerError::BadCredit {
        field: "user",
        reason: "a member of an organisation holds no credits of its own".into(),
    }
}

/// One credits change for the export: kind, id, amount, grant, at.
type Note = (ChangeKind, Arc<str>, u64, u64, u64);

impl UserLog {
    fn export_credit(&mut self, now: u64, (kind, id, cost, grant, at): Note) {
        self.push_export(now, |export_id| ExportEntry {
            id: export_id,
            kind,
            request_id: RequestId::from_kept(&id),
            cost,
            previous_cost: None,
            spent_at_ms: if kind == ChangeKind::CreditGrant {
                0
            } else {
                at
            },
            operation: None,
            service_key: None,
            forced: false,
            model: None,
            entry: None,
            prices: None,
            grant: Some(grant),
            expires_at_ms: (kind == ChangeKind::CreditGrant && at != 0).then_some(at),
        });
    }

    /// Drops the grants that expired (exported with what they held) and
    /// the spent ones no live charge can give back to.
    fn credits_now(&mut self, now: u64) {
        let retain = self.retain;
        let mut notes = Vec::new();
        self.credits.held.retain(|&n, g| {
            if g.expires.is_some_and(|e| e <= now) {
                if g.remaining > 0 {
                    let at = g.expires.unwrap_or(0);
                    notes.push((
                        ChangeKind::CreditExpire,
                        Arc::clone(&g.key),
                        g.remaining,
                        n,
                        at,
                    ));
                }
                return false;
            }
            !(g.remaining == 0 && g.last.saturating_add(retain) < now)
        });
        for note in notes {
            self.export_credit(now, note);
        }
    }

    /// The balance as it stands at `now`.
    pub(super) fn credit_balance(&mut self, now: u64) -> CreditBalance {
        self.credits_now(now);
        let grants = self
            .credits
            .held
            .iter()
            .map(|(&id, g)| Grant {
                id,
                remaining: g.remaining,
                expires_at_ms: g.expires,
            })
            .collect();
        CreditBalance::new(grants, now)
    }

    /// Adds a grant (checked by the caller), idempotent per key.
    pub(super) fn credit_grant(
        &mut self,
        grant: &GrantRequest<'_>,
        now: u64,
    ) -> Result<GrantOutcome, LedgerError> {
        self.credits_now(now);
        let key = grant.idempotency_key;
        if let Some(&(n, amount, expires)) = self.credits.keys.get(key) {
            if amount != grant.amount || expires != grant.expires_at_ms {
                return Err(LedgerError::CreditKeyReused {
                    key: key.to_owned(),
                    amount,
                    expires_at_ms: expires,
                });
            }
            return Ok(GrantOutcome::Existing {
                grant: n,
                credits: self.credit_balance(now),
            });
        }
        if grant.expires_at_ms.is_some_and(|e| e <= now) {
            return Err(LedgerError::BadCredit {
                field: "expires_at",
                reason: format!("must be after now ({now} ms on the ledger's clock)"),
            });
        }
        if self.credits.held.len() >= MAX_GRANTS {
            return Err(LedgerError::BadCredit {
                field: "user",
                reason: format!("holds {MAX_GRANTS} grants already, the most"),
            });
        }
        self.credits.next += 1;
        let n = self.credits.next;
        let key: Arc<str> = Arc::from(key);
        self.credits.held.insert(
            n,
            Held {
                remaining: grant.amount,
                expires: grant.expires_at_ms,
                last: now,
                key: Arc::clone(&key),
            },
        );
        self.credits
            .keys
            .insert(Arc::clone(&key), (n, grant.amount, grant.expires_at_ms));
        let at = grant.expires_at_ms.unwrap_or(0);
        self.export_credit(now, (ChangeKind::CreditGrant, key, grant.amount, n, at));
        Ok(GrantOutcome::Granted {
            grant: n,
            credits: self.credit_balance(now),
        })
    }

    /// Before a new charge of `cost`: `None` when credits do not apply or
    /// cover it, else the balance (the charge is refused).
    pub(super) fn credit_short(&mut self, cost: u64, now: u64) -> Option<u64> {
        match self.credit {
            CreditCall::Off => None,
            CreditCall::Member => Some(0),
            CreditCall::Draw => {
                let balance = self.credit_balance(now).balance;
                (balance < cost).then_some(balance)
            }
        }
    }

    /// Draws up to `cost` for `request` (spent at `at`); returns what was drawn.
    fn credit_draw(&mut self, request: &Arc<str>, cost: u64, at: u64, now: u64) -> u64 {
        self.credits_now(now);
        let mut order: Vec<Grant> = self
            .credits
            .held
            .iter()
            .filter(|(_, g)| g.remaining > 0)
            .map(|(&id, g)| Grant {
                id,
                remaining: g.remaining,
                expires_at_ms: g.expires,
            })
            .collect();
        order.sort_by_key(draw_order);
        let mut need = cost;
        let mut parts = Vec::new();
        for g in order {
            if need == 0 {
                break;
            }
            let take = g.remaining.min(need);
            if let Some(h) = self.credits.held.get_mut(&g.id) {
                h.remaining -= take;
                h.last = now;
            }
            need -= take;
            parts.push((g.id, take));
            self.export_credit(
                now,
                (ChangeKind::CreditDraw, Arc::clone(request), take, g.id, at),
            );
        }
        if !parts.is_empty() {
            self.credits
                .drawn
                .entry(Arc::clone(request))
                .or_default()
                .extend(parts);
        }
        cost - need
    }

    /// A new charge recorded: it draws its cost (checked to be covered).
    pub(super) fn credit_charged(&mut self, request: &Arc<str>, cost: u64, at: u64, now: u64) {
        if self.credit == CreditCall::Draw {
            self.credit_draw(request, cost, at, now);
        }
    }

    /// Gives what `request` drew past `keep` back to its grants, the last
    /// drawn first (keep 0: the charge is gone); a grant that expired since
    /// keeps nothing.
    pub(super) fn credit_give(&mut self, request: &str, at: u64, keep: u64, now: u64) {
        let Some((key, mut parts)) = self.credits.drawn.remove_entry(request) else {
            return;
        };
        self.credits_now(now);
        let drawn: u64 = parts.iter().map(|p| p.1).sum();
        let mut left = drawn.saturating_sub(keep);
        for p in parts.iter_mut().rev() {
            if left == 0 {
                break;
            }
            let back = p.1.min(left);
            p.1 -= back;
            left -= back;
            if let (Some(h), true) = (self.credits.held.get_mut(&p.0), back > 0) {
                h.remaining += back;
                let note = (ChangeKind::CreditReturn, Arc::clone(&key), back, p.0, at);
                self.export_credit(now, note);
            }
        }
        parts.retain(|p| p.1 > 0);
        if !parts.is_empty() {
            self.credits.drawn.insert(key, parts);
        }
    }

    /// A charge's cost set from `previous` to `cost`: a credits charge
    /// gives the difference back, or draws it (what the balance cannot
    /// cover is exported as uncovered: the charge keeps its cost).
    pub(super) fn credit_recost(
        &mut self,
        request: &Arc<str>,
        at: u64,
        previous: u64,
        cost: u64,
        now: u64,
    ) {
        if cost < previous {
            // What it drew past its new cost (an uncovered part goes first).
            self.credit_give(request, at, cost, now);
        } else if cost > previous && self.credits.drawn.contains_key(&**request) {
            let drawn = self.credit_draw(request, cost - previous, at, now);
            if drawn < cost - previous {
                let note = (
                    ChangeKind::CreditUncovered,
                    Arc::clone(request),
                    cost - previous - drawn,
                    0,
                    at,
                );
                self.export_credit(now, note);
            }
        }
    }
}
