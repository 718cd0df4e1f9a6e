//! The Redis Streams worker against a real Redis (`IDEM_TEST_REDIS_URL`, e.g.
//! `redis://127.0.0.1:6379`). Without it each test prints why and returns, or fails when
//! `IDEM_TEST_REQUIRE_BACKENDS=1`.
//!
//! Every test adds to its own uniquely named streams and deletes them at the end. The
//! crash test runs worker *processes* (this test binary again, running the ignored test
//! `child_worker_process`), sharing their store in the same Redis under a key prefix of
//! their own; the store-outage test stops a Redis server of its own (the store's), while
//! the stream stays on `IDEM_TEST_REDIS_URL`.

#![cfg(feature = "redis-streams")]

mod support;

/// Named after the backend, so that `cargo test redis_streams` runs these.
mod redis_streams {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use idem_consumer::redis_streams::{message_of, publish, Error, Topology, Worker};
    use idem_consumer::{
        Consumer, Policy, Summary, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER,
        IDEMPOTENCY_KEY_HEADER,
    };
    use idem_core::{Idem, Key, MemoryStore, Scope, Store};
    use idem_redis::RedisStore;
    use redis::aio::ConnectionManager;
    use redis::streams::StreamRangeReply;
    use tokio::sync::oneshot;
    use tokio::time::{sleep, timeout};

    use crate::support::{
        check_crash, check_dead_letters, check_retry_runs, child_env, counting, failing,
        retry_keys, retry_policy, start_and_kill_a, start_b, stop_child, wait_until, ChildFiles,
        ChildSetup, Effects, Handler, Runs, SharedStore, CHILD_CONCURRENCY, CHILD_REDELIVERY,
        CRASH_MESSAGES,
    };

    /// The server's URL, a client and a connection, and fresh streams named after the test
    /// (with `claim_idle`), declared. `None` when no server is configured.
    async fn broker(
        test: &str,
        claim_idle: Duration,
    ) -> Option<(redis::Client, ConnectionManager, Topology)> {
        let url = idem_testkit::harness::redis_url()?;
        let client = redis::Client::open(url).expect("a Redis URL");
        let mut conn = client.get_connection_manager().await.expect("connect");
        let topology = Topology::new(format!(
            "idem-test-{test}-{}",
            uuid::Uuid::new_v4().simple()
        ))
        .with_claim_idle(claim_idle);
        topology.declare(&mut conn).await.expect("declare");
        Some((client, conn, topology))
    }

    async fn add(conn: &mut ConnectionManager, stream: &str, key: &str, payload: &str) {
        let key = Key::new(key).expect("test keys are valid");
        publish(conn, stream, payload.as_bytes(), &key, None)
            .await
            .expect("XADD");
    }

    async fn xlen(conn: &mut ConnectionManager, stream: &str) -> u64 {
        redis::cmd("XLEN")
            .arg(stream)
            .query_async(conn)
            .await
            .expect("XLEN")
    }

    /// Entries of the group delivered and not acknowledged (`XPENDING`), and entries not
    /// delivered yet (the group's `lag`).
    async fn group_state(conn: &mut ConnectionManager, topology: &Topology) -> (u64, u64) {
        let pending: Vec<redis::Value> = redis::cmd("XPENDING")
            .arg(&topology.stream)
            .arg(&topology.group)
            .query_async(conn)
            .await
            .expect("XPENDING");
        let pending: u64 = redis::from_redis_value_ref(&pending[0]).expect("a count");
        let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&topology.stream)
            .query_async(conn)
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

    /// Waits until the group has had nothing pending or undelivered for 500 ms.
    async fn wait_until_settled(
        conn: &mut ConnectionManager,
        topology: &Topology,
        limit: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + limit;
        let mut settled_since: Option<tokio::time::Instant> = None;
        loop {
            if group_state(conn, topology).await != (0, 0) {
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
                "the entries were not all acknowledged"
            );
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `worker` in a task until the returned sender is used (or dropped).
    fn spawn_worker(
        worker: Worker,
        client: redis::Client,
        handler: Handler,
    ) -> (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<Summary, Error>>,
    ) {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            worker
                .run(&client, move |m, c| handler(m, c), async {
                    let _ = stopped.await;
                })
                .await
        });
        (stop, task)
    }

