//! The jobs family (`lua/jobs/`): a job's queue, lease, outcome and record,
//! and the workers' liveness.

use std::collections::HashMap;

use redis::Value;

use super::reply::{loose_int, loose_text, signed};
use super::FunctionCall;
use crate::keys::{Head, JobKeys, Members};

library! {
    /// The job scripts, one function each of one library: `lib/job.lua` is its
    /// prelude.
    static JOBS, const JOB_SCRIPTS = "job" in "jobs" {
        prelude: ["job"],
        scripts: [
            "job_enqueue", "job_lease", "job_renew", "job_started", "job_complete", "job_fail",
            "job_released", "job_hand_back", "job_due", "job_requeue", "job_unstick", "job_forget",
        ],
    }
}

eval_scripts!(static JOB_EVAL in "jobs" {
    LIVENESS_HEARTBEAT = "liveness_heartbeat" clock;
    LIVENESS_RECLAIM = "liveness_reclaim" clock;
    JOB_STATUS = "job_status";
});

/// `liveness_heartbeat.lua`: the listed members whose liveness lapsed.
pub fn liveness_heartbeat<'a>(
    m: Members<'_>,
    member: &str,
    liveness_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = LIVENESS_HEARTBEAT.prepare_invoke();
    inv.key(m.members).key(m.lists).arg(member).arg(liveness_ms);
    inv
}

/// Whose list `liveness_reclaim.lua` gives back.
#[derive(Debug, Clone, Copy)]
pub enum Reclaim {
    /// A member whose liveness lapsed: it stays listed, its list reclaimed
    /// again by every heartbeat of the others, until it has been lapsed for
    /// `forget_ms` (a pop of its may still land).
    Lapsed { forget_ms: u64 },
    /// The caller itself, stopping: reclaimed even though live, then lapsed.
    Stopping,
}

/// `liveness_reclaim.lua`: moves `processing` (the list of `member`) back to
/// the head of the queue; -1 when the member is live (and not stopping).
pub fn liveness_reclaim<'a>(
    m: Members<'_>,
    member: &str,
    processing: &str,
    reclaim: Reclaim,
) -> redis::ScriptInvocation<'a> {
    let mut inv = LIVENESS_RECLAIM.prepare_invoke();
    inv.key(m.members).key(processing).key(m.queue).key(m.lists);
    let (force, forget_ms) = match reclaim {
        Reclaim::Lapsed { forget_ms } => ("0", forget_ms),
        Reclaim::Stopping => ("1", 0),
    };
    inv.arg(member)
        .arg(force)
        .arg(match m.head {
            Head::Left => "LEFT",
            Head::Right => "RIGHT",
        })
        .arg(forget_ms);
    inv
}

/// `job_status.lua`'s text: sent as `EVAL` with this source, so that it rides
/// in a pipeline of plain commands ([`job_status`]).
pub const JOB_STATUS_SOURCE: &str = include_str!("../../../../lua/jobs/job_status.lua");

/// `job_status.lua` as an `EVAL` of job `id`'s record for `user`.
pub fn job_status(keys: &JobKeys, id: &str, user: &str) -> redis::Cmd {
    redis::cmd("EVAL")
        .arg(JOB_STATUS_SOURCE)
        .arg(1)
        .arg(keys.job(id))
        .arg(user)
        .to_owned()
}

/// `job_enqueue.lua`: creates `job` (queued) unless it exists.
pub fn job_enqueue(
    keys: &JobKeys,
    job: &tollgate_core::job::Job,
    input: &str,
    create: bool,
    stored: Stored,
    waiter: &str,
) -> FunctionCall {
    let mut inv = JOBS.prepare("job_enqueue");
    inv.key(keys.job(job.id.as_str()))
        .key(&keys.queue)
        .key(&keys.leases)
        .key(&keys.releases);
    inv.arg(job.id.as_str())
        .arg(job.user.as_str())
        .arg(&job.operation)
        .arg(&job.provider)
        .arg(input)
        .arg(job.cost)
        .arg(job.enqueued_at_ms)
        .arg(job.deadline_ms)
        .arg(&job.nonce)
        .arg(if create { "1" } else { "0" })
        .arg(
            job.trace
                .as_ref()
                .map(|t| t.to_string())
                .unwrap_or_default(),
        )
        .arg(keys.stored_prefix())
        .arg(stored.width_ms)
        .arg(stored.limit)
        .arg(waiter)
        .arg(job.price.as_deref().unwrap_or(""));
    inv
}

