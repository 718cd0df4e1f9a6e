//! The layout of a record: one Redis string per record, binary, versioned by its first byte.
//!
//! A string rather than a hash because a hash whose body field is longer than
//! `hash-max-listpack-value` (64 bytes by default) is stored as a hash table, which costs
//! several hundred bytes per record; a string costs only its bytes (see the crate docs for
//! the measured figures). Integers are big-endian.
//!
//! ```text
//! in progress (59 bytes)             completed (40 bytes + headers + body)
//! [0]       'P'                      [0]       'c' raw body | 'z' LZ4 body | 'h' body dropped
//! [1..17)   fencing token            [1..33)   fingerprint
//! [17..23)  margin, u48 ms           [33..37)  attempt, u32
//! [23..55)  fingerprint              [37]      0x80 | kind << 6 | header count n (< 64);
//! [55..59)  attempt, u32                       kind: 0 succeeded, 1 failed
//!                                    [38..40)  status, u16
//!                                    then n × (name length u8, name, value length u16,
//!                                    value), then the body ('z': u32 original length, then
//!                                    the LZ4 block)
//! ```
//!
//! The in-progress record holds no clock reading, so a client writes it with a plain
//! `SET .. NX GET PX <lease + margin>`: its lease deadline is its expiry (by the server's
//! clock) minus its margin, and the key's `PTTL` minus the margin is the lease time left.
//! A completion carries the in-progress record's last 36 bytes (fingerprint and attempt)
//! over as its bytes 1 to 36. The client writes the completed record whole when its lease
//! carries the fingerprint ([`Completed`]), so the `complete` script compares the record's
//! first 17 bytes with `'P'` and the token and sets it: one `GETRANGE` and one `SET`, no
//! string built in Lua.
//!
//! The metadata's first byte tells its form: with its top bit set, the compact form above;
//! clear, the length-prefixed form: the length of [`idem_core::encode_meta`]'s bytes (u32,
//! whose top byte is 0 for anything under 16 MiB), then those bytes. Completions the
//! compact form cannot hold (64 headers or more, a header name over 255 bytes or a value
//! over 65,535) are written in the length-prefixed form, which is also how the previous
//! layout wrote every completion, so its completed records are read as they are. Its
//! in-progress records (`p`: fingerprint, attempt, token, absolute deadline) are read too.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    decode_meta, encode_meta, Completion, CompletionKind, Error, FencingToken, Fingerprint,
    RecordId, RecordState, Response,
};

use crate::config::{BodyLimit, OversizeBody};
use crate::STORE;

/// Length of an in-progress record (either layout).
pub(crate) const IN_PROGRESS_LEN: usize = 59;
/// Length of what every completed record starts with (tag, fingerprint, attempt).
const COMPLETED_IDENTITY_END: usize = 37;
/// LZ4 cannot expand data by more than about 255 to 1; a stored length above that is corrupt,
/// and checking it bounds the allocation a corrupt record can cause.
const LZ4_MAX_RATIO: usize = 255;

/// An in-progress record, as the fast path's `SET` writes it (and `begin.lua` on a
/// takeover): a lease of `token` for attempt `attempt`, kept `margin_ms` past its deadline.
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

/// A completion as the `complete` script takes it.
#[derive(Debug)]
pub(crate) struct EncodedCompletion {
    /// `c` (raw body), `z` (LZ4 body) or `h` (body dropped).
    pub tag: &'static [u8],
    /// The metadata, compact or length-prefixed (its first byte tells which).
    pub meta: Vec<u8>,
    /// The body as stored.
    pub body: Bytes,
}

/// The completed record as one command argument, written straight into the command: whole
/// (the tag, the lease's fingerprint and attempt, the metadata, the body), or, without a
/// fingerprint, the tag followed by the metadata and the body (the `complete` script then
/// carries the identity over from the in-progress record).
pub(crate) struct Completed<'a> {
    pub encoded: &'a EncodedCompletion,
    /// The fingerprint and attempt of the lease's in-progress record, when known.
    pub identity: Option<(&'a Fingerprint, u32)>,
}

