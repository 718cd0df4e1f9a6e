//! # idemkit: the facade of idem
//!
//! Run an operation (charge a card, create an order, handle a message) once per idempotency
//! key, and hand every retry the original result.
//!
//! This facade re-exports [`idem_core`] (the state machine, the storage trait and the
//! embedded in-memory store); each storage backend or integration is a cargo feature that
//! re-exports its crate as a module:
//!
//! | feature | module | crate |
//! |---|---|---|
//! | `redis` | `idemkit::redis` | `idem-redis`: Redis 7+ or Valkey, standalone and Cluster (compare-and-set commands where the server has them, else two Lua scripts) |
//! | `postgres` | `idemkit::postgres` | `idem-postgres`: PostgreSQL with sqlx, transactional API |
//! | `outbox` | `idemkit::outbox` | `idem-outbox`: the tiered store (Redis first, PostgreSQL the arbiter) and its relay, as a library (`idem relay` runs it) |
//! | `http` | `idemkit::http` | `idem-http`: the tower middleware |
//! | `axum` | `idemkit::http` | `idem-http` with `LeaseHandle` as an axum extractor, for handlers that complete the record in their own transaction |
//! | `consumer` | `idemkit::consumer` | `idem-consumer`: message consumers, broker-neutral |
//! | `rabbitmq` | `idemkit::consumer` | `idem-consumer` with its RabbitMQ worker |
//! | `nats` | `idemkit::consumer::nats` | `idem-consumer`'s NATS JetStream worker |
//! | `redis-streams` | `idemkit::consumer::redis_streams` | `idem-consumer`'s Redis Streams worker |
//! | `full` | all of the above | |
//!
//! [`connect`] opens whichever store a URL names, among those compiled in.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use idemkit::{Failure, Fingerprint, Idem, Key, MemoryStore, Once, RecordId, Scope};
//!
//! let idem = Idem::new(MemoryStore::new());
//! let id = RecordId::new(Scope::new("orders").unwrap(), Key::new("order-1").unwrap());
//! let fp = Fingerprint::of_bytes(b"create order 1");
//! let once = idem
//!     .execute_once(&id, fp, |_lease| async { Ok::<_, Failure<String>>("created".to_owned()) })
//!     .await
//!     .unwrap();
//! assert!(matches!(once, Once::Executed { .. }));
//! # }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idem_core::*;

#[cfg(feature = "consumer")]
pub use idem_consumer as consumer;
#[cfg(feature = "http")]
pub use idem_http as http;
#[cfg(feature = "outbox")]
pub use idem_outbox as outbox;
#[cfg(feature = "postgres")]
pub use idem_postgres as postgres;
#[cfg(feature = "redis")]
pub use idem_redis as redis;

mod open;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod reach;
pub mod url;

pub use open::{open, OpenError, OpenErrorKind, Opened, SchemaMode};

use std::sync::Arc;
use std::time::Duration;

use crate::url::StoreUrl;

/// Settings of [`connect_with`]. Every field has a documented default and a `with_*`
/// setter: `ConnectOptions::default().with_purge_interval(Some(Duration::from_secs(10)))`.
#[derive(Debug, Clone, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct ConnectOptions {
    /// How often expired records are deleted in the background, for as long as the store
    /// is in use (the task ends soon after the last clone of the returned store is
    /// dropped). PostgreSQL, and the tiered store's PostgreSQL half: `PgStore::spawn_purge`
    /// with this interval (bounded batches), its first round one interval after the store
    /// is opened, so a short-lived operator's command deletes nothing; the memory store: [`MemoryStore::purge_expired`] (its writes sweep a few
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

