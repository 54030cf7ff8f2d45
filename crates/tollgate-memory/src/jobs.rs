//! The in-memory job queue: the embedded backend, with the same semantics as the
//! Redis queue (the submission sequence of [`JobQueue::submit`]; leases with
//! fencing tokens; a claim of the charge before the provider call; requeue on
//! lease expiry up to `max_runs`; release at most once).
//!
//! One mutex guards every job and queue; it is never held across an await (the
//! ledger calls happen between critical sections, in the same order as the
//! Redis backend's steps).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::Notify;

use tollgate_core::clock::{Clock, SystemClock};
use tollgate_core::config::Config;
use tollgate_core::head::Head;
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{
    self, millis, Charge, Enqueued, Failure, FailureCause, Finish, FullMarks, Job, JobError,
    JobInfo, JobOptions, JobQueue, JobSource, JobStatus, Lease, Maintenance, QueueStats, Taker,
    Watch, Watchers,
};
use tollgate_core::ledger::Ledger;
use tollgate_core::lock;

#[derive(Debug, Clone)]
enum Phase {
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
    /// A failed job whose release has not been confirmed yet.
    release_pending: bool,
    /// Its keyless sync call was answered while the release was pending:
    /// the record goes once the release is confirmed.
    forget_on_release: bool,
    /// A run claimed the charge, about to call the provider.
    started: bool,
    /// What the record stores: the input's JSON text while the job can run,
    /// the result's or the error message's once final.
    kept_len: usize,
}

impl Record {
    /// What the record counts towards its user's `max_stored_bytes` at
    /// `now`: nothing once its result expired (`ttl` ms after it ended).
    fn stored(&self, now: u64, ttl: u64) -> u64 {
        match self.phase {
            Phase::Done { at_ms, .. }
                if !self.release_pending && at_ms.saturating_add(ttl) <= now =>
            {
                0
            }
            _ => job::stored_bytes(self.kept_len),
        }
    }

    fn info(&self) -> JobInfo {
        let (status, finished_at_ms) = match &self.phase {
            Phase::Queued => (JobStatus::Queued, None),
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
    /// Each user's records, by operation: what counts towards the user's
    /// `max_stored_bytes` in that queue.
    by_user: HashMap<(UserId, String), Owned>,
}

/// A user's records in one queue.
#[derive(Debug, Default)]
struct Owned {
    ids: HashSet<RequestId>,
    /// What they store, counting a record whose result expired (it stores
    /// nothing) until maintenance forgets it: an upper bound of the exact
    /// figure, kept as records come, change and go, so that a submission
    /// well under the limit is checked in O(1); only one near it counts its
    /// records one by one.
    bound: u64,
}

impl State {
    /// The record of `lease`'s job while `lease` is the one it runs under.
    fn leased(&mut self, lease: &Lease) -> Option<&mut Record> {
        let current = |rec: &&mut Record| matches!(rec.phase, Phase::Running { token, .. } if token == lease.token);
        self.jobs.get_mut(&lease.job.id).filter(current)
    }

    fn forget(&mut self, id: &RequestId) {
        if let Some(rec) = self.jobs.remove(id) {
            let owner = (rec.job.user, rec.job.operation);
            if let Some(o) = self.by_user.get_mut(&owner) {
                if o.ids.remove(id) {
                    o.bound = o.bound.saturating_sub(job::stored_bytes(rec.kept_len));
                }
                if o.ids.is_empty() {
                    self.by_user.remove(&owner);
                }
            }
        }
    }

    /// Sets what record `id` keeps (`kept_len`), and its owner's bound.
    fn keep(&mut self, id: &RequestId, len: usize) {
        let Self { jobs, by_user, .. } = self;
        if let Some(rec) = jobs.get_mut(id) {
            let (old, new) = (job::stored_bytes(rec.kept_len), job::stored_bytes(len));
            rec.kept_len = len;
            let owner = (rec.job.user.clone(), rec.job.operation.clone());
            if let Some(o) = by_user.get_mut(&owner) {
                if o.ids.contains(id) {
                    o.bound = o.bound.saturating_sub(old).saturating_add(new);
                }
            }
        }
    }
}

/// What a final record keeps: the result's or the error's text length (its
/// input is dropped: the job can no longer run).
fn final_len(status: &JobStatus) -> usize {
    match status {
        JobStatus::Succeeded { result, head } => {
            result.to_string().len()
                + head
                    .as_ref()
                    .map_or(0, tollgate_core::head::Head::stored_len)
        }
        JobStatus::Failed { message, .. } => message.len(),
        JobStatus::Queued | JobStatus::Running => 0,
    }
}

/// Which end of its queue a job goes back to: the head is taken next.
#[derive(Debug, Clone, Copy)]
enum End {
    Head,
    Tail,
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
    /// Rung when a job finishes.
    watchers: Arc<Watchers>,
    /// Refusals for stored bytes remembered in process.
    full_marks: FullMarks,
    /// `"<operation> <retry key>"` -> the job a retry joins, and until when
    /// (on `clock`).
    retry_targets: Mutex<HashMap<String, (RequestId, u64)>>,
}

impl std::fmt::Debug for MemoryJobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryJobQueue")
            .field("jobs", &lock(&self.state).jobs.len())
            .finish_non_exhaustive()
    }
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
            watchers: Arc::default(),
            full_marks: FullMarks::default(),
            retry_targets: Mutex::new(HashMap::new()),
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

