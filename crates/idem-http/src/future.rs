//! The future returned by [`crate::IdempotencyService`], and [`Detach`], which keeps work
//! going once its awaiting future is dropped.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use tokio::runtime::Handle;
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

/// Work that must run to its end once started (the handler behind a lease, the storing of
/// its outcome), polled in place by the future that awaits it, and handed to the runtime as
/// a task of its own if that future is dropped first (the client went away, a timeout layer
/// gave up).
///
/// The same guarantee as spawning the work up front and awaiting its `JoinHandle`, without
/// a task, its scheduling and its cross-thread wake-up on every request that is not
/// abandoned (nearly all of them). What that buys: more than 5 % of the middleware's
/// guarded requests per CPU second, new keys and replays alike, over a spawned task
/// (`idem-bench --phases middleware`).
pub(crate) struct Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `None` once the work has ended, or while a poll is under way (so that a panic out of
    /// a poll leaves nothing to hand on).
    work: Option<Pin<Box<F>>>,
    runtime: Handle,
    /// The span the work goes on in once detached.
    span: tracing::Span,
}

impl<F> Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// Wraps `work`. Must be called within a Tokio runtime: the one the work is handed to.
    pub(crate) fn new(work: F) -> Self {
        Self {
            work: Some(Box::pin(work)),
            runtime: Handle::current(),
            span: tracing::Span::current(),
        }
    }
}

impl<F> Future for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Taken out for the poll: should it panic, the work is dropped while unwinding
        // rather than detached as if it were still running.
        let Some(mut work) = self.work.take() else {
            panic!("Detach polled after it completed");
        };
        match work.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(out),
            Poll::Pending => {
                self.work = Some(work);
                Poll::Pending
            }
        }
    }
}

impl<F> Drop for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            let span = std::mem::replace(&mut self.span, tracing::Span::none());
            // Nobody awaits it any more: its result (the response) has no one to go to,
            // and a panic stays in its task.
            drop(self.runtime.spawn(detached(work, span)));
        }
    }
}

/// The rest of detached work, run for its effects.
async fn detached<F: Future>(work: Pin<Box<F>>, span: tracing::Span) {
    work.instrument(span).await;
}

impl<F> fmt::Debug for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detach")
            .field("running", &self.work.is_some())
            .finish_non_exhaustive()
    }
}
