//! One record of the in-memory store in one allocation: its identity, fingerprint, lease or
//! completion, and times, packed into a boxed byte string.
//!
//! ```text
//! offset  size  field
//!      0     8  expires_at: store-clock nanoseconds (u64, little endian; saturated)
//!      8     8  deadline: the lease's deadline, in the same unit (unused once completed)
//!     16     4  attempt (u32)
//!     20     1  state: IN_PROGRESS or COMPLETED
//!     21     1  scope length (a scope is at most 255 bytes)
//!     22     1  key length (a key is at most 255 bytes)
//!     23    32  fingerprint
//!     55     -  scope, then key
//!             in progress: the fencing token (16 bytes)
//!             completed: meta length (u32), meta (`encode_meta`), body
//! ```
//!
//! One allocation instead of a dozen (the id's two strings, the headers' strings, the body's
//! buffer and its shared header, a second copy of the id in the expiry index) is what
//! halves the store's memory per record; a replay copies the body out, which for the
//! store of one process costs less than the memory it saves.

use bytes::Bytes;

use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::{
    decode_meta, encode_meta, Completion, CompletionKind, DecodeError, FencingToken,
};

const EXPIRES_AT: usize = 0;
const DEADLINE: usize = 8;
const ATTEMPT: usize = 16;
const STATE: usize = 20;
const SCOPE_LEN: usize = 21;
const KEY_LEN: usize = 22;
const FINGERPRINT: usize = 23;
const ID: usize = 55;

const IN_PROGRESS: u8 = 0;
const COMPLETED: u8 = 1;

/// One record, packed (see the [module](self)).
#[derive(Debug)]
pub(super) struct Slot(Box<[u8]>);

impl Slot {
    /// A record in progress under `token`.
    pub(super) fn in_progress(
        id: &RecordId,
        fingerprint: Fingerprint,
        attempt: u32,
        token: FencingToken,
        deadline: u64,
        expires_at: u64,
    ) -> Self {
        let mut out = head(id, fingerprint, attempt, IN_PROGRESS, 16);
        out.extend_from_slice(token.as_bytes());
        let mut slot = Self(out.into_boxed_slice());
        slot.set_deadline(deadline);
        slot.set_expires_at(expires_at);
        slot
    }

    /// This record, completed with `completion`: same identity, fingerprint and attempt.
    pub(super) fn completed(&self, completion: &Completion, expires_at: u64) -> Self {
        let meta = encode_meta(completion.kind, &completion.response);
        let body = &completion.response.body;
        let mut out = Vec::with_capacity(ID + self.id_len() + 4 + meta.len() + body.len());
        out.extend_from_slice(&self.0[..ID + self.id_len()]);
        out[STATE] = COMPLETED;
        // A meta past 4 GiB cannot be a response anyone stored: headers are bounded far
        // below that by every server.
        out.extend_from_slice(&u32::try_from(meta.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(body);
        let mut slot = Self(out.into_boxed_slice());
        slot.set_deadline(0);
        slot.set_expires_at(expires_at);
        slot
    }

    /// Bytes held (the allocation's length).
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn expires_at(&self) -> u64 {
        self.u64_at(EXPIRES_AT)
    }

    pub(super) fn set_expires_at(&mut self, at: u64) {
        self.0[EXPIRES_AT..EXPIRES_AT + 8].copy_from_slice(&at.to_le_bytes());
    }

    pub(super) fn deadline(&self) -> u64 {
        self.u64_at(DEADLINE)
    }

    pub(super) fn set_deadline(&mut self, at: u64) {
        self.0[DEADLINE..DEADLINE + 8].copy_from_slice(&at.to_le_bytes());
    }

    pub(super) fn attempt(&self) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.0[ATTEMPT..ATTEMPT + 4]);
        u32::from_le_bytes(b)
    }

    pub(super) fn fingerprint(&self) -> Fingerprint {
        let mut b = [0u8; 32];
        b.copy_from_slice(&self.0[FINGERPRINT..FINGERPRINT + 32]);
        Fingerprint::from_bytes(b)
    }

    /// The scope's and the key's bytes.
    pub(super) fn id_parts(&self) -> (&[u8], &[u8]) {
        let scope_len = usize::from(self.0[SCOPE_LEN]);
        let key_len = usize::from(self.0[KEY_LEN]);
        let scope = &self.0[ID..ID + scope_len];
        (scope, &self.0[ID + scope_len..ID + scope_len + key_len])
    }

