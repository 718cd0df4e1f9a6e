//! Throwaway Redis servers: a standalone server, a replica, a Redis Cluster of several
//! primaries, each on free loopback ports with its own temporary directory, run from the
//! `redis-server` and `redis-cli` binaries on `PATH`. Tests take them from here;
//! `idem-testenv` starts one for `scripts/test`.
//!
//! Every server runs under a small `sh` watchdog that stops it when the test process exits,
//! so servers held in a `static` (one cluster shared by a test binary) are torn down too;
//! dropping a [`RedisServer`] stops it at once.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::process::{self, wait_until};
use crate::{harness, tls::Pki};

/// Whether `redis-server` and `redis-cli` can be run.
pub fn binaries_available() -> bool {
    process::runs("redis-server") && process::runs("redis-cli")
}

/// Whether throwaway servers can be started; see [`harness::present`] for what happens
/// when they cannot.
pub fn available() -> bool {
    harness::present(
        binaries_available(),
        "redis-server and redis-cli on PATH (Debian/Ubuntu: apt-get install redis-server)",
    )
}

/// A throwaway standalone server with `extra` arguments, for a test that stops, flushes or
/// reconfigures its own; `None` when the binaries are missing (see [`available`]).
///
/// # Panics
///
/// When the binaries are there but the server does not start.
pub fn throwaway(extra: &[&str]) -> Option<RedisServer> {
    available().then(|| RedisServer::start_with(extra).expect("start a throwaway redis-server"))
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// A `redis-server` process of this test run. Stopped (and its directory removed) on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    /// The server binary: `redis-server`, or a `valkey-server` ([`crate::valkey`]).
    binary: PathBuf,
}

impl RedisServer {
    /// A standalone server with no persistence.
    ///
    /// # Errors
    ///
    /// When the server cannot be started.
    pub fn start() -> io::Result<Self> {
        Self::start_with(&[])
    }

    /// A server with extra `redis-server` arguments (such as `--maxmemory 2mb`).
    ///
    /// # Errors
    ///
    /// When the server cannot be started.
    pub fn start_with(extra: &[&str]) -> io::Result<Self> {
        Self::start_inner(Path::new("redis-server"), extra, false)
    }

    /// A standalone server of `binary` (`redis-server` or `valkey-server`, which take the
    /// same arguments) with `extra` arguments.
    ///
    /// # Errors
    ///
    /// When the server cannot be started.
    pub fn start_binary(binary: &Path, extra: &[&str]) -> io::Result<Self> {
        Self::start_inner(binary, extra, false)
    }

    /// A standalone server that also listens for TLS on a port of its own, with the PEM
    /// files given (clients are not asked for certificates). Returns the server and its TLS
    /// port; [`RedisServer::port`] stays the plain one.
    ///
    /// # Errors
    ///
    /// When the server cannot be started (a `redis-server` built without TLS, say).
    pub fn start_tls(cert: &str, key: &str, ca: &str) -> io::Result<(Self, u16)> {
        let tls_port = harness::free_port();
        let server = Self::start_with(&[
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            key,
            "--tls-ca-cert-file",
            ca,
            "--tls-auth-clients",
            "no",
        ])?;
        Ok((server, tls_port))
    }

    /// [`RedisServer::start_tls`] with the server certificate of `pki` and its authority.
    ///
    /// # Errors
    ///
    /// As [`RedisServer::start_tls`].
    pub fn start_tls_with(pki: &Pki) -> io::Result<(Self, u16)> {
        Self::start_tls(
            &pki.path("server.pem"),
            &pki.path("server.key"),
            &pki.path("ca.pem"),
        )
    }