/// The stored-bytes accounting's settings for a job script (`lua/jobs/lib/job.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Width of a time bucket (ms): [`stored_width_ms`].
    pub width_ms: u64,
    /// The user's bound in the queue (bytes; 0: none). Read by `job_enqueue.lua` only.
    pub limit: u64,
}

/// The bucket width for a queue whose jobs have `deadline_ms` to run and whose
/// results stay `result_ttl_ms`: a minute, or a sixtieth of the two when
/// longer, so a user's hash has at most ~120 buckets (unfinished jobs' by
/// deadline, results' by expiry) and a submit reads a bounded hash. A record
/// counts at most one bucket longer than it is kept.
pub fn stored_width_ms(deadline_ms: u64, result_ttl_ms: u64) -> u64 {
    (deadline_ms.saturating_add(result_ttl_ms) / 60).max(60_000)
}

/// What `job_lease.lua` is asked.
#[derive(Debug, Clone, Copy)]
pub struct LeaseArgs<'a> {
    pub id: &'a str,
    pub worker: &'a str,
    pub lease_ms: u64,
    pub max_runs: u32,
    /// The queue's operation.
    pub operation: &'a str,
    /// How long a record failed here with nothing to release stays readable.
    pub result_ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_lease.lua`
pub fn job_lease(keys: &JobKeys, a: LeaseArgs<'_>, channel: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_lease");
    inv.key(keys.job(a.id))
        .key(keys.processing(a.worker))
        .key(&keys.leases)
        .key(&keys.releases)
        .key(&keys.dead);
    inv.arg(a.id)
        .arg(a.worker)
        .arg(a.lease_ms)
        .arg(a.max_runs)
        .arg(a.operation)
        .arg(channel)
        .arg(a.result_ttl_ms)
        .arg(keys.stored_prefix())
        .arg(a.width_ms);
    inv
}

/// `job_renew.lua`
pub fn job_renew(keys: &JobKeys, id: &str, token: u64, lease_ms: u64) -> FunctionCall {
    let mut inv = JOBS.prepare("job_renew");
    inv.key(keys.job(id)).key(&keys.leases);
    inv.arg(id).arg(token).arg(lease_ms);
    inv
}

/// `job_started.lua`: marks the run started (`mark`), or takes the mark back.
pub fn job_started(keys: &JobKeys, id: &str, token: u64, mark: bool) -> FunctionCall {
    let mut inv = JOBS.prepare("job_started");
    inv.key(keys.job(id));
    inv.arg(token).arg(if mark { "1" } else { "0" });
    inv
}

/// How long a finished record stays readable, and its stored-bytes bucket width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    pub ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_complete.lua`; `head`: the upstream answer's status and safe headers
/// (JSON), `""` when a plain 200.
#[allow(clippy::too_many_arguments)]
pub fn job_complete(
    keys: &JobKeys,
    id: &str,
    worker: &str,
    token: u64,
    result: &str,
    head: &str,
    charged: Option<u64>,
    kept: Kept,
    channel: &str,
) -> FunctionCall {
    let mut inv = JOBS.prepare("job_complete");
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.leases);
    inv.arg(id)
        .arg(token)
        .arg(result)
        .arg(kept.ttl_ms)
        .arg(channel)
        .arg(keys.stored_prefix())
        .arg(kept.width_ms)
        .arg(head)
        .arg(charged.map(|c| c.to_string()).unwrap_or_default());
    inv
}

/// `job_forget.lua`: 1 deleted (a final record of `user` owing nothing), 2
/// marked to go once its pending release is confirmed, 0 left alone.
pub fn job_forget(keys: &JobKeys, id: &str, user: &str, nonce: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_forget");
    inv.key(keys.job(id));
    inv.arg(user).arg(keys.stored_prefix()).arg(nonce);
    inv
}

