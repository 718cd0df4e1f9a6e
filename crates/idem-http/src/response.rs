//! The responses the layer builds: a replay of a stored response, the expiry header, and a
//! handler's response body read up to the storing limit.

use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode};
use idem_core::{BoxError, Replay};

use crate::body::ResponseBody;
use crate::config::Config;
use crate::error::Problem;

/// The header set on every replayed response.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The header carrying, on a stored response (the first one and every replay), the HTTP
/// date after which it is forgotten (and the key may be used again).
pub const EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// Builds the replay of a stored response: its status, body and allowed headers, plus the
/// replay headers.
pub(crate) fn replay_response(config: &Config, replay: Replay) -> Response<ResponseBody> {
    let stored = replay.completion.response;
    let Ok(status) = StatusCode::from_u16(stored.status) else {
        tracing::error!(
            status = stored.status,
            "stored response has no valid HTTP status"
        );
        return Problem::bad_record().into_response();
    };
    let mut response = Response::new(ResponseBody::full(stored.body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) else {
            continue;
        };
        // Checked again here: the allowlist may have shrunk since the response was stored.
        if config.replays(&name) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    insert_expires(headers, replay.expires_in);
    response
}

/// Sets `Idempotency-Expires` to the HTTP date `retention` from now; none when that date
/// cannot be written (HTTP dates have four-digit years).
pub(crate) fn insert_expires(headers: &mut HeaderMap, retention: Duration) {
    /// 10000-01-01T00:00:00Z.
    const YEAR_10000: Duration = Duration::from_secs(253_402_300_800);
    let expires = SystemTime::now()
        .checked_add(retention)
        .filter(|expires| *expires < UNIX_EPOCH + YEAR_10000);
    if let Some(expires) = expires {
        // From the `String` itself: `from_str` would copy it.
        if let Ok(value) = HeaderValue::try_from(httpdate::fmt_http_date(expires)) {
            headers.insert(EXPIRES, value);
        }
    }
}

/// A response body that was whole when the handler returned it.
pub(crate) enum Buffer<B> {
    /// Read whole, with its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// Over the limit: what was read, and the rest (ended), to be sent on.
    Oversize(Bytes, Pin<Box<B>>),
    /// Broken off: what was read, and the error.
    Broken(Bytes, BoxError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expiry_header_is_the_date_retention_from_now_and_never_a_panic() {
        let expires = |retention| {
            let mut headers = HeaderMap::new();
            insert_expires(&mut headers, retention);
            headers.get(EXPIRES).map(|v| v.to_str().unwrap().to_owned())
        };
        for retention in [Duration::from_secs(3600), Duration::from_secs(86_400 * 400)] {
            let before = SystemTime::now();
            let date = httpdate::parse_http_date(&expires(retention).unwrap()).unwrap();
            let after = SystemTime::now();
            // HTTP dates are whole seconds: rounded down.
            assert!(date + Duration::from_secs(1) > before + retention);
            assert!(date <= after + retention);
        }
        assert_eq!(expires(Duration::MAX), None);
        assert_eq!(expires(Duration::from_secs(300 * 365 * 86_400 * 100)), None);
    }
}
