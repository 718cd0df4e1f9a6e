//! [`RedisStore`], its builder, and what every call goes through: a ready connection (the
//! eviction policy checked, the servers' path read) and one send again after a dropped
//! connection. The calls themselves are in `transitions.rs`.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{Error, RecordId};
use tokio::sync::OnceCell;

use crate::caps::{self, Path, Server};
use crate::codec;
use crate::config::{BodyLimit, Durability, EvictionCheck, OversizeBody, RedisConfig, Scripting};
use crate::connection::{values, Conn, Connection, CLUSTER_SCHEME};
use crate::error::{classify, EvictionPolicyError, ReplicationError};
use crate::key;
use crate::notify::Waiters;
use crate::STORE;

/// Durations sent to Redis are capped at 2^40 ms (about 34 years), far below what would
/// overflow its expiry arithmetic or the Lua number type.
const MAX_MS: u64 = 1 << 40;

/// How many compare-and-set rounds a call makes, each finding the record changed since it
/// was read, before it answers [`Error::Unavailable`].
pub(crate) const CAS_ROUNDS: usize = 8;

/// Runs one store call: `$body` with a connection in `$conn`, and once more on a fresh one
/// with `$resent` set when the connection fails under it ([`RedisStore::send_again`]). The
/// first send may or may not have reached the server; every call answers the second as if
/// only one had run (`begin` hands the same token its own lease back; `complete` and
/// `release` with `$resent` also accept their own write done; `extend` and `append` write
/// the same thing again). So the first call after a server restart succeeds, where the
/// connection manager would hand back the error of its last failed reconnect.
macro_rules! call {
    ($store:expr, |$conn:ident, $resent:ident| $body:expr) => {
        async {
            let mut $resent = false;
            loop {
                let result = match $store.ready().await {
                    Ok(mut $conn) => $body,
                    Err(e) => Err(e),
                };
                match result {
                    Err(e) if !$resent && $store.send_again(&e) => $resent = true,
                    other => break other,
                }
            }
        }
        .await
    };
}
pub(crate) use call;

/// The idempotency [`idem_core::Store`] on Redis or Valkey: one round trip per transition
/// in the common case, lease deadlines by the server's clock.
///
/// Cheap to clone (clones share the connection). See the [crate docs](crate) for a quick
/// start, the paths per server, the key layout, the memory per record and durability.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    connection: Connection,
    config: RedisConfig,
    /// Set once the eviction policy was checked and found acceptable (or warned about).
    checked: OnceCell<()>,
    /// Waiters' pub/sub: classic on one server, sharded on a cluster.
    pub(crate) notifier: Arc<Waiters>,
    /// The [`Path`] of the transitions (`as u8`), 0 until the servers were read (and
    /// again when a node refuses a command, so that they are read again).
    path: AtomicU8,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("connection", &self.inner.connection)
            .field("config", &self.inner.config)
            .finish()
    }
}

/// Builds a [`RedisStore`]: `RedisStore::builder(url).with_*(..).connect().await`.
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    config: RedisConfig,
}

impl RedisStoreBuilder {
    /// Replaces all settings.
    pub fn with_config(mut self, config: RedisConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets [`RedisConfig::prefix`]. Default: `"idem:"`.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.prefix = prefix.into();
        self
    }

    /// Sets [`RedisConfig::body`]. Default: 1 MiB, compressed above it.
    pub fn with_body_limit(mut self, max_bytes: usize, oversize: OversizeBody) -> Self {
        self.config.body = BodyLimit {
            max_bytes,
            oversize,
        };
        self
    }

    /// Sets [`RedisConfig::eviction`]. Default: [`EvictionCheck::Warn`].
    pub fn with_eviction_check(mut self, check: EvictionCheck) -> Self {
        self.config.eviction = check;
        self
    }

    /// Sets [`RedisConfig::durability`]: wait for `replicas` replicas, up to `timeout`,
    /// after each acquisition and completion. Default: no wait.
    pub fn with_durability(mut self, replicas: u32, timeout: Duration) -> Self {
        self.config.durability = Some(Durability { replicas, timeout });
        self
    }

    /// Sets [`RedisConfig::persistence_check`]. Default: on (a warning when the server
    /// persists nothing); turn it off for the Redis of a tiered store.
    pub fn with_persistence_check(mut self, check: bool) -> Self {
        self.config.persistence_check = check;
        self
    }

    /// Sets [`RedisConfig::scripting`]. Default: [`Scripting::Auto`].
    pub fn with_scripting(mut self, scripting: Scripting) -> Self {
        self.config.scripting = scripting;
        self
    }

    /// Sets [`RedisConfig::connect_timeout`] and [`RedisConfig::response_timeout`].
    /// Defaults: 1 s and 2 s.
    pub fn with_timeouts(mut self, connect: Duration, response: Duration) -> Self {
        self.config.connect_timeout = connect;
        self.config.response_timeout = response;
        self
    }

