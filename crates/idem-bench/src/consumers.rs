//! The `consumers` phase (alone): messages per second of idem-consumer's workers (Redis
//! Streams, NATS JetStream) with idem on the Redis store, against the same workers without
//! idem's store, in interleaved rounds on fresh streams.
//!
//! Each run adds `--keys` messages (one key each, untimed) to a fresh stream, then times a
//! worker from its start until its handler has run for every message. The handler parses
//! the JSON payload: the cost measured is the worker's and idem's, not the work's.
//!
//! Both sides run the very same `Worker` (same reads, batch [`BATCH`],
//! `--concurrency` handlers, one task per message, heartbeats, decision and ack); only the
//! store behind the consumer differs. "With idem" is the Redis store; "without" is
//! [`NoStore`], which answers every `begin` with a fresh lease at once and keeps nothing.
//! So the ratio prices idem's store round trips (a `begin` and a `complete` per message, on
//! the same Redis server that carries the Redis Streams broker); idem's in-process work
//! (key, fingerprint, the result as JSON) is on both sides. The figure is the median over
//! `--rounds` of the ratio taken within each round; the side that runs first alternates
//! between rounds.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, Context as JetStream};
use async_trait::async_trait;
use idemkit::consumer::{nats, redis_streams, Consumer, Context, Message};
use idemkit::redis::RedisStore;
use idemkit::{
    Begin, BeginRequest, Completion, Config, Failure, Idem, Key, Lease, Record, RecordId, Scope,
    Store,
};
use redis::aio::ConnectionManager;

use crate::report::{median, Figure, Target};
use crate::{Args, RETENTION};

/// Messages per pull.
const BATCH: usize = 16;

/// A store that grants every `begin` a fresh lease without any I/O and keeps nothing: the
/// worker runs exactly as with idem, minus idem's store round trips.
#[derive(Debug)]
pub(crate) struct NoStore;

#[async_trait]
impl Store for NoStore {
    fn name(&self) -> &'static str {
        "none"
    }
    async fn begin(&self, req: BeginRequest<'_>) -> idemkit::Result<Begin> {
        let now = tokio::time::Instant::now();
        let lease = Lease::new(req.id.clone(), req.token, 1, req.lease, now);
        Ok(Begin::Acquired(lease))
    }
    async fn complete(&self, _: &Lease, _: &Completion, _: Duration) -> idemkit::Result<()> {
        Ok(())
    }
    async fn release(&self, _: &Lease) -> idemkit::Result<()> {
        Ok(())
    }
    async fn extend(&self, lease: &Lease, by: Duration) -> idemkit::Result<Lease> {
        let now = tokio::time::Instant::now();
        Ok(lease.renewed(lease.attempt(), by, now))
    }
    async fn get(&self, _: &RecordId) -> idemkit::Result<Option<Record>> {
        Ok(None)
    }
    async fn evict(&self, _: &RecordId) -> idemkit::Result<bool> {
        Ok(false)
    }
}

/// The broker a run uses.
#[derive(Debug, Clone, Copy)]
enum Broker {
    RedisStreams,
    JetStream,
}

impl Broker {
    /// Its names: in the report, and in the names of the run's streams and of its idem
    /// scope.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::RedisStreams => ("Redis Streams", "streams"),
            Self::JetStream => ("NATS JetStream", "jetstream"),
        }
    }
}

/// The connections of the phase.
struct Brokers {
    client: redis::Client,
    conn: ConnectionManager,
    js: JetStream,
}

/// The handler both sides run: parse the payload.
fn work(payload: &[u8]) -> Result<u64, Failure<String>> {
    let value: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| Failure::Terminal(e.to_string()))?;
    Ok(value["n"].as_u64().unwrap_or(0))
}

