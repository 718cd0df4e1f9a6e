//! JSON-RPC routes: the calls of a protocol inside HTTP (MCP's `tools/call`, A2A's
//! `message/send`) run once per key, and every answer is the protocol's own.
//!
//! A route becomes a JSON-RPC route with [`crate::Config::with_jsonrpc`]. Every JSON-RPC
//! message is a `POST` to one path, so the layer reads the body (within
//! [`crate::Config::max_request_body`]) and guards only a request object whose `method`
//! is in [`JsonRpc::methods`] and which has an `id`. Everything else is handed on with its
//! bytes untouched: other methods (`initialize`, `tools/list`), notifications, responses
//! the client sends back, a body that is not JSON.
//!
//! | a guarded call | answer |
//! |---|---|
//! | key | the string at [`JsonRpc::key_pointer`] in the request object, else the key header ([`crate::Config::header`]) |
//! | no key | [`crate::Config::missing_key`]: handed on unguarded, or [`codes::KEY_MISSING`] |
//! | malformed key | [`codes::KEY_INVALID`] |
//! | fingerprint | RFC 8785 canonical JSON of `method` and `params`, without the key and the `params._meta` entries of [`JsonRpc::ignore_meta`] (then [`crate::Config::json_selection`] over `{"method", "params"}`); the request `id`, the headers (`Mcp-Session-Id` among them) and the path take no part |
//! | first call | the service runs; its answer (JSON, or an SSE stream sent on as it comes) is stored when the HTTP status is 2xx and the JSON-RPC response is a success (a JSON-RPC `error`, or an MCP tool result with `isError: true`, is stored only with [`JsonRpc::store_errors`]; otherwise the key is released) |
//! | retry (a new `id`) | the stored answer with its response's `id` replaced by the retry's, byte for byte otherwise (inside its SSE event for a stream), plus `Idempotent-Replayed: true` |
//! | same key, other arguments | [`codes::KEY_REUSED`], `data.idempotencyKey` naming the key; the service is not called |
//! | same key while the first runs | [`codes::IN_FLIGHT`] with `Retry-After` and `data.retryAfterSeconds`, or, with [`idem_core::Config::wait`], the first call's answer once stored |
//! | a batch (JSON array) holding a guarded call | [`codes::BATCH_REFUSED`]: send guarded calls one per request |
//! | any request with a `Content-Encoding` (but `identity`), or over [`crate::Config::max_request_body`] | [`codes::BODY_REFUSED`]: its method cannot be read |
//! | store unavailable | [`codes::STORE_UNAVAILABLE`] with `Retry-After` (or unguarded with [`crate::Config::fail_open`]) |
//!
//! The layer's errors are JSON-RPC error responses (`{"jsonrpc":"2.0","id":..,"error":
//! {"code":..,"message":..,"data":{"type":"urn:idem:problem:<kind>","detail":..}}}`) with
//! HTTP status 200, as a JSON-RPC server answers an error; the one exception is a caller
//! without a principal, answered 401 with the `WWW-Authenticate` challenge so that a
//! client's authorization flow starts. Their codes, in [`codes`], are in the range JSON-RPC
//! leaves to implementations (-32000 to -32099), away from the -32000 and -32001 that the
//! MCP SDKs use for their own errors.
//!
//! A JSON answer is read to its end within [`crate::Config::max_response_body`] before it
//! is stored and sent, so that whether the call failed is known. An SSE answer (an MCP
//! tool's progress notifications, then its response event) goes to the client as it comes
//! and is stored at its end when its response is a success, like any streamed response of
//! the layer; a duplicate meanwhile gets the in-flight error, never the live stream, whose
//! events carry the first call's `id`. A larger answer is sent on unstored, per
//! [`crate::Config::unstored`]. A replay
//! carries those notifications as the first attempt got them, with its `progressToken`
//! (the MCP TypeScript client reports a notification for a token it does not know to its
//! `onerror` and goes on).
//!
//! Keys are kept per principal ([`crate::IdempotencyLayer::with_scope`]): a scope read
//! from a bearer token changes when an OAuth client refreshes its token between a call and
//! its retry, so take the principal from what stays the same (the token's subject, or a
//! caller id an authorizing gateway sets).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited, StreamBody};
use idem_core::{
    remove_pointer, Begin, BoxError, Fingerprint, FingerprintBuilder, JsonSelection, Key, Lease,
    RecordId, Replay, Scope,
};
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use tower_service::Service;

