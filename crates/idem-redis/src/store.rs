//! [`RedisStore`]: the [`Store`] on Redis 7, standalone or Redis Cluster.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint, Lease, Record, RecordId,
    Replay, Result, Scope, Stats, Store, Watch,
};
use redis::aio::ConnectionLike;
use redis::Value;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::caps::{self, Path, Server};
use crate::codec::{self, Head};
use crate::config::{BodyLimit, Durability, EvictionCheck, OversizeBody, RedisConfig, Scripting};
use crate::connection::{
    pubsub_client, shard_pubsub_client, Conn, Connection, CLUSTER_SCHEME, RECONNECT_MAX_DELAY,
};
use crate::error::{classify, unexpected, EvictionPolicyError, ReplicationError};
use crate::key;
use crate::notify::{Notifier, ShardNotifier, Waiters};
use crate::transitions::Answer;
use crate::STORE;

/// Durations sent to Redis are capped at 2^40 ms (about 34 years), far below what would
/// overflow its expiry arithmetic or the Lua number type.
const MAX_MS: u64 = 1 << 40;

/// How many compare-and-set rounds a call makes, each finding the record changed since it
/// was read, before it answers [`Error::Unavailable`].
pub(crate) const CAS_ROUNDS: usize = 8;

/// Runs one store call, bounded by [`RedisConfig::call_timeout`]: `$body` with a connection
/// in `$conn`. When the connection fails under it (refused, dropped, reset), `$body` runs
/// once more on a fresh connection with `$resent` set: the first send may or may not have
/// reached the server, and every script answers a re-sent call as if only one had run (see
/// their contracts). This is also what makes the first call after a server restart succeed,
/// where the connection manager would hand back the error of its last failed reconnect.
macro_rules! call {
    ($store:expr, |$conn:ident, $resent:ident| $body:expr) => {
        $store
            .bounded(async {
                let mut $resent = false;
                loop {
                    let result = match $store.ready().await {
                        Ok($conn) => $body,
                        Err(e) => Err(e),
                    };
                    match result {
                        Err(e) if !$resent && (connection_failed(&e) || $store.refused(&e)) => {
                            $resent = true
                        }
                        other => break other,
                    }
                }
            })
            .await
    };
}

/// What [`RedisStore::apply_completion`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Applied {
    /// The completion was written.
    Written,
    /// The key was already completed; nothing changed.
    AlreadyCompleted,
    /// Another lease holds the key in Redis; nothing changed.
    HeldByAnotherLease,
    /// The key is absent and no identity was given; nothing changed.
    Absent,
}

