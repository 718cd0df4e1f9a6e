//! Opening the store a URL names, by backend ([`Opened`]), with errors that name it without
//! its password and say what is wrong (nothing listening, no answer, another protocol on
//! that port, a schema to migrate) and what to do ([`OpenError`]). [`crate::connect`] and
//! the `idem` binary (every command, `idem relay` too) open stores here.

use std::fmt;
use std::sync::Arc;

use idem_core::{Error, MemoryStore, Store};

use crate::url::StoreUrl;
use crate::ConnectOptions;

/// What opening a PostgreSQL (or tiered) store does with idem's schema.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaMode {
    /// Apply the migrations (creating the schema and tables needs the right to create
    /// them; safe from many instances at once). The default.
    #[default]
    Migrate,
    /// Check that every migration was applied; a missing or outdated schema is an
    /// [`OpenError`] of kind [`OpenErrorKind::Unmigrated`] that says how to migrate.
    /// Changes nothing.
    Require,
    /// Neither migrate nor check (a tool that looks for itself, such as `idem migrate`).
    Leave,
}

impl SchemaMode {
    /// [`SchemaMode::Migrate`] when `migrate`, else [`SchemaMode::Require`]: what a
    /// `--migrate` flag asks for.
    pub fn migrate_if(migrate: bool) -> Self {
        if migrate {
            Self::Migrate
        } else {
            Self::Require
        }
    }
}

/// An open store, by backend: what [`crate::connect`] hands out as `Arc<dyn Store>`, with
/// each backend's own type for what [`Store`] does not offer.
#[derive(Debug)]
#[non_exhaustive]
pub enum Opened {
    /// The memory store.
    Memory(Arc<MemoryStore>),
    /// Redis, one server or a cluster.
    #[cfg(feature = "redis")]
    Redis(idem_redis::RedisStore),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(idem_postgres::PgStore),
    /// Redis in front of PostgreSQL.
    #[cfg(feature = "outbox")]
    Tiered(idem_outbox::TieredStore),
}

impl Opened {
    /// The store as the engine and the middleware take it.
    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Self::Memory(store) => store.clone(),
            #[cfg(feature = "redis")]
            Self::Redis(store) => Arc::new(store.clone()),
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => Arc::new(store.clone()),
            #[cfg(feature = "outbox")]
            Self::Tiered(store) => Arc::new(store.clone()),
        }
    }

    /// The PostgreSQL store, when there is one (alone or as the arbiter of a tiered store).
    #[cfg(feature = "postgres")]
    pub fn pg(&self) -> Option<&idem_postgres::PgStore> {
        match self {
            Self::Postgres(pg) => Some(pg),
            #[cfg(feature = "outbox")]
            Self::Tiered(tiered) => Some(tiered.pg()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The migrations PostgreSQL's schema lacks: idem's, and the outbox's on a tiered store
    /// (none on a store without PostgreSQL).
    ///
    /// # Errors
    ///
    /// When the database cannot be read.
    pub async fn pending_migrations(&self) -> Result<Vec<i64>, Error> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(pg) => pg.pending_migrations().await,
            #[cfg(feature = "outbox")]
            Self::Tiered(tiered) => tiered_pending(tiered.pg()).await,
            _ => Ok(Vec::new()),
        }
    }
}

/// Why [`open`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenErrorKind {
    /// Bad input: a URL, prefix or schema the backend refuses.
    Invalid,
    /// The store cannot be reached, or refused us.
    Unreachable,
    /// PostgreSQL's schema is missing or outdated, under [`SchemaMode::Require`].
    Unmigrated,
}

/// A store that could not be opened: the message names it (without its password), says
/// what is wrong and what to do; the store's own error is its source.
#[derive(Debug)]
pub struct OpenError {
    kind: OpenErrorKind,
    message: String,
    source: Error,
}

impl OpenError {
    /// Why it failed.
    pub fn kind(&self) -> OpenErrorKind {
        self.kind
    }

    /// The store's own error ([`Error::Invalid`] for [`OpenErrorKind::Unmigrated`], with
    /// the message).
    pub fn into_source(self) -> Error {
        self.source
    }

