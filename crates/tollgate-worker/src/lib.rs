//! The worker role: for each operation, takes jobs from its queue (a
//! [`JobSource`]: Redis or in-memory), waits for the provider's throttle, calls
//! the provider, and records the result, or the failure with what the
//! outcome policy (`tollgate_providers::outcome`) decided for its charge:
//! released, or kept when the upstream may have done the work.
//!
//! The job's deadline (the lease's `time_left`, on the store's clock) bounds
//! the waits and is checked before each attempt is sent; a call already sent
//! is never abandoned for it: it ends by itself (bounded by the provider's
//! `timeout`) and its outcome decides, while the lease keeps being renewed, so
//! no maintenance requeues the job meanwhile. A worker that dies mid-call
//! leaves a job whose lease lapses, marked `started` (`JobSource::start`):
//! before its deadline it runs again under the same charge, and that run's
//! failure keeps the charge (`Lease::ran_before`); past its deadline (or its
//! attempts) the next take fails it `unanswered` with its charge kept
//! (`job::given_up`): never run again for free, never released.
//!
//! While a job runs its lease is renewed every third of the lease; a lost lease
//! (the worker was paused and the job went to another), or one this worker
//! sees lapsed on waking from a pause, abandons the call, and
//! the fencing token refuses anything this worker still tries to record.
//! Periodically every worker runs the queue's maintenance (requeue expired
//! leases, reclaim dead workers' jobs, abandon stale holds, finish releases).
//!
//! Workers are shared between users: one user's jobs hold at most its cap of
//! this worker's slots ([`WorkerConfig::user_share`], or its plan's
//! `max_in_flight`), counted per user by a guard each running job holds. A
//! job taken while its user is at its cap is deferred before its claim
//! ([`JobSource::defer`]: to its queue's tail, attempt uncounted, charge
//! untouched) and its slot is free at once; a fetch loop that takes again a
//! job it deferred lately has gone round its queue and waits before the next
//! round (`Rounds`).
//!
//! Shutdown: stop taking, give in-flight jobs `shutdown_grace` to finish, hand
//! the rest back to their queue, give back moved-but-unleased ids, exit.
//!
//! Observed in [`WorkerConfig::metrics`]: jobs in flight, how each ended,
//! the jobs deferred,
//! the charges released, leases lost, maintenance's reclaims; every fetch loop
//! and the maintenance loop beat a [`LoopBeat`] (`/readyz` reports a silent one).
//! **Invariant:** a worker touches a budget only as its job's charge's owner:
//! it claims it before the call, settles it to the reported cost after a
//! success (by the charge's nonce), and releases it, when the outcome policy
//! says so, through the job source's fenced `fail` (release once).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tollgate_core::lock;
use tollgate_core::throttle::{Grant, ThrottleError};
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::{self, Charge, Failure, FailureCause, Finish, JobSource, Lease, Taker},
    ledger::Ledger,
    metrics::{JobEnd, LoopBeat, Metrics},
    stream::{self, JobStreams, NoReaders, StreamEvent, StreamWriter},
};
use tollgate_providers::{outcome, CallError, CallOptions, Client, FirstSlot, Shares};
use tracing::Instrument;

/// Tunables of the worker role.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub config: Arc<Config>,
    /// Jobs run at once (across operations).
    pub concurrency: usize,
    /// A job's lease; renewed every third of it while the job runs.
    pub lease: Duration,
    /// How long this worker counts as alive after its last heartbeat.
    pub liveness: Duration,
    /// How often this worker runs the queue's maintenance (and heartbeats).
    pub maintain_every: Duration,
    /// How long one take blocks before the loop looks at shutdown again.
    pub block: Duration,
    /// On shutdown, how long in-flight jobs may still finish before they are
    /// handed back.
    pub shutdown_grace: Duration,
    /// Operations served (default: every configured one).
    pub operations: Vec<String>,
    /// Where the worker's metrics and loop beats go: the process's
    /// registry (`Backends::metrics`); a private one by default.
    pub metrics: Arc<Metrics>,
    /// Where streamed jobs' events go (`Backends::streams`): to the api pods'
    /// readers. By default none ([`NoReaders`]: every event is dropped).
    pub streams: Arc<dyn JobStreams>,
    /// The most of this worker's slots one user's jobs hold at once, as a
    /// fraction of `concurrency`, in (0, 1]: a user's cap is
    /// `max(1, ceil(concurrency × user_share))` (1: no bound). A user whose
    /// plan sets `max_in_flight` has that as its cap instead. Default
    /// [`USER_SHARE`]: one user's flood of long calls (streams) leaves half
    /// of every worker to everyone else.
    pub user_share: f64,
    /// Where a user's plan is read, for its `max_in_flight` (`Backends::ledger`);
    /// asked only when some plan sets one. `None`: every user has the
    /// default cap.
    pub plans: Option<Arc<dyn Ledger>>,
}

