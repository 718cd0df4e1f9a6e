//! [`LeaseHandle`]: the handler's share of its request's lease, to complete the record in
//! the handler's own database transaction.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idem_core::{Completion, Lease, RecordId};

use crate::shared::Shared;

/// Put in the request's extensions when the handler runs under a lease: the lease, so that
/// the handler can store the completed record **in the same transaction as its business
/// write** (`complete_in` on `idem_postgres::PgStore` or `idem_outbox::TieredStore`), then
/// say so with [`LeaseHandle::committed`].
///
/// The layer then sees that the outcome is already stored and does not store it again. A
/// handler that returns without calling [`LeaseHandle::committed`] (it did not complete, or
/// its store has no transactions) leaves the storing to the layer, as for any handler. A
/// crash after the commit loses nothing: the record is completed, and a retry replays it.
///
/// In axum, take it with `Extension<LeaseHandle>`, or directly as an extractor with the
/// `axum` feature (`Option<LeaseHandle>` on routes where the key is optional). The crate
/// docs show a complete handler.
#[derive(Clone)]
pub struct LeaseHandle {
    inner: Arc<Inner>,
}

struct Inner {
    lease: Lease,
    retention: Duration,
    shared: Arc<Shared>,
    committed: Mutex<Option<idem_core::Response>>,
}

impl LeaseHandle {
    pub(crate) fn new(lease: Lease, retention: Duration, shared: Arc<Shared>) -> Self {
        Self {
            inner: Arc::new(Inner {
                lease,
                retention,
                shared,
                committed: Mutex::new(None),
            }),
        }
    }

    /// The lease, for `complete_in`. It is the lease as first granted: the layer renews it
    /// while the handler runs, and `complete_in` checks only its fencing token, which
    /// renewals keep.
    pub fn lease(&self) -> &Lease {
        &self.inner.lease
    }

    /// The record: the request's scope and key.
    pub fn id(&self) -> &RecordId {
        self.inner.lease.id()
    }

    /// 1 on the key's first run; above 1 when an earlier run's lease expired without a
    /// stored response (see [`crate::IdempotencyInfo::attempt`]).
    pub fn attempt(&self) -> u32 {
        self.inner.lease.attempt()
    }

    /// How long the completed record is kept: pass it to `complete_in`. It is the engine's
    /// [`idem_core::Config::retention`], which the layer advertises in `Idempotency-Expires`.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// The completion to store for the response the handler is about to return: its status,
    /// the headers the layer replays ([`crate::Config::replay_headers`]) and its body, as the
    /// layer itself would store them.
    pub fn completion(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        body: impl Into<Bytes>,
    ) -> Completion {
        Completion::succeeded(
            self.inner
                .shared
                .config
                .to_stored(status, headers, body.into()),
        )
    }

    /// Tells the layer that `completion` is stored: call it once the transaction that ran
    /// `complete_in` has **committed** (never before: a commit that fails would leave the
    /// layer believing in a record that does not exist). The layer then sends the handler's
    /// response without storing it again.
    pub fn committed(&self, completion: &Completion) {
        *self
            .inner
            .committed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(completion.response.clone());
    }

    /// The response the handler said it committed, if it did.
    pub(crate) fn committed_response(&self) -> Option<idem_core::Response> {
        self.inner
            .committed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseHandle")
            .field("lease", &self.inner.lease)
            .field("retention", &self.inner.retention)
            .field("committed", &self.committed_response().is_some())
            .finish()
    }
}

#[cfg(feature = "axum")]
mod axum {
    use std::convert::Infallible;

    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::header::CONTENT_TYPE;
    use http::request::Parts;
    use http::{HeaderValue, StatusCode};

    use super::LeaseHandle;

    /// The handler's lease, from the request's extensions; a request that did not run
    /// under a lease (the route is not behind [`crate::IdempotencyLayer`], or the request
    /// passed through unguarded) is refused with 500 `application/problem+json`: take
    /// `Option<LeaseHandle>` on routes where that is expected.
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> FromRequestParts<S> for LeaseHandle {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
            parts
                .extensions
                .get::<LeaseHandle>()
                .cloned()
                .ok_or_else(|| {
                    let status = StatusCode::INTERNAL_SERVER_ERROR;
                    let doc = crate::error::problem_json(
                        "urn:idem:problem:lease-missing",
                        "No idempotency lease",
                        status,
                        "this handler needs the idempotency lease, and the request did not run \
                     under one: put the route behind IdempotencyLayer, or take \
                     Option<LeaseHandle>",
                    );
                    let mut response = (status, doc).into_response();
                    response.headers_mut().insert(
                        CONTENT_TYPE,
                        HeaderValue::from_static(crate::error::PROBLEM_JSON),
                    );
                    response
                })
        }
    }

    /// `Some` when the request runs under a lease, `None` when it passed through.
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> OptionalFromRequestParts<S> for LeaseHandle {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Infallible> {
            Ok(parts.extensions.get::<LeaseHandle>().cloned())
        }
    }
}
