//! [`IdempotencyService`]: the request path of the layer.

use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use idem_core::telemetry::KeyHash;
use idem_core::{
    Begin, BoxError, Error, Fingerprint, FingerprintBuilder, Idem, Key, Lease, Record, RecordId,
    RecordState, Replay, Scope,
};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_service::Service;
use tracing::field::Empty;
use tracing::Instrument;

use crate::body::{Broken, Buffered, Prefixed, RequestBody, ResponseBody};
use crate::config::{Config, MissingKey, Unstored};
use crate::error::{self, Problem};
use crate::future::{CatchUnwind, Panic, ResponseFuture};
use crate::layer::Shared;
use crate::outcome::{IdempotencyInfo, Outcome};

/// The header set on every replayed response.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The header carrying, on a replayed response, the HTTP date after which the stored
/// response is forgotten (and the key may be used again).
pub const EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// The service made by [`crate::IdempotencyLayer`]: it guards the configured methods of
/// `S` and passes every other request through untouched.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // `self.inner` is the instance `poll_ready` drove to readiness: it serves this
        // request, and a fresh clone (not yet ready) stays behind for the next `poll_ready`.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = if self.shared.config.methods.contains(req.method()) {
            // Stable field names for log searches; the key only ever as its hash.
            tracing::info_span!(
                "idem.http",
                method = %req.method(),
                path = req.uri().path(),
                scope = Empty,
                key_hash = Empty,
                attempt = Empty,
                outcome = Empty,
                status = Empty,
            )
        } else {
            tracing::Span::none()
        };
        let shared = self.shared.clone();
        ResponseFuture::new(
            async move {
                let out = handle(shared, inner, req).await;
                if let Ok(response) = &out {
                    tracing::Span::current().record("status", response.status().as_u16());
                }
                out
            }
            .instrument(span),
        )
    }
}

/// One request, start to end.
async fn handle<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let config = &shared.config;
    if !config.methods.contains(req.method()) {
        return pass(inner, req.map(Either::Right)).await;
    }
    let (parts, body) = req.into_parts();

    let key = match read_key(&parts.headers, &config.header) {
        Ok(Some(key)) => key,
        Ok(None) if config.missing_key == MissingKey::PassThrough => {
            shared.observe(Outcome::Unguarded);
            return pass(inner, Request::from_parts(parts, Either::Right(body))).await;
        }
        Ok(None) => {
            let detail = format!(
                "{} {} requires an {} header",
                parts.method,
                parts.uri.path(),
                config.header
            );
            return Ok(refuse(
                &shared,
                Outcome::Rejected,
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    error::KIND_KEY_MISSING,
                    "Idempotency key missing",
                    detail,
                ),
            ));
        }
        Err(detail) => {
            return Ok(refuse(
                &shared,
                Outcome::Rejected,
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    error::KIND_KEY_INVALID,
                    "Idempotency key malformed",
                    detail,
                ),
            ));
        }
    };

    let bytes = match read_body(body, &parts.headers, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err(problem) => return Ok(refuse(&shared, Outcome::Rejected, problem)),
    };

    let scope = shared
        .scope
        .as_ref()
        .and_then(|scope| scope(&parts))
        .unwrap_or_else(Scope::global);
    let id = RecordId::new(scope, key);
    let span = tracing::Span::current();
    span.record("scope", tracing::field::display(id.scope()));
    span.record("key_hash", tracing::field::display(KeyHash::of(&id)));
    let fingerprint = fingerprint(config, &parts, &bytes);

    let lease = match shared.idem.begin(&id, fingerprint).await {
        Ok(Begin::Acquired(lease) | Begin::TookOver(lease)) => lease,
        Ok(Begin::Replay(replay)) => {
            shared.observe(Outcome::Replayed);
            return Ok(replay_response(config, replay));
        }
        Ok(Begin::InFlight { retry_after }) => {
            let problem = Problem::new(
                StatusCode::CONFLICT,
                error::KIND_IN_FLIGHT,
                "Request in flight",
                "a request with this idempotency key is being processed; retry after the \
                 Retry-After delay to receive its response",
            )
            .retry_after(retry_after);
            return Ok(refuse(&shared, Outcome::InFlight, problem));
        }
        Ok(Begin::Mismatch) => {
            let problem = Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                error::KIND_MISMATCH,
                "Idempotency key reused",
                "this idempotency key was already used with a different request (method, \
                 path, body or fingerprinted headers); use a new key for a new request",
            );
            return Ok(refuse(&shared, Outcome::Mismatch, problem));
        }
        Err(e) if e.is_retryable() && config.fail_open => {
            tracing::debug!(error = %e, "idempotency store unavailable; failing open");
            shared.observe(Outcome::Unguarded);
            let req = Request::from_parts(parts, Either::Left(Full::new(bytes)));
            return pass(inner, req).await;
        }
        Err(e) => {
            return Ok(refuse(
                &shared,
                Outcome::StoreError,
                store_problem(config, &e),
            ))
        }
    };

    let mut req = Request::from_parts(parts, Either::Left(Full::new(bytes)));
    req.extensions_mut().insert(IdempotencyInfo {
        id,
        attempt: lease.attempt(),
    });
    span.record("attempt", lease.attempt());
    let started = Instant::now();
    let (lease, output) = run(&shared, &mut inner, req, lease).await;
    metrics::histogram!("idem_http_handler_duration_seconds")
        .record(started.elapsed().as_secs_f64());

    match output {
        Ok(Ok(response)) => Ok(settle(&shared, lease, response).await),
        Ok(Err(e)) => {
            release(&shared.idem, &lease, "the service returned an error").await;
            shared.observe(Outcome::NotStored);
            Err(e)
        }
        Err(panic) => {
            release(&shared.idem, &lease, "the service panicked").await;
            shared.observe(Outcome::NotStored);
            resume_unwind(panic)
        }
    }
}

