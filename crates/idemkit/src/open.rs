//! The one opener of stores: [`open`] takes a store URL and [`OpenOptions`], and hands out
//! the store as the engine takes it ([`Opened::store`]) with each backend's own type for
//! what [`Store`] does not offer. Its errors ([`OpenError`]) name the store without its
//! password and say what is wrong (nothing listening, no answer, another protocol on that
//! port, a schema to migrate) and what to do. The `idem` binary opens every store here too.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Error, MemoryCapacity, MemoryStore, Store};

use crate::url::StoreUrl;

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

/// Settings of [`open`]. Every field has a documented default and a `with_*` setter:
/// `OpenOptions::default().with_purge_interval(Some(Duration::from_secs(10)))`.
#[derive(Debug, Clone, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct OpenOptions {
    /// How often expired records are deleted in the background, for as long as the store
    /// is in use (the task ends soon after the [`Opened`] and the last clone of its
    /// [`Opened::store`] are dropped). PostgreSQL, and the tiered store's PostgreSQL half:
    /// `PgStore::spawn_purge` with this interval (bounded batches), its first round one
    /// interval after the store is opened, so a short-lived operator's command deletes
    /// nothing; the memory store: [`MemoryStore::purge_expired`] (its writes sweep a few
    /// records each too, but an idle store would keep the rest). Redis expires records by
    /// itself. Expired records already behave as absent: purging only gives their space
    /// back, so a database does not grow forever. `None`: no background task (an operator
    /// command that must not write, or a deployment that purges elsewhere). Default: 60 s.
    pub purge_interval: Option<Duration>,
    /// The capacity of the memory store (`memory`). Default: [`MemoryCapacity::default`].
    pub memory_capacity: MemoryCapacity,
    /// What opening a PostgreSQL or tiered store does with idem's schema: apply the
    /// migrations ([`SchemaMode::Migrate`], creating its schema and tables, which needs the
    /// right to create them; safe from many instances at once), only check them
    /// ([`SchemaMode::Require`]: a database whose idem tables are missing or older than
    /// this build is an error that says to migrate first), or neither. Default:
    /// [`SchemaMode::Migrate`].
    pub schema_mode: SchemaMode,
    /// The Redis key prefix of the records. Default: `None`, the store's (`idem:`).
    pub prefix: Option<String>,
    /// The PostgreSQL schema of idem's tables. Default: `None`, `idem`.
    pub schema: Option<String>,
    /// Whether a Redis out of reach at start (nothing listens, no answer) is waited for
    /// instead of failing: the store is built, logs so in one line, and its calls answer
    /// [`Error::Unavailable`] until Redis answers (on a tiered store PostgreSQL answers
    /// alone meanwhile), so a service restarted during an outage does not crash-loop.
    /// Another server answering at that address (PostgreSQL's port, a broker's) is an
    /// error all the same, naming it: it will never become the
    /// Redis. Such a Redis, alone, is also checked for persistence (a warning). `false`: an
    /// unreachable Redis is an error (an operator's command). Default: `true`.
    pub wait_for_redis: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            purge_interval: Some(Duration::from_secs(60)),
            memory_capacity: MemoryCapacity::default(),
            schema_mode: SchemaMode::Migrate,
            prefix: None,
            schema: None,
            wait_for_redis: true,
        }
    }
}

impl OpenOptions {
    /// [`SchemaMode::Migrate`] when `migrate`, else [`SchemaMode::Require`].
    pub fn with_migrate(self, migrate: bool) -> Self {
        self.with_schema_mode(SchemaMode::migrate_if(migrate))
    }
}

/// An open store: [`Opened::store`] as the engine and the middleware take it, and each
/// backend's own type for what [`Store`] does not offer ([`Opened::redis`],
/// [`Opened::pg`], [`Opened::tiered`]).
#[derive(Debug)]
pub struct Opened {
    url: StoreUrl,
    /// The one shared handle every [`Opened::store`] clones: the background purge runs
    /// while it is alive.
    store: Arc<dyn Store>,
    backend: Backend,
}

