//! Spans and metrics for every store call, through the `tracing` and `metrics` facades.
//!
//! idem never installs a subscriber or a recorder: a binary picks them (the `idem` binary
//! installs `tracing-subscriber` and a Prometheus exporter). With none
//! installed, both facades cost a few relaxed atomic loads per call.
//!
//! Every store call made through [`crate::Idem`] runs inside a `DEBUG` span named
//! `idem.store` whose fields are stable names a log search can use:
//!
//! | field | value |
//! |---|---|
//! | `store` | the backend: `memory`, `redis`, `postgres`, `tiered`, ... |
//! | `op` | `begin`, `complete`, `release`, `extend`, `get`, `evict`, `stats` |
//! | `scope` | the record's scope |
//! | `key_hash` | [`KeyHash`] of the record: never the key itself |
//! | `outcome` | `begin`: `acquired`, `took_over`, `replay`, `in_flight`, `mismatch`; `get`: `found`, `absent`; `evict`: `evicted`, `absent`; others: `ok`; on an error its [kind](error_kind) |
//! | `attempt` | the lease's attempt, where there is one |
//! | `elapsed_us` | how long the store took |
//!
//! and records `idem_store_calls_total`, `idem_store_call_duration_seconds` and
//! `idem_lease_lost_total` (docs/operations.md, "Metrics", gives their kinds and labels).
//!
//! Bodies, fingerprints and keys are never recorded.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::key::{RecordId, Scope};
use crate::record::{Completion, Lease, Record};
use crate::store::{Begin, BeginRequest, Stats, Store, StreamRead};
use crate::watch::Watch;

/// The first 8 bytes of SHA-256 over a record's injective encoding, in hex: the same record
/// gives the same hash in every process and every log line, and the hash does not give the
/// key away. `idem inspect` prints it, so an operator can go from a log line to a record.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyHash([u8; 8]);

impl KeyHash {
    /// The hash of `id`.
    pub fn of(id: &RecordId) -> Self {
        let digest = Sha256::digest(id.encoded().as_bytes());
        let mut out = [0u8; 8];
        out.copy_from_slice(&digest[..8]);
        Self(out)
    }
}

impl fmt::Display for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({self})")
    }
}

/// Histogram buckets, in seconds, for the `_seconds` histograms: 0.5 ms to 10 s. A binary
/// that installs a Prometheus exporter gives them to it (the library picks no exporter).
pub const LATENCY_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// An enum of span and metric label values: each variant with its name, `COUNT` of them
/// (the variants index arrays of metric keys), and `as_str`.
macro_rules! labels {
    ($(#[$doc:meta])* enum $name:ident { $($variant:ident => $label:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        enum $name {
            $($variant,)+
        }

        impl $name {
            const COUNT: usize = [$($label),+].len();

            const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }
        }
    };
}

labels! {
    /// The store calls [`Instrumented`] reports, by their `op` names.
    enum Op {
        Begin => "begin",
        Complete => "complete",
        Release => "release",
        Extend => "extend",
        Get => "get",
        Evict => "evict",
        Stats => "stats",
        Append => "append",
        ReadStream => "read_stream",
    }
}

labels! {
    /// What a store call came to, by the `outcome` names of spans and metrics: the
    /// successes, then the kinds of error.
    enum Outcome {
        Acquired => "acquired",
        TookOver => "took_over",
        Replay => "replay",
        InFlight => "in_flight",
        Mismatch => "mismatch",
        Expired => "expired",
        Found => "found",
        Absent => "absent",
        Evicted => "evicted",
        Ok => "ok",
        Unavailable => "unavailable",
        Backend => "backend",
        Corrupt => "corrupt",
        LeaseLost => "lease_lost",
        Unsupported => "unsupported",
        Invalid => "invalid",
    }
}

impl Outcome {
    fn of_begin(answer: &Begin) -> Self {
        match answer {
            Begin::Acquired(_) => Outcome::Acquired,
            Begin::TookOver(_) => Outcome::TookOver,
            Begin::Replay(_) => Outcome::Replay,
            Begin::InFlight { .. } => Outcome::InFlight,
            Begin::Mismatch => Outcome::Mismatch,
            Begin::Expired { .. } => Outcome::Expired,
        }
    }

    fn of_error(e: &Error) -> Self {
        match e {
            Error::Unavailable { .. } => Outcome::Unavailable,
            Error::Backend { .. } => Outcome::Backend,
            Error::Corrupt { .. } => Outcome::Corrupt,
            Error::LeaseLost => Outcome::LeaseLost,
            Error::Unsupported { .. } => Outcome::Unsupported,
            Error::Invalid(_) => Outcome::Invalid,
        }
    }
}

/// The kind of an error, as spans and metrics name it.
pub fn error_kind(e: &Error) -> &'static str {
    Outcome::of_error(e).as_str()
}

