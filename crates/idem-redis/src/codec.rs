//! The layout of a record: one Redis string per record, binary, versioned by its first byte.
//!
//! Why a string, and what a record costs: the crate docs. Integers are big-endian.
//!
//! ```text
//! in progress (59 bytes)             completed (41 bytes + headers + body)
//! [0]       'P'                      [0]       'C' raw body | 'Z' LZ4 body | 'H' body dropped
//! [1..17)   fencing token            [1..33)   fingerprint
//! [17..23)  margin, u48 ms           [33..37)  expires at, u32 Unix seconds (rounded down)
//! [23..55)  fingerprint              [37]      attempt, u8 when under 255; else 255, then
//! [55..59)  attempt, u32                       the attempt as u32 at [38..42)
//!                                    then the metadata:
//!                                    0x80 | kind << 6 | header count n (< 64);
//!                                    kind: 0 succeeded, 1 failed
//!                                    status, u16
//!                                    then n × (name length u8, name, value length u16,
//!                                    value), then the body ('Z': u32 original length, then
//!                                    the LZ4 block)
//! ```
//!
//! An in-progress record's lease deadline is its key's expiry (by the server's clock) minus
//! its margin. A completed record's expiry is the writer's clock plus the retention,
//! rounded down to the second (so never later than the key's own expiry, by a clock in step
//! with the server's): it only answers [`idem_core::Replay::expires_in`], the key's `PX`
//! removes the record. The client writes the completed record whole ([`Completed`]), with
//! the fingerprint and attempt of the in-progress record it replaces (`transitions.rs`).
//!
//! The metadata's first byte tells its form: with its top bit set, the compact form above;
//! clear, the length-prefixed form: the length of [`idem_core::encode_meta`]'s bytes (u32,
//! whose top byte is 0 for anything under 16 MiB), then those bytes. Completions the
//! compact form cannot hold (64 headers or more, a header name over 255 bytes or a value
//! over 65,535) are written in the length-prefixed form.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idem_core::{
    decode_meta, encode_meta, Completion, CompletionKind, Error, FencingToken, Fingerprint,
    RecordId, RecordState, Replay, Response,
};

use crate::config::{BodyLimit, OversizeBody};
use crate::STORE;

/// Length of an in-progress record.
pub(crate) const IN_PROGRESS_LEN: usize = 59;
/// The shortest identity of a completed record (tag, fingerprint, expiry, one-byte attempt).
const COMPLETED_IDENTITY_MIN: usize = 38;
/// The attempt byte that says the attempt follows as a u32.
const LONG_ATTEMPT: u8 = 255;
/// LZ4 cannot expand data by more than about 255 to 1; a stored length above that is corrupt,
/// and checking it bounds the allocation a corrupt record can cause.
const LZ4_MAX_RATIO: usize = 255;

/// An in-progress record, as `begin` writes it: a lease of `token` for attempt `attempt`, kept `margin_ms` past its deadline.
pub(crate) fn in_progress(
    token: &FencingToken,
    margin_ms: u64,
    fingerprint: &Fingerprint,
    attempt: u32,
) -> [u8; IN_PROGRESS_LEN] {
    let mut out = [0; IN_PROGRESS_LEN];
    out[0] = b'P';
    out[1..17].copy_from_slice(token.as_bytes());
    out[17..23].copy_from_slice(&margin_ms.min(MAX_U48).to_be_bytes()[2..]);
    out[23..55].copy_from_slice(fingerprint.as_bytes());
    out[55..59].copy_from_slice(&attempt.to_be_bytes());
    out
}

const MAX_U48: u64 = (1 << 48) - 1;

/// The margin (ms) of an in-progress record of [`IN_PROGRESS_LEN`] bytes.
pub(crate) fn margin_ms(record: &[u8]) -> u64 {
    u64::try_from(read_u48(&record[17..23])).unwrap_or(0)
}

/// The fingerprint and attempt of an in-progress record of [`IN_PROGRESS_LEN`] bytes.
pub(crate) fn identity(record: &[u8]) -> (Fingerprint, u32) {
    (
        fingerprint_of(&record[23..55]),
        u32::from_be_bytes(read4(&record[55..59])),
    )
}

