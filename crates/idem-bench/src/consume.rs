//! The `consume` phase (alone): messages per second that `idem consume` (the `idem` binary,
//! a process of its own) delivers to a minimal HTTP handler, against the same loop with a
//! store that grants everything, on RabbitMQ and Redis Streams, at concurrency 1 and
//! `--concurrency`; with the memory store and with the Redis store of `--store`.
//!
//! **The bare loop** is this binary run again as a child (`--bare-consume`): the same
//! idem-consumer `Worker` with `idem consume`'s settings (prefetch, batch, concurrency,
//! keys from the `x-idempotency-key` header, payload fingerprints), its `Consumer` on
//! [`NoStore`], and the same HTTP request sent through idem-proxy's pooled client
//! (`Forward`). What it leaves out is what `idem consume` adds: the store's work and round
//! trips, and the binary's metrics and logs. So the ratio prices `idem consume` whole against
//! the bare cost of reading the broker and calling HTTP.
//!
//! **The handler** runs in this process: hyper, HTTP/1.1 keep-alive, `200` and a short body
//! at once. **A run** publishes its messages (untimed, one key each) to a fresh queue or
//! stream, starts the consumer process, and counts from the handler's first request to its
//! last; the rate is the messages between them over that time, and the CPU per message is
//! the time each process spent on a CPU (`/proc/<pid>/task/*/schedstat`) over the same
//! window: the consumer process (client), this process (the handler: HTTP server), and the
//! broker's and store's servers (`beam.smp`, `redis-server`). Each round runs the three
//! sides in a rotated order; figures are medians over `--rounds` (a ratio: the median of
//! the rounds' own ratios).

use std::convert::Infallible;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idem_proxy::{Forward, HostHeader, UpstreamConfig, ATTEMPT};
use idemkit::consumer::{rabbitmq, redis_streams, Consumer, Context, Message};
use idemkit::{Config, Failure, Idem, Key, Scope};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use tower_service::Service as _;

use crate::consumers::NoStore;
use crate::report::{median, Figure, Target};
use crate::Args;

/// The handler's path, as `idem consume --path` and the bare loop send it.
const PATH: &str = "/messages";

/// The brokers of the phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Rabbit,
    Streams,
}

impl Broker {
    fn label(self) -> &'static str {
        match self {
            Self::Rabbit => "RabbitMQ",
            Self::Streams => "Redis Streams",
        }
    }

    /// Its name on the bare child's command line.
    fn arg(self) -> &'static str {
        match self {
            Self::Rabbit => "rabbitmq",
            Self::Streams => "redis-streams",
        }
    }
}

/// The three sides of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// This binary's `--bare-consume`: the loop on [`NoStore`].
    Bare,
    /// `idem consume --store memory`.
    Memory,
    /// `idem consume --store <the --store Redis URL>`.
    Redis,
}

const SIDES: [Side; 3] = [Side::Bare, Side::Memory, Side::Redis];

impl Side {
    fn label(self) -> &'static str {
        match self {
            Self::Bare => "bare loop",
            Self::Memory => "idem consume, memory",
            Self::Redis => "idem consume, Redis",
        }
    }
}

/// CPU time of the processes a run involves, at one instant.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    consumer: Duration,
    handler: Duration,
    rabbit: Duration,
    redis: Duration,
}

impl Cpu {
    fn sub(self, earlier: Cpu) -> Cpu {
        Cpu {
            consumer: self.consumer.saturating_sub(earlier.consumer),
            handler: self.handler.saturating_sub(earlier.handler),
            rabbit: self.rabbit.saturating_sub(earlier.rabbit),
            redis: self.redis.saturating_sub(earlier.redis),
        }
    }
}

/// The processes whose CPU a run reads.
#[derive(Debug, Clone, Copy)]
struct Pids {
    consumer: u32,
    rabbit: Option<u32>,
    redis: Option<u32>,
}

impl Pids {
    fn read(&self) -> Cpu {
        let of = |pid: Option<u32>| pid.and_then(cpu_of).unwrap_or_default();
        Cpu {
            consumer: of(Some(self.consumer)),
            handler: crate::middleware::process_cpu().unwrap_or_default(),
            rabbit: of(self.rabbit),
            redis: of(self.redis),
        }
    }
}

/// A process's CPU time so far: the sum of its threads' `schedstat` (time on a CPU, in
/// nanoseconds; finer than `stat`'s clock ticks). Threads that ended are not counted:
/// the runtimes' workers and the servers' threads live as long as the run.
fn cpu_of(pid: u32) -> Option<Duration> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(total))
}

