//! The distributed job queue: [`RedisJobQueue`], both sides ([`JobQueue`] for the
//! api role, [`JobSource`] for workers), on reliable Redis lists.
//!
//! **Submit** (three steps, none of which can leak a reservation): claim the id
//! (`{r:<id>}:claim`, one id to one job), hold the job (`job_hold.lua`), reserve
//! the budget (the ledger's `reserve.lua`), queue the job (`job_release.lua`).
//! Denied: the held job is dropped. A crash between the steps leaves a held job
//! whose hold ends; maintenance fails it and refunds by request id (a no-op when
//! the reservation never happened).
//!
//! **Take**: `BLMOVE` from the operation's queue into the worker's processing
//! list, on a connection of its own (a blocking command would stall a shared
//! multiplexed one), then `job_lease.lua`: validates the record (malformed ones
//! go to the `dead` list), counts the attempt, increments the fencing token.
//! `job_complete.lua` / `job_fail.lua` / `job_hand_back.lua` check that token in
//! the same script that writes, so a worker that lost its lease writes nothing.
//!
//! **Refunds** cross hash tags (the job lives on the queue's tag, the budget on
//! the user's), so they go in order: mark the job failed with `refund` pending,
//! refund (idempotent by request id), confirm (`job_refunded.lua`). Maintenance
//! finishes refunds left pending by a crash.
//!
//! **Waking waiters** does not depend on pub/sub alone: finishing scripts
//! publish the job id, and a waiter also re-reads the record every `poll`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, ScriptInvocation, Value};
use serde_json::Value as Json;
use tokio::sync::{oneshot, Notify};
use tollgate_core::job::{wait_until_final, JobOptions};
use tollgate_core::{
    Config, FailureCause, Finish, Job, JobError, JobInfo, JobQueue, JobRequest, JobSource,
    JobStatus, Lease, Ledger, Maintenance, RequestId, ReserveOutcome, SubmitOutcome, UserId,
};

use crate::call::{self, CallError};
use crate::keys::{JobKeys, KeySpace};
use crate::pool::{redact_url, Pool, RedisBackendError, DEFAULT_TIMEOUT};
use crate::scripts::{self, HoldArgs};

/// Most ids one maintenance step handles per set and operation.
const MAINTAIN_BATCH: u32 = 100;

impl From<CallError> for JobError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Unavailable(m) => Self::Unavailable(m),
            CallError::Backend(m) => Self::Backend(m),
        }
    }
}

/// For calls on the dedicated (blocking, pub/sub) connections.
fn map_redis_error(e: redis::RedisError) -> JobError {
    CallError::from(e).into()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn bad_reply(what: &str, reply: impl std::fmt::Debug) -> JobError {
    JobError::Backend(format!("unexpected {what} reply: {reply:?}"))
}

/// Waiters by job id; the subscriber wakes them.
#[derive(Debug, Default)]
struct Waiters {
    by_id: Mutex<HashMap<String, Arc<Notify>>>,
}

impl Waiters {
    fn register(&self, id: &str) -> Arc<Notify> {
        Arc::clone(lock(&self.by_id).entry(id.to_owned()).or_default())
    }

    fn unregister(&self, id: &str, n: Arc<Notify>) {
        let mut map = lock(&self.by_id);
        drop(n);
        if map.get(id).is_some_and(|n| Arc::strong_count(n) == 1) {
            map.remove(id);
        }
    }

    fn wake(&self, id: &str) {
        if let Some(n) = lock(&self.by_id).get(id) {
            n.notify_waiters();
        }
    }

    fn wake_all(&self) {
        for n in lock(&self.by_id).values() {
            n.notify_waiters();
        }
    }
}

/// The distributed job queue.
pub struct RedisJobQueue {
    pool: Pool,
    client: redis::Client,
    keys: KeySpace,
    config: Arc<Config>,
    ledger: Arc<dyn Ledger>,
    options: JobOptions,
    timeout: Duration,
    channel: String,
    /// Idle connections for BLMOVE, one per concurrent take.
    blocking: Mutex<Vec<MultiplexedConnection>>,
    waiters: Arc<Waiters>,
    subscribed: AtomicBool,
    /// Dropping it stops the subscriber task.
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl std::fmt::Debug for RedisJobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisJobQueue")
            .field("prefix", &self.keys.prefix())
            .finish_non_exhaustive()
    }
}

