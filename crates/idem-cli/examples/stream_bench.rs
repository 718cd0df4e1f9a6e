//! Streamed responses through `idem proxy` (in this process) in front of a hyper upstream
//! that streams Server-Sent Events: `/fast` sends 1,000 events of 100 bytes as fast as it
//! can, `/slow` 50 events 20 ms apart. Unguarded (pass-through, no route), then guarded on
//! the memory store and on Redis (`IDEM_BENCH_REDIS_URL`), at concurrency 1 and 32: time to
//! first byte (p50), bytes per second of the fast stream, store appends per stream, and a
//! duplicate that joins a running slow stream through a second proxy on the same Redis: its
//! first byte after its request. A Redis `PING` from this process, in the same run, is the
//! round trip the Redis rows are set against. Every stream is checked whole (its length; a
//! joined duplicate's bytes equal to its first caller's).
//!
//! ```sh
//! IDEM_BENCH_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run --release -p idem-cli --example stream_bench
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_core::{
    Begin, BeginRequest, Completion, Lease, MemoryStore, Record, RecordId, Result, Scope, Stats,
    Store, StreamRead, Watch,
};
use idem_http::Anonymous;
use idem_proxy::Route;
use idemkit::OpenOptions;
use support::HttpClient;

mod support;

/// Bytes of each event, `id:` line and blank line included.
const EVENT_BYTES: usize = 100;
/// Rounds of each row, the sides taking turns.
const ROUNDS: usize = 3;
/// The longest a stream may take before the run fails: every loop here is bounded in time.
const STREAM_LIMIT: Duration = Duration::from_secs(30);

/// An upstream stream: how many events, how far apart.
#[derive(Clone, Copy)]
struct Shape {
    path: &'static str,
    events: usize,
    gap: Duration,
}

const FAST: Shape = Shape {
    path: "/fast",
    events: 1000,
    gap: Duration::ZERO,
};
const SLOW: Shape = Shape {
    path: "/slow",
    events: 50,
    gap: Duration::from_millis(20),
};

/// The events of a stream, `id: <n>` and a `data:` line padded to [`EVENT_BYTES`].
fn events(count: usize) -> Arc<[Bytes]> {
    (0..count)
        .map(|i| {
            let mut event = format!("id: {i}\ndata: ").into_bytes();
            event.resize(EVENT_BYTES - 2, b'x');
            event.extend_from_slice(b"\n\n");
            Bytes::from(event)
        })
        .collect()
}

/// The upstream's body: each event as a frame of its own, the first at once and the next
/// `gap` after the one before (measured from the start, so the timer's rounding does not add
/// up over the stream).
struct Events {
    events: Arc<[Bytes]>,
    sent: usize,
    gap: Duration,
    start: tokio::time::Instant,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl hyper::body::Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        let Some(event) = this.events.get(this.sent).cloned() else {
            return Poll::Ready(None);
        };
        if this.sent > 0 && !this.gap.is_zero() {
            let due = this.start + this.gap * u32::try_from(this.sent).unwrap_or(u32::MAX);
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
        }
        this.sent += 1;
        Poll::Ready(Some(Ok(Frame::data(event))))
    }

    fn is_end_stream(&self) -> bool {
        self.sent == self.events.len()
    }
}

/// The upstream: `/fast` and `/slow` as `text/event-stream`, chunked.
async fn upstream() -> String {
    let (fast, slow) = (events(FAST.events), events(SLOW.events));
    support::upstream("text/event-stream", move |req: http::Request<Incoming>| {
        let (events, gap) = if req.uri().path() == SLOW.path {
            (slow.clone(), SLOW.gap)
        } else {
            (fast.clone(), FAST.gap)
        };
        async move {
            // Read the request whole, as a real service does.
            let _ = req.into_body().collect().await;
            Events {
                events,
                sent: 0,
                gap,
                start: tokio::time::Instant::now(),
                sleep: None,
            }
        }
    })
    .await
}

