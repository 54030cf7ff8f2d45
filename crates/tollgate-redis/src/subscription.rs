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

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use tokio::sync::oneshot;
use tollgate_core::error::StoreError;

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

/// Keeps `listener` subscribed to `channel` until the returned sender is
/// dropped or used; `reconnect_delay` between attempts, each on the next of
/// `clients` (a standalone Redis, or the seeds of a cluster: a PUBLISH on any
/// node of a cluster reaches subscribers on every node).
pub(crate) fn spawn<L: Listener>(
    clients: Vec<redis::Client>,
    channel: String,
    listener: Arc<L>,
    reconnect_delay: Duration,
) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            () = subscribe(clients, channel, listener, reconnect_delay) => {}
            _ = stopped => {}
        }
    });
    stop
}

async fn subscribe<L: Listener>(
    clients: Vec<redis::Client>,
    channel: String,
    listener: Arc<L>,
    reconnect_delay: Duration,
) {
    let name = listener.name();
    for client in clients.iter().cycle() {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.subscribe(&channel).await {
                Ok(()) => {
                    listener.live(true);
                    let resync = async {
                        let mut backoff = Duration::from_millis(50);
                        while let Err(e) = listener.resync().await {
                            tracing::warn!(error = %e, ?backoff, subscription = name, "re-check after subscribing failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
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
