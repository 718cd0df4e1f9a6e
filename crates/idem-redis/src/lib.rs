//! # idem-redis
//!
//! The Redis backend of idem: [`RedisStore`] implements [`idem_core::Store`] on Redis 7+
//! or Valkey, one server or a cluster. Each transition is one atomic step: the common ones
//! (acquiring a new key, replaying a completed one) one plain `SET .. NX GET`; the ones that
//! need a compare (completing, releasing and extending a lease, taking over an expired one)
//! one compare-and-set command on servers that have them, one Lua script on the others
//! (see [Which path](#which-path)). Lease deadlines come from the server's clock; every
//! write that ends or extends a lease checks its fencing token.
//!
//! ## Which path
//!
//! When it connects (and again whenever a node refuses a command, as after a failover onto
//! an older server) the store reads every primary's `INFO server` and logs what it chose,
//! per [`RedisConfig::scripting`]: `SET .. IFEQ` with `DELIFEQ` or `DELEX .. IFEQ` on
//! Valkey 8.1+ and Redis 8.4+, the [`lua`] scripts on older servers (docs/stores.md gives
//! the table). Each compare is with the whole in-progress record the lease holds: the exact
//! bytes its `begin` wrote, which the lease carries ([`idem_core::Lease::version`]); the
//! scripts go through redis-rs's `Script::invoke_async`, which loads them again after a
//! restart or `SCRIPT FLUSH`.
//!
//! ## Quick start
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idem_core::Idem;
//! use idem_redis::{EvictionCheck, OversizeBody, RedisStore};
//!
//! // One server: a `redis://` (or `unix://`) URL.
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//!
//! // Redis Cluster: `redis+cluster://` and any of its nodes, comma-separated.
//! let cluster = RedisStore::builder("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
//!     .with_prefix("payments:")
//!     .with_eviction_check(EvictionCheck::Refuse)
//!     .with_body_limit(256 * 1024, OversizeBody::Compress)
//!     .with_durability(1, Duration::from_millis(100))
//!     .connect()
//!     .await?;
//!
//! let idem = Idem::new(store);
//! # let _ = (idem, cluster); Ok(()) }
//! ```
//!
//! ## Connecting
//!
//! | URL | connection |
//! |---|---|
//! | `redis://[user:password@]host:port[/db]`, `unix:///path/redis.sock` | one server, through redis-rs's `ConnectionManager` (multiplexed, reconnects by itself) |
//! | `redis+cluster://[user:password@]host:port[,host:port...]` | Redis Cluster, through redis-rs's async cluster connection (any reachable nodes seed it; it follows `MOVED`/`ASK` and refreshes its slot map) |
//!
//! [`RedisStore::connect`] connects at once and fails with [`idem_core::Error::Unavailable`]
//! when Redis cannot be reached; [`RedisStoreBuilder::connect_lazy`] builds the store without
//! a server and connects on the first call. Each connection attempt and each round trip is
//! bounded by the timeouts of [`RedisConfig`], and the attempts by its retries: an
//! unreachable Redis answers `Unavailable` within them, never hangs. A call as a whole has
//! the one time limit of every store call, [`idem_core::Config::store_timeout`].
//!
//! When the connection fails under a call (refused, reset, dropped), the call is sent once
//! more on a fresh connection, marked as re-sent, and answered as if only one had run:
//! `begin` carries the same fencing token and gets its own lease back; `complete` accepts
//! a record that already holds exactly its completion; `release` accepts a record already
//! gone. So the first call after a server restart succeeds, and a
//! lost reply does not turn into a false lease-lost.
//!
//! ## Keys and records
//!
//! A record is one Redis string under `<prefix>{<tag>}<encoded id>`:
//!
//! - `<encoded id>` is [`idem_core::RecordId::encoded`], injective over (scope, key);
//! - `<tag>` is 8 hex digits of SHA-256 of the encoded id. Redis Cluster hashes only what is
//!   between the first `{` and the next `}`, so the slot depends on the tag alone: braces
//!   in a client's key cannot pin all its keys to one slot, and keys spread evenly;
//! - `<prefix>` ([`RedisConfig::prefix`], default `idem:`) may not contain braces.
//!
//! A property test checks that two different (scope, key) pairs never share a key, whatever
//! characters they hold, and that the slot is the tag's.
//!
//! The value is binary (layout in the `codec` module's source): in progress, 59 bytes with
//! no clock reading (the lease deadline is the key's expiry minus a margin it holds);
//! completed, 41 bytes plus the headers and the body. It is a string rather than a hash
//! because a hash whose body field exceeds `hash-max-listpack-value` (64 bytes by default)
//! becomes a hash table costing several hundred bytes more per record.
//!
//! ### Memory per record
//!
//! `MEMORY USAGE` on Redis 7.0.15 (jemalloc), a 33-byte key (`idem:` prefix, global scope,
//! 16-character idempotency key), status 200 and no headers:
//!
//! | record | `MEMORY USAGE` | beyond the body | the same body as a plain string under the same key |
//! |---|---|---|---|
//! | in progress | 152 | | |
//! | completed, empty body | 136 | 136 | 104 |
//! | completed, 16-byte body | 152 | 136 | 120 |
//! | completed, 100-byte body | 248 | 148 | 200 |
//! | completed, 200-byte body | 344 | 144 | 312 |
//! | completed, 1000-byte body | 1368 | 368 | 1112 |
//!
//! Redis itself charges about 104 bytes for any key of this length holding an empty string
//! (key, dictionary entry, object header); a record adds its 41 bytes of head and metadata
//! (+3 per header and its bytes) to that, rounded up to jemalloc's size classes (16 bytes
//! apart up to 128, 32 up to 256), so a completed record costs about 136–150 bytes beyond
//! its body. Past 1 KiB, those classes round every allocation up by up to a quarter, for
//! records and plain strings alike. Reproduce with
//! `cargo test -p idem-tests --test redis completed_record_memory -- --nocapture`.
//!
//! [`RedisConfig::body`] limits the stored body; [`OversizeBody`] says what happens above it.
//!
//! ## Deadlines
//!
//! Deadlines are expiries: set with `PX` and read back with `PTTL`, both by the server's
//! clock; no application instance's clock decides anything. In a cluster each record lives
//! on one primary, whose clock decides; a failover to a replica with a skewed clock shifts
//! live deadlines by the skew. The one reading of an instance's clock is the expiry a
//! completed record carries, for [`idem_core::Replay::expires_in`] alone: the writer's clock
//! plus the retention, rounded down to the second, read back against the reader's clock.
//! The key's own expiry (by the server's clock) is what removes the record.
//!
//! ## Errors
//!
//! | Redis | [`idem_core::Error`] |
//! |---|---|
//! | connection refused, dropped or reset, I/O errors, timeouts | `Unavailable` |
//! | `OOM`, `BUSY`, `LOADING`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY` | `Unavailable` |
//! | a value under a record key that is not a record | `Corrupt` (the value is left alone) |
//! | anything else (`WRONGTYPE`, `NOPERM`, a script error) | `Backend` |
//!
//! ## Eviction
//!
//! Every record has a time to live, so any `maxmemory-policy` but `noeviction` (the
//! `allkeys-*` and `volatile-*` ones alike) may delete live records under memory pressure,
//! letting a retry run the work again. The store reads the policy (`INFO memory`, on every
//! primary of a cluster) when it connects and, per [`EvictionCheck`], logs a `tracing`
//! warning (the default) or refuses the server. With `noeviction` a full server refuses
//! writes instead: `begin` and `complete` answer `Unavailable`, never run the work
//! unguarded, while `release`, `extend` and `get` keep working.
//!
//! ## Durability
//!
//! Replication in Redis is asynchronous: a record written to a primary that fails before
//! its replicas copy it is lost, and a retry then runs the work again. With
//! [`RedisConfig::durability`] set, the store waits for replicas (`WAIT`) after each
//! acquisition and completion; [`Durability`] says what that does and does not promise.
//!
//! ## Waiters
//!
//! A caller waiting for another worker's result ([`idem_core::Config::wait`]) is woken by
//! pub/sub on the record's key (sharded pub/sub on a cluster), published only when the
//! write counts a subscriber: docs/library.md, "Waiting for the holder's result". The conformance
//! suite runs against Redis 7.0 and Valkey 9.1, one server and a 3-primary cluster each.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod caps;
mod codec;
mod config;
mod connection;
mod error;
mod key;
mod notify;
mod scripts;
mod stats;
mod store;
pub mod tier;
mod transitions;

pub use config::{BodyLimit, Durability, EvictionCheck, OversizeBody, RedisConfig, Scripting};
pub use error::{EvictionPolicyError, ReplicationError};
pub use stats::{Finding, Problem, Scan, ScanCounts};
pub use store::{RedisStore, RedisStoreBuilder};

/// The store's name in errors and metrics.
const STORE: &str = "redis";

/// The Lua scripts, as they are in the workspace's `lua/redis/` folder, each opening with
/// its contract: sent only to servers without the compare-and-set commands.
pub mod lua {
    #![doc = concat!("## set_if.lua\n\n```lua\n", include_str!("../lua/set_if.lua"), "```\n")]
    #![doc = concat!("## end_if.lua\n\n```lua\n", include_str!("../lua/end_if.lua"), "```\n")]
}
