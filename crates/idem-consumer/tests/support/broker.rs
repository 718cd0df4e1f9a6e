//! The worker tests that read the same on every broker, written once against
//! [`TestBroker`]; each broker's test file implements it and runs them. Without the broker's
//! server a test prints why and returns, or fails when `IDEM_TEST_REQUIRE_BACKENDS=1`. The
//! crash test runs worker *processes* (the test binary again, running the ignored test
//! `child_worker_process`) that share their store in Redis (`IDEM_TEST_REDIS_URL`, see
//! [`SharedStore`]); the store-outage test stops a Redis server of its own.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idem_consumer::{Consumer, Policy, Summary};
use idem_core::{Idem, MemoryStore, Scope, Store};
use idem_redis::RedisStore;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout, Instant};

use super::{
    check_crash, counting, failing, retry_keys, start_and_kill_a, start_b, stop_child, wait_until,
    ChildFiles, ChildSetup, Effects, Handler, Runs, SharedStore, CHILD_CONCURRENCY,
    CHILD_REDELIVERY, CRASH_MESSAGES,
};

/// A broker with a fresh topology of one test's own, as the shared tests use it.
pub trait TestBroker: Sized {
    /// Fresh streams or queues named after `test`, declared; the broker delivers a message
    /// that is not acked again after `redelivery` where it has such a setting (`ack_wait`,
    /// the claim idle time). `None` when no server is configured.
    async fn open(test: &str, redelivery: Duration) -> Option<Self>;
    /// Publishes `payload` with `key` propagated, and waits for the broker's confirmation.
    async fn publish(&self, key: &str, payload: &str);
    /// The worker `spawn` says, on a connection of its own, until `stop`.
    fn worker(&self, spawn: Spawn, stop: Stop) -> Running;
    /// Runs [`TestBroker::worker`] in a task.
    fn spawn_worker(&self, consumer: Consumer, tuning: Tuning, handler: Handler) -> RunningWorker {
        let spawn = Spawn {
            consumer,
            tuning,
            handler,
        };
        RunningWorker::spawn(|stop| self.worker(spawn, stop))
    }
    /// The broker and topology of a crash test's child process, from the environment
    /// [`TestBroker::child_env`] gave it.
    async fn from_child_env() -> Self;
    /// Messages not yet settled: waiting for a worker, or (where the broker tells) delivered
    /// and not acked yet.
    async fn unsettled(&self) -> u64;
    /// How many dead letters there are.
    async fn dead_letter_count(&self) -> u64;
    /// The dead letters, as key -> (reason, attempt).
    async fn dead_letters(&self) -> BTreeMap<String, (String, String)>;
    /// Once `messages` (copies included) are all settled: what the broker shows of them,
    /// where it keeps them.
    async fn check_all_acked(&self, _messages: u64) {}
    /// Once the long handler's message is settled: that the broker delivered it once, where
    /// it tells.
    async fn check_delivered_once(&self) {}
    /// Where a crash test's child process finds the broker and the topology.
    fn child_env(&self) -> Vec<(&'static str, String)>;
    /// After a crash test, what the broker still holds, checked over the store the worker
    /// processes shared.
    async fn check_after_crash(&self, _shared: &SharedStore) {}
    /// Deletes the topology.
    async fn delete(&self);
}

/// A worker's settings in a test: handlers at once, and messages per read (where the worker
/// reads in batches; RabbitMQ's prefetch, at least twice the concurrency). The defaults are
/// the workers' own.
#[derive(Clone, Copy)]
pub struct Tuning {
    pub concurrency: usize,
    pub batch: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        tuning(4, 16)
    }
}

/// A test worker: one of `consumer` with `tuning`, running `handler`.
pub struct Spawn {
    pub consumer: Consumer,
    pub tuning: Tuning,
    pub handler: Handler,
}

/// Completes when a [`RunningWorker`] is told to stop.
pub type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;
/// A test worker's run, to what it did.
pub type Running = Pin<Box<dyn Future<Output = Summary> + Send>>;

/// The body of a [`TestBroker::worker`]: the worker `$worker` makes of the spawn's consumer
/// and tuning (bound to the names given) runs the spawn's handler on the connection that
/// `$connect` (a future) makes, until `$stop`; the test fails if the worker fails.
macro_rules! run_test_worker {
    ($spawn:expr, $stop:expr, $connect:expr, |$consumer:ident, $tuning:ident| $worker:expr) => {{
        let $crate::support::Spawn {
            consumer: $consumer,
            tuning: $tuning,
            handler,
        } = $spawn;
        let (worker, connect, stop) = ($worker, $connect, $stop);
        let running: $crate::support::Running = Box::pin(async move {
            let conn = connect.await;
            let run = worker.run(&conn, move |m, c| handler(m, c), stop).await;
            run.expect("the worker runs")
        });
        running
    }};
}
pub(crate) use run_test_worker;