/// The idempotency [`Store`] on Redis 7: one Lua script per transition, one round trip per
/// call, lease deadlines by the server's clock.
///
/// Cheap to clone (clones share the connection). See the [crate docs](crate) for the key
/// layout, the scripts' contracts, the memory per record and the durability option.
///
/// ```no_run
/// # async fn example() -> Result<(), idem_core::Error> {
/// use idem_core::Idem;
/// use idem_redis::RedisStore;
///
/// // One server (a ConnectionManager that reconnects by itself)...
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// // ...or Redis Cluster, from any of its nodes.
/// let cluster = RedisStore::connect("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").await?;
/// let idem = Idem::new(store);
/// # let _ = (idem, cluster); Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
    config: RedisConfig,
    /// Set once the eviction policy was checked and found acceptable (or warned about).
    checked: OnceCell<()>,
    /// Waiters' pub/sub: classic on one server, sharded on a cluster.
    notifier: Waiters,
    /// The [`Path`] of the transitions (its `to_u8`), 0 until the servers were read (and
    /// again when a node refuses a command, so that they are read again).
    path: AtomicU8,
    /// The margin (ms) of the last in-progress record this store wrote: the guess of the
    /// record a lease holds, for the compare-and-set path (`commands.rs`).
    margin_hint: AtomicU64,
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

    /// Sets [`RedisConfig::call_timeout`]. Default: 4 s.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.config.call_timeout = timeout;
        self
    }

    /// Connects and checks the server's `maxmemory-policy` per [`RedisConfig::eviction`].
    /// Scripts are loaded on first use.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a bad URL or setting; [`Error::Unavailable`] when Redis cannot
    /// be reached within [`RedisConfig::call_timeout`]; [`Error::Backend`] when the policy
    /// evicts and [`EvictionCheck::Refuse`] is set.
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let store = self.connect_lazy()?;
        store
            .bounded(async {
                let mut conn = store.ready().await?;
                // The eviction check may be off: make sure the server answers.
                redis::cmd("PING")
                    .query_async::<()>(&mut conn)
                    .await
                    .map_err(classify)
            })
            .await?;
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
        if config.call_timeout.is_zero() || config.response_timeout.is_zero() {
            return Err(Error::Invalid("redis timeouts must not be zero".into()));
        }
        let connection = Connection::open(&self.url, &config)?;
        let notifier = match pubsub_client(&self.url)? {
            Some(client) => Waiters::One(Notifier::start(client, config.response_timeout)),
            None => {
                let (push, pushes) = tokio::sync::mpsc::unbounded_channel();
                match shard_pubsub_client(&self.url, &config, push)? {
                    Some(client) => Waiters::Cluster(ShardNotifier::start(
                        client,
                        pushes,
                        config.response_timeout,
                    )),
                    None => Waiters::None,
                }
            }
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                config,
                checked: OnceCell::new(),
                notifier,
                path: AtomicU8::new(0),
                margin_hint: AtomicU64::new(u64::MAX),
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

    /// Writes a completion that was committed elsewhere (the arbiter of a tiered store) into
    /// Redis: when the key is absent, or in progress under `token` (the lease that
    /// completed). A completed key, or one held by another lease, is left as it is
    /// (the relay's docs say why). Applying twice is applying once, so a relay may deliver
    /// at least once. One round trip.
    ///
    /// `identity` is the record's fingerprint and attempt. Without it, the completing
    /// lease's in-progress record supplies them, and an absent key answers
    /// [`Applied::Absent`] (call again with them).
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Invalid`] when the body is over the limit and the
    /// [`OversizeBody`] policy refuses it.
    pub async fn apply_completion(
        &self,
        id: &RecordId,
        identity: Option<(&Fingerprint, u32)>,
        token: FencingToken,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<Applied, Error> {
        let key = self.record_key(id);
        // Applying twice is applying once: a re-send after a dropped connection needs no
        // marker.
        call!(self, |conn, _resent| {
            let mut conn = conn;
            self.apply_on(&mut conn, &key, identity, token, completion, ttl)
                .await
        })
    }

    /// What the record of `req.id` answers `req`, read without writing anything: a replay or a
    /// mismatch of a completed record, or in flight (or a mismatch) under another token's
    /// live lease. `None` when the key is absent, its lease ran out, or `req`'s own token
    /// holds it: then only a claim can answer. One round trip (`GET` and `PTTL`, pipelined).
    ///
    /// For a store that claims keys elsewhere (the tiered store claims in PostgreSQL and
    /// then writes the granted lease here with [`RedisStore::hold_granted`]): a read that
    /// times out leaves nothing behind when it lands late, where a claim would.
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Corrupt`] when the value is not a record.
    pub async fn peek(&self, req: &BeginRequest<'_>) -> Result<Option<Begin>, Error> {
        let key = self.record_key(req.id);
        let (record, pttl): (Option<Vec<u8>>, i64) = call!(self, |conn, _resent| {
            let mut conn = conn;
            redis::pipe()
                .get(&key)
                .pttl(&key)
                .query_async(&mut conn)
                .await
                .map_err(classify)
        })?;
        // Absent, or released a moment ago (Valkey 8.1).
        let Some(record) = record.filter(|r| r.as_slice() != codec::RELEASED) else {
            return Ok(None);
        };
        let record = Bytes::from(record);
        let fingerprint = req.fingerprint.as_bytes().as_slice();
        match codec::decode_head(&record, pttl) {
            Some(Head::Completed {
                fingerprint: f,
                expires_at,
                ..
            }) => {
                if f != fingerprint {
                    return Ok(Some(Begin::Mismatch));
                }
                Ok(Some(Begin::Replay(Replay {
                    completion: codec::decode_completion_in(&record, &record)?,
                    expires_in: codec::expires_in(expires_at),
                })))
            }
            Some(Head::InProgress {
                fingerprint: f,
                token,
                lease_left_ms,
                ..
            }) => Ok(
                if token == req.token.as_bytes().as_slice() || lease_left_ms <= 0 {
                    None
                } else if f != fingerprint {
                    Some(Begin::Mismatch)
                } else {
                    Some(Begin::InFlight {
                        retry_after: codec::millis(lease_left_ms),
                    })
                },
            ),
            // A key that vanished between the two commands, or expired under them.
            None if pttl < 0 && record.first() == Some(&b'P') => Ok(None),
            None => Err(Error::corrupt(STORE, "not a record")),
        }
    }

    /// Writes `lease`'s in-progress record (with `fingerprint`, kept no longer than the
    /// lease) into an absent key: a claim granted elsewhere, made visible here so that
    /// [`RedisStore::peek`] answers in flight for it. `SET .. NX PX`: a key that holds
    /// anything (a completion that landed first, an older holder's record) is left as it
    /// is. Returns whether the record was written.
    ///
    /// # Errors
    ///
    /// Store errors. After an [`Error::Unavailable`] the write may still land: give it back
    /// with [`Store::release`] (fenced by the lease's token) once Redis answers.
    pub async fn hold_granted(
        &self,
        lease: &Lease,
        fingerprint: &Fingerprint,
    ) -> Result<bool, Error> {
        let key = self.record_key(lease.id());
        let record = codec::in_progress(&lease.token(), 0, fingerprint, lease.attempt());
        // The fenced writes that follow rebuild this record to compare with: margin 0.
        self.inner.margin_hint.store(0, Ordering::Relaxed);
        let ttl_ms = millis(lease.remaining()).max(1);
        call!(self, |conn, _resent| {
            let mut conn = conn;
            // A re-sent SET NX finds its own record and writes nothing: the same outcome.
            redis::cmd("SET")
                .arg(&key)
                .arg(record.as_slice())
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query_async::<Option<String>>(&mut conn)
                .await
                .map(|ok| ok.is_some())
                .map_err(classify)
        })
    }

    /// Sends `PING`, bounded by [`RedisConfig::call_timeout`]: whether Redis answers.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when it does not.
    pub async fn ping(&self) -> Result<(), Error> {
        call!(self, |conn, _resent| {
            let mut conn = conn;
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
            self.inner.path.store(path.to_u8(), Ordering::Relaxed);
        }
        Ok(conn)
    }

    /// The margin (ms) of the last in-progress record this store wrote.
    pub(crate) fn margin_hint(&self) -> u64 {
        self.inner.margin_hint.load(Ordering::Relaxed)
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
                let e = classify(e);
                if e.is_retryable() {
                    return Err(e);
                }
                // INFO may be disabled (managed services rename it).
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
                Path::Commands(_) => "compare-and-set commands, no scripts",
            }
        );
        Ok(path)
    }

    /// Whether `error` is a node refusing a compare-and-set command (a failover or a
    /// resharding onto an older server): the servers are read again before the next call.
    fn refused(&self, error: &Error) -> bool {
        let Error::Backend { source, .. } = error else {
            return false;
        };
        let refused = matches!(self.path(), Path::Commands(_))
            && source
                .downcast_ref::<redis::RedisError>()
                .and_then(redis::RedisError::detail)
                .is_some_and(|d| d.contains("syntax error") || d.contains("unknown command"));
        if refused {
            self.inner.path.store(0, Ordering::Relaxed);
        }
        refused
    }

    /// Bounds a whole call by [`RedisConfig::call_timeout`], counted from its first poll.
    ///
    /// The timer is armed only when the call waits a second time. Nearly every call waits
    /// once (for the one round trip of its command) and is answered by the wake-up that
    /// follows, so it never pays for registering and clearing a timer: redis-rs already
    /// runs one per command. The first wait is always one redis-rs bounds by a timer of
    /// its own (the response timeout around a command, the connection timeout and the
    /// backoff pause of a reconnection, the cluster client's whole-request timeout, which is
    /// the call's). When the first three are shorter than the call's timeout, as by default,
    /// the call wakes again before its deadline and arms the timer then; otherwise the timer
    /// is armed at the first wait.
    async fn bounded<T>(&self, call: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let config = &self.inner.config;
        let limit = config.call_timeout;
        let deadline = Instant::now() + limit;
        let first_wait = config
            .response_timeout
            .max(config.connect_timeout)
            .max(RECONNECT_MAX_DELAY);
        let mut waited = first_wait >= limit;
        let mut call = std::pin::pin!(call);
        let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(result) = call.as_mut().poll(cx) {
                return Poll::Ready(result);
            }
            if !waited {
                waited = true;
                return Poll::Pending;
            }
            let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
            match timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(Error::unavailable(
                    STORE,
                    format!("no answer within {limit:?}"),
                ))),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// Waits for replicas after a write when durability is on; `Ok(None)` when enough
    /// acknowledged (or durability is off), `Ok(Some((acked, wanted)))` when too few did.
    async fn replicate(&self, conn: &mut Conn, key: &str) -> Result<Option<(u32, u32)>, Error> {
        let Some(d) = self.inner.config.durability.filter(|d| d.replicas > 0) else {
            return Ok(None);
        };
        let acked = conn.wait(key, d.replicas, d.timeout).await?;
        Ok((acked < d.replicas).then_some((acked, d.replicas)))
    }

    /// `begin`: one plain `SET key <in-progress record> NX GET PX <lease + retention>`, one
    /// round trip in the common cases. An absent key is acquired by the `SET` itself;
    /// otherwise the record it hands back decides: a completed record is replayed (it
    /// carries its own expiry), a record of another fingerprint is a mismatch. A record in
    /// progress needs the server's clock: its key's `PTTL` minus its margin is the lease
    /// time left, which tells in flight, or the caller's own lease sent again; an expired
    /// lease is taken over with a compare-and-set of the record read, whose answer is
    /// decided again when the record changed in between.
    async fn begin_once(
        &self,
        mut conn: Conn,
        key: &str,
        req: &BeginRequest<'_>,
    ) -> Result<Begin, Error> {
        let sent_at = Instant::now();
        let lease_ms = millis(req.lease).max(1);
        let margin_ms = millis(req.retention);
        self.inner.margin_hint.store(margin_ms, Ordering::Relaxed);
        let granted = |attempt, remaining| {
            Lease::new(req.id.clone(), req.token, attempt, remaining, sent_at)
                .with_fingerprint(req.fingerprint)
        };
        let full = Duration::from_millis(lease_ms);
        let first = codec::in_progress(&req.token, margin_ms, &req.fingerprint, 1);
        let mut set = redis::Cmd::with_capacity(7, key.len() + first.len() + 30);
        set.arg("SET")
            .arg(key)
            .arg(first.as_slice())
            .arg("NX")
            .arg("GET");
        set.arg("PX").arg(lease_ms + margin_ms);
        let mut found = self.set_nx(&mut conn, &set).await?;
        for _ in 0..CAS_ROUNDS {
            let Some(old) = found else {
                return self.hold(conn, key, granted(1, full)).await;
            };
            // What to write over `old`, and the attempt it is.
            let (write, attempt) = if old.as_ref() == codec::RELEASED {
                // Released on a server without a compare-and-delete: as good as absent.
                (first, 1)
            } else {
                match codec::decode_head(&old, 0) {
                    Some(
                        Head::Completed { fingerprint: f, .. }
                        | Head::InProgress { fingerprint: f, .. },
                    ) if f != req.fingerprint.as_bytes() => return Ok(Begin::Mismatch),
                    Some(Head::Completed { expires_at, .. }) => {
                        return Ok(Begin::Replay(Replay {
                            completion: codec::decode_completion_in(&old, &old)?,
                            expires_in: codec::expires_in(expires_at),
                        }))
                    }
                    Some(Head::InProgress { .. }) => {}
                    None => return Err(Error::corrupt(STORE, "not a record")),
                }
                let pttl = self.pttl(&mut conn, key).await?;
                let Some(Head::InProgress {
                    token,
                    attempt,
                    lease_left_ms,
                    ..
                }) = codec::decode_head(&old, pttl)
                else {
                    return Err(Error::corrupt(
                        STORE,
                        "in-progress record without an expiry",
                    ));
                };
                if token == req.token.as_bytes() {
                    // The same attempt asking again (its reply was lost): its own lease back.
                    let left = codec::millis(lease_left_ms);
                    return self.hold(conn, key, granted(attempt, left)).await;
                }
                if lease_left_ms > 0 {
                    return Ok(Begin::InFlight {
                        retry_after: codec::millis(lease_left_ms),
                    });
                }
                // The holder's lease expired: take it over if the record is still `old`.
                let attempt = attempt.saturating_add(1);
                let taken = codec::in_progress(&req.token, margin_ms, &req.fingerprint, attempt);
                (taken, attempt)
            };
            let ms = lease_ms + margin_ms;
            found = match self
                .set_if(&mut conn, key, &old, &write, ms, false)
                .await?
                .0
            {
                Answer::Matched => return self.hold(conn, key, granted(attempt, full)).await,
                // Gone meanwhile: start over.
                Answer::Found(None) | Answer::Unknown => self.set_nx(&mut conn, &set).await?,
                Answer::Found(Some(other)) => Some(other),
            };
        }
        Err(Error::unavailable(
            STORE,
            "the record kept changing under a takeover; try again",
        ))
    }

    /// Sends a `SET .. NX GET`: `None` when it wrote, else the value the key holds.
    async fn set_nx(&self, conn: &mut Conn, set: &redis::Cmd) -> Result<Option<Bytes>, Error> {
        let reply = conn.req_packed_command(set).await;
        match reply.and_then(Value::extract_error).map_err(classify)? {
            Value::Nil => Ok(None),
            Value::BulkString(old) => Ok(Some(Bytes::from(old))),
            other => Err(unexpected("SET NX GET", &other)),
        }
    }

    /// The key's `PTTL`.
    async fn pttl(&self, conn: &mut Conn, key: &str) -> Result<i64, Error> {
        redis::cmd("PTTL")
            .arg(key)
            .query_async(conn)
            .await
            .map_err(classify)
    }

    /// Hands a lease to the caller: `Acquired` for attempt 1, `TookOver` after, once enough
    /// replicas hold it when durability is on (otherwise it is given back).
    async fn hold(&self, mut conn: Conn, key: &str, lease: Lease) -> Result<Begin, Error> {
        if let Some((acked, wanted)) = self.replicate(&mut conn, key).await? {
            // The lease may not survive a failover: give it back rather than let the work
            // run on it. A failed release leaves it to expire.
            let _ = self.release_on(&mut conn, key, &lease, false).await;
            return Err(Error::unavailable(
                STORE,
                ReplicationError {
                    acked,
                    wanted,
                    step: "begin",
                    kept: false,
                },
            ));
        }
        Ok(if lease.attempt() == 1 {
            Begin::Acquired(lease)
        } else {
            Begin::TookOver(lease)
        })
    }

    /// Waits for replicas after a completion when durability is on.
    pub(crate) async fn after_complete(&self, conn: &mut Conn, key: &str) -> Result<(), Error> {
        if let Some((acked, wanted)) = self.replicate(conn, key).await? {
            return Err(Error::unavailable(
                STORE,
                ReplicationError {
                    acked,
                    wanted,
                    step: "complete",
                    kept: true,
                },
            ));
        }
        Ok(())
    }
}

