//! Throwaway NATS servers with JetStream: `nats-server -js` from `PATH`, on a free loopback
//! port, storing its streams in a temporary directory. `idem-testenv` starts one for
//! `scripts/test`; tests that stop their own server start one here.
//!
//! The server runs under the watchdog of [`crate::redis`]'s servers, which stops it when
//! the test process exits; dropping a [`NatsServer`] stops it at once and removes its
//! directory.

use std::io::{self, BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use crate::{harness, process};

/// Whether `nats-server` can be run.
pub fn binaries_available() -> bool {
    process::runs("nats-server")
}

/// Whether a throwaway server can be started; see [`harness::present`] for what happens
/// when it cannot.
pub fn available() -> bool {
    harness::present(
        binaries_available(),
        "nats-server on PATH (Debian/Ubuntu: apt-get install nats-server)",
    )
}

/// A `nats-server -js` process of this test run. Stopped (and its directory removed) on
/// drop.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl NatsServer {
    /// Starts a server with JetStream on a free loopback port and waits (up to 15 s) until
    /// it says JetStream is on.
    ///
    /// # Errors
    ///
    /// When the server cannot be started.
    pub fn start() -> io::Result<Self> {
        let mut last = None;
        // Another process may take the port between our look and the server's bind: retry.
        for _ in 0..5 {
            let port = harness::free_port();
            let dir = std::env::temp_dir().join(harness::unique_name("idem-nats-"));
            std::fs::create_dir_all(&dir)?;
            let (port_arg, dir_arg) = (port.to_string(), dir.to_string_lossy());
            let args = ["-js", "-a", "127.0.0.1", "-p", &port_arg, "-sd", &dir_arg];
            let log = std::fs::File::create(dir.join("server.log"))?;
            let up = process::start_watched(
                Path::new("nats-server"),
                &args,
                &dir,
                log.into(),
                Duration::from_secs(15),
                || jetstream_on(port),
            );
            match up {
                Ok(child) => {
                    return Ok(Self {
                        child: Some(child),
                        port,
                        dir,
                    })
                }
                Err(e) => {
                    let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
                    last = Some(io::Error::other(format!("{e}\n{log}")));
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("nats-server did not start")))
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            process::terminate(child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether a NATS server on `port` greets with an `INFO` that says JetStream is on.
fn jetstream_on(port: u16) -> bool {
    let attempt = || -> io::Result<bool> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut info = String::new();
        BufReader::new(stream).read_line(&mut info)?;
        Ok(info.starts_with("INFO ") && info.contains("\"jetstream\":true"))
    };
    attempt().unwrap_or(false)
}
