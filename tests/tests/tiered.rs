//! The tiered store (Redis first, PostgreSQL as the arbiter): the conformance suite, and the
//! guarantees of the outbox: completions commit with the business transaction, Redis losing
//! everything never lets a retry run the work again, and two business transactions for one
//! key never both commit.
//!
//! Needs `IDEM_TEST_REDIS_URL` and `IDEM_TEST_DATABASE_URL`; tests that flush or stop Redis
//! start their own `redis-server`. Each test has its own key prefix and schema
//! (`idem_t_<unix seconds>_<random>`, swept by the Postgres tests after an hour).

mod common;

mod tiered {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::{
        Begin, Completion, Error, Fingerprint, Lease, RecordId, RecordState, Response, Store,
    };
    use idem_outbox::TieredStore;
    use idem_postgres::PgStore;
    use idem_redis::RedisStore;
    use idem_testkit::harness;
    use idem_testkit::postgres as pg;
    use idem_testkit::redis::{throwaway, RedisServer};
    use idem_tests::{create_work_table, id, insert_work, request, runs, KEEP, LONG};
    use sqlx::PgConnection;
    use tokio::time::{sleep, timeout};

    use crate::common::{patient_builder, redis_pid, Stopped};

    /// Tiers `redis` over `pg`, as patient with Redis as [`patient_builder`]'s timeouts.
    pub(super) fn tiered_over(redis: RedisStore, pg: PgStore) -> TieredStore {
        TieredStore::new(redis, pg).with_redis_timeout(Duration::from_secs(15))
    }

    async fn redis_tier(url: &str) -> RedisStore {
        patient_builder(url, "idem-tiered")
            .connect_lazy()
            .expect("a lazy Redis store builds without a server")
    }

    pub(super) async fn pg_tier() -> Option<PgStore> {
        let pg = pg::fresh_store(8).await?;
        idem_outbox::migrate(&pg).await.expect("migrate");
        Some(pg)
    }

    /// A tiered store over a `redis-server` of its own (for the tests that flush or stop it)
    /// and a fresh schema, and that server.
    async fn on_a_throwaway_redis() -> Option<(RedisServer, TieredStore)> {
        let server = throwaway(&[])?;
        let store = tiered_over(redis_tier(&server.url()).await, pg_tier().await?);
        Some((server, store))
    }

    /// A tiered store over the shared Redis and a fresh schema.
    async fn tiered() -> Option<TieredStore> {
        let redis_url = harness::redis_url()?;
        let pg = pg_tier().await?;
        Some(tiered_over(redis_tier(&redis_url).await, pg))
    }

    async fn store() -> Option<Arc<dyn Store>> {
        Some(Arc::new(tiered().await?))
    }

    /// Both tiers pointed at ports nothing listens on.
    async fn unreachable() -> Arc<dyn Store> {
        let redis = redis_tier(&format!("redis://127.0.0.1:{}", harness::refused_port())).await;
        Arc::new(tiered_over(redis, pg::closed_port_store()))
    }

    idem_testkit::conformance_suite!(store, unreachable = unreachable, stats);

    // Both tiers' notifications: a waiter answers within milliseconds of the completion,
    // and a reader of an append (made to the arbiter).
    idem_testkit::conformance_suite!(store, notifies);

    // --- helpers ---------------------------------------------------------------------------

    fn fp() -> Fingerprint {
        Fingerprint::of_bytes(b"charge 12.50 EUR")
    }

    async fn begin(store: &dyn Store, id: &RecordId, lease: Duration) -> Begin {
        begin_for(store, id, fp(), lease).await
    }

    /// A begin of `id` for `lease`, for the request whose fingerprint is `fp`.
    async fn begin_for(
        store: &dyn Store,
        id: &RecordId,
        fp: Fingerprint,
        lease: Duration,
    ) -> Begin {
        store.begin(request(id, fp, lease)).await.expect("begin")
    }