use crate::body::{Prefixed, RequestBody, ResponseBody};
use crate::config::{Anonymous, Config, MissingKey, Unstored};
use crate::handle::LeaseHandle;
use crate::outcome::{KeepInFlight, Outcome};
use crate::request::read_key;
use crate::response::{insert_expires, REPLAYED};
use crate::settle::{keep_or_release, release, Kept};
use crate::shared::Shared;
use crate::steps::{answered, pass, record_on_span, run_leased, Admission};

/// The error codes of the layer's JSON-RPC answers, all in the range JSON-RPC leaves to
/// implementations (-32000 to -32099). Each error's `data.type` is
/// `urn:idem:problem:<kind>`, the kind named beside its code.
pub mod codes {
    /// The key was used with other arguments (`idempotency-key-reused`); `data.idempotencyKey`
    /// names the key. Use a new key for a new call.
    pub const KEY_REUSED: i64 = -32051;
    /// A call with this key is running (`request-in-flight`); retry after
    /// `data.retryAfterSeconds` (also the `Retry-After` header) with the same key.
    pub const IN_FLIGHT: i64 = -32052;
    /// The call carries no key and the route requires one (`idempotency-key-missing`).
    pub const KEY_MISSING: i64 = -32053;
    /// The key is not 1 to 255 bytes of visible ASCII (`idempotency-key-invalid`).
    pub const KEY_INVALID: i64 = -32054;
    /// No principal to keep the key under (`principal-missing`), answered with HTTP 401.
    pub const PRINCIPAL_MISSING: i64 = -32055;
    /// The idempotency store cannot be reached (`store-unavailable`) or failed
    /// (`store-error`): the call did not run.
    pub const STORE_UNAVAILABLE: i64 = -32056;
    /// The call ran, and its answer is not recorded yet (`outcome-not-recorded`) or never
    /// will be under this attempt (`lease-lost`): retry with the same key.
    pub const NOT_RECORDED: i64 = -32057;
    /// A batch holds a guarded call (`batch-refused`): send guarded calls one per request.
    pub const BATCH_REFUSED: i64 = -32058;
    /// The request body is over the limit or broke off (`request-body-too-large`,
    /// `request-body-unreadable`).
    pub const BODY_REFUSED: i64 = -32059;
    /// The answer stored for the key cannot be replayed (`stored-response-invalid`).
    pub const STORED_INVALID: i64 = -32060;
    /// The key's call completed long ago and its answer was forgotten when its retention
    /// ended; its tombstone refuses it (`key-expired`): use a new key for a new call.
    pub const KEY_EXPIRED: i64 = -32061;
}

/// The settings of a JSON-RPC route (see the module docs): which calls are guarded, where
/// their key is, what their fingerprint leaves out, and whether failed calls are stored.
///
/// ```
/// use idem_http::{Config, JsonRpc};
///
/// // MCP: tool calls run once per `params._meta.idempotencyKey`.
/// let mcp = Config::default().with_jsonrpc(JsonRpc::new(["tools/call"]));
/// // A2A: a message is sent once per `messageId`.
/// let a2a = Config::default().with_jsonrpc(
///     JsonRpc::new(["message/send"]).with_key_pointer("/params/message/messageId"),
/// );
/// # let _ = (mcp, a2a);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct JsonRpc {
    /// The guarded methods; calls of any other method pass through untouched. No default:
    /// given to [`JsonRpc::new`].
    pub methods: Vec<String>,
    /// The JSON pointer (RFC 6901) to the key in the request object; when it finds no
    /// string, the key header ([`crate::Config::header`]) is read. `None`: the header only.
    /// Default: `/params/_meta/idempotencyKey`.
    pub key_pointer: Option<String>,
    /// Entries of `params._meta` that change from one attempt to the next and are left out
    /// of the fingerprint (an empty `_meta` counts as none). Default: `progressToken`.
    pub ignore_meta: Vec<String>,
    /// Whether failed calls are stored and replayed: JSON-RPC error responses and MCP tool
    /// results with `isError: true`. Default: `false`, the key is released (as for a 5xx),
    /// so a retry runs the call again.
    pub store_errors: bool,
}

impl JsonRpc {
    /// Guards the calls of `methods`, with every other setting at its default.
    pub fn new<M: Into<String>>(methods: impl IntoIterator<Item = M>) -> Self {
        Self {
            methods: methods.into_iter().map(Into::into).collect(),
            key_pointer: Some("/params/_meta/idempotencyKey".to_owned()),
            ignore_meta: vec!["progressToken".to_owned()],
            store_errors: false,
        }
    }

    /// Sets [`JsonRpc::key_pointer`].
    pub fn with_key_pointer(mut self, pointer: impl Into<String>) -> Self {
        self.key_pointer = Some(pointer.into());
        self
    }

