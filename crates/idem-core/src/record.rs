//! Records, leases and stored responses, and the compact encoding backends store them in.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use uuid::Uuid;

use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

/// Identifies one acquisition of a key. A new random token is drawn for every `begin`, so
/// tokens never repeat across incarnations of a key: a worker whose lease was taken over, or
/// whose key was released and acquired again, holds a token that no longer matches and can
/// change nothing.
///
/// The token is unique, not ordered: compare it for equality only.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(Uuid);

impl FencingToken {
    /// A fresh random token: a version 4 UUID from the operating system's CSPRNG.
    pub fn random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Wraps a token read back from a store.
    pub const fn from_uuid(uuid: Uuid) -> Self {
        Self(uuid)
    }

    /// The token as a UUID.
    pub const fn as_uuid(&self) -> &Uuid {
        &self.0
    }

    /// The token's 16 bytes, as backends store it.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }

    /// Reads a token stored by [`FencingToken::as_bytes`].
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        Uuid::from_slice(bytes).ok().map(Self)
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", self.0)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Stands in for a deadline too far away for an `Instant` to hold: about 30 years.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// The right to run the work for one key, held until a deadline that the store's clock
/// decides. Every call that ends or extends it carries it, and the store checks its token.
#[derive(Clone, PartialEq, Eq)]
pub struct Lease {
    id: RecordId,
    token: FencingToken,
    attempt: u32,
    deadline: Instant,
    /// What the store wrote for this lease, when it hands that out ([`Lease::with_version`]).
    version: Option<Bytes>,
}

impl Lease {
    /// Builds a lease from a store's answer. `remaining` is the lease time the store granted,
    /// measured by the store's clock; `sent_at` is when the request that obtained it was
    /// sent, so the local deadline errs on the early side.
    pub fn new(
        id: RecordId,
        token: FencingToken,
        attempt: u32,
        remaining: Duration,
        sent_at: Instant,
    ) -> Self {
        Self {
            id,
            token,
            attempt,
            // A lease of `Duration::MAX` ("never expires") must not overflow the instant.
            deadline: sent_at
                .checked_add(remaining)
                .unwrap_or_else(|| sent_at + FAR_FUTURE),
            version: None,
        }
    }

    /// This lease, carrying the version its store handed out with it: opaque to everyone
    /// but that store, which compares its fenced writes (complete, release, extend) against
    /// exactly this, with nothing rebuilt or guessed (the Redis store: the bytes of the
    /// in-progress record it wrote). A store that sets none fences by the token alone.
    #[must_use]
    pub fn with_version(mut self, version: impl Into<Bytes>) -> Self {
        self.version = Some(version.into());
        self
    }

    /// The version the lease's store handed out with it ([`Lease::with_version`]).
    pub fn version(&self) -> Option<&[u8]> {
        self.version.as_deref()
    }

    /// This lease (same record, same token, same version) as a store renewed it: `attempt`
    /// and `remaining` as the store answered, measured from `sent_at` as in [`Lease::new`].
    pub fn renewed(&self, attempt: u32, remaining: Duration, sent_at: Instant) -> Self {
        Self {
            version: self.version.clone(),
            ..Self::new(self.id.clone(), self.token, attempt, remaining, sent_at)
        }
    }

    /// The record this lease is for.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// The fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// 1 for the first acquisition of the key, 2 after one takeover of an expired lease, and
    /// so on.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The local estimate of the deadline (the store decides; this errs early).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Lease time left by the local estimate.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("token", &self.token)
            .field("attempt", &self.attempt)
            .field("remaining", &self.remaining())
            .finish()
    }
}

/// Whether the stored outcome was a success or a terminal failure. Both are replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CompletionKind {
    /// The work succeeded.
    Succeeded,
    /// The work failed for good and the failure is replayed to every retry.
    Failed,
}

/// What a retry is handed: a status, metadata (header name and value pairs) and the body.
/// For HTTP these are the response's; a message consumer uses whatever fits (status 0 and
/// no headers are fine).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Response {
    /// A status code.
    pub status: u16,
    /// Name and value pairs, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, byte for byte.
    pub body: Bytes,
}

impl Response {
    /// A response with a status and a body and no headers.
    pub fn new(status: u16, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The final outcome of a key's work, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Success or terminal failure.
    pub kind: CompletionKind,
    /// The response handed to every retry.
    pub response: Response,
}

impl Completion {
    /// A success.
    pub fn succeeded(response: Response) -> Self {
        Self {
            kind: CompletionKind::Succeeded,
            response,
        }
    }

