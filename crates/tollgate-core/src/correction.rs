//! An operator's correction of a spend event's cost (`tollgate budget
//! settle`): the one sequence it runs, the counterpart of
//! [`operator_refund`](crate::refund::operator_refund).
//!
//! A correction must never let a job run at a cost it was not admitted at: a
//! job's charge is corrected only once its job is final (else a conflict,
//! like a refund's). And a settle to 0 of the charge of a job that may have
//! run (it succeeded, or failed keeping its charge) would leave the upstream's
//! work unpaid: it is refused unless forced, and a forced one is exported as
//! such ([`ExportEntry::forced`](crate::ledger::ExportEntry::forced)).

use crate::id::{RequestId, UserId};
use crate::job::{JobError, JobInfo, JobQueue, JobStatus};
use crate::ledger::{Ledger, OperatorSettleOutcome};

/// Whether a final job may have reached the upstream, so its charge paid for
/// work: it succeeded, or failed for a cause that keeps the charge.
pub fn may_have_run(info: &JobInfo) -> bool {
    match &info.status {
        JobStatus::Succeeded { .. } => true,
        JobStatus::Failed { cause, .. } => cause.charged(),
        JobStatus::Queued | JobStatus::Running => false,
    }
}

/// Settles `request` of `user` to `cost` for an operator: reads the job first
/// (a final one's charge may be corrected), then lets the ledger decide in
/// one step ([`Ledger::settle_operator`]): a charge whose job is not final
/// answers [`OperatorSettleOutcome::Running`]. A settle to 0 of the charge of
/// a final job that [`may_have_run`] answers
/// [`OperatorSettleOutcome::MayHaveRun`], unchanged, unless `force`.
pub async fn operator_settle(
    ledger: &dyn Ledger,
    jobs: &dyn JobQueue,
    user: &UserId,
    request: &RequestId,
    cost: u64,
    force: bool,
) -> Result<OperatorSettleOutcome, JobError> {
    let finished = jobs
        .status(user, request)
        .await?
        .filter(|info| info.status.is_final());
    let ran = finished.as_ref().is_some_and(may_have_run);
    if cost == 0 && ran && !force {
        return Ok(OperatorSettleOutcome::MayHaveRun);
    }
    let nonce = finished.as_ref().map(|info| info.job.nonce.as_str());
    Ok(ledger
        .settle_operator(user, request, cost, nonce, cost == 0 && ran)
        .await?)
}