/// The default [`WorkerConfig::user_share`].
pub const USER_SHARE: f64 = 0.5;

impl WorkerConfig {
    pub fn new(config: Arc<Config>) -> Self {
        Self {
            operations: config.operations().map(|o| o.name.clone()).collect(),
            metrics: Arc::new(Metrics::new(&config)),
            streams: Arc::new(NoReaders),
            config,
            concurrency: 32,
            lease: Duration::from_secs(10),
            liveness: Duration::from_secs(3),
            maintain_every: Duration::from_secs(1),
            block: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(10),
            user_share: USER_SHARE,
            plans: None,
        }
    }

    /// The most slots of this worker one user's jobs hold by default:
    /// `max(1, ceil(concurrency × user_share))`.
    pub fn user_cap(&self) -> usize {
        // Both small: `concurrency` is a count of tasks, the share at most 1.
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let cap = (self.concurrency as f64 * self.user_share).ceil() as usize;
        cap.clamp(1, self.concurrency.max(1))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("no operations to serve: the config has no [operations.*]")]
    NoOperations,
    #[error("operations.{0}: not configured")]
    UnknownOperation(String),
    #[error("operations.{operation}: provider {provider} has no client")]
    MissingProvider { operation: String, provider: String },
    #[error("--concurrency must be >= 1")]
    ZeroConcurrency,
    #[error("--user-share must be in (0, 1], got {0}")]
    BadUserShare(f64),
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs the worker until `shutdown` resolves; see the module docs.
pub async fn run(
    cfg: WorkerConfig,
    source: Arc<dyn JobSource>,
    providers: BTreeMap<String, Arc<dyn Client>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), WorkerError> {
    if cfg.concurrency == 0 {
        return Err(WorkerError::ZeroConcurrency);
    }
    if !(cfg.user_share > 0.0 && cfg.user_share <= 1.0) {
        return Err(WorkerError::BadUserShare(cfg.user_share));
    }
    if cfg.operations.is_empty() {
        return Err(WorkerError::NoOperations);
    }
    let mut routes = Vec::new();
    for name in &cfg.operations {
        let op = cfg
            .config
            .operation(name)
            .ok_or_else(|| WorkerError::UnknownOperation(name.clone()))?;
        let provider = providers
            .get(&op.provider)
            .ok_or_else(|| WorkerError::MissingProvider {
                operation: op.name.clone(),
                provider: op.provider.clone(),
            })?;
        routes.push((op.name.clone(), Arc::clone(provider)));
    }
    let worker = RequestId::generate().as_str().replace('-', "");
    tracing::info!(worker = %worker, operations = routes.len(), concurrency = cfg.concurrency, "worker starting");
    // When the last maintenance round that succeeded began: the fetch loops
    // pop only while it is recent (`job::may_pop`), so that no id lands in a
    // list nobody knows of (none before the first heartbeat, none long after
    // the last).
    let listed: Listed = Arc::new(Mutex::new(None));
    let began = Instant::now();
    match source.maintain(&worker, cfg.liveness).await {
        Ok(_) => *lock(&listed) = Some(began),
        Err(e) => tracing::warn!(error = %e, "first maintenance failed; retrying in the loop"),
    }
    let (stop_tx, stop) = watch::channel(false);
    let slots = Arc::new(Semaphore::new(cfg.concurrency));
    let users = Arc::new(Users::new(&cfg));
    let mut tasks = JoinSet::new();
    let loops = cfg.metrics.loops();
    tasks.spawn(maintenance(
        Arc::clone(&source),
        worker.clone(),
        cfg.clone(),
        Arc::clone(&listed),
        loops.register("worker maintenance", cfg.maintain_every),
        stop.clone(),
    ));
    for (operation, provider) in routes {
        let span = tracing::info_span!("fetch", operation = %operation);
        let beat = loops.register(format!("worker fetch {operation}"), cfg.block);
        tasks.spawn(
            fetch(
                Arc::clone(&source),
                provider,
                operation,
                worker.clone(),
                cfg.clone(),
                Arc::clone(&slots),
                Arc::clone(&users),
                Arc::clone(&listed),
                beat,
                stop.clone(),
            )
            .instrument(span),
        );
    }
    shutdown.await;
    tracing::info!("worker stopping: no new jobs; finishing or handing back the ones in flight");
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    // Every job task holds a slot: all slots back means all jobs ended.
    let all = u32::try_from(cfg.concurrency).unwrap_or(u32::MAX);
    let wait = cfg.shutdown_grace + Duration::from_secs(10);
    if tokio::time::timeout(wait, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("jobs still running after the grace period; their leases will expire");
    }
    match source.retire(&worker).await {
        Ok(()) => tracing::info!("worker stopped"),
        Err(e) => {
            tracing::warn!(error = %e, "retiring failed; others reclaim after the liveness ends")
        }
    }
    Ok(())
}

/// When this worker's last successful maintenance round began (its
/// heartbeats are at least that recent).
type Listed = Arc<Mutex<Option<Instant>>>;

async fn maintenance(
    source: Arc<dyn JobSource>,
    worker: String,
    cfg: WorkerConfig,
    listed: Listed,
    beat: LoopBeat,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let began = Instant::now();
        let r = source.maintain(&worker, cfg.liveness).await;
        if r.is_ok() {
            *lock(&listed) = Some(began);
        }
        match r {
            Ok(m) if m != Default::default() => {
                cfg.metrics.maintained(&m);
                tracing::info!(
                    requeued = m.requeued,
                    abandoned = m.abandoned,
                    released = m.released,
                    "maintenance"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "maintenance failed"),
        }
        beat.beat(cfg.maintain_every);
        tokio::select! {
            () = tokio::time::sleep(cfg.maintain_every) => {}
            () = stopped(&mut stop) => return,
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn fetch(
    source: Arc<dyn JobSource>,
    provider: Arc<dyn Client>,
    operation: String,
    worker: String,
    cfg: WorkerConfig,
    slots: Arc<Semaphore>,
    users: Arc<Users>,
    listed: Listed,
    beat: LoopBeat,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(50);
    let mut rounds = Rounds::default();
    let taker = Taker::new(&worker, cfg.block, cfg.lease);
    while !*stop.borrow() {
        beat.beat(cfg.block);
        // Not listed for sure (no heartbeat yet, or none for long: Redis is
        // unreachable for this worker): a pop now might land in a list that
        // the others have forgotten by the time this worker dies.
        let since = lock(&listed).map(|t| t.elapsed());
        if !job::may_pop(since, cfg.liveness) {
            tokio::select! {
                () = tokio::time::sleep(cfg.maintain_every) => continue,
                () = stopped(&mut stop) => return,
            }
        }
        // Every slot busy is a live loop too: it beats while it waits (in
        // its place in the semaphore's queue: the same acquire throughout).
        let acquire = Arc::clone(&slots).acquire_owned();
        tokio::pin!(acquire);
        let permit = loop {
            tokio::select! {
                p = &mut acquire => match p {
                    Ok(p) => break p,
                    Err(_) => return,
                },
                () = tokio::time::sleep(cfg.block) => beat.beat(cfg.block),
                () = stopped(&mut stop) => return,
            }
        };
        let taken = tokio::select! {
            r = source.take(&operation, taker) => r,
            // A take dropped here may have moved an id into this worker's
            // processing list: `retire` gives it back.
            () = stopped(&mut stop) => return,
        };
        match taken {
            Ok(Some(lease)) => {
                backoff = Duration::from_millis(50);
                // Its user at its cap here: back to the tail of the queue,
                // before its charge is claimed; the slot is free at once.
                let Some(held) = users.admit(&lease.job.user).await else {
                    drop(permit);
                    cfg.metrics.job_deferred(&operation);
                    defer(source.as_ref(), &lease).await;
                    // Taken again within moments: every job queued belongs
                    // to users at their cap; wait before the next round.
                    if let Some(pause) = rounds.deferred(&lease.job.id) {
                        tracing::debug!(?pause, "every queued job's user is at its cap; waiting");
                        tokio::select! {
                            () = tokio::time::sleep(pause) => {}
                            () = stopped(&mut stop) => return,
                        }
                    }
                    continue;
                };
                rounds.ran();
                let span = tracing::info_span!(
                    "job",
                    request_id = %lease.job.id,
                    user = %lease.job.user,
                    run = lease.job.run,
                    trace_id = lease.job.trace.as_ref().map(|t| t.trace_id()),
                );
                tokio::spawn(
                    run_job(
                        Arc::clone(&source),
                        Arc::clone(&provider),
                        lease,
                        cfg.clone(),
                        (permit, held),
                        stop.clone(),
                    )
                    .instrument(span),
                );
            }
            Ok(None) => backoff = Duration::from_millis(50),
            Err(e) => {
                drop(permit);
                tracing::warn!(error = %e, "take failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stopped(&mut stop) => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Puts a job taken past its user's cap back at the tail of its queue
/// ([`JobSource::defer`]). Tried once: a store that fails it fails the next
/// take too, and a lease not given back lapses and goes back by maintenance
/// (its attempt counted).
async fn defer(source: &dyn JobSource, lease: &Lease) {
    match source.defer(lease).await {
        Ok(Finish::Recorded) => {
            tracing::debug!(request_id = %lease.job.id, user = %lease.job.user, "the user holds its share of this worker; job deferred");
        }
        Ok(Finish::LeaseLost) => {
            tracing::warn!(request_id = %lease.job.id, "deferring a job found its lease lost");
        }
        Err(e) => {
            tracing::warn!(error = %e, request_id = %lease.job.id, "deferring a job failed; its lease will lapse");
        }
    }
}

/// How long a deferred id is remembered: taken again within this, the fetch
/// loop has gone round its queue.
const RECENT: Duration = Duration::from_secs(2);
/// The most deferred ids remembered: a round of this many deferrals counts
/// as gone round too (a backlog larger than that is not cycled without pause).
const RECENT_MAX: usize = 4096;
/// A fetch loop's first wait once it has gone round; doubled each round up
/// to [`PAUSE_MAX`], back to this when it runs a job.
const PAUSE_MIN: Duration = Duration::from_millis(50);
const PAUSE_MAX: Duration = Duration::from_secs(1);

/// A fetch loop's deferrals: the ids it deferred lately, to see when it has
/// gone round its queue (every job in it belongs to a user at its cap), and
/// how long it then waits before taking again. Without it, a queue of such
/// jobs would be taken and deferred in a loop as fast as Redis answers.
#[derive(Debug)]
struct Rounds {
    recent: HashMap<RequestId, Instant>,
    pause: Duration,
}

impl Default for Rounds {
    fn default() -> Self {
        Self {
            recent: HashMap::new(),
            pause: PAUSE_MIN,
        }
    }
}

impl Rounds {
    /// Job `id` was deferred: `Some(wait)` when the loop has gone round its
    /// queue (it deferred `id` lately, or [`RECENT_MAX`] ids). A new round
    /// starts then: one wait per round, not one per job of the round.
    fn deferred(&mut self, id: &RequestId) -> Option<Duration> {
        let now = Instant::now();
        if self.recent.len() >= RECENT_MAX {
            self.recent.retain(|_, at| now.duration_since(*at) < RECENT);
        }
        let again = self
            .recent
            .get(id)
            .is_some_and(|at| now.duration_since(*at) < RECENT);
        if !again && self.recent.len() < RECENT_MAX {
            self.recent.insert(id.clone(), now);
            return None;
        }
        self.recent.clear();
        self.recent.insert(id.clone(), now);
        let pause = self.pause;
        self.pause = (self.pause * 2).min(PAUSE_MAX);
        Some(pause)
    }

    /// The loop ran a job: the next round waits the least again.
    fn ran(&mut self) {
        self.pause = PAUSE_MIN;
    }
}

/// Each user's jobs running in this worker, bounded by its cap
/// ([`WorkerConfig::user_share`], or its plan's `max_in_flight`).
struct Users {
    cap: usize,
    /// Plans read for their `max_in_flight` (cached; asked only when some
    /// plan sets one).
    plans: Shares,
    running: Mutex<HashMap<UserId, usize>>,
}

/// How long a plan look-up may take before the default cap is used.
const PLAN_WITHIN: Duration = Duration::from_millis(500);

impl Users {
    fn new(cfg: &WorkerConfig) -> Self {
        let config = Arc::clone(&cfg.config);
        Self {
            cap: cfg.user_cap(),
            plans: match &cfg.plans {
                Some(ledger) => Shares::for_caps(config, Arc::clone(ledger)),
                None => Shares::default_plan(config),
            },
            running: Mutex::new(HashMap::new()),
        }
    }

    /// `user`'s cap here: its plan's `max_in_flight`, else the default.
    async fn cap(&self, user: &UserId) -> usize {
        let share = self.plans.share(user, Duration::ZERO, PLAN_WITHIN).await;
        share.max_in_flight.map_or(self.cap, |m| {
            usize::try_from(m).unwrap_or(usize::MAX).max(1)
        })
    }

    /// One more job of `user` running here, unless it is at its cap.
    async fn admit(self: &Arc<Self>, user: &UserId) -> Option<Held> {
        let cap = self.cap(user).await;
        let mut running = lock(&self.running);
        let n = running.entry(user.clone()).or_default();
        if *n >= cap {
            if *n == 0 {
                running.remove(user);
            }
            return None;
        }
        *n += 1;
        Some(Held {
            users: Arc::clone(self),
            user: user.clone(),
        })
    }
}

/// A job of `user` running here: counted until dropped.
struct Held {
    users: Arc<Users>,
    user: UserId,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut running = lock(&self.users.running);
        if let Some(n) = running.get_mut(&self.user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                running.remove(&self.user);
            }
        }
    }
}

enum Ended {
    Called(Result<tollgate_providers::Answer, CallError>),
    LeaseLost,
    Stopping,
}

async fn run_job(
    source: Arc<dyn JobSource>,
    provider: Arc<dyn Client>,
    lease: Lease,
    cfg: WorkerConfig,
    // Both given back however the job ends (a panic too): dropped with the task.
    _held: (OwnedSemaphorePermit, Held),
    stop: watch::Receiver<bool>,
) {
    let metrics = Arc::clone(&cfg.metrics);
    let _running = metrics.job_running(&lease.job.operation);
    let (end, released, spent) = job(source, provider, &lease, cfg, stop).await;
    metrics.job_ended(&lease.job.operation, end);
    if spent > 0 {
        let j = &lease.job;
        metrics.spent(&j.provider, &j.operation, &priced_as(j), spent);
    }
    if let Some(cause) = released {
        metrics.job_released(cause.as_str());
    }
}

/// How a recorded step ended the job: `ok` when it was recorded.
fn end_of(recorded: Option<Finish>, ok: JobEnd) -> JobEnd {
    match recorded {
        Some(Finish::Recorded) => ok,
        Some(Finish::LeaseLost) => JobEnd::LeaseLost,
        None => JobEnd::Unrecorded,
    }
}

/// The price sheet entry a job was priced by, as a metric label: its name or
/// pattern (bounded by the sheet, unlike the model a request names), `""`
/// when unpriced.
fn priced_as(job: &tollgate_core::job::Job) -> String {
    job.price
        .as_deref()
        .and_then(tollgate_core::price::Applied::parse)
        .map(|a| {
            let key = a.entry.key;
            match key.strip_prefix("models.") {
                Some(k) => k.trim_matches('"').to_owned(),
                None => key,
            }
        })
        .unwrap_or_default()
}

/// Runs one leased job; returns how it ended, when its charge was released,
/// why, and what it charged once recorded (0 when released or not recorded
/// by this run).
async fn job(
    source: Arc<dyn JobSource>,
    provider: Arc<dyn Client>,
    lease: &Lease,
    cfg: WorkerConfig,
    mut stop: watch::Receiver<bool>,
) -> (JobEnd, Option<FailureCause>, u64) {
    let job = &lease.job;
    // The store's clock said how long the job had left when it was leased: a
    // monotonic timer from there, never this pod's wall clock. It bounds what
    // is sent, not what is in flight (see the module docs).
    let deadline = tokio::time::Instant::now() + lease.time_left;
    // A streamed job's events go to the api pod holding its client, as the
    // upstream sends them.
    let sink = stream::wants_stream(&job.input).then(|| cfg.streams.writer(job));
    // An earlier run streamed part of the answer and was lost: no call now.
    let lost_mid_stream = sink.is_some() && lease.ran_before;
    // The first slot is waited for while the job claims its charge: one
    // round trip in sequence, not two.
    let first = if lost_mid_stream {
        None
    } else {
        provider.first_slot(job, Some(deadline))
    };
    let (started, first) = start_with(source.as_ref(), lease, first).await;
    match started {
        Ok(true) => {}
        Ok(false) => {
            if let Some(slot) = first {
                slot.unused(provider.as_ref()).await;
            }
            tracing::warn!("the job's charge is not its own: failed unrun, nothing to release");
            return (JobEnd::Unpaid, None, 0);
        }
        Err(e) => {
            if let Some(slot) = first {
                slot.unused(provider.as_ref()).await;
            }
            tracing::warn!(error = %e, "claiming the job's charge failed; handing the job back");
            let recorded = finish("hand back", || source.hand_back(lease)).await;
            return (end_of(recorded, JobEnd::HandedBack), None, 0);
        }
    }
    let renew = async {
        loop {
            let asleep = tokio::time::Instant::now();
            until(asleep + cfg.lease / 3).await;
            // Woken a lease or more after it was last renewed: this process
            // was paused past the lease (SIGSTOP, a stalled VM), and another
            // worker may run the job now. No renewal has to say so (one over
            // a connection cut meanwhile says nothing): the call must not go
            // out, whatever became ready during the pause.
            if asleep.elapsed() >= cfg.lease {
                tracing::warn!("paused past the lease; the call is abandoned");
                return;
            }
            match source.renew(lease, cfg.lease).await {
                Ok(Finish::Recorded) => {}
                Ok(Finish::LeaseLost) => return,
                Err(e) => tracing::warn!(error = %e, "renewing the lease failed"),
            }
        }
    };
    let grace = async {
        stopped(&mut stop).await;
        tokio::time::sleep(cfg.shutdown_grace).await;
    };
    if let (Some(sink), true) = (&sink, lost_mid_stream) {
        // Its client cannot be given the rest, and the upstream may have worked.
        return lost_stream(source.as_ref(), lease, sink.as_ref()).await;
    }
    let first = first.map(Slot::into_first);
    let call = provider.call(
        job,
        CallOptions {
            deadline: Some(deadline),
            sink: sink.as_deref(),
            first,
        },
    );
    let ended = tokio::select! {
        // The lease first: after a pause it must be seen lost before a call
        // that became ready meanwhile goes out.
        biased;
        () = renew => Ended::LeaseLost,
        r = call => Ended::Called(r),
        () = grace => Ended::Stopping,
    };
    // What the job charges if this run records its end.
    let mut spent = 0;
    let (recorded, ok, cause) = match ended {
        Ended::Called(Ok(answer)) => {
            let (result, head) = (answer.body, answer.head);
            let charged = settle(source.as_ref(), lease, &result).await;
            spent = charged.unwrap_or(job.cost);
            // Settled first: a client that read the end reads its usage.
            if let Some(sink) = &sink {
                end_stream(sink.as_ref(), StreamEvent::End).await;
            }
            tracing::debug!("the provider answered; recording the result");
            let recorded = finish("complete", || {
                source.complete_with(lease, result.clone(), head.clone(), charged)
            })
            .await;
            (recorded, JobEnd::Succeeded, None)
        }
        Ended::Called(Err(e)) if e.may_hand_back() => {
            tracing::warn!(error = %e, "throttle unavailable; handing the job back");
            // Not at once: the next take would most likely fail the same way.
            tokio::time::sleep(Duration::from_secs(1)).await;
            (
                finish("hand back", || source.hand_back(lease)).await,
                JobEnd::HandedBack,
                None,
            )
        }
        Ended::Called(Err(e)) => {
            let (cause, charge, message) = if lease.ran_before {
                let (cause, charge) = outcome::after_lost_run(e.cause, e.charge);
                (
                    cause,
                    charge,
                    format!("{}; this run: {e}", job::LOST_MID_RUN),
                )
            } else {
                (e.cause, e.charge, e.record_message())
            };
            // The upstream's answer may echo what it was sent (a 401 that
            // quotes the key): at DEBUG only, cut, its provider's secrets masked.
            if let Some(body) = e.upstream_body() {
                let secrets: Vec<String> = cfg
                    .config
                    .upstreams(&job.provider)
                    .into_iter()
                    .flat_map(secret_values)
                    .collect();
                tracing::debug!(upstream_body = %loggable_body(body, &secrets), "the upstream's error answer");
            }
            match charge {
                Charge::Keep => {
                    tracing::info!(error = %e, cause = cause.as_str(), "job failed; the upstream may have worked: the charge stands");
                    // No usage was reported: the call is charged the most
                    // it may have used (the reservation), never the estimate.
                    let kept = settle(source.as_ref(), lease, &serde_json::Value::Null).await;
                    spent = kept.unwrap_or(job.cost);
                }
                Charge::Release { absorbed } => {
                    tracing::info!(error = %e, cause = cause.as_str(), absorbed, "job failed; releasing its charge")
                }
            }
            if let Some(sink) = &sink {
                end_stream(sink.as_ref(), StreamEvent::Error(e.error.to_string())).await;
            }
            let recorded = finish("fail", || {
                source.fail(lease, Failure::new(cause, charge, &message))
            })
            .await;
            if let (
                Some(Finish::Recorded),
                Charge::Release {
                    absorbed: Some(reason),
                },
            ) = (recorded, charge)
            {
                cfg.metrics.absorbed(&job.provider, reason);
            }
            let released = matches!(charge, Charge::Release { .. });
            (recorded, JobEnd::Failed, released.then_some(cause))
        }
        Ended::Stopping => (
            finish("hand back", || source.hand_back(lease)).await,
            JobEnd::HandedBack,
            None,
        ),
        Ended::LeaseLost => {
            tracing::warn!("lease lost while running; the call is abandoned");
            return (JobEnd::LeaseLost, None, 0);
        }
    };
    if recorded == Some(Finish::LeaseLost) {
        tracing::warn!(
            "lease lost: another worker owns the job; nothing recorded, nothing released"
        );
    }
    let end = end_of(recorded, ok);
    let spent = if recorded == Some(Finish::Recorded) {
        spent
    } else {
        0
    };
    (end, cause.filter(|_| end == JobEnd::Failed), spent)
}

/// The first slot of a job's call, asked for while the job started
/// ([`start_with`]).
enum Slot<'a> {
    /// Granted (or refused) during the start.
    Ready(Result<Grant, ThrottleError>),
    /// Still waited for.
    Waiting(FirstSlot<'a>),
}

impl<'a> Slot<'a> {
    /// For the call's first attempt.
    fn into_first(self) -> FirstSlot<'a> {
        match self {
            Slot::Ready(r) => Box::pin(std::future::ready(r)),
            Slot::Waiting(f) => f,
        }
    }

    /// The job will not call: a slot granted is ended unused; a wait still
    /// going is given up (dropped: no token taken).
    async fn unused(self, provider: &dyn Client) {
        if let Slot::Ready(Ok(grant)) = self {
            provider.unused_slot(&grant).await;
        }
    }
}

/// Starts the run ([`JobSource::start`]: the claim) while the `first` slot is
/// waited for; the slot comes back granted or still waited for.
/// What of an upstream's error answer is logged, at most.
const LOGGED_BODY: usize = 256;

/// The values of `upstream`'s secret headers (`secret_headers`, `auth_env`),
/// as the worker sent them, read from the environment (unset ones: none). A
/// value sent as `Bearer <token>` counts its token too, which an echo may
/// quote alone.
fn secret_values(upstream: &tollgate_core::config::Upstream) -> Vec<String> {
    let mut values = Vec::new();
    for var in upstream
        .secret_headers
        .values()
        .chain(upstream.auth_env.as_ref())
    {
        if let Ok(v) = std::env::var(var) {
            if let Some((_, token)) = v.split_once(' ') {
                values.push(token.trim().to_owned());
            }
            values.push(v);
        }
    }
    values.retain(|v| !v.is_empty());
    // The longest first: a token inside its own `Bearer` value is masked with it.
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    values
}

/// `body` for a log line: each of `secrets` masked, then cut to
/// [`LOGGED_BODY`] bytes (on a character's boundary), so that a cut never
/// leaves part of a secret unmasked.
fn loggable_body(body: &str, secrets: &[String]) -> String {
    let mut text = body.to_owned();
    for secret in secrets {
        if !secret.is_empty() {
            text = text.replace(secret.as_str(), "[masked]");
        }
    }
    if text.len() > LOGGED_BODY {
        let mut end = LOGGED_BODY;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

async fn start_with<'a>(
    source: &dyn JobSource,
    lease: &Lease,
    first: Option<FirstSlot<'a>>,
) -> (Result<bool, job::JobError>, Option<Slot<'a>>) {
    let Some(mut first) = first else {
        return (source.start(lease).await, None);
    };
    let start = source.start(lease);
    tokio::pin!(start);
    let mut granted = None;
    let started = loop {
        tokio::select! {
            biased;
            r = &mut start => break r,
            g = &mut first, if granted.is_none() => granted = Some(g),
        }
    };
    let slot = match granted {
        Some(g) => Slot::Ready(g),
        None => Slot::Waiting(first),
    };
    (started, Some(slot))
}

/// Appends the last event of a job's stream. A failure is logged: the reader
/// then sees the job's final record without an end, which it reports as an
/// incomplete answer.
async fn end_stream(sink: &dyn StreamWriter, event: StreamEvent) {
    if let Err(e) = sink.push(event).await {
        tracing::warn!(error = %e, "ending the job's stream failed");
    }
}

/// A streamed job taken again after a run that started and was lost: it is
/// not run again (the client had part of an answer from the lost run); it
/// fails unanswered, its charge kept (the most it may have used), and its
/// stream says so.
async fn lost_stream(
    source: &dyn JobSource,
    lease: &Lease,
    sink: &dyn StreamWriter,
) -> (JobEnd, Option<FailureCause>, u64) {
    let message = job::LOST_MID_RUN.to_owned();
    tracing::warn!("a streamed job's earlier run was lost mid-stream; failing it, charged");
    let kept = settle(source, lease, &serde_json::Value::Null).await;
    end_stream(sink, StreamEvent::Error(message.clone())).await;
    let recorded = finish("fail", || {
        source.fail(
            lease,
            Failure::new(FailureCause::Unanswered, Charge::Keep, &message),
        )
    })
    .await;
    let spent = match recorded {
        Some(Finish::Recorded) => kept.unwrap_or(lease.job.cost),
        _ => 0,
    };
    (end_of(recorded, JobEnd::Failed), None, spent)
}

/// Settles the job's charge to the cost the provider reported, when its
/// operation says where to read it (`Null`: no answer, the most it may have
/// used: [`job::settle`]). A store
/// failure is retried with backoff as long as a finishing call is
/// ([`RECORD_FOR`]): an outage the job's recording waits out (a Redis
/// restart) leaves the charge where the outcome rules put it, not at the most
/// reserved. Past that the charge stays what it is (never lost: the most
/// reserved, or the estimate).
async fn settle(source: &dyn JobSource, lease: &Lease, answer: &serde_json::Value) -> Option<u64> {
    use tollgate_core::job::Settled;
    let give_up = tokio::time::Instant::now() + RECORD_FOR;
    let mut backoff = Duration::from_millis(50);
    loop {
        match source.settle(lease, answer).await {
            Ok(Settled::Fixed) => {}
            Ok(Settled::To { estimate, cost }) => {
                tracing::debug!(estimate, cost, "the charge settled to the reported cost");
                return Some(cost);
            }
            Ok(Settled::NoUsage) if answer.is_null() => {
                tracing::debug!("no answer to read usage from; charged the most it may have used");
            }
            Ok(Settled::NoUsage) => {
                tracing::warn!(
                    "the answer reports no usage where the operation reads it; charged the most it may have used"
                );
            }
            Ok(Settled::NotOwned) => {
                tracing::warn!("the charge is not this job's any more; nothing settled");
            }
            Err(e) if tokio::time::Instant::now() + backoff < give_up => {
                tracing::warn!(error = %e, ?backoff, "settling the charge failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "settling the charge failed; the charge stays as it is");
            }
        }
        return None;
    }
}

/// Sleeps until `at`, and ends on any poll from `at` on: after a pause, the
/// task may be polled before its timer has fired.
async fn until(at: tokio::time::Instant) {
    use std::future::Future as _;
    let mut timer = std::pin::pin!(tokio::time::sleep_until(at));
    std::future::poll_fn(|cx| {
        if tokio::time::Instant::now() >= at {
            std::task::Poll::Ready(())
        } else {
            timer.as_mut().poll(cx)
        }
    })
    .await;
}

/// How long a finishing call is retried while the store is unreachable.
const RECORD_FOR: Duration = Duration::from_secs(60);

/// Runs a finishing call, retrying a store failure with backoff for up to
/// [`RECORD_FOR`]: a result not recorded is a provider call made again after
/// the lease ends, so a Redis outage is waited out rather than given up on
/// (until another worker holds the job: `Finish::LeaseLost`).
async fn finish<F, Fut>(what: &'static str, mut f: F) -> Option<Finish>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Finish, tollgate_core::job::JobError>>,
{
    let give_up = tokio::time::Instant::now() + RECORD_FOR;
    let mut backoff = Duration::from_millis(100);
    loop {
        match f().await {
            Ok(r) => return Some(r),
            Err(e) if tokio::time::Instant::now() + backoff < give_up => {
                tracing::warn!(error = %e, what, ?backoff, "recording failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                tracing::error!(
                    error = %e, what,
                    "recording failed; the lease will expire and the job run again"
                );
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{loggable_body, LOGGED_BODY};

    #[test]
    fn an_upstream_body_is_logged_masked_then_cut() {
        let secrets = vec!["sk-0123456789".to_owned()];
        let body = format!("bad key sk-0123456789 {}", "é".repeat(400));
        let logged = loggable_body(&body, &secrets);
        assert!(logged.starts_with("bad key [masked] "), "{logged}");
        assert!(logged.len() <= LOGGED_BODY + 3, "{}", logged.len());
        assert!(logged.ends_with("..."));
        // A secret across the cut is masked before the cut: no prefix of it stays.
        let body = format!("{}sk-0123456789", "x".repeat(LOGGED_BODY - 5));
        let logged = loggable_body(&body, &secrets);
        assert!(!logged.contains("sk-01"), "{logged}");
        assert_eq!(loggable_body("short", &secrets), "short");
    }
}
