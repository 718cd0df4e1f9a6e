//! What a store that puts Redis in front of an arbiter (the tiered store of `idem-outbox`,
//! whose arbiter is PostgreSQL) asks of the Redis store beyond [`idem_core::Store`]:
//! [`RedisStore::tier`].
//!
//! The arbiter claims keys and commits completions; Redis answers duplicates first. So the
//! tier reads a key's answer without claiming it ([`Tier::peek`]), makes a claim the arbiter
//! granted visible ([`Tier::hold`]), and copies a completion the arbiter committed into
//! Redis without ever overwriting a newer state ([`Tier::apply_completion`]). Every other
//! call is the [`idem_core::Store`] itself.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint, Lease, RecordId,
};
use redis::Value;

use crate::codec::{self, Head};
use crate::error::classify;
use crate::store::{call, millis, read, RedisStore, CAS_ROUNDS};
use crate::transitions::{held_by, set_nx_get, Answer};
use crate::STORE;

/// What [`Tier::apply_completion`] did.
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

/// The Redis store's calls for a tiered store: [`RedisStore::tier`].
#[derive(Debug, Clone, Copy)]
pub struct Tier<'a> {
    store: &'a RedisStore,
}

impl RedisStore {
    /// The calls a tiered store makes of this store beyond [`idem_core::Store`]
    /// ([module docs](crate::tier)).
    pub fn tier(&self) -> Tier<'_> {
        Tier { store: self }
    }
}

impl Tier<'_> {
    /// What the record of `req.id` answers `req`, read without writing anything: a replay or a
    /// mismatch of a completed record, or in flight (or a mismatch) under another token's
    /// live lease. `None` when the key is absent, its lease ran out, or `req`'s own token
    /// holds it: then only a claim can answer. One round trip (`GET` and `PTTL`, pipelined).
    ///
    /// A read that times out leaves nothing behind when it lands late, where a claim would.
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Corrupt`] when the value is not a record.
    pub async fn peek(&self, req: &BeginRequest<'_>) -> Result<Option<Begin>, Error> {
        let store = self.store;
        let key = store.record_key(req.id);
        let (record, pttl) = call!(store, |conn, _resent| read(&mut conn, &key).await)?;
        let Some(record) = record else {
            return Ok(None);
        };
        let Some(head) = codec::decode_head(&record, pttl) else {
            return codec::vanished(&record, pttl).map(|()| None);
        };
        Ok(match head {
            Head::InProgress {
                token,
                lease_left_ms,
                ..
            } if token == req.token || lease_left_ms <= 0 => None,
            Head::Completed { fingerprint: f, .. } | Head::InProgress { fingerprint: f, .. }
                if f != req.fingerprint =>
            {
                Some(Begin::Mismatch)
            }
            Head::Completed { expires_at, .. } => {
                Some(Begin::Replay(codec::replay(&record, expires_at)?))
            }
            Head::InProgress { lease_left_ms, .. } => Some(Begin::InFlight {
                retry_after: codec::millis(lease_left_ms),
            }),
        })
    }

    /// Writes `lease`'s in-progress record (with `fingerprint`, kept no longer than the
    /// lease) into an absent key with `SET .. NX PX`: a claim granted by the arbiter, made
    /// visible so that [`Tier::peek`] answers in flight for it. A key that holds anything (a
    /// completion that landed first, an older holder's record) is left as it is.
    ///
    /// Returns `lease` with the record it meant to write as its version: the Redis store's
    /// extend and release compare with exactly that, so where the key holds anything else
    /// they find the lease lost and change nothing.
    ///
    /// # Errors
    ///
    /// Store errors. After an [`Error::Unavailable`] the write may still land: give it back
    /// with [`idem_core::Store::release`] (which then reads the record and compares the
    /// lease's token) once Redis answers.
    pub async fn hold(&self, lease: &Lease, fingerprint: &Fingerprint) -> Result<Lease, Error> {
        let store = self.store;
        let key = store.record_key(lease.id());
        let record = codec::in_progress(&lease.token(), 0, fingerprint, lease.attempt());
        let ttl_ms = millis(lease.remaining()).max(1);
        call!(store, |conn, _resent| {
            // A re-sent SET NX finds its own record and writes nothing: the same outcome.
            redis::cmd("SET")
                .arg(&key)
                .arg(record.as_slice())
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query_async::<Option<String>>(&mut conn)
                .await
                .map_err(classify)
        })?;
        Ok(lease.clone().with_version(Bytes::copy_from_slice(&record)))
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
    /// [`crate::OversizeBody`] policy refuses it.
    pub async fn apply_completion(
        &self,
        id: &RecordId,
        identity: Option<(&Fingerprint, u32)>,
        token: FencingToken,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<Applied, Error> {
        let store = self.store;
        let key = store.record_key(id);
        let encoded = codec::encode_completion(completion, &store.config().body)?;
        let expires_at = codec::expires_at(ttl);
        let ms = millis(ttl).max(1);
        // The record read, then the completion written with `SET .. NX GET` (absent) or a
        // compare-and-set (held by `token`), read again when it changed in between. A re-send
        // after a dropped connection applies once more, which changes nothing.
        call!(store, |conn, _resent| async {
            let conn = &mut conn;
            for _ in 0..CAS_ROUNDS {
                let current = store.get_value(conn, &key).await?;
                let held = match current.as_deref() {
                    None => None,
                    Some(value) => match codec::decode_head(value, 0) {
                        None => return Err(Error::corrupt(STORE, "not a record")),
                        Some(Head::Completed { .. }) => return Ok(Applied::AlreadyCompleted),
                        Some(_) if held_by(value, token) => Some(value),
                        Some(_) => return Ok(Applied::HeldByAnotherLease),
                    },
                };
                // The fingerprint and attempt: the held record's, else the ones given.
                let written_as = match (held, identity) {
                    (Some(held), _) => codec::identity(held),
                    (None, Some((fp, attempt))) => (*fp, attempt),
                    (None, None) => return Ok(Applied::Absent),
                };
                let record = codec::completed(written_as, &encoded, expires_at);
                let (written, waiters) = match held {
                    Some(held) => {
                        let (answer, waiters) =
                            store.set_if(conn, &key, held, &record, ms, true).await?;
                        (matches!(answer, Answer::Matched), waiters)
                    }
                    None => {
                        let cmd = set_nx_get(&key, &record, ms);
                        let (old, waiters) = store.counted(conn, &key, cmd, true).await?;
                        (old == Value::Nil, waiters)
                    }
                };
                if written {
                    store.wake(conn, &key, waiters).await;
                    return Ok(Applied::Written);
                }
            }
            Err(Error::unavailable(
                STORE,
                "the record kept changing under an apply; try again",
            ))
        }
        .await)
    }
}