/// What a release writes on a server without a compare-and-delete (Valkey 8.1): a value
/// that lives a millisecond and reads as absent.
pub(crate) const RELEASED: &[u8] = b"R";

/// A value read from a record's key: `None` for [`RELEASED`], which reads as absent.
pub(crate) fn live(value: Option<Vec<u8>>) -> Option<Bytes> {
    value.filter(|v| v.as_slice() != RELEASED).map(Bytes::from)
}

/// A completion, encoded.
#[derive(Debug)]
pub(crate) struct EncodedCompletion {
    /// `C` (raw body), `Z` (LZ4 body) or `H` (body dropped).
    pub tag: u8,
    /// The metadata, compact or length-prefixed (its first byte tells which).
    pub meta: Vec<u8>,
    /// The body as stored.
    pub body: Bytes,
}

/// The completed record that replaces an in-progress record of `identity` (its fingerprint
/// and attempt, as [`identity`] reads them): the tag, the fingerprint, the expiry, the
/// attempt (one byte under 255, else 255 and the u32), the metadata, the body.
pub(crate) fn completed(
    (fingerprint, attempt): (Fingerprint, u32),
    encoded: &EncodedCompletion,
    expires_at: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(42 + encoded.meta.len() + encoded.body.len());
    out.push(encoded.tag);
    out.extend_from_slice(fingerprint.as_bytes());
    out.extend_from_slice(&expires_at.to_be_bytes());
    match u8::try_from(attempt) {
        Ok(short) if short < LONG_ATTEMPT => out.push(short),
        _ => {
            out.push(LONG_ATTEMPT);
            out.extend_from_slice(&attempt.to_be_bytes());
        }
    }
    out.extend_from_slice(&encoded.meta);
    out.extend_from_slice(&encoded.body);
    out
}

/// Whether `stored` is the completed record that `encoded` makes of the in-progress record
/// `held`, its expiry aside (a completion sent again may be written a second later than the
/// first): how a completion whose reply was lost is told from another one.
pub(crate) fn completes(held: &[u8], encoded: &EncodedCompletion, stored: &[u8]) -> bool {
    let ours = completed(identity(held), encoded, 0);
    let expiry = 33..37;
    stored.len() == ours.len()
        && stored[..expiry.start] == ours[..expiry.start]
        && stored[expiry.end..] == ours[expiry.end..]
}

/// When a record written now and kept for `ttl` expires, in Unix seconds by this host's
/// clock, rounded down (so never later than the key's expiry, by a clock in step with the
/// server's); saturated at `u32::MAX` (in 2106).
pub(crate) fn expires_at(ttl: Duration) -> u32 {
    u32::try_from(unix_now().saturating_add(ttl).as_secs()).unwrap_or(u32::MAX)
}

/// The time left until `expires_at` (Unix seconds), by this host's clock; zero once passed.
pub(crate) fn expires_in(expires_at: u32) -> Duration {
    Duration::from_secs(u64::from(expires_at)).saturating_sub(unix_now())
}

fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Encodes a completion, applying the body limit.
pub(crate) fn encode_completion(
    completion: &Completion,
    limit: &BodyLimit,
) -> Result<EncodedCompletion, Error> {
    let response = &completion.response;
    let body = &response.body;
    // 0 raw, 1 LZ4, 2 dropped: the index into each family's tags.
    let (form, body): (usize, Bytes) = if body.len() <= limit.max_bytes {
        (0, body.clone())
    } else {
        match limit.oversize {
            OversizeBody::Refuse => {
                return Err(Error::Invalid(format!(
                    "response body of {} bytes is over the redis store's limit of {} bytes",
                    body.len(),
                    limit.max_bytes
                )))
            }
            OversizeBody::StatusAndHeaders => (2, Bytes::new()),
            OversizeBody::Compress => {
                let original = u32::try_from(body.len()).map_err(|_| {
                    Error::Invalid(format!("response body of {} bytes", body.len()))
                })?;
                let mut packed = Vec::with_capacity(4 + body.len() / 2);
                packed.extend_from_slice(&original.to_be_bytes());
                packed.extend_from_slice(&lz4_flex::compress(body));
                if packed.len() > limit.max_bytes {
                    return Err(Error::Invalid(format!(
                        "response body of {} bytes compresses to {} bytes, still over the \
                         redis store's limit of {} bytes",
                        body.len(),
                        packed.len(),
                        limit.max_bytes
                    )));
                }
                (1, Bytes::from(packed))
            }
        }
    };
    let meta = match compact_meta(completion.kind, response) {
        Some(meta) => meta,
        None => {
            let meta = encode_meta(completion.kind, response);
            let len = u32::try_from(meta.len())
                .ok()
                .filter(|len| *len < 1 << 24)
                .ok_or_else(|| Error::Invalid(format!("{} bytes of headers", meta.len())))?;
            let mut framed = Vec::with_capacity(4 + meta.len());
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(&meta);
            framed
        }
    };
    Ok(EncodedCompletion {
        tag: b"CZH"[form],
        meta,
        body,
    })
}

