//! `idem relay` as an operator runs it, against real PostgreSQL and Redis: its errors (the
//! same explanations as every `idem` command's), a start while Redis is down, a process
//! killed with `kill -9` mid-stream, the dead-letter commands, the metrics endpoint and
//! SIGTERM, a database it must not migrate, and TLS with certificate verification on.
//!
//! Needs `IDEM_TEST_DATABASE_URL` and `IDEM_TEST_REDIS_URL` (see `idem_testkit::harness`);
//! some tests start their own `redis-server`. Every test works in a PostgreSQL schema of its
//! own and a Redis key prefix of its own. The relay worker's own behaviour (outages, several
//! relays, shutdown mid-batch) is tested in crates/idem-outbox/tests/relay.rs.

mod support;

mod relay {
    use std::process::Stdio;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::support::{assert_fields, ms, outbox_rows};
    use idem_core::{
        Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, RecordId, RecordState,
        Response, Scope, Store,
    };
    use idem_testkit::harness;
    use idem_testkit::postgres::drop_schema;
    use idem_testkit::redis as testing;
    use idemkit::outbox::TieredStore;
    use idemkit::postgres::PgStore;
    use idemkit::redis::RedisStore;
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::process::{Child, Command};
    use tokio::time::timeout;

    /// The longest any test waits: generous for a loaded 2-core machine; nothing here
    /// asserts speed.
    const PATIENCE: Duration = Duration::from_secs(30);
    const KEEP: Duration = Duration::from_secs(600);

    // --- harness -------------------------------------------------------------------------------

    /// `idem relay <args>` as the tests start it: without the `IDEM_*` variables (and
    /// `RUST_LOG`) of the environment the tests run in, so only what the test passes counts;
    /// with no input; killed when its handle is dropped, so a failing test leaves no relay
    /// running.
    fn relay(args: &[&str]) -> Command {
        let mut cmd = super::support::idem(&["relay"]);
        for var in ["IDEM_LOG_FORMAT", "IDEM_RELAY_LOG", "RUST_LOG"] {
            cmd.env_remove(var);
        }
        cmd.args(args).stdin(Stdio::null());
        let mut cmd = Command::from(cmd);
        cmd.kill_on_drop(true);
        cmd
    }

