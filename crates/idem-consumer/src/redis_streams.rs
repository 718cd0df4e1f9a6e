//! A Redis Streams worker on [`redis`]: read entries as a member of a consumer group, run
//! each through a [`Consumer`], and acknowledge, hand back, retry or dead-letter it as
//! decided.
//!
//! # Topology
//!
//! [`Topology::new`] names a stream, a consumer group and a dead-letter stream;
//! [`Topology::declare`] creates the group (and the stream) when missing. An entry's
//! payload is its [`PAYLOAD_FIELD`] field; every other field reads as a header (so the key
//! comes from the [`IDEMPOTENCY_KEY_HEADER`](crate::IDEMPOTENCY_KEY_HEADER) field by
//! default; [`publish`] adds an entry with it).
//!
//! ```text
//!  XADD ──▶ <stream> ──XREADGROUP / XAUTOCLAIM──▶ Worker ──XACK──▶ (done)
//!              ▲   ▲                               │ │ │
//!              │   └── left pending: claimable ────┘ │ │
//!              │       again after the delay          │ │
//!   retry: MULTI XADD a copy with x-idem-attempt and  │ │
//!   x-idem-retry-at, XACK the original, EXEC ─────────┘ │
//!                  <stream>.dead ◀── MULTI XADD a copy with x-idem-dead-letter-reason,
//!                                    XACK the original, EXEC
//! ```
//!
//! docs/consumers.md's table says what each [`Delivery`](crate::Delivery) does
//! here. A requeued entry is left pending and made claimable after the delay (at most
//! [`Topology::claim_idle`]). A copy (retry, dead letter) carries [`ATTEMPT_HEADER`], and
//! [`RETRY_AT_HEADER`] or [`DEAD_LETTER_REASON_HEADER`]; it is added and the original
//! acknowledged in one `MULTI`/`EXEC`: both happen or neither does. A worker that reads a
//! retry early leaves it pending until it is due (not an attempt).
//!
//! Acknowledged entries stay in the stream until it is trimmed (`XADD .. MAXLEN`, `XTRIM`):
//! trim it as you would without idem. On Redis Cluster, give the stream a hash tag
//! (`{payments}`), so that `{payments}.dead` lives in the same slot; the worker itself talks
//! to one standalone server (a [`redis::Client`]).
//!
//! # Leases and redelivery
//!
//! While a handler runs, the worker resets its entry's idle time (`XCLAIM .. JUSTID`) every
//! third of [`Topology::claim_idle`], so `XAUTOCLAIM` by the other workers never takes the
//! entry of a live worker; the engine extends the lease in the store meanwhile. A worker
//! that dies stops both: once its entries have been idle for `claim_idle`, another worker
//! claims them (and leaves them pending while the dead worker's leases hold).
//!
//! # Shutdown
//!
//! When the `shutdown` future of [`Worker::run`] completes, the worker stops reading, lets
//! the handlers in progress finish and settles their entries, and hands the entries it read
//! but had not started back at once (claimable by the group's other workers).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use idem_core::{Failure, Key, Scope};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use redis::{RedisError, Value};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::consumer::{Consumer, Context, DeadLetterReason};
use crate::key::propagation_headers;
use crate::message::{Message, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, RETRY_AT_HEADER};
use crate::worker::{self, retry_at, Broker, Next, Settled, Source, Summary};

/// The field of an entry that holds the message's payload; the other fields are its
/// headers.
pub const PAYLOAD_FIELD: &str = "payload";

/// How long one `XREADGROUP` blocks waiting for entries, so that the worker also claims
/// handed-back entries and notices shutdown in between.
const READ_BLOCK: Duration = Duration::from_millis(200);

/// What went wrong with Redis.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A command failed: `what` says which.
    #[error("Redis Streams: {what}: {source}")]
    Redis {
        /// The command: `"create the consumer group"`, `"connect"`, ...
        what: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// The consumer group (or the stream) was deleted while the worker ran. The handlers in
    /// progress were finished first; `summary` says what was done.
    #[error("the consumer group is gone: {source}")]
    GroupGone {
        /// The client's error (`NOGROUP`).
        #[source]
        source: RedisError,
        /// What the worker did before.
        summary: Summary,
    },
}