/// The compact metadata, or `None` when the response does not fit it.
fn compact_meta(kind: CompletionKind, response: &Response) -> Option<Vec<u8>> {
    let count = u8::try_from(response.headers.len())
        .ok()
        .filter(|n| *n < 64)?;
    let kind_bit = match kind {
        CompletionKind::Succeeded => 0,
        CompletionKind::Failed => 0x40,
    };
    let size = 3 + response
        .headers
        .iter()
        .map(|(n, v)| 3 + n.len() + v.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.push(0x80 | kind_bit | count);
    out.extend_from_slice(&response.status.to_be_bytes());
    for (name, value) in &response.headers {
        out.push(u8::try_from(name.len()).ok()?);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&u16::try_from(value.len()).ok()?.to_be_bytes());
        out.extend_from_slice(value);
    }
    Some(out)
}

/// Reads the compact metadata at the start of `bytes`: the completion (with an empty body)
/// and the metadata's length.
fn decode_compact_meta(bytes: &[u8]) -> Option<(CompletionKind, Response, usize)> {
    let mut r = Reader(bytes);
    let first = r.take(1)?[0];
    let kind = kind(first & 0x40 != 0);
    let status = u16::from_be_bytes(r.take(2)?.try_into().ok()?);
    let count = first & 0x3f;
    let mut headers = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let len = usize::from(r.take(1)?[0]);
        let name = std::str::from_utf8(r.take(len)?).ok()?.to_owned();
        let len = usize::from(u16::from_be_bytes(r.take(2)?.try_into().ok()?));
        headers.push((name, r.take(len)?.to_vec()));
    }
    let mut response = Response::new(status, Bytes::new());
    response.headers = headers;
    Some((kind, response, bytes.len() - r.0.len()))
}

