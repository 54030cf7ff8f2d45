//! The distributed job queue: [`RedisJobQueue`], both sides ([`JobQueue`] for the
//! api role, [`JobSource`] for workers), on reliable Redis lists.
//!
//! **Submit** is [`JobQueue::submit`], written once in core: the ledger's
//! `charge.lua` on the user's keys, then `job_enqueue.lua` here, on the
//! operation's keys (the job record lives with its queue).
//!
//! **Take**: `BLMOVE` from the operation's queue into the worker's processing
//! list, on a connection of its own (a blocking command would stall a shared
//! multiplexed one), then `job_lease.lua`: validates the record (malformed ones
//! go to the `dead` list), counts the attempt, increments the fencing token.
//! Before the provider call, the job claims its charge (`start`: `claim.lua`,
//! on the user's keys), outside the fetch loop.
//! `job_complete.lua` / `job_fail.lua` / `job_hand_back.lua` (head or tail)
//! check that token in the same script that writes, so a worker that lost its
//! lease writes nothing. A job taken but not run now (its user holds its share
//! of the worker) is deferred: `job_hand_back.lua` puts it at the queue's tail.
//!
//! **Releases** cross hash tags (the job lives on the queue's tag, the charge on
//! the user's), so they go in order: mark the job failed with its release
//! pending, release (by the job's nonce: at most once, and never a later
//! attempt's charge), confirm (`job_released.lua`). Maintenance finishes
//! releases left pending by a crash.
//!
//! **Starting a run**: the claim and `job_started.lua` go out together (one
//! round trip, not two); a claim that failed takes the mark back.
//!
//! **Waking watchers** does not depend on pub/sub alone: finishing scripts
//! publish the job id to every pod, and the final record itself (when small)
//! to the pod that submitted the job, on that pod's own channel (`w` in the
//! record: this queue's `pod`), so its waiting call needs no read; a watcher
//! also re-reads the record every `poll`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use redis::{FromRedisValue, Value};
use serde_json::Value as Json;
use tokio::sync::oneshot;
use tollgate_core::job::{self, Failure, JobOptions, Taker, LAPSED_KEPT};
use tollgate_core::{
    config::Config,
    id::{RequestId, UserId},
    job::{
        Charge, Enqueued, FailureCause, Finish, Job, JobError, JobInfo, JobQueue, JobSource,
        JobStatus, Lease, Maintenance, QueueStats, Watch, Watchers,
    },
    ledger::Ledger,
};

use crate::call::{self, bad_reply};
use crate::keys::{JobKeys, KeySpace};
use crate::pool::{blocking_connection, Blocking};
use crate::pool::{Pool, DEFAULT_TIMEOUT};
use crate::scripts::reply::{loose_int as int, loose_text as text};
use crate::scripts::{
    self, EnqueueReply, FailArgs, Fenced, FunctionCall, LeaseArgs, LeaseReply, Reclaim,
};
use crate::subscription::{self, Listener};
use tollgate_core::error::StoreError;
use tollgate_core::head::Head;
use tollgate_core::lock;
use tollgate_core::trace::TraceParent;

/// Most ids one maintenance step handles per set and operation.
const MAINTAIN_BATCH: u32 = 100;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The distributed job queue.
pub struct RedisJobQueue {
    pool: Pool,
    keys: KeySpace,
    config: Arc<Config>,
    ledger: Arc<dyn Ledger>,
    options: JobOptions,
    timeout: Duration,
    channel: String,
    /// This process's name among the api pods: jobs it submits carry it, and
    /// their final records come back on its own channels (`<done>:<pod>`).
    pod: String,
    /// Idle connections for BLMOVE, one per concurrent take.
    blocking: Mutex<Vec<Blocking>>,
    watchers: Arc<Watchers>,
    /// The finished-jobs subscription's listener (it rings `watchers`).
    finished: Arc<Finished>,
    /// Refusals for stored bytes remembered in process.
    full_marks: job::FullMarks,
    /// Ids seen in this process's processing lists with their job still
    /// queued (never leased), by list: moved back if still so next round.
    suspects: Mutex<HashMap<String, HashSet<String>>>,
    /// The watchers' subscription, started by the first wait; dropping it
    /// stops the subscription.
    subscription: Mutex<Option<oneshot::Sender<()>>>,
}

impl std::fmt::Debug for RedisJobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.keys.debug_store(f, "RedisJobQueue")
    }
}

