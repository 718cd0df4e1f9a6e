//! Starts throwaway Redis and PostgreSQL containers with testcontainers, for `scripts/test`
//! on a machine that has Docker but not the server binaries.
//!
//! Usage: `idem-testenv redis postgres`. Prints `IDEM_TEST_REDIS_URL=...` and
//! `IDEM_TEST_DATABASE_URL=...` lines, then `READY`, then holds the containers until its
//! standard input closes (the script's exit), and removes them.

use std::io::Read;
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::SyncRunner;
use testcontainers::{Container, GenericImage, ImageExt};

fn main() -> ExitCode {
    let mut held: Vec<Container<GenericImage>> = Vec::new();
    for backend in std::env::args().skip(1) {
        let started = match backend.as_str() {
            "redis" => start(
                GenericImage::new("redis", "7.2-alpine")
                    .with_exposed_port(6379.tcp())
                    .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                    .with_cmd(["redis-server", "--save", "", "--appendonly", "no"]),
                6379,
            )
            .map(|(c, port)| (c, format!("IDEM_TEST_REDIS_URL=redis://127.0.0.1:{port}"))),
            "postgres" => start(
                GenericImage::new("postgres", "15-alpine")
                    .with_exposed_port(5432.tcp())
                    .with_wait_for(WaitFor::message_on_stderr(
                        "database system is ready to accept connections",
                    ))
                    .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
                    .with_cmd(["postgres", "-c", "max_connections=300", "-c", "fsync=off"]),
                5432,
            )
            .map(|(c, port)| {
                (
                    c,
                    format!("IDEM_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:{port}/postgres"),
                )
            }),
            other => Err(format!(
                "unknown backend {other:?}; expected redis or postgres"
            )),
        };
        match started {
            Ok((container, line)) => {
                println!("{line}");
                held.push(container);
            }
            Err(e) => {
                eprintln!("idem-testenv: {backend}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("READY");
    // Hold the containers until the caller closes our standard input; dropping them
    // removes them.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(held);
    ExitCode::SUCCESS
}

/// Starts `image` and waits until its port accepts connections (the official PostgreSQL
/// image logs "ready" once during its init phase too, so the log line alone is not enough).
fn start(
    image: impl SyncRunner<GenericImage>,
    port: u16,
) -> Result<(Container<GenericImage>, u16), String> {
    let container = image.start().map_err(|e| e.to_string())?;
    let host_port = container
        .get_host_port_ipv4(port.tcp())
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", host_port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("port {host_port} did not open within 60 s"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok((container, host_port))
}