    /// The error of a failed open, as the driver tells it (without the URL's password).
    fn plain(url: &StoreUrl, source: Error) -> Self {
        // Drivers may quote the URL they were given: never let its password through.
        let detail = url.scrub(&source.to_string());
        let kind = match source {
            Error::Invalid(_) => OpenErrorKind::Invalid,
            _ => OpenErrorKind::Unreachable,
        };
        Self {
            kind,
            message: format!("cannot open store {url}: {detail}"),
            source,
        }
    }

    /// The error of a failed open: bad input stays bad input; anything else names the store,
    /// the cause and what to check (`half` is the URL of the server that failed).
    #[cfg(any(feature = "redis", feature = "postgres"))]
    async fn explained(url: &StoreUrl, half: &str, source: Error) -> Self {
        if matches!(source, Error::Invalid(_)) {
            return Self::plain(url, source);
        }
        match crate::reach::explain(half, &source).await {
            Some(hint) => Self {
                kind: OpenErrorKind::Unreachable,
                message: format!("cannot open store {url}: {hint}"),
                source,
            },
            None => Self::plain(url, source),
        }
    }
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for OpenError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Opens the store `url` names with `options` ([`ConnectOptions::prefix`],
/// [`ConnectOptions::schema`], [`ConnectOptions::schema_mode`],
/// [`ConnectOptions::wait_for_redis`], [`ConnectOptions::memory_capacity`]); unlike
/// [`crate::connect`] it starts no background purge.
///
/// # Errors
///
/// [`OpenError`], by [`OpenErrorKind`]: a URL, prefix or schema the backend refuses, or a
/// backend this build leaves out; a store that cannot be reached; a schema to migrate.
pub async fn open(url: &StoreUrl, options: &ConnectOptions) -> Result<Opened, OpenError> {
    match url {
        StoreUrl::Memory => Ok(Opened::Memory(Arc::new(
            MemoryStore::new().with_capacity(options.memory_capacity),
        ))),
        #[cfg(feature = "redis")]
        StoreUrl::Redis(redis) => Ok(Opened::Redis(open_redis(url, redis, options, false).await?)),
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(postgres) => {
            let pg = match open_pg(postgres, options).await {
                Ok(pg) => pg,
                Err(e) => return Err(OpenError::explained(url, postgres, e).await),
            };
            ready_schema(url, &pg, options, false).await?;
            Ok(Opened::Postgres(pg))
        }
        #[cfg(feature = "outbox")]
        StoreUrl::Tiered { redis, postgres } => {
            let pg = match open_pg(postgres, options).await {
                Ok(pg) => pg,
                Err(e) => return Err(OpenError::explained(url, postgres, e).await),
            };
            // Redis before the schema: a Redis URL it refuses is found before a migration
            // writes anything.
            let redis = open_redis(url, redis, options, true).await?;
            ready_schema(url, &pg, options, true).await?;
            Ok(Opened::Tiered(idem_outbox::TieredStore::new(redis, pg)))
        }
        #[allow(unreachable_patterns)]
        other => Err(OpenError::plain(other, crate::not_compiled_in(other))),
    }
}

/// Connects to Redis (`redis`, the Redis URL of the store `url`). With
/// [`ConnectOptions::wait_for_redis`], when nothing answers at its address (nothing listens,
/// no answer), builds the store anyway and says so in one log line: a service started
/// during a Redis outage starts, its calls answer [`Error::Unavailable`] (the middleware's
/// 503) until Redis answers, and `Redis reachable` is logged then; on a tiered store
/// (`tiered`) PostgreSQL answers alone meanwhile. A Redis that refuses us (a wrong password,
/// a certificate from another authority), or another server at that address, is an error.
///
/// Only a Redis a service runs on alone is checked for persistence (a warning): an
/// operator's command reading records is no reason to, and the Redis of a tiered store
/// needs none, PostgreSQL being the arbiter.
#[cfg(feature = "redis")]
async fn open_redis(
    url: &StoreUrl,
    redis: &str,
    options: &ConnectOptions,
    tiered: bool,
) -> Result<idem_redis::RedisStore, OpenError> {
    let mut builder = idem_redis::RedisStore::builder(redis)
        .with_persistence_check(options.wait_for_redis && !tiered);
    if let Some(prefix) = &options.prefix {
        builder = builder.with_prefix(prefix.clone());
    }
    let error = match builder.clone().connect().await {
        Ok(store) => return Ok(store),
        Err(error) => error,
    };
    if !options.wait_for_redis || !idem_redis::is_unreachable(&error) {
        return Err(OpenError::explained(url, redis, error).await);
    }
    // Another server at that port (PostgreSQL's, a broker's) drops or garbles the
    // connection much as a Redis out of reach does, but will never become the Redis the URL
    // names: waiting for it would answer 503 until someone reads the log.
    if let Some(hint) = crate::reach::foreign(redis).await {
        return Err(OpenError {
            kind: OpenErrorKind::Unreachable,
            message: format!("cannot open store {url}: {hint}"),
            source: error,
        });
    }
    let name = crate::url::redact(redis);
    tracing::debug!(redis = %name, %error, "Redis out of reach at start");
    let store = builder
        .connect_later(&name)
        .map_err(|e| OpenError::plain(url, e))?;
    let meanwhile = if tiered {
        "PostgreSQL answers alone, and completions wait in its outbox, until it returns"
    } else {
        "calls fail as unavailable until it answers"
    };
    tracing::warn!(redis = %name, "Redis unreachable at start: {meanwhile}");
    Ok(store)
}

/// Connects to PostgreSQL, in [`ConnectOptions::schema`].
#[cfg(feature = "postgres")]
async fn open_pg(url: &str, options: &ConnectOptions) -> Result<idem_postgres::PgStore, Error> {
    use idem_postgres::PgStore;
    // The schema name is checked before connecting: a bad one is bad input whether or not
    // the server answers.
    let schema = options
        .schema
        .as_deref()
        .unwrap_or(idem_postgres::DEFAULT_SCHEMA);
    let pool = PgStore::pool_options()
        .connect_lazy(url)
        .map_err(|e| Error::Invalid(format!("postgres url: {e}")))?;
    let store = PgStore::new(pool).with_schema(schema)?;
    // Reach the server now, so that a wrong URL fails here.
    store
        .pool()
        .acquire()
        .await
        .map_err(idem_postgres::map_error)?;
    Ok(store)
}

/// The migrations a tiered store's PostgreSQL lacks: idem's and the outbox's.
#[cfg(feature = "outbox")]
async fn tiered_pending(pg: &idem_postgres::PgStore) -> Result<Vec<i64>, Error> {
    let mut pending = pg.pending_migrations().await?;
    pending.extend(pg.pending_migrations_with(idem_outbox::migrator()).await?);
    Ok(pending)
}

/// Migrates, or checks that nothing is left to migrate, as `options` say: opening a store to
/// read it must not need DDL rights nor create schemas.
#[cfg(feature = "postgres")]
async fn ready_schema(
    url: &StoreUrl,
    pg: &idem_postgres::PgStore,
    options: &ConnectOptions,
    outbox: bool,
) -> Result<(), OpenError> {
    let fail = |e: Error| OpenError::plain(url, e);
    let pending = match (options.schema_mode, outbox) {
        (SchemaMode::Leave, _) => return Ok(()),
        #[cfg(feature = "outbox")]
        (SchemaMode::Migrate, true) => return idem_outbox::migrate(pg).await.map_err(fail),
        (SchemaMode::Migrate, _) => return pg.migrate().await.map_err(fail),
        #[cfg(feature = "outbox")]
        (_, true) => tiered_pending(pg).await.map_err(fail)?,
        _ => pg.pending_migrations().await.map_err(fail)?,
    };
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
    let schema_flag = if pg.schema() == idem_postgres::DEFAULT_SCHEMA {
        String::new()
    } else {
        format!(" --schema {}", pg.schema())
    };
    let message = format!(
        "the database of {url} {what}; run `idem migrate --store <url>{schema_flag}` first \
         (it needs the right to create tables), or have it migrated at start: `--migrate` on \
         `idem serve`, `idem proxy` and `idem relay run`, SchemaMode::Migrate in a program"
    );
    Err(OpenError {
        kind: OpenErrorKind::Unmigrated,
        source: Error::Invalid(message.clone()),
        message,
    })
}
