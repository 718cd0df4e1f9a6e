//! The optional background task that deletes expired records.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::store::PgStore;

/// Settings of the purge task. Every field has a documented default.
#[derive(Debug, Clone, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct PurgeConfig {
    /// The pause between two rounds. Default: 60 s.
    pub interval: Duration,
    /// Records deleted per statement; each batch is its own short transaction, so row locks
    /// and WAL per statement stay bounded. Default: 1000 (0 counts as 1).
    pub batch: u32,
    /// Batches per round at most, so one round's work is bounded even when a backlog built
    /// up; the rest waits for the next round. Default: 100.
    pub max_batches: u32,
}

impl Default for PurgeConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            batch: 1000,
            max_batches: 100,
        }
    }
}

/// The handle of a running purge task (see [`PgStore::spawn_purge`]).
///
/// [`PurgeHandle::shutdown`] stops it and waits until it has stopped. Dropping the handle
/// also stops it, at its next pause or batch, without waiting.
#[derive(Debug)]
pub struct PurgeHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl PurgeHandle {
    /// Stops the task and waits for it to end. A batch being deleted when this is called is
    /// abandoned (PostgreSQL rolls that statement back whole); nothing is left half done.
    pub async fn shutdown(self) {
        // Ignored error: the task already ended and dropped its receiver.
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }

    /// Whether the task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl PgStore {
    /// Spawns a task that calls [`PgStore::purge_expired`] every `config.interval`: each
    /// round deletes batches of `config.batch` records until one comes back short (nothing
    /// left) or `config.max_batches` were deleted. A failed batch (database down) is logged
    /// with `tracing` and the round ends; the next round tries again.
    ///
    /// The first round starts at once. Run one per deployment or one per instance: batches
    /// skip rows that another purge holds, so concurrent tasks share the work without
    /// waiting on each other.
    ///
    /// ```no_run
    /// # async fn run(store: idem_postgres::PgStore) {
    /// use idem_postgres::PurgeConfig;
    ///
    /// let purge = store.spawn_purge(PurgeConfig::default());
    /// // ... serve ...
    /// purge.shutdown().await;
    /// # }
    /// ```
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, like `tokio::spawn`.
    pub fn spawn_purge(&self, config: PurgeConfig) -> PurgeHandle {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(self.clone(), config, stopped));
        PurgeHandle { stop, task }
    }
}

/// The task's loop. Every `await` is raced against the stop signal, so a shutdown never
/// waits for a pause or a slow batch to finish.
async fn run(store: PgStore, config: PurgeConfig, mut stopped: watch::Receiver<bool>) {
    let batch = config.batch.max(1);
    loop {
        // One round: batches until a short one says nothing expired is left.
        for _ in 0..config.max_batches {
            let purged = tokio::select! {
                // Checked first, so a stop requested during a long run of batches wins
                // over starting the next one.
                biased;
                _ = stop_requested(&mut stopped) => return,
                purged = store.purge_expired(batch) => purged,
            };
            match purged {
                Ok(n) if n < u64::from(batch) => break,
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, schema = store.schema(), "idem purge failed; retrying next round");
                    break;
                }
            }
        }
        tokio::select! {
            biased;
            _ = stop_requested(&mut stopped) => return,
            _ = tokio::time::sleep(config.interval) => {}
        }
    }
}

/// Resolves once a stop was sent or the handle was dropped.
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    // `wait_for` returns at once if the value is already true; an error means the sender
    // (the handle) is gone, which stops the task too.
    let _ = stopped.wait_for(|stop| *stop).await;
}