/// What `job_fail.lua` records.
#[derive(Debug, Clone, Copy)]
pub struct FailArgs<'a> {
    pub id: &'a str,
    pub worker: &'a str,
    pub token: u64,
    pub cause: &'a str,
    pub message: &'a str,
    /// The job owns its charge: its release goes pending.
    pub release: bool,
    /// How long the record stays readable when nothing is to be released.
    pub ttl_ms: u64,
    /// [`Stored::width_ms`].
    pub width_ms: u64,
}

/// `job_fail.lua`
pub fn job_fail(keys: &JobKeys, a: FailArgs<'_>, channel: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_fail");
    inv.key(keys.job(a.id))
        .key(keys.processing(a.worker))
        .key(&keys.leases)
        .key(&keys.releases);
    inv.arg(a.id)
        .arg(a.token)
        .arg(a.cause)
        .arg(a.message)
        .arg(channel)
        .arg(if a.release { "1" } else { "0" })
        .arg(a.ttl_ms)
        .arg(keys.stored_prefix())
        .arg(a.width_ms);
    inv
}

/// `job_released.lua`: a record marked to be forgotten is deleted (its
/// stored bytes given back), any other kept `ttl_ms`.
pub fn job_released(keys: &JobKeys, id: &str, ttl_ms: u64) -> FunctionCall {
    let mut inv = JOBS.prepare("job_released");
    inv.key(keys.job(id)).key(&keys.releases);
    inv.arg(id).arg(ttl_ms).arg(keys.stored_prefix());
    inv
}

/// Where [`job_hand_back`] puts a job back in its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueEnd {
    /// Next to be taken (a worker stopping).
    Head,
    /// Behind every queued job (a deferral).
    Tail,
}

/// `job_hand_back.lua`: job `id`, taken by `worker` under fencing `token` and
/// not run, back to `end` of its queue.
pub fn job_hand_back(
    keys: &JobKeys,
    id: &str,
    worker: &str,
    token: u64,
    end: QueueEnd,
) -> FunctionCall {
    let mut inv = JOBS.prepare("job_hand_back");
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.leases)
        .key(&keys.queue);
    let side = match end {
        QueueEnd::Head => "head",
        QueueEnd::Tail => "tail",
    };
    inv.arg(id).arg(token).arg(side);
    inv
}

/// `job_due.lua` on one of the time-scored sets of `keys`.
pub fn job_due(set: &str, age_ms: u64, limit: u32) -> FunctionCall {
    let mut inv = JOBS.prepare("job_due");
    inv.key(set).arg(age_ms).arg(limit);
    inv
}

/// `job_requeue.lua`
pub fn job_requeue(keys: &JobKeys, id: &str, worker: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_requeue");
    inv.key(keys.job(id))
        .key(&keys.leases)
        .key(&keys.queue)
        .key(keys.processing(worker));
    inv.arg(id);
    inv
}

/// `job_unstick.lua`: 1 requeued, 0 dropped as stale, -1 left alone.
pub fn job_unstick(keys: &JobKeys, id: &str, worker: &str) -> FunctionCall {
    let mut inv = JOBS.prepare("job_unstick");
    inv.key(keys.job(id))
        .key(keys.processing(worker))
        .key(&keys.queue);
    inv.arg(id);
    inv
}

// The replies. Each script's answer is read here, beside the call that asks
// it, so that a script's contract is its Lua and this file.

/// What a script fenced by a lease token did: `job_complete.lua`,
/// `job_fail.lua`, `job_hand_back.lua` answer 1 when the token was current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The token was the job's current one: the script's change is made.
    Recorded,
    /// Another run holds the job (or none does): nothing changed.
    LeaseLost,
}

impl redis::FromRedisValue for Fenced {
    fn from_redis_value(v: Value) -> Result<Self, redis::ParsingError> {
        Ok(if i64::from_redis_value(v)? == 1 {
            Self::Recorded
        } else {
            Self::LeaseLost
        })
    }
}

/// `job_enqueue.lua`'s answer.
#[derive(Debug, PartialEq, Eq)]
pub enum EnqueueReply {
    /// 1: the job is queued.
    Created,
    /// -2: the user's stored bytes are at their bound (`limit`: the bound the
    /// script read, when it said).
    Full { stored: u64, limit: Option<u64> },
    /// 0: asked not to create, and no record.
    Missing,
    /// -1: the id belongs to another user's or operation's job.
    IdInUse,
    /// 2: the job exists: its record's fields.
    Existing(HashMap<String, String>),
}

