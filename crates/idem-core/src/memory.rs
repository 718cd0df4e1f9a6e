//! The embedded in-memory store: the default for a single process and the reference
//! implementation of the [`Store`] contract.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use hashbrown::HashTable;
use tokio::time::Instant;

use crate::begin_rule::{decide_begin, BeginStep, Found};
use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::key::{RecordId, Scope};
use crate::record::{Completion, CompletionKind, FencingToken, Lease, Record, RecordState, Replay};
use crate::store::{Begin, BeginRequest, Stats, Store, StreamRead};
use crate::watch::{Watch, Watchers};

mod slot;

use slot::Slot;

const SHARDS: usize = 32;
/// Expired records removed per write, at most: enough to outpace inserts (one per `begin`)
/// while keeping every call's work bounded.
const SWEEP_PER_WRITE: usize = 16;
/// What a record costs beyond its own bytes, as [`MemoryCapacity::bytes`] counts it: its
/// slot in the hash table and its entry in the expiry index (about 48 bytes measured with
/// `idem-bench --phases memory`, the tables' spare room included).
pub const RECORD_OVERHEAD: usize = 48;

/// How much a [`MemoryStore`] may hold. Both bounds apply; the first one reached counts.
///
/// At the bound, expired records are dropped first; if that frees no room, a `begin` on a
/// new key is refused with [`Error::Unavailable`] (a [`CapacityError`] inside: over HTTP,
/// a 503 with `Retry-After`), while the keys already held keep working: a `begin` that finds
/// its record (replay, in flight, mismatch, takeover), `complete`, `release` and `extend`.
/// A completion is stored even when it takes the store past [`MemoryCapacity::bytes`]
/// (refusing it would leave work done and unrecorded), so the bytes held can exceed the
/// bound by the completions of the leases in flight when it was reached; new keys are
/// refused until the store is back under it. Memory stays bounded: nothing grows without a
/// new key, and new keys stop at the bound.
///
/// ```
/// use idem_core::{MemoryCapacity, MemoryStore};
/// let store = MemoryStore::new()
///     .with_capacity(MemoryCapacity::default().with_records(10_000).with_bytes(64 << 20));
/// assert_eq!(store.capacity().records, 10_000);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct MemoryCapacity {
    /// Records held at most, expired ones not yet swept included. Default: 1,000,000.
    pub records: usize,
    /// Bytes held at most: each record counts its scope, key, fingerprint, lease, and the
    /// status, headers and body of its completion, plus [`RECORD_OVERHEAD`]. Default: 1 GiB.
    /// The process's resident memory for the records is close to this count (measured with
    /// `idem-bench --phases memory`).
    pub bytes: usize,
}

impl Default for MemoryCapacity {
    fn default() -> Self {
        Self {
            records: 1_000_000,
            bytes: 1 << 30,
        }
    }
}

/// A [`MemoryStore`] at its [`MemoryCapacity`] refused a new key. It reaches callers as the
/// source of an [`Error::Unavailable`]: retry later, once records expire, or raise the
/// capacity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "full: it holds {records} records in {bytes} bytes, and its capacity is {} records or {} \
     bytes, so new keys are refused until records expire (keys already held still complete \
     and replay); raise the capacity with MemoryStore::with_capacity(MemoryCapacity::default()\
     .with_records(..).with_bytes(..))",
    capacity.records,
    capacity.bytes
)]
#[non_exhaustive]
pub struct CapacityError {
    /// Records held when the key was refused.
    pub records: usize,
    /// Bytes held when the key was refused, as [`MemoryCapacity::bytes`] counts them.
    pub bytes: usize,
    /// The store's capacity.
    pub capacity: MemoryCapacity,
}

