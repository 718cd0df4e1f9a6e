//! What admission reads from a guarded request: its key, its body within the limit, and
//! its fingerprint.

use bytes::Bytes;
use http::header::{HeaderName, CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::HeaderMap;
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{BoxError, Fingerprint, FingerprintBuilder, Key};

use crate::config::Config;
use crate::error::Problem;

/// Reads the key header: `Ok(None)` when absent, `Err(why)` when malformed. A Structured
/// Field string (`"..."`, as in the IETF draft) and a bare token are both accepted.
pub(crate) fn read_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Key>, String> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!("send exactly one {name} header"));
    }
    let raw = value.as_bytes();
    let text = if raw.first() == Some(&b'"') {
        parse_sf_string(raw).ok_or_else(|| format!("{name} is not a valid quoted string"))?
    } else {
        String::from_utf8(raw.to_vec()).map_err(|_| format!("{name} is not ASCII"))?
    };
    Key::new(text).map(Some).map_err(|e| e.to_string())
}

/// Parses an RFC 8941 sf-string: `"` then printable ASCII with `\"` and `\\` escapes,
/// then a closing `"` that ends the value.
fn parse_sf_string(raw: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut bytes = raw.strip_prefix(b"\"")?.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(char::from(c)),
                _ => return None,
            },
            b'"' => return bytes.next().is_none().then_some(out),
            0x20..=0x7e => out.push(char::from(b)),
            _ => return None,
        }
    }
    None
}

/// Reads the request body whole, refusing it with 413 once it is over `limit` bytes (at
/// once when its declared length is) and with 400 when it breaks off.
pub(crate) async fn read_body<B>(
    body: B,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Problem::body_too_large(limit));
    }
    // Trailers of a request are not part of what it asks for: only the data is kept.
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(Problem::body_too_large(limit)),
        Err(e) => Err(Problem::body_unreadable(&e)),
    }
}

/// The fingerprint: method, path with query, the configured headers, and the body (in
/// canonical form when it is JSON).
pub(crate) fn fingerprint(config: &Config, parts: &Parts, body: &[u8]) -> Fingerprint {
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |pq| pq.as_str());
    let mut fp = FingerprintBuilder::new()
        .text("method", parts.method.as_str())
        .text("target", target);
    for name in &config.fingerprint_headers {
        let mut values = parts.headers.get_all(name).iter().peekable();
        if values.peek().is_none() {
            // Absent differs from present and empty.
            fp = fp.bytes(&format!("absent header {name}"), b"");
            continue;
        }
        let mut joined = Vec::new();
        for (i, value) in values.enumerate() {
            if i > 0 {
                joined.push(b'\n');
            }
            joined.extend_from_slice(value.as_bytes());
        }
        fp = fp.bytes(&format!("header {name}"), &joined);
    }
    if is_json(&parts.headers) && !body.is_empty() {
        // A body that does not parse as JSON is fingerprinted by its raw bytes below.
        if let Ok(with_body) = fp.clone().json("json body", body, &config.json_selection) {
            return with_body.finish();
        }
    }
    fp.bytes("body", body).finish()
}

/// Whether the content type is `application/json` or `application/*+json`.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || subtype.to_ascii_lowercase().ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use http::header::HeaderValue;
    use http::Request;

    use super::*;

    #[test]
    fn key_header_forms() {
        let name = HeaderName::from_static("idempotency-key");
        let read = |values: &[&[u8]]| {
            let mut headers = HeaderMap::new();
            for v in values {
                headers.append(&name, HeaderValue::from_bytes(v).unwrap());
            }
            read_key(&headers, &name)
        };
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(read(&[b"abc-1"]).unwrap().unwrap().as_str(), "abc-1");
        assert_eq!(read(&[b"\"abc-1\""]).unwrap().unwrap().as_str(), "abc-1");
        assert_eq!(
            read(&[br#""a\"b\\c""#]).unwrap().unwrap().as_str(),
            r#"a"b\c"#
        );
        assert!(read(&[b"\"abc"]).is_err());
        assert!(read(&[b"\"a\"b\""]).is_err());
        assert!(read(&[b"\"a\\xb\""]).is_err());
        assert!(
            read(&[b"\"a b\""]).is_err(),
            "space is not allowed in a key"
        );
        assert!(read(&[b""]).is_err());
        assert!(read(&[b"a", b"b"]).is_err());
        assert!(read(&[&[b'a'; 256]]).is_err());
        assert!(read(&[b"caf\xc3\xa9"]).is_err());
    }

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut req = Request::builder().method(method).uri(uri);
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn fingerprint_parts() {
        let config = Config::default().with_fingerprint_headers([HeaderName::from_static("x-a")]);
        let json = [("content-type", "application/json; charset=utf-8")];
        let fp = |p: &Parts, body: &str| fingerprint(&config, p, body.as_bytes());
        let base = fp(&parts("POST", "/p", &json), r#"{"a":1,"b":2}"#);
        // Canonical JSON: order and whitespace do not count.
        assert_eq!(
            base,
            fp(&parts("POST", "/p", &json), r#"{ "b": 2, "a": 1 }"#)
        );
        assert_ne!(base, fp(&parts("POST", "/p", &json), r#"{"a":1,"b":3}"#));
        assert_ne!(base, fp(&parts("PATCH", "/p", &json), r#"{"a":1,"b":2}"#));
        assert_ne!(base, fp(&parts("POST", "/q", &json), r#"{"a":1,"b":2}"#));
        assert_ne!(
            base,
            fp(&parts("POST", "/p?x=1", &json), r#"{"a":1,"b":2}"#)
        );
        // Not JSON: raw bytes, so whitespace counts.
        let text = parts("POST", "/p", &[("content-type", "text/plain")]);
        assert_ne!(fp(&text, "a b"), fp(&text, "a  b"));
        // Fingerprinted headers: absent, empty and set all differ.
        let with = |v: Option<&str>| {
            let mut h = json.to_vec();
            if let Some(v) = v {
                h.push(("x-a", v));
            }
            fp(&parts("POST", "/p", &h), "{}")
        };
        assert_ne!(with(None), with(Some("")));
        assert_ne!(with(Some("")), with(Some("1")));
        assert_eq!(with(Some("1")), with(Some("1")));
        // Malformed JSON under a JSON content type still fingerprints, by its bytes.
        let p = parts("POST", "/p", &json);
        assert_ne!(fp(&p, "{nope"), fp(&p, "{nope "));
    }

    #[test]
    fn json_content_types() {
        let h = |ct: &str| {
            let mut m = HeaderMap::new();
            m.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            is_json(&m)
        };
        assert!(h("application/json"));
        assert!(h("Application/JSON; charset=utf-8"));
        assert!(h("application/merge-patch+json"));
        assert!(!h("text/json-ish"));
        assert!(!h("text/plain"));
        assert!(!is_json(&HeaderMap::new()));
    }
}
