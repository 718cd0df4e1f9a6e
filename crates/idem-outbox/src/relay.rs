//! [`Relay`]: the worker that copies committed completions from the outbox table into Redis.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use idem_core::{decode_meta, Completion, Error, FencingToken, Fingerprint, Key, RecordId, Scope};
use idem_postgres::{map_error, PgStore};
use idem_redis::tier::Applied;
use idem_redis::RedisStore;
use sqlx::postgres::{PgListener, PgRow};
use sqlx::Row;
use tokio::time::{sleep, Instant};

use crate::metrics::{Batch, Counters, RelayMetrics};
use crate::outbox::Outbox;
use crate::statements::Statements;
use crate::tiered::CHANNEL;

/// Settings of a [`Relay`]. Every field has a documented default.
#[derive(Debug, Clone, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct RelayConfig {
    /// Outbox rows claimed, applied and deleted per transaction. Default: 500 (0 counts
    /// as 1).
    pub batch: u32,
    /// How often the relay looks for work when no notification came: notifications are
    /// lost while the listening connection reconnects, and rows waiting for a retry are
    /// due without one. Default: 200 ms.
    pub poll_interval: Duration,
    /// Failed applications of one row before it is marked dead. Default: 10 (0 counts
    /// as 1).
    pub max_tries: u32,
    /// The pause before retrying a row after its first failure; it doubles with each
    /// further failure. Default: 1 s.
    pub backoff_base: Duration,
    /// The longest pause between two tries of a row. Default: 60 s.
    pub backoff_cap: Duration,
    /// The longest pause of the whole worker while Redis or PostgreSQL is unavailable
    /// (the pause starts at `poll_interval` and doubles). Default: 5 s.
    pub outage_backoff_cap: Duration,
    /// Backlog, dead count and lag are read from PostgreSQL at most this often by the
    /// worker loop (and on every [`Relay::observe`]). Default: 1 s.
    pub gauge_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch: 500,
            poll_interval: Duration::from_millis(200),
            max_tries: 10,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(60),
            outage_backoff_cap: Duration::from_secs(5),
            gauge_interval: Duration::from_secs(1),
        }
    }
}

impl RelayConfig {
    /// The pause before the next try of a row that has failed `tries` times before this
    /// failure: `backoff_base * 2^tries`, at most `backoff_cap`.
    pub fn backoff(&self, tries: u32) -> Duration {
        let factor = 2u32.saturating_pow(tries.min(31));
        self.backoff_base
            .saturating_mul(factor)
            .min(self.backoff_cap)
    }
}

/// The relay worker: claims batches of outbox rows with `FOR UPDATE SKIP LOCKED`, applies
/// each to Redis ([`idem_redis::tier::Tier::apply_completion`], idempotent and never overwriting a
/// newer state) and deletes them, in one transaction per batch.
///
/// Run any number of relays on one outbox: each batch skips the rows another relay holds.
/// Delivery is at least once (a relay killed after applying a batch but before committing
/// leaves the rows for the next one, which applies them again, harmlessly).
///
/// A row that fails on its own (a record that does not decode, Redis refusing it) is retried
/// with exponential backoff and marked dead after [`RelayConfig::max_tries`]; operators list
/// and retry dead rows with [`Outbox::dead_entries`] and [`Outbox::retry_dead`]. Redis (or
/// PostgreSQL) being unavailable is not the row's fault: the batch is rolled back untouched
/// and the whole worker backs off, so an outage grows the backlog and never kills rows.
///
/// Cheap to clone: clones share the connections and the metrics.
///
/// ```no_run
/// # async fn example() -> Result<(), idem_core::Error> {
/// use idem_outbox::{Relay, RelayConfig};
/// use idem_postgres::PgStore;
/// use idem_redis::RedisStore;
///
/// let pg = PgStore::connect("postgres://app@127.0.0.1/app").await?;
/// idem_outbox::migrate(&pg).await?;
/// let redis = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let relay = Relay::new(pg, redis).with_config(RelayConfig::default());
/// // Runs until `stop` is notified (from a signal handler, say), then finishes the batch
/// // in hand and returns.
/// let stop = std::sync::Arc::new(tokio::sync::Notify::new());
/// let worker = tokio::spawn({
///     let stop = stop.clone();
///     async move { relay.run(stop.notified()).await }
/// });
/// // ... later:
/// stop.notify_one();
/// worker.await.expect("the relay task");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Relay {
    outbox: Outbox,
    pg: PgStore,
    redis: RedisStore,
    config: Arc<RelayConfig>,
    sql: Arc<Statements>,
    counters: Arc<Counters>,
}

