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
    use std::time::Duration;

    use async_nats::jetstream::{self, Context as JetStream};
    use async_nats::HeaderMap;
    use idem_consumer::nats::{with_idempotency_key, Topology, Worker};
    use idem_consumer::{
        Consumer, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER,
    };
    use idem_core::Key;

    use crate::support::{
        self, child_env, ChildSetup, Handler, RunningWorker, TestBroker, Tuning, CHILD_CONCURRENCY,
        CHILD_REDELIVERY,
    };

    async fn connect(url: &str) -> JetStream {
        jetstream::new(async_nats::connect(url).await.expect("connect to NATS"))
    }

    /// The server's URL, a JetStream context on it, and fresh streams named after the test.
    struct Nats {
        url: String,
        js: JetStream,
        topology: Topology,
    }

    impl Nats {
        /// Messages in `stream`.
        async fn messages_in(&self, stream: &str) -> u64 {
            let mut stream = self.js.get_stream(stream).await.expect("the stream");
            stream.info().await.expect("stream info").state.messages
        }

        async fn consumer_info(&self) -> jetstream::consumer::Info {
            let stream = self.js.get_stream(&self.topology.stream);
            let stream = stream.await.expect("the stream");
            let info = stream.consumer_info(&self.topology.consumer).await;
            info.expect("consumer info")
        }

        /// The consumer's messages not yet delivered, delivered but not acked, and the
        /// stream sequence up to which all are acked.
        async fn consumer_state(&self) -> (u64, usize, u64) {
            let info = self.consumer_info().await;
            (
                info.num_pending,
                info.num_ack_pending,
                info.ack_floor.stream_sequence,
            )
        }
    }

    impl TestBroker for Nats {
        async fn open(test: &str, ack_wait: Duration) -> Option<Self> {
            let url = idem_testkit::harness::nats_url()?;
            let js = connect(&url).await;
            let id = uuid::Uuid::new_v4().simple().to_string();
            let topology = Topology::new(
                format!("IDEM-TEST-{test}-{}", &id[..12]),
                format!("idem-test.{test}.{}", &id[..12]),
            )
            .with_ack_wait(ack_wait);
            topology.declare(&js).await.expect("declare");
            Some(Self { url, js, topology })
        }

        async fn publish(&self, key: &str, payload: &str) {
            let headers = with_idempotency_key(
                HeaderMap::new(),
                &Key::new(key).expect("test keys are valid"),
                None,
            );
            let subject = self.topology.subject.clone();
            self.js
                .publish_with_headers(subject, headers, payload.to_owned().into())
                .await
                .expect("publish")
                .await
                .expect("the stream stores it");
        }

        async fn spawn_worker(
            &self,
            consumer: Consumer,
            tuning: Tuning,
            handler: Handler,
        ) -> RunningWorker {
            let worker = Worker::new(consumer, self.topology.clone())
                .with_concurrency(tuning.concurrency)
                .with_batch(tuning.batch);
            let js = connect(&self.url).await;
            RunningWorker::spawn(|stop| async move {
                worker.run(&js, move |m, c| handler(m, c), stop).await
            })
        }

        async fn unsettled(&self) -> u64 {
            let (pending, unacked, _) = self.consumer_state().await;
            pending + unacked as u64
        }

        async fn dead_letter_count(&self) -> u64 {
            self.messages_in(&self.topology.dead_letter_stream).await
        }

        async fn dead_letters(&self) -> BTreeMap<String, (String, String)> {
            let dead_stream = self
                .js
                .get_stream(&self.topology.dead_letter_stream)
                .await
                .expect("the dead-letter stream");
            let mut dead = BTreeMap::new();
            for seq in 1..=self.dead_letter_count().await {
                let letter = dead_stream.get_raw_message(seq).await.expect("dead letter");
                assert_eq!(
                    letter.subject.as_str(),
                    Topology::dead_letter_subject(&self.topology.subject)
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
            dead
        }

        fn child_env(&self) -> Vec<(&'static str, String)> {
            vec![
                ("IDEM_TEST_NATS_URL", self.url.clone()),
                ("IDEM_CHILD_STREAM", self.topology.stream.clone()),
                ("IDEM_CHILD_SUBJECT", self.topology.subject.clone()),
            ]
        }

        async fn check_all_acked(&self, messages: u64) {
            assert_eq!(self.messages_in(&self.topology.stream).await, messages);
            assert_eq!(self.consumer_state().await, (0, 0, messages));
        }

        async fn check_delivered_once(&self) {
            let info = self.consumer_info().await;
            assert_eq!(info.num_redelivered, 0, "delivered once");
        }

        async fn delete(&self) {
            self.topology
                .delete(&self.js)
                .await
                .expect("delete the streams");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_copies_to_four_workers_have_one_effect() {
        support::five_copies_to_four_workers::<Nats>(Duration::from_secs(5)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transient_failures_retry_and_permanent_ones_are_dead_lettered() {
        let ack_wait = Duration::from_secs(5);
        support::transient_failures_retry_and_permanent_ones_are_dead_lettered::<Nats>(ack_wait)
            .await;
    }

    /// Messages are NAKed for later while the store is down.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_outage_acks_nothing_and_loses_nothing() {
        support::a_store_outage_acks_nothing_and_loses_nothing::<Nats>(Duration::from_secs(5))
            .await;
    }

    /// The worker's "work in progress" acks keep the message.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_handler_keeps_its_message() {
        support::a_long_handler_keeps_its_message::<Nats>(Duration::from_secs(1)).await;
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

    /// See [`support::a_killed_worker_process_loses_nothing`](crate::support::a_killed_worker_process_loses_nothing):
    /// JetStream delivers a killed worker's messages again after ack_wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_worker_process_loses_nothing() {
        let Some(nats) = Nats::open("crash", CHILD_REDELIVERY).await else {
            return;
        };
        support::a_killed_worker_process_loses_nothing(&nats, "nats::child_worker_process").await;
        nats.delete().await;
    }
}