/// A [`Store`] in the process's memory, sharded to keep lock contention low, and bounded
/// by a [`MemoryCapacity`].
///
/// Records expire by the store's [`Clock`]; expired records are removed a few at a time on
/// every write (and all at once by [`MemoryStore::purge_expired`]), so the store does not
/// grow without bound when records expire. It holds nothing across a restart: use it for a
/// single process, for tests, or as the embedded default.
///
/// Each record is one allocation (its identity, fingerprint, lease or completion), indexed
/// by a hash table and an expiry index that hold no copy of it: 428 bytes of resident
/// memory for a demo payment's record (a 155 B body and two headers), 273 beyond the body
/// (`idem-bench --phases memory --keys 200000 --body-bytes 155`).
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    usage: Usage,
    /// Waiters for records to settle, woken in process by `complete`, `release` and `evict`
    /// (one atomic load each while nobody waits), and by `append`.
    watchers: Watchers<RecordId>,
    /// The streams of records in progress ([`Store::append`]), each with the token of the
    /// lease that appends to it. Locked after a shard's lock, never before.
    streams: Mutex<HashMap<RecordId, (FencingToken, Vec<u8>)>>,
    /// How many streams `streams` holds: while none, ending a record looks no further.
    streaming: AtomicUsize,
}

/// What the store holds and may hold, over all shards. Counts change under a shard's lock,
/// but shards change them concurrently, so they are atomics.
#[derive(Debug)]
struct Usage {
    records: AtomicUsize,
    bytes: AtomicUsize,
    max_records: AtomicUsize,
    max_bytes: AtomicUsize,
}

#[derive(Debug, Default)]
struct Shard {
    /// The records, by the hash of their id ([`Inner::hash`]).
    records: HashTable<Slot>,
    /// `(expires_at, hash)` of every record, exactly one entry each, so the oldest are
    /// found without a scan and without a second copy of the id. Two records share an entry
    /// only if both their 64-bit hash and their expiry nanosecond are equal; a sweep then
    /// drops both (both expired), and a change of one's expiry leaves the other to be swept
    /// when it is next looked up.
    expiry: BTreeSet<(u64, u64)>,
    /// At most the earliest instant in `expiry` (`u64::MAX` or lower when it is empty): a
    /// sweep before it has nothing to do and does not walk the index. Every entry added
    /// lowers it; one removed may leave it lower than needed, which only costs a walk.
    next_expiry: u64,
}

/// A store-clock instant as the slots keep it: nanoseconds, saturated (584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The time from `now` to `at`, zero when `at` passed.
fn until(at: u64, now: u64) -> Duration {
    Duration::from_nanos(at.saturating_sub(now))
}

