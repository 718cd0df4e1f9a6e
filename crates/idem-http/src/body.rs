//! The body types the layer hands on: the buffered request body given to the service, and
//! the response body given to the server.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Either, Full};
use idem_core::BoxError;

/// The request body the inner service receives: the buffered body of a guarded request
/// (`Left`), or the untouched body of a request that passed through (`Right`).
pub type RequestBody<B> = Either<Full<Bytes>, B>;

/// The response body of an [`crate::IdempotencyService`]: a stored or replayed body, an
/// error document, or the service's own body.
pub struct ResponseBody(UnsyncBoxBody<Bytes, BoxError>);

impl ResponseBody {
    /// Wraps any body.
    pub(crate) fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(body.map_err(Into::into).boxed_unsync())
    }

    /// A complete body held in memory.
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        Self::new(Full::new(bytes.into()))
    }
}

impl fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("size_hint", &self.0.size_hint())
            .finish()
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

/// A body read into memory: its bytes, then its trailers if it had any.
pub(crate) struct Buffered {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
    len: u64,
}

impl Buffered {
    pub(crate) fn new(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            len: data.len() as u64,
            data: Some(data).filter(|d| !d.is_empty()),
            trailers,
        }
    }
}

impl Body for Buffered {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.trailers.is_none() {
            SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
        } else {
            let mut hint = SizeHint::new();
            hint.set_lower(self.len);
            hint
        }
    }
}

/// What was read of a body that turned out too large to store, followed by the rest of it.
pub(crate) struct Prefixed<B> {
    head: Option<Bytes>,
    rest: Pin<Box<B>>,
}

impl<B> Prefixed<B> {
    pub(crate) fn new(head: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            head: Some(head).filter(|h| !h.is_empty()),
            rest,
        }
    }
}

impl<B> Body for Prefixed<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        self.rest.as_mut().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }
}

/// What was read of a body before it failed, followed by the failure: the client sees the
/// response break off as it would have without the layer.
pub(crate) struct Broken {
    head: Option<Bytes>,
    error: Option<BoxError>,
}

impl Broken {
    pub(crate) fn new(head: Bytes, error: BoxError) -> Self {
        Self {
            head: Some(head).filter(|h| !h.is_empty()),
            error: Some(error),
        }
    }
}

impl Body for Broken {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        Poll::Ready(self.error.take().map(Err))
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.error.is_none()
    }
}
