//! The Redis backend: the conformance suite on one server (`redis`, against
//! `IDEM_TEST_REDIS_URL`) and on a 3-primary Redis Cluster this test binary starts
//! (`redis_cluster`); the same on Valkey 9.1, which takes the compare-and-set path
//! (`valkey`, `valkey_cluster`), and on a Valkey whose users may not run scripts
//! (`valkey_noscripts`); and the Redis-specific tests: memory per record, script cache loss
//! and server restarts under load, `WAIT` against a real replica, eviction-policy and OOM
//! handling, and a race counting executions.
//!
//! Tests that restart, flush, reconfigure or need replicas start their own `redis-server`
//! processes (the binaries on `PATH`) on free loopback ports and stop them afterwards.

mod common;

use std::sync::Arc;

use idem_core::Store;
use idem_redis::{RedisStore, RedisStoreBuilder};

use common::patient_builder;

/// A key prefix of its own for every store, so tests share a server without meeting.
fn prefix() -> String {
    format!("idem-test-{}:", uuid::Uuid::new_v4().simple())
}

/// A store builder with a prefix of its own and patient timeouts ([`patient_builder`]).
/// The unreachable cases keep the defaults.
fn builder(url: &str) -> RedisStoreBuilder {
    patient_builder(url, "idem-test")
}

/// A store pointed at a port nothing listens on.
async fn closed_port_store(url: String) -> Arc<dyn Store> {
    Arc::new(
        RedisStore::builder(url)
            .with_prefix(prefix())
            .connect_lazy()
            .expect("a lazy store builds without a server"),
    )
}

/// A store on one server nothing listens on.
async fn unreachable_one() -> Arc<dyn Store> {
    let port = idem_testkit::harness::refused_port();
    closed_port_store(format!("redis://127.0.0.1:{port}")).await
}

/// A store on a cluster whose nodes nothing listens on.
async fn unreachable_cluster() -> Arc<dyn Store> {
    let (a, b) = (
        idem_testkit::harness::refused_port(),
        idem_testkit::harness::refused_port(),
    );
    closed_port_store(format!("redis+cluster://127.0.0.1:{a},127.0.0.1:{b}")).await
}

/// What `start` answers, run off the async runtime: starting servers takes seconds.
async fn started<T: Send + 'static>(start: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(start).await.expect("start")
}

/// A store on the cluster `cluster` starts on first use, with `scripting`; `None` when its
/// servers are missing.
async fn cluster_store(
    cluster: fn() -> Option<&'static idem_testkit::redis::RedisCluster>,
    scripting: idem_redis::Scripting,
) -> Option<Arc<dyn Store>> {
    let url = started(move || cluster().map(|c| c.url())).await?;
    let store = builder(&url)
        .with_scripting(scripting)
        .connect()
        .await
        .expect("connect to the cluster");
    assert!(store.is_cluster());
    Some(Arc::new(store))
}

/// The conformance suite on the module's `store()`, its unreachable case on a store made by
/// `$unreachable` (one of [`unreachable_one`] and [`unreachable_cluster`]); with `notifies`,
/// the checks that a waiter answers within milliseconds of the completion, and a reader of
/// an append, too.
macro_rules! suite {
    ($unreachable:ident) => {
        async fn unreachable() -> Arc<dyn Store> {
            $unreachable().await
        }

        idem_testkit::conformance_suite!(store, unreachable = unreachable, stats);
    };
    ($unreachable:ident, notifies) => {
        suite!($unreachable);
        idem_testkit::conformance_suite!(store, notifies);
    };
}

mod redis {
    //! One server: `IDEM_TEST_REDIS_URL`, and throwaway servers for the Redis-only tests.
    use super::*;

    async fn store() -> Option<Arc<dyn Store>> {
        let url = idem_testkit::harness::redis_url()?;
        Some(Arc::new(
            builder(&url)
                .connect()
                .await
                .expect("connect to IDEM_TEST_REDIS_URL"),
        ))
    }

    // Pub/sub wakes waiters and readers.
    suite!(unreachable_one, notifies);

    pub(crate) mod specific;
}

mod redis_cluster {
    //! A 3-primary Redis Cluster started by this test binary.
    use super::common::redis_cluster as cluster;
    use super::*;

    async fn store() -> Option<Arc<dyn Store>> {
        cluster_store(cluster, idem_redis::Scripting::Auto).await
    }

    // Sharded pub/sub wakes waiters and readers, with the record on any of the primaries.
    suite!(unreachable_cluster, notifies);

