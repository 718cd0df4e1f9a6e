//! [`Idem`]: the state machine's front door, over any [`Store`].

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::orphan::Orphans;
use crate::record::{Completion, CompletionKind, FencingToken, Lease, Replay, Response};
use crate::store::{Begin, BeginRequest, Store, StreamRead};
use crate::telemetry::{Instrumented, KeyHash};
use crate::tombstone;
use crate::watch::Watch;

/// What to do when the work fails for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Forget the key, so a retry runs the work again (the default).
    #[default]
    Release,
    /// Store the failure, and replay it to every retry like a success.
    Store,
}

/// What a request on a key gets once the key's completed record is forgotten (its
/// retention ended).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AfterRetention {
    /// The key is new again: the work runs (the default).
    #[default]
    Run,
    /// A tombstone (the fingerprint and when the work completed, no response) is kept for
    /// [`Config::tombstone`] after the record, and a request on the key meanwhile gets
    /// [`Begin::Expired`] and never runs. Costs one more store write per completion and one
    /// more read per first request.
    Refuse,
}

/// What [`Idem::run_with_heartbeat`] does with the work when it finds the lease lost (taken
/// over after it expired, or evicted by an operator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnLost {
    /// Drop the work at its next `.await` and return the error (the default): for work
    /// whose later steps would race the new holder.
    #[default]
    Cancel,
    /// Stop renewing and let the work run to its end: for work that must not stop halfway,
    /// such as an HTTP handler whose client waits for an answer. Storing its outcome then
    /// finds [`Error::LeaseLost`].
    Finish,
}

/// Settings of an [`Idem`]. Every field has a documented default, and a `with_*` setter:
/// `Config::default().with_lease(Duration::from_secs(10))`.
#[derive(Debug, Clone, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct Config {
    /// How long a lease lasts before another worker may take the key over. Default: 30 s.
    pub lease: Duration,
    /// How long a completed record is kept (and an abandoned in-progress record is kept past
    /// its deadline). Default: 24 h.
    pub retention: Duration,
    /// When set, `begin` on a key held by another worker waits up to this long for the
    /// holder to finish, instead of answering in flight at once. Default: `None`.
    #[setters(strip_option)]
    pub wait: Option<Duration>,
    /// The longest pause between two looks at a held key while waiting on a store that
    /// cannot notify (see [`Store::watch`]). Default: 50 ms.
    pub max_poll: Duration,
    /// The pause between two looks at a held key while waiting on a store that notifies: a
    /// safety net for a notification lost with a connection, so coarse. Default: 1 s.
    pub safety_poll: Duration,
    /// What [`Idem::fail`] does. Default: [`FailurePolicy::Release`].
    pub failure: FailurePolicy,
    /// The longest any one store call may take before it counts as
    /// [`Error::Unavailable`]. Default: 5 s.
    ///
    /// A `begin` that fails this way may still reach the store (a paused server runs it
    /// when it resumes) and hold its key under a token nobody has: the engine then releases
    /// that claim by its token in the background, retrying with backoff until the store
    /// answers, so retries of the key are not answered in flight for a whole lease.
    pub store_timeout: Duration,
    /// What a request on a key whose completed record was forgotten gets. Default:
    /// [`AfterRetention::Run`].
    pub after_retention: AfterRetention,
    /// How long a tombstone is kept after the completed record is forgotten, under
    /// [`AfterRetention::Refuse`]. Default: 7 days.
    pub tombstone: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            wait: None,
            max_poll: Duration::from_millis(50),
            safety_poll: Duration::from_secs(1),
            failure: FailurePolicy::Release,
            store_timeout: Duration::from_secs(5),
            after_retention: AfterRetention::Run,
            tombstone: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// The idempotency engine: [`Store`] steps plus waiting, failure policy, time limits and