/// Each backend's own store type.
#[derive(Debug)]
enum Backend {
    Memory(Arc<MemoryStore>),
    #[cfg(feature = "redis")]
    Redis(idem_redis::RedisStore),
    #[cfg(feature = "postgres")]
    Postgres(idem_postgres::PgStore),
    #[cfg(feature = "outbox")]
    Tiered(idem_outbox::TieredStore),
}

impl Opened {
    fn new(url: &StoreUrl, backend: Backend) -> Self {
        let store: Arc<dyn Store> = match &backend {
            Backend::Memory(store) => store.clone(),
            #[cfg(feature = "redis")]
            Backend::Redis(store) => Arc::new(store.clone()),
            #[cfg(feature = "postgres")]
            Backend::Postgres(store) => Arc::new(store.clone()),
            #[cfg(feature = "outbox")]
            Backend::Tiered(store) => Arc::new(store.clone()),
        };
        Self {
            url: url.clone(),
            store,
            backend,
        }
    }

    /// The store as the engine and the middleware take it: hand it to the engine with
    /// [`Idem::from_arc`](idem_core::Idem::from_arc). Every call returns the same shared
    /// store.
    pub fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    /// The URL the store was opened with; its `Display` hides passwords.
    pub fn url(&self) -> &StoreUrl {
        &self.url
    }

