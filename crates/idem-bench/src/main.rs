//! `idem-bench`: measures idem's phases against a store, and the raw floor of its server
//! through the same client at the same concurrency.
//!
//! ```text
//! idem-bench --store memory --keys 20000 --concurrency 32 --body-bytes 256
//! idem-bench --store redis://127.0.0.1:6380 --concurrency 32
//! idem-bench --store redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
//! idem-bench --store postgres://postgres@127.0.0.1:5432/test --concurrency 16
//! idem-bench --phases middleware
//! ```
//!
//! Phases (each on its own fresh keys):
//! - `lifecycle`: `begin` (acquire) + `complete` on new keys; one operation = both calls;
//! - `replay`: `begin` on completed keys;
//! - `race`: R rounds of K concurrent callers on one key each, counting how many times the
//!   protected work ran (must equal R);
//! - `inflight`: `begin` by many callers on keys another worker holds;
//! - `memory`: resident memory per record of the in-memory store (200,000 records of a
//!   155 B body: `idem-bench --phases memory --keys 200000 --body-bytes 155`; whatever
//!   `--store` says);
//! - `middleware`: requests/s of a trivial axum handler, bare and behind the idem-http layer
//!   on the in-memory store, over loopback HTTP (whatever `--store` says);
//! - `proxy`: `idem proxy` in this process in front of a minimal hyper upstream: direct,
//!   pass-through, nginx (`--nginx`), and guarded new keys and replays on the memory store
//!   and on `--store`, at concurrency 1 and `--concurrency` (see `proxy.rs`);
//! - `compare` (alone, on a `redis://` store): idem side by side with the `idempotent` and
//!   `klauthed-data` crates' Redis stores, in interleaved rounds (see `compare.rs`).
//! - `consumers` (alone, on a `redis://` store): messages/s of the Redis Streams and NATS
//!   JetStream workers with idem against the same workers without idem's store (NATS at
//!   `--nats-url`; see `consumers.rs`).
//! - `wait`: how soon a waiter (`Config::wait`) answers after the holder's completion, with
//!   the store's notifications and polled (`--wait-keys` operations each; see `wait.rs`).
//!
//! Each phase reports throughput, latency p50 / p99 / p99.9 and the count of each outcome.
//! For Redis and PostgreSQL the run adds the server's floor and the ratios to it (see
//! `BENCHMARKS.md`). Every run writes under its own Redis key prefix or PostgreSQL schema:
//! Redis keys expire by themselves (after `--retention-secs`), the schema is dropped at the
//! end.

use std::sync::Arc;

use idemkit::url::StoreUrl;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use idemkit::outbox::TieredStore;
use idemkit::postgres::PgStore;
use idemkit::redis::RedisStore;
use idemkit::{Completion, Response, Scope, Store};

mod compare;
mod consumers;
mod footprint;
mod middleware;
mod pg_floor;
mod phases;
mod proxy;
mod redis_floor;
mod relay;
mod report;
mod wait;

use pg_floor::PgSide;
use phases::Bench;
use redis_floor::{stats_delta, CommandStats, RedisSide};
use report::{Figure, PhaseReport, Target};

