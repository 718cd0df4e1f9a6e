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

use idem_core::url::StoreUrl;

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
    match url {
        StoreUrl::Memory => Ok(Arc::new(MemoryStore::new())),
        #[cfg(feature = "redis")]
        StoreUrl::Redis(url) => Ok(Arc::new(idem_redis::RedisStore::connect(url).await?)),
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(url) => {
            let store = idem_postgres::PgStore::connect(url).await?;
            store.migrate().await?;
            Ok(Arc::new(store))
        }
        #[cfg(feature = "outbox")]
        StoreUrl::Tiered { redis, postgres } => {
            let redis = idem_redis::RedisStore::connect(redis).await?;
            let pg = idem_postgres::PgStore::connect(postgres).await?;
            idem_outbox::migrate(&pg).await?;
            Ok(Arc::new(idem_outbox::TieredStore::new(redis, pg)))
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::Invalid(format!(
            "no store for {other} in this build; compiled in: {}",
            compiled_in().join(", ")
        ))),
    }
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
