//! The conformance suite on PostgreSQL, and the Postgres-only tests: races counting
//! executions, a business transaction killed mid-way, the transactional API, isolation
//! levels, migrations, purging and error mapping.
//!
//! Needs `IDEM_TEST_DATABASE_URL` (see `idem_testkit::harness`). Every test works in a
//! schema of its own (`idem_t_<unix seconds>_<random>`), so tests run in parallel on one
//! server; schemas left by earlier runs are dropped after an hour.

mod postgres {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::telemetry::KeyHash;
    use idem_core::{
        Begin, BeginRequest, Completion, Error, Fingerprint, Key, Lease, RecordId, RecordState,
        Response, Scope, Store,
    };
    use idem_postgres::{is_transaction_conflict, PgStore, PurgeConfig};
    use idem_testkit::harness;
    use idem_testkit::postgres::{self as pg, drop_schema};
    use idem_tests::{create_work_table, id, insert_work, request, work_rows, KEEP, LONG};
    use sqlx::postgres::{PgConnectOptions, PgListener};
    use sqlx::{Connection, PgConnection, PgPool};
    use tokio::time::{sleep, timeout, Instant};

    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

    /// A migrated store in a fresh schema, with the work table of [`create_work_table`], on
    /// a pool of `max` connections; `None` when no server is configured (the harness printed
    /// why, or panicked if backends are required).
    async fn fresh(max: u32) -> Option<PgStore> {
        let store = pg::fresh_store(max).await?;
        store.migrate().await.expect("migrate");
        create_work_table(&store).await;
        Some(store)
    }

    async fn store() -> Option<Arc<dyn Store>> {
        Some(Arc::new(fresh(8).await?))
    }

    async fn unreachable() -> Arc<dyn Store> {
        Arc::new(pg::closed_port_store())
    }

    idem_testkit::conformance_suite!(store, unreachable = unreachable, stats);

    fn fp(text: &str) -> Fingerprint {
        Fingerprint::of_bytes(text.as_bytes())
    }

