//! [`ObservedLedger`]: the one decorator of the budget ledger. Every
//! backend's ledger is wrapped in it ([`Backends::assemble`]), so the job
//! queue's charges, the api's plain reserves and the worker's claims and
//! releases are all timed, counted and noted.
//!
//! [`Backends::assemble`]: crate::backend::Backends::assemble

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;

use crate::activity::{job_note, spend_key, ActivityLog, JobNote, JobStep, Note, Spend};
use crate::id::{OrgId, RequestId, UserId};
use crate::ledger::{
    ChargeOutcome, ChargeRequest, ClaimOutcome, ClaimRequest, Ledger, LedgerError, Moved, OrgList,
    OrgUsage, RefundOutcome, ReserveOutcome, SettleOutcome, SettleRequest, Usage,
};
use crate::metrics::Metrics;

/// A [`Ledger`] that times every step of another one and counts its errors
/// and denials (by plan) into [`Metrics`], and notes every new charge and
/// every refund into an [`ActivityLog`]. A duplicate (nothing charged again)
/// is not noted; a charge the ledger releases by itself (its job never
/// claimed it) is not seen here. Its `Debug` is the inner ledger's.
pub struct ObservedLedger {
    inner: Arc<dyn Ledger>,
    metrics: Arc<Metrics>,
    log: Arc<dyn ActivityLog>,
}

impl std::fmt::Debug for ObservedLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl ObservedLedger {
    pub fn new(inner: Arc<dyn Ledger>, metrics: Arc<Metrics>, log: Arc<dyn ActivityLog>) -> Self {
        Self {
            inner,
            metrics,
            log,
        }
    }

    async fn timed<T, F>(&self, step: &'static str, f: F) -> Result<T, LedgerError>
    where
        F: std::future::Future<Output = Result<T, LedgerError>>,
    {
        let started = Instant::now();
        let r = f.await;
        self.metrics.ledger_step(step, started.elapsed(), &r);
        r
    }

    /// Counts a denial under the user's plan (known from the limit when one
    /// plan has it, else read from the store: a failure counts as
    /// `unknown`), then notes it, with the `operation` denied if any.
    async fn denial(&self, user: &UserId, limit: u64, operation: Option<&str>) {
        match self.metrics.plan_of_limit(limit) {
            Some(plan) => self.metrics.denied(plan),
            None => {
                let plan = self.inner.plan(user).await.unwrap_or_default();
                self.metrics.denied(&plan);
            }
        }
        self.log.note(Note::Denied {
            user: user.to_string(),
            operation: operation.map(str::to_owned),
        });
    }

    fn spent(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: Option<&str>,
        operation: Option<(&str, Option<&str>)>,
        cost: u64,
        at_ms: u64,
    ) {
        self.log.note(Note::Spent(Spend {
            at_ms,
            user: user.to_string(),
            operation: operation.map(|(op, _)| op.to_owned()),
            service_key: operation.and_then(|(_, kid)| kid).map(str::to_owned),
            cost,
            request_id: request.to_string(),
            key: spend_key(user, request, nonce),
        }));
    }
}

#[async_trait]
impl Ledger for ObservedLedger {
    async fn reserve(
        &self,
        user: &UserId,
        request: &RequestId,
        cost: u64,
    ) -> Result<ReserveOutcome, LedgerError> {
        let r = self
            .timed("reserve", self.inner.reserve(user, request, cost))
            .await;
        match &r {
            Ok(ReserveOutcome::Allowed(a)) if !a.duplicate => {
                self.spent(user, request, None, None, cost, a.at_ms);
            }
            Ok(ReserveOutcome::Denied(d)) => self.denial(user, d.limit, None).await,
            _ => {}
        }
        r
    }

    async fn refund_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        finished: Option<&str>,
    ) -> Result<RefundOutcome, LedgerError> {
        let r = self
            .timed("refund", self.inner.refund_charge(user, request, finished))
            .await;
        if let Ok(RefundOutcome::Refunded { .. } | RefundOutcome::Cancelled { .. }) = &r {
            self.log.note(Note::Refunded {
                key: spend_key(user, request, None),
            });
            self.log
                .note(job_note(request.as_str(), user.as_str(), JobStep::Refunded));
        }
        r
    }

    async fn settle(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
    ) -> Result<SettleOutcome, LedgerError> {
        self.timed("settle", self.inner.settle(user, request, actual_cost))
            .await
    }

    async fn settle_operator(
        &self,
        user: &UserId,
        request: &RequestId,
        actual_cost: u64,
        finished: Option<&str>,
        forced: bool,
    ) -> Result<crate::ledger::OperatorSettleOutcome, LedgerError> {
        self.timed(
            "settle",
            self.inner
                .settle_operator(user, request, actual_cost, finished, forced),
        )
        .await
    }

    async fn settle_charge(
        &self,
        user: &UserId,
        request: &RequestId,
        settle: &SettleRequest<'_>,
    ) -> Result<SettleOutcome, LedgerError> {
        self.timed("settle", self.inner.settle_charge(user, request, settle))
            .await
    }