/// Forwards every call to `inner`, counts the `append`s (the store writes of the streams'
/// recording, which goes to the store directly rather than through the engine's metrics)
/// and times the `begin`s (the store's part of a guarded stream's first byte).
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Store>,
    appends: AtomicUsize,
    begins: std::sync::Mutex<Vec<Duration>>,
}

#[async_trait::async_trait]
impl Store for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin> {
        let started = Instant::now();
        let begun = self.inner.begin(req).await;
        self.begins.lock().unwrap().push(started.elapsed());
        begun
    }

    async fn complete(&self, lease: &Lease, completion: &Completion, ttl: Duration) -> Result<()> {
        self.inner.complete(lease, completion, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease> {
        self.inner.extend(lease, by).await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>> {
        self.inner.get(id).await
    }

    async fn evict(&self, id: &RecordId) -> Result<bool> {
        self.inner.evict(id).await
    }

    async fn watch(&self, id: &RecordId) -> Option<Watch> {
        self.inner.watch(id).await
    }

    async fn append(&self, lease: &Lease, at: u64, bytes: &[u8]) -> Result<()> {
        self.appends.fetch_add(1, Ordering::Relaxed);
        self.inner.append(lease, at, bytes).await
    }

    async fn read_stream(&self, id: &RecordId, from: u64) -> Result<StreamRead> {
        self.inner.read_stream(id, from).await
    }

    async fn stats(&self, scope: Option<&Scope>, stuck_after: Duration) -> Result<Stats> {
        self.inner.stats(scope, stuck_after).await
    }
}

/// A proxy to `upstream` on `store`, every POST guarded unless `guarded` is false: its URL.
async fn proxy(store: Arc<dyn Store>, upstream: &str, guarded: bool) -> String {
    let mut routes = Vec::new();
    if guarded {
        let mut route = Route::default();
        route.http = route.http.clone().with_anonymous(Anonymous::Shared);
        // Kept briefly: long enough for the run, little left behind on a shared server.
        route.engine.retention = Duration::from_secs(60);
        routes.push(route);
    }
    support::proxy(store, upstream, routes).await
}

/// One stream as a client received it.
struct Received {
    /// When the request was sent.
    started: Instant,
    /// From sending the request to the first byte of the body.
    first_byte: Duration,
    /// From sending the request to the body's clean end.
    whole: Duration,
    bytes: Vec<u8>,
}

/// POSTs to `url` with `key` and reads the streamed body to its clean end; `first` is told
/// when its first byte came.
async fn fetch(
    client: &HttpClient,
    url: &str,
    key: &str,
    first: Option<tokio::sync::oneshot::Sender<()>>,
) -> Received {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(
            br#"{"prompt":"count to fifty"}"#,
        )))
        .unwrap();
    let started = Instant::now();
    let read = async {
        let response = client.request(req).await.unwrap();
        assert!(response.status().is_success(), "{:?}", response.status());
        let mut body = response.into_body();
        let (mut first_byte, mut bytes, mut first) = (None, Vec::new(), first);
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("a stream that ends cleanly");
            if let Ok(data) = frame.into_data() {
                if !data.is_empty() && first_byte.is_none() {
                    first_byte = Some(started.elapsed());
                    if let Some(first) = first.take() {
                        let _ = first.send(());
                    }
                }
                bytes.extend_from_slice(&data);
            }
        }
        Received {
            started,
            first_byte: first_byte.expect("a body"),
            whole: started.elapsed(),
            bytes,
        }
    };
    tokio::time::timeout(STREAM_LIMIT, read)
        .await
        .expect("a stream within its time limit")
}

/// What a row of streams measured.
struct Row {
    first_bytes: Vec<Duration>,
    bytes: usize,
    elapsed: Duration,
}

