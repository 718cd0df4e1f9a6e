//! `idem consume` as a user runs it: a real process reading a real broker and delivering to
//! a real handler (a Python standard-library service, `tests/handler.py`, that counts its
//! runs per key). Each broker's tests live in a module named after it (`rabbitmq`, `nats`,
//! `redis`), so that `scripts/test rabbitmq` runs them; `scripts/test` provides the URLs
//! (`IDEM_TEST_AMQP_URL`, `IDEM_TEST_NATS_URL`, `IDEM_TEST_REDIS_URL`), and with
//! `IDEM_TEST_REQUIRE_BACKENDS=1` a missing server fails the test. Within a broker, the
//! cases that need no shared store run on the memory store (`memory_store`), and those that
//! need one (a second process taking over from a killed one) on Redis (`shared_store`).
//! Every test has queues or streams and a key prefix of its own.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_testkit::harness::{eventually, unique_name};
use support::{call, client, idem, ms, run, secs, HttpClient, Proc};

/// The Python handler on `port` (0: a free one); its base URL is `Proc::printed`.
fn handler_on(port: u16) -> Proc {
    support::handler_py(port)
}

/// A running `idem consume`, killed (SIGKILL) when dropped; what it wrote is kept.
struct Consume {
    child: Option<Child>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Consume {
    /// `idem consume --from <from> --to <to> <args>`, with the consumer's decisions logged,
    /// once it says it is consuming.
    fn start(from: &str, to: &str, args: &[&str]) -> Consume {
        let mut command = idem(&["consume", "--from", from, "--to", to]);
        command
            .args(args)
            .env("RUST_LOG", "info,idem_consumer=debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("spawn idem consume");
        let keep = |pipe: Box<dyn std::io::Read + Send>| {
            let text = Arc::new(Mutex::new(String::new()));
            let kept = text.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut text = kept.lock().unwrap();
                    text.push_str(&line);
                    text.push('\n');
                }
            });
            text
        };
        let stdout = keep(Box::new(child.stdout.take().unwrap()));
        let stderr = keep(Box::new(child.stderr.take().unwrap()));
        let consume = Consume {
            child: Some(child),
            stdout,
            stderr,
        };
        let mut consume = consume;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !consume.stdout().contains("idem consume: consuming") {
            let exited = consume.child.as_mut().unwrap().try_wait().unwrap();
            if exited.is_some() || Instant::now() > deadline {
                // Give the reader a moment to take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "idem consume did not start ({exited:?}); stderr: {}",
                    consume.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        consume
    }

    fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// How many deliveries the consumer decided to ack (its debug lines).
    fn acked(&self) -> usize {
        self.stderr().matches(" acked key_hash=").count()
    }

    /// Waits until `n` deliveries were decided acked.
    async fn until_acked(&self, n: usize) {
        let acked = || async { (self.acked() >= n).then_some(()) };
        eventually(&format!("{n} acked"), secs(30), ms(50), acked).await;
    }

    /// SIGKILL, as a crash.
    fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGTERM; its exit status and its last line on stdout, within 30 s.
    fn terminate(&mut self) -> (ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        support::signal(child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "no exit 30 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The reader thread may be a moment behind the exit.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.stdout().contains("stopped") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let last = self.stdout().lines().last().unwrap_or_default().to_owned();
        (status, last)
    }
}

impl Drop for Consume {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A broker with a queue or stream of the test's own.
trait Broker: Sized {
    /// Opens the broker, `None` (the test returns) when its URL is not set.
    async fn open() -> Option<Self>;
    /// The `--from` of `idem consume`.
    fn from(&self) -> String;
    /// Publishes `payload` with the key header `key`, confirmed by the broker.
    async fn publish(&self, key: &str, payload: &str);
    /// How many messages reached the dead-letter queue or stream.
    async fn dead_letters(&self) -> u64;
    /// Deletes the queues or streams.
    async fn delete(&self);
}

/// Extra flags for every `idem consume` of the tests: short redelivery, quick retries.
const QUICK: [&str; 8] = [
    "--redelivery",
    "2",
    "--retry-delay",
    "0.1",
    "--max-retry-delay",
    "0.5",
    "--concurrency",
    "4",
];

/// The memory store's flags.
fn memory_store() -> Option<Vec<String>> {
    Some(vec!["--store".into(), "memory".into()])
}

/// Redis at `IDEM_TEST_REDIS_URL` as the store, with a prefix of the test's own.
fn redis_store() -> Option<Vec<String>> {
    let url = idem_testkit::harness::redis_url()?;
    let prefix = format!("{}:", unique_name("idem_consume_"));
    Some(vec!["--store".into(), url, "--prefix".into(), prefix])
}

/// A key no other test uses, starting with `what`.
fn new_key(what: &str) -> String {
    format!("{what}-{}", uuid::Uuid::new_v4().simple())
}

/// What every case runs on: a broker with a queue or stream of its own, the handler, a
/// store's flags, and a client to ask the handler what ran.
struct Case<B> {
    broker: B,
    handler: Proc,
    store: Vec<String>,
    client: HttpClient,
}

impl<B: Broker> Case<B> {
    /// The broker opened and the handler started; `None` (the test returns) when the
    /// broker's URL is not set.
    async fn open(store: Vec<String>) -> Option<Self> {
        let broker = B::open().await?;
        Some(Self {
            broker,
            handler: handler_on(0),
            store,
            client: client(),
        })
    }

    /// `idem consume` from the broker to the handler, on the store, with `extra` flags.
    fn consume(&self, extra: &[&str]) -> Consume {
        self.consume_to(&self.handler.printed, extra)
    }

    /// `idem consume` from the broker to `to`, on the store, with `extra` flags.
    fn consume_to(&self, to: &str, extra: &[&str]) -> Consume {
        let mut args: Vec<&str> = self.store.iter().map(String::as_str).collect();
        args.extend_from_slice(&QUICK);
        args.extend_from_slice(extra);
        Consume::start(&self.broker.from(), to, &args)
    }

    /// [`support::runs`] of `key` in the handler.
    async fn runs(&self, key: &str) -> (u64, Vec<String>, serde_json::Value) {
        support::runs(&self.client, &self.handler.printed, key).await
    }

    /// The attempts `key` ran with, asserted to be `want` ("1", "2", ...).
    async fn assert_attempts(&self, key: &str, want: &[&str]) {
        let (count, attempts, _) = self.runs(key).await;
        assert_eq!(
            (count, attempts),
            (
                want.len() as u64,
                want.iter().map(|a| (*a).to_owned()).collect()
            ),
            "{key}"
        );
    }

    /// Waits until `key` ran at least `n` times.
    async fn until_ran(&self, key: &str, n: u64) {
        let ran = || async { (self.runs(key).await.0 >= n).then_some(()) };
        eventually(&format!("run {n} of {key}"), secs(20), ms(20), ran).await;
    }

    /// The runs per key of every key the handler saw.
    async fn counts(&self) -> serde_json::Value {
        let url = format!("{}/counts", self.handler.printed);
        call(&self.client, "GET", &url, &[], "").await.json()
    }

    /// Waits up to `patience` until one message reached the dead letters.
    async fn until_dead_lettered(&self, patience: Duration) {
        let dead = || async { (self.broker.dead_letters().await == 1).then_some(()) };
        eventually("the dead letter", patience, ms(100), dead).await;
    }
}

/// One message published 5 times: the handler runs once, and every copy is acked; the
/// handler gets the payload, its content type, the key and the attempt.
async fn a_message_published_five_times_runs_once<B: Broker>(case: &Case<B>) {
    let mut consume = case.consume(&[]);
    let key = new_key("dup");
    for _ in 0..5 {
        case.broker.publish(&key, r#"{"delay_ms": 300}"#).await;
    }
    consume.until_acked(5).await;
    let (status, last) = consume.terminate();
    assert!(status.success(), "{status:?}: {}", consume.stderr());
    assert!(last.contains("5 acked"), "{last}");
    case.assert_attempts(&key, &["1"]).await;
    let headers = case.runs(&key).await.2;
    assert_eq!(headers["idempotency-key"], key.as_str());
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers[":path"], "/");
    assert_eq!(case.broker.dead_letters().await, 0);
}

/// The handler answers 422: dead-lettered at once, never run again.
async fn a_terminal_answer_is_dead_lettered_at_once<B: Broker>(case: &Case<B>) {
    let _consume = case.consume(&[]);
    let key = new_key("bad");
    case.broker.publish(&key, r#"{"status": 422}"#).await;
    case.until_dead_lettered(secs(20)).await;
    tokio::time::sleep(ms(700)).await;
    case.assert_attempts(&key, &["1"]).await;
}

/// The handler answers 500 every time: retried with backoff up to `--max-attempts`, then
/// dead-lettered.
async fn a_failing_handler_is_retried_then_dead_lettered<B: Broker>(case: &Case<B>) {
    let _consume = case.consume(&["--max-attempts", "3"]);
    let key = new_key("fail");
    case.broker.publish(&key, r#"{"status": 500}"#).await;
    case.until_dead_lettered(secs(30)).await;
    tokio::time::sleep(ms(700)).await;
    case.assert_attempts(&key, &["1", "2", "3"]).await;
}

/// The handler is down (connections refused) when the message comes, then up: the message
/// is not lost, and runs once.
async fn a_handler_down_then_up_loses_nothing<B: Broker>(case: &Case<B>) {
    let port = idem_testkit::harness::free_port();
    let to = format!("http://127.0.0.1:{port}");
    let consume = case.consume_to(&to, &["--max-attempts", "100"]);
    let key = new_key("down");
    case.broker.publish(&key, "{}").await;
    let refused = || async { consume.stderr().contains("did not answer").then_some(()) };
    eventually("a refused delivery", secs(20), ms(50), refused).await;
    let handler = handler_on(port);
    consume.until_acked(1).await;
    let (count, attempts, _) = support::runs(&case.client, &handler.printed, &key).await;
    assert_eq!(count, 1, "{attempts:?}");
    assert_eq!(case.broker.dead_letters().await, 0);
}

/// A call that times out may still be running in the handler: the key stays held for one
/// more lease (a copy arriving meanwhile waits), then the message is retried and runs again,
/// once.
async fn a_timed_out_call_holds_its_key_for_a_lease<B: Broker>(case: &Case<B>) {
    let consume = case.consume(&["--timeout", "0.5", "--lease", "2"]);
    let key = new_key("slow");
    case.broker
        .publish(&key, r#"{"delay_first_ms": 1500}"#)
        .await;
    case.until_ran(&key, 1).await;
    let first = Instant::now();
    case.broker
        .publish(&key, r#"{"delay_first_ms": 1500}"#)
        .await;
    case.until_ran(&key, 2).await;
    let held = first.elapsed();
    assert!(
        held >= secs(2),
        "run again after {held:?}, within the lease"
    );
    consume.until_acked(2).await;
    tokio::time::sleep(ms(500)).await;
    assert_eq!(case.runs(&key).await.0, 2);
    assert_eq!(case.broker.dead_letters().await, 0);
}

/// A handler that works three times longer than the lease keeps its key: the lease (and the
/// broker's redelivery clock) are renewed while it runs, so a copy published meanwhile waits
/// and is acked with the stored answer, and the handler runs once.
async fn a_slow_handler_keeps_its_lease<B: Broker>(case: &Case<B>) {
    let consume = case.consume(&["--lease", "1"]);
    let key = new_key("long");
    case.broker.publish(&key, r#"{"delay_ms": 3000}"#).await;
    case.until_ran(&key, 1).await;
    case.broker.publish(&key, r#"{"delay_ms": 3000}"#).await;
    consume.until_acked(2).await;
    case.assert_attempts(&key, &["1"]).await;
}

/// With `--key payload --key-fields /order`: a message without the field is dead-lettered
/// with the reason, and the handler never sees it; one with it runs.
async fn a_message_without_its_key_fields_is_dead_lettered<B: Broker>(case: &Case<B>) {
    let consume = case.consume(&["--key", "payload", "--key-fields", "/order"]);
    case.broker.publish("ignored-1", r#"{"amount": 5}"#).await;
    case.until_dead_lettered(secs(20)).await;
    assert!(
        consume
            .stderr()
            .contains(r#"the payload has no field "/order" to take its idempotency key from"#),
        "{}",
        consume.stderr()
    );
    case.broker
        .publish("ignored-2", r#"{"order": 7, "amount": 5}"#)
        .await;
    consume.until_acked(1).await;
    let counts = case.counts().await;
    let counts = counts.as_object().unwrap();
    assert_eq!(counts.len(), 1, "{counts:?}");
    assert!(
        counts.keys().all(|key| key.starts_with("msg-")),
        "{counts:?}"
    );
}

/// 200 messages, 40 of them duplicates of others, across two `idem consume` processes on
/// one store: every key runs exactly once, and every message is acked by one of them.
async fn two_processes_run_each_key_once<B: Broker>(case: &Case<B>) {
    let (mut a, mut b) = (case.consume(&[]), case.consume(&[]));
    let run = uuid::Uuid::new_v4().simple().to_string();
    let keys: Vec<String> = (0..160).map(|i| format!("many-{run}-{i}")).collect();
    for i in 0..200 {
        // Every fourth of the first 160 is published a second time, right after itself.
        let key = &keys[if i < 160 { i } else { (i - 160) * 4 }];
        case.broker.publish(key, r#"{"delay_ms": 20}"#).await;
    }
    let all = || async { (a.acked() + b.acked() >= 200).then_some(()) };
    eventually("200 acked", secs(60), ms(100), all).await;
    let (_, last_a) = a.terminate();
    let (_, last_b) = b.terminate();
    assert_eq!(
        summary(&last_a)[0] + summary(&last_b)[0],
        200,
        "{last_a}\n{last_b}"
    );
    let counts = case.counts().await;
    for key in &keys {
        assert_eq!(counts[key], 1, "{key}: {counts}");
    }
    assert_eq!(counts.as_object().unwrap().len(), 160);
}

/// `kill -9` of `idem consume` while the handler works on a message: the broker delivers it
/// again to a second process on the same store, which waits for the dead one's lease (2 s)
/// to end, then runs it once, as attempt 2.
async fn a_killed_consumer_leaves_its_message_to_the_lease<B: Broker>(case: &Case<B>) {
    let mut first = case.consume(&["--lease", "2"]);
    let key = new_key("crash");
    case.broker.publish(&key, r#"{"delay_ms": 3000}"#).await;
    case.until_ran(&key, 1).await;
    first.kill();
    let second = case.consume(&["--lease", "2"]);
    second.until_acked(1).await;
    case.assert_attempts(&key, &["1", "2"]).await;
    assert_eq!(case.broker.dead_letters().await, 0);
}

/// The numbers of `idem consume`'s last line: acked, requeued, retried, dead-lettered,
/// unsettled.
fn summary(last: &str) -> [u64; 5] {
    let numbers: Vec<u64> = last
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    numbers
        .try_into()
        .unwrap_or_else(|n| panic!("not a summary: {last:?} ({n:?})"))
}

/// SIGTERM while handlers work: the process stops taking messages, lets the calls in flight
/// finish, settles them and exits 0, with nothing unsettled; a second process on the same
/// store takes the rest. Every message runs once, and every one is acked by one of the two.
async fn sigterm_under_load_settles_what_ran_and_loses_nothing<B: Broker>(case: &Case<B>) {
    let mut first = case.consume(&[]);
    let keys: Vec<String> = (0..12).map(|i| new_key(&format!("load-{i}"))).collect();
    for key in &keys {
        case.broker.publish(key, r#"{"delay_ms": 400}"#).await;
    }
    first.until_acked(2).await;
    let (status, last) = first.terminate();
    assert!(status.success(), "{status:?}: {}", first.stderr());
    let [acked, _, _, dead, unsettled] = summary(&last);
    assert_eq!((dead, unsettled), (0, 0), "{last}");
    let left = keys.len() - usize::try_from(acked).unwrap();
    let mut second = case.consume(&[]);
    second.until_acked(left).await;
    let (status, last) = second.terminate();
    assert!(status.success(), "{status:?}");
    assert_eq!(summary(&last)[0], left as u64, "{last}");
    for key in &keys {
        case.assert_attempts(key, &["1"]).await;
    }
}

/// `--admin-listen`: `/livez`, `/readyz` (broker and store reachable) and `/metrics` with
/// the handler's answers by class and its latency.
async fn the_admin_endpoints_answer<B: Broker>(case: &Case<B>) {
    let admin = format!("127.0.0.1:{}", idem_testkit::harness::free_port());
    let consume = case.consume(&["--admin-listen", &admin]);
    let get = |path: &str| {
        let (client, url) = (case.client.clone(), format!("http://{admin}{path}"));
        async move { call(&client, "GET", &url, &[], "").await }
    };
    assert_eq!(get("/livez").await.status, 200);
    let ready = get("/readyz").await;
    assert_eq!(
        (ready.status.as_u16(), &ready.body[..]),
        (200, &b"ready\n"[..])
    );
    case.broker.publish("admin-1", "{}").await;
    consume.until_acked(1).await;
    let metrics = String::from_utf8(get("/metrics").await.body.to_vec()).unwrap();
    assert!(
        metrics.contains("idem_consume_answers_total{class=\"2xx\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("idem_consume_handler_duration_seconds_count 1"),
        "{metrics}"
    );
}

/// Each case a `#[tokio::test]` of the broker `$broker` on the store `$store` gives (the
/// test returns when it gives none, or the broker's URL is not set); the queues or streams
/// are deleted after a case that passed.
macro_rules! cases {
    ($broker:ty, $store:path: $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(store) = $store() else { return };
                let Some(case) = crate::Case::<$broker>::open(store).await else {
                    return;
                };
                crate::$case(&case).await;
                crate::Broker::delete(&case.broker).await;
            }
        )+
    };
}

/// The cases of a broker: on the memory store those that need no shared store, on Redis
/// those with a second process taking over from the first.
macro_rules! consume_suite {
    ($broker:ty) => {
        mod memory_store {
            use super::*;

            cases!(
                $broker,
                crate::memory_store: a_message_published_five_times_runs_once,
                a_terminal_answer_is_dead_lettered_at_once,
                a_failing_handler_is_retried_then_dead_lettered,
                a_handler_down_then_up_loses_nothing,
                a_timed_out_call_holds_its_key_for_a_lease,
                a_slow_handler_keeps_its_lease,
                a_message_without_its_key_fields_is_dead_lettered,
                the_admin_endpoints_answer,
            );
        }

        mod shared_store {
            use super::*;

            cases!(
                $broker,
                crate::redis_store: a_message_published_five_times_runs_once,
                a_killed_consumer_leaves_its_message_to_the_lease,
                two_processes_run_each_key_once,
                sigterm_under_load_settles_what_ran_and_loses_nothing,
            );
        }
    };
}

#[test]
fn a_malformed_from_names_the_broker_and_its_form() {
    for (from, broker, form) in [
        ("amqp://guest:guest@127.0.0.1:5672", "RabbitMQ", "/QUEUE"),
        (
            "nats://127.0.0.1:4222/ORDERS",
            "NATS JetStream",
            "/STREAM/SUBJECT",
        ),
        ("redis://127.0.0.1:6379/x/y/z", "Redis Streams", "/STREAM"),
        ("kafka://127.0.0.1:9092/orders", "amqp://", "nats://"),
    ] {
        let (code, _, err) = run(&["consume", "--from", from, "--to", "http://127.0.0.1:1"]);
        assert_eq!(code, 2, "{from}: {err}");
        assert!(err.contains(broker) && err.contains(form), "{from}: {err}");
    }
}

/// A broker out of reach at start: exit 3, naming the broker and where, without the
/// password.
#[test]
fn an_unreachable_broker_is_named() {
    let port = idem_testkit::harness::refused_port();
    for (from, broker) in [
        (
            format!("amqp://guest:secret@127.0.0.1:{port}/%2f/q"),
            "RabbitMQ",
        ),
        (format!("nats://127.0.0.1:{port}/S/s"), "NATS"),
        (format!("redis://:secret@127.0.0.1:{port}/s"), "Redis"),
    ] {
        let (code, _, err) = run(&["consume", "--from", &from, "--to", "http://127.0.0.1:1"]);
        assert_eq!(code, 3, "{from}: {err}");
        assert!(err.contains(&format!("cannot reach {broker} at")), "{err}");
        assert!(
            err.contains(&port.to_string()) && !err.contains("secret"),
            "{err}"
        );
    }
}

/// `--config`: a TOML file of settings, flags over it, checked by `--check-config`
/// without a broker; a wrong field is refused with the file, its line and the field.
#[test]
fn a_config_file_is_checked_and_flags_override_it() {
    let dir = std::env::temp_dir().join(unique_name("idem_consume_"));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("consume.toml");
    std::fs::write(
        &good,
        "from = \"amqp://guest:guest@127.0.0.1:5672/%2f/orders\"\n\
         to = \"http://127.0.0.1:3000\"\n\
         concurrency = 8\n\
         lease_secs = 10\n\
         path = \"/orders/{key}\"\n\
         terminal_status = [400, 422]\n",
    )
    .unwrap();
    let config = good.to_str().unwrap();
    let check = ["consume", "--config", config, "--check-config"];
    let (code, out, err) = run(&[&check[..], &["--concurrency", "2"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("config OK"), "{out}");
    assert!(out.contains("RabbitMQ queue \"orders\""), "{out}");
    assert!(!out.contains("guest:guest"), "{out}");
    assert!(
        out.contains("to POST http://127.0.0.1:3000/orders/{key}"),
        "{out}"
    );
    assert!(
        out.contains("lease 10s") && out.contains("concurrency 2"),
        "{out}"
    );
    assert!(out.contains("terminal statuses 400,422"), "{out}");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "to = \"http://127.0.0.1:3000\"\nretries = 3\n").unwrap();
    let (code, _, err) = run(&[
        "consume",
        "--config",
        bad.to_str().unwrap(),
        "--check-config",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("bad.toml") && err.contains("line 2") && err.contains("`retries`"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// RabbitMQ at `IDEM_TEST_AMQP_URL`.
mod rabbitmq {
    use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

    pub struct Rabbit {
        url: String,
        queue: String,
        _conn: Connection,
        channel: Channel,
    }

    impl crate::Broker for Rabbit {
        async fn open() -> Option<Self> {
            let url = idem_testkit::harness::url_from_env("IDEM_TEST_AMQP_URL", "RabbitMQ")?;
            let conn = Connection::connect(&url, ConnectionProperties::default())
                .await
                .expect("connect to RabbitMQ");
            let channel = conn.create_channel().await.expect("channel");
            let confirm = channel.confirm_select(ConfirmSelectOptions::default());
            confirm.await.expect("confirm_select");
            Some(Self {
                url: url.trim_end_matches('/').to_owned(),
                queue: crate::unique_name("idem-consume-"),
                _conn: conn,
                channel,
            })
        }

        fn from(&self) -> String {
            format!("{}/{}", self.url, self.queue)
        }

        async fn publish(&self, key: &str, payload: &str) {
            let mut headers = FieldTable::default();
            headers.insert(
                "x-idempotency-key".into(),
                AMQPValue::LongString(key.into()),
            );
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_headers(headers);
            let topology = idem_consumer::rabbitmq::Topology::for_queue(self.queue.clone());
            let published = topology.publish(&self.channel, payload.as_bytes(), props);
            published.await.expect("the broker confirms a test message");
        }

        async fn dead_letters(&self) -> u64 {
            let dead = format!("{}.dead", self.queue);
            let declared = self
                .channel
                .queue_declare(
                    dead.as_str().into(),
                    QueueDeclareOptions::default().passive(),
                    FieldTable::default(),
                )
                .await
                .expect("passive declare");
            declared.message_count().into()
        }

        async fn delete(&self) {
            let topology = idem_consumer::rabbitmq::Topology::for_queue(self.queue.clone());
            topology.delete(&self.channel).await.expect("delete queues");
        }
    }

    consume_suite!(Rabbit);
}

/// NATS JetStream at `IDEM_TEST_NATS_URL`.
mod nats {
    use async_nats::jetstream::{self, Context as JetStream};
    use async_nats::HeaderMap;

    pub struct Nats {
        url: String,
        js: JetStream,
        stream: String,
        subject: String,
    }

    impl crate::Broker for Nats {
        async fn open() -> Option<Self> {
            let url = idem_testkit::harness::nats_url()?;
            let client = async_nats::connect(url.as_str())
                .await
                .expect("connect to NATS");
            let name = crate::unique_name("IDEMC_");
            Some(Self {
                url: url.trim_end_matches('/').to_owned(),
                js: jetstream::new(client),
                subject: format!("idemc.{}", name.to_lowercase()),
                stream: name,
            })
        }

        fn from(&self) -> String {
            format!("{}/{}/{}", self.url, self.stream, self.subject)
        }

        async fn publish(&self, key: &str, payload: &str) {
            let mut headers = HeaderMap::new();
            headers.insert("x-idempotency-key", key);
            headers.insert("content-type", "application/json");
            self.js
                .publish_with_headers(self.subject.clone(), headers, payload.to_owned().into())
                .await
                .expect("publish")
                .await
                .expect("the stream confirms");
        }

        async fn dead_letters(&self) -> u64 {
            let mut stream = self
                .js
                .get_stream(format!("{}-dead", self.stream))
                .await
                .expect("the dead-letter stream");
            stream.info().await.expect("stream info").state.messages
        }

        async fn delete(&self) {
            let topology =
                idem_consumer::nats::Topology::new(self.stream.clone(), self.subject.clone());
            topology.delete(&self.js).await.expect("delete streams");
        }
    }

    consume_suite!(Nats);
}

/// Redis Streams at `IDEM_TEST_REDIS_URL`.
mod redis {
    use ::redis::aio::ConnectionManager;

    pub struct Streams {
        url: String,
        conn: ConnectionManager,
        stream: String,
    }

    impl crate::Broker for Streams {
        async fn open() -> Option<Self> {
            let url = idem_testkit::harness::redis_url()?;
            let client = ::redis::Client::open(url.as_str()).expect("a Redis URL");
            let conn = client
                .get_connection_manager()
                .await
                .expect("connect to Redis");
            Some(Self {
                url: url.trim_end_matches('/').to_owned(),
                conn,
                stream: crate::unique_name("idem-consume-"),
            })
        }

        fn from(&self) -> String {
            format!("{}/{}", self.url, self.stream)
        }

        async fn publish(&self, key: &str, payload: &str) {
            ::redis::cmd("XADD")
                .arg(&self.stream)
                .arg("*")
                .arg("payload")
                .arg(payload)
                .arg("x-idempotency-key")
                .arg(key)
                .arg("content-type")
                .arg("application/json")
                .query_async::<String>(&mut self.conn.clone())
                .await
                .expect("XADD");
        }

        async fn dead_letters(&self) -> u64 {
            ::redis::cmd("XLEN")
                .arg(format!("{}.dead", self.stream))
                .query_async(&mut self.conn.clone())
                .await
                .expect("XLEN")
        }

        async fn delete(&self) {
            let topology = idem_consumer::redis_streams::Topology::new(self.stream.clone());
            topology
                .delete(&mut self.conn.clone())
                .await
                .expect("delete streams");
        }
    }

    consume_suite!(Streams);
}
