//! Every pooled Redis round trip goes through here: one checkout from the pool,
//! one timeout (a stalled Redis fails closed), one tracing span, eviction of a
//! connection that broke, and one classification of failures
//! ([`store_error`]): a [`StoreError`],
//! transient or not, that each backend's error carries.
//!
//! **Retries.** A request that failed at the connection level is sent again, once,
//! on a fresh connection only when repeating it is harmless: [`read`] (a command
//! or pipeline that changes nothing, e.g. an API key lookup or PING). Everything
//! else ([`script`], [`command`], [`pipeline`]) is sent once: a lost reply does not
//! say whether Redis ran the request, and running some of them twice is wrong.
//! The budget scripts are idempotent by request id (a second `reserve` charges
//! nothing, a second `refund` refunds nothing), but the bucket scripts of the
//! throttle would take a second token, `job_lease` would lease a second job, and
//! the job submit/enqueue path is idempotent only once its nonce lands; so the
//! caller, which knows which it sent, decides. What makes a retry unnecessary in
//! the common case is the pool: it never hands out a connection whose socket
//! Redis already closed (see [`crate::pool`]), so after a Redis restart the first
//! request goes out on a new connection instead of failing.
//!
//! **Accepting writes.** In replica mode ([`Durability::Replica`]) the scripts
//! that accept a call ([`ACCEPTING`]: a job's charge, its enqueue) are followed
//! by `WAIT <replicas> <timeout>` in the same pipeline, on the same connection
//! (one round trip, as before): the call is answered 200/202 only once the
//! replicas hold its writes, so a failover to one of them loses no accepted
//! call. A WAIT short of its replicas fails the call as unavailable (503): the
//! write stands on the primary (the job may still run, charged by its own
//! rules), and a retry with the same request id finds it. WAIT blocks its
//! connection for at most its timeout, so the calls sharing that multiplexed
//! connection wait as long when replicas lag.

use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, FromRedisValue, Pipeline, RedisError, RedisFuture, ScriptInvocation, Value};
use tollgate_core::durability::Durability;
use tollgate_core::error::StoreError;
use tracing::Instrument;

use crate::pool::{checkout, is_connection_error, store_error, Blocking, Pool};
use crate::scripts::{is_noscript, FunctionCall};

/// The error for a reply of a shape the caller did not expect, as any
/// backend's error.
pub fn bad_reply<E: From<StoreError>>(what: &str, reply: impl std::fmt::Debug) -> E {
    StoreError::backend(format!("unexpected {what} reply: {reply:?}")).into()
}