    /// Each message added 5 times and consumed by 4 concurrent workers (sharing a store):
    /// one side effect per message, every copy acknowledged, nothing dead-lettered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_copies_to_four_workers_have_one_effect() {
        let Some((client, mut conn, topology)) = broker("copies", Duration::from_secs(5)).await
        else {
            return;
        };
        const N: u32 = 20;
        for _copy in 0..5 {
            for i in 0..N {
                let payload = format!(r#"{{"order": {i}}}"#);
                add(&mut conn, &topology.stream, &format!("order-{i}"), &payload).await;
            }
        }
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let consumer = Consumer::new(Idem::from_arc(store), Scope::new("copies-test").unwrap())
            .with_policy(Policy::default().with_max_in_flight_delay(Duration::from_millis(100)));
        let effects: Effects = Arc::default();
        let mut workers = Vec::new();
        for _ in 0..4 {
            workers.push(spawn_worker(
                Worker::new(consumer.clone(), topology.clone()).with_concurrency(3),
                client.clone(),
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
        wait_until_settled(&mut conn, &topology, Duration::from_secs(60)).await;
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
        assert_eq!(acked, u64::from(5 * N), "every copy was acknowledged");
        assert_eq!(xlen(&mut conn, &topology.dead_letter_stream).await, 0);
        topology
            .delete(&mut conn)
            .await
            .expect("delete the streams");
    }

    /// A handler that fails transiently succeeds in the end, once; one that always fails is
    /// dead-lettered after the policy's attempts, and one that fails for good at once. The
    /// retry copies and dead letters are counted on the server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transient_failures_retry_and_permanent_ones_are_dead_lettered() {
        // A short claim idle time: retry copies read early wait at most this long.
        let claim_idle = Duration::from_millis(300);
        let Some((client, mut conn, topology)) = broker("retries", claim_idle).await else {
            return;
        };
        let (flaky, broken) = retry_keys();
        for key in flaky.iter().chain(&broken) {
            add(&mut conn, &topology.stream, key, "{}").await;
        }
        add(&mut conn, &topology.stream, "declined", "{}").await;
        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("retry-test").unwrap(),
        )
        .with_policy(retry_policy());
        let runs: Runs = Arc::default();
        let effects: Effects = Arc::default();
        let (stop, task) = spawn_worker(
            Worker::new(consumer, topology.clone()).with_concurrency(2),
            client.clone(),
            failing(&runs, &effects),
        );
        let dead_stream = topology.dead_letter_stream.clone();
        wait_until(Duration::from_secs(60), "4 dead letters", || {
            let (mut conn, dead_stream) = (conn.clone(), dead_stream.clone());
            async move { xlen(&mut conn, &dead_stream).await == 4 }
        })
        .await;
        wait_until(Duration::from_secs(60), "the flaky ones succeed", || {
            let effects = effects.clone();
            async move { effects.lock().unwrap().len() == 5 }
        })
        .await;
        wait_until_settled(&mut conn, &topology, Duration::from_secs(30)).await;
        let _ = stop.send(());
        let summary = task.await.expect("no panic").expect("the worker ran");
        check_retry_runs(&runs, &effects, &summary);
        // On the server: the 9 originals and 16 retry copies, all acknowledged; 4 dead
        // letters.
        assert_eq!(xlen(&mut conn, &topology.stream).await, 9 + 16);
        assert_eq!(group_state(&mut conn, &topology).await, (0, 0));

        // Each dead letter says why, and how many attempts it had.
        let letters: StreamRangeReply = redis::cmd("XRANGE")
            .arg(&topology.dead_letter_stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
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
        check_dead_letters(&dead);
        topology
            .delete(&mut conn)
            .await
            .expect("delete the streams");
    }

    /// With the store down, the worker runs no handler and acknowledges nothing: every entry
    /// stays pending. When the store is back, each is processed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_outage_acks_nothing_and_loses_nothing() {
        let Some((client, mut conn, topology)) = broker("outage", Duration::from_millis(500)).await
        else {
            return;
        };
        let Some(mut redis) = idem_testkit::redis::throwaway(&[]) else {
            return;
        };
        const N: u32 = 8;
        for i in 0..N {
            add(&mut conn, &topology.stream, &format!("job-{i}"), "{}").await;
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
            client.clone(),
            counting(&effects, Duration::ZERO),
        );
        sleep(Duration::from_secs(3)).await;
        assert!(
            effects.lock().unwrap().is_empty(),
            "no handler ran unguarded"
        );
        assert_eq!(
            group_state(&mut conn, &topology).await,
            (u64::from(N), 0),
            "every entry was read and none acknowledged"
        );

        redis.start_again().expect("the store is back");
        wait_until(Duration::from_secs(60), "every job has its effect", || {
            let effects = effects.clone();
            async move { effects.lock().unwrap().len() == N as usize }
        })
        .await;
        wait_until_settled(&mut conn, &topology, Duration::from_secs(30)).await;
        let _ = stop.send(());
        let summary = task.await.expect("no panic").expect("the worker ran");
        for (key, count) in effects.lock().unwrap().iter() {
            assert_eq!(*count, 1, "{key} had its effect {count} times");
        }
        assert!(summary.requeued >= u64::from(N), "{summary:?}");
        assert_eq!(summary.acked, u64::from(N), "{summary:?}");
        topology
            .delete(&mut conn)
            .await
            .expect("delete the streams");
    }

    /// A handler that runs for several claim idle times keeps its entry: the worker's
    /// heartbeats stop the other worker from claiming it (which would hand it back, the key
    /// being held).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_handler_keeps_its_entry() {
        let claim_idle = Duration::from_secs(1);
        let Some((client, mut conn, topology)) = broker("long", claim_idle).await else {
            return;
        };
        add(&mut conn, &topology.stream, "slow-1", "{}").await;
        let consumer = Consumer::new(
            Idem::new(MemoryStore::new()),
            Scope::new("long-test").unwrap(),
        );
        let effects: Effects = Arc::default();
        let mut workers = Vec::new();
        for _ in 0..2 {
            workers.push(spawn_worker(
                Worker::new(consumer.clone(), topology.clone()).with_batch(1),
                client.clone(),
                counting(&effects, claim_idle * 4),
            ));
        }
        wait_until(Duration::from_secs(30), "the handler finishes", || {
            let effects = effects.clone();
            async move { !effects.lock().unwrap().is_empty() }
        })
        .await;
        wait_until_settled(&mut conn, &topology, Duration::from_secs(30)).await;
        let mut total = Summary::default();
        for (stop, task) in workers {
            let _ = stop.send(());
            let summary = task.await.expect("no panic").expect("the worker ran");
            total.acked += summary.acked;
            total.requeued += summary.requeued;
        }
        assert_eq!((total.acked, total.requeued), (1, 0), "{total:?}");
        topology
            .delete(&mut conn)
            .await
            .expect("delete the streams");
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
        let topology =
            Topology::new(child_env("IDEM_CHILD_STREAM")).with_claim_idle(CHILD_REDELIVERY);
        let client = redis::Client::open(child_env("IDEM_TEST_REDIS_URL")).expect("a Redis URL");
        let handler = child.handler.clone();
        let summary = Worker::new(child.consumer.clone(), topology)
            .with_name(format!("crash-{}", child.name))
            .with_concurrency(CHILD_CONCURRENCY)
            .with_batch(CHILD_CONCURRENCY)
            .run(&client, move |m, c| handler(m, c), child.stopped())
            .await
            .expect("the worker runs");
        child.report(&summary);
    }

