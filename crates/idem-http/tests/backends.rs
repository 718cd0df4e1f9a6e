//! End to end over real HTTP against every store: an axum server on a loopback port behind
//! the layer, a hyper client, and the store under test. The store-sensitive cases (a burst
//! of identical requests runs the handler once, replay byte for byte, 422 on a reused key,
//! scopes kept apart, 5xx releases the key, lease renewal, 503 when the store is down) are
//! written once in `cases` and instantiated per backend in a module named after it
//! (`memory`, `redis`, `postgres`, `tiered`), so `cargo test redis` runs one backend.
//!
//! Redis and PostgreSQL come from `IDEM_TEST_REDIS_URL` and `IDEM_TEST_DATABASE_URL`
//! (`scripts/test` provides them; see `idem_testkit::harness`). Each test has a key prefix
//! or a schema of its own, so tests run in parallel on one server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use idem_core::Store;

mod support;

/// What cleans up after a test.
type Teardown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A store for one test, and what to clean up after it.
struct Fixture {
    store: Arc<dyn Store>,
    /// Run when the test passed (a failed test leaves its data for a look).
    teardown: Option<Teardown>,
}

impl Fixture {
    fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            teardown: None,
        }
    }
}

/// One `#[tokio::test]` per case in the module where it is invoked, on stores from
/// `$factory` (an `async fn() -> Option<Fixture>`; `None`: backend missing, the harness
/// said why); with `unreachable = $path` (an `async fn() -> Arc<dyn Store>` pointed at a
/// closed port), the store-down case too.
macro_rules! backend_cases {
    ($factory:path $(, unreachable = $unreachable:path)?) => {
        backend_cases!(@each $factory;
            a_burst_of_identical_requests_runs_the_handler_once,
            with_a_wait_every_caller_of_a_burst_gets_the_one_response,
            a_replay_is_byte_for_byte_with_allowed_headers_only,
            a_key_reused_for_another_request_is_refused_with_422,
            one_scope_never_sees_another_scopes_response,
            a_5xx_releases_the_key_and_a_4xx_is_stored,
            a_slow_handler_keeps_its_lease_alive,
            a_store_stall_shorter_than_the_lease_never_costs_it,
            a_stale_holder_never_sends_a_2xx_the_key_will_not_replay,
            a_client_that_disconnects_does_not_cancel_the_work,
        );
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_unreachable_store_fails_closed_with_503() {
                crate::cases::an_unreachable_store_fails_closed_with_503($unreachable().await)
                    .await;
            }
        )?
    };
    (@each $factory:path; $($case:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(fixture) = $factory().await else {
                    return;
                };
                crate::cases::$case(fixture.store.clone()).await;
                if let Some(teardown) = fixture.teardown {
                    teardown.await;
                }
            }
        )*
    };
}

mod cases {
    //! The cases, each taking the store under test.

    use std::sync::Arc;
    use std::time::{Duration, Instant, SystemTime};

    use axum::http::StatusCode;
    use idem_core::{Idem, Store};
    use idem_http::{Config, Outcome};

    use crate::support::*;

    /// `n` copies of one `POST /pay` sent at once, each from a task of its own: the replies,
    /// in the order sent.
    async fn burst(
        server: &Server,
        n: usize,
        headers: &[(&'static str, &'static str)],
        body: &'static str,
    ) -> Vec<Reply> {
        let tasks: Vec<_> = (0..n)
            .map(|_| server.spawn_post("/pay", headers, body))
            .collect();
        let mut replies = Vec::with_capacity(n);
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    }

    /// The payments app on `store`, with the default configuration.
    async fn pay_on(store: Arc<dyn Store>) -> (Server, Runs, Outcomes) {
        serve_pay(Idem::from_arc(store), Config::default()).await
    }

