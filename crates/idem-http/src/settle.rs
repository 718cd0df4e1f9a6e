//! Settling a key's record once its work ran: storing the response (retrying a store that
//! failed, for as long as the lease was granted), or releasing the key; shared by HTTP and
//! JSON-RPC routes.

use std::time::Duration;

use idem_core::{Error, Idem, Lease, Record, RecordState};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use crate::handle::LeaseHandle;
use crate::shared::Shared;

/// What became of a whole response.
pub(crate) enum Kept {
    /// Stored for replay (by the layer, or by the handler in its transaction).
    Stored,
    /// Not stored: its status is not stored (the key released).
    Unstored,
    /// It should have been stored and the store failed: it must not be sent as done.
    Unrecorded,
    /// It should have been stored and the lease was lost (taken over, released or
    /// evicted): the key will never replay it, so it must not be sent as the answer.
    Superseded,
}

/// Stores a whole response under the lease when it is `storable`, else releases the key
/// (`unstored` saying why, for the log), unless the handler completed the record in its
/// own transaction already.
pub(crate) async fn keep_or_release(
    shared: &Shared,
    handle: &LeaseHandle,
    lease: &Lease,
    stored: idem_core::Response,
    storable: bool,
    unstored: &str,
) -> Kept {
    if let Some(committed) = handle.committed_response() {
        // Nothing to store; a retry is replayed what the record holds.
        if committed != stored {
            tracing::warn!(
                "the handler committed a response other than the one it returned; retries \
                 are replayed the committed one"
            );
        }
        shared.idem.completed_elsewhere(lease).await;
        Kept::Stored
    } else if !storable {
        release(&shared.idem, lease, unstored).await;
        Kept::Unstored
    } else {
        match shared.idem.complete(lease, stored.clone()).await {
            Ok(()) => Kept::Stored,
            Err(e) => not_completed(shared, lease, stored, e).await,
        }
    }
}

/// What became of a whole response whose `complete` failed with `e`.
pub(crate) async fn not_completed(
    shared: &Shared,
    lease: &Lease,
    stored: idem_core::Response,
    e: Error,
) -> Kept {
    match e {
        // The record already holds this very response: the handler completed it in its
        // transaction without saying so.
        Error::LeaseLost if holds(&shared.idem, lease, &stored).await => Kept::Stored,
        Error::LeaseLost => {
            // Another request took the key over after this lease expired (or an operator
            // evicted it): nothing of ours can be stored. Sending this response as a
            // success would leave two clients of one key with two different answers.
            tracing::warn!("lease lost before the response was stored; answered 503 lease-lost");
            Kept::Superseded
        }
        e => {
            tracing::warn!(error = %e, "storing the response failed; retrying");
            if store_later(shared, lease.clone(), stored).await {
                Kept::Stored
            } else {
                Kept::Unrecorded
            }
        }
    }
}

/// Keeps trying to store `response` in a task of its own, and waits up to
/// [`crate::Config::store_response_within`] for it to succeed. The task goes on after that
/// wait, for as long as the lease was granted (the record stays in progress, so retries get
/// 409 meanwhile, not a second run), so that a retry after the store recovers gets the
/// replay.
async fn store_later(shared: &Shared, lease: Lease, response: idem_core::Response) -> bool {
    let idem = shared.idem.clone();
    let within = shared.config.store_response_within;
    let (done, stored) = oneshot::channel();
    tokio::spawn(
        async move {
            // The waiter may have given up already; the record is what counts.
            let _ = done.send(store_until_lease_ends(&idem, &lease, &response, within).await);
        }
        .in_current_span(),
    );
    matches!(tokio::time::timeout(within, stored).await, Ok(Ok(true)))
}

/// Stores `response`, retrying with a growing pause for the lease's length (at least
/// `within`); whether it is stored.
async fn store_until_lease_ends(
    idem: &Idem,
    lease: &Lease,
    response: &idem_core::Response,
    within: Duration,
) -> bool {
    let give_up = Instant::now() + idem.config().lease.max(within);
    let mut pause = Duration::from_millis(20);
    loop {
        tokio::time::sleep(pause).await;
        match idem.complete(lease, response.clone()).await {
            Ok(()) => return true,
            // Either a takeover (the key is another request's now, and nothing can be
            // stored), or an earlier write of ours landed though its answer was lost.
            Err(Error::LeaseLost) => return holds(idem, lease, response).await,
            Err(e) if Instant::now() >= give_up => {
                tracing::error!(error = %e,
                    "gave up storing a response; a retry after the lease expires runs the handler again");
                return false;
            }
            Err(_) => pause = (pause * 2).min(Duration::from_secs(1)),
        }
    }
}

/// Whether the key's record is completed with `response`: how a write whose answer was
/// lost (a timeout after the store applied it) is told from a takeover.
async fn holds(idem: &Idem, lease: &Lease, response: &idem_core::Response) -> bool {
    match idem.store().get(lease.id()).await {
        Ok(Some(Record {
            state: RecordState::Completed(completion),
            ..
        })) => completion.response == *response,
        _ => false,
    }
}

/// Releases the key after a run whose response is not stored. A failure is logged: the key
/// then stays held until its lease expires, which refuses retries with 409 meanwhile and
/// never runs the work twice at once.
pub(crate) async fn release(idem: &Idem, lease: &Lease, why: &str) {
    if let Err(e) = idem.release(lease).await {
        tracing::warn!(error = %e, "could not release the key after {why}");
    }
}
