//! For tests (feature `testing`): throwaway Redis servers (a standalone server, a replica, a
//! Redis Cluster), which are `idem-testkit`'s, the one place the workspace starts test
//! servers, re-exported here; and the scripts exactly as the store sends them.

pub use idem_testkit::redis::{
    available, binaries_available, throwaway, RedisCluster, RedisServer,
};
pub use idem_testkit::valkey;

/// The script `name` (`begin`, `complete`, `release`, `extend`, `get`, `apply`) exactly as the
/// store sends it, for tests that call a script directly.
pub fn script(name: &str) -> Option<redis::Script> {
    crate::scripts::source(name).map(|source| redis::Script::new(&source))
}
