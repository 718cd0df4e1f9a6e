//! The outbox relay of the tiered store: drain throughput, and lag at a steady completion
//! rate. Completions go through `TieredStore::complete_in` without `publish`, so that every
//! record reaches Redis through the relay, as after a crash between commit and publish.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::outbox::{Relay, TieredStore};
use idemkit::Begin;
use tokio::sync::Semaphore;

use crate::phases::{drive, Bench};
use crate::report::{Outcomes, PhaseReport};

/// Completes key `i` of `phase` in PostgreSQL only (its outbox row waits for the relay).
async fn complete_unpublished(
    bench: &Bench,
    tiered: &TieredStore,
    phase: &str,
    i: usize,
) -> Result<(), String> {
    let begin = bench.begin(&bench.id(phase, i)?).await?;
    let Begin::Acquired(lease) = begin else {
        return Err(format!("a new key was not acquired: {begin:?}"));
    };
    let mut conn = tiered
        .pg()
        .pool()
        .acquire()
        .await
        .map_err(|e| format!("postgres: {e}"))?;
    tiered
        .complete_in(&mut conn, &lease, &bench.completion, bench.retention)
        .await
        .map_err(|e| e.to_string())
}

/// Writes `n` unpublished completions, then times `relay_batch` until the outbox is empty.
/// One operation of the report is one batch; its throughput line is rows per second.
pub async fn drain(
    bench: &Bench,
    tiered: &TieredStore,
    n: usize,
    concurrency: usize,
) -> Result<(PhaseReport, f64), String> {
    let relay = Relay::new(tiered.pg().clone(), tiered.redis().clone());
    // Untimed: the rows earlier phases left (completions published at once, which the
    // relay only deletes), so that the timed drain relays this phase's rows alone.
    while relay
        .relay_batch()
        .await
        .map_err(|e| e.to_string())?
        .claimed
        > 0
    {}
    let (b, t) = (Arc::new(bench.clone()), Arc::new(tiered.clone()));
    drive("relay backlog fill", n, concurrency, move |i| {
        let (b, t) = (b.clone(), t.clone());
        async move {
            complete_unpublished(&b, &t, "relay-drain", i).await?;
            Ok("completed")
        }
    })
    .await?;
    let started = Instant::now();
    let (mut rows, mut written, mut latencies) = (0usize, 0usize, Vec::new());
    loop {
        let t = Instant::now();
        let batch = relay.relay_batch().await.map_err(|e| e.to_string())?;
        if batch.claimed == 0 {
            break;
        }
        latencies.push(t.elapsed());
        rows += batch.relayed;
        written += batch.written;
        if batch.failed > 0 {
            return Err(format!("relay: {} rows failed in a batch", batch.failed));
        }
    }
    let elapsed = started.elapsed();
    if written != n || rows != n {
        return Err(format!(
            "relay relayed {rows} rows and wrote {written} records into Redis, for {n} completions"
        ));
    }
    let mut outcomes = Outcomes::new();
    outcomes.insert("batches", latencies.len() as u64);
    outcomes.insert("rows", rows as u64);
    let report = PhaseReport::new("relay drain (batches)", 1, elapsed, latencies, outcomes);
    Ok((
        report,
        rows as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
    ))
}

/// Completions per second while [`lag`] measures.
pub const RATE: u32 = 1_000;

/// Runs the relay while completions arrive at [`RATE`] per second for 5 s; samples the age
/// of the oldest waiting outbox row every 10 ms. The report's "latencies" are those samples
/// (an upper bound on each record's lag at that moment).
pub async fn lag(bench: &Bench, tiered: &TieredStore) -> Result<PhaseReport, String> {
    let (rate, seconds) = (RATE, 5);
    let relay = Arc::new(Relay::new(tiered.pg().clone(), tiered.redis().clone()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = {
        let relay = relay.clone();
        tokio::spawn(async move {
            relay
                .run(async {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let total = rate as usize * seconds as usize;
    let (b, t) = (Arc::new(bench.clone()), Arc::new(tiered.clone()));
    // Open loop: a completion starts every 1/rate s whether or not the previous ones
    // finished, up to 64 at once.
    let writers = Arc::new(Semaphore::new(64));
    let producer = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
        let mut tasks = Vec::with_capacity(total);
        for i in 0..total {
            tick.tick().await;
            let permit = writers
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| e.to_string())?;
            let (b, t) = (b.clone(), t.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = permit;
                complete_unpublished(&b, &t, "relay-lag", i).await
            }));
        }
        for task in tasks {
            task.await.map_err(|e| e.to_string())??;
        }
        Ok::<_, String>(())
    });
    let started = Instant::now();
    let mut samples = Vec::new();
    while !producer.is_finished() {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let gauges = relay.outbox().gauges().await.map_err(|e| e.to_string())?;
        samples.push(Duration::from_secs_f64(gauges.lag_seconds));
    }
    producer.await.map_err(|e| e.to_string())??;
    let elapsed = started.elapsed();
    // Let the relay catch up, then stop it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while relay
        .outbox()
        .gauges()
        .await
        .map_err(|e| e.to_string())?
        .backlog
        > 0
    {
        if Instant::now() > deadline {
            return Err("relay: backlog not drained 10 s after the last completion".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    worker.await.map_err(|e| e.to_string())?;
    let mut outcomes = Outcomes::new();
    outcomes.insert("completions", total as u64);
    outcomes.insert("samples", samples.len() as u64);
    // Throughput of this report: completions per second actually reached.
    let mut report = PhaseReport::new(
        &format!("relay lag @{rate}/s"),
        1,
        elapsed,
        samples,
        outcomes,
    );
    report.set_ops(total);
    Ok(report)
}