    /// Connects and checks the server's `maxmemory-policy` per [`RedisConfig::eviction`].
    /// Scripts are loaded on first use.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a bad URL or setting; [`Error::Unavailable`] when Redis cannot
    /// be reached within [`RedisConfig`]'s connection timeout and retries, or does not
    /// answer within its response timeout; [`Error::Backend`] when the policy evicts and
    /// [`EvictionCheck::Refuse`] is set.
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let store = self.connect_lazy()?;
        let mut conn = store.ready().await?;
        // The eviction check may be off: make sure the server answers.
        redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(classify)?;
        Ok(store)
    }

    /// Builds the store without connecting: the first call connects (and checks the
    /// eviction policy). For services that must start while Redis is down.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a bad URL or setting, or when called outside a Tokio runtime.
    pub fn connect_lazy(self) -> Result<RedisStore, Error> {
        let config = self.config;
        key::check_prefix(&config.prefix)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Invalid(
                "RedisStore must be built inside a Tokio runtime".into(),
            ));
        }
        if let Some(d) = config.durability {
            if d.replicas > 0 && d.timeout >= config.response_timeout {
                return Err(Error::Invalid(format!(
                    "durability timeout {:?} must be shorter than the response timeout {:?}",
                    d.timeout, config.response_timeout
                )));
            }
        }
        if config.response_timeout.is_zero() {
            return Err(Error::Invalid(
                "the redis response timeout must not be zero".into(),
            ));
        }
        let (connection, pubsub) = Connection::open(&self.url, &config)?;
        let notifier = Waiters::start(pubsub, config.response_timeout);
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                config,
                checked: OnceCell::new(),
                notifier,
                path: AtomicU8::new(0),
            }),
        })
    }
}

impl RedisStore {
    /// Connects with the default [`RedisConfig`]. `url` is `redis://[user:password@]host:port[/db]`
    /// (or `unix://`) for one server, or
    /// `redis+cluster://[user:password@]host:port[,host:port...]` for Redis Cluster (any
    /// reachable nodes; the rest are discovered).
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::connect`].
    pub async fn connect(url: impl Into<String>) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }

    /// A builder with the default [`RedisConfig`], for the URLs of [`RedisStore::connect`].
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            config: RedisConfig::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// Whether this store talks to Redis Cluster (a `redis+cluster://` URL).
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.connection, Connection::Cluster(_))
    }

    /// The Redis key that holds a record (for operators: `MEMORY USAGE`, `PTTL`, ...).
    pub fn record_key(&self, id: &RecordId) -> String {
        key::record_key(&self.inner.config.prefix, id)
    }

    /// Sends `PING`: whether Redis answers within [`RedisConfig::response_timeout`] (once
    /// connected).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when it does not.
    pub async fn ping(&self) -> Result<(), Error> {
        call!(self, |conn, _resent| {
            redis::cmd("PING")
                .query_async::<()>(&mut conn)
                .await
                .map_err(classify)
        })
    }

    /// The scheme that selects Redis Cluster in a URL.
    pub const CLUSTER_SCHEME: &'static str = CLUSTER_SCHEME;

    /// A connection, after the eviction-policy check has passed once and the servers'
    /// commands were read ([`RedisStore::path`]).
    pub(crate) async fn ready(&self) -> Result<Conn, Error> {
        let mut conn = self.inner.connection.get().await?;
        if self.inner.config.eviction != EvictionCheck::Skip {
            self.inner
                .checked
                .get_or_try_init(|| check_eviction(&mut conn, &self.inner.config))
                .await?;
        }
        if self.inner.path.load(Ordering::Relaxed) == 0 {
            let path = self.detect(&mut conn).await?;
            self.inner.path.store(path as u8, Ordering::Relaxed);
        }
        Ok(conn)
    }

    /// How the transitions are made: read from the servers by [`RedisStore::ready`].
    pub(crate) fn path(&self) -> Path {
        Path::from_u8(self.inner.path.load(Ordering::Relaxed)).unwrap_or(Path::Scripts)
    }

    /// Reads every primary's name and version (`INFO server`) and chooses the path per
    /// [`RedisConfig::scripting`]; logs it.
    async fn detect(&self, conn: &mut Conn) -> Result<Path, Error> {
        let scripting = self.inner.config.scripting;
        let servers: Option<Vec<Server>> = match conn.info("server").await {
            Ok(texts) => texts.iter().map(|t| Server::parse(t)).collect(),
            Err(e) => {
                let e = unreadable(e)?;
                tracing::warn!(error = %e, "could not read the redis servers' versions");
                None
            }
        };
        let path = caps::choose(servers.as_deref(), scripting)?;
        let servers: Vec<String> = servers.iter().flatten().map(ToString::to_string).collect();
        tracing::info!(
            servers = %servers.join(", "),
            path = ?path,
            ?scripting,
            "redis transitions: {}",
            match path {
                Path::Scripts => "Lua scripts",
                _ => "compare-and-set commands, no scripts",
            }
        );
        Ok(path)
    }

    /// Whether a call that failed with `error` is sent once more: when the connection failed
    /// under it (refused, dropped, reset; not a timeout, after which it may still run), or
    /// a node refused a compare-and-set command (a failover or a resharding onto an older
    /// server; the servers are read again first).
    pub(crate) fn send_again(&self, error: &Error) -> bool {
        let (Error::Unavailable { source, .. } | Error::Backend { source, .. }) = error else {
            return false;
        };
        let Some(e) = source.downcast_ref::<redis::RedisError>() else {
            return false;
        };
        if matches!(error, Error::Unavailable { .. }) {
            return e.is_connection_dropped() || e.is_connection_refusal();
        }
        let refused = self.path() != Path::Scripts
            && e.detail()
                .is_some_and(|d| d.contains("syntax error") || d.contains("unknown command"));
        if refused {
            self.inner.path.store(0, Ordering::Relaxed);
        }
        refused
    }

    /// Waits for replicas after a write when durability is on: `Ok(None)` when enough
    /// acknowledged (or durability is off), else the error the `step` answers (`kept`:
    /// whether its write stays on the primary).
    pub(crate) async fn replicate(
        &self,
        conn: &mut Conn,
        key: &str,
        step: &'static str,
        kept: bool,
    ) -> Result<Option<Error>, Error> {
        let Some(d) = self.inner.config.durability.filter(|d| d.replicas > 0) else {
            return Ok(None);
        };
        let acked = conn.wait(key, d.replicas, d.timeout).await?;
        let error = ReplicationError {
            acked,
            wanted: d.replicas,
            step,
            kept,
        };
        Ok((acked < d.replicas).then(|| Error::unavailable(STORE, error)))
    }
}

