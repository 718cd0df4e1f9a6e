//! What HTTP and JSON-RPC routes share on the way through the layer: admission's answer,
//! handing a request on, naming its record in the span, and running the handler under its
//! lease, the key released after its error or panic.

use std::future::Future;
use std::panic::{resume_unwind, AssertUnwindSafe};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use idem_core::telemetry::KeyHash;
use idem_core::{BoxError, Lease, OnLost, RecordId};
use tokio::time::Instant;
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::handle::LeaseHandle;
use crate::outcome::{IdempotencyInfo, Outcome};
use crate::settle::release;
use crate::shared::Shared;

/// What admission decided, on an HTTP route (`G` the record and fingerprint) or a JSON-RPC
/// route (`G` the guarded call).
pub(crate) enum Admission<B, G> {
    /// Guard the request under `G`; its body is read.
    Guard(G, Request<RequestBody<B>>),
    /// Hand it on unguarded (not a guarded call, or no key where keys are optional).
    Pass(Request<RequestBody<B>>),
    /// Refuse it with this answer.
    Refuse(Response<ResponseBody>),
}

/// Names the guarded record in the request's span, by its scope and its key's hash.
pub(crate) fn record_on_span(id: &RecordId) {
    let span = tracing::Span::current();
    // Hashing the key costs a SHA-256: only for a span that is recorded.
    if !span.is_disabled() {
        span.record("scope", tracing::field::display(id.scope()));
        span.record("key_hash", tracing::field::display(KeyHash::of(id)));
    }
}

/// Hands a request on without idempotency.
pub(crate) async fn pass<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let response = inner.call(req).await?;
    Ok(response.map(ResponseBody::new))
}

/// How the handler ended: its response or error, or the payload of its panic.
pub(crate) type Ran<R, E> = Result<Result<R, E>, Box<dyn std::any::Any + Send>>;

/// The handler's run on HTTP and JSON-RPC routes alike: `work` gets the request, carrying
/// [`IdempotencyInfo`] and the [`LeaseHandle`], and runs under the lease, which the engine's
/// heartbeat renews while it works ([`Idem::run_with_heartbeat`] with [`OnLost::Finish`]: a
/// handler whose lease is lost still runs to its end, and storing its outcome then finds
/// the lease lost). A panic in it is caught, so that the key can be released first.
/// Returns how it ended and the lease as last renewed.
///
/// [`Idem::run_with_heartbeat`]: idem_core::Idem::run_with_heartbeat
pub(crate) async fn run_leased<B, F>(
    shared: &Shared,
    id: RecordId,
    handle: &LeaseHandle,
    mut req: Request<B>,
    work: impl FnOnce(Request<B>) -> F,
) -> (Result<F::Output, Box<dyn std::any::Any + Send>>, Lease)
where
    F: Future,
{
    let attempt = handle.attempt();
    req.extensions_mut().insert(IdempotencyInfo { id, attempt });
    req.extensions_mut().insert(handle.clone());
    tracing::Span::current().record("attempt", attempt);
    let started = Instant::now();
    // `work` itself (the service's `call`) may panic before any future exists: it is
    // inside the caught future.
    let work = AssertUnwindSafe(async move { work(req).await }).catch_unwind();
    let mut work = std::pin::pin!(work);
    let granted = handle.lease().clone();
    let (lease, ran) = if shared.config.heartbeat {
        let beating = shared
            .idem
            .run_with_heartbeat(granted, OnLost::Finish, work.as_mut());
        // `Finish` never gives the work up; were it to, the work still ends here.
        match beating.await {
            Ok(renewed) => renewed,
            Err(_) => (handle.lease().clone(), work.await),
        }
    } else {
        (granted, work.await)
    };
    metrics::histogram!("idem_http_handler_duration_seconds")
        .record(started.elapsed().as_secs_f64());
    (ran, lease)
}

/// The handler's answer; after its error or its panic, the key released, then the error
/// returned or the panic resumed.
pub(crate) async fn answered<R, E>(shared: &Shared, lease: &Lease, ran: Ran<R, E>) -> Result<R, E> {
    match ran {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(e)) => {
            release(&shared.idem, lease, "the service returned an error").await;
            shared.observe(Outcome::NotStored);
            Err(e)
        }
        Err(panic) => {
            release(&shared.idem, lease, "the service panicked").await;
            shared.observe(Outcome::NotStored);
            resume_unwind(panic)
        }
    }
}