async fn evict_once(mut conn: Conn, key: &str) -> Result<bool, Error> {
    let deleted: i64 = redis::cmd("DEL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .map_err(classify)?;
    Ok(deleted > 0)
}

/// Whether an error means the connection failed under a call (as opposed to Redis
/// answering with an error, or a timeout, after which the call may still be running).
fn connection_failed(error: &Error) -> bool {
    let Error::Unavailable { source, .. } = error else {
        return false;
    };
    source
        .downcast_ref::<redis::RedisError>()
        .is_some_and(|e| e.is_connection_dropped() || e.is_connection_refusal())
}

/// Reads the servers' `maxmemory-policy` and warns or refuses per `config.eviction`; then,
/// per `config.persistence_check`, warns when they persist nothing.
async fn check_eviction(conn: &mut Conn, config: &RedisConfig) -> Result<(), Error> {
    let check = config.eviction;
    let policies = match conn.eviction_policies().await {
        Ok(policies) => policies,
        Err(e) => {
            // A server that refuses us (a wrong password, none given) is the error to
            // report, not a check to skip with a warning first.
            let refused = e.kind() == redis::ErrorKind::AuthenticationFailed
                || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"));
            let e = classify(e);
            if e.is_retryable() || refused {
                return Err(e);
            }
            // INFO may be disabled (managed services rename it): the check cannot be made.
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

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).min(MAX_MS)
}

#[async_trait]
impl Store for RedisStore {
    fn name(&self) -> &'static str {
        STORE
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin, Error> {
        let key = self.record_key(req.id);
        // A re-sent begin carries the same token, so it gets its own lease back.
        call!(self, |conn, _resent| self
            .begin_once(conn, &key, &req)
            .await)
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let encoded = codec::encode_completion(completion, &self.inner.config.body)?;
        let key = self.record_key(lease.id());
        call!(self, |conn, resent| {
            let mut conn = conn;
            self.complete_on(&mut conn, &key, lease, &encoded, ttl, resent)
                .await
        })
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let key = self.record_key(lease.id());
        call!(self, |conn, resent| {
            let mut conn = conn;
            self.release_on(&mut conn, &key, lease, resent).await
        })
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        let key = self.record_key(lease.id());
        // Extending twice to the same `by` from now is what one extend does.
        call!(self, |conn, _resent| {
            let mut conn = conn;
            self.extend_on(&mut conn, &key, lease, by).await
        })
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let key = self.record_key(id);
        call!(self, |conn, _resent| {
            let mut conn = conn;
            self.get_on(&mut conn, &key, id).await
        })
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        let key = self.record_key(id);
        call!(self, |conn, _resent| evict_once(conn, &key).await)
    }

    /// Pub/sub (see the [crate docs](crate#waiters)): the waiter subscribes to the record's
    /// channel on the store's subscribing connection, a shard channel on a cluster. `None`
    /// when the subscription is not confirmed in time (the caller polls).
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        match &self.inner.notifier {
            Waiters::One(notifier) => notifier.watch(self.record_key(id)).await,
            Waiters::Cluster(notifier) => notifier.watch(self.record_key(id)).await,
            Waiters::None => None,
        }
    }

    /// Scans every primary for the store's keys (`SCAN MATCH` on the prefix and scope) and
    /// reads each record, a page of keys at a time ([`RedisStore::scan`] to its end). Not a
    /// snapshot: records changing meanwhile may be counted in either state. Each page is
    /// bounded by [`RedisConfig::call_timeout`]; the whole count is not.
    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats, Error> {
        crate::stats::stats(self, scope, stuck_after).await
    }
}
