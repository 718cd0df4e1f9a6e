//! [`PgStore`]: the [`Store`] on PostgreSQL, and its transactional variants.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    decode_meta, encode_meta, Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint,
    Lease, Record, RecordId, RecordState, Replay, Result, Scope, Stats, Store, StreamRead, Watch,
};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgArguments, PgPoolOptions, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use tokio::time::Instant;
use uuid::Uuid;

use crate::error::{self, NAME};
use crate::migrate;
use crate::notify::{self, Notifier};
use crate::schema::{Schema, Statements, DEFAULT_SCHEMA};

/// Durations sent to the database are capped here (about 1000 years): far beyond any lease
/// or retention, and far from the end of PostgreSQL's timestamp range, so `now + duration`
/// can never overflow it.
pub const MAX_DURATION: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// How many times the store's own calls resend a statement that failed with a serialization
/// failure or a deadlock, unless [`PgStore::with_conflict_retries`] says otherwise.
pub const DEFAULT_CONFLICT_RETRIES: u32 = 10;

/// The [`Store`] on PostgreSQL.
///
/// Each statement works on one row, so each is atomic and takes one round trip; the crate
/// docs say how [`Store::begin`]'s one or two statements stay correct under any number of
/// concurrent callers. `complete`, `release` and `extend` are guarded by the lease's fencing
/// token: when no row matches, the lease was lost and they return [`Error::LeaseLost`].
/// Deadlines and expiry come from the database's `clock_timestamp()`.
///
/// The [`Store`] methods run on the pool, each statement in its own implicit transaction: no
/// transaction stays open across the protected work. To commit the completed record together
/// with the work's own writes, use [`PgStore::begin_in`] and [`PgStore::complete_in`] on
/// your transaction.
///
/// The store is cheap to clone (a pool handle and two `Arc`s).
///
/// ```no_run
/// # async fn run() -> Result<(), idem_core::Error> {
/// use idem_core::Idem;
/// use idem_postgres::PgStore;
///
/// let store = PgStore::connect("postgres://app@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let idem = Idem::new(store);
/// # let _ = idem; Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    schema: Arc<Schema>,
    sql: Arc<Statements>,
    conflict_retries: u32,
    /// Whether waiters listen for notifications (see [`PgStore::with_notify`]).
    notify: bool,
    /// Waiters' `LISTEN` connection, shared by clones.
    notifier: Arc<Notifier>,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("schema", &self.schema.name())
            .field("conflict_retries", &self.conflict_retries)
            .field("notify", &self.notify)
            .field("pool", &self.pool)
            .finish()
    }
}

impl PgStore {
    /// A store on `pool`, in the schema `idem`, resending a statement up to
    /// [`DEFAULT_CONFLICT_RETRIES`] times after a serialization failure or deadlock.
    ///
    /// The pool's `acquire_timeout` bounds how long a call waits for a connection, and with it
    /// how long an unreachable server takes to give [`Error::Unavailable`] (sqlx's default is
    /// 30 s; [`PgStore::pool_options`] sets 3 s).
    pub fn new(pool: PgPool) -> Self {
        let schema = Schema::new(DEFAULT_SCHEMA).expect("the default schema name is valid");
        Self {
            pool,
            sql: Arc::new(Statements::new(&schema)),
            schema: Arc::new(schema),
            conflict_retries: DEFAULT_CONFLICT_RETRIES,
            notify: true,
            notifier: Arc::new(Notifier::new()),
        }
    }