    fn spawn_begin(
        store: &TieredStore,
        id: &RecordId,
        fp: Fingerprint,
        lease: Duration,
    ) -> tokio::task::JoinHandle<Begin> {
        let (store, id) = (store.clone(), id.clone());
        tokio::spawn(async move { begin_for(&store, &id, fp, lease).await })
    }

    async fn acquired(store: &dyn Store, id: &RecordId, lease: Duration) -> Lease {
        match begin(store, id, lease).await {
            Begin::Acquired(lease) | Begin::TookOver(lease) => lease,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    fn charged(body: &str) -> Completion {
        Completion::succeeded(Response::new(201, body.to_owned()))
    }

    /// A first worker's business transaction completing `id` with "first", still open after
    /// the worker's lease (150 ms) ran out.
    async fn open_past_its_lease(
        store: &TieredStore,
        id: &RecordId,
    ) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let first = acquired(store, id, Duration::from_millis(150)).await;
        let mut tx = store.pg().pool().begin().await.expect("tx");
        complete_in_tx(store, &mut tx, &first, "first").await;
        sleep(Duration::from_millis(400)).await;
        tx
    }

    /// `lease` completed with `body` inside the business transaction on `conn`.
    async fn complete_in_tx(
        store: &TieredStore,
        conn: &mut PgConnection,
        lease: &Lease,
        body: &str,
    ) {
        store
            .complete_in(conn, lease, &charged(body), KEEP)
            .await
            .expect("complete_in");
    }

    /// Asserts that a retry of `id` replays `completion`; `context` says when, or what
    /// another answer would mean.
    async fn assert_replays(
        store: &dyn Store,
        id: &RecordId,
        completion: &Completion,
        context: &str,
    ) {
        match begin(store, id, LONG).await {
            Begin::Replay(r) => assert_eq!(&r.completion, completion),
            other => panic!("{context}: expected the replay, got {other:?}"),
        }
    }

    /// How many completions wait in the outbox.
    async fn outbox_rows(pg: &PgStore) -> i64 {
        let count = format!("SELECT count(*) FROM {}.outbox", pg.quoted_schema());
        let rows = sqlx::query_scalar(&count).fetch_one(pg.pool()).await;
        rows.expect("count outbox rows")
    }

    /// The state of `id`'s record in the Redis tier, if it holds one.
    async fn in_redis(store: &TieredStore, id: &RecordId) -> Option<RecordState> {
        let record = store.redis().get(id).await.expect("redis get");
        record.map(|r| r.state)
    }

    // --- the outbox's guarantees -----------------------------------------------------------

    /// Completing inside the business transaction: rollback leaves neither work rows nor
    /// a completion nor an outbox row; commit makes all three visible, and `publish` puts the
    /// completion into Redis.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_commits_and_rolls_back_with_the_business_transaction() {
        let Some(store) = tiered().await else { return };
        create_work_table(store.pg()).await;
        let id = id("order-1");

        let lease = acquired(&store, &id, LONG).await;
        for commit in [false, true] {
            let mut tx = store.pg().pool().begin().await.expect("tx");
            insert_work(&mut tx, store.pg(), "order-1", 1250).await;
            complete_in_tx(&store, &mut tx, &lease, "ch_1").await;
            let (n, what) = if commit {
                tx.commit().await.expect("commit");
                (1, "the business row and the outbox row commit together")
            } else {
                tx.rollback().await.expect("rollback");
                (0, "business or outbox rows survived a rollback")
            };
            let rows = (
                runs(store.pg(), "order-1").await,
                outbox_rows(store.pg()).await,
            );
            assert_eq!(rows, (n, n), "{what}");
            if !commit {
                match store.get(&id).await.expect("get").expect("record").state {
                    RecordState::InProgress { token, .. } => assert_eq!(token, lease.token()),
                    other => panic!("a rolled-back completion is visible: {other:?}"),
                }
            }
        }
        store
            .publish(&lease, &charged("ch_1"), KEEP)
            .await
            .expect("publish");
        // Redis answers the retry by itself now.
        match in_redis(&store, &id).await {
            Some(RecordState::Completed(c)) => assert_eq!(c, charged("ch_1")),
            other => panic!("Redis does not hold the completion: {other:?}"),
        }
        assert_replays(&store, &id, &charged("ch_1"), "Redis after the publish").await;
    }

