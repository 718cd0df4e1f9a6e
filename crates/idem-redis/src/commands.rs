//! The fenced transitions as plain commands, on servers with compare-and-set (`SET ..
//! IFEQ`, and `DELIFEQ` or `DELEX`; see [`crate::Scripting`]): no script is ever sent.
//!
//! Each compares the whole record the lease holds. The caller's lease carries its token,
//! fingerprint and attempt; the record's margin is what the store's last `begin` wrote
//! (`margin_hint`), the same for every `begin` of an [`idem_core::Idem`]. So the common
//! case is one command. When the record differs, the `GET` of a `SET .. IFEQ .. GET` (or a
//! `GET` after a compare-and-delete) hands back what it holds: still the lease's (another
//! margin), the command goes again with it; otherwise the lease is lost.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{Error, Lease, Record, RecordId};
use redis::aio::ConnectionLike as _;
use redis::{Cmd, Value};
use tokio::time::Instant;

use crate::caps::{Path, Release};
use crate::codec::{self, Head, IN_PROGRESS_LEN};
use crate::connection::Conn;
use crate::error::{classify, unexpected};
use crate::store::{RedisStore, CAS_ROUNDS};
use crate::STORE;

/// What a compare-and-set found.
enum Found {
    /// It wrote (or deleted): the record was the one expected.
    Done,
    /// The record is no longer the lease's: absent (`None`) or this value.
    Lost(Option<Bytes>),
}

impl RedisStore {
    /// The in-progress record `lease` holds, as this store writes it, with the margin of
    /// its last `begin`; `None` when the lease does not carry its fingerprint.
    fn guess(&self, lease: &Lease) -> Option<Bytes> {
        let margin = self.margin_hint();
        let fingerprint = lease.fingerprint().filter(|_| margin != u64::MAX)?;
        let record = codec::in_progress(&lease.token(), margin, fingerprint, lease.attempt());
        Some(Bytes::copy_from_slice(&record))
    }

    /// Runs `write(expected)` (a `SET .. IFEQ expected .. GET` with `PUBSUB NUMSUB` behind
    /// it, or a compare-and-delete, see [`RedisStore::send_cas`]) against the in-progress
    /// record `lease` holds, until it matches or the record is not the lease's. Returns
    /// what was found and the waiters counted.
    async fn cas(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        write: impl Fn(&[u8]) -> Cmd,
    ) -> Result<(Found, i64), Error> {
        let mut expected = self.guess(lease);
        for _ in 0..CAS_ROUNDS {
            let current = match expected.take() {
                Some(current) => current,
                None => match self.get_value(conn, key).await? {
                    Some(value) if held_by(&value, lease) => value,
                    other => return Ok((Found::Lost(other), 0)),
                },
            };
            let (answer, waiters) = self.send_cas(conn, key, write(&current)).await?;
            match answer {
                // A `SET .. GET` hands back the value it compared with; a delete, 1.
                Value::BulkString(old) if old == current => return Ok((Found::Done, waiters)),
                Value::Int(1) => return Ok((Found::Done, waiters)),
                Value::BulkString(old) if held_by(&old, lease) => expected = Some(old.into()),
                Value::BulkString(old) => return Ok((Found::Lost(Some(old.into())), 0)),
                Value::Nil => return Ok((Found::Lost(None), 0)),
                // A delete that did not match: read what is there.
                Value::Int(0) => {}
                other => return Err(unexpected("a compare-and-set", &other)),
            }
        }
        Err(Error::unavailable(
            STORE,
            "the record kept changing under a compare-and-set; try again",
        ))
    }

    /// Sends `cmd` with `PUBSUB NUMSUB` (`SHARDNUMSUB` on a cluster, where the pipeline goes
    /// to the key's primary) of the key behind it, in one round trip: its answer and the
    /// count of waiters.
    async fn send_cas(&self, conn: &mut Conn, key: &str, cmd: Cmd) -> Result<(Value, i64), Error> {
        let mut count = redis::cmd("PUBSUB");
        count
            .arg(if self.is_cluster() {
                "SHARDNUMSUB"
            } else {
                "NUMSUB"
            })
            .arg(key);
        let mut pipe = redis::Pipeline::with_capacity(2);
        pipe.add_command(cmd).add_command(count);
        let mut replies = conn
            .req_packed_commands(&pipe, 0, 2)
            .await
            .map_err(classify)?
            .into_iter();
        let (Some(answer), Some(count)) = (replies.next(), replies.next()) else {
            return Err(Error::backend(STORE, "a reply is missing"));
        };
        let waiters = match count {
            Value::Array(items) => match items.get(1) {
                Some(Value::Int(n)) => *n,
                _ => 0,
            },
            _ => 0,
        };
        Ok((answer.extract_error().map_err(classify)?, waiters))
    }