    /// Whether this store's waiters ([`idem_core::Config::wait`]) are notified with
    /// `LISTEN`/`NOTIFY` when the holder completes or releases, and so answer within about a
    /// millisecond instead of at their next poll. Default: on.
    ///
    /// On, the store opens one listening connection of its own at its first wait, and a
    /// completion nobody waits for sends nothing ([`crate::notify`] has the protocol).
    ///
    /// Off, this store's waiters poll (2 ms doubling to [`idem_core::Config::max_poll`])
    /// and it opens no listening connection (for a connection pooler that cannot keep a
    /// `LISTEN`, for example); its completions still wake the waiters of other stores. The
    /// tiered store's waiters are woken through Redis either way.
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Keeps idem's table in `schema` instead of `idem` (one schema per application sharing
    /// a database, or per test). The name is used exactly as given, quoted.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the name is empty, longer than 63 bytes (PostgreSQL would
    /// silently truncate it) or holds a NUL byte.
    pub fn with_schema(mut self, schema: &str) -> Result<Self, Error> {
        let schema = Schema::new(schema)?;
        self.sql = Arc::new(Statements::new(&schema));
        self.schema = Arc::new(schema);
        Ok(self)
    }

    /// How many times the store's own calls resend a statement that PostgreSQL aborted with
    /// a serialization failure (`40001`) or a deadlock (`40P01`), which can happen when the
    /// server or role defaults to a stricter isolation level than READ COMMITTED. Default:
    /// 10, with pauses of 2 ms doubling up to 64 ms plus jitter (under 0.5 s in all); under
    /// SERIALIZABLE, 3 was measured too few for 16 callers racing on the same keys.
    /// The `*_in` methods never resend: the caller's transaction is aborted and must be
    /// retried whole.
    pub fn with_conflict_retries(mut self, retries: u32) -> Self {
        self.conflict_retries = retries;
        self
    }

