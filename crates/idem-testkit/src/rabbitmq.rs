//! Throwaway RabbitMQ nodes: `rabbitmq-server` from `/usr/lib/rabbitmq/bin` (where Debian
//! keeps the real scripts; its `/usr/sbin` wrappers switch to the `rabbitmq` user) or from
//! `PATH`, on free loopback ports, in a temporary directory removed on drop. As root, the
//! node runs as the `rabbitmq` user when there is one, as Debian's wrappers do.

use std::io;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::{harness, process};

/// A running throwaway node; stopped (`rabbitmqctl stop`) and removed on drop.
#[derive(Debug)]
pub struct RabbitServer {
    bin: PathBuf,
    dir: PathBuf,
    node: String,
    user: Option<&'static str>,
    port: u16,
    child: Option<Child>,
}

/// The directory holding `rabbitmq-server` and `rabbitmqctl`, if any.
pub fn binaries() -> Option<PathBuf> {
    let debian = PathBuf::from("/usr/lib/rabbitmq/bin");
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>());
    std::iter::once(debian)
        .chain(on_path)
        .find(|dir| dir.join("rabbitmq-server").is_file())
}

/// Whether a throwaway node can be started; see [`harness::present`] for what happens when
/// it cannot.
pub fn available() -> bool {
    harness::present(
        binaries().is_some(),
        "rabbitmq-server (Debian/Ubuntu: apt-get install rabbitmq-server)",
    )
}

impl RabbitServer {
    /// Starts a node with no plugins and waits (up to 60 s) until its AMQP port accepts
    /// connections.
    ///
    /// # Errors
    ///
    /// When the binaries are missing or the node does not come up.
    pub fn start() -> io::Result<Self> {
        let bin = binaries().ok_or_else(|| io::Error::other("rabbitmq-server not found"))?;
        let dir = std::env::temp_dir().join(harness::unique_name("idem-rabbitmq-"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("enabled_plugins"), "")?;
        let user = process::server_user(&["rabbitmq"]);
        process::chown(user, &dir)?;
        let port = harness::free_port();
        let mut server = Self {
            bin,
            node: format!("idem-test-{port}@localhost"),
            dir,
            user,
            port,
            child: None,
        };
        let log = std::fs::File::create(server.dir.join("server.log"))?;
        // Everything the node writes stays in its directory; no config file, no plugins.
        let files = [
            ("MNESIA_BASE", "mnesia"),
            ("LOG_BASE", "log"),
            ("CONFIG_FILE", "none"),
            ("ENABLED_PLUGINS_FILE", "enabled_plugins"),
        ]
        .map(|(var, file)| format!("RABBITMQ_{var}={}", server.dir.join(file).display()));
        let child = server
            .node_env()
            .arg(format!("RABBITMQ_NODE_PORT={port}"))
            .arg(format!("RABBITMQ_DIST_PORT={}", harness::free_port()))
            .args(files)
            .arg(server.bin.join("rabbitmq-server"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let child = server.child.insert(child);
        let up = process::wait_for(child, "rabbitmq-server", Duration::from_secs(60), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        if let Err(e) = up {
            let log = std::fs::read_to_string(server.dir.join("server.log")).unwrap_or_default();
            return Err(io::Error::other(format!("{e}\n{log}")));
        }
        Ok(server)
    }

    /// `env HOME=<dir> RABBITMQ_NODENAME=<node>` as the node's user, for more variables and
    /// a tool to follow: HOME holds the node's Erlang cookie, which `rabbitmqctl` needs to
    /// reach the node.
    fn node_env(&self) -> std::process::Command {
        let mut command = process::as_user(self.user, "env");
        command
            .arg(format!("HOME={}", self.dir.display()))
            .arg(format!("RABBITMQ_NODENAME={}", self.node));
        command
    }

    /// The AMQP port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f` (RabbitMQ lets `guest` in from loopback).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The node's name (`idem-test-<port>@localhost`).
    pub fn node(&self) -> &str {
        &self.node
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        let _ = self
            .node_env()
            .arg(self.bin.join("rabbitmqctl"))
            .args(["-n", &self.node, "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