impl RedisJobQueue {
    /// A queue on `pool` (blocking takes and the watchers' subscription open
    /// connections of their own to the same Redis). `ledger` charges and
    /// releases.
    pub fn new(
        pool: Pool,
        keys: KeySpace,
        config: Arc<Config>,
        ledger: Arc<dyn Ledger>,
        options: JobOptions,
    ) -> Self {
        let watchers = Arc::new(Watchers::default());
        let finished = Arc::new(Finished {
            watchers: Arc::clone(&watchers),
            config: Arc::clone(&config),
            subscribed: tokio::sync::watch::channel(false).0,
        });
        Self {
            pool,
            channel: keys.jobs_done(),
            pod: RequestId::generate().as_str().replace('-', ""),
            keys,
            config,
            ledger,
            options,
            timeout: DEFAULT_TIMEOUT,
            blocking: Mutex::new(Vec::new()),
            watchers,
            finished,
            full_marks: job::FullMarks::default(),
            suspects: Mutex::default(),
            subscription: Mutex::new(None),
        }
    }

    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    /// One job script: its function of [`scripts::JOBS`].
    async fn script<T: FromRedisValue>(
        &self,
        op: &'static str,
        f: FunctionCall,
    ) -> Result<T, JobError> {
        Ok(call::function(&self.pool, self.timeout, op, &f).await?)
    }

    /// A script shared with the other roles (EVALSHA): the liveness scripts.
    async fn shared_script<T: FromRedisValue>(
        &self,
        op: &'static str,
        inv: redis::ScriptInvocation<'_>,
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

    /// `job_hand_back.lua`: a leased job not run, back to `end` of its queue.
    async fn put_back(&self, lease: &Lease, end: scripts::QueueEnd) -> Result<Finish, JobError> {
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let call = scripts::job_hand_back(
            &keys,
            lease.job.id.as_str(),
            &lease.worker,
            lease.token,
            end,
        );
        let r: Fenced = self.script("job_hand_back", call).await?;
        Ok(r.into())
    }

    fn op_keys(
        &self,
        operation: &str,
    ) -> Result<(&tollgate_core::config::Operation, JobKeys), JobError> {
        let op = self
            .config
            .operation(operation)
            .ok_or_else(|| JobError::unknown_operation(&self.config, operation))?;
        Ok((op, self.keys.jobs(&op.name)))
    }

    async fn read_record(
        &self,
        keys: &JobKeys,
        id: &RequestId,
    ) -> Result<Option<JobInfo>, JobError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(keys.job(id.as_str()));
        let map: HashMap<String, String> = self.command("job_read", cmd).await?;
        Ok(decode(id, &map)?.map(|i| self.with_provider(i)))
    }

    /// A final record keeps no provider: the operation's, from the config.
    fn with_provider(&self, info: JobInfo) -> JobInfo {
        with_provider(&self.config, info)
    }

    /// How long `operation`'s finished records stay readable (ms).
    fn ttl_ms(&self, operation: &str) -> u64 {
        millis(self.options.result_ttl(&self.config, operation))
    }

    /// The width of `operation`'s stored-bytes buckets (ms).
    fn width_ms(&self, operation: &str) -> u64 {
        let deadline = self
            .config
            .operation(operation)
            .map_or(0, |o| millis(o.deadline));
        scripts::stored_width_ms(deadline, self.ttl_ms(operation))
    }

    /// Releases the charge of job `id` (its owner failed: the record says so)
    /// and confirms it on the record, which then stays `ttl_ms`.
    async fn release(
        &self,
        keys: &JobKeys,
        id: &str,
        user: &str,
        nonce: &str,
        ttl_ms: u64,
    ) -> Result<(), JobError> {
        if let (Ok(rid), Ok(uid)) = (RequestId::existing(id), UserId::existing(user)) {
            if !nonce.is_empty() {
                let r = self.ledger.release(&uid, &rid, nonce).await?;
                tracing::debug!(request_id = id, user, outcome = ?r, "job's charge released");
            }
        }
        let _: i64 = self
            .script("job_released", scripts::job_released(keys, id, ttl_ms))
            .await?;
        Ok(())
    }

