//! Streamed responses shared while they run: the first caller's streamed response goes to
//! the store as it comes ([`Recorder`]), and a duplicate that arrives meanwhile, on any
//! instance on the same store, joins it ([`join`]): the same status and headers, every byte
//! produced so far, then the rest live, and the same end.
//!
//! What the store holds for a stream ([`idem_core::Store::append`]) is a sequence of frames,
//! each `[kind, u8][length, u32][payload]`: `H`, the head (`idem_core::encode_meta` of the
//! status and the replayed headers); `D`, bytes of the body as they were sent; then `E` once
//! the body has ended (its completion is being stored), or `X` when the response will not
//! be stored (over the size limit, broken off, or given up with its client). A duplicate
//! joins only a stream still being produced; one that comes after `E` or `X` is answered as
//! for any request in flight. The completion, stored when the body ends, is the commit
//! point for a joined client as for the first one: its body ends cleanly only once the
//! record is completed, and with an error on `X`, when the record is released, or when its
//! holder's lease runs out.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::StreamBody;
use idem_core::{
    decode_meta, encode_meta, BoxError, CompletionKind, Idem, Lease, RecordId, StreamRead,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

use crate::body::ResponseBody;
use crate::config::Config;
use crate::response::REPLAYED;

/// A batch is written once it holds this many bytes...
const BATCH_BYTES: usize = 16 * 1024;
/// ... or this long after its first byte came, whichever is first: a token-by-token stream
/// costs a store write per batch, not per token, and a joined client lags by at most this
/// (plus a store round trip).
const BATCH_WAIT: Duration = Duration::from_millis(20);
/// A joined client's look at the stream when no notification came: a safety net for a
/// notification lost with a connection.
const SAFETY_POLL: Duration = Duration::from_secs(1);

const HEAD: u8 = b'H';
const DATA: u8 = b'D';
const ENDED: u8 = b'E';
const ABANDONED: u8 = b'X';

/// One frame of a stream, as the store keeps it.
fn frame(kind: u8, payload: &[u8], out: &mut BytesMut) {
    out.extend_from_slice(&[kind]);
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(payload);
}

/// The frames at the start of `bytes`, and how many bytes they take (a frame cut short at
/// the end is left for the next read).
fn frames(bytes: &[u8]) -> (Vec<(u8, &[u8])>, usize) {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + 5) {
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let Some(payload) = bytes.get(at + 5..at + 5 + len) else {
            break;
        };
        found.push((header[0], payload));
        at += 5 + len;
    }
    (found, at)
}

/// The head of a stream as the store keeps it: the status and the headers a replay carries.
pub(crate) fn encode_head(config: &Config, status: StatusCode, headers: &HeaderMap) -> Vec<u8> {
    let head = config.to_stored(status, headers, Bytes::new());
    let mut out = BytesMut::new();
    frame(
        HEAD,
        &encode_meta(CompletionKind::Succeeded, &head),
        &mut out,
    );
    out.to_vec()
}

/// What the recording task is handed.
#[derive(Debug)]
enum Piece {
    /// Bytes of the body.
    Data(Bytes),
    /// The end: `E` (the body ended; its completion follows) or `X` (it will not be stored).
    End(u8),
}

/// Writes a streamed response into the store under its lease, in batches, from a task of
/// its own, so that the client's frames never wait for a store write. A write that fails
/// ends the recording (joined clients then see the stream end with an error, or its
/// completion): the first client's response does not depend on it. Dropped without
/// [`Recorder::end`], it marks the stream as not to be stored.
#[derive(Debug)]
pub(crate) struct Recorder {
    pieces: mpsc::UnboundedSender<Piece>,
    ended: bool,
}

impl Recorder {
    /// Starts recording the stream of `lease`'s record: `head` first (written at once, so a
    /// duplicate can join as soon as the head is there), then what [`Recorder::push`] gets.
    pub(crate) fn start(idem: &Idem, lease: Lease, head: Vec<u8>) -> Self {
        let (pieces, received) = mpsc::unbounded_channel();
        tokio::spawn(record(idem.clone(), lease, head, received).in_current_span());
        Self {
            pieces,
            ended: false,
        }
    }

    /// Hands the next bytes of the body to the recording. The caller bounds what it hands
    /// over (the layer stops at [`Config::max_response_body`]).
    pub(crate) fn push(&self, bytes: Bytes) {
        // The task ended (a failed write): the recording is over, the response goes on.
        let _ = self.pieces.send(Piece::Data(bytes));
    }