/// Where the metrics of every call are recorded from: the same as the `metrics` macros
/// would give in this module.
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The metric keys of one store's calls, each built the first time it is recorded and
/// reused after: a key built per call (as the `metrics` macros do with labels that are not
/// literals) is an allocation and a hash of its labels on every call. Every record still
/// goes through the recorder in place at that moment, as a macro's would.
struct Keys {
    /// `idem_store_calls_total`, by op and outcome.
    calls: [[OnceLock<metrics::Key>; Outcome::COUNT]; Op::COUNT],
    /// `idem_store_call_duration_seconds`, by op.
    durations: [OnceLock<metrics::Key>; Op::COUNT],
    /// `idem_lease_lost_total`, by op.
    lease_lost: [OnceLock<metrics::Key>; Op::COUNT],
}

impl Keys {
    fn new() -> Self {
        Self {
            calls: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
            durations: std::array::from_fn(|_| OnceLock::new()),
            lease_lost: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    fn counter(key: &metrics::Key) -> metrics::Counter {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA))
    }

    fn call(&self, store: &'static str, op: Op, outcome: Outcome) -> metrics::Counter {
        Self::counter(self.calls[op as usize][outcome as usize].get_or_init(|| {
            let mut labels = by_op(store, op);
            labels.push(metrics::Label::from_static_parts(
                "outcome",
                outcome.as_str(),
            ));
            metrics::Key::from_parts("idem_store_calls_total", labels)
        }))
    }

    fn lease_lost(&self, store: &'static str, op: Op) -> metrics::Counter {
        Self::counter(
            self.lease_lost[op as usize].get_or_init(|| {
                metrics::Key::from_parts("idem_lease_lost_total", by_op(store, op))
            }),
        )
    }

    fn duration(&self, store: &'static str, op: Op) -> metrics::Histogram {
        let key = self.durations[op as usize].get_or_init(|| {
            metrics::Key::from_parts("idem_store_call_duration_seconds", by_op(store, op))
        });
        metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
    }
}

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keys").finish_non_exhaustive()
    }
}

/// The `store` and `op` labels every metric of a call carries, in that order.
fn by_op(store: &'static str, op: Op) -> Vec<metrics::Label> {
    vec![
        metrics::Label::from_static_parts("store", store),
        metrics::Label::from_static_parts("op", op.as_str()),
    ]
}

/// A [`Store`] that reports every call of the store it wraps (see the [module](self)).
/// [`crate::Idem`] puts one around its store; wrap a store yourself only when calling it
/// without an `Idem`.
///
/// It also logs the store's outages once each: a `WARN` when a call finds the store
/// unavailable after it answered, an `INFO` when it answers again.
#[derive(Debug, Clone)]
pub struct Instrumented {
    inner: Arc<dyn Store>,
    timeout: Option<Duration>,
    /// Whether the last call found the store unavailable (shared by clones).
    down: Arc<AtomicBool>,
    /// The metric keys of the store's calls (shared by clones).
    keys: Arc<Keys>,
}

impl Instrumented {
    /// Wraps `inner`, with no time limit of its own.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            timeout: None,
            down: Arc::new(AtomicBool::new(false)),
            keys: Arc::new(Keys::new()),
        }
    }

    /// Bounds every call: one that takes longer fails with [`Error::Unavailable`] (and is
    /// counted as such). Default: no bound beyond the store's own.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    /// Runs one call in its span and records it. `describe` names the outcome of a success
    /// and the attempt it concerns, if any.
    async fn observe<T>(
        &self,
        op: Op,
        scope: Option<&Scope>,
        id: Option<&RecordId>,
        call: impl std::future::Future<Output = Result<T, Error>>,
        describe: impl FnOnce(&T) -> (Outcome, Option<u32>),
    ) -> Result<T> {
        let store = self.inner.name();
        let span = tracing::debug_span!(
            "idem.store",
            store,
            op = op.as_str(),
            scope = Empty,
            key_hash = Empty,
            outcome = Empty,
            attempt = Empty,
            elapsed_us = Empty,
        );
        if !span.is_disabled() {
            if let Some(scope) = scope.or(id.map(RecordId::scope)) {
                span.record("scope", tracing::field::display(scope));
            }
            if let Some(id) = id {
                span.record("key_hash", tracing::field::display(KeyHash::of(id)));
            }
        }
        let started = Instant::now();
        let bounded = async {
            match self.timeout {
                Some(limit) => time_limit(store, limit, call).await,
                None => call.await,
            }
        };
        let result = bounded.instrument(span.clone()).await;
        let elapsed = started.elapsed();
        let outcome = match &result {
            Ok(value) => {
                let (outcome, attempt) = describe(value);
                if let Some(attempt) = attempt {
                    span.record("attempt", attempt);
                }
                outcome
            }
            Err(e) => {
                if matches!(e, Error::LeaseLost) {
                    self.keys.lease_lost(store, op).increment(1);
                }
                Outcome::of_error(e)
            }
        };
        match &result {
            // A full memory store is not an outage: it refuses new keys while it answers
            // every stored one, so its refusals would flap between the two lines below.
            Err(Error::Unavailable { source, .. }) if source.is::<crate::CapacityError>() => {}
            Err(e @ Error::Unavailable { .. }) => {
                if !self.down.swap(true, Ordering::Relaxed) {
                    tracing::warn!(store, error = %e, "idempotency store unavailable: guarded work is refused until it answers");
                }
            }
            _ => {
                if self.down.swap(false, Ordering::Relaxed) {
                    tracing::info!(store, "idempotency store answers again");
                }
            }
        }
        span.record("outcome", outcome.as_str());
        span.record("elapsed_us", micros(elapsed));
        self.keys.call(store, op, outcome).increment(1);
        self.keys.duration(store, op).record(elapsed.as_secs_f64());
        result
    }
}