/// Runs the phase and prints (or returns as JSON) its figures.
pub async fn run(s: &Args, redis_url: &str, run_id: &str) -> Result<(), String> {
    let client = redis::Client::open(redis_url).map_err(|e| e.to_string())?;
    let conn = client
        .get_connection_manager()
        .await
        .map_err(|e| format!("{redis_url}: {e}"))?;
    let nats = async_nats::connect(&s.nats_url)
        .await
        .map_err(|e| format!("{}: {e} (give the NATS server with --nats-url)", s.nats_url))?;
    let mut brokers = Brokers {
        client,
        conn,
        js: jetstream::new(nats),
    };
    let store = RedisStore::builder(redis_url)
        .with_prefix(format!("idem-bench:{run_id}:"))
        .connect()
        .await
        .map_err(|e| format!("{redis_url}: {e}"))?;
    let config = Config::default().with_retention(RETENTION);
    let with_idem = Idem::new(store).with_config(config.clone());
    let without = Idem::new(NoStore).with_config(config);
    let mut figures = Vec::new();

    for broker in [Broker::RedisStreams, Broker::JetStream] {
        let (label, tag) = broker.names();
        let (mut bare, mut guarded, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..s.rounds {
            let mut rates = [0.0; 2];
            // Alternate which side runs first, so that neither always finds the servers
            // busier (a stream being deleted, records expiring).
            let mut order = [0, 1];
            order.rotate_left(round % 2);
            for side in order {
                let idem = if side == 0 { &without } else { &with_idem };
                // A scope of the run's own: a key completed in an earlier run would be
                // replayed, and the handler would never run.
                let name = format!("idem-bench-{run_id}-{tag}-{round}-{side}");
                let scope = Scope::new(format!("bench-{name}")).map_err(|e| e.to_string())?;
                let consumer = Consumer::new(idem.clone(), scope);
                rates[side] = match broker {
                    Broker::RedisStreams => streams_run(s, &mut brokers, &name, consumer).await?,
                    Broker::JetStream => jetstream_run(s, &brokers, &name, consumer).await?,
                };
            }
            bare.push(rates[0]);
            guarded.push(rates[1]);
            ratios.push(rates[1] / rates[0]);
        }
        let (b, i) = (median(&bare), median(&guarded));
        figures.push(
            Figure::new(
                format!("{label}: idem / bare messages/s"),
                median(&ratios),
                "",
                format!(
                    "medians of {} rounds: {i:.0}/s with idem vs {b:.0}/s without",
                    s.rounds
                ),
            )
            .target(Target::AtLeast(0.7)),
        );
    }
    let doc = serde_json::json!({
        "phase": "consumers",
        "messages": s.keys,
        "concurrency": s.concurrency,
        "batch": BATCH,
        "rounds": s.rounds,
    });
    let header = format!(
        "consumers: {} messages per run, concurrency {}, batch {BATCH}, {} rounds",
        s.keys, s.concurrency, s.rounds
    );
    crate::report::print(s.json, doc, &header, &[], &figures);
    Ok(())
}

/// The count of a timed run's handler calls, and when the run started.
struct Counted {
    done: Arc<AtomicUsize>,
    n: usize,
    started: Instant,
}

impl Counted {
    /// Starts the clock of a run of `n` messages.
    fn start(n: usize) -> Self {
        let done = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        Self { done, n, started }
    }

    /// The handler to give the worker.
    fn handler(
        &self,
    ) -> impl Fn(Message, Context) -> std::future::Ready<Result<u64, Failure<String>>>
           + Send
           + Sync
           + 'static {
        let done = self.done.clone();
        move |message, _ctx| {
            let n = work(message.payload());
            done.fetch_add(1, Ordering::Relaxed);
            std::future::ready(n)
        }
    }

    /// The worker's shutdown: once the handler has run for every message, or after a limit
    /// (a run that stalls ends, and [`Counted::rate`] says so, rather than hanging the
    /// benchmark).
    fn shutdown(&self) -> impl Future<Output = ()> + Send + 'static {
        let (done, n) = (self.done.clone(), self.n);
        let limit = Duration::from_secs(60) + Duration::from_millis(n as u64);
        let deadline = tokio::time::Instant::now() + limit;
        async move {
            while done.load(Ordering::Relaxed) < n && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// Messages per second since the start; an error when the handler did not run for
    /// every message.
    fn rate(&self, name: &str) -> Result<f64, String> {
        let (n, elapsed) = (self.n, self.started.elapsed());
        let done = self.done.load(Ordering::Relaxed);
        if done < n {
            return Err(format!(
                "{name}: the handler ran for {done} of {n} messages in {elapsed:?}; the worker \
                 stalled: is the broker up and the store reachable, and are the keys new to \
                 the scope (a completed key is replayed, and its handler does not run)?"
            ));
        }
        Ok(n as f64 / elapsed.as_secs_f64())
    }
}

/// One timed Redis Streams run on a fresh stream: messages per second.
async fn streams_run(
    s: &Args,
    brokers: &mut Brokers,
    name: &str,
    consumer: Consumer,
) -> Result<f64, String> {
    let e = |e: redis_streams::Error| e.to_string();
    let topology = redis_streams::Topology::new(name);
    topology.declare(&mut brokers.conn).await.map_err(e)?;
    // Untimed: the entries, with their keys, pipelined.
    for chunk in (0..s.keys).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            let key = Key::new(format!("m-{i}")).map_err(|e| e.to_string())?;
            let payload = format!(r#"{{"n": {i}}}"#);
            let fields = redis_streams::fields_with_key(payload.as_bytes(), &key, None);
            pipe.cmd("XADD")
                .arg(&topology.stream)
                .arg("*")
                .arg(fields)
                .ignore();
        }
        pipe.query_async::<()>(&mut brokers.conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    let counted = Counted::start(s.keys);
    redis_streams::Worker::new(consumer, topology.clone())
        .with_concurrency(s.concurrency)
        .with_batch(BATCH)
        .run(&brokers.client, counted.handler(), counted.shutdown())
        .await
        .map_err(e)?;
    let rate = counted.rate(name);
    topology.delete(&mut brokers.conn).await.map_err(e)?;
    rate
}

/// One timed JetStream run on a fresh stream and subject: messages per second.
async fn jetstream_run(
    s: &Args,
    brokers: &Brokers,
    name: &str,
    consumer: Consumer,
) -> Result<f64, String> {
    let e = |e: nats::Error| e.to_string();
    let js = &brokers.js;
    let topology = nats::Topology::new(name, format!("{name}.jobs"));
    topology.declare(js).await.map_err(e)?;
    // Untimed: the messages, with their keys. Confirmations are awaited in chunks: the
    // client lets at most 5,000 be outstanding, and a publish beyond that waits for one.
    for chunk in (0..s.keys).collect::<Vec<_>>().chunks(500) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for i in chunk {
            let key = Key::new(format!("m-{i}")).map_err(|e| e.to_string())?;
            let headers = nats::with_idempotency_key(async_nats::HeaderMap::new(), &key, None);
            let payload = format!(r#"{{"n": {i}}}"#);
            let confirm = js
                .publish_with_headers(topology.subject.clone(), headers, payload.into())
                .await
                .map_err(|e| e.to_string())?;
            confirms.push(confirm);
        }
        for confirm in confirms {
            confirm.await.map_err(|e| e.to_string())?;
        }
    }
    let counted = Counted::start(s.keys);
    nats::Worker::new(consumer, topology.clone())
        .with_concurrency(s.concurrency)
        .with_batch(BATCH)
        .run(js, counted.handler(), counted.shutdown())
        .await
        .map_err(e)?;
    let rate = counted.rate(name);
    topology.delete(js).await.map_err(e)?;
    rate
}
