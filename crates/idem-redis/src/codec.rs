//! The layout of a record: one Redis string per record, binary, versioned by its first byte.
//!
//! A string rather than a hash because a hash whose body field is longer than
//! `hash-max-listpack-value` (64 bytes by default) is stored as a hash table, which costs
//! several hundred bytes per record; a string costs only its bytes (see the crate docs for
//! the measured figures). Integers are big-endian.
//!
//! ```text
//! in progress (59 bytes)            completed (41 bytes + metadata + body)
//! [0]      'p'                      [0]       'c' raw body | 'z' LZ4 body | 'h' body dropped
//! [1..33)  fingerprint              [1..33)   fingerprint
//! [33..37) attempt, u32             [33..37)  attempt, u32
//! [37..53) fencing token            [37..41)  metadata length n, u32
//! [53..59) lease deadline, u48 ms   [41..41+n) metadata (idem_core::encode_meta)
//!          (server clock, Unix)     [41+n..)  body ('z': u32 original length, LZ4 block)
//! ```
//!
//! The scripts in `lua/` read the in-progress layout and the first 37 bytes of a completed
//! one; this module writes the completed tail and decodes everything the scripts return.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    decode_meta, encode_meta, Completion, Error, FencingToken, Fingerprint, RecordId, RecordState,
};

use crate::config::{BodyLimit, OversizeBody};
use crate::STORE;

/// Length of an in-progress record.
pub(crate) const IN_PROGRESS_LEN: usize = 59;
/// Length of a completed record's fixed head (tag, fingerprint, attempt, metadata length).
const COMPLETED_HEAD_LEN: usize = 41;
/// LZ4 cannot expand data by more than about 255 to 1; a stored length above that is corrupt,
/// and checking it bounds the allocation a corrupt record can cause.
const LZ4_MAX_RATIO: usize = 255;

/// A completion as the `complete` script takes it.
#[derive(Debug)]
pub(crate) struct EncodedCompletion {
    /// `c`, `z` or `h`.
    pub tag: &'static [u8],
    /// The metadata's length (u32) then the metadata.
    pub meta: Vec<u8>,
    /// The body as stored.
    pub body: Bytes,
}

/// Encodes a completion, applying the body limit.
pub(crate) fn encode_completion(
    completion: &Completion,
    limit: &BodyLimit,
) -> Result<EncodedCompletion, Error> {
    let response = &completion.response;
    let meta = encode_meta(completion.kind, response);
    let meta_len = u32::try_from(meta.len())
        .map_err(|_| Error::Invalid(format!("{} bytes of headers", meta.len())))?;
    let mut framed = Vec::with_capacity(4 + meta.len());
    framed.extend_from_slice(&meta_len.to_be_bytes());
    framed.extend_from_slice(&meta);

    let body = &response.body;
    let (tag, body): (&'static [u8], Bytes) = if body.len() <= limit.max_bytes {
        (b"c", body.clone())
    } else {
        match limit.oversize {
            OversizeBody::Refuse => {
                return Err(Error::Invalid(format!(
                    "response body of {} bytes is over the redis store's limit of {} bytes",
                    body.len(),
                    limit.max_bytes
                )))
            }
            OversizeBody::StatusAndHeaders => (b"h", Bytes::new()),
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
                (b"z", Bytes::from(packed))
            }
        }
    };
    Ok(EncodedCompletion {
        tag,
        meta: framed,
        body,
    })
}