    /// Reads the key from the header only ([`JsonRpc::key_pointer`] `None`).
    pub fn without_key_pointer(mut self) -> Self {
        self.key_pointer = None;
        self
    }

    /// Sets [`JsonRpc::ignore_meta`].
    pub fn with_ignore_meta<M: Into<String>>(
        mut self,
        entries: impl IntoIterator<Item = M>,
    ) -> Self {
        self.ignore_meta = entries.into_iter().map(Into::into).collect();
        self
    }

    /// Sets [`JsonRpc::store_errors`].
    pub fn with_store_errors(mut self, store: bool) -> Self {
        self.store_errors = store;
        self
    }
}

impl Config {
    /// Makes the route a JSON-RPC route with these settings ([`Config::jsonrpc`]).
    pub fn with_jsonrpc(mut self, jsonrpc: JsonRpc) -> Self {
        self.jsonrpc = Some(jsonrpc);
        self
    }
}

/// One guarded call, as admission read it.
struct Call {
    /// The request's `id`, which the answer carries.
    id: Value,
    key: Key,
}

/// A guarded call as [`admit`] hands it to [`claim`]: the route's settings, its record and
/// its fingerprint.
pub(crate) struct Guarded {
    rpc: JsonRpc,
    id: RecordId,
    fingerprint: Fingerprint,
    call: Call,
}

/// A request on a JSON-RPC route: reads its body, then guards it when it is a guarded call,
/// refuses a batch holding one, and hands every other message on untouched.
pub(crate) async fn admit<B>(
    shared: &Shared,
    rpc: JsonRpc,
    req: Request<B>,
) -> Admission<B, Guarded>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    let (parts, body) = req.into_parts();
    let encoded = parts
        .headers
        .get(CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        // A compressed body hides its method: passing it on could run a guarded call
        // unguarded.
        let detail = "send JSON-RPC requests uncompressed: this route reads each request to \
                      find its method and idempotency key";
        let kind = "request-body-unreadable";
        let error = RpcError::new(codes::BODY_REFUSED, kind, "Request body refused", detail);
        return Admission::Refuse(refuse(shared, Outcome::Rejected, error, &Value::Null));
    }
    let limit = shared.config.max_request_body;
    let bytes = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let (kind, detail) = if e.is::<LengthLimitError>() {
                let detail = format!("a JSON-RPC request may carry at most {limit} bytes");
                ("request-body-too-large", detail)
            } else {
                let detail = format!("the request body could not be read: {e}");
                ("request-body-unreadable", detail)
            };
            let error = RpcError::new(codes::BODY_REFUSED, kind, "Request body refused", detail);
            return Admission::Refuse(refuse(shared, Outcome::Rejected, error, &Value::Null));
        }
    };
    let (call, fingerprint) = match read_message(shared, &rpc, &parts, &bytes) {
        Message::Guard(call, fingerprint) => (call, fingerprint),
        Message::Other => {
            return Admission::Pass(Request::from_parts(parts, Either::Left(Full::new(bytes))))
        }
        Message::Unguarded => {
            shared.observe(Outcome::Unguarded);
            return Admission::Pass(Request::from_parts(parts, Either::Left(Full::new(bytes))));
        }
        Message::Refuse(error, id) => {
            return Admission::Refuse(refuse(shared, Outcome::Rejected, error, &id))
        }
    };
    let scope = match shared.scope.as_ref().and_then(|scope| scope(&parts)) {
        Some(scope) => scope,
        None if shared.config.anonymous == Anonymous::Shared => Scope::global(),
        None => {
            let detail = "idempotency keys are kept per caller, and this call names none: \
                          authenticate, then retry with the same key";
            let error = RpcError::new(
                codes::PRINCIPAL_MISSING,
                "principal-missing",
                "Caller unknown",
                detail,
            );
            let mut response = refuse(shared, Outcome::Rejected, error, &call.id);
            *response.status_mut() = StatusCode::UNAUTHORIZED;
            let challenge = shared.config.challenge.clone();
            response.headers_mut().insert(WWW_AUTHENTICATE, challenge);
            return Admission::Refuse(response);
        }
    };
    let id = RecordId::new(scope, call.key.clone());
    record_on_span(&id);
    let req = Request::from_parts(parts, Either::Left(Full::new(bytes)));
    let guarded = Guarded {
        rpc,
        id,
        fingerprint,
        call,
    };
    Admission::Guard(guarded, req)
}

/// What a request's body is.
enum Message {
    /// A guarded call with its key, under this fingerprint.
    Guard(Call, Fingerprint),
    /// Not a guarded call: handed on untouched, and not reported.
    Other,
    /// A guarded call without a key, on a route where keys are optional.
    Unguarded,
    /// Refused with this error, answering this `id`.
    Refuse(RpcError, Value),
}