/// Hands a request on without idempotency.
async fn pass<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let response = inner.call(req).await?;
    Ok(response.map(ResponseBody::new))
}

fn refuse(shared: &Shared, outcome: Outcome, problem: Problem) -> Response<ResponseBody> {
    shared.observe(outcome);
    problem.into_response()
}

fn store_problem(config: &Config, e: &Error) -> Problem {
    // An outage is logged once, where it starts and ends (idem_core::telemetry): per
    // request it is only a debug line. Anything else is worth a warning each time.
    if e.is_retryable() {
        tracing::debug!(error = %e, "idempotency store unavailable before the handler ran");
    } else {
        tracing::warn!(error = %e, "idempotency store failed before the handler ran");
    }
    if e.is_retryable() {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            error::KIND_STORE_UNAVAILABLE,
            "Idempotency store unavailable",
            "the request was not processed: its idempotency key cannot be checked right now; \
             retry later with the same key",
        )
        .retry_after(config.store_retry_after)
    } else {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            error::KIND_STORE_ERROR,
            "Idempotency store error",
            "the request was not processed: the idempotency store failed",
        )
    }
}

/// Reads the key header: `Ok(None)` when absent, `Err(why)` when malformed. A Structured
/// Field string (`"..."`, as in the IETF draft) and a bare token are both accepted.
fn read_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Key>, String> {
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

/// Buffers the request body up to `limit` bytes.
async fn read_body<B>(body: B, headers: &HeaderMap, limit: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            error::KIND_BODY_TOO_LARGE,
            "Request body too large",
            format!("requests with an idempotency key may carry at most {limit} bytes"),
        )
    };
    // A declared length over the limit is refused before a byte is read.
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            error::KIND_BODY_UNREADABLE,
            "Request body unreadable",
            format!("the request body could not be read: {e}"),
        )),
    }
}

