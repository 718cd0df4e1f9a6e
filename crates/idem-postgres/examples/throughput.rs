//! A rough throughput benchmark of the Postgres store: fresh keys (begin + complete) and
//! replays (begin on a completed key), from many concurrent tasks.
//!
//! ```text
//! IDEM_BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --release -p idem-postgres --example throughput [tasks] [ops per task]
//! ```
//!
//! It works in a schema of its own (`idem_bench_<random>`) and drops it at the end.

use std::time::{Duration, Instant};

use idem_core::{
    Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, RecordId, Response, Scope,
    Store,
};
use idem_postgres::PgStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_BENCH_DATABASE_URL")
        .map_err(|_| "set IDEM_BENCH_DATABASE_URL to a PostgreSQL URL")?;
    let mut args = std::env::args().skip(1);
    let tasks: usize = args.next().map_or(Ok(16), |a| a.parse())?;
    let per_task: usize = args.next().map_or(Ok(500), |a| a.parse())?;

    let pool = PgStore::pool_options()
        .max_connections(u32::try_from(tasks).unwrap_or(u32::MAX).min(32))
        .connect(&url)
        .await?;
    let schema = format!(
        "idem_bench_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let store = PgStore::new(pool).with_schema(&schema)?;
    store.migrate().await?;

    let fresh = run(&store, tasks, per_task, Phase::Fresh).await?;
    let replay = run(&store, tasks, per_task, Phase::Replay).await?;
    let ops = (tasks * per_task) as f64;
    println!("{tasks} tasks x {per_task} keys");
    println!(
        "fresh keys (begin + complete): {:>8.0} keys/s ({fresh:?})",
        ops / fresh.as_secs_f64()
    );
    println!(
        "replays (begin):               {:>8.0} begins/s ({replay:?})",
        ops / replay.as_secs_f64()
    );

    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(store.pool())
        .await?;
    Ok(())
}

#[derive(Clone, Copy)]
enum Phase {
    Fresh,
    Replay,
}

async fn run(
    store: &PgStore,
    tasks: usize,
    per_task: usize,
    phase: Phase,
) -> Result<Duration, Box<dyn std::error::Error>> {
    let started = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            for i in 0..per_task {
                let id = RecordId::new(Scope::new("bench")?, Key::new(format!("k-{t}-{i}"))?);
                let answer = store
                    .begin(BeginRequest {
                        id: &id,
                        fingerprint: Fingerprint::of_bytes(b"bench"),
                        token: FencingToken::random(),
                        lease: Duration::from_secs(30),
                        retention: Duration::from_secs(3600),
                    })
                    .await?;
                match (phase, answer) {
                    (Phase::Fresh, Begin::Acquired(lease)) => {
                        let done = Completion::succeeded(Response::new(200, "ok"));
                        store
                            .complete(&lease, &done, Duration::from_secs(3600))
                            .await?;
                    }
                    (Phase::Replay, Begin::Replay(_)) => {}
                    (_, other) => return Err(format!("unexpected answer {other:?}").into()),
                }
            }
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for handle in handles {
        handle.await?.map_err(|e| e.to_string())?;
    }
    Ok(started.elapsed())
}
