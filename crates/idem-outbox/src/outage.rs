//! [`RedisOutages`]: whether the tiered store's Redis tier answers, and the log of its
//! outages.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::telemetry::time_limit;
use idem_core::{Error, Result, Store};
use idem_redis::RedisStore;
use tokio::time::Instant;

/// How often a probe asks whether Redis answers again, during an outage.
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// Tracks the Redis tier's outages. Every call to Redis goes through
/// [`RedisOutages::call`], bounded by core's time limit; the first one that fails as
/// unavailable starts an outage, during which Redis is left out of every call until a
/// probe (one `PING` every half second) finds it back. Each outage is logged once when it
/// starts and once when it ends, with the count of begins PostgreSQL answered alone. Clones
/// share the outages.
#[derive(Debug, Clone)]
pub(crate) struct RedisOutages {
    /// How long one Redis call may take before PostgreSQL answers alone.
    limit: Duration,
    state: Arc<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Set from the first Redis call that failed as unavailable until a probe's `PING`
    /// is answered.
    down: AtomicBool,
    /// Begins answered by PostgreSQL alone during the current outage.
    without_redis: AtomicU64,
}

impl RedisOutages {
    /// No outage yet; each Redis call bounded by `limit`.
    pub(crate) fn new(limit: Duration) -> Self {
        Self {
            limit,
            state: Arc::default(),
        }
    }

    /// How long one Redis call may take.
    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }

    /// Whether an outage is under way (Redis is left out of calls).
    pub(crate) fn is_down(&self) -> bool {
        self.state.down.load(Ordering::Acquire)
    }

    /// Counts a begin PostgreSQL answered alone.
    pub(crate) fn answered_without_redis(&self) {
        self.state.without_redis.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs one call to `redis`, bounded by the limit; one that fails as unavailable starts
    /// an outage.
    pub(crate) async fn call<T>(
        &self,
        redis: &RedisStore,
        call: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let result = time_limit(redis.name(), self.limit, call).await;
        if let Err(e) = &result {
            if e.is_retryable() {
                self.start(redis, e);
            }
        }
        result
    }

    /// Starts an outage (once): logs it and spawns the probe that ends it.
    fn start(&self, redis: &RedisStore, error: &Error) {
        let state = &self.state;
        if state.down.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(%error, "Redis unavailable: PostgreSQL answers alone until Redis is back");
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing can probe: the next call tries Redis again.
            state.down.store(false, Ordering::Release);
            return;
        };
        let (redis, state, limit) = (redis.clone(), state.clone(), self.limit);
        runtime.spawn(async move {
            let started = Instant::now();
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                if time_limit(redis.name(), limit, redis.ping()).await.is_ok() {
                    break;
                }
            }
            state.down.store(false, Ordering::Release);
            let without_redis = state.without_redis.swap(0, Ordering::AcqRel);
            tracing::warn!(
                outage = ?started.elapsed(),
                begins_without_redis = without_redis,
                "Redis is back: {without_redis} begins were answered by PostgreSQL alone"
            );
        });
    }
}
