//! Waiters notified over Redis pub/sub: classic pub/sub on one server, sharded pub/sub on
//! Redis Cluster (the crate docs' [Waiters](crate#waiters) say what each sends). A lost
//! subscription is made again, and its waiters woken to look at their records; while none
//! holds, waiters fall back to polling ([`idem_core::Config::safety_poll`]).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use idem_core::{Watch, Watchers};
use redis::aio::{PubSubSink, PubSubStream};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{mpsc, watch, Mutex};

use crate::connection::PubSub;

/// How a [`crate::RedisStore`]'s waiters are notified.
pub(crate) enum Waiters {
    /// One server: classic pub/sub.
    One(Arc<Notifier>),
    /// Redis Cluster: sharded pub/sub.
    Cluster(Arc<ShardNotifier>),
}

impl Waiters {
    /// The notifier on `pubsub`'s servers, with its tasks (one unsubscribes idle channels;
    /// on a cluster, one reads the nodes' pushes); `timeout` bounds connecting and each
    /// subscribe. Must run inside a Tokio runtime.
    pub(crate) fn start(pubsub: PubSub, timeout: Duration) -> Self {
        match pubsub {
            PubSub::One(client) => Self::One(unsubscribing_idle(|watchers| Notifier {
                client,
                watchers,
                sink: Mutex::new(None),
                generation: AtomicU64::new(0),
                timeout,
                alive: watch::channel(()).0,
            })),
            PubSub::Cluster(client, pushes) => {
                let notifier = unsubscribing_idle(|watchers| ShardNotifier {
                    client,
                    watchers,
                    connection: Mutex::new(None),
                    timeout,
                });
                tokio::spawn(read_pushes(Arc::downgrade(&notifier), pushes));
                Self::Cluster(notifier)
            }
        }
    }

    /// A watch on `channel` (a record's key), subscribed when this returns; `None` when the
    /// servers cannot be reached or do not confirm in time (the caller polls).
    pub(crate) async fn watch(&self, channel: String) -> Option<Watch> {
        match self {
            Self::One(notifier) => notifier.watch(channel).await,
            Self::Cluster(notifier) => notifier.watch(channel).await,
        }
    }
}

/// The subscribing side of a [`crate::RedisStore`] on one server: made on the first wait.
pub(crate) struct Notifier {
    client: redis::Client,
    /// Waiters by channel (their record's key).
    watchers: Watchers<String>,
    /// The subscribing connection while it is up, and its generation. Every subscribe and
    /// unsubscribe goes through this lock, one at a time, so that unsubscribing a channel
    /// whose last waiter left can never undo the subscribe of a waiter that came since.
    sink: Mutex<Option<(u64, PubSubSink)>>,
    generation: AtomicU64,
    /// Bounds connecting and each subscribe.
    timeout: Duration,
    /// Dropped with the notifier, which ends its reader (and closes the connection).
    alive: watch::Sender<()>,
}

impl Notifier {
    /// As [`Waiters::watch`].
    async fn watch(self: &Arc<Self>, channel: String) -> Option<Watch> {
        // Registered first, so a message that arrives as soon as the subscription holds is
        // delivered to it.
        let watch = self.watchers.watch(channel.clone());
        let mut sink = self.sink.lock().await;
        if sink.is_none() {
            let (generation, connection, stream) = self.connect().await?;
            tokio::spawn(read(
                Arc::downgrade(self),
                self.alive.subscribe(),
                generation,
                stream,
            ));
            *sink = Some((generation, connection));
        }
        let (_, connection) = sink.as_mut()?;
        or_poll(self.timeout, "subscribe", connection.subscribe(&channel)).await?;
        Some(watch)
    }

