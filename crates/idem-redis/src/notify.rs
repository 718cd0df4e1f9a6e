//! Waiters notified over Redis pub/sub: classic pub/sub on one server, sharded pub/sub on
//! Redis Cluster (the crate docs' [Waiters](crate#waiters) say what each sends). Both
//! subscribe on a RESP3 connection of their own, which redis-rs reconnects, and one task
//! reads its pushes (messages, confirmations, disconnections). A lost subscription is made
//! again, and its waiters woken to look at their records; while none holds, waiters fall
//! back to polling ([`idem_core::Config::safety_poll`]).

use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use idem_core::{Watch, Watchers};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind, RedisResult, Value};
use tokio::sync::{mpsc, Mutex};

/// The client of the waiters' subscriptions, made with the store's connection
/// (`connection.rs`), and the receiver of what its servers push.
pub(crate) struct PubSub {
    pub(crate) client: Client,
    pub(crate) pushes: mpsc::UnboundedReceiver<PushInfo>,
}

/// A client speaking RESP3, which redis-rs needs for pub/sub on a multiplexed connection.
pub(crate) enum Client {
    /// One server: classic pub/sub on a connection manager, whose pushes go to the sender.
    One(redis::Client, mpsc::UnboundedSender<PushInfo>),
    /// Redis Cluster: sharded pub/sub on a cluster connection (built with its sender).
    Cluster(ClusterClient),
}

enum Subscriber {
    One(ConnectionManager),
    Cluster(ClusterConnection),
}

/// How a [`crate::RedisStore`]'s waiters are notified: made on the first wait.
pub(crate) struct Waiters {
    client: Client,
    /// Waiters by channel (their record's key).
    watchers: Watchers<String>,
    /// The subscribing connection once made. Every subscribe and unsubscribe goes through
    /// this lock, one at a time, so that unsubscribing a channel whose last waiter left can
    /// never undo the subscribe of a waiter that came since.
    connection: Mutex<Option<Subscriber>>,
    /// Bounds connecting and each subscribe.
    timeout: Duration,
}

impl Waiters {
    /// The waiters' notifier on `pubsub`'s servers, with its two tasks: one reads the pushes,
    /// one unsubscribes each channel whose last waiter left. They end with the notifier.
    /// Must run inside a Tokio runtime.
    pub(crate) fn start(pubsub: PubSub, timeout: Duration) -> Arc<Self> {
        let (idle_tx, mut idle_rx) = mpsc::unbounded_channel::<String>();
        let waiters = Arc::new(Self {
            client: pubsub.client,
            watchers: Watchers::with_on_idle(move |channel: &String| {
                // The task may be gone with the store: then there is nothing to undo.
                let _ = idle_tx.send(channel.clone());
            }),
            connection: Mutex::new(None),
            timeout,
        });
        let weak = Arc::downgrade(&waiters);
        tokio::spawn(async move {
            while let Some(channel) = idle_rx.recv().await {
                let Some(waiters) = weak.upgrade() else {
                    break;
                };
                let mut connection = waiters.connection.lock().await;
                if waiters.watchers.is_watched(&channel) {
                    continue;
                }
                let unsubscribed = async {
                    match connection.as_mut() {
                        Some(Subscriber::One(c)) => c.unsubscribe(&channel).await,
                        Some(Subscriber::Cluster(c)) => c.sunsubscribe(&channel).await,
                        None => RedisResult::Ok(()),
                    }
                };
                // Best effort: a channel left subscribed only costs a message nobody reads.
                let _ = tokio::time::timeout(waiters.timeout, unsubscribed).await;
            }
        });
        tokio::spawn(read_pushes(Arc::downgrade(&waiters), pubsub.pushes));
        waiters
    }

    /// A watch on `channel` (a record's key), subscribed when this returns; `None` when the
    /// servers cannot be reached or do not confirm in time (the caller polls).
    pub(crate) async fn watch(&self, channel: String) -> Option<Watch> {
        // Registered first, so a message that arrives as soon as the subscription holds is
        // delivered to it.
        let watch = self.watchers.watch(channel.clone());
        self.subscribe(&channel).await.then_some(watch)
    }

