//! [`Outbox`]: the outbox table of one schema, for operators (its gauges, the dead rows to
//! list and retry). PostgreSQL only.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Error;
use idem_postgres::{map_error, PgStore};
use sqlx::Row;

use crate::statements::Statements;
use crate::tiered::CHANNEL;

/// A dead outbox row, for operators ([`Outbox::dead_entries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadEntry {
    /// The row's id, for [`Outbox::retry_dead`].
    pub id: i64,
    /// The record's scope (invalid UTF-8 shown lossily: that may be why it died).
    pub scope: String,
    /// The record's key.
    pub key: String,
    /// Failed applications.
    pub tries: u32,
    /// The last failure.
    pub last_error: Option<String>,
    /// Time since the completion committed.
    pub age: Duration,
}

/// The outbox table of one schema, for operators: its gauges, and the dead rows to list
/// and retry. Needs PostgreSQL only. Cheap to clone.
///
/// ```no_run
/// # async fn example() -> Result<(), idem_core::Error> {
/// use idem_outbox::Outbox;
/// use idem_postgres::PgStore;
///
/// let outbox = Outbox::new(PgStore::connect("postgres://app@127.0.0.1/app").await?);
/// for dead in outbox.dead_entries(100).await? {
///     println!("{} {}/{}: {:?}", dead.id, dead.scope, dead.key, dead.last_error);
/// }
/// outbox.retry_dead(None).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    pg: PgStore,
    pub(crate) sql: Arc<Statements>,
}

/// The outbox's gauges, read by [`Outbox::gauges`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Gauges {
    /// Rows waiting to be relayed (due now or waiting for a retry).
    pub backlog: u64,
    /// Dead rows.
    pub dead: u64,
    /// Age in seconds of the oldest row waiting to be relayed; 0 when there is none.
    pub lag_seconds: f64,
}

impl Outbox {
    /// The outbox in `pg`'s schema (created by [`crate::migrate`]).
    pub fn new(pg: PgStore) -> Self {
        Self {
            sql: Arc::new(Statements::new(pg.quoted_schema())),
            pg,
        }
    }

    /// The schema.
    pub fn schema(&self) -> &str {
        self.pg.schema()
    }

    /// Reads backlog, dead rows and lag: one `count(*)` over the outbox.
    ///
    /// # Errors
    ///
    /// PostgreSQL errors.
    pub async fn gauges(&self) -> Result<Gauges, Error> {
        let row = sqlx::query(&self.sql.gauges)
            .fetch_one(self.pg.pool())
            .await
            .map_err(map_error)?;
        let backlog: i64 = row.try_get("backlog").map_err(map_error)?;
        let dead: i64 = row.try_get("dead").map_err(map_error)?;
        let lag: f64 = row.try_get("lag").map_err(map_error)?;
        Ok(Gauges {
            backlog: u64::try_from(backlog).unwrap_or(0),
            dead: u64::try_from(dead).unwrap_or(0),
            lag_seconds: lag.max(0.0),
        })
    }

    /// The dead rows, oldest first, at most `limit`: what `idem relay dead list` prints.
    ///
    /// # Errors
    ///
    /// PostgreSQL errors.
    pub async fn dead_entries(&self, limit: u32) -> Result<Vec<DeadEntry>, Error> {
        let rows = sqlx::query(&self.sql.dead)
            .bind(i64::from(limit))
            .fetch_all(self.pg.pool())
            .await
            .map_err(map_error)?;
        rows.iter()
            .map(|row| {
                let scope: Vec<u8> = row.try_get("scope")?;
                let tries: i32 = row.try_get("tries")?;
                let age: f64 = row.try_get("age")?;
                Ok(DeadEntry {
                    id: row.try_get("id")?,
                    scope: String::from_utf8_lossy(&scope).into_owned(),
                    key: row.try_get("key")?,
                    tries: u32::try_from(tries).unwrap_or(0),
                    last_error: row.try_get("last_error")?,
                    age: Duration::try_from_secs_f64(age.max(0.0)).unwrap_or_default(),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(map_error)
    }

    /// Makes dead rows pending again (tries back to 0, due now, relays woken): all of them
    /// with `ids` = `None`, or those listed. Returns how many rows came back. The last
    /// error is kept until the next failure replaces it.
    ///
    /// # Errors
    ///
    /// PostgreSQL errors.
    pub async fn retry_dead(&self, ids: Option<&[i64]>) -> Result<u64, Error> {
        let query = match ids {
            None => sqlx::query_scalar(&self.sql.retry_all),
            Some(_) => sqlx::query_scalar(&self.sql.retry_ids),
        }
        .bind(CHANNEL)
        .bind(self.pg.schema());
        let query = match ids {
            Some(ids) => query.bind(ids),
            None => query,
        };
        let n: i64 = query.fetch_one(self.pg.pool()).await.map_err(map_error)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
