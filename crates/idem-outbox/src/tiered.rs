//! [`TieredStore`]: Redis first, PostgreSQL as the arbiter.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::orphan::Orphans;
use idem_core::telemetry::KeyHash;
use idem_core::{
    Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint, Lease, Record, RecordId,
    RecordState, Replay, Result, Scope, Stats, Store, StreamRead, Watch,
};
use idem_postgres::{map_error, PgStore};

use crate::outage::RedisOutages;
use crate::statements::Statements;
use idem_redis::tier::Applied;
use idem_redis::{OversizeBody, RedisStore};
use sqlx::PgConnection;

/// The name in errors and metrics.
pub const STORE: &str = "tiered";

/// The notification channel the relays listen on; the payload is the schema's name.
pub const CHANNEL: &str = "idem_outbox";

/// Whether Redis can hold this completion whole. A body its limit would refuse, or keep
/// without the body ([`OversizeBody::StatusAndHeaders`]), stays in PostgreSQL only: Redis
/// must never replay anything but the committed response.
pub(crate) fn fits_redis(redis: &RedisStore, completion: &Completion) -> bool {
    let limit = &redis.config().body;
    completion.response.body.len() <= limit.max_bytes || limit.oversize == OversizeBody::Compress
}

/// A [`Store`] with Redis as the fast path and PostgreSQL as the source of truth: Redis only
/// ever holds a lease PostgreSQL granted or a completion it committed.
///
/// - `begin` reads Redis first, without writing ([`idem_redis::tier::Tier::peek`]): a replay, a mismatch
///   or an in-flight answer there is the answer (one Redis round trip). Otherwise (the key
///   is absent from Redis, or its lease ran out) PostgreSQL decides; a lease it grants is
///   then written into Redis ([`idem_redis::tier::Tier::hold`]), so that duplicates are answered
///   in flight by Redis, and a completion it replays is written back into Redis. A read
///   that times out leaves nothing behind, even if it reaches Redis later.
/// - `complete` ([`TieredStore::complete_in`] inside the business transaction) writes the
///   completed record and an outbox row in one PostgreSQL transaction; after the commit the
///   completion is written into Redis at once ([`TieredStore::publish`]), and in any case by
///   the relay ([`crate::Relay`]), at least once.
/// - `release` and `extend` act on PostgreSQL (whose answer counts) and then on Redis.
/// - `watch` (a waiter for another worker's result) listens to both tiers.
/// - A Redis call that takes longer than [`TieredStore::with_redis_timeout`] fails as
///   unavailable. While Redis does not answer, PostgreSQL answers alone and Redis is left
///   out of every call until a probe finds it back (one `PING` every half second): the
///   outage is logged once when it starts and once when it ends, with the count of begins
///   answered without Redis. A Redis write that timed out may still land when Redis
///   resumes: the lease it wrote is given back (fenced by its token) as soon as Redis
///   answers.
///
/// See the [crate docs](crate) for the exact guarantee and its cost.
#[derive(Debug, Clone)]
pub struct TieredStore {
    redis: RedisStore,
    pg: PgStore,
    sql: Arc<Statements>,
    outages: RedisOutages,
    orphans: Orphans,
}

/// The default of [`TieredStore::with_redis_timeout`].
const REDIS_TIMEOUT: Duration = Duration::from_secs(2);

impl TieredStore {
    /// Tiers `redis` over `pg`. Run [`TieredStore::migrate`] (or [`crate::migrate`]) once
    /// first: it creates the records table and the outbox table.
    pub fn new(redis: RedisStore, pg: PgStore) -> Self {
        let sql = Arc::new(Statements::new(pg.quoted_schema()));
        Self {
            redis,
            pg,
            sql,
            outages: RedisOutages::new(REDIS_TIMEOUT),
            orphans: Orphans::new(),
        }
    }

    /// Sets how long one call to the Redis tier may take before it fails as unavailable,
    /// PostgreSQL answers alone, and an outage starts. Keep it well under
    /// [`idem_core::Config::store_timeout`], so that PostgreSQL still answers within the
    /// call's own limit. Default: 2 s.
    pub fn with_redis_timeout(mut self, limit: Duration) -> Self {
        self.outages = RedisOutages::new(limit);
        self
    }

    /// Applies idem-postgres's migrations and the outbox's in the PostgreSQL tier's schema
    /// ([`crate::migrate`]).
    ///
    /// # Errors
    ///
    /// As [`PgStore::migrate`].
    pub async fn migrate(&self) -> Result<()> {
        crate::migrate(&self.pg).await
    }

    /// The Redis tier.
    pub fn redis(&self) -> &RedisStore {
        &self.redis
    }

    /// The PostgreSQL tier, the arbiter.
    pub fn pg(&self) -> &PgStore {
        &self.pg
    }

