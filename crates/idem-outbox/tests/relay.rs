//! The relay worker against real PostgreSQL and Redis: a Redis outage while completions
//! keep committing, four relays at once, dead letters, clean shutdown. `idem relay` (the
//! binary's command) has its own tests in crates/idem-cli/tests/relay.rs.
//!
//! Needs `IDEM_TEST_DATABASE_URL` and `IDEM_TEST_REDIS_URL` (see `idem_testkit::harness`);
//! the outage test starts its own `redis-server`. Every test works in a PostgreSQL schema of
//! its own (`idem_t_<unix seconds>_<random>`, swept by the PostgreSQL tests after an hour)
//! and a Redis key prefix of its own.

mod relay {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::{
        Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, Lease, RecordId,
        RecordState, Response, Scope, Store,
    };
    use idem_outbox::{Relay, RelayConfig, TieredStore};
    use idem_postgres::PgStore;
    use idem_redis::{RedisConfig, RedisStore};
    use idem_testkit::harness;
    use idem_testkit::redis::{self as testing, RedisServer};
    use tokio::sync::watch;
    use tokio::time::{sleep, timeout, Instant};

    const LEASE: Duration = Duration::from_secs(60);
    const KEEP: Duration = Duration::from_secs(600);
    /// The longest any test waits for the relay to catch up: generous for a loaded 2-core
    /// machine; the tests never assert speed.
    const PATIENCE: Duration = Duration::from_secs(30);

    // --- harness -------------------------------------------------------------------------------

    struct Env {
        pg: PgStore,
        redis: RedisStore,
        tiered: TieredStore,
        scope: Scope,
    }

