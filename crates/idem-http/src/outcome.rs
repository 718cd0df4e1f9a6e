//! What the layer did with each guarded request, for metrics and logs.

use std::fmt;

use idem_core::RecordId;

/// What the layer did with one guarded request. Handed to the observer set with
/// [`crate::IdempotencyLayer::with_observer`]; requests whose method is not guarded are not
/// reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran under a lease and its response was stored for replay (by the layer,
    /// or by the handler in its own transaction).
    Executed,
    /// The handler ran under a lease and its response was not stored: a status the
    /// [`crate::Config::store_status`] filter refuses, a handler error or panic (the key was
    /// released), or a response over [`crate::Config::max_response_body`].
    NotStored,
    /// The stored response of an earlier request was replayed.
    Replayed,
    /// Another request holds the key: answered 409.
    InFlight,
    /// The key was used with a different request: answered 422.
    Mismatch,
    /// The key's work completed before and its response was forgotten since, and its
    /// tombstone refuses it ([`idem_core::AfterRetention::Refuse`]): answered 410.
    Expired,
    /// Refused before the handler ran: missing or malformed key (400), no principal (401),
    /// unreadable body (400) or a body over the limit (413).
    Rejected,
    /// The store failed: 503 (or 500 for a store error that retrying will not fix) before the
    /// handler ran, or 503 after it when its response could not be stored in time.
    StoreError,
    /// The handler ran, but its lease was lost before its response was stored (taken over
    /// by a retry after it expired, or evicted): answered 503 `lease-lost`, since the key
    /// will never replay this response.
    LeaseLost,
    /// The handler ran without idempotency: no key under [`crate::MissingKey::PassThrough`],
    /// or the store was unavailable under [`crate::Config::fail_open`].
    Unguarded,
}

impl Outcome {
    /// Every outcome, in declaration order (for pre-registering metric labels).
    pub const ALL: [Outcome; 10] = [
        Outcome::Executed,
        Outcome::NotStored,
        Outcome::Replayed,
        Outcome::InFlight,
        Outcome::Mismatch,
        Outcome::Expired,
        Outcome::Rejected,
        Outcome::StoreError,
        Outcome::LeaseLost,
        Outcome::Unguarded,
    ];

    /// A stable snake_case name, usable as a metric label: `executed`, `not_stored`,
    /// `replayed`, `in_flight`, `mismatch`, `expired`, `rejected`, `store_error`, `lease_lost`,
    /// `unguarded`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::NotStored => "not_stored",
            Outcome::Replayed => "replayed",
            Outcome::InFlight => "in_flight",
            Outcome::Mismatch => "mismatch",
            Outcome::Expired => "expired",
            Outcome::Rejected => "rejected",
            Outcome::StoreError => "store_error",
            Outcome::LeaseLost => "lease_lost",
            Outcome::Unguarded => "unguarded",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Put in the request's extensions when the handler runs under a lease, so that it can tell
/// a first run from a run after a takeover (for example with axum's `Extension`
/// extractor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyInfo {
    /// The record: the request's scope and key.
    pub id: RecordId,
    /// 1 on the key's first run; above 1 when an earlier run's lease expired without a
    /// stored response (the earlier run may have done its side effect: check before doing
    /// it again).
    pub attempt: u32,
}

/// A response extension the inner service sets when the layer must neither store its
/// response nor release the key: the work's outcome is unknown (a request was sent on and
/// its answer lost), so a retry must not run it again at once. The key stays in flight
/// until its lease ends; retries get 409 meanwhile, and after the lease a retry takes the
/// key over with [`IdempotencyInfo::attempt`] above 1. A reverse proxy sets it on the 502 or
/// 504 it answers when the upstream connection broke after the request was sent.
///
/// ```
/// let mut response = http::Response::new("upstream timed out");
/// *response.status_mut() = http::StatusCode::GATEWAY_TIMEOUT;
/// response.extensions_mut().insert(idem_http::KeepInFlight::Always);
/// # let _ = response;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeepInFlight {
    /// This response is sent unstored and the key is left in flight.
    Always,
    /// The response is handled as usual, unless its body breaks off before its end: then
    /// the key is left in flight rather than released (the layer releases it by default,
    /// since a handler's body that fails usually means the work failed).
    IfBodyBreaks,
}
