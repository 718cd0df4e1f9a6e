//! A seeded fault soak of the tiered store, checked from the database.
//!
//! Two `idem serve` processes and one `idem relay run` share a `tiered:redis://..|postgres://..`
//! store on a throwaway Redis (no persistence) and a throwaway PostgreSQL. Clients pay under a
//! few dozen keys (duplicates, concurrent retries, slow handlers, clients that give up, and
//! now and then another body under a key already paid) while a seeded schedule of faults
//! runs: `kill -9` and restart of a server or the relay, Redis `FLUSHALL`, Redis `SIGSTOP`
//! for 2-5 s then `SIGCONT`, PostgreSQL restarted `fast` or `immediate`. Then the faults stop,
//! everything runs again, a settle period passes (a lease and a margin), and every key's own
//! body is retried until it is answered. Every answer and `idem_demo.payments` are then
//! checked (see [`check`]): one payment per key, every 2xx to a key's own body carries that
//! payment's id, no 422 to a key's own body, no 2xx to another body, no 5xx but 503, no 409
//! to a paid key once settled, no panic in any process.
//!
//! The seed comes from `IDEM_SOAK_SEED` (default 31) and the length of the fault phase from
//! `IDEM_SOAK_SECS` (default 40 s, what CI runs); both are printed, with the schedule, so a
//! failure can be replayed. A long run:
//!
//! ```sh
//! IDEM_SOAK_SECS=300 IDEM_SOAK_SEED=7 cargo test -p idem-cli --test soak -- --nocapture
//! ```

mod support;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_testkit::postgres::PgServer;
use idem_testkit::redis::RedisServer;
use support::HttpClient;

/// Keys paid during a run; each is paid by an owner of its own, so `idem_demo.payments`
/// counts the payments of one key by its owner.
const KEYS: usize = 40;
/// Client tasks sending requests during the fault phase.
const CLIENTS: usize = 16;
/// The servers' lease (`idem serve --lease`): what a `kill -9` mid-handler leaves behind.
const LEASE: Duration = Duration::from_secs(5);
/// The quiet time between the last fault and the final phase: every lease a fault left
/// behind has expired by then.
const SETTLE: Duration = Duration::from_secs(8);
/// How long the final phase may retry one key's own body before the run fails.
const FINAL_LIMIT: Duration = Duration::from_secs(60);
/// How long a client that does not give up waits for an answer: past Redis's response
/// timeout (2 s), a demo delay and a PostgreSQL restart.
const PATIENCE: Duration = Duration::from_secs(10);
/// The most requests one client makes, whatever the clock says.
const MAX_ROUNDS: usize = 20_000;

mod tiered {
    /// The soak on the tiered store; see the file's documentation.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn soak_under_random_faults_keeps_every_answer_right() {
        if !idem_testkit::redis::available() || !idem_testkit::postgres::available() {
            return;
        }
        let seed = super::env_number("IDEM_SOAK_SEED", 31);
        let faults_for = std::time::Duration::from_secs(super::env_number("IDEM_SOAK_SECS", 40));
        super::soak(seed, faults_for).await;
    }
}

/// The whole number in the variable `name`, or `default` when it is not set.
fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Err(_) => default,
        Ok(text) => text.trim().parse().unwrap_or_else(|_| {
            panic!("{name} must be a whole number, not {text:?}: unset it for {default}")
        }),
    }
}

// ---------------------------------------------------------------------------------------
// The schedule of faults.

/// One fault, with how long it lasts.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// `kill -9` of `idem serve` number `server`, started again after `down`.
    KillServer { server: usize, down: Duration },
    /// `kill -9` of the relay, started again after `down`.
    KillRelay { down: Duration },
    /// `FLUSHALL`: Redis forgets every record.
    FlushRedis,
    /// `SIGSTOP` to Redis, `SIGCONT` after `stalled`.
    StopRedis { stalled: Duration },
    /// `FLUSHALL` then at once `SIGSTOP`, `SIGCONT` after `stalled`: a Redis that lost its
    /// records (a failover) and stalls before any retry could repair them.
    FlushAndStopRedis { stalled: Duration },
    /// `pg_ctl restart -m fast`: sessions end with an error.
    RestartPostgresFast,
    /// `pg_ctl restart -m immediate`: the server dies and recovers.
    RestartPostgresImmediate,
}

