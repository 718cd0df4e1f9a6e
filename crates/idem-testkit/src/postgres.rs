//! Throwaway PostgreSQL servers for tests that need a server of their own (TLS, a special
//! setting): `initdb` and `pg_ctl` from `PATH`, or from `/usr/lib/postgresql/*/bin` where
//! Debian and Ubuntu keep them, on a free loopback port, in a temporary directory removed on
//! drop. PostgreSQL refuses to run as root: as root, the server runs as the `postgres` user
//! (or `nobody`), as `scripts/test` does.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::harness;

/// A running throwaway server; stopped (`pg_ctl stop -m immediate`) and removed on drop.
#[derive(Debug)]
pub struct PgServer {
    bin: PathBuf,
    data: PathBuf,
    dir: PathBuf,
    user: Option<&'static str>,
    port: u16,
}

/// The directory holding `initdb` and `pg_ctl`, if any.
pub fn binaries() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>());
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .collect();
    // Newest first: "15" sorts after "14".
    debian.sort();
    debian.reverse();
    on_path
        .chain(debian)
        .find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
}

/// Whether a throwaway server can be started; see [`harness::present`] for what happens
/// when it cannot.
pub fn available() -> bool {
    harness::present(
        binaries().is_some(),
        "the PostgreSQL server binaries initdb and pg_ctl (Debian/Ubuntu: apt-get install \
         postgresql)",
    )
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

impl PgServer {
    /// Starts a server with `settings` (`-c name=value` each), after writing `files` (name,
    /// contents) into its data directory, readable by the server only (a TLS key must be).
    ///
    /// # Errors
    ///
    /// When the binaries are missing or the server does not start.
    pub fn start(settings: &[(&str, &str)], files: &[(&str, &[u8])]) -> io::Result<Self> {
        let bin = binaries().ok_or_else(|| io::Error::other("initdb and pg_ctl not found"))?;
        let dir = std::env::temp_dir().join(harness::unique_name("idem-pg-"));
        let data = dir.join("data");
        std::fs::create_dir_all(&data)?;
        let user = if is_root() {
            ["postgres", "nobody"].into_iter().find(|user| {
                Command::new("id")
                    .arg(user)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
        } else {
            None
        };
        let server = Self {
            bin,
            data,
            dir,
            user,
            port: harness::free_port(),
        };
        if let Some(user) = user {
            server.run(Command::new("chown").args(["-R", user]).arg(&server.dir))?;
            server.run(Command::new("chmod").arg("755").arg(&server.dir))?;
        }
        server.run(
            server
                .as_server("initdb")
                .arg("-D")
                .arg(&server.data)
                .args(["-U", "postgres", "-A", "trust", "--no-sync"]),
        )?;
        for (name, contents) in files {
            let path = server.data.join(name);
            std::fs::write(&path, contents)?;
            server.run(Command::new("chmod").arg("600").arg(&path))?;
            if let Some(user) = user {
                server.run(Command::new("chown").arg(user).arg(&path))?;
            }
        }
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            server.port,
            server.data.display()
        );
        for (name, value) in settings {
            options.push_str(&format!(" -c {name}={value}"));
        }
        let log = server.data.join("server.log");
        server.run(
            server
                .as_server("pg_ctl")
                .arg("-D")
                .arg(&server.data)
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", "60", "-o", &options, "start"]),
        )?;
        Ok(server)
    }

    /// A server with `ssl=on`, serving the certificate of `pki`.
    ///
    /// # Errors
    ///
    /// As [`PgServer::start`].
    pub fn start_tls(pki: &crate::tls::Pki) -> io::Result<Self> {
        Self::start(
            &[
                ("ssl", "on"),
                ("ssl_cert_file", "server.pem"),
                ("ssl_key_file", "server.key"),
            ],
            &[
                ("server.pem", pki.server_cert.as_bytes()),
                ("server.key", pki.server_key.as_bytes()),
            ],
        )
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// A command running `tool` from the server binaries as the server's user.
    fn as_server(&self, tool: &str) -> Command {
        let program = self.bin.join(tool);
        match self.user {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(program);
                command
            }
            None => Command::new(program),
        }
    }

    fn run(&self, command: &mut Command) -> io::Result<()> {
        let out = command.stdin(Stdio::null()).output()?;
        if out.status.success() {
            Ok(())
        } else {
            let log = std::fs::read_to_string(self.data.join("server.log")).unwrap_or_default();
            Err(io::Error::other(format!(
                "{command:?} failed: {}{}\n{log}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self
            .as_server("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