fn redis_error(what: &'static str) -> impl FnOnce(RedisError) -> Error {
    move |source| Error::Redis { what, source }
}

/// The streams and consumer group a [`Worker`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Topology {
    /// The stream's key.
    pub stream: String,
    /// The consumer group the workers share. Default: `"idem"`.
    pub group: String,
    /// The stream dead letters are added to. Default: `"<stream>.dead"`.
    pub dead_letter_stream: String,
    /// How long an entry stays pending without a sign of life before another worker of the
    /// group claims it (`XAUTOCLAIM`): a dead worker's entries are picked up this long after
    /// its last heartbeat, and a handed-back entry waits at most this long. Default: 30 s.
    pub claim_idle: Duration,
}

impl Topology {
    /// `stream`, consumed by the group `"idem"`, dead letters to `"<stream>.dead"`.
    pub fn new(stream: impl Into<String>) -> Self {
        let stream = stream.into();
        Self {
            dead_letter_stream: format!("{stream}.dead"),
            stream,
            group: "idem".to_owned(),
            claim_idle: Duration::from_secs(30),
        }
    }

    /// Sets [`Topology::group`].
    pub fn with_group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Sets [`Topology::claim_idle`] (at least 1 ms).
    pub fn with_claim_idle(mut self, claim_idle: Duration) -> Self {
        self.claim_idle = claim_idle.max(Duration::from_millis(1));
        self
    }

    /// Creates the consumer group at the start of the stream (`XGROUP CREATE .. 0
    /// MKSTREAM`, creating the stream too), unless the group exists.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`].
    pub async fn declare(&self, conn: &mut ConnectionManager) -> Result<(), Error> {
        let created: Result<(), RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(conn)
            .await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => {
                Err(redis_error("create the consumer group")(e))
            }
            _ => Ok(()),
        }
    }

    /// Deletes the stream and the dead-letter stream, entries, group and all (for tests and
    /// teardown).
    ///
    /// # Errors
    ///
    /// [`Error::Redis`].
    pub async fn delete(&self, conn: &mut ConnectionManager) -> Result<(), Error> {
        redis::cmd("DEL")
            .arg(&self.stream)
            .arg(&self.dead_letter_stream)
            .query_async::<()>(conn)
            .await
            .map_err(redis_error("delete the streams"))
    }
}

/// Reads a stream as a member of a consumer group and runs each entry through a
/// [`Consumer`]. See the [module docs](self) for what each decision does on the stream, and
/// for shutdown.
/// `examples/redis_streams.rs` runs one from a fresh clone.
#[derive(Debug, Clone)]
pub struct Worker {
    settings: worker::Settings,
    topology: Topology,
    batch: usize,
    name: String,
}

impl Worker {
    /// A worker for `topology`, with concurrency 4, batches of 16, and a consumer name of
    /// its own (`idem-<process id>-<start time>`).
    pub fn new(consumer: Consumer, topology: Topology) -> Self {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Self {
            settings: worker::Settings::new(consumer),
            topology,
            batch: 16,
            name: format!("idem-{}-{started:x}", std::process::id()),
        }
    }

