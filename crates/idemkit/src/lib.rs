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
//! [`open`] opens whichever store a URL names, among those compiled in, with
//! [`OpenOptions`]; [`Opened::store`] is the store the engine takes.
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

pub use open::{open, OpenError, OpenErrorKind, OpenOptions, Opened, SchemaMode};

/// The URL schemes [`open`] takes in this build.
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

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