    pub async fn a_burst_of_identical_requests_runs_the_handler_once(store: Arc<dyn Store>) {
        let (server, runs, outcomes) = pay_on(store).await;
        let headers = [
            ("idempotency-key", "burst-1"),
            ("authorization", "Bearer alice"),
            ("x-delay-ms", "300"),
            JSON,
        ];
        let order = r#"{"amount": 1250, "currency": "EUR"}"#;
        let mut created = Vec::new();
        let mut conflicts = 0;
        for reply in burst(&server, 24, &headers, order).await {
            match reply.status {
                StatusCode::CREATED => created.push(reply.body),
                StatusCode::CONFLICT => {
                    assert_eq!(reply.problem_type(), "urn:idem:problem:request-in-flight");
                    let after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                    // At most the 30 s lease, rounded up. PostgreSQL (and so the tiered
                    // store) may overshoot it by the time a `begin` waited on the holder's
                    // row lock (its clock is read before the wait): hence 31.
                    assert!((1..=31).contains(&after), "retry-after {after}");
                    conflicts += 1;
                }
                other => panic!("unexpected {other}: {reply:?}"),
            }
        }
        assert_eq!(runs.get(), 1, "the handler ran more than once");
        assert!(!created.is_empty());
        assert!(created.iter().all(|b| *b == created[0]));
        assert_eq!(created.len() + conflicts, 24);
        assert_eq!(outcomes.count(Outcome::Executed), 1);
        assert_eq!(outcomes.count(Outcome::InFlight), conflicts);

        // Every caller that got 409 gets the one stored response when it retries.
        let retry = server
            .post(
                "/pay",
                &[
                    ("idempotency-key", "burst-1"),
                    ("authorization", "Bearer alice"),
                    JSON,
                ],
                r#"{"currency": "EUR", "amount": 1250}"#,
            )
            .await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.replayed());
        assert_eq!(retry.body, created[0]);
        assert_eq!(runs.get(), 1);
    }

    pub async fn with_a_wait_every_caller_of_a_burst_gets_the_one_response(store: Arc<dyn Store>) {
        let idem = Idem::from_arc(store)
            .with_config(idem_core::Config::default().with_wait(Duration::from_secs(5)));
        let (server, runs, _) = serve_pay(idem, Config::default()).await;
        let headers = [("idempotency-key", "burst-2"), ("x-delay-ms", "200"), JSON];
        let replies = burst(&server, 12, &headers, r#"{"amount": 1}"#).await;
        assert_eq!(runs.get(), 1);
        assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
        assert!(replies.iter().all(|r| r.body == replies[0].body));
        assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    }

    pub async fn a_replay_is_byte_for_byte_with_allowed_headers_only(store: Arc<dyn Store>) {
        let (server, runs, outcomes) = serve_counted(
            Idem::from_arc(store),
            Config::default(),
            "/blob",
            |n, _, _| async move {
                let body: Vec<u8> = (0..=255u8).chain([0xff, 0xfe, n as u8]).collect();
                let headers = [
                    ("content-type", "application/octet-stream"),
                    ("location", "/blob/7"),
                    ("set-cookie", "session=secret"),
                    ("x-request-id", "req-1"),
                ];
                (StatusCode::ACCEPTED, headers, body)
            },
        )
        .await;
        let headers = [("idempotency-key", "\"blob-1\"")];

        let first = server.post("/blob", &headers, "").await;
        assert_eq!(first.status, StatusCode::ACCEPTED);
        assert!(!first.replayed());
        assert_eq!(first.header("set-cookie"), Some("session=secret"));
        assert_eq!(first.header("x-request-id"), Some("req-1"));

        let again = server.post("/blob", &headers, "").await;
        assert_eq!(runs.get(), 1);
        assert_eq!(again.status, StatusCode::ACCEPTED);
        assert_eq!(again.body, first.body, "replayed body differs");
        assert_eq!(again.body.len(), 259);
        assert!(again.replayed());
        assert_eq!(
            again.header("content-type"),
            Some("application/octet-stream")
        );
        assert_eq!(again.header("location"), Some("/blob/7"));
        assert_eq!(
            again.header("set-cookie"),
            None,
            "Set-Cookie must never be replayed"
        );
        assert_eq!(
            again.header("x-request-id"),
            None,
            "unlisted headers are not replayed"
        );
        assert_eq!(again.header("content-length"), Some("259"));
        let expires =
            httpdate::parse_http_date(again.header("idempotency-expires").unwrap()).unwrap();
        let left = expires.duration_since(SystemTime::now()).unwrap();
        assert!(left > Duration::from_secs(23 * 3600) && left <= Duration::from_secs(24 * 3600));

        // The key in its quoted (RFC 8941) and bare forms is the same key.
        let bare = server
            .post("/blob", &[("idempotency-key", "blob-1")], "")
            .await;
        bare.assert_replay_of(&first);
        assert_eq!(outcomes.count(Outcome::Replayed), 2);
    }

    pub async fn a_key_reused_for_another_request_is_refused_with_422(store: Arc<dyn Store>) {
        let (server, runs, outcomes) = pay_on(store).await;
        let key = ("idempotency-key", "k-mismatch");

        let first = server.post("/pay", &[key, JSON], r#"{"amount": 1}"#).await;
        assert_eq!(first.status, StatusCode::CREATED);
        // Same JSON, other key order and spacing: a retry, not a mismatch.
        let same = server
            .post("/pay", &[key, JSON], r#"{ "amount" : 1 }"#)
            .await;
        assert!(same.replayed());
        let other = server.post("/pay", &[key, JSON], r#"{"amount": 2}"#).await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            other.problem_type(),
            "urn:idem:problem:idempotency-key-reused"
        );
        assert_eq!(runs.get(), 1);
        assert_eq!(outcomes.count(Outcome::Mismatch), 1);
    }

    pub async fn one_scope_never_sees_another_scopes_response(store: Arc<dyn Store>) {
        let (server, runs, _) = pay_on(store).await;
        let body = r#"{"amount": 5}"#;
        let as_user = |user: &'static str| {
            [
                ("idempotency-key", "shared-key"),
                ("authorization", user),
                JSON,
            ]
        };

        let alice = server.post("/pay", &as_user("Bearer alice"), body).await;
        let bob = server.post("/pay", &as_user("Bearer bob"), body).await;
        assert_eq!(alice.status, StatusCode::CREATED);
        assert_eq!(bob.status, StatusCode::CREATED);
        assert!(!bob.replayed(), "bob was handed alice's response");
        assert_ne!(alice.body, bob.body);
        assert_eq!(runs.get(), 2);

        let alice_again = server.post("/pay", &as_user("Bearer alice"), body).await;
        alice_again.assert_replay_of(&alice);
        // Anonymous requests share the global scope, apart from every named one.
        let anonymous = server
            .post("/pay", &[("idempotency-key", "shared-key"), JSON], body)
            .await;
        assert!(!anonymous.replayed());
        assert_eq!(runs.get(), 3);
    }

    pub async fn a_5xx_releases_the_key_and_a_4xx_is_stored(store: Arc<dyn Store>) {
        let (server, runs, outcomes) = serve_counted(
            Idem::from_arc(store),
            Config::default(),
            "/flaky",
            |n, _, body| async move {
                match (&body[..], n) {
                    (b"client-error", _) => (StatusCode::BAD_REQUEST, format!("bad {n}")),
                    (_, 1) => (StatusCode::BAD_GATEWAY, format!("down {n}")),
                    _ => (StatusCode::CREATED, format!("made {n}")),
                }
            },
        )
        .await;
        let key = [("idempotency-key", "five-1")];

        let first = server.post("/flaky", &key, "x").await;
        assert_eq!(first.status, StatusCode::BAD_GATEWAY);
        let second = server.post("/flaky", &key, "x").await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed(), "a 5xx must not be stored");
        assert_eq!(&second.body[..], b"made 2");
        assert_eq!(runs.get(), 2);
        assert!(server.post("/flaky", &key, "x").await.replayed());

        let key = [("idempotency-key", "four-1")];
        let bad = server.post("/flaky", &key, "client-error").await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        let bad_again = server.post("/flaky", &key, "client-error").await;
        bad_again.assert_replay_of(&bad);
        assert_eq!(runs.get(), 3);
        assert_eq!(outcomes.count(Outcome::NotStored), 1);
    }

    pub async fn a_slow_handler_keeps_its_lease_alive(store: Arc<dyn Store>) {
        let idem = Idem::from_arc(store)
            .with_config(idem_core::Config::default().with_lease(Duration::from_millis(600)));
        let (server, runs, _) = serve_pay(idem, Config::default()).await;
        let headers = [("idempotency-key", "slow-1"), ("x-delay-ms", "2000"), JSON];

        let first = server.spawn_post("/pay", &headers, "{}");
        // Well past the first lease's length: without renewal a retry would take the key over.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let retry = server.post("/pay", &headers, "{}").await;
        assert_eq!(retry.status, StatusCode::CONFLICT);
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
        assert_eq!(runs.get(), 1);
    }

    /// `store` behind switches that stall its renewals, under an engine with `lease` and a
    /// time limit of `store_timeout` on store calls, serving `POST /pay`.
    async fn pay_on_stallable(
        store: Arc<dyn Store>,
        lease: Duration,
        store_timeout: Duration,
    ) -> (
        Server,
        Runs,
        Outcomes,
        Arc<idem_testkit::faults::FaultyStore>,
    ) {
        let faulty = Arc::new(idem_testkit::faults::FaultyStore::from_arc(store));
        let config = idem_core::Config::default()
            .with_lease(lease)
            .with_store_timeout(store_timeout);
        let idem = Idem::from_arc(faulty.clone()).with_config(config);
        let (server, runs, outcomes) = serve_pay(idem, Config::default()).await;
        (server, runs, outcomes, faulty)
    }

    /// The store stalls from 0.5 s to 2.6 s into a 3 s lease while the handler works for
    /// 6 s: the renewal due at 1 s times out at 2.2 s, its retry waits out the stall, and
    /// the lease holds. Retries all along get 409, the handler runs once.
    pub async fn a_store_stall_shorter_than_the_lease_never_costs_it(store: Arc<dyn Store>) {
        let (lease, limit) = (Duration::from_secs(3), Duration::from_millis(1200));
        let (server, runs, _, faulty) = pay_on_stallable(store, lease, limit).await;
        let headers = [("idempotency-key", "stall-1"), ("x-delay-ms", "6000"), JSON];
        let started = Instant::now();
        let first = server.spawn_post("/pay", &headers, "{}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        faulty.set_extend_stalled(true);
        tokio::time::sleep(Duration::from_millis(2100)).await;
        faulty.set_extend_stalled(false);
        // Retries past the first grant's deadline (3 s) until the handler is done.
        while started.elapsed() < Duration::from_millis(5500) {
            let retry = server.post("/pay", &headers, "{}").await;
            assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert_eq!(runs.get(), 1);
        let replay = server.post("/pay", &headers, "{}").await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first.body);
    }

    /// The store stalls for longer than the lease (1.5 s) while the handler works for 3 s:
    /// a retry at 2 s takes the key over and its run is stored. The first run's 201 is then
    /// not the key's answer: its client gets 503 `lease-lost`, and its retry the stored
    /// answer of the second run. Every 2xx any client saw is the one stored answer.
    pub async fn a_stale_holder_never_sends_a_2xx_the_key_will_not_replay(store: Arc<dyn Store>) {
        let (lease, limit) = (Duration::from_millis(1500), Duration::from_millis(500));
        let (server, runs, outcomes, faulty) = pay_on_stallable(store, lease, limit).await;
        let slow = [("idempotency-key", "stale-1"), ("x-delay-ms", "3000"), JSON];
        let fast = [("idempotency-key", "stale-1"), JSON];
        let first = server.spawn_post("/pay", &slow, "{}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        faulty.set_extend_stalled(true);
        tokio::time::sleep(Duration::from_millis(1800)).await;
        let second = server.post("/pay", &fast, "{}").await;
        assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
        faulty.set_extend_stalled(false);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
        assert_eq!(first.problem_type(), "urn:idem:problem:lease-lost");
        assert_eq!(outcomes.count(Outcome::LeaseLost), 1);
        assert_eq!(
            runs.get(),
            2,
            "the overlap: the second attempt ran beside the first"
        );
        let retry = server.post("/pay", &slow, "{}").await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, second.body);
    }

    pub async fn a_client_that_disconnects_does_not_cancel_the_work(store: Arc<dyn Store>) {
        use tokio::io::AsyncWriteExt;

        let finished = Runs::default();
        let f = finished.clone();
        let (server, started, outcomes) = serve_counted(
            Idem::from_arc(store),
            Config::default(),
            "/slow",
            move |run, _, _| {
                let f = f.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    f.next();
                    (StatusCode::CREATED, format!("paid, run {run}"))
                }
            },
        )
        .await;

        // A client that sends the request and hangs up while the handler runs.
        let addr = server.base.strip_prefix("http://").unwrap();
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(
            b"POST /slow HTTP/1.1\r\nhost: test\r\nidempotency-key: gone-1\r\n\
              content-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while started.get() == 0 {
            assert!(Instant::now() < deadline, "the handler never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(tcp);

        // Its retry: 409 with a short hint while the work runs, then the stored response.
        let key = [("idempotency-key", "gone-1")];
        let reply = loop {
            let reply = server.post("/slow", &key, "{}").await;
            if reply.status != StatusCode::CONFLICT {
                break reply;
            }
            assert_eq!(reply.header("retry-after"), Some("1"), "{reply:?}");
            assert!(Instant::now() < deadline, "the work never ended: {reply:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(&reply.body[..], b"paid, run 1");
        assert_eq!(
            finished.get(),
            1,
            "the handler was cancelled with the connection"
        );
        assert_eq!(started.get(), 1, "the handler ran twice");
        assert_eq!(outcomes.count(Outcome::Executed), 1);
    }

    pub async fn an_unreachable_store_fails_closed_with_503(store: Arc<dyn Store>) {
        let (server, runs, outcomes) = pay_on(store).await;
        let started = Instant::now();
        let reply = server
            .post("/pay", &[("idempotency-key", "down-1"), JSON], "{}")
            .await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
        assert_eq!(reply.problem_type(), "urn:idem:problem:store-unavailable");
        assert!(reply.header("retry-after").is_some(), "{reply:?}");
        assert_eq!(runs.get(), 0, "the handler ran unguarded");
        assert_eq!(outcomes.count(Outcome::StoreError), 1);
        // Bounded by the store's timeouts, not hung on a dead connection.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "took {:?}",
            started.elapsed()
        );
    }
}

mod memory {
    //! The embedded in-memory store.

    use std::sync::Arc;

    use idem_core::MemoryStore;

    use crate::Fixture;

    async fn store() -> Option<Fixture> {
        Some(Fixture::new(Arc::new(MemoryStore::new())))
    }

    backend_cases!(store);
}

mod redis {
    //! One Redis server: `IDEM_TEST_REDIS_URL`, a key prefix per test.

    use std::sync::Arc;
    use std::time::Duration;

    use idem_redis::RedisStore;
    use idem_testkit::harness;

    use crate::Fixture;

    fn prefix() -> String {
        format!("idem-http-test-{}:", uuid::Uuid::new_v4().simple())
    }

    /// A store on `IDEM_TEST_REDIS_URL` under a prefix of its own.
    pub(crate) async fn fresh_store() -> Option<RedisStore> {
        let url = harness::redis_url()?;
        // Patient timeouts: tests run in parallel on a small shared machine. Records expire
        // with their retention; nothing to clean up.
        let store = RedisStore::builder(url)
            .with_prefix(prefix())
            .with_timeouts(Duration::from_secs(1), Duration::from_secs(8))
            .connect()
            .await
            .expect("connect to IDEM_TEST_REDIS_URL");
        Some(store)
    }

    /// A store pointed at a port nothing listens on, built without connecting.
    pub(crate) fn closed_port_store() -> RedisStore {
        let url = format!("redis://127.0.0.1:{}", harness::refused_port());
        RedisStore::builder(url)
            .with_prefix(prefix())
            .connect_lazy()
            .expect("a lazy store builds without a server")
    }

    async fn store() -> Option<Fixture> {
        Some(Fixture::new(Arc::new(fresh_store().await?)))
    }

    async fn unreachable() -> Arc<dyn idem_core::Store> {
        Arc::new(closed_port_store())
    }

    backend_cases!(store, unreachable = unreachable);
}

mod postgres {
    //! PostgreSQL: `IDEM_TEST_DATABASE_URL`, a schema per test (`idem_testkit::postgres`'s
    //! `idem_t_<unix seconds>_<random>`), dropped when the test passes; schemas of runs over
    //! an hour old are dropped too.

    use std::sync::Arc;

    use idem_postgres::PgStore;
    use idem_testkit::postgres;

    use crate::{Fixture, Teardown};

    /// A migrated store in a schema of its own, and the teardown that drops the schema.
    pub(crate) async fn fresh_store() -> Option<(PgStore, Teardown)> {
        let store = postgres::fresh_store(8).await?;
        // The records table and the outbox's: the tiered backend uses this store too.
        idem_outbox::migrate(&store).await.expect("migrate");
        let dropped = store.clone();
        let teardown: Teardown = Box::pin(async move { postgres::drop_schema(&dropped).await });
        Some((store, teardown))
    }

    pub(crate) use postgres::closed_port_store;

    async fn store() -> Option<Fixture> {
        let (store, teardown) = fresh_store().await?;
        Some(Fixture {
            store: Arc::new(store),
            teardown: Some(teardown),
        })
    }

    async fn unreachable() -> Arc<dyn idem_core::Store> {
        Arc::new(closed_port_store())
    }

    backend_cases!(store, unreachable = unreachable);
}

mod tiered {
    //! The tiered store: Redis first (a prefix per test), PostgreSQL the arbiter (a schema
    //! per test).

    use std::sync::Arc;

    use idem_outbox::TieredStore;

    use crate::Fixture;

    async fn store() -> Option<Fixture> {
        let redis = crate::redis::fresh_store().await?;
        let (pg, teardown) = crate::postgres::fresh_store().await?;
        Some(Fixture {
            store: Arc::new(TieredStore::new(redis, pg)),
            teardown: Some(teardown),
        })
    }

    /// Both tiers pointed at ports nothing listens on.
    async fn unreachable() -> Arc<dyn idem_core::Store> {
        Arc::new(TieredStore::new(
            crate::redis::closed_port_store(),
            crate::postgres::closed_port_store(),
        ))
    }

    backend_cases!(store, unreachable = unreachable);
}

mod transactional {
    //! The handler completes the record in its own PostgreSQL transaction (`complete_in` of
    //! `PgStore` and `TieredStore`, reached through the `LeaseHandle` in its extensions):
    //! the layer does not store it again; a handler that does not complete leaves the
    //! storing to the layer.

    use std::sync::Arc;
    use std::time::Duration;

    use axum::extract::Extension;
    use axum::http::{HeaderMap, HeaderValue, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::post;
    use axum::Router;
    use idem_core::{Completion, Error, Idem, Lease, Store};
    use idem_http::{Config, LeaseHandle, Outcome};
    use idem_outbox::TieredStore;
    use idem_postgres::PgStore;
    use idem_testkit::faults::FaultyStore;
    use sqlx::PgConnection;

    use crate::support::*;

    /// The store whose `complete_in` the handler calls.
    #[derive(Clone)]
    enum Transactional {
        Pg(PgStore),
        Tiered(TieredStore),
    }

    impl Transactional {
        fn pg(&self) -> &PgStore {
            match self {
                Self::Pg(pg) => pg,
                Self::Tiered(tiered) => tiered.pg(),
            }
        }

        async fn complete_in(
            &self,
            conn: &mut PgConnection,
            lease: &Lease,
            completion: &Completion,
            retention: Duration,
        ) -> Result<(), Error> {
            match self {
                Self::Pg(pg) => pg.complete_in(conn, lease, completion, retention).await,
                Self::Tiered(t) => t.complete_in(conn, lease, completion, retention).await,
            }
        }

        /// After the commit: the tiered store copies the completion into Redis at once
        /// (its relay would, later); until then Redis answers retries in flight.
        async fn publish(&self, lease: &Lease, completion: &Completion, retention: Duration) {
            if let Self::Tiered(t) = self {
                t.publish(lease, completion, retention).await.unwrap();
            }
        }
    }

    async fn completes_in_the_handlers_transaction(tx_store: Transactional, store: Arc<dyn Store>) {
        let table = format!("{}.payments", tx_store.pg().quoted_schema());
        sqlx::query(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, request text NOT NULL)"
        ))
        .execute(tx_store.pg().pool())
        .await
        .unwrap();
        // The store under test, counting the layer's own `complete` calls.
        let counting = Arc::new(FaultyStore::from_arc(store));
        let outcomes = Outcomes::default();
        let layer = layer_with(
            Idem::from_arc(counting.clone()),
            Config::default(),
            &outcomes,
        );
        let (state, insert) = (
            tx_store.clone(),
            format!("INSERT INTO {table} (request) VALUES ($1) RETURNING id"),
        );
        let app = Router::new()
            .route(
                "/pay",
                post(
                    move |Extension(lease): Extension<LeaseHandle>,
                          headers: HeaderMap,
                          body: String| {
                        let (store, insert) = (state.clone(), insert.clone());
                        async move {
                            let mut tx = store.pg().pool().begin().await.unwrap();
                            let id: i64 = sqlx::query_scalar(&insert)
                                .bind(&body)
                                .fetch_one(&mut *tx)
                                .await
                                .unwrap();
                            let mut out = HeaderMap::new();
                            out.insert("content-type", HeaderValue::from_static("text/plain"));
                            let body = format!("payment {id}");
                            if headers.contains_key("x-complete-in-tx") {
                                let completion =
                                    lease.completion(StatusCode::CREATED, &out, body.clone());
                                store
                                    .complete_in(
                                        &mut tx,
                                        lease.lease(),
                                        &completion,
                                        lease.retention(),
                                    )
                                    .await
                                    .unwrap();
                                tx.commit().await.unwrap();
                                lease.committed(&completion);
                                store
                                    .publish(lease.lease(), &completion, lease.retention())
                                    .await;
                            } else {
                                tx.commit().await.unwrap();
                            }
                            (StatusCode::CREATED, out, body).into_response()
                        }
                    },
                ),
            )
            .layer(layer);
        let server = serve(app).await;
        let rows = || async {
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
                .fetch_one(tx_store.pg().pool())
                .await
                .unwrap();
            n
        };

        // Completed in the handler's transaction: the layer stores nothing more.
        let headers = [("idempotency-key", "tx-1"), ("x-complete-in-tx", "1")];
        let first = server.post("/pay", &headers, "one").await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(first.header("idempotency-expires").is_some());
        assert_eq!(counting.completes(), 0, "stored twice");
        assert_eq!(outcomes.count(Outcome::Executed), 1);
        let retry = server.post("/pay", &headers, "one").await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.header("content-type"), Some("text/plain"));
        assert_eq!(rows().await, 1);

        // A handler that does not complete: the layer stores its response.
        let headers = [("idempotency-key", "tx-2")];
        let first = server.post("/pay", &headers, "two").await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(counting.completes(), 1);
        let retry = server.post("/pay", &headers, "two").await;
        retry.assert_replay_of(&first);
        assert_eq!(rows().await, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some((pg, teardown)) = crate::postgres::fresh_store().await else {
            return;
        };
        completes_in_the_handlers_transaction(Transactional::Pg(pg.clone()), Arc::new(pg)).await;
        teardown.await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiered() {
        let Some(redis) = crate::redis::fresh_store().await else {
            return;
        };
        let Some((pg, teardown)) = crate::postgres::fresh_store().await else {
            return;
        };
        let tiered = TieredStore::new(redis, pg);
        completes_in_the_handlers_transaction(
            Transactional::Tiered(tiered.clone()),
            Arc::new(tiered),
        )
        .await;
        teardown.await;
    }
}