    /// Pool settings suited to the store: at most 10 connections; a 3 s acquire timeout,
    /// which bounds both the wait for a free connection and the opening of a new one, so an
    /// unreachable server gives [`Error::Unavailable`] within about 3 s; and no test of a
    /// connection as it leaves the pool. Adjust and pass the pool to [`PgStore::new`].
    ///
    /// Why no test: sqlx pings every connection it hands out by default (a round trip of its
    /// own), which would make each transition two round trips instead of one. A connection
    /// that died while idle (a server restart) fails its next statement instead; sqlx drops
    /// it, and the store sends the statement again on the next connection, so callers of
    /// the store do not see the restart. Statements inside a caller's transaction
    /// (`*_in`) are not sent again: the transaction is the caller's.
    pub fn pool_options() -> PgPoolOptions {
        PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(3))
            .test_before_acquire(false)
    }

    /// Opens a pool with [`PgStore::pool_options`] on `url` (connecting once to check it) and
    /// builds a store on it.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the server cannot be reached within the acquire timeout;
    /// [`Error::Backend`] for a malformed URL or a refused login.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let pool = Self::pool_options()
            .connect(url)
            .await
            .map_err(error::map)?;
        Ok(Self::new(pool))
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema holding idem's table.
    pub fn schema(&self) -> &str {
        self.schema.name()
    }

    /// The schema as a quoted identifier, ready to splice into SQL (for crates that keep
    /// their own tables in idem's schema, such as the outbox).
    pub fn quoted_schema(&self) -> &str {
        self.schema.quoted()
    }

    /// Applies idem's migrations in the store's schema, creating the schema if needed. Safe
    /// to call from many instances at once; see [`crate::migrate`].
    ///
    /// # Errors
    ///
    /// As [`crate::migrate`].
    pub async fn migrate(&self) -> Result<(), Error> {
        migrate::migrate_schema(&self.pool, &self.schema).await
    }

    /// Applies another crate's migrations in the store's schema, the way [`PgStore::migrate`]
    /// applies idem's: on a connection of its own whose `search_path` is the schema alone,
    /// under sqlx's advisory lock, with the schema's ledger. For crates that keep tables of
    /// their own beside `records` (idem-outbox's outbox). Their versions must not collide
    /// with idem-postgres's (which start at 1), and their migrator must ignore the versions
    /// it does not know, since the ledger is shared: build it with
    /// [`sharing_the_ledger`](crate::sharing_the_ledger).
    ///
    /// # Errors
    ///
    /// As [`crate::migrate`].
    pub async fn migrate_with(&self, migrator: &sqlx::migrate::Migrator) -> Result<(), Error> {
        migrate::migrate_schema_with(&self.pool, &self.schema, migrator).await
    }

    /// The versions of idem's migrations not yet applied in the store's schema (all of them
    /// when the schema is absent), read without changing anything: for tools that open a
    /// store to read it and must neither need DDL rights nor create schemas.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the database cannot be reached; [`Error::Backend`] when
    /// the ledger cannot be read.
    pub async fn pending_migrations(&self) -> Result<Vec<i64>, Error> {
        migrate::pending_in(&self.pool, &self.schema, migrate::migrator()).await
    }

    /// [`PgStore::pending_migrations`] for another crate's migrations kept in the store's
    /// schema (see [`PgStore::migrate_with`]).
    ///
    /// # Errors
    ///
    /// As [`PgStore::pending_migrations`].
    pub async fn pending_migrations_with(
        &self,
        migrator: &sqlx::migrate::Migrator,
    ) -> Result<Vec<i64>, Error> {
        migrate::pending_in(&self.pool, &self.schema, migrator).await
    }

    /// [`Store::begin`] as part of the caller's transaction (pass `&mut *tx`).
    ///
    /// The in-progress record is written by the transaction: it becomes visible to others,
    /// and the key counts as claimed, only when the transaction commits; if it rolls back,
    /// the key is as it was. Meanwhile another caller's `begin` on the same key waits on the
    /// row until this transaction ends (set `lock_timeout` to bound that wait; a timeout
    /// gives [`Error::Unavailable`]), then sees its outcome. Complete the lease with
    /// [`PgStore::complete_in`] in the same transaction.
    ///
    /// # Errors
    ///
    /// As [`Store::begin`]. A serialization failure or deadlock is not resent (the
    /// transaction is aborted): it gives an [`Error::Unavailable`] for which
    /// [`crate::is_transaction_conflict`] holds; roll back and retry the whole transaction.
    pub async fn begin_in(
        &self,
        conn: &mut PgConnection,
        req: BeginRequest<'_>,
    ) -> Result<Begin, Error> {
        let sent_at = Instant::now();
        let row = self
            .begin_query(&self.sql.begin, &req)
            .fetch_one(conn)
            .await
            .map_err(error::map)?;
        classify_begin(&row, &req, sent_at)
    }

    /// [`Store::complete`] as part of the caller's transaction (pass `&mut *tx`): the
    /// completed record commits, or rolls back, together with the work's own writes.
    ///
    /// The update is guarded by the lease's token and runs on the row's latest committed
    /// version: if another worker took the key over, or another transaction already
    /// completed it, no row matches and this returns [`Error::LeaseLost`]; roll the
    /// transaction back then, so the work's writes are not committed twice. If the
    /// transaction rolls back after a successful `complete_in`, the record is as it was
    /// before (in progress under the lease if the lease came from [`Store::begin`], absent if
    /// it came from [`PgStore::begin_in`] in the same transaction).
    ///
    /// # Errors
    ///
    /// As [`Store::complete`]; a serialization failure or deadlock as in
    /// [`PgStore::begin_in`].
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        completion: &Completion,
        retention: Duration,
    ) -> Result<()> {
        let meta = encode_meta(completion.kind, &completion.response);
        let done = self
            .complete_query(lease, &meta, completion, retention)
            .execute(conn)
            .await
            .map_err(error::map)?;
        held(done.rows_affected())
    }

    /// [`Store::release`] as part of the caller's transaction: the record is forgotten if and
    /// when the transaction commits.
    ///
    /// # Errors
    ///
    /// As [`Store::release`]; a serialization failure or deadlock as in
    /// [`PgStore::begin_in`].
    pub async fn release_in(&self, conn: &mut PgConnection, lease: &Lease) -> Result<(), Error> {
        let done = self
            .release_query(lease)
            .execute(conn)
            .await
            .map_err(error::map)?;
        held(done.rows_affected())
    }

    /// Deletes up to `batch` expired records, the longest expired first, in one statement;
    /// returns how many it deleted. Fewer than `batch` means none are left for now. Expired
    /// records already behave as absent; this only reclaims their space. Rows that concurrent
    /// calls hold are skipped, so purging never waits on live traffic. `batch` 0 deletes
    /// nothing.
    ///
    /// Call it in a loop until it returns less than `batch`, or let
    /// [`PgStore::spawn_purge`] do so periodically.
    ///
    /// # Errors
    ///
    /// Store errors.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Error> {
        if batch == 0 {
            return Ok(0);
        }
        let done = self
            .retrying(|| {
                sqlx::query(&self.sql.purge)
                    .bind(i64::from(batch))
                    .execute(&self.pool)
            })
            .await
            .map_err(error::map)?;
        // The streams of records no longer in progress under their token go with them, a
        // batch at a time too (they are not counted: the count is of records).
        self.retrying(|| {
            sqlx::query(&self.sql.purge_streams)
                .bind(i64::from(batch))
                .execute(&self.pool)
        })
        .await
        .map_err(error::map)?;
        Ok(done.rows_affected())
    }

    /// Runs `op` (one statement on the pool), sending it again after a serialization failure
    /// or deadlock (PostgreSQL rolled the failed statement back whole), or when the server
    /// ended the connection's session (see [`PgStore::resending`]). Every statement of the
    /// store gives the same answer when repeated (begin with the same token included),
    /// except that a repeated complete or release finds its work done: those two use
    /// [`PgStore::resending`] and check.
    async fn retrying<T, F, Fut>(&self, op: F) -> Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        self.resending(op).await.map(|(answer, _)| answer)
    }

    /// [`PgStore::retrying`], also saying whether an earlier send may have run: its
    /// connection died before the answer came.
    ///
    /// The pool does not test a connection before handing it out (see
    /// [`PgStore::pool_options`]), so a server restart is absorbed here: every connection of
    /// the pool may have been ended by it, and each is dropped by sqlx as it fails, so the
    /// statement is sent again, up to once per pooled connection, each time on the next one.
    async fn resending<T, F, Fut>(&self, mut op: F) -> Result<(T, bool), sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let mut tries = 0;
        let mut ended = 0;
        let mut may_have_run = false;
        let max_ended = self.pool.options().get_max_connections();
        loop {
            match op().await {
                Ok(answer) => return Ok((answer, may_have_run)),
                Err(e) if ended < max_ended && error::session_ended(&e).is_some() => {
                    ended += 1;
                    may_have_run |= error::session_ended(&e) == Some(error::Ended::Unknown);
                    tracing::debug!(error = %e, ended, "postgres: session ended by the server, resending");
                }
                Err(e) if error::is_conflict(&e) && tries < self.conflict_retries => {
                    tries += 1;
                    // Back off a little, with jitter, so that colliding callers spread out.
                    let jitter = u64::from(Uuid::new_v4().as_bytes()[0] % 8);
                    let pause = (1u64 << tries.min(6)) + jitter;
                    tracing::debug!(error = %e, tries, "postgres: transaction conflict, resending");
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The row that `sql` (a statement on one record, `$1` its scope and `$2` its key)
    /// answers for `id`, if any, resent after a conflict as [`PgStore::retrying`] says.
    async fn fetch_by_id(&self, sql: &str, id: &RecordId) -> Result<Option<PgRow>, Error> {
        self.retrying(|| {
            sqlx::query(sql)
                .bind(id.scope().as_str().as_bytes())
                .bind(id.key().as_str())
                .fetch_optional(&self.pool)
        })
        .await
        .map_err(error::map)
    }

    /// `sql` (`claim.sql` or `begin.sql`, which take the same parameters) for `req`.
    fn begin_query<'q>(
        &'q self,
        sql: &'q str,
        req: &'q BeginRequest<'_>,
    ) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(sql)
            .bind(req.id.scope().as_str().as_bytes())
            .bind(req.id.key().as_str())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(*req.token.as_uuid())
            .bind(interval(req.lease))
            .bind(interval(req.retention))
    }

    fn complete_query<'q>(
        &'q self,
        lease: &'q Lease,
        meta: &'q [u8],
        completion: &'q Completion,
        retention: Duration,
    ) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(&self.sql.complete)
            .bind(lease.id().scope().as_str().as_bytes())
            .bind(lease.id().key().as_str())
            .bind(*lease.token().as_uuid())
            .bind(meta)
            .bind(&completion.response.body[..])
            .bind(interval(retention))
            .bind(self.notification(lease.id()))
    }

    /// The payload `complete.sql` and `release.sql` notify with, when someone waits.
    fn notification(&self, id: &RecordId) -> String {
        notify::payload(self.schema.name(), id)
    }

    fn release_query<'q>(&'q self, lease: &'q Lease) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(&self.sql.release)
            .bind(lease.id().scope().as_str().as_bytes())
            .bind(lease.id().key().as_str())
            .bind(*lease.token().as_uuid())
            .bind(self.notification(lease.id()))
    }
}

