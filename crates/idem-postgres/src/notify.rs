//! Waiters notified with PostgreSQL's `LISTEN` / `NOTIFY`, sent only for records someone
//! waits for.
//!
//! **The notification.** `complete.sql` and `release.sql` call
//! `pg_notify('idem_settled', <record>)` for the row they change, in the same statement, so
//! the notification is sent when (and only if) the transaction commits: a completion made
//! with [`crate::PgStore::complete_in`] in a business transaction wakes waiters at its
//! commit, never before. The payload names the record as `<KeyHash> <schema>` (the key's
//! hash as logs show it, then the store's schema); two records sharing a hash only wake
//! each other's waiters for nothing.
//!
//! **Only when someone waits.** PostgreSQL serialises the commits of notifying transactions
//! (a database-wide lock from the notification's queueing until the commit is flushed), so
//! notifying on every completion would halve the completions per second at 16 callers
//! (idem-bench's `wait` phase). A waiter therefore says that it waits with an advisory lock: its store's
//! listening connection holds the session-level **shared** lock
//! `(LOCK_CLASS, hashtext(payload))` while the record has a waiter in that store. The
//! statements notify only when they cannot take the same lock **exclusively**
//! (`pg_try_advisory_xact_lock`, which never waits): a completion nobody waits for takes
//! and frees one lock in memory, and sends nothing.
//!
//! Why no completion is missed: the waiter takes its lock (after its `LISTEN` holds), then
//! looks at the record once more (the engine does, see [`idem_core::Store::watch`]). Locks
//! are not versioned like rows, so either
//! - the completing statement tried its lock after the waiter took the shared one: it
//!   fails, and the notification is sent at the commit, to a connection already listening;
//! - or before: the statement holds the exclusive lock until its transaction ends, so the
//!   waiter's `pg_try_advisory_lock_shared` fails while the completion is uncommitted (the
//!   waiter tries again, 1 ms doubling to 8 ms, for 64 ms, then polls), and succeeds only
//!   after the commit, whose result the waiter's next look then reads. PostgreSQL releases a
//!   transaction's locks after its commit is visible.
//!
//! The lock is per record, not per row version, so it holds across takeovers, releases and
//! new attempts of the same key for as long as anyone waits for it. Why not a flag column
//! on the row, set by the waiter: it would make every waiter write (and flush) a row
//! version, be lost with the row when a release deletes it (another worker's new attempt
//! would then complete unnoticed), and need a migration before the new statements could
//! run at all.
//!
//! Each store (and its clones) has one listening connection of its own (outside the pool),
//! made on the first wait and shared by all its waiters, which also holds their locks (at
//! most [`MAX_WATCHED`] records at once; the waiters of more poll, so that waiters cannot
//! fill PostgreSQL's shared lock table). When it is lost, its locks go with it: the next
//! connection takes them again and wakes every waiter (a notification may have been lost).
//! While it is down, waiters poll ([`idem_core::Config::safety_poll`]).

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use idem_core::telemetry::KeyHash;
use idem_core::{RecordId, Watch, Watchers};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// The channel of every store's notifications.
pub const CHANNEL: &str = "idem_settled";

/// The first key of a waiter's advisory lock (the second is `hashtext(payload)`): `idem` in
/// ASCII. `complete.sql` and `release.sql` spell it as a literal (a unit test checks it).
/// PostgreSQL keeps two-key advisory locks apart from one-key ones, such as the lock sqlx
/// takes while migrating.
pub const LOCK_CLASS: i32 = 0x6964_656d;

/// How many records the waiters of one store (and its clones) hold locks on at once; the
/// waiters of further records poll.
pub const MAX_WATCHED: usize = 256;

/// How long a waiter tries for its lock while a completion of the record is uncommitted
/// (1 ms doubling to [`MAX_BUSY_PAUSE`] between tries) before it polls instead.
const BUSY_FOR: Duration = Duration::from_millis(64);
/// The longest pause between two tries: the waiter reads the committed result at most this
/// long after the commit.
const MAX_BUSY_PAUSE: Duration = Duration::from_millis(8);

/// The payload naming `id` in `schema`: what the statements send and waiters wait for.
pub(crate) fn payload(schema: &str, id: &RecordId) -> String {
    format!("{} {schema}", KeyHash::of(id))
}

