//! For operators: [`PgStore::stuck`], the records whose worker is gone, and
//! [`PgStore::corrupt`], the completed records that cannot be read.

use std::time::Duration;

use idem_core::{encode_meta, CompletionKind, Error, Key, RecordId, Response, Scope};
use sqlx::Row;

use crate::error::{self, NAME};
use crate::store::PgStore;

/// An in-progress record whose lease expired long ago, with no retry to take it over.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckRecord {
    /// The record.
    pub id: RecordId,
    /// The attempt that holds it.
    pub attempt: u32,
    /// How long ago its lease expired, by the database's clock.
    pub expired_for: Duration,
}

impl PgStore {
    /// The in-progress records (in `scope`, or in all) whose lease expired more than
    /// `stuck_after` ago, the longest expired first, at most `limit`: the records that
    /// [`idem_core::Store::stats`] counts as stuck. Reads only.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the database cannot be reached; [`Error::Corrupt`] for a
    /// row whose scope or key is not valid; [`Error::Backend`] otherwise (a missing table).
    pub async fn stuck(
        &self,
        scope: Option<&Scope>,
        stuck_after: Duration,
        limit: u32,
    ) -> Result<Vec<StuckRecord>, Error> {
        let sql = include_str!("sql/stuck.sql")
            .replace("{records}", &format!("{}.records", self.quoted_schema()));
        let after = sqlx::postgres::types::PgInterval {
            months: 0,
            days: 0,
            microseconds: i64::try_from(stuck_after.min(crate::MAX_DURATION).as_micros())
                .unwrap_or(i64::MAX),
        };
        let rows = sqlx::query(&sql)
            .bind(scope.map(|s| s.as_str().as_bytes()))
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await
            .map_err(error::map)?;
        rows.iter()
            .map(|row| {
                let attempt: i32 = row.try_get("attempt").map_err(error::map)?;
                let expired_us: i64 = row.try_get("expired_us").map_err(error::map)?;
                Ok(StuckRecord {
                    id: record_id(row)?,
                    attempt: u32::try_from(attempt)
                        .map_err(|_| Error::corrupt(NAME, "a stuck row's attempt"))?,
                    expired_for: Duration::from_micros(u64::try_from(expired_us).unwrap_or(0)),
                })
            })
            .collect()
    }

    /// The live completed records (in `scope`, or in all) whose metadata idem cannot read:
    /// too short, another version, or an unknown completion kind (the headers are checked
    /// only when a record is read). Every request for such a key fails until it is evicted.
    /// Answers how many there are in all, and the first `limit` (by scope and key). Reads
    /// the whole table (or the scope's rows): an operator's tool.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the database cannot be reached; [`Error::Corrupt`] for a
    /// row whose scope or key is not valid; [`Error::Backend`] otherwise (a missing table).
    pub async fn corrupt(
        &self,
        scope: Option<&Scope>,
        limit: u32,
    ) -> Result<(u64, Vec<RecordId>), Error> {
        let sql = include_str!("sql/corrupt.sql")
            .replace("{records}", &format!("{}.records", self.quoted_schema()));
        // The version byte idem writes, read off what it writes.
        let version = encode_meta(CompletionKind::Succeeded, &Response::new(200, ""))[0];
        // One row at least, to read the total from, even when no record is wanted.
        let rows = sqlx::query(&sql)
            .bind(scope.map(|s| s.as_str().as_bytes()))
            .bind(i32::from(version))
            .bind(i64::from(limit.max(1)))
            .fetch_all(self.pool())
            .await
            .map_err(error::map)?;
        let total = match rows.first() {
            Some(row) => row.try_get::<i64, _>("total").map_err(error::map)?,
            None => 0,
        };
        let ids = rows
            .iter()
            .take(limit as usize)
            .map(record_id)
            .collect::<Result<_, _>>()?;
        Ok((u64::try_from(total).unwrap_or(0), ids))
    }
}

/// The record a row of `stuck.sql` or `corrupt.sql` names.
fn record_id(row: &sqlx::postgres::PgRow) -> Result<RecordId, Error> {
    let scope: Vec<u8> = row.try_get("scope").map_err(error::map)?;
    let key: String = row.try_get("key").map_err(error::map)?;
    let bad = |what: &str| Error::corrupt(NAME, format!("a row's {what}"));
    let scope = String::from_utf8(scope)
        .ok()
        .and_then(|s| Scope::new(s).ok())
        .ok_or_else(|| bad("scope"))?;
    let key = Key::new(key).map_err(|_| bad("key"))?;
    Ok(RecordId::new(scope, key))
}
