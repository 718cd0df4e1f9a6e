//! Throwaway NATS servers with JetStream: `nats-server -js` from `PATH`, on a free loopback
//! port, storing its streams in a temporary directory. `idem-testenv` starts one for
//! `scripts/test`; tests that stop their own server start one here.
//!
//! The server runs under a small `sh` watchdog that stops it when the test process exits;
//! dropping a [`NatsServer`] stops it at once and removes its directory.

use std::io::{self, BufRead, BufReader};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{harness, process};

/// Whether `nats-server` can be run.
pub fn binaries_available() -> bool {
    Command::new("nats-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether a throwaway server can be started; see [`harness::present`] for what happens
/// when it cannot.
pub fn available() -> bool {
    harness::present(
        binaries_available(),
        "nats-server on PATH (Debian/Ubuntu: apt-get install nats-server)",
    )
}

/// Runs `nats-server "$@"` and stops it on `SIGTERM` or when the test process (`WATCH_PID`)
/// is gone; in the second case nothing will drop the server, so the watchdog also removes
/// its directory (`SERVER_DIR`).
const WATCHDOG: &str = r#"
nats-server "$@" &
srv=$!
trap 'kill $srv 2>/dev/null; wait $srv; exit 0' TERM INT
while kill -0 "$WATCH_PID" 2>/dev/null && kill -0 "$srv" 2>/dev/null; do sleep 0.2; done
kill "$srv" 2>/dev/null
wait "$srv"
kill -0 "$WATCH_PID" 2>/dev/null || rm -rf "$SERVER_DIR"
"#;

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
            let child = Command::new("sh")
                .arg("-c")
                .arg(WATCHDOG)
                .arg("sh")
                .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
                .arg(&dir)
                .env("WATCH_PID", std::process::id().to_string())
                .env("SERVER_DIR", &dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join("server.log"))?)
                .spawn()?;
            let mut server = Self {
                child: Some(child),
                port,
                dir,
            };
            let up = process::wait_until(Duration::from_secs(15), || {
                if let Some(child) = server.child.as_mut() {
                    if let Some(status) = child.try_wait()? {
                        return Err(io::Error::other(format!("nats-server exited: {status}")));
                    }
                }
                Ok(jetstream_on(port))
            });
            match up {
                Ok(()) => return Ok(server),
                Err(e) => {
                    let log =
                        std::fs::read_to_string(server.dir.join("server.log")).unwrap_or_default();
                    last = Some(io::Error::other(format!("{e}\n{log}")));
                    drop(server);
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
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let _ = child.wait();
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