/// `n` streams of `shape` from `base` by `c` callers, stream `i` keyed `<keys>-<i>`.
async fn streams(
    client: &HttpClient,
    base: &str,
    shape: Shape,
    keys: &str,
    n: usize,
    c: usize,
) -> Row {
    let url = format!("{base}{}", shape.path);
    let (client, keys) = (client.clone(), keys.to_owned());
    let started = Instant::now();
    let first_bytes = support::by_callers(n, c, move |i| {
        let (client, url, key) = (client.clone(), url.clone(), format!("{keys}-{i}"));
        async move {
            let received = fetch(&client, &url, &key, None).await;
            assert_eq!(received.bytes.len(), shape.events * EVENT_BYTES);
            received.first_byte
        }
    })
    .await;
    Row {
        bytes: first_bytes.len() * shape.events * EVENT_BYTES,
        first_bytes,
        elapsed: started.elapsed(),
    }
}

/// `n` slow streams from `first` by `c` callers, each joined `after` its first byte by a
/// duplicate (same key, same body) sent to `second`: the duplicates' first bytes, each after
/// its own request.
async fn joins(
    client: &HttpClient,
    (first, second): (&str, &str),
    keys: &str,
    n: usize,
    c: usize,
    after: Duration,
) -> Vec<Duration> {
    let (client, keys) = (client.clone(), keys.to_owned());
    let first = format!("{first}{}", SLOW.path);
    let second = format!("{second}{}", SLOW.path);
    support::by_callers(n, c, move |i| {
        let (client, first, second) = (client.clone(), first.clone(), second.clone());
        let key = format!("{keys}-{i}");
        async move {
            let (told, started) = tokio::sync::oneshot::channel();
            let original = {
                let (client, first, key) = (client.clone(), first.clone(), key.clone());
                tokio::spawn(async move { fetch(&client, &first, &key, Some(told)).await })
            };
            started.await.expect("the first caller's first byte");
            tokio::time::sleep(after).await;
            let joined = fetch(&client, &second, &key, None).await;
            let original = original.await.unwrap();
            // Joined while the first caller's stream still ran, not replayed after it.
            assert!(joined.started + joined.first_byte < original.started + original.whole);
            assert_eq!(joined.bytes, original.bytes, "a joined stream differs");
            joined.first_byte
        }
    })
    .await
}