    /// Marks a leased job done if `token` is current; `release` marks its
    /// release pending.
    fn finish(
        &self,
        lease: &Lease,
        status: JobStatus,
        release: bool,
        charged: Option<u64>,
    ) -> Finish {
        let now = self.now();
        let mut st = lock(&self.state);
        let Some(rec) = st.leased(lease) else {
            return Finish::LeaseLost;
        };
        let len = final_len(&status);
        rec.job.input = Value::Null;
        if charged.is_some() {
            rec.job.charged = charged;
        }
        rec.phase = Phase::Done { status, at_ms: now };
        rec.release_pending = release;
        st.keep(&lease.job.id, len);
        drop(st);
        self.watchers.ring(lease.job.id.as_str());
        Finish::Recorded
    }

    /// Releases the charge of job `id` (its owner failed) and confirms it.
    async fn release(&self, id: &RequestId) -> Result<(), JobError> {
        let Some(job) = lock(&self.state).jobs.get(id).map(|r| r.job.clone()) else {
            return Ok(());
        };
        self.ledger.release(&job.user, &job.id, &job.nonce).await?;
        let mut st = lock(&self.state);
        if let Some(rec) = st.jobs.get_mut(id) {
            if rec.job.nonce == job.nonce {
                rec.release_pending = false;
                if rec.forget_on_release {
                    st.forget(id);
                }
            }
        }
        Ok(())
    }

    /// Fails a job that is not leased (queued) and releases its charge,
    /// unless its cause keeps it.
    async fn fail_unleased(&self, id: &RequestId, cause: FailureCause, message: String) {
        let now = self.now();
        let release = !cause.charged();
        {
            let mut st = lock(&self.state);
            let Some(rec) = st.jobs.get_mut(id) else {
                return;
            };
            let len = message.len();
            rec.job.input = Value::Null;
            rec.phase = Phase::Done {
                status: JobStatus::Failed { cause, message },
                at_ms: now,
            };
            rec.release_pending = release;
            st.keep(id, len);
        }
        self.watchers.ring(id.as_str());
        if release {
            // A release that fails here stays pending; the next `maintain` retries it.
            let _ = self.release(id).await;
        }
    }

