//! [`TieredStore`]: Redis first, PostgreSQL as the arbiter.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::telemetry::KeyHash;
use idem_core::{
    Begin, BeginRequest, Completion, Error, Lease, Record, RecordId, RecordState, Replay, Result,
    Scope, Stats, Store, Watch,
};
use idem_postgres::{map_error, PgStore};

use crate::statements::Statements;
use idem_redis::{Applied, OversizeBody, RedisStore};
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

/// A [`Store`] with Redis as the fast path and PostgreSQL as the source of truth.
///
/// - `begin` asks Redis first. A replay, an in-flight answer or a mismatch from Redis is the
///   answer (one Redis round trip). When Redis grants the lease, PostgreSQL is asked too,
///   with the same token, and its answer wins: a completion committed there (which Redis
///   may have lost to a flush, a failover or eviction) is replayed and written back into
///   Redis, and a lease held there by another worker is in flight. When Redis is
///   unavailable, PostgreSQL alone answers.
/// - `complete` ([`TieredStore::complete_in`] inside the business transaction) writes the
///   completed record and an outbox row in one PostgreSQL transaction; after the commit the
///   completion is written into Redis at once ([`TieredStore::publish`]), and in any case by
///   the relay ([`crate::Relay`]), at least once.
/// - `release` and `extend` act on PostgreSQL (whose answer counts) and then on Redis.
/// - `watch` (a waiter for another worker's result) listens to both tiers.
///
/// See the [crate docs](crate) for the exact guarantee and its cost.
#[derive(Debug, Clone)]
pub struct TieredStore {
    redis: RedisStore,
    pg: PgStore,
    sql: Arc<Statements>,
}

impl TieredStore {
    /// Tiers `redis` over `pg`. Run [`TieredStore::migrate`] (or [`crate::migrate`]) once
    /// first: it creates the records table and the outbox table.
    pub fn new(redis: RedisStore, pg: PgStore) -> Self {
        let sql = Arc::new(Statements::new(pg.quoted_schema()));
        Self { redis, pg, sql }
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
        let applied = self.apply(lease.id(), lease, completion, retention).await;
        self.let_go_unless_applied(lease, &applied).await;
        applied
    }

    /// After a failed or refused write of a completion into Redis, gives back the Redis
    /// lease `lease` holds there (token-fenced: a lease someone else holds is left alone).
    /// Otherwise retries would see it in flight until it expired; without it they go on to
    /// PostgreSQL, which replays the committed response.
    async fn let_go_unless_applied(&self, lease: &Lease, applied: &Result<Applied, Error>) {
        if matches!(applied, Ok(Applied::Written | Applied::AlreadyCompleted)) {
            return;
        }
        if let Err(e) = self.redis.release(lease).await {
            tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "Redis lease not released");
        }
    }

    /// Writes a committed completion into Redis over `lease`'s in-progress record there, or
    /// into an absent key.
    async fn apply(
        &self,
        id: &RecordId,
        lease: &Lease,
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
            .redis
            .apply_completion(id, None, lease.token(), completion, ttl)
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
        self.redis
            .apply_completion(
                id,
                Some((&record.fingerprint, record.attempt)),
                lease.token(),
                completion,
                record.expires_in,
            )
            .await
    }

    /// PostgreSQL's answer to a `begin` that Redis granted.
    async fn arbitrate(&self, req: &BeginRequest<'_>, redis_lease: Lease) -> Result<Begin> {
        let answer = match self.pg.begin(req.clone()).await {
            Ok(answer) => answer,
            Err(e) => {
                // Without the arbiter nothing may run: give the Redis lease back.
                let _ = self.redis.release(&redis_lease).await;
                return Err(e);
            }
        };
        match answer {
            Begin::Acquired(pg_lease) | Begin::TookOver(pg_lease) => {
                // The same token holds both leases, and PostgreSQL's decides: Redis's may
                // have run out while this call waited on a row lock, which is harmless (a
                // caller taking the key over in Redis then meets this lease in PostgreSQL).
                // After such a wait, Redis's lease is renewed to match, best effort.
                if redis_lease.remaining() < pg_lease.remaining() / 2 {
                    let _ = self.redis.extend(&redis_lease, req.lease).await;
                }
                Ok(if pg_lease.attempt() == 1 {
                    Begin::Acquired(pg_lease)
                } else {
                    Begin::TookOver(pg_lease)
                })
            }
            Begin::Replay(replay) => {
                // Redis had lost the completion: write it back, fenced by our Redis lease.
                self.repair(&redis_lease, &replay).await;
                Ok(Begin::Replay(replay))
            }
            other @ (Begin::InFlight { .. } | Begin::Mismatch) => {
                // Another worker holds the key in PostgreSQL (Redis lost its lease), or the
                // key belongs to another request: our Redis lease must not linger.
                let _ = self.redis.release(&redis_lease).await;
                Ok(other)
            }
        }
    }

    async fn repair(&self, redis_lease: &Lease, replay: &Replay) {
        let id = redis_lease.id();
        let result = self
            .apply(id, redis_lease, &replay.completion, replay.expires_in)
            .await;
        self.let_go_unless_applied(redis_lease, &result).await;
        if let Err(e) = result {
            tracing::warn!(key_hash = %KeyHash::of(id), error = %e, "could not write a replayed completion back into Redis");
        }
    }
}

#[async_trait]
impl Store for TieredStore {
    fn name(&self) -> &'static str {
        STORE
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin> {
        // In Redis an in-progress record lives only as long as its lease: PostgreSQL keeps
        // the attempt count and the fingerprint past it, and a Redis record left behind (a
        // release that failed, a begin cancelled half-way) must not answer in flight or
        // mismatch for a whole retention.
        let fast = BeginRequest {
            retention: Duration::ZERO,
            ..req.clone()
        };
        match self.redis.begin(fast).await {
            Ok(Begin::Acquired(lease) | Begin::TookOver(lease)) => {
                self.arbitrate(&req, lease).await
            }
            Ok(answer) => Ok(answer),
            Err(e) if e.is_retryable() => {
                // Redis is down: the arbiter alone still keeps every guarantee.
                tracing::warn!(error = %e, "Redis unavailable: begin answered by PostgreSQL alone");
                self.pg.begin(req).await
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
        if let Err(e) = self.redis.release(lease).await {
            // The Redis lease expires on its own; until then retries see in flight.
            tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "Redis lease not released");
        }
        Ok(())
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        let renewed = self.pg.extend(lease, by).await?;
        if let Err(e) = self.redis.extend(lease, by).await {
            tracing::debug!(key_hash = %KeyHash::of(lease.id()), error = %e, "Redis lease not extended");
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
    /// reaches Redis (`apply.lua`, right after the commit or from the relay), which is what
    /// the waiter's next `begin` reads; PostgreSQL's fires at the commit, for a waiter
    /// answered by PostgreSQL alone while Redis is down. `None` when neither tier can
    /// register the waiter in time: the waiter polls.
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        let (redis, pg) = tokio::join!(self.redis.watch(id), self.pg.watch(id));
        Watch::any(redis.into_iter().chain(pg))
    }
}
