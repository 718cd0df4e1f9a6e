//! The JetStream worker against a real `nats-server -js` (`IDEM_TEST_NATS_URL`, e.g.
//! `nats://127.0.0.1:4222`). Without it each test prints why and returns, or fails when
//! `IDEM_TEST_REQUIRE_BACKENDS=1`.
//!
//! Every test creates its own uniquely named streams and deletes them at the end. The
//! crash test runs worker *processes* (this test binary again, running the ignored test
//! `child_worker_process`), sharing their store in Redis (`IDEM_TEST_REDIS_URL`); the
//! store-outage test stops a Redis server of its own.

#![cfg(feature = "nats")]

mod support;

/// Named after the backend, so that `cargo test nats` runs these.
mod nats {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_nats::jetstream::{self, Context as JetStream};
    use async_nats::HeaderMap;
    use idem_consumer::nats::{with_idempotency_key, Error, Topology, Worker};
    use idem_consumer::{
        Consumer, Context, Message, Policy, Summary, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER,
        IDEMPOTENCY_KEY_HEADER,
    };
    use idem_core::{Config, Failure, Idem, Key, MemoryStore, Scope, Store};
    use idem_redis::RedisStore;
    use tokio::sync::oneshot;
    use tokio::time::{sleep, timeout};

    use crate::support::{
        append, child_env, spawn_child, stop_child, wait_until, ChildFiles, SharedStore, CHILD_ENV,
    };

    async fn connect(url: &str) -> JetStream {
        jetstream::new(async_nats::connect(url).await.expect("connect to NATS"))
    }

    /// The server's URL, a JetStream context on it, and fresh streams named after the test
    /// (with `ack_wait`), declared. `None` when no server is configured.
    async fn broker(test: &str, ack_wait: Duration) -> Option<(String, JetStream, Topology)> {
        let url = idem_testkit::harness::nats_url()?;
        let js = connect(&url).await;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let topology = Topology::new(
            format!("IDEM-TEST-{test}-{}", &id[..12]),
            format!("idem-test.{test}.{}", &id[..12]),
        )
        .with_ack_wait(ack_wait);
        topology.declare(&js).await.expect("declare");
        Some((url, js, topology))
    }

    /// Publishes `payload` with `key` propagated in its headers, and waits for the stream's
    /// ack.
    async fn publish(js: &JetStream, subject: &str, key: &str, payload: &str) {
        let headers = with_idempotency_key(
            HeaderMap::new(),
            &Key::new(key).expect("test keys are valid"),
            None,
        );
        js.publish_with_headers(subject.to_owned(), headers, payload.to_owned().into())
            .await
            .expect("publish")
            .await
            .expect("the stream stores it");
    }

    /// Messages in `stream`.
    async fn messages_in(js: &JetStream, stream: &str) -> u64 {
        let mut stream = js.get_stream(stream).await.expect("the stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// The consumer's messages not yet delivered, delivered but not acked, and the stream
    /// sequence up to which all are acked.
    async fn consumer_state(js: &JetStream, topology: &Topology) -> (u64, usize, u64) {
        let stream = js.get_stream(&topology.stream).await.expect("the stream");
        let info = stream
            .consumer_info(&topology.consumer)
            .await
            .expect("consumer info");
        (
            info.num_pending,
            info.num_ack_pending,
            info.ack_floor.stream_sequence,
        )
    }

    /// Waits until the consumer has had nothing pending or unacked for 500 ms.
    async fn wait_until_settled(js: &JetStream, topology: &Topology, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        let mut settled_since: Option<tokio::time::Instant> = None;
        loop {
            let (pending, unacked, _) = consumer_state(js, topology).await;
            if pending > 0 || unacked > 0 {
                settled_since = None;
            } else if settled_since
                .get_or_insert_with(tokio::time::Instant::now)
                .elapsed()
                >= Duration::from_millis(500)
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the messages were not all acked"
            );
            sleep(Duration::from_millis(50)).await;
        }
    }

    type Handler = Arc<
        dyn Fn(
                Message,
                Context,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<u32, Failure<String>>> + Send>,
            > + Send
            + Sync,
    >;

    /// Runs `worker` in a task until the returned sender is used (or dropped).
    fn spawn_worker(
        worker: Worker,
        js: JetStream,
        handler: Handler,
    ) -> (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<Summary, Error>>,
    ) {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            worker
                .run(&js, move |m, c| handler(m, c), async {
                    let _ = stopped.await;
                })
                .await
        });
        (stop, task)
    }