    /// Puts a leased job back in its queue, at `end`, without counting the
    /// attempt, if `lease` is current ([`JobSource::hand_back`]: the head;
    /// [`JobSource::defer`]: the tail).
    fn requeue_leased(&self, lease: &Lease, end: End) -> Finish {
        {
            let mut st = lock(&self.state);
            let Some(rec) = st.leased(lease) else {
                return Finish::LeaseLost;
            };
            rec.phase = Phase::Queued;
            rec.job.run = rec.job.run.saturating_sub(1);
            let queue = st.queues.entry(lease.job.operation.clone()).or_default();
            match end {
                End::Head => queue.push_front(lease.job.id.clone()),
                End::Tail => queue.push_back(lease.job.id.clone()),
            }
        }
        self.queued.notify_waiters();
        Finish::Recorded
    }

    /// The job was leased but its claim was refused (or it was cancelled): it
    /// owns no charge, so it fails without a release.
    fn fail_unpaid(&self, lease: &Lease, cause: FailureCause, message: &str) {
        let status = JobStatus::Failed {
            cause,
            message: message.into(),
        };
        self.finish(lease, status, false, None);
    }
}

#[async_trait]
impl JobQueue for MemoryJobQueue {
    async fn stats(&self) -> Result<Vec<QueueStats>, JobError> {
        let st = lock(&self.state);
        let mut running: HashMap<&str, u64> = HashMap::new();
        for rec in st.jobs.values() {
            if matches!(rec.phase, Phase::Running { .. }) {
                *running.entry(rec.job.operation.as_str()).or_default() += 1;
            }
        }
        Ok(self
            .config
            .operations()
            .map(|o| QueueStats {
                operation: o.name.clone(),
                queued: st.queues.get(&o.name).map_or(0, |q| q.len() as u64),
                running: running.get(o.name.as_str()).copied().unwrap_or(0),
                dead: 0,
                workers: None,
            })
            .collect())
    }

    /// Jobs in memory are typed values, never an entry to decode: nothing is
    /// ever moved aside (`dead` is 0), so every page is empty.
    async fn dead_page(&self, operation: &str, _limit: usize) -> Result<Vec<String>, JobError> {
        if self.config.operation(operation).is_none() {
            return Err(JobError::unknown_operation(&self.config, operation));
        }
        Ok(Vec::new())
    }

    fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    fn config(&self) -> &Config {
        &self.config
    }

    fn full_marks(&self) -> &FullMarks {
        &self.full_marks
    }

    fn poll(&self) -> Duration {
        self.options.poll
    }

    fn watch(&self, id: &RequestId) -> Watch {
        self.watchers.watch(id)
    }

    async fn enqueue(
        &self,
        job: &Job,
        create: bool,
        max_stored: u64,
    ) -> Result<Enqueued, JobError> {
        let now = self.now();
        let ttl = millis(self.options.result_ttl(&self.config, &job.operation));
        let input_len = job.input.to_string().len();
        {
            let mut st = lock(&self.state);
            if let Some(rec) = st.jobs.get(&job.id) {
                if rec.job.user != job.user {
                    return Ok(Enqueued::IdInUse);
                }
                if rec.job.nonce == job.nonce {
                    return Ok(Enqueued::Existing(Box::new(rec.info())));
                }
            }
            if !create {
                return Ok(Enqueued::Missing);
            }
            let owner = (job.user.clone(), job.operation.clone());
            let adding = job::stored_bytes(input_len);
            let this = |st: &State| {
                st.jobs
                    .get(&job.id)
                    .filter(|r| r.job.user == job.user && r.job.operation == job.operation)
                    .map_or(0, |r| job::stored_bytes(r.kept_len))
            };
            let bound = st
                .by_user
                .get(&owner)
                .map_or(0, |o| o.bound.saturating_sub(this(&st)));
            if bound.saturating_add(adding) > max_stored {
                // Near the limit: the exact figure (expired results store nothing).
                let stored: u64 = st.by_user.get(&owner).map_or(0, |o| {
                    o.ids
                        .iter()
                        .filter(|id| **id != job.id)
                        .filter_map(|id| st.jobs.get(id))
                        .map(|r| r.stored(now, ttl))
                        .sum()
                });
                if stored + adding > max_stored {
                    return Ok(Enqueued::Full {
                        stored,
                        limit: max_stored,
                    });
                }
            }
            // A new attempt replaces an earlier one; the fencing token carries on.
            let seq = st.jobs.get(&job.id).map_or(0, |r| r.seq);
            if st
                .jobs
                .get(&job.id)
                .is_some_and(|r| r.job.operation != job.operation)
            {
                st.forget(&job.id);
            }
            // An earlier attempt of this id in this queue leaves the bound as
            // the new record enters it.
            let earlier = this(&st);
            let o = st.by_user.entry(owner).or_default();
            if !o.ids.insert(job.id.clone()) {
                o.bound = o.bound.saturating_sub(earlier);
            }
            o.bound = o.bound.saturating_add(adding);
            st.jobs.insert(
                job.id.clone(),
                Record {
                    job: job.clone(),
                    phase: Phase::Queued,
                    seq,
                    release_pending: false,
                    forget_on_release: false,
                    started: false,
                    kept_len: input_len,
                },
            );
            st.queues
                .entry(job.operation.clone())
                .or_default()
                .push_back(job.id.clone());
        }
        self.queued.notify_waiters();
        Ok(Enqueued::Created)
    }