    async fn exported(
        &self,
        user: &UserId,
        since_ms: u64,
        count: usize,
    ) -> Result<Vec<crate::ledger::ExportEntry>, LedgerError> {
        self.inner.exported(user, since_ms, count).await
    }

    async fn usage_page(
        &self,
        user: &UserId,
        page: crate::ledger::EventPage,
    ) -> Result<Usage, LedgerError> {
        self.timed("usage", self.inner.usage_page(user, page)).await
    }

    async fn charge(
        &self,
        user: &UserId,
        request: &RequestId,
        charge: &ChargeRequest<'_>,
    ) -> Result<ChargeOutcome, LedgerError> {
        let r = self
            .timed("charge", self.inner.charge(user, request, charge))
            .await;
        match &r {
            Ok(ChargeOutcome::Charged { allowed, .. }) => {
                self.spent(
                    user,
                    request,
                    Some(charge.nonce),
                    Some((charge.operation, charge.service_key)),
                    charge.cost,
                    allowed.at_ms,
                );
                self.log.note(Note::Job(JobNote {
                    id: request.to_string(),
                    user: user.to_string(),
                    at_ms: allowed.at_ms,
                    step: JobStep::Charged {
                        operation: charge.operation.to_owned(),
                        cost: charge.cost,
                    },
                }));
            }
            Ok(ChargeOutcome::Denied(d)) => {
                self.denial(user, d.limit, Some(charge.operation)).await;
            }
            _ => {}
        }
        r
    }

    async fn claim(
        &self,
        user: &UserId,
        request: &RequestId,
        claim: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, LedgerError> {
        self.timed("claim", self.inner.claim(user, request, claim))
            .await
    }

    async fn release(
        &self,
        user: &UserId,
        request: &RequestId,
        nonce: &str,
    ) -> Result<RefundOutcome, LedgerError> {
        let r = self
            .timed("release", self.inner.release(user, request, nonce))
            .await;
        if let Ok(RefundOutcome::Refunded { .. }) = &r {
            self.log.note(Note::Refunded {
                key: spend_key(user, request, Some(nonce)),
            });
            self.log
                .note(job_note(request.as_str(), user.as_str(), JobStep::Released));
        }
        r
    }

    async fn set_plan(&self, user: &UserId, plan: &str) -> Result<(), LedgerError> {
        self.timed("set_plan", self.inner.set_plan(user, plan))
            .await
    }

    async fn plan(&self, user: &UserId) -> Result<String, LedgerError> {
        self.timed("plan", self.inner.plan(user)).await
    }

    async fn set_limits(
        &self,
        user: &UserId,
        limits: &[crate::config::Limit],
    ) -> Result<(), LedgerError> {
        self.timed("set_limits", self.inner.set_limits(user, limits))
            .await
    }

    async fn clear_limits(&self, user: &UserId) -> Result<bool, LedgerError> {
        self.timed("clear_limits", self.inner.clear_limits(user))
            .await
    }

    async fn custom_limits(
        &self,
        user: &UserId,
    ) -> Result<Option<Vec<crate::config::Limit>>, LedgerError> {
        self.timed("custom_limits", self.inner.custom_limits(user))
            .await
    }

    async fn set_org_plan(&self, org: &OrgId, plan: &str) -> Result<(), LedgerError> {
        self.timed("orgs", self.inner.set_org_plan(org, plan)).await
    }

    async fn set_user_org(&self, user: &UserId, org: Option<&OrgId>) -> Result<Moved, LedgerError> {
        self.timed("move", self.inner.set_user_org(user, org)).await
    }

    async fn user_org(&self, user: &UserId) -> Result<Option<OrgId>, LedgerError> {
        self.timed("orgs", self.inner.user_org(user)).await
    }

    async fn org_usage(
        &self,
        org: &OrgId,
        after: Option<&UserId>,
        limit: usize,
    ) -> Result<OrgUsage, LedgerError> {
        self.timed("orgs", self.inner.org_usage(org, after, limit))
            .await
    }

    async fn orgs(&self, after: Option<&OrgId>, limit: usize) -> Result<OrgList, LedgerError> {
        self.timed("orgs", self.inner.orgs(after, limit)).await
    }

    async fn spend(
        &self,
        user: &UserId,
        step: crate::spend::Step,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<Vec<crate::spend::Bucket>, LedgerError> {
        self.timed("spend", self.inner.spend(user, step, from_ms, to_ms))
            .await
    }

    async fn add_credits(
        &self,
        user: &UserId,
        grant: &crate::credits::GrantRequest<'_>,
    ) -> Result<crate::credits::GrantOutcome, LedgerError> {
        self.timed("add_credits", self.inner.add_credits(user, grant))
            .await
    }

    async fn credits(&self, user: &UserId) -> Result<crate::credits::CreditBalance, LedgerError> {
        self.timed("credits", self.inner.credits(user)).await
    }
}