    async fn pg_store(url: &str) -> PgStore {
        let pool = PgStore::pool_options()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(15))
            .connect(url)
            .await
            .expect("connect to IDEM_TEST_DATABASE_URL");
        let store = PgStore::new(pool)
            .with_schema(&harness::unique_name("idem_t_"))
            .expect("a valid schema name");
        idem_outbox::migrate(&store).await.expect("migrate");
        store
    }

    async fn redis_store(url: &str, prefix: &str) -> RedisStore {
        RedisStore::builder(url)
            // No reconnection attempts inside a call: with Redis down (the outage test),
            // every call fails at once instead of after a few paced retries.
            .with_config(RedisConfig::default().with_reconnect_retries(0))
            .with_prefix(prefix)
            .with_timeouts(Duration::from_secs(1), Duration::from_secs(10))
            .connect()
            .await
            .expect("connect to Redis")
    }

    /// PostgreSQL from the harness, Redis at `redis_url` (the harness's when `None`), a fresh
    /// schema, prefix and scope. `None` when a backend is missing and not required.
    async fn env(redis_url: Option<String>) -> Option<Env> {
        let db_url = harness::database_url()?;
        let redis_url = match redis_url {
            Some(url) => url,
            None => harness::redis_url()?,
        };
        let prefix = format!("idem-relay-test-{}:", uuid::Uuid::new_v4().simple());
        let pg = pg_store(&db_url).await;
        let redis = redis_store(&redis_url, &prefix).await;
        Some(Env {
            tiered: TieredStore::new(redis.clone(), pg.clone()),
            pg,
            redis,
            scope: Scope::new(format!("relay-{}", uuid::Uuid::new_v4().simple())).expect("scope"),
        })
    }

    impl Env {
        fn relay(&self, config: RelayConfig) -> Relay {
            Relay::new(self.pg.clone(), self.redis.clone()).with_config(config)
        }

        fn id(&self, i: usize) -> RecordId {
            RecordId::new(self.scope.clone(), Key::new(format!("k{i}")).expect("key"))
        }

        /// Begins key `i`'s request on `store`.
        async fn begin_on(&self, store: &dyn Store, i: usize) -> Begin {
            let id = self.id(i);
            let req = BeginRequest {
                id: &id,
                fingerprint: fingerprint(i),
                token: FencingToken::random(),
                lease: LEASE,
                retention: KEEP,
            };
            store.begin(req).await.expect("begin")
        }

        /// Begins key `i` through the tiered store (Redis and PostgreSQL grant the lease).
        async fn begin(&self, i: usize) -> Lease {
            match self.begin_on(&self.tiered, i).await {
                Begin::Acquired(lease) => lease,
                other => panic!("key {i}: expected a fresh lease, got {other:?}"),
            }
        }

        /// Commits key `i`'s completion in a business transaction and does not publish it: the
        /// relay is the only way it reaches Redis.
        async fn commit_unpublished(&self, i: usize) {
            let lease = self.begin(i).await;
            let mut tx = self.pg.pool().begin().await.expect("transaction");
            self.tiered
                .complete_in(&mut tx, &lease, &completion(i), KEEP)
                .await
                .expect("complete_in");
            tx.commit().await.expect("commit");
        }

        /// Commits keys `range` with `tasks` concurrent writers.
        async fn commit_many(self: &Arc<Self>, range: std::ops::Range<usize>, tasks: usize) {
            let mut handles = Vec::new();
            for t in 0..tasks {
                let env = self.clone();
                let range = range.clone();
                handles.push(tokio::spawn(async move {
                    for i in range.skip(t).step_by(tasks) {
                        env.commit_unpublished(i).await;
                    }
                }));
            }
            for h in handles {
                h.await.expect("writer task");
            }
        }

        async fn outbox_rows(&self) -> i64 {
            sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {}.outbox",
                self.pg.quoted_schema()
            ))
            .fetch_one(self.pg.pool())
            .await
            .expect("count outbox rows")
        }

        async fn wait_outbox_empty(&self) {
            eventually("the outbox empty", Duration::from_millis(50), || async {
                (self.outbox_rows().await == 0).then_some(())
            })
            .await;
        }

        /// [`Env::assert_in_redis`] for every key of `keys`.
        async fn assert_all_in_redis(&self, keys: std::ops::Range<usize>) {
            for i in keys {
                self.assert_in_redis(i).await;
            }
        }

        /// Asserts that Redis holds key `i` completed with its own completion.
        async fn assert_in_redis(&self, i: usize) {
            let record = self
                .redis
                .get(&self.id(i))
                .await
                .expect("Redis get")
                .unwrap_or_else(|| panic!("key {i} is not in Redis"));
            match record.state {
                RecordState::Completed(c) => assert_eq!(c, completion(i), "key {i}"),
                other => panic!("key {i} is not completed in Redis: {other:?}"),
            }
        }

        async fn drop_schema(&self) {
            let _ = sqlx::query(&format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                self.pg.quoted_schema()
            ))
            .execute(self.pg.pool())
            .await;
        }
    }

    fn fingerprint(i: usize) -> Fingerprint {
        Fingerprint::of_bytes(format!("request {i}").as_bytes())
    }

    fn completion(i: usize) -> Completion {
        Completion::succeeded(
            Response::new(201, format!("payment {i}")).with_header("x-request", i.to_string()),
        )
    }

    fn fast() -> RelayConfig {
        RelayConfig::default()
            .with_poll_interval(Duration::from_millis(50))
            .with_outage_backoff_cap(Duration::from_millis(500))
            .with_gauge_interval(Duration::from_millis(100))
    }

    /// [`harness::eventually`] within [`PATIENCE`].
    async fn eventually<T, F>(what: &str, every: Duration, check: impl FnMut() -> F) -> T
    where
        F: std::future::Future<Output = Option<T>>,
    {
        harness::eventually(what, PATIENCE, every, check).await
    }

    /// A relay running in a task of its own until [`Running::stop`].
    struct Running {
        stop: watch::Sender<bool>,
        task: tokio::task::JoinHandle<()>,
    }

    /// Runs `relay` (its `run` loop) in a task of its own.
    fn start(relay: &Relay) -> Running {
        let (stop, mut stopped) = watch::channel(false);
        let relay = relay.clone();
        let task = tokio::spawn(async move {
            relay
                .run(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
        Running { stop, task }
    }

    impl Running {
        /// Sends the shutdown signal and waits for `run` to return; fails the test with
        /// `what` (what should have happened) when it does not within [`PATIENCE`].
        async fn stop(self, what: &str) {
            self.stop.send(true).expect("relay still running");
            timeout(PATIENCE, self.task)
                .await
                .unwrap_or_else(|_| panic!("{what}"))
                .expect("relay task");
        }
    }

    /// An environment whose Redis is a throwaway server of its own, for tests that stop or
    /// pause it; `None` when a backend is missing and not required.
    async fn env_with_own_redis() -> Option<(RedisServer, Env)> {
        harness::database_url()?;
        let server = testing::throwaway(&[])?;
        let env = env(Some(server.url())).await?;
        Some((server, env))
    }

    // --- tests ---------------------------------------------------------------------------------

    /// Redis stopped while completions keep committing: they commit in PostgreSQL alone, the
    /// backlog grows and nothing goes dead; Redis back (empty), the relay drains the backlog
    /// into it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn redis_outage_grows_the_backlog_then_drains() {
        let Some((mut server, env)) = env_with_own_redis().await else {
            return;
        };
        let relay = env.relay(fast());
        let running = start(&relay);

        // Redis up: published at once, and relayed (found completed) soon after.
        for i in 0..10 {
            let lease = env.begin(i).await;
            env.tiered
                .complete(&lease, &completion(i), KEEP)
                .await
                .expect("complete");
        }
        env.wait_outbox_empty().await;

        // Redis down: begin and complete are answered by PostgreSQL; publishing fails quietly.
        server.stop();
        const DOWN: std::ops::Range<usize> = 10..50;
        for i in DOWN {
            let lease = env.begin(i).await;
            env.tiered
                .complete(&lease, &completion(i), KEEP)
                .await
                .expect("complete with Redis down");
        }
        // The relay keeps failing whole batches (outages), never single rows.
        eventually(
            "outages seen by the relay",
            Duration::from_millis(50),
            || async { (relay.metrics().outages_total >= 2).then_some(()) },
        )
        .await;
        let during = relay.observe().await.expect("observe");
        assert_eq!(during.backlog, DOWN.len() as u64, "{during:?}");
        assert!(during.lag_seconds > 0.0, "{during:?}");
        assert_eq!(during.dead, 0, "{during:?}");
        assert_eq!(during.failed_total, 0, "{during:?}");

        // Redis back, empty: the backlog drains into it.
        server.start_again().expect("restart redis-server");
        env.wait_outbox_empty().await;
        env.assert_all_in_redis(DOWN).await;
        let after = relay.observe().await.expect("observe");
        assert_eq!((after.backlog, after.dead, after.failed_total), (0, 0, 0));
        assert!(after.relayed_total >= 10 + DOWN.len() as u64, "{after:?}");
        // And a retry of one of them is a replay, answered by Redis now.
        match env.begin_on(&env.redis, DOWN.start).await {
            Begin::Replay(replay) => assert_eq!(replay.completion, completion(DOWN.start)),
            other => panic!("expected a replay from Redis, got {other:?}"),
        }

        running.stop("the relay stops").await;
        env.drop_schema().await;
    }

    /// Four relays drain one outbox while completions commit: every row is relayed and
    /// deleted exactly once between them, and Redis ends with every completion.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn four_relays_share_the_outbox() {
        let Some(env) = env(None).await else { return };
        let env = Arc::new(env);
        let relays: Vec<Relay> = (0..4)
            .map(|_| env.relay(RelayConfig::default().with_batch(25)))
            .collect();
        let running: Vec<Running> = relays.iter().map(start).collect();

        const ROWS: usize = 600;
        env.commit_many(0..ROWS, 8).await;
        env.wait_outbox_empty().await;
        for relay in running {
            relay.stop("a relay stops").await;
        }

        // Each row was deleted by exactly one committed batch.
        let relayed: u64 = relays.iter().map(|r| r.metrics().relayed_total).sum();
        assert_eq!(relayed, ROWS as u64);
        assert!(relays.iter().all(|r| r.metrics().failed_total == 0));
        env.assert_all_in_redis(0..ROWS).await;
        env.drop_schema().await;
    }

    /// A row that cannot be applied does not hold up the rest, goes dead after the maximum
    /// tries with its error, is listed, and a retry makes it pending again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_that_keeps_failing_goes_dead_and_can_be_retried() {
        let Some(env) = env(None).await else { return };
        let schema = env.pg.quoted_schema().to_owned();
        // A good row, and a row whose metadata is not a completion's.
        env.commit_unpublished(1).await;
        let bad: i64 = sqlx::query_scalar(&format!(
            "INSERT INTO {schema}.outbox \
             (scope, key, fingerprint, token, attempt, meta, body, expires_at) \
         VALUES ($1, 'broken', $2, $3, 1, '\\xff'::bytea, '', now() + interval '1 hour') \
         RETURNING id"
        ))
        .bind(env.scope.as_str().as_bytes())
        .bind(vec![0u8; 32])
        .bind(uuid::Uuid::new_v4())
        .fetch_one(env.pg.pool())
        .await
        .expect("insert a corrupt row");

        let relay = env.relay(
            RelayConfig::default()
                .with_max_tries(3)
                .with_backoff_base(Duration::from_millis(20))
                .with_backoff_cap(Duration::from_millis(40)),
        );
        let first = relay.relay_batch().await.expect("batch");
        assert_eq!((first.claimed, first.relayed, first.failed), (2, 1, 1));
        env.assert_in_redis(1).await;

        // Two more failed tries (after their backoff): dead.
        let mut tries = 1;
        let started = Instant::now();
        while tries < 3 {
            assert!(started.elapsed() < PATIENCE, "the row was not retried");
            sleep(Duration::from_millis(30)).await;
            let batch = relay.relay_batch().await.expect("batch");
            tries += batch.failed;
            assert_eq!(batch.dead, usize::from(tries == 3), "after {tries} tries");
        }
        // Dead rows are not claimed any more.
        sleep(Duration::from_millis(60)).await;
        assert_eq!(relay.relay_batch().await.expect("batch").claimed, 0);
        let metrics = relay.observe().await.expect("observe");
        assert_eq!((metrics.dead, metrics.backlog), (1, 0), "{metrics:?}");
        assert_eq!(metrics.failed_total, 3);

        let dead = relay.outbox().dead_entries(10).await.expect("dead entries");
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].id, dead[0].key.as_str(), dead[0].tries),
            (bad, "broken", 3)
        );
        let error = dead[0].last_error.as_deref().unwrap_or_default();
        assert!(error.contains("corrupt"), "last error: {error}");

        // Retried by id: pending again, tries reset, claimed again.
        assert_eq!(
            relay
                .outbox()
                .retry_dead(Some(&[bad]))
                .await
                .expect("retry"),
            1
        );
        assert!(relay
            .outbox()
            .dead_entries(10)
            .await
            .expect("dead")
            .is_empty());
        let again = relay.relay_batch().await.expect("batch");
        assert_eq!((again.claimed, again.failed, again.dead), (1, 1, 0));
        env.drop_schema().await;
    }

    /// A shutdown signal while the relay drains: `run` returns; every row it counted as
    /// relayed is gone and every row left is untouched (no half-done batch).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn shutdown_finishes_the_batch_and_returns() {
        const ROWS: usize = 800;
        let Some(env) = env(None).await else { return };
        let env = Arc::new(env);
        env.commit_many(0..ROWS, 8).await;
        let relay = env.relay(RelayConfig::default().with_batch(10));
        let running = start(&relay);
        eventually("the relay started", Duration::from_millis(1), || async {
            (relay.metrics().relayed_total >= 30).then_some(())
        })
        .await;
        running.stop("run returns after the signal").await;

        let relayed = relay.metrics().relayed_total;
        let left = env.outbox_rows().await;
        assert!(
            left > 0,
            "drained everything before the signal: nothing was tested"
        );
        assert_eq!(relayed + left as u64, ROWS as u64);
        let touched: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {}.outbox WHERE tries > 0 OR dead",
            env.pg.quoted_schema()
        ))
        .fetch_one(env.pg.pool())
        .await
        .expect("count");
        assert_eq!(touched, 0);
        // Nothing holds the remaining rows: a new batch claims them at once.
        let next = relay.relay_batch().await.expect("batch");
        assert_eq!(next.claimed, 10);
        env.drop_schema().await;
    }

    /// A shutdown signal while a batch is in hand (claimed, its Redis calls held up by
    /// `CLIENT PAUSE`): `run` does not abandon it but waits for Redis, applies and commits
    /// the batch, then returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn shutdown_mid_batch_commits_the_batch_in_hand() {
        let Some((server, env)) = env_with_own_redis().await else {
            return;
        };
        const ROWS: usize = 20;
        for i in 0..ROWS {
            env.commit_unpublished(i).await;
        }
        let relay = env.relay(fast());
        // Warm the relay's Redis connection up (and its eviction-policy check): an empty
        // batch does not touch Redis, so ask for a record.
        env.redis.get(&env.id(0)).await.expect("Redis answers");
        // Writes (scripts included) from every client wait for 3 s from now.
        server
            .cli(&["client", "pause", "3000", "WRITE"])
            .expect("CLIENT PAUSE");
        let running = start(&relay);
        // Wait until the relay holds every row: a batch is in hand, stuck on Redis.
        let schema = env.pg.quoted_schema().to_owned();
        let unlocked = format!(
            "SELECT count(*) FROM (SELECT id FROM {schema}.outbox FOR UPDATE SKIP LOCKED) AS f"
        );
        eventually(
            "the relay claimed the rows",
            Duration::from_millis(10),
            || async {
                let mut tx = env.pg.pool().begin().await.expect("transaction");
                let free: i64 = sqlx::query_scalar(&unlocked)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("count unlocked rows");
                tx.rollback().await.expect("rollback");
                (free == 0).then_some(())
            },
        )
        .await;
        assert_eq!(relay.metrics().relayed_total, 0, "Redis is paused");
        running.stop("run returns once the batch is done").await;
        // The batch in hand was finished, not dropped: applied, deleted, committed.
        assert_eq!(relay.metrics().relayed_total, ROWS as u64);
        assert_eq!(env.outbox_rows().await, 0);
        env.assert_all_in_redis(0..ROWS).await;
        env.drop_schema().await;
    }
}
