//! [`IdempotencyService`]: the request path of the layer.

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full};
use idem_core::telemetry::KeyHash;
use idem_core::{
    Begin, BoxError, Error, Fingerprint, FingerprintBuilder, Idem, Key, Lease, OnLost, Record,
    RecordId, RecordState, Replay, Scope,
};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_service::Service;
use tracing::field::Empty;
use tracing::Instrument;

use crate::body::{Broken, Chunks, Prefixed, RequestBody, ResponseBody};
use crate::config::{Anonymous, Config, MissingKey, Unstored};
use crate::error::{self, Problem};
use crate::future::{CatchUnwind, Detach, Panic, ResponseFuture};
use crate::handle::LeaseHandle;
use crate::layer::Shared;
use crate::outcome::{IdempotencyInfo, KeepInFlight, Outcome};

/// The header set on every replayed response.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The header carrying, on a stored response (the first one and every replay), the HTTP
/// date after which it is forgotten (and the key may be used again).
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
    ReqBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
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
        if !self.shared.config.methods.contains(req.method()) {
            // Not guarded: handed on as it came, without the guarded path's state.
            return ResponseFuture::new(pass(inner, req.map(Either::Right)), tracing::Span::none());
        }
        // Stable field names for log searches; the key only ever as its hash.
        let span = tracing::info_span!(
            "idem.http",
            method = %req.method(),
            path = req.uri().path(),
            scope = Empty,
            key_hash = Empty,
            attempt = Empty,
            outcome = Empty,
            status = Empty,
        );
        ResponseFuture::new(handle(self.shared.clone(), inner, req), span)
    }
}

/// One guarded request, start to end, in four named steps: **admit** (key, principal,
/// body, fingerprint), then **decide** (the store's `begin`), **run** (the handler, its
/// lease renewed) and **store** (its outcome).
///
/// Everything from `begin` on outlives the response future: it is polled in place while
/// the response is awaited, and moved to a task of its own if the response future is
/// dropped first ([`Detach`]). A client that goes away drops the response future, not the
/// work. Once a lease is taken, the handler and the storing of its outcome run to their
/// end, so a retry gets the stored response rather than a lease held for nothing.
///
/// The steps are written inline rather than as nested `async fn`s, and the rare paths are
/// boxed: a nested future is built, then moved into its caller's state, a copy of its whole
/// size on every request, and the state of a rare path would make every request's larger.
// An `async fn` would keep a second copy of its arguments in its state: see the body.
#[allow(clippy::manual_async_fn)]
fn handle<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    inner: S,
    req: Request<ReqBody>,
) -> impl Future<Output = Result<Response<ResponseBody>, S::Error>> + Send + 'static
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    // An `async` block rather than an `async fn`: the latter keeps a copy of each argument
    // in its state besides the one it works on.
    async move {
        // Step 1, admit: the key, the principal, the body within its limit, the
        // fingerprint. Nothing is claimed yet, so a client that goes away here leaves
        // nothing behind.
        let config = &shared.config;
        let (parts, body) = req.into_parts();
        let id = match admit(&shared, &parts) {
            Admission::Guard(id) => id,
            Admission::Pass => {
                let req = Request::from_parts(parts, Either::Right(body));
                return Box::pin(pass(inner, req)).await;
            }
            Admission::Refuse(response) => return Ok(response),
        };
        let bytes = match read_body(body, &parts.headers, config.max_request_body).await {
            Ok(bytes) => bytes,
            Err(problem) => return Ok(refuse(&shared, Outcome::Rejected, problem)),
        };
        let span = tracing::Span::current();
        // Hashing the key costs a SHA-256: only for a span that is recorded.
        if !span.is_disabled() {
            span.record("scope", tracing::field::display(id.scope()));
            span.record("key_hash", tracing::field::display(KeyHash::of(&id)));
        }
        let fingerprint = fingerprint(config, &parts, &bytes);
        let req = Request::from_parts(parts, Either::Left(Full::new(bytes)));
        // From here the work runs to its end even if this future is dropped (see `Detach`).
        Detach::new(guard(shared, inner, id, fingerprint, req)).await
    }
}

/// What admission decided from the request's head.
enum Admission {
    /// Guard the request under this record.
    Guard(RecordId),
    /// Hand it on unguarded (no key, and keys are optional).
    Pass,
    /// Refuse it with this answer.
    Refuse(Response<ResponseBody>),
}

