//! The consumer's decisions, on the in-memory store (no broker needed).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_consumer::{
    Consumer, DeadLetterReason, Delivery, InvalidMessage, Message, OnTerminal, Outcome, Policy,
    RequeueReason, ATTEMPT_HEADER, IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_SCOPE_HEADER,
    MIN_REQUEUE_DELAY,
};
use idem_core::{Begin, Config, Failure, Idem, Key, ManualClock, MemoryStore, Scope, Store};
use idem_testkit::faults::FaultyStore;

fn scope() -> Scope {
    Scope::new(format!("test-{}", uuid::Uuid::new_v4())).unwrap()
}

fn msg(key: &str, payload: &str) -> Message {
    Message::new(payload.as_bytes().to_vec()).with_header(IDEMPOTENCY_KEY_HEADER, key)
}

fn consumer(store: MemoryStore, policy: Policy) -> Consumer {
    Consumer::new(Idem::new(store), scope()).with_policy(policy)
}

/// Asserts that the handler ran (as `attempt`) and the message is acked with its `value`.
fn assert_executed(d: &Delivery<u32>, value: u32, attempt: u32) {
    assert!(
        matches!(d, Delivery::Ack(Outcome::Executed { value: v, attempt: a }) if (*v, *a) == (value, attempt)),
        "expected the work run as attempt {attempt} with value {value}, got {d:?}"
    );
}

/// A consumer on a store whose clock the test moves, with leases of 10 s.
fn on_a_manual_clock(policy: Policy) -> (ManualClock, Idem, Consumer) {
    let clock = ManualClock::new();
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let config = Config::default().with_lease(Duration::from_secs(10));
    let idem = Idem::from_arc(store).with_config(config);
    let c = Consumer::new(idem.clone(), scope()).with_policy(policy);
    (clock, idem, c)
}

/// A handler that counts its runs and returns `result`.
async fn counted(
    runs: &AtomicU32,
    result: Result<u32, Failure<&'static str>>,
) -> Result<u32, Failure<&'static str>> {
    runs.fetch_add(1, Ordering::SeqCst);
    result
}

