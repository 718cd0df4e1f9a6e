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
//! `--phases` names the phases (see `--help`; each phase's module says what it measures),
//! each on its own fresh keys.
//!
//! Each phase reports throughput, latency p50 / p99 / p99.9 and the count of each outcome.
//! For Redis and PostgreSQL the run adds the server's floor and the ratios to it (see
//! `BENCHMARKS.md`). Every run writes under its own Redis key prefix or PostgreSQL schema:
//! Redis keys expire by themselves (after [`RETENTION`]), the schema is dropped at the end.

use std::sync::Arc;

use idemkit::url::StoreUrl;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use idemkit::outbox::TieredStore;
use idemkit::postgres::PgStore;
use idemkit::redis::RedisStore;
use idemkit::{Completion, Response, Scope, Store};

mod compare;
mod consume;
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
use redis_floor::{stats_delta, RedisSide};
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
    /// Phases to run, comma-separated: lifecycle, replay, race, inflight, memory (the
    /// in-memory store's footprint), middleware, proxy (`idem proxy` against a minimal
    /// upstream, guarded on the memory store and on `--store`), relay (the tiered store's outbox relay:
    /// `--store tiered:...` only), wait, compare (alone, on a `redis://` store), consumers
    /// (alone: the Redis Streams and JetStream workers with idem against the same workers
    /// without its store), consume (alone: `idem consume` against the same loop on a store
    /// that grants everything, on RabbitMQ and Redis Streams).
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
    /// Interleaved rounds of the `compare` and `consumers` phases.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A Redis Cluster (`redis+cluster://...`) on which the `compare` phase also runs idem's
    /// concurrent lifecycle and replay, for the cluster / standalone ratio.
    #[arg(long)]
    compare_cluster: Option<String>,
    /// The NATS server (JetStream on) of the `consumers` phase's JetStream worker.
    #[arg(
        long,
        default_value = "nats://127.0.0.1:4222",
        env = "IDEM_BENCH_NATS_URL"
    )]
    nats_url: String,
    /// The RabbitMQ server (vhost included) of the `consume` phase.
    #[arg(
        long,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        env = "IDEM_BENCH_AMQP_URL"
    )]
    amqp_url: String,
    /// The `idem` binary the `consume` phase runs [default: `idem` beside this binary].
    #[arg(long, value_name = "PATH")]
    idem: Option<std::path::PathBuf>,
    /// Internal, for the `consume` phase: run as its bare loop (`BROKER FROM TO`) with
    /// `--concurrency`, until SIGTERM.
    #[arg(long, hide = true, num_args = 3)]
    bare_consume: Option<Vec<String>>,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
}

