//! Helpers the broker tests share: polling, the Redis store that consumer processes share,
//! and the consumer processes of the crash tests (this test binary, run again as a child).
//! Each test binary uses part of them.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_consumer::{Consumer, Policy, Summary};
use idem_core::{Config, Failure, Idem, Scope, Store};
use idem_redis::RedisStore;
use tokio::time::{sleep, Instant};

mod broker;
pub use broker::*;

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

// --- What the broker tests share -----------------------------------------------------------

/// A test handler: the key's attempt as its value.
pub type Handler = Arc<
    dyn Fn(
            idem_consumer::Message,
            idem_consumer::Context,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<u32, Failure<String>>> + Send>,
        > + Send
        + Sync,
>;

/// Side effects per key.
pub type Effects = Arc<Mutex<BTreeMap<String, u32>>>;

/// A handler that counts its side effect per key after `work`.
pub fn counting(effects: &Effects, work: Duration) -> Handler {
    let effects = effects.clone();
    Arc::new(move |_message, ctx| {
        let effects = effects.clone();
        Box::pin(async move {
            sleep(work).await;
            *effects
                .lock()
                .unwrap()
                .entry(ctx.key().to_string())
                .or_insert(0) += 1;
            Ok(ctx.attempt())
        })
    })
}

/// The keys of the retry tests: five that fail twice then succeed, three that always fail,
/// and `declined`, which fails for good at once.
pub fn retry_keys() -> (Vec<String>, Vec<String>) {
    let flaky = (0..5).map(|i| format!("flaky-{i}")).collect();
    let broken = (0..3).map(|i| format!("broken-{i}")).collect();
    (flaky, broken)
}

/// Each key's attempts, and when they started.
pub type Runs = Arc<Mutex<BTreeMap<String, Vec<(u32, std::time::Instant)>>>>;

/// The handler of the retry tests (see [`retry_keys`]), recording its runs.
pub fn failing(runs: &Runs, effects: &Effects) -> Handler {
    let (runs, effects) = (runs.clone(), effects.clone());
    Arc::new(move |_message, ctx| {
        let (runs, effects) = (runs.clone(), effects.clone());
        Box::pin(async move {
            let key = ctx.key().to_string();
            runs.lock()
                .unwrap()
                .entry(key.clone())
                .or_default()
                .push((ctx.attempt(), std::time::Instant::now()));
            if key == "declined" {
                return Err(Failure::Terminal("card declined".to_string()));
            }
            if key.starts_with("broken") || ctx.attempt() < 3 {
                return Err(Failure::Retryable(format!(
                    "gateway timeout on attempt {}",
                    ctx.attempt()
                )));
            }
            *effects.lock().unwrap().entry(key).or_insert(0) += 1;
            Ok(ctx.attempt())
        })
    })
}

// --- The crash tests -----------------------------------------------------------------------

/// The child's lease: a killed child's keys are taken over this long after its last
/// heartbeat. Longer than the broker's redelivery time, so that the killed child's
/// messages come back while its leases still hold.
pub const CHILD_LEASE: Duration = Duration::from_secs(4);
/// The broker's redelivery time in the crash tests (ack_wait, claim idle time).
pub const CHILD_REDELIVERY: Duration = Duration::from_secs(1);
/// Handlers per child.
pub const CHILD_CONCURRENCY: usize = 4;
/// Messages of the crash tests (each published twice), and how many the first child works
/// before its handlers hang.
pub const CRASH_MESSAGES: u32 = 20;
const QUICK: u32 = 6;

/// What a child worker process runs with: its files, name, consumer and handler, and the
/// future that says when to stop. `None` unless this process is a crash test's child.
pub struct ChildSetup {
    pub files: ChildFiles,
    pub name: String,
    pub consumer: Consumer,
    pub handler: Handler,
}

impl ChildSetup {
    pub fn from_env() -> Option<Self> {
        if std::env::var(CHILD_ENV).is_err() {
            eprintln!("this test runs only as a crash test's child process");
            return None;
        }
        let files = ChildFiles {
            dir: PathBuf::from(child_env("IDEM_CHILD_DIR")),
            owner: false,
        };
        let name = child_env("IDEM_CHILD_NAME");
        let hang_after: u32 = child_env("IDEM_CHILD_HANG_AFTER")
            .parse()
            .expect("a number");
        let store = SharedStore::open(&child_env("IDEM_CHILD_STORE"));
        let consumer = Consumer::new(
            Idem::from_arc(store).with_config(Config::default().with_lease(CHILD_LEASE)),
            Scope::new("crash-test").unwrap(),
        )
        .with_policy(Policy::default().with_max_in_flight_delay(Duration::from_millis(300)));
        let starts = Arc::new(AtomicU32::new(0));
        let (starts_file, effects_file) = (files.starts(), files.effects());
        let handler_name = name.clone();
        let handler: Handler = Arc::new(move |_message, ctx| {
            let (starts, starts_file, effects_file, name) = (
                starts.clone(),
                starts_file.clone(),
                effects_file.clone(),
                handler_name.clone(),
            );
            Box::pin(async move {
                let n = starts.fetch_add(1, Ordering::SeqCst) + 1;
                let line = format!("{} {} {name}", ctx.key(), ctx.attempt());
                append(&starts_file, &line);
                if n > hang_after {
                    // Stuck while holding the key (its lease is extended and the broker
                    // told the work goes on, in the background), until the process is
                    // killed.
                    sleep(Duration::from_secs(3600)).await;
                }
                sleep(Duration::from_millis(30)).await;
                append(&effects_file, &line);
                Ok(n)
            })
        });
        Some(Self {
            files,
            name,
            consumer,
            handler,
        })
    }

    /// Completes when the test writes this child's stop file, or is gone (it removes the
    /// directory).
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let stop_file = self.files.stop(&self.name);
        async move {
            while !stop_file.exists() && stop_file.parent().is_some_and(Path::exists) {
                sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Writes the worker's summary for the test to read.
    pub fn report(&self, summary: &Summary) {
        std::fs::write(
            self.files.summary(&self.name),
            format!("{} {}", summary.acked, summary.requeued),
        )
        .expect("write the summary");
    }
}

/// The first half of a crash test: starts child `A` (running `test` with `env`), which
/// works [`QUICK`] messages and then hangs on a full set of handlers, kills it with SIGKILL
/// and returns the keys it held.
pub async fn start_and_kill_a(
    files: &ChildFiles,
    test: &str,
    env: &[(&str, String)],
) -> BTreeSet<String> {
    let mut env = env.to_vec();
    env.push(("IDEM_CHILD_HANG_AFTER", QUICK.to_string()));
    let mut a = spawn_child(files, test, "A", &env);
    wait_until(
        Duration::from_secs(60),
        "A does its quick work and hangs on a full set of handlers",
        || async {
            ChildFiles::lines(&files.effects()).len() == QUICK as usize
                && ChildFiles::lines(&files.starts()).len() >= QUICK as usize + CHILD_CONCURRENCY
        },
    )
    .await;
    // SIGKILL, as `kill -9`: no cleanup, no acks, no releases.
    a.0.kill().expect("kill -9 the worker process");
    a.0.wait().expect("reap it");
    let starts = ChildFiles::lines(&files.starts());
    assert_eq!(
        starts.len(),
        QUICK as usize + CHILD_CONCURRENCY,
        "{starts:?}"
    );
    let hung: BTreeSet<String> = starts
        .into_iter()
        .skip(QUICK as usize)
        .map(|l| l[0].clone())
        .collect();
    assert_eq!(hung.len(), CHILD_CONCURRENCY, "{hung:?}");
    hung
}

/// Starts child `B`, which handles everything, and waits until every message had its
/// effect.
pub async fn start_b(files: &ChildFiles, test: &str, env: &[(&str, String)]) -> ChildProcess {
    let mut env = env.to_vec();
    env.push(("IDEM_CHILD_HANG_AFTER", u32::MAX.to_string()));
    let b = spawn_child(files, test, "B", &env);
    wait_until(
        Duration::from_secs(90),
        "every message has its effect",
        || async {
            let keys: BTreeSet<String> = ChildFiles::lines(&files.effects())
                .into_iter()
                .map(|l| l[0].clone())
                .collect();
            keys.len() == CRASH_MESSAGES as usize
        },
    )
    .await;
    b
}

/// The end of a crash test, B stopped with `summary_b`: B handed A's messages back while
/// A's leases held, then took them over as attempt 2; every message had its effect once.
pub fn check_crash(files: &ChildFiles, hung: &BTreeSet<String>, summary_b: &str) {
    let requeued: u64 = summary_b
        .split(' ')
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("requeued count");
    assert!(
        requeued > 0,
        "B found A's keys held and handed their messages back until the leases expired"
    );
    let mut per_key: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for line in ChildFiles::lines(&files.effects()) {
        per_key
            .entry(line[0].clone())
            .or_default()
            .push((line[1].clone(), line[2].clone()));
    }
    assert_eq!(per_key.len(), CRASH_MESSAGES as usize, "no message lost");
    for (key, done) in &per_key {
        assert_eq!(
            done.len(),
            1,
            "{key} had its effect {} times: {done:?}",
            done.len()
        );
        if hung.contains(key) {
            assert_eq!(
                done[0],
                ("2".to_string(), "B".to_string()),
                "{key}: B took over A's key as attempt 2"
            );
        }
    }
}