/// Reads the servers' `maxmemory-policy` and warns or refuses per `config.eviction`; then,
/// per `config.persistence_check`, warns when they persist nothing.
async fn check_eviction(conn: &mut Conn, config: &RedisConfig) -> Result<(), Error> {
    let check = config.eviction;
    let policies: Vec<String> = match conn.info("memory").await {
        Ok(texts) => values(&texts, "maxmemory_policy")
            .map(str::to_owned)
            .collect(),
        Err(e) => {
            let e = unreadable(e)?;
            tracing::warn!(
                error = %e,
                "could not read redis maxmemory-policy; make sure it is noeviction, or records \
                 may be evicted and their work run again"
            );
            return Ok(());
        }
    };
    if policies.is_empty() {
        tracing::warn!(
            "redis did not report its maxmemory-policy; make sure it is noeviction, or records \
             may be evicted and their work run again"
        );
    }
    if let Some(policy) = policies.into_iter().find(|p| p != "noeviction") {
        let error = EvictionPolicyError { policy };
        if check == EvictionCheck::Refuse {
            return Err(Error::backend(STORE, error));
        }
        tracing::warn!(
            policy = %error.policy,
            "REDIS MAY EVICT IDEMPOTENCY RECORDS: {error}"
        );
    }
    if !config.persistence_check {
        return Ok(());
    }
    match conn.persists_nothing().await {
        Ok(true) => tracing::warn!(
            "REDIS PERSISTS NOTHING (no AOF, no RDB save points): a restart of it forgets every \
             record, and retries of completed keys run their work again; turn on \
             `appendonly yes`, or use the tiered store (PostgreSQL the arbiter)"
        ),
        Ok(false) => {}
        Err(e) => tracing::debug!(error = %e, "could not read redis persistence settings"),
    }
    Ok(())
}

/// A failed read of the servers' settings (`INFO` may be disabled: managed services rename
/// it): `Ok` with the error when the check is to be skipped with a warning; `Err` when it is
/// the error to return: Redis out of reach, refusing us (a wrong password, none given), or
/// answering what is not RESP (another server at that port, which the caller names).
fn unreadable(e: redis::RedisError) -> Result<Error, Error> {
    let refused = e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"));
    let foreign = e.kind() == redis::ErrorKind::Parse;
    let e = classify(e);
    if e.is_retryable() || refused || foreign {
        Err(e)
    } else {
        Ok(e)
    }
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).min(MAX_MS)
}

/// The value of `key` (`None` when absent, or released a moment ago on Valkey 8.1) and its
/// `PTTL`, in one round trip.
pub(crate) async fn read(conn: &mut Conn, key: &str) -> Result<(Option<Bytes>, i64), Error> {
    let mut pipe = redis::pipe();
    pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
    let (value, pttl) = pipe.query_async(conn).await.map_err(classify)?;
    Ok((codec::live(value), pttl))
}