    /// Moves back to the queue the ids that sit in `worker`'s own processing
    /// list with their job never leased (its lease script failed after the
    /// BLMOVE): seen so in two rounds in a row, so that a take in progress is
    /// left to finish. Returns how many went back.
    async fn unstick(&self, keys: &JobKeys, worker: &str) -> Result<u64, JobError> {
        let list = keys.processing(worker);
        let mut range = redis::cmd("LRANGE");
        range.arg(&list).arg(0).arg(i64::from(MAINTAIN_BATCH) - 1);
        let ids: Vec<String> = self.command("job_processing", range).await?;
        let mut states = Vec::new();
        if !ids.is_empty() {
            let mut pipe = redis::pipe();
            for id in &ids {
                pipe.cmd("HGET").arg(keys.job(id)).arg("state");
            }
            states = call::pipeline(&self.pool, self.timeout, "job_processing", &pipe).await?;
        }
        let unleased: HashSet<String> = ids
            .into_iter()
            .zip(states)
            .filter(|(_, state): &(String, Option<String>)| state.as_deref() != Some("running"))
            .map(|(id, _)| id)
            .collect();
        let previous = lock(&self.suspects).insert(list.clone(), unleased.clone());
        let mut moved = 0;
        for id in unleased.intersection(&previous.unwrap_or_default()) {
            let r: i64 = self
                .script("job_unstick", scripts::job_unstick(keys, id, worker))
                .await?;
            if r == 1 {
                tracing::warn!(request_id = %id, worker, "a job taken but never leased went back to its queue");
                moved += 1;
            }
            if r >= 0 {
                if let Some(s) = lock(&self.suspects).get_mut(&list) {
                    s.remove(id);
                }
            }
        }
        Ok(moved)
    }

    /// `job_fail.lua`: true when recorded (the token was current).
    async fn record_failure(&self, keys: &JobKeys, args: FailArgs<'_>) -> Result<bool, JobError> {
        let r: Fenced = self
            .script(
                "job_fail",
                scripts::job_fail(keys, args, &self.done_channel(keys)),
            )
            .await?;
        Ok(r == Fenced::Recorded)
    }

    async fn blocking_conn(&self) -> Result<Blocking, JobError> {
        if let Some(c) = lock(&self.blocking).pop() {
            return Ok(c);
        }
        Ok(blocking_connection(&self.pool).await?)
    }

    /// Where the job scripts publish the finished jobs of `keys`' queue: on a
    /// cluster, the queue's own sharded channel (in its slot); on a single
    /// Redis, the one channel.
    fn done_channel(&self, keys: &JobKeys) -> String {
        if self.pool.is_cluster() {
            keys.done()
        } else {
            self.channel.clone()
        }
    }

    fn ensure_subscriber(&self) {
        let mut subscription = lock(&self.subscription);
        if subscription.is_none() {
            // Every pod's channel(s), and this pod's own (`publish_done`).
            let shared: Vec<String> = if self.pool.is_cluster() {
                self.config
                    .operations()
                    .map(|op| self.keys.jobs(&op.name).done())
                    .collect()
            } else {
                vec![self.channel.clone()]
            };
            let own = shared.iter().map(|c| format!("{c}:{}", self.pod));
            let channels = shared.iter().cloned().chain(own).collect();
            *subscription = Some(subscription::spawn(
                &self.pool,
                channels,
                Arc::clone(&self.finished),
                Duration::from_millis(200),
            ));
        }
    }

