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
//! | `redis` | `idemkit::redis` | `idem-redis`: Redis 7, standalone and Cluster, Lua scripts |
//! | `postgres` | `idemkit::postgres` | `idem-postgres`: PostgreSQL with sqlx, transactional API |
//! | `outbox` | `idemkit::outbox` | `idem-outbox`: the tiered store (Redis first, PostgreSQL the arbiter) and its relay |
//! | `http` | `idemkit::http` | `idem-http`: the tower middleware |
//! | `axum` | `idemkit::http` | `idem-http` with `LeaseHandle` as an axum extractor, for handlers that complete the record in their own transaction |
//! | `consumer` | `idemkit::consumer` | `idem-consumer`: message consumers (RabbitMQ) |
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

use std::sync::Arc;
use std::time::Duration;

use idem_core::url::StoreUrl;

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
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            purge_interval: Some(Duration::from_secs(60)),
            memory_capacity: MemoryCapacity::default(),
        }
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
/// with the default [`ConnectOptions`]: expired records of PostgreSQL and of the memory
/// store are purged in the background every 60 s while the store is in use.
///
/// # Errors
///
/// [`Error::Invalid`] for a URL no compiled-in backend takes; the backend's own errors
/// ([`Error::Unavailable`] when its server cannot be reached).
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
    let purge = options.purge_interval;
    match url {
        StoreUrl::Memory => {
            let store = Arc::new(MemoryStore::new().with_capacity(options.memory_capacity));
            if let Some(every) = purge {
                sweep_while_used(&store, every);
            }
            Ok(store)
        }
        #[cfg(feature = "redis")]
        StoreUrl::Redis(url) => Ok(Arc::new(idem_redis::RedisStore::connect(url).await?)),
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(url) => {
            let store = idem_postgres::PgStore::connect(url).await?;
            store.migrate().await?;
            let store = Arc::new(store);
            if let Some(every) = purge {
                purge_while_used(&store, &store, every);
            }
            Ok(store)
        }
        #[cfg(feature = "outbox")]
        StoreUrl::Tiered { redis, postgres } => {
            // PostgreSQL is the arbiter: a Redis that persists nothing loses no record.
            let redis = idem_redis::RedisStore::builder(redis)
                .with_persistence_check(false)
                .connect()
                .await?;
            let pg = idem_postgres::PgStore::connect(postgres).await?;
            idem_outbox::migrate(&pg).await?;
            let store = Arc::new(idem_outbox::TieredStore::new(redis, pg.clone()));
            if let Some(every) = purge {
                purge_while_used(&store, &pg, every);
            }
            Ok(store)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::Invalid(format!(
            "no store for {other} in this build; compiled in: {}",
            compiled_in().join(", ")
        ))),
    }
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
