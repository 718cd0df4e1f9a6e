//! The layer's own answers: `application/problem+json` documents (RFC 9457).

use std::time::Duration;

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use idem_core::{BoxError, Error};

use crate::body::ResponseBody;

/// The media type of the layer's error documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One of the layer's refusals, made by the constructors below. Its `type` is
/// `urn:idem:problem:<kind>`, with the kinds the crate docs list.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: String,
    retry_after: Option<Duration>,
    /// The `WWW-Authenticate` challenge of a 401 (RFC 9110 section 11.6.1 requires one).
    challenge: Option<HeaderValue>,
}

impl Problem {
    fn new(
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

    /// 400: no key on a route that requires one; `detail` names the route and the header.
    pub(crate) fn key_missing(detail: String) -> Self {
        let (status, title) = (StatusCode::BAD_REQUEST, "Idempotency key missing");
        Self::new(status, "idempotency-key-missing", title, detail)
    }

    /// 400: a malformed key, or the header twice; `detail` says which.
    pub(crate) fn key_invalid(detail: String) -> Self {
        let (status, title) = (StatusCode::BAD_REQUEST, "Idempotency key malformed");
        Self::new(status, "idempotency-key-invalid", title, detail)
    }

    /// 401 with `challenge`: no principal to keep the key under.
    pub(crate) fn principal_missing(challenge: HeaderValue) -> Self {
        let detail = "idempotency keys are kept per caller, and this request names none: \
                      authenticate, then retry with the same key";
        Self::new(
            StatusCode::UNAUTHORIZED,
            "principal-missing",
            "Caller unknown",
            detail,
        )
        .challenge(challenge)
    }

    /// 413: a request body over `limit` bytes.
    pub(crate) fn body_too_large(limit: usize) -> Self {
        let detail = format!("requests with an idempotency key may carry at most {limit} bytes");
        let (status, title) = (StatusCode::PAYLOAD_TOO_LARGE, "Request body too large");
        Self::new(status, "request-body-too-large", title, detail)
    }

    /// 400: the request body broke off with `e`.
    pub(crate) fn body_unreadable(e: &BoxError) -> Self {
        let detail = format!("the request body could not be read: {e}");
        let (status, title) = (StatusCode::BAD_REQUEST, "Request body unreadable");
        Self::new(status, "request-body-unreadable", title, detail)
    }

    /// 409: another request holds the key; retry after `retry_after`.
    pub(crate) fn in_flight(retry_after: Duration) -> Self {
        let detail = "a request with this idempotency key is being processed; retry after the \
                      Retry-After delay to receive its response";
        Self::new(
            StatusCode::CONFLICT,
            "request-in-flight",
            "Request in flight",
            detail,
        )
        .retry_after(retry_after)
    }

    /// 422: the key was used with another request.
    pub(crate) fn mismatch() -> Self {
        let detail = "this idempotency key was already used with a different request (method, \
                      path, body or fingerprinted headers); use a new key for a new request";
        let (status, title) = (StatusCode::UNPROCESSABLE_ENTITY, "Idempotency key reused");
        Self::new(status, "idempotency-key-reused", title, detail)
    }

    /// 410: the key's work completed long ago, and its response was forgotten when its
    /// retention ended; its tombstone says so, and the request does not run. A 410 rather
    /// than a 409 or a 422: the request is neither in flight nor another request, and no
    /// retry with this key will ever succeed: the key's answer is gone for good.
    pub(crate) fn key_expired(completed_at: std::time::SystemTime) -> Self {
        let detail = format!(
            "the request with this idempotency key completed on {}, and its response was \
             kept only until its retention ended; the key cannot run again. Look up the \
             outcome by other means, or use a new key for a new request",
            httpdate::fmt_http_date(completed_at)
        );
        let (status, title) = (StatusCode::GONE, "Idempotency key expired");
        Self::new(status, "key-expired", title, detail)
    }

    /// 404 from the status monitor: no completed or running work under this key for this
    /// caller (released, never stored, abandoned, or never used).
    pub(crate) fn not_completed() -> Self {
        let detail = "no work under this idempotency key has completed or is running for \
                      you: it was released, failed without a stored response, was abandoned \
                      by a worker that stopped, or never began. The key can be retried";
        let (status, title) = (StatusCode::NOT_FOUND, "Not completed");
        Self::new(status, "not-completed", title, detail)
    }

    /// 405 from the status monitor: it takes only the `allow`ed methods.
    pub(crate) fn method_not_allowed(allow: &str) -> Self {
        let detail = format!("the idempotency status monitor takes {allow}");
        let (status, title) = (StatusCode::METHOD_NOT_ALLOWED, "Method not allowed");
        Self::new(status, "method-not-allowed", title, detail)
    }

    /// The store failed before the handler ran: 503 with `retry_after` when retrying may
    /// help (`e` is retryable), else 500.
    pub(crate) fn store_failed(e: &Error, retry_after: Duration) -> Self {
        if e.is_retryable() {
            let detail = "the request was not processed: its idempotency key cannot be checked \
                          right now; retry later with the same key";
            let (status, title) = (
                StatusCode::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
            );
            Self::new(status, "store-unavailable", title, detail).retry_after(retry_after)
        } else {
            let detail = "the request was not processed: the idempotency store failed";
            let (status, title) = (StatusCode::INTERNAL_SERVER_ERROR, "Idempotency store error");
            Self::new(status, "store-error", title, detail)
        }
    }

    /// 503 with `retry_after`: the handler ran, and its response is not recorded yet.
    pub(crate) fn not_recorded(retry_after: Duration) -> Self {
        let detail = "the request was processed, but its response could not be recorded yet; \
                      retry with the same idempotency key to receive it once it is recorded";
        let (status, title) = (StatusCode::SERVICE_UNAVAILABLE, "Outcome not recorded");
        Self::new(status, "outcome-not-recorded", title, detail).retry_after(retry_after)
    }

    /// 503 with `retry_after`: the handler ran, but its lease was lost before its response
    /// was stored, so the key will never replay it. A 503 rather than a 409: this request
    /// did run (a 409 says that it did not), its answer is not final, and generic HTTP
    /// clients retry a 503 with its `Retry-After` by default, which is what converges on the
    /// key's one recorded answer.
    pub(crate) fn lease_lost(retry_after: Duration) -> Self {
        let detail = "the request was processed, but its hold on the idempotency key ran out \
                      before its response was recorded, and another attempt may hold the key \
                      now: this response is not the key's answer. Retry with the same \
                      idempotency key to receive the key's recorded answer";
        let (status, title) = (StatusCode::SERVICE_UNAVAILABLE, "Idempotency lease lost");
        Self::new(status, "lease-lost", title, detail).retry_after(retry_after)
    }

    /// 500: the stored response is not an HTTP response.
    pub(crate) fn bad_record() -> Self {
        let detail = "the response stored for this idempotency key is not an HTTP response";
        let (status, title) = (StatusCode::INTERNAL_SERVER_ERROR, "Stored response invalid");
        Self::new(status, "stored-response-invalid", title, detail)
    }

    fn challenge(mut self, challenge: HeaderValue) -> Self {
        self.challenge = Some(challenge);
        self
    }

    fn retry_after(mut self, after: Duration) -> Self {
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
fn retry_after_secs(after: Duration) -> u64 {
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
