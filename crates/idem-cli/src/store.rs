//! Opening the store `--store` names ([`StoreUrl`], idem-core's one parser of store URLs),
//! with `--prefix` and `--schema`, with errors that name it without its password and say
//! what is wrong (nothing listening, no answer, another protocol on that port) and what to
//! do.
//!
//! `idem serve` opens its store migrated; the operator commands open theirs without changing
//! the schema unless asked ([`SchemaMode`], `idem migrate`).

use std::sync::Arc;

use idem_core::{Error, MemoryStore, Store};
use idemkit::outbox::TieredStore;
use idemkit::postgres::PgStore;
use idemkit::redis::{RedisStore, RedisStoreBuilder};
use idemkit::url::StoreUrl;

use crate::CliError;

/// Reads a `--store` value.
///
/// # Errors
///
/// [`CliError::Usage`] for an unknown scheme (the message names what is accepted).
pub fn parse(url: &str) -> Result<StoreUrl, CliError> {
    StoreUrl::parse(url).map_err(|e| CliError::Usage(e.to_string()))
}

/// How to open a store.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The Redis key prefix (`--prefix`); the store's default (`idem:`) when `None`.
    pub prefix: Option<String>,
    /// The PostgreSQL schema (`--schema`); `idem` when `None`.
    pub schema: Option<String>,
    /// What to do with PostgreSQL's schema.
    pub schema_mode: SchemaMode,
    /// Start while Redis is out of reach instead of failing: for `idem serve`, so that a
    /// restart during a Redis outage does not crash-loop. On a tiered store PostgreSQL
    /// answers alone until Redis returns; on a plain Redis store requests get 503 (fail
    /// closed) until it answers. This also marks the store as one a service runs on: only
    /// such a store warns that Redis persists nothing (an operator's command reading
    /// records is no reason to).
    pub without_redis: bool,
}

/// What opening a store does with PostgreSQL's schema.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SchemaMode {
    /// Check that every migration was applied; a missing or outdated schema is an error
    /// that says to run `idem migrate`. Changes nothing.
    #[default]
    Require,
    /// Apply the migrations (`idem migrate`, `idem serve --migrate`).
    Migrate,
    /// Neither check nor migrate (`idem migrate` looks for itself).
    Leave,
}

/// An open store, by backend: the operator commands do more on some than [`Store`] offers.
#[derive(Debug)]
pub enum Opened {
    /// The memory store.
    Memory(Arc<MemoryStore>),
    /// Redis, one server or a cluster.
    Redis(RedisStore),
    /// PostgreSQL.
    Postgres(PgStore),
    /// Redis in front of PostgreSQL.
    Tiered(TieredStore),
}

impl Opened {
    /// The store as the engine and the middleware take it.
    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Self::Memory(store) => store.clone(),
            Self::Redis(store) => Arc::new(store.clone()),
            Self::Postgres(store) => Arc::new(store.clone()),
            Self::Tiered(store) => Arc::new(store.clone()),
        }
    }

    /// The PostgreSQL store, when there is one (alone or as the arbiter of a tiered store).
    pub fn pg(&self) -> Option<&PgStore> {
        match self {
            Self::Postgres(pg) => Some(pg),
            Self::Tiered(tiered) => Some(tiered.pg()),
            _ => None,
        }
    }
}

/// Opens the store `url` names with `options`.
///
/// # Errors
///
/// [`CliError::Usage`] for a URL, prefix or schema the backend refuses;
/// [`CliError::Open`] when the store cannot be reached (saying why and what to check), or
/// when its PostgreSQL schema is missing or outdated under [`SchemaMode::Require`]. Neither
/// carries the URL's password.
pub async fn open_with(url: &StoreUrl, options: &Options) -> Result<Opened, CliError> {
    match url {
        StoreUrl::Memory => Ok(Opened::Memory(Arc::new(MemoryStore::new()))),
        StoreUrl::Redis(redis) => {
            let opened = if options.without_redis {
                open_redis_or_wait(redis, options, false).await
            } else {
                open_redis(redis, options, false).await
            };
            match opened {
                Ok(store) => Ok(Opened::Redis(store)),
                Err(e) => Err(failure(url, redis, e).await),
            }
        }
        StoreUrl::Postgres(postgres) => {
            let pg = match open_pg(postgres, options).await {
                Ok(pg) => pg,
                Err(e) => return Err(failure(url, postgres, e).await),
            };
            ready_schema(url, &pg, options, false).await?;
            Ok(Opened::Postgres(pg))
        }
        StoreUrl::Tiered { redis, postgres } => Ok(Opened::Tiered(
            open_tiered(url, redis, postgres, options).await?,
        )),
        other => Err(CliError::Unsupported(format!(
            "no store for {other} in this build"
        ))),
    }
}

