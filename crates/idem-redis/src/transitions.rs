//! The store's calls: [`Store`] for [`RedisStore`]. `begin` is one plain `SET .. NX GET`
//! in the common cases; each fenced transition is written once for both paths
//! ([`crate::Scripting`]): a compare-and-set with the exact record the lease holds
//! ([`Lease::version`]), sent as the server's own command (`SET .. IFEQ .. GET`, `DELIFEQ`,
//! `DELEX .. IFEQ`) or as `set_if.lua` / `end_if.lua`. When the record holds anything else,
//! the lease is lost. (A lease handed out without a version, such as the release of a claim
//! whose `begin` answer was lost, reads the record first and writes only if its token
//! holds it.)

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Completion, Error, FencingToken, Lease, Record, RecordId, Result, Scope,
    Stats, Store, StreamRead, Watch,
};
use redis::aio::ConnectionLike as _;
use redis::{Cmd, ErrorKind, ServerErrorKind, Value};
use tokio::time::Instant;

use crate::caps::Path;
use crate::codec::{self, Head};
use crate::connection::Conn;
use crate::error::{classify, unexpected};
use crate::scripts;
use crate::store::{call, millis, read, RedisStore, CAS_ROUNDS};
use crate::STORE;

/// What a compare-and-set answered.
pub(crate) enum Answer {
    /// It wrote, expired or deleted: the value was the one expected.
    Matched,
    /// It did nothing: the key held this value instead (`None`: absent).
    Found(Option<Bytes>),
}

/// A transition of a lease's record.
enum Write<'a> {
    Complete {
        encoded: &'a codec::EncodedCompletion,
        expires_at: u32,
        ms: u64,
    },
    Release,
    Extend {
        by_ms: u64,
    },
}