/// Decodes a completed record (tag `c`, `z` or `h`).
pub(crate) fn decode_completion(record: &[u8]) -> Result<Completion, Error> {
    let corrupt = |why: &str| Error::corrupt(STORE, why.to_owned());
    if record.len() < COMPLETED_HEAD_LEN {
        return Err(corrupt("completed record too short"));
    }
    let meta_len = u32::from_be_bytes(read4(&record[37..41])) as usize;
    let rest = &record[COMPLETED_HEAD_LEN..];
    if meta_len > rest.len() {
        return Err(corrupt("metadata length past the record's end"));
    }
    let (meta, stored) = rest.split_at(meta_len);
    let body = match record[0] {
        b'c' | b'h' => Bytes::copy_from_slice(stored),
        b'z' => Bytes::from(decompress(stored).ok_or_else(|| corrupt("bad LZ4 body"))?),
        _ => return Err(corrupt("not a completed record")),
    };
    decode_meta(meta, body).map_err(|e| Error::corrupt(STORE, e.to_string()))
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

/// The fingerprint and attempt every record starts with.
pub(crate) fn decode_head(record: &[u8]) -> Result<(Fingerprint, u32), Error> {
    if record.len() < 37 {
        return Err(Error::corrupt(STORE, "record too short"));
    }
    let mut fp = [0; 32];
    fp.copy_from_slice(&record[1..33]);
    Ok((
        Fingerprint::from_bytes(fp),
        u32::from_be_bytes(read4(&record[33..37])),
    ))
}

/// Decodes any record for [`idem_core::Store::get`]; `now_ms` is the server's clock.
pub(crate) fn decode_record(
    id: &RecordId,
    record: &[u8],
    pttl_ms: i64,
    now_ms: i64,
) -> Result<idem_core::Record, Error> {
    check_tag(record)?;
    let (fingerprint, attempt) = decode_head(record)?;
    let state = match record[0] {
        b'p' => {
            if record.len() != IN_PROGRESS_LEN {
                return Err(Error::corrupt(STORE, "in-progress record of wrong length"));
            }
            let token = FencingToken::from_slice(&record[37..53])
                .ok_or_else(|| Error::corrupt(STORE, "bad token"))?;
            // A 48-bit deadline, widened to 64 bits.
            let mut deadline = [0; 8];
            deadline[2..].copy_from_slice(&record[53..59]);
            let deadline = i64::try_from(u64::from_be_bytes(deadline)).unwrap_or(i64::MAX);
            RecordState::InProgress {
                token,
                lease_remaining: millis(deadline.saturating_sub(now_ms)),
            }
        }
        _ => RecordState::Completed(decode_completion(record)?),
    };
    Ok(idem_core::Record {
        id: id.clone(),
        fingerprint,
        attempt,
        state,
        expires_in: millis(pttl_ms),
    })
}

/// Refuses a value whose first byte is no record tag, saying so (rather than failing later
/// on a length that means nothing in a foreign value).
fn check_tag(record: &[u8]) -> Result<(), Error> {
    match record.first() {
        Some(b'p' | b'c' | b'z' | b'h') => Ok(()),
        Some(&tag) => Err(Error::corrupt(
            STORE,
            format!(
                "unknown record tag {:?} (byte 0x{tag:02x}; idem writes 'p', 'c', 'z' or 'h'): \
                 the value was not written by this version of idem",
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

    /// Builds the record the `complete` script would write over an in-progress record.
    fn as_stored(fp: &Fingerprint, attempt: u32, e: &EncodedCompletion) -> Vec<u8> {
        let mut out = e.tag.to_vec();
        out.extend_from_slice(fp.as_bytes());
        out.extend_from_slice(&attempt.to_be_bytes());
        out.extend_from_slice(&e.meta);
        out.extend_from_slice(&e.body);
        out
    }

    fn completion(body: Vec<u8>) -> Completion {
        Completion {
            kind: CompletionKind::Failed,
            response: Response::new(503, body).with_header("retry-after", "3"),
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
        assert_eq!(decode_completion(&as_stored(&fp, 2, &z)).unwrap(), big);

        let h = encode_completion(&big, &limit(OversizeBody::StatusAndHeaders)).unwrap();
        let back = decode_completion(&as_stored(&fp, 2, &h)).unwrap();
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
        let mut stored = as_stored(&fp, 1, &z);
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
        ) {
            let fp = Fingerprint::of_bytes(&body);
            let c = completion(body);
            let e = encode_completion(&c, &BodyLimit { max_bytes: 100, oversize: OversizeBody::Compress });
            if let Ok(e) = e {
                let stored = as_stored(&fp, attempt, &e);
                prop_assert_eq!(decode_head(&stored).unwrap(), (fp, attempt));
                prop_assert_eq!(decode_completion(&stored).unwrap(), c);
            }
        }

        #[test]
        fn decoding_never_panics(record in proptest::collection::vec(any::<u8>(), 0..120), tag in prop_oneof![Just(b'p'), Just(b'c'), Just(b'z'), Just(b'h'), any::<u8>()]) {
            let mut record = record;
            if let Some(first) = record.first_mut() {
                *first = tag;
            }
            let id = RecordId::new(idem_core::Scope::global(), idem_core::Key::new("k").unwrap());
            let _ = decode_record(&id, &record, 1000, 0);
        }

        #[test]
        fn unknown_tags_are_named(record in proptest::collection::vec(any::<u8>(), 0..120), tag in any::<u8>().prop_filter("not a tag", |t| !b"pczh".contains(t))) {
            let mut record = record;
            record.insert(0, tag);
            let id = RecordId::new(idem_core::Scope::global(), idem_core::Key::new("k").unwrap());
            let Err(Error::Corrupt { detail, .. }) = decode_record(&id, &record, 1000, 0) else {
                panic!("tag {tag} decoded");
            };
            prop_assert!(detail.contains("unknown record tag"), "{}", detail);
        }
    }
}