/// Step 1, admit, from the request's head: reads the key and finds the principal.
fn admit(shared: &Shared, parts: &Parts) -> Admission {
    let config = &shared.config;
    let rejected = |problem| Admission::Refuse(refuse(shared, Outcome::Rejected, problem));

    let key = match read_key(&parts.headers, &config.header) {
        Ok(Some(key)) => key,
        Ok(None) if config.missing_key == MissingKey::PassThrough => {
            shared.observe(Outcome::Unguarded);
            return Admission::Pass;
        }
        Ok(None) => {
            let detail = format!(
                "{} {} requires an {} header",
                parts.method,
                parts.uri.path(),
                config.header
            );
            return rejected(Problem::new(
                StatusCode::BAD_REQUEST,
                error::KIND_KEY_MISSING,
                "Idempotency key missing",
                detail,
            ));
        }
        Err(detail) => {
            return rejected(Problem::new(
                StatusCode::BAD_REQUEST,
                error::KIND_KEY_INVALID,
                "Idempotency key malformed",
                detail,
            ));
        }
    };

    let scope = match shared.scope.as_ref().and_then(|scope| scope(parts)) {
        Some(scope) => scope,
        None if config.anonymous == Anonymous::Shared => Scope::global(),
        None => {
            return rejected(
                Problem::new(
                    StatusCode::UNAUTHORIZED,
                    error::KIND_NO_PRINCIPAL,
                    "Caller unknown",
                    "idempotency keys are kept per caller, and this request names none: \
                 authenticate, then retry with the same key",
                )
                .challenge(config.challenge.clone()),
            );
        }
    };
    Admission::Guard(RecordId::new(scope, key))
}