    /// How many entries one read asks for (at least 1). Entries read wait in the worker for
    /// a free handler, pending and without heartbeat: keep it a small multiple of the
    /// concurrency. Default: 16.
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The consumer name within the group. Names must differ between the workers running at
    /// once. Default: `idem-<process id>-<start time>`.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    worker::run_method! {
        /// Reads the topology's stream as a member of its group (which must exist: see
        /// [`Topology::declare`]) until `shutdown` completes, then shuts down cleanly (see the
        /// [module docs](self)). `handler` gets each message and its [`Context`]; its value is
        /// stored as JSON and handed to duplicates.
        ///
        /// # Errors
        ///
        /// [`Error::Redis`] when the connections cannot be made; [`Error::GroupGone`] when the
        /// group or the stream is deleted while the worker runs (after the handlers in progress
        /// finished). A server that goes away for a while is waited for.
        client: &redis::Client,
        Error::GroupGone
    }

    /// Starts consuming: the worker's [`Source`].
    async fn source(&self, client: &redis::Client) -> Result<Reading, Error> {
        // Reads block for READ_BLOCK on a connection of their own, so that acks and
        // heartbeats on the other never wait behind them.
        let reader = ConnectionManager::new_with_config(
            client.clone(),
            ConnectionManagerConfig::new().set_response_timeout(Some(READ_BLOCK * 10)),
        )
        .await
        .map_err(redis_error("connect"))?;
        let conn = client
            .get_connection_manager()
            .await
            .map_err(redis_error("connect"))?;
        let entries = Entries {
            topology: self.topology.clone(),
            name: self.name.clone(),
            conn,
        };
        tracing::info!(stream = %self.topology.stream, group = %self.topology.group, name = %self.name, "consuming");
        Ok(Reading {
            entries,
            reader,
            batch: self.batch,
            buffer: VecDeque::new(),
            // XAUTOCLAIM scans the group's pending entries from a cursor; it runs every
            // quarter of claim_idle (at least every second) when nothing new is buffered.
            claim_every: (self.topology.claim_idle / 4)
                .clamp(Duration::from_millis(20), Duration::from_secs(1)),
            claimed_at: None,
            cursor: "0-0".to_owned(),
        })
    }
}

/// The worker's reads: entries read or claimed, waiting for a handler.
struct Reading {
    entries: Entries,
    reader: ConnectionManager,
    batch: usize,
    buffer: VecDeque<StreamId>,
    claim_every: Duration,
    claimed_at: Option<tokio::time::Instant>,
    cursor: String,
}

impl Source for Reading {
    type Broker = Entry;
    type Error = RedisError;

