//! Opening the store `--store` names, with `--prefix` and `--schema`: [`open`], the one
//! opener of every command, over [`idemkit::open`] (whose errors name the store without its
//! password and say what is wrong and what to do), with its errors as the exit codes want
//! them.

use std::time::Duration;

use idemkit::outbox::TieredStore;
use idemkit::postgres::PgStore;
use idemkit::url::StoreUrl;
use idemkit::{OpenErrorKind, OpenOptions};
pub use idemkit::{Opened, SchemaMode};

use crate::args::StoreArg;
use crate::error::CliError;

/// What a command opens its store for, which decides how it is opened.
#[derive(Debug, Clone, Copy)]
pub enum Use {
    /// A service (`idem serve`, `proxy`, `consume`): migrated first with `migrate`, started
    /// while its Redis is out of reach, and on PostgreSQL and tiered stores purged of
    /// expired records every `purge_every` (never when zero) for as long as the store is in
    /// use.
    Service {
        /// Apply the migrations at start (else require them).
        migrate: bool,
        /// How often expired records are deleted.
        purge_every: Duration,
    },
    /// `idem relay run`: a tiered store only, started while its Redis is down, migrated
    /// first with `migrate`; without it, the schema is left for the relay to wait for (a
    /// relay started beside `idem serve --migrate` may be up first).
    Relay {
        /// Apply the migrations at start.
        migrate: bool,
    },
    /// `idem relay dead`: the PostgreSQL store holding the outbox (the PostgreSQL half of a
    /// tiered URL, or a `postgres://` URL), whose idem and outbox migrations were applied.
    Outbox,
    /// An operator's command: a shared store (the memory store is refused), failing when
    /// it cannot be reached, with the schema as `SchemaMode` says, never purged.
    Operator(SchemaMode),
}

/// What the relay works on, for its errors.
const RELAY_STORES: &str = "the relay works on a tiered store, --store \
    tiered:REDIS_URL|POSTGRES_URL (`idem relay dead` takes its postgres:// URL too)";

/// Opens the store `args` names for `what`: a service's store starts while its Redis is out
/// of reach (on a tiered store PostgreSQL answers alone until Redis returns; on a plain
/// Redis store requests get 503 until it answers), so that a restart during an outage does
/// not crash-loop; an operator's command fails instead. [`Opened::url`] is the URL opened
/// (for [`Use::Outbox`], the PostgreSQL one).
///
/// # Errors
///
/// [`CliError::Usage`] for a URL, prefix or schema the backend refuses, or a store `what`
/// does not take; [`CliError::Unsupported`] for the memory store of an operator's command;
/// [`CliError::Open`] when the store cannot be reached, or its PostgreSQL schema is missing
/// or outdated. None carries the URL's password.
pub async fn open(args: &StoreArg, what: Use) -> Result<Opened, CliError> {
    let mut url = StoreUrl::parse(&args.store).map_err(|e| CliError::Usage(e.to_string()))?;
    let options = OpenOptions::default()
        .with_prefix(args.prefix.clone())
        .with_schema(args.schema.clone())
        .with_purge_interval(None);
    let options = match what {
        Use::Service {
            migrate,
            purge_every,
        } => options
            .with_migrate(migrate)
            .with_purge_interval((!purge_every.is_zero()).then_some(purge_every)),
        Use::Relay { migrate } => {
            if url.tiered().is_none() {
                return Err(CliError::Usage(format!("--store {url}: {RELAY_STORES}")));
            }
            let schema_mode = if migrate {
                SchemaMode::Migrate
            } else {
                SchemaMode::Leave
            };
            options.with_schema_mode(schema_mode)
        }
        Use::Outbox => {
            url = match url {
                StoreUrl::Tiered { postgres, .. } => StoreUrl::Postgres(postgres),
                StoreUrl::Postgres(postgres) => StoreUrl::Postgres(postgres),
                _ => return Err(CliError::Usage(format!("--store {url}: {RELAY_STORES}"))),
            };
            options
                .with_schema_mode(SchemaMode::Require)
                .with_wait_for_redis(false)
        }
        Use::Operator(schema_mode) => {
            // The memory store lives inside one process: another has nothing to read.
            if url == StoreUrl::Memory {
                return Err(CliError::Unsupported(
                    "the memory store lives inside one `idem serve` process and cannot be \
                     read from another; pass --store with a shared store (redis://..., \
                     postgres://...)"
                        .into(),
                ));
            }
            options
                .with_schema_mode(schema_mode)
                .with_wait_for_redis(false)
        }
    };
    let opened = idemkit::open(&url.as_str(), &options)
        .await
        .map_err(|e| match e.kind() {
            OpenErrorKind::Invalid => CliError::Usage(e.to_string()),
            _ => CliError::Open(e.to_string()),
        })?;
    if let Use::Outbox = what {
        outbox_ready(&opened).await?;
    }
    Ok(opened)
}

/// The tiered store of a store opened for [`Use::Relay`].
///
/// # Errors
///
/// [`CliError::Usage`] for a store that is not tiered.
pub fn tiered(opened: &Opened) -> Result<TieredStore, CliError> {
    let url = opened.url();
    let tiered = opened.tiered().cloned();
    tiered.ok_or_else(|| CliError::Usage(format!("--store {url}: {RELAY_STORES}")))
}

/// The PostgreSQL store holding the outbox, of a store opened for [`Use::Outbox`].
///
/// # Errors
///
/// [`CliError::Usage`] for a store without PostgreSQL.
pub fn outbox_pg(opened: &Opened) -> Result<PgStore, CliError> {
    let url = opened.url();
    let pg = opened.pg().cloned();
    pg.ok_or_else(|| CliError::Usage(format!("--store {url}: {RELAY_STORES}")))
}

/// Checks that the database of `opened` (PostgreSQL) holds the outbox's tables.
async fn outbox_ready(opened: &Opened) -> Result<(), CliError> {
    let pg = outbox_pg(opened)?;
    let pending = pg
        .pending_migrations_with(idemkit::outbox::migrator())
        .await?;
    if !pending.is_empty() {
        return Err(CliError::Open(format!(
            "the database of {} has no outbox in schema {:?}: run `idem migrate --store \
             'tiered:REDIS_URL|POSTGRES_URL'` first, or start `idem relay run --migrate`",
            opened.url(),
            pg.schema()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(url: &str) -> StoreArg {
        StoreArg {
            store: url.into(),
            prefix: None,
            schema: None,
        }
    }

    #[tokio::test]
    async fn unknown_schemes_are_usage_errors_without_the_password() {
        let opened = open(&store("memory"), Use::Relay { migrate: false }).await;
        assert!(matches!(opened, Err(CliError::Usage(_))), "{opened:?}");
        for bad in ["mysql://root:hunter2@db/x", ""] {
            let Err(CliError::Usage(msg)) = open(&store(bad), Use::Outbox).await else {
                panic!("{bad:?} is no store")
            };
            assert!(!msg.contains("hunter2"), "{msg}");
        }
    }

    #[tokio::test]
    async fn operators_refuse_the_memory_store() {
        let opened = open(&store("memory"), Use::Operator(SchemaMode::Require)).await;
        assert!(
            matches!(opened, Err(CliError::Unsupported(_))),
            "{opened:?}"
        );
    }
}
