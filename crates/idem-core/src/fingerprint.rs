//! Request and message fingerprints: SHA-256 over chosen parts, with canonical JSON.

use std::fmt;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The SHA-256 digest of a request or message, stored with its record. A retry with the
/// same key but a different fingerprint is answered with a mismatch.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps a digest computed elsewhere.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The fingerprint of raw bytes alone (no parts, no canonicalisation).
    pub fn of_bytes(bytes: &[u8]) -> Self {
        FingerprintBuilder::new().bytes("body", bytes).finish()
    }

    /// Starts a fingerprint from several parts.
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder::new()
    }

    /// Lower-case hex.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

/// The body handed to [`FingerprintBuilder::json`] is not JSON.
#[derive(Debug, thiserror::Error)]
#[error("body is not valid JSON: {0}")]
pub struct JsonError(#[from] serde_json::Error);

/// Which fields of a JSON document take part in a fingerprint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum JsonSelection {
    /// The whole document (the default).
    #[default]
    All,
    /// Only the values at these JSON pointers (RFC 6901, such as `/order/id`); a pointer that
    /// names nothing counts as absent, which is different from `null`.
    Only(Vec<String>),
    /// Everything but the values at these JSON pointers: volatile fields such as
    /// `/sent_at` or `/delivery_id`.
    Except(Vec<String>),
}

/// Builds a [`Fingerprint`] from named parts. Each part is framed with its name and length,
/// so no two different sequences of parts hash alike.
///
/// ```
/// use idem_core::{Fingerprint, JsonSelection};
/// let a = Fingerprint::builder()
///     .text("method", "POST")
///     .text("path", "/payments")
///     .json("body", br#"{"amount": 1250, "currency": "EUR"}"#, &JsonSelection::All)
///     .unwrap()
///     .finish();
/// let b = Fingerprint::builder()
///     .text("method", "POST")
///     .text("path", "/payments")
///     .json("body", br#"{"currency":"EUR","amount":1250}"#, &JsonSelection::All)
///     .unwrap()
///     .finish();
/// assert_eq!(a, b); // key order and whitespace do not matter
/// ```
#[derive(Debug, Clone)]
pub struct FingerprintBuilder {
    hasher: Sha256,
}

impl Default for FingerprintBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl FingerprintBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-fp-v1");
        Self { hasher }
    }

    /// Adds a part of raw bytes.
    pub fn bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.frame(name, value);
        self
    }

    /// Adds a part of text (a method, a path, a header value).
    pub fn text(self, name: &str, value: &str) -> Self {
        self.bytes(name, value.as_bytes())
    }

    /// Adds a JSON document in canonical form: object keys sorted, insignificant whitespace
    /// dropped, and only the selected fields.
    ///
    /// # Errors
    ///
    /// [`JsonError`] when `body` is not JSON.
    pub fn json(
        self,
        name: &str,
        body: &[u8],
        selection: &JsonSelection,
    ) -> Result<Self, JsonError> {
        let value: Value = serde_json::from_slice(body)?;
        Ok(self.json_value(name, &value, selection))
    }

    /// Adds an already-parsed JSON value, canonicalised as in [`FingerprintBuilder::json`].
    pub fn json_value(mut self, name: &str, value: &Value, selection: &JsonSelection) -> Self {
        let mut canonical = Vec::new();
        match selection {
            JsonSelection::All => write_canonical(value, &mut canonical),
            JsonSelection::Only(pointers) => {
                // Each selected pointer is framed with its value, or a marker for "absent".
                for pointer in pointers {
                    canonical.extend_from_slice(&(pointer.len() as u64).to_be_bytes());
                    canonical.extend_from_slice(pointer.as_bytes());
                    match value.pointer(pointer) {
                        Some(v) => {
                            canonical.push(1);
                            write_canonical(v, &mut canonical);
                        }
                        None => canonical.push(0),
                    }
                }
            }
            JsonSelection::Except(pointers) => {
                let mut pruned = value.clone();
                for pointer in pointers {
                    remove_pointer(&mut pruned, pointer);
                }
                write_canonical(&pruned, &mut canonical);
            }
        }
        self.frame(name, &canonical);
        self
    }

    /// The digest of everything added.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.hasher.finalize().into())
    }

    fn frame(&mut self, name: &str, value: &[u8]) {
        self.hasher.update((name.len() as u64).to_be_bytes());
        self.hasher.update(name.as_bytes());
        self.hasher.update((value.len() as u64).to_be_bytes());
        self.hasher.update(value);
    }
}