impl Fault {
    /// Every kind, in the order [`Fault::draw`] numbers them.
    const KINDS: usize = 7;

    /// A fault of kind `kind` (0 to [`Fault::KINDS`] - 1), its details drawn from `rng`.
    fn draw(kind: usize, rng: &mut fastrand::Rng) -> Self {
        let millis = |rng: &mut fastrand::Rng, from, to| Duration::from_millis(rng.u64(from..to));
        match kind {
            0 => Self::KillServer {
                server: rng.usize(0..2),
                down: millis(rng, 200, 1500),
            },
            1 => Self::KillRelay {
                down: millis(rng, 200, 2000),
            },
            2 => Self::FlushRedis,
            3 => Self::StopRedis {
                stalled: millis(rng, 2000, 5000),
            },
            4 => Self::FlushAndStopRedis {
                stalled: millis(rng, 2000, 5000),
            },
            5 => Self::RestartPostgresFast,
            _ => Self::RestartPostgresImmediate,
        }
    }

    /// The name the summary counts it under.
    fn kind(&self) -> &'static str {
        match self {
            Self::KillServer { .. } => "kill -9 idem serve",
            Self::KillRelay { .. } => "kill -9 idem relay",
            Self::FlushRedis => "Redis FLUSHALL",
            Self::StopRedis { .. } => "Redis SIGSTOP",
            Self::FlushAndStopRedis { .. } => "Redis FLUSHALL and SIGSTOP",
            Self::RestartPostgresFast => "PostgreSQL restart fast",
            Self::RestartPostgresImmediate => "PostgreSQL restart immediate",
        }
    }

    /// About how long it takes, for planning (a restart takes longer).
    fn planned(&self) -> Duration {
        match *self {
            Self::KillServer { down, .. } | Self::KillRelay { down } => down,
            Self::StopRedis { stalled } | Self::FlushAndStopRedis { stalled } => stalled,
            Self::FlushRedis => Duration::ZERO,
            Self::RestartPostgresFast | Self::RestartPostgresImmediate => Duration::from_secs(1),
        }
    }
}

/// The faults of a run, in order, each after a pause of its own.
#[derive(Debug)]
struct Schedule {
    steps: Vec<(Duration, Fault)>,
}

impl Schedule {
    /// Faults drawn from `seed` until about `length` is planned: every kind once first (in
    /// a random order), so a short run meets each, then kinds at random; pauses of 1-3 s.
    fn random(seed: u64, length: Duration) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut first: Vec<usize> = (0..Fault::KINDS).collect();
        rng.shuffle(&mut first);
        let mut steps = Vec::new();
        let mut planned = Duration::ZERO;
        loop {
            let kind = first.pop().unwrap_or_else(|| rng.usize(0..Fault::KINDS));
            let fault = Fault::draw(kind, &mut rng);
            let pause = Duration::from_millis(rng.u64(1000..3000));
            planned += pause + fault.planned();
            if planned > length {
                return Self { steps };
            }
            steps.push((pause, fault));
        }
    }
}

// ---------------------------------------------------------------------------------------
// The processes and servers of a run.

/// One `idem serve` or `idem relay run`, started again with the same command after a
/// `kill -9`. Its standard error goes to `<dir>/<name>.log`, kept across restarts; its
/// standard output to `<dir>/<name>.out`, anew at each start. Killed when dropped.
#[derive(Debug)]
struct Process {
    name: String,
    args: Vec<String>,
    dir: PathBuf,
    child: Option<Child>,
}

