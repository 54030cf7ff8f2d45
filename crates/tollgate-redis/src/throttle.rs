//! The distributed throttle: [`RedisThrottle`], the waiter side of the
//! [`Throttle`] trait, and [`Dispatcher`], the throttler side of one provider.
//!
//! A waiter registers a unique ticket with its process's one shared pub/sub
//! subscription (the inbox), makes sure that subscription is live, then queues
//! the ticket (`throttle_enqueue.lua`; when nobody is queued and the bucket has
//! a token, that script takes it and the waiter goes ahead at once). A
//! throttler pops tickets and serves them
//! from the provider's bucket in one atomic script (`throttle_grant.lua`), which
//! also records the grant (the readiness record) and publishes it to the inbox.
//!
//! **No lost wake-ups.** Pub/sub is at-most-once, so every (re)subscription is
//! followed by a re-check of the readiness records of all pending tickets: a grant
//! published while the subscription was down is found there.
//!
//! **Nothing burns a token for nobody.** A waiter that gives up runs
//! `throttle_cancel.lua`: still queued, it leaves the queue; already granted, the
//! token goes back to the bucket. Throttlers skip tickets nobody waits for.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, ScriptInvocation};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tollgate_core::{Config, Grant, Provider, RequestId, Throttle, ThrottleError};

use crate::call::{self, CallError};
use crate::keys::{KeySpace, ThrottleKeys};
use crate::pool::{redact_url, Pool, RedisBackendError, DEFAULT_TIMEOUT};
use crate::scripts::{self, BucketArgs};

/// The least time a readiness record outlives its grant. A provider's records
/// live at least its `max_wait` (plus [`READY_MARGIN`]): a waiter still waiting
/// always finds its grant after a re-subscription.
pub const READY_TTL: Duration = Duration::from_secs(30);

/// How much longer than a provider's `max_wait` its readiness records live.
pub const READY_MARGIN: Duration = Duration::from_secs(5);

/// How long the readiness records of `provider`'s grants live.
pub fn ready_ttl(provider: &Provider) -> Duration {
    READY_TTL.max(provider.max_wait + READY_MARGIN)
}

/// Idle provider keys (no waiter, no grant) expire after this.
pub const IDLE_TTL: Duration = Duration::from_secs(2 * 3600);

impl From<CallError> for ThrottleError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Unavailable(m) => Self::Unavailable(m),
            CallError::Backend(m) => Self::Backend(m),
        }
    }
}

/// For calls on the dedicated (blocking, pub/sub) connections.
fn map_redis_error(e: redis::RedisError) -> ThrottleError {
    CallError::from(e).into()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

async fn run_script<T: FromRedisValue>(
    pool: &Pool,
    timeout: Duration,
    op: &'static str,
    inv: ScriptInvocation<'_>,
) -> Result<T, ThrottleError> {
    Ok(call::script(pool, timeout, op, &inv).await?)
}

/// Tunables of the waiter side.
#[derive(Debug, Clone)]
pub struct RedisThrottleOptions {
    /// Bounds each Redis call (not the wait for a slot).
    pub call_timeout: Duration,
    /// Pause before re-subscribing after the subscription dropped.
    pub reconnect_delay: Duration,
    /// A grant that reaches its waiter older than this (the process was
    /// paused, or its subscription was down) is not used: its token goes back
    /// to the bucket and the waiter queues again, so that grants made during
    /// a pause never reach the upstream together.
    pub late_grant: Duration,
}

impl Default for RedisThrottleOptions {
    fn default() -> Self {
        Self {
            call_timeout: DEFAULT_TIMEOUT,
            reconnect_delay: Duration::from_millis(100),
            late_grant: Duration::from_secs(1),
        }
    }
}

/// One try of [`RedisThrottle::acquire`].
enum Attempt {
    Granted(Grant),
    /// The grant came too late to be used; the waiter queues again.
    Late {
        age: Duration,
    },
}

/// The distributed throttle, waiter side: one per process (it owns the process's
/// single pub/sub subscription and demultiplexes grants to waiters by ticket).
pub struct RedisThrottle {
    shared: Arc<Shared>,
    providers: BTreeMap<String, Provider>,
    options: RedisThrottleOptions,
    /// Dropping it stops the subscriber task.
    _stop: oneshot::Sender<()>,
}

impl std::fmt::Debug for RedisThrottle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisThrottle")
            .field("inbox", &self.shared.inbox)
            .field("pending", &lock(&self.shared.pending).len())
            .finish_non_exhaustive()
    }
}