/// One claimed row.
struct Claimed {
    id: i64,
    tries: u32,
    /// The decoded entry, or why it does not decode; `None` when the record expired.
    entry: Option<Result<Entry, Error>>,
}

/// A claimed row, decoded and ready to apply.
struct Entry {
    record: RecordId,
    fingerprint: Fingerprint,
    token: FencingToken,
    attempt: u32,
    completion: Completion,
    ttl: Duration,
}

/// What applying one row came to.
enum Outcome {
    /// Applied (written, or nothing left to do): delete the row.
    Done(Applied),
    /// The record had expired: delete the row.
    Expired,
    /// This row failed: count a try.
    Failed(String),
    /// Redis cannot hold this completion whole (over its body limit): it is replayed from
    /// PostgreSQL, and the row has nothing to do.
    NotForRedis,
}

impl Relay {
    /// A relay with the default [`RelayConfig`] for the outbox in `pg`'s schema, applying to
    /// `redis`. Run [`crate::migrate`] first.
    pub fn new(pg: PgStore, redis: RedisStore) -> Self {
        let outbox = Outbox::new(pg.clone());
        let counters = Arc::new(Counters::new(pg.schema()));
        Self {
            sql: outbox.sql.clone(),
            outbox,
            pg,
            redis,
            config: Arc::new(RelayConfig::default()),
            counters,
        }
    }

    /// Replaces the settings.
    pub fn with_config(mut self, config: RelayConfig) -> Self {
        self.config = Arc::new(config);
        self
    }

    /// The settings.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// The outbox this relay drains, for its operator functions (dead rows).
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// The schema whose outbox this relay drains.
    pub fn schema(&self) -> &str {
        self.pg.schema()
    }

    /// The counters and the gauges as last read (see [`Relay::observe`] to read them now).
    pub fn metrics(&self) -> RelayMetrics {
        self.counters.snapshot()
    }

    /// Reads the gauges (backlog, dead rows, lag) from PostgreSQL now, stores them, and
    /// returns the metrics. One `count(*)` over the outbox.
    ///
    /// # Errors
    ///
    /// PostgreSQL errors.
    pub async fn observe(&self) -> Result<RelayMetrics, Error> {
        self.counters.gauges(&self.outbox.gauges().await?);
        Ok(self.metrics())
    }

    /// Runs the worker until `shutdown` resolves, then finishes the batch in hand (commits
    /// it) and returns. Errors never end the loop: they are logged with `tracing` and
    /// retried with backoff.
    ///
    /// Wakes on `LISTEN idem_outbox` notifications for this schema, and polls every
    /// [`RelayConfig::poll_interval`] in any case; drains batch after batch while they come
    /// back full.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let schema = self.pg.schema().to_owned();
        self.counters.register();
        tokio::pin!(shutdown);
        // Set once `shutdown` resolved (a finished future must not be polled again).
        let mut stopping = false;
        // The pause after an outage; reset by any batch that commits.
        let mut outage_pause = self.config.poll_interval;
        let mut gauges_read: Option<Instant> = None;

        // Step 1: subscribe before the first batch, so that a row committed between that
        // batch and the first wait still wakes us. Without a listener (PostgreSQL down at
        // start) the relay polls, and tries to subscribe again after each poll.
        let mut listener = self.listen().await;
        tracing::info!(schema = %schema, batch = self.config.batch, listening = listener.is_some(), "idem relay started");

