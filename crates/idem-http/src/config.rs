//! What the layer guards, what it stores and replays, and its limits.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, StatusCode};
use idem_core::JsonSelection;

/// What to do with a guarded request that carries no idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Refuse it with 400 (the default): the route documents the key as required, as the
    /// IETF Idempotency-Key draft recommends.
    #[default]
    Reject,
    /// Hand it to the service unguarded, for routes where the key is optional.
    PassThrough,
}

/// What to do with the key when the work ran but its response cannot be stored: the
/// response is larger than [`Config::max_response_body`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Unstored {
    /// Keep the lease until it expires (the default): retries get 409 until then, so a
    /// client that lost the response does not run the work again at once; after the lease
    /// expires a retry takes the key over and runs the work again, with
    /// [`crate::IdempotencyInfo::attempt`] above 1.
    #[default]
    KeepLease,
    /// Release the key at once (a streamed response's once its body has ended): the next
    /// retry runs the work again.
    Release,
}

/// What happens to a streamed response's work when its client goes away before the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnDisconnect {
    /// The body is read to its end and stored as if the client were there (the default):
    /// a retry with the same key gets the whole response replayed, and the work is done
    /// once.
    #[default]
    Continue,
    /// The body is dropped as soon as the layer sees the client gone (for a proxy: the
    /// upstream connection is closed), the key is released and nothing is stored: a retry
    /// runs the work again. For streams whose work is worth nothing without a reader.
    /// A response whose body was already whole when the handler returned it is stored
    /// either way.
    Cancel,
}

/// What to do with a guarded request whose scope extractor finds no principal (or when the
/// layer has no scope extractor, see [`crate::IdempotencyLayer::with_scope`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Anonymous {
    /// Refuse it with 401 `application/problem+json` (`principal-missing`) before the
    /// handler runs (the default): anonymous callers sharing one key space could be handed
    /// each other's stored responses.
    #[default]
    Refuse,
    /// Key it in [`idem_core::Scope::global`], one key space shared by every anonymous
    /// caller and apart from every named scope. For routes whose keys are unguessable and
    /// whose responses hold nothing private, or services with a single caller.
    Shared,
}

/// Decides from the status whether a response is stored and replayed or the key released.
pub type StatusFilter = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The statuses that are never stored by default: the answers that say "not now" or "not
/// you" rather than "done" or "never", so that a retry may well succeed.
pub const TRANSIENT_4XX: [StatusCode; 7] = [
    StatusCode::UNAUTHORIZED,
    StatusCode::FORBIDDEN,
    StatusCode::REQUEST_TIMEOUT,
    StatusCode::CONFLICT,
    StatusCode::LOCKED,
    StatusCode::TOO_EARLY,
    StatusCode::TOO_MANY_REQUESTS,
];

/// The default of [`Config::store_status`]: whether a response with `status` is stored and
/// replayed.
///
/// | status | stored | why |
/// |---|---|---|
/// | 1xx | no | never ends a response |
/// | 2xx | yes | the work is done |
/// | 3xx | no | add it with [`Config::with_store_status`] if a create answers `303 See Other` |
/// | 400, 404, 405, 410, 413, 415, 422 and every other 4xx not below | yes | final for this request: the same request fails again |
/// | 401, 403 | no | credentials or rights may change (a token refreshed, a role granted) |
/// | 408 | no | the request was too slow, not wrong |
/// | 409 | no | a conflict with the resource's current state, which may pass |
/// | 423, 425 | no | locked, too early: retry later |
/// | 429 | no | rate limited: retry later |
/// | 5xx | no | the server failed: the key is released so a retry runs the work again |
///
/// ```
/// use http::StatusCode;
/// use idem_http::default_store_status;
///
/// assert!(default_store_status(StatusCode::CREATED));
/// assert!(default_store_status(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(!default_store_status(StatusCode::TOO_MANY_REQUESTS));
/// assert!(!default_store_status(StatusCode::SERVICE_UNAVAILABLE));
/// ```
pub fn default_store_status(status: StatusCode) -> bool {
    status.is_success() || (status.is_client_error() && !TRANSIENT_4XX.contains(&status))
}