    /// Kill a worker process (SIGKILL) while its handlers hold keys: once its entries have
    /// been idle for the claim idle time, another worker claims them (`XAUTOCLAIM`), leaves
    /// them pending while the dead worker's leases hold, then takes the keys over. Every
    /// entry is handled exactly once and none is lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_worker_process_loses_nothing() {
        let Some((_client, mut conn, topology)) = broker("crash", CHILD_REDELIVERY).await else {
            return;
        };
        let Some(shared) = SharedStore::for_test() else {
            return;
        };
        for _copy in 0..2 {
            for i in 0..CRASH_MESSAGES {
                let payload = format!("{{\"i\":{i}}}");
                add(&mut conn, &topology.stream, &format!("msg-{i}"), &payload).await;
            }
        }
        let files = ChildFiles::new();
        let env = [
            ("IDEM_TEST_REDIS_URL", shared.url.clone()),
            ("IDEM_CHILD_STREAM", topology.stream.clone()),
            ("IDEM_CHILD_STORE", shared.descriptor()),
        ];
        const CHILD: &str = "redis_streams::child_worker_process";
        let hung = start_and_kill_a(&files, CHILD, &env).await;
        let mut b = start_b(&files, CHILD, &env).await;
        wait_until_settled(&mut conn, &topology, Duration::from_secs(60)).await;
        let summary = stop_child(&files, &mut b, "B").await;
        check_crash(&files, &hung, &summary);
        assert_eq!(xlen(&mut conn, &topology.dead_letter_stream).await, 0);
        topology
            .delete(&mut conn)
            .await
            .expect("delete the streams");
    }
}