    /// Redis flushed after the completion committed: the retry is replayed from PostgreSQL
    /// (the work does not run again), and Redis is repaired.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_flushed_after_completion_replays_from_postgres() {
        let Some((server, store)) = on_a_throwaway_redis().await else {
            return;
        };
        let id = id("order-2");
        let lease = acquired(&store, &id, LONG).await;
        store
            .complete(&lease, &charged("ch_2"), KEEP)
            .await
            .expect("complete");

        server.cli(&["FLUSHALL"]).expect("FLUSHALL");
        assert!(in_redis(&store, &id).await.is_none());

        assert_replays(
            &store,
            &id,
            &charged("ch_2"),
            "a flushed Redis let the work run again",
        )
        .await;
        match in_redis(&store, &id).await {
            Some(RecordState::Completed(c)) => assert_eq!(c, charged("ch_2")),
            other => panic!("Redis was not repaired: {other:?}"),
        }
    }

    /// Redis down: PostgreSQL alone answers, with every guarantee; completions commit and
    /// wait in the outbox.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_down_postgres_answers_alone() {
        let Some((mut server, store)) = on_a_throwaway_redis().await else {
            return;
        };
        server.stop();
        let id = id("order-3");
        let lease = acquired(&store, &id, LONG).await;
        assert!(matches!(
            begin(&store, &id, LONG).await,
            Begin::InFlight { .. }
        ));
        store
            .complete(&lease, &charged("ch_3"), KEEP)
            .await
            .expect("complete commits in PostgreSQL with Redis down");
        assert_replays(&store, &id, &charged("ch_3"), "with Redis down").await;
        let pending = outbox_rows(store.pg()).await;
        assert_eq!(pending, 1, "the completion waits in the outbox");
    }

    /// A worker whose lease expired while its business transaction ran cannot commit it once
    /// another worker took the key over and completed: its `complete_in` is refused, so only
    /// one business transaction for the key commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_taken_over_worker_cannot_commit_its_transaction() {
        let Some(store) = tiered().await else { return };
        let pool = store.pg().pool().clone();
        create_work_table(store.pg()).await;
        let id = id("order-4");

        let slow = acquired(&store, &id, Duration::from_millis(150)).await;
        let mut slow_tx = pool.begin().await.expect("tx");
        insert_work(&mut slow_tx, store.pg(), "order-4", 1).await;
        sleep(Duration::from_millis(400)).await;

        let fast = acquired(&store, &id, LONG).await;
        assert_eq!(fast.attempt(), 2);
        let mut fast_tx = pool.begin().await.expect("tx");
        insert_work(&mut fast_tx, store.pg(), "order-4", 2).await;
        complete_in_tx(&store, &mut fast_tx, &fast, "fast").await;
        fast_tx.commit().await.expect("commit");
        store
            .publish(&fast, &charged("fast"), KEEP)
            .await
            .expect("publish");

        match store
            .complete_in(&mut slow_tx, &slow, &charged("slow"), KEEP)
            .await
        {
            Err(Error::LeaseLost) => slow_tx.rollback().await.expect("rollback"),
            other => panic!("the taken-over worker could complete: {other:?}"),
        }
        assert_eq!(runs(store.pg(), "order-4").await, 1);
        assert_replays(&store, &id, &charged("fast"), "the holder completed").await;
    }

    /// A takeover attempted while the first worker's completing transaction is still open
    /// waits for it, and then replays its result: never a second run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_takeover_waits_for_an_open_completing_transaction() {
        let Some(store) = tiered().await else { return };
        let id = id("order-5");
        let tx = open_past_its_lease(&store, &id).await;
        let racer = spawn_begin(&store, &id, fp(), LONG);
        sleep(Duration::from_millis(300)).await;
        assert!(
            !racer.is_finished(),
            "the takeover did not wait for the open transaction"
        );
        tx.commit().await.expect("commit");
        match timeout(Duration::from_secs(10), racer)
            .await
            .expect("the racer answers once the transaction ends")
            .expect("task")
        {
            Begin::Replay(r) => assert_eq!(r.completion, charged("first")),
            other => panic!("a second run was allowed: {other:?}"),
        }
    }

    /// A takeover that waited behind an open completing transaction which then rolled back
    /// gets a whole lease, counted from when it got the row, not one already past.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_takeover_after_a_rolled_back_transaction_gets_a_live_lease() {
        let Some(store) = tiered().await else { return };
        let id = id("order-6");
        let lease_len = Duration::from_millis(600);
        let tx = open_past_its_lease(&store, &id).await;
        let racer = spawn_begin(&store, &id, fp(), lease_len);
        // Longer than the racer's whole lease.
        sleep(Duration::from_millis(900)).await;
        tx.rollback().await.expect("rollback");
        match timeout(Duration::from_secs(10), racer)
            .await
            .expect("the racer answers")
            .expect("task")
        {
            Begin::TookOver(lease) => assert!(
                lease.remaining() > lease_len / 3,
                "the takeover's lease was already spent: {:?} left",
                lease.remaining()
            ),
            other => panic!("expected a takeover, got {other:?}"),
        }
    }

    /// A completion the Redis tier cannot hold whole (over its body limit) stays in
    /// PostgreSQL: every retry gets the full committed response, none sees "in flight".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_over_the_redis_limit_is_replayed_from_postgres() {
        let Some(redis_url) = harness::redis_url() else {
            return;
        };
        let Some(pg) = pg_tier().await else { return };
        let redis = patient_builder(redis_url, "idem-tiered")
            .with_body_limit(16, idem_redis::OversizeBody::StatusAndHeaders)
            .connect_lazy()
            .expect("lazy store");
        let store = tiered_over(redis, pg);
        let id = id("big");
        let big = charged(&"x".repeat(1000));
        let lease = acquired(&store, &id, LONG).await;
        store.complete(&lease, &big, KEEP).await.expect("complete");
        for _ in 0..3 {
            assert_replays(&store, &id, &big, "the full replay").await;
        }
        assert!(in_redis(&store, &id).await.is_none());
    }

    // --- the outbox's own schema ---------------------------------------------------------------

    async fn has_table(pg: &PgStore, table: &str) -> bool {
        sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
            .bind(format!("{}.{table}", pg.quoted_schema()))
            .fetch_one(pg.pool())
            .await
            .expect("to_regclass")
    }

    async fn ledger(pg: &PgStore) -> Vec<i64> {
        sqlx::query_scalar(&format!(
            "SELECT version FROM {}._sqlx_migrations ORDER BY version",
            pg.quoted_schema()
        ))
        .fetch_all(pg.pool())
        .await
        .expect("read the ledger")
    }

    /// A plain PostgreSQL store gets no outbox table; the outbox's migrations add it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_outbox_creates_the_outbox_table() {
        let Some(pg) = pg::fresh_store(2).await else {
            return;
        };
        pg.migrate().await.expect("migrate records");
        assert!(has_table(&pg, "records").await);
        assert!(
            !has_table(&pg, "outbox").await,
            "idem-postgres made an outbox"
        );
        idem_outbox::migrate(&pg).await.expect("migrate the outbox");
        idem_outbox::migrate(&pg)
            .await
            .expect("migrating again is a no-op");
        assert!(has_table(&pg, "outbox").await);
        assert_eq!(ledger(&pg).await, [1, 3, 1001]);
    }

    /// A database migrated when idem-postgres still made the outbox (its version 2, now
    /// gone) keeps working: both migrators pass over the version they do not know, the
    /// outbox migration finds its table already there, and the tiered store works on it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_with_the_former_outbox_migration_keeps_working() {
        let Some(redis_url) = harness::redis_url() else {
            return;
        };
        let Some(pg) = pg::fresh_store(2).await else {
            return;
        };
        pg.migrate().await.expect("migrate records");
        let schema = pg.quoted_schema().to_owned();
        let mut tx = pg.pool().begin().await.expect("tx");
        sqlx::query(&format!("SET LOCAL search_path TO {schema}"))
            .execute(&mut *tx)
            .await
            .expect("search_path");
        // The outbox table and index as idem-postgres's former `0002_outbox` created them,
        // before idem-outbox owned its schema: the SQL of the outbox's own `1001_outbox`,
        // which creates the same table and index (only `IF NOT EXISTS` differs), taken from
        // the crate's migrator so the two cannot drift apart.
        let outbox = idem_outbox::migrator().iter().find(|m| m.version == 1001);
        sqlx::raw_sql(&outbox.expect("the outbox's 1001_outbox migration").sql)
            .execute(&mut *tx)
            .await
            .expect("the former 0002");
        sqlx::query(&format!(
            "INSERT INTO {schema}._sqlx_migrations \
             (version, description, success, checksum, execution_time) \
             VALUES (2, 'outbox', true, '\\x00'::bytea, 0)"
        ))
        .execute(&mut *tx)
        .await
        .expect("the former 0002 in the ledger");
        tx.commit().await.expect("commit");

        pg.migrate()
            .await
            .expect("idem-postgres passes over version 2");
        idem_outbox::migrate(&pg)
            .await
            .expect("the outbox migration over the former table");
        assert_eq!(ledger(&pg).await, [1, 2, 3, 1001]);

        // The tiered store works on it: a completion writes its outbox row.
        let store = tiered_over(redis_tier(&redis_url).await, pg.clone());
        let id = id("order-1");
        let lease = acquired(&store, &id, LONG).await;
        let mut tx = pg.pool().begin().await.expect("tx");
        complete_in_tx(&store, &mut tx, &lease, "ok").await;
        tx.commit().await.expect("commit");
        assert_eq!(outbox_rows(&pg).await, 1);
        store
            .publish(&lease, &charged("ok"), KEEP)
            .await
            .expect("publish to Redis");
        assert!(matches!(begin(&store, &id, LONG).await, Begin::Replay(_)));
        pg::drop_schema(&pg).await;
    }

    // --- Redis answers only from what PostgreSQL granted ------------------------------------

    /// `id` acquired for the request whose fingerprint is `fp`, and completed with
    /// [`charged`] `body`.
    async fn committed_as(store: &dyn Store, id: &RecordId, fp: Fingerprint, body: &str) {
        let lease = match begin_for(store, id, fp, LONG).await {
            Begin::Acquired(lease) => lease,
            other => panic!("expected a lease, got {other:?}"),
        };
        store
            .complete(&lease, &charged(body), KEEP)
            .await
            .expect("complete");
    }

    /// Asserts that Redis holds no record in progress for `id` (none nobody holds, and none
    /// PostgreSQL did not grant).
    async fn assert_no_claim_in_redis(store: &TieredStore, id: &RecordId) {
        let state = in_redis(store, id).await;
        assert!(
            !matches!(state, Some(RecordState::InProgress { .. })),
            "Redis holds a claim for {id}: {state:?}"
        );
    }

    /// Redis lost a committed key and then stalled longer than the tier's Redis timeout. Begins sent
    /// meanwhile are answered by PostgreSQL alone; when Redis resumes, what they sent must not
    /// turn into claims that answer the committed request's retries with 409 or 422.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_redis_never_refuses_the_retry_of_a_committed_request() {
        let Some(server) = throwaway(&[]) else {
            return;
        };
        let Some(pg) = pg_tier().await else { return };
        let redis = patient_builder(server.url(), "idem-stall")
            .with_timeouts(Duration::from_secs(1), Duration::from_millis(500))
            .connect()
            .await
            .expect("connect");
        let store = TieredStore::new(redis, pg).with_redis_timeout(Duration::from_secs(1));
        // The committed request's fingerprint is fp(), which assert_replays sends.
        let (paid, other) = (fp(), Fingerprint::of_bytes(b"401 EUR"));
        let id = id("k4");
        committed_as(&store, &id, paid, "pay_k4").await;

        server.cli(&["FLUSHALL"]).expect("FLUSHALL");
        let stopped = Stopped::stop(redis_pid(&server));
        // Answered by PostgreSQL alone: the other body is refused, the committed one replayed.
        let during = async {
            assert!(matches!(
                begin_for(&store, &id, other, LONG).await,
                Begin::Mismatch
            ));
            assert_replays(&store, &id, &charged("pay_k4"), "during the stall").await;
            // Redis is stalled indeed: it answers nothing within its response timeout.
            let read = store.redis().get(&id).await;
            assert!(read.is_err(), "Redis answered during the stall: {read:?}");
        };
        let stalled = timeout(Duration::from_secs(20), during).await;
        sleep(Duration::from_secs(2)).await;
        stopped.resume();
        stalled.expect("PostgreSQL answers while Redis is stalled");

        // Every retry of the committed request from the resume on is its replay.
        let resumed = tokio::time::Instant::now();
        while resumed.elapsed() < Duration::from_secs(3) {
            assert_replays(
                &store,
                &id,
                &charged("pay_k4"),
                "after the resume (a begin sent during the stall claimed the key)",
            )
            .await;
            sleep(Duration::from_millis(50)).await;
        }
        assert_no_claim_in_redis(&store, &id).await;
    }

    /// The committed key is missing from Redis, and a request with another body is waiting
    /// for PostgreSQL (slow: the records table is locked). Meanwhile the committed request's
    /// retry must not be refused on the strength of that request's claim: it waits for
    /// PostgreSQL too, and is replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_postgres_has_not_granted_never_refuses_the_committed_request() {
        let Some((server, store)) = on_a_throwaway_redis().await else {
            return;
        };
        let paid = Fingerprint::of_bytes(b"500 EUR");
        let other = Fingerprint::of_bytes(b"999 EUR");
        let id = id("k5");
        committed_as(&store, &id, paid, "pay_k5").await;
        server.cli(&["FLUSHALL"]).expect("FLUSHALL");

        // PostgreSQL made slow: every statement on the records table waits for this lock.
        let mut lock = store.pg().pool().begin().await.expect("tx");
        sqlx::query(&format!(
            "LOCK TABLE \"{}\".records IN ACCESS EXCLUSIVE MODE",
            store.pg().schema()
        ))
        .execute(&mut *lock)
        .await
        .expect("lock the records table");

        let stranger = spawn_begin(&store, &id, other, LONG);
        sleep(Duration::from_millis(300)).await;
        let retry = spawn_begin(&store, &id, paid, LONG);
        sleep(Duration::from_millis(300)).await;
        assert!(
            !retry.is_finished(),
            "the retry was answered without PostgreSQL: {:?}",
            retry.await
        );
        lock.rollback().await.expect("unlock");

        match retry.await.expect("retry task") {
            Begin::Replay(r) => assert_eq!(r.completion, charged("pay_k5")),
            other => panic!("the committed request's retry got {other:?}"),
        }
        assert!(matches!(
            stranger.await.expect("stranger task"),
            Begin::Mismatch
        ));
        assert_no_claim_in_redis(&store, &id).await;
    }
}

/// The tiered store with a 3-primary Redis Cluster as its Redis tier: the conformance suite.
mod tiered_cluster {
    use std::sync::Arc;

    use idem_core::Store;

    use super::tiered::{pg_tier, tiered_over};
    use crate::common::{patient_builder, redis_cluster_url};

    async fn store() -> Option<Arc<dyn Store>> {
        let url = redis_cluster_url().await?;
        let redis = patient_builder(url, "idem-tiered")
            .connect()
            .await
            .expect("connect to the cluster");
        assert!(redis.is_cluster());
        Some(Arc::new(tiered_over(redis, pg_tier().await?)))
    }

    idem_testkit::conformance_suite!(store);
}
