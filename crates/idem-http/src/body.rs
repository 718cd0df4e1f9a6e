//! The body types the layer hands on: the buffered request body given to the service, and
//! the response body given to the server.

use std::convert::Infallible;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
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
pub struct ResponseBody(Inner);

enum Inner {
    /// Held in memory (a stored, replayed or refusal body): no box, no error to map.
    Buffered(Buffered),
    /// Any other body: the service's own, streamed.
    Boxed(UnsyncBoxBody<Bytes, BoxError>),
}

impl ResponseBody {
    /// Wraps any body.
    pub(crate) fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(Inner::Boxed(body.map_err(Into::into).boxed_unsync()))
    }

    /// A complete body held in memory.
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        Self::buffered(bytes.into(), None)
    }

    /// A body read into memory, with its trailers if it had any.
    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self(Inner::Buffered(Buffered::new(data, trailers)))
    }
}

impl fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("size_hint", &self.size_hint())
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
        match &mut self.0 {
            Inner::Buffered(body) => Pin::new(body)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            Inner::Boxed(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Buffered(body) => body.is_end_stream(),
            Inner::Boxed(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Inner::Buffered(body) => body.size_hint(),
            Inner::Boxed(body) => body.size_hint(),
        }
    }
}

/// A body being read into memory: the first chunk kept as it came (no copy for the usual
/// body of one chunk), later ones appended to a buffer.
#[derive(Default)]
pub(crate) struct Chunks {
    first: Bytes,
    joined: Option<BytesMut>,
}

impl Chunks {
    /// Appends a chunk.
    pub(crate) fn push(&mut self, data: Bytes) {
        match &mut self.joined {
            Some(joined) => joined.extend_from_slice(&data),
            None if self.first.is_empty() => self.first = data,
            None => {
                let mut joined = BytesMut::with_capacity(self.first.len() + data.len());
                joined.extend_from_slice(&self.first);
                joined.extend_from_slice(&data);
                self.joined = Some(joined);
            }
        }
    }

    /// Bytes read so far.
    pub(crate) fn len(&self) -> usize {
        self.joined.as_ref().map_or(self.first.len(), BytesMut::len)
    }

    /// Everything read, in order.
    pub(crate) fn into_bytes(self) -> Bytes {
        self.joined.map_or(self.first, BytesMut::freeze)
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
    type Error = Infallible;

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

/// What was read of a body that turned out too large to store, followed by the rest of it;
/// or what was read of a body before it failed, followed by the failure, so that the client
/// sees the response break off as it would have without the layer.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_join_in_order_and_keep_a_single_chunk_as_it_came() {
        let read = |parts: &[&'static [u8]]| {
            let mut chunks = Chunks::default();
            for part in parts {
                chunks.push(Bytes::from_static(part));
            }
            (chunks.len(), chunks.into_bytes())
        };
        assert_eq!(read(&[]), (0, Bytes::new()));
        assert_eq!(read(&[b"abc"]), (3, Bytes::from_static(b"abc")));
        assert_eq!(
            read(&[b"", b"ab", b"", b"c"]),
            (3, Bytes::from_static(b"abc"))
        );
        assert_eq!(
            read(&[b"ab", b"cd", b"e"]),
            (5, Bytes::from_static(b"abcde"))
        );
        // One chunk is handed on without a copy: the same memory.
        let one = Bytes::from(vec![7u8; 64]);
        let mut chunks = Chunks::default();
        chunks.push(one.clone());
        assert_eq!(chunks.into_bytes().as_ptr(), one.as_ptr());
    }
}