    /// Wakes the record's waiters, when [`RedisStore::send_cas`] counted some; should this
    /// fail, they fall back to polling.
    pub(crate) async fn wake(&self, conn: &mut Conn, key: &str, waiters: i64) {
        if waiters <= 0 {
            return;
        }
        let publish = if self.is_cluster() {
            "SPUBLISH"
        } else {
            "PUBLISH"
        };
        if let Err(e) = redis::cmd(publish)
            .arg(key)
            .arg("")
            .query_async::<i64>(conn)
            .await
        {
            tracing::debug!(error = %e, "could not wake the waiters of a record");
        }
    }

    async fn get_value(&self, conn: &mut Conn, key: &str) -> Result<Option<Bytes>, Error> {
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query_async(conn)
            .await
            .map_err(classify)?;
        Ok(value
            .filter(|v| v.as_slice() != codec::RELEASED)
            .map(Bytes::from))
    }

    /// `complete` as `SET key <completed record> IFEQ <held record> GET PX <retention>`.
    /// A call sent again also succeeds when the record already holds this completion.
    pub(crate) async fn complete_commands(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        encoded: &codec::EncodedCompletion,
        retention: Duration,
        resent: bool,
    ) -> Result<(), Error> {
        let expires_at = codec::expires_at(retention);
        let completed = |held: &[u8]| {
            let fingerprint = codec::fingerprint_of(&held[23..55]);
            let attempt = u32::from_be_bytes([held[55], held[56], held[57], held[58]]);
            let record = codec::Completed {
                encoded,
                identity: Some((&fingerprint, attempt)),
                expires_at,
            };
            redis::ToRedisArgs::to_redis_args(&record).remove(0)
        };
        let ms = millis(retention).max(1);
        let (found, waiters) = self
            .cas(conn, key, lease, |held| {
                let record = completed(held);
                let mut cmd = Cmd::with_capacity(8, key.len() + record.len() + held.len() + 30);
                cmd.arg("SET").arg(key).arg(record).arg("IFEQ").arg(held);
                cmd.arg("GET").arg("PX").arg(ms);
                cmd
            })
            .await?;
        match found {
            Found::Done => {}
            // The first send did it; only its reply was lost. (The same completion, the
            // expiry at 33..37 aside, which a call sent again may put a second later.)
            Found::Lost(Some(stored))
                if resent
                    && lease.fingerprint().is_some_and(|fp| {
                        let ours =
                            completed(&codec::in_progress(&lease.token(), 0, fp, lease.attempt()));
                        stored.len() == ours.len()
                            && stored[..33] == ours[..33]
                            && stored[37..] == ours[37..]
                    }) => {}
            Found::Lost(_) => return Err(Error::LeaseLost),
        }
        self.wake(conn, key, waiters).await;
        self.after_complete(conn, key).await
    }

    /// `release` as a compare-and-delete of the held record. A call sent again also
    /// succeeds when the record is absent.
    pub(crate) async fn release_commands(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        resent: bool,
    ) -> Result<(), Error> {
        let Path::Commands(release) = self.path() else {
            return Err(Error::backend(
                STORE,
                "no compare-and-delete on this server",
            ));
        };
        let (found, waiters) = self
            .cas(conn, key, lease, |held| {
                let mut cmd = Cmd::with_capacity(8, key.len() + held.len() + 20);
                match release {
                    Release::DelIfEq => cmd.arg("DELIFEQ").arg(key).arg(held),
                    Release::DelEx => cmd.arg("DELEX").arg(key).arg("IFEQ").arg(held),
                    Release::SetReleased => cmd
                        .arg("SET")
                        .arg(key)
                        .arg(codec::RELEASED)
                        .arg("IFEQ")
                        .arg(held)
                        .arg("GET")
                        .arg("PX")
                        .arg(1),
                };
                cmd
            })
            .await?;
        match found {
            Found::Done => {
                self.wake(conn, key, waiters).await;
                Ok(())
            }
            Found::Lost(None) if resent => Ok(()),
            Found::Lost(_) => Err(Error::LeaseLost),
        }
    }

