//! Relay throughput and lag, measured against real servers.
//!
//! ```text
//! IDEM_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//! IDEM_REDIS_URL=redis://127.0.0.1:6379 \
//! cargo run --release -p idem-outbox --example relay_throughput -- \
//!     [--backlog 20000] [--rate 500] [--seconds 10] [--batch 500] [--relays 1]
//! ```
//!
//! Two phases, in a schema of its own (dropped at the end) and under a Redis key prefix of
//! its own (records kept 5 minutes):
//!
//! 1. **Drain**: `--backlog` committed completions are put in the outbox at once (one
//!    `INSERT ... SELECT generate_series`, so filling it is not what is timed), then
//!    `--relays` relays drain it: records/s.
//! 2. **Lag under load**: writers commit `--rate` completions per second for `--seconds`
//!    through the tiered store (`begin`, then `complete_in` in a transaction, and no
//!    `publish`, so that the relay alone carries each completion to Redis) while the relays
//!    run; the age of the oldest unrelayed row (the `idem_relay_lag_seconds` gauge) is
//!    sampled every 10 ms: p50, p99 and max (a sample with nothing waiting counts as 0).
//!
//! The relays and the sampler have connection pools of their own, as a relay process would.
//!
//! Measured on the development machine (2 shared cores, PostgreSQL 15 and Redis 7.0 on
//! loopback, other builds running, load average 3 to 7; release build, batch 500):
//!
//! | run | result |
//! |---|---|
//! | drain 20 000 rows, 1 relay | 25 000 to 47 000 records/s (0.4 to 0.8 s) |
//! | drain 50 000 rows, 1 relay / 4 relays | 40 700 / 37 800 records/s |
//! | 500 completions/s for 10 s, 1 relay | lag p50 1 to 6 ms, p99 38 to 105 ms, max 140 ms |
//! | 1000/s asked (the writers reach 740/s), 1 relay / 4 relays | lag p99 111 / 135 ms |
//!
//! At these rates the writers, not the relay, saturate the machine; the lag is mostly the
//! wait for a CPU.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    encode_meta, Begin, BeginRequest, CompletionKind, FencingToken, Fingerprint, Key, RecordId,
    Response, Scope, Store,
};
use idem_outbox::{Outbox, Relay, RelayConfig, TieredStore};
use idem_postgres::PgStore;
use idem_redis::RedisStore;
use tokio::sync::watch;
use tokio::time::{interval, sleep, Instant, MissedTickBehavior};

const KEEP: Duration = Duration::from_secs(300);