pub fn tuning(concurrency: usize, batch: usize) -> Tuning {
    Tuning { concurrency, batch }
}

/// A worker running in a task until [`RunningWorker::stop`].
pub struct RunningWorker {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Summary>,
}

impl RunningWorker {
    /// Runs `run` in a task: a worker, given the future that says when to stop.
    pub fn spawn<F>(run: impl FnOnce(Stop) -> F) -> Self
    where
        F: Future<Output = Summary> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(Box::pin(async move {
            let _ = stopped.await;
        })));
        Self { stop, task }
    }

    /// Tells the worker to stop and returns its summary once it has shut down (within 30 s).
    pub async fn stop(self) -> Summary {
        let _ = self.stop.send(());
        timeout(Duration::from_secs(30), self.task)
            .await
            .expect("clean shutdown")
            .expect("no panic")
    }
}

/// The worker process of a crash test ([`a_killed_worker_process_loses_nothing`]); does
/// nothing unless that test spawned it.
pub async fn child_worker_process<B: TestBroker>() {
    let Some(child) = ChildSetup::from_env() else {
        return;
    };
    let spawn = Spawn {
        consumer: child.consumer.clone(),
        tuning: tuning(CHILD_CONCURRENCY, CHILD_CONCURRENCY),
        handler: child.handler.clone(),
    };
    let broker = B::from_child_env().await;
    child.report(&broker.worker(spawn, Box::pin(child.stopped())).await);
}

