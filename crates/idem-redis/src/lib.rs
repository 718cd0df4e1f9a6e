//! # idem-redis
//!
//! The Redis backend of idem (draft docs; completed below).

#![forbid(unsafe_code)]

mod codec;
mod config;
mod connection;
mod error;
mod key;
mod scripts;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use config::{BodyLimit, Durability, EvictionCheck, OversizeBody, RedisConfig};
pub use error::{EvictionPolicyError, ReplicationError};
pub use store::{RedisStore, RedisStoreBuilder};

/// The store's name in errors and metrics.
const STORE: &str = "redis";