fn kind(failed: bool) -> CompletionKind {
    if failed {
        CompletionKind::Failed
    } else {
        CompletionKind::Succeeded
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
}

/// Decodes a completed record (a raw body is handed out as a slice of it, without a copy).
pub(crate) fn decode_completion(record: &Bytes) -> Result<Completion, Error> {
    let corrupt = |why: &str| Error::corrupt(STORE, why.to_owned());
    let Some(Head::Completed { meta_at, .. }) = decode_head(record, 0) else {
        return Err(corrupt("not a completed record"));
    };
    let rest = &record[meta_at..];
    let (stored, meta) = match rest.first() {
        Some(first) if first & 0x80 != 0 => {
            let (kind, response, len) =
                decode_compact_meta(rest).ok_or_else(|| corrupt("bad metadata"))?;
            (&rest[len..], Ok((kind, response)))
        }
        _ => {
            let (len, rest) = rest
                .split_at_checked(4)
                .ok_or_else(|| corrupt("completed record too short"))?;
            let len = u32::from_be_bytes(read4(len)) as usize;
            if len > rest.len() {
                return Err(corrupt("metadata length past the record's end"));
            }
            let (meta, stored) = rest.split_at(len);
            (stored, Err(meta))
        }
    };
    let body = match record[0] {
        b'Z' => Bytes::from(decompress(stored).ok_or_else(|| corrupt("bad LZ4 body"))?),
        _ => record.slice_ref(stored),
    };
    match meta {
        Ok((kind, mut response)) => {
            response.body = body;
            Ok(Completion { kind, response })
        }
        Err(meta) => decode_meta(meta, body).map_err(|e| Error::corrupt(STORE, e.to_string())),
    }
}

/// The replay of a completed record whose head says it expires at `expires_at`.
pub(crate) fn replay(record: &Bytes, expires_at: u32) -> Result<Replay, Error> {
    Ok(Replay {
        completion: decode_completion(record)?,
        expires_in: expires_in(expires_at),
    })
}

/// Answers a `value` whose head does not decode, read with its key's `pttl`: absent when it
/// is an in-progress record whose key expired between the `GET` and the `PTTL`, else corrupt.
pub(crate) fn vanished(value: &[u8], pttl: i64) -> Result<(), Error> {
    if pttl < 0 && value.first() == Some(&b'P') {
        Ok(())
    } else {
        Err(Error::corrupt(STORE, "not a record"))
    }
}

fn decompress(stored: &[u8]) -> Option<Vec<u8>> {
    let (len, block) = stored.split_at_checked(4)?;
    let len = u32::from_be_bytes(read4(len)) as usize;
    if len > block.len().saturating_mul(LZ4_MAX_RATIO).saturating_add(16) {
        return None;
    }
    let mut out = vec![0; len];
    let written = lz4_flex::decompress_into(block, &mut out).ok()?;
    (written == len).then_some(out)
}

/// What a record's head says, decoded for the store's decisions and for `stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Head {
    /// In progress: the holder's token, the attempt, and the lease time left by the
    /// server's clock (negative once the deadline passed).
    InProgress {
        fingerprint: Fingerprint,
        token: FencingToken,
        attempt: u32,
        lease_left_ms: i64,
    },
    /// Completed, with its kind (read from the head alone), its expiry (Unix seconds) and
    /// where its metadata starts.
    Completed {
        fingerprint: Fingerprint,
        attempt: u32,
        kind: Option<CompletionKind>,
        expires_at: u32,
        meta_at: usize,
    },
}

/// Decodes the head of a record (at least its first 59 bytes, or all of it when shorter).
/// `pttl_ms` is the key's `PTTL`. `None` when the bytes are not a record, or an in-progress
/// record has no expiry.
pub(crate) fn decode_head(head: &[u8], pttl_ms: i64) -> Option<Head> {
    match *head.first()? {
        b'P' if head.len() == IN_PROGRESS_LEN => {
            if pttl_ms < 0 {
                return None;
            }
            let (fingerprint, attempt) = identity(head);
            Some(Head::InProgress {
                fingerprint,
                token: FencingToken::from_slice(&head[1..17])?,
                attempt,
                lease_left_ms: pttl_ms.saturating_sub(read_u48(&head[17..23])),
            })
        }
        b'C' | b'Z' | b'H' if head.len() >= COMPLETED_IDENTITY_MIN => {
            let (attempt, meta_at) = match head[37] {
                LONG_ATTEMPT => (u32::from_be_bytes(read4(head.get(38..42)?)), 42),
                short => (u32::from(short), 38),
            };
            let kind = match head.get(meta_at) {
                Some(first) if first & 0x80 != 0 => Some(first & 0x40 != 0),
                // The length-prefixed metadata: length (4), version (1), kind (1).
                _ => head
                    .get(meta_at + 5)
                    .and_then(|b| (*b < 2).then_some(*b == 1)),
            };
            Some(Head::Completed {
                fingerprint: fingerprint_of(&head[1..33]),
                attempt,
                expires_at: u32::from_be_bytes(read4(&head[33..37])),
                kind: kind.map(self::kind),
                meta_at,
            })
        }
        _ => None,
    }
}

fn read_u48(bytes: &[u8]) -> i64 {
    let mut wide = [0; 8];
    wide[2..].copy_from_slice(&bytes[..6]);
    i64::try_from(u64::from_be_bytes(wide)).unwrap_or(i64::MAX)
}