/// Settings of an [`crate::IdempotencyLayer`]. Every field has a documented default; build
/// one with [`Config::default`] and the `with_*` methods.
///
/// The lease length, retention and the wait for an in-flight request belong to the engine:
/// see [`idem_core::Config`].
#[derive(Clone, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct Config {
    /// The request header carrying the key. Default: `Idempotency-Key`.
    pub header: HeaderName,
    /// The methods that are guarded; requests with other methods pass through untouched.
    /// Default: `POST` and `PATCH`.
    #[setters(skip)]
    pub methods: Vec<Method>,
    /// A guarded request without a key. Default: [`MissingKey::Reject`] (400).
    pub missing_key: MissingKey,
    /// Request headers that take part in the fingerprint besides the method, the path
    /// with its query, and the body. Default: none.
    #[setters(skip)]
    pub fingerprint_headers: Vec<HeaderName>,
    /// Which fields of a JSON body take part in the fingerprint. Default: all of it.
    pub json_selection: JsonSelection,
    /// The largest request body read, in bytes; a larger one is refused with 413 before the
    /// handler runs. Default: 1 MiB.
    pub max_request_body: usize,
    /// The largest response body stored, in bytes. A larger response is still sent, but not
    /// stored, and the key is handled by [`Config::unstored`]. Default: 1 MiB.
    pub max_response_body: usize,
    /// What happens to the key when a response is too large to store. Default:
    /// [`Unstored::KeepLease`].
    pub unstored: Unstored,
    /// What happens to a streamed response's work when its client goes away before the
    /// end. Default: [`OnDisconnect::Continue`].
    pub on_disconnect: OnDisconnect,
    /// Numbers the events of a `text/event-stream` response that carry no `id:` field of
    /// their own: each event with data gets `id: N`, its sequence number from 0, before its
    /// other lines, so that a client can resume with `Last-Event-ID` and every replay
    /// carries the same ids. Default: `false` (the events as the service sent them).
    pub sse_ids: bool,
    /// Which statuses are stored and replayed; for the others the key is released so that a
    /// retry runs the handler again. Default: [`default_store_status`], 2xx and the 4xx
    /// that are final for the request, never 401, 403, 408, 409, 423, 425 or 429 (its docs
    /// hold the whole table). A service that answers a create with `303 See Other` should
    /// add 3xx here.
    #[setters(skip)]
    pub store_status: StatusFilter,
    /// Response headers stored and replayed (compared case-insensitively). Headers not
    /// listed are sent with the first response only. `Set-Cookie`, hop-by-hop headers
    /// (`Connection`, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Upgrade`) and everything
    /// else not listed are never replayed; `Content-Length` and `Transfer-Encoding` never
    /// are even when listed, as a replayed body is framed anew. Default: `Content-Type`,
    /// `Content-Encoding`, `Content-Language`, `Content-Location`, `Location`, `ETag`,
    /// `Last-Modified`, `Cache-Control`, `Link`.
    #[setters(skip)]
    pub replay_headers: Vec<HeaderName>,
    /// When the store is unavailable at the start of a request: `false` (the default)
    /// answers 503 with `Retry-After` and never runs the handler unguarded (fail closed);
    /// `true` runs the handler without idempotency (fail open).
    pub fail_open: bool,
    /// The `Retry-After` of a 503 answered because the store is unavailable. Default: 1 s.
    pub store_retry_after: Duration,
    /// The `Retry-After` of a 409 answered while another request holds the key: a short
    /// hint, never past the holder's lease time left (in whole seconds, at least 1, as the
    /// header allows). Most work ends long before its lease, so the lease time left would
    /// make clients wait for nothing. Default: 1 s.
    pub in_flight_retry_after: Duration,
    /// A guarded request without a principal. Default: [`Anonymous::Refuse`] (401).
    pub anonymous: Anonymous,
    /// The `WWW-Authenticate` challenge of the 401 answered to a request without a
    /// principal: name the scheme your scope extractor reads. Default: `Bearer`.
    pub challenge: HeaderValue,
    /// How long the layer keeps trying to store a response when the store fails after the
    /// handler ran, before it gives up on sending it (see the crate docs, "When storing the
    /// response fails"). Default: 2 s.
    pub store_response_within: Duration,
    /// Whether the lease is renewed every third of its length while the handler runs, so a
    /// slow handler is not taken over by a retry. Default: `true`.
    pub heartbeat: bool,
    /// The longest a duplicate of a request in flight waits for its response when it asks
    /// with `Prefer: wait=N` (RFC 7240): it waits `min(N, max_wait)`, then answers as
    /// without the header, with `Preference-Applied: wait=M` (`M` the seconds honoured).
    /// Without the header, [`idem_core::Config::wait`] applies. Default: 10 s.
    pub max_wait: Duration,
    /// Where the status monitor answers (see [`crate::monitor`]): every guarded answer names
    /// its key's monitor under it in `Link: <…>; rel="monitor"`. Default: `/.idem/keys`.
    #[setters(into)]
    pub monitor_path: String,
    /// Makes the route a JSON-RPC route: the calls it guards are found in the body (see
    /// [`crate::jsonrpc`]), and its answers are JSON-RPC. Default: `None`, an HTTP route.
    #[setters(skip)]
    pub jsonrpc: Option<crate::JsonRpc>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            methods: vec![Method::POST, Method::PATCH],
            missing_key: MissingKey::Reject,
            fingerprint_headers: Vec::new(),
            json_selection: JsonSelection::All,
            max_request_body: 1 << 20,
            max_response_body: 1 << 20,
            unstored: Unstored::KeepLease,
            on_disconnect: OnDisconnect::Continue,
            sse_ids: false,
            store_status: Arc::new(default_store_status),
            replay_headers: [
                http::header::CONTENT_TYPE,
                http::header::CONTENT_ENCODING,
                http::header::CONTENT_LANGUAGE,
                http::header::CONTENT_LOCATION,
                http::header::LOCATION,
                http::header::ETAG,
                http::header::LAST_MODIFIED,
                http::header::CACHE_CONTROL,
                http::header::LINK,
            ]
            .into(),
            fail_open: false,
            store_retry_after: Duration::from_secs(1),
            in_flight_retry_after: Duration::from_secs(1),
            anonymous: Anonymous::Refuse,
            challenge: HeaderValue::from_static("Bearer"),
            store_response_within: Duration::from_secs(2),
            heartbeat: true,
            max_wait: Duration::from_secs(10),
            monitor_path: "/.idem/keys".to_owned(),
            jsonrpc: None,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct("Config");
        // Every field by its name and value, in order; the status filter, a closure, by its
        // signature.
        macro_rules! fields {
            ($($name:ident),*) => { $(out.field(stringify!($name), &self.$name);)* };
        }
        fields!(
            header,
            methods,
            missing_key,
            fingerprint_headers,
            json_selection,
            max_request_body,
            max_response_body,
            unstored,
            on_disconnect,
            sse_ids
        );
        out.field("store_status", &"Fn(StatusCode) -> bool");
        fields!(
            replay_headers,
            fail_open,
            store_retry_after,
            in_flight_retry_after,
            anonymous,
            challenge,
            store_response_within,
            heartbeat,
            max_wait,
            monitor_path,
            jsonrpc
        );
        out.finish()
    }
}