impl Default for ConnectOptions {
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

impl ConnectOptions {
    /// [`SchemaMode::Migrate`] when `migrate`, else [`SchemaMode::Require`].
    pub fn with_migrate(self, migrate: bool) -> Self {
        self.with_schema_mode(SchemaMode::migrate_if(migrate))
    }
}

/// Opens the store a URL names:
///
/// | URL | store | feature |
/// |---|---|---|
/// | `memory` | [`MemoryStore`], private to this process | always |
/// | `redis://host:port[/db]`, `rediss://...`, `unix:///path` | Redis, one server | `redis` |
/// | `redis+cluster://host:port[,host:port...]`, `rediss+cluster://...` | Redis Cluster | `redis` |
/// | `postgres://user@host/db`, `postgresql://...` | PostgreSQL, schema `idem`, migrated on connect | `postgres` |
/// | `tiered:<redis URL>\|<postgres URL>` | the tiered store: Redis first, PostgreSQL the arbiter (migrated on connect) | `outbox` |
///
/// with the default [`ConnectOptions`] (PostgreSQL migrated, expired records purged in the
/// background while the store is in use).
///
/// The store is shared (`Arc<dyn Store>`): hand it to the engine with [`Idem::from_arc`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemkit::Error> {
/// use idemkit::Idem;
///
/// let url = "memory"; // or "redis://127.0.0.1:6379", "postgres://app@127.0.0.1/app", ...
/// let idem = Idem::from_arc(idemkit::connect(url).await?);
/// # drop(idem);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`Error::Invalid`] for a URL no compiled-in backend takes (naming the cargo feature to
/// turn on); the backend's own errors ([`Error::Unavailable`] when its server cannot be
/// reached); with [`SchemaMode::Require`], [`Error::Invalid`] when idem's tables are
/// missing or outdated. [`open`] tells the same failures with their explanation.
pub async fn connect(url: &str) -> Result<Arc<dyn Store>, Error> {
    connect_url(&StoreUrl::parse(url)?).await
}

/// [`connect`] for a URL already parsed.
///
/// # Errors
///
/// As [`connect`].
pub async fn connect_url(url: &StoreUrl) -> Result<Arc<dyn Store>, Error> {
    connect_url_with(url, &ConnectOptions::default()).await
}

/// [`connect`] with settings: the background purge's interval (or none), the memory
/// store's capacity.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemkit::Error> {
/// use std::time::Duration;
/// use idemkit::{ConnectOptions, MemoryCapacity};
///
/// let options = ConnectOptions::default()
///     .with_purge_interval(Some(Duration::from_secs(10)))
///     .with_memory_capacity(MemoryCapacity::default().with_records(100_000));
/// let store = idemkit::connect_with("memory", &options).await?;
/// assert_eq!(store.name(), "memory");
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// As [`connect`].
pub async fn connect_with(url: &str, options: &ConnectOptions) -> Result<Arc<dyn Store>, Error> {
    connect_url_with(&StoreUrl::parse(url)?, options).await
}

/// [`connect_with`] for a URL already parsed.
///
/// # Errors
///
/// As [`connect`].
pub async fn connect_url_with(
    url: &StoreUrl,
    options: &ConnectOptions,
) -> Result<Arc<dyn Store>, Error> {
    let opened = open(url, options).await.map_err(OpenError::into_source)?;
    let store = opened.store();
    if let Some(every) = options.purge_interval {
        match &opened {
            Opened::Memory(memory) => sweep_while_used(memory, every),
            #[cfg(feature = "postgres")]
            Opened::Postgres(pg) => purge_while_used(&store, pg, every),
            #[cfg(feature = "outbox")]
            Opened::Tiered(tiered) => purge_while_used(&store, tiered.pg(), every),
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }
    Ok(store)
}

/// The error for a URL whose backend this build leaves out: it names the cargo feature.
pub(crate) fn not_compiled_in(url: &StoreUrl) -> Error {
    let compiled = compiled_in().join(", ");
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

/// The URL schemes [`connect`] takes in this build.
pub fn compiled_in() -> Vec<&'static str> {
    let mut schemes = vec!["memory"];
    if cfg!(feature = "redis") {
        schemes.extend([
            "redis://",
            "rediss://",
            "unix://",
            "redis+cluster://",
            "rediss+cluster://",
        ]);
    }
    if cfg!(feature = "postgres") {
        schemes.extend(["postgres://", "postgresql://"]);
    }
    if cfg!(feature = "outbox") {
        schemes.push("tiered:<redis URL>|<postgres URL>");
    }
    schemes
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

    #[cfg(not(feature = "redis"))]
    #[tokio::test]
    async fn a_backend_left_out_names_its_feature() {
        let err = super::connect("redis://127.0.0.1:6379")
            .await
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(text.contains("`redis` feature"), "{text}");
        let err = super::connect("tiered:redis://h|postgres://u@h/d")
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("`outbox` feature"), "{err}");
    }

    #[tokio::test]
    async fn connect_names_what_it_cannot_open() {
        assert_eq!(super::connect("memory").await.unwrap().name(), "memory");
        let err = super::connect("mysql://x").await.err().unwrap();
        let text = err.to_string();
        assert!(
            text.contains("\"mysql://x\"") && text.contains("memory"),
            "{text}"
        );
    }
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
