//! Throwaway PostgreSQL servers for tests that need a server of their own (TLS, a special
//! setting), and (feature `postgres`) stores in schemas of their own on the test server.
//!
//! Throwaway servers: `initdb` and `pg_ctl` from `PATH`, or from `/usr/lib/postgresql/*/bin`
//! where Debian and Ubuntu keep them, on a free loopback port, in a temporary directory
//! removed on drop (`idem-testenv` starts the server of `scripts/test` this way too).
//! PostgreSQL refuses to run as root: as root, the server runs as the `postgres` user (or
//! `nobody`).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{harness, process};

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
    debian.sort_by(|a, b| b.cmp(a));
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
        let user = process::server_user(&["postgres", "nobody"]);
        let server = Self {
            bin,
            data,
            dir,
            user,
            port: harness::free_port(),
        };
        if user.is_some() {
            process::chown(user, &server.dir)?;
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
            process::chown(user, &path)?;
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

    /// Restarts the server on the same port and data, as an operator's `pg_ctl restart`
    /// would (`mode`: `fast` ends every session with `57P01`, `immediate` kills them), and
    /// waits until it accepts connections again.
    ///
    /// # Errors
    ///
    /// When `pg_ctl` fails or the server does not come back.
    pub fn restart(&self, mode: &str) -> io::Result<()> {
        self.run(
            self.as_server("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                // The log file again: without it the new server would write to (and hold
                // open) the pipe that `run` reads to its end.
                .arg("-l")
                .arg(self.data.join("server.log"))
                .args(["-w", "-t", "60", "-m", mode, "restart"]),
        )
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
        process::as_user(self.user, self.bin.join(tool))
    }

    fn run(&self, command: &mut Command) -> io::Result<()> {
        process::run(command, || {
            std::fs::read_to_string(self.data.join("server.log")).unwrap_or_default()
        })
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

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use stores::*;

/// Stores on the test server (`IDEM_TEST_DATABASE_URL`), each in a schema of its own, so
/// tests share the server without meeting.
#[cfg(feature = "postgres")]
mod stores {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use idem_postgres::PgStore;
    use sqlx::postgres::PgPoolOptions;
    use sqlx::PgPool;

    use crate::harness;

    /// The prefix of test schemas: `idem_t_<unix seconds>_<random>`, dropped by
    /// [`fresh_store`] an hour after they were made.
    pub const SCHEMA_PREFIX: &str = "idem_t_";

    /// The store's pool settings with `max` connections and a patient acquire timeout, so a
    /// loaded CI machine does not turn queueing for a connection into a failure.
    pub fn pool_options(max: u32) -> PgPoolOptions {
        PgStore::pool_options()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(15))
    }

    /// A pool of [`pool_options`] on `url`.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub async fn connect(url: &str, max: u32) -> PgPool {
        pool_options(max)
            .connect(url)
            .await
            .expect("connect to IDEM_TEST_DATABASE_URL")
    }

    /// A store in a fresh schema, not migrated yet, on a pool of `max` connections to
    /// `IDEM_TEST_DATABASE_URL`; `None` when it is not set (see [`harness::url_from_env`]).
    /// First, once per process, it drops the schemas of test runs that ended over an hour
    /// ago, so a long-lived test server does not collect them.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub async fn fresh_store(max: u32) -> Option<PgStore> {
        static SWEPT: AtomicBool = AtomicBool::new(false);
        let url = harness::database_url()?;
        let pool = connect(&url, max).await;
        if !SWEPT.swap(true, Ordering::SeqCst) {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)",
            )
            .bind(SCHEMA_PREFIX)
            .fetch_all(&pool)
            .await
            .expect("list test schemas");
            for name in names.iter().filter(|n| harness::is_stale(n, SCHEMA_PREFIX)) {
                // Another process may drop it at the same time: its error is not ours.
                let drop = format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE");
                let _ = sqlx::query(&drop).execute(&pool).await;
            }
        }
        let store = PgStore::new(pool)
            .with_schema(&harness::unique_name(SCHEMA_PREFIX))
            .expect("a valid schema name");
        Some(store)
    }

    /// Drops the store's schema and everything in it.
    ///
    /// # Panics
    ///
    /// When the server refuses.
    pub async fn drop_schema(store: &PgStore) {
        let drop = format!("DROP SCHEMA IF EXISTS {} CASCADE", store.quoted_schema());
        sqlx::query(&drop)
            .execute(store.pool())
            .await
            .expect("drop the test schema");
    }

    /// A store whose pool points at a loopback port nothing listens on, opened lazily.
    pub fn closed_port_store() -> PgStore {
        let url = format!(
            "postgres://postgres@127.0.0.1:{}/test",
            harness::refused_port()
        );
        let pool = PgStore::pool_options()
            .connect_lazy(&url)
            .expect("a well-formed URL");
        PgStore::new(pool)
    }
}