#[async_trait]
impl Store for PgStore {
    fn name(&self) -> &'static str {
        NAME
    }

    /// `claim.sql` first: it answers a new key (one plain insert) and a record that needs
    /// no change (a snapshot read), which is nearly every call. When it returns no row (a
    /// record past its expiry, a lease to take over, or a key a concurrent caller inserted
    /// meanwhile), `begin.sql` decides on the row under its lock.
    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin, Error> {
        for sql in [&self.sql.claim, &self.sql.begin] {
            let sent_at = Instant::now();
            let row = self
                .retrying(|| self.begin_query(sql, &req).fetch_optional(&self.pool))
                .await
                .map_err(error::map)?;
            if let Some(row) = row {
                return classify_begin(&row, &req, sent_at);
            }
        }
        // begin.sql answers every call with a row.
        Err(error::map(sqlx::Error::RowNotFound))
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let meta = encode_meta(completion.kind, &completion.response);
        let (done, may_have_run) = self
            .resending(|| {
                self.complete_query(lease, &meta, completion, ttl)
                    .execute(&self.pool)
            })
            .await
            .map_err(error::map)?;
        if done.rows_affected() == 0 && may_have_run {
            // The send whose connection died may have stored it: then the record holds
            // exactly this completion, from this attempt.
            let record = self.get(lease.id()).await?;
            if record.is_some_and(|r| {
                r.attempt == lease.attempt()
                    && matches!(&r.state, RecordState::Completed(c) if c == completion)
            }) {
                return Ok(());
            }
        }
        held(done.rows_affected())
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let (done, may_have_run) = self
            .resending(|| self.release_query(lease).execute(&self.pool))
            .await
            .map_err(error::map)?;
        if done.rows_affected() == 0 && may_have_run && self.get(lease.id()).await?.is_none() {
            // The send whose connection died may have released it; either way the record
            // is gone, which is what the caller asked for.
            return Ok(());
        }
        held(done.rows_affected())
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        let sent_at = Instant::now();
        let row = self
            .retrying(|| {
                sqlx::query(&self.sql.extend)
                    .bind(lease.id().scope().as_str().as_bytes())
                    .bind(lease.id().key().as_str())
                    .bind(*lease.token().as_uuid())
                    .bind(interval(by))
                    .fetch_optional(&self.pool)
            })
            .await
            .map_err(error::map)?;
        let Some(row) = row else {
            return Err(Error::LeaseLost);
        };
        let attempt = attempt_of(&row)?;
        let granted = micros(row.try_get("lease_us").map_err(error::map)?);
        Ok(lease.renewed(attempt, granted, sent_at))
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let row = self.fetch_by_id(&self.sql.get, id).await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let token: Option<Uuid> = row.try_get("token").map_err(error::map)?;
        let state = match token {
            Some(token) => RecordState::InProgress {
                token: FencingToken::from_uuid(token),
                lease_remaining: micros(row.try_get("lease_us").map_err(error::map)?),
            },
            None => RecordState::Completed(completion_of(&row)?),
        };
        Ok(Some(Record {
            id: id.clone(),
            fingerprint: fingerprint_of(&row)?,
            attempt: attempt_of(&row)?,
            state,
            expires_in: micros(row.try_get("expires_us").map_err(error::map)?),
        }))
    }

    /// One statement (`append.sql`): the lease's check, the stream's length and the insert
    /// of the bytes as one row keyed by the token and the offset; readers waiting for more
    /// are notified as for a completion.
    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<(), Error> {
        let id = lease.id();
        let at_i64 = i64::try_from(at)
            .map_err(|_| Error::Invalid(format!("append at byte {at}: past any stream")))?;
        let row = self
            .retrying(|| {
                sqlx::query(&self.sql.append)
                    .bind(id.scope().as_str().as_bytes())
                    .bind(id.key().as_str())
                    .bind(*lease.token().as_uuid())
                    .bind(at_i64)
                    .bind(bytes)
                    .bind(self.notification(id))
                    .fetch_one(&self.pool)
            })
            .await
            .map_err(error::map)?;
        let held: bool = row.try_get("held").map_err(error::map)?;
        let len: i64 = row.try_get("len").map_err(error::map)?;
        if !held {
            return Err(Error::LeaseLost);
        }
        if at_i64 > len {
            return Err(Error::Invalid(format!(
                "append at byte {at} of a stream of {len} bytes: append at its end"
            )));
        }
        Ok(())
    }

    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead, Error> {
        let from = i64::try_from(from).unwrap_or(i64::MAX);
        let row = self
            .retrying(|| {
                sqlx::query(&self.sql.read_stream)
                    .bind(id.scope().as_str().as_bytes())
                    .bind(id.key().as_str())
                    .bind(from)
                    .fetch_optional(&self.pool)
            })
            .await
            .map_err(error::map)?;
        let Some(row) = row else {
            return Ok(StreamRead::Absent);
        };
        let token: Option<Uuid> = row.try_get("token").map_err(error::map)?;
        match token {
            Some(token) => {
                let bytes: Option<Vec<u8>> = row.try_get("stream").map_err(error::map)?;
                Ok(StreamRead::Live {
                    token: FencingToken::from_uuid(token),
                    bytes: Bytes::from(bytes.unwrap_or_default()),
                    lease_remaining: micros(row.try_get("lease_us").map_err(error::map)?),
                })
            }
            None => Ok(StreamRead::Completed(completion_of(&row)?)),
        }
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        let row = self.fetch_by_id(&self.sql.evict, id).await?;
        match row {
            // An expired record was deleted too, but it already counted as absent.
            Some(row) => row.try_get::<bool, _>("live").map_err(error::map),
            None => Ok(false),
        }
    }

    /// `LISTEN` on the store's own connection, which then holds the record's waiter lock
    /// (see [`crate::notify`]); made on the first wait. `None` when notifications are off,
    /// when it does not listen within 3 s, or when the lock cannot be had (the caller polls).
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        if !self.notify {
            return None;
        }
        let payload = notify::payload(self.schema.name(), id);
        self.notifier
            .watch(&self.pool, payload, Duration::from_secs(3))
            .await
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats, Error> {
        let row = self
            .retrying(|| {
                sqlx::query(&self.sql.stats)
                    .bind(scope.map(|s| s.as_str().as_bytes()))
                    .bind(interval(stuck_after))
                    .fetch_one(&self.pool)
            })
            .await
            .map_err(error::map)?;
        let count = |column: &str| -> Result<u64, Error> {
            let n: i64 = row.try_get(column).map_err(error::map)?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        Ok(Stats::default()
            .with_in_flight(count("in_flight")?)
            .with_expired_leases(count("expired_leases")?)
            .with_stuck(count("stuck")?)
            .with_succeeded(count("succeeded")?)
            .with_failed(count("failed")?))
    }
}

