//! The RabbitMQ worker against a real broker (`IDEM_TEST_AMQP_URL`, e.g.
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). Without it each test prints why and returns,
//! or fails when `IDEM_TEST_REQUIRE_BACKENDS=1`.
//!
//! Every test declares its own uniquely named queues (with `x-expires`, so a failed test
//! leaves nothing behind for long) and deletes them at the end.
//!
//! The crash test runs consumer *processes*: this test binary, re-executed to run the
//! ignored test `child_consumer_process` with its settings in the environment. They share
//! their idempotency store through [`SharedStore`]: Redis (`IDEM_TEST_REDIS_URL`) under a
//! key prefix of the test's own.

#![cfg(feature = "rabbitmq")]

mod support;

/// Named after the backend, so that `cargo test rabbitmq` runs these.
mod rabbitmq {

    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use idem_consumer::rabbitmq::{with_idempotency_key, Summary, Topology, Worker};
    use idem_consumer::{
        Consumer, Policy, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER,
    };
    use idem_core::{Config, Failure, Idem, Key, MemoryStore, Scope, Store};
    use lapin::options::{
        BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
        QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
    use tokio::sync::oneshot;
    use tokio::time::{sleep, timeout, Instant};

    use crate::support::{
        self, child_env, wait_until, ChildSetup, Effects, Handler, RunningWorker, TestBroker,
        Tuning, CHILD_CONCURRENCY,
    };

    fn amqp_url() -> Option<String> {
        idem_testkit::harness::url_from_env("IDEM_TEST_AMQP_URL", "RabbitMQ")
    }

    async fn connect(url: &str) -> Connection {
        Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ")
    }

    /// Fresh queues named after the test, deleted by the broker after 5 idle minutes if the
    /// test fails before deleting them.
    fn topology(test: &str) -> Topology {
        Topology::for_queue(format!("idem-test-{test}-{}", uuid::Uuid::new_v4()))
            .with_expires(Duration::from_secs(300))
    }

    /// What a broker test starts from: the broker's URL, the test's own connection (keep it
    /// open while the test runs), a channel of [`admin_channel`] on it, and fresh queues of
    /// [`topology`] named after the test, declared. `None` when no broker is configured.
    async fn broker(test: &str) -> Option<(String, Connection, Channel, Topology)> {
        let url = amqp_url()?;
        let conn = connect(&url).await;
        let admin = admin_channel(&conn).await;
        let topology = topology(test);
        topology.declare(&admin).await.expect("declare");
        Some((url, conn, admin, topology))
    }

    /// A channel with publisher confirms, for the test's own publishing and inspection.
    async fn admin_channel(conn: &Connection) -> Channel {
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm_select");
        channel
    }

    /// Publishes `payload` with `key` propagated in its headers, and waits for the broker's
    /// confirm.
    async fn publish(channel: &Channel, queue: &str, key: &str, payload: &str) {
        let props = with_idempotency_key(
            BasicProperties::default().with_delivery_mode(2),
            &Key::new(key).expect("test keys are valid"),
            None,
        );
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                payload.as_bytes(),
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "the broker refused a test message");
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

    /// Waits until the main and retry queues have had no ready message for 500 ms.
    async fn wait_for_empty_queues(channel: &Channel, topology: &Topology, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut empty_since: Option<Instant> = None;
        loop {
            let empty = ready(channel, &topology.queue).await == 0
                && ready(channel, &topology.retry_queue).await == 0;
            match (empty, empty_since) {
                (true, Some(since)) if since.elapsed() >= Duration::from_millis(500) => return,
                (true, None) => empty_since = Some(Instant::now()),
                (true, Some(_)) => {}
                (false, _) => empty_since = None,
            }
            assert!(Instant::now() < deadline, "the queues did not drain");
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `worker` in a task until the returned sender is used (or dropped).
    fn spawn_worker<F>(
        worker: Worker,
        conn: Arc<Connection>,
        handler: F,
    ) -> (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<Summary, idem_consumer::rabbitmq::Error>>,
    )
    where
        F: Fn(
                idem_consumer::Message,
                idem_consumer::Context,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<u32, Failure<String>>> + Send>,
            > + Send
            + Sync
            + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            worker
                .run(&conn, handler, async {
                    let _ = stopped.await;
                })
                .await
        });
        (stop, task)
    }

    /// The broker's URL, the test's own connection (kept open while the test runs), a
    /// channel of [`admin_channel`] on it, and fresh queues named after the test.
    struct Rabbit {
        url: String,
        _conn: Connection,
        admin: Channel,
        topology: Topology,
    }

    impl TestBroker for Rabbit {
        /// RabbitMQ redelivers what a consumer had not acked when its channel closes, so
        /// `redelivery` does not apply.
        async fn open(test: &str, _redelivery: Duration) -> Option<Self> {
            let (url, _conn, admin, topology) = broker(test).await?;
            Some(Self {
                url,
                _conn,
                admin,
                topology,
            })
        }

        async fn publish(&self, key: &str, payload: &str) {
            publish(&self.admin, &self.topology.queue, key, payload).await;
        }

        /// `tuning.batch` is not used: the worker's prefetch stays the default.
        async fn spawn_worker(
            &self,
            consumer: Consumer,
            tuning: Tuning,
            handler: Handler,
        ) -> RunningWorker {
            let worker =
                Worker::new(consumer, self.topology.clone()).with_concurrency(tuning.concurrency);
            let conn = connect(&self.url).await;
            RunningWorker::spawn(|stop| async move {
                worker.run(&conn, move |m, c| handler(m, c), stop).await
            })
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
        let Some((url, _conn, admin, topology)) = broker("exactly-once").await else {
            return;
        };
        const N: u32 = 40;
        for copy in 0..3 {
            for i in 0..N {
                // The third round publishes in reverse, so copies meet each other mid-flight.
                let i = if copy == 2 { N - 1 - i } else { i };
                let payload = format!(r#"{{"order": {i}, "amount": {}}}"#, 100 + i);
                publish(&admin, &topology.queue, &format!("order-{i}"), &payload).await;
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
        let handler = |effects: Effects, work: Duration, starts: Arc<AtomicU32>| {
            move |message: idem_consumer::Message, ctx: idem_consumer::Context| {
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
                }) as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>
            }
        };

        // The doomed worker: slow handlers, so that some are mid-work when its connection
        // closes; their work completes and is stored, but their acks cannot be sent. It
        // starts first, so that it has deliveries before the fast workers drain the queue.
        let doomed_conn = Arc::new(connect(&url).await);
        let doomed_starts = Arc::new(AtomicU32::new(0));
        let (_doomed_stop, doomed) = spawn_worker(
            Worker::new(consumer.clone(), topology.clone())
                .with_prefetch(8)
                .with_concurrency(4),
            doomed_conn.clone(),
            handler(
                effects.clone(),
                Duration::from_millis(400),
                doomed_starts.clone(),
            ),
        );
        let mut running = Vec::new();
        for _ in 0..2 {
            let conn = Arc::new(connect(&url).await);
            let worker = Worker::new(consumer.clone(), topology.clone())
                .with_prefetch(8)
                .with_concurrency(3);
            let starts = Arc::new(AtomicU32::new(0));
            running.push(spawn_worker(
                worker,
                conn,
                handler(effects.clone(), Duration::from_millis(10), starts),
            ));
        }
        wait_until(Duration::from_secs(30), "the doomed worker runs", || {
            let starts = doomed_starts.clone();
            async move { starts.load(Ordering::SeqCst) >= 3 }
        })
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
            || {
                let effects = effects.clone();
                async move { effects.lock().unwrap().len() == N as usize }
            },
        )
        .await;
        wait_for_empty_queues(&admin, &topology, Duration::from_secs(60)).await;
        let mut summaries = Vec::new();
        for (stop, task) in running {
            let _ = stop.send(());
            summaries.push(
                timeout(Duration::from_secs(30), task)
                    .await
                    .expect("clean shutdown")
                    .expect("no panic")
                    .expect("worker ran"),
            );
        }
        // Held requeues are nacked back at shutdown: a last worker drains them, all duplicates.
        let drain_conn = Arc::new(connect(&url).await);
        let (stop, task) = spawn_worker(
            Worker::new(consumer.clone(), topology.clone()),
            drain_conn,
            handler(effects.clone(), Duration::ZERO, Arc::new(AtomicU32::new(0))),
        );
        wait_for_empty_queues(&admin, &topology, Duration::from_secs(30)).await;
        let _ = stop.send(());
        summaries.push(task.await.expect("no panic").expect("worker ran"));

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
        assert_eq!(ready(&admin, &topology.dead_letter_queue).await, 0);
        topology.delete(&admin).await.expect("delete queues");
    }

    /// Retries go through the retry queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transient_failures_retry_and_permanent_ones_are_dead_lettered() {
        support::transient_failures_retry_and_permanent_ones_are_dead_lettered::<Rabbit>(
            Duration::ZERO,
        )
        .await;
    }

    /// Shutdown stops consuming, lets the handlers in progress finish and acks their
    /// deliveries, and hands the deliveries not started back to the queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_finishes_the_work_in_progress_and_returns_the_rest() {
        let Some((url, _conn, admin, topology)) = broker("shutdown").await else {
            return;
        };
        const N: usize = 12;
        for i in 0..N {
            publish(&admin, &topology.queue, &format!("job-{i}"), "{}").await;
        }
        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("shutdown-test").unwrap(),
        );
        let started = Arc::new(AtomicU32::new(0));
        let finished: Effects = Arc::default();
        let conn = Arc::new(connect(&url).await);
        let (stop, task) = {
            let (started, finished) = (started.clone(), finished.clone());
            spawn_worker(
                Worker::new(consumer, topology.clone())
                    .with_prefetch(6)
                    .with_concurrency(2),
                conn,
                move |_message, ctx| {
                    let (started, finished) = (started.clone(), finished.clone());
                    Box::pin(async move {
                        started.fetch_add(1, Ordering::SeqCst);
                        sleep(Duration::from_millis(500)).await;
                        finished.lock().unwrap().insert(ctx.key().to_string(), 1);
                        Ok(0)
                    })
                },
            )
        };
        wait_until(Duration::from_secs(30), "two handlers run", || {
            let started = started.clone();
            async move { started.load(Ordering::SeqCst) >= 2 }
        })
        .await;
        let _ = stop.send(());
        let summary = timeout(Duration::from_secs(30), task)
            .await
            .expect("shutdown completes")
            .expect("no panic")
            .expect("worker ran");
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
            || {
                let (admin, queue) = (&admin, topology.queue.clone());
                async move { ready(admin, &queue).await as usize == N - finished }
            },
        )
        .await;
        topology.delete(&admin).await.expect("delete queues");
    }

    // --- The crash test -----------------------------------------------------------------------

    /// The consumer process of [`a_killed_consumer_process_loses_nothing`]; does nothing unless
    /// that test spawned it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "the consumer process of the crash test; runs only when that test spawns it"]
    async fn child_consumer_process() {
        let Some(child) = ChildSetup::from_env() else {
            return;
        };
        let conn = connect(&child_env("IDEM_TEST_AMQP_URL")).await;
        let handler = child.handler.clone();
        let summary = Worker::new(
            child.consumer.clone(),
            Topology::for_queue(child_env("IDEM_CHILD_QUEUE")),
        )
        .with_prefetch(8)
        .with_concurrency(CHILD_CONCURRENCY)
        .run(&conn, move |m, c| handler(m, c), child.stopped())
        .await
        .expect("the worker runs");
        child.report(&summary);
    }

    /// See [`support::a_killed_worker_process_loses_nothing`](crate::support::a_killed_worker_process_loses_nothing):
    /// the broker redelivers a killed consumer's messages when its connection drops. What
    /// the surviving process requeued at its shutdown is then drained over the same store,
    /// and no handler runs again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_consumer_process_loses_nothing() {
        let Some(rabbit) = Rabbit::open("crash", Duration::ZERO).await else {
            return;
        };
        let Some(shared) = support::a_killed_worker_process_loses_nothing(
            &rabbit,
            "rabbitmq::child_consumer_process",
        )
        .await
        else {
            return;
        };

        // Anything B requeued at its shutdown is a duplicate of finished work: drain it here,
        // over the same store, and check that no handler runs.
        let conn = Arc::new(connect(&rabbit.url).await);
        let consumer = Consumer::new(
            Idem::from_arc(shared.store()),
            Scope::new("crash-test").unwrap(),
        );
        let reruns = Arc::new(AtomicU32::new(0));
        let (stop, task) = {
            let reruns = reruns.clone();
            spawn_worker(
                Worker::new(consumer, rabbit.topology.clone()),
                conn,
                move |_, _| {
                    reruns.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async { Ok(0) })
                },
            )
        };
        wait_for_empty_queues(&rabbit.admin, &rabbit.topology, Duration::from_secs(30)).await;
        let _ = stop.send(());
        let drained = task.await.expect("no panic").expect("worker ran");
        assert_eq!(
            reruns.load(Ordering::SeqCst),
            0,
            "no finished work ran again"
        );
        assert_eq!(drained.requeued, 0, "{drained:?}");
        rabbit.delete().await;
    }
}