/// Writes `value` with sorted object keys and no whitespace. serde_json's `Map` is a
/// `BTreeMap` unless its `preserve_order` feature is on, so keys are sorted here explicitly
/// rather than relying on that.
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json(k.as_str(), out);
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => write_json(scalar, out),
    }
}

/// Writes any serialisable JSON piece straight into `out`, with no intermediate `String`.
fn write_json<T: serde::Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) {
    // Serialising a string or a `Value` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

/// Removes the value at an RFC 6901 pointer, if there is one.
fn remove_pointer(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    let target = if parent.is_empty() {
        Some(value)
    } else {
        value.pointer_mut(parent)
    };
    match target {
        Some(Value::Object(map)) => {
            map.remove(&last);
        }
        Some(Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>() {
                if i < items.len() {
                    items.remove(i);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED: &str = "7d460182877fd9e8317d06613bb5da3ce1f1aadbba70bdf4563a161613af4ccf";

    fn fp(body: &str, sel: &JsonSelection) -> Fingerprint {
        Fingerprint::builder()
            .json("body", body.as_bytes(), sel)
            .unwrap()
            .finish()
    }

    #[test]
    fn canonical_json_ignores_order_and_whitespace() {
        let all = JsonSelection::All;
        assert_eq!(
            fp(r#"{"a":1,"b":{"y":[1,2],"x":"s"}}"#, &all),
            fp(" { \"b\" : {\"x\":\"s\", \"y\": [1, 2]}, \"a\": 1 } ", &all)
        );
        assert_ne!(fp(r#"{"a":1}"#, &all), fp(r#"{"a":2}"#, &all));
        assert_ne!(fp(r#"[1,2]"#, &all), fp(r#"[2,1]"#, &all));
    }

    #[test]
    fn selection_leaves_volatile_fields_out() {
        let except = JsonSelection::Except(vec!["/sent_at".into(), "/meta/id".into()]);
        assert_eq!(
            fp(r#"{"o":1,"sent_at":"t1","meta":{"id":1,"k":2}}"#, &except),
            fp(r#"{"o":1,"sent_at":"t2","meta":{"id":9,"k":2}}"#, &except)
        );
        assert_ne!(
            fp(r#"{"o":1,"meta":{"k":2}}"#, &except),
            fp(r#"{"o":1,"meta":{"k":3}}"#, &except)
        );
        let only = JsonSelection::Only(vec!["/order".into()]);
        assert_eq!(
            fp(r#"{"order":7,"ts":1}"#, &only),
            fp(r#"{"order":7,"ts":2}"#, &only)
        );
        assert_ne!(fp(r#"{"order":null}"#, &only), fp(r#"{}"#, &only));
    }

    /// One exact digest, so that no optimisation of the canonical form can change the
    /// fingerprints of records already stored.
    #[test]
    fn digest_is_pinned() {
        let body =
            r#"{"z":[1,2.5,-3e2,true,null,{"b":"\u00e9\n","a":{}}],"a":"x\"y","m":{"k":[]}}"#;
        let f = Fingerprint::builder()
            .text("method", "POST")
            .json("body", body.as_bytes(), &JsonSelection::All)
            .unwrap()
            .finish();
        assert_eq!(f.to_hex(), PINNED);
    }

    #[test]
    fn parts_are_framed() {
        let a = Fingerprint::builder().text("a", "bc").finish();
        let b = Fingerprint::builder().text("ab", "c").finish();
        assert_ne!(a, b);
        assert!(Fingerprint::builder()
            .json("b", b"{nope", &JsonSelection::All)
            .is_err());
    }
}
