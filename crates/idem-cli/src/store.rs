//! Opening the store `--store` names, with `--prefix` and `--schema`: [`idemkit::open`] (the
//! one opener of stores, whose errors name the store without its password and say what is
//! wrong and what to do), its errors as the exit codes want them, and the relay's stores.

use idemkit::outbox::TieredStore;
use idemkit::postgres::PgStore;
use idemkit::url::StoreUrl;
use idemkit::{OpenErrorKind, OpenOptions};
pub use idemkit::{Opened, SchemaMode};

use crate::{CliError, StoreArg};

/// Reads a `--store` value.
///
/// # Errors
///
/// [`CliError::Usage`] for an unknown scheme (the message names what is accepted).
pub fn parse(url: &str) -> Result<StoreUrl, CliError> {
    StoreUrl::parse(url).map_err(|e| CliError::Usage(e.to_string()))
}

/// Opens the store `url` with the `--prefix` and `--schema` of `args`. A store a service
/// runs on (`serving`: `idem serve`, `proxy`, `relay run`) starts while its Redis is out of
/// reach (on a tiered store PostgreSQL answers alone until Redis returns; on a plain Redis
/// store requests get 503 until it answers), so that a restart during an outage does not
/// crash-loop; an operator's command fails instead.
///
/// # Errors
///
/// [`CliError::Usage`] for a URL, prefix or schema the backend refuses; [`CliError::Open`]
/// when the store cannot be reached, or its PostgreSQL schema is missing or outdated under
/// [`SchemaMode::Require`]. Neither carries the URL's password.
pub async fn open(
    url: &StoreUrl,
    args: &StoreArg,
    schema_mode: SchemaMode,
    serving: bool,
) -> Result<Opened, CliError> {
    let options = OpenOptions::default()
        .with_purge_interval(None)
        .with_prefix(args.prefix.clone())
        .with_schema(args.schema.clone())
        .with_schema_mode(schema_mode)
        .with_wait_for_redis(serving);
    idemkit::open(&url.as_str(), &options)
        .await
        .map_err(|e| match e.kind() {
            OpenErrorKind::Invalid => CliError::Usage(e.to_string()),
            _ => CliError::Open(e.to_string()),
        })
}

/// What the relay works on, for its errors.
const RELAY_STORES: &str = "the relay works on a tiered store, --store \
    tiered:REDIS_URL|POSTGRES_URL (`idem relay dead` takes its postgres:// URL too)";

/// Opens the tiered store of `idem relay run`: started while its Redis is down, migrated
/// first with `migrate`; without it, the schema is left for the relay to wait for (a relay
/// started beside `idem serve --migrate` may be up first).
///
/// # Errors
///
/// As [`open`]; [`CliError::Usage`] for a store that is not tiered.
pub async fn open_relay(
    args: &StoreArg,
    migrate: bool,
) -> Result<(StoreUrl, TieredStore), CliError> {
    let url = parse(&args.store)?;
    if url.tiered().is_some() {
        let schema_mode = if migrate {
            SchemaMode::Migrate
        } else {
            SchemaMode::Leave
        };
        if let Some(tiered) = open(&url, args, schema_mode, true).await?.tiered() {
            return Ok((url, tiered.clone()));
        }
    }
    Err(CliError::Usage(format!("--store {url}: {RELAY_STORES}")))
}

/// Opens the PostgreSQL store holding the outbox of `idem relay dead`: the PostgreSQL half
/// of a tiered URL, or a `postgres://` URL, with idem's and the outbox's migrations applied.
///
/// # Errors
///
/// As [`open`]; [`CliError::Usage`] for a store without PostgreSQL.
pub async fn open_outbox(args: &StoreArg) -> Result<PgStore, CliError> {
    let url = match parse(&args.store)? {
        StoreUrl::Tiered { postgres, .. } => StoreUrl::Postgres(postgres),
        url => url,
    };
    let opened = open(&url, args, SchemaMode::Require, false).await?;
    let Some(pg) = opened.pg().cloned() else {
        return Err(CliError::Usage(format!("--store {url}: {RELAY_STORES}")));
    };
    let pending = pg
        .pending_migrations_with(idemkit::outbox::migrator())
        .await?;
    if !pending.is_empty() {
        return Err(CliError::Open(format!(
            "the database of {url} has no outbox in schema {:?}: run `idem migrate --store \
             'tiered:REDIS_URL|POSTGRES_URL'` first, or start `idem relay run --migrate`",
            pg.schema()
        )));
    }
    Ok(pg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_schemes_are_usage_errors_without_the_password() {
        assert_eq!(parse("memory").unwrap(), StoreUrl::Memory);
        for bad in ["mysql://root:hunter2@db/x", ""] {
            let Err(CliError::Usage(msg)) = parse(bad) else {
                panic!("{bad:?} is no store")
            };
            assert!(!msg.contains("hunter2"), "{msg}");
        }
    }
}
