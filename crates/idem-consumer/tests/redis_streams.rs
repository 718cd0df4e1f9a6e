//! The Redis Streams worker against a real Redis (`IDEM_TEST_REDIS_URL`, e.g.
//! `redis://127.0.0.1:6379`), through the shared broker tests (`support/broker.rs`, whose
//! docs say how they run); every test adds to its own streams and deletes them. The
//! store-outage test stops a Redis of its own (the store's); the stream stays.

#![cfg(feature = "redis-streams")]

mod support;

/// Named after the backend, so that `cargo test redis_streams` runs these.
mod redis_streams {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use idem_consumer::redis_streams::{message_of, publish, Topology, Worker};
    use idem_consumer::{ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER};
    use idem_core::Key;
    use redis::aio::ConnectionManager;
    use redis::streams::StreamRangeReply;

    use crate::support::{self, child_env, Running, Spawn, Stop, TestBroker, CHILD_REDELIVERY};

    /// A client of the server, a connection, and fresh streams named after the test.
    struct Streams {
        client: redis::Client,
        conn: ConnectionManager,
        topology: Topology,
    }

    impl Streams {
        async fn xlen(&self, stream: &str) -> u64 {
            redis::cmd("XLEN")
                .arg(stream)
                .query_async(&mut self.conn.clone())
                .await
                .expect("XLEN")
        }

        /// Entries of the group delivered and not acknowledged (`XPENDING`), and entries
        /// not delivered yet (the group's `lag`).
        async fn group_state(&self) -> (u64, u64) {
            let (mut conn, topology) = (self.conn.clone(), &self.topology);
            let pending: Vec<redis::Value> = redis::cmd("XPENDING")
                .arg(&topology.stream)
                .arg(&topology.group)
                .query_async(&mut conn)
                .await
                .expect("XPENDING");
            let pending: u64 = redis::from_redis_value_ref(&pending[0]).expect("a count");
            let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(&topology.stream)
                .query_async(&mut conn)
                .await
                .expect("XINFO GROUPS");
            let group = groups
                .iter()
                .find(|g| {
                    redis::from_redis_value_ref::<String>(&g["name"])
                        .ok()
                        .as_deref()
                        == Some(topology.group.as_str())
                })
                .expect("the group");
            let lag: u64 = redis::from_redis_value_ref(&group["lag"]).expect("a lag");
            (pending, lag)
        }
    }

    impl TestBroker for Streams {
        async fn open(test: &str, claim_idle: Duration) -> Option<Self> {
            let url = idem_testkit::harness::redis_url()?;
            let client = redis::Client::open(url).expect("a Redis URL");
            let mut conn = client.get_connection_manager().await.expect("connect");
            let topology = Topology::new(format!(
                "idem-test-{test}-{}",
                uuid::Uuid::new_v4().simple()
            ))
            .with_claim_idle(claim_idle);
            topology.declare(&mut conn).await.expect("declare");
            Some(Self {
                client,
                conn,
                topology,
            })
        }

        async fn publish(&self, key: &str, payload: &str) {
            let key = Key::new(key).expect("test keys are valid");
            let stream = &self.topology.stream;
            publish(
                &mut self.conn.clone(),
                stream,
                payload.as_bytes(),
                &key,
                None,
            )
            .await
            .expect("XADD");
        }

        /// The worker makes its connections from the client.
        fn worker(&self, spawn: Spawn, stop: Stop) -> Running {
            let client = std::future::ready(self.client.clone());
            support::run_test_worker!(spawn, stop, client, |consumer, tuning| {
                Worker::new(consumer, self.topology.clone())
                    .with_concurrency(tuning.concurrency)
                    .with_batch(tuning.batch)
            })
        }

        async fn from_child_env() -> Self {
            let client =
                redis::Client::open(child_env("IDEM_TEST_REDIS_URL")).expect("a Redis URL");
            let conn = client.get_connection_manager().await.expect("connect");
            let topology =
                Topology::new(child_env("IDEM_CHILD_STREAM")).with_claim_idle(CHILD_REDELIVERY);
            Self {
                client,
                conn,
                topology,
            }
        }

        async fn unsettled(&self) -> u64 {
            let (pending, lag) = self.group_state().await;
            pending + lag
        }

        async fn dead_letter_count(&self) -> u64 {
            self.xlen(&self.topology.dead_letter_stream).await
        }

        async fn dead_letters(&self) -> BTreeMap<String, (String, String)> {
            let letters: StreamRangeReply = redis::cmd("XRANGE")
                .arg(&self.topology.dead_letter_stream)
                .arg("-")
                .arg("+")
                .query_async(&mut self.conn.clone())
                .await
                .expect("XRANGE");
            let mut dead = BTreeMap::new();
            for letter in &letters.ids {
                let message = message_of(letter);
                let header = |name: &str| {
                    message
                        .text_header(name)
                        .unwrap_or_else(|| panic!("dead letter without {name}"))
                        .to_owned()
                };
                dead.insert(
                    header(IDEMPOTENCY_KEY_HEADER),
                    (header(DEAD_LETTER_REASON_HEADER), header(ATTEMPT_HEADER)),
                );
            }
            dead
        }

        fn child_env(&self) -> Vec<(&'static str, String)> {
            let url = idem_testkit::harness::redis_url().expect("a Redis URL");
            vec![
                ("IDEM_TEST_REDIS_URL", url),
                ("IDEM_CHILD_STREAM", self.topology.stream.clone()),
            ]
        }

        async fn check_all_acked(&self, messages: u64) {
            assert_eq!(self.xlen(&self.topology.stream).await, messages);
            assert_eq!(self.group_state().await, (0, 0));
        }

        async fn delete(&self) {
            self.topology
                .delete(&mut self.conn.clone())
                .await
                .expect("delete the streams");
        }
    }

    // A short claim idle time for the retries: copies read early wait at most this long.
    // Entries stay pending while the store is down; heartbeats stop the other worker from
    // claiming a long handler's entry; a killed worker's entries are claimed (XAUTOCLAIM)
    // once they have been idle for the claim idle time.
    support::broker_tests!(
        redis_streams: Streams,
        retries: Duration::from_millis(300),
        copies: Duration::from_secs(5),
        outage: Duration::from_millis(500),
        long: Duration::from_secs(1)
    );
}