    type Effects = Arc<Mutex<BTreeMap<String, u32>>>;

    /// A handler that counts its side effect per key after `work`.
    fn counting(effects: &Effects, work: Duration) -> Handler {
        let effects = effects.clone();
        Arc::new(move |_message, ctx| {
            let effects = effects.clone();
            Box::pin(async move {
                sleep(work).await;
                *effects
                    .lock()
                    .unwrap()
                    .entry(ctx.key().to_string())
                    .or_insert(0) += 1;
                Ok(ctx.attempt())
            })
        })
    }

    /// Each message published 5 times and consumed by 4 concurrent workers (on their own
    /// connections, sharing a store): one side effect per message, every copy acked, nothing
    /// dead-lettered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_copies_to_four_workers_have_one_effect() {
        let Some((url, js, topology)) = broker("copies", Duration::from_secs(5)).await else {
            return;
        };
        const N: u32 = 20;
        for _copy in 0..5 {
            for i in 0..N {
                let payload = format!(r#"{{"order": {i}}}"#);
                publish(&js, &topology.subject, &format!("order-{i}"), &payload).await;
            }
        }
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let consumer = Consumer::new(Idem::from_arc(store), Scope::new("copies-test").unwrap())
            .with_policy(Policy::default().with_max_in_flight_delay(Duration::from_millis(100)));
        let effects: Effects = Arc::default();
        let mut workers = Vec::new();
        for _ in 0..4 {
            let js = connect(&url).await;
            workers.push(spawn_worker(
                Worker::new(consumer.clone(), topology.clone()).with_concurrency(3),
                js,
                counting(&effects, Duration::from_millis(20)),
            ));
        }
        wait_until(
            Duration::from_secs(60),
            "every order has its effect",
            || {
                let effects = effects.clone();
                async move { effects.lock().unwrap().len() == N as usize }
            },
        )
        .await;
        wait_until_settled(&js, &topology, Duration::from_secs(60)).await;
        let mut acked = 0;
        for (stop, task) in workers {
            let _ = stop.send(());
            let summary = timeout(Duration::from_secs(30), task)
                .await
                .expect("clean shutdown")
                .expect("no panic")
                .expect("the worker ran");
            assert_eq!(summary.dead_lettered + summary.retried, 0, "{summary:?}");
            acked += summary.acked;
        }
        for (key, count) in effects.lock().unwrap().iter() {
            assert_eq!(*count, 1, "{key} had its effect {count} times");
        }
        assert_eq!(acked, u64::from(5 * N), "every copy was acked");
        let (pending, unacked, floor) = consumer_state(&js, &topology).await;
        assert_eq!((pending, unacked, floor), (0, 0, u64::from(5 * N)));
        assert_eq!(messages_in(&js, &topology.dead_letter_stream).await, 0);
        topology.delete(&js).await.expect("delete the streams");
    }

    /// A handler that fails transiently succeeds in the end, once; one that always fails is
    /// dead-lettered after the policy's attempts, and one that fails for good at once. The
    /// retry copies and dead letters are counted on the broker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transient_failures_retry_and_permanent_ones_are_dead_lettered() {
        let Some((url, js, topology)) = broker("retries", Duration::from_secs(5)).await else {
            return;
        };
        let flaky: Vec<String> = (0..5).map(|i| format!("flaky-{i}")).collect();
        let broken: Vec<String> = (0..3).map(|i| format!("broken-{i}")).collect();
        for key in flaky.iter().chain(&broken) {
            publish(&js, &topology.subject, key, "{}").await;
        }
        publish(&js, &topology.subject, "declined", "{}").await;