impl EnqueueReply {
    /// Reads the reply; `Err` names what did not fit.
    pub fn decode(reply: &[Value]) -> Result<Self, String> {
        match reply.first().and_then(signed) {
            Some(1) => Ok(Self::Created),
            Some(-2) => Ok(Self::Full {
                stored: reply.get(1).and_then(loose_int).unwrap_or(0),
                limit: reply.get(2).and_then(loose_int),
            }),
            Some(0) => Ok(Self::Missing),
            Some(-1) => Ok(Self::IdInUse),
            Some(2) => {
                let map: HashMap<String, String> = redis::FromRedisValue::from_redis_value(
                    reply.get(1).cloned().unwrap_or(Value::Nil),
                )
                .map_err(|e| e.to_string())?;
                Ok(Self::Existing(map))
            }
            _ => Err(format!("{reply:?}")),
        }
    }
}

/// `job_lease.lua`'s answer.
#[derive(Debug, PartialEq, Eq)]
pub enum LeaseReply {
    /// 1: leased under `token` (`None`: unreadable), `time_left_ms` to its
    /// deadline, with the job's fields.
    Job {
        token: Option<u64>,
        time_left_ms: u64,
        fields: HashMap<String, String>,
    },
    /// 0: the entry was no job to run (stale, already gone).
    Skipped,
    /// 2: failed at its take (`cause`, a [`tollgate_core::job::FailureCause`]
    /// name): past its deadline or its runs.
    Failed {
        cause: String,
        user: String,
        nonce: String,
    },
    /// 3: malformed, moved aside (`reason`).
    MovedAside {
        reason: String,
        user: String,
        nonce: String,
    },
}

impl LeaseReply {
    /// Reads the reply; `Err` names what did not fit.
    pub fn decode(reply: &[Value]) -> Result<Self, String> {
        let at = |i: usize| reply.get(i).and_then(loose_text).unwrap_or_default();
        match reply.first().and_then(loose_int) {
            Some(1) if reply.len() >= 3 => Ok(Self::Job {
                token: loose_int(&reply[1]),
                time_left_ms: loose_int(&reply[2]).unwrap_or(0),
                fields: reply[3..]
                    .chunks_exact(2)
                    .filter_map(|kv| Some((loose_text(&kv[0])?, loose_text(&kv[1])?)))
                    .collect(),
            }),
            Some(0) => Ok(Self::Skipped),
            Some(2) => Ok(Self::Failed {
                cause: at(1),
                user: at(2),
                nonce: at(3),
            }),
            Some(3) => Ok(Self::MovedAside {
                reason: at(1),
                user: at(2),
                nonce: at(3),
            }),
            _ => Err(format!("{reply:?}")),
        }
    }
}

#[cfg(test)]
mod replies {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn each_answer_of_enqueue_and_lease_reads_as_its_case() {
        assert_eq!(
            EnqueueReply::decode(&[Value::Int(1)]),
            Ok(EnqueueReply::Created)
        );
        assert_eq!(
            EnqueueReply::decode(&[Value::Int(-2), Value::Int(10)]),
            Ok(EnqueueReply::Full {
                stored: 10,
                limit: None
            })
        );
        let existing = EnqueueReply::decode(&[
            Value::Int(2),
            Value::Array(vec![bulk("state"), bulk("queued")]),
        ]);
        assert!(matches!(existing, Ok(EnqueueReply::Existing(m)) if m["state"] == "queued"));
        assert!(EnqueueReply::decode(&[bulk("x")]).is_err());

        let job = LeaseReply::decode(&[
            Value::Int(1),
            Value::Int(7),
            Value::Int(500),
            bulk("user"),
            bulk("u"),
        ]);
        assert!(matches!(
            job,
            Ok(LeaseReply::Job { token: Some(7), time_left_ms: 500, fields }) if fields["user"] == "u"
        ));
        assert_eq!(
            LeaseReply::decode(&[Value::Int(2), bulk("expired"), bulk("u"), bulk("n")]),
            Ok(LeaseReply::Failed {
                cause: "expired".into(),
                user: "u".into(),
                nonce: "n".into()
            })
        );
        assert!(LeaseReply::decode(&[]).is_err());
    }
}
