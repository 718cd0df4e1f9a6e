//! The `consumers` phase (alone): messages per second of idem-consumer's Redis Streams
//! worker, with idem on the Redis store, against the same read, run and ack loop without
//! idem, in interleaved rounds on fresh streams.
//!
//! Each run adds `--keys` messages (one key each, untimed), then times a worker from its
//! start until its handler has run for every message. The handler parses the JSON payload:
//! the cost measured is the worker's and idem's, not the work's. Both sides pull in the same
//! batches (`--consumer-batch`) and run `--concurrency` handlers at once. The figure is
//! the median over `--rounds` of idem's rate over the bare loop's rate taken in the same
//! round.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::consumer::{redis_streams, Consumer, Message};
use idemkit::redis::RedisStore;
use idemkit::{Config, Failure, Idem, Key, Scope};
use redis::aio::ConnectionManager;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::compare::median;
use crate::report::{Figure, Target};

/// What the phase runs against.
#[derive(Debug)]
pub struct Settings {
    /// The Redis server: idem's store, and the Redis Streams broker.
    pub redis_url: String,
    /// Messages per run.
    pub messages: usize,
    /// Handlers at once.
    pub concurrency: usize,
    /// Messages per pull.
    pub batch: usize,
    /// Interleaved rounds (one bare run and one idem run each).
    pub rounds: usize,
    /// Unique per benchmark run.
    pub run_id: String,
}

/// The bare worker or the one with idem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Bare,
    Idem,
}

/// The handler both sides run: parse the payload.
fn work(payload: &[u8]) -> Result<u64, Failure<String>> {
    let value: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| Failure::Terminal(e.to_string()))?;
    Ok(value["n"].as_u64().unwrap_or(0))
}

/// Runs the phase and prints (or returns as JSON) its figures.
pub async fn run(settings: &Settings, json: bool) -> Result<(), String> {
    let client = redis::Client::open(settings.redis_url.as_str()).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_connection_manager()
        .await
        .map_err(|e| format!("{}: {e}", settings.redis_url))?;
    let store = RedisStore::builder(&settings.redis_url)
        .with_prefix(format!("idem-bench:{}:", settings.run_id))
        .connect()
        .await
        .map_err(|e| format!("{}: {e}", settings.redis_url))?;
    let idem =
        Idem::new(store).with_config(Config::default().with_retention(Duration::from_secs(300)));
    let mut figures = Vec::new();

    let broker = "Redis Streams";
    {
        let (mut bare, mut with_idem, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..settings.rounds {
            let mut rates = [0.0; 2];
            for (slot, side) in [Side::Bare, Side::Idem].into_iter().enumerate() {
                let name = format!("idem-bench-{}-{round}-{slot}", settings.run_id);
                let scope = Scope::new(format!("bench-{name}")).map_err(|e| e.to_string())?;
                let consumer = Consumer::new(idem.clone(), scope);
                rates[slot] =
                    streams_run(settings, &client, &mut conn, &name, side, consumer).await?;
            }
            bare.push(rates[0]);
            with_idem.push(rates[1]);
            ratios.push(rates[1] / rates[0]);
        }
        let (b, i) = (median(&bare), median(&with_idem));
        figures.push(
            Figure::new(
                format!("{broker}: idem / bare messages/s"),
                median(&ratios),
                "",
                format!(
                    "medians of {} rounds: {i:.0}/s with idem vs {b:.0}/s bare",
                    settings.rounds
                ),
            )
            .target(Target::AtLeast(0.7)),
        );
    }
    if json {
        let doc = serde_json::json!({
            "phase": "consumers",
            "messages": settings.messages,
            "concurrency": settings.concurrency,
            "batch": settings.batch,
            "rounds": settings.rounds,
            "figures": figures.iter().map(Figure::to_json).collect::<Vec<_>>(),
        });
        println!("{doc:#}");
    } else {
        println!(
            "consumers: {} messages per run, concurrency {}, batch {}, {} rounds",
            settings.messages, settings.concurrency, settings.batch, settings.rounds
        );
        crate::report::print_figures(&figures);
    }
    Ok(())
}

/// Completes once `done` reaches `n`.
fn all_done(done: &Arc<AtomicUsize>, n: usize) -> impl Future<Output = ()> + Send + 'static {
    let done = done.clone();
    async move {
        while done.load(Ordering::Relaxed) < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// One timed Redis Streams run on a fresh stream: messages per second.
async fn streams_run(
    s: &Settings,
    client: &redis::Client,
    conn: &mut ConnectionManager,
    name: &str,
    side: Side,
    consumer: Consumer,
) -> Result<f64, String> {
    let e = |e: redis_streams::Error| e.to_string();
    let topology = redis_streams::Topology::new(name);
    topology.declare(conn).await.map_err(e)?;
    // Untimed: the entries, with their keys, pipelined.
    for chunk in (0..s.messages).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            let key = Key::new(format!("m-{i}")).map_err(|e| e.to_string())?;
            let payload = format!(r#"{{"n": {i}}}"#);
            pipe.cmd("XADD")
                .arg(&topology.stream)
                .arg("*")
                .arg(redis_streams::fields_with_key(
                    payload.as_bytes(),
                    &key,
                    None,
                ))
                .ignore();
        }
        pipe.query_async::<()>(conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    match side {
        Side::Idem => {
            let counter = done.clone();
            redis_streams::Worker::new(consumer, topology.clone())
                .with_concurrency(s.concurrency)
                .with_batch(s.batch)
                .run(
                    client,
                    move |message: Message, _ctx| {
                        let counter = counter.clone();
                        async move {
                            let n = work(message.payload());
                            counter.fetch_add(1, Ordering::Relaxed);
                            n
                        }
                    },
                    all_done(&done, s.messages),
                )
                .await
                .map_err(e)?;
        }
        Side::Bare => {
            // The same read, run and XACK loop, without idem.
            let mut reader = client
                .get_connection_manager()
                .await
                .map_err(|e| e.to_string())?;
            let slots = Arc::new(Semaphore::new(s.concurrency));
            let mut tasks = JoinSet::new();
            let mut buffer = std::collections::VecDeque::new();
            while done.load(Ordering::Relaxed) < s.messages {
                let slot = slots
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|e| e.to_string())?;
                if buffer.is_empty() {
                    let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg(&topology.group)
                        .arg("bare")
                        .arg("COUNT")
                        .arg(s.batch)
                        .arg("BLOCK")
                        .arg(200)
                        .arg("STREAMS")
                        .arg(&topology.stream)
                        .arg(">")
                        .query_async(&mut reader)
                        .await
                        .map_err(|e| e.to_string())?;
                    buffer.extend(reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids));
                }
                let Some(entry) = buffer.pop_front() else {
                    continue;
                };
                let (done, mut conn, stream, group) = (
                    done.clone(),
                    conn.clone(),
                    topology.stream.clone(),
                    topology.group.clone(),
                );
                tasks.spawn(async move {
                    let _ = work(redis_streams::message_of(&entry).payload());
                    let _ = redis::cmd("XACK")
                        .arg(&stream)
                        .arg(&group)
                        .arg(&entry.id)
                        .query_async::<()>(&mut conn)
                        .await;
                    done.fetch_add(1, Ordering::Relaxed);
                    drop(slot);
                });
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        }
    }
    let rate = s.messages as f64 / started.elapsed().as_secs_f64();
    topology.delete(conn).await.map_err(e)?;
    Ok(rate)
}