impl Completed<'_> {
    /// The argument's length in bytes.
    pub(crate) fn len(&self) -> usize {
        let identity = if self.identity.is_some() { 36 } else { 0 };
        1 + identity + self.encoded.meta.len() + self.encoded.body.len()
    }
}

impl redis::ToRedisArgs for Completed<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use bytes::BufMut as _;
        let mut arg = out.bufmut_for_next_arg(self.len());
        arg.put_slice(self.encoded.tag);
        if let Some((fingerprint, attempt)) = self.identity {
            arg.put_slice(fingerprint.as_bytes());
            arg.put_u32(attempt);
        }
        arg.put_slice(&self.encoded.meta);
        arg.put_slice(&self.encoded.body);
    }
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
        tag: [b"c", b"z", b"h"][form],
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
    let kind = if first & 0x40 == 0 {
        CompletionKind::Succeeded
    } else {
        CompletionKind::Failed
    };
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

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
}

/// Decodes a completed record (tag `c`, `z` or `h`) held in `record` (a slice of `owner`,
/// so a raw body is handed out without a copy).
pub(crate) fn decode_completion_in(owner: &Bytes, record: &[u8]) -> Result<Completion, Error> {
    let corrupt = |why: &str| Error::corrupt(STORE, why.to_owned());
    if record.len() < COMPLETED_IDENTITY_END || !matches!(record[0], b'c' | b'z' | b'h') {
        return Err(corrupt("not a completed record"));
    }
    let rest = &record[COMPLETED_IDENTITY_END..];
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
        b'z' => Bytes::from(decompress(stored).ok_or_else(|| corrupt("bad LZ4 body"))?),
        _ => owner.slice_ref(stored),
    };
    match meta {
        Ok((kind, mut response)) => {
            response.body = body;
            Ok(Completion { kind, response })
        }
        Err(meta) => decode_meta(meta, body).map_err(|e| Error::corrupt(STORE, e.to_string())),
    }
}

/// Decodes a completed record for tests and callers holding a plain slice.
#[cfg(test)]
pub(crate) fn decode_completion(record: &[u8]) -> Result<Completion, Error> {
    let owner = Bytes::copy_from_slice(record);
    decode_completion_in(&owner, &owner)
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
pub(crate) enum Head<'a> {
    /// In progress: the holder's token, the attempt, and the lease time left by the
    /// server's clock (negative once the deadline passed).
    InProgress {
        fingerprint: &'a [u8],
        token: &'a [u8],
        attempt: u32,
        lease_left_ms: i64,
    },
    /// Completed, with its kind (read from the head alone).
    Completed {
        fingerprint: &'a [u8],
        attempt: u32,
        kind: Option<CompletionKind>,
    },
}