    /// If shutdown comes while a read is in flight, the read may leave entries pending
    /// under this worker's name: the group claims them after claim_idle.
    async fn next(&mut self) -> Next<Entry, RedisError> {
        if self.buffer.is_empty() {
            match self.read().await {
                Ok(read) => self.buffer.extend(read),
                Err(e) if e.code() == Some("NOGROUP") => {
                    tracing::error!(error = %e, "consumer group gone");
                    return Next::Failed(e);
                }
                // The server away for a while: the connection manager reconnects; wait a
                // little so that an outage is not a busy loop.
                Err(e) => {
                    tracing::warn!(error = %e, "reading the stream failed; reading again");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        match self.buffer.pop_front() {
            Some(entry) => Next::Delivery(Entry {
                entries: self.entries.clone(),
                entry,
            }),
            None => Next::Again,
        }
    }

    /// Hands back what was read but not started, claimable at once.
    async fn stop(&mut self, _failed: bool) {
        for entry in self.buffer.drain(..) {
            self.entries.hand_back(&entry.id, Duration::ZERO).await;
        }
    }

    async fn close(self, summary: &Summary) {
        tracing::info!(stream = %self.entries.topology.stream, ?summary, "stopped");
    }
}

impl Reading {
    /// Entries handed back or left by a dead worker when a claim is due and finds some,
    /// else new entries.
    async fn read(&mut self) -> Result<Vec<StreamId>, RedisError> {
        if self
            .claimed_at
            .is_none_or(|at| at.elapsed() >= self.claim_every)
        {
            self.claimed_at = Some(tokio::time::Instant::now());
            let claimed = self
                .entries
                .autoclaim(&mut self.reader, &mut self.cursor, self.batch)
                .await?;
            if !claimed.is_empty() {
                return Ok(claimed);
            }
        }
        self.entries.read(&mut self.reader, self.batch).await
    }
}

/// The worker's commands on its stream, under its consumer name.
#[derive(Clone)]
struct Entries {
    topology: Topology,
    name: String,
    conn: ConnectionManager,
}

impl Entries {
    /// New entries for this consumer (`XREADGROUP .. >`), waiting up to [`READ_BLOCK`].
    async fn read(
        &self,
        reader: &mut ConnectionManager,
        count: usize,
    ) -> Result<Vec<StreamId>, RedisError> {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.topology.group)
            .arg(&self.name)
            .arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(millis(READ_BLOCK))
            .arg("STREAMS")
            .arg(&self.topology.stream)
            .arg(">")
            .query_async(reader)
            .await?;
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .collect())
    }

    /// Entries of the group idle for `claim_idle` (a dead worker's, or handed back), now
    /// this consumer's (`XAUTOCLAIM`), scanning on from `cursor`.
    async fn autoclaim(
        &self,
        conn: &mut ConnectionManager,
        cursor: &mut String,
        count: usize,
    ) -> Result<Vec<StreamId>, RedisError> {
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(&self.name)
            .arg(millis(self.topology.claim_idle))
            .arg(cursor.as_str())
            .arg("COUNT")
            .arg(count)
            .query_async(conn)
            .await?;
        *cursor = reply.next_stream_id;
        Ok(reply.claimed)
    }

    /// Resets the entry's idle time: a sign of life, so no other worker claims it.
    async fn keep(&self, id: &str) {
        let kept: Result<Value, RedisError> = self
            .claim(id, None)
            .query_async(&mut self.conn.clone())
            .await;
        if let Err(e) = kept {
            tracing::warn!(error = %e, "heartbeat on a pending entry failed");
        }
    }

    /// Leaves the entry pending, claimable by the group after `after` (at most
    /// `claim_idle`): its idle time is set to `claim_idle - after`.
    async fn hand_back(&self, id: &str, after: Duration) -> Settled {
        let idle = self.topology.claim_idle.saturating_sub(after);
        let result: Result<Value, RedisError> = self
            .claim(id, Some(idle))
            .query_async(&mut self.conn.clone())
            .await;
        // Even when this fails the entry stays pending, and is claimed after claim_idle.
        Settled::Requeued.unless_failed(result.map(drop), "hand back", CLAIMED_AGAIN)
    }

    /// `XCLAIM <stream> <group> <name> 0 <id> [IDLE <ms>] JUSTID`: the entry stays this
    /// consumer's, its idle time reset (or set), its delivery count unchanged.
    fn claim(&self, id: &str, idle: Option<Duration>) -> redis::Cmd {
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(&self.name)
            .arg(0)
            .arg(id);
        if let Some(idle) = idle {
            cmd.arg("IDLE").arg(millis(idle));
        }
        cmd.arg("JUSTID");
        cmd
    }

    async fn ack(&self, id: &str) -> Settled {
        let result = redis::cmd("XACK")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(id)
            .query_async::<()>(&mut self.conn.clone())
            .await;
        Settled::Acked.unless_failed(result, "XACK", CLAIMED_AGAIN)
    }

    /// Adds a copy of `entry` with `extra` fields to `stream` and acknowledges the original,
    /// in one transaction. Returns false (nothing done) when it failed.
    async fn copy_then_ack(
        &self,
        entry: &StreamId,
        stream: &str,
        extra: &[(&str, String)],
    ) -> bool {
        let mut fields: Vec<(&str, Vec<u8>)> = entry
            .map
            .iter()
            .filter(|(name, _)| !extra.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)))
            .filter_map(|(name, value)| Some((name.as_str(), bytes(value)?)))
            .collect();
        fields.extend(extra.iter().map(|(n, v)| (*n, v.as_bytes().to_vec())));
        let result = redis::pipe()
            .atomic()
            .cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg(fields)
            .ignore()
            .cmd("XACK")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(&entry.id)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await;
        match result {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%stream, error = %e, "copy not added");
                false
            }
        }
    }
}

/// One entry read by the worker, to settle.
struct Entry {
    entries: Entries,
    entry: StreamId,
}

impl Broker for Entry {
    const RETRY_AT: bool = true;

    fn message(&self) -> Message {
        message_of(&self.entry)
    }

    /// A sign of life every third of claim_idle, so the group's other workers do not claim
    /// the entry while the handler runs.
    fn heartbeat(&self) -> Option<Duration> {
        Some((self.entries.topology.claim_idle / 3).max(Duration::from_millis(1)))
    }

    async fn beat(&self) {
        self.entries.keep(&self.entry.id).await;
    }

    async fn ack(&mut self) -> Settled {
        self.entries.ack(&self.entry.id).await
    }