/// Reads the message: a guarded call (an object with an `id` and a guarded `method`) is
/// keyed and fingerprinted; a batch holding one is refused; anything else is not ours.
fn read_message(shared: &Shared, rpc: &JsonRpc, parts: &Parts, bytes: &[u8]) -> Message {
    let Ok(message) = serde_json::from_slice::<Value>(bytes) else {
        // The service answers a parse error in its own words.
        return Message::Other;
    };
    let guarded = |m: &Value| {
        m.as_object().is_some_and(|o| {
            o.contains_key("id")
                && o.get("method")
                    .and_then(Value::as_str)
                    .is_some_and(|method| rpc.methods.iter().any(|g| g == method))
        })
    };
    match &message {
        Value::Array(batch) if batch.iter().any(guarded) => {
            let methods = rpc.methods.join(", ");
            let detail = format!(
                "a batch may not hold a call of {methods}: each must be answered under its own \
                 idempotency key, so send it as a request of its own"
            );
            let error = RpcError::new(
                codes::BATCH_REFUSED,
                "batch-refused",
                "Batch refused",
                detail,
            );
            return Message::Refuse(error, Value::Null);
        }
        m if guarded(m) => {}
        _ => return Message::Other,
    }
    let id = message["id"].clone();
    let from_body = rpc
        .key_pointer
        .as_deref()
        .and_then(|pointer| message.pointer(pointer))
        .and_then(Value::as_str);
    // A string at the pointer is the key, well-formed or not; the header only without one.
    let read = match from_body {
        Some(text) => Key::new(text).map(Some).map_err(|e| e.to_string()),
        None => read_key(&parts.headers, &shared.config.header),
    };
    let refused = match read {
        Ok(Some(key)) => {
            let fingerprint = fingerprint(&shared.config, rpc, message);
            return Message::Guard(Call { id, key }, fingerprint);
        }
        Ok(None) if shared.config.missing_key == MissingKey::PassThrough => {
            return Message::Unguarded
        }
        Ok(None) => {
            let method = message["method"].as_str().unwrap_or_default();
            let header = &shared.config.header;
            let detail = match &rpc.key_pointer {
                Some(pointer) => format!(
                    "{method} requires an idempotency key: a string at {pointer} in the \
                     request, or an {header} header"
                ),
                None => format!("{method} requires an {header} header"),
            };
            let title = "Idempotency key missing";
            RpcError::new(codes::KEY_MISSING, "idempotency-key-missing", title, detail)
        }
        Err(detail) => {
            let title = "Idempotency key malformed";
            RpcError::new(codes::KEY_INVALID, "idempotency-key-invalid", title, detail)
        }
    };
    Message::Refuse(refused, id)
}

/// What a call means: its `method` and `params` in canonical JSON, without the key (found
/// at [`JsonRpc::key_pointer`]) and the per-attempt `params._meta` entries.
fn fingerprint(config: &Config, rpc: &JsonRpc, message: Value) -> Fingerprint {
    let mut message = match message {
        Value::Object(message) => message,
        // Admission guards objects only; anything else means what it says.
        other => {
            return FingerprintBuilder::new()
                .json_value("message", &other, &JsonSelection::All)
                .finish()
        }
    };
    let mut call = Map::new();
    call.insert(
        "method".into(),
        message.remove("method").unwrap_or_default(),
    );
    if let Some(params) = message.remove("params") {
        call.insert("params".into(), params);
    }
    let mut call = Value::Object(call);
    if let Some(pointer) = &rpc.key_pointer {
        remove_pointer(&mut call, pointer);
    }
    if let Some(Value::Object(meta)) = call.pointer_mut("/params/_meta") {
        for entry in &rpc.ignore_meta {
            meta.remove(entry);
        }
        if meta.is_empty() {
            if let Some(Value::Object(params)) = call.get_mut("params") {
                params.remove("_meta");
            }
        }
    }
    FingerprintBuilder::new()
        .text("protocol", "json-rpc")
        .json_value("call", &call, &config.json_selection)
        .finish()
}

