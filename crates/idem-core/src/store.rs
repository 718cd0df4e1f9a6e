//! The storage trait that every backend implements.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::{RecordId, Scope};
use crate::record::{Completion, FencingToken, Lease, Record, Replay};
use crate::watch::Watch;

/// What `begin` asks of a store.
#[derive(Debug, Clone)]
pub struct BeginRequest<'a> {
    /// The record.
    pub id: &'a RecordId,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// A fresh token for this attempt. Sending the same request again (after a lost reply)
    /// with the same token must hand back the same lease.
    pub token: FencingToken,
    /// How long the lease lasts, by the store's clock.
    pub lease: Duration,
    /// How long an in-progress record is kept after its lease deadline (so a takeover still
    /// counts attempts and sees the fingerprint), and how long a completed record is kept by
    /// default.
    pub retention: Duration,
}

/// The answer to `begin`: one of its outcomes, all of them values.
#[derive(Debug, Clone)]
pub enum Begin {
    /// The key was absent (or released): the caller holds a fresh lease (attempt 1) and must
    /// run the work, then complete, fail or release.
    Acquired(Lease),
    /// The previous holder's lease expired without a completion: the caller took it over
    /// and must run the work. [`Lease::attempt`] counts the acquisitions so far.
    TookOver(Lease),
    /// The work was done: hand the stored outcome to the caller.
    Replay(Replay),
    /// Another worker holds a live lease on the key. Try again after `retry_after` (the
    /// holder's lease time left), or wait.
    InFlight {
        /// The live lease's time left, by the store's clock.
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint: the request is not a retry of the
    /// original one and must be refused.
    Mismatch,
    /// The key's work completed, and its stored outcome was forgotten when its retention
    /// ended; its tombstone is kept, so the work must not run again. Answered by
    /// [`crate::Idem::begin`] under [`crate::AfterRetention::Refuse`], never by a store.
    Expired {
        /// When the work completed.
        completed_at: std::time::SystemTime,
    },
}

/// What [`Store::read_stream`] found: a record's streamed response, as far as it went.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamRead {
    /// In progress under `token`'s lease: the bytes appended under it from the offset asked
    /// for (empty when there are none yet, or none past the offset), and the lease time
    /// left (zero once the deadline passed: the holder may be dead). Another token on a
    /// later read means another attempt, whose stream starts again from its first byte.
    Live {
        /// The holder's token.
        token: FencingToken,
        /// The stream's bytes from the offset asked for.
        bytes: Bytes,
        /// The holder's lease time left, by the store's clock.
        lease_remaining: Duration,
    },
    /// The work finished: the stored completion, the whole response.
    Completed(Completion),
    /// No record: released, evicted or expired (or never begun).
    Absent,
}

/// Counts of records by state, for operators (`idem stats`). Stores build it with the
/// `with_*` setters: `Stats::default().with_in_flight(3)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct Stats {
    /// In progress under a live lease.
    pub in_flight: u64,
    /// In progress with a lease that expired and that nobody has taken over yet.
    pub expired_leases: u64,
    /// Of those, the leases that expired longer ago than the `stuck_after` asked for: the
    /// work was abandoned (a crashed worker) and no retry came. The alarm to watch.
    pub stuck: u64,
    /// Completed with a success.
    pub succeeded: u64,
    /// Completed with a stored terminal failure.
    pub failed: u64,
}

