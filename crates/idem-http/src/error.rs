//! The layer's own answers: `application/problem+json` documents (RFC 9457).

use std::time::Duration;

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
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
}

pub(crate) const KIND_KEY_MISSING: &str = "idempotency-key-missing";
pub(crate) const KIND_KEY_INVALID: &str = "idempotency-key-invalid";
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
        }
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn into_response(self) -> Response<ResponseBody> {
        let doc = serde_json::json!({
            "type": format!("urn:idem:problem:{}", self.kind),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = Response::new(ResponseBody::full(doc.to_string()));
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }
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
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