/// The listening side of a [`crate::PgStore`], shared by its clones.
pub(crate) struct Notifier {
    watchers: Watchers<String>,
    /// Whether the listener is connected and listening; set by its task.
    up: watch::Sender<bool>,
    /// Requests to the listener's task, which holds the waiters' locks.
    commands: mpsc::UnboundedSender<Command>,
    /// The receiving end of `commands`, until the listener's task takes it.
    unstarted: Mutex<Option<mpsc::UnboundedReceiver<Command>>>,
    /// The listener's task, started on the first wait; it stops when this is dropped.
    stop: OnceLock<oneshot::Sender<()>>,
}

/// What the listener's task is asked to do.
enum Command {
    /// Hold the waiters' lock on a payload, and answer whether it does.
    Hold(String, oneshot::Sender<Held>),
    /// The last watch on a payload was dropped: let its lock go, unless it is watched again.
    Idle(String),
}

/// The answer to [`Command::Hold`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Held: completions of the record notify from now on.
    Yes,
    /// A completion of the record (or of one whose payload shares its hash) holds the lock
    /// exclusively in an uncommitted transaction: try again shortly.
    Busy,
    /// Not held ([`MAX_WATCHED`] reached, or the watch is gone): the waiter polls.
    No,
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
        let (commands, unstarted) = mpsc::unbounded_channel();
        let idle = commands.clone();
        Self {
            watchers: Watchers::with_on_idle(move |payload: &String| {
                // The task may be gone with the store: then its connection, and the lock
                // with it, are gone too.
                let _ = idle.send(Command::Idle(payload.clone()));
            }),
            up: watch::channel(false).0,
            commands,
            unstarted: Mutex::new(Some(unstarted)),
            stop: OnceLock::new(),
        }
    }

    /// A watch on `payload`, once the listener listens (started here on the first call) and
    /// holds the waiters' lock on it; `None` when it is not listening within `wait`, when
    /// the lock cannot be had (the caller polls).
    pub(crate) async fn watch(
        &self,
        pool: &PgPool,
        payload: String,
        wait: Duration,
    ) -> Option<Watch> {
        let deadline = Instant::now() + wait;
        // Registered before the listener is known to listen: whatever it receives from then
        // on reaches this watch.
        let watch = self.watchers.watch(payload.clone());
        self.stop.get_or_init(|| {
            let (stop, stopped) = oneshot::channel();
            let commands = self
                .unstarted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(commands) = commands {
                tokio::spawn(listen(
                    pool.clone(),
                    self.watchers.clone(),
                    self.up.clone(),
                    commands,
                    stopped,
                ));
            }
            stop
        });
        let mut up = self.up.subscribe();
        let listening = tokio::time::timeout_at(deadline, up.wait_for(|up| *up))
            .await
            .is_ok_and(|r| r.is_ok());
        if !listening {
            return None;
        }
        let mut pause = Duration::from_millis(1);
        let busy_until = Instant::now() + BUSY_FOR;
        loop {
            let (answer, answered) = oneshot::channel();
            self.commands
                .send(Command::Hold(payload.clone(), answer))
                .ok()?;
            match tokio::time::timeout_at(deadline, answered).await {
                Ok(Ok(Held::Yes)) => return Some(watch),
                // A completion is committing: its result is for the next look, once the
                // lock is ours (or for the polling, if it takes too long).
                Ok(Ok(Held::Busy)) if Instant::now() < busy_until => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_BUSY_PAUSE);
                }
                _ => return None,
            }
        }
    }
}

/// Takes the waiters' shared lock on a payload, without waiting (see [`on_session`]).
const HOLD: &str = "pg_try_advisory_lock_shared($1, hashtext($2))";

/// Lets the waiters' shared lock on a payload go (see [`on_session`]).
const LET_GO: &str = "pg_advisory_unlock_shared($1, hashtext($2))";

/// Runs the lock function `call` on `payload`, only in the session `pid` that holds the
/// waiters' locks. sqlx's listener makes a lost connection again by itself on the next
/// statement, and a new session holds none of the locks: an unlock there would make
/// PostgreSQL warn "you don't own a lock of type ShareLock", and a lock taken there would
/// sit beside locks that are gone. So the call is skipped and the answer is `None`, which
/// the caller takes as the connection lost.
async fn on_session(
    listener: &mut PgListener,
    pid: i32,
    call: &str,
    payload: &str,
) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT CASE WHEN pg_backend_pid() = $3 THEN {call} END"
    ))
    .bind(LOCK_CLASS)
    .bind(payload)
    .bind(pid)
    .fetch_one(listener)
    .await
}

/// Why [`serve`] returned.
enum Ended {
    /// The store is gone.
    Stopped,
    /// The connection was lost (its locks with it).
    Lost(Option<sqlx::Error>),
}

