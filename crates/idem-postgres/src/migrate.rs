//! idem's migrations, applied in its own schema with its own ledger.

use std::sync::LazyLock;

use idem_core::Error;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{self, Class, NAME};
use crate::schema::{Schema, DEFAULT_SCHEMA};

/// idem-postgres's migrations. The schema's ledger is shared with the migrations of crates
/// built on this store (idem-outbox's outbox table, at versions of their own): each
/// migrator ignores the versions it does not know, and checks those it does.
static MIGRATOR: LazyLock<Migrator> =
    LazyLock::new(|| sharing_the_ledger(sqlx::migrate!("./migrations")));

/// `migrator`, made to share a schema's ledger: it ignores the versions it does not know
/// (`Migrator::set_ignore_missing`), those of idem-postgres and of the other crates whose
/// tables live in the schema. Build the migrator of [`crate::PgStore::migrate_with`] with it.
pub fn sharing_the_ledger(mut migrator: Migrator) -> Migrator {
    migrator.set_ignore_missing(true);
    migrator
}

/// idem's migrations (the top-level `migrations/postgres/` folder, embedded at build time).
///
/// They name no schema: they create their tables in the first schema of the connection's
/// `search_path`, and sqlx keeps its ledger (`_sqlx_migrations`) there too. Prefer
/// [`migrate`] or [`crate::PgStore::migrate`], which create the schema and point the
/// `search_path` at it on a connection of their own. Run this migrator yourself only on a
/// connection whose `search_path` is idem's schema alone; on the application's usual
/// connection it would create idem's table in the application's schema and write to the
/// application's ledger.
pub fn migrator() -> &'static Migrator {
    &MIGRATOR
}

/// Applies idem's migrations in the default schema, `idem` (created if missing).
///
/// Safe to call from many instances at once: sqlx holds a PostgreSQL advisory lock while it
/// migrates, so one instance applies the migrations and the others wait, then find nothing
/// left to do. The ledger is `idem._sqlx_migrations`, apart from the application's own
/// `_sqlx_migrations`, so the two sets of migrations never meet. Applying them again is a
/// no-op.
///
/// The advisory lock is the one sqlx takes for every migrator on the same database: do not
/// call this while the same task holds a migration of the application's own in progress.
///
/// # Errors
///
/// [`Error::Unavailable`] when the database cannot be reached; [`Error::Backend`] when a
/// migration fails, or when the schema's ledger holds migrations idem does not know (the
/// schema belongs to something else).
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    migrate_schema(pool, &Schema::new(DEFAULT_SCHEMA)?).await
}

/// [`migrate`] into a given schema.
pub(crate) async fn migrate_schema(pool: &PgPool, schema: &Schema) -> Result<(), Error> {
    migrate_schema_with(pool, schema, &MIGRATOR).await
}

/// `migrator` applied in `schema`, as idem's own migrations are (see
/// [`crate::PgStore::migrate_with`]).
pub(crate) async fn migrate_schema_with(
    pool: &PgPool,
    schema: &Schema,
    migrator: &Migrator,
) -> Result<(), Error> {
    // A connection of our own, taken out of the pool for good: its search_path is changed
    // below, and it must never go back to serve the application's queries. Closing it also
    // frees sqlx's advisory lock if a migration failed with the lock held.
    let mut conn = pool.acquire().await.map_err(error::map)?.detach();
    let result = run(&mut conn, schema, migrator).await;
    // Closing is a courtesy to the server; the outcome is the migration's.
    let _ = conn.close().await;
    result
}

async fn run(conn: &mut PgConnection, schema: &Schema, migrator: &Migrator) -> Result<(), Error> {
    create_schema(conn, schema).await?;
    // Session-level and on this connection only: the migrations and sqlx's ledger resolve
    // unqualified names in idem's schema and nowhere else.
    sqlx::query(&format!("SET search_path TO {}", schema.quoted()))
        .execute(&mut *conn)
        .await
        .map_err(error::map)?;
    // `run_direct` rather than `run`: `run` goes through `Acquire`, whose higher-ranked
    // bounds make the future not `Send` for `&mut PgConnection` (sqlx keeps `run_direct`
    // public for exactly this), and callers spawn `migrate` on multi-threaded runtimes.
    migrator.run_direct(conn).await.map_err(map_migrate)
}

/// Creates the schema unless it exists. Looks first, so a role without the CREATE privilege
/// on the database can migrate a schema an administrator made for it.
async fn create_schema(conn: &mut PgConnection, schema: &Schema) -> Result<(), Error> {
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema.name())
            .fetch_one(&mut *conn)
            .await
            .map_err(error::map)?;
    if exists {
        return Ok(());
    }
    let created = sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {}", schema.quoted()))
        .execute(&mut *conn)
        .await;
    match created {
        Ok(_) => Ok(()),
        // Two instances creating the schema at once: IF NOT EXISTS does not cover the race,
        // and the loser trips the catalog's unique index (23505) or sees the schema appear
        // (42P06). Either way the schema now exists.
        Err(e) if matches!(error::sqlstate(&e).as_deref(), Some("23505" | "42P06")) => Ok(()),
        Err(e) => Err(error::map(e)),
    }
}

fn map_migrate(err: MigrateError) -> Error {
    match err {
        MigrateError::Execute(e) => error::map(e),
        // Keep the migration's version in the message unless the failure is the server
        // going away, which the caller retries like any other.
        MigrateError::ExecuteMigration(e, _) if error::kind(&e) == Class::Unavailable => {
            error::map(e)
        }
        other => Error::backend(NAME, other),
    }
}

/// The versions of `migrator`'s migrations not applied in `schema`, read from the schema's
/// ledger without changing anything: all of them when the schema or its ledger is absent.
pub(crate) async fn pending_in(
    pool: &PgPool,
    schema: &Schema,
    migrator: &Migrator,
) -> Result<Vec<i64>, Error> {
    let ledger = format!("{}._sqlx_migrations", schema.quoted());
    // to_regclass answers NULL, never an error, for a missing schema or table.
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&ledger)
        .fetch_one(pool)
        .await
        .map_err(error::map)?;
    let applied: Vec<i64> = if exists {
        sqlx::query_scalar(&format!("SELECT version FROM {ledger} WHERE success"))
            .fetch_all(pool)
            .await
            .map_err(error::map)?
    } else {
        Vec::new()
    };
    Ok(migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| m.version)
        .filter(|v| !applied.contains(v))
        .collect())
}