        loop {
            // Step 2: drain. One batch per transaction, as long as they come back full.
            loop {
                let batch = self.relay_batch();
                tokio::pin!(batch);
                let result = tokio::select! {
                    // The batch finished first: the usual case.
                    result = &mut batch => result,
                    // A shutdown signal while the batch runs: do not abandon it (its rows
                    // are claimed, maybe applied), finish it, commit, then stop below.
                    () = &mut shutdown, if !stopping => {
                        tracing::info!(schema = %schema, "idem relay stopping: finishing the batch in hand");
                        stopping = true;
                        batch.await
                    }
                };
                match result {
                    Ok(done) => {
                        outage_pause = self.config.poll_interval;
                        if done.claimed > 0 {
                            tracing::debug!(
                                schema = %schema,
                                claimed = done.claimed,
                                relayed = done.relayed,
                                expired = done.expired,
                                failed = done.failed,
                                dead = done.dead,
                                "idem relay batch committed"
                            );
                        }
                        // A short batch means the due rows are drained (or held by other
                        // relays): go and wait.
                        if stopping || done.claimed < self.batch_size() {
                            break;
                        }
                    }
                    Err(error) => {
                        // Redis or PostgreSQL unavailable (or PostgreSQL failing outright):
                        // the batch was rolled back, its rows are untouched. Pause the whole
                        // worker, doubling up to the cap, instead of burning tries.
                        self.counters.outage();
                        if error.is_retryable() {
                            tracing::warn!(schema = %schema, %error, pause = ?outage_pause, "idem relay: store unavailable, batch rolled back; backing off");
                        } else {
                            tracing::error!(schema = %schema, %error, pause = ?outage_pause, "idem relay: batch failed and rolled back; backing off");
                        }
                        if stopping {
                            break;
                        }
                        tokio::select! {
                            // Shutdown during the pause: nothing is in hand, stop now.
                            () = &mut shutdown => {
                                stopping = true;
                                break;
                            }
                            () = sleep(outage_pause) => {}
                        }
                        outage_pause = (outage_pause * 2).min(self.config.outage_backoff_cap);
                        // Keep the gauges moving during an outage (the backlog grows).
                        self.refresh_gauges(&mut gauges_read).await;
                    }
                }
            }

            // Step 3: a shutdown seen while draining ends the worker, with no batch in hand.
            if stopping {
                tracing::info!(schema = %schema, "idem relay stopped");
                return;
            }

            // Step 4: idle. Refresh the gauges, then wait for a reason to look again.
            self.refresh_gauges(&mut gauges_read).await;
            let poll = sleep(self.config.poll_interval);
            tokio::pin!(poll);
            loop {
                tokio::select! {
                    // Shutdown wins over work that arrives at the same moment.
                    biased;
                    // Shutdown while idle: nothing is in hand, return at once.
                    () = &mut shutdown => {
                        tracing::info!(schema = %schema, "idem relay stopped");
                        return;
                    }
                    // A notification: some transaction committed outbox rows. The channel
                    // is shared by every schema of the database: only ours counts.
                    woke = recv(&mut listener) => match woke {
                        Ok(payload) if payload == schema => break,
                        Ok(_) => continue,
                        Err(error) => {
                            // The listening connection failed and could not reconnect:
                            // drop it and rely on polling until it can be opened again.
                            tracing::warn!(schema = %schema, %error, "idem relay: LISTEN connection lost; polling");
                            listener = None;
                        }
                    },
                    // The poll: notifications may have been lost (reconnects), and rows
                    // waiting for a retry become due without one.
                    () = &mut poll => {
                        if listener.is_none() {
                            listener = self.listen().await;
                        }
                        break;
                    }
                }
            }
        }
    }

    /// Claims one batch of due rows, applies them to Redis, deletes the applied ones and
    /// counts a try on the failed ones, in one transaction. Rows held by other relays are
    /// skipped. [`Relay::run`] calls this in a loop; call it yourself to drain on demand.
    ///
    /// # Errors
    ///
    /// When Redis or PostgreSQL is unavailable (or PostgreSQL fails): the transaction is
    /// rolled back and every row is left as it was.
    pub async fn relay_batch(&self) -> Result<Batch, Error> {
        let mut tx = self.pg.pool().begin().await.map_err(map_error)?;
        // 1. Claim: lock up to `batch` due rows, skipping those other relays hold.
        let rows = sqlx::query(&self.sql.claim)
            .bind(i64::from(self.config.batch.max(1)))
            .fetch_all(&mut *tx)
            .await
            .map_err(map_error)?;
        if rows.is_empty() {
            // Nothing to do; ending the empty transaction either way is harmless.
            tx.commit().await.map_err(map_error)?;
            return Ok(Batch::default());
        }
        let claimed: Vec<Claimed> = rows.iter().map(claim).collect();

        // 2. Apply, all rows at once: the calls share Redis's multiplexed connection, so
        // the batch costs about one round trip. A row that met an unavailable Redis is left
        // as it was (no try counted); if no row got through at all, the whole batch fails
        // (returning drops `tx`, which rolls it back) and the worker backs off.
        let outcomes = join_all(claimed.iter().map(|row| self.apply(row))).await;
        let mut done = Vec::new();
        let mut failed = Vec::new();
        let mut batch = Batch {
            claimed: claimed.len(),
            ..Batch::default()
        };
        let mut unavailable = None;
        for (row, outcome) in claimed.iter().zip(outcomes) {
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(e) => {
                    unavailable = Some(e);
                    continue;
                }
            };
            match outcome {
                Outcome::NotForRedis => {
                    tracing::debug!(
                        schema = self.pg.schema(),
                        id = row.id,
                        "idem relay: completion over the Redis body limit, left to PostgreSQL"
                    );
                    batch.relayed += 1;
                    done.push(row.id);
                }
                Outcome::Done(applied) => {
                    batch.relayed += 1;
                    if applied == Applied::Written {
                        batch.written += 1;
                    }
                    done.push(row.id);
                }
                Outcome::Expired => {
                    batch.expired += 1;
                    done.push(row.id);
                }
                Outcome::Failed(error) => {
                    tracing::warn!(schema = self.pg.schema(), id = row.id, tries = row.tries + 1, %error, "idem relay: outbox row failed");
                    failed.push((row.id, self.config.backoff(row.tries), error));
                }
            }
        }

        if let Some(e) = unavailable {
            if done.is_empty() && failed.is_empty() {
                return Err(e);
            }
            tracing::warn!(schema = self.pg.schema(), error = %e, "idem relay: Redis failed part of a batch; those rows stay pending");
        }

        // 3. Delete what is done: one statement.
        if !done.is_empty() {
            sqlx::query(&self.sql.delete)
                .bind(&done)
                .execute(&mut *tx)
                .await
                .map_err(map_error)?;
        }

        // 4. Count a try on each failed row: back off, remember why, and mark it dead at
        // the maximum.
        if !failed.is_empty() {
            let ids: Vec<i64> = failed.iter().map(|f| f.0).collect();
            let delays: Vec<i64> = failed
                .iter()
                .map(|f| i64::try_from(f.1.as_millis()).unwrap_or(i64::MAX))
                .collect();
            let errors: Vec<String> = failed.into_iter().map(|f| f.2).collect();
            let marked = sqlx::query(&self.sql.fail)
                .bind(&ids)
                .bind(&delays)
                .bind(&errors)
                .bind(i32::try_from(self.config.max_tries.max(1)).unwrap_or(i32::MAX))
                .fetch_all(&mut *tx)
                .await
                .map_err(map_error)?;
            batch.failed = ids.len();
            for row in &marked {
                let (id, dead): (i64, bool) = (
                    row.try_get(0).map_err(map_error)?,
                    row.try_get(1).map_err(map_error)?,
                );
                if dead {
                    batch.dead += 1;
                    tracing::error!(schema = self.pg.schema(), id, "idem relay: outbox row is dead after the maximum tries; see `idem relay dead list`");
                }
            }
        }

        // 5. Commit: the deletions and the tries become visible together. If the commit
        // fails, the rows come back and are applied again (idempotently).
        tx.commit().await.map_err(map_error)?;
        self.counters.batch(&batch);
        Ok(batch)
    }

    fn batch_size(&self) -> usize {
        self.config.batch.max(1) as usize
    }

    /// Reads the gauges when they are older than the gauge interval; a failure is logged.
    async fn refresh_gauges(&self, last: &mut Option<Instant>) {
        if last.is_some_and(|at| at.elapsed() < self.config.gauge_interval) {
            return;
        }
        *last = Some(Instant::now());
        match self.observe().await {
            Ok(m) => tracing::debug!(
                schema = self.pg.schema(),
                backlog = m.backlog,
                dead = m.dead,
                lag_seconds = m.lag_seconds,
                "idem relay gauges"
            ),
            Err(error) => {
                tracing::debug!(schema = self.pg.schema(), %error, "idem relay: gauges not read")
            }
        }
    }

    /// A listener subscribed to [`CHANNEL`], or `None` (logged) when PostgreSQL refuses.
    async fn listen(&self) -> Option<PgListener> {
        let attempt = async {
            let mut listener = PgListener::connect_with(self.pg.pool()).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match attempt.await {
            Ok(listener) => Some(listener),
            Err(error) => {
                tracing::warn!(schema = self.pg.schema(), %error, "idem relay: cannot LISTEN; polling only");
                None
            }
        }
    }

    /// Applies one claimed row. `Err` only when Redis is unavailable (the batch must roll
    /// back); every other failure is the row's own.
    async fn apply(&self, row: &Claimed) -> Result<Outcome, Error> {
        let entry = match &row.entry {
            None => return Ok(Outcome::Expired),
            Some(Err(e)) => return Ok(Outcome::Failed(e.to_string())),
            Some(Ok(entry)) => entry,
        };
        if !crate::tiered::fits_redis(&self.redis, &entry.completion) {
            return Ok(Outcome::NotForRedis);
        }
        let applied = self
            .redis
            .tier()
            .apply_completion(
                &entry.record,
                Some((&entry.fingerprint, entry.attempt)),
                entry.token,
                &entry.completion,
                entry.ttl,
            )
            .await;
        match applied {
            // Given the identity, the script never answers Absent; if it does, the row is
            // not relayed and must not be deleted.
            Ok(Applied::Absent) => Ok(Outcome::Failed(
                "Redis answered absent to an application with the record's identity".into(),
            )),
            Ok(applied) => Ok(Outcome::Done(applied)),
            Err(e) if e.is_retryable() => Err(e),
            // Refused by the body limit even compressed: PostgreSQL replays it.
            Err(Error::Invalid(_)) => Ok(Outcome::NotForRedis),
            Err(e) => Ok(Outcome::Failed(e.to_string())),
        }
    }
}