/// The listener's task: one connection of its own with the pool's settings, `LISTEN`ing
/// on [`CHANNEL`] and holding the waiters' locks, waking the watchers of each payload,
/// until `stopped`.
async fn listen(
    pool: PgPool,
    watchers: Watchers<String>,
    up: watch::Sender<bool>,
    mut commands: mpsc::UnboundedReceiver<Command>,
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
    let mut again = false;
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
        let served = serve(
            &mut listener,
            &watchers,
            &up,
            &mut commands,
            &mut stopped,
            again,
        );
        again = true;
        match served.await {
            Ended::Stopped => return,
            Ended::Lost(e) => {
                if let Some(e) = e {
                    tracing::debug!(error = %e, "postgres: LISTEN connection lost; waiters poll");
                }
                up.send_replace(false);
                // Wake everyone: notifications may have been lost, and until the next
                // connection holds their locks again, completions do not notify.
                watchers.notify_all();
            }
        }
    }
}

/// Serves one listening connection: takes the locks of the records watched now (and wakes
/// their waiters when this connection replaces a lost one), then answers the commands and
/// delivers the notifications until the connection is lost or the store is gone.
async fn serve(
    listener: &mut PgListener,
    watchers: &Watchers<String>,
    up: &watch::Sender<bool>,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    stopped: &mut oneshot::Receiver<()>,
    again: bool,
) -> Ended {
    // The session the locks below are taken in.
    let pid: i32 = match sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *listener)
        .await
    {
        Ok(pid) => pid,
        Err(e) => return Ended::Lost(Some(e)),
    };
    // The payloads whose lock this connection holds (once each).
    let mut held: HashSet<String> = HashSet::new();
    // Waiters from before a lost connection: their locks went with it. Take them again, then
    // wake them, so that each looks at its record with its lock held (or polls).
    let before = watchers.keys();
    for payload in &before {
        if held.len() >= MAX_WATCHED {
            break;
        }
        match on_session(listener, pid, HOLD, payload).await {
            Ok(Some(true)) => {
                held.insert(payload.clone());
            }
            Ok(Some(false)) => {}
            Ok(None) => return Ended::Lost(None),
            Err(e) => return Ended::Lost(Some(e)),
        }
    }
    up.send_replace(true);
    if again {
        watchers.notify_all();
    }
    loop {
        tokio::select! {
            // The store is gone: stop listening (the connection closes with the pool).
            _ = &mut *stopped => return Ended::Stopped,
            // The notifier holds a sender as long as the store lives.
            command = commands.recv() => match command {
                None => return Ended::Stopped,
                Some(Command::Hold(payload, answer)) => {
                    let answer_is = if held.contains(&payload) {
                        Held::Yes
                    } else if held.len() >= MAX_WATCHED || !watchers.is_watched(&payload) {
                        // Full, or the waiter gave up meanwhile (its Idle follows).
                        Held::No
                    } else {
                        match on_session(listener, pid, HOLD, &payload).await {
                            Ok(Some(true)) => {
                                held.insert(payload);
                                Held::Yes
                            }
                            Ok(Some(false)) => Held::Busy,
                            Ok(None) => return Ended::Lost(None),
                            Err(e) => return Ended::Lost(Some(e)),
                        }
                    };
                    // The waiter may have given up; then its Idle lets the lock go.
                    let _ = answer.send(answer_is);
                }
                Some(Command::Idle(payload)) => {
                    // A waiter that came since the last one left keeps the lock.
                    if !watchers.is_watched(&payload) && held.remove(&payload) {
                        match on_session(listener, pid, LET_GO, &payload).await {
                            Ok(Some(_)) => {}
                            Ok(None) => return Ended::Lost(None),
                            Err(e) => return Ended::Lost(Some(e)),
                        }
                    }
                }
            },
            received = listener.try_recv() => match received {
                Ok(Some(notification)) => {
                    watchers.notify(&notification.payload().to_owned());
                }
                // sqlx made the connection again by itself, on a new session without our
                // locks: start over on a connection of ours.
                Ok(None) => return Ended::Lost(None),
                Err(e) => return Ended::Lost(Some(e)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_statements_test_the_waiters_lock() {
        // The class is a literal in the SQL: it must be the one the listener locks with.
        let lock = format!("pg_try_advisory_xact_lock({LOCK_CLASS}, hashtext(");
        for sql in [
            include_str!("sql/complete.sql"),
            include_str!("sql/release.sql"),
            include_str!("sql/append.sql"),
        ] {
            assert!(sql.contains(&lock), "{sql}");
            assert!(sql.contains(&format!("pg_notify('{CHANNEL}'")), "{sql}");
        }
    }
}