#[tokio::test]
async fn duplicates_are_acked_with_the_stored_value_and_do_not_run_again() {
    let c = consumer(MemoryStore::new(), Policy::default());
    let runs = AtomicU32::new(0);
    let m = msg("order-1", r#"{"amount": 5}"#);
    let first = c.process(&m, |_| counted(&runs, Ok(7))).await;
    assert_executed(&first, 7, 1);
    for _ in 0..3 {
        let again = c.process(&m, |_| counted(&runs, Ok(8))).await;
        assert!(matches!(again, Delivery::Ack(Outcome::Replayed(7))));
        assert_eq!(again.value(), Some(&7));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_run_once_and_the_others_are_requeued_not_dropped() {
    let c = consumer(MemoryStore::new(), Policy::default());
    let runs = Arc::new(AtomicU32::new(0));
    let m = msg("order-2", "{}");
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (c, m, runs) = (c.clone(), m.clone(), runs.clone());
        tasks.push(tokio::spawn(async move {
            c.process(&m, |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok::<_, Failure<String>>(1u8)
            })
            .await
        }));
    }
    let (mut executed, mut requeued) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Delivery::Ack(Outcome::Executed { .. }) => executed += 1,
            Delivery::Ack(Outcome::Replayed(_)) => {}
            Delivery::Requeue {
                after,
                reason: RequeueReason::InFlight,
            } => {
                assert!(after >= MIN_REQUEUE_DELAY && after <= Duration::from_secs(5));
                requeued += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed, 1);
    assert!(requeued > 0, "a duplicate arriving mid-work is requeued");
    // The requeued copies come back once the work is done: acked as duplicates.
    let back = c
        .process(&m, |_| async { Ok::<_, Failure<String>>(2u8) })
        .await;
    assert!(matches!(back, Delivery::Ack(Outcome::Replayed(1))));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_duplicate_can_wait_for_the_holders_result() {
    let store = MemoryStore::new();
    let config = Config::default().with_wait(Duration::from_secs(5));
    let c = Consumer::new(Idem::new(store).with_config(config), scope());
    let m = msg("order-3", "{}");
    let holder = {
        let (c, m) = (c.clone(), m.clone());
        tokio::spawn(async move {
            c.process(&m, |_| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, Failure<String>>("done".to_string())
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waited = c
        .process(&m, |_| async {
            Ok::<_, Failure<String>>("second run".to_string())
        })
        .await;
    assert!(matches!(waited, Delivery::Ack(Outcome::Replayed(ref v)) if v == "done"));
    assert!(matches!(
        holder.await.unwrap(),
        Delivery::Ack(Outcome::Executed { .. })
    ));
}

#[tokio::test]
async fn transient_failures_are_nacked_with_backoff_then_succeed_once() {
    let policy = Policy::default().with_retry_delay(Duration::from_millis(100));
    let c = consumer(MemoryStore::new(), policy);
    let runs = AtomicU32::new(0);
    let mut m = msg("order-4", "{}");
    // Attempts 1 and 2 fail; the broker redelivers with the attempt header set.
    for expected in 1..=2u32 {
        let d = c
            .process(&m, |ctx| {
                assert_eq!(ctx.attempt(), expected);
                counted(&runs, Err(Failure::Retryable("timeout")))
            })
            .await;
        let Delivery::Nack {
            after,
            attempt,
            error,
        } = d
        else {
            panic!("expected a nack, got {d:?}");
        };
        assert_eq!(attempt, expected);
        assert_eq!(error, "timeout");
        assert_eq!(after, Duration::from_millis(100) * 2u32.pow(expected - 1));
        m = m.with_header(ATTEMPT_HEADER, attempt);
    }
    let d = c.process(&m, |_| counted(&runs, Ok(1))).await;
    assert_executed(&d, 1, 3);
    let dup = c.process(&m, |_| counted(&runs, Ok(2))).await;
    assert!(matches!(dup, Delivery::Ack(Outcome::Replayed(1))));
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// A retryable failure whose handler asked for a later retry (a `Retry-After` it was given)
/// waits the longer of that and the policy's delay, never past `max_retry_delay`.
#[tokio::test]
async fn a_retry_waits_for_what_the_handler_asked_within_the_longest_delay() {
    let policy = Policy::default()
        .with_retry_delay(Duration::from_millis(100))
        .with_max_retry_delay(Duration::from_secs(10));
    let c = consumer(MemoryStore::new(), policy);
    let nack_after = |m: Message, asked: Option<Duration>| {
        let c = c.clone();
        async move {
            let d: Delivery<u32> = c
                .process(&m, |ctx| async move {
                    if let Some(asked) = asked {
                        ctx.retry_after(asked);
                    }
                    Err(Failure::Retryable("busy"))
                })
                .await;
            match d {
                Delivery::Nack { after, .. } => after,
                other => panic!("expected a nack, got {other:?}"),
            }
        }
    };
    let (ms, secs) = (Duration::from_millis, Duration::from_secs);
    // What the handler asks for (none, within the bounds, shorter, longer), and the delay.
    for (key, asked, nacked) in [
        ("ra-1", None, ms(100)),
        ("ra-2", Some(secs(3)), secs(3)),
        ("ra-3", Some(ms(10)), ms(100)),
        ("ra-4", Some(secs(3600)), secs(10)),
    ] {
        assert_eq!(nack_after(msg(key, "{}"), asked).await, nacked, "{key}");
    }
}

#[tokio::test]
async fn a_handler_that_always_fails_is_dead_lettered_after_max_attempts_never_acked() {
    for on_terminal in [
        OnTerminal::DeadLetter,
        OnTerminal::StoreAndAck,
        OnTerminal::StoreAndDeadLetter,
    ] {
        let policy = Policy::default()
            .with_max_attempts(3)
            .with_on_terminal(on_terminal);
        let c = consumer(MemoryStore::new(), policy);
        let runs = AtomicU32::new(0);
        let mut m = msg("order-5", "{}");
        let dead = loop {
            let d = c
                .process(&m, |_| counted(&runs, Err(Failure::Retryable("down"))))
                .await;
            match d {
                Delivery::Nack { attempt, .. } => m = m.with_header(ATTEMPT_HEADER, attempt),
                Delivery::DeadLetter { .. } => break d,
                other => panic!("{on_terminal:?}: unexpected {other:?}"),
            }
            assert!(
                runs.load(Ordering::SeqCst) <= 3,
                "{on_terminal:?}: runs away"
            );
        };
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{on_terminal:?}");
        let Delivery::DeadLetter {
            reason: DeadLetterReason::Exhausted { error, stored },
            attempt: 3,
        } = &dead
        else {
            panic!("{on_terminal:?}: {dead:?}");
        };
        assert_eq!(error, "down");
        assert_eq!(*stored, on_terminal != OnTerminal::DeadLetter);
    }
}

/// A message whose work fails for good, delivered twice under `on_terminal`: both
/// decisions. Asserts that the duplicate ran the work again only where the key was
/// released (`DeadLetter`).
async fn terminal_failure_twice(on_terminal: OnTerminal) -> [Delivery<u8>; 2] {
    let c = consumer(
        MemoryStore::new(),
        Policy::default().with_on_terminal(on_terminal),
    );
    let m = msg("k", "{}");
    let runs = AtomicU32::new(0);
    let fail = || {
        runs.fetch_add(1, Ordering::SeqCst);
        async { Err::<u8, _>(Failure::Terminal("card declined")) }
    };
    let first = c.process(&m, |_| fail()).await;
    let duplicate = c.process(&m, |_| fail()).await;
    let expected_runs = 1 + u32::from(on_terminal == OnTerminal::DeadLetter);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        expected_runs,
        "{on_terminal:?}"
    );
    [first, duplicate]
}

#[tokio::test]
async fn terminal_failures_follow_the_policy() {
    // DeadLetter: the key is released, so a duplicate runs (and fails) again.
    for d in terminal_failure_twice(OnTerminal::DeadLetter).await {
        assert!(
            matches!(&d, Delivery::DeadLetter { reason: DeadLetterReason::Terminal { error, stored: false }, attempt: 1 } if error == "card declined"),
            "{d:?}"
        );
    }

    // StoreAndAck: acked with the failure; a duplicate is acked without running.
    let [d, duplicate] = terminal_failure_twice(OnTerminal::StoreAndAck).await;
    assert!(
        matches!(&d, Delivery::Ack(Outcome::Failed { error, attempt: 1 }) if error == "card declined"),
        "{d:?}"
    );
    assert!(
        matches!(&duplicate, Delivery::Ack(Outcome::FailedBefore(e)) if e == "card declined"),
        "{duplicate:?}"
    );

    // StoreAndDeadLetter: dead-lettered once; a duplicate is acked without running.
    let [d, duplicate] = terminal_failure_twice(OnTerminal::StoreAndDeadLetter).await;
    assert!(
        matches!(
            &d,
            Delivery::DeadLetter {
                reason: DeadLetterReason::Terminal { stored: true, .. },
                ..
            }
        ),
        "{d:?}"
    );
    assert!(
        matches!(&duplicate, Delivery::Ack(Outcome::FailedBefore(_))),
        "{duplicate:?}"
    );
}

#[tokio::test]
async fn a_key_reused_with_another_payload_is_dead_lettered_not_acked() {
    let c = consumer(MemoryStore::new(), Policy::default());
    let runs = AtomicU32::new(0);
    let d = c
        .process(&msg("k", r#"{"amount": 5}"#), |_| counted(&runs, Ok(1)))
        .await;
    assert!(matches!(d, Delivery::Ack(_)));
    let d = c
        .process(&msg("k", r#"{"amount": 500}"#), |_| counted(&runs, Ok(2)))
        .await;
    assert!(matches!(
        d,
        Delivery::DeadLetter {
            reason: DeadLetterReason::Mismatch,
            ..
        }
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_message_without_a_key_is_dead_lettered_and_not_handled() {
    let c = consumer(MemoryStore::new(), Policy::default());
    let runs = AtomicU32::new(0);
    let d = c
        .process(&Message::new(b"{}".to_vec()), |_| counted(&runs, Ok(1)))
        .await;
    assert!(matches!(
        d,
        Delivery::DeadLetter {
            reason: DeadLetterReason::Invalid(InvalidMessage::MissingKey { .. }),
            attempt: 0
        }
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_scope_header_keeps_tenants_apart() {
    let c = Consumer::new(Idem::new(MemoryStore::new()), scope())
        .with_scope_header(IDEMPOTENCY_SCOPE_HEADER);
    let runs = AtomicU32::new(0);
    for tenant in ["tenant-a", "tenant-b"] {
        let m = msg("same-key", "{}").with_header(IDEMPOTENCY_SCOPE_HEADER, tenant);
        let d = c.process(&m, |_| counted(&runs, Ok(1))).await;
        assert!(
            matches!(d, Delivery::Ack(Outcome::Executed { .. })),
            "{d:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let d = c
        .process(&msg("same-key", "{}"), |_| counted(&runs, Ok(1)))
        .await;
    assert!(matches!(
        d,
        Delivery::DeadLetter {
            reason: DeadLetterReason::Invalid(InvalidMessage::MissingScope { .. }),
            ..
        }
    ));
}

#[tokio::test]
async fn a_store_that_is_down_means_requeue_and_the_handler_never_runs_unguarded() {
    // A store that is down: every claim fails as unreachable.
    let down = FaultyStore::new(MemoryStore::new());
    down.set_begin_down(true);
    let c = Consumer::new(Idem::new(down), scope());
    let runs = AtomicU32::new(0);
    let d = c.process(&msg("k", "{}"), |_| counted(&runs, Ok(1))).await;
    let Delivery::Requeue {
        after,
        reason: RequeueReason::Store(e),
    } = d
    else {
        panic!("{d:?}");
    };
    assert!(e.is_retryable());
    assert_eq!(after, Policy::default().unavailable_delay);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_message_whose_consumers_keep_crashing_is_dead_lettered_without_running_again() {
    let (clock, idem, c) = on_a_manual_clock(Policy::default().with_max_attempts(3));
    let m = msg("poison", "{}");
    let (id, fp) = c.identify(&m).unwrap();
    // Three consumers took the key and died holding it.
    for _ in 0..3 {
        let lease = idem.begin(&id, fp).await.unwrap();
        assert!(matches!(lease, Begin::Acquired(_) | Begin::TookOver(_)));
        clock.advance(Duration::from_secs(11));
    }
    let runs = AtomicU32::new(0);
    let d = c.process(&m, |_| counted(&runs, Ok(1))).await;
    assert!(
        matches!(
            d,
            Delivery::DeadLetter {
                reason: DeadLetterReason::Exhausted { .. },
                attempt: 3
            }
        ),
        "{d:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_takeover_counts_as_an_attempt_and_a_live_holder_means_requeue() {
    let (clock, idem, c) = on_a_manual_clock(Policy::default());
    let m = msg("crashed", "{}");
    let (id, fp) = c.identify(&m).unwrap();
    let Begin::Acquired(_) = idem.begin(&id, fp).await.unwrap() else {
        panic!()
    };
    // The holder's lease is live: requeue after its time left, capped by the policy.
    let runs = AtomicU32::new(0);
    let d = c.process(&m, |_| counted(&runs, Ok(1))).await;
    assert!(
        matches!(d, Delivery::Requeue { after, reason: RequeueReason::InFlight } if after == Duration::from_secs(5)),
        "{d:?}"
    );
    clock.advance(Duration::from_secs(8));
    let d = c.process(&m, |_| counted(&runs, Ok(1))).await;
    assert!(
        matches!(d, Delivery::Requeue { after, .. } if after == Duration::from_secs(2)),
        "{d:?}"
    );
    // The holder died: after its lease, the key is taken over as attempt 2.
    clock.advance(Duration::from_secs(3));
    let d = c.process(&m, |_| counted(&runs, Ok(1))).await;
    assert_executed(&d, 1, 2);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Two consumers (two processes) on one memory store whose renewals can be stalled, on the
/// timer's clock (for tests with `start_paused`), with 3 s leases and a 1.5 s limit on a
/// store call; the store's switches.
fn two_on_a_stallable_store() -> (Consumer, Consumer, Arc<FaultyStore>) {
    let memory = MemoryStore::with_clock(Arc::new(idem_testkit::faults::TimerClock::new()));
    let store = Arc::new(FaultyStore::new(memory));
    let config = Config::default()
        .with_lease(Duration::from_secs(3))
        .with_store_timeout(Duration::from_millis(1500));
    let scope = scope();
    let one = || {
        let idem = Idem::from_arc(store.clone()).with_config(config.clone());
        Consumer::new(idem, scope.clone())
    };
    (one(), one(), store)
}

/// A handler that counts its run, then works for 6 s and answers 1.
async fn six_seconds_of_work(runs: &AtomicU32) -> Result<u32, Failure<String>> {
    runs.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(6)).await;
    Ok(1)
}

/// What a stall of the store's renewals did to a message's two deliveries.
struct Stalled {
    /// The consumer of the first delivery.
    a: Consumer,
    store: Arc<FaultyStore>,
    m: Message,
    runs: AtomicU32,
    /// The first delivery's decision, after [`six_seconds_of_work`].
    first: Delivery<u32>,
    /// The redelivery's, to the other consumer, whose handler answers 2.
    redelivered: Delivery<u32>,
}

/// Consumer `a` runs [`six_seconds_of_work`] on the message `key` while the store's
/// renewals stall from `stall_from` to `stall_until` (`None`: past the end of the test) into
/// the work, and the other consumer gets a redelivery at `redelivery_at`. With
/// `start_paused`, to the millisecond.
async fn stall_while_working(
    key: &str,
    stall_from: Duration,
    stall_until: Option<Duration>,
    redelivery_at: Duration,
) -> Stalled {
    let (a, b, store) = two_on_a_stallable_store();
    let m = msg(key, "{}");
    let runs = AtomicU32::new(0);
    let start = tokio::time::Instant::now();
    let first = a.process(&m, |_| six_seconds_of_work(&runs));
    let redelivered = async {
        tokio::time::sleep_until(start + stall_from).await;
        store.set_extend_stalled(true);
        if let Some(until) = stall_until {
            tokio::time::sleep_until(start + until).await;
            store.set_extend_stalled(false);
        }
        tokio::time::sleep_until(start + redelivery_at).await;
        b.process(&m, |_| counted(&runs, Ok(2))).await
    };
    let (first, redelivered) = tokio::join!(first, redelivered);
    Stalled {
        a,
        store,
        m,
        runs,
        first,
        redelivered,
    }
}

/// The store stalls from 0.5 s to 2.9 s into a 3 s lease while the handler works 6 s: the
/// lease is kept, a redelivery to the other consumer at 3.2 s is handed back (requeued),
/// and the handler runs once.
#[tokio::test(start_paused = true)]
async fn a_store_stall_shorter_than_the_lease_never_costs_it() {
    let ms = Duration::from_millis;
    let stalled = stall_while_working("stall", ms(500), Some(ms(2900)), ms(3200)).await;
    assert_executed(&stalled.first, 1, 1);
    let redelivered = &stalled.redelivered;
    assert!(
        matches!(redelivered, Delivery::Requeue { .. }),
        "{redelivered:?}"
    );
    assert_eq!(stalled.runs.load(Ordering::SeqCst), 1);
}

/// The store stalls for longer than the lease while the handler works: the handler is
/// given up when the lease runs out and its message requeued, never acked; a redelivery
/// after the stall takes the key over and is acked with its value, which is what every
/// later copy, the first one's included, is acked with.
#[tokio::test(start_paused = true)]
async fn a_store_stall_longer_than_the_lease_never_acks_a_value_the_key_will_not_replay() {
    let ms = Duration::from_millis;
    let Stalled {
        a,
        store,
        m,
        runs,
        first,
        redelivered,
    } = stall_while_working("long-stall", ms(200), None, ms(4200)).await;
    assert!(matches!(first, Delivery::Requeue { .. }), "{first:?}");
    assert_executed(&redelivered, 2, 2);
    store.set_extend_stalled(false);
    let again = a.process(&m, |_| counted(&runs, Ok(3))).await;
    assert!(
        matches!(again, Delivery::Ack(Outcome::Replayed(2))),
        "{again:?}"
    );
}

#[tokio::test]
async fn a_lost_lease_cancels_the_handler_and_requeues() {
    let store = Arc::new(MemoryStore::new());
    let config = Config::default().with_lease(Duration::from_millis(150));
    let idem = Idem::from_arc(store.clone()).with_config(config);
    let c = Consumer::new(idem, scope());
    let m = msg("lost", "{}");
    let (id, _) = c.identify(&m).unwrap();
    let finished = Arc::new(AtomicU32::new(0));
    let evictor = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            // An operator evicts the record while the handler runs: the next heartbeat
            // finds the lease gone.
            store.evict(&id).await.unwrap()
        })
    };
    let f = finished.clone();
    let d = c
        .process(&m, |_| async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            f.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(1u8)
        })
        .await;
    assert!(evictor.await.unwrap());
    assert!(
        matches!(
            d,
            Delivery::Requeue {
                reason: RequeueReason::LeaseLost,
                ..
            }
        ),
        "{d:?}"
    );
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the handler was cancelled"
    );
}

#[tokio::test]
async fn a_stored_value_of_another_type_is_dead_lettered() {
    let c = consumer(MemoryStore::new(), Policy::default());
    let m = msg("typed", "{}");
    let d = c
        .process(&m, |_| async {
            Ok::<_, Failure<String>>("text".to_string())
        })
        .await;
    assert!(matches!(d, Delivery::Ack(_)));
    let d = c
        .process(&m, |_| async { Ok::<_, Failure<String>>(1u32) })
        .await;
    assert!(
        matches!(
            d,
            Delivery::DeadLetter {
                reason: DeadLetterReason::Codec(_),
                ..
            }
        ),
        "{d:?}"
    );
}

#[tokio::test]
async fn child_keys_in_the_context_are_stable_across_redeliveries() {
    let c = consumer(MemoryStore::new(), Policy::default());
    let mut m = msg("parent-key", "{}");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let d = c
            .process(&m, |ctx| {
                seen.push(ctx.child_key("send-email"));
                async { Err::<u8, _>(Failure::Retryable("smtp down")) }
            })
            .await;
        let Delivery::Nack { attempt, .. } = d else {
            panic!("{d:?}")
        };
        m = m.with_header(ATTEMPT_HEADER, attempt);
    }
    assert_eq!(seen[0], seen[1]);
    assert_eq!(
        seen[0],
        idem_consumer::child_key(&Key::new("parent-key").unwrap(), "send-email")
    );
}

/// Under `AfterRetention::Refuse`, a message redelivered after its key's stored value was
/// forgotten is dead-lettered as `Expired`, and the handler does not run again.
#[tokio::test]
async fn a_message_redelivered_after_its_retention_is_dead_lettered_under_refuse() {
    let clock = ManualClock::new();
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let config = Config::default()
        .with_retention(Duration::from_secs(60))
        .with_after_retention(idem_core::AfterRetention::Refuse);
    let c = Consumer::new(Idem::from_arc(store).with_config(config), scope());
    let runs = AtomicU32::new(0);
    let d = c
        .process(&msg("late", "{}"), |_| counted(&runs, Ok(1)))
        .await;
    assert_executed(&d, 1, 1);
    clock.advance(Duration::from_secs(61));
    let d = c
        .process(&msg("late", "{}"), |_| counted(&runs, Ok(2)))
        .await;
    assert!(
        matches!(
            d,
            Delivery::DeadLetter {
                reason: DeadLetterReason::Expired,
                ..
            }
        ),
        "{d:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