/// The work that runs to its end once begun: the store's `begin`, then the service and
/// the storing of its answer when the key is ours.
pub(crate) async fn claim<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    mut inner: S,
    guarded: Guarded,
    req: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let Guarded {
        rpc,
        id,
        fingerprint,
        call,
    } = guarded;
    let config = &shared.config;
    let key = Some(&call.key);
    let lease = match shared.idem.begin(&id, fingerprint).await {
        Ok(Begin::Acquired(lease) | Begin::TookOver(lease)) => lease,
        Ok(Begin::Replay(replay)) => return Ok(replay_call(&shared, replay, &call)),
        Ok(Begin::InFlight { retry_after }) => {
            let retry_after = retry_after.min(config.in_flight_retry_after);
            let detail = "a call with this idempotency key is running; retry after \
                          data.retryAfterSeconds with the same key to receive its answer";
            let error = RpcError::new(
                codes::IN_FLIGHT,
                "request-in-flight",
                "Call in flight",
                detail,
            )
            .with_key(key)
            .with_retry_after(retry_after);
            return Ok(refuse(&shared, Outcome::InFlight, error, &call.id));
        }
        Ok(Begin::Expired { .. }) => {
            let detail = "the call with this idempotency key completed long ago, and its \
                          answer was kept only until its retention ended; the key cannot run \
                          again: use a new key for a new call";
            let error = RpcError::new(
                codes::KEY_EXPIRED,
                "key-expired",
                "Idempotency key expired",
                detail,
            )
            .with_key(key);
            return Ok(refuse(&shared, Outcome::Expired, error, &call.id));
        }
        Ok(Begin::Mismatch) => {
            let detail = "this idempotency key was already used for a call with other \
                          arguments; use a new key for a new call";
            let error = RpcError::new(
                codes::KEY_REUSED,
                "idempotency-key-reused",
                "Idempotency key reused",
                detail,
            )
            .with_key(key);
            return Ok(refuse(&shared, Outcome::Mismatch, error, &call.id));
        }
        Err(e) if e.is_retryable() && config.fail_open => {
            tracing::debug!(error = %e, "idempotency store unavailable; failing open");
            shared.observe(Outcome::Unguarded);
            return pass(inner, req).await;
        }
        Err(e) => {
            if e.is_retryable() {
                tracing::debug!(error = %e, "idempotency store unavailable before the call ran");
            } else {
                tracing::warn!(error = %e, "idempotency store failed before the call ran");
            }
            let (kind, title) = if e.is_retryable() {
                ("store-unavailable", "Idempotency store unavailable")
            } else {
                ("store-error", "Idempotency store error")
            };
            let detail = "the call did not run: its idempotency key cannot be checked right \
                          now; retry later with the same key";
            let mut error = RpcError::new(codes::STORE_UNAVAILABLE, kind, title, detail);
            if e.is_retryable() {
                error = error.with_retry_after(config.store_retry_after);
            }
            return Ok(refuse(&shared, Outcome::StoreError, error, &call.id));
        }
    };
    let retention = shared.idem.config().retention;
    let handle = LeaseHandle::new(lease, retention, shared.clone());
    // The service runs and its answer is read to the end (an SSE answer is a stream that
    // ends after its response event), under the lease: the time measured is the service's
    // and its answer's, as for an HTTP route's handler.
    let limit = config.max_response_body;
    let work = |req| async move {
        let (parts, body) = inner.call(req).await?.into_parts();
        if crate::join::is_sse(&parts.headers) {
            return Ok((parts, Read::Live(body)));
        }
        Ok::<_, S::Error>((parts, read(body, limit).await))
    };
    let (ran, lease) = run_leased(&shared, id, &handle, req, work).await;
    let (parts, read) = answered(&shared, &lease, ran).await?;
    Ok(store(&shared, &rpc, &handle, &lease, &call, parts, read).await)
}

/// How the service's answer was read.
enum Read<B> {
    /// Whole.
    Whole(Bytes),
    /// Over [`crate::Config::max_response_body`]: what was read, and the rest.
    Oversize(Bytes, Pin<Box<B>>),
    /// Broken off: what was read, and the error.
    Broken(Bytes, BoxError),
    /// A stream of events (Server-Sent Events), not read: it goes to the client as it
    /// comes, and is stored at its end.
    Live(B),
}

/// Reads `body` to its end, or until it is over `limit` bytes.
async fn read<B>(body: B, limit: usize) -> Read<B>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    let mut body = Box::pin(body);
    let mut kept = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Read::Whole(kept.freeze()),
            Some(Ok(frame)) => {
                // Trailers are no part of a JSON-RPC answer.
                if let Ok(data) = frame.into_data() {
                    kept.extend_from_slice(&data);
                    if kept.len() > limit {
                        return Read::Oversize(kept.freeze(), body);
                    }
                }
            }
            Some(Err(e)) => return Read::Broken(kept.freeze(), e.into()),
        }
    }
}

