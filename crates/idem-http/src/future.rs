//! The future returned by [`crate::IdempotencyService`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use tracing::instrument::Instrumented;
use tracing::Instrument;

use crate::body::ResponseBody;

type Boxed<E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody>, E>> + Send>>;

/// The response future of [`crate::IdempotencyService`].
pub struct ResponseFuture<E> {
    /// In the request's span (`idem.http`, or none for a method that is not guarded),
    /// entered around every poll and around the drop.
    inner: Instrumented<Boxed<E>>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(
        inner: impl Future<Output = Result<Response<ResponseBody>, E>> + Send + 'static,
        span: tracing::Span,
    ) -> Self {
        let inner: Boxed<E> = Box::pin(inner);
        Self {
            inner: inner.instrument(span),
        }
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<ResponseBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = std::task::ready!(Pin::new(&mut self.inner).poll(cx));
        if let Ok(response) = &out {
            // This request's own span, even when a filter disabled it (then nothing is
            // recorded, rather than the field of whatever span the caller has open).
            let status = response.status().as_u16();
            self.inner.span().record("status", status);
        }
        Poll::Ready(out)
    }
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
