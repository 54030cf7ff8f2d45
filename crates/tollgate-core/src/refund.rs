//! An operator's refund of a spend event (`tollgate budget refund`, `POST
//! /admin/users/{user}/refunds/{request_id}`): the one sequence both run.
//!
//! A refund must never let a job run unpaid: a job's charge still held (no
//! worker claimed it) is released and its job cancelled in the same ledger step
//! ([`Ledger::refund_charge`]); a charge its job owns is refused while the job
//! may be calling the provider, and credited once the job is final.

use crate::id::{RequestId, UserId};
use crate::job::{JobError, JobQueue};
use crate::ledger::{Ledger, RefundOutcome};

/// Refunds `request` of `user` for an operator: reads the job first (a final
/// one's charge is a plain credit), then lets the ledger decide in one step.
/// A job that moves on between the read and the step is the step's to judge:
/// one claimed meanwhile answers [`RefundOutcome::Running`] (a conflict; ask
/// again once it is final), never a refund under a running job.
pub async fn operator_refund(
    ledger: &dyn Ledger,
    jobs: &dyn JobQueue,
    user: &UserId,
    request: &RequestId,
) -> Result<RefundOutcome, JobError> {
    let finished = jobs
        .status(user, request)
        .await?
        .filter(|info| info.status.is_final())
        .map(|info| info.job.nonce);
    Ok(ledger
        .refund_charge(user, request, finished.as_deref())
        .await?)
}