/// Steps 2 to 4 as work that outlives the response future: decide, run, store.
#[allow(clippy::manual_async_fn)] // As `handle`.
fn guard<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    mut inner: S,
    id: RecordId,
    fingerprint: Fingerprint,
    mut req: Request<RequestBody<ReqBody>>,
) -> impl Future<Output = Result<Response<ResponseBody>, S::Error>>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    // An `async` block, as in `handle`.
    async move {
        // Step 2, decide: claims the key, or answers from the store.
        let begun = shared.idem.begin(&id, fingerprint).await;
        let lease = match decide(&shared, begun) {
            Decision::Run(lease) => lease,
            Decision::Answer(response) => return Ok(response),
            // Rare: boxed, so that its state is not part of every request's.
            Decision::FailOpen => return Box::pin(pass(inner, req)).await,
        };

        // Step 3, run: the service under the lease, renewed by the engine's heartbeat
        // ([`Idem::run_with_heartbeat`] with [`OnLost::Finish`]: a handler whose lease is lost
        // still runs to its end, and storing its outcome then finds the lease lost).
        let attempt = lease.attempt();
        // The handle keeps the lease as granted, and the layer uses that one too (a renewal
        // below is kept in `renewed`); `IdempotencyInfo` takes the id admission made. Both
        // moved: no copy of the key for a handler that answers at its first poll (one
        // that waits lends the heartbeat a clone of the lease).
        let retention = shared.idem.config().retention;
        // The handle takes this work's share of the layer's state (one reference count
        // less to bump on a line every request of every thread touches); used from it below.
        let handle = LeaseHandle::new(lease, retention, shared);
        let shared = handle.shared();
        let mut renewed: Option<Lease> = None;
        req.extensions_mut().insert(IdempotencyInfo { id, attempt });
        req.extensions_mut().insert(handle.clone());
        tracing::Span::current().record("attempt", attempt);
        let started = Instant::now();
        // `call` itself may panic, before any future exists. The future is boxed (in
        // `CatchUnwind`) before the `match`: a `match` keeps its scrutinee until its end,
        // across the awaits of its arms, and this work's state would hold it there twice.
        let called = catch_unwind(AssertUnwindSafe(|| inner.call(req))).map(CatchUnwind::new);
        let ran = match called {
            Err(panic) => Ran::Panicked(panic),
            // Dropped at the end of this arm, before the outcome is stored.
            Ok(mut work) => {
                // Most handlers answer on their first poll: then there is no heartbeat to
                // start. Otherwise the heartbeat drives the rest (`run_with_heartbeat`
                // starts its timer only at its first poll of the work, so nothing is lost
                // by polling once before it).
                let first = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut work).poll(cx)));
                let polled = first.await;
                let output = match polled {
                    Poll::Ready(output) => output,
                    Poll::Pending if shared.config.heartbeat => {
                        let granted = handle.lease().clone();
                        let beating =
                            shared
                                .idem
                                .run_with_heartbeat(granted, OnLost::Finish, &mut work);
                        match beating.await {
                            Ok((latest, output)) => {
                                renewed = Some(latest);
                                output
                            }
                            // `Finish` never gives the work up; were it to, the work still
                            // ends here.
                            Err(_) => (&mut work).await,
                        }
                    }
                    Poll::Pending => (&mut work).await,
                };
                metrics::histogram!("idem_http_handler_duration_seconds")
                    .record(started.elapsed().as_secs_f64());
                match output {
                    Ok(Ok(response)) => Ran::Answered(response),
                    Ok(Err(e)) => Ran::Failed(e),
                    Err(panic) => Ran::Panicked(panic),
                }
            }
        };

        // Step 4, store: the handler's response stored (or found stored by the handler) and
        // sent; after an error or a panic, the key released.
        let lease = renewed.as_ref().unwrap_or(handle.lease());
        let response = match ran {
            Ran::Answered(response) => response,
            Ran::Failed(e) => {
                release(&shared.idem, lease, "the service returned an error").await;
                shared.observe(Outcome::NotStored);
                return Err(e);
            }
            Ran::Panicked(panic) => {
                release(&shared.idem, lease, "the service panicked").await;
                shared.observe(Outcome::NotStored);
                resume_unwind(panic)
            }
        };
        let config = &shared.config;
        let (mut parts, body) = response.into_parts();
        let keep_in_flight = parts.extensions.get::<KeepInFlight>().copied();
        if keep_in_flight == Some(KeepInFlight::Always) {
            // The outcome is unknown: neither stored nor released, the key stays in flight
            // until its lease ends.
            shared.observe(Outcome::NotStored);
            return Ok(Response::from_parts(parts, ResponseBody::new(body)));
        }
        Ok(match buffer(body, config.max_response_body).await {
            Buffer::Broken(read, e) => {
                // The body broke off: nothing complete to store. The client sees the same
                // break it would have seen without the layer.
                if keep_in_flight.is_none() {
                    release(&shared.idem, lease, "the response body failed").await;
                }
                shared.observe(Outcome::NotStored);
                Response::from_parts(parts, ResponseBody::new(Broken::new(read, e)))
            }
            Buffer::Oversize(read, rest) => {
                let limit = config.max_response_body;
                tracing::warn!(limit, "response too large to store; sent unstored");
                if config.unstored == Unstored::Release {
                    release(&shared.idem, lease, "a response too large to store").await;
                }
                shared.observe(Outcome::NotStored);
                Response::from_parts(parts, ResponseBody::new(Prefixed::new(read, rest)))
            }
            Buffer::Whole(bytes, trailers) => {
                match keep(shared, lease, &handle, &parts, bytes.clone()).await {
                    // The first response advertises its expiry too, as replays do.
                    Kept::Stored => {
                        insert_expires(&mut parts.headers, shared.idem.config().retention)
                    }
                    Kept::Unstored => {}
                    Kept::Unrecorded => return Ok(not_recorded(config).into_response()),
                }
                Response::from_parts(parts, ResponseBody::buffered(bytes, trailers))
            }
        })
    }
}

/// What the store's `begin` decided.
enum Decision {
    /// Run the handler under this lease.
    Run(Lease),
    /// Answer without running it: a replay or a refusal.
    Answer(Response<ResponseBody>),
    /// The store is unavailable and the layer fails open: run it unguarded.
    FailOpen,
}

/// Step 2, decide: what the store's `begin` answered means for the request.
fn decide(shared: &Shared, begun: Result<Begin, Error>) -> Decision {
    let config = &shared.config;
    let answer = |outcome, problem| Decision::Answer(refuse(shared, outcome, problem));
    match begun {
        Ok(Begin::Acquired(lease) | Begin::TookOver(lease)) => Decision::Run(lease),
        Ok(Begin::Replay(replay)) => {
            shared.observe(Outcome::Replayed);
            Decision::Answer(replay_response(config, replay))
        }
        Ok(Begin::InFlight { retry_after }) => {
            let problem = Problem::new(
                StatusCode::CONFLICT,
                error::KIND_IN_FLIGHT,
                "Request in flight",
                "a request with this idempotency key is being processed; retry after the \
                 Retry-After delay to receive its response",
            )
            .retry_after(retry_after.min(config.in_flight_retry_after));
            answer(Outcome::InFlight, problem)
        }
        Ok(Begin::Mismatch) => {
            let problem = Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                error::KIND_MISMATCH,
                "Idempotency key reused",
                "this idempotency key was already used with a different request (method, \
                 path, body or fingerprinted headers); use a new key for a new request",
            );
            answer(Outcome::Mismatch, problem)
        }
        Err(e) if e.is_retryable() && config.fail_open => {
            tracing::debug!(error = %e, "idempotency store unavailable; failing open");
            shared.observe(Outcome::Unguarded);
            Decision::FailOpen
        }
        Err(e) => answer(Outcome::StoreError, store_problem(config, &e)),
    }
}