    /// Starts the finished-jobs subscription if no watch has, and waits until
    /// it is live and its first re-check rang every watcher, at most `within`.
    pub async fn subscribed(&self, within: Duration) -> bool {
        self.ensure_subscriber();
        let mut rx = self.finished.subscribed.subscribe();
        tokio::time::timeout(within, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
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

    /// One pop of `take`: a job leased, an entry dealt with (failed or moved
    /// aside), or nothing within `block`.
    async fn take_one(
        &self,
        operation: &str,
        worker: &str,
        block: Duration,
        lease: Duration,
    ) -> Result<Taken, JobError> {
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
            return Ok(Taken::Empty);
        };
        let reply: Vec<Value> = self
            .script(
                "job_lease",
                scripts::job_lease(
                    &keys,
                    LeaseArgs {
                        id: &id,
                        worker,
                        lease_ms: millis(lease),
                        max_runs: op.max_runs,
                        operation: &op.name,
                        result_ttl_ms: self.ttl_ms(&op.name),
                        width_ms: self.width_ms(&op.name),
                    },
                    &self.done_channel(&keys),
                ),
            )
            .await?;
        match LeaseReply::decode(&reply).map_err(|r| bad_reply::<JobError>("job_lease", r))? {
            LeaseReply::Job {
                token,
                time_left_ms,
                fields,
            } => {
                let parsed = RequestId::existing(id.as_str())
                    .map_err(|e| e.to_string())
                    .and_then(|rid| parse_job(&rid, &fields));
                let (Some(token), Ok(job)) = (token, parsed) else {
                    tracing::error!(entry = %id, "leased job has unreadable fields; failing it");
                    let token = token.unwrap_or(0);
                    let user = fields.get("user").cloned().unwrap_or_default();
                    let nonce = fields.get("nonce").cloned().unwrap_or_default();
                    if self
                        .record_failure(
                            &keys,
                            FailArgs {
                                id: &id,
                                worker,
                                token,
                                cause: FailureCause::Abandoned.as_str(),
                                message: "malformed job: unreadable fields",
                                release: true,
                                ttl_ms: self.ttl_ms(&op.name),
                                width_ms: self.width_ms(&op.name),
                            },
                        )
                        .await?
                    {
                        self.release(&keys, &id, &user, &nonce, self.ttl_ms(&op.name))
                            .await?;
                    }
                    return Ok(Taken::Skipped);
                };
                Ok(Taken::Job(Box::new(Lease {
                    token,
                    job,
                    worker: worker.to_owned(),
                    time_left: Duration::from_millis(time_left_ms),
                    ran_before: fields.get("started").is_some_and(|v| v == "1"),
                })))
            }
            LeaseReply::Skipped => Ok(Taken::Skipped),
            LeaseReply::Failed { cause, user, nonce } => {
                let keeps = FailureCause::parse(&cause).is_some_and(FailureCause::charged);
                if keeps {
                    // Its worker was lost mid-run: the charge stands (`job::given_up`).
                    tracing::warn!(request_id = %id, user, cause, "job failed at its take; its charge stands");
                } else {
                    tracing::warn!(request_id = %id, user, cause, "job failed before it ran; releasing its charge");
                    self.release(&keys, &id, &user, &nonce, self.ttl_ms(&op.name))
                        .await?;
                }
                Ok(Taken::Skipped)
            }
            LeaseReply::MovedAside {
                reason,
                user,
                nonce,
            } => {
                tracing::error!(entry = %id, operation = %op.name, reason, "malformed job moved aside");
                self.release(&keys, &id, &user, &nonce, self.ttl_ms(&op.name))
                    .await?;
                Ok(Taken::Skipped)
            }
        }
    }
}

/// What one pop of [`RedisJobQueue::take_one`] came to.
enum Taken {
    Job(Box<Lease>),
    /// An entry failed or moved aside: not a job, not the end of the queue.
    Skipped,
    /// Nothing within the block.
    Empty,
}

/// A final record keeps no provider: the operation's, from `config`.
fn with_provider(config: &Config, mut info: JobInfo) -> JobInfo {
    if info.job.provider.is_empty() {
        if let Some(op) = config.operation(&info.job.operation) {
            info.job.provider = op.provider.clone();
        }
    }
    info
}

/// The finished-jobs channels' listener: an id rings the watchers of that job;
/// an id with its final record (`"<id>\n<JSON array of names and values>"`,
/// this pod's own channel: `jobs/lib/job.lua` publish_done) is delivered to them.
/// After every (re)subscription every watcher is rung to re-read its job (what
/// was published while the subscription was down is found that way).
struct Finished {
    watchers: Arc<Watchers>,
    config: Arc<Config>,
    /// Live, and every watcher rung since it last was not.
    subscribed: tokio::sync::watch::Sender<bool>,
}

impl Finished {
    /// The job of a message with its record; `None` when it is unreadable
    /// (the watchers then read the record themselves).
    fn record(&self, id: &str, record: &str) -> Option<JobInfo> {
        let rid = RequestId::existing(id).ok()?;
        let flat: Vec<String> = serde_json::from_str(record).ok()?;
        let map: HashMap<String, String> = flat
            .chunks_exact(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect();
        let info = decode(&rid, &map).ok()??;
        Some(with_provider(&self.config, info))
    }
}

#[async_trait]
impl Listener for Finished {
    fn name(&self) -> &'static str {
        "finished jobs"
    }

    async fn resync(&self) -> Result<(), StoreError> {
        self.watchers.ring_all();
        self.subscribed.send_replace(true);
        Ok(())
    }

    fn live(&self, live: bool) {
        if !live {
            self.subscribed.send_replace(false);
        }
    }

