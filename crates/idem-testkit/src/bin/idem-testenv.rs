//! Starts the throwaway servers of `scripts/test`, the same way the tests start theirs
//! (`idem_testkit::redis`, `postgres`, `rabbitmq`, `nats`): from the server binaries, on free
//! loopback ports, in temporary directories. Built with the `testcontainers` feature, it
//! falls back to Docker containers for Redis and PostgreSQL when their binaries are missing.
//!
//! Usage: `idem-testenv [redis] [postgres] [rabbitmq] [nats]`. For each backend it prints one
//! line, then `READY`, then holds the servers until its standard input closes (the
//! script's exit) and stops them:
//!
//! - `IDEM_TEST_REDIS_URL=...`, `IDEM_TEST_DATABASE_URL=...`, `IDEM_TEST_AMQP_URL=...`,
//!   `IDEM_TEST_NATS_URL=...`: started,
//!   followed by `NOTE <what was started>`;
//! - `MISSING <backend>: <how to get it>`: neither binaries nor (with the feature) Docker.
//!
//! A backend whose binaries are there but which does not start is an error (exit 1).

use std::any::Any;
use std::io::Read;
use std::process::ExitCode;

use idem_testkit::nats::{self, NatsServer};
use idem_testkit::postgres::{self as pg, PgServer};
use idem_testkit::rabbitmq::{self, RabbitServer};
use idem_testkit::redis::{self, RedisServer};

/// What holds a backend up until the end: dropping it stops the server.
type Held = Box<dyn Any>;

/// A started backend: the variable and URL, what to tell the user, and what to hold.
struct Started {
    var: &'static str,
    url: String,
    note: String,
    held: Held,
}

fn main() -> ExitCode {
    let mut held: Vec<Held> = Vec::new();
    for backend in std::env::args().skip(1) {
        match start(&backend) {
            Ok(Some(started)) => {
                println!("{}={}", started.var, started.url);
                println!("NOTE {}", started.note);
                held.push(started.held);
            }
            Ok(None) => println!("MISSING {}", missing(&backend)),
            Err(e) => {
                eprintln!("idem-testenv: {backend}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("READY");
    // Hold the servers until the caller closes our standard input; dropping them stops
    // them.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(held);
    ExitCode::SUCCESS
}

/// Starts `backend` from its binaries, or in a container; `None` when neither can be.
fn start(backend: &str) -> Result<Option<Started>, String> {
    let e = |e: std::io::Error| e.to_string();
    let started = match backend {
        "redis" if redis::binaries_available() => {
            let server = RedisServer::start().map_err(e)?;
            let what = "Redis: started a throwaway redis-server".to_owned();
            let (url, port) = (server.url(), server.port());
            local("IDEM_TEST_REDIS_URL", url, what, port, server)
        }
        "postgres" if pg::binaries().is_some() => {
            // The races of the PostgreSQL tests open many connections at once.
            let server = PgServer::start(&[("max_connections", "300")], &[]).map_err(e)?;
            let url = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());
            let what = "PostgreSQL: started a throwaway server".to_owned();
            local("IDEM_TEST_DATABASE_URL", url, what, server.port(), server)
        }
        "rabbitmq" if rabbitmq::binaries().is_some() => {
            let server = RabbitServer::start().map_err(e)?;
            let what = format!("RabbitMQ: started a throwaway node {}", server.node());
            let (url, port) = (server.url(), server.port());
            local("IDEM_TEST_AMQP_URL", url, what, port, server)
        }
        "nats" if nats::binaries_available() => {
            let server = NatsServer::start().map_err(e)?;
            let what = "NATS: started a throwaway nats-server -js".to_owned();
            let (url, port) = (server.url(), server.port());
            local("IDEM_TEST_NATS_URL", url, what, port, server)
        }
        "redis" | "postgres" | "rabbitmq" | "nats" => return container(backend),
        other => {
            return Err(format!(
                "unknown backend {other:?}; expected redis, postgres, rabbitmq or nats"
            ))
        }
    };
    Ok(Some(started))
}

/// A server started from its binaries (`what`, listening on `port`), with `var` set to
/// `url`.
fn local(var: &'static str, url: String, what: String, port: u16, server: impl Any) -> Started {
    Started {
        var,
        url,
        note: format!("{what} on 127.0.0.1:{port} (stopped at exit)"),
        held: Box::new(server),
    }
}

/// How to get `backend` when it is missing.
fn missing(backend: &str) -> String {
    let (name, var, how) = match backend {
        "redis" => (
            "Redis",
            "IDEM_TEST_REDIS_URL",
            "install redis-server (Debian/Ubuntu: apt-get install redis-server; macOS: brew \
             install redis), or run Docker (testcontainers is used then)",
        ),
        "postgres" => (
            "PostgreSQL",
            "IDEM_TEST_DATABASE_URL",
            "install the server binaries initdb and pg_ctl (Debian/Ubuntu: apt-get install \
             postgresql; macOS: brew install postgresql), or run Docker (testcontainers is \
             used then)",
        ),
        "nats" => (
            "NATS",
            "IDEM_TEST_NATS_URL",
            "install nats-server (Debian/Ubuntu: apt-get install nats-server; macOS: brew \
             install nats-server)",
        ),
        _ => (
            "RabbitMQ",
            "IDEM_TEST_AMQP_URL",
            "install rabbitmq-server (Debian/Ubuntu: apt-get install rabbitmq-server; macOS: \
             brew install rabbitmq)",
        ),
    };
    format!("{name}: set {var}, or {how}")
}

#[cfg(not(feature = "testcontainers"))]
fn container(_backend: &str) -> Result<Option<Started>, String> {
    Ok(None)
}

/// A Redis or PostgreSQL container, when Docker runs (the caller built us with the
/// `testcontainers` feature because it does).
#[cfg(feature = "testcontainers")]
fn container(backend: &str) -> Result<Option<Started>, String> {
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::SyncRunner;
    use testcontainers::{Container, GenericImage, ImageExt};

    /// Starts `image` and waits until its port accepts connections (the official
    /// PostgreSQL image logs "ready" once during its init phase too, so the log line alone
    /// is not enough).
    fn run(
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

    let (var, container, url) = match backend {
        "redis" => {
            let (container, port) = run(
                GenericImage::new("redis", "7.2-alpine")
                    .with_exposed_port(6379.tcp())
                    .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                    .with_cmd(["redis-server", "--save", "", "--appendonly", "no"]),
                6379,
            )?;
            let url = format!("redis://127.0.0.1:{port}");
            ("IDEM_TEST_REDIS_URL", container, url)
        }
        "postgres" => {
            let (container, port) = run(
                GenericImage::new("postgres", "15-alpine")
                    .with_exposed_port(5432.tcp())
                    .with_wait_for(WaitFor::message_on_stderr(
                        "database system is ready to accept connections",
                    ))
                    .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
                    .with_cmd(["postgres", "-c", "max_connections=300", "-c", "fsync=off"]),
                5432,
            )?;
            let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
            ("IDEM_TEST_DATABASE_URL", container, url)
        }
        _ => return Ok(None),
    };
    Ok(Some(Started {
        var,
        note: format!("{backend}: started a throwaway container, {url} (removed at exit)"),
        url,
        held: Box::new(container),
    }))
}
