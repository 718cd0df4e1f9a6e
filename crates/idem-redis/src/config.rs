//! Settings of a [`crate::RedisStore`]. Every field has a documented default.

use std::time::Duration;

/// Settings of a [`crate::RedisStore`].
///
/// ```
/// use std::time::Duration;
/// use idem_redis::{BodyLimit, Durability, EvictionCheck, OversizeBody, RedisConfig};
///
/// let config = RedisConfig::default()
///     .with_prefix("payments:".to_owned())
///     .with_body(
///         BodyLimit::default()
///             .with_max_bytes(256 * 1024)
///             .with_oversize(OversizeBody::Refuse),
///     )
///     .with_eviction(EvictionCheck::Refuse)
///     .with_durability(Some(Durability::new(1, Duration::from_millis(100))));
/// assert_eq!(config.connect_timeout, Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct RedisConfig {
    /// Put in front of every key, to share a Redis with other data. It must not contain `{`
    /// or `}` (they would change the keys' hash slot). Default: `"idem:"`.
    pub prefix: String,
    /// The longest a connection attempt may take. Default: 1 s.
    pub connect_timeout: Duration,
    /// The longest Redis may take to answer one command. Must be longer than the
    /// [`Durability::timeout`], since `WAIT` is a command too. Default: 2 s.
    pub response_timeout: Duration,
    /// How many times a failed connection to one server is retried, with a short exponential
    /// backoff, before a call gives up with [`idem_core::Error::Unavailable`]. (A cluster
    /// connection follows redirections and retries with redis-rs's defaults.) Default: 2.
    ///
    /// The store puts no limit of its own on a call as a whole: [`idem_core::Idem`] bounds
    /// every store call by [`idem_core::Config::store_timeout`].
    pub reconnect_retries: usize,
    /// How big a stored body may be, and what happens to bigger ones.
    /// Default: [`BodyLimit::default`] (1 MiB, compressed above it).
    pub body: BodyLimit,
    /// What to do when the server may evict keys. Default: [`EvictionCheck::Warn`].
    pub eviction: EvictionCheck,
    /// Wait for replicas after each acquisition and completion. Default: `None` (no wait).
    pub durability: Option<Durability>,
    /// Whether the first connection warns when the server persists nothing (no AOF, no RDB
    /// save points), so that a restart forgets every record. Default: `true`. Off for the
    /// Redis of a tiered store, which needs no persistence: PostgreSQL is its arbiter.
    pub persistence_check: bool,
    /// Whether the store may use Lua scripts, or the servers' compare-and-set commands.
    /// Default: [`Scripting::Auto`].
    pub scripting: Scripting,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            prefix: "idem:".to_owned(),
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(2),
            reconnect_retries: 2,
            body: BodyLimit::default(),
            eviction: EvictionCheck::default(),
            durability: None,
            persistence_check: true,
            scripting: Scripting::default(),
        }
    }
}

/// How the store makes its fenced transitions (complete, release, extend, a takeover):
/// with the servers' compare-and-set commands, or with Lua scripts. The crate docs'
/// [Which path](crate#which-path) says which servers have the commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Scripting {
    /// The commands where every primary has them, Lua scripts otherwise. The default.
    #[default]
    Auto,
    /// Lua scripts on every server.
    Scripts,
    /// The commands only: no `EVAL`, `EVALSHA` or `FCALL` is ever sent (for services that
    /// disable scripting). Connecting to a server without the commands fails with
    /// [`idem_core::Error::Backend`], naming the versions that have them.
    NoScripts,
}

/// The largest body a completed record keeps as it is, and what happens to a bigger one.
///
/// The limit is on the body only; status and headers are always kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct BodyLimit {
    /// Bodies up to this many bytes are stored as they are. Default: 1 MiB.
    pub max_bytes: usize,
    /// What happens to a body over `max_bytes`. Default: [`OversizeBody::Compress`].
    pub oversize: OversizeBody,
}

impl Default for BodyLimit {
    fn default() -> Self {
        Self {
            max_bytes: 1024 * 1024,
            oversize: OversizeBody::Compress,
        }
    }
}

/// What happens to a body over [`BodyLimit::max_bytes`] when a record is completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OversizeBody {
    /// Compress it with LZ4; if it is still over the limit, refuse it as
    /// [`OversizeBody::Refuse`] does. Retries get the original bytes back. The default.
    #[default]
    Compress,
    /// Keep the status and headers and drop the body: retries get an empty body.
    StatusAndHeaders,
    /// Refuse the completion with [`idem_core::Error::Invalid`]; the record stays in progress
    /// and the caller decides (release it, or store a smaller response).
    Refuse,
}

/// What to do when the server's `maxmemory-policy` lets it evict keys (any policy but
/// `noeviction`: see the crate docs' [Eviction](crate#eviction)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EvictionCheck {
    /// Log a `tracing` warning when the policy evicts (or cannot be read), and go on. The
    /// default.
    #[default]
    Warn,
    /// Refuse to work with a server whose policy evicts: connecting fails with
    /// [`idem_core::Error::Backend`] (and so does every call of a lazily connected store).
    /// A policy that cannot be read is warned about and accepted.
    Refuse,
    /// Do not look.
    Skip,
}

/// Wait for replicas to acknowledge each acquisition and completion (Redis `WAIT`).
///
/// After a `begin` that wrote a lease and after every `complete`, the store sends
/// `WAIT replicas timeout` on the connection that wrote (in a cluster, to the record's
/// primary) and checks the count. When too few replicas answer in time:
/// - after `begin`, the lease is released again and the call fails with
///   [`idem_core::Error::Unavailable`] (its source is a [`crate::ReplicationError`]), so
///   the work does not run on a lease a failover could forget;
/// - after `complete`, the completion stays on the primary and the call fails the same
///   way: the outcome is stored but not yet known to be on `replicas` replicas.
///
/// What it does **not** promise: replication stays asynchronous. `WAIT` says the replicas
/// received the write, not that a failover will pick one of them, nor that they wrote it to
/// disk; an acknowledged write can still be lost. And `WAIT` blocks the connection it is sent
/// on: other calls multiplexed on it queue behind it until the replicas answer or the
/// timeout passes. For a guarantee, make the database the arbiter (the outbox pattern).
#[derive(Debug, Clone, Copy, PartialEq, Eq, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct Durability {
    /// How many replicas must acknowledge. 0 turns the wait off.
    pub replicas: u32,
    /// How long to wait for them (at least 1 ms; shorter than
    /// [`RedisConfig::response_timeout`]).
    pub timeout: Duration,
}

impl Durability {
    /// Waits for `replicas` to acknowledge each write, at most `timeout`.
    pub fn new(replicas: u32, timeout: Duration) -> Self {
        Self { replicas, timeout }
    }
}
