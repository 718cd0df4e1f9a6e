//! The embedded in-memory store: the default for a single process and the reference
//! implementation of the [`Store`] contract.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::clock::{Clock, SystemClock};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::{RecordId, Scope};
use crate::record::{Completion, CompletionKind, FencingToken, Lease, Record, RecordState, Replay};
use crate::store::{Begin, BeginRequest, Stats, Store};
use crate::transition::{decide_begin, BeginStep, Found};
use crate::watch::{Watch, Watchers};

const SHARDS: usize = 32;
/// Expired records removed per write, at most: enough to outpace inserts (one per `begin`)
/// while keeping every call's work bounded.
const SWEEP_PER_WRITE: usize = 16;

/// A [`Store`] in the process's memory, sharded to keep lock contention low.
///
/// Records expire by the store's [`Clock`]; expired records are removed a few at a time on
/// every write (and all at once by [`MemoryStore::purge_expired`]), so the store does not
/// grow without bound when records expire. It holds nothing across a restart: use it for a
/// single process, for tests, or as the embedded default.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idem_core::{MemoryStore, Idem};
/// let idem = Idem::new(MemoryStore::new());
/// # let _ = idem; }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    /// Waiters for records to settle, woken in process by `complete`, `release` and `evict`
    /// (one atomic load each while nobody waits).
    watchers: Watchers<RecordId>,
}

#[derive(Debug, Default)]
struct Shard {
    records: HashMap<RecordId, Entry>,
    /// Records by expiry, so the oldest are found without a scan. The `u64` makes entries
    /// with the same instant distinct.
    expiry: BTreeMap<(Duration, u64), RecordId>,
    seq: u64,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    attempt: u32,
    state: State,
    expiry: (Duration, u64),
}

#[derive(Debug)]
enum State {
    InProgress {
        token: FencingToken,
        deadline: Duration,
    },
    Completed(Completion),
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the process's monotonic clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock::default()))
    }

    /// An empty store on the given clock (a [`crate::ManualClock`] in tests).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hasher: RandomState::new(),
                clock,
                watchers: Watchers::new(),
            }),
        }
    }

    /// Removes every expired record now; returns how many.
    pub fn purge_expired(&self) -> usize {
        let now = self.inner.clock.now();
        (0..SHARDS)
            .map(|i| lock(&self.inner.shards[i]).sweep(now, usize::MAX))
            .sum()
    }

    /// Records held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        (0..SHARDS)
            .map(|i| lock(&self.inner.shards[i]).records.len())
            .sum()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, id: &RecordId) -> MutexGuard<'_, Shard> {
        let i = (self.inner.hasher.hash_one(id) as usize) % SHARDS;
        lock(&self.inner.shards[i])
    }
}

/// When a record begun at `now` is forgotten. Durations add up saturating: a caller may ask
/// to keep records "forever" with `Duration::MAX`, and that must not panic.
fn kept_until(now: Duration, lease: Duration, retention: Duration) -> Duration {
    now.saturating_add(lease).saturating_add(retention)
}