/// The RabbitMQ server's process: the `beam.smp` whose command line names rabbit.
fn rabbit_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let entry = entry.ok()?;
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        let rabbit = String::from_utf8_lossy(&cmdline).contains("rabbit");
        (comm.trim() == "beam.smp" && rabbit).then_some(pid)
    })
}

/// The Redis server's process, as it says itself (`INFO server`).
async fn redis_pid(conn: &mut ConnectionManager) -> Option<u32> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}

/// What the handler saw of one run: its requests, and the time and CPU at the first and
/// at the `n`-th.
struct Tally {
    n: usize,
    requests: AtomicUsize,
    pids: Mutex<Option<Pids>>,
    marks: Mutex<Vec<(Instant, Cpu)>>,
    done: tokio::sync::Notify,
}

impl Tally {
    fn new(n: usize) -> Self {
        Self {
            n,
            requests: AtomicUsize::new(0),
            pids: Mutex::new(None),
            marks: Mutex::new(Vec::new()),
            done: tokio::sync::Notify::new(),
        }
    }

    /// Counts a request; the first and the `n`-th read the clock and the CPU.
    fn request(&self) {
        let i = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if i == 1 || i == self.n {
            let pids = *self.pids.lock().expect("pids");
            let cpu = pids.map(|p| p.read()).unwrap_or_default();
            self.marks
                .lock()
                .expect("marks")
                .push((Instant::now(), cpu));
            if i == self.n {
                self.done.notify_one();
            }
        }
    }
}

/// The handler's current run (none between runs: a stray request is only counted there).
type Current = Arc<Mutex<Option<Arc<Tally>>>>;

/// The minimal handler: reads the body, answers `200` and `ok` at once.
async fn handler(current: Current) -> Result<String, String> {
    let (listener, url) = crate::middleware::bind().await?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let current = current.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let current = current.clone();
                        async move {
                            let _ = req.into_body().collect().await;
                            let tally = current.lock().expect("current").clone();
                            if let Some(tally) = tally {
                                tally.request();
                            }
                            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
                                b"ok",
                            ))))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(url)
}

/// The measures of one run.
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    /// CPU per message.
    cpu: Cpu,
}

/// The phase's connections and settings.
struct Phase<'a> {
    args: &'a Args,
    redis_url: &'a str,
    run_id: &'a str,
    idem: PathBuf,
    rabbit: Channel,
    _rabbit_conn: Connection,
    redis: ConnectionManager,
    current: Current,
    handler: String,
    pids: (Option<u32>, Option<u32>),
    tmp: PathBuf,
}

/// Runs the phase and prints (or returns as JSON) its figures.
pub async fn run(args: &Args, redis_url: &str, run_id: &str) -> Result<(), String> {
    let idem = match &args.idem {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("idem"),
    };
    if !idem.is_file() {
        return Err(format!(
            "no idem binary at {} (build it with `cargo build --release -p idem-cli`, or \
             give it with --idem)",
            idem.display()
        ));
    }
    let amqp = args.amqp_url.trim_end_matches('/');
    let rabbit_conn = Connection::connect(amqp, ConnectionProperties::default())
        .await
        .map_err(|e| format!("{amqp}: {e} (give RabbitMQ with --amqp-url)"))?;
    let rabbit = rabbit_conn
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    rabbit
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let client = redis::Client::open(redis_url).map_err(|e| e.to_string())?;
    let mut redis = client
        .get_connection_manager()
        .await
        .map_err(|e| format!("{redis_url}: {e}"))?;
    let current: Current = Arc::default();
    let handler = handler(current.clone()).await?;
    let tmp = std::env::temp_dir().join(format!("idem-bench-consume-{run_id}"));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let pids = (rabbit_pid(), redis_pid(&mut redis).await);
    let mut phase = Phase {
        args,
        redis_url,
        run_id,
        idem,
        rabbit,
        _rabbit_conn: rabbit_conn,
        redis,
        current,
        handler,
        pids,
        tmp,
    };
    let result = phase.all().await;
    let _ = std::fs::remove_dir_all(&phase.tmp);
    let figures = result?;
    let doc = serde_json::json!({
        "phase": "consume",
        "messages": args.keys,
        "messages_c1": args.c1_keys,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
    });
    let header = format!(
        "consume: {} messages per run at C={}, {} at C=1, {} rounds; CPU in µs per message",
        args.keys, args.concurrency, args.c1_keys, args.rounds
    );
    crate::report::print(args.json, doc, &header, &[], &figures);
    Ok(())
}

