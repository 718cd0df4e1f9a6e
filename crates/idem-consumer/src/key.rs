//! Where a message's idempotency key and fingerprint come from, and stable child keys for
//! the calls a handler makes downstream.

use idem_core::{Fingerprint, FingerprintBuilder, JsonError, JsonSelection, Key, KeyError, Scope};

use crate::message::{Message, IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_SCOPE_HEADER};

/// Where the [`Consumer`](crate::Consumer) finds a message's idempotency key.
///
/// Default: [`KeySource::Header`] with [`IDEMPOTENCY_KEY_HEADER`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// The text of this header, as the publisher propagated it (for example the key of the
    /// HTTP request that published the message). A message without it is dead-lettered.
    Header(String),
    /// A canonical hash of the chosen fields of the JSON payload: object keys sorted,
    /// whitespace ignored. Leave volatile fields out ([`JsonSelection::Except`] with
    /// `/sent_at`, `/trace_id`, ...) or name the business fields
    /// ([`JsonSelection::Only`] with `/order_id`, `/amount`), so two publications of one
    /// business event get one key. A payload that is not JSON, or that lacks a field
    /// [`JsonSelection::Only`] names, is dead-lettered: messages missing the fields that
    /// tell events apart would otherwise all share one key.
    PayloadHash(JsonSelection),
    /// The header when the message has it, otherwise the payload hash.
    HeaderOrPayloadHash(String, JsonSelection),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::Header(IDEMPOTENCY_KEY_HEADER.to_owned())
    }
}

/// What a message's [`Fingerprint`] is computed from. A second message with the same key but
/// another fingerprint is not a duplicate: it is dead-lettered as a key collision instead of
/// being acked as done.
///
/// Default: [`FingerprintSource::Payload`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FingerprintSource {
    /// The payload's bytes as they are.
    #[default]
    Payload,
    /// The payload as canonical JSON, restricted to the selected fields: use it when
    /// republished copies differ in volatile fields such as a timestamp. A payload that is not
    /// JSON is dead-lettered.
    Json(JsonSelection),
}

/// Why a message could not be given a key or a fingerprint. The message is dead-lettered,
/// never handled without a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// The key header is missing, or is not text.
    #[error("the message has no text header {header:?} to take its idempotency key from")]
    MissingKey {
        /// The header's name.
        header: String,
    },
    /// The scope header is missing, or is not text.
    #[error("the message has no text header {header:?} to take its scope from")]
    MissingScope {
        /// The header's name.
        header: String,
    },
    /// The key (or the scope built from a header) is not valid.
    #[error("invalid idempotency key or scope: {0}")]
    InvalidKey(#[from] KeyError),
    /// The payload had to be JSON and is not.
    #[error("the payload is not JSON: {0}")]
    NotJson(String),
    /// The payload lacks a field its key is hashed from.
    #[error("the payload has no field {pointer:?} to take its idempotency key from")]
    MissingField {
        /// The field's JSON pointer.
        pointer: String,
    },
}

impl From<JsonError> for InvalidMessage {
    fn from(e: JsonError) -> Self {
        Self::NotJson(e.to_string())
    }
}

impl KeySource {
    /// The key of `message`.
    ///
    /// # Errors
    ///
    /// [`InvalidMessage`] when the header is missing or holds an invalid key, or the payload
    /// had to be JSON and is not.
    pub fn key_of(&self, message: &Message) -> Result<Key, InvalidMessage> {
        match self {
            Self::Header(name) => {
                header_key(message, name)?.ok_or_else(|| InvalidMessage::MissingKey {
                    header: name.clone(),
                })
            }
            Self::PayloadHash(selection) => payload_key(message, selection),
            Self::HeaderOrPayloadHash(name, selection) => match header_key(message, name)? {
                Some(key) => Ok(key),
                None => payload_key(message, selection),
            },
        }
    }
}

impl FingerprintSource {
    /// The fingerprint of `message`.
    ///
    /// # Errors
    ///
    /// [`InvalidMessage::NotJson`] when the payload had to be JSON and is not.
    pub fn fingerprint_of(&self, message: &Message) -> Result<Fingerprint, InvalidMessage> {
        Ok(match self {
            Self::Payload => Fingerprint::of_bytes(message.payload()),
            Self::Json(selection) => FingerprintBuilder::new()
                .json("payload", message.payload(), selection)?
                .finish(),
        })
    }
}

