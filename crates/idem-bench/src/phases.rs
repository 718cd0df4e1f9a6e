//! The store phases (lifecycle, replay, race, in-flight) and the driver every timed phase
//! runs on, floors included, so that both sides of a ratio pay the same harness costs.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::{
    Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, RecordId, Scope, Store,
};

use crate::report::{Outcomes, PhaseReport};

/// Runs `op(i)` for every i in `0..n` on `concurrency` tasks that each take the next `i` as
/// soon as their previous operation ends (a closed loop: at most `concurrency` operations in
/// flight). Returns the latency of each operation and the count of each outcome.
pub async fn drive<F, Fut>(
    phase: &str,
    n: usize,
    concurrency: usize,
    op: F,
) -> Result<PhaseReport, String>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<&'static str, String>> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency.min(n) {
        let (op, next) = (op.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(n / concurrency + 1);
            let mut outcomes = Outcomes::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let t = Instant::now();
                let outcome = op(i).await?;
                latencies.push(t.elapsed());
                *outcomes.entry(outcome).or_insert(0) += 1;
            }
            Ok::<_, String>((latencies, outcomes))
        }));
    }
    let mut latencies = Vec::with_capacity(n);
    let mut outcomes = BTreeMap::new();
    for worker in workers {
        let (l, o) = worker.await.map_err(|e| e.to_string())??;
        latencies.extend(l);
        for (k, v) in o {
            *outcomes.entry(k).or_insert(0) += v;
        }
    }
    Ok(PhaseReport::new(
        phase,
        concurrency.min(n),
        started.elapsed(),
        latencies,
        outcomes,
    ))
}

/// The store under test and what every phase stores.
#[derive(Debug, Clone)]
pub struct Bench {
    /// The store.
    pub store: Arc<dyn Store>,
    /// This run's scope: keys never meet another run's.
    pub scope: Scope,
    /// The completion every executed key stores.
    pub completion: Arc<Completion>,
    /// Lease of each acquisition.
    pub lease: Duration,
    /// How long completed records are kept.
    pub retention: Duration,
}

impl Bench {
    /// The record of operation `i` of `phase`.
    pub fn id(&self, phase: &str, i: usize) -> Result<RecordId, String> {
        let key = Key::new(format!("{phase}-{i}")).map_err(|e| e.to_string())?;
        Ok(RecordId::new(self.scope.clone(), key))
    }

    /// `begin` on `id`, with the phases' fingerprint, lease and retention.
    pub async fn begin(&self, id: &RecordId) -> Result<Begin, String> {
        self.store
            .begin(BeginRequest {
                id,
                fingerprint: Fingerprint::of_bytes(b"bench"),
                token: FencingToken::random(),
                lease: self.lease,
                retention: self.retention,
            })
            .await
            .map_err(|e| e.to_string())
    }

    /// `begin` + `complete` on `n` new keys named after `phase`.
    pub async fn lifecycle(
        &self,
        phase: &str,
        n: usize,
        concurrency: usize,
    ) -> Result<PhaseReport, String> {
        let this = Arc::new(self.clone());
        let keys: Arc<str> = Arc::from(phase);
        drive(phase, n, concurrency, move |i| {
            let (this, keys) = (this.clone(), keys.clone());
            async move {
                let id = this.id(&keys, i)?;
                match this.begin(&id).await? {
                    Begin::Acquired(lease) => {
                        this.store
                            .complete(&lease, &this.completion, this.retention)
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok("executed")
                    }
                    other => Err(format!("a new key was not acquired: {other:?}")),
                }
            }
        })
        .await
    }

    /// `begin` on `n` completed keys: complete them first with `lifecycle("replay", ..)`.
    pub async fn replay(&self, n: usize, concurrency: usize) -> Result<PhaseReport, String> {
        let this = Arc::new(self.clone());
        drive("replay", n, concurrency, move |i| {
            let this = this.clone();
            async move {
                match this.begin(&this.id("replay", i)?).await? {
                    Begin::Replay(_) => Ok("replayed"),
                    other => Err(format!("a completed key did not replay: {other:?}")),
                }
            }
        })
        .await
    }

    /// `rounds` keys, each raced by `callers` concurrent callers; fails unless the work ran
    /// exactly once per key.
    pub async fn race(&self, rounds: usize, callers: usize) -> Result<PhaseReport, String> {
        let executions = Arc::new(AtomicUsize::new(0));
        let this = Arc::new(self.clone());
        let counted = executions.clone();
        // Every operation is one caller; the callers of one round share a key, and all of a
        // round's callers run at once.
        let report = drive("race", rounds * callers, callers, move |i| {
            let (this, counted) = (this.clone(), counted.clone());
            async move {
                let id = this.id("race", i / callers)?;
                match this.begin(&id).await? {
                    Begin::Acquired(lease) => {
                        counted.fetch_add(1, Ordering::SeqCst);
                        this.store
                            .complete(&lease, &this.completion, this.retention)
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok("executed")
                    }
                    Begin::InFlight { .. } => Ok("in_flight"),
                    Begin::Replay(_) => Ok("replayed"),
                    other => Err(format!("unexpected race outcome {other:?}")),
                }
            }
        })
        .await?;
        let ran = executions.load(Ordering::SeqCst);
        if ran != rounds {
            return Err(format!("race: the work ran {ran} times for {rounds} keys"));
        }
        Ok(report)
    }

    /// `begin` by `n` callers on a few keys another worker holds.
    pub async fn inflight(&self, n: usize, concurrency: usize) -> Result<PhaseReport, String> {
        let held = 64.min(n);
        let mut leases = Vec::new();
        for i in 0..held {
            match self.begin(&self.id("inflight", i)?).await? {
                Begin::Acquired(lease) => leases.push(lease),
                other => return Err(format!("a new key was not acquired: {other:?}")),
            }
        }
        let this = Arc::new(self.clone());
        let report = drive("inflight", n, concurrency, move |i| {
            let this = this.clone();
            async move {
                match this.begin(&this.id("inflight", i % held)?).await? {
                    Begin::InFlight { .. } => Ok("in_flight"),
                    other => Err(format!("a held key was not in flight: {other:?}")),
                }
            }
        })
        .await?;
        for lease in leases {
            self.store
                .release(&lease)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(report)
    }
}