impl Phase<'_> {
    async fn all(&mut self) -> Result<Vec<Figure>, String> {
        let mut figures = Vec::new();
        let c = self.args.concurrency;
        for broker in [Broker::Rabbit, Broker::Streams] {
            for (c, n) in [(1, self.args.c1_keys), (c, self.args.keys)] {
                let mut runs: [Vec<Run>; 3] = Default::default();
                for round in 0..self.args.rounds {
                    // Rotate the order, so that no side always runs first (or after the
                    // same other side's teardown).
                    let mut order = SIDES;
                    order.rotate_left(round % SIDES.len());
                    for side in order {
                        let name = format!(
                            "idem-bench-{}-{}-c{c}-{round}-{side:?}",
                            self.run_id,
                            broker.arg()
                        );
                        let run = self.once(broker, side, c, n, &name).await?;
                        runs[side as usize].push(run);
                    }
                }
                figures.extend(summarise(broker, c, n, &runs, self.pids));
            }
        }
        Ok(figures)
    }

    /// One timed run of `side` on a fresh queue or stream `name`.
    async fn once(
        &mut self,
        broker: Broker,
        side: Side,
        c: usize,
        n: usize,
        name: &str,
    ) -> Result<Run, String> {
        let from = self.publish(broker, name, n).await?;
        let log = self.tmp.join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = match side {
            Side::Bare => {
                let mut command = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
                command.args(["--concurrency", &c.to_string(), "--bare-consume"]);
                command.args([broker.arg(), &from, &self.handler]);
                command
            }
            Side::Memory | Side::Redis => {
                let mut command = Command::new(&self.idem);
                command.args(["consume", "--from", &from, "--to", &self.handler]);
                command.args(["--path", PATH, "--concurrency", &c.to_string()]);
                if side == Side::Redis {
                    let prefix = format!("idem-bench:{}:", self.run_id);
                    command.args(["--store", self.redis_url, "--prefix", &prefix]);
                } else {
                    command.args(["--store", "memory"]);
                }
                command
            }
        };
        // The run's tally is in place before the consumer starts, so that no request is
        // counted nowhere; its first request waits for the pids (the lock held across the
        // start) to read the consumer's CPU.
        let tally = Arc::new(Tally::new(n));
        let mut child = {
            let mut pids = tally.pids.lock().expect("pids");
            *self.current.lock().expect("current") = Some(tally.clone());
            let child = command
                .env_remove("RUST_LOG")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn();
            let child = match child {
                Ok(child) => Stopped(child),
                Err(e) => {
                    *self.current.lock().expect("current") = None;
                    return Err(format!("starting the {}: {e}", side.label()));
                }
            };
            *pids = Some(Pids {
                consumer: child.0.id(),
                rabbit: self.pids.0,
                redis: self.pids.1,
            });
            child
        };
        let limit = Duration::from_secs(60) + Duration::from_millis(n as u64);
        let deadline = Instant::now() + limit;
        let outcome = loop {
            let seen = tally.requests.load(Ordering::Relaxed);
            if seen >= n {
                break Ok(());
            }
            if let Ok(Some(status)) = child.0.try_wait() {
                break Err(format!("exited ({status}) after {seen} of {n} messages"));
            }
            if Instant::now() > deadline {
                break Err(format!("{seen} of {n} messages within {limit:?}"));
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), tally.done.notified()).await;
        };
        *self.current.lock().expect("current") = None;
        drop(child);
        self.teardown(broker, name).await?;
        if let Err(why) = outcome {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(format!(
                "{} on {name}: {why}; its stderr: {log}",
                side.label()
            ));
        }
        let marks = tally.marks.lock().expect("marks").clone();
        let [(t0, cpu0), (t1, cpu1)] = marks[..] else {
            return Err(format!(
                "{name}: the handler did not mark its first and last"
            ));
        };
        // Messages after the first, over the time since the first.
        let between = (n - 1).max(1) as f64;
        let cpu = cpu1.sub(cpu0);
        let per = |d: Duration| d / (between as u32);
        let rate = between / t1.duration_since(t0).as_secs_f64().max(f64::EPSILON);
        // Each run on stderr, for the spread the medians hide.
        eprintln!(
            "idem-bench: {name}: {rate:.0} msg/s, consumer CPU {:.1} µs/msg",
            per(cpu.consumer).as_secs_f64() * 1e6
        );
        Ok(Run {
            rate,
            cpu: Cpu {
                consumer: per(cpu.consumer),
                handler: per(cpu.handler),
                rabbit: per(cpu.rabbit),
                redis: per(cpu.redis),
            },
        })
    }

    /// Declares `name` and publishes `n` messages to it, one key each; returns its `--from`.
    async fn publish(&mut self, broker: Broker, name: &str, n: usize) -> Result<String, String> {
        let payload = |i: usize| format!(r#"{{"order": {i}, "amount": 1250, "currency": "EUR"}}"#);
        let key = |i: usize| Key::new(format!("m-{i}")).map_err(|e| e.to_string());
        match broker {
            Broker::Rabbit => {
                let topology = rabbitmq::Topology::for_queue(name);
                topology
                    .declare(&self.rabbit)
                    .await
                    .map_err(|e| e.to_string())?;
                // Confirms awaited in chunks: all of them at once would hold every message.
                for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
                    let mut confirms = Vec::with_capacity(chunk.len());
                    for &i in chunk {
                        // Persistent, as a queue of orders would be.
                        let props = BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type("application/json".into());
                        let props = rabbitmq::with_idempotency_key(props, &key(i)?, None);
                        let confirm = self
                            .rabbit
                            .basic_publish(
                                "".into(),
                                name.into(),
                                BasicPublishOptions::default(),
                                payload(i).as_bytes(),
                                props,
                            )
                            .await
                            .map_err(|e| e.to_string())?;
                        confirms.push(confirm);
                    }
                    for confirm in confirms {
                        confirm.await.map_err(|e| e.to_string())?;
                    }
                }
                Ok(format!(
                    "{}/{name}",
                    self.args.amqp_url.trim_end_matches('/')
                ))
            }
            Broker::Streams => {
                let topology = redis_streams::Topology::new(name);
                topology
                    .declare(&mut self.redis)
                    .await
                    .map_err(|e| e.to_string())?;
                for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
                    let mut pipe = redis::pipe();
                    for &i in chunk {
                        let fields =
                            redis_streams::fields_with_key(payload(i).as_bytes(), &key(i)?, None);
                        pipe.cmd("XADD").arg(name).arg("*").arg(fields).ignore();
                    }
                    pipe.query_async::<()>(&mut self.redis)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Ok(format!("{}/{name}", self.redis_url.trim_end_matches('/')))
            }
        }
    }

    async fn teardown(&mut self, broker: Broker, name: &str) -> Result<(), String> {
        match broker {
            Broker::Rabbit => rabbitmq::Topology::for_queue(name)
                .delete(&self.rabbit)
                .await
                .map_err(|e| e.to_string()),
            Broker::Streams => redis_streams::Topology::new(name)
                .delete(&mut self.redis)
                .await
                .map_err(|e| e.to_string()),
        }
    }
}