/// Hands a request on without idempotency.
async fn pass<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
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
    let mut body = std::pin::pin!(body);
    let mut read = Chunks::default();
    // A body that says it has ended (its declared length read) is not polled again for
    // its end: one poll less per request.
    while !body.is_end_stream() {
        let Some(frame) = body.frame().await else {
            break;
        };
        match frame {
            Ok(frame) => {
                // Trailers of a request are not part of what it asks for.
                if let Ok(data) = frame.into_data() {
                    if read.len().saturating_add(data.len()) > limit {
                        return Err(too_large());
                    }
                    read.push(data);
                }
            }
            Err(e) => {
                let e: BoxError = e.into();
                return Err(Problem::new(
                    StatusCode::BAD_REQUEST,
                    error::KIND_BODY_UNREADABLE,
                    "Request body unreadable",
                    format!("the request body could not be read: {e}"),
                ));
            }
        }
    }
    Ok(read.into_bytes())
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
    insert_expires(headers, replay.expires_in);
    response
}

/// How the handler ended.
enum Ran<R, E> {
    /// With a response.
    Answered(R),
    /// With an error of the service.
    Failed(E),
    /// With a panic, caught.
    Panicked(Panic),
}

/// Releases the key after a run whose response is not stored. A failure is logged: the key
/// then stays held until its lease expires, which refuses retries with 409 meanwhile and
/// never runs the work twice at once.
async fn release(idem: &Idem, lease: &Lease, why: &str) {
    if let Err(e) = idem.release(lease).await {
        tracing::warn!(error = %e, "could not release the key after {why}");
    }
}

/// A response body, read up to the storing limit.
enum Buffer<B> {
    /// Read whole, with its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// Over the limit: what was read, and the rest, still to be streamed.
    Oversize(Bytes, Pin<Box<B>>),
    /// Broken off: what was read, and the error.
    Broken(Bytes, BoxError),
}

/// Reads `body` until its end, or until it is over `limit` bytes.
async fn buffer<B>(body: B, limit: usize) -> Buffer<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut read = Chunks::default();
    let mut trailers = None;
    if body.size_hint().lower() > limit as u64 {
        return Buffer::Oversize(read.into_bytes(), body);
    }
    loop {
        // Ended (as `read_body` asks): no frame follows, trailers included.
        if body.is_end_stream() {
            return Buffer::Whole(read.into_bytes(), trailers);
        }
        match body.frame().await {
            None => return Buffer::Whole(read.into_bytes(), trailers),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    read.push(data);
                    if read.len() > limit {
                        return Buffer::Oversize(read.into_bytes(), body);
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            },
            Some(Err(e)) => return Buffer::Broken(read.into_bytes(), e.into()),
        }
    }
}

/// What became of a whole response.
enum Kept {
    /// Stored for replay (by the layer, or by the handler in its transaction).
    Stored,
    /// Not stored: its status is not stored (the key released), or the lease was lost.
    Unstored,
    /// It should have been stored and the store failed: it must not be sent as done.
    Unrecorded,
}