/// Stores a whole answer when it is a success (or a failure, with
/// [`JsonRpc::store_errors`]) under a 2xx status, else releases the key, and answers with
/// it; an answer that broke off or is too large is sent on unstored.
async fn store<B>(
    shared: &Arc<Shared>,
    rpc: &JsonRpc,
    handle: &LeaseHandle,
    lease: &Lease,
    call: &Call,
    mut parts: http::response::Parts,
    read: Read<B>,
) -> Response<ResponseBody>
where
    B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let config = &shared.config;
    let keep_in_flight = parts.extensions.get::<KeepInFlight>().copied();
    let bytes = match read {
        Read::Whole(bytes) => bytes,
        Read::Live(body) => {
            let answer = Response::from_parts(parts, body);
            return crate::respond::store_response(shared, handle, lease.clone(), answer).await;
        }
        Read::Oversize(head, rest) => {
            let limit = config.max_response_body;
            tracing::warn!(limit, "JSON-RPC answer too large to store; sent unstored");
            if config.unstored == Unstored::Release && keep_in_flight.is_none() {
                release(&shared.idem, lease, "an answer too large to store").await;
            }
            shared.observe(Outcome::NotStored);
            return Response::from_parts(parts, ResponseBody::new(Prefixed::new(head, rest)));
        }
        Read::Broken(head, e) => {
            if keep_in_flight.is_none() {
                release(&shared.idem, lease, "the answer's body failed").await;
            }
            shared.observe(Outcome::NotStored);
            // The client sees the same break it would have seen without the layer.
            let frames = [Ok(Frame::data(head)), Err(e)];
            let body = StreamBody::new(futures_util::stream::iter(frames));
            return Response::from_parts(parts, ResponseBody::new(body));
        }
    };
    if keep_in_flight == Some(KeepInFlight::Always) {
        shared.observe(Outcome::NotStored);
        return Response::from_parts(parts, ResponseBody::full(bytes));
    }
    let storable = storable(rpc, parts.status, &parts.headers, &bytes);
    let stored = config.to_stored(parts.status, &parts.headers, bytes.clone());
    let kept = keep_or_release(shared, handle, lease, stored, storable, "a failed call").await;
    // Not recorded: the call ran, and a retry with the same key gets the recorded answer.
    let (outcome, unrecorded) = match kept {
        Kept::Stored => (Outcome::Executed, None),
        Kept::Unstored => (Outcome::NotStored, None),
        Kept::Unrecorded => {
            let detail = "the call ran, but its answer could not be recorded yet; retry with \
                          the same idempotency key to receive it once it is recorded";
            let why = ("outcome-not-recorded", "Outcome not recorded", detail);
            (Outcome::StoreError, Some(why))
        }
        Kept::Superseded => {
            let detail = "the call ran, but its hold on the idempotency key ran out before its \
                          answer was recorded, and another attempt may hold the key now: retry \
                          with the same idempotency key to receive the key's recorded answer";
            let why = ("lease-lost", "Idempotency lease lost", detail);
            (Outcome::LeaseLost, Some(why))
        }
    };
    if let Some((kind, title, detail)) = unrecorded {
        let error = RpcError::new(codes::NOT_RECORDED, kind, title, detail)
            .with_key(Some(&call.key))
            .with_retry_after(config.store_retry_after);
        return refuse(shared, outcome, error, &call.id);
    }
    shared.observe(outcome);
    if matches!(kept, Kept::Stored) {
        insert_expires(&mut parts.headers, shared.idem.config().retention);
    }
    Response::from_parts(parts, ResponseBody::full(bytes))
}

/// Whether an answer is stored: a 2xx whose JSON-RPC response is a success, or any
/// JSON-RPC response with [`JsonRpc::store_errors`]. Any other status (a session the
/// server no longer knows, a transport error) says nothing final about the call.
pub(crate) fn storable(
    rpc: &JsonRpc,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
) -> bool {
    if !status.is_success() {
        return false;
    }
    let Some(response) = messages(headers, body).find_map(|(_, m)| response_of(m)) else {
        return false;
    };
    if rpc.store_errors {
        return true;
    }
    let value: Value = match serde_json::from_str(response.text) {
        Ok(value) => value,
        Err(_) => return false,
    };
    let tool_failed = value.pointer("/result/isError") == Some(&Value::Bool(true));
    value.get("error").is_none() && !tool_failed
}