/// A consumer process, stopped when dropped: SIGTERM (`idem consume` settles what is in
/// flight and exits), then SIGKILL if it is still running 10 s later.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The figures of one broker and concurrency: each side's rate and CPU per message, and
/// the ratios to the bare loop.
fn summarise(
    broker: Broker,
    c: usize,
    n: usize,
    runs: &[Vec<Run>; 3],
    pids: (Option<u32>, Option<u32>),
) -> Vec<Figure> {
    let rounds = runs[0].len();
    let mut figures = Vec::new();
    let us = |f: &dyn Fn(&Run) -> Duration, side: usize| {
        let v: Vec<f64> = runs[side]
            .iter()
            .map(|r| f(r).as_secs_f64() * 1e6)
            .collect();
        median(&v)
    };
    let bare: Vec<f64> = runs[0].iter().map(|r| r.rate).collect();
    for side in SIDES {
        let i = side as usize;
        let rates: Vec<f64> = runs[i].iter().map(|r| r.rate).collect();
        let mut cpu = format!(
            "CPU µs/msg: consumer {:.1}, handler {:.1}",
            us(&|r| r.cpu.consumer, i),
            us(&|r| r.cpu.handler, i)
        );
        if pids.0.is_some() && broker == Broker::Rabbit {
            cpu += &format!(", RabbitMQ {:.1}", us(&|r| r.cpu.rabbit, i));
        }
        if pids.1.is_some() && (broker == Broker::Streams || side == Side::Redis) {
            cpu += &format!(", redis-server {:.1}", us(&|r| r.cpu.redis, i));
        }
        figures.push(Figure::new(
            format!("{} C={c}: {}", broker.label(), side.label()),
            median(&rates),
            "msg/s",
            format!("median of {rounds} runs of {n} messages; {cpu}"),
        ));
        if side != Side::Bare {
            let ratios: Vec<f64> = rates.iter().zip(&bare).map(|(r, b)| r / b).collect();
            let store = if side == Side::Memory {
                "memory"
            } else {
                "Redis"
            };
            let figure = Figure::new(
                format!("{} C={c}: {store} / bare", broker.label()),
                median(&ratios),
                "",
                format!(
                    "median of the rounds' ratios (range {:.3}-{:.3})",
                    ratios.iter().copied().fold(f64::INFINITY, f64::min),
                    ratios.iter().copied().fold(0.0, f64::max)
                ),
            );
            figures.push(if side == Side::Memory {
                figure.target(Target::AtLeast(0.7))
            } else {
                figure
            });
        }
    }
    figures
}

