//! A store that forwards every call to another, with switches that make `begin`, `complete`
//! and `extend` fail as an unreachable store's, `begin` hang, `extend` stall (as a paused
//! server's, answered once it resumes), or lose the answer of a call that landed,
//! and a count of the `complete` and `extend` calls that reached it; and [`TimerClock`], on
//! which a memory store's leases expire as a paused test's sleeps pass: for tests of what a caller (the
//! engine, the HTTP layer, a consumer) does when its store fails, or of how often it stores.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, Completion, Error, Lease, Record, RecordId, Store, StreamRead, Watch,
};

/// Forwards to an inner store, failing the calls its switches say (with
/// [`Error::Unavailable`] named after the inner store, "connection refused"). All switches
/// start off, so a new `FaultyStore` behaves as its inner store.
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    begin_down: AtomicBool,
    begin_hung: AtomicBool,
    complete_down: AtomicBool,
    complete_failures: AtomicUsize,
    complete_lost_answers: AtomicUsize,
    begin_lost_answers: AtomicUsize,
    extend_failures: AtomicUsize,
    /// While true, `extend` waits (it goes on to the inner store once false again).
    extend_stalled: tokio::sync::watch::Sender<bool>,
    completes: AtomicUsize,
    extends: AtomicUsize,
}

impl FaultyStore {
    /// Forwards to `inner`.
    pub fn new(inner: impl Store + 'static) -> Self {
        Self::from_arc(Arc::new(inner))
    }

    /// Forwards to the shared `inner`.
    pub fn from_arc(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            begin_down: AtomicBool::new(false),
            begin_hung: AtomicBool::new(false),
            complete_down: AtomicBool::new(false),
            complete_failures: AtomicUsize::new(0),
            complete_lost_answers: AtomicUsize::new(0),
            begin_lost_answers: AtomicUsize::new(0),
            extend_failures: AtomicUsize::new(0),
            extend_stalled: tokio::sync::watch::Sender::new(false),
            completes: AtomicUsize::new(0),
            extends: AtomicUsize::new(0),
        }
    }

    /// While `stalled`, every `extend` waits; when the stall ends, the waiting calls go on to
    /// the inner store and answer (unless their caller gave up on them): a server paused
    /// with `SIGSTOP` and resumed.
    pub fn set_extend_stalled(&self, stalled: bool) {
        self.extend_stalled.send_replace(stalled);
    }

    /// How many calls of `extend` were made, failed and stalled ones included.
    pub fn extends(&self) -> usize {
        self.extends.load(Ordering::SeqCst)
    }

    /// How many calls of `complete` were made, failed ones included.
    pub fn completes(&self) -> usize {
        self.completes.load(Ordering::SeqCst)
    }

    fn down(&self) -> Error {
        Error::unavailable(
            self.inner.name(),
            std::io::Error::other("connection refused"),
        )
    }
}

/// The switches' setters, one line each: the setter, its argument, the field it stores.
macro_rules! switches {
    ($($(#[$doc:meta])* $setter:ident($arg:ident: $ty:ty) => $field:ident;)*) => {
        impl FaultyStore {
            $(
                $(#[$doc])*
                pub fn $setter(&self, $arg: $ty) {
                    self.$field.store($arg, Ordering::SeqCst);
                }
            )*
        }
    };
}

switches! {
    /// While `down`, every `begin` fails without reaching the inner store.
    set_begin_down(down: bool) => begin_down;
    /// While `hung`, every `begin` waits forever without reaching the inner store: a server
    /// that stopped answering.
    set_begin_hung(hung: bool) => begin_hung;
    /// While `down`, every `complete` fails without reaching the inner store.
    set_complete_down(down: bool) => complete_down;
    /// The next `n` calls of `complete` fail without reaching the inner store; later ones
    /// work.
    fail_next_completes(n: usize) => complete_failures;
    /// The next `n` calls of `complete` that reach the inner store write there, then report
    /// a failure: an answer lost on the way back.
    lose_next_complete_answers(n: usize) => complete_lost_answers;
    /// The next `n` calls of `begin` write to the inner store, then never answer: a server
    /// paused right after it ran the command.
    lose_next_begin_answers(n: usize) => begin_lost_answers;
    /// The next `n` calls of `extend` fail without reaching the inner store; later ones work.
    fail_next_extends(n: usize) => extend_failures;
}

/// The clock of tokio's timer, which a test with `start_paused` moves: a
/// [`idem_core::MemoryStore::with_clock`] on it expires leases as the test's sleeps pass, so
/// a stall against a lease's deadline is tested to the millisecond without waiting.
#[derive(Debug, Clone, Copy)]
pub struct TimerClock(tokio::time::Instant);

impl TimerClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self(tokio::time::Instant::now())
    }
}

impl Default for TimerClock {
    fn default() -> Self {
        Self::new()
    }
}

impl idem_core::Clock for TimerClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// Takes one from a positive counter; false when it is at zero.
fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[async_trait]
impl Store for FaultyStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin, Error> {
        if self.begin_down.load(Ordering::SeqCst) {
            return Err(self.down());
        }
        if self.begin_hung.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let answer = self.inner.begin(req).await;
        if take_one(&self.begin_lost_answers) {
            std::future::pending::<()>().await;
        }
        answer
    }
    async fn complete(&self, lease: &Lease, c: &Completion, ttl: Duration) -> Result<(), Error> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.complete_failures) || self.complete_down.load(Ordering::SeqCst) {
            return Err(self.down());
        }
        self.inner.complete(lease, c, ttl).await?;
        if take_one(&self.complete_lost_answers) {
            return Err(self.down());
        }
        Ok(())
    }
    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        self.inner.release(lease).await
    }
    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        let mut stalled = self.extend_stalled.subscribe();
        // The sender lives as long as `self`, so this wait ends only with the stall.
        let _ = stalled.wait_for(|stalled| !stalled).await;
        if take_one(&self.extend_failures) {
            return Err(self.down());
        }
        self.inner.extend(lease, by).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }
    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        self.inner.evict(id).await
    }
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        self.inner.watch(id).await
    }
    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<(), Error> {
        self.inner.append(lease, at, bytes).await
    }
    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead, Error> {
        self.inner.read_stream(id, from).await
    }
}
