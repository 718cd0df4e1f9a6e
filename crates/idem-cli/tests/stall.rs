//! A store that stalls while `idem proxy` holds a key, tried with real processes: two
//! proxies on one store in front of a Python upstream (`tests/upstream.py`) that counts its
//! side effects, the store paused (`SIGSTOP` of Redis, every node of a Redis Cluster; an
//! exclusive lock on PostgreSQL's `records` table, for PostgreSQL and the tiered store)
//! while the upstream works, and a client retrying the same key through the other proxy.
//!
//! - A stall shorter than the time left on the lease never costs the lease: the upstream
//!   runs once, and every 2xx any client gets carries that one charge.
//! - A stall longer than the lease may let a retry take the key over (the upstream may then
//!   run twice, overlapping), but no client ever gets a 2xx other than the key's stored
//!   answer: the stale holder's client gets 503 `lease-lost` and its retry the stored answer.
//!
//! Each store's case is in a module named after it (`redis`, `redis_cluster`, `postgres`,
//! `tiered`), so `scripts/test redis` runs its own.

mod support;

use std::time::{Duration, Instant};

use hyper::StatusCode;
use idem_testkit::redis::{RedisCluster, RedisServer};
use support::{client, idem, ms, send, signal, HttpClient, Proc, Reply};

/// The Python upstream on a free port; its base URL is `Proc::printed`.
fn upstream() -> Proc {
    support::upstream_py(0, "HTTP/1.1")
}

/// How many times `key` ran upstream.
async fn runs(client: &HttpClient, upstream: &Proc, key: &str) -> u64 {
    support::runs(client, &upstream.printed, key).await.0
}

/// What pauses a store and resumes it.
enum Pause {
    /// `SIGSTOP` to these `redis-server` processes; `SIGCONT` to resume.
    Processes(Vec<u32>),
    /// An exclusive lock on `<schema>.records` held in an open transaction of this
    /// database; rolled back to resume.
    Lock { url: String, schema: String },
}

/// A paused store, resumed by [`Paused::resume`] or, when a failing test never gets there,
/// on drop (a stopped server's drop would wait for it).
enum Paused {
    Processes(Vec<u32>),
    Lock(Option<sqlx::Transaction<'static, sqlx::Postgres>>),
}

impl Pause {
    async fn pause(&self) -> Paused {
        match self {
            Pause::Processes(pids) => {
                for pid in pids {
                    signal(*pid, "STOP");
                }
                Paused::Processes(pids.clone())
            }
            Pause::Lock { url, schema } => {
                let pool = sqlx::PgPool::connect(url).await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                let lock = format!("LOCK TABLE \"{schema}\".records IN ACCESS EXCLUSIVE MODE");
                sqlx::query(&lock).execute(&mut *tx).await.unwrap();
                Paused::Lock(Some(tx))
            }
        }
    }
}

impl Paused {
    async fn resume(mut self) {
        if let Paused::Lock(tx) = &mut self {
            tx.take().unwrap().rollback().await.unwrap();
        }
        self.resume_now();
    }

    fn resume_now(&mut self) {
        if let Paused::Processes(pids) = self {
            for pid in std::mem::take(pids) {
                signal(pid, "CONT");
            }
        }
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        // A lock's transaction rolls back when dropped.
        self.resume_now();
    }
}

/// The process id of a throwaway `redis-server`, as it reports it.
fn pid_of(server: &RedisServer) -> u32 {
    let info = server.cli(&["info", "server"]).expect("INFO server");
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .expect("process_id in INFO server");
    pid.trim().parse().unwrap()
}

/// A store two proxies share, what pauses it, and the timing of a case on it.
struct Stallable {
    /// `--store` and the naming flags.
    args: Vec<String>,
    pause: Pause,
    /// The proxies' `--lease`.
    lease: Duration,
    /// How long a renewal into the paused store takes to fail: the store's own limit on a
    /// call (Redis: its 2 s response time limit) or the engine's (5 s).
    call_limit: Duration,
    _servers: (Option<RedisServer>, Option<RedisCluster>),
}

impl Stallable {
    /// A throwaway Redis of this test's own (so that it can be paused).
    /// The store named `name` (`redis`, `redis_cluster`, `postgres`, `tiered`), its servers
    /// started off the runtime (they start blocking); `None` as each of them.
    async fn open(name: &'static str) -> Option<Self> {
        let open = match name {
            "redis" => Self::redis,
            "redis_cluster" => Self::redis_cluster,
            "postgres" => Self::postgres,
            "tiered" => Self::tiered,
            other => panic!("no stallable store named {other}"),
        };
        tokio::task::spawn_blocking(open).await.unwrap()
    }