    fn deliver(&self, payload: &[u8]) {
        let Ok(text) = std::str::from_utf8(payload) else {
            return;
        };
        match text.split_once('\n') {
            None => self.watchers.ring(text),
            Some((id, record)) => match self.record(id, record) {
                Some(info) => self.watchers.deliver(id, info),
                None => {
                    tracing::warn!(
                        request_id = id,
                        "a finished job's message has an unreadable record; reading it instead"
                    );
                    self.watchers.ring(id);
                }
            },
        }
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

fn json(map: &HashMap<String, String>, name: &str) -> Result<Json, String> {
    serde_json::from_str(field(map, name)?).map_err(|e| format!("field {name}: {e}"))
}

/// The job of a record's fields: the one decoder of a job, for a record read
/// whole (HGETALL) and for the fields `job_lease.lua` returns.
fn parse_job(id: &RequestId, map: &HashMap<String, String>) -> Result<Job, String> {
    Ok(Job {
        id: id.clone(),
        user: UserId::existing(field(map, "user")?).map_err(|e| e.to_string())?,
        operation: field(map, "op")?.to_owned(),
        // A final record keeps neither (jobs/lib/job.lua: compact_final).
        provider: map.get("provider").cloned().unwrap_or_default(),
        input: match map.get("input") {
            Some(_) => json(map, "input")?,
            None if is_final(map) => Json::Null,
            None => return Err("no field input".into()),
        },
        cost: num(map, "cost")?,
        enqueued_at_ms: num(map, "enq")?,
        deadline_ms: num(map, "deadline")?,
        run: u32::try_from(num(map, "attempt")?).unwrap_or(u32::MAX),
        nonce: field(map, "nonce")?.to_owned(),
        // Absent in records of earlier versions, and for calls with no trace.
        trace: map.get("tp").and_then(|v| TraceParent::parse(v)),
        price: map.get("pr").filter(|p| !p.is_empty()).cloned(),
        charged: map.get("charged").and_then(|c| c.parse().ok()),
    })
}

fn is_final(map: &HashMap<String, String>) -> bool {
    matches!(
        map.get("state").map(String::as_str),
        Some("succeeded" | "failed")
    )
}

fn parse_record(id: &RequestId, map: &HashMap<String, String>) -> Result<JobInfo, String> {
    let job = parse_job(id, map)?;
    let status = match field(map, "state")? {
        "queued" => JobStatus::Queued,
        "running" => JobStatus::Running,
        "succeeded" => JobStatus::Succeeded {
            result: json(map, "result")?,
            // Absent for a plain 200, and in records of earlier versions.
            head: map.get("head").and_then(|h| serde_json::from_str(h).ok()),
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

/// A final record's long values are stored in pieces, `<field>#1`, `<field>#2`,
/// ... (`lua/jobs/lib/job.lua`: compact_final): the whole values again.
fn joined(map: &HashMap<String, String>) -> std::borrow::Cow<'_, HashMap<String, String>> {
    if !map.keys().any(|k| k.contains('#')) {
        return std::borrow::Cow::Borrowed(map);
    }
    let mut out = HashMap::new();
    let mut pieces: HashMap<&str, Vec<(u32, &str)>> = HashMap::new();
    for (k, v) in map {
        match k.split_once('#').map(|(f, n)| (f, n.parse::<u32>())) {
            Some((field, Ok(n))) => pieces.entry(field).or_default().push((n, v)),
            _ => {
                out.insert(k.clone(), v.clone());
            }
        }
    }
    for (field, mut parts) in pieces {
        parts.sort_unstable_by_key(|(n, _)| *n);
        out.insert(
            field.to_owned(),
            parts.into_iter().map(|(_, v)| v).collect::<String>(),
        );
    }
    std::borrow::Cow::Owned(out)
}

/// A record read with HGETALL; empty: no record.
fn decode(id: &RequestId, map: &HashMap<String, String>) -> Result<Option<JobInfo>, JobError> {
    if map.is_empty() {
        return Ok(None);
    }
    parse_record(id, &joined(map))
        .map(Some)
        .map_err(|e| StoreError::backend(format!("job {id}: {e}")).into())
}

#[async_trait]
impl JobQueue for RedisJobQueue {
    /// One read-only pipeline: Redis TIME, then per operation the queue's and
    /// the dead list's lengths, the leases and the workers' liveness.
    async fn stats(&self) -> Result<Vec<QueueStats>, JobError> {
        let operations: Vec<String> = self.config.operations().map(|o| o.name.clone()).collect();
        let mut cmds = vec![redis::cmd("TIME")];
        for op in &operations {
            let keys = self.keys.jobs(op);
            cmds.push(redis::cmd("LLEN").arg(&keys.queue).to_owned());
            cmds.push(redis::cmd("ZCARD").arg(&keys.leases).to_owned());
            cmds.push(redis::cmd("LLEN").arg(&keys.dead).to_owned());
            cmds.push(redis::cmd("HVALS").arg(&keys.workers).to_owned());
        }
        let reply: Vec<Value> =
            call::gather(&self.pool, self.timeout, "queue_stats", &cmds).await?;
        let now_ms = match reply.first() {
            Some(Value::Array(t)) if t.len() == 2 => {
                let secs = t.first().and_then(text).and_then(|s| s.parse::<u64>().ok());
                let micros = t.get(1).and_then(text).and_then(|s| s.parse::<u64>().ok());
                secs.zip(micros).map(|(s, us)| s * 1000 + us / 1000)
            }
            _ => None,
        }
        .ok_or_else(|| bad_reply::<JobError>("TIME", reply.first()))?;
        let count = |v: &Value| int(v).unwrap_or(0);
        Ok(operations
            .into_iter()
            .zip(reply[1..].chunks_exact(4))
            .map(|(operation, r)| QueueStats {
                operation,
                queued: count(&r[0]),
                running: count(&r[1]),
                dead: count(&r[2]),
                workers: Some(match &r[3] {
                    Value::Array(vals) => vals
                        .iter()
                        .filter_map(|v| text(v)?.parse::<u64>().ok())
                        .filter(|until| *until >= now_ms)
                        .count() as u64,
                    _ => 0,
                }),
            })
            .collect())
    }

    async fn dead_page(&self, operation: &str, limit: usize) -> Result<Vec<String>, JobError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let (_, keys) = self.op_keys(operation)?;
        // job_lease.lua appends: the newest are at the tail.
        let mut cmd = redis::cmd("LRANGE");
        cmd.arg(&keys.dead)
            .arg(-i64::try_from(limit).unwrap_or(i64::MAX))
            .arg(-1);
        let mut page: Vec<String> = self.command("lrange", cmd).await?;
        page.reverse();
        Ok(page)
    }

    fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    fn config(&self) -> &Config {
        &self.config
    }

    fn full_marks(&self) -> &job::FullMarks {
        &self.full_marks
    }

    fn poll(&self) -> Duration {
        self.options.poll
    }

    fn watch(&self, id: &RequestId) -> Watch {
        self.ensure_subscriber();
        self.watchers.watch(id)
    }

    #[tracing::instrument(skip_all, fields(request_id = %job.id, user = %job.user, operation = %job.operation))]
    async fn enqueue(
        &self,
        job: &Job,
        create: bool,
        max_stored: u64,
    ) -> Result<Enqueued, JobError> {
        let (_, keys) = self.op_keys(&job.operation)?;
        let input = job.input.to_string();
        let stored = scripts::Stored {
            width_ms: self.width_ms(&job.operation),
            limit: max_stored,
        };
        let reply: Vec<Value> = self
            .script(
                call::ENQUEUE,
                scripts::job_enqueue(&keys, job, &input, create, stored, &self.pod),
            )
            .await?;
        match EnqueueReply::decode(&reply).map_err(|r| bad_reply::<JobError>("job_enqueue", r))? {
            EnqueueReply::Created => Ok(Enqueued::Created),
            EnqueueReply::Full { stored, limit } => Ok(Enqueued::Full {
                stored,
                limit: limit.unwrap_or(max_stored),
            }),
            EnqueueReply::Missing => Ok(Enqueued::Missing),
            EnqueueReply::IdInUse => Ok(Enqueued::IdInUse),
            EnqueueReply::Existing(map) => {
                match decode(&job.id, &map)?.map(|i| self.with_provider(i)) {
                    Some(info) => Ok(Enqueued::Existing(Box::new(info))),
                    None => Err(bad_reply("job_enqueue", "an empty record")),
                }
            }
        }
    }

    async fn answered(&self, info: &JobInfo) -> Result<(), JobError> {
        let (_, keys) = self.op_keys(&info.job.operation)?;
        let _: i64 = self
            .script(
                "job_forget",
                scripts::job_forget(
                    &keys,
                    info.job.id.as_str(),
                    info.job.user.as_str(),
                    &info.job.nonce,
                ),
            )
            .await?;
        Ok(())
    }

    async fn remember_retry_target(
        &self,
        operation: &str,
        key: &str,
        id: &RequestId,
        ttl: Duration,
    ) -> Result<(), JobError> {
        let (_, keys) = self.op_keys(operation)?;
        let mut cmd = redis::cmd("SET");
        cmd.arg(keys.retry_target(key))
            .arg(id.as_str())
            .arg("PX")
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        self.command::<()>("retry_target_set", cmd).await
    }

    async fn retry_target(
        &self,
        operation: &str,
        key: &str,
    ) -> Result<Option<RequestId>, JobError> {
        let (_, keys) = self.op_keys(operation)?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(keys.retry_target(key));
        let id: Option<String> = self.command("retry_target", cmd).await?;
        // A value that is no request id (written by hand) joins nothing.
        Ok(id.and_then(|id| RequestId::existing(id).ok()))
    }

    async fn read(
        &self,
        user: &UserId,
        operation: &str,
        id: &RequestId,
    ) -> Result<Option<JobInfo>, JobError> {
        let (_, keys) = self.op_keys(operation)?;
        Ok(self
            .read_record(&keys, id)
            .await?
            .filter(|info| &info.job.user == user))
    }

    /// Looks in every operation's queue (one pipelined round trip): the id
    /// alone does not say which queue holds the job. The owner is checked in
    /// Redis (`job_status.lua`): another user's job comes back empty, as a
    /// missing one does, so both answer alike in content and in time (reading
    /// the whole record and dropping it here took ~100 µs more, a probe of
    /// whether someone used an Idempotency-Key).
    async fn status(&self, user: &UserId, id: &RequestId) -> Result<Option<JobInfo>, JobError> {
        let operations: Vec<&str> = self.config.operations().map(|o| o.name.as_str()).collect();
        let cmds: Vec<redis::Cmd> = operations
            .iter()
            .map(|op| {
                // EVAL, not EVALSHA: it rides in the same pipeline as plain
                // commands; Redis caches the script by its digest.
                scripts::job_status(&self.keys.jobs(op), id.as_str(), user.as_str())
            })
            .collect();
        let records: Vec<HashMap<String, String>> =
            call::gather(&self.pool, self.timeout, "job_status", &cmds).await?;
        let mut found: Option<JobInfo> = None;
        for map in &records {
            if let Some(info) = decode(id, map)?
                .filter(|i| &i.job.user == user)
                .map(|i| self.with_provider(i))
            {
                // One id in two queues: the newest attempt is the one that counts.
                if found
                    .as_ref()
                    .is_none_or(|f| f.job.enqueued_at_ms < info.job.enqueued_at_ms)
                {
                    found = Some(info);
                }
            }
        }
        Ok(found)
    }
}

#[async_trait]
impl JobSource for RedisJobQueue {
    async fn take(&self, operation: &str, taker: Taker<'_>) -> Result<Option<Lease>, JobError> {
        let Taker {
            worker,
            block,
            lease,
        } = taker;
        // An entry failed or moved aside on the way (past its deadline or its
        // attempts, stale, malformed) is not a job to return, and not the end
        // of the queue either: the next one is taken, within what is left of
        // `block`, as the memory backend does. (Returning `None` for it told
        // a caller that drains with `while take(..).is_some()` the queue was
        // empty with jobs left in it.)
        let deadline = tokio::time::Instant::now() + block;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            // BLMOVE's 0 blocks forever: an empty queue past the deadline
            // still answers within a millisecond.
            match self
                .take_one(operation, worker, left.max(Duration::from_millis(1)), lease)
                .await?
            {
                Taken::Job(lease) => return Ok(Some(*lease)),
                Taken::Skipped => continue,
                Taken::Empty => return Ok(None),
            }
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
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let (id, token) = (lease.job.id.as_str(), lease.token);
        // The claim and the start mark go out together: one round trip, not
        // two. The mark says a run may have called the provider (a run lost
        // after it keeps its charge, `job::given_up`); the two land within
        // moments of each other, so a worker lost between them counts as
        // started (its job's later failure keeps the charge): the cautious
        // side. A claim refused fails the job unrun below (the mark changes
        // nothing then); a claim whose answer is unknown takes the mark back
        // (unless an earlier run had set it), and the job is handed back.
        let grace = self.config.hold_grace();
        let (claim, marked) = tokio::join!(
            job::claim(&*self.ledger, &lease.job, grace),
            self.script::<i64>("job_started", scripts::job_started(&keys, id, token, true)),
        );
        let claim = match claim {
            Ok(claim) => claim,
            Err(e) => {
                if !lease.ran_before {
                    let unmark = scripts::job_started(&keys, id, token, false);
                    if let Err(e) = self.script::<i64>("job_started", unmark).await {
                        tracing::warn!(error = %e, request_id = id, "taking back the start mark failed: a later run counts this one as started");
                    }
                }
                return Err(e);
            }
        };
        if let Some((cause, message)) = job::unrun(claim) {
            tracing::warn!(request_id = %lease.job.id, %message, "the job's charge is not its own; failing it unrun");
            self.record_failure(
                &keys,
                FailArgs {
                    id,
                    worker: &lease.worker,
                    token,
                    cause: cause.as_str(),
                    message,
                    release: false,
                    ttl_ms: self.ttl_ms(&lease.job.operation),
                    width_ms: self.width_ms(&lease.job.operation),
                },
            )
            .await?;
            return Ok(false);
        }
        marked?;
        Ok(true)
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
        self.complete_with(lease, result, None, None).await
    }

    async fn complete_with(
        &self,
        lease: &Lease,
        result: Json,
        head: Option<Head>,
        charged: Option<u64>,
    ) -> Result<Finish, JobError> {
        let head = match head.filter(|h| !h.is_plain()) {
            Some(h) => serde_json::to_string(&h)
                .map_err(|e| StoreError::backend(format!("a job's head as JSON: {e}")))?,
            None => String::new(),
        };
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let r: Fenced = self
            .script(
                "job_complete",
                scripts::job_complete(
                    &keys,
                    lease.job.id.as_str(),
                    &lease.worker,
                    lease.token,
                    &result.to_string(),
                    &head,
                    charged,
                    scripts::Kept {
                        ttl_ms: self.ttl_ms(&lease.job.operation),
                        width_ms: self.width_ms(&lease.job.operation),
                    },
                    &self.done_channel(&keys),
                ),
            )
            .await?;
        Ok(r.into())
    }

    async fn fail(&self, lease: &Lease, failure: Failure<'_>) -> Result<Finish, JobError> {
        let Failure {
            cause,
            charge,
            message,
        } = failure;
        let release = matches!(charge, Charge::Release { .. });
        let (_, keys) = self.op_keys(&lease.job.operation)?;
        let id = lease.job.id.as_str();
        let recorded = self
            .record_failure(
                &keys,
                FailArgs {
                    id,
                    worker: &lease.worker,
                    token: lease.token,
                    cause: cause.as_str(),
                    message,
                    release,
                    ttl_ms: self.ttl_ms(&lease.job.operation),
                    width_ms: self.width_ms(&lease.job.operation),
                },
            )
            .await?;
        if !recorded {
            return Ok(Finish::LeaseLost);
        }
        if !release {
            return Ok(Finish::Recorded);
        }
        if let Err(e) = self
            .release(
                &keys,
                id,
                lease.job.user.as_str(),
                &lease.job.nonce,
                self.ttl_ms(&lease.job.operation),
            )
            .await
        {
            tracing::warn!(error = %e, request_id = id, "release left pending; maintenance retries it");
        }
        Ok(Finish::Recorded)
    }

    async fn hand_back(&self, lease: &Lease) -> Result<Finish, JobError> {
        self.put_back(lease, scripts::QueueEnd::Head).await
    }

    async fn defer(&self, lease: &Lease) -> Result<Finish, JobError> {
        self.put_back(lease, scripts::QueueEnd::Tail).await
    }

    async fn maintain(&self, worker: &str, liveness: Duration) -> Result<Maintenance, JobError> {
        let mut report = Maintenance::default();
        let operations: Vec<String> = self.config.operations().map(|o| o.name.clone()).collect();
        for operation in operations {
            let keys = self.keys.jobs(&operation);
            // Workers whose liveness ended: their moved-but-unleased ids go back.
            let dead: Vec<String> = self
                .shared_script(
                    "liveness_heartbeat",
                    scripts::liveness_heartbeat(keys.members(), worker, millis(liveness)),
                )
                .await?;
            for other in dead {
                let n: i64 = self
                    .shared_script(
                        "liveness_reclaim",
                        scripts::liveness_reclaim(
                            keys.members(),
                            &other,
                            &keys.processing(&other),
                            Reclaim::Lapsed {
                                forget_ms: millis(liveness) * u64::from(LAPSED_KEPT),
                            },
                        ),
                    )
                    .await?;
                if n > 0 {
                    tracing::warn!(worker = %other, operation, returned = n, "reclaimed the ids of a dead worker");
                    report.requeued += n as u64;
                }
            }
            report.requeued += self.unstick(&keys, worker).await?;
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
            // Releases left pending.
            let due: Vec<String> = self
                .script(
                    "job_due",
                    scripts::job_due(
                        &keys.releases,
                        millis(self.options.release_grace),
                        MAINTAIN_BATCH,
                    ),
                )
                .await?;
            for id in due {
                let mut get = redis::cmd("HMGET");
                get.arg(keys.job(&id)).arg("user").arg("nonce");
                let f: Vec<Option<String>> = self.command("job_read", get).await?;
                let field = |i: usize| f.get(i).cloned().flatten().unwrap_or_default();
                self.release(&keys, &id, &field(0), &field(1), self.ttl_ms(&operation))
                    .await?;
                report.released += 1;
            }
        }
        Ok(report)
    }

    async fn retire(&self, worker: &str) -> Result<(), JobError> {
        let operations: Vec<String> = self.config.operations().map(|o| o.name.clone()).collect();
        for operation in operations {
            let keys = self.keys.jobs(&operation);
            let _: i64 = self
                .shared_script(
                    "liveness_reclaim",
                    scripts::liveness_reclaim(
                        keys.members(),
                        worker,
                        &keys.processing(worker),
                        Reclaim::Stopping,
                    ),
                )
                .await?;
        }
        Ok(())
    }
}

impl From<Fenced> for Finish {
    fn from(f: Fenced) -> Self {
        match f {
            Fenced::Recorded => Self::Recorded,
            Fenced::LeaseLost => Self::LeaseLost,
        }
    }
}
