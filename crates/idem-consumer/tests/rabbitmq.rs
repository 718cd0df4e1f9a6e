//! The RabbitMQ worker against a real broker (`IDEM_TEST_AMQP_URL`, e.g.
//! `amqp://guest:guest@127.0.0.1:5672/%2f`), through the shared broker tests
//! (`support/broker.rs`, whose docs say how they run) and tests of its own. Every test
//! declares its own queues (with `x-expires`, so a failed test leaves nothing behind for
//! long) and deletes them.

#![cfg(feature = "rabbitmq")]

mod support;

/// Named after the backend, so that `cargo test rabbitmq` runs these.
mod rabbitmq {

    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use idem_consumer::rabbitmq::{with_idempotency_key, Topology, Worker};
    use idem_consumer::{
        Consumer, Policy, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER,
    };
    use idem_core::{Config, Failure, Idem, Key, MemoryStore, Scope, Store};
    use lapin::options::{
        BasicAckOptions, BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
    use tokio::time::{sleep, timeout};

    use crate::support::{
        self, child_env, tuning, wait_until, wait_until_settled, Effects, Handler, Running,
        SharedStore, Spawn, Stop, TestBroker, Tuning,
    };

    async fn connect(url: &str) -> Connection {
        Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ")
    }

    /// Messages ready in `queue` (not counting deliveries held unacked by consumers).
    async fn ready(channel: &Channel, queue: &str) -> u32 {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await
            .expect("passive declare")
            .message_count()
    }

    /// The broker's URL, the test's own connection (kept open while the test runs), a
    /// channel with publisher confirms on it (for the test's own publishing and
    /// inspection), and the test's queues.
    struct Rabbit {
        url: String,
        _conn: Connection,
        admin: Channel,
        topology: Topology,
    }

    impl Rabbit {
        async fn connect(url: String, topology: Topology) -> Self {
            let conn = connect(&url).await;
            let admin = conn.create_channel().await.expect("channel");
            let confirm = admin.confirm_select(ConfirmSelectOptions::default());
            confirm.await.expect("confirm_select");
            Self {
                url,
                _conn: conn,
                admin,
                topology,
            }
        }
    }

    impl TestBroker for Rabbit {
        /// Fresh queues named after the test (deleted by the broker after 5 idle minutes if
        /// the test fails before deleting them), declared. RabbitMQ redelivers what a
        /// consumer had not acked when its channel closes, so `redelivery` does not apply.
        async fn open(test: &str, _redelivery: Duration) -> Option<Self> {
            let url = idem_testkit::harness::url_from_env("IDEM_TEST_AMQP_URL", "RabbitMQ")?;
            let topology =
                Topology::for_queue(format!("idem-test-{test}-{}", uuid::Uuid::new_v4()))
                    .with_expires(Duration::from_secs(300));
            let rabbit = Self::connect(url, topology).await;
            rabbit
                .topology
                .declare(&rabbit.admin)
                .await
                .expect("declare");
            Some(rabbit)
        }

        /// Persistent, and the broker confirms it.
        async fn publish(&self, key: &str, payload: &str) {
            let props = with_idempotency_key(
                BasicProperties::default().with_delivery_mode(2),
                &Key::new(key).expect("test keys are valid"),
                None,
            );
            let published = self
                .topology
                .publish(&self.admin, payload.as_bytes(), props);
            published.await.expect("the broker confirms a test message");
        }

        /// `tuning.batch` is the prefetch, at least twice the concurrency: deliveries held
        /// for a delayed requeue count against it.
        fn worker(&self, spawn: Spawn, stop: Stop) -> Running {
            let url = self.url.clone();
            let conn = async move { connect(&url).await };
            support::run_test_worker!(spawn, stop, conn, |consumer, tuning| {
                let prefetch = tuning.batch.max(2 * tuning.concurrency);
                Worker::new(consumer, self.topology.clone())
                    .with_prefetch(prefetch.try_into().expect("a prefetch"))
                    .with_concurrency(tuning.concurrency)
            })
        }

        async fn from_child_env() -> Self {
            let topology = Topology::for_queue(child_env("IDEM_CHILD_QUEUE"));
            Self::connect(child_env("IDEM_TEST_AMQP_URL"), topology).await
        }

        /// Ready in the main and retry queues (the broker does not say what consumers hold).
        async fn unsettled(&self) -> u64 {
            let main = ready(&self.admin, &self.topology.queue).await;
            let retry = ready(&self.admin, &self.topology.retry_queue).await;
            u64::from(main + retry)
        }

        async fn dead_letter_count(&self) -> u64 {
            ready(&self.admin, &self.topology.dead_letter_queue)
                .await
                .into()
        }

        /// Takes the dead letters off their queue.
        async fn dead_letters(&self) -> BTreeMap<String, (String, String)> {
            let mut dead = BTreeMap::new();
            let queue = self.topology.dead_letter_queue.as_str();
            while let Some(got) = self
                .admin
                .basic_get(queue.into(), BasicGetOptions::default())
                .await
                .expect("basic.get")
            {
                let headers = got.delivery.properties.headers().clone().expect("headers");
                let text = |name: &str| match headers.inner().get(name) {
                    Some(AMQPValue::LongString(s)) => {
                        String::from_utf8_lossy(s.as_bytes()).into_owned()
                    }
                    other => panic!("{name}: {other:?}"),
                };
                let attempt = match headers.inner().get(ATTEMPT_HEADER) {
                    Some(AMQPValue::LongLongInt(n)) => *n,
                    other => panic!("attempt header: {other:?}"),
                };
                dead.insert(
                    text(IDEMPOTENCY_KEY_HEADER),
                    (text(DEAD_LETTER_REASON_HEADER), attempt.to_string()),
                );
                got.delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .expect("ack");
            }
            dead
        }

        fn child_env(&self) -> Vec<(&'static str, String)> {
            vec![
                ("IDEM_TEST_AMQP_URL", self.url.clone()),
                ("IDEM_CHILD_QUEUE", self.topology.queue.clone()),
            ]
        }

        /// What the surviving process requeued at its shutdown is a duplicate of finished
        /// work: drained here, over the same store, no handler runs again.
        async fn check_after_crash(&self, shared: &SharedStore) {
            let consumer = Consumer::new(
                Idem::from_arc(shared.store()),
                Scope::new("crash-test").unwrap(),
            );
            let reruns = Arc::new(AtomicU32::new(0));
            let handler: Handler = {
                let reruns = reruns.clone();
                Arc::new(move |_, _| {
                    reruns.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async { Ok(0) })
                })
            };
            let drain = self.spawn_worker(consumer, Tuning::default(), handler);
            wait_until_settled(self, Duration::from_secs(30)).await;
            let drained = drain.stop().await;
            assert_eq!(
                reruns.load(Ordering::SeqCst),
                0,
                "no finished work ran again"
            );
            assert_eq!(drained.requeued, 0, "{drained:?}");
        }

        async fn delete(&self) {
            self.topology
                .delete(&self.admin)
                .await
                .expect("delete queues");
        }
    }