/// A script call: EVALSHA of a script, or FCALL of a library's function.
#[derive(Clone, Copy)]
enum Invocation<'a, 'b> {
    Script(&'a ScriptInvocation<'b>),
    Function(&'a FunctionCall),
}

#[derive(Clone, Copy)]
enum Request<'a, 'b> {
    Script(Invocation<'a, 'b>),
    Command(&'a Cmd),
    Pipeline(&'a Pipeline),
}

/// Whether a request may be sent a second time after a connection failure.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Repeat {
    /// It changes nothing: send it again on a fresh connection.
    Safe,
    /// It may have run: report the failure.
    Never,
}

/// The `op` of a job's charge (`RedisLedger::charge`).
pub const CHARGE: &str = "charge";
/// The `op` of a job's enqueue (`RedisJobQueue::enqueue`).
pub const ENQUEUE: &str = "job_enqueue";
/// The scripts (by their `op`) whose writes accept a call: a job's charge and
/// its enqueue. Replica mode WAITs after them.
pub const ACCEPTING: [&str; 2] = [CHARGE, ENQUEUE];

/// EVALSHA (loading the script on NOSCRIPT) on a pooled connection; followed
/// by WAIT for an [`ACCEPTING`] script in replica mode.
pub fn script<'a, T: FromRedisValue + 'a>(
    pool: &'a Pool,
    timeout: Duration,
    op: &'static str,
    inv: &'a ScriptInvocation<'_>,
) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a {
    invocation(pool, timeout, op, Invocation::Script(inv))
}

/// FCALL (loading its library when Redis has none) on a pooled connection;
/// followed by WAIT for an [`ACCEPTING`] function in replica mode.
pub fn function<'a, T: FromRedisValue + 'a>(
    pool: &'a Pool,
    timeout: Duration,
    op: &'static str,
    f: &'a FunctionCall,
) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a {
    invocation(pool, timeout, op, Invocation::Function(f))
}

async fn invocation<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    inv: Invocation<'_, '_>,
) -> Result<T, StoreError> {
    match pool.durability() {
        Durability::Replica {
            replicas,
            timeout: wait,
        } if ACCEPTING.contains(&op) => {
            let wait = Wait {
                replicas,
                ms: wait.as_millis().max(1),
            };
            accepting(pool, timeout, op, inv, wait).await
        }
        _ => call(pool, timeout, op, Request::Script(inv), Repeat::Never).await,
    }
}

/// The WAIT of replica mode.
#[derive(Debug, Clone, Copy)]
struct Wait {
    replicas: u32,
    ms: u128,
}

/// A connection that sends `WAIT` in one pipeline with each EVALSHA or FCALL and keeps
/// its answer: how many replicas acknowledged the script's writes.
struct Waiting<C> {
    inner: C,
    wait: Wait,
    acked: Option<i64>,
}

impl<C: ConnectionLike + Send> ConnectionLike for Waiting<C> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let call = matches!(cmd.args_iter().next(), Some(Arg::Simple(name))
            if name.eq_ignore_ascii_case(b"EVALSHA") || name.eq_ignore_ascii_case(b"FCALL"));
        if !call {
            return self.inner.req_packed_command(cmd);
        }
        Box::pin(async move {
            let mut pipe = redis::pipe();
            pipe.add_command(cmd.clone())
                .cmd("WAIT")
                .arg(self.wait.replicas)
                .arg(self.wait.ms as u64);
            let mut replies = self.inner.req_packed_commands(&pipe, 0, 2).await?;
            let waited = replies.pop();
            let script = replies.pop();
            // A script that failed (NOSCRIPT, a function not found among
            // others) wrote nothing to wait for.
            if let (Some(Value::Int(n)), Some(v)) = (&waited, &script) {
                if !matches!(v, Value::ServerError(_)) {
                    self.acked = Some(*n);
                }
            }
            script.ok_or_else(|| {
                RedisError::from((redis::ErrorKind::Parse, "no reply to the script"))
            })
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.inner.req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// An accepting script and its WAIT, sent once (never repeated: it wrote).
async fn accepting<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    inv: Invocation<'_, '_>,
    wait: Wait,
) -> Result<T, StoreError> {
    let round_trip = async {
        let (value, acked) = match pool {
            Pool::Single(p) => {
                let lease = checkout(p).await?;
                let mut conn = Waiting {
                    inner: lease.conn.clone(),
                    wait,
                    acked: None,
                };
                let value = invoke::<T>(inv, &mut conn).await.map_err(|e| {
                    lease.fail(&e);
                    store_error(e)
                })?;
                (value, conn.acked)
            }
            Pool::Cluster(c) => {
                let mut conn = Waiting {
                    inner: c.connection(),
                    wait,
                    acked: None,
                };
                let value = invoke::<T>(inv, &mut conn).await.map_err(store_error)?;
                (value, conn.acked)
            }
        };
        match acked {
            Some(n) if n >= i64::from(wait.replicas) => Ok(value),
            acked => Err(StoreError::unavailable(format!(
                "{op} ran on the primary, but {} of {} replica(s) acknowledged it within {} ms \
                 (WAIT): it stands there and may still take effect",
                acked.unwrap_or(0),
                wait.replicas,
                wait.ms
            ))),
        }
    };
    bounded(timeout, op, round_trip).await
}

/// One command on a pooled connection.
pub async fn command<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    cmd: &Cmd,
) -> Result<T, StoreError> {
    call(pool, timeout, op, Request::Command(cmd), Repeat::Never).await
}

/// A pipeline on a pooled connection.
pub async fn pipeline<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    pipe: &Pipeline,
) -> Result<T, StoreError> {
    call(pool, timeout, op, Request::Pipeline(pipe), Repeat::Never).await
}

/// A pipeline that only reads (or PINGs): after a connection failure it is sent
/// once more on a fresh connection, since running it twice changes nothing.
pub async fn read<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    pipe: &Pipeline,
) -> Result<T, StoreError> {
    call(pool, timeout, op, Request::Pipeline(pipe), Repeat::Safe).await
}

/// One command on a dedicated connection (a blocking pop, never the pool's shared
/// ones), bounded by `timeout`.
pub async fn dedicated<T: FromRedisValue>(
    conn: &mut Blocking,
    timeout: Duration,
    op: &'static str,
    cmd: &Cmd,
) -> Result<T, StoreError> {
    bounded(timeout, op, async {
        cmd.query_async::<T>(conn).await.map_err(store_error)
    })
    .await
}

