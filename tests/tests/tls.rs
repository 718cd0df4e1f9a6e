//! TLS against real servers, with certificate verification on: a `redis-server` with a
//! `--tls-port`, and a PostgreSQL with `ssl=on`, each with a certificate authority and a
//! server certificate made in the test (rcgen). A client that trusts another authority is
//! refused.

mod tls {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::{Begin, Fingerprint, Idem, Key, RecordId, Response, Scope, Store};
    use idem_postgres::PgStore;
    use idem_redis::RedisStore;
    use idem_testkit::postgres::{self as pg, PgServer};
    use idem_testkit::redis::{self as testing, RedisServer};
    use idem_testkit::tls::Pki;

    /// A fresh key runs once and its retry replays: the store works end to end.
    async fn lifecycle(store: Arc<dyn Store>) {
        let idem = Idem::from_arc(store);
        let id = RecordId::new(
            Scope::new("tls").expect("scope"),
            Key::new(uuid::Uuid::new_v4().to_string()).expect("key"),
        );
        let fp = Fingerprint::of_bytes(b"over TLS");
        let Begin::Acquired(lease) = idem.begin(&id, fp).await.expect("begin over TLS") else {
            panic!("a fresh key is acquired")
        };
        idem.complete(&lease, Response::new(201, "sealed"))
            .await
            .expect("complete over TLS");
        match idem.begin(&id, fp).await.expect("begin over TLS") {
            Begin::Replay(replay) => assert_eq!(replay.completion.response.body, "sealed"),
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    fn redis_store(url: String) -> Result<RedisStore, idem_core::Error> {
        RedisStore::builder(url)
            .with_prefix(format!("idem-tls-{}:", uuid::Uuid::new_v4().simple()))
            .with_timeouts(Duration::from_secs(2), Duration::from_secs(4))
            .connect_lazy()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_over_tls_verifies_the_server() {
        if !testing::available() {
            return;
        }
        let pki = Pki::new();
        let ca = pki.path("ca.pem");
        let (_server, tls_port) =
            RedisServer::start_tls_with(&pki).expect("start redis-server with TLS");

        // Trusting the authority that signed the server's certificate: it works, by name
        // and by address.
        for host in ["localhost", "127.0.0.1"] {
            let url = format!("rediss://{host}:{tls_port}/?tls_ca_file={ca}");
            lifecycle(Arc::new(redis_store(url).expect("a TLS store"))).await;
        }

        // Trusting another authority: the handshake fails, and the store says so.
        let url = format!(
            "rediss://localhost:{tls_port}/?tls_ca_file={}",
            pki.path("other-ca.pem")
        );
        let store = redis_store(url).expect("a lazy store builds");
        let id = RecordId::new(Scope::global(), Key::new("k").expect("key"));
        let err = Idem::new(store)
            .begin(&id, Fingerprint::of_bytes(b"x"))
            .await
            .expect_err("a server signed by an untrusted authority is refused");
        assert!(
            matches!(err, idem_core::Error::Unavailable { .. }),
            "expected Unavailable, got {err:?}"
        );

        // A plain client on the TLS port gets nowhere either.
        let plain = redis_store(format!("redis://127.0.0.1:{tls_port}")).expect("lazy");
        assert!(Idem::new(plain)
            .begin(&id, Fingerprint::of_bytes(b"x"))
            .await
            .is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_over_tls_verifies_the_server() {
        if !pg::available() {
            return;
        }
        let pki = Pki::new();
        let server = PgServer::start_tls(&pki).expect("start PostgreSQL with ssl=on");
        let port = server.port();
        let ca = pki.path("ca.pem");

        for mode in ["verify-full", "verify-ca", "require"] {
            let url = format!(
                "postgres://postgres@localhost:{port}/postgres?sslmode={mode}&sslrootcert={ca}"
            );
            let store = PgStore::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("connect with sslmode={mode}: {e}"));
            store.migrate().await.expect("migrate over TLS");
            let encrypted: bool =
                sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                    .fetch_one(store.pool())
                    .await
                    .expect("pg_stat_ssl");
            assert!(encrypted, "sslmode={mode} connected without TLS");
            lifecycle(Arc::new(store)).await;
        }

        // Trusting another authority: refused.
        let url = format!(
            "postgres://postgres@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}",
            pki.path("other-ca.pem")
        );
        let err = PgStore::connect(&url)
            .await
            .expect_err("a server signed by an untrusted authority is refused");
        let text = format!("{err:?}");
        assert!(
            text.contains("certificate") || text.contains("Certificate") || text.contains("tls"),
            "unexpected error: {text}"
        );
        drop(server);
    }
}
