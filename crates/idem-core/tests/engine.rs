//! The engine's own behaviour on top of a store: waiting, execute_once's mapping of every
//! outcome, heartbeats, time limits on store calls, and the span and metrics of every store
//! call, neither of which gives the key away.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::telemetry::{Instrumented, KeyHash};
use idem_core::{
    Begin, BeginRequest, Completion, Config, Error, Failure, FailurePolicy, FencingToken,
    Fingerprint, Idem, Key, Lease, MemoryStore, Once, OnceError, RecordId, Response, Scope, Store,
};
use idem_testkit::faults::FaultyStore;
use idem_testkit::telemetry::{logs_of, metrics_of, FmtSpan, Level};
use metrics_util::debugging::{DebugValue, Snapshot};
use metrics_util::MetricKind;
use tokio::time::{sleep, Instant};

fn id(key: &str) -> RecordId {
    RecordId::new(Scope::new("engine").unwrap(), Key::new(key).unwrap())
}

fn fp() -> Fingerprint {
    Fingerprint::of_bytes(b"request")
}

fn idem(config: Config) -> Idem {
    Idem::new(MemoryStore::new()).with_config(config)
}

/// The lease of `key`, which no one holds yet.
async fn acquired(idem: &Idem, key: &str) -> Lease {
    match idem.begin(&id(key), fp()).await.unwrap() {
        Begin::Acquired(lease) => lease,
        other => panic!("{key}: a fresh key is acquired, got {other:?}"),
    }
}

/// The error of `execute_once` on `key` when its work fails with `failure`.
async fn fails(idem: &Idem, key: &str, failure: Failure<String>) -> OnceError<String> {
    idem.execute_once(&id(key), fp(), |_| async { Err::<u32, _>(failure) })
        .await
        .unwrap_err()
}

