//! The in-memory job queue: the embedded backend, with the same semantics as the
//! Redis queue (hold, reserve, release on submit; leases with fencing tokens;
//! requeue on lease expiry up to `max_attempts`; refund at most once).
//!
//! One mutex guards every job and queue; it is never held across an await (the
//! ledger calls happen between critical sections, in the same order as the
//! Redis backend's steps).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::id::{RequestId, UserId};
use crate::job::{
    millis, wait_until_final, FailureCause, Finish, Job, JobError, JobInfo, JobOptions, JobQueue,
    JobRequest, JobSource, JobStatus, Lease, Maintenance, SubmitOutcome,
};
use crate::ledger::{Ledger, ReserveOutcome};

#[derive(Debug, Clone)]
enum Phase {
    Held { until_ms: u64 },
    Queued,
    Running { token: u64, until_ms: u64 },
    Done { status: JobStatus, at_ms: u64 },
}

#[derive(Debug)]
struct Record {
    job: Job,
    phase: Phase,
    /// The last fencing token handed out.
    seq: u64,
    /// A failed job whose refund has not been confirmed yet.
    refund_pending: bool,
}

impl Record {
    fn info(&self) -> JobInfo {
        let (status, finished_at_ms) = match &self.phase {
            Phase::Held { .. } | Phase::Queued => (JobStatus::Queued, None),
            Phase::Running { .. } => (JobStatus::Running, None),
            Phase::Done { status, at_ms } => (status.clone(), Some(*at_ms)),
        };
        JobInfo {
            job: self.job.clone(),
            status,
            finished_at_ms,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    jobs: HashMap<RequestId, Record>,
    queues: HashMap<String, VecDeque<RequestId>>,
}

/// The embedded job queue (both sides: [`JobQueue`] and [`JobSource`]).
pub struct MemoryJobQueue {
    config: Arc<Config>,
    ledger: Arc<dyn Ledger>,
    clock: Arc<dyn Clock>,
    options: JobOptions,
    state: Mutex<State>,
    /// Woken when a job is queued.
    queued: Notify,
    /// Woken when a job finishes.
    finished: Notify,
}

impl std::fmt::Debug for MemoryJobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryJobQueue")
            .field("jobs", &lock(&self.state).jobs.len())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections are panic-free map and queue moves.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemoryJobQueue {
    pub fn new(config: Arc<Config>, ledger: Arc<dyn Ledger>) -> Self {
        Self::with_clock(config, ledger, Arc::new(SystemClock), JobOptions::default())
    }

    pub fn with_clock(
        config: Arc<Config>,
        ledger: Arc<dyn Ledger>,
        clock: Arc<dyn Clock>,
        options: JobOptions,
    ) -> Self {
        Self {
            config,
            ledger,
            clock,
            options,
            state: Mutex::new(State::default()),
            queued: Notify::new(),
            finished: Notify::new(),
        }
    }

    /// Jobs waiting in `operation`'s queue (tests and metrics).
    pub fn queued_len(&self, operation: &str) -> usize {
        lock(&self.state)
            .queues
            .get(operation)
            .map_or(0, VecDeque::len)
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Marks a leased job done if `token` is current; `refund` marks it pending.
    fn finish(&self, lease: &Lease, status: JobStatus, refund: bool) -> Finish {
        let now = self.now();
        let mut st = lock(&self.state);
        let Some(rec) = st.jobs.get_mut(&lease.job.id) else {
            return Finish::LeaseLost;
        };
        match rec.phase {
            Phase::Running { token, .. } if token == lease.token => {}
            _ => return Finish::LeaseLost,
        }
        rec.phase = Phase::Done { status, at_ms: now };
        rec.refund_pending = refund;
        drop(st);
        self.finished.notify_waiters();
        Finish::Recorded
    }

    async fn refund(&self, id: &RequestId, user: &UserId) -> Result<(), JobError> {
        self.ledger.refund(user, id).await?;
        if let Some(rec) = lock(&self.state).jobs.get_mut(id) {
            rec.refund_pending = false;
        }
        Ok(())
    }

    /// Fails a job that is not leased (queued or held) and refunds it.
    async fn fail_unleased(&self, id: &RequestId, cause: FailureCause, message: String) {
        let now = self.now();
        let user = {
            let mut st = lock(&self.state);
            let Some(rec) = st.jobs.get_mut(id) else {
                return;
            };
            rec.phase = Phase::Done {
                status: JobStatus::Failed { cause, message },
                at_ms: now,
            };
            rec.refund_pending = true;
            rec.job.user.clone()
        };
        self.finished.notify_waiters();
        // A refund that fails here stays pending; the next `maintain` retries it.
        let _ = self.refund(id, &user).await;
    }
}

#[async_trait]
impl JobQueue for MemoryJobQueue {
    async fn submit(&self, request: JobRequest) -> Result<SubmitOutcome, JobError> {
        let op = self
            .config
            .operation(&request.operation)
            .ok_or_else(|| JobError::unknown_operation(&self.config, &request.operation))?;
        let now = self.now();
        let job = Job {
            id: request.id.clone(),
            user: request.user.clone(),
            operation: op.name.clone(),
            provider: op.provider.clone(),
            input: request.input,
            cost: op.cost,
            enqueued_at_ms: now,
            deadline_ms: now.saturating_add(op.deadline_ms()),
            attempt: 0,
        };
        // 1. Hold the job (idempotent by id).
        {
            let mut st = lock(&self.state);
            if let Some(rec) = st.jobs.get(&job.id) {
                if rec.job.user != job.user || rec.job.operation != job.operation {
                    return Err(JobError::IdInUse(job.id));
                }
                return Ok(SubmitOutcome::Duplicate { info: rec.info() });
            }
            st.jobs.insert(
                job.id.clone(),
                Record {
                    job: job.clone(),
                    phase: Phase::Held {
                        until_ms: now.saturating_add(millis(self.options.hold)),
                    },
                    seq: 0,
                    refund_pending: false,
                },
            );
        }
        // 2. Reserve.
        let reserved = self.ledger.reserve(&job.user, &job.id, job.cost).await;
        let allowed = match reserved {
            Ok(ReserveOutcome::Allowed(a)) => a,
            Ok(ReserveOutcome::Denied(denied)) => {
                lock(&self.state).jobs.remove(&job.id);
                return Ok(SubmitOutcome::Denied { denied });
            }
            Err(e) => {
                lock(&self.state).jobs.remove(&job.id);
                return Err(e.into());
            }
        };
        // 3. Release onto the queue, unless maintenance gave the hold up meanwhile.
        let released = {
            let mut st = lock(&self.state);
            let released = match st.jobs.get_mut(&job.id) {
                Some(rec) if matches!(rec.phase, Phase::Held { .. }) => {
                    rec.phase = Phase::Queued;
                    true
                }
                _ => false,
            };
            if released {
                st.queues
                    .entry(job.operation.clone())
                    .or_default()
                    .push_back(job.id.clone());
            }
            released
        };
        if !released {
            self.ledger.refund(&job.user, &job.id).await?;
            let info = lock(&self.state).jobs.get(&job.id).map(Record::info);
            return match info {
                Some(info) => Ok(SubmitOutcome::Duplicate { info }),
                None => Err(JobError::Backend("the held job vanished".into())),
            };
        }
        self.queued.notify_waiters();
        Ok(SubmitOutcome::Queued { job, allowed })
    }

    async fn status(&self, user: &UserId, id: &RequestId) -> Result<Option<JobInfo>, JobError> {
        Ok(lock(&self.state)
            .jobs
            .get(id)
            .filter(|r| &r.job.user == user)
            .map(Record::info))
    }

    async fn wait(
        &self,
        user: &UserId,
        id: &RequestId,
        timeout: Duration,
    ) -> Result<Option<JobInfo>, JobError> {
        wait_until_final(&self.finished, timeout, self.options.poll, || {
            self.status(user, id)
        })
        .await
    }
}

#[async_trait]
impl JobSource for MemoryJobQueue {
    async fn take(
        &self,
        operation: &str,
        worker: &str,
        block: Duration,
        lease: Duration,
    ) -> Result<Option<Lease>, JobError> {
        let op = self
            .config
            .operation(operation)
            .ok_or_else(|| JobError::unknown_operation(&self.config, operation))?;
        let deadline = tokio::time::Instant::now() + block;
        loop {
            let notified = self.queued.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = self.now();
            let mut give_up = None;
            let taken = {
                let mut st = lock(&self.state);
                let id = st.queues.get_mut(operation).and_then(VecDeque::pop_front);
                match id.and_then(|id| st.jobs.get_mut(&id)) {
                    Some(rec) if matches!(rec.phase, Phase::Queued) => {
                        rec.job.attempt += 1;
                        if now >= rec.job.deadline_ms {
                            give_up = Some((rec.job.id.clone(), FailureCause::Expired));
                            None
                        } else if rec.job.attempt > op.max_attempts {
                            give_up = Some((rec.job.id.clone(), FailureCause::Abandoned));
                            None
                        } else {
                            rec.seq += 1;
                            rec.phase = Phase::Running {
                                token: rec.seq,
                                until_ms: now.saturating_add(millis(lease)),
                            };
                            Some(Lease {
                                job: rec.job.clone(),
                                token: rec.seq,
                                worker: worker.to_owned(),
                            })
                        }
                    }
                    // A stale queue entry (the job ended or expired): skip it.
                    Some(_) | None => None,
                }
            };
            if let Some(l) = taken {
                return Ok(Some(l));
            }
            if let Some((id, cause)) = give_up {
                let message = match cause {
                    FailureCause::Expired => "the job passed its deadline before it ran",
                    _ => "the job used up its attempts",
                };
                self.fail_unleased(&id, cause, message.into()).await;
                continue;
            }
            if self.queued_len(operation) > 0 {
                continue;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let _ = tokio::time::timeout(deadline - now, notified).await;
        }
    }

    async fn renew(&self, lease: &Lease, by: Duration) -> Result<Finish, JobError> {
        let now = self.now();
        let mut st = lock(&self.state);
        match st.jobs.get_mut(&lease.job.id).map(|r| &mut r.phase) {
            Some(Phase::Running { token, until_ms }) if *token == lease.token => {
                *until_ms = now.saturating_add(millis(by));
                Ok(Finish::Recorded)
            }
            _ => Ok(Finish::LeaseLost),
        }
    }

    async fn complete(&self, lease: &Lease, result: Value) -> Result<Finish, JobError> {
        Ok(self.finish(lease, JobStatus::Succeeded { result }, false))
    }

    async fn fail(
        &self,
        lease: &Lease,
        cause: FailureCause,
        message: &str,
    ) -> Result<Finish, JobError> {
        let status = JobStatus::Failed {
            cause,
            message: message.to_owned(),
        };
        if self.finish(lease, status, true) == Finish::LeaseLost {
            return Ok(Finish::LeaseLost);
        }
        self.refund(&lease.job.id, &lease.job.user).await?;
        Ok(Finish::Recorded)
    }

    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError> {
        {
            let mut st = lock(&self.state);
            let Some(rec) = st.jobs.get_mut(&lease.job.id) else {
                return Ok(Finish::LeaseLost);
            };
            match rec.phase {
                Phase::Running { token, .. } if token == lease.token => {}
                _ => return Ok(Finish::LeaseLost),
            }
            rec.phase = Phase::Queued;
            rec.job.attempt = rec.job.attempt.saturating_sub(1);
            st.queues
                .entry(lease.job.operation.clone())
                .or_default()
                .push_front(lease.job.id.clone());
        }
        self.queued.notify_waiters();
        Ok(Finish::Recorded)
    }

    async fn maintain(&self, _worker: &str, _lease: Duration) -> Result<Maintenance, JobError> {
        let now = self.now();
        let mut report = Maintenance::default();
        let mut abandon = Vec::new();
        let mut refunds = Vec::new();
        {
            let mut st = lock(&self.state);
            let ttl = millis(self.options.result_ttl);
            let grace = millis(self.options.refund_grace);
            st.jobs.retain(|_, r| match r.phase {
                Phase::Done { at_ms, .. } => r.refund_pending || at_ms.saturating_add(ttl) > now,
                _ => true,
            });
            let mut requeue = Vec::new();
            for rec in st.jobs.values_mut() {
                match rec.phase {
                    Phase::Running { until_ms, .. } if until_ms < now => {
                        rec.phase = Phase::Queued;
                        requeue.push((rec.job.operation.clone(), rec.job.id.clone()));
                    }
                    Phase::Held { until_ms } if until_ms < now => {
                        abandon.push(rec.job.id.clone());
                    }
                    Phase::Done { at_ms, .. }
                        if rec.refund_pending && at_ms.saturating_add(grace) <= now =>
                    {
                        refunds.push((rec.job.id.clone(), rec.job.user.clone()));
                    }
                    _ => {}
                }
            }
            report.requeued = requeue.len() as u64;
            for (op, id) in requeue {
                st.queues.entry(op).or_default().push_front(id);
            }
        }
        if report.requeued > 0 {
            self.queued.notify_waiters();
        }
        for id in abandon {
            self.fail_unleased(
                &id,
                FailureCause::Abandoned,
                "the submission did not complete".into(),
            )
            .await;
            report.abandoned += 1;
        }
        for (id, user) in refunds {
            self.refund(&id, &user).await?;
            report.refunded += 1;
        }
        Ok(report)
    }

    async fn retire(&self, _worker: &str) -> Result<(), JobError> {
        Ok(())
    }
}
