//! The outbox's schema: its own migrations (the top-level `migrations/outbox/` folder,
//! embedded at build time), applied beside idem-postgres's `records` in the store's schema.

use std::sync::LazyLock;

use idem_core::Error;
use idem_postgres::PgStore;
use sqlx::migrate::Migrator;

/// The outbox's migrations. Their versions (from 1001) stay clear of idem-postgres's, whose
/// ledger in the schema they share; each migrator ignores the other's versions.
static MIGRATOR: LazyLock<Migrator> =
    LazyLock::new(|| idem_postgres::sharing_the_ledger(sqlx::migrate!("./migrations")));

/// The outbox's migrations, for tools that list them. Apply them with [`migrate`], which
/// runs them in the store's schema.
pub fn migrator() -> &'static Migrator {
    &MIGRATOR
}

/// Applies idem-postgres's migrations and then the outbox's in `pg`'s schema: everything
/// [`crate::TieredStore`] and [`crate::Relay`] need. Safe from many instances at once, and a
/// no-op when already applied.
///
/// A database migrated by an idem-postgres that still created the outbox table itself (its
/// former `0002_outbox`) keeps working: the outbox migration creates the table and its index
/// only if they are missing, and idem-postgres ignores the version it no longer has.
///
/// # Errors
///
/// As [`PgStore::migrate`].
pub async fn migrate(pg: &PgStore) -> Result<(), Error> {
    pg.migrate().await?;
    pg.migrate_with(&MIGRATOR).await
}
