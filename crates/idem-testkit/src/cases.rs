//! The conformance cases: plain async functions over [`Store`], one per behaviour of the
//! contract. Each uses its own random scope, so cases run in parallel on one server.
//!
//! Timing: cases that need a lease to stay live use leases of seconds; cases that need it to
//! expire use leases of 100 ms or so and sleep a little past them. Nothing sleeps long.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Completion, CompletionKind, Error, FencingToken, Fingerprint, Key, Lease,
    RecordId, RecordState, Response, Scope, Store, StreamRead,
};
use tokio::time::{sleep, timeout, Instant};

/// A lease that outlives any case.
pub const LONG: Duration = Duration::from_secs(30);
/// A lease meant to expire during a case.
const SHORT: Duration = Duration::from_millis(150);
/// Sleeping this long lets a [`SHORT`] lease expire, with margin for a slow machine.
const PAST_SHORT: Duration = Duration::from_millis(300);
/// Retention for completed records in cases that do not test retention.
pub const KEEP: Duration = Duration::from_secs(600);

fn scope() -> Scope {
    Scope::new(format!("conformance-{}", uuid::Uuid::new_v4())).expect("short scope")
}

fn id(scope: &Scope, key: &str) -> RecordId {
    RecordId::new(scope.clone(), Key::new(key).expect("valid test key"))
}

fn fp(text: &str) -> Fingerprint {
    Fingerprint::of_bytes(text.as_bytes())
}

/// A begin of `id` by a new worker (a token of its own) for `lease`, kept [`KEEP`].
pub fn request(id: &RecordId, fingerprint: Fingerprint, lease: Duration) -> BeginRequest<'_> {
    BeginRequest {
        id,
        fingerprint,
        token: FencingToken::random(),
        lease,
        retention: KEEP,
    }
}

async fn begin(
    store: &dyn Store,
    id: &RecordId,
    fingerprint: Fingerprint,
    lease: Duration,
) -> Begin {
    store
        .begin(request(id, fingerprint, lease))
        .await
        .expect("begin")
}