    /// The body ended whole: joined clients wait for its completion.
    pub(crate) fn end(mut self) {
        self.ended = true;
        let _ = self.pieces.send(Piece::End(ENDED));
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.pieces.send(Piece::End(ABANDONED));
        }
    }
}

/// The recording task: the head, then batches of what comes (a `D` frame each), each
/// written at the offset where the last one ended, then the end's frame.
async fn record(
    idem: Idem,
    lease: Lease,
    head: Vec<u8>,
    mut received: mpsc::UnboundedReceiver<Piece>,
) {
    let mut at = 0u64;
    let mut pending = BytesMut::from(&head[..]);
    let mut data = BytesMut::new();
    let mut end = None;
    loop {
        if !data.is_empty() {
            frame(DATA, &data, &mut pending);
            data.clear();
        }
        if let Some(kind) = end {
            frame(kind, &[], &mut pending);
        }
        if !pending.is_empty() {
            // Bounded by the engine's time limit on store calls, and counted with them.
            if let Err(e) = idem.append(&lease, at, &pending).await {
                tracing::debug!(error = %e, "a streamed response is no longer recorded");
                return;
            }
            at += pending.len() as u64;
            pending.clear();
        }
        if end.is_some() {
            return;
        }
        // The next batch: its first piece, then what comes within the batch's time.
        match received.recv().await {
            Some(Piece::Data(piece)) => data.extend_from_slice(&piece),
            Some(Piece::End(kind)) => end = Some(kind),
            None => end = Some(ABANDONED),
        }
        let due = Instant::now() + BATCH_WAIT;
        while end.is_none() && data.len() < BATCH_BYTES {
            tokio::select! {
                piece = received.recv() => match piece {
                    Some(Piece::Data(piece)) => data.extend_from_slice(&piece),
                    Some(Piece::End(kind)) => end = Some(kind),
                    None => end = Some(ABANDONED),
                },
                () = tokio::time::sleep_until(due) => break,
            }
        }
    }
}

/// A duplicate of a request whose response streams: the response as far as the store has
/// it, then the rest as it comes, and the same end. `None` when there is nothing to join
/// (no stream, or its head not written yet): the caller answers as for any request in
/// flight.
pub(crate) async fn join(
    config: &Config,
    idem: &Idem,
    id: &RecordId,
    last_event_id: Option<&str>,
) -> Option<Response<ResponseBody>> {
    // Registered before the first read, so that nothing appended after it goes unnoticed.
    let watch = idem.watch(id).await;
    let StreamRead::Live { token, bytes, .. } = idem.read_stream(id, 0).await.ok()? else {
        return None;
    };
    let (found, _) = frames(&bytes);
    let (&(kind, meta), rest) = found.split_first()?;
    // Only a stream still being produced is joined.
    if kind != HEAD || rest.iter().any(|(kind, _)| *kind != DATA) {
        return None;
    }
    let head = decode_meta(meta, Bytes::new()).ok()?.response;
    let status = StatusCode::from_u16(head.status).ok()?;
    // A client resuming a stream of events gets those after the last one it received.
    let resume = last_event_id
        .filter(|_| is_event_stream(&head.headers))
        .map(|last| (last.to_owned(), BytesMut::new()));
    let mut response = Response::new(());
    *response.status_mut() = status;
    for (name, value) in head.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            if config.replays(&name) {
                response.headers_mut().append(name, value);
            }
        }
    }
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    let follow = Follow {
        idem: idem.clone(),
        id: id.clone(),
        token,
        at: bytes.len() as u64,
        unread: BytesMut::from(&bytes[..]),
        resume,
        sent: 0,
        watch,
        done: false,
    };
    let frames = futures_util::stream::unfold(follow, Follow::next);
    Some(response.map(|()| ResponseBody::new(StreamBody::new(frames))))
}

/// A joined client's place in the stream.
struct Follow {
    idem: Idem,
    id: RecordId,
    /// The holder whose stream this is: another token means another attempt's stream.
    token: idem_core::FencingToken,
    /// How far into the stream's bytes it has read.
    at: u64,
    /// Bytes read and not parsed yet (a frame cut short by the read's end).
    unread: BytesMut,
    /// While the client resumes after an event (`Last-Event-ID`) not seen yet: its id, and
    /// the body's bytes held back until that event has gone by.
    resume: Option<(String, BytesMut)>,
    /// How many bytes of the body the client was sent.
    sent: u64,
    watch: Option<idem_core::Watch>,
    done: bool,
}