/// What a record counts against [`MemoryCapacity::bytes`].
fn cost(slot: &Slot) -> usize {
    slot.len() + RECORD_OVERHEAD
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the process's monotonic clock, with the default
    /// [`MemoryCapacity`].
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock::default()))
    }

    /// An empty store on the given clock (a [`crate::ManualClock`] in tests), with the
    /// default [`MemoryCapacity`].
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        let capacity = MemoryCapacity::default();
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hasher: RandomState::new(),
                clock,
                usage: Usage {
                    records: AtomicUsize::new(0),
                    bytes: AtomicUsize::new(0),
                    max_records: AtomicUsize::new(capacity.records),
                    max_bytes: AtomicUsize::new(capacity.bytes),
                },
                watchers: Watchers::new(),
                streams: Mutex::default(),
                streaming: AtomicUsize::new(0),
            }),
        }
    }

    /// Sets the store's capacity (for every clone of it). Records already held stay, even
    /// above a lower bound: new keys are refused until enough of them expire.
    pub fn with_capacity(self, capacity: MemoryCapacity) -> Self {
        let usage = &self.inner.usage;
        usage.max_records.store(capacity.records, Ordering::Relaxed);
        usage.max_bytes.store(capacity.bytes, Ordering::Relaxed);
        self
    }

    /// The store's capacity.
    pub fn capacity(&self) -> MemoryCapacity {
        self.inner.usage.capacity()
    }

    /// Removes every expired record now, and the streams of records no longer in progress
    /// under the lease that wrote them (a holder that died mid-stream); returns how many
    /// records.
    pub fn purge_expired(&self) -> usize {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let purged = (0..SHARDS)
            .map(|i| lock(&self.inner.shards[i]).sweep(now, usize::MAX, usage))
            .sum();
        if self.inner.streaming.load(Ordering::Relaxed) > 0 {
            self.purge_streams(now);
        }
        purged
    }

    /// Drops the streams whose record is not in progress under their token.
    fn purge_streams(&self, now: u64) {
        let usage = &self.inner.usage;
        let streams: Vec<(RecordId, FencingToken)> = lock(&self.inner.streams)
            .iter()
            .map(|(id, (token, _))| (id.clone(), *token))
            .collect();
        for (id, token) in streams {
            let hash = self.inner.hash_id(&id);
            // The shard's lock first, as everywhere: an append in between is then either
            // before this look (and seen) or after it (a live record, so kept).
            let mut shard = self.inner.shard(hash);
            let held = shard
                .live(hash, &id, now, usage)
                .and_then(|slot| slot.token());
            if held != Some(token) {
                let mut streams = lock(&self.inner.streams);
                if streams.get(&id).is_some_and(|(t, _)| *t == token) {
                    streams.remove(&id);
                }
                self.inner.streaming.store(streams.len(), Ordering::Relaxed);
            }
        }
    }

    /// Records held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.inner.usage.records.load(Ordering::Relaxed)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held, as [`MemoryCapacity::bytes`] counts them.
    pub fn bytes(&self) -> usize {
        self.inner.usage.bytes.load(Ordering::Relaxed)
    }

    /// One `begin` under the record's shard lock. `Ok(Err(_))`: a new key at the bound,
    /// after this shard's expired records were dropped.
    fn begin_in_shard(
        &self,
        req: &BeginRequest<'_>,
        hash: u64,
        sent_at: Instant,
    ) -> Result<Result<Begin, CapacityError>> {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let mut shard = self.inner.shard(hash);
        shard.sweep(now, SWEEP_PER_WRITE, usage);
        let lease = |attempt| Lease::new(req.id.clone(), req.token, attempt, req.lease, sent_at);
        let fresh = |attempt| {
            let deadline = nanos(now_plus(now, req.lease));
            let expires_at = nanos(kept_until(from_nanos(now), req.lease, req.retention));
            Slot::in_progress(
                req.id,
                req.fingerprint,
                attempt,
                req.token,
                deadline,
                expires_at,
            )
        };
        // One look at the record: what the rule reads, and the completion a replay hands out.
        let mut replay = None;
        let found = match shard.live(hash, req.id, now, usage) {
            Some(slot) => {
                let lease = slot
                    .token()
                    .map(|token| (token, from_nanos(slot.deadline())));
                if lease.is_none() && slot.fingerprint() == req.fingerprint {
                    replay = slot
                        .completion()
                        .map(|c| (c, until(slot.expires_at(), now)));
                }
                Some(Found {
                    fingerprint: slot.fingerprint(),
                    attempt: slot.attempt(),
                    lease,
                })
            }
            None => None,
        };
        Ok(Ok(
            match decide_begin(found.as_ref(), req.fingerprint, req.token, from_nanos(now)) {
                BeginStep::Insert => {
                    let slot = fresh(1);
                    if let Err(full) = usage.reserve(cost(&slot)) {
                        // Expired records go first: every one of this shard's, then try again.
                        if shard.sweep(now, usize::MAX, usage) == 0
                            || usage.reserve(cost(&slot)).is_err()
                        {
                            return Ok(Err(full));
                        }
                    }
                    shard.insert(hash, slot, &self.inner.hasher);
                    Begin::Acquired(lease(1))
                }
                BeginStep::Mismatch => Begin::Mismatch,
                // The rule answers Replay only for a completed record of this fingerprint,
                // which is when `replay` was filled.
                BeginStep::Replay => match replay {
                    Some((Ok(completion), expires_in)) => Begin::Replay(Replay {
                        completion,
                        expires_in,
                    }),
                    Some((Err(e), _)) => return Err(Error::corrupt(self.name(), e.to_string())),
                    None => {
                        return Err(Error::corrupt(
                            self.name(),
                            "replay of a record not completed",
                        ))
                    }
                },
                BeginStep::SameAttempt { remaining } => {
                    // The same attempt asking again: hand its lease back.
                    let attempt = found.map_or(1, |f| f.attempt);
                    let lease = Lease::new(req.id.clone(), req.token, attempt, remaining, sent_at);
                    if attempt == 1 {
                        Begin::Acquired(lease)
                    } else {
                        Begin::TookOver(lease)
                    }
                }
                BeginStep::InFlight { retry_after } => Begin::InFlight { retry_after },
                // A key already held: never refused at the bound.
                BeginStep::TakeOver { attempt } => {
                    shard.replace(hash, req.id, fresh(attempt), usage);
                    Begin::TookOver(lease(attempt))
                }
            },
        ))
    }
}