/// Opens the tiered store `url`, whose halves are `redis` and `postgres`.
async fn open_tiered(
    url: &StoreUrl,
    redis: &str,
    postgres: &str,
    options: &Options,
) -> Result<TieredStore, CliError> {
    let pg = match open_pg(postgres, options).await {
        Ok(pg) => pg,
        Err(e) => return Err(failure(url, postgres, e).await),
    };
    // Redis before the schema: a Redis URL it refuses is found before a migration writes
    // anything.
    let opened = if options.without_redis {
        open_redis_or_wait(redis, options, true).await
    } else {
        open_redis(redis, options, true).await
    };
    let redis = match opened {
        Ok(redis) => redis,
        Err(e) => return Err(failure(url, redis, e).await),
    };
    ready_schema(url, &pg, options, true).await?;
    Ok(TieredStore::new(redis, pg))
}

/// What the relay works on, for its errors.
const RELAY_STORES: &str = "the relay works on a tiered store, --store \
    tiered:REDIS_URL|POSTGRES_URL (`idem relay dead` takes its postgres:// URL too)";

/// Opens the tiered store of `idem relay run`: started while its Redis is down, migrated
/// first with `migrate`.
///
/// # Errors
///
/// As [`open_with`]; [`CliError::Usage`] for a store that is not tiered.
pub async fn open_relay(
    args: &crate::StoreArg,
    migrate: bool,
) -> Result<(StoreUrl, TieredStore), CliError> {
    let url = parse(&args.store)?;
    let Some((redis, postgres)) = url.tiered() else {
        return Err(CliError::Usage(format!("--store {url}: {RELAY_STORES}")));
    };
    let schema_mode = if migrate {
        SchemaMode::Migrate
    } else {
        SchemaMode::Require
    };
    let options = Options {
        without_redis: true,
        ..args.options(schema_mode)
    };
    let tiered = open_tiered(&url, redis, postgres, &options).await?;
    Ok((url, tiered))
}

/// Opens the PostgreSQL store holding the outbox of `idem relay dead`: the PostgreSQL half
/// of a tiered URL, or a `postgres://` URL, its idem and outbox migrations applied.
///
/// # Errors
///
/// As [`open_with`]; [`CliError::Usage`] for a store without an outbox.
pub async fn open_outbox(args: &crate::StoreArg) -> Result<PgStore, CliError> {
    let url = parse(&args.store)?;
    let postgres = match &url {
        StoreUrl::Tiered { postgres, .. } | StoreUrl::Postgres(postgres) => postgres,
        _ => return Err(CliError::Usage(format!("--store {url}: {RELAY_STORES}"))),
    };
    let options = args.options(SchemaMode::Require);
    let pg = match open_pg(postgres, &options).await {
        Ok(pg) => pg,
        Err(e) => return Err(failure(&url, postgres, e).await),
    };
    ready_schema(&url, &pg, &options, true).await?;
    Ok(pg)
}

/// The builder of a Redis store. It warns that Redis persists nothing only for a store a
/// service runs on ([`Options::without_redis`]), and never for the Redis of a tiered store
/// (`tiered`), which needs no persistence: PostgreSQL is the arbiter.
fn redis_builder(url: &str, options: &Options, tiered: bool) -> RedisStoreBuilder {
    let builder = RedisStore::builder(url).with_persistence_check(options.without_redis && !tiered);
    match &options.prefix {
        Some(prefix) => builder.with_prefix(prefix.clone()),
        None => builder,
    }
}

async fn open_redis(url: &str, options: &Options, tiered: bool) -> Result<RedisStore, Error> {
    redis_builder(url, options, tiered).connect().await
}