/// Command-line options.
#[derive(Debug, Parser)]
#[command(
    name = "idem-bench",
    about = "Benchmarks idem's phases against a store, with the server's raw floor"
)]
struct Args {
    /// The store: `memory`, `redis://host:port`, `redis+cluster://host:port,...` (list every
    /// primary for the CPU and memory figures), `postgres://user@host/db`, or
    /// `tiered:<redis URL>|<postgres URL>` (the tiered store; no floor).
    #[arg(long, default_value = "memory", env = "IDEM_BENCH_STORE")]
    store: String,
    /// Keys per phase (and operations of each floor at `--concurrency`).
    #[arg(long, default_value_t = 20_000)]
    keys: usize,
    /// Concurrent callers.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Operations of the concurrency-1 phases (lifecycle and PING at C=1).
    #[arg(long, default_value_t = 5_000)]
    c1_keys: usize,
    /// Bytes of each stored response body.
    #[arg(long, default_value_t = 256)]
    body_bytes: usize,
    /// Rounds of the race phase.
    #[arg(long, default_value_t = 200)]
    race_rounds: usize,
    /// Concurrent callers per key in the race phase.
    #[arg(long, default_value_t = 16)]
    race_callers: usize,
    /// Phases to run, comma-separated: lifecycle, replay, race, inflight, memory (the
    /// in-memory store's footprint), middleware, proxy (`idem proxy` against a minimal
    /// upstream, guarded on the memory store and on `--store`), relay (the tiered store's outbox relay:
    /// `--store tiered:...` only), wait, compare (alone, on a `redis://` store), consumers
    /// (alone: the Redis Streams and JetStream workers with idem against the same workers
    /// without its store).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lifecycle,replay,race,inflight"
    )]
    phases: Vec<String>,
    /// An nginx binary: the proxy phase adds it as a plain reverse proxy (keep-alive) to the
    /// same upstream, a reference beside the pass-through row. Left out when not given.
    #[arg(long, value_name = "PATH")]
    nginx: Option<std::path::PathBuf>,
    /// Skip the server's floor (PING / SET NX, or the two-statement PostgreSQL floor).
    #[arg(long)]
    no_floor: bool,
    /// PostgreSQL pool size. Default: `--concurrency`, so no caller waits for a connection.
    #[arg(long)]
    pg_pool: Option<u32>,
    /// PostgreSQL: whether waiters listen for notifications (`PgStore::with_notify`, on
    /// by default); `--pg-notify false` makes them poll, to compare what it costs.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pg_notify: bool,
    /// Keep the run's PostgreSQL schema instead of dropping it.
    #[arg(long)]
    keep: bool,
    /// How long records (and the floor's Redis keys) are kept, in seconds.
    #[arg(long, default_value_t = 300)]
    retention_secs: u64,
    /// Completions per second while the relay phase measures lag.
    #[arg(long, default_value_t = 1_000)]
    relay_rate: u32,
    /// Seconds of completions at `--relay-rate` in the relay phase.
    #[arg(long, default_value_t = 5)]
    relay_seconds: u64,
    /// Interleaved rounds of the `compare` phase.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A Redis Cluster (`redis+cluster://...`) on which the `compare` phase also runs idem's
    /// concurrent lifecycle and replay, for the cluster / standalone ratio.
    #[arg(long)]
    compare_cluster: Option<String>,
    /// Bytes of the JSON response body of the `compare` phase.
    #[arg(long, default_value_t = 35)]
    compare_body_bytes: usize,
    /// Operations of each run of the wait phase.
    #[arg(long, default_value_t = 500)]
    wait_keys: usize,
    /// Messages per pull of the `consumers` phase.
    #[arg(long, default_value_t = 16)]
    consumer_batch: usize,
    /// The NATS server (JetStream on) of the `consumers` phase's JetStream worker.
    #[arg(
        long,
        default_value = "nats://127.0.0.1:4222",
        env = "IDEM_BENCH_NATS_URL"
    )]
    nats_url: String,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
}

const PHASES: [&str; 11] = [
    "compare",
    "consumers",
    "memory",
    "lifecycle",
    "replay",
    "race",
    "inflight",
    "middleware",
    "proxy",
    "relay",
    "wait",
];

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

/// The server behind the store, when the run measures its floor.
enum Server {
    None,
    Redis(Arc<RedisSide>, RedisStore),
    Postgres(PgSide),
    /// The tiered store: no floor (its Redis keys expire; its schema is dropped at the end).
    Tiered(PgSide, TieredStore),
}