fn from_nanos(at: u64) -> Duration {
    Duration::from_nanos(at)
}

fn now_plus(now: u64, d: Duration) -> Duration {
    from_nanos(now).saturating_add(d)
}

/// When a record begun at `now` is forgotten. Durations add up saturating: a caller may ask
/// to keep records "forever" with `Duration::MAX`, and that must not panic.
fn kept_until(now: Duration, lease: Duration, retention: Duration) -> Duration {
    now.saturating_add(lease).saturating_add(retention)
}

/// A poisoned lock means a panic while a shard was held; every update below leaves the shard
/// consistent before any call that could panic, so the data is still sound.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// The hash of a record's id, from its scope's and key's bytes (so a slot hashes alike
    /// from what it stores).
    fn hash(&self, scope: &[u8], key: &[u8]) -> u64 {
        self.hasher.hash_one((scope, key))
    }

    fn hash_id(&self, id: &RecordId) -> u64 {
        self.hash(id.scope().as_str().as_bytes(), id.key().as_str().as_bytes())
    }

    /// The shard of a hash: from its middle bits, since the tables use the low ones for the
    /// bucket and the high ones for the tag; taking those would crowd each shard's table.
    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        lock(&self.shards[((hash >> 32) as usize) % SHARDS])
    }

    /// Drops the stream of `id`, whose record left progress (or changed hands).
    fn forget_stream(&self, id: &RecordId) {
        if self.streaming.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut streams = lock(&self.streams);
        if streams.remove(id).is_some() {
            self.streaming.store(streams.len(), Ordering::Relaxed);
        }
    }
}

impl Usage {
    fn capacity(&self) -> MemoryCapacity {
        MemoryCapacity {
            records: self.max_records.load(Ordering::Relaxed),
            bytes: self.max_bytes.load(Ordering::Relaxed),
        }
    }

    /// Counts a new record of `bytes`, or refuses it at the bound (counting nothing).
    fn reserve(&self, bytes: usize) -> Result<(), CapacityError> {
        let capacity = self.capacity();
        let records = self.records.fetch_add(1, Ordering::Relaxed);
        let held = self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if records < capacity.records && held.saturating_add(bytes) <= capacity.bytes {
            return Ok(());
        }
        self.records.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        Err(CapacityError {
            records,
            bytes: held,
            capacity,
        })
    }

    /// A record of `bytes` is gone.
    fn forget(&self, bytes: usize) {
        self.records.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// A record went from `old` to `new` bytes.
    fn resize(&self, old: usize, new: usize) {
        if new >= old {
            self.bytes.fetch_add(new - old, Ordering::Relaxed);
        } else {
            self.bytes.fetch_sub(old - new, Ordering::Relaxed);
        }
    }
}

impl Shard {
    /// Removes up to `max` expired records, oldest first.
    fn sweep(&mut self, now: u64, max: usize, usage: &Usage) -> usize {
        if now < self.next_expiry {
            return 0;
        }
        let mut removed = 0;
        while removed < max {
            let Some(&(at, hash)) = self.expiry.first() else {
                break;
            };
            if at > now {
                break;
            }
            self.expiry.pop_first();
            // The entry is exact: the record with this hash that expires at this instant.
            while let Ok(entry) = self.records.find_entry(hash, |s| s.expires_at() == at) {
                let (slot, _) = entry.remove();
                usage.forget(cost(&slot));
                removed += 1;
            }
        }
        self.next_expiry = self.expiry.first().map_or(u64::MAX, |&(at, _)| at);
        removed
    }

    /// Adds `(at, hash)` to the expiry index.
    fn index(&mut self, at: u64, hash: u64) {
        self.expiry.insert((at, hash));
        self.next_expiry = self.next_expiry.min(at);
    }

    /// The live record for `id`, dropping it first if it expired. One probe of the table.
    fn live(&mut self, hash: u64, id: &RecordId, now: u64, usage: &Usage) -> Option<&mut Slot> {
        match self.records.find_entry(hash, |s| s.is(id)) {
            Ok(entry) if entry.get().expires_at() <= now => {
                let (slot, _) = entry.remove();
                Self::unindexed(&mut self.expiry, hash, &slot, usage);
                None
            }
            Ok(entry) => Some(entry.into_mut()),
            Err(_) => None,
        }
    }