    /// `extend` as `SET key <held record> IFEQ <held record> GET PX <by + margin>`: the
    /// deadline moves to `by` from now, the margin kept after it stays what `begin` set.
    pub(crate) async fn extend_commands(
        &self,
        conn: &mut Conn,
        key: &str,
        lease: &Lease,
        by: Duration,
    ) -> Result<Lease, Error> {
        let sent_at = Instant::now();
        let by_ms = millis(by);
        let (found, _) = self
            .cas(conn, key, lease, |held| {
                let margin = codec::margin_ms(held);
                let mut cmd = Cmd::with_capacity(8, key.len() + 2 * held.len() + 30);
                cmd.arg("SET").arg(key).arg(held).arg("IFEQ").arg(held);
                cmd.arg("GET")
                    .arg("PX")
                    .arg(by_ms.saturating_add(margin).max(1));
                cmd
            })
            .await?;
        match found {
            Found::Done => {
                Ok(lease.renewed(lease.attempt(), Duration::from_millis(by_ms), sent_at))
            }
            Found::Lost(_) => Err(Error::LeaseLost),
        }
    }

    /// `get` as `GET` and `PTTL` in one round trip.
    pub(crate) async fn get_commands(
        &self,
        conn: &mut Conn,
        key: &str,
        id: &RecordId,
    ) -> Result<Option<Record>, Error> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
        let (value, pttl): (Option<Vec<u8>>, i64) =
            pipe.query_async(conn).await.map_err(classify)?;
        match value {
            Some(v) if v.as_slice() != codec::RELEASED => {
                codec::decode_record(id, Bytes::from(v), pttl, 0).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// [`RedisStore::apply_completion`] with plain commands: the record read, then written
    /// with `SET .. NX GET` (absent) or `SET .. IFEQ .. GET` (held by `token`), read again
    /// when it changed in between.
    pub(crate) async fn apply_commands(
        &self,
        conn: &mut Conn,
        key: &str,
        identity: Option<(&idem_core::Fingerprint, u32)>,
        token: idem_core::FencingToken,
        encoded: &codec::EncodedCompletion,
        ttl: Duration,
    ) -> Result<crate::Applied, Error> {
        use crate::Applied;
        let expires_at = codec::expires_at(ttl);
        let ms = millis(ttl).max(1);
        for _ in 0..CAS_ROUNDS {
            let current = self.get_value(conn, key).await?;
            let (identity, expected) = match current
                .as_deref()
                .map(|v| (v, codec::decode_head(v, 0, 0)))
            {
                None => match identity {
                    Some((fp, attempt)) => ((*fp, attempt), None),
                    None => return Ok(Applied::Absent),
                },
                Some((_, Some(Head::Completed { .. }))) => return Ok(Applied::AlreadyCompleted),
                Some((
                    held,
                    Some(Head::InProgress {
                        token: t,
                        attempt,
                        fingerprint,
                        ..
                    }),
                )) if t == token.as_bytes() => {
                    ((codec::fingerprint_of(fingerprint), attempt), Some(held))
                }
                Some((_, Some(Head::InProgress { .. }))) => return Ok(Applied::HeldByAnotherLease),
                Some((_, None)) => return Err(Error::corrupt(STORE, "not a record")),
            };
            let record = codec::Completed {
                encoded,
                identity: Some((&identity.0, identity.1)),
                expires_at,
            };
            let mut cmd = Cmd::with_capacity(8, key.len() + record.len() + IN_PROGRESS_LEN + 30);
            cmd.arg("SET").arg(key).arg(&record);
            match expected {
                Some(held) => cmd.arg("IFEQ").arg(held),
                None => cmd.arg("NX"),
            };
            cmd.arg("GET").arg("PX").arg(ms);
            let (answer, waiters) = self.send_cas(conn, key, cmd).await?;
            let written = match (answer, expected) {
                (Value::Nil, None) => true,
                (Value::BulkString(old), Some(held)) => old == held,
                _ => false,
            };
            if written {
                self.wake(conn, key, waiters).await;
                return Ok(Applied::Written);
            }
        }
        Err(Error::unavailable(
            STORE,
            "the record kept changing under an apply; try again",
        ))
    }
}

/// Whether `value` is an in-progress record held by `lease`'s token.
fn held_by(value: &[u8], lease: &Lease) -> bool {
    value.first() == Some(&b'P')
        && matches!(codec::decode_head(value, 0, 0),
            Some(Head::InProgress { token, .. }) if token == lease.token().as_bytes())
}

fn millis(d: Duration) -> u64 {
    crate::store::millis(d)
}
