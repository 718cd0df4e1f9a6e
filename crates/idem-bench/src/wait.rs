//! The wait phase: how soon a caller waiting for another worker's result
//! ([`idemkit::Config::wait`]) answers once the holder completes.
//!
//! Each operation takes a key (the holder), starts a waiter on it through [`Idem::begin`],
//! lets the waiter find the key in flight and settle into its wait, completes the key, and
//! measures from the moment `complete` returned to the waiter's answer (zero when the
//! waiter answered first: a notification can overtake the completion's reply). The phase
//! runs twice: with the store's notifications (`wait`), and with them hidden so that the
//! waiter polls as it did before notifications (`wait-polled`: 2 ms doubling to 50 ms).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemkit::{
    Begin, BeginRequest, Completion, Config, Error, Fingerprint, Idem, Lease, Record, RecordId,
    Result, Store, Watch,
};
use tokio::time::Instant;

use crate::phases::Bench;
use crate::report::{Outcomes, PhaseReport};

/// How long a waiter is given to find the key in flight and start waiting before the
/// holder completes.
const SETTLE: Duration = Duration::from_millis(20);

/// Both runs of the phase, 500 operations each at `concurrency`: notified, then polled.
pub async fn run(bench: &Bench, concurrency: usize) -> Result<Vec<PhaseReport>, String> {
    let n = 500;
    // Untimed: the store's listening connection opened, the pool warm.
    one_run(bench, "wait-warmup", bench.store.clone(), 16, concurrency).await?;
    let notified = one_run(bench, "wait", bench.store.clone(), n, concurrency).await?;
    let polled: Arc<dyn Store> = Arc::new(Polled(bench.store.clone()));
    let polled = one_run(bench, "wait-polled", polled, n, concurrency).await?;
    Ok(vec![notified, polled])
}

/// `n` operations by `concurrency` workers; the report's latencies are the waiters'
/// answers after the completions (not the operations' durations).
async fn one_run(
    bench: &Bench,
    phase: &'static str,
    store: Arc<dyn Store>,
    n: usize,
    concurrency: usize,
) -> Result<PhaseReport, String> {
    let idem = Idem::from_arc(store).with_config(
        Config::default()
            .with_lease(bench.lease)
            .with_retention(bench.retention)
            .with_wait(Duration::from_secs(10)),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency.clamp(1, n.max(1)) {
        let (bench, idem, next) = (bench.clone(), idem.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, String>(latencies);
                }
                latencies.push(wait_once(&bench, &idem, &bench.id(phase, i)?).await?);
            }
        }));
    }
    let mut latencies = Vec::with_capacity(n);
    for worker in workers {
        latencies.extend(worker.await.map_err(|e| e.to_string())??);
    }
    let outcomes = Outcomes::from([("replayed", latencies.len() as u64)]);
    Ok(PhaseReport::new(
        phase,
        concurrency,
        started.elapsed(),
        latencies,
        outcomes,
    ))
}

/// One operation: how long after `complete` returned the waiter on `id` answered.
async fn wait_once(bench: &Bench, idem: &Idem, id: &RecordId) -> Result<Duration, String> {
    let fingerprint = Fingerprint::of_bytes(b"bench");
    let Begin::Acquired(lease) = idem.begin(id, fingerprint).await.map_err(str)? else {
        return Err("a new key was not acquired".into());
    };
    let waiter = {
        let (idem, id) = (idem.clone(), id.clone());
        tokio::spawn(async move {
            let answer = idem.begin(&id, fingerprint).await;
            (answer, Instant::now())
        })
    };
    tokio::time::sleep(SETTLE).await;
    idem.store()
        .complete(&lease, &bench.completion, bench.retention)
        .await
        .map_err(str)?;
    let completed = Instant::now();
    let (answer, answered) = waiter.await.map_err(|e| e.to_string())?;
    match answer.map_err(str)? {
        Begin::Replay(_) => Ok(answered.saturating_duration_since(completed)),
        other => Err(format!("the waiter did not get the replay: {other:?}")),
    }
}

fn str(e: Error) -> String {
    e.to_string()
}

/// A store with its notifications hidden: waiters poll it.
#[derive(Debug)]
struct Polled(Arc<dyn Store>);

#[async_trait]
impl Store for Polled {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin> {
        self.0.begin(req).await
    }
    async fn complete(&self, lease: &Lease, c: &Completion, ttl: Duration) -> Result<()> {
        self.0.complete(lease, c, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.0.release(lease).await
    }
    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        self.0.extend(lease, by).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>> {
        self.0.get(id).await
    }
    async fn evict(&self, id: &RecordId) -> Result<bool> {
        self.0.evict(id).await
    }
    async fn watch(&self, _: &RecordId) -> Option<Watch> {
        None
    }
}