/// Stores a whole response when it should be, unless the handler did already.
async fn keep(
    shared: &Shared,
    lease: &Lease,
    handle: &LeaseHandle,
    parts: &http::response::Parts,
    bytes: Bytes,
) -> Kept {
    let config = &shared.config;
    let stored = config.to_stored(parts.status, &parts.headers, bytes.clone());
    if let Some(committed) = handle.committed_response() {
        // The handler completed the record in its own transaction: nothing to store.
        if committed != stored {
            tracing::warn!(
                "the handler committed a response other than the one it returned; \
                 retries are replayed the committed one"
            );
        }
        shared.observe(Outcome::Executed);
        return Kept::Stored;
    }
    if !(config.store_status)(parts.status) {
        let why = "a response whose status is not stored";
        release(&shared.idem, lease, why).await;
        shared.observe(Outcome::NotStored);
        return Kept::Unstored;
    }
    let kept = match shared.idem.complete(lease, stored).await {
        Ok(()) => Kept::Stored,
        // Boxed: the state of this rare path (a read of the record, a task that retries)
        // would otherwise be part of every request's future.
        Err(e) => Box::pin(not_completed(shared, lease, parts, bytes, e)).await,
    };
    shared.observe(match kept {
        Kept::Stored => Outcome::Executed,
        Kept::Unstored => Outcome::NotStored,
        Kept::Unrecorded => Outcome::StoreError,
    });
    kept
}

/// What became of a whole response whose `complete` failed with `e`.
async fn not_completed(
    shared: &Shared,
    lease: &Lease,
    parts: &http::response::Parts,
    bytes: Bytes,
    e: Error,
) -> Kept {
    // Built again rather than cloned up front: only a failed write needs it twice.
    let stored = shared.config.to_stored(parts.status, &parts.headers, bytes);
    match e {
        // The record already holds this very response: the handler completed it in its
        // transaction without saying so.
        Error::LeaseLost if holds(&shared.idem, lease, &stored).await => Kept::Stored,
        Error::LeaseLost => {
            // Another request took the key over after this lease expired (or an operator
            // evicted it): nothing of ours can be stored, and this response is the truth
            // for this request.
            tracing::warn!("lease lost before the response was stored");
            Kept::Unstored
        }
        e => {
            tracing::warn!(error = %e, "storing the response failed; retrying");
            if store_later(shared, lease.clone(), stored).await {
                Kept::Stored
            } else {
                Kept::Unrecorded
            }
        }
    }
}

/// The answer when the handler ran but its outcome is not recorded (yet).
fn not_recorded(config: &Config) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        error::KIND_NOT_RECORDED,
        "Outcome not recorded",
        "the request was processed, but its response could not be recorded yet; retry \
         with the same idempotency key to receive it once it is recorded",
    )
    .retry_after(config.store_retry_after)
}

/// Sets `Idempotency-Expires` to the HTTP date `retention` from now; none when that date
/// cannot be written (past the year 9999).
fn insert_expires(headers: &mut HeaderMap, retention: Duration) {
    thread_local! {
        /// The last date this thread wrote, by its second since the epoch: the responses of
        /// one second share it, and formatting a date costs more than the rest of a replay's
        /// headers.
        static LAST: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
    }
    /// 10000-01-01T00:00:00Z: HTTP dates have four-digit years.
    const YEAR_10000: u64 = 253_402_300_800;
    let Some(expires) = SystemTime::now().checked_add(retention) else {
        return;
    };
    let Ok(since_epoch) = expires.duration_since(UNIX_EPOCH) else {
        return;
    };
    let second = since_epoch.as_secs();
    if second >= YEAR_10000 {
        return;
    }
    let value = LAST.with_borrow_mut(|last| match last {
        Some((at, value)) if *at == second => Some(value.clone()),
        _ => {
            let date = UNIX_EPOCH + Duration::from_secs(second);
            let value = HeaderValue::from_str(&httpdate::fmt_http_date(date)).ok()?;
            *last = Some((second, value.clone()));
            Some(value)
        }
    });
    if let Some(value) = value {
        headers.insert(EXPIRES, value);
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
    fn the_expiry_header_is_the_date_retention_from_now_and_never_a_panic() {
        let expires = |retention| {
            let mut headers = HeaderMap::new();
            insert_expires(&mut headers, retention);
            headers.get(EXPIRES).map(|v| v.to_str().unwrap().to_owned())
        };
        for retention in [Duration::from_secs(3600), Duration::from_secs(86_400 * 400)] {
            let before = SystemTime::now();
            // Twice: the second comes from the thread's cache (or a new second's date).
            for _ in 0..2 {
                let date = httpdate::parse_http_date(&expires(retention).unwrap()).unwrap();
                let after = SystemTime::now();
                // HTTP dates are whole seconds: rounded down.
                assert!(date + Duration::from_secs(1) > before + retention);
                assert!(date <= after + retention);
            }
        }
        assert_eq!(expires(Duration::MAX), None);
        assert_eq!(expires(Duration::from_secs(300 * 365 * 86_400 * 100)), None);
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
