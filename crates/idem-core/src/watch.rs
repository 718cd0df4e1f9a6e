//! Notifications for waiters: a [`Watch`] is what [`Store::watch`](crate::Store::watch)
//! hands out, and [`Watchers`] is the registry a store builds its watches with.
//!
//! How a waiter uses it: [`crate::Idem::begin`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use idem_core::Watchers;
//!
//! let watchers: Watchers<String> = Watchers::new();
//! let mut watch = watchers.watch("order-42".to_owned());
//! assert!(watchers.notify(&"order-42".to_owned()));
//! watch.changed().await; // returns at once: a notification came after the watch was made
//! drop(watch);
//! assert!(!watchers.notify(&"order-42".to_owned())); // nobody watches any more
//! # }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::{poll_fn, Future};
use std::hash::Hash;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;

use tokio::sync::watch;

/// A registration for news of one record: [`Watch::changed`] returns when the record may have
/// settled (completed, released, evicted) since the watch was made, or since the last call
/// returned. Dropping the watch ends the registration.
///
/// A watch may fire without a change (the caller looks and waits again), and may miss one
/// (a notification lost with a connection): callers keep polling at a coarse interval.
pub struct Watch {
    sources: Vec<Source>,
}

/// One registration: its receiver, then what unregisters it when dropped. Fields drop in
/// order, so the receiver is gone when the registration checks whether it was the last.
struct Source {
    rx: watch::Receiver<()>,
    _registration: Box<dyn Send + Sync>,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("sources", &self.sources.len())
            .finish()
    }
}

impl Watch {
    /// A watch on a channel of [`tokio::sync::watch`]: it fires on every value sent after
    /// it was made (a store with its own registry). `registration` is dropped with the watch,
    /// after the receiver: put the unregistering there.
    pub fn from_receiver(
        mut rx: watch::Receiver<()>,
        registration: impl Send + Sync + 'static,
    ) -> Self {
        // Only what is sent from now on counts.
        rx.mark_unchanged();
        Self {
            sources: vec![Source {
                rx,
                _registration: Box::new(registration),
            }],
        }
    }

    /// One watch that fires when any of `watches` does (a store over several others, such
    /// as a tiered store watching both its tiers). `None` when there is none.
    pub fn any(watches: impl IntoIterator<Item = Watch>) -> Option<Watch> {
        let sources: Vec<Source> = watches.into_iter().flat_map(|w| w.sources).collect();
        (!sources.is_empty()).then_some(Watch { sources })
    }

    /// Returns when a notification came since the watch was made or since the last call
    /// returned. A source whose sender is gone never fires again (the caller's safety-net
    /// poll takes over). Cancel safe: dropping the future loses nothing.
    pub async fn changed(&mut self) {
        let mut pending: Vec<Pin<Box<dyn Future<Output = bool> + Send + '_>>> = self
            .sources
            .iter_mut()
            .map(|s| {
                Box::pin(async { s.rx.changed().await.is_ok() })
                    as Pin<Box<dyn Future<Output = bool> + Send + '_>>
            })
            .collect();
        poll_fn(|cx| {
            let mut i = 0;
            while i < pending.len() {
                match pending[i].as_mut().poll(cx) {
                    Poll::Ready(true) => return Poll::Ready(()),
                    // The sender is gone: this source is silent from now on.
                    Poll::Ready(false) => {
                        drop(pending.swap_remove(i));
                        continue;
                    }
                    Poll::Pending => {}
                }
                i += 1;
            }
            // Every source closed: never ready (the caller's timer decides).
            Poll::Pending
        })
        .await
    }
}

/// A registry of watches by key, for stores that deliver notifications themselves (in
/// process, or from a pub/sub listener). Cheap to clone: clones share the registry.
///
/// [`Watchers::notify`] costs one atomic load while nobody watches anything, so a store may
/// call it on every completion.
pub struct Watchers<K> {
    shared: Arc<Shared<K>>,
}

struct Shared<K> {
    senders: Mutex<HashMap<K, watch::Sender<()>>>,
    /// Keys with at least one watch: lets `notify` skip the lock when it is zero.
    watched: AtomicUsize,
    on_idle: Option<OnIdle<K>>,
}

/// What runs when the last watch on a key is dropped.
type OnIdle<K> = Box<dyn Fn(&K) + Send + Sync>;