    /// `SUBSCRIBE` (`SSUBSCRIBE` on a cluster) `channel`, connecting first if needed;
    /// whether the server confirmed it.
    async fn subscribe(&self, channel: &str) -> bool {
        let mut connection = self.connection.lock().await;
        if connection.is_none() {
            let connecting = async {
                match &self.client {
                    Client::One(client, pushes) => {
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(self.timeout))
                            .set_response_timeout(Some(self.timeout))
                            .set_push_sender(pushes.clone());
                        let made = client.get_connection_manager_with_config(config).await;
                        made.map(Subscriber::One)
                    }
                    Client::Cluster(client) => {
                        client.get_async_connection().await.map(Subscriber::Cluster)
                    }
                }
            };
            let made = or_poll(self.timeout, "subscribing connection", connecting).await;
            let Some(made) = made else {
                return false;
            };
            *connection = Some(made);
        }
        let subscribed = async {
            match connection.as_mut() {
                Some(Subscriber::One(c)) => c.subscribe(channel).await,
                Some(Subscriber::Cluster(c)) => c.ssubscribe(channel).await,
                None => Ok(()),
            }
        };
        or_poll(self.timeout, "subscribe", subscribed)
            .await
            .is_some()
    }

    /// Subscribes `channels` again (those still watched), after their node dropped them or
    /// a connection was lost, then wakes their waiters, so that each looks at its record
    /// with its subscription in place. Tries again, backing off up to a second, while
    /// anyone still waits (meanwhile waiters poll).
    async fn resubscribe(&self, channels: Vec<String>) {
        let mut pause = Duration::from_millis(20);
        let mut left = channels;
        loop {
            let mut failed = Vec::new();
            for channel in left {
                if !self.watchers.is_watched(&channel) {
                    continue;
                }
                if self.subscribe(&channel).await {
                    self.watchers.notify(&channel);
                } else {
                    failed.push(channel);
                }
            }
            if failed.is_empty() {
                return;
            }
            left = failed;
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}

/// The channel a push is about (its first element).
fn channel_of(push: &PushInfo) -> Option<String> {
    match push.data.first() {
        Some(Value::BulkString(name)) => Some(String::from_utf8_lossy(name).into_owned()),
        _ => None,
    }
}

/// Reads what the servers push to the subscribing connection: wakes the waiters of each
/// message's channel; subscribes again the watched channels a node dropped (its slot
/// moved) or whose connection was lost. Ends with the notifier.
async fn read_pushes(waiters: Weak<Waiters>, mut pushes: mpsc::UnboundedReceiver<PushInfo>) {
    while let Some(push) = pushes.recv().await {
        let Some(waiters) = waiters.upgrade() else {
            return;
        };
        match push.kind {
            PushKind::Message | PushKind::SMessage => {
                if let Some(channel) = channel_of(&push) {
                    waiters.watchers.notify(&channel);
                }
            }
            // Our own unsubscribes of idle channels are confirmed the same way: those are
            // no longer watched and left alone. A watched one was dropped by its node.
            PushKind::Unsubscribe | PushKind::SUnsubscribe => {
                if let Some(channel) = channel_of(&push) {
                    if waiters.watchers.is_watched(&channel) {
                        tokio::spawn(async move { waiters.resubscribe(vec![channel]).await });
                    }
                }
            }
            // A connection was lost, and with it its subscriptions and maybe a message.
            // redis-rs reconnects (on a cluster it also subscribes again by itself);
            // subscribing every watched channel here makes sure they hold before the
            // waiters look.
            PushKind::Disconnection => {
                let channels = waiters.watchers.keys();
                if !channels.is_empty() {
                    tokio::spawn(async move { waiters.resubscribe(channels).await });
                }
            }
            _ => {}
        }
    }
}

/// Awaits `step` (`what`) of setting up a waiter's notification, for at most `limit`. When
/// it fails or is not confirmed in time, says so at debug level and gives `None`: the
/// waiter then polls, which is slower but misses nothing.
async fn or_poll<T, E: std::fmt::Display>(
    limit: Duration,
    what: &str,
    step: impl Future<Output = Result<T, E>>,
) -> Option<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(Ok(done)) => Some(done),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "redis: {what} failed; the waiter polls");
            None
        }
        Err(_) => {
            tracing::debug!("redis: {what} not confirmed in time; the waiter polls");
            None
        }
    }
}
