//! Waiters notified over Redis pub/sub, on one server.
//!
//! The channel of a record is its key (channels and keys are separate namespaces in Redis).
//! A waiter subscribes to it on the store's one subscribing connection, shared by all of
//! the store's waiters, before it looks at the record once more; `complete.lua`,
//! `release.lua` and `apply.lua` publish on it after their write, and only when
//! `PUBSUB NUMSUB` counts a subscriber, so a completion nobody waits for costs one
//! dictionary lookup in the script and nothing is published or replicated.
//!
//! Redis Cluster is polled instead: a `PUBLISH` there is broadcast to every node, and
//! `PUBSUB NUMSUB` counts only the node's own subscribers (sharded pub/sub would fit, but
//! redis-rs's cluster client offers it only over RESP3 push messages; not used yet).
//!
//! A lost subscribing connection is made again, its channels subscribed again, and every
//! waiter woken (a notification may have been lost meanwhile); while it is down, waiters
//! fall back to polling ([`idem_core::Config::safety_poll`]).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use idem_core::{Watch, Watchers};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{mpsc, watch, Mutex};

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

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifier")
            .field("watchers", &self.watchers)
            .finish_non_exhaustive()
    }
}

impl Notifier {
    /// A notifier on `client`'s server, and its task that unsubscribes idle channels. Must
    /// run inside a Tokio runtime.
    pub(crate) fn start(client: redis::Client, timeout: Duration) -> Arc<Self> {
        let (idle_tx, mut idle_rx) = mpsc::unbounded_channel::<String>();
        let notifier = Arc::new(Self {
            client,
            watchers: Watchers::with_on_idle(move |channel: &String| {
                // The task may be gone with the store: then there is nothing to undo.
                let _ = idle_tx.send(channel.clone());
            }),
            sink: Mutex::new(None),
            generation: AtomicU64::new(0),
            timeout,
            alive: watch::channel(()).0,
        });
        let weak = Arc::downgrade(&notifier);
        tokio::spawn(async move {
            // Ends when the last watch and the notifier are gone (the sender lives in the
            // registry they share).
            while let Some(channel) = idle_rx.recv().await {
                let Some(notifier) = weak.upgrade() else {
                    break;
                };
                notifier.unsubscribe_if_idle(&channel).await;
            }
        });
        notifier
    }

    /// A watch on `channel`, subscribed on the server when this returns; `None` when the
    /// server cannot be reached or does not confirm in time (the caller polls).
    pub(crate) async fn watch(self: &Arc<Self>, channel: String) -> Option<Watch> {
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
        match tokio::time::timeout(self.timeout, connection.subscribe(&channel)).await {
            Ok(Ok(())) => Some(watch),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "redis: subscribe failed; the waiter polls");
                None
            }
            Err(_) => {
                tracing::debug!("redis: subscribe not confirmed in time; the waiter polls");
                None
            }
        }
    }

    async fn unsubscribe_if_idle(&self, channel: &String) {
        let mut sink = self.sink.lock().await;
        if self.watchers.is_watched(channel) {
            return;
        }
        if let Some((_, connection)) = sink.as_mut() {
            // Best effort: a channel left subscribed only costs a message nobody reads.
            let _ = tokio::time::timeout(self.timeout, connection.unsubscribe(channel)).await;
        }
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