    mod specific;
}

mod valkey {
    //! One Valkey server, started by this test binary: every transition a plain command.
    use std::sync::OnceLock;

    use idem_redis::Scripting;
    use idem_testkit::{redis::RedisServer, valkey};

    use super::*;

    fn server() -> Option<&'static RedisServer> {
        static SERVER: OnceLock<Option<RedisServer>> = OnceLock::new();
        SERVER.get_or_init(|| valkey::throwaway(&[])).as_ref()
    }

    async fn url() -> Option<String> {
        started(|| server().map(RedisServer::url)).await
    }

    async fn store() -> Option<Arc<dyn Store>> {
        let url = url().await?;
        Some(Arc::new(
            builder(&url)
                .with_scripting(Scripting::NoScripts)
                .connect()
                .await
                .expect("connect to valkey without scripts"),
        ))
    }

    // Pub/sub wakes waiters of a completion made without scripts, and readers.
    suite!(unreachable_one, notifies);

    /// A restart of the server under load: `Unavailable` while it is down, and every
    /// call started after it is back succeeds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_restart() {
        let Some(server) = started(|| valkey::throwaway(&[])).await else {
            return;
        };
        super::redis::specific::outages::restart(server).await;
    }

    /// 2000 keys, 24 concurrent callers each: the work runs once per key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn race_exactly_once_per_key() {
        let Some(url) = url().await else { return };
        let store: Arc<dyn Store> = Arc::new(builder(&url).connect().await.unwrap());
        super::redis::specific::fencing::race(store, 2000, 24).await;
    }

    /// A lease without its version, and the records of a takeover, without scripts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leases_without_a_version_and_takeovers() {
        let Some(url) = url().await else { return };
        let store = builder(&url).connect().await.unwrap();
        super::redis::specific::fencing::versionless_leases_on(&store).await;
    }

    /// An instance on scripts and one on the commands, racing over the same keys.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_on_both_paths() {
        let Some(url) = url().await else { return };
        super::redis::specific::fencing::two_instances(&url).await;
    }
}

mod valkey_noscripts {
    //! A Valkey whose default user may not run scripts (an ACL without `@scripting`), as
    //! managed services configure it: the store's default `Scripting::Auto` sends none.
    use std::sync::OnceLock;

    use idem_testkit::{redis::RedisServer, valkey};

    use super::*;

    fn server() -> Option<&'static RedisServer> {
        static SERVER: OnceLock<Option<RedisServer>> = OnceLock::new();
        SERVER
            .get_or_init(|| {
                let server = valkey::throwaway(&[])?;
                server
                    .cli(&["ACL", "SETUSER", "default", "-@scripting"])
                    .expect("take scripting from the default user");
                Some(server)
            })
            .as_ref()
    }

    async fn store() -> Option<Arc<dyn Store>> {
        let url = started(|| server().map(RedisServer::url)).await?;
        Some(Arc::new(
            builder(&url).connect().await.expect("connect to valkey"),
        ))
    }

    suite!(unreachable_one);

    /// The server refuses scripts indeed, so the suite above ran without any.
    #[tokio::test]
    async fn scripts_are_refused() {
        let Some(server) = started(server).await else {
            return;
        };
        let client = ::redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let refused = ::redis::cmd("EVAL")
            .arg("return 1")
            .arg(0)
            .query_async::<i64>(&mut conn)
            .await
            .expect_err("EVAL ran");
        assert!(refused.to_string().contains("no permissions"), "{refused}");
    }
}

mod valkey_cluster {
    //! A 3-primary Valkey cluster started by this test binary.
    use std::sync::OnceLock;

    use idem_redis::Scripting;
    use idem_testkit::{redis::RedisCluster, valkey};

    use super::*;

    fn cluster() -> Option<&'static RedisCluster> {
        static CLUSTER: OnceLock<Option<RedisCluster>> = OnceLock::new();
        CLUSTER.get_or_init(|| valkey::cluster(3)).as_ref()
    }

    async fn store() -> Option<Arc<dyn Store>> {
        cluster_store(cluster, Scripting::NoScripts).await
    }

    // Sharded pub/sub without scripts: `SPUBLISH` behind the completion and the append.
    suite!(unreachable_cluster, notifies);

    /// Thousands of callers racing over keys on all three primaries: once per key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn race_across_primaries() {
        let Some(store) = store().await else { return };
        super::redis::specific::fencing::race(store, 1000, 16).await;
    }
}