/// `Ok(None)` when the header is absent (or not text); an error when it holds a bad key.
fn header_key(message: &Message, name: &str) -> Result<Option<Key>, InvalidMessage> {
    match message.text_header(name) {
        Some(text) => Ok(Some(Key::new(text)?)),
        None => Ok(None),
    }
}

/// `"msg-"` and the hex SHA-256 of the selected fields: 68 visible ASCII bytes, a valid key.
fn payload_key(message: &Message, selection: &JsonSelection) -> Result<Key, InvalidMessage> {
    if let JsonSelection::Only(pointers) = selection {
        let payload: serde_json::Value = serde_json::from_slice(message.payload())
            .map_err(|e| InvalidMessage::NotJson(e.to_string()))?;
        if let Some(missing) = pointers.iter().find(|p| payload.pointer(p).is_none()) {
            return Err(InvalidMessage::MissingField {
                pointer: missing.clone(),
            });
        }
    }
    let digest = FingerprintBuilder::new()
        .json("idem-consumer/payload-key", message.payload(), selection)?
        .finish();
    Ok(Key::new(format!("msg-{}", digest.to_hex()))?)
}

/// A stable key for one step that a handler (or an HTTP handler) performs downstream under
/// the key `parent`: calling a payment provider, sending an e-mail, publishing a follow-up
/// message. The same `(parent, step)` always gives the same key, so a retry of the parent
/// reuses the child's record (or the provider's own idempotency key) instead of repeating the
/// step; different pairs give different keys.
///
/// The key is `"ck-"` followed by the hex SHA-256 of the length-framed `parent` and `step`:
/// always a valid [`Key`] (67 bytes) whatever the inputs, and free of collisions as far as
/// SHA-256 is (framing keeps `("a", "bc")` and `("ab", "c")` apart). Child keys nest:
/// `child_key(&child_key(&k, "a"), "b")`.
///
/// ```
/// use idem_consumer::child_key;
/// use idem_core::Key;
/// let parent = Key::new("3f9c-payment").unwrap();
/// let email = child_key(&parent, "send-receipt-email");
/// assert_eq!(email, child_key(&parent, "send-receipt-email"));
/// assert_ne!(email, child_key(&parent, "charge-card"));
/// assert!(email.as_str().starts_with("ck-"));
/// ```
pub fn child_key(parent: &Key, step: &str) -> Key {
    let digest = FingerprintBuilder::new()
        .text("idem-consumer/child-key/parent", parent.as_str())
        .text("idem-consumer/child-key/step", step)
        .finish();
    Key::new(format!("ck-{}", digest.to_hex()))
        .expect("\"ck-\" and 64 hex digits are 67 visible ASCII bytes, a valid key")
}

