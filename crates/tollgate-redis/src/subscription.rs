//! A process's long-lived pub/sub subscriptions, written once: the finished-jobs
//! channel of the job queue and the grants inbox of the throttle each run
//! [`spawn`] with their own [`Listener`].
//!
//! **No lost wake-ups.** Pub/sub delivers at most once, and nothing published
//! while a subscription is down reaches it. So after every (re)subscription the
//! listener's [`Listener::resync`] finds what was missed (a re-read of the
//! records the messages announce), retried with backoff until it succeeds, while
//! new messages keep arriving. What each listener keeps of its waiters differs
//! (the job queue rings a waiter that then re-reads its job; the throttle hands
//! its waiter the grant time carried by the message), so the registries are two.
//!
//! On a Redis Cluster the channels are sharded ([`subscribe_sharded`]): each
//! lives in the slot of what it announces (a provider's inbox, a queue's
//! finished jobs), the scripts SPUBLISH there, and the subscription follows the
//! slot's owner through failovers and resharding.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tollgate_core::error::StoreError;

use crate::pool::{ClusterPool, Pool};
use tollgate_core::lock;

/// What a subscription does with its channel.
#[async_trait]
pub(crate) trait Listener: Send + Sync + 'static {
    /// What the subscription is for, in logs.
    fn name(&self) -> &'static str;

    /// After each (re)subscription: deliver what was published while nobody
    /// listened.
    async fn resync(&self) -> Result<(), StoreError>;

    /// One message of the channel.
    fn deliver(&self, payload: &[u8]);

    /// Whether the subscription is live now.
    fn live(&self, _live: bool) {}
}

/// Keeps `listener` subscribed to `channels` until the returned sender is
/// dropped or used; `reconnect_delay` between attempts. On a single Redis, one
/// SUBSCRIBE connection; on a cluster, sharded pub/sub ([`subscribe_sharded`]):
/// each channel must hash to the slot its publishing script runs in.
pub(crate) fn spawn<L: Listener>(
    pool: &Pool,
    channels: Vec<String>,
    listener: Arc<L>,
    reconnect_delay: Duration,
) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel::<()>();
    let pool = pool.clone();
    tokio::spawn(async move {
        let run = async {
            match &pool {
                Pool::Single(p) => {
                    let client = p.manager().client().clone();
                    subscribe(client, channels, listener, reconnect_delay).await
                }
                Pool::Cluster(c) => subscribe_sharded(c, channels, listener, reconnect_delay).await,
            }
        };
        tokio::select! {
            () = run => {}
            _ = stopped => {}
        }
    });
    stop
}

async fn subscribe<L: Listener>(
    client: redis::Client,
    channels: Vec<String>,
    listener: Arc<L>,
    reconnect_delay: Duration,
) {
    let name = listener.name();
    loop {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.subscribe(&channels).await {
                Ok(()) => {
                    listener.live(true);
                    let resync = async {
                        resync_until_ok(&*listener).await;
                        std::future::pending::<()>().await;
                    };
                    let listen = async {
                        let mut messages = pubsub.on_message();
                        while let Some(msg) = messages.next().await {
                            listener.deliver(msg.get_payload_bytes());
                        }
                    };
                    // The subscription ending ends the re-check too.
                    tokio::select! {
                        () = listen => {}
                        () = resync => {}
                    }
                    listener.live(false);
                    tracing::warn!(subscription = name, "subscription lost; re-subscribing");
                }
                Err(e) => tracing::warn!(error = %e, subscription = name, "cannot subscribe"),
            },
            Err(e) => {
                tracing::warn!(error = %e, subscription = name, "cannot open the subscription")
            }
        }
        tokio::time::sleep(reconnect_delay).await;
    }
}