impl Process {
    fn new(name: &str, args: &str, dir: &Path) -> Self {
        Self {
            name: name.to_owned(),
            args: args.split_whitespace().map(str::to_owned).collect(),
            dir: dir.to_owned(),
            child: None,
        }
    }

    fn start(&mut self) {
        let out = std::fs::File::create(self.dir.join(format!("{}.out", self.name)))
            .expect("create the standard output file");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the log file");
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let child = support::idem(&args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start idem {}: {e}", self.name));
        self.child = Some(child);
    }

    /// `kill -9`, as a crash: no shutdown code runs.
    fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The URL `idem serve` printed at this start, once it did (within 30 s).
    fn url(&mut self) -> String {
        let started = Instant::now();
        let out = self.dir.join(format!("{}.out", self.name));
        loop {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            if let Some(url) = text.split_whitespace().find(|w| w.starts_with("http://")) {
                return url.to_owned();
            }
            let exited = self
                .child
                .as_mut()
                .is_none_or(|c| c.try_wait().ok().flatten().is_some());
            if exited || started.elapsed() > Duration::from_secs(30) {
                panic!(
                    "{} printed no URL (exited: {exited}); its log:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join(format!("{}.log", self.name))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill_9();
    }
}

/// The base URLs clients send to: one per `idem serve`, `None` while it is down.
#[derive(Debug, Clone)]
struct Bases(Arc<Mutex<Vec<Option<String>>>>);

impl Bases {
    fn set(&self, server: usize, base: Option<String>) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)[server] = base;
    }

    /// A server that is up, drawn with `rng`.
    fn pick(&self, rng: &mut fastrand::Rng) -> Option<String> {
        let bases = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let up: Vec<&String> = bases.iter().flatten().collect();
        (!up.is_empty()).then(|| up[rng.usize(0..up.len())].clone())
    }
}

/// A Redis stopped with `SIGSTOP`: continued when dropped, so that a failing run never
/// leaves a stopped server behind (its watchdog could not stop it).
struct Stopped(u32);

impl Drop for Stopped {
    fn drop(&mut self) {
        support::signal(self.0, "CONT");
    }
}

/// Everything a run starts: Redis, PostgreSQL, two `idem serve` and the relay, with a
/// directory for their logs.
struct Servers {
    redis: RedisServer,
    redis_pid: u32,
    postgres: PgServer,
    serve: Vec<Process>,
    relay: Process,
    bases: Bases,
    dir: PathBuf,
    started: Instant,
}

impl Servers {
    fn start(dir: &Path, started: Instant) -> Self {
        let redis = RedisServer::start().expect("start a throwaway redis-server");
        let info = redis.cli(&["info", "server"]).expect("redis-cli info");
        let redis_pid = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|pid| pid.trim().parse().ok())
            .unwrap_or_else(|| panic!("no process_id in INFO: {info}"));
        let postgres = PgServer::start(&[], &[]).expect("start a throwaway PostgreSQL");
        let store = format!(
            "tiered:{}|postgres://postgres@127.0.0.1:{}/postgres",
            redis.url(),
            postgres.port()
        );

        support::exits(0, support::run(&["migrate", "--store", &store]));

        let lease = LEASE.as_secs();
        let serve_args = format!("serve --listen 127.0.0.1:0 --store {store} --lease {lease}");
        let bases = Bases(Arc::new(Mutex::new(vec![None; 2])));
        let mut serve = Vec::new();
        for n in 0..2 {
            let mut process = Process::new(&format!("serve-{n}"), &serve_args, dir);
            process.start();
            bases.set(n, Some(process.url()));
            serve.push(process);
        }
        let mut relay = Process::new("relay", &format!("relay run --store {store}"), dir);
        relay.start();
        Self {
            redis,
            redis_pid,
            postgres,
            serve,
            relay,
            bases,
            dir: dir.to_owned(),
            started,
        }
    }

    /// Runs the faults of `schedule` in order, counting them in `done`.
    fn run(&mut self, schedule: &Schedule, done: &mut BTreeMap<&'static str, usize>) {
        for (pause, fault) in &schedule.steps {
            std::thread::sleep(*pause);
            println!("[{:>6.1?}] {fault:?}", self.started.elapsed());
            self.inflict(*fault);
            *done.entry(fault.kind()).or_default() += 1;
        }
    }

    /// Inflicts `fault` and undoes it: when this returns, everything runs again.
    fn inflict(&mut self, fault: Fault) {
        match fault {
            Fault::KillServer { server, down } => {
                self.bases.set(server, None);
                self.serve[server].kill_9();
                std::thread::sleep(down);
                self.serve[server].start();
                let url = self.serve[server].url();
                self.bases.set(server, Some(url));
            }
            Fault::KillRelay { down } => {
                self.relay.kill_9();
                std::thread::sleep(down);
                self.relay.start();
            }
            Fault::FlushRedis => {
                self.redis.cli(&["FLUSHALL"]).expect("FLUSHALL");
            }
            Fault::StopRedis { stalled } => self.stop_redis(stalled),
            Fault::FlushAndStopRedis { stalled } => {
                self.redis.cli(&["FLUSHALL"]).expect("FLUSHALL");
                self.stop_redis(stalled);
            }
            Fault::RestartPostgresFast => self.restart_postgres("fast"),
            Fault::RestartPostgresImmediate => self.restart_postgres("immediate"),
        }
    }

    fn stop_redis(&self, stalled: Duration) {
        support::signal(self.redis_pid, "STOP");
        let stopped = Stopped(self.redis_pid);
        std::thread::sleep(stalled);
        drop(stopped);
    }

    fn restart_postgres(&self, mode: &str) {
        if let Err(e) = self.postgres.restart(mode) {
            panic!("PostgreSQL did not come back after a {mode} restart: {e}");
        }
    }

    /// The payments' ids in `idem_demo.payments`, by key.
    async fn payments(&self) -> HashMap<usize, Vec<String>> {
        let url = format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.postgres.port()
        );
        let pool = sqlx::PgPool::connect(&url)
            .await
            .expect("connect to PostgreSQL");
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT owner, id FROM idem_demo.payments ORDER BY seq")
                .fetch_all(&pool)
                .await
                .expect("read idem_demo.payments");
        let mut by_key: HashMap<usize, Vec<String>> = HashMap::new();
        for (owner, id) in rows {
            let key = Key::of_owner(&owner)
                .unwrap_or_else(|| panic!("a payment of an owner of no key: {owner}"));
            by_key.entry(key.0).or_default().push(id);
        }
        by_key
    }