    fn remove(&mut self, hash: u64, id: &RecordId, usage: &Usage) -> bool {
        match self.records.find_entry(hash, |s| s.is(id)) {
            Ok(entry) => {
                let (slot, _) = entry.remove();
                Self::unindexed(&mut self.expiry, hash, &slot, usage);
                true
            }
            Err(_) => false,
        }
    }

    /// The expiry index and counts after `slot`, the record of `hash`, left the table. On
    /// the index alone, so that it may run while the table is still borrowed (`live`).
    fn unindexed(expiry: &mut BTreeSet<(u64, u64)>, hash: u64, slot: &Slot, usage: &Usage) {
        expiry.remove(&(slot.expires_at(), hash));
        usage.forget(cost(slot));
    }

    /// Adds a record whose key is absent, already counted by [`Usage::reserve`].
    fn insert(&mut self, hash: u64, slot: Slot, hasher: &RandomState) {
        self.index(slot.expires_at(), hash);
        self.records.insert_unique(hash, slot, |s| {
            let (scope, key) = s.id_parts();
            hasher.hash_one((scope, key))
        });
    }

    /// Puts `slot` in place of the record of `id`, which is present.
    fn replace(&mut self, hash: u64, id: &RecordId, slot: Slot, usage: &Usage) {
        if let Some(old) = self.records.find_mut(hash, |s| s.is(id)) {
            let (at, bytes) = (slot.expires_at(), cost(&slot));
            let old = std::mem::replace(old, slot);
            self.reindexed(hash, &old, at, bytes, usage);
        }
    }

    /// The expiry index and counts after the record of `hash` that was `old` became one
    /// of `bytes` expiring at `at`.
    fn reindexed(&mut self, hash: u64, old: &Slot, at: u64, bytes: usize, usage: &Usage) {
        self.expiry.remove(&(old.expires_at(), hash));
        self.index(at, hash);
        usage.resize(cost(old), bytes);
    }

    fn set_expiry(&mut self, hash: u64, id: &RecordId, expires_at: u64) {
        if let Some(slot) = self.records.find_mut(hash, |s| s.is(id)) {
            let old = slot.expires_at();
            slot.set_expires_at(expires_at);
            self.expiry.remove(&(old, hash));
            self.index(expires_at, hash);
        }
    }

