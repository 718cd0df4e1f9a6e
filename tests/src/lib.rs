//! Test-only package: see `tests/`. This library holds what its test files share: record
//! ids and begin requests, and the business table that the protected work of the PostgreSQL and tiered tests
//! writes to, in the test store's own schema. Its functions panic when the server refuses.

use std::collections::HashMap;

use idem_core::{Key, RecordId, Scope};
use idem_postgres::PgStore;
use sqlx::PgConnection;

pub use idem_testkit::cases::{request, KEEP, LONG};

/// `key` in the scope `tenant`.
///
/// # Panics
///
/// When `key` is not a valid key.
pub fn id(key: &str) -> RecordId {
    RecordId::new(
        Scope::new("tenant").expect("scope"),
        Key::new(key).expect("key"),
    )
}

/// The business table that the protected work writes to, one row per run: `work (key,
/// worker)` in the store's schema.
fn work_table(store: &PgStore) -> String {
    format!("{}.work", store.quoted_schema())
}

/// Creates the business table `work (key, worker)` in the store's schema.
pub async fn create_work_table(store: &PgStore) {
    sqlx::query(&format!(
        "CREATE TABLE {} (key text NOT NULL, worker integer NOT NULL)",
        work_table(store)
    ))
    .execute(store.pool())
    .await
    .expect("create the work table");
}

/// A run of the protected work for `key` by `worker`, on `conn` (in a business transaction,
/// say).
pub async fn insert_work(conn: &mut PgConnection, store: &PgStore, key: &str, worker: i32) {
    sqlx::query(&format!(
        "INSERT INTO {} (key, worker) VALUES ($1, $2)",
        work_table(store)
    ))
    .bind(key)
    .bind(worker)
    .execute(conn)
    .await
    .expect("business write");
}

/// How many times the work ran, by key.
pub async fn work_rows(store: &PgStore) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT key, count(*) FROM {} GROUP BY key",
        work_table(store)
    ))
    .fetch_all(store.pool())
    .await
    .expect("count work rows");
    rows.into_iter().collect()
}

/// How many times the work of `key` ran.
pub async fn runs(store: &PgStore, key: &str) -> i64 {
    work_rows(store).await.get(key).copied().unwrap_or(0)
}
