//! Redis-only behaviour, on one server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::telemetry::Instrumented;
use idem_core::{
    Begin, Completion, Error, FencingToken, Fingerprint, Key, Lease, RecordId, RecordState,
    Response, Scope, Store,
};
use idem_redis::{EvictionCheck, EvictionPolicyError, OversizeBody, RedisStore, ReplicationError};
use idem_testkit::redis::{throwaway, RedisServer};
use tokio::time::Instant;

use idem_tests::{request, KEEP, LONG};

use super::super::{builder, started};

pub(crate) fn new_id(key: &str) -> RecordId {
    RecordId::new(
        Scope::new(format!("t-{}", uuid::Uuid::new_v4().simple())).unwrap(),
        Key::new(key).unwrap(),
    )
}

/// A new `begin` of `id`, with a token of its own, and its error if it failed.
pub(crate) async fn try_begin(store: &dyn Store, id: &RecordId) -> Result<Begin, Error> {
    store
        .begin(request(id, Fingerprint::of_bytes(b"f"), LONG))
        .await
}

async fn begin(store: &dyn Store, id: &RecordId) -> Begin {
    try_begin(store, id).await.expect("begin")
}

pub(crate) async fn acquire(store: &dyn Store, id: &RecordId) -> Lease {
    match begin(store, id).await {
        Begin::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn succeeded(status: u16, body: impl Into<Bytes>) -> Completion {
    Completion::succeeded(Response::new(status, body))
}

async fn replay(store: &dyn Store, id: &RecordId) -> idem_core::Replay {
    match begin(store, id).await {
        Begin::Replay(replay) => replay,
        other => panic!("expected Replay, got {other:?}"),
    }
}

/// The command `name` with `args` (a tuple of them, say) on a raw connection, and its answer.
async fn cmd<T: redis::FromRedisValue>(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
    args: impl redis::ToRedisArgs,
) -> T {
    let answer = redis::cmd(name).arg(args).query_async(conn).await;
    answer.unwrap_or_else(|e| panic!("{name}: {e}"))
}

async fn memory_usage(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    cmd(conn, "MEMORY", ("USAGE", key)).await
}

/// A store with a prefix of its own on the shared server (`IDEM_TEST_REDIS_URL`), and a
/// raw connection to it; `None` when it is not set.
async fn on_the_shared_server() -> Option<(RedisStore, redis::aio::MultiplexedConnection)> {
    let url = idem_testkit::harness::redis_url()?;
    let store = builder(&url).connect().await.unwrap();
    Some((store, raw(&url).await))
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

pub(crate) fn unavailable_source<T: std::fmt::Debug, S: std::error::Error + Clone + 'static>(
    result: Result<T, Error>,
) -> S {
    match result {
        Err(Error::Unavailable { source, .. }) => source
            .downcast_ref::<S>()
            .cloned()
            .unwrap_or_else(|| panic!("unexpected source: {source}")),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

mod records {
    //! What a record holds and costs in Redis: its memory, its expiry and attempt, corrupt
    //! values, and the body limit's policies.

    use super::*;

    /// The memory a completed record costs, by `MEMORY USAGE`, against the same body stored
    /// alone under a key of the same length. Prints the figures the crate docs report.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completed_record_memory() {
        let Some(url) = idem_testkit::harness::redis_url() else {
            return;
        };
        let store = RedisStore::builder(&url)
            .with_prefix("idem:")
            .connect()
            .await
            .unwrap();
        let mut conn = raw(&url).await;
        println!("body bytes | record (MEMORY USAGE) | beyond body | same body in a plain string");
        for len in [0usize, 16, 100, 200, 1000] {
            // A typical key: the global scope and a 16-character idempotency key.
            let key = format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0);
            let id = RecordId::new(Scope::global(), Key::new(key).unwrap());
            let lease = acquire(&store, &id).await;
            if len == 0 {
                let in_progress = memory_usage(&mut conn, &store.record_key(&id)).await;
                println!("in progress: {in_progress} bytes");
                assert!(
                    in_progress <= 160,
                    "an in-progress record costs {in_progress} bytes"
                );
            }
            let body = Bytes::from(vec![b'x'; len]);
            store
                .complete(&lease, &succeeded(200, body.clone()), KEEP)
                .await
                .unwrap();
            let key = store.record_key(&id);
            let usage = memory_usage(&mut conn, &key).await;
            // A plain string under a key of the same length.
            let bare_key = format!("bare:{}", &key["idem:".len()..]);
            cmd::<()>(&mut conn, "SET", (&bare_key, body.as_ref())).await;
            let bare = memory_usage(&mut conn, &bare_key).await;
            cmd::<()>(&mut conn, "DEL", (&key, &bare_key)).await;
            let beyond = usage - len as i64;
            println!(
                "{len:>10} | {usage:>21} | {beyond:>11} | {bare:>6} (key of {} bytes)",
                key.len()
            );
            // The record adds its 38-byte head and 3 bytes of metadata to the plain string.
            // jemalloc's size classes round allocations up (by up to a quarter past 1 KiB), so
            // the difference is only bounded tightly for small bodies.
            if len <= 200 {
                assert!(
                    usage - bare <= 64,
                    "a {len}-byte body costs {usage} bytes as a record, {bare} alone"
                );
                assert!(
                    beyond <= 160,
                    "a record costs {beyond} bytes beyond its {len}-byte body"
                );
            }
        }
    }

    fn corrupt<T>(r: &Result<T, Error>) -> bool {
        matches!(r, Err(Error::Corrupt { .. }))
    }

    /// A value that is not a record is reported as corrupt by every call, and left as it is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn corrupt_records_are_reported_and_left_alone() {
        let Some((store, mut conn)) = on_the_shared_server().await else {
            return;
        };
        let id = new_id("k");
        let lease = acquire(&store, &id).await;
        let key = store.record_key(&id);
        for garbage in [&b"not a record"[..], b"p-too-short", &[b'c'; 40][..]] {
            cmd::<()>(&mut conn, "SET", (&key, garbage)).await;
            let begin = try_begin(&store, &id).await;
            let get = store.get(&id).await;
            assert!(corrupt(&get), "get: {get:?}");
            // A completed-looking record with the right fingerprint but bad metadata is only
            // found out when decoded; one with the wrong fingerprint is just a mismatch.
            assert!(
                corrupt(&begin) || matches!(begin, Ok(Begin::Mismatch)),
                "begin: {begin:?}"
            );
            if garbage[0] != b'c' {
                let done = succeeded(200, "x");
                assert!(corrupt(
                    &store.complete(&lease, &done, KEEP).await.map(|_| ())
                ));
                assert!(corrupt(&store.extend(&lease, LONG).await.map(|_| ())));
                assert!(corrupt(&store.release(&lease).await));
            }
            let kept: Vec<u8> = cmd(&mut conn, "GET", &key).await;
            assert_eq!(kept, garbage, "the corrupt value was changed");
        }
        assert!(store.evict(&id).await.unwrap());
    }

    /// Bodies over the limit are compressed, cut to status and headers, or refused, as
    /// configured.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn body_limit_policies() {
        let Some(url) = idem_testkit::harness::redis_url() else {
            return;
        };
        let body = Bytes::from("{\"line\": \"the same text again\"}\n".repeat(4000));
        let response =
            Response::new(200, body.clone()).with_header("content-type", "application/json");
        let mut conn = raw(&url).await;
        for policy in [
            OversizeBody::Compress,
            OversizeBody::StatusAndHeaders,
            OversizeBody::Refuse,
        ] {
            let store = builder(&url)
                .with_body_limit(4096, policy)
                .connect()
                .await
                .unwrap();
            let id = new_id("k");
            let lease = acquire(&store, &id).await;
            let result = store
                .complete(&lease, &Completion::succeeded(response.clone()), KEEP)
                .await;
            if policy == OversizeBody::Refuse {
                assert!(matches!(result, Err(Error::Invalid(_))), "{result:?}");
                // Refused before anything was sent: the lease still holds the record.
                store.release(&lease).await.expect("release");
                continue;
            }
            result.expect("complete");
            let replay = replay(&store, &id).await;
            assert_eq!(replay.completion.response.headers, response.headers);
            let usage = memory_usage(&mut conn, &store.record_key(&id)).await;
            assert!(usage < 4096, "{policy:?}: {usage} bytes stored");
            match policy {
                OversizeBody::Compress => assert_eq!(replay.completion.response.body, body),
                _ => assert!(replay.completion.response.body.is_empty()),
            }
        }
    }

    /// An in-progress record as `begin` writes it: tag, token, margin, fingerprint, attempt.
    fn in_progress(token: &FencingToken, fingerprint: &Fingerprint, attempt: u32) -> Vec<u8> {
        let mut record = b"P".to_vec();
        record.extend_from_slice(token.as_bytes());
        record.extend_from_slice(&KEEP.as_millis().to_be_bytes()[10..]);
        record.extend_from_slice(fingerprint.as_bytes());
        record.extend_from_slice(&attempt.to_be_bytes());
        record
    }

    /// A completed record carries its expiry (Unix seconds, rounded down), and a replay reads
    /// it from there. An attempt of 255 or more, carried over from the in-progress record (by a
    /// lease without its fingerprint, or an apply), is kept whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completed_records_carry_their_expiry_and_attempt() {
        let Some((store, mut conn)) = on_the_shared_server().await else {
            return;
        };
        let unix_now = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
        };

        // Written by `complete`: the tag, the fingerprint, then the expiry.
        let id = new_id("expiry");
        let lease = acquire(&store, &id).await;
        let before = unix_now();
        store
            .complete(&lease, &succeeded(201, "done"), KEEP)
            .await
            .unwrap();
        let after = unix_now();
        let stored: Vec<u8> = cmd(&mut conn, "GET", store.record_key(&id)).await;
        assert_eq!(stored[0], b'C');
        let at = u64::from(u32::from_be_bytes(stored[33..37].try_into().unwrap()));
        assert!(
            ((before + KEEP).as_secs()..=(after + KEEP).as_secs()).contains(&at),
            "{at}"
        );
        let expires_in = replay(&store, &id).await.expires_in;
        assert!(
            expires_in <= KEEP && expires_in >= KEEP - Duration::from_secs(3),
            "{expires_in:?}"
        );

        // Attempt 300, carried over by complete and by apply.
        let fingerprint = Fingerprint::of_bytes(b"f");
        for through_apply in [false, true] {
            let id = new_id(if through_apply { "apply" } else { "complete" });
            let token = FencingToken::random();
            let record = in_progress(&token, &fingerprint, 300);
            cmd::<()>(
                &mut conn,
                "SET",
                (store.record_key(&id), record, "PX", 60_000),
            )
            .await;
            let done = succeeded(200, "late");
            if through_apply {
                let applied = store
                    .tier()
                    .apply_completion(&id, None, token, &done, KEEP)
                    .await
                    .unwrap();
                assert_eq!(applied, idem_redis::tier::Applied::Written);
            } else {
                let bare = Lease::new(id.clone(), token, 300, LONG, Instant::now());
                store.complete(&bare, &done, KEEP).await.unwrap();
            }
            let record = store.get(&id).await.unwrap().expect("the record");
            assert_eq!((record.fingerprint, record.attempt), (fingerprint, 300));
            assert_eq!(replay(&store, &id).await.completion, done);
        }
    }
}