    /// Opens a subscribing connection and subscribes every watched channel on it; the
    /// caller reads its stream. Called with the sink's lock held.
    async fn connect(&self) -> Option<(u64, PubSubSink, PubSubStream)> {
        let connected = tokio::time::timeout(self.timeout, self.client.get_async_pubsub()).await;
        let (mut sink, stream) = match connected {
            Ok(Ok(pubsub)) => pubsub.split(),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "redis: no subscribing connection; waiters poll");
                return None;
            }
            Err(_) => {
                tracing::debug!("redis: subscribing connection timed out; waiters poll");
                return None;
            }
        };
        let channels = self.watchers.keys();
        if !channels.is_empty() {
            let subscribed = tokio::time::timeout(self.timeout, sink.subscribe(&channels)).await;
            if !matches!(subscribed, Ok(Ok(()))) {
                return None;
            }
        }
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        Some((generation, sink, stream))
    }
}

/// Reads the messages of the subscribing connection and wakes the waiters of each channel.
/// When the connection is lost, forgets it and, while anyone waits, makes a new one and
/// reads that (backing off up to a second between tries; meanwhile waiters poll). Ends
/// when nobody waits any more (the next waiter connects), when a newer connection has its
/// own reader, or with the store.
async fn read(
    notifier: Weak<Notifier>,
    mut alive: watch::Receiver<()>,
    mut generation: u64,
    mut stream: PubSubStream,
) {
    loop {
        loop {
            let message = tokio::select! {
                message = stream.next() => message,
                // Nothing is ever sent: this fires when the notifier (the store) is dropped.
                _ = alive.changed() => return,
            };
            // `None`: the connection is lost.
            let Some(message) = message else { break };
            let Some(notifier) = notifier.upgrade() else {
                return;
            };
            notifier
                .watchers
                .notify(&message.get_channel_name().to_owned());
        }
        let mut pause = Duration::from_millis(50);
        loop {
            let Some(notifier) = notifier.upgrade() else {
                return;
            };
            let mut sink = notifier.sink.lock().await;
            if sink.as_ref().is_some_and(|(g, _)| *g != generation) {
                // A newer connection was made meanwhile, with its own reader.
                return;
            }
            *sink = None;
            // Wake the waiters: they look at their records, and poll until a connection
            // is back.
            notifier.watchers.notify_all();
            if notifier.watchers.keys().is_empty() {
                return;
            }
            if let Some((g, connection, next)) = notifier.connect().await {
                *sink = Some((g, connection));
                // Subscribed again: a notification sent in between was lost.
                notifier.watchers.notify_all();
                (generation, stream) = (g, next);
                break;
            }
            drop(sink);
            drop(notifier);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}

/// The subscribing side of a [`crate::RedisStore`] on Redis Cluster: sharded pub/sub on a
/// cluster connection of its own, made on the first wait.
pub(crate) struct ShardNotifier {
    client: ClusterClient,
    /// Waiters by shard channel (their record's key).
    watchers: Watchers<String>,
    /// The subscribing connection once made. Every subscribe and unsubscribe goes through
    /// this lock, one at a time, so that unsubscribing a channel whose last waiter left can
    /// never undo the subscribe of a waiter that came since.
    connection: Mutex<Option<ClusterConnection>>,
    /// Bounds connecting and each subscribe.
    timeout: Duration,
}

impl ShardNotifier {
    /// As [`Waiters::watch`].
    async fn watch(&self, channel: String) -> Option<Watch> {
        // Registered first, so a message that arrives as soon as the subscription holds is
        // delivered to it.
        let watch = self.watchers.watch(channel.clone());
        self.subscribe(&channel).await.then_some(watch)
    }

    /// `SSUBSCRIBE channel`, connecting first if needed; whether the node confirmed it.
    async fn subscribe(&self, channel: &str) -> bool {
        let mut connection = self.connection.lock().await;
        if connection.is_none() {
            let connecting = self.client.get_async_connection();
            let Some(made) =
                or_poll(self.timeout, "subscribing cluster connection", connecting).await
            else {
                return false;
            };
            *connection = Some(made);
        }
        let Some(connection) = connection.as_mut() else {
            return false;
        };
        or_poll(self.timeout, "ssubscribe", connection.ssubscribe(channel))
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

/// The shard channel a push is about (its first element).
fn channel_of(push: &PushInfo) -> Option<String> {
    match push.data.first() {
        Some(Value::BulkString(name)) => Some(String::from_utf8_lossy(name).into_owned()),
        _ => None,
    }
}

/// Reads what the nodes push to the subscribing cluster connection: wakes the waiters of
/// each message's channel; subscribes again the watched channels a node dropped (its slot
/// moved) or whose connection was lost. Ends with the notifier.
async fn read_pushes(notifier: Weak<ShardNotifier>, mut pushes: mpsc::UnboundedReceiver<PushInfo>) {
    while let Some(push) = pushes.recv().await {
        let Some(notifier) = notifier.upgrade() else {
            return;
        };
        match push.kind {
            PushKind::SMessage => {
                if let Some(channel) = channel_of(&push) {
                    notifier.watchers.notify(&channel);
                }
            }
            // Our own unsubscribes of idle channels are confirmed the same way: those are
            // no longer watched and left alone. A watched one was dropped by its node.
            PushKind::SUnsubscribe => {
                if let Some(channel) = channel_of(&push) {
                    if notifier.watchers.is_watched(&channel) {
                        tokio::spawn(async move { notifier.resubscribe(vec![channel]).await });
                    }
                }
            }
            // A node's connection was lost, and with it its subscriptions and maybe a
            // message. redis-rs reconnects and subscribes again by itself; subscribing every
            // watched channel here too makes sure they hold before the waiters look.
            PushKind::Disconnection => {
                let channels = notifier.watchers.keys();
                if !channels.is_empty() {
                    tokio::spawn(async move { notifier.resubscribe(channels).await });
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
    step: impl std::future::Future<Output = Result<T, E>>,
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

/// A notifier's subscriptions, as [`unsubscribing_idle`] needs them.
trait Subscriptions: Send + Sync + 'static {
    /// Unsubscribes `channel` if it is still without waiters.
    fn unsubscribe_if_idle(&self, channel: String) -> impl Future<Output = ()> + Send;
}

impl Subscriptions for Notifier {
    async fn unsubscribe_if_idle(&self, channel: String) {
        let mut sink = self.sink.lock().await;
        if self.watchers.is_watched(&channel) {
            return;
        }
        if let Some((_, connection)) = sink.as_mut() {
            // Best effort: a channel left subscribed only costs a message nobody reads.
            let _ = tokio::time::timeout(self.timeout, connection.unsubscribe(&channel)).await;
        }
    }
}

impl Subscriptions for ShardNotifier {
    async fn unsubscribe_if_idle(&self, channel: String) {
        let mut connection = self.connection.lock().await;
        if self.watchers.is_watched(&channel) {
            return;
        }
        if let Some(connection) = connection.as_mut() {
            // Best effort: a channel left subscribed only costs a message nobody reads.
            let _ = tokio::time::timeout(self.timeout, connection.sunsubscribe(&channel)).await;
        }
    }
}

/// The notifier that `build` makes around a waiters' registry, and its task that
/// unsubscribes each channel whose last waiter left. The task ends when the last watch and
/// the notifier are gone (the sender lives in the registry they share).
fn unsubscribing_idle<N: Subscriptions>(build: impl FnOnce(Watchers<String>) -> N) -> Arc<N> {
    let (idle_tx, mut idle_rx) = mpsc::unbounded_channel::<String>();
    let notifier = Arc::new(build(Watchers::with_on_idle(move |channel: &String| {
        // The task may be gone with the store: then there is nothing to undo.
        let _ = idle_tx.send(channel.clone());
    })));
    let weak = Arc::downgrade(&notifier);
    tokio::spawn(async move {
        while let Some(channel) = idle_rx.recv().await {
            let Some(notifier) = weak.upgrade() else {
                break;
            };
            notifier.unsubscribe_if_idle(channel).await;
        }
    });
    notifier
}