/// [`open_redis`], or the store built without Redis when it is out of reach, said in the
/// log in one line (and `Redis reachable` once it answers).
async fn open_redis_or_wait(
    url: &str,
    options: &Options,
    tiered: bool,
) -> Result<RedisStore, Error> {
    let name = idemkit::url::redact(url);
    let (redis, answered) = redis_builder(url, options, tiered)
        .connect_or_wait(&name)
        .await?;
    if !answered && tiered {
        tracing::warn!(
            redis = %name,
            "Redis unreachable at start: PostgreSQL answers alone, and completions wait in \
             its outbox, until it returns"
        );
    } else if !answered {
        tracing::warn!(
            redis = %name,
            "Redis unreachable at start: guarded requests get 503 until it answers"
        );
    }
    Ok(redis)
}

async fn open_pg(url: &str, options: &Options) -> Result<PgStore, Error> {
    // The schema name is checked before connecting: a bad one is bad input whether or not
    // the server answers.
    let schema = options
        .schema
        .as_deref()
        .unwrap_or(idemkit::postgres::DEFAULT_SCHEMA);
    let pool = PgStore::pool_options()
        .connect_lazy(url)
        .map_err(|e| Error::Invalid(format!("postgres url: {e}")))?;
    let store = PgStore::new(pool).with_schema(schema)?;
    // Reach the server now, so that a wrong URL fails here.
    store
        .pool()
        .acquire()
        .await
        .map_err(idemkit::postgres::map_error)?;
    Ok(store)
}

/// Migrates, or checks that nothing is left to migrate, as `options` say: opening a store to
/// read it must not need DDL rights nor create schemas.
async fn ready_schema(
    url: &StoreUrl,
    pg: &PgStore,
    options: &Options,
    outbox: bool,
) -> Result<(), CliError> {
    let fail = |e: Error| plain_failure(url, e);
    match options.schema_mode {
        SchemaMode::Leave => return Ok(()),
        SchemaMode::Migrate if outbox => return idemkit::outbox::migrate(pg).await.map_err(fail),
        SchemaMode::Migrate => return pg.migrate().await.map_err(fail),
        SchemaMode::Require => {}
    }
    let pending = pending(pg, outbox).await.map_err(fail)?;
    if pending.is_empty() {
        return Ok(());
    }
    // Version 1 creates the records table: without it there is no idem schema at all.
    let what = if pending.contains(&1) {
        format!("has no idem tables in schema {:?}", pg.schema())
    } else {
        format!(
            "has idem's schema {:?} at an older version (migrations {pending:?} not applied)",
            pg.schema()
        )
    };
    Err(CliError::Open(format!(
        "the database of {url} {what}; run `idem migrate --store <url>{}` first (it needs \
         the right to create tables)",
        if pg.schema() == idemkit::postgres::DEFAULT_SCHEMA {
            String::new()
        } else {
            format!(" --schema {}", pg.schema())
        }
    )))
}

/// The migrations not applied yet: idem's, and the outbox's on a tiered store.
///
/// # Errors
///
/// When the database cannot be read.
pub async fn pending(pg: &PgStore, outbox: bool) -> Result<Vec<i64>, Error> {
    let mut pending = pg.pending_migrations().await?;
    if outbox {
        pending.extend(
            pg.pending_migrations_with(idemkit::outbox::migrator())
                .await?,
        );
    }
    Ok(pending)
}

/// The error of a failed open: bad input stays bad input; anything else names the store,
/// the cause and what to check (`half` is the URL of the server that failed).
async fn failure(url: &StoreUrl, half: &str, e: Error) -> CliError {
    if matches!(e, Error::Invalid(_)) {
        return plain_failure(url, e);
    }
    match idemkit::reach::explain(half, &e).await {
        Some(hint) => CliError::Open(format!("cannot open store {url}: {hint}")),
        None => plain_failure(url, e),
    }
}

/// The error of a failed open, as the driver tells it (without the URL's password).
fn plain_failure(url: &StoreUrl, e: Error) -> CliError {
    // Drivers may quote the URL they were given: never let its password through.
    let detail = url.scrub(&e.to_string());
    match e {
        Error::Invalid(_) => CliError::Usage(format!("cannot open store {url}: {detail}")),
        _ => CliError::Open(format!("cannot open store {url}: {detail}")),
    }
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

    #[tokio::test]
    async fn opening_an_unreachable_store_names_it_without_its_password() {
        // A port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = parse(&format!("redis://:hunter2@127.0.0.1:{port}")).unwrap();
        let Err(CliError::Open(msg)) = open_with(&url, &Options::default()).await else {
            panic!("nothing listens on port {port}")
        };
        assert!(msg.contains("redis://:***@127.0.0.1:"), "{msg}");
        assert!(msg.contains("connection refused"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }
}