pub(crate) mod outages {
    //! A server that restarts, forgets its scripts, or takes connections and never answers.

    use super::*;

    /// `SCRIPT FLUSH` while calls are running: every call still succeeds (the scripts are
    /// reloaded on `NOSCRIPT`), and every key's work runs once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn script_flush_under_load() {
        let Some(server) = throwaway(&[]) else { return };
        let store: Arc<dyn Store> = Arc::new(builder(&server.url()).connect().await.unwrap());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let runs = Arc::new(AtomicUsize::new(0));
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..8 {
            let (store, stop, runs) = (store.clone(), stop.clone(), runs.clone());
            workers.spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let id = new_id(&format!("w{w}-{n}"));
                    let lease = acquire(&*store, &id).await;
                    runs.fetch_add(1, Ordering::Relaxed);
                    let done = succeeded(200, "ok");
                    store.complete(&lease, &done, KEEP).await.expect("complete");
                    assert_eq!(replay(&*store, &id).await.completion, done);
                    let lease = store.extend(&lease, LONG).await;
                    assert!(matches!(lease, Err(Error::LeaseLost)), "{lease:?}");
                    n += 1;
                }
                n
            });
        }
        let mut conn = raw(&server.url()).await;
        for _ in 0..25 {
            tokio::time::sleep(Duration::from_millis(40)).await;
            cmd::<()>(&mut conn, "SCRIPT", "FLUSH").await;
        }
        stop.store(true, Ordering::Relaxed);
        let total: usize = workers.join_all().await.into_iter().sum();
        assert!(total > 100, "only {total} rounds ran");
        assert_eq!(runs.load(Ordering::Relaxed), total);
    }

    /// A restart of the server: calls fail with `Unavailable` while it is down, and succeed
    /// again once it is back, on the same store (no rebuild), the very first call included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_restart() {
        let Some(server) = throwaway(&[]) else {
            return;
        };
        restart(server).await;
    }

    /// [`server_restart`] on `server` (a Redis or a Valkey).
    pub(crate) async fn restart(mut server: RedisServer) {
        let store: Arc<dyn Store> = Arc::new(builder(&server.url()).connect().await.unwrap());
        let before = new_id("before");
        acquire(&*store, &before).await;

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Set once the server is back: calls started after it must all succeed.
        let back_at: Arc<std::sync::OnceLock<Instant>> = Arc::new(std::sync::OnceLock::new());
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..4 {
            let (store, stop, back_at) = (store.clone(), stop.clone(), back_at.clone());
            workers.spawn(async move {
                let (mut ok, mut n) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let id = new_id(&format!("w{w}-{n}"));
                    n += 1;
                    let result = async {
                        let lease = match try_begin(&*store, &id).await? {
                            Begin::Acquired(lease) => lease,
                            other => panic!("expected Acquired, got {other:?}"),
                        };
                        store.complete(&lease, &succeeded(200, "x"), KEEP).await
                    }
                    .await;
                    match result {
                        Ok(()) => ok += 1,
                        Err(e) => {
                            assert!(e.is_retryable(), "not Unavailable: {e}");
                            if back_at.get().is_some_and(|back| started > *back) {
                                panic!("a call failed after the server was back: {e}");
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
                ok
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut server_back = started(move || {
            server.stop();
            server
        })
        .await;
        // While it is down, calls answer Unavailable once the reconnection's few retries fail.
        let down = Instant::now();
        let answer = try_begin(&*store, &new_id("down")).await;
        assert!(
            matches!(answer, Err(Error::Unavailable { .. })),
            "{answer:?}"
        );
        assert!(down.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(300)).await;

        let server = started(move || {
            server_back.start_again().expect("restart");
            server_back
        })
        .await;
        back_at.set(Instant::now()).unwrap();
        // The very first call after the restart succeeds.
        acquire(&*store, &new_id("first-after")).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let ok: i32 = workers.join_all().await.into_iter().sum();
        assert!(ok > 10, "only {ok} calls succeeded");
        // The restart lost the data (no persistence): the key is fresh again.
        acquire(&*store, &before).await;
        drop(server);
    }

    /// A store call against a server that takes connections and never answers ends with
    /// `Unavailable` at the time limit it is called with (core's store timeout), however many
    /// reconnections redis-rs would still try and whatever its own timeouts: the store's
    /// futures give up their connection attempts when dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_to_a_silent_server_ends_at_the_store_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        // Takes every connection and keeps it open, reading nothing, for the test's life.
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().flatten() {
                held.push(stream);
            }
        });
        let limit = Duration::from_millis(1500);
        // Without the limit, each would go on through its 13 connection attempts: about 4 s
        // with the first timeouts, close to a minute with the second.
        for (connect, response) in [
            (Duration::from_millis(300), Duration::from_secs(1)),
            (Duration::from_secs(4), Duration::from_secs(4)),
        ] {
            let config = idem_redis::RedisConfig::default()
                .with_prefix(format!("idem-test-{}:", uuid::Uuid::new_v4().simple()))
                .with_connect_timeout(connect)
                .with_response_timeout(response)
                .with_reconnect_retries(12);
            let store = RedisStore::builder(format!("redis://127.0.0.1:{port}"))
                .with_config(config)
                .connect_lazy()
                .expect("a lazy store builds");
            let store = Instrumented::new(Arc::new(store)).with_timeout(limit);
            let started = Instant::now();
            let answer = try_begin(&store, &new_id("silent")).await;
            let took = started.elapsed();
            assert!(
                matches!(answer, Err(Error::Unavailable { .. })),
                "timeouts {connect:?} / {response:?}: expected Unavailable, got {answer:?}"
            );
            assert!(
                took >= limit && took < limit + Duration::from_millis(900),
                "timeouts {connect:?} / {response:?}: the call took {took:?}, its limit is {limit:?}"
            );
        }
    }
}

mod server_settings {
    //! The server's settings the store depends on: replicas to wait for, the eviction policy,
    //! a memory limit.

    use super::*;

    /// `WAIT` against a real replica: with one replica up, acquisitions and completions are
    /// acknowledged and reach it; asking for more replicas than there are fails clearly, and
    /// an acquisition that was not acknowledged is given back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wait_for_a_real_replica() {
        let Some(primary) = throwaway(&[]) else {
            return;
        };
        let replica =
            tokio::task::block_in_place(|| RedisServer::replica_of(&primary)).expect("replica");
        // Stores sharing a prefix on the primary, waiting for `replicas` acknowledgements.
        let prefix = super::super::prefix();
        let waiting_for = |replicas: u32, timeout: Duration| {
            RedisStore::builder(primary.url())
                .with_prefix(&prefix)
                .with_durability(replicas, timeout)
                .connect()
        };
        let durable = waiting_for(1, Duration::from_millis(500)).await.unwrap();
        let id = new_id("k");
        let lease = acquire(&durable, &id).await;
        durable
            .complete(&lease, &succeeded(201, "done"), KEEP)
            .await
            .expect("one replica acknowledges");
        // WAIT returned, so the replica has the completed record.
        let mut on_replica = raw(&replica.url()).await;
        let stored: Option<Vec<u8>> = cmd(&mut on_replica, "GET", durable.record_key(&id)).await;
        assert_eq!(stored.as_deref().map(|r| r[0]), Some(b'C'));

        // Two replicas required, one exists: begin fails and gives its lease back.
        let greedy = waiting_for(2, Duration::from_millis(100)).await.unwrap();
        let other = new_id("other");
        let error: ReplicationError = unavailable_source(try_begin(&greedy, &other).await);
        assert_eq!((error.acked, error.wanted, error.step), (1, 2, "begin"));
        assert!(
            greedy.get(&other).await.unwrap().is_none(),
            "the lease was not given back"
        );

        // A completion that too few replicas acknowledged stays on the primary, and says so.
        let lease = acquire(&durable, &other).await;
        let error: ReplicationError =
            unavailable_source(greedy.complete(&lease, &succeeded(200, "x"), KEEP).await);
        assert_eq!(
            (error.acked, error.wanted, error.step, error.kept),
            (1, 2, "complete", true)
        );
        assert!(matches!(
            durable.get(&other).await.unwrap().map(|r| r.state),
            Some(RecordState::Completed(_))
        ));

        // With the replica gone, even one is too many.
        drop(on_replica);
        started(move || drop(replica)).await;
        let error: ReplicationError =
            unavailable_source(try_begin(&durable, &new_id("alone")).await);
        assert_eq!((error.acked, error.wanted), (0, 1));
    }

    /// An evicting `maxmemory-policy` is refused when asked, and only warned about otherwise.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn evicting_policy_is_refused_or_warned() {
        let Some(server) = throwaway(&["--maxmemory-policy", "allkeys-lru"]) else {
            return;
        };
        let refused = builder(&server.url())
            .with_eviction_check(EvictionCheck::Refuse)
            .connect()
            .await;
        match refused {
            Err(Error::Backend { source, .. }) => {
                let policy = source
                    .downcast_ref::<EvictionPolicyError>()
                    .expect("policy error");
                assert_eq!(policy.policy, "allkeys-lru");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        // A lazily connected store refuses on its first call instead.
        let lazy = builder(&server.url())
            .with_eviction_check(EvictionCheck::Refuse)
            .connect_lazy()
            .unwrap();
        let answer = try_begin(&lazy, &new_id("k")).await;
        assert!(matches!(answer, Err(Error::Backend { .. })), "{answer:?}");
        // The default warns and works.
        let warned = builder(&server.url()).connect().await.expect("warn only");
        acquire(&warned, &new_id("k")).await;
        // `noeviction` passes the strict check.
        let mut conn = raw(&server.url()).await;
        cmd::<()>(
            &mut conn,
            "CONFIG",
            ("SET", "maxmemory-policy", "noeviction"),
        )
        .await;
        let strict = builder(&server.url())
            .with_eviction_check(EvictionCheck::Refuse)
            .connect()
            .await
            .expect("noeviction is accepted");
        acquire(&strict, &new_id("k")).await;
    }

    /// A server out of memory refuses `begin` and `complete` before they write, which the store
    /// reports as `Unavailable`; releases, heartbeats and reads still work.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn out_of_memory_is_unavailable() {
        let Some(server) = throwaway(&["--maxmemory-policy", "noeviction"]) else {
            return;
        };
        let store = builder(&server.url()).connect().await.unwrap();
        let held = new_id("held");
        let lease = acquire(&store, &held).await;
        let mut conn = raw(&server.url()).await;
        // A limit below what is used: the server is out of memory for every write from now.
        cmd::<()>(&mut conn, "CONFIG", ("SET", "maxmemory", 1)).await;
        let answer = try_begin(&store, &new_id("new")).await;
        match &answer {
            Err(e @ Error::Unavailable { .. }) => assert!(e.to_string().contains("OOM"), "{e}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
        let done = succeeded(200, "x");
        assert!(matches!(
            store.complete(&lease, &done, KEEP).await,
            Err(Error::Unavailable { .. })
        ));
        // Nothing was half-written: the record is still in progress under its lease.
        let record = store.get(&held).await.unwrap().expect("record");
        assert!(
            matches!(record.state, RecordState::InProgress { token, .. } if token == lease.token())
        );
        let lease = store
            .extend(&lease, LONG)
            .await
            .expect("heartbeat under OOM");
        store.release(&lease).await.expect("release under OOM");
        assert!(store.get(&held).await.unwrap().is_none());
    }
}

pub(crate) mod fencing {
    //! Fenced writes under races: leases without a version, takeovers, two instances on both
    //! paths, and the tiered store's `apply_completion`.

    use super::*;

    /// A lease without its version, and the records of a takeover, through the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leases_without_a_version_and_takeovers() {
        let Some((store, _conn)) = on_the_shared_server().await else {
            return;
        };
        versionless_leases_on(&store).await;
    }

    /// [`leases_without_a_version_and_takeovers`] on `store`.
    pub(crate) async fn versionless_leases_on(store: &RedisStore) {
        // A lease made without its version (a claim whose begin answer was lost): the record is
        // read and written only because the lease's token holds it, and keeps the fingerprint
        // its begin wrote.
        let id = new_id("kl");
        let lease = acquire(store, &id).await;
        let bare = Lease::new(
            id.clone(),
            lease.token(),
            lease.attempt(),
            lease.remaining(),
            tokio::time::Instant::now(),
        );
        assert!(bare.version().is_none());
        let record = completed_record(store, &bare, "bare").await;
        assert_eq!(record.fingerprint, Fingerprint::of_bytes(b"f"));
        assert_eq!(replay(store, &id).await.completion.response.body, "bare");

        // Through the store, leases that carry their version (the record goes whole): it
        // holds the begin's fingerprint and the lease's attempt, 2 after a takeover.
        let id = new_id("kt");
        let short = request(&id, Fingerprint::of_bytes(b"f"), Duration::from_millis(30));
        let first = match store.begin(short).await.expect("begin") {
            Begin::Acquired(lease) => lease,
            other => panic!("expected Acquired, got {other:?}"),
        };
        tokio::time::sleep(Duration::from_millis(80)).await;
        let second = match begin(store, &id).await {
            Begin::TookOver(lease) => lease,
            other => panic!("expected TookOver, got {other:?}"),
        };
        assert_eq!((first.attempt(), second.attempt()), (1, 2));
        let record = completed_record(store, &second, "second").await;
        assert_eq!(record.fingerprint, Fingerprint::of_bytes(b"f"));
        assert_eq!(record.attempt, 2);
        assert!(matches!(
            store.complete(&first, &succeeded(201, "first"), KEEP).await,
            Err(Error::LeaseLost)
        ));
    }

    /// The record of `lease`'s key once `lease` completed it with a 201 and `body`.
    async fn completed_record(store: &RedisStore, lease: &Lease, body: &str) -> idem_core::Record {
        store
            .complete(lease, &succeeded(201, body.to_owned()), KEEP)
            .await
            .expect("complete");
        store.get(lease.id()).await.unwrap().expect("the record")
    }

    /// Thousands of keys, dozens of concurrent callers per key: the protected side effect runs
    /// exactly once per key, and every caller ends with the one stored result.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn race_exactly_once_per_key() {
        let Some((store, _)) = on_the_shared_server().await else {
            return;
        };
        race(Arc::new(store), 2000, 24).await;
    }

    /// Both the store's paths on one server against each other (a rolling upgrade onto a
    /// server with the compare-and-set commands): two instances, one forced to scripts, race
    /// over the same keys and the work still runs once per key.
    pub(crate) async fn two_instances(url: &str) {
        let prefix = format!("idem-test-{}:", uuid::Uuid::new_v4().simple());
        let commands = builder(url).with_prefix(prefix.clone());
        let scripts = builder(url)
            .with_prefix(prefix)
            .with_scripting(idem_redis::Scripting::Scripts);
        let both: [Arc<dyn Store>; 2] = [
            Arc::new(commands.connect().await.unwrap()),
            Arc::new(scripts.connect().await.unwrap()),
        ];
        race_on(&both, 500, 8).await;
    }

    /// The race on any store: `keys` keys with `callers` concurrent callers each. Keys are
    /// raced `KEYS_AT_ONCE` at a time (all callers of a key at once), so the connection is
    /// not asked to queue every call of the test at the same moment.
    pub async fn race(store: Arc<dyn Store>, keys: usize, callers: usize) {
        race_on(&[store], keys, callers).await;
    }

    /// [`race`] with the callers of each key spread over `stores` (instances sharing keys).
    pub async fn race_on(stores: &[Arc<dyn Store>], keys: usize, callers: usize) {
        const KEYS_AT_ONCE: usize = 64;
        let scope = Scope::new(format!("race-{}", uuid::Uuid::new_v4().simple())).unwrap();
        let runs: Arc<Vec<AtomicUsize>> =
            Arc::new((0..keys).map(|_| AtomicUsize::new(0)).collect());
        let slots = Arc::new(tokio::sync::Semaphore::new(KEYS_AT_ONCE));
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..keys {
            let permit = slots.clone().acquire_owned().await.unwrap();
            let mut key_callers = tokio::task::JoinSet::new();
            for caller in 0..callers {
                let store = stores[caller % stores.len()].clone();
                let (runs, scope) = (runs.clone(), scope.clone());
                key_callers.spawn(async move {
                    let id = RecordId::new(scope, Key::new(format!("key-{k}")).unwrap());
                    let expected = format!("charged {k}");
                    let req = request(&id, Fingerprint::of_bytes(b"f"), LONG);
                    loop {
                        match store.begin(req.clone()).await.expect("begin") {
                            Begin::Acquired(lease) => {
                                // The protected side effect.
                                runs[k].fetch_add(1, Ordering::SeqCst);
                                let done = succeeded(201, expected.clone());
                                store.complete(&lease, &done, KEEP).await.expect("complete");
                                return;
                            }
                            Begin::InFlight { .. } => {
                                tokio::time::sleep(Duration::from_millis(1 + (caller % 4) as u64))
                                    .await
                            }
                            Begin::Replay(replay) => {
                                assert_eq!(replay.completion.response.body, expected);
                                return;
                            }
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                });
            }
            tasks.spawn(async move {
                while let Some(done) = key_callers.join_next().await {
                    done.expect("caller");
                }
                drop(permit);
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("caller");
        }
        for (k, n) in runs.iter().enumerate() {
            assert_eq!(n.load(Ordering::SeqCst), 1, "key-{k} ran {n:?} times");
        }
        println!(
            "{keys} keys x {callers} callers: {} calls settled in {:?}",
            keys * callers,
            started.elapsed()
        );
    }

    /// `apply_completion` (the tiered store's relay and repair): writes into an absent key or
    /// over the completing lease, and never over a completion or another lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn apply_completion_never_overwrites_a_newer_state() {
        use idem_redis::tier::Applied;
        let Some((store, _)) = on_the_shared_server().await else {
            return;
        };
        let fp = Fingerprint::of_bytes(b"f");
        let done = succeeded(201, Bytes::from_static(b"\0committed\xff"));
        let tier = store.tier();
        let apply = |id, identity, token| tier.apply_completion(id, identity, token, &done, KEEP);

        // Absent (Redis lost it): written, and replayed with its attempt and time to live.
        let id = new_id("absent");
        let token = FencingToken::random();
        let applied = apply(&id, None, token).await.unwrap();
        assert_eq!(applied, Applied::Absent, "an absent key needs the identity");
        let applied = apply(&id, Some((&fp, 3)), token).await.unwrap();
        assert_eq!(applied, Applied::Written);
        let replayed = replay(&store, &id).await;
        assert_eq!(replayed.completion, done);
        assert!(replayed.expires_in <= KEEP && replayed.expires_in > KEEP / 2);
        assert_eq!(store.get(&id).await.unwrap().unwrap().attempt, 3);
        // Twice is once.
        let again = apply(&id, Some((&fp, 3)), token).await.unwrap();
        assert_eq!(again, Applied::AlreadyCompleted);

        // In progress under the completing lease: written.
        let id = new_id("held");
        let lease = acquire(&store, &id).await;
        let applied = apply(&id, None, lease.token()).await.unwrap();
        assert_eq!(
            applied,
            Applied::Written,
            "the in-progress record supplies the identity"
        );
        assert_eq!(replay(&store, &id).await.completion, done);

        // In progress under another lease: left alone.
        let id = new_id("other");
        let lease = acquire(&store, &id).await;
        let applied = apply(&id, Some((&fp, 1)), FencingToken::random()).await;
        assert_eq!(applied.unwrap(), Applied::HeldByAnotherLease);
        match store.get(&id).await.unwrap().unwrap().state {
            RecordState::InProgress { token, .. } => assert_eq!(token, lease.token()),
            other => panic!("the live lease was overwritten: {other:?}"),
        }

        // Completed with something else: left alone.
        let id = new_id("completed");
        let lease = acquire(&store, &id).await;
        let first = succeeded(200, "first");
        store.complete(&lease, &first, KEEP).await.unwrap();
        let applied = apply(&id, Some((&fp, 1)), FencingToken::random()).await;
        assert_eq!(applied.unwrap(), Applied::AlreadyCompleted);
        assert_eq!(replay(&store, &id).await.completion, first);
    }
}

mod waiters {
    //! Waiters' subscriptions: one per record someone waits for, dropped with its last waiter.

    use super::*;

    /// A channel is subscribed while someone waits for its record, and unsubscribed once the
    /// last waiter has left: otherwise every later completion of that key would publish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_is_unsubscribed_when_its_last_waiter_leaves() {
        let Some((store, mut raw)) = on_the_shared_server().await else {
            return;
        };
        let id = new_id("watched");
        let channel = store.record_key(&id);
        let first = store.watch(&id).await.expect("a watch");
        let second = store.watch(&id).await.expect("a second watch");
        assert_eq!(
            subscribers(&mut raw, &channel).await,
            1,
            "one subscription for the record's waiters"
        );
        drop(first);
        // One waiter is still there: the channel stays subscribed.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            subscribers(&mut raw, &channel).await,
            1,
            "unsubscribed while a waiter was left"
        );
        drop(second);
        let started = Instant::now();
        while subscribers(&mut raw, &channel).await != 0 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "still subscribed after its last waiter left"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn subscribers(raw: &mut redis::aio::MultiplexedConnection, channel: &str) -> i64 {
        cmd::<(String, i64)>(raw, "PUBSUB", ("NUMSUB", channel))
            .await
            .1
    }
}