async fn run(args: &Args) -> Result<(), String> {
    if args.keys == 0
        || args.concurrency == 0
        || args.c1_keys == 0
        || args.race_callers == 0
        || args.race_rounds == 0
    {
        return Err(
            "--keys, --concurrency, --c1-keys, --race-rounds and --race-callers must be at least 1"
                .into(),
        );
    }
    if let Some(p) = args.phases.iter().find(|p| !PHASES.contains(&p.as_str())) {
        return Err(format!(
            "unknown phase {p:?}; phases: {}",
            PHASES.join(", ")
        ));
    }
    // Unique per run: this run's keys, prefix and schema meet no other run's.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .subsec_nanos();
    let run_id = format!("{}_{nanos}", std::process::id());
    if args.phases.iter().any(|p| p == "compare") {
        return compare(args, run_id).await;
    }
    if args.phases.iter().any(|p| p == "consumers") {
        return consumers(args, run_id).await;
    }
    let (store, server) = open(args, &run_id).await?;
    let result = measure(args, &run_id, store, &server).await;
    if let Server::Postgres(pg) | Server::Tiered(pg, _) = &server {
        if !args.keep {
            pg.drop_schema().await?;
        }
    }
    let (reports, figures) = result?;
    if args.json {
        let doc = serde_json::json!({
            "store": args.store,
            "keys": args.keys,
            "concurrency": args.concurrency,
            "body_bytes": args.body_bytes,
            "run": run_id,
            "phases": reports.iter().map(PhaseReport::to_json).collect::<Vec<_>>(),
            "figures": figures.iter().map(Figure::to_json).collect::<Vec<_>>(),
        });
        println!("{doc:#}");
    } else {
        println!(
            "store {}  keys {}  concurrency {}  body {} B",
            args.store, args.keys, args.concurrency, args.body_bytes
        );
        report::print_table(&reports);
        report::print_figures(&figures);
    }
    Ok(())
}

/// The `compare` phase, which runs alone: idem against its peers on one Redis server.
async fn compare(args: &Args, run_id: String) -> Result<(), String> {
    if args.phases.len() > 1 || args.rounds == 0 {
        return Err("the compare phase runs alone (--phases compare), with --rounds >= 1".into());
    }
    let url = match StoreUrl::parse(&args.store).map_err(|e| e.to_string())? {
        StoreUrl::Redis(url) if !url.starts_with(RedisStore::CLUSTER_SCHEME) => url,
        other => {
            return Err(format!(
                "the compare phase needs a standalone redis:// store (the peers have no cluster \
                 support; --compare-cluster adds idem's cluster figures), not {other}"
            ))
        }
    };
    let settings = compare::Settings {
        url,
        cluster: args.compare_cluster.clone(),
        keys: args.keys,
        c1_keys: args.c1_keys,
        concurrency: args.concurrency,
        rounds: args.rounds,
        body_bytes: args.compare_body_bytes,
        retention: Duration::from_secs(args.retention_secs.max(1)),
        run_id,
    };
    compare::run(&settings, args.json).await
}

/// The `consumers` phase, which runs alone: the message workers with and without idem.
async fn consumers(args: &Args, run_id: String) -> Result<(), String> {
    if args.phases.len() > 1 || args.rounds == 0 || args.consumer_batch == 0 {
        return Err(
            "the consumers phase runs alone (--phases consumers), with --rounds and \
             --consumer-batch >= 1"
                .into(),
        );
    }
    let redis_url = match StoreUrl::parse(&args.store).map_err(|e| e.to_string())? {
        StoreUrl::Redis(url) if !url.starts_with(RedisStore::CLUSTER_SCHEME) => url,
        other => {
            return Err(format!(
                "the consumers phase needs a standalone redis:// store (idem's store and the \
                 Redis Streams broker), not {other}"
            ))
        }
    };
    let settings = consumers::Settings {
        redis_url,
        nats_url: args.nats_url.clone(),
        messages: args.keys,
        concurrency: args.concurrency,
        batch: args.consumer_batch,
        rounds: args.rounds,
        run_id,
    };
    consumers::run(&settings, args.json).await
}

/// Opens the store under this run's own prefix or schema, and the server side for the floor.
async fn open(args: &Args, run_id: &str) -> Result<(Arc<dyn Store>, Server), String> {
    let url = StoreUrl::parse(&args.store).map_err(|e| e.to_string())?;
    let prefix = format!("idem-bench:{run_id}:");
    match &url {
        StoreUrl::Redis(url) => {
            let store = redis_store(url, &prefix).await?;
            let side = Arc::new(RedisSide::connect(url, &prefix).await?);
            Ok((Arc::new(store.clone()), Server::Redis(side, store)))
        }
        StoreUrl::Postgres(url) => {
            let store = pg_store(args, url, run_id).await?;
            let side = PgSide::create(&store).await?;
            Ok((Arc::new(store), Server::Postgres(side)))
        }
        StoreUrl::Tiered { redis, postgres } => {
            let pg = pg_store(args, postgres, run_id).await?;
            let side = PgSide::create(&pg).await?;
            let store = TieredStore::new(redis_store(redis, &prefix).await?, pg);
            Ok((Arc::new(store.clone()), Server::Tiered(side, store)))
        }
        // Everything else through the facade, which names what this build can open.
        _ => Ok((
            idemkit::connect_url(&url)
                .await
                .map_err(|e| format!("{url}: {e}"))?,
            Server::None,
        )),
    }
}

