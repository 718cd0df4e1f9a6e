//! A broker-neutral view of a delivered message: its headers and its payload.

use std::fmt;

/// The header that carries an idempotency key from the HTTP request (or the job) that
/// published a message to its consumers.
pub const IDEMPOTENCY_KEY_HEADER: &str = "x-idempotency-key";

/// The header that carries the scope of the publishing request (its tenant or principal),
/// so that two tenants choosing the same key never share a consumer record. Read when
/// [`Consumer::with_scope_header`](crate::Consumer::with_scope_header) is set.
pub const IDEMPOTENCY_SCOPE_HEADER: &str = "x-idempotency-scope";

/// The header that counts the handler's failed attempts before this delivery. Integrations
/// that delay a retry by republishing the message set it to [`Delivery::Nack`]'s `attempt`
/// (see [`crate::Delivery`]); a message without it has had no failed attempt.
///
/// [`Delivery::Nack`]: crate::Delivery::Nack
pub const ATTEMPT_HEADER: &str = "x-idem-attempt";

/// The header of a retry copy (JetStream, Redis Streams) that says when it is due, in Unix
/// milliseconds: a worker that receives it earlier hands it back until then, without running
/// the handler. RabbitMQ retries wait in a retry queue instead.
pub const RETRY_AT_HEADER: &str = "x-idem-retry-at";

/// The header an integration sets on a dead-lettered copy to say why it was dead-lettered.
pub const DEAD_LETTER_REASON_HEADER: &str = "x-idem-dead-letter-reason";

/// The value of one message header, as far as idem reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    /// Text (AMQP short and long strings, Kafka and NATS header values).
    Text(String),
    /// A whole number (AMQP integer types).
    Int(i64),
}

impl From<&str> for HeaderValue {
    fn from(value: &str) -> Self {
        Self::Text(value.to_owned())
    }
}

impl From<String> for HeaderValue {
    fn from(value: String) -> Self {
        Self::Text(value)
    }
}

impl From<i64> for HeaderValue {
    fn from(value: i64) -> Self {
        Self::Int(value)
    }
}

impl From<u32> for HeaderValue {
    fn from(value: u32) -> Self {
        Self::Int(i64::from(value))
    }
}

/// A delivered message as the [`Consumer`](crate::Consumer) sees it: header name and value
/// pairs and the payload bytes. Broker integrations build one per delivery (see
/// `rabbitmq::message_of` with the `rabbitmq` feature); headers idem does not read may be
/// left out.
///
/// Header names are matched ASCII case-insensitively, so `X-Idempotency-Key` set by an HTTP
/// stack and `x-idempotency-key` are the same header.
///
/// ```
/// use idem_consumer::{Message, IDEMPOTENCY_KEY_HEADER};
/// let msg = Message::new(br#"{"order": 42}"#.to_vec())
///     .with_header(IDEMPOTENCY_KEY_HEADER, "3f9c-payment");
/// assert_eq!(msg.text_header("X-Idempotency-Key"), Some("3f9c-payment"));
/// assert_eq!(msg.failed_attempts(), 0);
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Message {
    headers: Vec<(String, HeaderValue)>,
    payload: Vec<u8>,
}

impl Message {
    /// A message with `payload` and no headers.
    pub fn new(payload: impl Into<Vec<u8>>) -> Self {
        Self {
            headers: Vec::new(),
            payload: payload.into(),
        }
    }

    /// Adds a header. A later header of the same name wins over an earlier one.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// All headers, in the order they were added.
    pub fn headers(&self) -> &[(String, HeaderValue)] {
        &self.headers
    }

    /// The value of header `name` (the last one, if it appears twice).
    pub fn header(&self, name: &str) -> Option<&HeaderValue> {
        self.headers
            .iter()
            .rev()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// The value of header `name` when it is text.
    pub fn text_header(&self, name: &str) -> Option<&str> {
        match self.header(name)? {
            HeaderValue::Text(text) => Some(text),
            HeaderValue::Int(_) => None,
        }
    }

    /// The failed attempts recorded in [`ATTEMPT_HEADER`]: 0 when it is absent, and also when
    /// it is not a whole number from 0 to `u32::MAX` (as an integer or as decimal text), since
    /// a garbled counter must not stop a message from being handled.
    pub fn failed_attempts(&self) -> u32 {
        match self.header(ATTEMPT_HEADER) {
            Some(HeaderValue::Int(n)) => u32::try_from(*n).unwrap_or(0),
            Some(HeaderValue::Text(text)) => text.trim().parse().unwrap_or(0),
            None => 0,
        }
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("headers", &self.headers)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_case_insensitive_and_last_wins() {
        let msg = Message::new(Vec::new())
            .with_header("X-Idempotency-Key", "a")
            .with_header("x-idempotency-key", "b");
        assert_eq!(msg.text_header(IDEMPOTENCY_KEY_HEADER), Some("b"));
        assert_eq!(msg.text_header("other"), None);
    }

    #[test]
    fn failed_attempts_reads_ints_and_text_and_ignores_garbage() {
        let m = |v: HeaderValue| Message::new(Vec::new()).with_header(ATTEMPT_HEADER, v);
        assert_eq!(Message::new(Vec::new()).failed_attempts(), 0);
        assert_eq!(m(HeaderValue::Int(3)).failed_attempts(), 3);
        assert_eq!(m(HeaderValue::Text(" 4 ".into())).failed_attempts(), 4);
        assert_eq!(m(HeaderValue::Int(-1)).failed_attempts(), 0);
        assert_eq!(m(HeaderValue::Int(i64::MAX)).failed_attempts(), 0);
        assert_eq!(m(HeaderValue::Text("many".into())).failed_attempts(), 0);
    }
}