    fn redis() -> Option<Self> {
        let server = idem_testkit::redis::throwaway(&[])?;
        Some(Self {
            args: vec!["--store".into(), server.url()],
            pause: Pause::Processes(vec![pid_of(&server)]),
            lease: Duration::from_secs(5),
            call_limit: Duration::from_secs(2),
            _servers: (Some(server), None),
        })
    }

    /// A throwaway 3-primary Redis Cluster, every node paused.
    fn redis_cluster() -> Option<Self> {
        if !idem_testkit::redis::available() {
            return None;
        }
        let cluster = RedisCluster::start(3).expect("start a 3-primary cluster");
        Some(Self {
            args: vec!["--store".into(), cluster.url()],
            pause: Pause::Processes(cluster.nodes().iter().map(pid_of).collect()),
            lease: Duration::from_secs(5),
            call_limit: Duration::from_secs(2),
            _servers: (None, Some(cluster)),
        })
    }

    /// PostgreSQL at `IDEM_TEST_DATABASE_URL`, in a schema of this test's own.
    fn postgres() -> Option<Self> {
        let url = idem_testkit::harness::database_url()?;
        let schema = idem_testkit::harness::unique_name("idem_stall_");
        Some(Self::locked(url.clone(), url, schema, vec![]))
    }

    /// The tiered store on a throwaway Redis and PostgreSQL, PostgreSQL (which holds the
    /// lease) paused.
    fn tiered() -> Option<Self> {
        let pg = idem_testkit::harness::database_url()?;
        let redis = idem_testkit::harness::redis_url()?;
        let name = idem_testkit::harness::unique_name("idem_stall_");
        let store = format!("tiered:{redis}|{pg}");
        let prefix = vec!["--prefix".to_owned(), name.clone()];
        Some(Self::locked(store, pg, name, prefix))
    }

    fn locked(store: String, pg: String, schema: String, extra: Vec<String>) -> Self {
        let mut args = vec!["--store".into(), store, "--schema".into(), schema.clone()];
        args.extend(extra);
        Self {
            args,
            pause: Pause::Lock { url: pg, schema },
            // The engine bounds a call at 5 s: a lease whose third is shorter than that, so
            // that a renewal failing at the limit leaves the next regular one past the
            // deadline.
            lease: Duration::from_secs(10),
            call_limit: Duration::from_secs(5),
            _servers: (None, None),
        }
    }