        let policy = Policy::default()
            .with_max_attempts(3)
            .with_retry_delay(Duration::from_millis(200))
            .with_max_retry_delay(Duration::from_millis(400));
        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("retry-test").unwrap(),
        )
        .with_policy(policy);
        // Each key's attempts, and when they started.
        type Runs = Arc<Mutex<BTreeMap<String, Vec<(u32, std::time::Instant)>>>>;
        let runs: Runs = Arc::default();
        let effects: Effects = Arc::default();
        let handler: Handler = {
            let (runs, effects) = (runs.clone(), effects.clone());
            Arc::new(move |_message, ctx| {
                let (runs, effects) = (runs.clone(), effects.clone());
                Box::pin(async move {
                    let key = ctx.key().to_string();
                    runs.lock()
                        .unwrap()
                        .entry(key.clone())
                        .or_default()
                        .push((ctx.attempt(), std::time::Instant::now()));
                    if key == "declined" {
                        return Err(Failure::Terminal("card declined".to_string()));
                    }
                    if key.starts_with("broken") || ctx.attempt() < 3 {
                        return Err(Failure::Retryable(format!(
                            "gateway timeout on attempt {}",
                            ctx.attempt()
                        )));
                    }
                    *effects.lock().unwrap().entry(key).or_insert(0) += 1;
                    Ok(ctx.attempt())
                })
            })
        };
        let (stop, task) = spawn_worker(
            Worker::new(consumer, topology.clone()).with_concurrency(2),
            connect(&url).await,
            handler,
        );
        wait_until(Duration::from_secs(60), "4 dead letters", || async {
            messages_in(&js, &topology.dead_letter_stream).await == 4
        })
        .await;
        wait_until(Duration::from_secs(60), "the flaky ones succeed", || {
            let effects = effects.clone();
            async move { effects.lock().unwrap().len() == 5 }
        })
        .await;
        wait_until_settled(&js, &topology, Duration::from_secs(30)).await;
        let _ = stop.send(());
        let summary = task.await.expect("no panic").expect("the worker ran");

        let runs = runs.lock().unwrap().clone();
        let attempts = |key: &str| runs[key].iter().map(|(a, _)| *a).collect::<Vec<_>>();
        for key in flaky.iter().chain(&broken) {
            assert_eq!(attempts(key), vec![1, 2, 3], "{key}");
            // The backoff: 200 ms before the second attempt, 400 ms before the third.
            let at: Vec<_> = runs[key].iter().map(|(_, t)| *t).collect();
            assert!(at[1] - at[0] >= Duration::from_millis(190), "{key}: {at:?}");
            assert!(at[2] - at[1] >= Duration::from_millis(390), "{key}: {at:?}");
        }
        for key in &flaky {
            assert_eq!(effects.lock().unwrap()[key], 1, "{key}");
        }
        assert_eq!(
            attempts("declined"),
            vec![1],
            "a terminal failure is not retried"
        );
        assert_eq!(summary.retried, 5 * 2 + 3 * 2, "{summary:?}");
        assert_eq!(summary.dead_lettered, 4, "{summary:?}");
        assert_eq!(summary.acked, 5, "{summary:?}");
        // On the broker: the 9 originals and 16 retry copies, all acked; 4 dead letters.
        assert_eq!(messages_in(&js, &topology.stream).await, 9 + 16);
        assert_eq!(consumer_state(&js, &topology).await, (0, 0, 9 + 16));

        // Each dead letter says why, and how many attempts it had.
        let dead_stream = js
            .get_stream(&topology.dead_letter_stream)
            .await
            .expect("the dead-letter stream");
        let mut dead = BTreeMap::new();
        for seq in 1..=4 {
            let letter = dead_stream.get_raw_message(seq).await.expect("dead letter");
            assert_eq!(
                letter.subject.as_str(),
                Topology::dead_letter_subject(&topology.subject)
            );
            let header = |name: &str| {
                letter
                    .headers
                    .get(name)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_else(|| panic!("dead letter without {name}"))
            };
            dead.insert(
                header(IDEMPOTENCY_KEY_HEADER),
                (header(DEAD_LETTER_REASON_HEADER), header(ATTEMPT_HEADER)),
            );
        }
        for key in &broken {
            let (reason, attempt) = &dead[key];
            assert!(reason.starts_with("attempts exhausted"), "{reason}");
            assert_eq!(attempt, "3");
        }
        assert_eq!(dead["declined"].0, "terminal failure: card declined");
        topology.delete(&js).await.expect("delete the streams");
    }

    /// With the store down, the worker runs no handler and acks nothing: every message stays
    /// on the broker (NAKed for later). When the store is back, each is processed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_outage_acks_nothing_and_loses_nothing() {
        let Some((url, js, topology)) = broker("outage", Duration::from_secs(5)).await else {
            return;
        };
        let Some(mut redis) = idem_testkit::redis::throwaway(&[]) else {
            return;
        };
        const N: u32 = 8;
        for i in 0..N {
            publish(&js, &topology.subject, &format!("job-{i}"), "{}").await;
        }
        let store = RedisStore::builder(redis.url())
            .connect_lazy()
            .expect("a Redis store");
        redis.stop();
        let consumer = Consumer::new(Idem::new(store), Scope::new("outage-test").unwrap())
            .with_policy(Policy::default().with_unavailable_delay(Duration::from_millis(200)));
        let effects: Effects = Arc::default();
        let (stop, task) = spawn_worker(
            Worker::new(consumer, topology.clone()),
            connect(&url).await,
            counting(&effects, Duration::ZERO),
        );
        sleep(Duration::from_secs(3)).await;
        assert!(
            effects.lock().unwrap().is_empty(),
            "no handler ran unguarded"
        );
        let (pending, unacked, floor) = consumer_state(&js, &topology).await;
        assert_eq!(floor, 0, "nothing was acked");
        assert_eq!(
            pending + unacked as u64,
            u64::from(N),
            "every message is still there"
        );

        redis.start_again().expect("the store is back");
        wait_until(Duration::from_secs(60), "every job has its effect", || {
            let effects = effects.clone();
            async move { effects.lock().unwrap().len() == N as usize }
        })
        .await;
        wait_until_settled(&js, &topology, Duration::from_secs(30)).await;
        let _ = stop.send(());
        let summary = task.await.expect("no panic").expect("the worker ran");
        for (key, count) in effects.lock().unwrap().iter() {
            assert_eq!(*count, 1, "{key} had its effect {count} times");
        }
        assert!(summary.requeued >= u64::from(N), "{summary:?}");
        assert_eq!(summary.acked, u64::from(N), "{summary:?}");
        topology.delete(&js).await.expect("delete the streams");
    }

    /// A handler that runs for several ack_waits keeps its message: the worker's "work in
    /// progress" acks stop JetStream from delivering it again to the other worker waiting
    /// for messages (which would NAK it, the key being held).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_handler_keeps_its_message() {
        let ack_wait = Duration::from_secs(1);
        let Some((url, js, topology)) = broker("long", ack_wait).await else {
            return;
        };
        publish(&js, &topology.subject, "slow-1", "{}").await;
        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("long-test").unwrap(),
        );
        let effects: Effects = Arc::default();
        let mut workers = Vec::new();
        for _ in 0..2 {
            workers.push(spawn_worker(
                Worker::new(consumer.clone(), topology.clone()).with_batch(1),
                connect(&url).await,
                counting(&effects, ack_wait * 4),
            ));
        }
        wait_until(Duration::from_secs(30), "the handler finishes", || {
            let effects = effects.clone();
            async move { !effects.lock().unwrap().is_empty() }
        })
        .await;
        wait_until_settled(&js, &topology, Duration::from_secs(30)).await;
        let mut total = Summary::default();
        for (stop, task) in workers {
            let _ = stop.send(());
            let summary = task.await.expect("no panic").expect("the worker ran");
            total.acked += summary.acked;
            total.requeued += summary.requeued;
        }
        assert_eq!((total.acked, total.requeued), (1, 0), "{total:?}");
        let stream = js.get_stream(&topology.stream).await.expect("the stream");
        let info = stream
            .consumer_info(&topology.consumer)
            .await
            .expect("consumer info");
        assert_eq!(info.num_redelivered, 0, "delivered once");
        topology.delete(&js).await.expect("delete the streams");
    }

    // --- The crash test ---------------------------------------------------------------------

    /// The child's lease: a killed child's keys are taken over this long after its last
    /// heartbeat. Longer than the consumer's ack_wait, so that JetStream delivers the
    /// killed child's messages again while its leases still hold.
    const CHILD_LEASE: Duration = Duration::from_secs(4);
    const CHILD_ACK_WAIT: Duration = Duration::from_secs(1);
    const CHILD_CONCURRENCY: usize = 4;

    /// The worker process of [`a_killed_worker_process_loses_nothing`]; does nothing unless
    /// that test spawned it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "the worker process of the crash test; runs only when that test spawns it"]
    async fn child_worker_process() {
        if std::env::var(CHILD_ENV).is_err() {
            eprintln!("child_worker_process runs only as the crash test's child process");
            return;
        }
        let files = ChildFiles {
            dir: PathBuf::from(child_env("IDEM_CHILD_DIR")),
            owner: false,
        };
        let name = child_env("IDEM_CHILD_NAME");
        let hang_after: u32 = child_env("IDEM_CHILD_HANG_AFTER")
            .parse()
            .expect("a number");
        let store = SharedStore::open(&child_env("IDEM_CHILD_STORE"));
        let consumer = Consumer::new(
            Idem::from_arc(store).with_config(Config::default().with_lease(CHILD_LEASE)),
            Scope::new("crash-test").unwrap(),
        )
        .with_policy(Policy::default().with_max_in_flight_delay(Duration::from_millis(300)));
        let topology = Topology::new(
            child_env("IDEM_CHILD_STREAM"),
            child_env("IDEM_CHILD_SUBJECT"),
        );
        let js = connect(&child_env("IDEM_TEST_NATS_URL")).await;
        let starts = Arc::new(AtomicU32::new(0));
        let (starts_file, effects_file) = (files.starts(), files.effects());
        let handler_name = name.clone();
        let handler = move |_message: Message, ctx: Context| {
            let (starts, starts_file, effects_file, name) = (
                starts.clone(),
                starts_file.clone(),
                effects_file.clone(),
                handler_name.clone(),
            );
            async move {
                let n = starts.fetch_add(1, Ordering::SeqCst) + 1;
                let line = format!("{} {} {name}", ctx.key(), ctx.attempt());
                append(&starts_file, &line);
                if n > hang_after {
                    // Stuck while holding the key (its lease is extended and JetStream told
                    // "work in progress" in the background), until the process is killed.
                    sleep(Duration::from_secs(3600)).await;
                }
                sleep(Duration::from_millis(30)).await;
                append(&effects_file, &line);
                Ok::<_, Failure<String>>(n)
            }
        };
        let stop_file = files.stop(&name);
        let summary = Worker::new(consumer, topology)
            .with_concurrency(CHILD_CONCURRENCY)
            .with_batch(CHILD_CONCURRENCY)
            .run(&js, handler, async move {
                // Stop when told to, or when the test is gone (it removes the directory).
                while !stop_file.exists() && stop_file.parent().is_some_and(Path::exists) {
                    sleep(Duration::from_millis(50)).await;
                }
            })
            .await
            .expect("the worker runs");
        std::fs::write(
            files.summary(&name),
            format!("{} {}", summary.acked, summary.requeued),
        )
        .expect("write the summary");
    }

    /// Kill a worker process (SIGKILL) while its handlers hold keys: JetStream delivers
    /// their messages to another worker after ack_wait, which NAKs them while the dead
    /// worker's leases hold, then takes the keys over. Every message is handled exactly once
    /// and none is lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_worker_process_loses_nothing() {
        let Some((url, js, topology)) = broker("crash", CHILD_ACK_WAIT).await else {
            return;
        };
        let Some(shared) = SharedStore::for_test() else {
            return;
        };
        const N: u32 = 20;
        const QUICK: u32 = 6;
        for _copy in 0..2 {
            for i in 0..N {
                let payload = format!("{{\"i\":{i}}}");
                publish(&js, &topology.subject, &format!("msg-{i}"), &payload).await;
            }
        }
        let files = ChildFiles::new();
        let env = |hang_after: u32| {
            vec![
                ("IDEM_TEST_NATS_URL", url.clone()),
                ("IDEM_CHILD_STREAM", topology.stream.clone()),
                ("IDEM_CHILD_SUBJECT", topology.subject.clone()),
                ("IDEM_CHILD_STORE", shared.descriptor()),
                ("IDEM_CHILD_HANG_AFTER", hang_after.to_string()),
            ]
        };
        const CHILD: &str = "nats::child_worker_process";

        // Process A works QUICK messages, then its handlers hang holding their keys.
        let mut a = spawn_child(&files, CHILD, "A", &env(QUICK));
        wait_until(
            Duration::from_secs(60),
            "A does its quick work and hangs on a full set of handlers",
            || {
                let (starts, effects) = (files.starts(), files.effects());
                async move {
                    ChildFiles::lines(&effects).len() == QUICK as usize
                        && ChildFiles::lines(&starts).len() >= QUICK as usize + CHILD_CONCURRENCY
                }
            },
        )
        .await;
        let starts = ChildFiles::lines(&files.starts());
        assert_eq!(
            starts.len(),
            QUICK as usize + CHILD_CONCURRENCY,
            "{starts:?}"
        );
        // SIGKILL, as `kill -9`: no cleanup, no acks, no releases.
        a.0.kill().expect("kill -9 the worker process");
        a.0.wait().expect("reap it");
        let hung: BTreeSet<String> = starts
            .into_iter()
            .skip(QUICK as usize)
            .map(|l| l[0].clone())
            .collect();
        assert_eq!(hung.len(), CHILD_CONCURRENCY, "{hung:?}");

        // Process B handles everything else, and A's hung messages once their leases expire.
        let mut b = spawn_child(&files, CHILD, "B", &env(u32::MAX));
        wait_until(
            Duration::from_secs(90),
            "every message has its effect",
            || {
                let effects = files.effects();
                async move {
                    let keys: BTreeSet<String> = ChildFiles::lines(&effects)
                        .into_iter()
                        .map(|l| l[0].clone())
                        .collect();
                    keys.len() == N as usize
                }
            },
        )
        .await;
        wait_until_settled(&js, &topology, Duration::from_secs(60)).await;
        let summary = stop_child(&files, &mut b, "B").await;
        let requeued: u64 = summary
            .split(' ')
            .nth(1)
            .and_then(|n| n.parse().ok())
            .expect("requeued count");
        assert!(
            requeued > 0,
            "B found A's keys held and NAKed their messages until the leases expired"
        );

        let mut per_key: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for line in ChildFiles::lines(&files.effects()) {
            per_key
                .entry(line[0].clone())
                .or_default()
                .push((line[1].clone(), line[2].clone()));
        }
        assert_eq!(per_key.len(), N as usize, "no message lost");
        for (key, done) in &per_key {
            assert_eq!(
                done.len(),
                1,
                "{key} had its effect {} times: {done:?}",
                done.len()
            );
            if hung.contains(key) {
                assert_eq!(
                    done[0],
                    ("2".to_string(), "B".to_string()),
                    "{key}: B took over A's key as attempt 2"
                );
            }
        }
        assert_eq!(messages_in(&js, &topology.dead_letter_stream).await, 0);
        topology.delete(&js).await.expect("delete the streams");
    }
}
