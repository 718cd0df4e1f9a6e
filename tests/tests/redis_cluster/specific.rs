//! Redis Cluster only: records spread over the primaries, the race across nodes, scripts
//! flushed on every node mid-load, and `WAIT` routed to the record's primary.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Fingerprint, Key, RecordId, Scope, Store};
use idem_redis::ReplicationError;

use super::super::{builder, started};
use super::cluster;
use crate::redis::specific::fencing::race;
use crate::redis::specific::{acquire, new_id, try_begin, unavailable_source};

async fn cluster_store() -> Option<(
    idem_redis::RedisStore,
    &'static idem_testkit::redis::RedisCluster,
)> {
    let cluster = started(cluster).await?;
    let store = builder(&cluster.url()).connect().await.expect("connect");
    Some((store, cluster))
}

/// Thousands of callers racing over keys on all three primaries: one execution per key;
/// and the keys did land on every primary (the hash tag spreads them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn race_across_primaries() {
    let Some((store, cluster)) = cluster_store().await else {
        return;
    };
    let prefix = store.config().prefix.clone();
    let store: Arc<dyn Store> = Arc::new(store);
    race(store, 600, 16).await;
    for node in cluster.nodes() {
        let keys = node
            .cli(&["--scan", "--pattern", &format!("{prefix}*")])
            .expect("scan");
        assert!(
            keys.lines().count() > 50,
            "node {} holds {} of 600 keys",
            node.port(),
            keys.lines().count()
        );
    }
}

/// `SCRIPT FLUSH` on every node while calls run: no call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn script_flush_on_every_node() {
    let Some((store, cluster)) = cluster_store().await else {
        return;
    };
    let store: Arc<dyn Store> = Arc::new(store);
    let load = tokio::spawn(race(store, 300, 8));
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        started(move || {
            for node in cluster.nodes() {
                node.cli(&["script", "flush"]).expect("script flush");
            }
        })
        .await;
    }
    load.await.expect("no call failed");
}

/// `WAIT` goes to the record's primary and its count is checked: these primaries have no
/// replicas, so asking for one fails clearly and gives the lease back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_without_replicas_fails_clearly() {
    let Some((_, cluster)) = cluster_store().await else {
        return;
    };
    let store = builder(&cluster.url())
        .with_durability(1, Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let id = new_id("k");
    let e: ReplicationError = unavailable_source(try_begin(&store, &id).await);
    assert_eq!((e.acked, e.wanted), (0, 1));
    assert!(store.get(&id).await.unwrap().is_none());
}

/// A waiter's shard subscription follows its record's slot: while it waits, the slot moves
/// to another primary (the keys migrated, then `CLUSTER SETSLOT NODE`, as a resharding
/// does; the old primary drops the slot's subscriptions), and the completion on the new
/// primary still wakes it, long before its safety-net poll. On a cluster of its own, so
/// that moving a slot disturbs no other test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_follows_a_moved_slot() {
    use idem_core::{Begin, Completion, Config, Idem, Response};
    use idem_testkit::redis::RedisCluster;

    if !idem_testkit::redis::available() {
        return;
    }
    let cluster = started(|| RedisCluster::start(3).map(Arc::new))
        .await
        .expect("start a 3-primary cluster");
    let store = builder(&cluster.url()).connect().await.expect("connect");
    let safety_poll = Duration::from_secs(10);
    let idem = Idem::new(store.clone()).with_config(
        Config::default()
            .with_wait(Duration::from_secs(60))
            .with_safety_poll(safety_poll)
            .with_max_poll(safety_poll),
    );
    let id = RecordId::new(Scope::new("moved").unwrap(), Key::new("slot").unwrap());
    let lease = acquire(&store, &id).await;
    let waiter = idem_testkit::cases::spawn_waiter(&idem, &id, Fingerprint::of_bytes(b"f"));
    // The waiter finds the key in flight and subscribes on the slot's primary.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the waiter did not wait");

    let (moved, on) = (store.record_key(&id), cluster.clone());
    started(move || {
        let nodes = on.nodes();
        let trim = |s: String| s.trim().to_owned();
        let slot = trim(nodes[0].cli(&["cluster", "keyslot", &moved]).unwrap());
        let owns = |n: &idem_testkit::redis::RedisServer| {
            trim(n.cli(&["cluster", "countkeysinslot", &slot]).unwrap()) == "1"
        };
        let from = nodes
            .iter()
            .find(|n| owns(n))
            .expect("the record's primary");
        let to = nodes
            .iter()
            .find(|n| n.port() != from.port())
            .expect("another primary");
        let to_id = trim(to.cli(&["cluster", "myid"]).unwrap());
        let from_id = trim(from.cli(&["cluster", "myid"]).unwrap());
        let port = to.port().to_string();
        let migrate = vec![
            "migrate",
            "127.0.0.1",
            &port,
            "",
            "0",
            "5000",
            "keys",
            &moved,
        ];
        for (node, args) in [
            (to, vec!["cluster", "setslot", &slot, "importing", &from_id]),
            (from, vec!["cluster", "setslot", &slot, "migrating", &to_id]),
            (from, migrate),
            (to, vec!["cluster", "setslot", &slot, "node", &to_id]),
            (from, vec!["cluster", "setslot", &slot, "node", &to_id]),
        ] {
            let out = node.cli(&args).unwrap();
            assert!(out.trim() == "OK", "{args:?}: {out}");
        }
        assert!(owns(to), "the record did not move");
    })
    .await;
    // The old primary dropped the subscription: it is made again on the new one, and the
    // waiter, woken, finds the record still in flight and waits on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "the waiter stopped waiting");

    let completion = Completion::succeeded(Response::new(200, "moved"));
    store
        .complete(&lease, &completion, Duration::from_secs(600))
        .await
        .expect("complete on the new primary");
    let completed = tokio::time::Instant::now();
    let (answer, answered) = idem_testkit::cases::answer_of(waiter, Duration::from_secs(30)).await;
    match answer {
        Begin::Replay(replay) => assert_eq!(replay.completion.response.body, "moved"),
        other => panic!("expected Replay, got {other:?}"),
    }
    let after = answered.saturating_duration_since(completed);
    assert!(
        after < safety_poll / 4,
        "answered {after:?} after the completion: not notified (safety poll {safety_poll:?})"
    );
}