/// [`Idem::execute_once`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem_core::Error> {
/// use idem_core::{Begin, Fingerprint, Idem, Key, MemoryStore, RecordId, Response, Scope};
///
/// let idem = Idem::new(MemoryStore::new());
/// let id = RecordId::new(Scope::new("tenant-1").unwrap(), Key::new("order-42").unwrap());
/// let fp = Fingerprint::of_bytes(b"charge 12.50 EUR");
///
/// match idem.begin(&id, fp).await? {
///     Begin::Acquired(lease) | Begin::TookOver(lease) => {
///         // ... charge the card, once ...
///         idem.complete(&lease, Response::new(201, "charged")).await?;
///     }
///     other => panic!("a fresh key is acquired, got {other:?}"),
/// }
/// // A retry gets the stored response, and the card is not charged again.
/// let Begin::Replay(replay) = idem.begin(&id, fp).await? else { panic!() };
/// assert_eq!(replay.completion.response.body, "charged");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Idem {
    store: Arc<dyn Store>,
    /// The same store, reporting every call (spans and metrics; see [`crate::telemetry`]).
    calls: Instrumented,
    config: Config,
    /// Claims of begins that failed as unavailable, given back in the background.
    orphans: Orphans,
}

/// What [`Idem::execute_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once<T> {
    /// The work ran now (`attempt` > 1 after a takeover) and its value was stored.
    Executed {
        /// The work's value.
        value: T,
        /// Acquisitions of the key so far.
        attempt: u32,
    },
    /// The work ran before; this is its stored value.
    Replayed(T),
    /// The work failed for good before and the failure was stored; this is its message.
    FailedBefore(String),
    /// Another worker holds the key. Do not drop the message: try again after `retry_after`.
    InFlight {
        /// The holder's lease time left.
        retry_after: Duration,
    },
    /// The key was used for a different request or message.
    Mismatch,
    /// The key completed at `completed_at` and its stored value was forgotten since
    /// ([`AfterRetention::Refuse`]): the work does not run again.
    Expired {
        /// When the work completed.
        completed_at: SystemTime,
    },
}

/// How the work of [`Idem::execute_once`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure<E> {
    /// Worth another try: the key is released so a retry runs the work again.
    Retryable(E),
    /// Will fail again: handled by the [`FailurePolicy`].
    Terminal(E),
}