    /// N business messages, each published three times, consumed by three workers on their own
    /// connections; one worker's connection is closed while it holds deliveries whose work is
    /// done but not acked, so the broker redelivers them. The side effect happens exactly N
    /// times.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicates_and_redeliveries_have_their_effect_exactly_once() {
        let Some(rabbit) = Rabbit::open("exactly-once", Duration::ZERO).await else {
            return;
        };
        const N: u32 = 40;
        for copy in 0..3 {
            for i in 0..N {
                // The third round publishes in reverse, so copies meet each other mid-flight.
                let i = if copy == 2 { N - 1 - i } else { i };
                let payload = format!(r#"{{"order": {i}, "amount": {}}}"#, 100 + i);
                rabbit.publish(&format!("order-{i}"), &payload).await;
            }
        }

        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let policy = Policy::default().with_max_in_flight_delay(Duration::from_millis(200));
        let config = Config::default().with_lease(Duration::from_secs(5));
        let consumer = Consumer::new(
            Idem::from_arc(store).with_config(config),
            Scope::new("exactly-once-test").unwrap(),
        )
        .with_policy(policy);
        let effects: Effects = Arc::default();
        let handler = |work: Duration, starts: Arc<AtomicU32>| -> Handler {
            let effects = effects.clone();
            Arc::new(move |message, ctx| {
                let effects = effects.clone();
                let starts = starts.clone();
                Box::pin(async move {
                    starts.fetch_add(1, Ordering::SeqCst);
                    sleep(work).await;
                    let order: serde_json::Value = serde_json::from_slice(message.payload())
                        .map_err(|e| Failure::Terminal(format!("bad payload: {e}")))?;
                    *effects
                        .lock()
                        .unwrap()
                        .entry(ctx.key().to_string())
                        .or_insert(0) += 1;
                    Ok(order["order"].as_u64().unwrap_or(0) as u32)
                })
            })
        };

        // The doomed worker: slow handlers, so that some are mid-work when its connection
        // closes; their work completes and is stored, but their acks cannot be sent. It
        // starts first, so that it has deliveries before the fast workers drain the queue.
        let doomed_conn = Arc::new(connect(&rabbit.url).await);
        let doomed_starts = Arc::new(AtomicU32::new(0));
        let doomed = {
            let worker = Worker::new(consumer.clone(), rabbit.topology.clone())
                .with_prefetch(8)
                .with_concurrency(4);
            let handler = handler(Duration::from_millis(400), doomed_starts.clone());
            let conn = doomed_conn.clone();
            tokio::spawn(async move {
                let run = move |m, c| handler(m, c);
                worker.run(&conn, run, std::future::pending()).await
            })
        };
        let fast = tuning(3, 8);
        let running: Vec<_> = (0..2)
            .map(|_| {
                let handler = handler(Duration::from_millis(10), Arc::default());
                rabbit.spawn_worker(consumer.clone(), fast, handler)
            })
            .collect();
        wait_until(
            Duration::from_secs(30),
            "the doomed worker runs",
            || async { doomed_starts.load(Ordering::SeqCst) >= 3 },
        )
        .await;
        doomed_conn
            .close(320, "test: connection lost".into())
            .await
            .expect("close the doomed connection");
        let doomed_summary = match timeout(Duration::from_secs(30), doomed)
            .await
            .expect("the doomed worker stops")
            .expect("no panic")
        {
            Ok(summary) | Err(idem_consumer::rabbitmq::Error::ConsumerFailed { summary, .. }) => {
                summary
            }
            Err(e) => panic!("the doomed worker failed to start: {e}"),
        };

        wait_until(
            Duration::from_secs(60),
            "every order has its effect",
            || async { effects.lock().unwrap().len() == N as usize },
        )
        .await;
        wait_until_settled(&rabbit, Duration::from_secs(60)).await;
        let mut summaries = Vec::new();
        for worker in running {
            summaries.push(worker.stop().await);
        }
        // Held requeues are nacked back at shutdown: a last worker drains them, all duplicates.
        let handler = handler(Duration::ZERO, Arc::default());
        let drain = rabbit.spawn_worker(consumer.clone(), Tuning::default(), handler);
        wait_until_settled(&rabbit, Duration::from_secs(30)).await;
        summaries.push(drain.stop().await);

        let effects = effects.lock().unwrap().clone();
        assert_eq!(effects.len(), N as usize, "every order was handled");
        for (key, count) in &effects {
            assert_eq!(*count, 1, "{key} had its effect {count} times");
        }
        let acked: u64 = summaries.iter().map(|s| s.acked).sum();
        assert!(
            acked + doomed_summary.acked >= u64::from(3 * N),
            "{summaries:?}"
        );
        assert!(
            doomed_summary.unsettled > 0,
            "the doomed worker held done-but-unacked deliveries: {doomed_summary:?}"
        );
        assert_eq!(rabbit.dead_letter_count().await, 0);
        rabbit.delete().await;
    }