impl RedisStore {
    /// `begin`: `SET key <in-progress record> NX GET PX <lease + retention>` acquires an
    /// absent key, else hands back the record that decides: completed, a replay; another
    /// fingerprint, a mismatch. A record in progress also needs its key's `PTTL` (the
    /// server's clock): minus its margin, the lease time left. An expired lease is taken
    /// over with a compare-and-set of the record read, decided again if it changed.
    async fn begin_once(
        &self,
        conn: &mut Conn,
        key: &str,
        req: &BeginRequest<'_>,
    ) -> Result<Begin, Error> {
        let sent_at = Instant::now();
        let lease_ms = millis(req.lease).max(1);
        let margin_ms = millis(req.retention);
        // The lease carries the record written for it: its fenced writes compare with that.
        let granted = |attempt, remaining, written: &[u8]| {
            Lease::new(req.id.clone(), req.token, attempt, remaining, sent_at)
                .with_version(Bytes::copy_from_slice(written))
        };
        let full = Duration::from_millis(lease_ms);
        let first = codec::in_progress(&req.token, margin_ms, &req.fingerprint, 1);
        let set = set_nx_get(key, &first, lease_ms + margin_ms);
        let mut found = self.set_nx(conn, &set).await?;
        for _ in 0..CAS_ROUNDS {
            let Some(old) = found else {
                return self.hold(conn, key, granted(1, full, &first)).await;
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
                    ) if f != req.fingerprint => return Ok(Begin::Mismatch),
                    Some(Head::Completed { expires_at, .. }) => {
                        return Ok(Begin::Replay(codec::replay(&old, expires_at)?))
                    }
                    Some(Head::InProgress { .. }) => {}
                    None => return Err(Error::corrupt(STORE, "not a record")),
                }
                let pttl = redis::cmd("PTTL").arg(key).query_async(conn).await;
                let pttl: i64 = pttl.map_err(classify)?;
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
                if token == req.token {
                    // The same attempt asking again (its reply was lost): its own lease back.
                    let left = codec::millis(lease_left_ms);
                    return self.hold(conn, key, granted(attempt, left, &old)).await;
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
            found = match self.set_if(conn, key, &old, &write, ms, false).await?.0 {
                Answer::Matched => {
                    return self.hold(conn, key, granted(attempt, full, &write)).await
                }
                // Gone meanwhile: start over.
                Answer::Found(None) => self.set_nx(conn, &set).await?,
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

    /// Hands a lease to the caller: `Acquired` for attempt 1, `TookOver` after, once enough
    /// replicas hold it when durability is on (otherwise it is given back).
    async fn hold(&self, conn: &mut Conn, key: &str, lease: Lease) -> Result<Begin, Error> {
        if let Some(error) = self.replicate(conn, key, "begin", false).await? {
            // The lease may not survive a failover: give it back rather than let the work
            // run on it. A failed release leaves it to expire.
            let _ = self.release_on(conn, key, &lease, false).await;
            return Err(error);
        }
        Ok(if lease.attempt() == 1 {
            Begin::Acquired(lease)
        } else {
            Begin::TookOver(lease)
        })
    }

    /// The pub/sub command of a record's waiters: `sharded` on a cluster, else `classic`.
    fn pubsub(&self, sharded: &'static str, classic: &'static str) -> &'static str {
        if self.is_cluster() {
            sharded
        } else {
            classic
        }
    }

    /// Sets `key` to `value` for `ms` if it holds exactly `expected`, waking its waiters
    /// after a write when `wake`: the answer, and the waiters still to wake
    /// ([`RedisStore::wake`]).
    pub(crate) async fn set_if(
        &self,
        conn: &mut Conn,
        key: &str,
        expected: &[u8],
        value: &[u8],
        ms: u64,
        wake: bool,
    ) -> Result<(Answer, i64), Error> {
        if self.path() == Path::Scripts {
            let mut call = scripts::SET_IF.key(key);
            call.arg(expected).arg(value).arg(ms);
            call.arg(if wake {
                self.pubsub("SHARDNUMSUB", "NUMSUB")
            } else {
                ""
            });
            return Ok((answer(invoke(&call, conn).await?, expected)?, 0));
        }
        let mut cmd = Cmd::with_capacity(8, key.len() + expected.len() + value.len() + 30);
        cmd.arg("SET").arg(key).arg(value).arg("IFEQ").arg(expected);
        cmd.arg("GET").arg("PX").arg(ms);
        let (old, waiters) = self.counted(conn, key, cmd, wake).await?;
        Ok((answer(old, expected)?, waiters))
    }

    /// Deletes `key` (`ms` 0) or sets its time to live to `ms`, if it holds exactly
    /// `expected`; a delete wakes its waiters. As [`RedisStore::set_if`].
    async fn end_if(
        &self,
        conn: &mut Conn,
        key: &str,
        expected: &[u8],
        ms: u64,
    ) -> Result<(Answer, i64), Error> {
        let mut cmd = Cmd::with_capacity(8, key.len() + expected.len() + 20);
        match self.path() {
            Path::Scripts => {
                let mut call = scripts::END_IF.key(key);
                call.arg(expected)
                    .arg(ms)
                    .arg(self.pubsub("SHARDNUMSUB", "NUMSUB"));
                return Ok((answer(invoke(&call, conn).await?, expected)?, 0));
            }
            // No compare-and-expire command: the same value set again, with the new expiry.
            _ if ms > 0 => return self.set_if(conn, key, expected, expected, ms, false).await,
            Path::DelIfEq => cmd.arg("DELIFEQ").arg(key).arg(expected),
            Path::DelEx => cmd.arg("DELEX").arg(key).arg("IFEQ").arg(expected),
            Path::SetReleased => {
                let released = codec::RELEASED;
                return self.set_if(conn, key, expected, released, 1, true).await;
            }
        };
        let (deleted, waiters) = self.counted(conn, key, cmd, true).await?;
        match deleted {
            Value::Int(1) => Ok((Answer::Matched, waiters)),
            // It does not say what the key holds instead: read it.
            Value::Int(0) => Ok((Answer::Found(self.get_value(conn, key).await?), 0)),
            other => Err(unexpected("a compare-and-delete", &other)),
        }
    }

    /// Sends `cmd`, with `PUBSUB NUMSUB` (`SHARDNUMSUB`) of `key` behind it in the same
    /// round trip when `count` (on a cluster the pipeline goes to the key's primary, where
    /// its shard channel lives): its answer, and the waiters counted.
    pub(crate) async fn counted(
        &self,
        conn: &mut Conn,
        key: &str,
        cmd: Cmd,
        count: bool,
    ) -> Result<(Value, i64), Error> {
        if !count {
            let answer = conn.req_packed_command(&cmd).await;
            return Ok((answer.and_then(Value::extract_error).map_err(classify)?, 0));
        }
        let mut pipe = redis::Pipeline::with_capacity(2);
        pipe.add_command(cmd);
        pipe.cmd("PUBSUB")
            .arg(self.pubsub("SHARDNUMSUB", "NUMSUB"))
            .arg(key);
        let replies = conn
            .req_packed_commands(&pipe, 0, 2)
            .await
            .map_err(classify)?;
        let [answer, count] = <[Value; 2]>::try_from(replies)
            .map_err(|_| Error::backend(STORE, "a reply is missing"))?;
        // `[channel, subscribers]`.
        let waiters = redis::from_redis_value_ref::<(Value, i64)>(&count).map_or(0, |(_, n)| n);
        Ok((answer.extract_error().map_err(classify)?, waiters))
    }

    /// Wakes a record's waiters, when [`RedisStore::counted`] counted some; should this
    /// fail, they fall back to polling.
    pub(crate) async fn wake(&self, conn: &mut Conn, key: &str, waiters: i64) {
        if waiters <= 0 {
            return;
        }
        if let Err(e) = redis::cmd(self.pubsub("SPUBLISH", "PUBLISH"))
            .arg(key)
            .arg("")
            .query_async::<i64>(conn)
            .await
        {
            tracing::debug!(error = %e, "could not wake the waiters of a record");
        }
    }

    /// The value of `key`, as [`crate::store::read`] reads it, without its `PTTL`.
    pub(crate) async fn get_value(
        &self,
        conn: &mut Conn,
        key: &str,
    ) -> Result<Option<Bytes>, Error> {
        let value = redis::cmd("GET").arg(key).query_async(conn).await;
        Ok(codec::live(value.map_err(classify)?))
    }

    /// Makes `write` on the record `lease` holds: the version it carries, or (for a lease
    /// handed out without one) the record read, when the lease's token holds it. One
    /// compare-and-set. Returns the waiters to wake on success, or the value the key holds
    /// instead.
    async fn on_lease(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        write: &Write<'_>,
    ) -> Result<Result<i64, Option<Bytes>>, Error> {
        let other = |value: Option<Bytes>| match value {
            Some(v) if codec::decode_head(&v, 0).is_none() => {
                Err(Error::corrupt(STORE, "not a record"))
            }
            v => Ok(Err(v)),
        };
        let read;
        let held: &[u8] = match lease.version() {
            Some(version) => version,
            None => match self.get_value(conn, key).await? {
                Some(value) if held_by(&value, lease.token()) => {
                    read = value;
                    &read
                }
                value => return other(value),
            },
        };
        let (answer, waiters) = match write {
            Write::Complete {
                encoded,
                expires_at,
                ms,
            } => {
                let record = codec::completed(codec::identity(held), encoded, *expires_at);
                self.set_if(conn, key, held, &record, *ms, true).await?
            }
            Write::Release => self.end_if(conn, key, held, 0).await?,
            Write::Extend { by_ms } => {
                let ms = by_ms.saturating_add(codec::margin_ms(held)).max(1);
                self.end_if(conn, key, held, ms).await?
            }
        };
        match answer {
            Answer::Matched => Ok(Ok(waiters)),
            Answer::Found(value) => other(value),
        }
    }

    /// `complete`: the completed record in place of the one the lease holds. A call sent
    /// again (`resent`) also succeeds when the record already holds this completion.
    pub(crate) async fn complete_on(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        encoded: &codec::EncodedCompletion,
        retention: Duration,
        resent: bool,
    ) -> Result<(), Error> {
        let expires_at = codec::expires_at(retention);
        let ms = millis(retention).max(1);
        let write = Write::Complete {
            encoded,
            expires_at,
            ms,
        };
        let waiters = match self.on_lease(conn, key, lease, &write).await? {
            Ok(waiters) => waiters,
            // The first send did it; only its reply was lost.
            Err(Some(stored))
                if resent
                    && lease
                        .version()
                        .is_some_and(|held| codec::completes(held, encoded, &stored)) =>
            {
                0
            }
            Err(_) => return Err(Error::LeaseLost),
        };
        self.wake(conn, key, waiters).await;
        self.replicate(conn, key, "complete", true)
            .await?
            .map_or(Ok(()), Err)
    }

    /// `release`: the record the lease holds deleted. A call sent again (`resent`) also
    /// succeeds when the record is absent.
    pub(crate) async fn release_on(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        resent: bool,
    ) -> Result<(), Error> {
        match self.on_lease(conn, key, lease, &Write::Release).await? {
            Ok(waiters) => {
                self.wake(conn, key, waiters).await;
                Ok(())
            }
            Err(None) if resent => Ok(()),
            Err(_) => Err(Error::LeaseLost),
        }
    }
}

/// `SET key value NX GET PX ms`: writes an absent key, else answers what it holds.
pub(crate) fn set_nx_get(key: &str, value: &[u8], ms: u64) -> Cmd {
    let mut cmd = Cmd::with_capacity(7, key.len() + value.len() + 30);
    cmd.arg("SET").arg(key).arg(value).arg("NX").arg("GET");
    cmd.arg("PX").arg(ms);
    cmd
}

/// Runs a script through `invoke_async` (which loads it on `NOSCRIPT` and sends it once
/// more), again when the script cache was flushed between that load and that send (a
/// `SCRIPT FLUSH` or a failover racing it), up to three sends in all.
async fn invoke(call: &redis::ScriptInvocation<'_>, conn: &mut Conn) -> Result<Value, Error> {
    let mut sends = 0;
    loop {
        sends += 1;
        match call.invoke_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) && sends < 3 => {}
            other => return other.map_err(classify),
        }
    }
}

