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
        for preference in preferences(headers) {
            let (token, value) = split(preference);
            if token.eq_ignore_ascii_case("respond-async") {
                prefer.respond_async = true;
            } else if token.eq_ignore_ascii_case("wait") && !seen_wait {
                seen_wait = true;
                prefer.wait = value
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(Duration::from_secs);
            }
        }
        prefer
    }
}

/// Removes from `headers` the preferences the layer honours (`wait`, `respond-async`),
/// keeping every other one: the service behind the layer must not honour them a second
/// time (its own `202` would be stored as the key's final answer).
pub(crate) fn strip_honoured(headers: &mut HeaderMap) {
    let kept: Vec<String> = preferences(headers)
        .filter(|preference| {
            let (token, _) = split(preference);
            !token.eq_ignore_ascii_case("wait") && !token.eq_ignore_ascii_case("respond-async")
        })
        .map(str::to_owned)
        .collect();
    headers.remove(PREFER);
    if kept.is_empty() {
        return;
    }
    if let Ok(value) = http::HeaderValue::try_from(kept.join(", ")) {
        headers.insert(PREFER, value);
    }
}

/// Every preference of every `Prefer` header, as written (parameters included), trimmed.
fn preferences(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .filter(|preference| !preference.is_empty())
}

/// A preference's token and value, its `;` parameters left out.
fn split(preference: &str) -> (&str, Option<&str>) {
    let preference = preference.split(';').next().unwrap_or("").trim();
    match preference.split_once('=') {
        Some((token, value)) => (token.trim(), Some(value.trim().trim_matches('"'))),
        None => (preference, None),
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

    #[test]
    fn the_honoured_preferences_are_not_passed_on() {
        let mut headers = HeaderMap::new();
        headers.append(PREFER, "respond-async, return=minimal".parse().unwrap());
        headers.append(PREFER, "Wait=5; x=y, handling=lenient".parse().unwrap());
        strip_honoured(&mut headers);
        assert_eq!(headers[PREFER], "return=minimal, handling=lenient");
        let mut headers = HeaderMap::new();
        headers.append(PREFER, "wait=5".parse().unwrap());
        strip_honoured(&mut headers);
        assert!(headers.get(PREFER).is_none());
    }
}