/// A Redis store writing under `prefix`.
async fn redis_store(url: &str, prefix: &str) -> Result<RedisStore, String> {
    RedisStore::builder(url)
        .with_prefix(prefix)
        .connect()
        .await
        .map_err(|e| format!("{url}: {e}"))
}

/// A PostgreSQL store in a schema of this run's own, migrated, with a pool of
/// `--pg-pool` connections.
async fn pg_store(args: &Args, url: &str, run_id: &str) -> Result<PgStore, String> {
    let e = |e: idemkit::Error| format!("{url}: {e}");
    let pool = PgStore::pool_options()
        .max_connections(args.pg_pool.unwrap_or(args.concurrency as u32).max(1))
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|err| format!("{url}: {err}"))?;
    let store = PgStore::new(pool)
        .with_schema(&format!("idem_bench_{run_id}"))
        .map_err(e)?
        .with_notify(args.pg_notify);
    // The records table and the outbox's (the tiered store needs both).
    idemkit::outbox::migrate(&store).await.map_err(e)?;
    Ok(store)
}

/// Runs the phases and the floors; returns the phase reports and the derived figures.
async fn measure(
    args: &Args,
    run_id: &str,
    store: Arc<dyn Store>,
    server: &Server,
) -> Result<(Vec<PhaseReport>, Vec<Figure>), String> {
    let (n, c) = (args.keys, args.concurrency);
    let retention = Duration::from_secs(args.retention_secs.max(1));
    let bench = Bench {
        store,
        scope: Scope::new(format!("bench-{run_id}")).map_err(|e| e.to_string())?,
        completion: Arc::new(Completion::succeeded(Response::new(
            201,
            vec![b'x'; args.body_bytes],
        ))),
        lease: Duration::from_secs(30),
        retention,
    };
    let mut reports = Vec::new();
    let mut figures = Vec::new();
    let wants = |p: &str| args.phases.iter().any(|x| x == p);
    let store_phases = ["lifecycle", "replay", "race", "inflight"]
        .iter()
        .any(|p| wants(p));
    let redis = match server {
        Server::Redis(side, store) if !args.no_floor => Some((side.clone(), store)),
        _ => None,
    };

    // First, before any other phase frees memory that its records would reuse unseen.
    if wants("memory") {
        let (phase, measured) = footprint::run(n, args.body_bytes).await?;
        reports.push(phase);
        figures.extend(measured);
    }

    if store_phases {
        // Untimed: connections opened, scripts loaded, statements prepared.
        bench.lifecycle("warmup", 1000.min(n), c).await?;
    }

    // The concurrency-1 pair: a lifecycle is two round trips, so its floor is two PINGs.
    if let (Some((side, _)), true) = (&redis, wants("lifecycle")) {
        let ping1 = side.ping("redis PING", args.c1_keys, 1).await?;
        let life1 = bench.lifecycle("lifecycle-c1", args.c1_keys, 1).await?;
        figures.push(
            Figure::new(
                "lifecycle C=1 / (2 x PING C=1)",
                life1.throughput() / (ping1.throughput() / 2.0),
                "",
                format!(
                    "lifecycle {:.1} µs vs PING {:.1} µs (mean)",
                    micros(life1.mean_latency()),
                    micros(ping1.mean_latency())
                ),
            )
            .target(Target::AtLeast(0.9)),
        );
        // The median leaves out the scheduling stalls a shared 2-core machine adds.
        figures.push(
            Figure::new(
                "lifecycle C=1 / (2 x PING C=1), medians",
                2.0 * micros(ping1.p50()) / micros(life1.p50()),
                "",
                format!(
                    "lifecycle p50 {:.1} µs vs PING p50 {:.1} µs",
                    micros(life1.p50()),
                    micros(ping1.p50())
                ),
            )
            .target(Target::AtLeast(0.9)),
        );
        reports.push(ping1);
        reports.push(life1);
    }

    let mut set_nx: Option<f64> = None;
    if let Some((side, _)) = &redis {
        let before = side.command_stats().await?;
        let ping = side.ping("redis PING", n, c).await?;
        cpu_figure(
            &mut figures,
            "PING",
            &ping,
            &before,
            &side.command_stats().await?,
        );
        let before = side.command_stats().await?;
        let set = side
            .set_nx(n, c, args.body_bytes, retention.as_millis() as u64)
            .await?;
        cpu_figure(
            &mut figures,
            "SET NX",
            &set,
            &before,
            &side.command_stats().await?,
        );
        set_nx = Some(set.throughput());
        let sizes = sample_usage(side, (0..n).map(|i| side.floor_key(i)).collect()).await?;
        figures.push(Figure::new(
            "SET NX key: bytes beyond its value",
            sizes - args.body_bytes as f64,
            "B",
            format!(
                "MEMORY USAGE of {} sampled floor keys (reference)",
                SAMPLES.min(n)
            ),
        ));
        reports.push(ping);
        reports.push(set);
    }

    if wants("lifecycle") {
        let stats = match &redis {
            Some((side, _)) => Some((side.command_stats().await?, side.used_memory().await?)),
            None => None,
        };
        let life = bench.lifecycle("lifecycle", n, c).await?;
        if let (Some((side, store)), Some((before, mem_before))) = (&redis, stats) {
            let mem_after = side.used_memory().await?;
            cpu_figure(
                &mut figures,
                "lifecycle",
                &life,
                &before,
                &side.command_stats().await?,
            );
            if let Some(set) = set_nx {
                let name = format!("lifecycle C={c} / (SET NX C={c} / 2)");
                let half = "SET NX / 2 (two round trips)";
                let figure = Figure::ratio(name, life.throughput(), set / 2.0, half);
                figures.push(figure.target(Target::AtLeast(0.8)));
            }
            let keys = (0..n)
                .map(|i| bench.id("lifecycle", i).map(|id| store.record_key(&id)))
                .collect::<Result<Vec<_>, _>>()?;
            let usage = sample_usage(side, keys).await?;
            figures.push(
                Figure::new(
                    "record: bytes beyond its body (MEMORY USAGE)",
                    usage - args.body_bytes as f64,
                    "B",
                    format!(
                        "mean of {} sampled records of a {} B body",
                        SAMPLES.min(n),
                        args.body_bytes
                    ),
                )
                .target(Target::AtMost(100.0)),
            );
            let per_record = (mem_after as f64 - mem_before as f64) / n as f64;
            figures.push(
                Figure::new(
                    "record: bytes beyond its body (used_memory)",
                    per_record - args.body_bytes as f64,
                    "B",
                    format!(
                        "INFO used_memory delta over {n} records, summed over {} primar{}",
                        side.primaries(),
                        if side.primaries() == 1 { "y" } else { "ies" }
                    ),
                )
                .target(Target::AtMost(100.0)),
            );
        }
        if let (Server::Postgres(pg), false) = (server, args.no_floor) {
            let floor = pg.floor(n, c, args.body_bytes).await?;
            let name = format!("lifecycle C={c} / insert+update C={c}");
            let floor_is = "two-statement floor";
            let figure = Figure::ratio(name, life.throughput(), floor.throughput(), floor_is);
            figures.push(figure.target(Target::AtLeast(0.95)));
            reports.push(life);
            reports.push(floor);
        } else {
            reports.push(life);
        }
    }

    if wants("replay") {
        bench.prepare_replay(n, c).await?;
        let before = match &redis {
            Some((side, _)) => Some(side.command_stats().await?),
            None => None,
        };
        let replay = bench.replay(n, c).await?;
        if let (Some((side, _)), Some(before)) = (&redis, before) {
            cpu_figure(
                &mut figures,
                "replay",
                &replay,
                &before,
                &side.command_stats().await?,
            );
            if let Some(set) = set_nx {
                let name = format!("replay C={c} / SET NX C={c}");
                let figure = Figure::ratio(name, replay.throughput(), set, "SET NX");
                figures.push(figure.target(Target::AtLeast(0.8)));
            }
        }
        reports.push(replay);
    }
    if wants("race") {
        reports.push(bench.race(args.race_rounds, args.race_callers).await?);
    }
    if wants("inflight") {
        reports.push(bench.inflight(n, c).await?);
    }
    if wants("relay") {
        let Server::Tiered(_, tiered) = server else {
            return Err("the relay phase needs a tiered store (--store tiered:...)".into());
        };
        if args.relay_rate == 0 || args.relay_seconds == 0 {
            return Err("--relay-rate and --relay-seconds must be at least 1".into());
        }
        let (drain, rows_per_sec) = relay::drain(&bench, tiered, n, c).await?;
        figures.push(
            Figure::new(
                "relay: records/s draining a backlog",
                rows_per_sec,
                "/s",
                format!("{n} unpublished completions, default batch of 500"),
            )
            .target(Target::AtLeast(20_000.0)),
        );
        let lag = relay::lag(&bench, tiered, args.relay_rate, args.relay_seconds).await?;
        figures.push(
            Figure::new(
                format!("relay: lag p99 at {}/s", args.relay_rate),
                micros(lag.p99()) / 1000.0,
                "ms",
                format!(
                    "age of the oldest waiting row, sampled every 10 ms; {:.0} completions/s reached",
                    lag.throughput()
                ),
            )
            .target(Target::AtMost(100.0)),
        );
        reports.push(drain);
        reports.push(lag);
    }
    if wants("wait") {
        reports.extend(wait::run(&bench, args.wait_keys.max(1), c).await?);
    }
    if wants("proxy") {
        let store = bench.store.clone();
        let redis = match server {
            Server::Redis(side, _) => Some(side.clone()),
            _ => None,
        };
        let (http, measured) = proxy::run(
            store,
            &args.store,
            redis,
            args.nginx.as_deref(),
            (n, args.c1_keys, c),
        )
        .await?;
        reports.extend(http);
        figures.extend(measured);
    }
    if wants("middleware") {
        let http = middleware::run(n, c).await?;
        let (bare, bare_is) = (http[0].throughput(), "requests to the bare handler");
        let name = "http: layer new keys / bare handler";
        let figure = Figure::ratio(name, http[1].throughput(), bare, bare_is);
        figures.push(figure.target(Target::AtLeast(0.75)));
        let name = "http: layer replays / bare handler";
        figures.push(Figure::ratio(name, http[2].throughput(), bare, bare_is));
        reports.extend(http);
    }
    Ok((reports, figures))
}

