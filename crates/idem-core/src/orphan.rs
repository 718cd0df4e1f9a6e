//! Claims whose answer never reached the caller, given back once the store answers again.
//!
//! A `begin` that fails as unavailable (it timed out per [`crate::Config::store_timeout`],
//! or its connection dropped) may still land: a paused server runs it when it resumes. The
//! record is then held under a token nobody holds, and every retry of the key gets
//! `InFlight` until the lease expires, although no work ever ran. The engine knows the token
//! it sent (tokens are drawn by the caller), so it gives such a claim back by that token, in
//! a task of its own, once the store answers again. A claim that never landed makes that
//! release a no-op ([`Error::LeaseLost`]): the token is fresh, so it can match nothing else.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::error::Error;
use crate::key::RecordId;
use crate::record::{FencingToken, Lease};
use crate::store::Store;
use crate::telemetry::{time_limit, KeyHash};

/// Releases in progress at most, per engine: past that, an orphan claim is left to expire
/// with its lease (an outage under heavy load must not turn into a flood of tasks, nor
/// into a burst of releases when the store comes back).
const MAX_PENDING: usize = 1024;
/// The first pause between two tries; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(2);
/// How long the store must keep answering that no such claim exists before the task
/// believes it. The begin that timed out may reach the store after the release does (a
/// pool sends them on different connections), so one answer is not enough.
const SETTLE: Duration = Duration::from_secs(1);
/// How long the task tries at least, when the lease is shorter: a begin may land long
/// after it was sent (a server paused for longer than the lease runs it when it resumes).
const MIN_WINDOW: Duration = Duration::from_secs(60);

/// Gives back claims whose `begin` failed as unavailable (see the [module](self)). Clones
/// share one bound on the releases under way.
#[derive(Debug, Clone)]
pub struct Orphans {
    pending: Arc<Semaphore>,
}

impl Default for Orphans {
    fn default() -> Self {
        Self::new()
    }
}

impl Orphans {
    /// A new set of releases under way, none yet.
    pub fn new() -> Self {
        Self {
            pending: Arc::new(Semaphore::new(MAX_PENDING)),
        }
    }

    /// Releases, in the background, the claim that `token` may hold on `id`. Tries with
    /// backoff until the store answers, each try bounded by `call_timeout`, for `lease` (at
    /// least a minute) at most: a claim not given back by then has expired by itself or was
    /// never made. Never blocks; does nothing outside a Tokio runtime or when
    /// 1,024 releases are already under way.
    pub fn release_later(
        &self,
        store: Arc<dyn Store>,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
        call_timeout: Duration,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(permit) = self.pending.clone().try_acquire_owned() else {
            tracing::debug!(key_hash = %KeyHash::of(id), "too many orphan claims pending; this one expires with its lease");
            return;
        };
        let started = Instant::now();
        // The attempt is not known (a takeover counts more than 1); stores fence by token.
        let claim = Lease::new(id.clone(), token, 1, lease, started);
        let window = lease.max(MIN_WINDOW);
        runtime.spawn(async move {
            let _permit = permit;
            let key_hash = KeyHash::of(claim.id());
            let mut pause = FIRST_PAUSE;
            let mut absent_since = None;
            loop {
                match time_limit(store.name(), call_timeout, store.release(&claim)).await {
                    Ok(()) => {
                        tracing::info!(%key_hash, "released a claim whose begin timed out: its key is free again");
                        return;
                    }
                    // No such claim (never landed, or already expired or taken over): once
                    // the answer held for SETTLE, there is nothing to give back.
                    Err(Error::LeaseLost) => {
                        let since = *absent_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= SETTLE {
                            return;
                        }
                        pause = FIRST_PAUSE;
                    }
                    // Still unreachable (or the try timed out itself): try again later.
                    Err(e) if e.is_retryable() => {}
                    Err(e) => {
                        tracing::warn!(%key_hash, error = %e, "releasing a claim whose begin timed out failed; it expires with its lease");
                        return;
                    }
                }
                if started.elapsed() + pause >= window {
                    return;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        });
    }
}