/// A storage backend: the atomic steps of the state machine.
///
/// # Contract
///
/// Implementors must make each method a single atomic step with respect to every other
/// call on the same record, from any process:
///
/// - **Clock.** Lease deadlines and expiries are decided by the store's own clock, never by
///   the caller's. All durations are relative to it.
/// - **`begin`.** If the record is absent: insert it in progress with `req.token`, attempt 1,
///   lease deadline `now + req.lease`, kept until `deadline + req.retention`, and answer
///   [`Begin::Acquired`]. If present with another fingerprint: [`Begin::Mismatch`], whatever
///   its state. If completed: [`Begin::Replay`]. If in progress with `req.token` (the same
///   attempt sent twice): answer with that same lease again. If in progress with a live
///   lease: [`Begin::InFlight`] with the time left. If in progress with an expired lease:
///   replace the token with `req.token`, increment the attempt, set a new deadline and answer
///   [`Begin::TookOver`].
/// - **Fencing.** `complete`, `release` and `extend` change the record only while it is in
///   progress with the lease's token; otherwise they return [`Error::LeaseLost`] and change
///   nothing. A lease whose deadline passed but which nobody took over still matches: its
///   holder may complete, release or extend it.
/// - **`complete`** replaces the record by the completion, kept for `retention`; **`release`**
///   deletes it (the next `begin` is attempt 1 again); **`extend`** sets the deadline to
///   `now + by` and moves the record's expiry by as much as the deadline moved, so the
///   margin after the deadline stays what `begin` set.
/// - **Expiry.** Records past their expiry behave as absent and must not accumulate.
/// - **Errors.** Unreachable, timed-out or overloaded stores give [`Error::Unavailable`]
///   within a bounded time; undecodable records give [`Error::Corrupt`] and are left alone.
/// - **`watch`** (optional; the default answers `None` and waiters poll). A store that can
///   tell waiters that a record settled returns a [`Watch`] that is registered when `watch`
///   returns: a `complete` or `release` of that record by any caller of the store (in any
///   process) that takes effect after that should fire it within milliseconds. It may fire
///   without a change, and may miss one when a notification is lost: the engine looks at
///   the record again after each firing and polls at [`crate::Config::safety_poll`] anyway.
///   `watch` writes nothing to the record and must not slow down the other methods while
///   nobody watches.
/// - **Streams** (optional; the defaults answer [`Error::Unsupported`]). A record in
///   progress has a stream of bytes that its holder appends to while the work runs (a
///   streamed response, recorded as it is produced) and that anyone reads
///   ([`Store::read_stream`]). `append` is fenced like `complete`: it writes only while the
///   record is in progress with the lease's token, and otherwise returns
///   [`Error::LeaseLost`] with nothing appended that a reader can see. Appending bytes at an
///   offset where the stream already holds those bytes changes nothing (a call re-sent
///   after a lost reply is harmless). A new holder (a takeover, or a new attempt after a
///   release) starts an empty stream; the stream is forgotten when the record leaves
///   progress (completed, released, evicted or expired). A store that notifies fires the
///   record's watches on every `append` too, so that readers wait for more with
///   [`Store::watch`].
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// A short name for errors and metrics: `"memory"`, `"redis"`, `"postgres"`.
    fn name(&self) -> &'static str;

    /// Claims the key, or reports why not. See the trait's contract.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`], [`Error::Backend`] or [`Error::Corrupt`].
    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin>;

    /// Stores the outcome and ends the lease. The completion is kept for `ttl` (its time to
    /// live; the engine passes [`crate::Config::retention`]), then forgotten.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease no longer holds the record; store errors.
    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()>;

    /// Ends the lease and forgets the record, so a retry runs the work again.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease no longer holds the record; store errors.
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Moves the lease deadline to `by` from now (a heartbeat for long work), returning the
    /// renewed lease.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease no longer holds the record; store errors.
    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease>;

    /// Reads a record, for inspection. `None` when it is absent or expired.
    ///
    /// # Errors
    ///
    /// Store errors.
    async fn get(&self, id: &RecordId) -> Result<Option<Record>>;

    /// Deletes a record whatever its state (an operator's tool). Returns whether it existed.
    ///
    /// # Errors
    ///
    /// Store errors.
    async fn evict(&self, id: &RecordId) -> Result<bool>;

    /// Registers interest in `id` settling (see the trait's contract): `None` when the store
    /// cannot notify (the default), or cannot now (its listener is down), and the caller
    /// polls. Called by [`crate::Idem::begin`] when it waits for another worker's result.
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        let _ = id;
        None
    }

    /// Writes `bytes` into the stream of the record `lease` holds, at byte offset `at`: the
    /// length of what this lease appended before (or less, for a call sent again). See the
    /// trait's contract.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease no longer holds the record; [`Error::Invalid`]
    /// when `at` is past the stream's end; store errors; [`Error::Unsupported`] from stores
    /// without streams (the default).
    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<()> {
        let _ = (lease, at, bytes);
        Err(Error::Unsupported {
            store: self.name(),
            what: "streams",
        })
    }

    /// The stream of `id` from byte `from`, or what became of it (see [`StreamRead`]).
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Unsupported`] from stores without streams (the default).
    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead> {
        let _ = (id, from);
        Err(Error::Unsupported {
            store: self.name(),
            what: "streams",
        })
    }

    /// Counts live records by state, in one scope or in all (an operator's tool; it may scan
    /// and is not meant for the hot path). Leases that expired more than `stuck_after` ago
    /// count as [`Stats::stuck`].
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Unsupported`] from stores that cannot count (the default).
    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats> {
        let _ = (scope, stuck_after);
        Err(Error::Unsupported {
            store: self.name(),
            what: "stats",
        })
    }
}