/// A poisoned lock means a panic while a shard was held; every update below leaves the shard
/// consistent before any call that could panic, so the data is still sound.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shard {
    /// Removes up to `max` expired records, oldest first.
    fn sweep(&mut self, now: Duration, max: usize) -> usize {
        let mut removed = 0;
        while removed < max {
            let Some(entry) = self.expiry.first_entry() else {
                break;
            };
            if entry.key().0 > now {
                break;
            }
            let id = entry.remove();
            self.records.remove(&id);
            removed += 1;
        }
        removed
    }

    /// The live record for `id`, dropping it first if it expired.
    fn live(&mut self, id: &RecordId, now: Duration) -> Option<&mut Entry> {
        let expired = self.records.get(id).is_some_and(|e| e.expiry.0 <= now);
        if expired {
            self.remove(id);
        }
        self.records.get_mut(id)
    }

    fn remove(&mut self, id: &RecordId) -> bool {
        match self.records.remove(id) {
            Some(entry) => {
                self.expiry.remove(&entry.expiry);
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, id: RecordId, mut entry: Entry, expires_at: Duration) {
        self.seq += 1;
        entry.expiry = (expires_at, self.seq);
        self.expiry.insert(entry.expiry, id.clone());
        if let Some(old) = self.records.insert(id, entry) {
            self.expiry.remove(&old.expiry);
        }
    }

    fn set_expiry(&mut self, id: &RecordId, expires_at: Duration) {
        self.seq += 1;
        let handle = (expires_at, self.seq);
        if let Some(entry) = self.records.get_mut(id) {
            self.expiry.remove(&entry.expiry);
            entry.expiry = handle;
            self.expiry.insert(handle, id.clone());
        }
    }

    /// The entry if it is in progress under `token`.
    fn held(&mut self, lease: &Lease, now: Duration) -> Result<&mut Entry, Error> {
        match self.live(lease.id(), now) {
            Some(entry) if matches!(entry.state, State::InProgress { token, .. } if token == lease.token()) => {
                Ok(entry)
            }
            _ => Err(Error::LeaseLost),
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin, Error> {
        let sent_at = Instant::now();
        let now = self.inner.clock.now();
        let mut shard = self.shard(req.id);
        shard.sweep(now, SWEEP_PER_WRITE);
        let lease = |attempt| Lease::new(req.id.clone(), req.token, attempt, req.lease, sent_at);
        let fresh = |attempt| Entry {
            fingerprint: req.fingerprint,
            attempt,
            state: State::InProgress {
                token: req.token,
                deadline: now.saturating_add(req.lease),
            },
            expiry: (Duration::ZERO, 0),
        };
        // One look at the record: what the rule reads, and the completion a replay hands out.
        let mut replay = None;
        let found = shard.live(req.id, now).map(|entry| Found {
            fingerprint: entry.fingerprint,
            attempt: entry.attempt,
            lease: match &entry.state {
                State::InProgress { token, deadline } => Some((*token, *deadline)),
                State::Completed(completion) => {
                    if entry.fingerprint == req.fingerprint {
                        replay = Some(Replay {
                            completion: completion.clone(),
                            expires_in: entry.expiry.0.saturating_sub(now),
                        });
                    }
                    None
                }
            },
        });
        match decide_begin(found.as_ref(), req.fingerprint, req.token, now) {
            BeginStep::Insert => {
                let expires_at = kept_until(now, req.lease, req.retention);
                shard.insert(req.id.clone(), fresh(1), expires_at);
                Ok(Begin::Acquired(lease(1)))
            }
            BeginStep::Mismatch => Ok(Begin::Mismatch),
            // The rule answers Replay only for a completed record of this fingerprint, which
            // is when `replay` was filled.
            BeginStep::Replay => replay
                .map(Begin::Replay)
                .ok_or_else(|| Error::corrupt(self.name(), "replay of a record not completed")),
            BeginStep::SameAttempt { remaining } => {
                // The same attempt asking again: hand its lease back.
                let attempt = found.map_or(1, |f| f.attempt);
                let lease = Lease::new(req.id.clone(), req.token, attempt, remaining, sent_at);
                Ok(if attempt == 1 {
                    Begin::Acquired(lease)
                } else {
                    Begin::TookOver(lease)
                })
            }
            BeginStep::InFlight { retry_after } => Ok(Begin::InFlight { retry_after }),
            BeginStep::TakeOver { attempt } => {
                let expires_at = kept_until(now, req.lease, req.retention);
                shard.insert(req.id.clone(), fresh(attempt), expires_at);
                Ok(Begin::TookOver(lease(attempt)))
            }
        }
    }

    async fn complete(
        &self,
        lease: &Lease,
        completion: &Completion,
        retention: Duration,
    ) -> Result<(), Error> {
        let now = self.inner.clock.now();
        let mut shard = self.shard(lease.id());
        shard.sweep(now, SWEEP_PER_WRITE);
        let entry = shard.held(lease, now)?;
        entry.state = State::Completed(completion.clone());
        shard.set_expiry(lease.id(), now.saturating_add(retention));
        drop(shard);
        self.inner.watchers.notify(lease.id());
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let now = self.inner.clock.now();
        let mut shard = self.shard(lease.id());
        shard.held(lease, now)?;
        shard.remove(lease.id());
        drop(shard);
        self.inner.watchers.notify(lease.id());
        Ok(())
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        let sent_at = Instant::now();
        let now = self.inner.clock.now();
        let mut shard = self.shard(lease.id());
        let entry = shard.held(lease, now)?;
        let State::InProgress { deadline, .. } = &mut entry.state else {
            return Err(Error::LeaseLost);
        };
        let new_deadline = now.saturating_add(by);
        let moved = new_deadline.saturating_sub(*deadline);
        *deadline = new_deadline;
        let expires_at = entry.expiry.0.saturating_add(moved);
        let attempt = entry.attempt;
        shard.set_expiry(lease.id(), expires_at);
        Ok(Lease::new(
            lease.id().clone(),
            lease.token(),
            attempt,
            by,
            sent_at,
        ))
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let now = self.inner.clock.now();
        let mut shard = self.shard(id);
        Ok(shard.live(id, now).map(|entry| Record {
            id: id.clone(),
            fingerprint: entry.fingerprint,
            attempt: entry.attempt,
            state: match &entry.state {
                State::InProgress { token, deadline } => RecordState::InProgress {
                    token: *token,
                    lease_remaining: deadline.saturating_sub(now),
                },
                State::Completed(c) => RecordState::Completed(c.clone()),
            },
            expires_in: entry.expiry.0.saturating_sub(now),
        }))
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        let now = self.inner.clock.now();
        let mut shard = self.shard(id);
        let existed = shard.live(id, now).is_some();
        shard.remove(id);
        drop(shard);
        self.inner.watchers.notify(id);
        Ok(existed)
    }

    /// Notified in process: the store's own `complete`, `release` and `evict` fire it.
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        Some(self.inner.watchers.watch(id.clone()))
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats, Error> {
        let now = self.inner.clock.now();
        let mut stats = Stats::default();
        for shard in &self.inner.shards {
            let shard = lock(shard);
            let live = shard.records.iter().filter(|(id, entry)| {
                entry.expiry.0 > now && scope.is_none_or(|s| id.scope() == s)
            });
            for (_, entry) in live {
                match &entry.state {
                    State::InProgress { deadline, .. } if *deadline > now => stats.in_flight += 1,
                    State::InProgress { deadline, .. } => {
                        stats.expired_leases += 1;
                        if now.saturating_sub(*deadline) > stuck_after {
                            stats.stuck += 1;
                        }
                    }
                    State::Completed(c) if c.kind == CompletionKind::Failed => stats.failed += 1,
                    State::Completed(_) => stats.succeeded += 1,
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
    use crate::key::{Key, Scope};
    use crate::record::Response;

    fn id(k: &str) -> RecordId {
        RecordId::new(Scope::global(), Key::new(k).unwrap())
    }

    #[tokio::test]
    async fn endless_durations_do_not_panic() {
        let store = MemoryStore::new();
        let id = id("forever");
        let req = BeginRequest {
            id: &id,
            fingerprint: Fingerprint::of_bytes(b""),
            token: FencingToken::random(),
            lease: Duration::MAX,
            retention: Duration::MAX,
        };
        let Begin::Acquired(lease) = store.begin(req).await.unwrap() else {
            panic!("fresh key not acquired")
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
            let id = id(&format!("k{i}"));
            let req = BeginRequest {
                id: &id,
                fingerprint: Fingerprint::of_bytes(b""),
                token: FencingToken::random(),
                lease: Duration::from_secs(1),
                retention: Duration::from_secs(1),
            };
            let Begin::Acquired(lease) = store.begin(req).await.unwrap() else {
                panic!("fresh key not acquired")
            };
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
            let id = id(&format!("n{i}"));
            let req = BeginRequest {
                id: &id,
                fingerprint: Fingerprint::of_bytes(b""),
                token: FencingToken::random(),
                lease: Duration::from_secs(1),
                retention: Duration::from_secs(1),
            };
            store.begin(req).await.unwrap();
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
}
