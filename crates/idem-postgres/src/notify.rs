//! Waiters notified with PostgreSQL's `LISTEN` / `NOTIFY`, when turned on with
//! [`crate::PgStore::with_notify`] (off by default: what it costs is said there).
//!
//! `complete.sql` and `release.sql` call `pg_notify('idem_settled', <record>)` for the row
//! they change, in the same statement, so the notification is sent when (and only if) the
//! transaction commits: a completion made with [`crate::PgStore::complete_in`] in a
//! business transaction wakes waiters at its commit, never before. The payload names the
//! record as `<KeyHash> <schema>` (the key's hash as logs show it, then the store's schema);
//! two records sharing a hash only wake each other's waiters for nothing.
//!
//! Each store (and its clones) has one listening connection of its own (outside the pool),
//! made on the first wait and shared by all its waiters; sqlx's `PgListener` makes it again
//! when it is lost, and every waiter is then woken (a notification may have been lost).
//! While it is down, waiters poll ([`idem_core::Config::safety_poll`]).

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

use idem_core::telemetry::KeyHash;
use idem_core::{RecordId, Watch, Watchers};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::{oneshot, watch};

/// The channel of every store's notifications.
pub const CHANNEL: &str = "idem_settled";

/// The payload naming `id` in `schema`: what the statements send and waiters wait for.
pub(crate) fn payload(schema: &str, id: &RecordId) -> String {
    format!("{} {schema}", KeyHash::of(id))
}

/// The listening side of a [`crate::PgStore`], shared by its clones.
pub(crate) struct Notifier {
    watchers: Watchers<String>,
    /// Whether the listener is connected and listening; set by its task.
    up: watch::Sender<bool>,
    /// The listener's task, started on the first wait; it stops when this is dropped.
    stop: OnceLock<oneshot::Sender<()>>,
}

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifier")
            .field("up", &*self.up.borrow())
            .field("watchers", &self.watchers)
            .finish()
    }
}

impl Notifier {
    pub(crate) fn new() -> Self {
        Self {
            watchers: Watchers::new(),
            up: watch::channel(false).0,
            stop: OnceLock::new(),
        }
    }

    /// A watch on `payload`, once the listener listens (started here on the first call);
    /// `None` when it is not listening within `wait` (the caller polls).
    pub(crate) async fn watch(
        &self,
        pool: &PgPool,
        payload: String,
        wait: Duration,
    ) -> Option<Watch> {
        // Registered before the listener is known to listen: whatever it receives from then
        // on reaches this watch.
        let watch = self.watchers.watch(payload);
        self.stop.get_or_init(|| {
            let (stop, stopped) = oneshot::channel();
            tokio::spawn(listen(
                pool.clone(),
                self.watchers.clone(),
                self.up.clone(),
                stopped,
            ));
            stop
        });
        let mut up = self.up.subscribe();
        let listening = tokio::time::timeout(wait, up.wait_for(|up| *up))
            .await
            .is_ok_and(|r| r.is_ok());
        listening.then_some(watch)
    }
}

/// The listener's task: one connection of its own with the pool's settings, `LISTEN`ing
/// on [`CHANNEL`], waking the watchers of each payload, until `stopped`.
async fn listen(
    pool: PgPool,
    watchers: Watchers<String>,
    up: watch::Sender<bool>,
    mut stopped: oneshot::Receiver<()>,
) {
    // A pool of one, so that sqlx's listener can make its connection again; outside the
    // store's pool, whose connections stay for the store's statements.
    let own = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut pause = Duration::from_millis(50);
    let mut listened_before = false;
    loop {
        // Connect and LISTEN; on failure try again, backing off up to a second.
        let connected = async {
            let mut listener = PgListener::connect_with(&own).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = tokio::select! {
            _ = &mut stopped => return,
            connected = connected => match connected {
                Ok(listener) => listener,
                Err(e) => {
                    tracing::debug!(error = %e, "postgres: no LISTEN connection; waiters poll");
                    tokio::select! {
                        _ = &mut stopped => return,
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
        };
        pause = Duration::from_millis(50);
        up.send_replace(true);
        if listened_before {
            // Listening again after a lost connection: waiters may have missed a
            // notification.
            watchers.notify_all();
        }
        listened_before = true;
        loop {
            tokio::select! {
                // The store is gone: stop listening (the connection closes with `own`).
                _ = &mut stopped => return,
                received = listener.try_recv() => match received {
                    Ok(Some(notification)) => {
                        watchers.notify(&notification.payload().to_owned());
                    }
                    // The connection was lost and made again (LISTEN included): wake
                    // everyone, since notifications may have been lost in between.
                    Ok(None) => watchers.notify_all(),
                    Err(e) => {
                        tracing::debug!(error = %e, "postgres: LISTEN connection lost; waiters poll");
                        up.send_replace(false);
                        watchers.notify_all();
                        break;
                    }
                },
            }
        }
    }
}