/// Nearest-rank percentile, in per mille.
fn pct(samples: &mut [Duration], per_mille: usize) -> Duration {
    samples.sort_unstable();
    let rank = (per_mille * samples.len()).div_ceil(1000);
    samples[rank.clamp(1, samples.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `n` Redis `PING`s, one at a time, on a connection of their own: their latencies.
async fn pings(url: &str, n: usize) -> Vec<Duration> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        got.push(started.elapsed());
    }
    got
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[tokio::main]
async fn main() {
    let redis_url = std::env::var("IDEM_BENCH_REDIS_URL")
        .expect("IDEM_BENCH_REDIS_URL, a Redis server for the guarded Redis rows");
    println!("load average at the start: {}\n", load_average());
    let up = upstream().await;
    let pass = proxy(Arc::new(MemoryStore::new()), &up, false).await;
    let counted = |inner: Arc<dyn Store>| {
        Arc::new(Counting {
            inner,
            appends: AtomicUsize::new(0),
            begins: std::sync::Mutex::new(Vec::new()),
        })
    };
    let memory = counted(Arc::new(MemoryStore::new()));
    let options = OpenOptions::default();
    let redis = counted(idemkit::open(&redis_url, &options).await.unwrap().store());
    let targets = [
        ("memory", proxy(memory.clone(), &up, true).await, memory),
        ("redis", proxy(redis.clone(), &up, true).await, redis),
    ];
    // A second proxy on the same Redis, with its own connection: the joining duplicates go
    // there, as to another instance.
    let other = idemkit::open(&redis_url, &options).await.unwrap().store();
    let other = proxy(other, &up, true).await;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(128)
        .build_http();
    let run = uuid::Uuid::new_v4().simple().to_string();

    let mut ping = pings(&redis_url, 2000).await;
    let ping = pct(&mut ping, 500);
    println!("Redis PING p50: {:.3} ms\n", ms(ping));
    println!("| stream | C | figure | pass-through | memory | Redis |");
    println!("|---|---|---|---|---|---|");
    for (shape, name, counts) in [(SLOW, "slow", [9, 96]), (FAST, "fast", [120, 384])] {
        for (c, n) in [1, 32].into_iter().zip(counts) {
            // Untimed: opens the pooled connections (client to proxy, proxy to upstream).
            for base in [&pass, &targets[0].1, &targets[1].1, &other] {
                streams(
                    &client,
                    base,
                    FAST,
                    &format!("{run}-warm-{name}{c}"),
                    c * 2,
                    c,
                )
                .await;
            }
            let bases = [&pass, &targets[0].1, &targets[1].1];
            let mut rows: Vec<Row> = (0..3)
                .map(|_| Row {
                    first_bytes: Vec::new(),
                    bytes: 0,
                    elapsed: Duration::ZERO,
                })
                .collect();
            let mut appends = [0; 2];
            for (_, _, store) in &targets {
                store.begins.lock().unwrap().clear();
            }
            // Rounds in turn, each starting with the next side, so that a change in the
            // machine's load falls on every side alike.
            for round in 0..ROUNDS {
                let keys = format!("{run}-{name}{c}-{round}");
                for side in (0..3).map(|k| (k + round) % 3) {
                    let store = side.checked_sub(1).map(|t| &targets[t].2);
                    let before = store.map(|s| s.appends.load(Ordering::Relaxed));
                    let row = streams(&client, bases[side], shape, &keys, n / ROUNDS, c).await;
                    if let (Some(store), Some(before)) = (store, before) {
                        // The recording's last write may land after its client's clean end.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        appends[side - 1] += store.appends.load(Ordering::Relaxed) - before;
                    }
                    rows[side].first_bytes.extend(row.first_bytes);
                    rows[side].bytes += row.bytes;
                    rows[side].elapsed += row.elapsed;
                }
            }
            let streamed = (n / ROUNDS * ROUNDS) as f64;
            let first: Vec<f64> = rows
                .iter_mut()
                .map(|row| ms(pct(&mut row.first_bytes, 500)))
                .collect();
            println!(
                "| {name} | {c} | first byte p50, ms | {:.3} | {:.3} (+{:.3}) | {:.3} (+{:.3}) |",
                first[0],
                first[1],
                first[1] - first[0],
                first[2],
                first[2] - first[0]
            );
            let begins: Vec<f64> = targets
                .iter()
                .map(|(_, _, store)| ms(pct(&mut store.begins.lock().unwrap(), 500)))
                .collect();
            println!(
                "| {name} | {c} | store `begin` p50, ms | | {:.3} | {:.3} |",
                begins[0], begins[1]
            );
            if shape.gap.is_zero() {
                let rate: Vec<f64> = rows
                    .iter()
                    .map(|row| row.bytes as f64 / row.elapsed.as_secs_f64())
                    .collect();
                println!(
                    "| {name} | {c} | MB/s | {:.1} | {:.1} ({:.2}) | {:.1} ({:.2}) |",
                    rate[0] / 1e6,
                    rate[1] / 1e6,
                    rate[1] / rate[0],
                    rate[2] / 1e6,
                    rate[2] / rate[0]
                );
            }
            println!(
                "| {name} | {c} | appends per stream | | {:.1} | {:.1} |",
                appends[0] as f64 / streamed,
                appends[1] as f64 / streamed
            );
        }
    }
    for (c, n) in [(1, 8), (32, 64)] {
        let keys = format!("{run}-join{c}");
        let mut joined = joins(
            &client,
            (&targets[1].1, &other),
            &keys,
            n,
            c,
            Duration::from_millis(100),
        )
        .await;
        println!(
            "| slow, joined 100 ms in | {c} | duplicate's first byte p50 / p99, ms | | | {:.3} / {:.3} |",
            ms(pct(&mut joined, 500)),
            ms(pct(&mut joined, 990))
        );
    }
    println!("\nload average at the end: {}", load_average());
}