    /// A terminal failure.
    pub fn failed(response: Response) -> Self {
        Self {
            kind: CompletionKind::Failed,
            response,
        }
    }
}

/// A completion read back from a store, with how long it is still kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The stored completion.
    pub completion: Completion,
    /// Time until the store forgets it. By the store's clock for the memory and PostgreSQL
    /// stores; the Redis store reads it from the expiry its completed record holds (the
    /// writing instance's clock, rounded down to the second) against this host's clock.
    pub expires_in: Duration,
}

/// One record as a store holds it, for inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its identity.
    pub id: RecordId,
    /// The fingerprint of the request that created it.
    pub fingerprint: Fingerprint,
    /// How many times its lease was acquired (1 + takeovers).
    pub attempt: u32,
    /// Its state.
    pub state: RecordState,
    /// Time until the store forgets the record.
    pub expires_in: Duration,
}

/// The state of a stored record. An absent record is `None` where records are looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A worker holds (or held) the lease.
    InProgress {
        /// The holder's token.
        token: FencingToken,
        /// Lease time left; zero once the lease expired and awaits a takeover.
        lease_remaining: Duration,
    },
    /// The work finished; its outcome is replayed.
    Completed(Completion),
}

/// A stored record could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("corrupt record metadata: {0}")]
pub struct DecodeError(pub &'static str);

const META_VERSION: u8 = 1;

/// Encodes a completion's kind, status and headers (not its body) into a compact byte
/// string: version, kind, status, header count, then each header's name and value with
/// their lengths. Backends store it beside the body.
pub fn encode_meta(kind: CompletionKind, response: &Response) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        6 + response
            .headers
            .iter()
            .map(|(n, v)| 6 + n.len() + v.len())
            .sum::<usize>(),
    );
    out.push(META_VERSION);
    out.push(match kind {
        CompletionKind::Succeeded => 0,
        CompletionKind::Failed => 1,
    });
    out.extend_from_slice(&response.status.to_be_bytes());
    let count = u16::try_from(response.headers.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&count.to_be_bytes());
    for (name, value) in response.headers.iter().take(usize::from(count)) {
        let name = &name.as_bytes()[..name.len().min(usize::from(u16::MAX))];
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Decodes what [`encode_meta`] wrote and joins it with the body.
///
/// # Errors
///
/// [`DecodeError`] when the bytes were not written by [`encode_meta`].
pub fn decode_meta(meta: &[u8], body: Bytes) -> Result<Completion, DecodeError> {
    let mut r = Reader(meta);
    if r.take(1)?[0] != META_VERSION {
        return Err(DecodeError("unknown version"));
    }
    let kind = match r.take(1)?[0] {
        0 => CompletionKind::Succeeded,
        1 => CompletionKind::Failed,
        _ => return Err(DecodeError("unknown completion kind")),
    };
    let status = u16::from_be_bytes([r.take(1)?[0], r.take(1)?[0]]);
    let count = r.u16()?;
    let mut headers = Vec::with_capacity(usize::from(count).min(64));
    for _ in 0..count {
        let len = usize::from(r.u16()?);
        let name = std::str::from_utf8(r.take(len)?)
            .map_err(|_| DecodeError("header name is not UTF-8"))?
            .to_owned();
        let len = r.u32()? as usize;
        headers.push((name, r.take(len)?.to_vec()));
    }
    if !r.0.is_empty() {
        return Err(DecodeError("trailing bytes"));
    }
    Ok(Completion {
        kind,
        response: Response {
            status,
            headers,
            body,
        },
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tokens_are_fresh_version_4_uuids() {
        let token = FencingToken::random();
        assert_eq!(token.as_uuid().get_version_num(), 4);
        assert_eq!(token.as_uuid().get_variant(), uuid::Variant::RFC4122);
        let drawn: std::collections::HashSet<_> =
            (0..1000).map(|_| FencingToken::random()).collect();
        assert_eq!(drawn.len(), 1000);
    }

    proptest! {
        #[test]
        fn meta_round_trips(
            status: u16,
            failed: bool,
            headers in proptest::collection::vec(("[a-z-]{0,20}", proptest::collection::vec(any::<u8>(), 0..40)), 0..6),
            body in proptest::collection::vec(any::<u8>(), 0..100),
        ) {
            let kind = if failed { CompletionKind::Failed } else { CompletionKind::Succeeded };
            let response = Response { status, headers, body: Bytes::from(body) };
            let meta = encode_meta(kind, &response);
            let back = decode_meta(&meta, response.body.clone()).unwrap();
            prop_assert_eq!(back, Completion { kind, response });
        }

        #[test]
        fn decode_never_panics(meta in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_meta(&meta, Bytes::new());
        }
    }
}