struct Shared {
    pool: Pool,
    keys: KeySpace,
    inbox: String,
    process: String,
    next: AtomicU64,
    /// ticket -> (provider, the waiter's receiver of `granted_at_us`)
    pending: Mutex<HashMap<String, (String, oneshot::Sender<u64>)>>,
    subscribed: watch::Sender<bool>,
    call_timeout: Duration,
    /// Cancels of dropped waits still running: [`RedisThrottle::drain`] lets
    /// them finish before a process exits (a runtime that stops first would
    /// drop them, leaving their tickets queued until their deadline).
    cancels: Mutex<tokio::task::JoinSet<()>>,
}

impl Shared {
    fn deliver(&self, ticket: &str, granted_at_us: u64) {
        if let Some((_, tx)) = lock(&self.pending).remove(ticket) {
            // A waiter that left meanwhile hands the grant back itself (its
            // cancel finds the readiness record).
            let _ = tx.send(granted_at_us);
        }
    }

    /// Looks up the readiness record of every pending ticket: the grants
    /// published while this process was not subscribed.
    async fn recheck(&self) -> Result<usize, ThrottleError> {
        let mut by_provider: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (ticket, (provider, _)) in lock(&self.pending).iter() {
            by_provider
                .entry(provider.clone())
                .or_default()
                .push(ticket.clone());
        }
        let mut found = 0;
        for (provider, tickets) in by_provider {
            let keys = self.keys.throttle(&provider);
            let mut cmd = redis::cmd("ZMSCORE");
            cmd.arg(&keys.granted).arg(&tickets);
            let scores: Vec<Option<f64>> =
                call::command(&self.pool, self.call_timeout, "recheck", &cmd).await?;
            for (ticket, score) in tickets.iter().zip(scores) {
                if let Some(at) = score {
                    found += 1;
                    self.deliver(ticket, at as u64);
                }
            }
        }
        Ok(found)
    }
}

/// Keeps the process's one subscription to its inbox alive; after each
/// (re)subscription, re-checks the pending tickets.
async fn subscriber(shared: Arc<Shared>, client: redis::Client, reconnect_delay: Duration) {
    loop {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.subscribe(&shared.inbox).await {
                Ok(()) => {
                    shared.subscribed.send_replace(true);
                    // Grants published while nobody listened are found by the
                    // re-check; it is retried until it succeeds (a failed one
                    // would strand them until max_wait), while grants keep
                    // arriving on the subscription meanwhile.
                    let recheck = async {
                        let mut backoff = Duration::from_millis(50);
                        loop {
                            match shared.recheck().await {
                                Ok(0) => break,
                                Ok(n) => {
                                    tracing::info!(found = n, "grants found after subscribing");
                                    break;
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e, ?backoff, "re-check after subscribing failed; retrying");
                                    tokio::time::sleep(backoff).await;
                                    backoff = (backoff * 2).min(Duration::from_secs(2));
                                }
                            }
                        }
                        std::future::pending::<()>().await;
                    };
                    let listen = async {
                        let mut messages = pubsub.on_message();
                        while let Some(msg) = messages.next().await {
                            let payload = msg.get_payload_bytes();
                            let parsed = std::str::from_utf8(payload)
                                .ok()
                                .and_then(|s| s.split_once(' '))
                                .and_then(|(t, at)| Some((t, at.parse::<u64>().ok()?)));
                            match parsed {
                                Some((ticket, at)) => shared.deliver(ticket, at),
                                None => tracing::warn!(?payload, "malformed readiness message"),
                            }
                        }
                    };
                    // The subscription ending ends the re-check too.
                    tokio::select! {
                        () = listen => {}
                        () = recheck => {}
                    }
                    shared.subscribed.send_replace(false);
                    tracing::warn!("throttle subscription lost; re-subscribing");
                }
                Err(e) => tracing::warn!(error = %e, "cannot subscribe to the throttle inbox"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot open the throttle subscription"),
        }
        tokio::time::sleep(reconnect_delay).await;
    }
}

