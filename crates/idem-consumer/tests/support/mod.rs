//! Helpers the broker tests share: polling, the Redis store that consumer processes share,
//! and the consumer processes of the crash tests (this test binary, run again as a child).
//! Each test binary uses part of them.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_core::Store;
use idem_redis::RedisStore;
use tokio::time::{sleep, Instant};

/// Set in a child consumer process's environment.
pub const CHILD_ENV: &str = "IDEM_CONSUMER_CHILD";

/// Polls `check` every 50 ms until it holds; panics with `what` after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        sleep(Duration::from_millis(50)).await;
    }
}

/// The store the consumer processes share: Redis (`IDEM_TEST_REDIS_URL`) under a key
/// prefix of this test's own.
pub struct SharedStore {
    pub url: String,
    pub prefix: String,
}

impl SharedStore {
    /// `None` (skipped, after the harness said why) when no Redis is configured; the
    /// harness panics instead when backends are required.
    pub fn for_test() -> Option<Self> {
        Some(Self {
            url: idem_testkit::harness::redis_url()?,
            prefix: format!("idem-consumer-test-{}:", uuid::Uuid::new_v4().simple()),
        })
    }

    /// How a child process opens the same store: `<prefix>|<url>`.
    pub fn descriptor(&self) -> String {
        format!("{}|{}", self.prefix, self.url)
    }

    pub fn open(descriptor: &str) -> Arc<dyn Store> {
        let (prefix, url) = descriptor
            .split_once('|')
            .unwrap_or_else(|| panic!("unknown store descriptor {descriptor:?}"));
        Arc::new(
            RedisStore::builder(url)
                .with_prefix(prefix)
                .connect_lazy()
                .expect("a Redis store"),
        )
    }

    pub fn store(&self) -> Arc<dyn Store> {
        Self::open(&self.descriptor())
    }
}

/// Where a child consumer process reads its settings and writes what it does.
pub struct ChildFiles {
    pub dir: PathBuf,
    /// Whether dropping this removes the directory (the test's own, not a child's view).
    pub owner: bool,
}

impl ChildFiles {
    pub fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("idem-consumer-crash-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        Self { dir, owner: true }
    }
    /// One line per handler start: `<key> <attempt> <process>`.
    pub fn starts(&self) -> PathBuf {
        self.dir.join("starts")
    }
    /// One line per side effect: `<key> <attempt> <process>`.
    pub fn effects(&self) -> PathBuf {
        self.dir.join("effects")
    }
    pub fn stop(&self, name: &str) -> PathBuf {
        self.dir.join(format!("stop-{name}"))
    }
    pub fn summary(&self, name: &str) -> PathBuf {
        self.dir.join(format!("summary-{name}"))
    }
    pub fn lines(path: &Path) -> Vec<Vec<String>> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').map(str::to_owned).collect())
            .collect()
    }
}

impl Drop for ChildFiles {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

pub fn append(path: &Path, line: &str) {
    // One `write` on a file opened for appending: lines from concurrent writers, in this
    // process or another, do not interleave.
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open for append");
    file.write_all(format!("{line}\n").as_bytes())
        .expect("append");
}

/// A child process, killed when dropped, so a failing test leaves no consumer behind.
pub struct ChildProcess(pub Child);

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts this test binary as the consumer process `name`, running the ignored test `test`
/// (its full path, such as `nats::child_worker_process`) with `CHILD_ENV`, the files' directory
/// in `IDEM_CHILD_DIR`, `IDEM_CHILD_NAME` and `env`; its standard error goes to
/// `stderr-<name>` in that directory.
pub fn spawn_child(
    files: &ChildFiles,
    test: &str,
    name: &str,
    env: &[(&str, String)],
) -> ChildProcess {
    let child = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("IDEM_CHILD_DIR", &files.dir)
        .env("IDEM_CHILD_NAME", name)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(
            std::fs::File::create(files.dir.join(format!("stderr-{name}"))).expect("stderr file"),
        )
        .spawn()
        .expect("spawn the consumer process");
    ChildProcess(child)
}

/// Tells the child `name` to stop (its stop file), waits up to 30 s for it to exit
/// successfully, and returns its summary file's text.
pub async fn stop_child(files: &ChildFiles, child: &mut ChildProcess, name: &str) -> String {
    std::fs::write(files.stop(name), b"").expect("write the stop file");
    let stderr =
        || std::fs::read_to_string(files.dir.join(format!("stderr-{name}"))).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("the child's status") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "{name} did not shut down: {}",
            stderr()
        );
        sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{name} failed: {}", stderr());
    std::fs::read_to_string(files.summary(name)).expect("the child's summary")
}

/// The environment variable `name` of a child process.
pub fn child_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set"))
}