/// Answers a retry with the stored answer, its response's `id` replaced by the retry's.
fn replay_call(shared: &Shared, replay: Replay, call: &Call) -> Response<ResponseBody> {
    let config = &shared.config;
    let stored = replay.completion.response;
    let Ok(status) = StatusCode::from_u16(stored.status) else {
        tracing::error!(
            status = stored.status,
            "stored answer has no valid HTTP status"
        );
        let detail = "the answer stored for this idempotency key is not an HTTP response";
        let error = RpcError::new(
            codes::STORED_INVALID,
            "stored-response-invalid",
            "Stored answer invalid",
            detail,
        );
        return refuse(shared, Outcome::StoreError, error, &call.id);
    };
    let mut headers = HeaderMap::new();
    for (name, value) in stored.headers {
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) else {
            continue;
        };
        // Checked again here: the allowlist may have shrunk since the answer was stored.
        if config.replays(&name) {
            headers.append(name, value);
        }
    }
    let body = with_id(&headers, &stored.body, &call.id);
    let mut response = Response::new(ResponseBody::full(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    let headers = response.headers_mut();
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    insert_expires(headers, replay.expires_in);
    shared.observe(Outcome::Replayed);
    response
}

/// `body` with the `id` of its JSON-RPC response (the whole body, or the `data:` line of an
/// SSE event that carries it) replaced by `id`; every other byte as it was.
fn with_id(headers: &HeaderMap, body: &Bytes, id: &Value) -> Bytes {
    let Some((start, response)) = messages(headers, body).find_map(|(at, m)| {
        let response = response_of(m)?;
        Some((at, response))
    }) else {
        return body.clone();
    };
    let Some((from, to)) = response.id else {
        return body.clone();
    };
    let id = id.to_string();
    let mut out = BytesMut::with_capacity(body.len() + id.len());
    out.extend_from_slice(&body[..start + from]);
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(&body[start + to..]);
    out.freeze()
}

/// The JSON-RPC messages of an answer, each with its offset in `body`: the whole body, or,
/// for `text/event-stream`, each event's `data:` line (a JSON message is one line, as every
/// SDK writes it; data split over several lines is not looked into). A body that does not
/// open as JSON is read as an event stream too, so that a replay whose `Content-Type` was
/// not kept ([`crate::Config::replay_headers`]) is still found.
fn messages<'a>(headers: &HeaderMap, body: &'a [u8]) -> impl Iterator<Item = (usize, &'a str)> {
    let declared = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("text/event-stream"));
    let opens_as_json = body
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| matches!(b, b'{' | b'['));
    let sse = declared || !opens_as_json;
    let whole = (!declared)
        .then(|| std::str::from_utf8(body).ok().map(|text| (0, text)))
        .flatten();
    let mut lines = Vec::new();
    if sse {
        let mut at = 0;
        for line in body.split(|&b| b == b'\n') {
            let start = at;
            at += line.len() + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            // One leading space belongs to the field syntax, not to the data.
            let (skip, data) = match data.strip_prefix(b" ") {
                Some(data) => (6, data),
                None => (5, data),
            };
            if let Ok(text) = std::str::from_utf8(data) {
                lines.push((start + skip, text));
            }
        }
    }
    whole.into_iter().chain(lines)
}

/// A JSON-RPC response found in a message.
struct Found<'a> {
    /// The message.
    text: &'a str,
    /// Where its `id`'s value is in `text`.
    id: Option<(usize, usize)>,
}

/// `text` read as a JSON-RPC response (an object with `result` or `error`, and no
/// `method`), with where its `id` is.
fn response_of(text: &str) -> Option<Found<'_>> {
    let fields: HashMap<String, &RawValue> = serde_json::from_str(text).ok()?;
    if fields.contains_key("method")
        || !(fields.contains_key("result") || fields.contains_key("error"))
    {
        return None;
    }
    // The raw value borrows from `text`: its offset there is where the id is written.
    let id = fields.get("id").map(|raw| {
        let from = raw.get().as_ptr() as usize - text.as_ptr() as usize;
        (from, from + raw.get().len())
    });
    Some(Found { text, id })
}

/// One of the layer's JSON-RPC errors.
#[derive(Debug)]
struct RpcError {
    code: i64,
    kind: &'static str,
    title: &'static str,
    detail: String,
    key: Option<String>,
    retry_after: Option<Duration>,
}

impl RpcError {
    fn new(code: i64, kind: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Self {
            code,
            kind,
            title,
            detail: detail.into(),
            key: None,
            retry_after: None,
        }
    }

    fn with_key(mut self, key: Option<&Key>) -> Self {
        self.key = key.map(|k| k.as_str().to_owned());
        self
    }

    fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }
}