/// Waits until the broker has had no unsettled message for 500 ms.
pub async fn wait_until_settled(broker: &impl TestBroker, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut settled_since: Option<Instant> = None;
    loop {
        if broker.unsettled().await > 0 {
            settled_since = None;
        } else if settled_since.get_or_insert_with(Instant::now).elapsed()
            >= Duration::from_millis(500)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the messages were not all settled"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `effects` has an effect for `n` keys.
async fn wait_for_effects(effects: &Effects, n: usize, what: &str) {
    wait_until(Duration::from_secs(60), what, || {
        let effects = effects.clone();
        async move { effects.lock().unwrap().len() == n }
    })
    .await;
}

/// Each message published 5 times and consumed by 4 concurrent workers (on their own
/// connections, sharing a store): one side effect per message, every copy acked, nothing
/// dead-lettered.
pub async fn five_copies_to_four_workers<B: TestBroker>(redelivery: Duration) {
    let Some(broker) = B::open("copies", redelivery).await else {
        return;
    };
    let broker = &broker;
    const N: u32 = 20;
    for _copy in 0..5 {
        for i in 0..N {
            let payload = format!(r#"{{"order": {i}}}"#);
            broker.publish(&format!("order-{i}"), &payload).await;
        }
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let consumer = Consumer::new(Idem::from_arc(store), Scope::new("copies-test").unwrap())
        .with_policy(Policy::default().with_max_in_flight_delay(Duration::from_millis(100)));
    let effects: Effects = Arc::default();
    let mut workers = Vec::new();
    for _ in 0..4 {
        let handler = counting(&effects, Duration::from_millis(20));
        workers.push(broker.spawn_worker(consumer.clone(), tuning(3, 16), handler));
    }
    wait_for_effects(&effects, N as usize, "every order has its effect").await;
    wait_until_settled(broker, Duration::from_secs(60)).await;
    let mut acked = 0;
    for worker in workers {
        let summary = worker.stop().await;
        assert_eq!(summary.dead_lettered + summary.retried, 0, "{summary:?}");
        acked += summary.acked;
    }
    for (key, count) in effects.lock().unwrap().iter() {
        assert_eq!(*count, 1, "{key} had its effect {count} times");
    }
    assert_eq!(acked, u64::from(5 * N), "every copy was acked");
    broker.check_all_acked(u64::from(5 * N)).await;
    assert_eq!(broker.dead_letter_count().await, 0);
    broker.delete().await;
}

/// A handler that fails transiently succeeds in the end, once; one that always fails is
/// dead-lettered after the policy's attempts, and one that fails for good at once; each dead
/// letter says why, and how many attempts it had.
pub async fn transient_failures_retry_and_permanent_ones_are_dead_lettered<B: TestBroker>(
    redelivery: Duration,
) {
    let Some(broker) = B::open("retries", redelivery).await else {
        return;
    };
    let broker = &broker;
    let (flaky, broken) = retry_keys();
    for key in flaky.iter().chain(&broken) {
        broker.publish(key, "{}").await;
    }
    broker.publish("declined", "{}").await;
    let consumer = Consumer::new(
        Idem::new(MemoryStore::new()),
        Scope::new("retry-test").unwrap(),
    )
    // 3 attempts, 200 ms then 400 ms apart.
    .with_policy(
        Policy::default()
            .with_max_attempts(3)
            .with_retry_delay(Duration::from_millis(200))
            .with_max_retry_delay(Duration::from_millis(400)),
    );
    let runs: Runs = Arc::default();
    let effects: Effects = Arc::default();
    let worker = broker.spawn_worker(consumer, tuning(2, 16), failing(&runs, &effects));
    wait_until(Duration::from_secs(60), "4 dead letters", || async {
        broker.dead_letter_count().await == 4
    })
    .await;
    wait_for_effects(&effects, 5, "the flaky ones succeed").await;
    wait_until_settled(broker, Duration::from_secs(30)).await;
    let summary = worker.stop().await;
    // Every retried key ran 3 times, with the policy's backoff between attempts; the flaky
    // ones had their effect once; `declined` ran once.
    let runs = runs.lock().unwrap().clone();
    let attempts = |key: &str| runs[key].iter().map(|(a, _)| *a).collect::<Vec<_>>();
    for key in flaky.iter().chain(&broken) {
        assert_eq!(attempts(key), vec![1, 2, 3], "{key}");
        let at: Vec<_> = runs[key].iter().map(|(_, t)| *t).collect();
        assert!(at[1] - at[0] >= Duration::from_millis(190), "{key}: {at:?}");
        assert!(at[2] - at[1] >= Duration::from_millis(390), "{key}: {at:?}");
    }
    for key in &flaky {
        assert_eq!(effects.lock().unwrap()[key], 1, "{key}");
    }
    assert_eq!(
        attempts("declined"),
        vec![1],
        "a terminal failure is not retried"
    );
    assert_eq!(summary.retried, 5 * 2 + 3 * 2, "{summary:?}");
    assert_eq!(summary.dead_lettered, 4, "{summary:?}");
    assert_eq!(summary.acked, 5, "{summary:?}");
    // The 9 originals and 16 retry copies, all acked.
    broker.check_all_acked(9 + 16).await;
    // The three broken keys exhausted after 3 attempts, `declined` terminal.
    let dead = broker.dead_letters().await;
    assert_eq!(dead.len(), 4, "{dead:?}");
    for key in &broken {
        let (reason, attempt) = &dead[key];
        assert!(reason.starts_with("attempts exhausted"), "{reason}");
        assert_eq!(attempt, "3");
    }
    assert_eq!(dead["declined"].0, "terminal failure: card declined");
    broker.delete().await;
}

/// With the store down, the worker runs no handler and acks nothing: every message stays
/// on the broker. When the store is back, each is processed once.
pub async fn a_store_outage_acks_nothing_and_loses_nothing<B: TestBroker>(redelivery: Duration) {
    let Some(broker) = B::open("outage", redelivery).await else {
        return;
    };
    let broker = &broker;
    let Some(mut redis) = idem_testkit::redis::throwaway(&[]) else {
        return;
    };
    const N: u32 = 8;
    for i in 0..N {
        broker.publish(&format!("job-{i}"), "{}").await;
    }
    let store = RedisStore::builder(redis.url())
        .connect_lazy()
        .expect("a Redis store");
    redis.stop();
    let consumer = Consumer::new(Idem::new(store), Scope::new("outage-test").unwrap())
        .with_policy(Policy::default().with_unavailable_delay(Duration::from_millis(200)));
    let effects: Effects = Arc::default();
    let worker = broker.spawn_worker(
        consumer,
        Tuning::default(),
        counting(&effects, Duration::ZERO),
    );
    sleep(Duration::from_secs(3)).await;
    assert!(
        effects.lock().unwrap().is_empty(),
        "no handler ran unguarded"
    );
    assert_eq!(
        broker.unsettled().await,
        u64::from(N),
        "every message is still there, none acked"
    );

    redis.start_again().expect("the store is back");
    wait_for_effects(&effects, N as usize, "every job has its effect").await;
    wait_until_settled(broker, Duration::from_secs(30)).await;
    let summary = worker.stop().await;
    for (key, count) in effects.lock().unwrap().iter() {
        assert_eq!(*count, 1, "{key} had its effect {count} times");
    }
    assert!(summary.requeued >= u64::from(N), "{summary:?}");
    assert_eq!(summary.acked, u64::from(N), "{summary:?}");
    broker.delete().await;
}

/// A handler that runs for four times `redelivery` keeps its message: the worker's signs
/// of life stop the broker from handing it to the other worker waiting for messages
/// (which would hand it back, the key being held).
pub async fn a_long_handler_keeps_its_message<B: TestBroker>(redelivery: Duration) {
    let Some(broker) = B::open("long", redelivery).await else {
        return;
    };
    let broker = &broker;
    broker.publish("slow-1", "{}").await;
    let consumer = Consumer::new(
        Idem::new(MemoryStore::new()),
        Scope::new("long-test").unwrap(),
    );
    let effects: Effects = Arc::default();
    let mut workers = Vec::new();
    for _ in 0..2 {
        let handler = counting(&effects, redelivery * 4);
        workers.push(broker.spawn_worker(consumer.clone(), tuning(4, 1), handler));
    }
    wait_for_effects(&effects, 1, "the handler finishes").await;
    wait_until_settled(broker, Duration::from_secs(30)).await;
    let mut total = Summary::default();
    for worker in workers {
        let summary = worker.stop().await;
        total.acked += summary.acked;
        total.requeued += summary.requeued;
    }
    assert_eq!((total.acked, total.requeued), (1, 0), "{total:?}");
    broker.check_delivered_once().await;
    broker.delete().await;
}

/// Kill a worker process (SIGKILL, the child test `child`) while its handlers hold keys:
/// the broker delivers their messages to another worker process, which hands them back
/// while the dead worker's leases hold, then takes the keys over. Every message is handled
/// exactly once and none is lost.
pub async fn a_killed_worker_process_loses_nothing<B: TestBroker>(child: &str) {
    let Some(shared) = SharedStore::for_test() else {
        return;
    };
    let Some(broker) = B::open("crash", CHILD_REDELIVERY).await else {
        return;
    };
    for _copy in 0..2 {
        for i in 0..CRASH_MESSAGES {
            let payload = format!("{{\"i\":{i}}}");
            broker.publish(&format!("msg-{i}"), &payload).await;
        }
    }
    let files = ChildFiles::new();
    let mut env = broker.child_env();
    env.push(("IDEM_CHILD_STORE", shared.descriptor()));
    // Process A works a few messages, then its handlers hang holding their keys, and it is
    // killed; process B handles everything else, and A's messages once their leases expire.
    let hung = start_and_kill_a(&files, child, &env).await;
    let mut b = start_b(&files, child, &env).await;
    wait_until_settled(&broker, Duration::from_secs(60)).await;
    let summary = stop_child(&files, &mut b, "B").await;
    check_crash(&files, &hung, &summary);
    assert_eq!(broker.dead_letter_count().await, 0);
    broker.check_after_crash(&shared).await;
    broker.delete().await;
}

/// The shared tests for the [`TestBroker`] `$broker`, in a module named after the broker
/// (`$module`, so that `cargo test nats` runs one broker's), with the broker's redelivery
/// time for each; the first three run on every broker.
macro_rules! broker_tests {
    (
        $module:ident: $broker:ty,
        retries: $retries:expr
        $(, copies: $copies:expr, outage: $outage:expr, long: $long:expr)?
    ) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn transient_failures_retry_and_permanent_ones_are_dead_lettered() {
            use $crate::support::transient_failures_retry_and_permanent_ones_are_dead_lettered;
            transient_failures_retry_and_permanent_ones_are_dead_lettered::<$broker>($retries).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "the worker process of the crash test; runs only when that test spawns it"]
        async fn child_worker_process() {
            $crate::support::child_worker_process::<$broker>().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_killed_worker_process_loses_nothing() {
            let child = concat!(stringify!($module), "::child_worker_process");
            $crate::support::a_killed_worker_process_loses_nothing::<$broker>(child).await;
        }
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn five_copies_to_four_workers_have_one_effect() {
                $crate::support::five_copies_to_four_workers::<$broker>($copies).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_store_outage_acks_nothing_and_loses_nothing() {
                use $crate::support::a_store_outage_acks_nothing_and_loses_nothing as test;
                test::<$broker>($outage).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_long_handler_keeps_its_message() {
                $crate::support::a_long_handler_keeps_its_message::<$broker>($long).await;
            }
        )?
    };
}
pub(crate) use broker_tests;