/// Decodes any record for [`idem_core::Store::get`], with its key's `PTTL`.
pub(crate) fn decode_record(
    id: &RecordId,
    record: Bytes,
    pttl_ms: i64,
) -> Result<idem_core::Record, Error> {
    check_tag(&record)?;
    let head = decode_head(&record, pttl_ms).ok_or_else(|| {
        Error::corrupt(
            STORE,
            match record[0] {
                b'P' if record.len() != IN_PROGRESS_LEN => "in-progress record of wrong length",
                b'P' => "in-progress record without an expiry",
                _ => "completed record too short",
            },
        )
    })?;
    let (fingerprint, attempt, state) = match head {
        Head::InProgress {
            fingerprint,
            token,
            attempt,
            lease_left_ms,
        } => (
            fingerprint,
            attempt,
            RecordState::InProgress {
                token,
                lease_remaining: millis(lease_left_ms),
            },
        ),
        Head::Completed {
            fingerprint,
            attempt,
            ..
        } => (
            fingerprint,
            attempt,
            RecordState::Completed(decode_completion(&record)?),
        ),
    };
    Ok(idem_core::Record {
        id: id.clone(),
        fingerprint,
        attempt,
        state,
        expires_in: millis(pttl_ms),
    })
}

/// A 32-byte slice of a decoded head as a fingerprint.
pub(crate) fn fingerprint_of(bytes: &[u8]) -> Fingerprint {
    let mut fp = [0; 32];
    fp.copy_from_slice(&bytes[..32]);
    Fingerprint::from_bytes(fp)
}

/// Refuses a value whose first byte is no record tag, saying so (rather than failing later
/// on a length that means nothing in a foreign value).
fn check_tag(record: &[u8]) -> Result<(), Error> {
    match record.first() {
        Some(b'P' | b'C' | b'Z' | b'H') => Ok(()),
        Some(&tag) => Err(Error::corrupt(
            STORE,
            format!(
                "unknown record tag {:?} (byte 0x{tag:02x}; idem writes 'P', 'C', 'Z' or \
                 'H'): the value was not written by this version of idem",
                char::from(tag)
            ),
        )),
        None => Err(Error::corrupt(STORE, "empty value (not a record)")),
    }
}

/// A non-negative millisecond count from Redis as a duration (negative counts are zero).
pub(crate) fn millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