impl<K> Clone for Watchers<K> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<K> fmt::Debug for Watchers<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watchers")
            .field("watched", &self.shared.watched.load(Ordering::Relaxed))
            .finish()
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Default for Watchers<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Watchers<K> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::build(None)
    }

    /// An empty registry that calls `on_idle` with a key when the last watch on it is
    /// dropped (a pub/sub listener unsubscribes there). It runs on the thread dropping the
    /// watch, outside the registry's lock: keep it short and non-blocking.
    pub fn with_on_idle(on_idle: impl Fn(&K) + Send + Sync + 'static) -> Self {
        Self::build(Some(Box::new(on_idle)))
    }

    fn build(on_idle: Option<OnIdle<K>>) -> Self {
        Self {
            shared: Arc::new(Shared {
                senders: Mutex::default(),
                watched: AtomicUsize::new(0),
                on_idle,
            }),
        }
    }

    /// A new watch on `key`, registered when this returns.
    pub fn watch(&self, key: K) -> Watch {
        let rx = {
            let mut senders = self.shared.lock();
            match senders.get(&key) {
                Some(tx) => tx.subscribe(),
                None => {
                    let (tx, rx) = watch::channel(());
                    senders.insert(key.clone(), tx);
                    self.shared.watched.fetch_add(1, Ordering::SeqCst);
                    rx
                }
            }
        };
        Watch::from_receiver(
            rx,
            Registration {
                key,
                shared: self.shared.clone(),
            },
        )
    }

    /// Fires every watch on `key`; returns whether there was one.
    pub fn notify(&self, key: &K) -> bool {
        // The common case, nobody waiting anywhere: one atomic load. A watcher registers
        // (and counts itself) before it looks at the record, so a settle it does not see
        // happens after this count is non-zero.
        if self.shared.watched.load(Ordering::SeqCst) == 0 {
            return false;
        }
        match self.shared.lock().get(key) {
            Some(tx) => {
                tx.send_replace(());
                true
            }
            None => false,
        }
    }

    /// Fires every watch (after a listener reconnected: notifications may have been lost).
    pub fn notify_all(&self) {
        for tx in self.shared.lock().values() {
            tx.send_replace(());
        }
    }

    /// Whether `key` has a watch now.
    pub fn is_watched(&self, key: &K) -> bool {
        self.shared.lock().contains_key(key)
    }

    /// The keys watched now.
    pub fn keys(&self) -> Vec<K> {
        self.shared.lock().keys().cloned().collect()
    }
}

impl<K> Shared<K> {
    /// Every update leaves the map consistent, so a poisoned lock is still sound.
    fn lock(&self) -> MutexGuard<'_, HashMap<K, watch::Sender<()>>> {
        self.senders.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Unregisters a watch when dropped: the last one on a key removes the key.
struct Registration<K: Hash + Eq> {
    key: K,
    shared: Arc<Shared<K>>,
}

impl<K: Hash + Eq> Drop for Registration<K> {
    fn drop(&mut self) {
        let idle = {
            let mut senders = self.shared.lock();
            // The receiver was dropped just before this: none left means this was the last.
            let last = senders
                .get(&self.key)
                .is_some_and(|tx| tx.receiver_count() == 0);
            if last {
                senders.remove(&self.key);
                self.shared.watched.fetch_sub(1, Ordering::SeqCst);
            }
            last
        };
        if idle {
            if let Some(on_idle) = &self.shared.on_idle {
                on_idle(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;

    async fn fires(watch: &mut Watch) -> bool {
        tokio::time::timeout(Duration::from_millis(50), watch.changed())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn fires_once_per_notification_and_unregisters() {
        let idle = Arc::new(AtomicUsize::new(0));
        let counted = idle.clone();
        let watchers = Watchers::with_on_idle(move |_: &u32| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        let mut a = watchers.watch(1);
        let mut b = watchers.watch(1);
        let mut other = watchers.watch(2);
        assert!(!fires(&mut a).await, "fired before any notification");
        assert!(watchers.notify(&1));
        assert!(fires(&mut a).await);
        assert!(fires(&mut b).await);
        assert!(!fires(&mut other).await, "another key's watch fired");
        // Seen once: no second firing without a second notification.
        assert!(!fires(&mut a).await);
        drop(a);
        assert_eq!(idle.load(Ordering::SeqCst), 0, "idle while a watch remains");
        drop(b);
        assert_eq!(idle.load(Ordering::SeqCst), 1);
        assert!(!watchers.notify(&1));
        assert!(watchers.is_watched(&2));
        drop(other);
        assert!(watchers.keys().is_empty());
        assert_eq!(watchers.shared.watched.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn any_fires_on_either() {
        let left: Watchers<u8> = Watchers::new();
        let right: Watchers<u8> = Watchers::new();
        let mut both = Watch::any([left.watch(0), right.watch(0)]).unwrap();
        assert!(!fires(&mut both).await);
        right.notify(&0);
        assert!(fires(&mut both).await);
        left.notify(&0);
        assert!(fires(&mut both).await);
        assert!(Watch::any([]).is_none());
    }
}