impl Follow {
    /// The next frame: body bytes recorded since the last one, the rest of the completion
    /// and then the clean end, or an error when the stream will not complete.
    async fn next(mut self) -> Option<(Result<Frame<Bytes>, BoxError>, Self)> {
        if self.done {
            return None;
        }
        loop {
            // What was read and not sent yet: the body's bytes, up to the last whole frame.
            let (found, used) = frames(&self.unread);
            let mut body = BytesMut::new();
            let mut abandoned = false;
            for (kind, payload) in found {
                match kind {
                    HEAD => {}
                    DATA => body.extend_from_slice(payload),
                    // The body ended: its completion follows, read as `Completed` below.
                    ENDED => {}
                    _ => abandoned = true,
                }
            }
            let _ = self.unread.split_to(used);
            if !body.is_empty() {
                self.sent += body.len() as u64;
                if let Some(body) = self.resumed(body.freeze()) {
                    return Some((Ok(Frame::data(body)), self));
                }
                continue;
            }
            if abandoned {
                return self.fail("the response will not be recorded".to_owned());
            }
            let read = match self.idem.read_stream(&self.id, self.at).await {
                Ok(read) => read,
                Err(e) => return self.fail(format!("the stream could not be read: {e}")),
            };
            match read {
                StreamRead::Live { token, .. } if token != self.token => {
                    return self.fail("another attempt took the key over".to_owned())
                }
                StreamRead::Live { bytes, .. } if !bytes.is_empty() => {
                    self.at += bytes.len() as u64;
                    self.unread.extend_from_slice(&bytes);
                }
                StreamRead::Live {
                    lease_remaining, ..
                } if lease_remaining.is_zero() => {
                    return self.fail("the stream's holder stopped before its end".to_owned())
                }
                StreamRead::Live { .. } => self.wait().await,
                StreamRead::Completed(completion) => {
                    // The rest from the stored response, which is the stream's body whole.
                    self.done = true;
                    let body = completion.response.body;
                    let from = match self.resume.take() {
                        // The event was not in what came before: look in the whole body.
                        Some((last, _)) => after_event(&body, &last).unwrap_or(0),
                        None => usize::try_from(self.sent).unwrap_or(usize::MAX),
                    };
                    let Some(rest) = (from <= body.len()).then(|| body.slice(from..)) else {
                        return self.fail("the stored response differs from the stream".into());
                    };
                    return (!rest.is_empty()).then(|| (Ok(Frame::data(rest)), self));
                }
                StreamRead::Absent => {
                    return self.fail("the work ended without a stored response".to_owned())
                }
                _ => return self.fail("the stream is in an unknown state".to_owned()),
            }
        }
    }

    /// What of `body` the client gets: all of it, or, while it resumes after an event not
    /// seen yet, nothing until that event has gone by, then the bytes after it.
    fn resumed(&mut self, body: Bytes) -> Option<Bytes> {
        let Some((last, held)) = &mut self.resume else {
            return Some(body);
        };
        held.extend_from_slice(&body);
        let at = after_event(held, last)?;
        let rest = held.split_off(at).freeze();
        self.resume = None;
        (!rest.is_empty()).then_some(rest)
    }