    async fn hand_back(&mut self, after: Duration) -> Settled {
        self.entries.hand_back(&self.entry.id, after).await
    }

    async fn retry(&mut self, attempt: u32, after: Duration) -> bool {
        let extra = [
            (ATTEMPT_HEADER, attempt.to_string()),
            (RETRY_AT_HEADER, retry_at(after)),
        ];
        let stream = &self.entries.topology.stream;
        self.entries
            .copy_then_ack(&self.entry, stream, &extra)
            .await
    }

    async fn dead_letter(&mut self, reason: &DeadLetterReason, attempt: u32) -> bool {
        let extra = [
            (ATTEMPT_HEADER, attempt.to_string()),
            (DEAD_LETTER_REASON_HEADER, reason.to_string()),
        ];
        let dead = &self.entries.topology.dead_letter_stream;
        self.entries.copy_then_ack(&self.entry, dead, &extra).await
    }
}

/// What becomes of an entry whose command failed.
const CLAIMED_AGAIN: &str = "the entry stays pending and is claimed again";

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The bytes of a field's value (a bulk or simple string, or an integer as its digits).
fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.as_bytes().to_vec()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

/// The [`Message`] of a stream entry: [`PAYLOAD_FIELD`] as its payload (empty when
/// missing), and every other field whose value is UTF-8 text as a header.
pub fn message_of(entry: &StreamId) -> Message {
    let payload = entry
        .map
        .get(PAYLOAD_FIELD)
        .and_then(bytes)
        .unwrap_or_default();
    let mut message = Message::new(payload);
    for (name, value) in &entry.map {
        if name == PAYLOAD_FIELD {
            continue;
        }
        if let Some(text) = bytes(value).and_then(|b| String::from_utf8(b).ok()) {
            message = message.with_header(name.as_str(), text);
        }
    }
    message
}

/// The fields of an entry for `payload`, with the fields of [`propagation_headers`] (`key`,
/// and when given the publishing request's `scope`, for
/// [`Consumer::with_scope_header`]): add them with `XADD <stream> * <fields>`, or use
/// [`publish`].
///
/// ```
/// use idem_consumer::redis_streams::fields_with_key;
/// use idem_core::Key;
/// let fields = fields_with_key(b"{}", &Key::new("3f9c-payment").unwrap(), None);
/// assert_eq!(fields[0], ("payload", b"{}".to_vec()));
/// assert_eq!(fields[1], ("x-idempotency-key", b"3f9c-payment".to_vec()));
/// ```
pub fn fields_with_key(
    payload: &[u8],
    key: &Key,
    scope: Option<&Scope>,
) -> Vec<(&'static str, Vec<u8>)> {
    let mut fields = vec![(PAYLOAD_FIELD, payload.to_vec())];
    fields.extend(
        propagation_headers(key, scope)
            .into_iter()
            .map(|(name, value)| (name, value.into_bytes())),
    );
    fields
}

/// Adds an entry for `payload` with `key` (see [`fields_with_key`]) to `stream`, and
/// returns its ID.
///
/// # Errors
///
/// The server's.
pub async fn publish(
    conn: &mut ConnectionManager,
    stream: &str,
    payload: &[u8],
    key: &Key,
    scope: Option<&Scope>,
) -> Result<String, RedisError> {
    redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg(fields_with_key(payload, key, scope))
        .query_async(conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_as_messages() {
        let mut entry = StreamId {
            id: "1-0".into(),
            ..StreamId::default()
        };
        for (field, value) in [
            (PAYLOAD_FIELD, &b"{\"a\":1}"[..]),
            ("x-idempotency-key", b"k-1"),
            (ATTEMPT_HEADER, b"2"),
            ("binary", &[0xff, 0xfe]),
        ] {
            let value = Value::BulkString(value.to_vec());
            entry.map.insert(field.into(), value);
        }
        let message = message_of(&entry);
        assert_eq!(message.payload(), b"{\"a\":1}");
        assert_eq!(message.text_header("x-idempotency-key"), Some("k-1"));
        assert_eq!(message.failed_attempts(), 2);
        assert_eq!(message.header("binary"), None);
        assert_eq!(message.header(PAYLOAD_FIELD), None);
    }
}