    /// Two proxies on this store and the upstream they share.
    fn proxies(&self, lease: Duration) -> (Proc, Proc, Proc) {
        let up = upstream();
        let lease = lease.as_secs().to_string();
        let start = || {
            let args = [
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                &up.printed,
            ];
            let mut command = idem(&args);
            command
                .args(&self.args)
                .args(["--migrate", "--lease", &lease]);
            Proc::listening(command)
        };
        let (a, b) = (start(), start());
        (up, a, b)
    }
}

/// `POST <proxy>/charge` as alice with `key`, the upstream taking `work`: its reply, or the
/// error of a reply that broke off (a response whose recording failed is cut, never ended
/// cleanly: that is no answer, and no 2xx).
async fn charge(
    client: &HttpClient,
    proxy: &str,
    key: &str,
    work: Duration,
) -> Result<Reply, String> {
    send(client, support::charge(proxy, key, work, "{}")).await
}

/// What a case saw: the first client's answer, every answer of the retrying client, the
/// key's stored answer (a replay after everything settled) and the upstream's runs.
struct Seen {
    first: Result<Reply, String>,
    retries: Vec<Reply>,
    stored: Reply,
    runs: u64,
    /// What proxy A (the first holder) logged.
    log: String,
}

impl Seen {
    /// Every 2xx any client got is the key's stored answer, byte for byte.
    fn every_2xx_is_the_stored_answer(&self) {
        assert!(self.stored.replayed(), "{:?}", self.stored);
        assert_eq!(self.stored.status, StatusCode::CREATED, "{:?}", self.stored);
        for reply in self.first.iter().chain(&self.retries) {
            if reply.status.is_success() {
                assert_eq!(
                    reply.body, self.stored.body,
                    "a 2xx the key does not replay"
                );
            } else {
                // Each refusal says why and when to come back.
                assert!(
                    matches!(
                        reply.status,
                        StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
                    ),
                    "{reply:?}"
                );
            }
        }
    }
}

/// The first client charges through proxy A (the upstream working `work`); the store is
/// paused from `from` to `to` after that; a second client retries the same key through
/// proxy B every 100 ms until A's answer is in, and once more after.
async fn run_case(store: &Stallable, from: Duration, to: Duration, work: Duration) -> Seen {
    let (up, a, b) = store.proxies(store.lease);
    let client = client();
    let key = format!("stall-{}", uuid::Uuid::new_v4().simple());
    let started = Instant::now();
    let first = {
        let (client, a, key) = (client.clone(), a.printed.clone(), key.clone());
        tokio::spawn(async move { charge(&client, &a, &key, work).await })
    };
    let retrying = {
        let (client, b, key) = (client.clone(), b.printed.clone(), key.clone());
        let first_done = first.abort_handle();
        tokio::spawn(async move {
            let mut replies = Vec::new();
            tokio::time::sleep(ms(200)).await;
            while !first_done.is_finished() {
                replies.push(charge(&client, &b, &key, work).await);
                tokio::time::sleep(ms(100)).await;
            }
            replies
        })
    };
    tokio::time::sleep(from.saturating_sub(started.elapsed())).await;
    let paused = store.pause.pause().await;
    tokio::time::sleep(to.saturating_sub(started.elapsed())).await;
    paused.resume().await;
    let first = first.await.unwrap();
    let mut retries: Vec<Reply> = retrying.await.unwrap().into_iter().flatten().collect();
    // Until the key settles (another attempt may still run), then its stored answer.
    let stored = loop {
        let reply = match charge(&client, &b.printed, &key, work).await {
            Ok(reply) => reply,
            // A reply cut off (another attempt's stream not recorded): ask again.
            Err(e) if started.elapsed() < Duration::from_secs(60) => {
                eprintln!("a retry broke off: {e}");
                tokio::time::sleep(ms(200)).await;
                continue;
            }
            Err(e) => panic!("no answer from the key within a minute: {e}"),
        };
        if reply.status != StatusCode::CONFLICT || started.elapsed() > Duration::from_secs(60) {
            break reply;
        }
        retries.push(reply);
        tokio::time::sleep(ms(200)).await;
    };
    let runs = runs(&client, &up, &key).await;
    let (mut a, _b) = (a, b);
    Seen {
        first,
        retries,
        stored,
        runs,
        log: a.stop(),
    }
}

/// The store paused from just before the first renewal (a third of the lease) until 0.6 s
/// before the lease's deadline: the first renewal fails at the store's time limit, and only
/// a retry before the deadline keeps the lease. The upstream works past the lease, and past
/// the next regular renewal (a third later), after which a retry would take the key over.
async fn a_stall_shorter_than_the_lease(store: Stallable) {
    let third = store.lease / 3;
    let (from, to) = (third - ms(600), store.lease - ms(600));
    assert!(to - from > store.call_limit, "the first renewal must fail");
    let work = third * 2 + store.call_limit + Duration::from_secs(2);
    let seen = run_case(&store, from, to, work).await;
    assert_eq!(
        seen.runs, 1,
        "the key ran twice; proxy A logged:\n{}",
        seen.log
    );
    let first = seen.first.as_ref().expect("the first client's answer");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    seen.every_2xx_is_the_stored_answer();
}

/// The store paused from 0.5 s for 1.5 leases while the upstream works 1.2 leases: the
/// lease runs out, and when the store answers again a retry may take the key over before
/// the first holder renews. Whichever wins, every 2xx is the stored answer.
async fn a_stall_longer_than_the_lease(store: Stallable) {
    let (from, to) = (ms(500), ms(500) + store.lease * 3 / 2);
    let work = store.lease * 6 / 5;
    let seen = run_case(&store, from, to, work).await;
    assert!((1..=2).contains(&seen.runs), "{} runs", seen.runs);
    if seen.runs == 2 {
        // Taken over: the first holder's 201 is not the key's answer. It gets 503, or (its
        // upstream's body still arriving when the head came) a response cut off.
        if let Ok(first) = &seen.first {
            assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
        }
    }
    seen.every_2xx_is_the_stored_answer();
}

async fn a_stall_shorter_than_the_lease_never_costs_it(store: &'static str) {
    if let Some(store) = Stallable::open(store).await {
        a_stall_shorter_than_the_lease(store).await;
    }
}

async fn a_stall_longer_than_the_lease_never_sends_a_stale_2xx(store: &'static str) {
    if let Some(store) = Stallable::open(store).await {
        a_stall_longer_than_the_lease(store).await;
    }
}

support::on_stores!(
    [redis, redis_cluster, postgres, tiered],
    [
        a_stall_shorter_than_the_lease_never_costs_it,
        a_stall_longer_than_the_lease_never_sends_a_stale_2xx,
    ]
);