/// The fingerprint: method, path with query, the configured headers, and the body (in
/// canonical form when it is JSON).
fn fingerprint(config: &Config, parts: &Parts, body: &[u8]) -> Fingerprint {
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

/// Builds the replay of a stored response: its status, body and allowed headers, plus the
/// replay headers.
fn replay_response(config: &Config, replay: Replay) -> Response<ResponseBody> {
    let stored = replay.completion.response;
    let Ok(status) = StatusCode::from_u16(stored.status) else {
        tracing::error!(
            status = stored.status,
            "stored response has no valid HTTP status"
        );
        return Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            error::KIND_BAD_RECORD,
            "Stored response invalid",
            "the response stored for this idempotency key is not an HTTP response",
        )
        .into_response();
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
    let expires = SystemTime::now() + replay.expires_in;
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(expires)) {
        headers.insert(EXPIRES, value);
    }
    response
}

/// Runs the service under the lease, renewing the lease meanwhile. Returns the latest
/// lease and the service's answer, or its panic.
async fn run<S, ReqBody>(
    shared: &Shared,
    inner: &mut S,
    req: Request<RequestBody<ReqBody>>,
    lease: Lease,
) -> (Lease, Result<Result<S::Response, S::Error>, Panic>)
where
    S: Service<Request<RequestBody<ReqBody>>>,
{
    // `call` itself may panic, before any future exists.
    let future = match catch_unwind(AssertUnwindSafe(|| inner.call(req))) {
        Ok(future) => future,
        Err(panic) => return (lease, Err(panic)),
    };
    let mut work = CatchUnwind::new(future);
    if !shared.config.heartbeat {
        return (lease, work.await);
    }
    let current = Mutex::new(lease);
    let output = tokio::select! {
        // The work finishing wins over a due heartbeat.
        biased;
        out = &mut work => out,
        // The heartbeat only ends when the lease is lost; the work then runs to its end
        // unrenewed, and storing its response will find the lease lost.
        () = heartbeat(&shared.idem, &current) => (&mut work).await,
    };
    let lease = current.into_inner().unwrap_or_else(PoisonError::into_inner);
    (lease, output)
}

/// Renews the lease every third of its length, until it is found lost.
async fn heartbeat(idem: &Idem, current: &Mutex<Lease>) {
    let every = (idem.config().lease / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(every).await;
        let lease = current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match idem.extend(&lease).await {
            Ok(renewed) => *current.lock().unwrap_or_else(PoisonError::into_inner) = renewed,
            Err(Error::LeaseLost) => {
                tracing::warn!("lease lost while the handler ran");
                return;
            }
            // The store may be back by the next beat; the lease still runs meanwhile.
            Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
        }
    }
}

/// Releases the key after a run whose response is not stored. A failure is logged: the key
/// then stays held until its lease expires, which refuses retries with 409 meanwhile and
/// never runs the work twice at once.
async fn release(idem: &Idem, lease: &Lease, why: &str) {
    if let Err(e) = idem.release(lease).await {
        tracing::warn!(error = %e, "could not release the key after {why}");
    }
}