    /// Whether this is the record of `id`.
    pub(super) fn is(&self, id: &RecordId) -> bool {
        self.id_parts() == (id.scope().as_str().as_bytes(), id.key().as_str().as_bytes())
    }

    /// The lease's token while in progress; `None` once completed.
    pub(super) fn token(&self) -> Option<FencingToken> {
        if self.0[STATE] != IN_PROGRESS {
            return None;
        }
        let at = ID + self.id_len();
        FencingToken::from_slice(&self.0[at..at + 16])
    }

    /// The completion's kind without decoding it; `None` while in progress.
    pub(super) fn kind(&self) -> Option<CompletionKind> {
        let meta = self.meta()?;
        // The second byte of `encode_meta`'s layout.
        Some(match meta.get(1) {
            Some(1) => CompletionKind::Failed,
            _ => CompletionKind::Succeeded,
        })
    }

    /// The completion, decoded (the body copied out); `None` while in progress.
    pub(super) fn completion(&self) -> Option<Result<Completion, DecodeError>> {
        let meta = self.meta()?;
        let body_at = ID + self.id_len() + 4 + meta.len();
        Some(decode_meta(
            meta,
            Bytes::copy_from_slice(&self.0[body_at..]),
        ))
    }

    fn meta(&self) -> Option<&[u8]> {
        if self.0[STATE] != COMPLETED {
            return None;
        }
        let at = ID + self.id_len();
        let len = self.0.get(at..at + 4)?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        self.0.get(at + 4..at + 4 + len)
    }

    fn id_len(&self) -> usize {
        usize::from(self.0[SCOPE_LEN]) + usize::from(self.0[KEY_LEN])
    }

    fn u64_at(&self, at: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[at..at + 8]);
        u64::from_le_bytes(b)
    }
}

/// The fixed fields and the id, with room for `extra` more bytes.
fn head(id: &RecordId, fingerprint: Fingerprint, attempt: u32, state: u8, extra: usize) -> Vec<u8> {
    let (scope, key) = (id.scope().as_str().as_bytes(), id.key().as_str().as_bytes());
    let mut out = Vec::with_capacity(ID + scope.len() + key.len() + extra);
    out.extend_from_slice(&[0u8; 16]);
    out.extend_from_slice(&attempt.to_le_bytes());
    out.push(state);
    // Scopes and keys are validated to at most 255 bytes (MAX_SCOPE_LEN, MAX_KEY_LEN).
    out.push(u8::try_from(scope.len()).unwrap_or(u8::MAX));
    out.push(u8::try_from(key.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(fingerprint.as_bytes());
    out.extend_from_slice(&scope[..scope.len().min(255)]);
    out.extend_from_slice(&key[..key.len().min(255)]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{Key, Scope};
    use crate::record::Response;

    #[test]
    fn fields_round_trip() {
        let id = RecordId::new(Scope::new("ténant").unwrap(), Key::new("k-1").unwrap());
        // The same bytes split elsewhere is another record.
        let other = RecordId::new(Scope::new("ténan").unwrap(), Key::new("tk-1").unwrap());
        let fp = Fingerprint::of_bytes(b"req");
        let token = FencingToken::random();
        let mut slot = Slot::in_progress(&id, fp, 3, token, 7, u64::MAX);
        assert!(slot.is(&id) && !slot.is(&other));
        assert_eq!(
            (slot.attempt(), slot.fingerprint(), slot.token()),
            (3, fp, Some(token))
        );
        assert_eq!((slot.deadline(), slot.expires_at()), (7, u64::MAX));
        assert!(slot.completion().is_none() && slot.kind().is_none());
        slot.set_deadline(9);
        slot.set_expires_at(11);
        assert_eq!((slot.deadline(), slot.expires_at()), (9, 11));

        let completion = Completion::failed(
            Response::new(409, vec![0u8, 255, 1]).with_header("x-a", b"\x00b".to_vec()),
        );
        let done = slot.completed(&completion, 42);
        assert!(done.is(&id) && done.token().is_none());
        assert_eq!(
            (done.attempt(), done.fingerprint(), done.expires_at()),
            (3, fp, 42)
        );
        assert_eq!(done.kind(), Some(CompletionKind::Failed));
        assert_eq!(done.completion().unwrap().unwrap(), completion);
    }
}