    /// `command` run to its end: its exit code, stdout and stderr.
    async fn output(mut command: Command) -> (Option<i32>, String, String) {
        let out = timeout(PATIENCE, command.output())
            .await
            .expect("idem relay ends in time")
            .expect("idem relay runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// A PostgreSQL store on `db_url` in a schema of its own, with idem's and the outbox's
    /// tables.
    async fn migrated(db_url: &str) -> PgStore {
        let pg = PgStore::new(idem_testkit::postgres::connect(db_url, 10).await)
            .with_schema(&harness::unique_name("idem_t_"))
            .expect("a valid schema name");
        idemkit::outbox::migrate(&pg).await.expect("migrate");
        pg
    }

    fn completion(i: usize) -> Completion {
        Completion::succeeded(Response::new(201, format!("payment {i}")))
    }

    /// Key `i` of `scope`.
    fn id(scope: &Scope, i: usize) -> RecordId {
        RecordId::new(scope.clone(), Key::new(format!("k{i}")).expect("key"))
    }

    /// Commits key `i`'s completion through `tiered` in a business transaction and does not
    /// publish it: the relay is the only way it reaches Redis.
    async fn commit_unpublished(tiered: &TieredStore, scope: &Scope, i: usize) {
        let id = id(scope, i);
        let req = BeginRequest {
            id: &id,
            fingerprint: Fingerprint::of_bytes(format!("request {i}").as_bytes()),
            token: FencingToken::random(),
            lease: Duration::from_secs(60),
            retention: KEEP,
        };
        let Begin::Acquired(lease) = tiered.begin(req).await.expect("begin") else {
            panic!("key {i}: a fresh key")
        };
        let mut tx = tiered.pg().pool().begin().await.expect("transaction");
        tiered
            .complete_in(&mut tx, &lease, &completion(i), KEEP)
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
    }

    /// Asserts that `redis` holds key `i` completed with its own completion.
    async fn assert_in_redis(redis: &RedisStore, scope: &Scope, i: usize) {
        match redis.get(&id(scope, i)).await.expect("Redis get") {
            Some(record) => match record.state {
                RecordState::Completed(c) => assert_eq!(c, completion(i), "key {i}"),
                other => panic!("key {i} is not completed in Redis: {other:?}"),
            },
            None => panic!("key {i} is not in Redis"),
        }
    }

    /// A tiered store on the harness's servers, in a schema, Redis prefix and scope of its
    /// own.
    struct Env {
        tiered: TieredStore,
        /// Its `tiered:` URL.
        store: String,
        prefix: String,
        scope: Scope,
    }

    /// A Redis store at `url` under a key prefix of its own (`<name>-<random>:`), and that
    /// prefix.
    async fn redis_under_a_prefix(url: &str, name: &str) -> (RedisStore, String) {
        let prefix = format!("{name}-{}:", uuid::Uuid::new_v4().simple());
        let redis = RedisStore::builder(url)
            .with_prefix(prefix.clone())
            .connect()
            .await
            .expect("connect to Redis");
        (redis, prefix)
    }

    /// `None` when a backend is missing and not required.
    async fn env() -> Option<Env> {
        let db_url = harness::database_url()?;
        let redis_url = harness::redis_url()?;
        let pg = migrated(&db_url).await;
        let (redis, prefix) = redis_under_a_prefix(&redis_url, "idem-relay-cli").await;
        Some(Env {
            tiered: TieredStore::new(redis, pg),
            store: format!("tiered:{redis_url}|{db_url}"),
            prefix,
            scope: Scope::new(format!("relay-{}", uuid::Uuid::new_v4().simple())).unwrap(),
        })
    }

    impl Env {
        /// `idem relay run` on this store, standard output piped.
        fn spawn_run(&self, extra: &[&str]) -> Child {
            relay(&["run", "--store", &self.store, "--prefix", &self.prefix])
                .args(["--schema", self.tiered.pg().schema(), "--log", "warn"])
                .args(extra)
                .stdout(Stdio::piped())
                .spawn()
                .expect("start idem relay run")
        }
    }

    async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
        timeout(PATIENCE, child.wait())
            .await
            .expect("idem relay exits in time")
            .expect("wait for idem relay")
    }

    /// SIGTERM, then the exit status.
    async fn terminate(child: &mut Child) -> std::process::ExitStatus {
        super::support::signal(child.id().expect("idem relay still running"), "TERM");
        wait_exit(child).await
    }

    /// The address of the metrics endpoint, from the first line `idem relay run
    /// --metrics-listen` prints; what it wrote on stderr when it printed none.
    async fn metrics_address(child: &mut Child) -> Result<String, String> {
        let stdout = child.stdout.take().expect("stdout");
        let line = timeout(PATIENCE, BufReader::new(stdout).lines().next_line())
            .await
            .expect("the metrics address in time")
            .expect("read stdout")
            .unwrap_or_default();
        line.strip_prefix("idem relay: metrics on http://")
            .and_then(|rest| rest.strip_suffix("/metrics"))
            .map(str::to_owned)
            .ok_or(line)
    }

    /// `GET http://<addr><path>`: the status, and the content type and the body, each
    /// starting a line.
    async fn get(addr: &str, path: &str) -> (u16, String) {
        let url = format!("http://{addr}{path}");
        let reply = super::support::call(&super::support::client(), "GET", &url, &[], "").await;
        let body = String::from_utf8_lossy(&reply.body);
        let text = format!(
            "{}\n{body}",
            reply.header("content-type").unwrap_or_default()
        );
        (reply.status.as_u16(), text)
    }

    // --- tests ---------------------------------------------------------------------------------

    #[tokio::test]
    async fn errors_say_what_to_write() {
        let tiered = "tiered:redis://127.0.0.1:1|postgres://a@127.0.0.1:1/x";
        let backoff = ["--backoff-ms", "100", "--backoff-cap-ms", "10"];
        for (args, says) in [
            (
                vec!["run", "--metrics-listen", "9187"],
                &["--metrics-listen 127.0.0.1:9187"][..],
            ),
            // No store: `dead` needs only PostgreSQL, and the error says so.
            (
                vec!["dead", "list"],
                &["postgres:// URL", "tiered:REDIS_URL|POSTGRES_URL"],
            ),
            // `run` needs both halves.
            (
                vec!["run", "--store", "postgres://app:hunter2@127.0.0.1:1/x"],
                &["tiered:REDIS_URL|POSTGRES_URL"],
            ),
            (
                [&["run", "--store", tiered][..], &backoff].concat(),
                &["--backoff-cap-ms (10)"],
            ),
        ] {
            let (code, _, err) = output(relay(&args)).await;
            assert_eq!(code, Some(2), "{args:?}: {err}");
            for text in says {
                assert!(err.contains(text), "{args:?}: {err}");
            }
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[tokio::test]
    async fn names_the_protocol_found_at_the_port() {
        let Some(redis) = testing::throwaway(&[]) else {
            return;
        };
        let port = redis.url().rsplit(':').next().unwrap().to_owned();
        let url = format!("postgres://postgres:hunter2@127.0.0.1:{port}/test");
        let (code, _, err) = output(relay(&["dead", "list", "--store", &url])).await;
        assert_eq!(code, Some(3), "{err}");
        assert!(
            err.contains("speaks Redis and this URL expects PostgreSQL"),
            "{err}"
        );
        assert!(err.contains("use redis://"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    /// `run` starts while nothing answers at its Redis, never when another server answers
    /// there: a PostgreSQL port given as the Redis half is refused, as `dead list` refuses a
    /// Redis port given as PostgreSQL.
    #[tokio::test]
    async fn run_refuses_a_redis_url_at_a_postgresql_port() {
        let Some((redis, db_url)) = super::support::redis_url_at_the_postgresql_port() else {
            return;
        };
        let pg = migrated(&db_url).await;
        let store = format!("tiered:{redis}|{db_url}");
        let run = ["run", "--store", &store, "--schema", pg.schema()];
        let (code, _, err) = output(relay(&run)).await;
        assert_eq!(code, Some(3), "{err}");
        assert!(
            err.contains("speaks PostgreSQL and this URL expects Redis: use postgres://"),
            "{err}"
        );
        drop_schema(&pg).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn starts_while_redis_is_down_and_relays_once_it_returns() {
        let Some(db_url) = harness::database_url() else {
            return;
        };
        let Some(mut server) = testing::throwaway(&[]) else {
            return;
        };
        let redis_url = server.url();
        let prefix = format!("idem-relay-start-{}:", uuid::Uuid::new_v4().simple());
        let pg = migrated(&db_url).await;
        server.stop();

        let mut relay = relay(&["run"])
            .env("IDEM_STORE", format!("tiered:{redis_url}|{db_url}"))
            .env("IDEM_PREFIX", &prefix)
            .env("IDEM_SCHEMA", pg.schema())
            .args(["--poll-ms", "50", "--backoff-ms", "50", "--log", "info"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start idem relay");
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        {
            let lines = lines.clone();
            let mut stderr = BufReader::new(relay.stderr.take().unwrap()).lines();
            tokio::spawn(async move {
                while let Ok(Some(line)) = stderr.next_line().await {
                    lines.lock().unwrap().push(line);
                }
            });
        }
        let logged = |text: &'static str| {
            let lines = lines.clone();
            async move {
                let what = format!("idem relay logging {text:?}");
                harness::eventually(&what, PATIENCE, ms(50), || async {
                    let lines = lines.lock().unwrap();
                    lines.iter().any(|l| l.contains(text)).then_some(())
                })
                .await
            }
        };
        logged("Redis unreachable at start").await;
        logged("idem relay started").await;
        assert!(
            relay.try_wait().unwrap().is_none(),
            "{:#?}",
            lines.lock().unwrap()
        );

        // A completion committed while Redis is down: PostgreSQL alone takes it, and its
        // outbox row waits for the relay.
        let redis = RedisStore::builder(&redis_url)
            .with_prefix(prefix.clone())
            .connect_lazy()
            .unwrap();
        let tiered = TieredStore::new(redis.clone(), pg.clone());
        let scope = Scope::global();
        commit_unpublished(&tiered, &scope, 0).await;

        // Redis returns: the relay says so and writes the completion into it.
        server.start_again().expect("restart redis-server");
        harness::eventually("the completion in Redis", PATIENCE, ms(100), || async {
            redis.get(&id(&scope, 0)).await.ok().flatten()
        })
        .await;
        assert_in_redis(&redis, &scope, 0).await;
        logged("Redis reachable").await;
        assert!(relay.try_wait().unwrap().is_none(), "the relay stopped");

        assert!(terminate(&mut relay).await.success());
        logged("idem relay: shutting down").await;
        drop_schema(&pg).await;
    }

    /// `kill -9` of a relay process while it drains a backlog in small batches, then a new
    /// process: every committed completion reaches Redis, and the outbox empties.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_mid_stream_loses_nothing() {
        const ROWS: usize = 1200;
        let Some(env) = env().await else {
            return;
        };
        let (tiered, scope) = (Arc::new(env.tiered.clone()), env.scope.clone());
        let mut writers = tokio::task::JoinSet::new();
        for t in 0..8 {
            let (tiered, scope) = (tiered.clone(), scope.clone());
            writers.spawn(async move {
                for i in (0..ROWS).skip(t).step_by(8) {
                    commit_unpublished(&tiered, &scope, i).await;
                }
            });
        }
        writers.join_all().await;
        let pg = tiered.pg();
        assert_eq!(outbox_rows(pg, None).await, ROWS as i64);

        let mut first = env.spawn_run(&["--batch", "10", "--poll-ms", "50"]);
        // Kill it once it has relayed a few batches, while most of the backlog is left.
        let left = harness::eventually("the relay started", PATIENCE, ms(2), || async {
            let left = outbox_rows(pg, None).await;
            (left <= (ROWS - 30) as i64).then_some(left)
        })
        .await;
        first.start_kill().expect("kill -9 the relay");
        let status = wait_exit(&mut first).await;
        assert!(!status.success(), "killed, not exited: {status:?}");
        let left_at_kill = outbox_rows(pg, None).await;
        assert!(
            left_at_kill > 0,
            "the relay finished before the kill ({left} left when it was sent): nothing was tested"
        );

        // A new process takes over and drains what is left, including any batch the dead one
        // had claimed (its transaction died with its connection).
        let mut second = env.spawn_run(&["--batch", "100", "--poll-ms", "50"]);
        harness::eventually("the outbox empty", PATIENCE, ms(50), || async {
            (outbox_rows(pg, None).await == 0).then_some(())
        })
        .await;
        assert!(terminate(&mut second).await.success());

        for i in 0..ROWS {
            assert_in_redis(tiered.redis(), &scope, i).await;
        }
        drop_schema(pg).await;
    }

    /// `dead list` (text and JSON) and `dead retry --id` on a dead row, with the store from
    /// `IDEM_STORE` and `IDEM_SCHEMA` as every `idem` command reads them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_letters_are_listed_and_retried() {
        let Some(db_url) = harness::database_url() else {
            return;
        };
        let pg = migrated(&db_url).await;
        let schema = pg.schema().to_owned();
        let dead_list = |args: &[&str]| {
            let mut command = relay(&["dead"]);
            command.args(args).env("IDEM_STORE", &db_url);
            command.env("IDEM_SCHEMA", &schema);
            output(command)
        };
        let (code, out, err) = dead_list(&["list"]).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(
            out.contains(&format!("no dead outbox rows in schema {schema}")),
            "{out}"
        );

        let id: i64 = sqlx::query_scalar(&format!(
            "INSERT INTO {}.outbox \
             (scope, key, fingerprint, token, attempt, meta, body, expires_at, tries, dead, \
              last_error) \
             VALUES ('', 'broken', $1, $2, 1, '\\xff'::bytea, '', now() + interval '1 hour', \
              3, true, 'corrupt record') RETURNING id",
            pg.quoted_schema()
        ))
        .bind(vec![0u8; 32])
        .bind(uuid::Uuid::new_v4())
        .fetch_one(pg.pool())
        .await
        .expect("insert a dead row");

        let (code, out, err) = dead_list(&["list"]).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("/broken: corrupt record"), "{out}");
        let (code, out, err) = dead_list(&["list", "--json"]).await;
        assert_eq!(code, Some(0), "{err}");
        let line: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
        assert_fields(
            &line,
            serde_json::json!({"id": id, "tries": 3, "key": "broken"}),
        );

        // Retried by id, the store given by flag: pending again, tries reset.
        let store = format!("tiered:redis://127.0.0.1:1|{db_url}");
        let mut retry = relay(&["dead", "retry", "--id", &id.to_string(), "--store", &store]);
        retry.args(["--schema", &schema]);
        let (code, out, err) = output(retry).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(
            out.starts_with("1 dead outbox rows made pending again"),
            "{out}"
        );
        let (dead, tries): (bool, i32) = sqlx::query_as(&format!(
            "SELECT dead, tries FROM {}.outbox WHERE id = $1",
            pg.quoted_schema()
        ))
        .bind(id)
        .fetch_one(pg.pool())
        .await
        .expect("the row");
        assert_eq!((dead, tries), (false, 0));
        drop_schema(&pg).await;
    }

    /// `--metrics-listen` serves the relay's metrics at `GET /metrics`; SIGTERM exits 0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_metrics_and_exits_cleanly_on_sigterm() {
        let Some(env) = env().await else { return };
        let (tiered, scope) = (&env.tiered, &env.scope);
        commit_unpublished(tiered, scope, 7).await;
        let mut child = env.spawn_run(&["--metrics-listen", "127.0.0.1:0"]);
        let addr = metrics_address(&mut child)
            .await
            .unwrap_or_else(|line| panic!("unexpected line: {line}"));
        let schema = tiered.pg().schema();
        // The counter is bumped after the commit that emptied the outbox: give it a moment.
        let relayed = format!("idem_relay_relayed_total{{schema=\"{schema}\"}} 1");
        let (status, response) =
            harness::eventually("the row relayed", PATIENCE, ms(50), || async {
                let (status, response) = get(&addr, "/metrics").await;
                response.contains(&relayed).then_some((status, response))
            })
            .await;
        assert_in_redis(tiered.redis(), scope, 7).await;
        assert_eq!(status, 200, "{response}");
        assert!(
            response.starts_with("text/plain; version=0.0.4"),
            "{response}"
        );
        for (name, value) in [
            ("idem_relay_failed_total", "0"),
            ("idem_relay_dead", "0"),
            ("idem_relay_backlog", "0"),
            ("idem_relay_lag_seconds", "0"),
        ] {
            let sample = format!("\n{name}{{schema=\"{schema}\"}} {value}\n");
            assert!(
                response.contains(&sample),
                "missing {sample:?} in\n{response}"
            );
        }
        assert_eq!(get(&addr, "/nope").await.0, 404);

        let status = terminate(&mut child).await;
        assert!(status.success(), "SIGTERM gives exit 0: {status:?}");
        drop_schema(tiered.pg()).await;
    }

    /// Without `--migrate`, `idem relay run` on a database lacking idem's tables (started
    /// beside `idem serve --migrate`, before it) creates nothing: it says once what it waits
    /// for and how the tables are made, then relays once they are there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_without_migrate_waits_for_the_schema_and_creates_nothing() {
        let (Some(db_url), Some(redis_url)) = (harness::database_url(), harness::redis_url())
        else {
            return;
        };
        // A schema nobody made yet: the relay started before `idem serve --migrate`.
        let schema = harness::unique_name("idem_relay_wait_");
        let pg = PgStore::new(idem_testkit::postgres::connect(&db_url, 10).await)
            .with_schema(&schema)
            .expect("a valid schema name");
        let (redis, prefix) = redis_under_a_prefix(&redis_url, "idem-relay-wait").await;
        let tiered = TieredStore::new(redis, pg);
        let scope = Scope::new(format!("relay-{}", uuid::Uuid::new_v4().simple())).unwrap();
        let store = format!("tiered:{redis_url}|{db_url}");
        let run = [
            "run", "--store", &store, "--prefix", &prefix, "--schema", &schema,
        ];
        let mut child = relay(&run)
            .args(["--log", "warn", "--poll-ms", "50"])
            .stderr(Stdio::piped())
            .spawn()
            .expect("start idem relay run");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let waiting = timeout(PATIENCE, async {
            while let Some(line) = lines.next_line().await.expect("read stderr") {
                if line.contains("waiting for idem's tables and the outbox") {
                    return line;
                }
            }
            panic!("idem relay run ended without saying what it waits for")
        })
        .await
        .expect("the waiting line in time");
        assert!(waiting.contains("--migrate"), "{waiting}");
        // Keep reading, so that the relay never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        assert!(
            !super::support::schema_exists(&db_url, &schema).await,
            "idem relay run created schema {schema} without --migrate"
        );

        // The schema made (as `idem serve --migrate` makes it): the relay relays.
        idemkit::outbox::migrate(tiered.pg())
            .await
            .expect("migrate");
        commit_unpublished(&tiered, &scope, 0).await;
        harness::eventually("the outbox empty", PATIENCE, ms(50), || async {
            (outbox_rows(tiered.pg(), None).await == 0).then_some(())
        })
        .await;
        assert_in_redis(tiered.redis(), &scope, 0).await;
        assert!(terminate(&mut child).await.success());
        drop_schema(tiered.pg()).await;
    }

    /// Over TLS with certificate verification on: a `redis-server` with a `--tls-port` and a
    /// PostgreSQL with `ssl=on` that the test starts, with certificates it makes. The relay
    /// connects to both, migrates, serves its metrics (read from PostgreSQL) and stops
    /// cleanly; trusting another authority, it refuses to start.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_over_tls() {
        let Some(servers) = super::support::TlsServers::start() else {
            return;
        };
        let ca = servers.pki.path("ca.pem");
        let store = |redis_ca: &str, pg_ca: &str| servers.tiered_url(redis_ca, pg_ca);
        let start = |store: String| {
            let mut command = relay(&["run", "--migrate", "--store", &store]);
            let args = ["--metrics-listen", "127.0.0.1:0", "--log", "warn"];
            command
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            command
        };

        let mut child = start(store(&ca, &ca)).spawn().expect("start idem relay");
        let addr = match metrics_address(&mut child).await {
            Ok(addr) => addr,
            Err(line) => {
                let out = child.wait_with_output().await.expect("relay output");
                panic!(
                    "idem relay did not start over TLS ({line:?}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        };
        // The gauges come from PostgreSQL at every scrape: over TLS.
        let (status, response) = get(&addr, "/metrics").await;
        assert_eq!(status, 200, "{response}");
        assert!(
            response.contains("\nidem_relay_backlog{schema=\"idem\"} 0\n"),
            "{response}"
        );
        assert!(terminate(&mut child).await.success());

        // Trusting another authority, for either store: the relay refuses to start (3).
        let other = servers.pki.path("other-ca.pem");
        for store in [store(&ca, &other), store(&other, &ca)] {
            let (code, _, err) = output(start(store)).await;
            assert_eq!(code, Some(3), "{err}");
        }
    }
}