    /// The record if it is in progress under the lease's token.
    fn held(&mut self, hash: u64, lease: &Lease, now: u64, usage: &Usage) -> Result<&mut Slot> {
        match self.live(hash, lease.id(), now, usage) {
            Some(slot) if slot.token() == Some(lease.token()) => Ok(slot),
            _ => Err(Error::LeaseLost),
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin> {
        let sent_at = Instant::now();
        let hash = self.inner.hash_id(req.id);
        let full = match self.begin_in_shard(&req, hash, sent_at)? {
            Ok(answer) => return Ok(answer),
            Err(full) => full,
        };
        // A new key at the bound, and nothing of its shard expired: every other shard's
        // expired records go before the key is refused. The shard's lock was let go first
        // (shards are locked one at a time), so the record is looked up again.
        if self.purge_expired() == 0 {
            return Err(Error::unavailable(self.name(), full));
        }
        match self.begin_in_shard(&req, hash, sent_at)? {
            Ok(answer) => Ok(answer),
            Err(full) => Err(Error::unavailable(self.name(), full)),
        }
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let hash = self.inner.hash_id(lease.id());
        let mut shard = self.inner.shard(hash);
        shard.sweep(now, SWEEP_PER_WRITE, usage);
        // One probe of the table: the completed record takes the held one's place.
        let held = shard.held(hash, lease, now, usage)?;
        let done = held.completed(completion, nanos(now_plus(now, ttl)));
        let (at, bytes) = (done.expires_at(), cost(&done));
        let old = std::mem::replace(held, done);
        shard.reindexed(hash, &old, at, bytes, usage);
        drop(shard);
        self.inner.forget_stream(lease.id());
        self.inner.watchers.notify(lease.id());
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let hash = self.inner.hash_id(lease.id());
        let mut shard = self.inner.shard(hash);
        shard.held(hash, lease, now, usage)?;
        shard.remove(hash, lease.id(), usage);
        drop(shard);
        self.inner.forget_stream(lease.id());
        self.inner.watchers.notify(lease.id());
        Ok(())
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        let sent_at = Instant::now();
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let hash = self.inner.hash_id(lease.id());
        let mut shard = self.inner.shard(hash);
        let slot = shard.held(hash, lease, now, usage)?;
        let new_deadline = nanos(now_plus(now, by));
        let moved = new_deadline.saturating_sub(slot.deadline());
        slot.set_deadline(new_deadline);
        let expires_at = slot.expires_at().saturating_add(moved);
        let attempt = slot.attempt();
        shard.set_expiry(hash, lease.id(), expires_at);
        Ok(lease.renewed(attempt, by, sent_at))
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>> {
        let now = nanos(self.inner.clock.now());
        let hash = self.inner.hash_id(id);
        let mut shard = self.inner.shard(hash);
        let Some(slot) = shard.live(hash, id, now, &self.inner.usage) else {
            return Ok(None);
        };
        let state = match (slot.token(), slot.completion()) {
            (Some(token), _) => RecordState::InProgress {
                token,
                lease_remaining: until(slot.deadline(), now),
            },
            (None, Some(Ok(completion))) => RecordState::Completed(completion),
            (None, Some(Err(e))) => return Err(Error::corrupt(self.name(), e.to_string())),
            (None, None) => return Err(Error::corrupt(self.name(), "record without a state")),
        };
        Ok(Some(Record {
            id: id.clone(),
            fingerprint: slot.fingerprint(),
            attempt: slot.attempt(),
            state,
            expires_in: until(slot.expires_at(), now),
        }))
    }

    async fn evict(&self, id: &RecordId) -> Result<bool> {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let hash = self.inner.hash_id(id);
        let mut shard = self.inner.shard(hash);
        let existed = shard.live(hash, id, now, usage).is_some();
        shard.remove(hash, id, usage);
        drop(shard);
        self.inner.forget_stream(id);
        self.inner.watchers.notify(id);
        Ok(existed)
    }

    /// The stream lives beside the records, in one map, written under the record's shard
    /// lock (so a completion cannot come between the check of the lease and the write).
    /// Its bytes do not count against [`MemoryCapacity`]: the caller bounds each stream
    /// (the HTTP layer by its largest stored response).
    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<()> {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let hash = self.inner.hash_id(lease.id());
        let mut shard = self.inner.shard(hash);
        shard.held(hash, lease, now, usage)?;
        let mut streams = lock(&self.inner.streams);
        let stream = streams
            .entry(lease.id().clone())
            .or_insert_with(|| (lease.token(), Vec::new()));
        if stream.0 != lease.token() {
            // An earlier holder's: this lease starts its own.
            *stream = (lease.token(), Vec::new());
        }
        let at = usize::try_from(at).unwrap_or(usize::MAX);
        if at > stream.1.len() {
            return Err(Error::Invalid(format!(
                "append at byte {at} of a stream of {} bytes: append at its end",
                stream.1.len()
            )));
        }
        let end = at + bytes.len();
        if end > stream.1.len() {
            stream.1.resize(end, 0);
        }
        stream.1[at..end].copy_from_slice(bytes);
        self.inner.streaming.store(streams.len(), Ordering::Relaxed);
        drop((streams, shard));
        self.inner.watchers.notify(lease.id());
        Ok(())
    }

    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead> {
        let now = nanos(self.inner.clock.now());
        let usage = &self.inner.usage;
        let hash = self.inner.hash_id(id);
        let mut shard = self.inner.shard(hash);
        let Some(slot) = shard.live(hash, id, now, usage) else {
            drop(shard);
            self.inner.forget_stream(id);
            return Ok(StreamRead::Absent);
        };
        match (slot.token(), slot.completion()) {
            (Some(token), _) => {
                let lease_remaining = until(slot.deadline(), now);
                let streams = lock(&self.inner.streams);
                let from = usize::try_from(from).unwrap_or(usize::MAX);
                let bytes = match streams.get(id) {
                    Some((t, bytes)) if *t == token => bytes.get(from..).unwrap_or_default(),
                    _ => &[],
                };
                Ok(StreamRead::Live {
                    token,
                    bytes: Bytes::copy_from_slice(bytes),
                    lease_remaining,
                })
            }
            (None, Some(Ok(completion))) => Ok(StreamRead::Completed(completion)),
            (None, Some(Err(e))) => Err(Error::corrupt(self.name(), e.to_string())),
            (None, None) => Err(Error::corrupt(self.name(), "record without a state")),
        }
    }

    /// Notified in process: the store's own `complete`, `release`, `evict` and `append`
    /// fire it.
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        Some(self.inner.watchers.watch(id.clone()))
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats> {
        let now = nanos(self.inner.clock.now());
        let stuck_after = nanos(stuck_after);
        let mut stats = Stats::default();
        for shard in &self.inner.shards {
            let shard = lock(shard);
            let live = shard.records.iter().filter(|slot| {
                slot.expires_at() > now
                    && scope.is_none_or(|s| slot.id_parts().0 == s.as_str().as_bytes())
            });
            for slot in live {
                match slot.kind() {
                    None if slot.deadline() > now => stats.in_flight += 1,
                    None => {
                        stats.expired_leases += 1;
                        if now.saturating_sub(slot.deadline()) > stuck_after {
                            stats.stuck += 1;
                        }
                    }
                    Some(CompletionKind::Failed) => stats.failed += 1,
                    Some(CompletionKind::Succeeded) => stats.succeeded += 1,
                }
            }
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::fingerprint::Fingerprint;
    use crate::key::{Key, Scope};
    use crate::record::{FencingToken, Response};

    fn id(k: &str) -> RecordId {
        RecordId::new(Scope::global(), Key::new(k).unwrap())
    }

    /// A `begin` with a token of its own, for `lease`, keeping the record `retention`.
    fn req(id: &RecordId, lease: Duration, retention: Duration) -> BeginRequest<'_> {
        BeginRequest {
            id,
            fingerprint: Fingerprint::of_bytes(b""),
            token: FencingToken::random(),
            lease,
            retention,
        }
    }

    #[tokio::test]
    async fn endless_durations_do_not_panic() {
        let store = MemoryStore::new();
        let id = id("forever");
        let begun = store.begin(req(&id, Duration::MAX, Duration::MAX)).await;
        let Ok(Begin::Acquired(lease)) = begun else {
            panic!("fresh key not acquired: {begun:?}")
        };
        let lease = store.extend(&lease, Duration::MAX).await.unwrap();
        store
            .complete(
                &lease,
                &Completion::succeeded(Response::new(200, "")),
                Duration::MAX,
            )
            .await
            .unwrap();
        assert!(store.get(&id).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn expired_records_are_swept() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        for i in 0..1000 {
            let lease = acquire_key(&store, &format!("k{i}")).await;
            store
                .complete(
                    &lease,
                    &Completion::succeeded(Response::new(200, "x")),
                    Duration::from_secs(5),
                )
                .await
                .unwrap();
        }
        assert_eq!(store.len(), 1000);
        clock.advance(Duration::from_secs(6));
        // Writes sweep as they go: steady traffic keeps the store at its live size.
        for i in 0..200 {
            begin(&store, &format!("n{i}")).await.unwrap();
        }
        assert!(
            store.len() < 1000,
            "sweeping did not keep up: {}",
            store.len()
        );
        let leftover = store.len() - 200;
        assert_eq!(store.purge_expired(), leftover);
        assert_eq!(store.len(), 200);
    }

    /// A begin of `key` on `store`, with a 1 s lease and 1 s retention.
    async fn begin(store: &MemoryStore, key: &str) -> Result<Begin> {
        let second = Duration::from_secs(1);
        store.begin(req(&id(key), second, second)).await
    }

    async fn acquire_key(store: &MemoryStore, key: &str) -> Lease {
        match begin(store, key).await {
            Ok(Begin::Acquired(lease)) => lease,
            other => panic!("{key}: a fresh key not acquired: {other:?}"),
        }
    }

    /// The capacity error inside a refusal, with its message.
    fn refusal(answer: Result<Begin, Error>) -> (CapacityError, String) {
        match answer {
            Err(e @ Error::Unavailable { .. }) => {
                let text = e.to_string();
                let Error::Unavailable { source, .. } = e else {
                    unreachable!()
                };
                let full = source
                    .downcast_ref::<CapacityError>()
                    .unwrap_or_else(|| panic!("not a capacity error: {text}"))
                    .clone();
                (full, text)
            }
            other => panic!("a new key at the bound was not refused: {other:?}"),
        }
    }

    #[tokio::test]
    async fn new_keys_are_refused_at_the_record_bound_and_held_keys_keep_working() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()))
            .with_capacity(MemoryCapacity::default().with_records(3));
        let leases = [
            acquire_key(&store, "a").await,
            acquire_key(&store, "b").await,
            acquire_key(&store, "c").await,
        ];
        let (full, text) = refusal(begin(&store, "d").await);
        assert_eq!((full.records, full.capacity.records), (3, 3));
        assert!(
            text.starts_with("memory store unavailable: full")
                && text.contains("capacity is 3 records")
                && text.contains("MemoryStore::with_capacity"),
            "{text}"
        );
        assert!(
            Error::unavailable("memory", full).is_retryable(),
            "a 503, not a 500"
        );
        // At the bound, the keys held keep working: in flight, complete, replay, release.
        assert!(matches!(
            begin(&store, "a").await,
            Ok(Begin::InFlight { .. })
        ));
        let done = Completion::succeeded(Response::new(201, vec![7u8; 4096]));
        store
            .complete(&leases[0], &done, Duration::from_secs(60))
            .await
            .unwrap();
        store
            .complete(&leases[1], &done, Duration::from_secs(60))
            .await
            .unwrap();
        let Ok(Begin::Replay(replay)) = begin(&store, "a").await else {
            panic!("a completed key at the bound is not replayed")
        };
        assert_eq!(replay.completion, done);
        refusal(begin(&store, "d").await);
        store.release(&leases[2]).await.unwrap();
        // Room again: the next new key fits, and the one after it does not.
        acquire_key(&store, "d").await;
        refusal(begin(&store, "e").await);
        assert_eq!(store.len(), 3);
    }

    #[tokio::test]
    async fn new_keys_are_refused_at_the_byte_bound_and_completions_still_land() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        let lease = acquire_key(&store, "k0").await;
        let one = store.bytes();
        assert!(one > RECORD_OVERHEAD, "{one}");
        // Room for three records in progress.
        let store = store.with_capacity(
            MemoryCapacity::default()
                .with_records(1000)
                .with_bytes(3 * one + one / 2),
        );
        let second = acquire_key(&store, "k1").await;
        acquire_key(&store, "k2").await;
        let (full, text) = refusal(begin(&store, "k3").await);
        assert_eq!(full.bytes, 3 * one);
        assert!(
            text.contains(&format!("{} bytes", 3 * one + one / 2)),
            "{text}"
        );
        // A completion past the bound is stored all the same: the work was done.
        let big = Completion::succeeded(Response::new(200, vec![1u8; 10 * one]));
        store
            .complete(&lease, &big, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(store.bytes() > store.capacity().bytes);
        store.release(&second).await.unwrap();
        // Still over the bound after a release: new keys wait for the completion to expire.
        refusal(begin(&store, "k3").await);
        clock.advance(Duration::from_secs(61));
        acquire_key(&store, "k3").await;
    }

    #[tokio::test]
    async fn expired_records_make_room_before_a_key_is_refused() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()))
            .with_capacity(MemoryCapacity::default().with_records(64));
        // Spread over the shards, so room is found in other shards than the new key's.
        for i in 0..64 {
            acquire_key(&store, &format!("old{i}")).await;
        }
        refusal(begin(&store, "new").await);
        // Lease and retention of 1 s each: gone after 2 s, not before.
        clock.advance(Duration::from_millis(1999));
        refusal(begin(&store, "new").await);
        clock.advance(Duration::from_millis(1));
        for i in 0..64 {
            acquire_key(&store, &format!("new{i}")).await;
        }
        assert_eq!(store.len(), 64);
        refusal(begin(&store, "one-more").await);
        // Everything counted is given back.
        clock.advance(Duration::from_secs(2));
        assert_eq!(store.purge_expired(), 64);
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }
}