/// Decodes the head of a record (at least its first 59 bytes, or all of it when shorter).
/// `pttl_ms` is the key's `PTTL`, `now_ms` the server's clock (Unix ms; only records of the
/// previous layout need it). `None` when the bytes are not a record, or an in-progress
/// record has no expiry.
pub(crate) fn decode_head(head: &[u8], pttl_ms: i64, now_ms: i64) -> Option<Head<'_>> {
    match *head.first()? {
        b'P' if head.len() == IN_PROGRESS_LEN => {
            if pttl_ms < 0 {
                return None;
            }
            Some(Head::InProgress {
                fingerprint: &head[23..55],
                token: &head[1..17],
                attempt: u32::from_be_bytes(read4(&head[55..59])),
                lease_left_ms: pttl_ms.saturating_sub(read_u48(&head[17..23])),
            })
        }
        b'p' if head.len() == IN_PROGRESS_LEN => Some(Head::InProgress {
            fingerprint: &head[1..33],
            token: &head[37..53],
            attempt: u32::from_be_bytes(read4(&head[33..37])),
            lease_left_ms: read_u48(&head[53..59]).saturating_sub(now_ms),
        }),
        b'c' | b'z' | b'h' if head.len() >= COMPLETED_IDENTITY_END => {
            let kind = match head.get(37) {
                Some(first) if first & 0x80 != 0 => Some(first & 0x40 != 0),
                // The length-prefixed metadata: length (4), version (1), kind (1).
                _ => head.get(42).and_then(|b| (*b < 2).then_some(*b == 1)),
            };
            Some(Head::Completed {
                fingerprint: &head[1..33],
                attempt: u32::from_be_bytes(read4(&head[33..37])),
                kind: kind.map(|failed| {
                    if failed {
                        CompletionKind::Failed
                    } else {
                        CompletionKind::Succeeded
                    }
                }),
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

/// Decodes any record for [`idem_core::Store::get`]; `now_ms` is the server's clock.
pub(crate) fn decode_record(
    id: &RecordId,
    record: Bytes,
    pttl_ms: i64,
    now_ms: i64,
) -> Result<idem_core::Record, Error> {
    check_tag(&record)?;
    let corrupt = || Error::corrupt(STORE, "bad fencing token");
    let head = decode_head(&record, pttl_ms, now_ms).ok_or_else(|| {
        Error::corrupt(
            STORE,
            match record[0] {
                b'P' | b'p' if record.len() != IN_PROGRESS_LEN => {
                    "in-progress record of wrong length"
                }
                b'P' | b'p' => "in-progress record without an expiry",
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
                token: FencingToken::from_slice(token).ok_or_else(corrupt)?,
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
            RecordState::Completed(decode_completion_in(&record, &record)?),
        ),
    };
    Ok(idem_core::Record {
        id: id.clone(),
        fingerprint: fingerprint_of(fingerprint),
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
        Some(b'P' | b'p' | b'c' | b'z' | b'h') => Ok(()),
        Some(&tag) => Err(Error::corrupt(
            STORE,
            format!(
                "unknown record tag {:?} (byte 0x{tag:02x}; idem writes 'P', 'c', 'z' or 'h', \
                 and reads 'p' of its previous layout): the value was not written by this \
                 version of idem",
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

    /// Builds the record the `complete` script writes over the in-progress record `p`.
    fn as_stored(p: &[u8; IN_PROGRESS_LEN], e: &EncodedCompletion) -> Vec<u8> {
        let mut out = e.tag.to_vec();
        out.extend_from_slice(&p[23..59]);
        out.extend_from_slice(&e.meta);
        out.extend_from_slice(&e.body);
        out
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

    #[test]
    fn in_progress_head_reads_back() {
        let (fp, token) = (Fingerprint::of_bytes(b"x"), FencingToken::random());
        let record = in_progress(&token, 5_000, &fp, 7);
        let head = decode_head(&record, 12_000, 0).unwrap();
        assert_eq!(
            head,
            Head::InProgress {
                fingerprint: fp.as_bytes(),
                token: token.as_bytes(),
                attempt: 7,
                lease_left_ms: 7_000,
            }
        );
        // No expiry: the deadline cannot be told.
        assert_eq!(decode_head(&record, -1, 0), None);
        // A deadline passed: negative time left.
        let Some(Head::InProgress { lease_left_ms, .. }) = decode_head(&record, 4_000, 0) else {
            panic!()
        };
        assert_eq!(lease_left_ms, -1_000);
    }

    #[test]
    fn a_plain_success_is_40_bytes_plus_its_body() {
        let fp = Fingerprint::of_bytes(b"x");
        let ok = Completion::succeeded(Response::new(201, "0123456789"));
        let e = encode_completion(&ok, &BodyLimit::default()).unwrap();
        assert_eq!(e.tag, b"c");
        assert_eq!(e.meta[0], 0x80);
        let stored = as_stored(&held(&fp, 1), &e);
        assert_eq!(stored.len(), 40 + 10);
        assert_eq!(decode_completion(&stored).unwrap(), ok);
        assert!(matches!(
            decode_head(&stored, 10, 0),
            Some(Head::Completed {
                attempt: 1,
                kind: Some(CompletionKind::Succeeded),
                ..
            })
        ));
    }

    #[test]
    fn what_the_compact_metadata_cannot_hold_is_length_prefixed() {
        let fp = Fingerprint::of_bytes(b"x");
        let many = (0..64).fold(Response::new(200, "x"), |r, i| {
            r.with_header(format!("h{i}"), "v")
        });
        for response in [
            many,
            Response::new(200, "x").with_header("h".repeat(300), "v"),
            Response::new(200, "x").with_header("h", vec![b'v'; 70_000]),
        ] {
            let c = Completion::failed(response);
            let e = encode_completion(&c, &BodyLimit::default()).unwrap();
            assert_eq!((e.tag, e.meta[0]), (&b"c"[..], 0));
            let stored = as_stored(&held(&fp, 2), &e);
            assert_eq!(decode_completion(&stored).unwrap(), c);
            assert!(matches!(
                decode_head(&stored, 10, 0),
                Some(Head::Completed {
                    attempt: 2,
                    kind: Some(CompletionKind::Failed),
                    ..
                })
            ));
        }
    }

    #[test]
    fn records_of_the_previous_layout_are_read() {
        let fp = Fingerprint::of_bytes(b"x");
        // Completed: tag, fingerprint, attempt, metadata length, encode_meta, body.
        let c = completion(b"old".to_vec());
        let meta = encode_meta(c.kind, &c.response);
        let mut old = b"c".to_vec();
        old.extend_from_slice(fp.as_bytes());
        old.extend_from_slice(&3u32.to_be_bytes());
        old.extend_from_slice(&(meta.len() as u32).to_be_bytes());
        old.extend_from_slice(&meta);
        old.extend_from_slice(b"old");
        assert_eq!(decode_completion(&old).unwrap(), c);
        // In progress: tag, fingerprint, attempt, token, absolute deadline.
        let token = FencingToken::random();
        let mut p = b"p".to_vec();
        p.extend_from_slice(fp.as_bytes());
        p.extend_from_slice(&4u32.to_be_bytes());
        p.extend_from_slice(token.as_bytes());
        p.extend_from_slice(&10_000u64.to_be_bytes()[2..]);
        assert_eq!(
            decode_head(&p, -1, 9_000),
            Some(Head::InProgress {
                fingerprint: fp.as_bytes(),
                token: token.as_bytes(),
                attempt: 4,
                lease_left_ms: 1_000,
            })
        );
    }

    #[test]
    fn every_tag_of_both_layouts_passes_the_tag_check() {
        let id = RecordId::new(
            idem_core::Scope::global(),
            idem_core::Key::new("k").unwrap(),
        );
        let fp = Fingerprint::of_bytes(b"x");
        let p = held(&fp, 3);
        let limit = |oversize| BodyLimit {
            max_bytes: 100,
            oversize,
        };
        let big = completion(vec![b'a'; 1000]);
        let mut records = vec![p.to_vec()];
        for oversize in [OversizeBody::Compress, OversizeBody::StatusAndHeaders] {
            records.push(as_stored(
                &p,
                &encode_completion(&big, &limit(oversize)).unwrap(),
            ));
        }
        records.push(as_stored(
            &p,
            &encode_completion(&completion(b"ok".to_vec()), &limit(OversizeBody::Refuse)).unwrap(),
        ));
        // The previous layout's in-progress record: fingerprint, attempt, token, deadline.
        let mut old = b"p".to_vec();
        old.extend_from_slice(fp.as_bytes());
        old.extend_from_slice(&3u32.to_be_bytes());
        old.extend_from_slice(FencingToken::random().as_bytes());
        old.extend_from_slice(&10_000u64.to_be_bytes()[2..]);
        records.push(old);
        let mut tags: Vec<u8> = records.iter().map(|r| r[0]).collect();
        tags.sort_unstable();
        assert_eq!(tags, b"Pchpz");
        for record in records {
            let back = decode_record(&id, Bytes::from(record), 5_000, 9_000).unwrap();
            assert_eq!((back.fingerprint, back.attempt), (fp, 3));
        }
        // A known tag on a value of the wrong shape is corrupt, and says why.
        for (value, why) in [
            (&b"P0123"[..], "in-progress record of wrong length"),
            (&p[..], "in-progress record without an expiry"),
            (&b"c0123"[..], "completed record too short"),
        ] {
            let Err(Error::Corrupt { detail, .. }) =
                decode_record(&id, Bytes::copy_from_slice(value), -1, 0)
            else {
                panic!("{value:?} decoded");
            };
            assert_eq!(detail, why);
        }
    }

    #[test]
    fn body_policies() {
        let fp = Fingerprint::of_bytes(b"x");
        let big = completion(b"abcd".repeat(1000));
        let limit = |oversize| BodyLimit {
            max_bytes: 1000,
            oversize,
        };

        let z = encode_completion(&big, &limit(OversizeBody::Compress)).unwrap();
        assert_eq!(z.tag, b"z");
        assert!(z.body.len() < 1000);
        assert_eq!(
            decode_completion(&as_stored(&held(&fp, 2), &z)).unwrap(),
            big
        );

        let h = encode_completion(&big, &limit(OversizeBody::StatusAndHeaders)).unwrap();
        assert_eq!(h.tag, b"h");
        let back = decode_completion(&as_stored(&held(&fp, 2), &h)).unwrap();
        assert_eq!(back.response.status, 503);
        assert_eq!(back.response.headers, big.response.headers);
        assert!(back.response.body.is_empty());

        assert!(matches!(
            encode_completion(&big, &limit(OversizeBody::Refuse)),
            Err(Error::Invalid(_))
        ));
        // Incompressible data over the limit is refused even when compressing.
        let noise: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        assert!(matches!(
            encode_completion(&completion(noise), &limit(OversizeBody::Compress)),
            Err(Error::Invalid(_))
        ));
    }

    #[test]
    fn corrupt_lz4_length_is_refused_without_allocating() {
        let fp = Fingerprint::of_bytes(b"x");
        let z = encode_completion(
            &completion(vec![7; 4000]),
            &BodyLimit {
                max_bytes: 100,
                oversize: OversizeBody::Compress,
            },
        )
        .unwrap();
        let mut stored = as_stored(&held(&fp, 1), &z);
        let at = stored.len() - z.body.len();
        stored[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_completion(&stored),
            Err(Error::Corrupt { .. })
        ));
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
            let e = encode_completion(&c, &BodyLimit { max_bytes: 100, oversize: OversizeBody::Compress });
            if let Ok(e) = e {
                let stored = as_stored(&held(&fp, attempt), &e);
                let head = decode_head(&stored, 10, 0);
                prop_assert!(
                    matches!(head, Some(Head::Completed { fingerprint, attempt: a, kind: Some(CompletionKind::Failed) }) if fingerprint == fp.as_bytes() && a == attempt),
                    "{:?}", head
                );
                prop_assert_eq!(decode_completion(&stored).unwrap(), c);
            }
        }

        #[test]
        fn decoding_never_panics(record in proptest::collection::vec(any::<u8>(), 0..120), tag in prop_oneof![Just(b'P'), Just(b'p'), Just(b'c'), Just(b'z'), Just(b'h'), any::<u8>()], pttl in -2i64..100_000) {
            let mut record = record;
            if let Some(first) = record.first_mut() {
                *first = tag;
            }
            let id = RecordId::new(idem_core::Scope::global(), idem_core::Key::new("k").unwrap());
            let _ = decode_record(&id, Bytes::from(record), pttl, 0);
        }

        #[test]
        fn unknown_tags_are_named(record in proptest::collection::vec(any::<u8>(), 0..120), tag in any::<u8>().prop_filter("not a tag", |t| !b"Ppczh".contains(t))) {
            let mut record = record;
            record.insert(0, tag);
            let id = RecordId::new(idem_core::Scope::global(), idem_core::Key::new("k").unwrap());
            let Err(Error::Corrupt { detail, .. }) = decode_record(&id, Bytes::from(record), 1000, 0) else {
                panic!("tag {tag} decoded");
            };
            prop_assert!(detail.contains("unknown record tag"), "{}", detail);
        }
    }
}