const PHASES: [&str; 12] = [
    "compare",
    "consume",
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

/// How long records (and the floor's Redis keys) are kept.
const RETENTION: Duration = Duration::from_secs(300);

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let result = match &args.bare_consume {
        Some(spec) => consume::bare(spec, args.concurrency).await,
        None => run(&args).await,
    };
    match result {
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
    if args.keys == 0 || args.concurrency == 0 || args.c1_keys == 0 {
        return Err("--keys, --concurrency and --c1-keys must be at least 1".into());
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
        let why =
            "the peers have no cluster support; --compare-cluster adds idem's cluster figures";
        let url = alone_on_redis(args, "compare", why)?;
        return compare::run(args, &url, &run_id).await;
    }
    if args.phases.iter().any(|p| p == "consume") {
        let why = "the Redis store and the Redis Streams broker";
        let url = alone_on_redis(args, "consume", why)?;
        return consume::run(args, &url, &run_id).await;
    }
    if args.phases.iter().any(|p| p == "consumers") {
        let why = "idem's store and the Redis Streams broker";
        let url = alone_on_redis(args, "consumers", why)?;
        return consumers::run(args, &url, &run_id).await;
    }
    let (store, server) = open(args, &run_id).await?;
    let result = measure(args, &run_id, store, &server).await;
    if let Server::Postgres(pg) | Server::Tiered(pg, _) = &server {
        pg.drop_schema().await?;
    }
    let (reports, figures) = result?;
    let doc = serde_json::json!({
        "store": args.store,
        "keys": args.keys,
        "concurrency": args.concurrency,
        "body_bytes": args.body_bytes,
        "run": run_id,
    });
    let header = format!(
        "store {}  keys {}  concurrency {}  body {} B",
        args.store, args.keys, args.concurrency, args.body_bytes
    );
    report::print(args.json, doc, &header, &reports, &figures);
    Ok(())
}

/// The standalone `redis://` URL of `--store`, for `phase`, which runs alone on one (`why`
/// says what for).
fn alone_on_redis(args: &Args, phase: &str, why: &str) -> Result<String, String> {
    if args.phases.len() > 1 || args.rounds == 0 {
        return Err(format!(
            "the {phase} phase runs alone (--phases {phase}), with --rounds >= 1"
        ));
    }
    match StoreUrl::parse(&args.store).map_err(|e| e.to_string())? {
        StoreUrl::Redis(url) if !url.starts_with(RedisStore::CLUSTER_SCHEME) => Ok(url),
        other => Err(format!(
            "the {phase} phase needs a standalone redis:// store ({why}), not {other}"
        )),
    }
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
            idemkit::open(&args.store, &idemkit::OpenOptions::default())
                .await
                .map_err(|e| e.to_string())?
                .store(),
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
/// `--concurrency` connections (no caller waits for one).
async fn pg_store(args: &Args, url: &str, run_id: &str) -> Result<PgStore, String> {
    let e = |e: idemkit::Error| format!("{url}: {e}");
    let pool = PgStore::pool_options()
        .max_connections(args.concurrency as u32)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|err| format!("{url}: {err}"))?;
    let store = PgStore::new(pool)
        .with_schema(&format!("idem_bench_{run_id}"))
        .map_err(e)?;
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
    let bench = Bench {
        store,
        scope: Scope::new(format!("bench-{run_id}")).map_err(|e| e.to_string())?,
        completion: Arc::new(Completion::succeeded(Response::new(
            201,
            vec![b'x'; args.body_bytes],
        ))),
        lease: Duration::from_secs(30),
        retention: RETENTION,
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
    let side = redis.as_ref().map(|(side, _)| &**side);

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

    // Bytes of a record or key beyond its value or body.
    let beyond =
        |name, bytes: f64, basis| Figure::new(name, bytes - args.body_bytes as f64, "B", basis);

    // The concurrency-1 pair: a lifecycle is two round trips, so its floor is two PINGs.
    if let (Some((side, _)), true) = (&redis, wants("lifecycle")) {
        let ping1 = side.ping("redis PING", args.c1_keys, 1).await?;
        let life1 = bench.lifecycle("lifecycle-c1", args.c1_keys, 1).await?;
        let name = "lifecycle C=1 / (2 x PING C=1)";
        let (life, ping) = (micros(life1.mean_latency()), micros(ping1.mean_latency()));
        let basis = format!("lifecycle {life:.1} µs vs PING {ping:.1} µs (mean)");
        let value = life1.throughput() / (ping1.throughput() / 2.0);
        figures.push(Figure::new(name, value, "", basis).target(Target::AtLeast(0.9)));
        // The median leaves out the scheduling stalls a shared 2-core machine adds.
        let name = "lifecycle C=1 / (2 x PING C=1), medians";
        let (life, ping) = (micros(life1.p50()), micros(ping1.p50()));
        let basis = format!("lifecycle p50 {life:.1} µs vs PING p50 {ping:.1} µs");
        let value = 2.0 * ping / life;
        figures.push(Figure::new(name, value, "", basis).target(Target::AtLeast(0.9)));
        reports.push(ping1);
        reports.push(life1);
    }

    let samples = redis_floor::SAMPLES.min(n);
    let mut set_nx: Option<f64> = None;
    if let Some((side, _)) = &redis {
        let cpu = Some(side.as_ref());
        let ping = with_cpu(&mut figures, cpu, "PING", side.ping("redis PING", n, c)).await?;
        let set = side.set_nx(n, c, args.body_bytes, RETENTION.as_millis() as u64);
        let set = with_cpu(&mut figures, cpu, "SET NX", set).await?;
        set_nx = Some(set.throughput());
        let sizes = side.mean_memory_usage(n, |i| Ok(side.floor_key(i))).await?;
        let basis = format!("MEMORY USAGE of {samples} sampled floor keys (reference)");
        figures.push(beyond("SET NX key: bytes beyond its value", sizes, basis));
        reports.push(ping);
        reports.push(set);
    }

    if wants("lifecycle") {
        let mem_before = match side {
            Some(side) => side.used_memory().await?,
            None => 0,
        };
        let life = bench.lifecycle("lifecycle", n, c);
        let life = with_cpu(&mut figures, side, "lifecycle", life).await?;
        if let Some((side, store)) = &redis {
            let mem_after = side.used_memory().await?;
            if let Some(set) = set_nx {
                let name = format!("lifecycle C={c} / (SET NX C={c} / 2)");
                let half = "SET NX / 2 (two round trips)";
                let figure = Figure::ratio(name, life.throughput(), set / 2.0, half);
                figures.push(figure.target(Target::AtLeast(0.8)));
            }
            let key = |i| bench.id("lifecycle", i).map(|id| store.record_key(&id));
            let usage = side.mean_memory_usage(n, key).await?;
            let name = "record: bytes beyond its body (MEMORY USAGE)";
            let basis = format!(
                "mean of {samples} sampled records of a {} B body",
                args.body_bytes
            );
            figures.push(beyond(name, usage, basis).target(Target::AtMost(100.0)));
            let per_record = (mem_after as f64 - mem_before as f64) / n as f64;
            let name = "record: bytes beyond its body (used_memory)";
            let primaries = side.primaries();
            let basis = format!(
                "INFO used_memory delta over {n} records, summed over {primaries} primar{}",
                if primaries == 1 { "y" } else { "ies" }
            );
            figures.push(beyond(name, per_record, basis).target(Target::AtMost(100.0)));
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
        bench.lifecycle("replay", n, c).await?;
        let replay = with_cpu(&mut figures, side, "replay", bench.replay(n, c)).await?;
        if let Some(set) = set_nx {
            let name = format!("replay C={c} / SET NX C={c}");
            let figure = Figure::ratio(name, replay.throughput(), set, "SET NX");
            figures.push(figure.target(Target::AtLeast(0.8)));
        }
        reports.push(replay);
    }
    if wants("race") {
        reports.push(bench.race(200, 16).await?);
    }
    if wants("inflight") {
        reports.push(bench.inflight(n, c).await?);
    }
    if wants("relay") {
        let Server::Tiered(_, tiered) = server else {
            return Err("the relay phase needs a tiered store (--store tiered:...)".into());
        };
        let (drain, rows_per_sec) = relay::drain(&bench, tiered, n, c).await?;
        let name = "relay: records/s draining a backlog";
        let basis = format!("{n} unpublished completions, default batch of 500");
        let figure = Figure::new(name, rows_per_sec, "/s", basis);
        figures.push(figure.target(Target::AtLeast(20_000.0)));
        let lag = relay::lag(&bench, tiered).await?;
        let name = format!("relay: lag p99 at {}/s", relay::RATE);
        let basis = format!(
            "age of the oldest waiting row, sampled every 10 ms; {:.0} completions/s reached",
            lag.throughput()
        );
        let figure = Figure::new(name, micros(lag.p99()) / 1000.0, "ms", basis);
        figures.push(figure.target(Target::AtMost(100.0)));
        reports.push(drain);
        reports.push(lag);
    }
    if wants("wait") {
        reports.extend(wait::run(&bench, c).await?);
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

/// Awaits `phase`; with a Redis `side`, adds to `figures` the server CPU per operation of
/// the phase, from the `INFO commandstats` delta around it: the basis names each command's
/// calls per operation and microseconds per call. Scripts count with the commands they
/// call, and the store's own plain commands on their own ([`compare::server_usec`]).
async fn with_cpu(
    figures: &mut Vec<Figure>,
    side: Option<&RedisSide>,
    what: &str,
    phase: impl std::future::Future<Output = Result<PhaseReport, String>>,
) -> Result<PhaseReport, String> {
    let Some(side) = side else {
        return phase.await;
    };
    let before = side.command_stats().await?;
    let report = phase.await?;
    let delta = stats_delta(&before, &side.command_stats().await?);
    let ops = report.ops().max(1) as f64;
    let (total, parts) = compare::server_usec(&delta, compare::IDEM_TOP_LEVEL, ops);
    figures.push(Figure::new(
        format!("redis CPU per op: {what}"),
        total / ops,
        "µs",
        parts,
    ));
    Ok(report)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