fn read4(bytes: &[u8]) -> [u8; 4] {
    let mut out = [0; 4];
    out.copy_from_slice(&bytes[..4]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{CompletionKind, Response};
    use proptest::prelude::*;

    /// An expiry for the records the tests build.
    const AT: u32 = 1_900_000_000;

    /// Builds the record the `complete` script writes over the in-progress record `p`, by
    /// the layout's table (not by [`completed`], which the tests check against it).
    fn as_stored(p: &[u8; IN_PROGRESS_LEN], e: &EncodedCompletion) -> Vec<u8> {
        let mut out = vec![e.tag];
        out.extend_from_slice(&p[23..55]);
        out.extend_from_slice(&AT.to_be_bytes());
        match p[55..59] {
            [0, 0, 0, short] if short < 255 => out.push(short),
            _ => {
                out.push(255);
                out.extend_from_slice(&p[55..59]);
            }
        }
        out.extend_from_slice(&e.meta);
        out.extend_from_slice(&e.body);
        out
    }

    fn decode(stored: &[u8]) -> Result<Completion, Error> {
        decode_completion(&Bytes::copy_from_slice(stored))
    }

    fn id() -> RecordId {
        RecordId::new(
            idem_core::Scope::global(),
            idem_core::Key::new("k").unwrap(),
        )
    }

    fn held(fp: &Fingerprint, attempt: u32) -> [u8; IN_PROGRESS_LEN] {
        in_progress(&FencingToken::random(), 1000, fp, attempt)
    }

    fn completion(body: Vec<u8>) -> Completion {
        Completion {
            kind: CompletionKind::Failed,
            response: Response::new(503, body).with_header("retry-after", "3"),
        }
    }

    fn limit(max_bytes: usize, oversize: OversizeBody) -> BodyLimit {
        BodyLimit {
            max_bytes,
            oversize,
        }
    }

    #[test]
    fn the_written_record_is_the_layouts() {
        let fp = Fingerprint::of_bytes(b"x");
        let e = encode_completion(&completion(b"body".to_vec()), &BodyLimit::default()).unwrap();
        for attempt in [1, 254, 255, 70_000, u32::MAX] {
            let written = completed((fp, attempt), &e, AT);
            assert_eq!(written, as_stored(&held(&fp, attempt), &e));
        }
    }

    #[test]
    fn the_stored_expiry_is_rounded_down_and_read_back_by_the_clock() {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let at = expires_at(Duration::from_millis(2_500));
        assert!(
            u64::from(at) * 1000 <= (now + Duration::from_millis(2_500)).as_millis() as u64 + 5
        );
        assert!(u64::from(at) + 1 >= (now + Duration::from_millis(2_500)).as_secs());
        let left = expires_in(at);
        assert!(left <= Duration::from_millis(2_500), "{left:?}");
        assert!(left >= Duration::from_millis(1_000), "{left:?}");
        assert_eq!(expires_in(0), Duration::ZERO);
        assert_eq!(expires_at(Duration::MAX), u32::MAX);
    }

    #[test]
    fn in_progress_head_reads_back() {
        let (fp, token) = (Fingerprint::of_bytes(b"x"), FencingToken::random());
        let record = in_progress(&token, 5_000, &fp, 7);
        // The lease time left is the PTTL minus the margin: negative once the deadline
        // passed, unknown without an expiry.
        for (pttl, left) in [(12_000, Some(7_000)), (4_000, Some(-1_000)), (-1, None)] {
            let head = left.map(|lease_left_ms| Head::InProgress {
                fingerprint: fp,
                token,
                attempt: 7,
                lease_left_ms,
            });
            assert_eq!(decode_head(&record, pttl), head, "PTTL {pttl}");
        }
    }

    #[test]
    fn completions_read_back_in_either_metadata_form() {
        let fp = Fingerprint::of_bytes(b"x");
        let plain = Completion::succeeded(Response::new(201, "0123456789"));
        let many = (0..64).fold(Response::new(200, "x"), |r, i| {
            r.with_header(format!("h{i}"), "v")
        });
        let long_name = Response::new(200, "x").with_header("h".repeat(300), "v");
        let long_value = Response::new(200, "x").with_header("h", vec![b'v'; 70_000]);
        // (completion, attempt, the metadata's first byte, the stored length when fixed):
        // a plain success is 41 bytes plus its body; what the compact metadata cannot hold
        // is length-prefixed.
        let cases = [
            (plain, 1, 0x80, Some(41 + 10)),
            (Completion::failed(many), 2, 0, None),
            (Completion::failed(long_name), 2, 0, None),
            (Completion::failed(long_value), 2, 0, None),
        ];
        for (c, attempt, meta, len) in cases {
            let e = encode_completion(&c, &BodyLimit::default()).unwrap();
            assert_eq!((e.tag, e.meta[0]), (b'C', meta));
            let stored = as_stored(&held(&fp, attempt), &e);
            if let Some(len) = len {
                assert_eq!(stored.len(), len);
            }
            assert_eq!(decode(&stored).unwrap(), c);
            let head = Head::Completed {
                fingerprint: fp,
                attempt,
                kind: Some(c.kind),
                expires_at: AT,
                meta_at: 38,
            };
            assert_eq!(decode_head(&stored, 10), Some(head));
        }
    }

    #[test]
    fn every_tag_passes_the_tag_check() {
        let fp = Fingerprint::of_bytes(b"x");
        let p = held(&fp, 3);
        let big = completion(vec![b'a'; 1000]);
        let mut records = vec![p.to_vec()];
        for (c, oversize) in [
            (&big, OversizeBody::Compress),
            (&big, OversizeBody::StatusAndHeaders),
            (&completion(b"ok".to_vec()), OversizeBody::Refuse),
        ] {
            let e = encode_completion(c, &limit(100, oversize)).unwrap();
            records.push(as_stored(&p, &e));
        }
        let mut tags: Vec<u8> = records.iter().map(|r| r[0]).collect();
        tags.sort_unstable();
        assert_eq!(tags, b"CHPZ");
        for record in records {
            let back = decode_record(&id(), Bytes::from(record), 5_000).unwrap();
            assert_eq!((back.fingerprint, back.attempt), (fp, 3));
        }
        // A known tag on a value of the wrong shape is corrupt, and says why.
        for (value, why) in [
            (&b"P0123"[..], "in-progress record of wrong length"),
            (&p[..], "in-progress record without an expiry"),
            (&b"C0123"[..], "completed record too short"),
        ] {
            let Err(Error::Corrupt { detail, .. }) =
                decode_record(&id(), Bytes::copy_from_slice(value), -1)
            else {
                panic!("{value:?} decoded");
            };
            assert_eq!(detail, why);
        }
    }

    #[test]
    fn body_policies() {
        let stored = |e: &EncodedCompletion| as_stored(&held(&Fingerprint::of_bytes(b"x"), 2), e);
        let big = completion(b"abcd".repeat(1000));

        let z = encode_completion(&big, &limit(1000, OversizeBody::Compress)).unwrap();
        assert_eq!(z.tag, b'Z');
        assert!(z.body.len() < 1000);
        assert_eq!(decode(&stored(&z)).unwrap(), big);

        let h = encode_completion(&big, &limit(1000, OversizeBody::StatusAndHeaders)).unwrap();
        assert_eq!(h.tag, b'H');
        let back = decode(&stored(&h)).unwrap();
        assert_eq!(back.response.status, 503);
        assert_eq!(back.response.headers, big.response.headers);
        assert!(back.response.body.is_empty());

        // Refused over the limit; incompressible data too, even when compressing.
        let noise: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for (c, oversize) in [
            (big, OversizeBody::Refuse),
            (completion(noise), OversizeBody::Compress),
        ] {
            let refused = encode_completion(&c, &limit(1000, oversize));
            assert!(matches!(refused, Err(Error::Invalid(_))), "{oversize:?}");
        }
    }

    #[test]
    fn corrupt_lz4_length_is_refused_without_allocating() {
        let fp = Fingerprint::of_bytes(b"x");
        let c = completion(vec![7; 4000]);
        let z = encode_completion(&c, &limit(100, OversizeBody::Compress)).unwrap();
        let mut stored = as_stored(&held(&fp, 1), &z);
        let at = stored.len() - z.body.len();
        stored[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(decode(&stored), Err(Error::Corrupt { .. })));
    }

    proptest! {
        #[test]
        fn completed_records_round_trip(
            body in proptest::collection::vec(any::<u8>(), 0..300),
            attempt: u32,
            status: u16,
            headers in proptest::collection::vec(("[a-z-]{0,300}", proptest::collection::vec(any::<u8>(), 0..40)), 0..70),
        ) {
            let fp = Fingerprint::of_bytes(&body);
            let mut c = completion(body);
            c.response.status = status;
            c.response.headers = headers;
            if let Ok(e) = encode_completion(&c, &limit(100, OversizeBody::Compress)) {
                let stored = as_stored(&held(&fp, attempt), &e);
                let head = decode_head(&stored, 10);
                prop_assert!(
                    matches!(head, Some(Head::Completed { fingerprint, attempt: a, kind: Some(CompletionKind::Failed), expires_at: AT, .. }) if fingerprint == fp && a == attempt),
                    "{:?}", head
                );
                prop_assert_eq!(decode(&stored).unwrap(), c);
            }
        }

        #[test]
        fn decoding_never_panics(record in proptest::collection::vec(any::<u8>(), 0..120), tag in prop_oneof![Just(b'P'), Just(b'C'), Just(b'Z'), Just(b'H'), any::<u8>()], pttl in -2i64..100_000) {
            let mut record = record;
            if let Some(first) = record.first_mut() {
                *first = tag;
            }
            let _ = decode_record(&id(), Bytes::from(record), pttl);
        }

        #[test]
        fn unknown_tags_are_named(record in proptest::collection::vec(any::<u8>(), 0..120), tag in any::<u8>().prop_filter("not a tag", |t| !b"PCZH".contains(t))) {
            let mut record = record;
            record.insert(0, tag);
            let Err(Error::Corrupt { detail, .. }) = decode_record(&id(), Bytes::from(record), 1000) else {
                panic!("tag {tag} decoded");
            };
            prop_assert!(detail.contains("unknown record tag"), "{}", detail);
        }
    }
}