    /// A replica of `primary`, once its replication link is up.
    ///
    /// # Errors
    ///
    /// When the replica cannot be started or does not sync within 15 s.
    pub fn replica_of(primary: &RedisServer) -> io::Result<Self> {
        let port = primary.port.to_string();
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &port])?;
        wait_until(Duration::from_secs(15), || {
            Ok(replica
                .cli(&["info", "replication"])?
                .contains("master_link_status:up"))
        })?;
        Ok(replica)
    }

    fn start_inner(binary: &Path, extra: &[&str], cluster: bool) -> io::Result<Self> {
        let mut last = None;
        for _ in 0..5 {
            let port = harness::free_port_and(if cluster { 10_000 } else { 0 });
            let dir = std::env::temp_dir().join(format!(
                "idem-redis-{}-{}-{port}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir)?;
            let mut args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir.to_string_lossy(),
                "--logfile",
                "redis.log",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            if cluster {
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    ]
                    .iter()
                    .map(|s| s.to_string()),
                );
            }
            args.extend(extra.iter().map(|s| s.to_string()));
            let mut server = Self {
                child: None,
                port,
                dir,
                args,
                binary: binary.to_owned(),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                // Another process may have taken the port: try another.
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    fn spawn(&mut self) -> io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let port = self.port;
        let child = process::start_watched(
            &self.binary,
            &self.args,
            &self.dir,
            Stdio::null(),
            Duration::from_secs(10),
            || ping(port),
        )?;
        self.child = Some(child);
        Ok(())
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the server (`SIGTERM`, then waits). Its data is gone: nothing is persisted.
    pub fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            process::terminate(child);
        }
        // The watchdog waits for the server, but make sure the port is free again.
        let _ = wait_until(Duration::from_secs(5), || Ok(!ping(self.port)));
    }

    /// Starts a stopped server again on the same port, empty.
    ///
    /// # Errors
    ///
    /// When it does not come back (another process may have taken the port meanwhile).
    pub fn start_again(&mut self) -> io::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        self.spawn()
    }

    /// Runs `redis-cli -p <port> <args>` and returns its output.
    ///
    /// # Errors
    ///
    /// When `redis-cli` cannot run or fails.
    pub fn cli(&self, args: &[&str]) -> io::Result<String> {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of primaries without replicas, on loopback.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `primaries` cluster-enabled servers, joins them with
    /// `redis-cli --cluster create`, and waits until every node says `cluster_state:ok`.
    ///
    /// # Errors
    ///
    /// When a server does not start or the cluster does not form within 30 s.
    pub fn start(primaries: usize) -> io::Result<Self> {
        Self::start_binary(Path::new("redis-server"), primaries)
    }

    /// [`RedisCluster::start`] with the servers of `binary` (`redis-server` or
    /// `valkey-server`), joined by `redis-cli`.
    ///
    /// # Errors
    ///
    /// As [`RedisCluster::start`].
    pub fn start_binary(binary: &Path, primaries: usize) -> io::Result<Self> {
        let nodes = (0..primaries)
            .map(|_| RedisServer::start_inner(binary, &[], true))
            .collect::<io::Result<Vec<_>>>()?;
        let mut create: Vec<String> = vec!["--cluster".into(), "create".into()];
        create.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let create: Vec<&str> = create.iter().map(String::as_str).collect();
        cli(nodes[0].port, &create)?;
        wait_until(Duration::from_secs(30), || {
            for node in &nodes {
                if !node.cli(&["cluster", "info"])?.contains("cluster_state:ok") {
                    return Ok(false);
                }
            }
            Ok(true)
        })?;
        Ok(Self { nodes })
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,...`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        // idem-redis's `RedisStore::CLUSTER_SCHEME`.
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

fn cli(port: u16, args: &[&str]) -> io::Result<String> {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "redis-cli {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether something on `port` answers `PING` like Redis.
fn ping(port: u16) -> bool {
    let attempt = || -> io::Result<bool> {
        let mut stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_millis(500)))?;
        stream.write_all(b"PING\r\n")?;
        let mut buf = [0; 7];
        stream.read_exact(&mut buf)?;
        Ok(&buf == b"+PONG\r\n")
    };
    attempt().unwrap_or(false)
}