    // Retries go through the retry queue; the broker redelivers a killed consumer's messages
    // when its connection drops.
    support::broker_tests!(rabbitmq: Rabbit, retries: Duration::ZERO);

    /// Shutdown stops consuming, lets the handlers in progress finish and acks their
    /// deliveries, and hands the deliveries not started back to the queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_finishes_the_work_in_progress_and_returns_the_rest() {
        let Some(rabbit) = Rabbit::open("shutdown", Duration::ZERO).await else {
            return;
        };
        const N: usize = 12;
        for i in 0..N {
            rabbit.publish(&format!("job-{i}"), "{}").await;
        }
        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("shutdown-test").unwrap(),
        );
        let started = Arc::new(AtomicU32::new(0));
        let finished: Effects = Arc::default();
        let handler: Handler = {
            let (started, finished) = (started.clone(), finished.clone());
            Arc::new(move |_message, ctx| {
                let (started, finished) = (started.clone(), finished.clone());
                Box::pin(async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    sleep(Duration::from_millis(500)).await;
                    finished.lock().unwrap().insert(ctx.key().to_string(), 1);
                    Ok(0)
                })
            })
        };
        let worker = rabbit.spawn_worker(consumer, tuning(2, 6), handler);
        wait_until(Duration::from_secs(30), "two handlers run", || async {
            started.load(Ordering::SeqCst) >= 2
        })
        .await;
        let summary = worker.stop().await;
        let finished = finished.lock().unwrap().len();
        assert_eq!(
            finished,
            started.load(Ordering::SeqCst) as usize,
            "every handler started ran to its end"
        );
        assert_eq!(summary.acked as usize, finished, "{summary:?}");
        // Deliveries prefetched but not started went back to the queue when the channel closed.
        wait_until(
            Duration::from_secs(10),
            "the rest is back in the queue",
            || async {
                ready(&rabbit.admin, &rabbit.topology.queue).await as usize == N - finished
            },
        )
        .await;
        rabbit.delete().await;
    }
}