/// The error of [`Idem::execute_once`].
#[derive(Debug, thiserror::Error)]
pub enum OnceError<E> {
    /// The work failed; `stored` tells whether the failure was stored for replay (a terminal
    /// failure under [`FailurePolicy::Store`]) or the key released.
    #[error("the work failed ({}): {error}", if *.stored { "stored" } else { "key released" })]
    Work {
        /// The work's error.
        error: E,
        /// Whether the failure was stored.
        stored: bool,
    },
    /// The store failed, or the lease was lost while the work ran. When the lease was lost
    /// the work was cancelled at its next `.await`; what it did before then stands.
    #[error(transparent)]
    Store(#[from] Error),
    /// The stored value could not be encoded or decoded as JSON.
    #[error("stored value is not the expected JSON: {0}")]
    Codec(#[source] serde_json::Error),
}

impl Idem {
    /// An engine over `store` with the default [`Config`].
    pub fn new(store: impl Store + 'static) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// An engine over a shared store.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        let config = Config::default();
        Self {
            calls: Instrumented::new(store.clone()).with_timeout(config.store_timeout),
            store,
            config,
            orphans: Orphans::new(),
        }
    }

    /// Replaces the configuration.
    pub fn with_config(mut self, config: Config) -> Self {
        self.calls = Instrumented::new(self.store.clone()).with_timeout(config.store_timeout);
        self.config = config;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Claims `id` for a request with fingerprint `fingerprint`. With [`Config::wait`] set, a
    /// key held by another worker is watched until the holder finishes (answering
    /// [`Begin::Replay`]), its lease expires (answering [`Begin::TookOver`]) or the wait runs
    /// out (answering [`Begin::InFlight`]).
    ///
    /// While waiting, a store that notifies ([`Store::watch`]: the memory store, Redis (one
    /// server or a cluster), PostgreSQL, the tiered store) wakes the waiter when the holder
    /// completes or releases, and the key is looked at again only
    /// then, at the holder's deadline, or every [`Config::safety_poll`]; other stores are
    /// polled, from 2 ms doubling up to [`Config::max_poll`].
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Unavailable`] when a store call takes longer than
    /// [`Config::store_timeout`] (the claim it may have made is released in the background;
    /// see there).
    pub async fn begin(&self, id: &RecordId, fingerprint: Fingerprint) -> Result<Begin, Error> {
        self.begin_within(id, fingerprint, self.config.wait).await
    }

    /// [`Idem::begin`], waiting up to `wait` (rather than [`Config::wait`]) for a key held by
    /// another worker: a caller's own bound, such as an HTTP client's `Prefer: wait=N`.
    /// `None` answers [`Begin::InFlight`] at once.
    ///
    /// # Errors
    ///
    /// As [`Idem::begin`].
    pub async fn begin_within(
        &self,
        id: &RecordId,
        fingerprint: Fingerprint,
        wait: Option<Duration>,
    ) -> Result<Begin, Error> {
        let begun = self.claim(id, fingerprint, wait).await?;
        if self.config.after_retention != AfterRetention::Refuse {
            return Ok(begun);
        }
        // A key claimed to run may be one whose record was forgotten (or whose claim after
        // that was abandoned, a takeover): its tombstone says.
        let (Begin::Acquired(lease) | Begin::TookOver(lease)) = &begun else {
            return Ok(begun);
        };
        let found = tombstone::find(&self.calls, id).await;
        if !matches!(found, Ok(None)) {
            // Refused, or undecided: the work must not run, and the key must not stay
            // held; a release that fails is tried again in the background.
            if self.release(lease).await.is_err() {
                let (store, limit) = (self.store.clone(), self.config.store_timeout);
                self.orphans
                    .release_later(store, id, lease.token(), self.config.lease, limit);
            }
        }
        match found? {
            None => Ok(begun),
            Some(completed_at) => Ok(Begin::Expired { completed_at }),
        }
    }

    /// The begin steps of [`Idem::begin_within`], with its wait.
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: Fingerprint,
        wait: Option<Duration>,
    ) -> Result<Begin, Error> {
        let token = FencingToken::random();
        let give_up = wait.map(|w| {
            let now = Instant::now();
            // A wait too long for an Instant is a wait without end, not a panic.
            now.checked_add(w)
                .unwrap_or(now + Duration::from_secs(30 * 365 * 24 * 3600))
        });
        let mut pause = Duration::from_millis(2);
        // Made at the first in-flight answer, and kept (registered) for the whole wait.
        let mut watch: Option<Watch> = None;
        let mut watched = false;
        loop {
            let req = BeginRequest {
                id,
                fingerprint,
                token,
                lease: self.config.lease,
                retention: self.config.retention,
            };
            let answer = self.calls.begin(req).await.inspect_err(|e| {
                if e.is_retryable() {
                    let (lease, limit) = (self.config.lease, self.config.store_timeout);
                    let store = self.store.clone();
                    self.orphans.release_later(store, id, token, lease, limit);
                }
            })?;
            let (Begin::InFlight { retry_after }, Some(give_up)) = (&answer, give_up) else {
                return Ok(answer);
            };
            let now = Instant::now();
            if now >= give_up {
                return Ok(answer);
            }
            if !watched {
                watched = true;
                watch = self.calls.watch(id).await;
                if watch.is_some() {
                    // Registered: look once more, so that a completion between the answer
                    // above and the registration is not waited for in vain.
                    continue;
                }
            }
            // Never past the holder's deadline (a takeover is due then) or our own.
            let cap = retry_after
                .saturating_add(Duration::from_millis(1))
                .min(give_up - now);
            match &mut watch {
                Some(watch) => {
                    tokio::select! {
                        // Notified: the record may have settled; look.
                        () = watch.changed() => {}
                        // A lost notification costs at most this pause.
                        () = tokio::time::sleep(self.config.safety_poll.min(cap)) => {}
                    }
                }
                None => {
                    // Poll with a growing pause.
                    tokio::time::sleep(pause.min(cap)).await;
                    pause = (pause * 2).min(self.config.max_poll);
                }
            }
        }
    }

    /// Stores `response` as the key's successful outcome, kept for [`Config::retention`].
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease was taken over or released; store errors.
    pub async fn complete(&self, lease: &Lease, response: Response) -> Result<(), Error> {
        let completion = Completion::succeeded(response);
        self.calls
            .complete(lease, &completion, self.config.retention)
            .await?;
        self.leave_tombstone(lease).await;
        Ok(())
    }

    /// Tells the engine that the key `lease` holds was completed outside it, in the
    /// caller's own transaction (a store's `complete_in`): under [`AfterRetention::Refuse`]
    /// it writes the key's tombstone, as [`Idem::complete`] does.
    pub async fn completed_elsewhere(&self, lease: &Lease) {
        self.leave_tombstone(lease).await;
    }

    /// Under [`AfterRetention::Refuse`], writes the tombstone of the key `lease` completed,
    /// kept until [`Config::tombstone`] after the completion is forgotten. The completion
    /// stands either way: a tombstone that cannot be written is logged and counted
    /// (`idem_tombstones_lost_total`), and its key runs again once its retention ends (as
    /// it does after a crash between the completion and this write). The write is on the
    /// completion's path, so that an answer sent means a tombstone kept: a store that
    /// stalls there delays the answer by up to three of its time limits.
    async fn leave_tombstone(&self, lease: &Lease) {
        if self.config.after_retention != AfterRetention::Refuse {
            return;
        }
        let ttl = self.config.retention.saturating_add(self.config.tombstone);
        let fingerprint = match self.calls.get(lease.id()).await {
            Ok(Some(record)) => record.fingerprint,
            _ => Fingerprint::of_bytes(b""),
        };
        if let Err(e) = tombstone::write(&self.calls, lease.id(), fingerprint, ttl).await {
            metrics::counter!("idem_tombstones_lost_total").increment(1);
            tracing::warn!(
                key_hash = %KeyHash::of(lease.id()),
                error = %e,
                "the key's tombstone could not be written: once its retention ends, a request \
                 on it runs again"
            );
        }
    }

    /// The record of `id` as the store holds it ([`Store::get`]), bounded by
    /// [`Config::store_timeout`] and reported like every store call: for status lookups.
    ///
    /// # Errors
    ///
    /// Store errors; [`Error::Unavailable`] past the time limit.
    pub async fn get(&self, id: &RecordId) -> Result<Option<crate::Record>, Error> {
        self.calls.get(id).await
    }

    /// When the key `id` completed, if its tombstone is kept ([`AfterRetention::Refuse`]):
    /// for status lookups, which tell a forgotten key from one never used.
    ///
    /// # Errors
    ///
    /// Store errors.
    pub async fn tombstone(&self, id: &RecordId) -> Result<Option<SystemTime>, Error> {
        tombstone::find(&self.calls, id).await
    }

    /// Handles a terminal failure by [`Config::failure`]: releases the key, or stores
    /// `response` as a failure replayed to every retry. Returns whether it was stored.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease was taken over or released; store errors.
    pub async fn fail(&self, lease: &Lease, response: Response) -> Result<bool, Error> {
        match self.config.failure {
            FailurePolicy::Release => self.release(lease).await.map(|()| false),
            FailurePolicy::Store => {
                let completion = Completion::failed(response);
                self.calls
                    .complete(lease, &completion, self.config.retention)
                    .await?;
                self.leave_tombstone(lease).await;
                Ok(true)
            }
        }
    }

    /// Forgets the key so that a retry runs the work again.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease was taken over or released; store errors.
    pub async fn release(&self, lease: &Lease) -> Result<(), Error> {
        self.calls.release(lease).await
    }

    /// Writes `bytes` into the stream of the record `lease` holds, at byte offset `at`
    /// ([`Store::append`]), bounded by [`Config::store_timeout`] and reported like every
    /// store call.
    ///
    /// # Errors
    ///
    /// As [`Store::append`]; [`Error::Unavailable`] past the time limit.
    pub async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<(), Error> {
        self.calls.append(lease, at, bytes).await
    }

    /// The stream of `id` from byte `from` ([`Store::read_stream`]), bounded by
    /// [`Config::store_timeout`] and reported like every store call.
    ///
    /// # Errors
    ///
    /// As [`Store::read_stream`]; [`Error::Unavailable`] past the time limit.
    pub async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead, Error> {
        self.calls.read_stream(id, from).await
    }

    /// Registers interest in `id` changing ([`Store::watch`]): a completion, a release, an
    /// append. `None` when the store cannot notify, or does not register within
    /// [`Config::store_timeout`]: the caller polls.
    pub async fn watch(&self, id: &RecordId) -> Option<Watch> {
        self.calls.watch(id).await
    }

    /// Renews the lease for another [`Config::lease`] (a heartbeat for long work).
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease was taken over or released; store errors.
    pub async fn extend(&self, lease: &Lease) -> Result<Lease, Error> {
        self.calls.extend(lease, self.config.lease).await
    }

    /// Runs `work` at most once per key and hands every later call its stored value: the
    /// helper for message consumers and plain functions. The value is stored as JSON.
    ///
    /// While `work` runs, the lease is extended every third of [`Config::lease`]
    /// ([`Idem::run_with_heartbeat`] with [`OnLost::Cancel`]); if an extension finds the
    /// lease lost, `work` is dropped at its next `.await` and [`Error::LeaseLost`] is
    /// returned.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use idem_core::{Failure, Fingerprint, Idem, Key, MemoryStore, Once, RecordId, Scope};
    /// let idem = Idem::new(MemoryStore::new());
    /// let id = RecordId::new(Scope::new("billing").unwrap(), Key::new("msg-7").unwrap());
    /// let fp = Fingerprint::of_bytes(b"payload");
    /// let first = idem.execute_once(&id, fp, |_lease| async { Ok::<_, Failure<String>>(42) }).await.unwrap();
    /// assert_eq!(first, Once::Executed { value: 42, attempt: 1 });
    /// let again = idem.execute_once(&id, fp, |_lease| async { Ok::<_, Failure<String>>(0) }).await.unwrap();
    /// assert_eq!(again, Once::Replayed(42));
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`OnceError::Work`] when `work` fails (the key is released or the failure stored, per
    /// [`Failure`] and [`FailurePolicy`]); [`OnceError::Store`] on store errors and lost
    /// leases; [`OnceError::Codec`] when a stored value does not decode as `T`.
    pub async fn execute_once<T, E, F, Fut>(
        &self,
        id: &RecordId,
        fingerprint: Fingerprint,
        work: F,
    ) -> Result<Once<T>, OnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: std::fmt::Display,
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<T, Failure<E>>>,
    {
        let lease = match self.begin(id, fingerprint).await? {
            Begin::Acquired(lease) | Begin::TookOver(lease) => lease,
            Begin::Replay(Replay { completion, .. }) => {
                return match completion.kind {
                    CompletionKind::Succeeded => serde_json::from_slice(&completion.response.body)
                        .map(Once::Replayed)
                        .map_err(OnceError::Codec),
                    CompletionKind::Failed => Ok(Once::FailedBefore(
                        String::from_utf8_lossy(&completion.response.body).into_owned(),
                    )),
                };
            }
            Begin::InFlight { retry_after } => return Ok(Once::InFlight { retry_after }),
            Begin::Mismatch => return Ok(Once::Mismatch),
            Begin::Expired { completed_at } => return Ok(Once::Expired { completed_at }),
        };
        let attempt = lease.attempt();
        let (lease, outcome) = self
            .run_with_heartbeat(lease.clone(), OnLost::Cancel, work(lease))
            .await?;
        match outcome {
            Ok(value) => {
                let body = match serde_json::to_vec(&value) {
                    Ok(body) => body,
                    Err(e) => {
                        // Nothing can be stored: let a retry run it again.
                        self.release(&lease).await?;
                        return Err(OnceError::Codec(e));
                    }
                };
                self.complete(&lease, Response::new(0, body)).await?;
                Ok(Once::Executed { value, attempt })
            }
            Err(Failure::Retryable(error)) => {
                self.release(&lease).await?;
                Err(OnceError::Work {
                    error,
                    stored: false,
                })
            }
            Err(Failure::Terminal(error)) => {
                let stored = self
                    .fail(&lease, Response::new(0, error.to_string()))
                    .await?;
                Err(OnceError::Work { error, stored })
            }
        }
    }

    /// Drives `work` while renewing `lease` every third of [`Config::lease`]: the one
    /// heartbeat of idem, used by [`Idem::execute_once`], the HTTP layer and anyone holding
    /// a lease over long work. Returns the latest lease (renewed) with the work's output.
    ///
    /// **An outage shorter than the time left on the lease never costs the lease.** A
    /// renewal that fails for a retryable reason (the store briefly unavailable: a timeout,
    /// a refused or reset connection) is tried again soon, not a third of a lease later:
    /// after 100 ms, then with a pause growing by 50 ms up to 250 ms, until the lease's
    /// deadline (and never later than half the time left, so a try still has time to land).
    /// Each try is bounded by half the time left on the lease (all of it in the last
    /// 250 ms) as well as by [`Config::store_timeout`]: an answer after the deadline cannot
    /// keep the lease, and a try stuck in a stalled store gives way to a fresh one while
    /// there is time for it.
    /// While the store answers, renewals stay at one every third of a lease, with no extra
    /// calls.
    ///
    /// When the lease is lost (taken over or evicted), or ran out without a renewal,
    /// `on_lost` decides:
    ///
    /// - [`OnLost::Cancel`]: `work` is dropped at its next `.await` and the error returned;
    /// - [`OnLost::Finish`]: renewing stops and `work` runs to its end; this never returns an
    ///   error, and storing the outcome afterwards finds [`Error::LeaseLost`]. Past its local
    ///   deadline a lease is still renewed (with a pause growing to a third of a lease) as
    ///   long as nobody took it over.
    ///
    /// The work finishing wins over a heartbeat due at the same moment.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem_core::Error> {
    /// use idem_core::{Begin, Fingerprint, Idem, Key, MemoryStore, OnLost, RecordId, Response, Scope};
    ///
    /// let idem = Idem::new(MemoryStore::new());
    /// let id = RecordId::new(Scope::new("reports").unwrap(), Key::new("2025-q1").unwrap());
    /// let Begin::Acquired(lease) = idem.begin(&id, Fingerprint::of_bytes(b"q1")).await? else {
    ///     unreachable!("a fresh key")
    /// };
    /// let (lease, report) = idem
    ///     .run_with_heartbeat(lease, OnLost::Cancel, async { "a long report" })
    ///     .await?;
    /// idem.complete(&lease, Response::new(200, report)).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// Under [`OnLost::Cancel`]: [`Error::LeaseLost`] when the lease was lost; the last
    /// renewal's error when the lease ran out without a renewal. Under [`OnLost::Finish`]:
    /// none.
    pub async fn run_with_heartbeat<O>(
        &self,
        mut lease: Lease,
        on_lost: OnLost,
        work: impl Future<Output = O>,
    ) -> Result<(Lease, O), Error> {
        let every = (self.config.lease / 3).max(Duration::from_millis(1));
        let mut work = std::pin::pin!(work);
        // The pause before the next renewal: a third of a lease while the store answers;
        // after a failed try, a short backoff (see `retry_pause`).
        let mut pause = every;
        let mut failed_tries = 0u32;
        loop {
            // A renewal in progress is raced against the work too, so the work is polled
            // while the store answers.
            let beat = async {
                tokio::time::sleep(pause).await;
                self.renew(&lease).await
            };
            tokio::select! {
                // The work finishing wins over a due heartbeat.
                biased;
                out = &mut work => return Ok((lease, out)),
                renewed = beat => match renewed {
                    Ok(renewed) => {
                        lease = renewed;
                        pause = every;
                        failed_tries = 0;
                    }
                    // Finish keeps trying past the local deadline: a lease nobody took
                    // over still renews.
                    Err(e) if e.is_retryable()
                        && (on_lost == OnLost::Finish || !lease.remaining().is_zero()) =>
                    {
                        failed_tries += 1;
                        pause = retry_pause(failed_tries, lease.remaining(), every);
                        tracing::warn!(key_hash = %KeyHash::of(lease.id()), error = %e,
                            retry_in_ms = pause.as_millis() as u64, "lease renewal failed; trying again");
                    }
                    Err(e) => match on_lost {
                        // Lost, or expired without a renewal: the work future is dropped
                        // with this frame.
                        OnLost::Cancel => return Err(e),
                        OnLost::Finish => {
                            tracing::warn!(key_hash = %KeyHash::of(lease.id()), error = %e,
                                "lease lost while the work ran; it runs to its end unrenewed");
                            let out = work.await;
                            return Ok((lease, out));
                        }
                    },
                },
            }
        }
    }

    /// One renewal of the heartbeat, bounded by half the time left on `lease` (all of it
    /// once that is under 250 ms): a try stuck in a stalled store gives way to a fresh one
    /// while there is still time for it, since a client library may sit in its own backoff
    /// after a stall and answer a stuck call later than a new one. The call is also bounded
    /// by [`Config::store_timeout`]; past the deadline, only by that.
    async fn renew(&self, lease: &Lease) -> Result<Lease, Error> {
        let left = lease.remaining();
        if left.is_zero() {
            return self.extend(lease).await;
        }
        let bound = (left / 2).max(left.min(RENEW_RETRY_MAX));
        match tokio::time::timeout(bound, self.extend(lease)).await {
            Ok(renewed) => renewed,
            Err(elapsed) => Err(Error::unavailable(self.store.name(), elapsed)),
        }
    }
}

/// The pause before the first try after a renewal failed as unavailable.
const RENEW_RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest pause between two tries of a failed renewal while the lease has time left.
const RENEW_RETRY_MAX: Duration = Duration::from_millis(250);

/// The pause before try `failed + 1` of a renewal that failed `failed` times in a row, with
/// `left` on the lease: 100 ms, then 50 ms more each time up to 250 ms, and never more than
/// half of `left` (at least 1 ms), so a store that answers again before the deadline is
/// asked in time. Past the deadline (`left` zero: only under [`OnLost::Finish`]) the pause
/// doubles up to a third of a lease (`every`), since nothing is lost by waiting any more.
fn retry_pause(failed: u32, left: Duration, every: Duration) -> Duration {
    let steps = failed.saturating_sub(1).min(8);
    if left.is_zero() {
        return (RENEW_RETRY_MAX * 2u32.pow(steps)).min(every.max(RENEW_RETRY_MAX));
    }
    let pause = (RENEW_RETRY_FIRST + Duration::from_millis(50) * steps).min(RENEW_RETRY_MAX);
    pause.min(left / 2).max(Duration::from_millis(1))
}