async fn bounded<T>(
    timeout: Duration,
    op: &'static str,
    fut: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, fut)
        .instrument(tracing::debug_span!("redis", op))
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::unavailable(format!(
                "Redis did not answer {op} within {timeout:?}"
            )))
        })
}

/// Commands that may live in different hash slots (reads across operations or
/// providers), each answer in the order sent: one pipeline on a standalone
/// Redis; on a cluster each command goes to its own node, all at once.
pub async fn gather<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    cmds: &[Cmd],
) -> Result<T, StoreError> {
    // No command (a read across the operations of a config that has none: a
    // budget-only deployment) is no answer, not a round trip: redis-rs refuses
    // an empty pipeline ("empty command").
    if cmds.is_empty() {
        return T::from_redis_value(Value::Array(Vec::new())).map_err(|e| bad_reply(op, e));
    }
    match pool {
        Pool::Single(_) => {
            let mut pipe = redis::pipe();
            for cmd in cmds {
                pipe.add_command(cmd.clone());
            }
            read(pool, timeout, op, &pipe).await
        }
        Pool::Cluster(c) => {
            let each = cmds.iter().map(|cmd| {
                let mut conn = c.connection();
                async move { cmd.query_async::<Value>(&mut conn).await }
            });
            let values = bounded(timeout, op, async {
                futures_util::future::try_join_all(each)
                    .await
                    .map_err(store_error)
            })
            .await?;
            T::from_redis_value(Value::Array(values)).map_err(|e| bad_reply(op, e))
        }
    }
}

/// How many times a script call loads its script before it gives up (each
/// time: EVALSHA, and on NOSCRIPT, SCRIPT LOAD and EVALSHA again).
const SCRIPT_LOADS: usize = 3;

/// EVALSHA, loading the script on NOSCRIPT. redis-rs loads it once; a script
/// flushed again between its load and its run (a `SCRIPT FLUSH`, a failover
/// or a restart landing in that window, which a slow link widens) is loaded
/// again, up to [`SCRIPT_LOADS`] times. A NOSCRIPT means the script did not
/// run, so this never runs it twice; a NOSCRIPT left after the last load is
/// reported as unavailable ([`store_error`]).
async fn invoke<T: FromRedisValue>(
    inv: Invocation<'_, '_>,
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<T, RedisError> {
    let inv = match inv {
        Invocation::Script(inv) => inv,
        // Boxed: keeps the futures of every script call small.
        Invocation::Function(f) => return Box::pin(f.invoke_async(conn, SCRIPT_LOADS)).await,
    };
    let mut loads = 1;
    loop {
        match inv.invoke_async::<T>(conn).await {
            Err(e) if is_noscript(&e) && loads < SCRIPT_LOADS => loads += 1,
            done => return done,
        }
    }
}

/// One request on `conn`, whichever kind of connection it is.
async fn send<T: FromRedisValue>(
    request: Request<'_, '_>,
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<T, RedisError> {
    match request {
        Request::Script(inv) => invoke(inv, conn).await,
        Request::Command(cmd) => cmd.query_async(conn).await,
        Request::Pipeline(pipe) => pipe.query_async(conn).await,
    }
}

async fn call<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    request: Request<'_, '_>,
    repeat: Repeat,
) -> Result<T, StoreError> {
    let pool = match pool {
        Pool::Single(p) => p,
        Pool::Cluster(c) => {
            // The cluster connection reconnects, follows MOVED/ASK and
            // refreshes its slot map by itself; a failed call is reported.
            let mut conn = c.connection();
            let round_trip = async { send(request, &mut conn).await.map_err(store_error) };
            return bounded(timeout, op, round_trip).await;
        }
    };
    let round_trip = async {
        let mut retried = false;
        loop {
            let mut lease = checkout(pool).await?;
            match send(request, &mut lease.conn).await {
                Ok(value) => return Ok(value),
                Err(e) => {
                    let broken = is_connection_error(&e);
                    lease.fail(&e);
                    if broken && repeat == Repeat::Safe && !retried {
                        retried = true;
                        tracing::debug!(op, error = %e, "connection failed; reading again on a fresh one");
                        continue;
                    }
                    return Err(store_error(e));
                }
            }
        }
    };
    bounded(timeout, op, round_trip).await
}