/// How many keys `MEMORY USAGE` samples.
const SAMPLES: usize = 200;

/// Mean `MEMORY USAGE` of up to [`SAMPLES`] keys spread evenly over `keys`.
async fn sample_usage(side: &RedisSide, keys: Vec<String>) -> Result<f64, String> {
    let step = (keys.len() / SAMPLES).max(1);
    let (mut total, mut count) = (0u64, 0u64);
    for key in keys.iter().step_by(step).take(SAMPLES) {
        if let Some(bytes) = side.memory_usage(key).await? {
            total += bytes;
            count += 1;
        }
    }
    if count == 0 {
        return Err("MEMORY USAGE found none of the sampled keys".into());
    }
    Ok(total as f64 / count as f64)
}

/// Server CPU per operation of a phase, from the `INFO commandstats` delta around it; the
/// basis names each command's calls per operation and microseconds per call. Scripts count
/// with the commands they call, and the store's own plain commands on their own
/// ([`compare::server_usec`]).
fn cpu_figure(
    figures: &mut Vec<Figure>,
    what: &str,
    phase: &PhaseReport,
    before: &CommandStats,
    after: &CommandStats,
) {
    let ops = phase.ops().max(1) as f64;
    let (total, parts) =
        compare::server_usec(&stats_delta(before, after), compare::IDEM_TOP_LEVEL, ops);
    figures.push(Figure::new(
        format!("redis CPU per op: {what}"),
        total / ops,
        "µs",
        parts,
    ));
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