#[tokio::test]
async fn wait_returns_the_holders_result() {
    let idem = idem(Config::default().with_wait(Duration::from_secs(5)));
    let lease = acquired(&idem, "k").await;
    let holder = idem.clone();
    tokio::spawn(async move {
        sleep(Duration::from_millis(100)).await;
        holder
            .complete(&lease, Response::new(201, "made"))
            .await
            .unwrap();
    });
    let started = Instant::now();
    match idem.begin(&id("k"), fp()).await.unwrap() {
        Begin::Replay(r) => assert_eq!(r.completion.response.body, "made"),
        other => panic!("expected the holder's result, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn wait_gives_up_with_in_flight() {
    let idem = idem(Config::default().with_wait(Duration::from_millis(150)));
    let _lease = acquired(&idem, "k").await;
    let started = Instant::now();
    assert!(matches!(
        idem.begin(&id("k"), fp()).await.unwrap(),
        Begin::InFlight { .. }
    ));
    assert!(started.elapsed() >= Duration::from_millis(150));
}

#[tokio::test]
async fn wait_takes_over_when_the_holder_dies() {
    let idem = idem(
        Config::default()
            .with_lease(Duration::from_millis(100))
            .with_wait(Duration::from_secs(5)),
    );
    let _crashed = acquired(&idem, "k").await;
    match idem.begin(&id("k"), fp()).await.unwrap() {
        Begin::TookOver(lease) => assert_eq!(lease.attempt(), 2),
        other => panic!("expected a takeover, got {other:?}"),
    }
}

#[tokio::test]
async fn execute_once_maps_every_outcome() {
    let idem = idem(Config::default().with_failure(FailurePolicy::Store));
    let runs = AtomicUsize::new(0);
    let work = |value: u32| {
        let runs = &runs;
        move |_lease: Lease| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(value)
        }
    };
    assert_eq!(
        idem.execute_once(&id("ok"), fp(), work(7)).await.unwrap(),
        Once::Executed {
            value: 7,
            attempt: 1
        }
    );
    assert_eq!(
        idem.execute_once(&id("ok"), fp(), work(8)).await.unwrap(),
        Once::Replayed(7)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        idem.execute_once(&id("ok"), Fingerprint::of_bytes(b"other"), work(9))
            .await
            .unwrap(),
        Once::Mismatch
    );

    // A retryable failure releases the key: the next call runs the work again.
    let err = fails(&idem, "flaky", Failure::Retryable("timeout".to_owned())).await;
    assert!(matches!(err, OnceError::Work { stored: false, .. }));
    assert_eq!(
        idem.execute_once(&id("flaky"), fp(), work(1))
            .await
            .unwrap(),
        Once::Executed {
            value: 1,
            attempt: 1
        }
    );

    // A terminal failure under FailurePolicy::Store is replayed.
    let err = fails(&idem, "bad", Failure::Terminal("card declined".to_owned())).await;
    assert!(matches!(err, OnceError::Work { stored: true, .. }));
    assert_eq!(
        idem.execute_once(&id("bad"), fp(), work(1)).await.unwrap(),
        Once::FailedBefore("card declined".to_owned())
    );

    // In flight while another worker holds the key.
    let _held = acquired(&idem, "held").await;
    assert!(matches!(
        idem.execute_once(&id("held"), fp(), work(1)).await.unwrap(),
        Once::InFlight { .. }
    ));
}

#[tokio::test]
async fn terminal_failure_under_release_policy_runs_again() {
    let idem = idem(Config::default());
    let err = fails(&idem, "k", Failure::Terminal("no".to_owned())).await;
    assert!(matches!(err, OnceError::Work { stored: false, .. }));
    assert!(matches!(
        idem.begin(&id("k"), fp()).await.unwrap(),
        Begin::Acquired(_)
    ));
}

#[tokio::test]
async fn heartbeat_keeps_long_work_alive() {
    let idem = idem(Config::default().with_lease(Duration::from_millis(150)));
    let watcher = idem.clone();
    let outcome = idem
        .execute_once(&id("long"), fp(), |_| async move {
            for _ in 0..5 {
                sleep(Duration::from_millis(100)).await;
                // Three lease lengths in, nobody can take the key over.
                assert!(matches!(
                    watcher.begin(&id("long"), fp()).await.unwrap(),
                    Begin::InFlight { .. }
                ));
            }
            Ok::<_, Failure<String>>("done".to_owned())
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Once::Executed { .. }));
}

#[tokio::test]
async fn lost_lease_cancels_the_work() {
    let idem = idem(Config::default().with_lease(Duration::from_millis(90)));
    let evicter = idem.clone();
    let finished = Arc::new(AtomicUsize::new(0));
    let done = finished.clone();
    let err = idem
        .execute_once(&id("k"), fp(), |_| async move {
            // An operator evicts the key: the next heartbeat finds the lease lost.
            evicter.store().evict(&id("k")).await.unwrap();
            sleep(Duration::from_millis(500)).await;
            done.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(1)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, OnceError::Store(Error::LeaseLost)), "{err:?}");
    assert_eq!(finished.load(Ordering::SeqCst), 0, "work was not cancelled");
}

#[tokio::test]
async fn a_hung_store_is_unavailable_after_the_timeout() {
    let idem = Idem::new(hung())
        .with_config(Config::default().with_store_timeout(Duration::from_millis(100)));
    let err = idem.begin(&id("k"), fp()).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert!(matches!(err, Error::Unavailable { store, .. } if store == "memory"));
}

#[tokio::test]
async fn a_failed_heartbeat_does_not_cancel_the_work() {
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next_extends(1);
    let idem =
        Idem::new(store).with_config(Config::default().with_lease(Duration::from_millis(300)));
    let outcome = idem
        .execute_once(&id("k"), fp(), |_| async {
            sleep(Duration::from_millis(450)).await;
            Ok::<_, Failure<String>>(7)
        })
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Once::Executed {
            value: 7,
            attempt: 1
        }
    );
}

/// A memory store on the timer's clock, behind switches that stall its renewals.
fn faulty_on_timer() -> Arc<FaultyStore> {
    let memory = MemoryStore::with_clock(Arc::new(idem_testkit::faults::TimerClock::new()));
    Arc::new(FaultyStore::new(memory))
}

/// An engine on `store` with a 3 s lease and a 1.5 s time limit on store calls, and the
/// lease of a fresh key.
async fn on_faulty(store: &Arc<FaultyStore>, key: &str) -> (Idem, Lease) {
    let idem = Idem::from_arc(store.clone()).with_config(
        Config::default()
            .with_lease(Duration::from_secs(3))
            .with_store_timeout(Duration::from_millis(1500)),
    );
    let lease = acquired(&idem, key).await;
    (idem, lease)
}