/// The headers a publisher sets so that consumers share its idempotency boundary: `key` in
/// [`IDEMPOTENCY_KEY_HEADER`] and, when given, the publishing request's `scope` in
/// [`IDEMPOTENCY_SCOPE_HEADER`] (read by
/// [`Consumer::with_scope_header`](crate::Consumer::with_scope_header)). For any broker with
/// text headers; `rabbitmq::with_idempotency_key` sets them on AMQP properties.
///
/// An HTTP handler behind idem-http finds its request's record in the `IdempotencyInfo`
/// request extension: publish with `info.id.key()` and `info.id.scope()`. When one request
/// publishes several messages, give each its own key with [`child_key`] (for example
/// `child_key(info.id.key(), "payment-initiated")`), or their consumers would take the
/// second for a duplicate of the first.
///
/// ```
/// use idem_consumer::{propagation_headers, Message};
/// use idem_core::{Key, Scope};
/// let key = Key::new("3f9c-payment").unwrap();
/// let headers = propagation_headers(&key, Some(&Scope::new("tenant-1").unwrap()));
/// let mut message = Message::new(b"{}".to_vec());
/// for (name, value) in headers {
///     message = message.with_header(name, value);
/// }
/// assert_eq!(message.text_header("x-idempotency-key"), Some("3f9c-payment"));
/// assert_eq!(message.text_header("x-idempotency-scope"), Some("tenant-1"));
/// ```
pub fn propagation_headers(key: &Key, scope: Option<&Scope>) -> Vec<(&'static str, String)> {
    let mut headers = vec![(IDEMPOTENCY_KEY_HEADER, key.as_str().to_owned())];
    if let Some(scope) = scope {
        headers.push((IDEMPOTENCY_SCOPE_HEADER, scope.as_str().to_owned()));
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn json(body: &str) -> Message {
        Message::new(body.as_bytes().to_vec())
    }

    #[test]
    fn header_keys() {
        let src = KeySource::default();
        let msg = json("{}").with_header(IDEMPOTENCY_KEY_HEADER, "k-1");
        assert_eq!(src.key_of(&msg).unwrap().as_str(), "k-1");
        assert_eq!(
            src.key_of(&json("{}")),
            Err(InvalidMessage::MissingKey {
                header: IDEMPOTENCY_KEY_HEADER.into()
            })
        );
        let bad = json("{}").with_header(IDEMPOTENCY_KEY_HEADER, "has space");
        assert!(matches!(
            src.key_of(&bad),
            Err(InvalidMessage::InvalidKey(_))
        ));
        // An integer header is not a key.
        let int = json("{}").with_header(IDEMPOTENCY_KEY_HEADER, 7i64);
        assert!(matches!(
            src.key_of(&int),
            Err(InvalidMessage::MissingKey { .. })
        ));
    }

    #[test]
    fn payload_hash_keys_ignore_volatile_fields_and_key_order() {
        let src = KeySource::PayloadHash(JsonSelection::Except(vec!["/sent_at".into()]));
        let key = |body| src.key_of(&json(body)).unwrap();
        let a = key(r#"{"order": 1, "amount": 5, "sent_at": "10:00"}"#);
        let b = key(r#"{"sent_at": "10:07", "amount": 5,  "order": 1}"#);
        let c = key(r#"{"order": 2, "amount": 5, "sent_at": "10:00"}"#);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.as_str().starts_with("msg-"));
        assert!(matches!(
            src.key_of(&json("not json")),
            Err(InvalidMessage::NotJson(_))
        ));
    }

    #[test]
    fn payload_hash_keys_refuse_a_payload_without_a_named_field() {
        let src =
            KeySource::PayloadHash(JsonSelection::Only(vec!["/order".into(), "/amount".into()]));
        assert!(src.key_of(&json(r#"{"order": 1, "amount": null}"#)).is_ok());
        assert_eq!(
            src.key_of(&json(r#"{"order": 1}"#)),
            Err(InvalidMessage::MissingField {
                pointer: "/amount".into()
            })
        );
        assert!(matches!(
            src.key_of(&json("[1")),
            Err(InvalidMessage::NotJson(_))
        ));
    }

    #[test]
    fn header_or_payload_hash_prefers_the_header() {
        let src = KeySource::HeaderOrPayloadHash(IDEMPOTENCY_KEY_HEADER.into(), JsonSelection::All);
        let with = json("{}").with_header(IDEMPOTENCY_KEY_HEADER, "given");
        assert_eq!(src.key_of(&with).unwrap().as_str(), "given");
        let hashed = src.key_of(&json("{}")).unwrap();
        assert!(hashed.as_str().starts_with("msg-"));
    }

    #[test]
    fn fingerprints() {
        let fp = |src: &FingerprintSource, body| src.fingerprint_of(&json(body)).unwrap();
        let raw = FingerprintSource::Payload;
        assert_ne!(fp(&raw, r#"{"a":1,"b":2}"#), fp(&raw, r#"{"b":2,"a":1}"#));
        let canonical = FingerprintSource::Json(JsonSelection::Except(vec!["/at".into()]));
        let (a, b) = (r#"{"a":1,"b":2,"at":1}"#, r#"{"b":2,"a":1,"at":2}"#);
        assert_eq!(fp(&canonical, a), fp(&canonical, b));
        assert!(canonical.fingerprint_of(&json("<xml/>")).is_err());
    }

    proptest! {
        #[test]
        fn child_keys_are_valid_deterministic_and_distinct(
            p1 in "[!-~]{1,40}", s1 in ".{0,40}",
            p2 in "[!-~]{1,40}", s2 in ".{0,40}",
        ) {
            let (k1, k2) = (Key::new(p1).unwrap(), Key::new(p2).unwrap());
            let a = child_key(&k1, &s1);
            prop_assert_eq!(&a, &child_key(&k1, &s1));
            prop_assert!(Key::new(a.as_str()).is_ok());
            prop_assert_eq!(k1 == k2 && s1 == s2, a == child_key(&k2, &s2));
        }
    }

    #[test]
    fn child_key_framing_separates_boundaries() {
        let ab = Key::new("ab").unwrap();
        let a = Key::new("a").unwrap();
        assert_ne!(child_key(&ab, "c"), child_key(&a, "bc"));
        let long = Key::new("k".repeat(255)).unwrap();
        assert_eq!(child_key(&long, &"s".repeat(10_000)).as_str().len(), 67);
    }
}