// The `with_*` builders of the other fields, which set them as given, are derived.
impl Config {
    /// Sets [`Config::methods`].
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Sets [`Config::fingerprint_headers`].
    pub fn with_fingerprint_headers(
        mut self,
        headers: impl IntoIterator<Item = HeaderName>,
    ) -> Self {
        self.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// Sets [`Config::store_status`]: `filter` returns `true` for statuses to store.
    ///
    /// ```
    /// // Store 5xx answers too, so that no retry ever runs the handler again.
    /// let config = idem_http::Config::default().with_store_status(|_status| true);
    /// # let _ = config;
    /// ```
    pub fn with_store_status(
        mut self,
        filter: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.store_status = Arc::new(filter);
        self
    }

    /// Sets [`Config::replay_headers`].
    pub fn with_replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_headers = headers.into_iter().collect();
        self
    }

    /// The record's response for an HTTP response: its status, the headers of
    /// [`Config::replay_headers`] and its body.
    pub(crate) fn to_stored(
        &self,
        status: StatusCode,
        headers: &http::HeaderMap,
        body: bytes::Bytes,
    ) -> idem_core::Response {
        let mut stored = idem_core::Response::new(status.as_u16(), body);
        for (name, value) in headers {
            if self.replays(name) {
                stored = stored.with_header(name.as_str(), value.as_bytes());
            }
        }
        stored
    }

    /// Whether a response header is stored and replayed.
    pub(crate) fn replays(&self, name: &HeaderName) -> bool {
        name != http::header::CONTENT_LENGTH
            && name != http::header::TRANSFER_ENCODING
            && self.replay_headers.contains(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_status_table() {
        let stored = |code: u16| default_store_status(StatusCode::from_u16(code).unwrap());
        for code in [
            200, 201, 202, 204, 206, 299, 400, 402, 404, 405, 410, 412, 413, 415, 422, 451, 499,
        ] {
            assert!(stored(code), "{code} must be stored");
        }
        for code in [
            100, 101, 301, 303, 304, 401, 403, 408, 409, 423, 425, 429, 500, 502, 503, 504,
        ] {
            assert!(!stored(code), "{code} must not be stored");
        }
    }
}