struct Args {
    backlog: u64,
    rate: u64,
    seconds: u64,
    batch: u32,
    relays: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backlog: 20_000,
        rate: 500,
        seconds: 10,
        batch: 500,
        relays: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .parse::<u64>()
            .map_err(|e| format!("{flag}: {e}"))?;
        match flag.as_str() {
            "--backlog" => args.backlog = value,
            "--rate" => args.rate = value.max(1),
            "--seconds" => args.seconds = value,
            "--batch" => args.batch = u32::try_from(value).map_err(|e| e.to_string())?,
            "--relays" => args.relays = usize::try_from(value.max(1)).unwrap_or(1),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let db_url = std::env::var("IDEM_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let redis_url =
        std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let run = uuid::Uuid::new_v4().simple().to_string();
    let pool = PgStore::pool_options()
        .max_connections(40)
        .connect(&db_url)
        .await?;
    let schema = format!("idem_bench_{}", &run[..12]);
    let pg = PgStore::new(pool).with_schema(&schema)?;
    idem_outbox::migrate(&pg).await?;
    // The relays and the lag sampler have pools of their own, as a relay process would:
    // sharing the writers' pool would measure the queue for its connections.
    let relay_pg =
        PgStore::new(PgStore::pool_options().connect(&db_url).await?).with_schema(&schema)?;
    let sampler_pg = PgStore::new(
        PgStore::pool_options()
            .max_connections(2)
            .connect(&db_url)
            .await?,
    )
    .with_schema(&schema)?;
    let redis = RedisStore::builder(&redis_url)
        .with_prefix(format!("idem-bench-{}:", &run[..12]))
        .connect()
        .await?;
    let tiered = Arc::new(TieredStore::new(redis.clone(), pg.clone()));
    let config = RelayConfig::default().with_batch(args.batch);
    let relays: Vec<Relay> = (0..args.relays)
        .map(|_| Relay::new(relay_pg.clone(), redis.clone()).with_config(config.clone()))
        .collect();
    let outbox = Outbox::new(sampler_pg);
    println!(
        "relay_throughput: batch {}, {} relay(s), schema {}",
        args.batch,
        args.relays,
        pg.schema()
    );

    // --- 1. drain a backlog -------------------------------------------------------------
    if args.backlog > 0 {
        let meta = encode_meta(CompletionKind::Succeeded, &Response::new(201, ""));
        let schema = pg.quoted_schema();
        sqlx::query(&format!(
            "INSERT INTO {schema}.outbox \
                 (scope, key, fingerprint, token, attempt, meta, body, expires_at) \
             SELECT 'bench', 'drain-' || i, $1, gen_random_uuid(), 1, $2, \
                    convert_to('{{\"payment\":' || i || '}}', 'UTF8'), now() + $3 * interval '1 second' \
             FROM generate_series(1, $4) AS i"
        ))
        .bind(Fingerprint::of_bytes(b"bench").as_bytes().to_vec())
        .bind(meta)
        .bind(KEEP.as_secs() as i64)
        .bind(args.backlog as i64)
        .execute(pg.pool())
        .await?;
        let started = Instant::now();
        let drained = relays.iter().map(|relay| async move {
            let mut n = 0;
            loop {
                let batch = relay.relay_batch().await?;
                n += batch.relayed;
                if batch.claimed == 0 {
                    return Ok::<_, idem_core::Error>(n);
                }
            }
        });
        let counts = futures_util::future::join_all(drained).await;
        let elapsed = started.elapsed();
        let total: usize = counts
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?
            .iter()
            .sum();
        assert_eq!(outbox.gauges().await?.backlog, 0);
        println!(
            "drain: {total} rows in {:.2} s = {:.0} records/s",
            elapsed.as_secs_f64(),
            total as f64 / elapsed.as_secs_f64()
        );
    }

    // --- 2. lag under a steady completion rate --------------------------------------------
    if args.seconds > 0 {
        let (stop, stopped) = watch::channel(false);
        let workers: Vec<_> = relays
            .iter()
            .map(|relay| {
                let relay = relay.clone();
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    relay
                        .run(async move {
                            let _ = stopped.wait_for(|s| *s).await;
                        })
                        .await
                })
            })
            .collect();

        let done = Arc::new(AtomicBool::new(false));
        let samples = {
            let outbox = outbox.clone();
            let done = done.clone();
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut tick = interval(Duration::from_millis(10));
                while !done.load(Ordering::Relaxed) {
                    tick.tick().await;
                    if let Ok(g) = outbox.gauges().await {
                        samples.push(g.lag_seconds);
                    }
                }
                samples
            })
        };

        let committed = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let scope = Scope::new("bench")?;
        let started = Instant::now();
        let mut tick = interval(Duration::from_secs_f64(1.0 / args.rate as f64));
        tick.set_missed_tick_behavior(MissedTickBehavior::Burst);
        let mut writers = Vec::new();
        for i in 0..args.rate * args.seconds {
            tick.tick().await;
            let tiered = tiered.clone();
            let scope = scope.clone();
            let committed = committed.clone();
            let failed = failed.clone();
            writers.push(tokio::spawn(async move {
                let id = RecordId::new(scope, Key::new(format!("load-{i}")).expect("key"));
                let req = BeginRequest {
                    id: &id,
                    fingerprint: Fingerprint::of_bytes(&i.to_be_bytes()),
                    token: FencingToken::random(),
                    lease: Duration::from_secs(30),
                    retention: KEEP,
                };
                let Ok(Begin::Acquired(lease)) = tiered.begin(req).await else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let completion = idem_core::Completion::succeeded(Response::new(
                    201,
                    format!("{{\"payment\":{i}}}"),
                ));
                let Ok(mut tx) = tiered.pg().pool().begin().await else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                if tiered
                    .complete_in(&mut tx, &lease, &completion, KEEP)
                    .await
                    .is_ok()
                    && tx.commit().await.is_ok()
                {
                    committed.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for w in writers {
            w.await?;
        }
        let load = started.elapsed();
        // Let the relays catch up before stopping them.
        while outbox.gauges().await?.backlog > 0 {
            sleep(Duration::from_millis(10)).await;
        }
        done.store(true, Ordering::Relaxed);
        let mut samples = samples.await?;
        stop.send(true)?;
        for w in workers {
            w.await?;
        }
        samples.sort_by(f64::total_cmp);
        let pick = |q: f64| {
            samples
                .get(((samples.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
                * 1000.0
        };
        let n = committed.load(Ordering::Relaxed);
        println!(
            "load: {n} completions committed ({} failed) in {:.2} s ({:.0}/s, asked {}/s); lag \
             of the oldest unrelayed row over {} samples: p50 {:.1} ms, p99 {:.1} ms, max \
             {:.1} ms",
            failed.load(Ordering::Relaxed),
            load.as_secs_f64(),
            n as f64 / load.as_secs_f64(),
            args.rate,
            samples.len(),
            pick(0.5),
            pick(0.99),
            pick(1.0),
        );
        let relayed: u64 = relays.iter().map(|r| r.metrics().relayed_total).sum();
        println!("relayed in all: {relayed}");
    }

    sqlx::query(&format!("DROP SCHEMA {} CASCADE", pg.quoted_schema()))
        .execute(pg.pool())
        .await?;
    Ok(())
}
