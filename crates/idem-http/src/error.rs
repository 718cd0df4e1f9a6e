//! The layer's own answers: `application/problem+json` documents (RFC 9457).

use std::time::Duration;

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};

use crate::body::ResponseBody;

/// The media type of the layer's error documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One of the layer's refusals. Its `type` is `urn:idem:problem:<kind>`, where kind is one
/// of the `KIND_*` names below.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<Duration>,
    /// The `WWW-Authenticate` challenge of a 401 (RFC 9110 section 11.6.1 requires one).
    pub(crate) challenge: Option<HeaderValue>,
}

pub(crate) const KIND_KEY_MISSING: &str = "idempotency-key-missing";
pub(crate) const KIND_KEY_INVALID: &str = "idempotency-key-invalid";
pub(crate) const KIND_NO_PRINCIPAL: &str = "principal-missing";
pub(crate) const KIND_BODY_TOO_LARGE: &str = "request-body-too-large";
pub(crate) const KIND_BODY_UNREADABLE: &str = "request-body-unreadable";
pub(crate) const KIND_MISMATCH: &str = "idempotency-key-reused";
pub(crate) const KIND_IN_FLIGHT: &str = "request-in-flight";
pub(crate) const KIND_STORE_UNAVAILABLE: &str = "store-unavailable";
pub(crate) const KIND_STORE_ERROR: &str = "store-error";
pub(crate) const KIND_NOT_RECORDED: &str = "outcome-not-recorded";
pub(crate) const KIND_BAD_RECORD: &str = "stored-response-invalid";

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            title,
            detail: detail.into(),
            retry_after: None,
            challenge: None,
        }
    }

    pub(crate) fn challenge(mut self, challenge: HeaderValue) -> Self {
        self.challenge = Some(challenge);
        self
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn into_response(self) -> Response<ResponseBody> {
        let doc = problem_json(
            &format!("urn:idem:problem:{}", self.kind),
            self.title,
            self.status,
            &self.detail,
        );
        let mut response = Response::new(ResponseBody::full(doc));
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        if let Some(challenge) = self.challenge {
            response.headers_mut().insert(WWW_AUTHENTICATE, challenge);
        }
        response
    }
}

/// An RFC 9457 problem document (`application/problem+json`) with its members in the RFC's
/// order, `type`, `title`, `status`, `detail`, which `serde_json`'s sorted maps would not
/// keep. The layer writes its own refusals with it; services can write theirs alike.
///
/// ```
/// let doc = idem_http::problem_json("urn:example:out-of-stock", "Out of stock", http::StatusCode::CONFLICT, "no more \"blue\"");
/// assert_eq!(doc, r#"{"type":"urn:example:out-of-stock","title":"Out of stock","status":409,"detail":"no more \"blue\""}"#);
/// ```
pub fn problem_json(type_uri: &str, title: &str, status: StatusCode, detail: &str) -> String {
    let s = |v: &str| serde_json::Value::from(v).to_string();
    format!(
        "{{\"type\":{},\"title\":{},\"status\":{},\"detail\":{}}}",
        s(type_uri),
        s(title),
        status.as_u16(),
        s(detail)
    )
}

/// Whole seconds for `Retry-After`, rounded up and at least 1, so that a client never
/// retries before the hint has passed.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_documents_escape_and_keep_order() {
        let doc = problem_json("urn:x", "T", StatusCode::CONFLICT, "say \"hi\"\n");
        assert_eq!(
            doc,
            r#"{"type":"urn:x","title":"T","status":409,"detail":"say \"hi\"\n"}"#
        );
        let parsed: serde_json::Value = serde_json::from_str(&doc).unwrap();
        assert_eq!(parsed["detail"], "say \"hi\"\n");
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