/// Waits for the next notification's payload; never resolves without a listener.
async fn recv(listener: &mut Option<PgListener>) -> Result<String, sqlx::Error> {
    match listener {
        Some(l) => l.recv().await.map(|n| n.payload().to_owned()),
        None => std::future::pending().await,
    }
}

/// Reads a claimed row. Never fails: a row that does not decode carries its error, to be
/// counted as a failed try like any other failure of the row.
fn claim(row: &PgRow) -> Claimed {
    let id: i64 = row.try_get("id").unwrap_or(0);
    let tries: i32 = row.try_get("tries").unwrap_or(0);
    let ttl_ms: Option<i64> = row.try_get("ttl_ms").unwrap_or(None);
    let entry = match ttl_ms {
        Some(ms) if ms <= 0 => None,
        _ => Some(decode(row, ttl_ms)),
    };
    Claimed {
        id,
        tries: u32::try_from(tries).unwrap_or(0),
        entry,
    }
}

fn decode(row: &PgRow, ttl_ms: Option<i64>) -> Result<Entry, Error> {
    let corrupt = |what: String| Error::corrupt(crate::STORE, what);
    let sql = |e: sqlx::Error| corrupt(format!("outbox row: {e}"));
    let scope: Vec<u8> = row.try_get("scope").map_err(sql)?;
    let scope = String::from_utf8(scope)
        .map_err(|_| corrupt("outbox row: the scope is not UTF-8".into()))
        .and_then(|s| Scope::new(s).map_err(|e| corrupt(format!("outbox row: scope: {e}"))))?;
    let key: String = row.try_get("key").map_err(sql)?;
    let key = Key::new(key).map_err(|e| corrupt(format!("outbox row: key: {e}")))?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(sql)?;
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|_| corrupt("outbox row: the fingerprint is not 32 bytes".into()))?;
    let token: uuid::Uuid = row.try_get("token").map_err(sql)?;
    let attempt: i32 = row.try_get("attempt").map_err(sql)?;
    let attempt = u32::try_from(attempt)
        .ok()
        .filter(|a| *a >= 1)
        .ok_or_else(|| corrupt(format!("outbox row: attempt {attempt}")))?;
    let meta: Vec<u8> = row.try_get("meta").map_err(sql)?;
    let body: Vec<u8> = row.try_get("body").map_err(sql)?;
    let completion =
        decode_meta(&meta, Bytes::from(body)).map_err(|e| corrupt(format!("outbox row: {e}")))?;
    let ttl_ms = ttl_ms.ok_or_else(|| corrupt("outbox row: no expiry".into()))?;
    Ok(Entry {
        record: RecordId::new(scope, key),
        fingerprint: Fingerprint::from_bytes(fingerprint),
        token: FencingToken::from_uuid(token),
        attempt,
        completion,
        ttl: Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(1)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let config = RelayConfig {
            backoff_base: Duration::from_millis(100),
            backoff_cap: Duration::from_secs(1),
            ..RelayConfig::default()
        };
        assert_eq!(config.backoff(0), Duration::from_millis(100));
        assert_eq!(config.backoff(1), Duration::from_millis(200));
        assert_eq!(config.backoff(3), Duration::from_millis(800));
        assert_eq!(config.backoff(4), Duration::from_secs(1));
        assert_eq!(config.backoff(u32::MAX), Duration::from_secs(1));
    }
}