/// Runs one call to `store`, bounded by `limit`: a call that takes longer is dropped, and
/// answers [`Error::Unavailable`] naming `store`. The one time limit of store calls:
/// [`Instrumented::with_timeout`] bounds every call with it, and a store made of other
/// stores (the tiered store's Redis tier) bounds its calls to them the same way. A store
/// sets none of its own: its client's timeouts bound each round trip, this the call.
///
/// # Errors
///
/// [`Error::Unavailable`] when `limit` passes first; otherwise the call's own error.
pub async fn time_limit<T>(
    store: &'static str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => result,
        Err(elapsed) => Err(Error::unavailable(store, elapsed)),
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[async_trait]
impl Store for Instrumented {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin> {
        let id = req.id;
        self.observe(Op::Begin, None, Some(id), self.inner.begin(req), |answer| {
            let attempt = match answer {
                Begin::Acquired(lease) | Begin::TookOver(lease) => Some(lease.attempt()),
                _ => None,
            };
            (Outcome::of_begin(answer), attempt)
        })
        .await
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let call = self.inner.complete(lease, completion, ttl);
        self.observe(Op::Complete, None, Some(lease.id()), call, |()| {
            (Outcome::Ok, Some(lease.attempt()))
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let call = self.inner.release(lease);
        self.observe(Op::Release, None, Some(lease.id()), call, |()| {
            (Outcome::Ok, Some(lease.attempt()))
        })
        .await
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        let call = self.inner.extend(lease, by);
        self.observe(Op::Extend, None, Some(lease.id()), call, |renewed| {
            (Outcome::Ok, Some(renewed.attempt()))
        })
        .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>> {
        let call = self.inner.get(id);
        self.observe(Op::Get, None, Some(id), call, |record| {
            (
                if record.is_some() {
                    Outcome::Found
                } else {
                    Outcome::Absent
                },
                None,
            )
        })
        .await
    }

    async fn evict(&self, id: &RecordId) -> Result<bool> {
        let call = self.inner.evict(id);
        self.observe(Op::Evict, None, Some(id), call, |existed| {
            (
                if *existed {
                    Outcome::Evicted
                } else {
                    Outcome::Absent
                },
                None,
            )
        })
        .await
    }

    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<()> {
        let call = self.inner.append(lease, at, bytes);
        self.observe(Op::Append, None, Some(lease.id()), call, |()| {
            (Outcome::Ok, Some(lease.attempt()))
        })
        .await
    }

    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead> {
        let call = self.inner.read_stream(id, from);
        self.observe(Op::ReadStream, None, Some(id), call, |read| {
            let outcome = match read {
                StreamRead::Absent => Outcome::Absent,
                _ => Outcome::Found,
            };
            (outcome, None)
        })
        .await
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats> {
        let call = self.inner.stats(scope, stuck_after);
        self.observe(Op::Stats, scope, None, call, |_| (Outcome::Ok, None))
            .await
    }

    /// Passed through, unobserved (a registration, not a store call), and bounded by the
    /// time limit: a registration that takes longer leaves the caller polling.
    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        match self.timeout {
            Some(limit) => tokio::time::timeout(limit, self.inner.watch(id))
                .await
                .ok()
                .flatten(),
            None => self.inner.watch(id).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;

    #[test]
    fn key_hash_is_stable_and_hides_the_key() {
        let id = RecordId::new(Scope::new("tenant").unwrap(), Key::new("order-1").unwrap());
        let hash = KeyHash::of(&id).to_string();
        assert_eq!(hash.len(), 16);
        assert_eq!(hash, KeyHash::of(&id.clone()).to_string());
        assert!(!hash.contains("order"));
        let other = RecordId::new(Scope::new("tenant").unwrap(), Key::new("order-2").unwrap());
        assert_ne!(KeyHash::of(&other), KeyHash::of(&id));
    }
}
