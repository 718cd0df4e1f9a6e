//! `idem-relay` over TLS with certificate verification on: a `redis-server` with a
//! `--tls-port` and a PostgreSQL with `ssl=on` that the test starts, with certificates it
//! makes. The relay connects to both, migrates, serves its metrics (read from PostgreSQL)
//! and stops cleanly; trusting another authority, it refuses to start.

mod support;

mod tls {
    use std::process::Stdio;
    use std::time::Duration;

    use idem_redis::testing::{self, RedisServer};
    use idem_testkit::postgres::{self as pg, PgServer};
    use idem_testkit::tls::Pki;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    use tokio::time::timeout;

    const PATIENCE: Duration = Duration::from_secs(30);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relay_runs_over_tls() {
        if !testing::available() || !pg::available() {
            return;
        }
        let pki = Pki::new();
        let ca = pki.path("ca.pem");
        let (_redis, tls_port) =
            RedisServer::start_tls_with(&pki).expect("start redis-server with TLS");
        let postgres = PgServer::start_tls(&pki).expect("start PostgreSQL with ssl=on");
        let database = |ca: &str| {
            format!(
                "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
                postgres.port()
            )
        };
        let redis = |ca: &str| format!("rediss://localhost:{tls_port}/?tls_ca_file={ca}");
        let relay = |database: String, redis: String| {
            crate::support::relay_command()
                .args(["run", "--migrate", "--database-url", &database])
                .args(["--redis-url", &redis])
                .args(["--metrics-listen", "127.0.0.1:0", "--log", "warn"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start idem-relay")
        };

        let mut child = relay(database(&ca), redis(&ca));
        let stdout = child.stdout.take().expect("stdout");
        let line = timeout(PATIENCE, BufReader::new(stdout).lines().next_line())
            .await
            .expect("the metrics address in time")
            .expect("read stdout")
            .unwrap_or_default();
        let Some(addr) = line
            .strip_prefix("idem-relay: metrics on http://")
            .and_then(|rest| rest.strip_suffix("/metrics"))
        else {
            let out = child.wait_with_output().await.expect("relay output");
            panic!(
                "idem-relay did not start over TLS ({line:?}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        // The gauges come from PostgreSQL at every scrape: over TLS.
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("metrics");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
            .await
            .expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
        assert!(
            response.contains("\nidem_relay_backlog{schema=\"idem\"} 0\n"),
            "{response}"
        );
        let pid = child.id().expect("running").to_string();
        assert!(std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success());
        let status = timeout(PATIENCE, child.wait())
            .await
            .expect("exits in time")
            .expect("wait");
        assert!(status.success(), "{status:?}");

        // Trusting another authority, for either store: the relay refuses to start (3).
        let other = pki.path("other-ca.pem");
        for (database, redis) in [
            (database(&ca), redis(&other)),
            (database(&other), redis(&ca)),
        ] {
            let out = timeout(PATIENCE, relay(database, redis).wait_with_output())
                .await
                .expect("exits in time")
                .expect("output");
            assert_eq!(
                out.status.code(),
                Some(3),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