    /// Waits for more: a notification, or the safety poll.
    async fn wait(&mut self) {
        match &mut self.watch {
            Some(watch) => {
                let _ = tokio::time::timeout(SAFETY_POLL, watch.changed()).await;
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }

    /// Ends the joined client's body with an error: it sees no clean end, and a retry with
    /// the same key gets the key's answer.
    fn fail(mut self, why: String) -> Option<(Result<Frame<Bytes>, BoxError>, Self)> {
        self.done = true;
        tracing::debug!(why, "a joined stream ends without its clean end");
        Some((Err(why.into()), self))
    }
}

/// The offset in a Server-Sent Events body just past the event whose `id` field is `id`:
/// where a client that last received that event resumes (`Last-Event-ID`); `None` when no
/// event carries it. Events end at a blank line; the bytes are kept as they were sent.
///
/// Written here rather than with an SSE parsing crate: those hand back parsed events, and a
/// resumed stream must be the recorded bytes from an event's end on, which needs each
/// event's place in the bytes.
pub(crate) fn after_event(body: &[u8], id: &str) -> Option<usize> {
    let mut at = 0;
    let mut event_id: Option<&[u8]> = None;
    while at < body.len() {
        let rest = &body[at..];
        let (line, next) = match rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            Some(end) => {
                let skip = if rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                (&rest[..end], at + end + skip)
            }
            // An event not ended yet.
            None => return None,
        };
        if line.is_empty() {
            if event_id == Some(id.as_bytes()) {
                return Some(next);
            }
            event_id = None;
        } else if let Some(value) = line.strip_prefix(b"id:") {
            event_id = Some(value.strip_prefix(b" ").unwrap_or(value));
        }
        at = next;
    }
    None
}

/// Numbers the events of a stream of Server-Sent Events that carry no `id:` field
/// ([`Config::sse_ids`]): each event with data gets `id: N`, its sequence number from 0, as
/// its first line. Bytes are handed on event by event: a partial event waits for its end
/// (or for [`SseIds::finish`]).
#[derive(Debug, Default)]
pub(crate) struct SseIds {
    next: u64,
    pending: BytesMut,
}

impl SseIds {
    /// The complete events of what came so far, numbered.
    pub(crate) fn push(&mut self, data: &[u8]) -> Bytes {
        self.pending.extend_from_slice(data);
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&self.pending) {
            let event = self.pending.split_to(end);
            let has = |field: &[u8]| {
                event[..]
                    .split(|b: &u8| *b == b'\n' || *b == b'\r')
                    .any(|line| line.starts_with(field))
            };
            if has(b"data")
                && !has(b"id:")
                && !event[..].split(|b: &u8| *b == b'\n').any(|l| l == b"id")
            {
                out.extend_from_slice(format!("id: {}\n", self.next).as_bytes());
            }
            if has(b"data") {
                self.next += 1;
            }
            out.extend_from_slice(&event);
        }
        out.freeze()
    }

    /// What is left at the body's end: an event never ended, as it came.
    pub(crate) fn finish(&mut self) -> Bytes {
        self.pending.split().freeze()
    }
}

/// Where the first event of `bytes` ends, its blank line included.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let end = rest.iter().position(|b| *b == b'\n' || *b == b'\r')?;
        let skip = if rest[end] == b'\r' {
            match rest.get(end + 1) {
                Some(b'\n') => 2,
                // A lone `\r` at the end may be the first half of `\r\n`: wait.
                None => return None,
                _ => 1,
            }
        } else {
            1
        };
        let next = at + end + skip;
        if end == 0 {
            return Some(next);
        }
        at = next;
    }
    None
}

/// Whether a response head says its body is Server-Sent Events.
pub(crate) fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// Whether a response's headers say its body is Server-Sent Events.
pub(crate) fn is_event_stream(headers: &[(String, Vec<u8>)]) -> bool {
    headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("content-type") && value.starts_with(b"text/event-stream")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_found_by_id_and_resumed_after_their_blank_line() {
        let body = b"id: 1\ndata: a\n\n: a comment\nid:2\r\ndata: b\r\n\r\ndata: c\n\n";
        let after = |id| after_event(body, id).map(|at| &body[at..]);
        assert_eq!(
            after("1"),
            Some(&b": a comment\nid:2\r\ndata: b\r\n\r\ndata: c\n\n"[..])
        );
        assert_eq!(after("2"), Some(&b"data: c\n\n"[..]));
        assert_eq!(after("3"), None);
        // An event not ended yet is not resumed after.
        assert_eq!(after_event(b"id: 9\ndata: x\n", "9"), None);
    }

    #[test]
    fn events_without_an_id_are_numbered_across_chunks() {
        let mut ids = SseIds::default();
        let mut out = BytesMut::new();
        for chunk in [
            &b"data: a\n\n: ping\n\nda"[..],
            b"ta: b\r\n\r\nid: x\ndata: c\n\ndata: d\n",
        ] {
            out.extend_from_slice(&ids.push(chunk));
        }
        out.extend_from_slice(&ids.finish());
        assert_eq!(
            &out[..],
            &b"id: 0\ndata: a\n\n: ping\n\nid: 1\ndata: b\r\n\r\nid: x\ndata: c\n\ndata: d\n"[..]
        );
    }

    #[test]
    fn frames_are_read_whole_and_a_frame_cut_short_waits() {
        let mut bytes = BytesMut::new();
        frame(HEAD, b"h", &mut bytes);
        frame(DATA, b"data", &mut bytes);
        let whole = bytes.len();
        frame(DATA, b"more", &mut bytes);
        let (found, used) = frames(&bytes[..whole + 3]);
        assert_eq!(found, vec![(HEAD, &b"h"[..]), (DATA, &b"data"[..])]);
        assert_eq!(used, whole);
    }
}
