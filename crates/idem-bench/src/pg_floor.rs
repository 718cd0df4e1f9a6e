//! PostgreSQL: the two-statement floor (an insert that does nothing on conflict, then an
//! update of that row) on a scratch copy of idem's table, through the store's own pool.

use std::sync::Arc;
use std::time::Duration;

use idemkit::postgres::PgStore;
use idemkit::FencingToken;
use sqlx::PgPool;

use crate::phases::drive;
use crate::report::PhaseReport;

/// The floor's table, beside idem's in the run's schema.
#[derive(Debug, Clone)]
pub struct PgSide {
    pool: PgPool,
    /// `"schema".floor`.
    table: String,
    /// `"schema"`.
    schema: String,
}

impl PgSide {
    /// Creates `floor` in the store's schema, with idem's columns, primary key and
    /// defaults (`LIKE ... INCLUDING ALL`), so both write the same rows into the same
    /// index shape.
    pub async fn create(store: &PgStore) -> Result<Self, String> {
        let schema = store.quoted_schema().to_owned();
        let table = format!("{schema}.floor");
        sqlx::query(&format!(
            "CREATE TABLE {table} (LIKE {schema}.records INCLUDING ALL)"
        ))
        .execute(store.pool())
        .await
        .map_err(|e| format!("postgres: creating the floor table: {e}"))?;
        Ok(Self {
            pool: store.pool().clone(),
            table,
            schema,
        })
    }

    /// `n` pairs of statements (insert on a new key, then complete it) from `concurrency`
    /// callers, each statement a round trip of its own, as `begin` + `complete` are.
    pub async fn floor(
        &self,
        n: usize,
        concurrency: usize,
        body_bytes: usize,
    ) -> Result<PhaseReport, String> {
        let insert: Arc<str> = format!(
            "INSERT INTO {} (scope, key, fingerprint, attempt, token, lease_until, expires_at) \
             VALUES ($1, $2, $3, 1, $4, clock_timestamp() + $5, clock_timestamp() + $5 + $6) \
             ON CONFLICT (scope, key) DO NOTHING",
            self.table
        )
        .into();
        let update: Arc<str> = format!(
            "UPDATE {} SET token = NULL, lease_until = NULL, meta = $4, body = $5, \
             expires_at = clock_timestamp() + $6 \
             WHERE scope = $1 AND key = $2 AND token = $3",
            self.table
        )
        .into();
        let body: Arc<[u8]> = vec![b'x'; body_bytes].into();
        let pool = self.pool.clone();
        drive("postgres insert+update", n, concurrency, move |i| {
            let (pool, insert, update, body) =
                (pool.clone(), insert.clone(), update.clone(), body.clone());
            async move {
                let key = format!("floor-{i}");
                let token = *FencingToken::random().as_uuid();
                let err = |e: sqlx::Error| format!("postgres floor: {e}");
                let inserted = sqlx::query(&insert)
                    .bind(&b"bench"[..])
                    .bind(&key)
                    .bind(&[7u8; 32][..])
                    .bind(token)
                    .bind(Duration::from_secs(30))
                    .bind(Duration::from_secs(600))
                    .execute(&pool)
                    .await
                    .map_err(err)?;
                if inserted.rows_affected() != 1 {
                    return Err(format!("postgres floor: key {key} existed"));
                }
                sqlx::query(&update)
                    .bind(&b"bench"[..])
                    .bind(&key)
                    .bind(token)
                    .bind(&b"meta"[..])
                    .bind(&body[..])
                    .bind(Duration::from_secs(600))
                    .execute(&pool)
                    .await
                    .map_err(err)?;
                Ok("written")
            }
        })
        .await
    }

    /// Drops the run's schema: idem's table, its ledger and the floor's table.
    pub async fn drop_schema(&self) -> Result<(), String> {
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| format!("postgres: dropping schema {}: {e}", self.schema))
    }
}
