//! Spans and metrics for every store call, through the `tracing` and `metrics` facades.
//!
//! idem never installs a subscriber or a recorder: a binary picks them (the `idem` and
//! `idem-relay` binaries install `tracing-subscriber` and a Prometheus exporter). With none
//! installed, both facades cost a few relaxed atomic loads per call.
//!
//! Every store call made through [`crate::Idem`] runs inside a `DEBUG` span named
//! `idem.store` whose fields are stable names a log search can use:
//!
//! | field | value |
//! |---|---|
//! | `store` | the backend: `memory`, `redis`, `postgres`, `tiered`, ... |
//! | `op` | `begin`, `complete`, `release`, `extend`, `get`, `evict` |
//! | `scope` | the record's scope |
//! | `key_hash` | [`KeyHash`] of the record: never the key itself |
//! | `outcome` | `begin`: `acquired`, `took_over`, `replay`, `in_flight`, `mismatch`; `get`: `found`, `absent`; `evict`: `evicted`, `absent`; others: `ok`; on an error its [kind](error_kind) |
//! | `attempt` | the lease's attempt, where there is one |
//! | `elapsed_us` | how long the store took |
//!
//! and records these metrics (names follow Prometheus conventions; the Prometheus exporter
//! adds `_bucket`/`_sum`/`_count` to histograms):
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `idem_store_calls_total` | counter | `store`, `op`, `outcome` |
//! | `idem_store_call_duration_seconds` | histogram | `store`, `op` |
//! | `idem_lease_lost_total` | counter | `store`, `op` |
//!
//! Bodies, fingerprints and keys are never recorded.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::key::{RecordId, Scope};
use crate::record::{Completion, Lease, Record};
use crate::store::{Begin, BeginRequest, Stats, Store};
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

/// The name an outcome or error goes by in spans and metrics.
fn begin_outcome(answer: &Begin) -> &'static str {
    match answer {
        Begin::Acquired(_) => "acquired",
        Begin::TookOver(_) => "took_over",
        Begin::Replay(_) => "replay",
        Begin::InFlight { .. } => "in_flight",
        Begin::Mismatch => "mismatch",
    }
}

/// The kind of an error, as spans and metrics name it.
pub fn error_kind(e: &Error) -> &'static str {
    match e {
        Error::Unavailable { .. } => "unavailable",
        Error::Backend { .. } => "backend",
        Error::Corrupt { .. } => "corrupt",
        Error::LeaseLost => "lease_lost",
        Error::Unsupported { .. } => "unsupported",
        Error::Invalid(_) => "invalid",
    }
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
}

impl Instrumented {
    /// Wraps `inner`, with no time limit of its own.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            timeout: None,
            down: Arc::new(AtomicBool::new(false)),
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
        op: &'static str,
        scope: Option<&Scope>,
        id: Option<&RecordId>,
        call: impl std::future::Future<Output = Result<T, Error>>,
        describe: impl FnOnce(&T) -> (&'static str, Option<u32>),
    ) -> Result<T> {
        let store = self.inner.name();
        let span = tracing::debug_span!(
            "idem.store",
            store,
            op,
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
                Some(limit) => match tokio::time::timeout(limit, call).await {
                    Ok(result) => result,
                    Err(elapsed) => Err(Error::unavailable(store, elapsed)),
                },
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
                    metrics::counter!("idem_lease_lost_total", "store" => store, "op" => op)
                        .increment(1);
                }
                error_kind(e)
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
        span.record("outcome", outcome);
        span.record("elapsed_us", micros(elapsed));
        metrics::counter!("idem_store_calls_total", "store" => store, "op" => op, "outcome" => outcome)
            .increment(1);
        metrics::histogram!("idem_store_call_duration_seconds", "store" => store, "op" => op)
            .record(elapsed.as_secs_f64());
        result
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
        self.observe("begin", None, Some(id), self.inner.begin(req), |answer| {
            let attempt = match answer {
                Begin::Acquired(lease) | Begin::TookOver(lease) => Some(lease.attempt()),
                _ => None,
            };
            (begin_outcome(answer), attempt)
        })
        .await
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        let call = self.inner.complete(lease, completion, ttl);
        self.observe("complete", None, Some(lease.id()), call, |()| {
            ("ok", Some(lease.attempt()))
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let call = self.inner.release(lease);
        self.observe("release", None, Some(lease.id()), call, |()| {
            ("ok", Some(lease.attempt()))
        })
        .await
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        let call = self.inner.extend(lease, by);
        self.observe("extend", None, Some(lease.id()), call, |renewed| {
            ("ok", Some(renewed.attempt()))
        })
        .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>> {
        let call = self.inner.get(id);
        self.observe("get", None, Some(id), call, |record| {
            (if record.is_some() { "found" } else { "absent" }, None)
        })
        .await
    }

    async fn evict(&self, id: &RecordId) -> Result<bool> {
        let call = self.inner.evict(id);
        self.observe("evict", None, Some(id), call, |existed| {
            (if *existed { "evicted" } else { "absent" }, None)
        })
        .await
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats> {
        let call = self.inner.stats(scope, stuck_after);
        self.observe("stats", scope, None, call, |_| ("ok", None))
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