    /// Completes the lease inside the caller's business transaction (pass `&mut *tx`): the
    /// completed record and its outbox row commit, or roll back, with the business writes.
    /// After the commit, call [`TieredStore::publish`] to copy the completion into Redis at
    /// once (the relay does it otherwise).
    ///
    /// If this returns an error, roll the transaction back: with [`Error::LeaseLost`] another
    /// worker took the key over (or already completed it), and committing the business
    /// writes would do the work twice.
    ///
    /// # Errors
    ///
    /// As [`PgStore::complete_in`]; store errors from writing the outbox row.
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        completion: &Completion,
        retention: Duration,
    ) -> Result<()> {
        self.pg
            .complete_in(conn, lease, completion, retention)
            .await?;
        let id = lease.id();
        let done = sqlx::query(&self.sql.record)
            .bind(id.scope().as_str().as_bytes())
            .bind(id.key().as_str())
            .bind(lease.token().as_uuid())
            .bind(CHANNEL)
            .bind(self.pg.schema())
            .execute(conn)
            .await
            .map_err(map_error)?;
        if done.rows_affected() != 1 {
            // complete_in just wrote the record in this transaction: not finding it means
            // the schema is not what this code expects.
            return Err(Error::backend(
                STORE,
                format!(
                    "the outbox row for {id} was not written ({} rows)",
                    done.rows_affected()
                ),
            ));
        }
        Ok(())
    }

    /// Copies a committed completion into Redis now, so retries are answered there without
    /// waiting for the relay. Call it after the transaction of
    /// [`TieredStore::complete_in`] committed (never before: Redis must only ever hold
    /// completions that PostgreSQL has). A failure here loses nothing: the relay applies the
    /// outbox row.
    ///
    /// # Errors
    ///
    /// Redis errors.
    pub async fn publish(
        &self,
        lease: &Lease,
        completion: &Completion,
        retention: Duration,
    ) -> Result<Applied> {
        if self.outages.is_down() {
            // The relay writes it; a lease record Redis may still hold is given back.
            self.release_redis_later(lease);
            return Err(Error::unavailable(STORE, "Redis is unavailable"));
        }
        let applied = self
            .apply(lease.id(), lease.token(), completion, retention)
            .await;
        self.let_go_unless_applied(lease, &applied).await;
        applied
    }

    /// After a failed or refused write of a completion into Redis, gives back the Redis
    /// lease `lease` holds there (token-fenced: a lease someone else holds is left alone).
    /// Otherwise retries would see it in flight until it expired; without it they go on to
    /// PostgreSQL, which replays the committed response.
    async fn let_go_unless_applied(&self, lease: &Lease, applied: &Result<Applied, Error>) {
        match applied {
            Ok(Applied::Written | Applied::AlreadyCompleted) => {}
            // The write may still land; the release must come after it.
            Err(e) if e.is_retryable() => self.release_redis_later(lease),
            _ => self.release_redis(lease).await,
        }
    }

    /// Writes a committed completion into Redis over the in-progress record of the lease
    /// whose token is `token`, or into an absent key.
    async fn apply(
        &self,
        id: &RecordId,
        token: FencingToken,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<Applied> {
        if !fits_redis(&self.redis, completion) {
            return Err(Error::Invalid(format!(
                "the completion of {id} is over the Redis tier's body limit; it is replayed \
                 from PostgreSQL"
            )));
        }
        // The common case: Redis still holds the lease, whose record supplies the
        // fingerprint and attempt: one Redis round trip.
        let applied = self
            .outages
            .call(
                &self.redis,
                self.redis
                    .tier()
                    .apply_completion(id, None, token, completion, ttl),
            )
            .await?;
        if applied != Applied::Absent {
            return Ok(applied);
        }
        // Redis lost the lease: take the identity and the time left from the arbiter.
        // Only a completed record: after an evict and a new incarnation, an in-progress
        // record's identity is not this completion's.
        let Some(record) = self
            .pg
            .get(id)
            .await?
            .filter(|r| matches!(r.state, RecordState::Completed(_)))
        else {
            return Ok(Applied::Absent);
        };
        self.outages
            .call(
                &self.redis,
                self.redis.tier().apply_completion(
                    id,
                    Some((&record.fingerprint, record.attempt)),
                    token,
                    completion,
                    record.expires_in,
                ),
            )
            .await
    }

    /// Makes a lease PostgreSQL granted visible in Redis, so duplicates get their in-flight
    /// answer there, and returns it carrying the Redis record written for it (which the
    /// Redis tier's fenced writes, extend and release, compare with). Best effort: without
    /// it duplicates ask PostgreSQL, and the lease is returned as it was.
    async fn hold_in_redis(&self, lease: Lease, fingerprint: &Fingerprint) -> Lease {
        if self.outages.is_down() {
            return lease;
        }
        match self
            .outages
            .call(&self.redis, self.redis.tier().hold(&lease, fingerprint))
            .await
        {
            Ok(held) => held,
            // The SET may land later: give the lease back once Redis answers.
            Err(e) if e.is_retryable() => {
                self.release_redis_later(&lease);
                lease
            }
            Err(e) => {
                tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "granted lease not written into Redis");
                lease
            }
        }
    }

    /// Writes a completion PostgreSQL replayed back into Redis (which had lost it), so the
    /// next retry is answered there. Best effort.
    async fn repair(&self, req: &BeginRequest<'_>, replay: &Replay) {
        if self.outages.is_down() {
            return;
        }
        let id = req.id;
        let result = self
            .apply(id, req.token, &replay.completion, replay.expires_in)
            .await;
        if let Err(e) = result {
            tracing::debug!(key_hash = %KeyHash::of(id), error = %e, "could not write a replayed completion back into Redis");
        }
    }

    /// Gives back the Redis record of `lease`, fenced by its token; best effort.
    async fn release_redis(&self, lease: &Lease) {
        if self.outages.is_down() {
            self.release_redis_later(lease);
            return;
        }
        match self
            .outages
            .call(&self.redis, self.redis.release(lease))
            .await
        {
            Ok(()) | Err(Error::LeaseLost) => {}
            Err(e) if e.is_retryable() => self.release_redis_later(lease),
            Err(e) => {
                tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "Redis lease not released");
            }
        }
    }

    /// Gives back the Redis record of `lease` in the background, once Redis answers: a
    /// write of it that timed out may land when Redis resumes, and nobody would hold it.
    fn release_redis_later(&self, lease: &Lease) {
        let redis: Arc<dyn Store> = Arc::new(self.redis.clone());
        self.orphans.release_later(
            redis,
            lease.id(),
            lease.token(),
            lease.remaining(),
            self.outages.limit(),
        );
    }

    /// PostgreSQL's answer to `req`, after Redis had none (or was left out), made visible
    /// in Redis.
    async fn decide(&self, req: BeginRequest<'_>) -> Result<Begin> {
        Ok(match self.pg.begin(req.clone()).await? {
            // The lease carries the Redis record written for it, so the Redis tier's fenced
            // writes (extend, release) compare in one round trip.
            Begin::Acquired(lease) => {
                Begin::Acquired(self.hold_in_redis(lease, &req.fingerprint).await)
            }
            Begin::TookOver(lease) => {
                Begin::TookOver(self.hold_in_redis(lease, &req.fingerprint).await)
            }
            Begin::Replay(replay) => {
                self.repair(&req, &replay).await;
                Begin::Replay(replay)
            }
            other => other,
        })
    }
}