    /// The lines of every process's log that hold `text`, each after the process's name.
    fn log_lines(&self, text: &str) -> Vec<String> {
        self.serve
            .iter()
            .chain([&self.relay])
            .flat_map(|p| {
                p.log()
                    .lines()
                    .filter(|l| l.contains(text))
                    .map(|l| format!("{}: {l}", p.name))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------
// Clients.

/// Key number `n`: the idempotency key `order-<n>`, paid by the owner `soak-<n>` with its
/// own body (`amount` 100 + n in EUR); its other body is the same amount in USD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key(usize);

impl Key {
    fn auth(self) -> String {
        format!("Bearer soak-{}", self.0)
    }

    fn of_owner(owner: &str) -> Option<Key> {
        owner.strip_prefix("soak-")?.parse().ok().map(Key)
    }

    fn body(self, body: Body) -> String {
        let currency = match body {
            Body::Own => "EUR",
            Body::Other => "USD",
        };
        format!(
            r#"{{"amount": {}, "currency": "{currency}"}}"#,
            100 + self.0
        )
    }
}

/// Which body a request carries under its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Body {
    /// The key's own: the one it is paid with.
    Own,
    /// Another body, sent only once the own body was answered 2xx.
    Other,
}

/// When an answer came.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// While faults ran.
    Faults,
    /// After the faults and the settle period.
    Final,
}

/// One request and what it got: its status, or `None` for no answer (a connection refused
/// or broken, or a client that gave up); on a 2xx, the payment id in the body.
#[derive(Debug, Clone)]
struct Answer {
    at: Duration,
    key: Key,
    body: Body,
    phase: Phase,
    status: Option<u16>,
    payment: Option<String>,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self
            .status
            .map_or("no answer".to_owned(), |s| s.to_string());
        write!(
            f,
            "[{:>6.1?}] order-{} {:?} body, {:?} phase: {status}",
            self.at, self.key.0, self.body, self.phase
        )?;
        if let Some(payment) = &self.payment {
            write!(f, " ({payment})")?;
        }
        Ok(())
    }
}

/// What the clients share: where to send, what came back, which keys were paid.
#[derive(Clone)]
struct Clients {
    http: HttpClient,
    bases: Bases,
    answers: Arc<Mutex<Vec<Answer>>>,
    paid: Arc<Vec<AtomicBool>>,
    stop: Arc<AtomicBool>,
    started: Instant,
}

impl Clients {
    /// Pays `key` with `body` on a server drawn with `rng`, waiting up to `patience`; the
    /// answer is recorded.
    async fn pay(
        &self,
        rng: &mut fastrand::Rng,
        key: Key,
        body: Body,
        delay: Option<Duration>,
        patience: Duration,
        phase: Phase,
    ) -> Answer {
        let (status, payment) = match self.bases.pick(rng) {
            None => (None, None),
            Some(base) => {
                let sent = send(&self.http, &base, (key, body), delay);
                match tokio::time::timeout(patience, sent).await {
                    Ok(Ok(reply)) => reply,
                    Ok(Err(_)) | Err(_) => (None, None),
                }
            }
        };
        let answer = Answer {
            at: self.started.elapsed(),
            key,
            body,
            phase,
            status,
            payment,
        };
        if body == Body::Own && status.is_some_and(|s| (200..300).contains(&s)) {
            self.paid[key.0].store(true, Ordering::SeqCst);
        }
        self.answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(answer.clone());
        answer
    }

