//! The JetStream worker against a real `nats-server -js` (`IDEM_TEST_NATS_URL`, e.g.
//! `nats://127.0.0.1:4222`), through the shared broker tests (`support/broker.rs`, whose
//! docs say how they run); every test creates its own streams and deletes them.

#![cfg(feature = "nats")]

mod support;

/// Named after the backend, so that `cargo test nats` runs these.
mod nats {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use async_nats::jetstream::{self, Context as JetStream};
    use async_nats::HeaderMap;
    use idem_consumer::nats::{with_idempotency_key, Topology, Worker};
    use idem_consumer::{ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER};
    use idem_core::Key;

    use crate::support::{self, child_env, Running, Spawn, Stop, TestBroker};

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

        fn worker(&self, spawn: Spawn, stop: Stop) -> Running {
            let url = self.url.clone();
            let js = async move { connect(&url).await };
            support::run_test_worker!(spawn, stop, js, |consumer, tuning| {
                Worker::new(consumer, self.topology.clone())
                    .with_concurrency(tuning.concurrency)
                    .with_batch(tuning.batch)
            })
        }

        async fn from_child_env() -> Self {
            let url = child_env("IDEM_TEST_NATS_URL");
            let topology = Topology::new(
                child_env("IDEM_CHILD_STREAM"),
                child_env("IDEM_CHILD_SUBJECT"),
            );
            let js = connect(&url).await;
            Self { url, js, topology }
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

    // With the store down, messages are NAKed for later; "work in progress" acks keep a long
    // handler's message; JetStream delivers a killed worker's messages again after ack_wait.
    support::broker_tests!(
        nats: Nats,
        retries: Duration::from_secs(5),
        copies: Duration::from_secs(5),
        outage: Duration::from_secs(5),
        long: Duration::from_secs(1)
    );
}
