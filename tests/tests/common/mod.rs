//! What the Redis, tiered and outage test files share: store builders with patient
//! timeouts, one Redis Cluster per test binary, and pausing a throwaway server's process.
//!
//! Each test binary compiles this module and uses a part of it.
#![allow(dead_code)]

use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use idem_redis::{RedisStore, RedisStoreBuilder};
use idem_testkit::redis::{self as testing, RedisCluster, RedisServer};

/// A store builder for `url` with a key prefix of its own (`<name>-<uuid>:`, so tests share
/// a server without meeting) and patient timeouts: tests run in parallel on two shared
/// cores, where thousands of queued calls can wait longer than the default 2 s response
/// timeout.
pub fn patient_builder(url: impl Into<String>, name: &str) -> RedisStoreBuilder {
    RedisStore::builder(url.into())
        .with_prefix(format!("{name}-{}:", uuid::Uuid::new_v4().simple()))
        .with_timeouts(Duration::from_secs(1), Duration::from_secs(8))
}

/// One 3-primary Redis Cluster for the whole test binary, started on first use; `None` when
/// the Redis binaries are missing. A static is never dropped: its servers stop when this
/// process exits (each runs under a watchdog polling the test's pid).
pub fn redis_cluster() -> Option<&'static RedisCluster> {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    if !testing::available() {
        return None;
    }
    Some(CLUSTER.get_or_init(|| RedisCluster::start(3).expect("start a 3-primary cluster")))
}

/// The URL of [`redis_cluster`], started off the async runtime (starting takes seconds).
pub async fn redis_cluster_url() -> Option<String> {
    tokio::task::spawn_blocking(|| redis_cluster().map(RedisCluster::url))
        .await
        .expect("cluster start")
}

/// A throwaway server's process id, as it reports it (the test harness may start it through
/// a wrapper).
pub fn redis_pid(server: &RedisServer) -> String {
    let info = server.cli(&["info", "server"]).expect("INFO server");
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .expect("process_id in INFO server")
        .trim()
        .to_owned()
}

/// A process stopped with `SIGSTOP`, resumed with `SIGCONT` by [`Stopped::resume`] or,
/// when a failing test never gets there, on drop (so that its server's drop does not wait
/// for it).
pub struct Stopped(String);

impl Stopped {
    /// Stops the process `pid`.
    pub fn stop(pid: String) -> Self {
        signal(&pid, "-STOP");
        Self(pid)
    }

    /// Resumes the process.
    pub fn resume(mut self) {
        signal(&std::mem::take(&mut self.0), "-CONT");
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let _ = Command::new("kill").args(["-CONT", &self.0]).status();
        }
    }
}

fn signal(pid: &str, signal: &str) {
    let status = Command::new("kill")
        .args([signal, pid])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
}