fn acquired(answer: Begin) -> Lease {
    match answer {
        Begin::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn lease_lost<T: std::fmt::Debug>(result: Result<T, Error>, what: &str) {
    match result {
        Err(Error::LeaseLost) => {}
        other => panic!("{what}: expected LeaseLost, got {other:?}"),
    }
}

fn ok_response(body: &str) -> Completion {
    Completion::succeeded(Response::new(200, body.to_owned()))
}

/// Completes `lease` with a success carrying `body`, kept [`KEEP`].
async fn complete_ok(store: &dyn Store, lease: &Lease, body: &str) {
    store
        .complete(lease, &ok_response(body), KEEP)
        .await
        .expect("complete");
}

/// Completes `lease` on `id` with `body`, and asserts that a retry gets it replayed.
async fn assert_completes(store: &dyn Store, lease: &Lease, id: &RecordId, body: &str) {
    complete_ok(store, lease, body).await;
    assert_eq!(replayed_body(store, id).await, body);
}

/// The body that a retry of `id` (the request `fp("f")`) gets replayed.
async fn replayed_body(store: &dyn Store, id: &RecordId) -> Bytes {
    replayed(store, id, fp("f")).await.response.body
}

async fn replayed(store: &dyn Store, id: &RecordId, fingerprint: Fingerprint) -> Completion {
    match begin(store, id, fingerprint, LONG).await {
        Begin::Replay(replay) => replay.completion,
        other => panic!("expected Replay, got {other:?}"),
    }
}

/// Many tasks race `begin` on each of many keys; the protected work runs exactly once per
/// key, and every other caller sees in flight or the replay of the one result.
pub async fn one_winner(store: Arc<dyn Store>) {
    const KEYS: usize = 40;
    const CALLERS: usize = 16;
    let scope = scope();
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        for k in 0..KEYS {
            let (store, runs, scope) = (store.clone(), runs.clone(), scope.clone());
            tasks.push(tokio::spawn(async move {
                let id = id(&scope, &format!("key-{k}"));
                let body = format!("result-{k}");
                match begin(&*store, &id, fp("same"), LONG).await {
                    Begin::Acquired(lease) => {
                        runs[k].fetch_add(1, Ordering::SeqCst);
                        // Give the racers time to arrive while the lease is held.
                        sleep(Duration::from_millis(5 + (caller % 3) as u64)).await;
                        store
                            .complete(&lease, &ok_response(&body), KEEP)
                            .await
                            .expect("winner completes");
                        Some(body)
                    }
                    Begin::InFlight { retry_after } => {
                        assert!(retry_after <= LONG, "retry hint {retry_after:?} > lease");
                        None
                    }
                    Begin::Replay(replay) => {
                        assert_eq!(replay.completion.response.body, body.as_bytes());
                        None
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("task");
    }
    for (k, n) in runs.iter().enumerate() {
        assert_eq!(
            n.load(Ordering::SeqCst),
            1,
            "key-{k} ran the work {n:?} times"
        );
        let completion = replayed(&*store, &id(&scope, &format!("key-{k}")), fp("same")).await;
        assert_eq!(completion.response.body, format!("result-{k}").as_bytes());
    }
}

/// Deterministic bytes covering every byte value, without a random-number dependency.
fn binary_body(len: usize, seed: u64) -> Bytes {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// Completions come back byte for byte: binary bodies from empty to 1 MiB, status, header
/// order and values, and the kind (success or stored failure).
pub async fn replay_is_byte_exact(store: Arc<dyn Store>) {
    let scope = scope();
    let all_bytes: Bytes = (0..=255u8).collect::<Vec<u8>>().into();
    let bodies = [
        Bytes::new(),
        Bytes::from_static(b"\0"),
        all_bytes,
        binary_body(64 * 1024 + 3, 7),
        binary_body(1024 * 1024, 11),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let id = id(&scope, &format!("body-{i}"));
        let lease = acquired(begin(&*store, &id, fp("b"), LONG).await);
        let kind = if i % 2 == 0 {
            CompletionKind::Succeeded
        } else {
            CompletionKind::Failed
        };
        let completion = Completion {
            kind,
            response: Response {
                status: 200 + i as u16,
                headers: vec![
                    ("content-type".into(), b"application/octet-stream".to_vec()),
                    ("x-bin".into(), vec![0, 255, 10, 13]),
                    ("content-type".into(), b"second".to_vec()),
                ],
                body,
            },
        };
        store
            .complete(&lease, &completion, KEEP)
            .await
            .expect("complete");
        let back = replayed(&*store, &id, fp("b")).await;
        assert_eq!(back.kind, completion.kind, "kind of body-{i}");
        assert_eq!(back.response.status, completion.response.status);
        assert_eq!(back.response.headers, completion.response.headers);
        assert!(
            back.response.body == completion.response.body,
            "body-{i} of {} bytes came back different ({} bytes)",
            completion.response.body.len(),
            back.response.body.len()
        );
    }
}

/// The same key with another fingerprint is a mismatch, in progress and completed, and
/// changes nothing.
pub async fn mismatch(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let lease = acquired(begin(&*store, &id, fp("one"), LONG).await);
    assert!(matches!(
        begin(&*store, &id, fp("two"), LONG).await,
        Begin::Mismatch
    ));
    complete_ok(&*store, &lease, "r1").await;
    assert!(matches!(
        begin(&*store, &id, fp("two"), LONG).await,
        Begin::Mismatch
    ));
    assert_eq!(replayed(&*store, &id, fp("one")).await.response.body, "r1");
}

/// A live lease answers in flight with a hint no longer than the lease; once it expires, a
/// retry takes over with the attempt counted, and the first worker can change nothing.
pub async fn lease_expiry_and_takeover(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let first = acquired(begin(&*store, &id, fp("f"), SHORT).await);
    assert_eq!(first.attempt(), 1);
    match begin(&*store, &id, fp("f"), SHORT).await {
        // On a slow machine the short lease may already be gone; both are right then.
        Begin::InFlight { retry_after } => assert!(retry_after <= SHORT),
        Begin::TookOver(_) => return,
        other => panic!("expected InFlight, got {other:?}"),
    }
    sleep(PAST_SHORT).await;
    let second = match begin(&*store, &id, fp("f"), LONG).await {
        Begin::TookOver(lease) => lease,
        other => panic!("expected TookOver, got {other:?}"),
    };
    assert_eq!(second.attempt(), 2);
    assert_ne!(second.token(), first.token());
    lease_lost(
        store.complete(&first, &ok_response("stale"), KEEP).await,
        "stale complete",
    );
    lease_lost(store.extend(&first, LONG).await, "stale extend");
    lease_lost(store.release(&first).await, "stale release");
    assert!(matches!(
        begin(&*store, &id, fp("f"), LONG).await,
        Begin::InFlight { .. }
    ));
    complete_ok(&*store, &second, "fresh").await;
    lease_lost(
        store.complete(&first, &ok_response("stale"), KEEP).await,
        "late complete",
    );
    assert_eq!(replayed_body(&*store, &id).await, "fresh");
}

/// Tokens stay unique across incarnations: a worker whose lease was taken over, after which
/// the key was released and acquired again, still cannot complete, release or extend.
pub async fn stale_lease_after_release_and_reacquire(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let a = acquired(begin(&*store, &id, fp("f"), SHORT).await);
    sleep(PAST_SHORT).await;
    let b = match begin(&*store, &id, fp("f"), SHORT).await {
        Begin::TookOver(lease) => lease,
        other => panic!("expected TookOver, got {other:?}"),
    };
    store.release(&b).await.expect("release");
    let c = acquired(begin(&*store, &id, fp("f"), LONG).await);
    assert_eq!(c.attempt(), 1, "a released key starts over");
    for (name, stale) in [("taken-over", &a), ("released", &b)] {
        lease_lost(
            store.complete(stale, &ok_response("stale"), KEEP).await,
            name,
        );
        lease_lost(store.extend(stale, LONG).await, name);
        lease_lost(store.release(stale).await, name);
    }
    assert_completes(&*store, &c, &id, "c").await;
    // A released lease is finished for good too.
    lease_lost(store.release(&c).await, "release after complete");
}

/// The same attempt sending `begin` twice (a reply lost on the way back) gets its own lease
/// again, never "in flight" against itself.
pub async fn same_attempt_gets_its_lease_back(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let req = request(&id, fp("f"), LONG);
    let first = acquired(store.begin(req.clone()).await.expect("begin"));
    let again = acquired(store.begin(req).await.expect("begin"));
    assert_eq!(again.token(), first.token());
    assert_eq!(again.attempt(), 1);
    complete_ok(&*store, &again, "x").await;
}

/// `extend` keeps a lease alive past its original deadline; other callers keep seeing in
/// flight until it completes.
pub async fn extend_keeps_lease_alive(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let lease_len = Duration::from_millis(400);
    let mut lease = acquired(begin(&*store, &id, fp("f"), lease_len).await);
    let started = Instant::now();
    while started.elapsed() < lease_len * 3 {
        sleep(Duration::from_millis(100)).await;
        lease = store.extend(&lease, lease_len).await.expect("extend");
        assert!(
            matches!(
                begin(&*store, &id, fp("f"), LONG).await,
                Begin::InFlight { .. }
            ),
            "an extended lease was taken over"
        );
    }
    assert_completes(&*store, &lease, &id, "done").await;
}

/// A lease past its deadline that nobody took over still belongs to its holder.
pub async fn expired_lease_not_taken_over_can_complete(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let lease = acquired(begin(&*store, &id, fp("f"), SHORT).await);
    sleep(PAST_SHORT).await;
    assert_completes(&*store, &lease, &id, "late").await;
}

/// Releasing forgets the key: the next `begin` runs the work again as attempt 1.
pub async fn release_lets_a_retry_run(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let lease = acquired(begin(&*store, &id, fp("f"), LONG).await);
    store.release(&lease).await.expect("release");
    assert!(store.get(&id).await.expect("get").is_none());
    let again = acquired(begin(&*store, &id, fp("other request is fine now"), LONG).await);
    assert_ne!(again.token(), lease.token());
}

/// Completed records are forgotten after their retention; the replay says how long is left.
pub async fn completed_records_expire(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let retention = Duration::from_millis(400);
    let lease = acquired(begin(&*store, &id, fp("f"), LONG).await);
    store
        .complete(&lease, &ok_response("r"), retention)
        .await
        .expect("complete");
    match begin(&*store, &id, fp("f"), LONG).await {
        Begin::Replay(replay) => assert!(
            replay.expires_in <= retention,
            "expires_in {:?} > retention",
            replay.expires_in
        ),
        other => panic!("expected Replay, got {other:?}"),
    }
    sleep(retention + Duration::from_millis(300)).await;
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "record outlived its retention"
    );
    acquired(begin(&*store, &id, fp("f"), LONG).await);
}

/// In-progress records abandoned by their holder are forgotten too, `retention` after their
/// lease deadline.
pub async fn abandoned_records_expire(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let retention = Duration::from_millis(200);
    let req = BeginRequest {
        retention,
        ..request(&id, fp("f"), SHORT)
    };
    acquired(store.begin(req).await.expect("begin"));
    sleep(SHORT + retention + Duration::from_millis(300)).await;
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "abandoned record kept"
    );
}

/// The same key in two scopes is two records: neither sees the other's state or response.
pub async fn scopes_are_isolated(store: Arc<dyn Store>) {
    let base = scope();
    let tenant_a = Scope::new(format!("{base}-a")).expect("scope");
    let tenant_b = Scope::new(format!("{base}-b")).expect("scope");
    // Scopes and keys that would collide under naive concatenation.
    let tricky = [
        (Scope::new(format!("{base}:x")).expect("scope"), "y"),
        (Scope::new(format!("{base}")).expect("scope"), ":xy"),
        (Scope::new(format!("{base}:")).expect("scope"), "xy"),
    ];
    let a = acquired(begin(&*store, &id(&tenant_a, "same"), fp("f"), LONG).await);
    let b = acquired(begin(&*store, &id(&tenant_b, "same"), fp("f"), LONG).await);
    complete_ok(&*store, &a, "for a").await;
    assert!(matches!(
        begin(&*store, &id(&tenant_b, "same"), fp("f"), LONG).await,
        Begin::InFlight { .. }
    ));
    complete_ok(&*store, &b, "for b").await;
    for (tenant, body) in [(&tenant_a, "for a"), (&tenant_b, "for b")] {
        assert_eq!(replayed_body(&*store, &id(tenant, "same")).await, body);
    }
    for (i, (scope, key)) in tricky.iter().enumerate() {
        let lease = acquired(begin(&*store, &id(scope, key), fp("f"), LONG).await);
        complete_ok(&*store, &lease, &format!("tricky-{i}")).await;
    }
    for (i, (scope, key)) in tricky.iter().enumerate() {
        let back = replayed(&*store, &id(scope, key), fp("f")).await;
        assert_eq!(back.response.body, format!("tricky-{i}").as_bytes());
    }
}

/// `get` shows each state, and `evict` removes a record whatever its state.
pub async fn get_and_evict(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    assert!(store.get(&id).await.expect("get").is_none());
    let lease = acquired(begin(&*store, &id, fp("f"), LONG).await);
    let record = store.get(&id).await.expect("get").expect("record");
    assert_eq!(record.fingerprint, fp("f"));
    assert_eq!(record.attempt, 1);
    match record.state {
        RecordState::InProgress {
            token,
            lease_remaining,
        } => {
            assert_eq!(token, lease.token());
            assert!(lease_remaining <= LONG && lease_remaining > Duration::ZERO);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    complete_ok(&*store, &lease, "r").await;
    let record = store.get(&id).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Completed(ok_response("r")));
    assert!(record.expires_in <= KEEP);
    assert!(store.evict(&id).await.expect("evict"));
    assert!(!store.evict(&id).await.expect("evict"));
    assert!(store.get(&id).await.expect("get").is_none());
    acquired(begin(&*store, &id, fp("f"), LONG).await);
}

/// Concurrent completes, releases and extends of one lease leave one coherent outcome.
pub async fn racing_writers_on_one_lease(store: Arc<dyn Store>) {
    let scope = scope();
    for round in 0..20 {
        let id = id(&scope, &format!("k{round}"));
        let lease = acquired(begin(&*store, &id, fp("f"), LONG).await);
        let (s1, s2, l1, l2) = (store.clone(), store.clone(), lease.clone(), lease.clone());
        let complete = tokio::spawn(async move { s1.complete(&l1, &ok_response("c"), KEEP).await });
        let release = tokio::spawn(async move { s2.release(&l2).await });
        let completed = complete.await.expect("task").is_ok();
        let released = release.await.expect("task").is_ok();
        match (completed, released) {
            (true, false) => assert_eq!(replayed_body(&*store, &id).await, "c"),
            (false, true) => assert!(store.get(&id).await.expect("get").is_none()),
            other => panic!("complete/release both {other:?}: exactly one must win"),
        }
    }
}

/// A store pointed at nothing answers [`Error::Unavailable`] within a bounded time.
pub async fn unreachable_is_unavailable(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "k");
    let started = Instant::now();
    let answer = timeout(
        Duration::from_secs(20),
        store.begin(request(&id, fp("f"), LONG)),
    )
    .await
    .expect("an unreachable store must answer within its own time limit, not hang");
    match answer {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(15));
}

/// `stats` counts live records by state within a scope, and flags leases that expired
/// longer ago than the threshold as stuck.
pub async fn stats_count_by_state(store: Arc<dyn Store>) {
    let scope = scope();
    let s = &*store;
    for k in ["live-1", "live-2"] {
        acquired(begin(s, &id(&scope, k), fp("f"), LONG).await);
    }
    acquired(begin(s, &id(&scope, "abandoned"), fp("f"), SHORT).await);
    let ok = acquired(begin(s, &id(&scope, "ok"), fp("f"), LONG).await);
    s.complete(&ok, &ok_response("ok"), KEEP)
        .await
        .expect("complete");
    let bad = acquired(begin(s, &id(&scope, "bad"), fp("f"), LONG).await);
    let failure = Completion::failed(Response::new(402, "declined"));
    s.complete(&bad, &failure, KEEP).await.expect("complete");
    let released = acquired(begin(s, &id(&scope, "released"), fp("f"), LONG).await);
    s.release(&released).await.expect("release");
    // Another scope's records are not counted.
    acquired(begin(s, &id(&self::scope(), "elsewhere"), fp("f"), LONG).await);
    sleep(PAST_SHORT).await;

    let stats = s.stats(Some(&scope), Duration::ZERO).await.expect("stats");
    assert_eq!(
        (
            stats.in_flight,
            stats.expired_leases,
            stats.stuck,
            stats.succeeded,
            stats.failed
        ),
        (2, 1, 1, 1, 1),
        "{stats:?}"
    );
    let patient = s
        .stats(Some(&scope), Duration::from_secs(3600))
        .await
        .expect("stats");
    assert_eq!(
        (patient.expired_leases, patient.stuck),
        (1, 0),
        "{patient:?}"
    );
    let all = s.stats(None, Duration::ZERO).await.expect("stats");
    assert!(
        all.in_flight >= 3,
        "stats over every scope missed some: {all:?}"
    );
}

/// How soon after a completion a notified waiter must answer. A poll would take the
/// safety-net interval ([`NOTIFY_SAFETY_POLL`]), far longer.
pub const NOTIFIED_WITHIN: Duration = Duration::from_millis(25);
/// The safety-net poll of [`waiter_is_notified`]: long, so that only a notification can
/// answer the waiter within [`NOTIFIED_WITHIN`].
pub const NOTIFY_SAFETY_POLL: Duration = Duration::from_secs(2);
/// Rounds of [`waiter_is_notified`]; one in time is enough.
pub const NOTIFY_ROUNDS: usize = 3;

/// A waiter: `idem.begin(id, fingerprint)` on a task of its own, answering with the
/// instant it got its answer (to compare with when the holder settled the record).
pub fn spawn_waiter(
    idem: &idem_core::Idem,
    id: &RecordId,
    fingerprint: Fingerprint,
) -> tokio::task::JoinHandle<(Begin, Instant)> {
    let (idem, id) = (idem.clone(), id.clone());
    tokio::spawn(async move {
        let answer = idem
            .begin(&id, fingerprint)
            .await
            .expect("the waiter's begin");
        (answer, Instant::now())
    })
}

/// The answer of a [`spawn_waiter`] task, which must come within `limit`, and when it came.
///
/// # Panics
///
/// When it does not come in time or the task failed.
pub async fn answer_of(
    waiter: tokio::task::JoinHandle<(Begin, Instant)>,
    limit: Duration,
) -> (Begin, Instant) {
    timeout(limit, waiter)
        .await
        .expect("the waiter answers")
        .expect("the waiter task")
}

/// For stores that notify ([`Store::watch`]): a caller waiting for the holder's result
/// ([`idem_core::Config::wait`]) answers within [`NOTIFIED_WITHIN`] of the holder's
/// completion (a replay: a read), and within [`NOTIFIED_WITHIN`] plus what an acquisition
/// took on this store just before of the holder's release (the answer is an acquisition:
/// a write, which on PostgreSQL waits for a WAL flush), while its safety-net poll is
/// [`NOTIFY_SAFETY_POLL`].
///
/// Each is tried in up to [`NOTIFY_ROUNDS`] rounds and passes when one round is in time: a
/// loaded machine can stall any one store call by tens of milliseconds, while a store
/// whose notifications do not arrive answers every round a poll later, over a second late.
pub async fn waiter_is_notified(store: Arc<dyn Store>) {
    use idem_core::{Config, Idem};

    let idem = Idem::from_arc(store.clone()).with_config(
        Config::default()
            .with_wait(Duration::from_secs(20))
            .with_safety_poll(NOTIFY_SAFETY_POLL)
            .with_max_poll(NOTIFY_SAFETY_POLL),
    );
    let scope = scope();
    // Open a few of the store's connections first (a pool opens them on demand), so that
    // the timing below is the notification's, not a connect's.
    let warm = id(&scope, "warm-up");
    let gets: Vec<_> = (0..4)
        .map(|_| {
            let (store, warm) = (store.clone(), warm.clone());
            tokio::spawn(async move { store.get(&warm).await })
        })
        .collect();
    for get in gets {
        get.await.expect("warm-up task").expect("warm-up get");
    }
    for settle in ["complete", "release"] {
        let mut rounds = Vec::new();
        for round in 0..NOTIFY_ROUNDS {
            let (late, allowed) = notified_round(&store, &idem, &scope, settle, round).await;
            if late < allowed {
                break;
            }
            rounds.push((late, allowed));
        }
        assert!(
            rounds.len() < NOTIFY_ROUNDS,
            "{settle}: in every round the waiter answered too long after it (answered after, \
             allowed): {rounds:?}: not notified"
        );
    }
}

/// One round of [`waiter_is_notified`]: how long after the holder's settle the waiter
/// answered, and how long it may take.
async fn notified_round(
    store: &Arc<dyn Store>,
    idem: &idem_core::Idem,
    scope: &Scope,
    settle: &str,
    round: usize,
) -> (Duration, Duration) {
    let id = id(scope, &format!("notified-{settle}-{round}"));
    let started = Instant::now();
    let lease = acquired(begin(&**store, &id, fp("n"), LONG).await);
    let acquisition = started.elapsed();
    let waiter = spawn_waiter(idem, &id, fp("n"));
    // Let the waiter find the key in flight and register its watch.
    sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "{settle}: the waiter did not wait");
    match settle {
        "complete" => store
            .complete(&lease, &ok_response("done"), KEEP)
            .await
            .expect("complete"),
        _ => store.release(&lease).await.expect("release"),
    }
    let settled = Instant::now();
    let (answer, answered) = answer_of(waiter, Duration::from_secs(10)).await;
    let allowed = match (&answer, settle) {
        (Begin::Replay(replay), "complete") => {
            assert_eq!(replay.completion.response.body, Bytes::from_static(b"done"));
            NOTIFIED_WITHIN
        }
        (Begin::Acquired(_), "release") => NOTIFIED_WITHIN + acquisition,
        other => panic!("{settle}: unexpected answer {other:?}"),
    };
    (answered.saturating_duration_since(settled), allowed)
}

/// The bytes of a live stream read from `from`, asserting it is `lease`'s.
async fn live_bytes(store: &dyn Store, lease: &Lease, from: u64) -> Bytes {
    match store
        .read_stream(lease.id(), from)
        .await
        .expect("read_stream")
    {
        StreamRead::Live { token, bytes, .. } => {
            assert_eq!(token, lease.token(), "the stream of another holder");
            bytes
        }
        other => panic!("expected a live stream, got {other:?}"),
    }
}

/// Streams ([`Store::append`], [`Store::read_stream`]): what a holder appends is read back
/// from any offset, a re-sent append changes nothing, an append past the end is refused,
/// and once completed the stream reads as the completion while appends find the lease
/// lost.
pub async fn stream_appends_are_read_back(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "stream");
    let lease = acquired(begin(&*store, &id, fp("f"), LONG).await);
    assert_eq!(live_bytes(&*store, &lease, 0).await, "");
    store.append(&lease, 0, b"head|").await.expect("append");
    store.append(&lease, 5, b"one|").await.expect("append");
    assert_eq!(live_bytes(&*store, &lease, 0).await, "head|one|");
    assert_eq!(live_bytes(&*store, &lease, 5).await, "one|");
    assert_eq!(live_bytes(&*store, &lease, 9).await, "");
    assert_eq!(live_bytes(&*store, &lease, 1000).await, "");
    // Sent again after a lost reply: the same bytes at the same offset.
    store
        .append(&lease, 5, b"one|")
        .await
        .expect("a re-sent append");
    store.append(&lease, 9, b"two|").await.expect("append");
    assert_eq!(live_bytes(&*store, &lease, 0).await, "head|one|two|");
    match store.append(&lease, 100, b"gap").await {
        Err(Error::Invalid(_)) => {}
        other => panic!("an append past the end: expected Invalid, got {other:?}"),
    }
    // Binary bytes survive as they are.
    store
        .append(&lease, 13, b"\0\xff\r\n")
        .await
        .expect("append");
    assert_eq!(live_bytes(&*store, &lease, 13).await, &b"\0\xff\r\n"[..]);

    complete_ok(&*store, &lease, "head|one|two|").await;
    match store.read_stream(&id, 0).await.expect("read_stream") {
        StreamRead::Completed(c) => assert_eq!(c.response.body, "head|one|two|"),
        other => panic!("expected the completion, got {other:?}"),
    }
    lease_lost(
        store.append(&lease, 17, b"late").await,
        "append after complete",
    );
    let absent = id_absent(&scope);
    assert_eq!(
        store.read_stream(&absent, 0).await.expect("read_stream"),
        StreamRead::Absent
    );
}

fn id_absent(scope: &Scope) -> RecordId {
    id(scope, "never-begun")
}

/// Streams are fenced: a holder whose lease was taken over cannot append (and nothing it
/// tries is read), the new holder starts an empty stream of its own, and a released
/// record's stream is gone.
pub async fn a_taken_over_holder_cannot_append(store: Arc<dyn Store>) {
    let scope = scope();
    let id = id(&scope, "fenced");
    let first = acquired(begin(&*store, &id, fp("f"), SHORT).await);
    store.append(&first, 0, b"first|").await.expect("append");
    sleep(PAST_SHORT).await;
    match store.read_stream(&id, 0).await.expect("read_stream") {
        StreamRead::Live {
            lease_remaining, ..
        } => assert_eq!(lease_remaining, Duration::ZERO, "an expired lease"),
        other => panic!("expected a live stream, got {other:?}"),
    }
    let second = match begin(&*store, &id, fp("f"), LONG).await {
        Begin::TookOver(lease) => lease,
        other => panic!("expected TookOver, got {other:?}"),
    };
    lease_lost(store.append(&first, 6, b"stale|").await, "stale append");
    lease_lost(
        store.append(&first, 0, b"stale|").await,
        "stale append at 0",
    );
    assert_eq!(live_bytes(&*store, &second, 0).await, "", "a fresh stream");
    store.append(&second, 0, b"second|").await.expect("append");
    assert_eq!(live_bytes(&*store, &second, 0).await, "second|");
    store.release(&second).await.expect("release");
    assert_eq!(
        store.read_stream(&id, 0).await.expect("read_stream"),
        StreamRead::Absent
    );
    lease_lost(
        store.append(&second, 7, b"late").await,
        "append after release",
    );
    // The next holder starts empty again.
    let third = acquired(begin(&*store, &id, fp("f"), LONG).await);
    assert_eq!(live_bytes(&*store, &third, 0).await, "");
}

/// For stores that notify: a reader watching a record is woken by an `append`, within
/// [`NOTIFIED_WITHIN`] in one of [`NOTIFY_ROUNDS`] rounds.
pub async fn stream_appends_wake_watchers(store: Arc<dyn Store>) {
    let scope = scope();
    for round in 0..NOTIFY_ROUNDS {
        let id = id(&scope, &format!("woken-{round}"));
        let lease = acquired(begin(&*store, &id, fp("f"), LONG).await);
        let mut watch = store.watch(&id).await.expect("the store notifies");
        let appended = Instant::now();
        store.append(&lease, 0, b"piece").await.expect("append");
        if timeout(NOTIFIED_WITHIN, watch.changed()).await.is_ok() {
            assert_eq!(live_bytes(&*store, &lease, 0).await, "piece");
            return;
        }
        eprintln!(
            "round {round}: no notification {:?} after the append",
            appended.elapsed()
        );
    }
    panic!("no round was woken by an append within {NOTIFIED_WITHIN:?}");
}