/// Reports `outcome` and answers `id` with `error`: HTTP 200, a JSON-RPC error response,
/// and `Retry-After` when the error carries a delay.
fn refuse(
    shared: &Shared,
    outcome: Outcome,
    error: RpcError,
    id: &Value,
) -> Response<ResponseBody> {
    shared.observe(outcome);
    let mut data = json!({
        "type": format!("urn:idem:problem:{}", error.kind),
        "detail": error.detail,
    });
    if let Some(key) = &error.key {
        data["idempotencyKey"] = Value::from(key.as_str());
    }
    let retry_secs = error.retry_after.map(|after| {
        // Whole seconds, rounded up and at least 1, as the header allows.
        (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1)
    });
    if let Some(secs) = retry_secs {
        data["retryAfterSeconds"] = Value::from(secs);
    }
    let doc = json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {"code": error.code, "message": error.title, "data": data},
    });
    let mut response = Response::new(ResponseBody::full(doc.to_string()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(secs) = retry_secs {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers
    }

    #[test]
    fn the_id_is_replaced_and_every_other_byte_kept() {
        let json = Bytes::from_static(br#"{"result":{"n":1},"jsonrpc":"2.0", "id" : 7 }"#);
        let out = with_id(&HeaderMap::new(), &json, &json!("retry-2"));
        assert_eq!(
            &out[..],
            br#"{"result":{"n":1},"jsonrpc":"2.0", "id" : "retry-2" }"#
        );

        let stream = Bytes::from_static(
            b"event: message\r\nid: ev-1\r\ndata: {\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\n\
              event: message\r\ndata: {\"result\":{},\"jsonrpc\":\"2.0\",\"id\":\"a\"}\r\n\r\n",
        );
        let out = with_id(&sse(), &stream, &json!(42));
        assert_eq!(
            &out[..],
            &b"event: message\r\nid: ev-1\r\ndata: {\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\n\
               event: message\r\ndata: {\"result\":{},\"jsonrpc\":\"2.0\",\"id\":42}\r\n\r\n"[..]
        );
        // Without the space after `data:`.
        let tight = Bytes::from_static(b"data:{\"error\":{\"code\":1},\"id\":1}\n\n");
        assert_eq!(
            &with_id(&sse(), &tight, &json!(2))[..],
            b"data:{\"error\":{\"code\":1},\"id\":2}\n\n"
        );
        // An event stream whose Content-Type was not kept is still read as one.
        let bare = Bytes::from_static(b"event: message\ndata: {\"result\":{},\"id\":1}\n\n");
        assert_eq!(
            &with_id(&HeaderMap::new(), &bare, &json!(5))[..],
            b"event: message\ndata: {\"result\":{},\"id\":5}\n\n"
        );
        // Nothing to rewrite: as it was.
        let other = Bytes::from_static(b"not json");
        assert_eq!(with_id(&HeaderMap::new(), &other, &json!(1)), other);
    }

    #[test]
    fn failures_are_stored_only_when_asked() {
        let rpc = JsonRpc::new(["tools/call"]);
        let ok = StatusCode::OK;
        let h = HeaderMap::new();
        let stored = |rpc: &JsonRpc, body: &str| storable(rpc, ok, &h, body.as_bytes());
        assert!(stored(
            &rpc,
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#
        ));
        assert!(!stored(
            &rpc,
            r#"{"jsonrpc":"2.0","id":1,"result":{"isError":true}}"#
        ));
        assert!(!stored(
            &rpc,
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602}}"#
        ));
        assert!(!stored(&rpc, r#"{"jsonrpc":"2.0","method":"x"}"#));
        let all = rpc.clone().with_store_errors(true);
        assert!(stored(
            &all,
            r#"{"jsonrpc":"2.0","id":1,"result":{"isError":true}}"#
        ));
        assert!(stored(
            &all,
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602}}"#
        ));
        let body = br#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
        assert!(!storable(&rpc, StatusCode::NOT_FOUND, &h, body));
    }

    #[test]
    fn the_fingerprint_is_what_the_call_means() {
        let config = Config::default();
        let rpc = JsonRpc::new(["tools/call"]);
        let fp = |text: &str| fingerprint(&config, &rpc, serde_json::from_str(text).unwrap());
        let base = fp(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5},"_meta":{"idempotencyKey":"k1","progressToken":3}}}"#,
        );
        // Another id, key and progress token, the keys in another order, no `_meta` left.
        assert_eq!(
            base,
            fp(
                r#"{"params":{"arguments":{"amount":5.0},"name":"charge"},"method":"tools/call","id":"x","jsonrpc":"2.0"}"#
            )
        );
        assert_ne!(
            base,
            fp(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":6}}}"#
            )
        );
        // Another `_meta` entry counts.
        assert_ne!(
            base,
            fp(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5},"_meta":{"trace":1}}}"#
            )
        );
    }
}