/// A store that stalls from 0.5 s to 2.9 s into a 3 s lease (shorter than the time left
/// when the first renewal is due, at 1 s): that renewal fails (at 2 s, half the time left),
/// and the lease survives only if a later try comes before the deadline and waits out the
/// stall. Another worker at 3.2 s finds the key held, and the work (6 s)
/// completes under the lease.
#[tokio::test(start_paused = true)]
async fn a_stall_shorter_than_the_lease_never_costs_it() {
    use idem_core::OnLost;

    for on_lost in [OnLost::Cancel, OnLost::Finish] {
        let store = faulty_on_timer();
        let (idem, lease) = on_faulty(&store, "stall").await;
        let started = Instant::now();
        let rival = idem.clone();
        let (lease, taken) = idem
            .run_with_heartbeat(lease, on_lost, async {
                sleep(Duration::from_millis(500)).await;
                store.set_extend_stalled(true);
                sleep(Duration::from_millis(2400)).await;
                store.set_extend_stalled(false);
                // Past the lease granted at the start: another worker finds it renewed.
                sleep(Duration::from_millis(300)).await;
                let rival = rival.begin(&id("stall"), fp()).await.unwrap();
                sleep(Duration::from_millis(2800)).await;
                rival
            })
            .await
            .unwrap();
        assert_eq!(started.elapsed(), Duration::from_secs(6));
        assert!(
            matches!(taken, Begin::InFlight { .. }),
            "{on_lost:?}: {taken:?}"
        );
        idem.complete(&lease, Response::new(201, "once"))
            .await
            .unwrap();
        // The renewal due at 1 s (given up at 2 s, half the time left), its retries at
        // 2.1 s (given up at 2.55 s) and 2.7 s (answered when the stall ended, at 2.9 s),
        // then one every second: 3.9 s, 4.9 s, 5.9 s.
        assert_eq!(store.extends(), 6, "{on_lost:?}");
    }
}

/// While the store answers, the heartbeat renews once every third of a lease, no more.
#[tokio::test(start_paused = true)]
async fn a_healthy_store_gets_one_renewal_per_third_of_a_lease() {
    use idem_core::OnLost;

    let store = faulty_on_timer();
    let (idem, lease) = on_faulty(&store, "healthy").await;
    let work = sleep(Duration::from_millis(10_500));
    let (lease, ()) = idem
        .run_with_heartbeat(lease, OnLost::Cancel, work)
        .await
        .unwrap();
    assert_eq!(store.extends(), 10);
    idem.complete(&lease, Response::new(200, "done"))
        .await
        .unwrap();
}

/// A stall longer than the time left: the lease runs out, and `Cancel` gives the work up
/// with the renewal's error instead of letting it run on as if it held the key.
#[tokio::test(start_paused = true)]
async fn a_stall_longer_than_the_lease_costs_it() {
    use idem_core::OnLost;

    let store = faulty_on_timer();
    let (idem, lease) = on_faulty(&store, "long-stall").await;
    store.set_extend_stalled(true);
    let work = sleep(Duration::from_secs(10));
    let err = idem
        .run_with_heartbeat(lease, OnLost::Cancel, work)
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
    // A retry after the deadline takes the key over: attempt 2.
    store.set_extend_stalled(false);
    match idem.begin(&id("long-stall"), fp()).await.unwrap() {
        Begin::TookOver(lease) => assert_eq!(lease.attempt(), 2),
        other => panic!("expected a takeover, got {other:?}"),
    }
}

#[tokio::test]
async fn a_lost_lease_under_on_lost_finish_lets_the_work_end() {
    use idem_core::OnLost;

    let idem = idem(Config::default().with_lease(Duration::from_millis(90)));
    let lease = acquired(&idem, "finish").await;
    let evicter = idem.clone();
    let (lease, out) = idem
        .run_with_heartbeat(lease, OnLost::Finish, async move {
            // An operator evicts the key: the next heartbeat finds the lease lost, and the
            // work still runs to its end.
            evicter.store().evict(&id("finish")).await.unwrap();
            sleep(Duration::from_millis(300)).await;
            "finished"
        })
        .await
        .unwrap();
    assert_eq!(out, "finished");
    // Storing its outcome finds the lease lost: nothing is written over the new state.
    let stored = idem.complete(&lease, Response::new(200, out)).await;
    assert!(matches!(stored, Err(Error::LeaseLost)), "{stored:?}");
    assert!(idem.store().get(&id("finish")).await.unwrap().is_none());
}