/// Maps the row count of a guarded write: none means the lease no longer holds the record.
fn held(rows: u64) -> Result<(), Error> {
    if rows == 0 {
        Err(Error::LeaseLost)
    } else {
        Ok(())
    }
}

/// Reads the row `claim.sql` or `begin.sql` returns and decides which of the five outcomes
/// it is.
fn classify_begin(row: &PgRow, req: &BeginRequest<'_>, sent_at: Instant) -> Result<Begin, Error> {
    let token: Option<Uuid> = row.try_get("token").map_err(error::map)?;
    let attempt = attempt_of(row)?;
    let lease_left =
        || -> Result<Duration, Error> { Ok(micros(row.try_get("lease_us").map_err(error::map)?)) };
    // Our token on the row: we inserted it, took it over, or this is a re-send of the same
    // attempt. In every case the lease is ours, and the attempt number says which.
    if token == Some(*req.token.as_uuid()) {
        // The time left was measured when the statement answered, at least `waited_us` after
        // it was sent: counting from `sent_at` alone would spend the lease on a lock wait.
        let waited = micros(row.try_get("waited_us").map_err(error::map)?);
        let measured_after = sent_at.checked_add(waited).unwrap_or(sent_at);
        let lease = Lease::new(
            req.id.clone(),
            req.token,
            attempt,
            lease_left()?,
            measured_after,
        );
        return Ok(if attempt == 1 {
            Begin::Acquired(lease)
        } else {
            Begin::TookOver(lease)
        });
    }
    if fingerprint_of(row)? != req.fingerprint {
        return Ok(Begin::Mismatch);
    }
    match token {
        None => Ok(Begin::Replay(Replay {
            completion: completion_of(row)?,
            expires_in: micros(row.try_get("expires_us").map_err(error::map)?),
        })),
        // Same fingerprint, another token, not taken over: the lease is live.
        Some(_) => Ok(Begin::InFlight {
            retry_after: lease_left()?,
        }),
    }
}