    async fn answered(&self, info: &JobInfo) -> Result<(), JobError> {
        let mut st = lock(&self.state);
        let Some(rec) = st.jobs.get_mut(&info.job.id).filter(|r| {
            r.job.user == info.job.user
                && r.job.nonce == info.job.nonce
                && matches!(r.phase, Phase::Done { .. })
        }) else {
            return Ok(());
        };
        if rec.release_pending {
            // Needed until the release is confirmed: it goes then.
            rec.forget_on_release = true;
        } else {
            st.forget(&info.job.id);
        }
        Ok(())
    }

    async fn remember_retry_target(
        &self,
        operation: &str,
        key: &str,
        id: &RequestId,
        ttl: Duration,
    ) -> Result<(), JobError> {
        let now = self.clock.now_ms();
        let until = now.saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        let mut targets = lock(&self.retry_targets);
        // Bounded by the calls left unanswered within a ttl: the expired go
        // whenever one is added.
        targets.retain(|_, (_, until)| *until > now);
        targets.insert(format!("{operation} {key}"), (id.clone(), until));
        Ok(())
    }

    async fn retry_target(
        &self,
        operation: &str,
        key: &str,
    ) -> Result<Option<RequestId>, JobError> {
        let now = self.clock.now_ms();
        Ok(lock(&self.retry_targets)
            .get(&format!("{operation} {key}"))
            .filter(|(_, until)| *until > now)
            .map(|(id, _)| id.clone()))
    }

    async fn read(
        &self,
        user: &UserId,
        operation: &str,
        id: &RequestId,
    ) -> Result<Option<JobInfo>, JobError> {
        Ok(lock(&self.state)
            .jobs
            .get(id)
            .filter(|r| &r.job.user == user && r.job.operation == operation)
            .map(Record::info))
    }

    async fn status(&self, user: &UserId, id: &RequestId) -> Result<Option<JobInfo>, JobError> {
        Ok(lock(&self.state)
            .jobs
            .get(id)
            .filter(|r| &r.job.user == user)
            .map(Record::info))
    }
}

