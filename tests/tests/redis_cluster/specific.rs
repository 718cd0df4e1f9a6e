//! Redis Cluster only: records spread over the primaries, the race across nodes, scripts
//! flushed on every node mid-load, and `WAIT` routed to the record's primary.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{BeginRequest, Error, FencingToken, Fingerprint, Key, RecordId, Scope, Store};
use idem_redis::ReplicationError;

use super::super::builder;
use super::cluster;

async fn cluster_store() -> Option<(idem_redis::RedisStore, &'static idem_redis::testing::RedisCluster)> {
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster start")?;
    let store = builder(&cluster.url()).connect().await.expect("connect");
    Some((store, cluster))
}

fn request(id: &RecordId) -> BeginRequest<'_> {
    BeginRequest {
        id,
        fingerprint: Fingerprint::of_bytes(b"f"),
        token: FencingToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(600),
    }
}

/// Thousands of callers racing over keys on all three primaries: one execution per key;
/// and the keys did land on every primary (the hash tag spreads them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn race_across_primaries() {
    let Some((store, cluster)) = cluster_store().await else { return };
    let prefix = store.config().prefix.clone();
    let store: Arc<dyn Store> = Arc::new(store);
    crate::redis::specific::race(store, 600, 16).await;
    for node in cluster.nodes() {
        let keys = node
            .cli(&["--scan", "--pattern", &format!("{prefix}*")])
            .expect("scan");
        assert!(keys.lines().count() > 50, "node {} holds {} of 600 keys", node.port(), keys.lines().count());
    }
}

/// `SCRIPT FLUSH` on every node while calls run: no call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn script_flush_on_every_node() {
    let Some((store, cluster)) = cluster_store().await else { return };
    let store: Arc<dyn Store> = Arc::new(store);
    let load = tokio::spawn(crate::redis::specific::race(store, 300, 8));
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        tokio::task::spawn_blocking(move || {
            for node in cluster.nodes() {
                node.cli(&["script", "flush"]).expect("script flush");
            }
        })
        .await
        .unwrap();
    }
    load.await.expect("no call failed");
}

/// `WAIT` goes to the record's primary and its count is checked: these primaries have no
/// replicas, so asking for one fails clearly and gives the lease back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_without_replicas_fails_clearly() {
    let Some((_, cluster)) = cluster_store().await else { return };
    let store = builder(&cluster.url())
        .with_durability(1, Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let id = RecordId::new(Scope::new("wait").unwrap(), Key::new(format!("k-{}", uuid::Uuid::new_v4())).unwrap());
    match store.begin(request(&id)).await {
        Err(Error::Unavailable { source, .. }) => {
            let e = source.downcast_ref::<ReplicationError>().expect("replication error");
            assert_eq!((e.acked, e.wanted), (0, 1));
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(store.get(&id).await.unwrap().is_none());
}
