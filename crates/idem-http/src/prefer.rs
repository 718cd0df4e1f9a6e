//! The client's preferences (RFC 7240 `Prefer`) that the layer honours: `wait=N`, how long
//! a duplicate may wait for the first request's response, and `respond-async`, an answer at
//! once while the work runs on.

use std::time::Duration;

use http::{HeaderMap, HeaderName};

/// The `Preference-Applied` response header (RFC 7240 section 3).
pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");
/// The `Prefer` request header (RFC 7240 section 2).
const PREFER: HeaderName = HeaderName::from_static("prefer");

/// What a request's `Prefer` headers ask of the layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Prefer {
    /// `wait=N`: the client waits up to N seconds for an answer.
    pub(crate) wait: Option<Duration>,
    /// `respond-async`: the client takes a 202 and a status monitor.
    pub(crate) respond_async: bool,
}

impl Prefer {
    /// The preferences of every `Prefer` header of `headers`: a comma-separated list of
    /// `token[=value]` with optional `;` parameters, tokens compared without case, the
    /// first of a repeated preference winning (RFC 7240 section 2); preferences the layer
    /// does not know, and malformed ones, are ignored, as the RFC asks.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let mut prefer = Self::default();
        let mut seen_wait = false;
        for value in headers.get_all(PREFER) {
            let Ok(value) = value.to_str() else { continue };
            for preference in value.split(',') {
                let preference = preference.split(';').next().unwrap_or("").trim();
                let (token, value) = match preference.split_once('=') {
                    Some((token, value)) => (token.trim(), Some(value.trim().trim_matches('"'))),
                    None => (preference, None),
                };
                if token.eq_ignore_ascii_case("respond-async") {
                    prefer.respond_async = true;
                } else if token.eq_ignore_ascii_case("wait") && !seen_wait {
                    seen_wait = true;
                    prefer.wait = value
                        .and_then(|v| v.parse::<u64>().ok())
                        .map(Duration::from_secs);
                }
            }
        }
        prefer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> Prefer {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(PREFER, v.parse().unwrap());
        }
        Prefer::of(&headers)
    }

    #[test]
    fn the_forms_of_rfc_7240() {
        assert_eq!(prefer(&[]), Prefer::default());
        assert_eq!(prefer(&["wait=5"]).wait, Some(Duration::from_secs(5)));
        assert_eq!(prefer(&["WAIT = \"7\""]).wait, Some(Duration::from_secs(7)));
        let both = prefer(&["return=minimal, Respond-Async; foo=bar", "wait=0"]);
        assert!(both.respond_async);
        assert_eq!(both.wait, Some(Duration::ZERO));
        // The first of a repeated preference wins; a malformed one is ignored.
        assert_eq!(
            prefer(&["wait=2, wait=9"]).wait,
            Some(Duration::from_secs(2))
        );
        assert_eq!(prefer(&["wait=soon"]).wait, None);
        assert!(!prefer(&["respond-asyncx"]).respond_async);
    }
}