impl RedisJobQueue {
    /// A queue on `pool` (blocking takes and the waiters' subscription open
    /// their own connections to `url`). `ledger` reserves and refunds.
    pub fn new(
        url: &str,
        pool: Pool,
        keys: KeySpace,
        config: Arc<Config>,
        ledger: Arc<dyn Ledger>,
        options: JobOptions,
    ) -> Result<Self, RedisBackendError> {
        let client = redis::Client::open(url).map_err(|e| RedisBackendError::BadUrl {
            url: redact_url(url),
            message: e.to_string(),
        })?;
        Ok(Self {
            pool,
            client,
            channel: keys.jobs_done(),
            keys,
            config,
            ledger,
            options,
            timeout: DEFAULT_TIMEOUT,
            blocking: Mutex::new(Vec::new()),
            waiters: Arc::new(Waiters::default()),
            subscribed: AtomicBool::new(false),
            stop: Mutex::new(None),
        })
    }

    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    async fn script<T: FromRedisValue>(
        &self,
        op: &'static str,
        inv: ScriptInvocation<'_>,
    ) -> Result<T, JobError> {
        Ok(call::script(&self.pool, self.timeout, op, &inv).await?)
    }

    async fn command<T: FromRedisValue>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T, JobError> {
        Ok(call::command(&self.pool, self.timeout, op, &cmd).await?)
    }

    /// The keys of the queue that holds job `id`, when `user` owns it (the claim
    /// records the owner and the operation).
    async fn locate(&self, user: &UserId, id: &RequestId) -> Result<Option<JobKeys>, JobError> {
        let mut get = redis::cmd("GET");
        get.arg(self.keys.job_claim(id));
        let owner: Option<String> = self.command("job_claim", get).await?;
        let Some((owner_user, operation)) = owner.as_deref().and_then(|o| o.split_once(' ')) else {
            return Ok(None);
        };
        if owner_user != user.as_str() {
            return Ok(None);
        }
        Ok(self
            .config
            .operation(operation)
            .map(|op| self.keys.jobs(&op.name)))
    }

    /// The job record, when it belongs to `user`.
    async fn read_owned(
        &self,
        keys: &JobKeys,
        user: &UserId,
        id: &RequestId,
    ) -> Result<Option<JobInfo>, JobError> {
        Ok(self
            .read(keys, id)
            .await?
            .filter(|info| &info.job.user == user))
    }

    fn op_keys(&self, operation: &str) -> Result<(&tollgate_core::Operation, JobKeys), JobError> {
        let op = self
            .config
            .operation(operation)
            .ok_or_else(|| JobError::unknown_operation(&self.config, operation))?;
        Ok((op, self.keys.jobs(&op.name)))
    }

    async fn read(&self, keys: &JobKeys, id: &RequestId) -> Result<Option<JobInfo>, JobError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(keys.job(id.as_str()));
        let map: HashMap<String, String> = self.command("job_read", cmd).await?;
        if map.is_empty() {
            return Ok(None);
        }
        parse_record(id, &map)
            .map(Some)
            .map_err(|e| JobError::Backend(format!("job {id}: {e}")))
    }

    /// Refunds `id` and confirms it on the job record.
    async fn refund(&self, keys: &JobKeys, id: &str, user: &str) -> Result<(), JobError> {
        if let (Ok(rid), Ok(uid)) = (RequestId::new(id), UserId::new(user)) {
            let r = self.ledger.refund(&uid, &rid).await?;
            tracing::debug!(request_id = id, user, outcome = ?r, "job refunded");
        }
        let _: i64 = self
            .script(
                "job_refunded",
                scripts::job_refunded(keys, id, millis(self.options.result_ttl)),
            )
            .await?;
        Ok(())
    }

    async fn blocking_conn(&self) -> Result<MultiplexedConnection, JobError> {
        if let Some(c) = lock(&self.blocking).pop() {
            return Ok(c);
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(self.timeout));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(map_redis_error)
    }

    fn ensure_subscriber(&self) {
        if self.subscribed.swap(true, Ordering::SeqCst) {
            return;
        }
        let (tx, rx) = oneshot::channel::<()>();
        *lock(&self.stop) = Some(tx);
        let task = subscriber(
            self.client.clone(),
            self.channel.clone(),
            Arc::clone(&self.waiters),
        );
        tokio::spawn(async move {
            tokio::select! {
                () = task => {}
                _ = rx => {}
            }
        });
    }

    /// Jobs waiting in `operation`'s queue (tests and metrics).
    pub async fn queued_len(&self, operation: &str) -> Result<u64, JobError> {
        let (_, keys) = self.op_keys(operation)?;
        let mut cmd = redis::cmd("LLEN");
        cmd.arg(&keys.queue);
        self.command("llen", cmd).await
    }

    /// Entries moved aside as malformed, `"<entry> <reason>"`.
    pub async fn dead_letters(&self, operation: &str) -> Result<Vec<String>, JobError> {
        let (_, keys) = self.op_keys(operation)?;
        let mut cmd = redis::cmd("LRANGE");
        cmd.arg(&keys.dead).arg(0).arg(-1);
        self.command("lrange", cmd).await
    }
}