    /// One client of the fault phase: [`MAX_ROUNDS`] rounds at most, until told to stop or
    /// `until` passes, whichever comes first.
    async fn run(self, seed: u64, until: Instant) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let millis = |rng: &mut fastrand::Rng, from, to| Duration::from_millis(rng.u64(from..to));
        for _ in 0..MAX_ROUNDS {
            if self.stop.load(Ordering::SeqCst) || Instant::now() > until {
                return;
            }
            let key = Key(rng.usize(0..KEYS));
            let (own, faults) = (Body::Own, Phase::Faults);
            let (body, delay, patience, copies) = match rng.u8(0..10) {
                // A plain request, or a retry of one.
                0..=2 => (own, None, PATIENCE, 1),
                // A slow handler.
                3 | 4 => (own, Some(millis(&mut rng, 200, 1500)), PATIENCE, 1),
                // A client that gives up before the slow handler is done.
                5 => {
                    let delay = millis(&mut rng, 800, 1500);
                    (own, Some(delay), millis(&mut rng, 100, 600), 1)
                }
                // Concurrent retries of one request.
                6 | 7 => (own, None, PATIENCE, rng.usize(2..5)),
                // Another body under a key already paid (else its own body).
                _ if self.paid[key.0].load(Ordering::SeqCst) => (Body::Other, None, PATIENCE, 1),
                _ => (own, None, PATIENCE, 1),
            };
            if copies == 1 {
                self.pay(&mut rng, key, body, delay, patience, faults).await;
            } else {
                let mut retries = tokio::task::JoinSet::new();
                for _ in 0..copies {
                    let (clients, mut rng) = (self.clone(), rng.fork());
                    retries.spawn(async move {
                        clients
                            .pay(&mut rng, key, body, delay, patience, faults)
                            .await
                    });
                }
                retries.join_all().await;
            }
            tokio::time::sleep(Duration::from_millis(rng.u64(10..100))).await;
        }
    }