/// What the bare loop stores for a message: as `idem consume` does, the handler's status
/// and body.
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    status: u16,
    body: String,
}

/// `--bare-consume BROKER FROM TO`: the bare loop, until SIGTERM. `FROM` is the broker's
/// URL followed by `/<queue or stream>`, as `idem consume --from` takes it (RabbitMQ's with
/// its vhost).
pub async fn bare(spec: &[String], concurrency: usize) -> Result<(), String> {
    let [broker, from, to] = spec else {
        return Err("--bare-consume takes BROKER FROM TO".into());
    };
    let (url, queue) = from
        .rsplit_once('/')
        .ok_or_else(|| format!("{from}: no queue"))?;
    // `idem consume`'s defaults: lease, retention, keys and fingerprints.
    let config = Config::default()
        .with_lease(Duration::from_secs(30))
        .with_retention(Duration::from_secs(86_400));
    let idem = Idem::new(NoStore).with_config(config);
    let scope = Scope::new(queue).map_err(|e| e.to_string())?;
    let consumer = Consumer::new(idem, scope);
    let mut upstream = UpstreamConfig::new(to).map_err(|e| e.to_string())?;
    upstream.timeout = Duration::from_secs(30);
    upstream.host = HostHeader::Upstream;
    let forward = Forward::new(&upstream).map_err(|e| e.to_string())?;
    let handler = move |message: Message, ctx: Context| {
        let forward = forward.clone();
        async move { deliver(forward, message, ctx).await }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    let shutdown = async move {
        term.recv().await;
    };
    match broker.as_str() {
        "rabbitmq" => {
            let conn = Connection::connect(url, ConnectionProperties::default())
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let prefetch = u16::try_from(concurrency.saturating_mul(4).max(16)).unwrap_or(u16::MAX);
            rabbitmq::Worker::new(consumer, rabbitmq::Topology::for_queue(queue))
                .with_prefetch(prefetch)
                .with_concurrency(concurrency)
                .run(&conn, handler, shutdown)
                .await
                .map_err(|e| e.to_string())?;
        }
        "redis-streams" => {
            let client = redis::Client::open(url).map_err(|e| e.to_string())?;
            redis_streams::Worker::new(consumer, redis_streams::Topology::new(queue))
                .with_batch(concurrency.saturating_mul(2))
                .with_concurrency(concurrency)
                .run(&client, handler, shutdown)
                .await
                .map_err(|e| e.to_string())?;
        }
        other => return Err(format!("--bare-consume: no broker {other:?}")),
    }
    Ok(())
}

/// The bare loop's delivery: `idem consume`'s request (method, path, content type,
/// `Idempotency-Key`, `Idempotency-Attempt`, the payload) through the same client, a 2xx
/// answer stored as its status and body.
async fn deliver(
    mut forward: Forward,
    message: Message,
    ctx: Context,
) -> Result<Answer, Failure<String>> {
    let content_type = message
        .text_header("content-type")
        .and_then(|t| HeaderValue::from_str(t).ok())
        .unwrap_or_else(|| HeaderValue::from_static("application/json"));
    let req = Request::builder()
        .method(Method::POST)
        .uri(PATH)
        .header(CONTENT_TYPE, content_type)
        .header("idempotency-key", ctx.key().as_str())
        .header(ATTEMPT, ctx.attempt())
        .body(Full::new(Bytes::copy_from_slice(message.payload())))
        .map_err(|e| Failure::Terminal(e.to_string()))?;
    let response = forward
        .call(req)
        .await
        .map_err(|e| Failure::Retryable(e.to_string()))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    if status.is_success() {
        Ok(Answer {
            status: status.as_u16(),
            body,
        })
    } else if status == StatusCode::UNPROCESSABLE_ENTITY {
        Err(Failure::Terminal(body))
    } else {
        Err(Failure::Retryable(body))
    }
}
