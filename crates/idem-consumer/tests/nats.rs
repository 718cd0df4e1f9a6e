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
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use async_nats::jetstream::{self, Context as JetStream};
    use async_nats::HeaderMap;
    use idem_consumer::nats::{with_idempotency_key, Error, Topology, Worker};
    use idem_consumer::{
        Consumer, Policy, Summary, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER,
        IDEMPOTENCY_KEY_HEADER,
    };
    use idem_core::{Idem, Key, MemoryStore, Scope, Store};
    use idem_redis::RedisStore;
    use tokio::sync::oneshot;
    use tokio::time::{sleep, timeout};

    use crate::support::{
        check_crash, check_dead_letters, check_retry_runs, child_env, counting, failing,
        retry_keys, retry_policy, start_and_kill_a, start_b, stop_child, wait_until, ChildFiles,
        ChildSetup, Effects, Handler, Runs, SharedStore, CHILD_CONCURRENCY, CHILD_REDELIVERY,
        CRASH_MESSAGES,
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
        let (flaky, broken) = retry_keys();
        for key in flaky.iter().chain(&broken) {
            publish(&js, &topology.subject, key, "{}").await;
        }
        publish(&js, &topology.subject, "declined", "{}").await;

        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("retry-test").unwrap(),
        )
        .with_policy(retry_policy());
        let runs: Runs = Arc::default();
        let effects: Effects = Arc::default();
        let (stop, task) = spawn_worker(
            Worker::new(consumer, topology.clone()).with_concurrency(2),
            connect(&url).await,
            failing(&runs, &effects),
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

        check_retry_runs(&runs, &effects, &summary);
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
        check_dead_letters(&dead);
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

    /// The worker process of [`a_killed_worker_process_loses_nothing`]; does nothing unless
    /// that test spawned it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "the worker process of the crash test; runs only when that test spawns it"]
    async fn child_worker_process() {
        let Some(child) = ChildSetup::from_env() else {
            return;
        };
        let topology = Topology::new(
            child_env("IDEM_CHILD_STREAM"),
            child_env("IDEM_CHILD_SUBJECT"),
        );
        let js = connect(&child_env("IDEM_TEST_NATS_URL")).await;
        let handler = child.handler.clone();
        let summary = Worker::new(child.consumer.clone(), topology)
            .with_concurrency(CHILD_CONCURRENCY)
            .with_batch(CHILD_CONCURRENCY)
            .run(&js, move |m, c| handler(m, c), child.stopped())
            .await
            .expect("the worker runs");
        child.report(&summary);
    }

    /// Kill a worker process (SIGKILL) while its handlers hold keys: JetStream delivers
    /// their messages to another worker after ack_wait, which NAKs them while the dead
    /// worker's leases hold, then takes the keys over. Every message is handled exactly once
    /// and none is lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_worker_process_loses_nothing() {
        let Some((url, js, topology)) = broker("crash", CHILD_REDELIVERY).await else {
            return;
        };
        let Some(shared) = SharedStore::for_test() else {
            return;
        };
        for _copy in 0..2 {
            for i in 0..CRASH_MESSAGES {
                let payload = format!("{{\"i\":{i}}}");
                publish(&js, &topology.subject, &format!("msg-{i}"), &payload).await;
            }
        }
        let files = ChildFiles::new();
        let env = [
            ("IDEM_TEST_NATS_URL", url.clone()),
            ("IDEM_CHILD_STREAM", topology.stream.clone()),
            ("IDEM_CHILD_SUBJECT", topology.subject.clone()),
            ("IDEM_CHILD_STORE", shared.descriptor()),
        ];
        const CHILD: &str = "nats::child_worker_process";
        let hung = start_and_kill_a(&files, CHILD, &env).await;
        let mut b = start_b(&files, CHILD, &env).await;
        wait_until_settled(&js, &topology, Duration::from_secs(60)).await;
        let summary = stop_child(&files, &mut b, "B").await;
        check_crash(&files, &hung, &summary);
        assert_eq!(messages_in(&js, &topology.dead_letter_stream).await, 0);
        topology.delete(&js).await.expect("delete the streams");
    }
}