    /// The final phase for `key`: its own body, again until a 2xx or [`FINAL_LIMIT`].
    async fn settle(self, key: Key, seed: u64) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let limit = Instant::now() + FINAL_LIMIT;
        while Instant::now() < limit {
            let answer = self
                .pay(&mut rng, key, Body::Own, None, PATIENCE, Phase::Final)
                .await;
            if answer.status.is_some_and(|s| (200..300).contains(&s)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// `POST <base>/payments` of `key` with `body`, the handler held for `delay`: its status
/// and, on a 2xx, the payment id its body names.
async fn send(
    http: &HttpClient,
    base: &str,
    (key, body): (Key, Body),
    delay: Option<Duration>,
) -> Result<(Option<u16>, Option<String>), String> {
    let (auth, order) = (key.auth(), format!("order-{}", key.0));
    let delay = delay.map(|d| d.as_millis().to_string());
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("idempotency-key", order.as_str()),
    ];
    headers.extend(delay.as_deref().map(|ms| ("x-demo-delay-ms", ms)));
    let url = format!("{base}/payments");
    let request = support::request("POST", &url, &headers, &key.body(body));
    let reply = support::send(http, request).await?;
    let payment = reply
        .status
        .is_success()
        .then(|| serde_json::from_slice::<serde_json::Value>(&reply.body).ok())
        .flatten()
        .and_then(|json| json["id"].as_str().map(str::to_owned));
    Ok((Some(reply.status.as_u16()), payment))
}

// ---------------------------------------------------------------------------------------
// The checker.

/// What a run found: the broken rules, each with its examples (empty when all held).
#[derive(Debug, Default)]
struct Violations(BTreeMap<&'static str, Vec<String>>);

impl Violations {
    fn add(&mut self, rule: &'static str, example: String) {
        self.0.entry(rule).or_default().push(example);
    }
}

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (rule, examples) in &self.0 {
            writeln!(f, "{rule}: {} times, first ones:", examples.len())?;
            for example in examples.iter().take(8) {
                writeln!(f, "    {example}")?;
            }
        }
        Ok(())
    }
}

/// Checks every answer against `payments` (the payments' ids by key, from the database);
/// `paid_before_final` holds the keys that had a payment when the final phase began, and
/// `panics` the lines of the logs that say a process panicked.
fn check(
    answers: &[Answer],
    payments: &HashMap<usize, Vec<String>>,
    paid_before_final: &[usize],
    panics: &[String],
) -> Violations {
    let mut found = Violations::default();
    let ok = |status: u16| (200..300).contains(&status);
    for n in 0..KEYS {
        let ids = payments.get(&n).map_or(&[][..], Vec::as_slice);
        if ids.len() != 1 {
            found.add(
                "not exactly one payment per key",
                format!("order-{n}: {ids:?}"),
            );
        }
        let settled = answers
            .iter()
            .any(|a| a.key.0 == n && a.phase == Phase::Final && a.status.is_some_and(ok));
        if !settled {
            found.add(
                "a key's own body never answered 2xx in the final phase",
                format!("order-{n}"),
            );
        }
    }
    for answer in answers {
        let Some(status) = answer.status else {
            continue;
        };
        let paid = payments.get(&answer.key.0).and_then(|ids| ids.first());
        match answer.body {
            Body::Own if ok(status) && answer.payment.as_ref() != paid => found.add(
                "a 2xx to a key's own body names another payment than the database",
                format!("{answer}; the database: {paid:?}"),
            ),
            Body::Own if status == 422 => found.add("422 to a key's own body", answer.to_string()),
            Body::Own
                if status == 409
                    && answer.phase == Phase::Final
                    && paid_before_final.contains(&answer.key.0) =>
            {
                found.add(
                    "409 to a paid key after the settle period",
                    answer.to_string(),
                )
            }
            Body::Other if ok(status) => found.add("2xx to another body", answer.to_string()),
            _ if status >= 500 && status != 503 => {
                found.add("a 5xx other than 503", answer.to_string())
            }
            _ if !ok(status) && ![409, 422, 503].contains(&status) => {
                found.add("an unexpected status", answer.to_string())
            }
            _ => {}
        }
    }
    for line in panics {
        found.add("a process panicked", line.clone());
    }
    found
}

/// The answers counted by phase, body and status.
fn summary(answers: &[Answer]) -> String {
    let mut counts: BTreeMap<(Phase, Body, String), usize> = BTreeMap::new();
    for a in answers {
        let status = a.status.map_or("no answer".to_owned(), |s| s.to_string());
        *counts.entry((a.phase, a.body, status)).or_default() += 1;
    }
    let mut text = format!("{} requests\n", answers.len());
    for ((phase, body, status), n) in counts {
        text.push_str(&format!(
            "  {phase:?} phase, {body:?} body, {status}: {n}\n"
        ));
    }
    // Allowed while faults run, but a sign of a wrong answer: 409 to a key's own body
    // after that body was answered 2xx.
    let mut paid = [false; KEYS];
    let mut conflicts = 0;
    for a in answers.iter().filter(|a| a.body == Body::Own) {
        match a.status {
            Some(409) if paid[a.key.0] => conflicts += 1,
            Some(s) if (200..300).contains(&s) => paid[a.key.0] = true,
            _ => {}
        }
    }
    text.push_str(&format!(
        "  409 to a key's own body once paid: {conflicts}\n"
    ));
    text
}

// ---------------------------------------------------------------------------------------
// The run.

/// The soak of `faults_for` of faults drawn from `seed`.
async fn soak(seed: u64, faults_for: Duration) {
    println!(
        "soak: seed {seed} (IDEM_SOAK_SEED), faults for {faults_for:?} (IDEM_SOAK_SECS); \
         replay with IDEM_SOAK_SEED={seed} IDEM_SOAK_SECS={}",
        faults_for.as_secs()
    );
    let schedule = Schedule::random(seed, faults_for);
    println!("soak: {} faults planned", schedule.steps.len());

    let dir = std::env::temp_dir().join(idem_testkit::harness::unique_name("idem-soak-"));
    std::fs::create_dir_all(&dir).expect("create the log directory");
    let started = Instant::now();
    let servers = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || Servers::start(&dir, started)
    })
    .await
    .expect("start the servers");

    let clients = Clients {
        http: support::client(),
        bases: servers.bases.clone(),
        answers: Arc::default(),
        paid: Arc::new((0..KEYS).map(|_| AtomicBool::new(false)).collect()),
        stop: Arc::default(),
        started,
    };

    // The fault phase: the schedule on a thread of its own (every fault is a blocking
    // command or sleep), the clients beside it until it is done.
    // The clients stop with the faults, or a minute after they should have ended.
    let until = Instant::now() + faults_for + Duration::from_secs(60);
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..CLIENTS {
        tasks.spawn(clients.clone().run(seed.wrapping_add(1 + n as u64), until));
    }
    let (servers, faults) = tokio::task::spawn_blocking(move || {
        let mut servers = servers;
        let mut faults = BTreeMap::new();
        servers.run(&schedule, &mut faults);
        (servers, faults)
    })
    .await
    .expect("the faults run to their end");
    clients.stop.store(true, Ordering::SeqCst);
    tasks.join_all().await;

    // Nothing fails any more: let every lease a fault left behind expire, then retry every
    // key's own body until it is answered.
    println!("[{:>6.1?}] faults over, settling", started.elapsed());
    tokio::time::sleep(SETTLE).await;
    let paid_before_final: Vec<usize> = servers.payments().await.into_keys().collect();
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..KEYS {
        let seed = seed.wrapping_mul(31).wrapping_add(n as u64);
        tasks.spawn(clients.clone().settle(Key(n), seed));
    }
    tasks.join_all().await;
    println!("[{:>6.1?}] final phase over", started.elapsed());

    let answers = clients
        .answers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let payments = servers.payments().await;
    let violations = check(
        &answers,
        &payments,
        &paid_before_final,
        &servers.log_lines("panicked"),
    );

    let mut report = format!("soak, seed {seed}, {faults_for:?} of faults:\n");
    for (kind, n) in &faults {
        report.push_str(&format!("  {kind}: {n}\n"));
    }
    report.push_str(&summary(&answers));
    report.push_str(&format!(
        "  payments: {}; log lines \"Redis unavailable\": {}\n",
        payments.values().map(Vec::len).sum::<usize>(),
        servers.log_lines("Redis unavailable").len()
    ));
    println!("{report}");
    let _ = std::io::stdout().flush();
    if !violations.0.is_empty() {
        // Keep the logs and every answer for a look; the servers' own directories go.
        let lines: Vec<String> = answers.iter().map(Answer::to_string).collect();
        let _ = std::fs::write(dir.join("answers.txt"), lines.join("\n"));
        panic!(
            "the soak broke these rules (seed {seed}; logs in {}):\n{violations}",
            servers.dir.display()
        );
    }
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The checker on made-up runs: a clean run breaks no rule, and each broken rule is named.
#[test]
fn the_checker_names_each_broken_rule() {
    let answer = |key: usize, body, phase, status: u16, payment: Option<&str>| Answer {
        at: Duration::ZERO,
        key: Key(key),
        body,
        phase,
        status: Some(status),
        payment: payment.map(str::to_owned),
    };
    let payments: HashMap<usize, Vec<String>> =
        (0..KEYS).map(|n| (n, vec![format!("pay_{n}")])).collect();
    let clean: Vec<Answer> = (0..KEYS)
        .map(|n| answer(n, Body::Own, Phase::Final, 201, Some(&format!("pay_{n}"))))
        .collect();
    let rules = |extra: Answer, payments: &HashMap<usize, Vec<String>>, panics: &[String]| {
        let mut answers = clean.clone();
        answers.push(extra);
        let found = check(&answers, payments, &[1], panics);
        found.0.into_keys().collect::<Vec<_>>()
    };
    let fine = answer(1, Body::Own, Phase::Faults, 409, None);
    assert_eq!(rules(fine.clone(), &payments, &[]), Vec::<&str>::new());
    let mut twice = payments.clone();
    twice.insert(3, vec!["pay_3".into(), "pay_x".into()]);
    assert_eq!(
        rules(fine.clone(), &twice, &[]),
        ["not exactly one payment per key"]
    );
    let panicked = ["serve-0: thread 'main' panicked".to_owned()];
    assert_eq!(
        rules(fine.clone(), &payments, &panicked),
        ["a process panicked"]
    );
    let (own, other, faults) = (Body::Own, Body::Other, Phase::Faults);
    for (extra, rule) in [
        (
            answer(1, own, faults, 201, Some("pay_x")),
            "a 2xx to a key's own body names another payment than the database",
        ),
        (answer(1, own, faults, 422, None), "422 to a key's own body"),
        (
            answer(1, own, Phase::Final, 409, None),
            "409 to a paid key after the settle period",
        ),
        (
            answer(1, other, faults, 201, Some("pay_y")),
            "2xx to another body",
        ),
        (answer(1, other, faults, 500, None), "a 5xx other than 503"),
        (answer(1, own, faults, 400, None), "an unexpected status"),
    ] {
        assert_eq!(rules(extra, &payments, &[]), [rule]);
    }
    let found = check(&clean[1..], &payments, &[], &[]);
    assert_eq!(
        found.0.into_keys().collect::<Vec<_>>(),
        ["a key's own body never answered 2xx in the final phase"]
    );
}