    /// The Redis store, when there is one (alone or as the first tier of a tiered store).
    #[cfg(feature = "redis")]
    pub fn redis(&self) -> Option<&idem_redis::RedisStore> {
        match &self.backend {
            Backend::Redis(redis) => Some(redis),
            #[cfg(feature = "outbox")]
            Backend::Tiered(tiered) => Some(tiered.redis()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The PostgreSQL store, when there is one (alone or as the arbiter of a tiered store).
    #[cfg(feature = "postgres")]
    pub fn pg(&self) -> Option<&idem_postgres::PgStore> {
        match &self.backend {
            Backend::Postgres(pg) => Some(pg),
            #[cfg(feature = "outbox")]
            Backend::Tiered(tiered) => Some(tiered.pg()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The tiered store, when the URL named one.
    #[cfg(feature = "outbox")]
    pub fn tiered(&self) -> Option<&idem_outbox::TieredStore> {
        match &self.backend {
            Backend::Tiered(tiered) => Some(tiered),
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
        match &self.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => pg.pending_migrations().await,
            #[cfg(feature = "outbox")]
            Backend::Tiered(tiered) => tiered_pending(tiered.pg()).await,
            _ => Ok(Vec::new()),
        }
    }

    /// Starts the background purge `every` (see [`OpenOptions::purge_interval`]).
    fn purge_while_used(&self, every: Duration) {
        match &self.backend {
            Backend::Memory(memory) => sweep_while_used(memory, every),
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => purge_while_used(&self.store, pg, every),
            #[cfg(feature = "outbox")]
            Backend::Tiered(tiered) => purge_while_used(&self.store, tiered.pg(), every),
            #[allow(unreachable_patterns)]
            _ => {}
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

    /// The error of a URL that does not parse (its message never shows a password).
    fn unparsed(source: Error) -> Self {
        let detail = match &source {
            Error::Invalid(detail) => detail.clone(),
            other => other.to_string(),
        };
        Self {
            kind: OpenErrorKind::Invalid,
            message: format!("cannot open store: {detail}"),
            source,
        }
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

/// Opens the store a URL names:
///
/// | URL | store | feature |
/// |---|---|---|
/// | `memory` | [`MemoryStore`], private to this process | always |
/// | `redis://host:port[/db]`, `rediss://...`, `unix:///path` | Redis, one server | `redis` |
/// | `redis+cluster://host:port[,host:port...]`, `rediss+cluster://...` | Redis Cluster | `redis` |
/// | `postgres://user@host/db`, `postgresql://...` | PostgreSQL, schema `idem` | `postgres` |
/// | `tiered:<redis URL>\|<postgres URL>` | the tiered store: Redis first, PostgreSQL the arbiter | `outbox` |
///
/// with `options`: with [`OpenOptions::default`], PostgreSQL's schema is migrated, expired
/// records are purged in the background while the store is in use, and a Redis out of reach
/// at start is waited for. [`crate::url::StoreUrl`] parses and redacts such URLs.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idemkit::{Idem, MemoryCapacity, OpenOptions};
///
/// let url = "memory"; // or "redis://127.0.0.1:6379", "postgres://app@127.0.0.1/app", ...
/// let options = OpenOptions::default()
///     .with_purge_interval(Some(Duration::from_secs(10)))
///     .with_memory_capacity(MemoryCapacity::default().with_records(100_000));
/// let opened = idemkit::open(url, &options).await?;
/// assert_eq!(opened.store().name(), "memory");
/// let idem = Idem::from_arc(opened.store());
/// # drop(idem);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`OpenError`], by [`OpenErrorKind`]: a URL no compiled-in backend takes (naming the
/// cargo feature to turn on), a prefix or schema the backend refuses; a store that cannot
/// be reached (saying why, when what answers at its address tells); with
/// [`SchemaMode::Require`], a schema to migrate.
pub async fn open(url: &str, options: &OpenOptions) -> Result<Opened, OpenError> {
    let url = StoreUrl::parse(url).map_err(OpenError::unparsed)?;
    let opened = Opened::new(&url, open_backend(&url, options).await?);
    if let Some(every) = options.purge_interval {
        opened.purge_while_used(every);
    }
    Ok(opened)
}

/// Opens the backend of `url`.
async fn open_backend(url: &StoreUrl, options: &OpenOptions) -> Result<Backend, OpenError> {
    match url {
        StoreUrl::Memory => Ok(Backend::Memory(Arc::new(
            MemoryStore::new().with_capacity(options.memory_capacity),
        ))),
        #[cfg(feature = "redis")]
        StoreUrl::Redis(redis) => Ok(Backend::Redis(
            open_redis(url, redis, options, false).await?,
        )),
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(postgres) => {
            let pg = match open_pg(postgres, options).await {
                Ok(pg) => pg,
                Err(e) => return Err(OpenError::explained(url, postgres, e).await),
            };
            ready_schema(url, &pg, options, false).await?;
            Ok(Backend::Postgres(pg))
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
            Ok(Backend::Tiered(idem_outbox::TieredStore::new(redis, pg)))
        }
        #[allow(unreachable_patterns)]
        other => Err(OpenError::plain(other, not_compiled_in(other))),
    }
}

/// The error for a URL whose backend this build leaves out: it names the cargo feature.
fn not_compiled_in(url: &StoreUrl) -> Error {
    let compiled = crate::compiled_in().join(", ");
    let feature = match url {
        StoreUrl::Redis(_) => "redis",
        StoreUrl::Postgres(_) => "postgres",
        StoreUrl::Tiered { .. } => "outbox",
        _ => {
            return Error::Invalid(format!(
                "no store for {url} in this build; compiled in: {compiled}"
            ))
        }
    };
    Error::Invalid(format!(
        "no store for {url} in this build: turn on idemkit's `{feature}` feature \
         (idemkit = {{ version = \"0.1\", features = [\"{feature}\"] }}); compiled in: {compiled}"
    ))
}

/// Connects to Redis (`redis`, the Redis URL of the store `url`). With
/// [`OpenOptions::wait_for_redis`], when nothing answers at its address (nothing listens,
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
    options: &OpenOptions,
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
    if !options.wait_for_redis || !crate::reach::is_unreachable(&error) {
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
    let store =
        crate::reach::connect_later(builder, &name).map_err(|e| OpenError::plain(url, e))?;
    let meanwhile = if tiered {
        "PostgreSQL answers alone, and completions wait in its outbox, until it returns"
    } else {
        "calls fail as unavailable until it answers"
    };
    tracing::warn!(redis = %name, "Redis unreachable at start: {meanwhile}");
    Ok(store)
}

/// Connects to PostgreSQL, in [`OpenOptions::schema`].
#[cfg(feature = "postgres")]
async fn open_pg(url: &str, options: &OpenOptions) -> Result<idem_postgres::PgStore, Error> {
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
    options: &OpenOptions,
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

/// Sweeps the memory store's expired records every `every`, until the store is dropped.
fn sweep_while_used(store: &Arc<MemoryStore>, every: Duration) {
    let store = Arc::downgrade(store);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            // Held only for the sweep: the task never keeps the store alive.
            let Some(store) = store.upgrade() else {
                return;
            };
            store.purge_expired();
        }
    });
}

/// Runs PostgreSQL's purge task on `pg` every `every`, from one interval after now until
/// `user` (the store handed out, which holds `pg`) is dropped; then stops it.
#[cfg(feature = "postgres")]
fn purge_while_used<S: ?Sized + Send + Sync + 'static>(
    user: &Arc<S>,
    pg: &idem_postgres::PgStore,
    every: Duration,
) {
    let user: std::sync::Weak<S> = Arc::downgrade(user);
    let pg = pg.clone();
    tokio::spawn(async move {
        // The first round one interval from now: an operator's short-lived command that
        // opens a store by URL ends before it, and never deletes anything.
        if !in_use_for(&user, every).await {
            return;
        }
        let purge = pg.spawn_purge(idem_postgres::PurgeConfig::default().with_interval(every));
        while in_use_for(&user, every).await {}
        purge.shutdown().await;
    });
}

/// Waits `period`, or less once `user` is dropped; returns whether it is still in use. It
/// looks every second at most: the task holds a clone of the pool, which must not outlive
/// the store by long.
#[cfg(feature = "postgres")]
async fn in_use_for<S: ?Sized>(user: &std::sync::Weak<S>, period: Duration) -> bool {
    let started = tokio::time::Instant::now();
    while user.strong_count() > 0 && started.elapsed() < period {
        let left = period.saturating_sub(started.elapsed());
        tokio::time::sleep(left.min(Duration::from_secs(1))).await;
    }
    user.strong_count() > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Begin, BeginRequest, FencingToken, Fingerprint, Key, RecordId, Scope};

    #[tokio::test]
    async fn the_memory_store_is_swept_while_in_use_and_the_task_ends_with_it() {
        let store = Arc::new(MemoryStore::new());
        for i in 0..100 {
            let id = RecordId::new(Scope::global(), Key::new(format!("k{i}")).unwrap());
            let req = BeginRequest {
                id: &id,
                fingerprint: Fingerprint::of_bytes(b""),
                token: FencingToken::random(),
                lease: Duration::from_millis(10),
                retention: Duration::from_millis(10),
            };
            assert!(matches!(store.begin(req).await, Ok(Begin::Acquired(_))));
        }
        sweep_while_used(&store, Duration::from_millis(50));
        // No write comes: only the background sweep can empty it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(store.len(), 0);
        let weak = Arc::downgrade(&store);
        drop(store);
        assert!(weak.upgrade().is_none(), "the sweep keeps the store alive");
    }

    /// The message of opening `url`, which must fail as bad input.
    async fn refused(url: &str) -> String {
        let err = open(url, &OpenOptions::default()).await.err().unwrap();
        assert_eq!(err.kind(), OpenErrorKind::Invalid, "{err}");
        err.to_string()
    }

    #[cfg(not(feature = "redis"))]
    #[tokio::test]
    async fn a_backend_left_out_names_its_feature() {
        let text = refused("redis://127.0.0.1:6379").await;
        assert!(text.contains("`redis` feature"), "{text}");
        let text = refused("tiered:redis://h|postgres://u@h/d").await;
        assert!(text.contains("`outbox` feature"), "{text}");
    }

    #[tokio::test]
    async fn open_names_what_it_cannot_open() {
        let opened = open("memory", &OpenOptions::default()).await.unwrap();
        assert_eq!(opened.store().name(), "memory");
        assert_eq!(opened.url(), &StoreUrl::Memory);
        let text = refused("mysql://root:hunter2@x").await;
        assert!(
            text.contains("\"mysql://root:***@x\"") && text.contains("memory"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn every_store_of_one_open_is_the_same() {
        let opened = open("memory", &OpenOptions::default()).await.unwrap();
        assert!(Arc::ptr_eq(&opened.store(), &opened.store()));
    }
}