#[async_trait]
impl Store for TieredStore {
    fn name(&self) -> &'static str {
        STORE
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin> {
        if self.outages.is_down() {
            self.outages.answered_without_redis();
            return self.decide(req).await;
        }
        match self
            .outages
            .call(&self.redis, self.redis.tier().peek(&req))
            .await
        {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => self.decide(req).await,
            Err(e) if e.is_retryable() => {
                // Redis is down or stalled: the arbiter alone keeps every guarantee.
                self.outages.answered_without_redis();
                self.decide(req).await
            }
            Err(e) => Err(e),
        }
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let mut tx = self.pg.pool().begin().await.map_err(map_error)?;
        self.complete_in(&mut tx, lease, completion, ttl).await?;
        tx.commit().await.map_err(map_error)?;
        if let Err(e) = self.publish(lease, completion, ttl).await {
            tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "completion left to the relay");
        }
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.pg.release(lease).await?;
        self.release_redis(lease).await;
        Ok(())
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        let renewed = self.pg.extend(lease, by).await?;
        if !self.outages.is_down() {
            if let Err(e) = self
                .outages
                .call(&self.redis, self.redis.extend(lease, by))
                .await
            {
                // Without it, duplicates are answered by PostgreSQL once Redis's lease ends.
                tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "Redis lease not extended");
            }
        }
        Ok(renewed)
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>> {
        self.pg.get(id).await
    }

    async fn evict(&self, id: &RecordId) -> Result<bool> {
        // The key's outbox rows go first, so the relay cannot write an evicted completion
        // back into Redis.
        sqlx::query(&self.sql.evict)
            .bind(id.scope().as_str().as_bytes())
            .bind(id.key().as_str())
            .execute(self.pg.pool())
            .await
            .map_err(map_error)?;
        let in_pg = self.pg.evict(id).await?;
        let in_redis = self.redis.evict(id).await?;
        Ok(in_pg || in_redis)
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats> {
        self.pg.stats(scope, stuck_after).await
    }

    /// Both tiers' notifications, whichever comes first: Redis's fires when the completion
    /// reaches Redis (`apply_completion`, right after the commit or from the relay), which is what
    /// the waiter's next `begin` reads; PostgreSQL's fires at the commit, for a waiter
    /// answered by PostgreSQL alone while Redis is down. `None` when neither tier can
    /// register the waiter in time: the waiter polls.
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        let (redis, pg) = tokio::join!(self.redis.watch(id), self.pg.watch(id));
        Watch::any(redis.into_iter().chain(pg))
    }

    /// Streams live in PostgreSQL, the arbiter that holds the lease: fenced by its token,
    /// and woken through its notifications, which [`Store::watch`] listens to as well.
    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<()> {
        self.pg.append(lease, at, bytes).await
    }

    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead> {
        self.pg.read_stream(id, from).await
    }
}