    fn req(id: &RecordId, lease: Duration) -> BeginRequest<'_> {
        request(id, fp("request"), lease)
    }

    fn done(body: &str) -> Completion {
        Completion::succeeded(Response::new(200, body.to_owned()))
    }

    fn leased(answer: Begin) -> Lease {
        match answer {
            Begin::Acquired(lease) | Begin::TookOver(lease) => lease,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    async fn begin(store: &PgStore, id: &RecordId) -> Begin {
        store.begin(req(id, LONG)).await.expect("begin")
    }

    async fn begin_in(conn: &mut PgConnection, store: &PgStore, id: &RecordId) -> Begin {
        store.begin_in(conn, req(id, LONG)).await.expect("begin")
    }

    /// A lease on `id` (acquired or taken over) for `lease`.
    async fn claim(store: &PgStore, id: &RecordId, lease: Duration) -> Lease {
        leased(store.begin(req(id, lease)).await.expect("begin"))
    }

    fn assert_replays(answer: Begin, body: &str) {
        match answer {
            Begin::Replay(replay) => assert_eq!(replay.completion.response.body, body),
            other => panic!("expected Replay, got {other:?}"),
        }
    }

    async fn claim_in(conn: &mut PgConnection, store: &PgStore, id: &RecordId) -> Lease {
        leased(begin_in(conn, store, id).await)
    }

    /// A record for `id`, completed now and kept for `retention`.
    async fn completed(store: &PgStore, id: &RecordId, retention: Duration) {
        let lease = claim(store, id, LONG).await;
        store
            .complete(&lease, &done("x"), retention)
            .await
            .expect("complete");
    }

    /// Asserts that the work of `key` ran once, and that a retry replays the stored `body`.
    async fn assert_done_once(store: &PgStore, key: &str, body: &str) {
        assert_eq!(work_rows(store).await.get(key), Some(&1), "runs of {key}");
        assert_replays(begin(store, &id(key)).await, body);
    }

    /// The protected work on `conn`: a row in the work table for `key` by `worker`, then the
    /// lease's completion with `body` (its result is returned).
    async fn work_in(
        conn: &mut PgConnection,
        store: &PgStore,
        lease: &Lease,
        key: &str,
        worker: i32,
        body: &str,
    ) -> Result<(), Error> {
        insert_work(conn, store, key, worker).await;
        store.complete_in(conn, lease, &done(body), KEEP).await
    }

    /// [`work_in`] a business transaction of its own, handed back open with the completion's
    /// result, for the test to commit, roll back or kill.
    async fn work_and_complete(
        store: &PgStore,
        lease: &Lease,
        key: &str,
        worker: i32,
        body: &str,
    ) -> (Tx, Result<(), Error>) {
        let mut tx = store.pool().begin().await.expect("tx");
        let completed = work_in(&mut tx, store, lease, key, worker, body).await;
        (tx, completed)
    }

    /// [`work_and_complete`], committed.
    async fn commit_work(store: &PgStore, lease: &Lease, key: &str, worker: i32, body: &str) {
        let (tx, completed) = work_and_complete(store, lease, key, worker, body).await;
        completed.expect("complete");
        tx.commit().await.expect("commit");
    }

    async fn backend_pid(conn: &mut PgConnection) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("backend pid")
    }

    async fn terminate(pool: &PgPool, pid: i32) {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(pool)
            .await
            .expect("pg_terminate_backend");
        assert!(killed, "backend {pid} was not terminated");
    }

    /// Many workers on many connections run every key to completion, retrying while the key
    /// is in flight; the protected work writes one row per run to the work table, and must
    /// have run exactly once per key. Returns how many transaction conflicts reached the
    /// workers (who retry them, as a client would).
    async fn race(store: &PgStore, keys: usize, workers: usize) -> usize {
        let conflicts = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for worker in 0..workers {
            let (store, conflicts) = (store.clone(), conflicts.clone());
            tasks.spawn(async move {
                // Each worker walks the keys from its own starting point, so every key sees
                // a different crowd at a different moment.
                for i in 0..keys {
                    let key = format!("key-{}", (i + worker) % keys);
                    let id = id(&key);
                    loop {
                        match store.begin(req(&id, LONG)).await {
                            Ok(Begin::Acquired(lease) | Begin::TookOver(lease)) => {
                                // The protected work: a row in the business table.
                                let mut conn = store.pool().acquire().await.expect("acquire");
                                insert_work(&mut conn, &store, &key, worker as i32).await;
                                drop(conn);
                                sleep(Duration::from_millis(2)).await;
                                store
                                    .complete(&lease, &done(&key), KEEP)
                                    .await
                                    .expect("the winner completes");
                                break;
                            }
                            Ok(Begin::InFlight { retry_after }) => {
                                assert!(retry_after <= LONG);
                                sleep(retry_after.min(Duration::from_millis(3))).await;
                            }
                            Ok(Begin::Replay(replay)) => {
                                assert_eq!(replay.completion.response.body, key.as_bytes());
                                break;
                            }
                            Ok(Begin::Mismatch) => panic!("same request reported as mismatch"),
                            Ok(Begin::Expired { .. }) => panic!("a store never answers expired"),
                            Err(e) if is_transaction_conflict(&e) => {
                                conflicts.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("begin failed: {e}"),
                        }
                    }
                }
            });
        }
        tasks.join_all().await;
        let rows = work_rows(store).await;
        assert_eq!(rows.len(), keys, "keys that ran: {rows:?}");
        for (key, n) in &rows {
            assert_eq!(*n, 1, "{key} ran {n} times");
        }
        conflicts.load(Ordering::Relaxed)
    }

    mod restarts {
        //! A server restart closes pooled connections and ends the sessions that hold the
        //! waiters' locks: callers see neither.

        use super::*;

        /// A server restart closes every pooled connection. The store does not ping a
        /// connection before each statement (that would be a second round trip per transition),
        /// so the first statements after a restart meet connections the server has ended: they
        /// are sent again on fresh ones, and callers see no error. `fast` ends the sessions with
        /// `57P01`, `immediate` kills them; a crashed server's sessions end like the latter.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_server_restart_is_not_seen_by_callers() {
            let Some((server, store)) = throwaway().await else {
                return;
            };
            let scope = Scope::new(harness::unique_name("restart")).unwrap();
            let id = |n: usize| RecordId::new(scope.clone(), Key::new(format!("k{n}")).unwrap());
            let mut n = 0;
            for mode in ["fast", "immediate"] {
                // Fill the pool with idle connections: concurrent calls each hold one.
                let mut round = tokio::task::JoinSet::new();
                for _ in 0..8 {
                    n += 1;
                    let (store, id) = (store.clone(), id(n));
                    round.spawn(async move { acquire_and_complete(&store, &id).await });
                }
                for outcome in round.join_all().await {
                    outcome.unwrap_or_else(|e| panic!("before the {mode} restart: {e}"));
                }
                server.restart(mode).expect("restart");
                for _ in 0..12 {
                    n += 1;
                    acquire_and_complete(&store, &id(n))
                        .await
                        .unwrap_or_else(|e| panic!("after the {mode} restart: {e}"));
                }
            }
        }

        /// After a restart the waiters' advisory locks are taken again on a new session, and
        /// none is let go in a session that does not hold it (PostgreSQL would warn "you don't
        /// own a lock of type ShareLock"): watches made before the restart and dropped after it,
        /// and new ones, leave nothing in the server's log.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn waiters_locks_survive_a_restart_without_warnings() {
            let Some((server, store)) = throwaway().await else {
                return;
            };
            let scope = Scope::new(harness::unique_name("locks")).unwrap();
            let id = |n: &str| RecordId::new(scope.clone(), Key::new(n).unwrap());
            for mode in ["fast", "immediate"] {
                // Waiters come and go all through the restart: their locks are taken and let go
                // while the listening connection is lost and made again.
                let churn = {
                    let (store, scope) = (store.clone(), scope.clone());
                    tokio::spawn(async move {
                        let started = Instant::now();
                        let mut n = 0u32;
                        while started.elapsed() < Duration::from_secs(3) {
                            n += 1;
                            let id = RecordId::new(
                                scope.clone(),
                                Key::new(format!("w{}", n % 8)).unwrap(),
                            );
                            let watch = store.watch(&id).await;
                            sleep(Duration::from_millis(2)).await;
                            drop(watch);
                        }
                    })
                };
                sleep(Duration::from_millis(300)).await;
                server.restart(mode).expect("restart");
                churn.await.expect("churn");
                let again = timeout(LONG, async {
                    loop {
                        if let Some(watch) = store.watch(&id("again")).await {
                            break watch;
                        }
                        sleep(Duration::from_millis(100)).await;
                    }
                })
                .await
                .expect("the waiters' locks are taken again after the restart");
                drop(again);
                sleep(Duration::from_millis(300)).await;
            }
            let log = std::fs::read_to_string(server.data_dir().join("server.log")).expect("log");
            assert!(
                !log.contains("you don't own a lock"),
                "a waiters' lock was let go in a session that did not hold it:\n{log}"
            );
        }

        /// A throwaway server of this test's own (to restart), and a migrated store on it;
        /// `None` when the PostgreSQL binaries are missing.
        async fn throwaway() -> Option<(pg::PgServer, PgStore)> {
            if !pg::available() {
                return None;
            }
            let server = pg::PgServer::start(&[], &[]).expect("start a throwaway PostgreSQL");
            let url = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());
            let store = PgStore::connect(&url).await.expect("connect");
            store.migrate().await.expect("migrate");
            Some((server, store))
        }

        async fn acquire_and_complete(store: &PgStore, id: &RecordId) -> Result<(), Error> {
            let begun = store.begin(req(id, LONG)).await?;
            let Begin::Acquired(lease) = begun else {
                panic!("a new key was not acquired: {begun:?}");
            };
            store.complete(&lease, &done("ok"), KEEP).await
        }
    }

    mod notifications {
        //! Waiters woken by LISTEN/NOTIFY: at a completion, a release, an append and a commit,
        //! and only when someone waits.

        use super::*;

        /// LISTEN/NOTIFY with the default settings: a waiter answers within milliseconds of the
        /// completion (and of the release), while its polls are seconds apart.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn waiter_is_notified() {
            let Some(store) = fresh(4).await else {
                return;
            };
            idem_testkit::cases::waiter_is_notified(Arc::new(store.clone())).await;
            drop_schema(&store).await;
        }

        /// An append wakes a reader watching the record, through the same notifications.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn stream_appends_wake_watchers() {
            let Some(store) = fresh(4).await else {
                return;
            };
            idem_testkit::cases::stream_appends_wake_watchers(Arc::new(store.clone())).await;
            drop_schema(&store).await;
        }

        /// `complete` and `release` send a notification only for a record someone waits for,
        /// here a waiter of another store on the same schema (as in another process).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn notifies_only_when_someone_waits() {
            let Some(store) = fresh(4).await else {
                return;
            };
            let payload = |id: &RecordId| format!("{} {}", KeyHash::of(id), store.schema());
            let mut listener = PgListener::connect_with(store.pool())
                .await
                .expect("listener");
            listener
                .listen(idem_postgres::notify::CHANNEL)
                .await
                .expect("listen");

            let (alone, released) = (id("nobody-waits"), id("nobody-waits-released"));
            completed(&store, &alone, KEEP).await;
            let lease = claim(&store, &released, LONG).await;
            store.release(&lease).await.expect("release");

            let other = PgStore::new(store.pool().clone())
                .with_schema(store.schema())
                .expect("schema");
            let waited = id("somebody-waits");
            let lease = claim(&store, &waited, LONG).await;
            let watch = other.watch(&waited).await.expect("a watch");
            store
                .complete(&lease, &done("x"), KEEP)
                .await
                .expect("complete");
            // Notifications arrive in commit order: any for the first two records comes first.
            let mut seen = Vec::new();
            loop {
                let n = timeout(Duration::from_secs(10), listener.recv())
                    .await
                    .expect("the waited-for record's notification")
                    .expect("recv");
                if n.payload() == payload(&waited) {
                    break;
                }
                seen.push(n.payload().to_owned());
            }
            for quiet in [&alone, &released] {
                assert!(
                    !seen.contains(&payload(quiet)),
                    "notified for nobody: {seen:?}"
                );
            }
            drop(watch);
            drop_schema(&store).await;
        }

        /// A waiter that comes while the holder's completion is written but not committed
        /// (`complete_in` in an open business transaction) answers within milliseconds of the
        /// commit: it cannot register while the completion holds the record's lock, and reads
        /// the committed result once it can. Polls are seconds apart. Tried in three rounds, one
        /// in time is enough (a loaded machine can stall any one round).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn waiter_during_an_uncommitted_completion_is_answered_at_the_commit() {
            use idem_core::{Config, Idem};
            use idem_testkit::cases::{self, NOTIFIED_WITHIN, NOTIFY_SAFETY_POLL};

            let Some(store) = fresh(6).await else {
                return;
            };
            let idem = Idem::new(store.clone()).with_config(
                Config::default()
                    .with_wait(Duration::from_secs(20))
                    .with_safety_poll(NOTIFY_SAFETY_POLL)
                    .with_max_poll(NOTIFY_SAFETY_POLL),
            );
            // The listening connection, made before the rounds.
            drop(store.watch(&id("warm-up")).await);
            let mut late = Vec::new();
            for round in 0..3 {
                let key = id(&format!("uncommitted-{round}"));
                let lease = claim(&store, &key, LONG).await;
                let mut tx = store.pool().begin().await.expect("tx");
                store
                    .complete_in(&mut tx, &lease, &done("paid"), KEEP)
                    .await
                    .expect("complete_in");
                let waiter = cases::spawn_waiter(&idem, &key, fp("request"));
                // The waiter finds the key in flight and tries to register meanwhile.
                sleep(Duration::from_millis(15)).await;
                tx.commit().await.expect("commit");
                let committed = Instant::now();
                let (answer, answered) = cases::answer_of(waiter, Duration::from_secs(10)).await;
                assert_replays(answer, "paid");
                let after = answered.saturating_duration_since(committed);
                if after < NOTIFIED_WITHIN {
                    break;
                }
                late.push(after);
            }
            assert!(late.len() < 3, "answered long after every commit: {late:?}");
            drop_schema(&store).await;
        }
    }

    mod races {
        //! Racing callers on many connections: the protected work runs once per key.

        use super::*;

        /// 24 workers on 16 connections race over 30 keys: the protected work runs exactly once
        /// per key, and every worker ends with the one stored result.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn race_runs_the_work_once_per_key() {
            let Some(store) = fresh(16).await else { return };
            race(&store, 30, 24).await;
            drop_schema(&store).await;
        }

        /// Under SERIALIZABLE as the server default, the statements of racing callers abort with
        /// serialization failures; the store resends them, and the work still runs exactly once.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn race_under_serializable_default() {
            let Some(url) = harness::database_url() else {
                return;
            };
            let options: PgConnectOptions = url.parse().expect("a well-formed URL");
            let options = options.options([("default_transaction_isolation", "serializable")]);
            let pool = pg::pool_options(12)
                .connect_with(options)
                .await
                .expect("connect");
            let level: String = sqlx::query_scalar("SHOW transaction_isolation")
                .fetch_one(&pool)
                .await
                .expect("show");
            assert_eq!(level, "serializable");
            let store = PgStore::new(pool)
                .with_schema(&harness::unique_name(pg::SCHEMA_PREFIX))
                .expect("schema");
            store.migrate().await.expect("migrate");
            create_work_table(&store).await;
            let reported = race(&store, 12, 16).await;
            eprintln!("conflicts left to the workers after the store's resends: {reported}");
            drop_schema(&store).await;
        }

        /// Sixteen callers find the same expired lease at once: exactly one takes it over.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn race_for_an_expired_lease_has_one_winner() {
            let Some(store) = fresh(16).await else { return };
            let keys: Vec<RecordId> = (0..10).map(|k| id(&format!("k{k}"))).collect();
            for id in &keys {
                claim(&store, id, Duration::from_millis(100)).await;
            }
            sleep(Duration::from_millis(300)).await;
            for id in &keys {
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..16 {
                    let (store, id) = (store.clone(), id.clone());
                    tasks.spawn(async move { begin(&store, &id).await });
                }
                let mut took_over = 0;
                for answer in tasks.join_all().await {
                    match answer {
                        Begin::TookOver(lease) => {
                            assert_eq!(lease.attempt(), 2);
                            took_over += 1;
                        }
                        Begin::InFlight { .. } => {}
                        other => panic!("expected TookOver or InFlight, got {other:?}"),
                    }
                }
                assert_eq!(took_over, 1, "{id}: {took_over} callers took over");
            }
            drop_schema(&store).await;
        }
    }

    mod killed_transactions {
        //! A business transaction killed mid-way leaves nothing, and a retry proceeds.

        use super::*;

        /// The key was claimed on the pool (committed), the work's transaction wrote its row and
        /// the completion, then its backend was terminated mid-statement: neither the row nor
        /// the completion is there, the key is still in progress under the lease, and once the
        /// lease expires a retry takes over and finishes.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn killed_transaction_leaves_nothing_and_a_retry_proceeds() {
            let Some(store) = fresh(4).await else { return };
            let id = id("order-1");
            // Long enough to outlast the kill below on a slow machine, so the retry first sees
            // the key in flight.
            let lease = claim(&store, &id, Duration::from_secs(3)).await;

            let mut tx = store.pool().begin().await.expect("tx");
            let pid = backend_pid(&mut tx).await;
            work_in(&mut tx, &store, &lease, "order-1", 1, "first")
                .await
                .expect("complete in the transaction");
            // Kill the backend while the transaction is busy with more work.
            let killer = {
                let pool = store.pool().clone();
                tokio::spawn(async move {
                    sleep(Duration::from_millis(200)).await;
                    terminate(&pool, pid).await;
                })
            };
            let slow = sqlx::query("SELECT pg_sleep(10)").execute(&mut *tx).await;
            killer.await.expect("killer");
            assert!(slow.is_err(), "the killed statement succeeded");
            // The store maps the dead connection to Unavailable, not to a lost lease.
            match store
                .complete_in(&mut tx, &lease, &done("first"), KEEP)
                .await
            {
                Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
                other => panic!("expected Unavailable on a dead connection, got {other:?}"),
            }
            assert!(tx.commit().await.is_err(), "a dead transaction committed");

            assert!(work_rows(&store).await.is_empty(), "business rows survived");
            let record = store.get(&id).await.expect("get").expect("record");
            assert!(
                matches!(record.state, RecordState::InProgress { token, .. } if token == lease.token()),
                "expected the key still in progress under the lease, got {:?}",
                record.state
            );

            // The retry: in flight while the lease lives, then a takeover that finishes.
            assert!(matches!(begin(&store, &id).await, Begin::InFlight { .. }));
            sleep(lease.remaining() + Duration::from_millis(200)).await;
            let retry = claim(&store, &id, LONG).await;
            assert_eq!(retry.attempt(), 2, "the retry takes over");
            commit_work(&store, &retry, "order-1", 2, "second").await;
            assert_done_once(&store, "order-1", "second").await;
            drop_schema(&store).await;
        }

        /// The key was claimed inside the killed transaction too: then nothing of it remains, and
        /// a retry acquires the key at once as attempt 1.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn killed_transaction_that_claimed_the_key_leaves_it_absent() {
            let Some(store) = fresh(4).await else { return };
            let id = id("order-2");
            let mut tx = store.pool().begin().await.expect("tx");
            let pid = backend_pid(&mut tx).await;
            let lease = claim_in(&mut tx, &store, &id).await;
            work_in(&mut tx, &store, &lease, "order-2", 1, "first")
                .await
                .expect("complete");
            terminate(store.pool(), pid).await;
            assert!(tx.commit().await.is_err(), "a killed transaction committed");

            assert!(work_rows(&store).await.is_empty());
            assert!(store.get(&id).await.expect("get").is_none());
            assert_eq!(claim(&store, &id, LONG).await.attempt(), 1);
            drop_schema(&store).await;
        }
    }

    mod transactions {
        //! The transactional API: completing inside the business transaction, rollbacks,
        //! duplicates meanwhile, isolation levels.

        use super::*;

        /// Completing inside a transaction that rolls back leaves the key as it was: absent when
        /// the transaction also claimed it, in progress under the lease when the pool did.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn rollback_leaves_the_key_rerunnable() {
            let Some(store) = fresh(4).await else { return };

            // Claimed and completed in the transaction, rolled back: as if never seen.
            let a = id("a");
            let mut tx = store.pool().begin().await.expect("tx");
            let lease = claim_in(&mut tx, &store, &a).await;
            work_in(&mut tx, &store, &lease, "a", 1, "a")
                .await
                .expect("complete");
            tx.rollback().await.expect("rollback");
            assert!(store.get(&a).await.expect("get").is_none());
            assert_eq!(claim(&store, &a, LONG).await.attempt(), 1);

            // Claimed on the pool, completed in a transaction that rolls back: still ours.
            let b = id("b");
            let lease = claim(&store, &b, LONG).await;
            let (tx, completed) = work_and_complete(&store, &lease, "b", 1, "b").await;
            completed.expect("complete");
            tx.rollback().await.expect("rollback");
            let record = store.get(&b).await.expect("get").expect("record");
            assert!(
                matches!(record.state, RecordState::InProgress { token, .. } if token == lease.token())
            );
            // The work runs again, in a transaction that commits.
            commit_work(&store, &lease, "b", 2, "b").await;
            let rows = work_rows(&store).await;
            assert_eq!(rows.get("a"), None);
            assert_eq!(rows.get("b"), Some(&1));
            drop_schema(&store).await;
        }

        /// A worker whose lease was taken over and completed by another cannot complete in its
        /// own transaction: the database refuses (LeaseLost), and the rollback keeps its business
        /// write out.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn completing_a_key_completed_by_a_takeover_is_refused() {
            let Some(store) = fresh(4).await else { return };
            let id = id("k");
            let slow = claim(&store, &id, Duration::from_millis(100)).await;
            sleep(Duration::from_millis(300)).await;
            let fast = claim(&store, &id, LONG).await;
            assert_eq!(fast.attempt(), 2, "the fast worker takes over");
            commit_work(&store, &fast, "k", 2, "fast").await;

            let (tx, completed) = work_and_complete(&store, &slow, "k", 1, "slow").await;
            match completed {
                Err(Error::LeaseLost) => tx.rollback().await.expect("rollback"),
                other => panic!("expected LeaseLost, got {other:?}"),
            }
            assert_done_once(&store, "k", "fast").await;
            drop_schema(&store).await;
        }

        /// Two transactions complete the same lease at once (a duplicate delivery of one
        /// message): the second waits on the row, re-checks the guard after the first commits,
        /// and is refused. The work is committed once.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn concurrent_duplicate_completion_is_refused() {
            let Some(store) = fresh(4).await else { return };
            let id = id("k");
            let lease = claim(&store, &id, LONG).await;

            let mut first = store.pool().begin().await.expect("tx");
            work_in(&mut first, &store, &lease, "k", 1, "first")
                .await
                .expect("complete");

            let second = {
                let (store, lease) = (store.clone(), lease.clone());
                tokio::spawn(async move {
                    let (tx, result) = work_and_complete(&store, &lease, "k", 2, "second").await;
                    match result {
                        Ok(()) => tx.commit().await.expect("commit"),
                        Err(_) => tx.rollback().await.expect("rollback"),
                    }
                    result
                })
            };
            // Let the second transaction reach the row lock before the first commits.
            sleep(Duration::from_millis(300)).await;
            assert!(!second.is_finished(), "the second completion did not wait");
            first.commit().await.expect("commit");
            match second.await.expect("task") {
                Err(Error::LeaseLost) => {}
                other => panic!("expected LeaseLost, got {other:?}"),
            }
            assert_done_once(&store, "k", "first").await;
            drop_schema(&store).await;
        }

        /// Two transactions claim the same key with `begin_in`: the second waits for the first,
        /// which commits its work and completion, and then gets the replay.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn begin_in_waits_for_the_claiming_transaction() {
            let Some(store) = fresh(4).await else { return };
            let id = id("k");
            let mut first = store.pool().begin().await.expect("tx");
            let lease = claim_in(&mut first, &store, &id).await;
            let second = {
                let (store, id) = (store.clone(), id.clone());
                tokio::spawn(async move {
                    let mut tx = store.pool().begin().await.expect("tx");
                    let answer = begin_in(&mut tx, &store, &id).await;
                    tx.commit().await.expect("commit");
                    answer
                })
            };
            sleep(Duration::from_millis(300)).await;
            assert!(!second.is_finished(), "the second begin did not wait");
            work_in(&mut first, &store, &lease, "k", 1, "once")
                .await
                .expect("complete");
            first.commit().await.expect("commit");
            assert_replays(second.await.expect("task"), "once");
            assert_done_once(&store, "k", "once").await;
            drop_schema(&store).await;
        }

        /// A duplicate that comes while the holder's completion is written but not committed
        /// (`complete_in` in an open business transaction, which holds the row) is answered in
        /// flight at once, from its snapshot: `begin` never waits for a transaction that holds
        /// a record it reads. After the commit, the duplicate gets the replay.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn duplicate_during_an_uncommitted_completion_is_in_flight_at_once() {
            let Some(store) = fresh(4).await else { return };
            let id = id("held");
            let lease = claim(&store, &id, LONG).await;
            let mut tx = store.pool().begin().await.expect("tx");
            store
                .complete_in(&mut tx, &lease, &done("paid"), KEEP)
                .await
                .expect("complete_in");
            let answer = timeout(Duration::from_secs(5), store.begin(req(&id, LONG))).await;
            tx.commit().await.expect("commit");
            match answer {
                Ok(Ok(Begin::InFlight { .. })) => {}
                Ok(other) => panic!("expected InFlight, got {other:?}"),
                Err(_) => panic!("begin waited for the transaction that holds the record"),
            }
            assert_replays(begin(&store, &id).await, "paid");
            drop_schema(&store).await;
        }

        /// In a REPEATABLE READ transaction whose snapshot predates another caller's claim,
        /// `begin_in` reports a transaction conflict (retryable), and retrying the whole
        /// transaction sees the key in flight.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn repeatable_read_conflict_is_reported() {
            let Some(store) = fresh(4).await else { return };
            let id = id("k");
            let mut tx = repeatable_read(&store).await;
            // The snapshot is taken by the first statement.
            sqlx::query("SELECT 1")
                .execute(&mut *tx)
                .await
                .expect("snapshot");
            claim(&store, &id, LONG).await;
            let err = store
                .begin_in(&mut tx, req(&id, LONG))
                .await
                .expect_err("a row claimed after the snapshot");
            assert!(is_transaction_conflict(&err), "got {err:?}");
            assert!(err.is_retryable());
            assert!(
                err.to_string().contains("unavailable"),
                "unexpected message: {err}"
            );
            tx.rollback().await.expect("rollback");

            let mut tx = repeatable_read(&store).await;
            let answer = begin_in(&mut tx, &store, &id).await;
            assert!(matches!(answer, Begin::InFlight { .. }), "{answer:?}");
            tx.commit().await.expect("commit");
            drop_schema(&store).await;
        }

        async fn repeatable_read(store: &PgStore) -> Tx {
            let mut tx = store.pool().begin().await.expect("tx");
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *tx)
                .await
                .expect("isolation");
            tx
        }
    }

    mod migrations {
        //! Migrations: safe to run concurrently, in the `idem` schema by default.

        use super::*;

        /// Eight instances migrate the same new schema at once: all succeed, the table exists
        /// once, and the ledger lives in idem's schema with one row per migration.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn migrate_is_safe_to_run_concurrently() {
            let Some(url) = harness::database_url() else {
                return;
            };
            let schema = harness::unique_name(pg::SCHEMA_PREFIX);
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..8 {
                let (url, schema) = (url.clone(), schema.clone());
                tasks.spawn(async move {
                    let store = PgStore::new(pg::connect(&url, 2).await)
                        .with_schema(&schema)
                        .expect("schema");
                    store.migrate().await.expect("concurrent migrate");
                    store
                });
            }
            let stores = tasks.join_all().await;
            let store = &stores[0];
            let applied: Vec<(i64, bool)> = sqlx::query_as(&format!(
                "SELECT version, success FROM \"{schema}\"._sqlx_migrations ORDER BY version"
            ))
            .fetch_all(store.pool())
            .await
            .expect("ledger in idem's schema");
            let expected: Vec<(i64, bool)> = idem_postgres::migrator()
                .iter()
                .map(|m| (m.version, true))
                .collect();
            assert_eq!(applied, expected);
            // The pool's own connections still use the default search_path: the migration's
            // connection was taken out of the pool.
            let path: String = sqlx::query_scalar("SHOW search_path")
                .fetch_one(store.pool())
                .await
                .expect("search_path");
            assert!(!path.contains(&schema), "search_path leaked: {path}");
            // Running it again is a no-op, and the store works.
            store.migrate().await.expect("migrate again");
            claim(store, &id("k"), LONG).await;
            drop_schema(store).await;
        }

        /// `migrate(&pool)` uses the schema `idem` and its own ledger there.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn migrate_defaults_to_the_idem_schema() {
            let Some(url) = harness::database_url() else {
                return;
            };
            let pool = pg::connect(&url, 2).await;
            idem_postgres::migrate(&pool).await.expect("migrate");
            let ledger: Option<String> =
                sqlx::query_scalar("SELECT to_regclass('idem._sqlx_migrations')::text")
                    .fetch_one(&pool)
                    .await
                    .expect("regclass");
            assert!(ledger.is_some(), "no ledger in the idem schema");
            let store = PgStore::new(pool);
            assert_eq!(store.schema(), "idem");
            // A unique scope: the schema `idem` is shared by every run against this server.
            let scope = Scope::new(uuid::Uuid::new_v4().to_string()).expect("scope");
            let id = RecordId::new(scope, Key::new("k").expect("key"));
            let lease = claim(&store, &id, LONG).await;
            store.release(&lease).await.expect("release");
        }
    }

    mod purge {
        //! Purging expired records (and their streams) in batches, and the purge task.

        use super::*;

        async fn table_rows(store: &PgStore) -> i64 {
            let count = format!("SELECT count(*) FROM {}.records", store.quoted_schema());
            sqlx::query_scalar(&count)
                .fetch_one(store.pool())
                .await
                .expect("count")
        }

        /// Expired records (completed or abandoned) go in batches of at most the size asked;
        /// live ones stay.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_deletes_expired_records_in_batches() {
            let Some(store) = fresh(4).await else { return };
            for k in 0..10 {
                let id = id(&format!("done-{k}"));
                completed(&store, &id, Duration::from_millis(50)).await;
            }
            for k in 0..10 {
                let id = id(&format!("abandoned-{k}"));
                let mut request = req(&id, Duration::from_millis(50));
                request.retention = Duration::from_millis(50);
                leased(store.begin(request).await.expect("begin"));
            }
            for k in 0..5 {
                claim(&store, &id(&format!("live-{k}")), LONG).await;
            }
            sleep(Duration::from_millis(300)).await;
            assert_eq!(
                table_rows(&store).await,
                25,
                "expired rows linger until purged"
            );
            for (batch, purged) in [(8, 8), (8, 8), (8, 4), (8, 0), (0, 0)] {
                assert_eq!(store.purge_expired(batch).await.expect("purge"), purged);
            }
            assert_eq!(table_rows(&store).await, 5);
            for k in 0..5 {
                let live = store.get(&id(&format!("live-{k}"))).await.expect("get");
                assert!(live.is_some(), "live-{k} was purged");
            }
            drop_schema(&store).await;
        }

        /// The streams of records no longer in progress under their token (completed, released,
        /// taken over) go with the purge; the stream of a live lease stays.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_deletes_the_streams_of_records_no_longer_in_progress() {
            let Some(store) = fresh(4).await else { return };
            let stream_rows = || async {
                let count = format!("SELECT count(*) FROM {}.streams", store.quoted_schema());
                sqlx::query_scalar::<_, i64>(&count)
                    .fetch_one(store.pool())
                    .await
                    .expect("count")
            };
            let finished = claim(&store, &id("streamed-done"), LONG).await;
            store.append(&finished, 0, b"a").await.expect("append");
            store.append(&finished, 1, b"b").await.expect("append");
            store
                .complete(&finished, &done("ab"), LONG)
                .await
                .expect("complete");
            let released = claim(&store, &id("streamed-released"), LONG).await;
            store.append(&released, 0, b"r").await.expect("append");
            store.release(&released).await.expect("release");
            let live = claim(&store, &id("streamed-live"), LONG).await;
            store.append(&live, 0, b"live").await.expect("append");
            assert_eq!(stream_rows().await, 4, "rows stay until the purge");
            store.purge_expired(100).await.expect("purge");
            assert_eq!(
                stream_rows().await,
                1,
                "only the live lease's stream is left"
            );
            drop_schema(&store).await;
        }

        /// The background task purges on its own and stops promptly on shutdown.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_task_runs_and_shuts_down() {
            let Some(store) = fresh(4).await else { return };
            for k in 0..12 {
                let id = id(&format!("done-{k}"));
                completed(&store, &id, Duration::from_millis(50)).await;
            }
            claim(&store, &id("live"), LONG).await;
            sleep(Duration::from_millis(200)).await;
            let purge = store.spawn_purge(
                PurgeConfig::default()
                    .with_interval(Duration::from_millis(50))
                    .with_batch(5)
                    .with_max_batches(10),
            );
            let started = Instant::now();
            while table_rows(&store).await > 1 {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "the purge task did not purge"
                );
                sleep(Duration::from_millis(20)).await;
            }
            assert!(!purge.is_finished());
            timeout(Duration::from_secs(2), purge.shutdown())
                .await
                .expect("shutdown within 2 s");
            assert!(store.get(&id("live")).await.expect("get").is_some());
            drop_schema(&store).await;
        }
    }

    mod errors {
        //! Store errors: a corrupt record, a terminated connection.

        use super::*;

        /// A record whose stored metadata does not decode is reported as corrupt, by `begin` and
        /// `get`, and left as it is.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn corrupt_record_is_reported_and_left_alone() {
            let Some(store) = fresh(4).await else { return };
            let id = id("k");
            completed(&store, &id, KEEP).await;
            sqlx::query(&format!(
                "UPDATE \"{}\".records SET meta = '\\x09ff'",
                store.schema()
            ))
            .execute(store.pool())
            .await
            .expect("corrupt it");
            assert!(matches!(
                store.begin(req(&id, LONG)).await,
                Err(Error::Corrupt { .. })
            ));
            assert!(matches!(store.get(&id).await, Err(Error::Corrupt { .. })));
            let meta: Vec<u8> =
                sqlx::query_scalar(&format!("SELECT meta FROM \"{}\".records", store.schema()))
                    .fetch_one(store.pool())
                    .await
                    .expect("read");
            assert_eq!(meta, vec![0x09, 0xff], "the corrupt record was changed");
            drop_schema(&store).await;
        }

        /// A connection the server terminated (`57P01`, then a closed socket) gives Unavailable.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn terminated_connection_is_unavailable() {
            let Some(store) = fresh(4).await else { return };
            let url = harness::database_url().expect("checked by fresh");
            let mut conn = PgConnection::connect(&url).await.expect("connect");
            let pid = backend_pid(&mut conn).await;
            terminate(store.pool(), pid).await;
            // Give the server a moment to close the socket.
            sleep(Duration::from_millis(100)).await;
            match store.begin_in(&mut conn, req(&id("k"), LONG)).await {
                Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
                other => panic!("expected Unavailable, got {other:?}"),
            }
            drop_schema(&store).await;
        }
    }
}