/// Runs [`Listener::resync`] until it succeeds, backing off between tries.
async fn resync_until_ok<L: Listener>(listener: &L) {
    let mut backoff = Duration::from_millis(50);
    while let Err(e) = listener.resync().await {
        tracing::warn!(error = %e, ?backoff, subscription = listener.name(), "re-check after subscribing failed; retrying");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// How long subscription confirmations are gathered before the one re-check
/// that follows them: a reconnection confirms every channel at once.
const DEBOUNCE: Duration = Duration::from_millis(20);

/// The longest pause between two attempts to subscribe a channel whose
/// subscription is not confirmed.
const MAX_RETRY: Duration = Duration::from_secs(1);

/// Sharded pub/sub on a Redis Cluster: SSUBSCRIBE to each channel on the node
/// that owns its slot, through a cluster client of its own
/// ([`ClusterPool::subscriber`]). redis-rs keeps the subscriptions and makes
/// them again after a disconnection or a topology change (a MOVED, a
/// failover), each on its slot's new owner, and the server confirms each
/// with an `ssubscribe` push: every confirmation is a re-subscription, so it
/// is followed by a re-check ([`Listener::resync`], once for a burst of
/// them). A disconnection, or a server that drops a channel (its slot moved
/// away), makes the subscription not live until every channel is confirmed
/// again; meanwhile the unconfirmed channels are subscribed again every
/// `reconnect_delay` (backing off to [`MAX_RETRY`]): a node that died takes
/// its subscriptions with it, and only a command makes redis-rs look for the
/// slot's new owner.
async fn subscribe_sharded<L: Listener>(
    cluster: &ClusterPool,
    channels: Vec<String>,
    listener: Arc<L>,
    reconnect_delay: Duration,
) {
    let name = listener.name();
    loop {
        let (tx, rx) = mpsc::unbounded_channel();
        let connect = async {
            let client = cluster.subscriber(tx)?;
            client.get_async_connection().await
        };
        match tokio::time::timeout(cluster.timeout(), connect).await {
            Ok(Ok(conn)) => {
                let session = Session {
                    channels: &channels,
                    listener: &*listener,
                    timeout: cluster.timeout(),
                    reconnect_delay,
                };
                session.run(conn, rx).await;
                tracing::warn!(
                    subscription = name,
                    "sharded subscription closed; opening it again"
                );
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, subscription = name, "cannot open the sharded subscription")
            }
            Err(_) => tracing::warn!(
                subscription = name,
                "cannot open the sharded subscription: no answer"
            ),
        }
        listener.live(false);
        tokio::time::sleep(reconnect_delay).await;
    }
}

struct Session<'a, L> {
    channels: &'a [String],
    listener: &'a L,
    timeout: Duration,
    reconnect_delay: Duration,
}

impl<L: Listener> Session<'_, L> {
    /// Until the connection's pushes end (redis-rs dropped the connection).
    async fn run(
        &self,
        conn: redis::cluster_async::ClusterConnection,
        mut pushes: mpsc::UnboundedReceiver<PushInfo>,
    ) {
        let name = self.listener.name();
        if self.channels.is_empty() {
            self.listener.live(true);
        }
        // The channels the server confirmed since the last disconnection.
        let confirmed: Mutex<HashSet<Vec<u8>>> = Mutex::default();
        // A channel lost its subscription.
        let lost = Notify::new();
        // Bumped by every confirmation; made before the tasks below run, so
        // that none is missed.
        let (confirmations, mut confirmed_rx) = watch::channel(0u64);
        let is_complete = |confirmed: &HashSet<Vec<u8>>| {
            self.channels
                .iter()
                .all(|c| confirmed.contains(c.as_bytes()))
        };

        let listen = async {
            while let Some(push) = pushes.recv().await {
                match push.kind {
                    PushKind::SMessage => match push.data.get(1) {
                        Some(Value::BulkString(payload)) => self.listener.deliver(payload),
                        other => tracing::warn!(?other, subscription = name, "malformed message"),
                    },
                    PushKind::SSubscribe => {
                        let complete = {
                            let mut c = lock(&confirmed);
                            if let Some(Value::BulkString(channel)) = push.data.first() {
                                c.insert(channel.clone());
                            }
                            is_complete(&c)
                        };
                        if complete {
                            self.listener.live(true);
                        }
                        confirmations.send_modify(|n| *n += 1);
                    }
                    PushKind::SUnsubscribe => {
                        if let Some(Value::BulkString(channel)) = push.data.first() {
                            lock(&confirmed).remove(channel);
                        }
                        self.listener.live(false);
                        tracing::warn!(subscription = name, "a channel was unsubscribed by the server (its slot moved); subscribing again");
                        lost.notify_one();
                    }
                    PushKind::Disconnection => {
                        lock(&confirmed).clear();
                        self.listener.live(false);
                        tracing::warn!(
                            subscription = name,
                            "a node of the subscription disconnected; re-subscribing"
                        );
                        lost.notify_one();
                    }
                    _ => {}
                }
            }
        };

        // Subscribes the channels not confirmed, until all are.
        let subscribe = async {
            let mut delay = self.reconnect_delay;
            loop {
                let missing: Vec<&String> = {
                    let c = lock(&confirmed);
                    self.channels
                        .iter()
                        .filter(|ch| !c.contains(ch.as_bytes()))
                        .collect()
                };
                if missing.is_empty() {
                    lost.notified().await;
                    delay = self.reconnect_delay;
                    continue;
                }
                for channel in missing {
                    let mut conn = conn.clone();
                    match tokio::time::timeout(self.timeout, conn.ssubscribe(channel)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, subscription = name, channel, "cannot subscribe")
                        }
                        Err(_) => {
                            tracing::warn!(
                                subscription = name,
                                channel,
                                "cannot subscribe: no answer"
                            )
                        }
                    }
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RETRY);
            }
        };

        // One re-check after each burst of confirmations; a confirmation that
        // comes during a re-check is followed by another.
        let resync = async {
            while confirmed_rx.changed().await.is_ok() {
                tokio::time::sleep(DEBOUNCE).await;
                confirmed_rx.borrow_and_update();
                resync_until_ok(self.listener).await;
            }
        };

        tokio::select! {
            () = listen => {}
            () = subscribe => {}
            () = resync => {}
        }
        self.listener.live(false);
    }
}