fn fingerprint_of(row: &PgRow) -> Result<Fingerprint, Error> {
    let bytes: Vec<u8> = row.try_get("fingerprint").map_err(error::map)?;
    let bytes: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| {
        Error::corrupt(NAME, format!("fingerprint is {} bytes, not 32", b.len()))
    })?;
    Ok(Fingerprint::from_bytes(bytes))
}

fn attempt_of(row: &PgRow) -> Result<u32, Error> {
    let attempt: i32 = row.try_get("attempt").map_err(error::map)?;
    u32::try_from(attempt)
        .ok()
        .filter(|a| *a >= 1)
        .ok_or_else(|| Error::corrupt(NAME, format!("attempt is {attempt}")))
}

fn completion_of(row: &PgRow) -> Result<Completion, Error> {
    let meta: Option<Vec<u8>> = row.try_get("meta").map_err(error::map)?;
    let body: Option<Vec<u8>> = row.try_get("body").map_err(error::map)?;
    let (Some(meta), Some(body)) = (meta, body) else {
        return Err(Error::corrupt(
            NAME,
            "completed record without meta or body",
        ));
    };
    decode_meta(&meta, Bytes::from(body)).map_err(|e| Error::corrupt(NAME, e.to_string()))
}

/// A duration as an interval, capped at [`MAX_DURATION`] and truncated to microseconds (the
/// database's resolution).
fn interval(d: Duration) -> PgInterval {
    let micros = d.min(MAX_DURATION).as_micros();
    PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(micros).unwrap_or(i64::MAX),
    }
}

/// A microsecond count from the database as a duration; NULL or negative (already past)
/// is zero.
fn micros(us: Option<i64>) -> Duration {
    Duration::from_micros(us.map_or(0, |us| u64::try_from(us).unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_convert() {
        assert_eq!(
            interval(Duration::from_millis(1500)).microseconds,
            1_500_000
        );
        assert_eq!(interval(Duration::from_nanos(999)).microseconds, 0);
        assert_eq!(
            interval(Duration::MAX).microseconds,
            i64::try_from(MAX_DURATION.as_micros()).unwrap()
        );
        assert_eq!(micros(None), Duration::ZERO);
        assert_eq!(micros(Some(-5)), Duration::ZERO);
        assert_eq!(micros(Some(2_000_001)), Duration::from_micros(2_000_001));
    }
}
