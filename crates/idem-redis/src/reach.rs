//! Starting while Redis is down: for services whose other tier answers meanwhile (the tiered
//! store, whose PostgreSQL decides alone, and the relay, whose outbox keeps the rows).

use std::time::Duration;

use idem_core::{Error, Key, RecordId, Scope, Store as _};

use crate::{RedisStore, RedisStoreBuilder};

impl RedisStoreBuilder {
    /// Builds the store without connecting, as [`RedisStoreBuilder::connect_lazy`], and
    /// spawns a task that logs `Redis reachable` once it answers (trying every second): for
    /// a caller whose [`RedisStoreBuilder::connect`] failed with an error that
    /// [`is_unreachable`] accepts, and that starts without Redis. `name` is how the log
    /// names this Redis (without its password).
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::connect_lazy`].
    pub fn connect_later(self, name: &str) -> Result<RedisStore, Error> {
        let redis = self.connect_lazy()?;
        tokio::spawn(announce_when_reachable(redis.clone(), name.to_owned()));
        Ok(redis)
    }
}

/// Whether `error` says Redis is out of reach (nothing listening, no answer, the connection
/// dropped), as opposed to reached and refusing us (a certificate from another authority, a
/// wrong password): only the first is worth starting without it.
pub fn is_unreachable(error: &Error) -> bool {
    use std::io::ErrorKind;
    if !error.is_retryable() {
        return false;
    }
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = source {
        // redis-rs keeps an I/O error in an `Arc`, whose own `source` skips it.
        let io = cause.downcast_ref::<std::io::Error>().or_else(|| {
            cause
                .downcast_ref::<Shared>()
                .and_then(|shared| shared.downcast_ref::<std::io::Error>())
        });
        if let Some(io) = io {
            return matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::NotConnected
                    | ErrorKind::BrokenPipe
                    | ErrorKind::TimedOut
                    | ErrorKind::HostUnreachable
                    | ErrorKind::NetworkUnreachable
                    | ErrorKind::AddrNotAvailable
                    | ErrorKind::NotFound
            );
        }
        source = cause.source();
    }
    // No I/O error underneath: the call's own time limit ran out, or the server answered
    // that it cannot serve yet (LOADING, ...).
    true
}

/// Logs once Redis answers, trying every second.
async fn announce_when_reachable(redis: RedisStore, name: String) {
    let probe = RecordId::new(
        Scope::global(),
        Key::new("idem-reachability-probe").expect("a valid key"),
    );
    while redis.get(&probe).await.is_err() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tracing::info!(redis = %name, "Redis reachable");
}