/// Keeps one subscription to the finished-jobs channel; after every
/// (re)subscription, wakes every waiter to re-read (what was published while
/// the subscription was down is found that way).
async fn subscriber(client: redis::Client, channel: String, waiters: Arc<Waiters>) {
    loop {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.subscribe(&channel).await {
                Ok(()) => {
                    waiters.wake_all();
                    let mut messages = pubsub.on_message();
                    while let Some(msg) = messages.next().await {
                        if let Ok(id) = std::str::from_utf8(msg.get_payload_bytes()) {
                            waiters.wake(id);
                        }
                    }
                    tracing::warn!("job subscription lost; re-subscribing");
                }
                Err(e) => tracing::warn!(error = %e, "cannot subscribe to finished jobs"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot open the job subscription"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn field<'a>(map: &'a HashMap<String, String>, name: &str) -> Result<&'a str, String> {
    map.get(name)
        .map(String::as_str)
        .ok_or_else(|| format!("no field {name}"))
}

fn num(map: &HashMap<String, String>, name: &str) -> Result<u64, String> {
    field(map, name)?
        .parse()
        .map_err(|_| format!("field {name} is not a number"))
}

fn parse_record(id: &RequestId, map: &HashMap<String, String>) -> Result<JobInfo, String> {
    let json = |name: &str| -> Result<Json, String> {
        serde_json::from_str(field(map, name)?).map_err(|e| format!("field {name}: {e}"))
    };
    let job = Job {
        id: id.clone(),
        user: UserId::new(field(map, "user")?).map_err(|e| e.to_string())?,
        operation: field(map, "op")?.to_owned(),
        provider: field(map, "provider")?.to_owned(),
        input: json("input")?,
        cost: num(map, "cost")?,
        enqueued_at_ms: num(map, "enq")?,
        deadline_ms: num(map, "deadline")?,
        attempt: u32::try_from(num(map, "attempt")?).unwrap_or(u32::MAX),
    };
    let status = match field(map, "state")? {
        "held" | "queued" => JobStatus::Queued,
        "running" => JobStatus::Running,
        "succeeded" => JobStatus::Succeeded {
            result: json("result")?,
        },
        "failed" => JobStatus::Failed {
            cause: FailureCause::parse(field(map, "cause")?).ok_or("unknown cause")?,
            message: field(map, "message")?.to_owned(),
        },
        other => return Err(format!("unknown state {other:?}")),
    };
    let finished_at_ms = if status.is_final() {
        num(map, "finished").ok()
    } else {
        None
    };
    Ok(JobInfo {
        job,
        status,
        finished_at_ms,
    })
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => text(other)?.parse().ok(),
    }
}

#[async_trait]
impl JobQueue for RedisJobQueue {
    #[tracing::instrument(skip_all, fields(request_id = %request.id, user = %request.user, operation = %request.operation))]
    async fn submit(&self, request: JobRequest) -> Result<SubmitOutcome, JobError> {
        let (op, keys) = self.op_keys(&request.operation)?;
        let id = request.id.as_str();
        // 0. Claim the id: one id, one job (whatever the operation).
        let claim = self.keys.job_claim(&request.id);
        let owner = format!("{} {}", request.user, op.name);
        let claim_ttl = millis(self.options.hold + op.deadline + self.options.result_ttl)
            .saturating_add(60_000);
        let mut set = redis::cmd("SET");
        set.arg(&claim)
            .arg(&owner)
            .arg("NX")
            .arg("PX")
            .arg(claim_ttl);
        let created: Option<String> = self.command("job_claim", set).await?;
        if created.is_none() {
            let mut get = redis::cmd("GET");
            get.arg(&claim);
            let current: Option<String> = self.command("job_claim", get).await?;
            if current.is_some_and(|c| c != owner) {
                return Err(JobError::IdInUse(request.id));
            }
        }
        // 1. Hold.
        let input = request.input.to_string();
        let held: Vec<i64> = self
            .script(
                "job_hold",
                scripts::job_hold(
                    &keys,
                    HoldArgs {
                        id,
                        user: request.user.as_str(),
                        operation: &op.name,
                        provider: &op.provider,
                        input: &input,
                        cost: op.cost,
                        deadline_ms: op.deadline_ms(),
                        hold_ms: millis(self.options.hold),
                    },
                ),
            )
            .await?;
        let (enq, deadline) = match held.as_slice() {
            &[1, enq, deadline] => (enq.max(0) as u64, deadline.max(0) as u64),
            &[0] => {
                return match self.read(&keys, &request.id).await? {
                    Some(info) => Ok(SubmitOutcome::Duplicate { info }),
                    None => Err(JobError::Backend(format!(
                        "job {id} vanished during a concurrent submission; retry"
                    ))),
                }
            }
            other => return Err(bad_reply("job_hold", other)),
        };
        let job = Job {
            id: request.id.clone(),
            user: request.user.clone(),
            operation: op.name.clone(),
            provider: op.provider.clone(),
            input: request.input,
            cost: op.cost,
            enqueued_at_ms: enq,
            deadline_ms: deadline,
            attempt: 0,
        };
        // 2. Reserve.
        let drop_held = || async {
            let dropped: i64 = self
                .script("job_drop", scripts::job_drop(&keys, id))
                .await?;
            if dropped == 1 {
                let mut del = redis::cmd("DEL");
                del.arg(&claim);
                let _: i64 = self.command("job_claim", del).await?;
            }
            Ok::<_, JobError>(())
        };
        let allowed = match self.ledger.reserve(&job.user, &job.id, job.cost).await {
            Ok(ReserveOutcome::Allowed(a)) => a,
            Ok(ReserveOutcome::Denied(denied)) => {
                if let Err(e) = drop_held().await {
                    tracing::warn!(error = %e, "dropping a denied job failed; its hold will end");
                }
                return Ok(SubmitOutcome::Denied { denied });
            }
            Err(e) if e.is_transient() => {
                // The reservation may still land (a timed-out call is not a
                // cancelled one): keep the hold, so that maintenance refunds it
                // once the hold ends, whatever happened.
                return Err(e.into());
            }
            Err(e) => {
                // Bad input (cost over the plan's limit...): nothing was recorded.
                if let Err(e) = drop_held().await {
                    tracing::warn!(error = %e, "dropping a refused job failed; its hold will end");
                }
                return Err(e.into());
            }
        };
        // 3. Queue.
        let released: i64 = self
            .script("job_release", scripts::job_release(&keys, id))
            .await?;
        if released != 1 {
            // Maintenance gave the hold up meanwhile (and refunded before our
            // reservation landed): refund it ourselves.
            self.ledger.refund(&job.user, &job.id).await?;
            return match self.read(&keys, &job.id).await? {
                Some(info) => Ok(SubmitOutcome::Duplicate { info }),
                None => Err(JobError::Backend(format!("job {id} vanished"))),
            };
        }
        Ok(SubmitOutcome::Queued { job, allowed })
    }

    async fn status(&self, user: &UserId, id: &RequestId) -> Result<Option<JobInfo>, JobError> {
        match self.locate(user, id).await? {
            Some(keys) => self.read_owned(&keys, user, id).await,
            None => Ok(None),
        }
    }

    async fn wait(
        &self,
        user: &UserId,
        id: &RequestId,
        timeout: Duration,
    ) -> Result<Option<JobInfo>, JobError> {
        self.ensure_subscriber();
        let notify = self.waiters.register(id.as_str());
        let result = async {
            // The claim names the job's queue once; each look after that is one
            // read of the record.
            let Some(keys) = self.locate(user, id).await? else {
                return Ok(None);
            };
            wait_until_final(&notify, timeout, self.options.poll, || {
                self.read_owned(&keys, user, id)
            })
            .await
        }
        .await;
        self.waiters.unregister(id.as_str(), notify);
        result
    }
}

#[async_trait]
impl JobSource for RedisJobQueue {
    async fn take(
        &self,
        operation: &str,
        worker: &str,
        block: Duration,
        lease: Duration,
    ) -> Result<Option<Lease>, JobError> {
        let (op, keys) = self.op_keys(operation)?;
        let mut conn = self.blocking_conn().await?;
        let mut cmd = redis::cmd("BLMOVE");
        cmd.arg(&keys.queue)
            .arg(keys.processing(worker))
            .arg("RIGHT")
            .arg("LEFT")
            .arg(block.as_secs_f64());
        let moved: Result<Option<String>, JobError> =
            call::dedicated(&mut conn, block + self.timeout, "blmove", &cmd)
                .await
                .map_err(JobError::from);
        let moved = match moved {
            Ok(m) => {
                lock(&self.blocking).push(conn);
                m
            }
            // A dropped or failed connection is not reused: it may still block.
            Err(e) => return Err(e),
        };
        let Some(id) = moved else {
            return Ok(None);
        };
        let reply: Vec<Value> = self
            .script(
                "job_lease",
                scripts::job_lease(
                    &keys,
                    &id,
                    worker,
                    millis(lease),
                    op.max_attempts,
                    &op.name,
                    &self.channel,
                ),
            )
            .await?;
        match reply.first().and_then(int) {
            Some(1) if reply.len() == 9 => {
                let parsed = (|| {
                    let input: Json = serde_json::from_str(&text(&reply[4])?).ok()?;
                    Some(Lease {
                        token: int(&reply[1])?,
                        job: Job {
                            id: RequestId::new(id.as_str()).ok()?,
                            user: UserId::new(text(&reply[2])?).ok()?,
                            operation: op.name.clone(),
                            provider: text(&reply[3])?,
                            input,
                            cost: int(&reply[5])?,
                            enqueued_at_ms: int(&reply[6])?,
                            deadline_ms: int(&reply[7])?,
                            attempt: u32::try_from(int(&reply[8])?).ok()?,
                        },
                        worker: worker.to_owned(),
                    })
                })();
                match parsed {
                    Some(lease) => Ok(Some(lease)),
                    None => {
                        tracing::error!(entry = %id, "leased job has unreadable fields; failing it");
                        let token = int(&reply[1]).unwrap_or(0);
                        let user = text(&reply[2]).unwrap_or_default();
                        let r: i64 = self
                            .script(
                                "job_fail",
                                scripts::job_fail(
                                    &keys,
                                    &id,
                                    worker,
                                    token,
                                    FailureCause::Abandoned.as_str(),
                                    "malformed job: unreadable fields",
                                    &self.channel,
                                ),
                            )
                            .await?;
                        if r == 1 {
                            self.refund(&keys, &id, &user).await?;
                        }
                        Ok(None)
                    }
                }
            }
            Some(0) => Ok(None),
            Some(2) => {
                let cause = reply.get(1).and_then(text).unwrap_or_default();
                let user = reply.get(2).and_then(text).unwrap_or_default();
                tracing::warn!(request_id = %id, user, cause, "job failed before it ran; refunding");
                self.refund(&keys, &id, &user).await?;
                Ok(None)
            }
            Some(3) => {
                let reason = reply.get(1).and_then(text).unwrap_or_default();
                let user = reply.get(2).and_then(text).unwrap_or_default();
                tracing::error!(entry = %id, operation = %op.name, reason, "malformed job moved aside");
                self.refund(&keys, &id, &user).await?;
                Ok(None)
            }
            _ => Err(bad_reply("job_lease", reply)),
        }
    }

    async fn renew(&self, lease: &Lease, by: Duration) -> Result<Finish, JobError> {
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let r: i64 = self
            .script(
                "job_renew",
                scripts::job_renew(&keys, lease.job.id.as_str(), lease.token, millis(by)),
            )
            .await?;
        Ok(if r == 1 {
            Finish::Recorded
        } else {
            Finish::LeaseLost
        })
    }

    async fn complete(&self, lease: &Lease, result: Json) -> Result<Finish, JobError> {
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let r: i64 = self
            .script(
                "job_complete",
                scripts::job_complete(
                    &keys,
                    lease.job.id.as_str(),
                    &lease.worker,
                    lease.token,
                    &result.to_string(),
                    millis(self.options.result_ttl),
                    &self.channel,
                ),
            )
            .await?;
        Ok(if r == 1 {
            Finish::Recorded
        } else {
            Finish::LeaseLost
        })
    }

    async fn fail(
        &self,
        lease: &Lease,
        cause: FailureCause,
        message: &str,
    ) -> Result<Finish, JobError> {
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let id = lease.job.id.as_str();
        let r: i64 = self
            .script(
                "job_fail",
                scripts::job_fail(
                    &keys,
                    id,
                    &lease.worker,
                    lease.token,
                    cause.as_str(),
                    message,
                    &self.channel,
                ),
            )
            .await?;
        if r != 1 {
            return Ok(Finish::LeaseLost);
        }
        if let Err(e) = self.refund(&keys, id, lease.job.user.as_str()).await {
            tracing::warn!(error = %e, request_id = id, "refund left pending; maintenance retries it");
        }
        Ok(Finish::Recorded)
    }

    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError> {
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let r: i64 = self
            .script(
                "job_hand_back",
                scripts::job_hand_back(&keys, lease.job.id.as_str(), &lease.worker, lease.token),
            )
            .await?;
        Ok(if r == 1 {
            Finish::Recorded
        } else {
            Finish::LeaseLost
        })
    }

    async fn maintain(&self, worker: &str, liveness: Duration) -> Result<Maintenance, JobError> {
        let mut report = Maintenance::default();
        let operations: Vec<String> = self.config.operations().map(|o| o.name.clone()).collect();
        for operation in operations {
            let keys = self.keys.jobs(&operation);
            // Workers whose liveness ended: their moved-but-unleased ids go back.
            let dead: Vec<String> = self
                .script(
                    "job_heartbeat",
                    scripts::job_heartbeat(&keys, worker, millis(liveness)),
                )
                .await?;
            for other in dead {
                let n: i64 = self
                    .script("job_reclaim", scripts::job_reclaim(&keys, &other, false))
                    .await?;
                if n > 0 {
                    tracing::warn!(worker = %other, operation, returned = n, "reclaimed the ids of a dead worker");
                    report.requeued += n as u64;
                }
            }
            // Expired leases.
            let due: Vec<String> = self
                .script("job_due", scripts::job_due(&keys.leases, 0, MAINTAIN_BATCH))
                .await?;
            for id in due {
                let mut get = redis::cmd("HGET");
                get.arg(keys.job(&id)).arg("worker");
                let owner: Option<String> = self.command("job_read", get).await?;
                let n: i64 = self
                    .script(
                        "job_requeue",
                        scripts::job_requeue(&keys, &id, owner.as_deref().unwrap_or("-")),
                    )
                    .await?;
                if n == 1 {
                    tracing::warn!(request_id = %id, operation, worker = ?owner, "lease expired; job requeued");
                    report.requeued += 1;
                }
            }
            // Holds that ended: submissions that never completed.
            let due: Vec<String> = self
                .script("job_due", scripts::job_due(&keys.held, 0, MAINTAIN_BATCH))
                .await?;
            for id in due {
                let r: Vec<Value> = self
                    .script(
                        "job_abandon",
                        scripts::job_abandon(&keys, &id, &self.channel),
                    )
                    .await?;
                if r.first().and_then(int) == Some(1) {
                    let user = r.get(1).and_then(text).unwrap_or_default();
                    tracing::warn!(request_id = %id, user, "submission never completed; refunding");
                    self.refund(&keys, &id, &user).await?;
                    report.abandoned += 1;
                }
            }
            // Refunds left pending.
            let due: Vec<String> = self
                .script(
                    "job_due",
                    scripts::job_due(
                        &keys.refunds,
                        millis(self.options.refund_grace),
                        MAINTAIN_BATCH,
                    ),
                )
                .await?;
            for id in due {
                let mut get = redis::cmd("HGET");
                get.arg(keys.job(&id)).arg("user");
                let user: Option<String> = self.command("job_read", get).await?;
                self.refund(&keys, &id, user.as_deref().unwrap_or(""))
                    .await?;
                report.refunded += 1;
            }
        }
        Ok(report)
    }

    async fn retire(&self, worker: &str) -> Result<(), JobError> {
        let operations: Vec<String> = self.config.operations().map(|o| o.name.clone()).collect();
        for operation in operations {
            let keys = self.keys.jobs(&operation);
            let _: i64 = self
                .script("job_reclaim", scripts::job_reclaim(&keys, worker, true))
                .await?;
        }
        Ok(())
    }
}