/// A waiter's claim on its ticket. Dropped while armed (the caller's future was
/// dropped, or the enqueue failed), it cancels the ticket in the background.
struct Ticket<'a> {
    throttle: &'a RedisThrottle,
    provider: &'a Provider,
    id: String,
    armed: bool,
}

impl Ticket<'_> {
    async fn cancel(&mut self) -> Result<i64, ThrottleError> {
        self.armed = false;
        lock(&self.throttle.shared.pending).remove(&self.id);
        cancel(
            &self.throttle.shared,
            self.provider,
            &self.id,
            self.throttle.options.call_timeout,
        )
        .await
    }
}

async fn cancel(
    shared: &Shared,
    provider: &Provider,
    ticket: &str,
    timeout: Duration,
) -> Result<i64, ThrottleError> {
    let keys = shared.keys.throttle(&provider.name);
    let r = run_script(
        &shared.pool,
        timeout,
        "throttle_cancel",
        scripts::throttle_cancel(&keys, ticket, BucketArgs::from(provider)),
    )
    .await;
    if let Ok(2) = r {
        tracing::debug!(provider = %provider.name, ticket, "late grant handed back");
    }
    r
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        lock(&self.throttle.shared.pending).remove(&self.id);
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the ticket expires at its deadline
        };
        let shared = Arc::clone(&self.throttle.shared);
        let provider = self.provider.clone();
        let ticket = std::mem::take(&mut self.id);
        let timeout = self.throttle.options.call_timeout;
        let task = async move {
            if let Err(e) = cancel(&shared, &provider, &ticket, timeout).await {
                tracing::warn!(error = %e, ticket, "cancelling a dropped wait failed");
            }
        };
        lock(&self.throttle.shared.cancels).spawn_on(task, &rt);
    }
}