/// A compare-and-set's answer: the value the key held, which is `expected` when it wrote.
fn answer(old: Value, expected: &[u8]) -> Result<Answer, Error> {
    match old {
        Value::BulkString(old) if old == expected => Ok(Answer::Matched),
        Value::BulkString(old) => Ok(Answer::Found(Some(old.into()))),
        Value::Nil => Ok(Answer::Found(None)),
        other => Err(unexpected("a compare-and-set", &other)),
    }
}

/// Whether `value` is an in-progress record held by `token`.
pub(crate) fn held_by(value: &[u8], token: FencingToken) -> bool {
    matches!(codec::decode_head(value, 0),
        Some(Head::InProgress { token: t, .. }) if t == token)
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
            .begin_once(&mut conn, &key, &req)
            .await)
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let encoded = codec::encode_completion(completion, &self.config().body)?;
        let key = self.record_key(lease.id());
        call!(self, |conn, resent| {
            self.complete_on(&mut conn, &key, lease, &encoded, ttl, resent)
                .await
        })
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let key = self.record_key(lease.id());
        call!(self, |conn, resent| {
            self.release_on(&mut conn, &key, lease, resent).await
        })
    }

    /// The deadline moved to `by` from now, the key's expiry with it (the margin kept after
    /// the deadline stays what `begin` set). Extending twice to the same `by` from now is
    /// what one extend does.
    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        let key = self.record_key(lease.id());
        let by_ms = millis(by);
        let (write, by) = (Write::Extend { by_ms }, Duration::from_millis(by_ms));
        call!(self, |conn, _resent| async {
            let sent_at = Instant::now();
            match self.on_lease(&mut conn, &key, lease, &write).await? {
                Ok(_) => Ok(lease.renewed(lease.attempt(), by, sent_at)),
                Err(_) => Err(Error::LeaseLost),
            }
        }
        .await)
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let key = self.record_key(id);
        let (value, pttl) = call!(self, |conn, _resent| read(&mut conn, &key).await)?;
        value.map(|v| codec::decode_record(id, v, pttl)).transpose()
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        let key = self.record_key(id);
        call!(self, |conn, _resent| redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .map(|deleted: i64| deleted > 0)
            .map_err(classify))
    }

    /// In two round trips: the record and the stream's length read (a lost lease and a gap
    /// refused before anything is written), then `SETRANGE` at `at`, the stream's expiry
    /// pushed back, the waiters woken. Sent again after a dropped connection, it writes the
    /// same bytes at the same offset, which changes nothing. No compare needed: the stream's
    /// key is its holder's token's, and readers read only the stream of the token the
    /// record holds, so a lost lease's writes are never read.
    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<()> {
        let key = self.record_key(lease.id());
        let stream = crate::key::stream_key(&self.config().prefix, &key, lease.token());
        let held = |record: &[u8]| match lease.version() {
            Some(version) => version == record,
            None => held_by(record, lease.token()),
        };
        call!(self, |conn, _resent| async {
            let mut pipe = redis::pipe();
            pipe.cmd("GET").arg(&key).cmd("STRLEN").arg(&stream);
            let (record, len): (Option<Vec<u8>>, u64) =
                pipe.query_async(&mut conn).await.map_err(classify)?;
            if !record.as_deref().is_some_and(held) {
                return Err(Error::LeaseLost);
            }
            if at > len {
                // The caller skipped bytes, or the stream expired during a pause longer than
                // its time to live.
                return Err(Error::Invalid(format!(
                    "append at byte {at} of a stream of {len} bytes: append at its end"
                )));
            }
            // The stream outlives its last append by twice the lease time left and a minute,
            // so that a holder renewing its lease through a long pause still finds it.
            let ttl_ms = millis(lease.remaining()).saturating_mul(2);
            let ttl_ms = ttl_ms.saturating_add(60_000);
            let mut pipe = redis::pipe();
            pipe.cmd("SETRANGE")
                .arg(&stream)
                .arg(at)
                .arg(bytes)
                .ignore();
            pipe.cmd("PEXPIRE").arg(&stream).arg(ttl_ms).ignore();
            let publish = self.pubsub("SPUBLISH", "PUBLISH");
            pipe.cmd(publish).arg(&key).arg("").ignore();
            pipe.query_async::<()>(&mut conn).await.map_err(classify)
        }
        .await)
    }

    /// The record and its time to live, then, in progress, the holder's stream from `from`
    /// (two round trips: the stream's key depends on the holder).
    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead> {
        let key = self.record_key(id);
        let start = i64::try_from(from).unwrap_or(i64::MAX);
        call!(self, |conn, _resent| async {
            let (value, pttl) = read(&mut conn, &key).await?;
            let Some(value) = value else {
                return Ok(StreamRead::Absent);
            };
            match codec::decode_head(&value, pttl) {
                Some(Head::Completed { .. }) => {
                    Ok(StreamRead::Completed(codec::decode_completion(&value)?))
                }
                Some(Head::InProgress {
                    token,
                    lease_left_ms,
                    ..
                }) => {
                    let stream = crate::key::stream_key(&self.config().prefix, &key, token);
                    let mut range = redis::cmd("GETRANGE");
                    range.arg(&stream).arg(start).arg(-1);
                    let bytes: Vec<u8> = range.query_async(&mut conn).await.map_err(classify)?;
                    Ok(StreamRead::Live {
                        token,
                        bytes: Bytes::from(bytes),
                        lease_remaining: codec::millis(lease_left_ms),
                    })
                }
                None => codec::vanished(&value, pttl).map(|()| StreamRead::Absent),
            }
        }
        .await)
    }

    /// Pub/sub (see the [crate docs](crate#waiters)): the waiter subscribes to the record's
    /// channel on the store's subscribing connection, a shard channel on a cluster. `None`
    /// when the subscription is not confirmed in time (the caller polls).
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        self.inner.notifier.watch(self.record_key(id)).await
    }

    /// Scans every primary for the store's keys (`SCAN MATCH` on the prefix and scope) and
    /// reads each record, a page of keys at a time ([`RedisStore::scan`] to its end). Not a
    /// snapshot: records changing meanwhile may be counted in either state. Each round trip
    /// is bounded by [`crate::RedisConfig::response_timeout`]; the whole count is not.
    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats, Error> {
        let mut scan = self.scan(scope, stuck_after);
        while scan.step().await? {}
        Ok(scan.counts().stats)
    }
}

