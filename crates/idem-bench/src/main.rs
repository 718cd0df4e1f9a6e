//! `idem-bench`: measures the state machine's phases against a store.
//!
//! ```text
//! idem-bench --store memory --keys 20000 --concurrency 32 --body-bytes 256
//! ```
//!
//! Phases (each on its own fresh keys):
//! - `lifecycle`: `begin` (acquire) + `complete` on new keys; one operation = both calls;
//! - `replay`: `begin` on completed keys;
//! - `race`: R rounds of K concurrent callers on one key each, counting how many times the
//!   protected work ran (must equal R);
//! - `inflight`: `begin` by many callers on keys another worker holds.
//!
//! Each phase reports throughput, latency p50 / p99 / p99.9 and the count of each outcome.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use idem::{
    Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, MemoryStore, RecordId,
    Response, Scope, Store,
};

mod report;

use report::{Outcomes, PhaseReport};

/// Command-line options.
#[derive(Debug, Parser)]
#[command(
    name = "idem-bench",
    about = "Benchmarks idem's phases against a store"
)]
struct Args {
    /// The store: `memory` (the embedded in-memory store).
    #[arg(long, default_value = "memory", env = "IDEM_BENCH_STORE")]
    store: String,
    /// Keys per phase.
    #[arg(long, default_value_t = 20_000)]
    keys: usize,
    /// Concurrent callers.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Bytes of each stored response body.
    #[arg(long, default_value_t = 256)]
    body_bytes: usize,
    /// Rounds of the race phase.
    #[arg(long, default_value_t = 200)]
    race_rounds: usize,
    /// Concurrent callers per key in the race phase.
    #[arg(long, default_value_t = 16)]
    race_callers: usize,
    /// Phases to run, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lifecycle,replay,race,inflight"
    )]
    phases: Vec<String>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem-bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<(), String> {
    if args.keys == 0 || args.concurrency == 0 || args.race_callers == 0 {
        return Err("--keys, --concurrency and --race-callers must be at least 1".into());
    }
    let store = open(&args.store)?;
    let body = Response::new(201, vec![b'x'; args.body_bytes]);
    let bench = Bench {
        store,
        scope: Scope::new(format!("bench-{}", std::process::id())).map_err(|e| e.to_string())?,
        completion: Arc::new(Completion::succeeded(body)),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(600),
    };
    let mut reports = Vec::new();
    for phase in &args.phases {
        let report = match phase.as_str() {
            "lifecycle" => {
                bench
                    .lifecycle("lifecycle", args.keys, args.concurrency)
                    .await?
            }
            "replay" => bench.replay(args.keys, args.concurrency).await?,
            "race" => bench.race(args.race_rounds, args.race_callers).await?,
            "inflight" => bench.inflight(args.keys, args.concurrency).await?,
            other => return Err(format!("unknown phase {other:?}")),
        };
        reports.push(report);
    }
    if args.json {
        let doc = serde_json::json!({
            "store": args.store,
            "keys": args.keys,
            "concurrency": args.concurrency,
            "body_bytes": args.body_bytes,
            "phases": reports.iter().map(PhaseReport::to_json).collect::<Vec<_>>(),
        });
        println!("{doc:#}");
    } else {
        println!(
            "store {}  keys {}  concurrency {}  body {} B",
            args.store, args.keys, args.concurrency, args.body_bytes
        );
        report::print_table(&reports);
    }
    Ok(())
}

fn open(url: &str) -> Result<Arc<dyn Store>, String> {
    match url {
        "memory" | "memory://" => Ok(Arc::new(MemoryStore::new())),
        other => Err(format!(
            "unsupported store {other:?}: this build knows `memory`"
        )),
    }
}

struct Bench {
    store: Arc<dyn Store>,
    scope: Scope,
    completion: Arc<Completion>,
    lease: Duration,
    retention: Duration,
}

impl Bench {
    fn id(&self, phase: &str, i: usize) -> Result<RecordId, String> {
        let key = Key::new(format!("{phase}-{i}")).map_err(|e| e.to_string())?;
        Ok(RecordId::new(self.scope.clone(), key))
    }

    async fn begin(&self, id: &RecordId) -> Result<Begin, String> {
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

    /// Runs `op(i)` for i in 0..n on `concurrency` workers; returns latencies and outcomes.
    async fn drive<F, Fut>(
        &self,
        phase: &str,
        n: usize,
        concurrency: usize,
        op: F,
    ) -> Result<PhaseReport, String>
    where
        F: Fn(usize) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<&'static str, String>> + Send,
    {
        let op = Arc::new(op);
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..concurrency.min(n) {
            let (op, next) = (op.clone(), next.clone());
            workers.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
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
            started.elapsed(),
            latencies,
            outcomes,
        ))
    }

    async fn lifecycle(
        self: &Bench,
        phase: &'static str,
        n: usize,
        concurrency: usize,
    ) -> Result<PhaseReport, String> {
        let this = self.shared();
        self.drive(phase, n, concurrency, move |i| {
            let this = this.clone();
            async move {
                let id = this.id(phase, i)?;
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

    async fn replay(&self, n: usize, concurrency: usize) -> Result<PhaseReport, String> {
        // Completed keys to replay, written first and not timed.
        self.lifecycle("replay", n, concurrency).await?;
        let this = self.shared();
        self.drive("replay", n, concurrency, move |i| {
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

    async fn race(&self, rounds: usize, callers: usize) -> Result<PhaseReport, String> {
        let executions = Arc::new(AtomicUsize::new(0));
        let this = self.shared();
        let counted = executions.clone();
        // Every operation is one caller; callers of one round share a key, and all of a
        // round's callers run at once.
        let report = self
            .drive("race", rounds * callers, callers, move |i| {
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

    async fn inflight(&self, n: usize, concurrency: usize) -> Result<PhaseReport, String> {
        // A few held keys, hit by every caller.
        let held = 64.min(n);
        let mut leases = Vec::new();
        for i in 0..held {
            match self.begin(&self.id("inflight", i)?).await? {
                Begin::Acquired(lease) => leases.push(lease),
                other => return Err(format!("a new key was not acquired: {other:?}")),
            }
        }
        let this = self.shared();
        let report = self
            .drive("inflight", n, concurrency, move |i| {
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

    fn shared(&self) -> Arc<Bench> {
        Arc::new(Bench {
            store: self.store.clone(),
            scope: self.scope.clone(),
            completion: self.completion.clone(),
            lease: self.lease,
            retention: self.retention,
        })
    }
}