impl RedisThrottle {
    /// Starts the process's subscription (on `url`; commands go through `pool`).
    pub fn start(
        url: &str,
        pool: Pool,
        keys: KeySpace,
        config: &Config,
        options: RedisThrottleOptions,
    ) -> Result<Self, RedisBackendError> {
        let client = redis::Client::open(url).map_err(|e| RedisBackendError::BadUrl {
            url: redact_url(url),
            message: e.to_string(),
        })?;
        let process = RequestId::generate().as_str().replace('-', "");
        let (subscribed, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            pool,
            inbox: keys.inbox(&process),
            keys,
            process,
            next: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            subscribed,
            call_timeout: options.call_timeout,
            cancels: Mutex::default(),
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = subscriber(Arc::clone(&shared), client, options.reconnect_delay);
        tokio::spawn(async move {
            tokio::select! {
                () = task => {}
                _ = stopped => {}
            }
        });
        Ok(Self {
            shared,
            providers: config
                .providers()
                .map(|p| (p.name.clone(), p.clone()))
                .collect(),
            options,
            _stop: stop,
        })
    }

    /// Lets the cancels of dropped waits finish, at most `limit`; call it
    /// before the runtime stops. Returns how many did not finish in time.
    pub async fn drain(&self, limit: Duration) -> usize {
        let mut cancels = std::mem::take(&mut *lock(&self.shared.cancels));
        let _ = tokio::time::timeout(limit, async {
            while cancels.join_next().await.is_some() {}
        })
        .await;
        cancels.len()
    }

    /// The pub/sub channel this process's waiters hear their grants on.
    pub fn inbox(&self) -> &str {
        &self.shared.inbox
    }

    /// Tickets this process is waiting on.
    pub fn pending(&self) -> usize {
        lock(&self.shared.pending).len()
    }

    /// Waits until the subscription is live, at most `within`.
    pub async fn subscribed(&self, within: Duration) -> bool {
        let mut rx = self.shared.subscribed.subscribe();
        tokio::time::timeout(within, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

#[async_trait]
impl Throttle for RedisThrottle {
    #[tracing::instrument(skip_all, fields(provider, request_id = %request_id))]
    async fn acquire(
        &self,
        provider: &str,
        request_id: &RequestId,
        max_wait: Duration,
    ) -> Result<Grant, ThrottleError> {
        let started = Instant::now();
        let deadline = started + max_wait;
        let p = self.providers.get(provider).ok_or_else(|| {
            ThrottleError::unknown_provider(provider, self.providers.keys().map(String::as_str))
        })?;
        loop {
            match self.attempt(p, request_id, started, max_wait).await? {
                Attempt::Granted(grant) => return Ok(grant),
                Attempt::Late { age } => {
                    tracing::warn!(
                        provider = %p.name, ?age,
                        "a grant arrived late (a pause or a lost subscription): not used, queued again"
                    );
                    if Instant::now() >= deadline {
                        return Err(ThrottleError::Timeout {
                            provider: p.name.clone(),
                            max_wait,
                        });
                    }
                }
            }
        }
    }
}

impl RedisThrottle {
    /// One ticket: queued (or granted on the way in), then its grant, its
    /// timeout, or a grant too old to use (handed back).
    async fn attempt(
        &self,
        p: &Provider,
        request_id: &RequestId,
        started: Instant,
        max_wait: Duration,
    ) -> Result<Attempt, ThrottleError> {
        let deadline = started + max_wait;
        let left = deadline.saturating_duration_since(Instant::now());
        let shared = &self.shared;
        let n = shared.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("{request_id}~{}.{n:x}", shared.process);
        let (tx, rx) = oneshot::channel();
        // Registered before the subscription is checked: a subscription that
        // drops from here on is followed by a re-check that includes this ticket.
        lock(&shared.pending).insert(id.clone(), (p.name.clone(), tx));
        let mut ticket = Ticket {
            throttle: self,
            provider: p,
            id,
            armed: false,
        };
        let timeout = || ThrottleError::Timeout {
            provider: p.name.clone(),
            max_wait,
        };
        let connect_wait = self.options.call_timeout.min(left);
        if !self.subscribed(connect_wait).await {
            return Err(if connect_wait == left {
                timeout()
            } else {
                ThrottleError::Unavailable("no pub/sub subscription to Redis".into())
            });
        }
        ticket.armed = true;
        let keys = shared.keys.throttle(&p.name);
        let queued: Vec<i64> = run_script(
            &shared.pool,
            self.options.call_timeout,
            "throttle_enqueue",
            scripts::throttle_enqueue(
                &keys,
                &ticket.id,
                &shared.inbox,
                micros(left),
                u64::try_from(IDLE_TTL.as_millis()).unwrap_or(u64::MAX),
                BucketArgs::from(p),
            ),
        )
        .await?;
        let grant = |granted_at_us: u64| Grant {
            provider: p.name.clone(),
            request_id: request_id.clone(),
            waited: started.elapsed(),
            granted_at_us,
        };
        let queued_at = Instant::now();
        let redis_now_us = match queued[..] {
            [2, granted_at_us] => {
                // Nobody was queued and the bucket had a token: taken at once.
                ticket.armed = false;
                lock(&shared.pending).remove(&ticket.id);
                return Ok(Attempt::Granted(grant(
                    u64::try_from(granted_at_us).unwrap_or(0),
                )));
            }
            [1, now_us] => u64::try_from(now_us).unwrap_or(0),
            _ => {
                return Err(ThrottleError::Backend(format!(
                    "throttle_enqueue refused ticket {}: {queued:?}",
                    ticket.id
                )))
            }
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(granted_at_us)) => {
                // Redis's clock now, as far as this process can tell: the
                // enqueue's reply plus the time elapsed here since (a monotonic
                // clock; the wall clock decides nothing).
                let now_us = redis_now_us.saturating_add(micros(queued_at.elapsed()));
                let age = Duration::from_micros(now_us.saturating_sub(granted_at_us));
                if age > self.options.late_grant {
                    // Not used: the token goes back (once), the caller queues again.
                    if let Err(e) = ticket.cancel().await {
                        tracing::warn!(error = %e, "handing back a late grant failed");
                    }
                    return Ok(Attempt::Late { age });
                }
                ticket.armed = false;
                Ok(Attempt::Granted(grant(granted_at_us)))
            }
            Ok(Err(_)) => Err(ThrottleError::Backend(
                "the throttle subscriber stopped".into(),
            )),
            Err(_) => {
                if let Err(e) = ticket.cancel().await {
                    tracing::warn!(error = %e, "cancelling a timed-out wait failed");
                }
                Err(timeout())
            }
        }
    }
}

/// What one [`Dispatcher::pump`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pumped {
    pub granted: u64,
    pub skipped: u64,
    /// `Some(d)`: the bucket is dry with tickets left; the next token is due in `d`.
    pub wait: Option<Duration>,
    /// The grant limit stopped the call with tickets left: pump again.
    pub more: bool,
}

/// The throttler side of one provider: serves its queue from its bucket.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pool: Pool,
    keys: ThrottleKeys,
    throttler: String,
    bucket: BucketArgs,
    ready_ttl: Duration,
    timeout: Duration,
}

impl Dispatcher {
    pub fn new(pool: Pool, keys: &KeySpace, provider: &Provider, throttler: &str) -> Self {
        Self {
            pool,
            keys: keys.throttle(&provider.name),
            throttler: throttler.to_owned(),
            bucket: BucketArgs::from(provider),
            ready_ttl: ready_ttl(provider),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    pub fn keys(&self) -> &ThrottleKeys {
        &self.keys
    }

    /// Grants up to `limit` tickets, oldest first, while the bucket has tokens.
    pub async fn pump(&self, limit: u32) -> Result<Pumped, ThrottleError> {
        let r: Vec<i64> = run_script(
            &self.pool,
            self.timeout,
            "throttle_grant",
            scripts::throttle_grant(
                &self.keys,
                &self.throttler,
                self.bucket,
                limit,
                micros(self.ready_ttl),
                u64::try_from(IDLE_TTL.as_millis()).unwrap_or(u64::MAX),
            ),
        )
        .await?;
        match r.as_slice() {
            &[granted, skipped, wait, more] => Ok(Pumped {
                granted: granted.max(0) as u64,
                skipped: skipped.max(0) as u64,
                wait: (wait > 0).then(|| Duration::from_micros(wait as u64)),
                more: more == 1,
            }),
            other => Err(ThrottleError::Backend(format!(
                "unexpected throttle_grant reply: {other:?}"
            ))),
        }
    }

    /// Blocks on `conn` (a dedicated connection: see [`blocking_connection`])
    /// until a ticket is queued, at most `block`, and moves it into this
    /// throttler's processing list. Returns whether a ticket came.
    pub async fn wait_for_ticket(
        &self,
        conn: &mut MultiplexedConnection,
        block: Duration,
    ) -> Result<bool, ThrottleError> {
        let mut cmd = redis::cmd("BLMOVE");
        cmd.arg(&self.keys.queue)
            .arg(self.keys.processing(&self.throttler))
            .arg("LEFT")
            .arg("RIGHT")
            .arg(block.as_secs_f64());
        let moved: Option<String> =
            call::dedicated(conn, block + self.timeout, "blmove", &cmd).await?;
        Ok(moved.is_some())
    }

    /// Renews this throttler's lease; returns throttlers whose lease ended.
    pub async fn heartbeat(&self, lease: Duration) -> Result<Vec<String>, ThrottleError> {
        run_script(
            &self.pool,
            self.timeout,
            "throttle_heartbeat",
            scripts::throttle_heartbeat(&self.keys, &self.throttler, micros(lease)),
        )
        .await
    }

    /// Moves a dead throttler's tickets back to the head of the queue. Returns
    /// how many, or `None` when its lease turned out to be live.
    pub async fn reclaim(&self, dead: &str) -> Result<Option<u64>, ThrottleError> {
        let n: i64 = run_script(
            &self.pool,
            self.timeout,
            "throttle_reclaim",
            scripts::throttle_reclaim(&self.keys, dead, false),
        )
        .await?;
        Ok(u64::try_from(n).ok())
    }

    /// This throttler stops: its tickets go back to the queue, its lease ends.
    pub async fn release(&self) -> Result<u64, ThrottleError> {
        let n: i64 = run_script(
            &self.pool,
            self.timeout,
            "throttle_reclaim",
            scripts::throttle_reclaim(&self.keys, &self.throttler, true),
        )
        .await?;
        Ok(n.max(0) as u64)
    }
}

/// A connection of its own for blocking commands (BLMOVE): on a shared
/// multiplexed connection a blocking command stalls every other command.
pub async fn blocking_connection(url: &str) -> Result<MultiplexedConnection, ThrottleError> {
    let client = redis::Client::open(url).map_err(|e| {
        ThrottleError::Unavailable(format!("bad Redis URL {}: {e}", redact_url(url)))
    })?;
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(None)
        .set_connection_timeout(Some(DEFAULT_TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(map_redis_error)
}