#[tokio::test]
async fn a_claim_whose_answer_was_lost_is_given_back() {
    let store = FaultyStore::new(MemoryStore::new());
    store.lose_next_begin_answers(1);
    let idem = Idem::new(store).with_config(
        Config::default()
            .with_lease(Duration::from_secs(30))
            .with_store_timeout(Duration::from_millis(100)),
    );
    let err = idem.begin(&id("lost"), fp()).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    // The claim landed: without its release, the key is in flight for the 30 s lease.
    let started = Instant::now();
    loop {
        match idem.begin(&id("lost"), fp()).await.unwrap() {
            Begin::Acquired(_) => break,
            Begin::InFlight { .. } if started.elapsed() < Duration::from_secs(5) => {
                sleep(Duration::from_millis(20)).await;
            }
            other => panic!("the key is still blocked: {other:?}"),
        }
    }
}

/// A memory store whose `begin` never answers.
fn hung() -> FaultyStore {
    let store = FaultyStore::new(MemoryStore::new());
    store.set_begin_hung(true);
    store
}

/// A record whose key must never appear in spans or metrics.
fn secret_id() -> RecordId {
    RecordId::new(
        Scope::new("tenant-7").unwrap(),
        Key::new("secret-order-key").unwrap(),
    )
}

async fn lifecycle(store: &Instrumented) {
    let id = secret_id();
    let req = || BeginRequest {
        id: &id,
        fingerprint: fp(),
        token: FencingToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(60),
    };
    let Begin::Acquired(lease) = store.begin(req()).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    let done = Completion::succeeded(Response::new(201, "card-number-4111"));
    store
        .complete(&lease, &done, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(matches!(
        store.begin(req()).await.unwrap(),
        Begin::Replay(_)
    ));
    assert!(matches!(store.release(&lease).await, Err(Error::LeaseLost)));
}

/// The counters of `snapshot` as sorted `name label=value,... count` lines, and the samples
/// of the one histogram, `idem_store_call_duration_seconds`.
fn counters_and_samples(snapshot: Snapshot) -> (Vec<String>, usize) {
    let mut counters = Vec::new();
    let mut samples = 0;
    for (key, _, _, value) in snapshot.into_vec() {
        let (kind, key) = key.into_parts();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        match (kind, value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => {
                counters.push(format!("{} {} {n}", key.name(), labels.join(",")));
            }
            (MetricKind::Histogram, DebugValue::Histogram(values)) => {
                assert_eq!(key.name(), "idem_store_call_duration_seconds");
                samples += values.len();
            }
            other => panic!("unexpected metric {other:?}"),
        }
    }
    counters.sort();
    (counters, samples)
}

#[test]
fn metrics_count_every_call_by_outcome() {
    let store = Instrumented::new(Arc::new(MemoryStore::new()));
    let (counters, samples) = counters_and_samples(metrics_of(lifecycle(&store)));
    assert_eq!(
        counters,
        [
            "idem_lease_lost_total store=memory,op=release 1",
            "idem_store_calls_total store=memory,op=begin,outcome=acquired 1",
            "idem_store_calls_total store=memory,op=begin,outcome=replay 1",
            "idem_store_calls_total store=memory,op=complete,outcome=ok 1",
            "idem_store_calls_total store=memory,op=release,outcome=lease_lost 1",
        ]
    );
    assert_eq!(samples, 4, "one latency sample per call");
}

#[test]
fn spans_name_the_key_by_its_hash_only() {
    let store = Instrumented::new(Arc::new(MemoryStore::new()));
    let out = logs_of(Level::DEBUG, FmtSpan::CLOSE, lifecycle(&store));
    let hash = KeyHash::of(&secret_id()).to_string();
    assert_eq!(out.matches("idem.store").count(), 4, "{out}");
    assert_eq!(out.matches(&format!("key_hash={hash}")).count(), 4, "{out}");
    for field in [
        "store=\"memory\"",
        "op=\"begin\"",
        "scope=tenant-7",
        "outcome=\"acquired\"",
        "outcome=\"replay\"",
        "outcome=\"lease_lost\"",
        "attempt=1",
        "elapsed_us=",
    ] {
        assert!(out.contains(field), "no {field} in {out}");
    }
    assert!(!out.contains("secret-order-key"), "the key leaked: {out}");
    assert!(!out.contains("card-number"), "the body leaked: {out}");
}

/// `Idem` reports its store calls, and a call cut off by the time limit counts as
/// unavailable.
#[test]
fn idem_reports_its_calls_and_their_time_limit() {
    let snapshot = metrics_of(async {
        let idem = Idem::new(MemoryStore::new());
        assert!(matches!(
            idem.begin(&secret_id(), fp()).await.unwrap(),
            Begin::Acquired(_)
        ));
        let hang = Idem::new(hung())
            .with_config(Config::default().with_store_timeout(Duration::from_millis(20)));
        assert!(matches!(
            hang.begin(&secret_id(), fp()).await,
            Err(Error::Unavailable { store, .. }) if store == "memory"
        ));
    });
    let (counters, _) = counters_and_samples(snapshot);
    assert_eq!(
        counters,
        [
            "idem_store_calls_total store=memory,op=begin,outcome=acquired 1",
            "idem_store_calls_total store=memory,op=begin,outcome=unavailable 1",
        ]
    );
}

/// A full memory store refusing new keys is not an outage: no "unavailable" warning, no
/// "answers again" line, while it keeps answering the keys it holds.
#[test]
fn a_full_memory_store_is_not_logged_as_an_outage() {
    let full =
        MemoryStore::new().with_capacity(idem_core::MemoryCapacity::default().with_records(1));
    let idem = Idem::new(full);
    let out = logs_of(Level::INFO, FmtSpan::NONE, async {
        assert!(matches!(
            idem.begin(&secret_id(), fp()).await.unwrap(),
            Begin::Acquired(_)
        ));
        for i in 0..3 {
            let other = RecordId::new(Scope::global(), Key::new(format!("k{i}")).unwrap());
            let refused = idem.begin(&other, fp()).await;
            assert!(
                matches!(refused, Err(Error::Unavailable { .. })),
                "{refused:?}"
            );
            assert!(matches!(
                idem.begin(&secret_id(), fp()).await.unwrap(),
                Begin::InFlight { .. }
            ));
        }
    });
    assert!(!out.contains("unavailable"), "{out}");
    assert!(!out.contains("answers again"), "{out}");
}

/// `AfterRetention::Refuse`: once a completed key's record is forgotten, its tombstone
/// answers `Begin::Expired` (and `execute_once` `Once::Expired`, without running the work)
/// until the tombstone's own time is over; then the key is new again. Under the default
/// `Run`, no tombstone is kept.
#[tokio::test]
async fn a_completed_key_is_refused_after_its_retention_while_its_tombstone_lasts() {
    use idem_core::{AfterRetention, ManualClock};
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(Arc::new(clock.clone()));
    let config = Config::default()
        .with_retention(Duration::from_secs(60))
        .with_after_retention(AfterRetention::Refuse)
        .with_tombstone(Duration::from_secs(600));
    let idem = Idem::new(store).with_config(config);
    let lease = acquired(&idem, "stone").await;
    idem.complete(&lease, Response::new(201, "done"))
        .await
        .unwrap();
    assert!(matches!(
        idem.begin(&id("stone"), fp()).await.unwrap(),
        Begin::Replay(_)
    ));

    clock.advance(Duration::from_secs(61));
    let Begin::Expired { completed_at } = idem.begin(&id("stone"), fp()).await.unwrap() else {
        panic!("a forgotten key under its tombstone is refused");
    };
    let ago = std::time::SystemTime::now()
        .duration_since(completed_at)
        .unwrap();
    assert!(ago < Duration::from_secs(5), "{ago:?}");
    let runs = AtomicUsize::new(0);
    let once = idem
        .execute_once(&id("stone"), fp(), |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(1)
        })
        .await
        .unwrap();
    assert!(matches!(once, Once::Expired { .. }), "{once:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // The refusal left nothing held: at once, the key is refused again, not in flight.
    let again = idem.begin(&id("stone"), fp()).await.unwrap();
    assert!(matches!(again, Begin::Expired { .. }), "{again:?}");
    // A claim that skipped the check (its worker died between claiming and looking) is
    // taken over once its lease ends, and the takeover is refused too.
    let raw = BeginRequest {
        id: &id("stone"),
        fingerprint: fp(),
        token: FencingToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(60),
    };
    assert!(matches!(
        idem.store().begin(raw).await.unwrap(),
        Begin::Acquired(_)
    ));
    clock.advance(Duration::from_secs(31));
    let taken = idem.begin(&id("stone"), fp()).await.unwrap();
    assert!(matches!(taken, Begin::Expired { .. }), "{taken:?}");
    // Once the tombstone's time is over, the key is new again.
    clock.advance(Duration::from_secs(600));
    acquired(&idem, "stone").await;

    // Under the default, a forgotten key is new again at once.
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(Arc::new(clock.clone()));
    let config = Config::default().with_retention(Duration::from_secs(60));
    let idem = Idem::new(store).with_config(config);
    let lease = acquired(&idem, "run").await;
    idem.complete(&lease, Response::new(201, "done"))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(61));
    acquired(&idem, "run").await;
}