#[async_trait]
impl JobSource for MemoryJobQueue {
    async fn take(&self, operation: &str, taker: Taker<'_>) -> Result<Option<Lease>, JobError> {
        let Taker {
            worker,
            block,
            lease,
        } = taker;
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
                        rec.job.run += 1;
                        if now >= rec.job.deadline_ms {
                            give_up = Some((
                                rec.job.id.clone(),
                                job::given_up(FailureCause::Expired, rec.started),
                            ));
                            None
                        } else if rec.job.run > op.max_runs {
                            give_up = Some((
                                rec.job.id.clone(),
                                job::given_up(FailureCause::Abandoned, rec.started),
                            ));
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
                                time_left: Duration::from_millis(
                                    rec.job.deadline_ms.saturating_sub(now),
                                ),
                                ran_before: rec.started,
                            })
                        }
                    }
                    // A stale queue entry (the job ended or expired): skip it.
                    Some(_) | None => None,
                }
            };
            if let Some(lease) = taken {
                return Ok(Some(lease));
            }
            if let Some((id, cause)) = give_up {
                let message = match cause {
                    FailureCause::Expired => "the job passed its deadline before it ran",
                    FailureCause::Unanswered => job::LOST_MID_RUN,
                    _ => "the job used up its runs",
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

    async fn settle(
        &self,
        lease: &Lease,
        answer: &serde_json::Value,
    ) -> Result<job::Settled, JobError> {
        job::settle(&*self.ledger, &self.config, &lease.job, answer).await
    }

    async fn start(&self, lease: &Lease) -> Result<bool, JobError> {
        let claim = job::claim(&*self.ledger, &lease.job, self.config.hold_grace()).await?;
        if let Some((cause, message)) = job::unrun(claim) {
            self.fail_unpaid(lease, cause, message);
            return Ok(false);
        }
        let mut st = lock(&self.state);
        if let Some(rec) = st.leased(lease) {
            rec.started = true;
        }
        Ok(true)
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
        self.complete_with(lease, result, None, None).await
    }

    async fn complete_with(
        &self,
        lease: &Lease,
        result: Value,
        head: Option<Head>,
        charged: Option<u64>,
    ) -> Result<Finish, JobError> {
        let head = head.filter(|h| !h.is_plain());
        Ok(self.finish(lease, JobStatus::Succeeded { result, head }, false, charged))
    }

    async fn fail(&self, lease: &Lease, failure: Failure<'_>) -> Result<Finish, JobError> {
        let Failure {
            cause,
            charge,
            message,
        } = failure;
        let status = JobStatus::Failed {
            cause,
            message: message.to_owned(),
        };
        let release = matches!(charge, Charge::Release { .. });
        if self.finish(lease, status, release, None) == Finish::LeaseLost {
            return Ok(Finish::LeaseLost);
        }
        if release {
            self.release(&lease.job.id).await?;
        }
        Ok(Finish::Recorded)
    }

    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError> {
        Ok(self.requeue_leased(lease, End::Head))
    }

    async fn defer(&self, lease: &Lease) -> Result<Finish, JobError> {
        Ok(self.requeue_leased(lease, End::Tail))
    }

    async fn maintain(&self, _worker: &str, _lease: Duration) -> Result<Maintenance, JobError> {
        let now = self.now();
        let mut report = Maintenance::default();
        let mut releases = Vec::new();
        {
            let mut st = lock(&self.state);
            let grace = millis(self.options.release_grace);
            let expired: Vec<RequestId> = st
                .jobs
                .values()
                .filter(|r| match r.phase {
                    Phase::Done { at_ms, .. } => {
                        let ttl = millis(self.options.result_ttl(&self.config, &r.job.operation));
                        !r.release_pending && at_ms.saturating_add(ttl) <= now
                    }
                    _ => false,
                })
                .map(|r| r.job.id.clone())
                .collect();
            for id in &expired {
                st.forget(id);
            }
            let mut requeue = Vec::new();
            for rec in st.jobs.values_mut() {
                match rec.phase {
                    Phase::Running { until_ms, .. } if until_ms < now => {
                        rec.phase = Phase::Queued;
                        requeue.push((rec.job.operation.clone(), rec.job.id.clone()));
                    }
                    Phase::Done { at_ms, .. }
                        if rec.release_pending && at_ms.saturating_add(grace) <= now =>
                    {
                        releases.push(rec.job.id.clone());
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
        for id in releases {
            self.release(&id).await?;
            report.released += 1;
        }
        Ok(report)
    }

    async fn retire(&self, _worker: &str) -> Result<(), JobError> {
        Ok(())
    }
}