#[cfg(test)]
mod on_redis {
    //! A call sent twice (its first reply lost with its connection) is answered as if it ran
    //! once, on both paths: Lua scripts (the server at `IDEM_TEST_REDIS_URL`) and the
    //! compare-and-set commands (a throwaway Valkey). The module's name puts it among the
    //! Redis tests (`scripts/test redis`).
    use super::*;
    use idem_core::{Fingerprint, Key, Response, Scope};

    const KEEP: Duration = Duration::from_secs(600);

    async fn acquired(store: &RedisStore, key: &str) -> Lease {
        let id = RecordId::new(Scope::new("resend").unwrap(), Key::new(key).unwrap());
        let req = BeginRequest {
            id: &id,
            fingerprint: Fingerprint::of_bytes(b"f"),
            token: FencingToken::random(),
            lease: Duration::from_secs(30),
            retention: KEEP,
        };
        match store.begin(req).await.unwrap() {
            Begin::Acquired(lease) => lease,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    /// A re-sent complete that finds its own completion, and a re-sent release that finds
    /// the key gone, succeed; the same calls not marked as re-sent are lease-lost, and a
    /// re-sent complete of another completion too.
    async fn resent_calls_count_once_on(store: &RedisStore) {
        let mut conn = store.ready().await.unwrap();
        let body = Completion::succeeded(Response::new(200, "body"));
        let other = Completion::succeeded(Response::new(200, "other"));
        let lease = acquired(store, "complete").await;
        let key = store.record_key(lease.id());
        store.complete(&lease, &body, KEEP).await.unwrap();
        let again = store.complete(&lease, &body, KEEP).await;
        assert!(matches!(again, Err(Error::LeaseLost)), "{again:?}");
        for (c, lost) in [(&body, false), (&other, true)] {
            let encoded = codec::encode_completion(c, &store.config().body).unwrap();
            let resent = store.complete_on(&mut conn, &key, &lease, &encoded, KEEP, true);
            match resent.await {
                Err(Error::LeaseLost) if lost => {}
                Ok(()) if !lost => {}
                other => panic!("a completion sent again answered {other:?}"),
            }
        }
        let stored = store.get(lease.id()).await.unwrap().expect("the record");
        match stored.state {
            idem_core::RecordState::Completed(c) => assert_eq!(c.response.body, "body"),
            other => panic!("expected the completion, got {other:?}"),
        }

        let lease = acquired(store, "release").await;
        let key = store.record_key(lease.id());
        store.release(&lease).await.unwrap();
        let again = store.release(&lease).await;
        assert!(matches!(again, Err(Error::LeaseLost)), "{again:?}");
        let resent = store.release_on(&mut conn, &key, &lease, true).await;
        resent.expect("a release sent again");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resent_calls_count_once() {
        let Some(url) = idem_testkit::harness::redis_url() else {
            return;
        };
        let prefix = idem_testkit::harness::unique_name("idem_resend_");
        let store = RedisStore::builder(url)
            .with_prefix(prefix)
            .connect()
            .await
            .unwrap();
        resent_calls_count_once_on(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resent_calls_count_once_without_scripts() {
        let server = tokio::task::spawn_blocking(|| idem_testkit::valkey::throwaway(&[]));
        let Some(server) = server.await.unwrap() else {
            return;
        };
        let store = RedisStore::builder(server.url())
            .with_scripting(crate::Scripting::NoScripts)
            .connect()
            .await
            .unwrap();
        resent_calls_count_once_on(&store).await;
    }
}