/// Reads the service's response, stores it when it should be, and returns what to send.
async fn settle<ResBody>(
    shared: &Shared,
    lease: Lease,
    response: Response<ResBody>,
) -> Response<ResponseBody>
where
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let config = &shared.config;
    let (parts, body) = response.into_parts();
    let mut body = Box::pin(body);
    let limit = config.max_response_body;

    let mut buf = BytesMut::new();
    let mut trailers = None;
    let oversize = body.size_hint().lower() > limit as u64
        || loop {
            let next = body
                .frame()
                .await
                .map(|r| r.map_err(Into::<BoxError>::into));
            match next {
                None => break false,
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        buf.extend_from_slice(&data);
                        if buf.len() > limit {
                            break true;
                        }
                    }
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            trailers = Some(t);
                        }
                    }
                },
                Some(Err(e)) => {
                    // The body broke off: nothing complete to store. The client sees the same
                    // break it would have seen without the layer.
                    release(&shared.idem, &lease, "the response body failed").await;
                    shared.observe(Outcome::NotStored);
                    let body = Broken::new(buf.freeze(), e);
                    return Response::from_parts(parts, ResponseBody::new(body));
                }
            }
        };

    if oversize {
        tracing::warn!(limit, "response too large to store; sent unstored");
        if config.unstored == Unstored::Release {
            release(&shared.idem, &lease, "a response too large to store").await;
        }
        shared.observe(Outcome::NotStored);
        let body = Prefixed::new(buf.freeze(), body);
        return Response::from_parts(parts, ResponseBody::new(body));
    }

    let bytes = buf.freeze();
    let send = |parts, bytes| {
        Response::from_parts(parts, ResponseBody::new(Buffered::new(bytes, trailers)))
    };
    if !(config.store_status)(parts.status) {
        release(
            &shared.idem,
            &lease,
            "a response whose status is not stored",
        )
        .await;
        shared.observe(Outcome::NotStored);
        return send(parts, bytes);
    }

    let mut stored = idem_core::Response::new(parts.status.as_u16(), bytes.clone());
    for (name, value) in &parts.headers {
        if config.replays(name) {
            stored = stored.with_header(name.as_str(), value.as_bytes());
        }
    }
    match shared.idem.complete(&lease, stored.clone()).await {
        Ok(()) => {
            shared.observe(Outcome::Executed);
            send(parts, bytes)
        }
        Err(Error::LeaseLost) => {
            // Another request took the key over after this lease expired (or an operator
            // evicted it): nothing of ours can be stored, and this response is the truth
            // for this request.
            tracing::warn!("lease lost before the response was stored");
            shared.observe(Outcome::NotStored);
            send(parts, bytes)
        }
        Err(e) => {
            tracing::warn!(error = %e, "storing the response failed; retrying");
            if store_later(shared, lease, stored).await {
                shared.observe(Outcome::Executed);
                send(parts, bytes)
            } else {
                shared.observe(Outcome::StoreError);
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    error::KIND_NOT_RECORDED,
                    "Outcome not recorded",
                    "the request was processed, but its response could not be recorded yet; \
                     retry with the same idempotency key to receive it once it is recorded",
                )
                .retry_after(config.store_retry_after)
                .into_response()
            }
        }
    }
}

/// Keeps trying to store `response` in a task of its own, and waits up to
/// [`Config::store_response_within`] for it to succeed. The task goes on after that wait,
/// for as long as the lease was granted (the record stays in progress, so retries get 409
/// meanwhile, not a second run), so that a retry after the store recovers gets the replay.
async fn store_later(shared: &Shared, lease: Lease, response: idem_core::Response) -> bool {
    let idem = shared.idem.clone();
    let within = shared.config.store_response_within;
    let (done, stored) = oneshot::channel();
    tokio::spawn(async move {
        let give_up = Instant::now() + idem.config().lease.max(within);
        let mut pause = Duration::from_millis(20);
        let outcome = loop {
            tokio::time::sleep(pause).await;
            match idem.complete(&lease, response.clone()).await {
                Ok(()) => break true,
                // Either a takeover (the key is another request's now, and nothing can be
                // stored), or an earlier write of ours landed though its answer was lost.
                Err(Error::LeaseLost) => break holds(&idem, &lease, &response).await,
                Err(e) if Instant::now() >= give_up => {
                    tracing::error!(error = %e,
                        "gave up storing a response; a retry after the lease expires runs the handler again");
                    break false;
                }
                Err(_) => pause = (pause * 2).min(Duration::from_secs(1)),
            }
        };
        // The waiter may have given up already; the record is what counts.
        let _ = done.send(outcome);
    }
    .instrument(tracing::Span::current()));
    matches!(tokio::time::timeout(within, stored).await, Ok(Ok(true)))
}

/// Whether the key's record is completed with `response`: how a write whose answer was
/// lost (a timeout after the store applied it) is told from a takeover.
async fn holds(idem: &Idem, lease: &Lease, response: &idem_core::Response) -> bool {
    match idem.store().get(lease.id()).await {
        Ok(Some(Record {
            state: RecordState::Completed(completion),
            ..
        })) => completion.response == *response,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
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
