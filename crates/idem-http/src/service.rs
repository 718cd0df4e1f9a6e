//! [`IdempotencyService`]: the request path of the layer, in four named steps: [`admit`],
//! [`decide`], [`run`] and [`store`].

use std::fmt;
use std::panic::{resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Either, Full, StreamBody};
use idem_core::telemetry::KeyHash;
use idem_core::{Begin, BoxError, Fingerprint, Lease, OnLost, RecordId, Scope};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tower_service::Service;
use tracing::field::Empty;
use tracing::Instrument;

use crate::body::{Chunks, Prefixed, RequestBody, ResponseBody};
use crate::config::{Anonymous, MissingKey, OnDisconnect, Unstored};
use crate::error::Problem;
use crate::future::{Detach, ResponseFuture};
use crate::handle::LeaseHandle;
use crate::outcome::{IdempotencyInfo, KeepInFlight, Outcome};
use crate::prefer::{Prefer, PREFERENCE_APPLIED};
use crate::request::{fingerprint, read_body, read_key};
use crate::response::{insert_expires, replay_response, Buffer};
use crate::settle::{not_completed, release, Kept};
use crate::shared::Shared;

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

impl<S> IdempotencyService<S> {
    /// Whether `path` is this layer's status monitor's (see [`crate::monitor`]), which the
    /// service answers itself, whatever the method.
    pub fn is_monitor(&self, path: &str) -> bool {
        crate::monitor::is_monitor(&self.shared, path)
    }

    /// The status monitor's answer to a request under its path; `None` when this layer
    /// knows nothing of the key it names (no record, or not the caller's), where the service
    /// answers 404 `not-completed`: for a server with several layers over one store, which
    /// asks each in turn.
    pub async fn monitor(&self, parts: &Parts) -> Option<Response<ResponseBody>> {
        crate::monitor::answer(&self.shared, parts).await
    }

    /// This layer's key lifetime, as `OPTIONS` on the monitor path answers it: lease,
    /// retention, waits and tombstones, as JSON.
    pub fn lifetime(&self) -> serde_json::Value {
        crate::monitor::lifetime(&self.shared)
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
        if crate::monitor::is_monitor(&self.shared, req.uri().path()) {
            let shared = self.shared.clone();
            let (parts, _) = req.into_parts();
            let answer = async move {
                let answer = crate::monitor::answer(&shared, &parts).await;
                Ok(answer.unwrap_or_else(crate::monitor::not_found))
            };
            return ResponseFuture::new(answer, tracing::Span::none());
        }
        if !self.shared.config.methods.contains(req.method()) {
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
        if self.shared.config.jsonrpc.is_some() {
            // A protocol inside HTTP: its calls are found in the body, not in the method.
            let call = crate::jsonrpc::guarded(self.shared.clone(), inner, req);
            return ResponseFuture::new(call, span);
        }
        ResponseFuture::new(guarded(self.shared.clone(), inner, req), span)
    }
}

/// One guarded request: [`admit`], then [`claim`] as work that outlives this future.
///
/// Once [`claim`] may have taken the key, the work must run to its end: a client that goes
/// away (a timeout, a closed tab) drops the response future, and with it this future, and
/// [`Detach`] then moves the work to a task of its own, so the handler and the storing of
/// its outcome still happen and a retry gets the stored response rather than a key held
/// for nothing.
async fn guarded<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let (id, fingerprint, req) = match admit(&shared, req).await {
        Admission::Guard(id, fingerprint, req) => (id, fingerprint, req),
        Admission::Pass(req) => return pass(inner, req).await,
        Admission::Refuse(response) => return Ok(response),
    };
    // Every answer for the key names its status monitor, by the key the client knows.
    let link = crate::monitor::by_key_path(&shared.config.monitor_path, id.key().as_str());
    let claimed = claim(shared.clone(), inner, id, fingerprint, req);
    let mut response = Detach::new(claimed).await?;
    crate::monitor::insert_link(response.headers_mut(), &link);
    Ok(response)
}

/// What admission decided.
enum Admission<B> {
    /// Guard the request under this record and fingerprint; its body is read.
    Guard(RecordId, Fingerprint, Request<RequestBody<B>>),
    /// Hand it on unguarded (no key, and keys are optional).
    Pass(Request<RequestBody<B>>),
    /// Refuse it with this answer.
    Refuse(Response<ResponseBody>),
}

/// Step 1, admit: decides whether the request is guarded, handed on or refused, from its
/// key, its scope and its body (read within [`crate::Config::max_request_body`]), and
/// fingerprints it. Nothing is claimed yet: a client that goes away here leaves nothing.
async fn admit<B>(shared: &Shared, req: Request<B>) -> Admission<B>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    let (parts, body) = req.into_parts();
    let id = match record_id(shared, &parts) {
        Ok(Some(id)) => id,
        Ok(None) => {
            shared.observe(Outcome::Unguarded);
            return Admission::Pass(Request::from_parts(parts, Either::Right(body)));
        }
        Err(problem) => return Admission::Refuse(refuse(shared, Outcome::Rejected, problem)),
    };
    let config = &shared.config;
    let bytes = match read_body(body, &parts.headers, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err(problem) => return Admission::Refuse(refuse(shared, Outcome::Rejected, problem)),
    };
    let span = tracing::Span::current();
    // Hashing the key costs a SHA-256: only for a span that is recorded.
    if !span.is_disabled() {
        span.record("scope", tracing::field::display(id.scope()));
        span.record("key_hash", tracing::field::display(KeyHash::of(&id)));
    }
    let fingerprint = fingerprint(config, &parts, &bytes);
    let req = Request::from_parts(parts, Either::Left(Full::new(bytes)));
    Admission::Guard(id, fingerprint, req)
}

/// The request's record, from its key header and its scope: `None` to hand it on
/// unguarded (no key, and keys are optional); the refusal when the key is missing or
/// malformed, or no principal is found.
fn record_id(shared: &Shared, parts: &Parts) -> Result<Option<RecordId>, Problem> {
    let config = &shared.config;
    let key = match read_key(&parts.headers, &config.header) {
        Ok(Some(key)) => key,
        Ok(None) if config.missing_key == MissingKey::PassThrough => return Ok(None),
        Ok(None) => {
            let (method, path, header) = (&parts.method, parts.uri.path(), &config.header);
            let detail = format!("{method} {path} requires an {header} header");
            return Err(Problem::key_missing(detail));
        }
        Err(detail) => return Err(Problem::key_invalid(detail)),
    };
    let scope = match shared.scope.as_ref().and_then(|scope| scope(parts)) {
        Some(scope) => scope,
        None if config.anonymous == Anonymous::Shared => Scope::global(),
        None => return Err(Problem::principal_missing(config.challenge.clone())),
    };
    Ok(Some(RecordId::new(scope, key)))
}

/// Steps 2 to 4, the work that runs to its end once begun: [`decide`], then [`run`] and
/// [`store`] when the key is ours.
///
/// Under `Prefer: respond-async` the work runs on in a task of its own, to its end, and the
/// client is answered `202 Accepted` at once, with the `Location` of the key's monitor.
async fn claim<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    inner: S,
    id: RecordId,
    fingerprint: Fingerprint,
    req: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    // The client's place in a stream of events it resumes: a replay or a joined stream
    // starts after that event.
    let last_event_id = req
        .headers()
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let prefer = Prefer::of(req.headers());
    let mut req = req;
    if prefer != Prefer::default() {
        crate::prefer::strip_honoured(req.headers_mut());
    }
    // The monitor a 202 sends the client to, by an id that does not reveal the key.
    let location = match prefer.respond_async {
        true => Some(crate::monitor::location(&shared, &id).await),
        false => None,
    };
    let asked = Asked {
        last_event_id: last_event_id.as_deref(),
        prefer,
        location: location.as_deref(),
    };
    let lease = match decide(&shared, &id, fingerprint, asked).await {
        Decision::Run(lease) => lease,
        Decision::Answer(response) => return Ok(response),
        Decision::FailOpen => return pass(inner, req).await,
    };
    let retention = shared.idem.config().retention;
    let handle = LeaseHandle::new(lease, retention, shared.clone());
    if prefer.respond_async {
        let work = {
            let shared = shared.clone();
            async move {
                let (ran, lease) = run(&shared, inner, id, &handle, req).await;
                // Read to its end, so a streamed body is recorded whole with nobody reading.
                if let Ok(response) = store(&shared, &handle, lease, ran).await {
                    let _ = response.into_body().collect().await;
                }
            }
        };
        tokio::spawn(work.in_current_span());
        let mut accepted = crate::monitor::accepted(&shared, location.as_deref());
        let applied = HeaderValue::from_static("respond-async");
        accepted.headers_mut().insert(PREFERENCE_APPLIED, applied);
        return Ok(accepted);
    }
    let (ran, lease) = run(&shared, inner, id, &handle, req).await;
    store(&shared, &handle, lease, ran).await
}

/// What the client asked for besides the request itself.
#[derive(Clone, Copy)]
struct Asked<'a> {
    /// `Last-Event-ID`: where a resumed stream of events starts.
    last_event_id: Option<&'a str>,
    /// Its `Prefer` header.
    prefer: Prefer,
    /// The key's monitor, for the `Location` of a `202`.
    location: Option<&'a str>,
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

/// Step 2, decide: asks the store's `begin` for the key, and decides from its answer:
/// run the handler (the key is ours), replay the stored response, refuse with 409 while
/// another request holds the key (or, with [`idem_core::Config::wait`], answer with its
/// response once stored), refuse a mismatch with 422, or, the store failing, refuse with
/// 503 / 500 or fail open.
///
/// `Prefer: wait=N` bounds the wait by `min(N, max_wait)` in place of the engine's, and
/// every answer given without running says so in `Preference-Applied`; under
/// `Prefer: respond-async` a duplicate in flight is answered `202` with the key's monitor.
async fn decide(
    shared: &Shared,
    id: &RecordId,
    fingerprint: Fingerprint,
    asked: Asked<'_>,
) -> Decision {
    let config = &shared.config;
    let honoured = asked.prefer.wait.map(|n| n.min(config.max_wait));
    // A client that asked for an answer at once waits only as long as it said.
    let wait = match asked.prefer.respond_async {
        true => honoured,
        false => honoured.or(shared.idem.config().wait),
    };
    let decision = decide_within(shared, id, fingerprint, asked, wait).await;
    match (decision, honoured) {
        (Decision::Answer(mut response), Some(wait)) => {
            let applied = HeaderValue::try_from(format!("wait={}", wait.as_secs()));
            if let Ok(applied) = applied {
                response.headers_mut().append(PREFERENCE_APPLIED, applied);
            }
            Decision::Answer(response)
        }
        (decision, _) => decision,
    }
}

/// [`decide`], waiting up to `wait` for a key in flight.
async fn decide_within(
    shared: &Shared,
    id: &RecordId,
    fingerprint: Fingerprint,
    asked: Asked<'_>,
    wait: Option<Duration>,
) -> Decision {
    let config = &shared.config;
    let last_event_id = asked.last_event_id;
    let answer = |outcome, problem| Decision::Answer(refuse(shared, outcome, problem));
    match shared.idem.begin_within(id, fingerprint, wait).await {
        Ok(Begin::Acquired(lease) | Begin::TookOver(lease)) => Decision::Run(lease),
        Ok(Begin::Replay(mut replay)) => {
            shared.observe(Outcome::Replayed);
            let response = &mut replay.completion.response;
            if let Some(last) =
                last_event_id.filter(|_| crate::join::is_event_stream(&response.headers))
            {
                if let Some(at) = crate::join::after_event(&response.body, last) {
                    response.body = response.body.slice(at..);
                }
            }
            Decision::Answer(replay_response(config, replay))
        }
        Ok(Begin::InFlight { .. }) if asked.prefer.respond_async => {
            shared.observe(Outcome::InFlight);
            let mut accepted = crate::monitor::accepted(shared, asked.location);
            let applied = HeaderValue::from_static("respond-async");
            accepted.headers_mut().insert(PREFERENCE_APPLIED, applied);
            Decision::Answer(accepted)
        }
        Ok(Begin::InFlight { retry_after }) => {
            // A response that streams is joined: its head, what came so far, then the rest.
            if let Some(joined) = crate::join::join(config, &shared.idem, id, last_event_id).await {
                shared.observe(Outcome::Replayed);
                return Decision::Answer(joined);
            }
            let retry_after = retry_after.min(config.in_flight_retry_after);
            answer(Outcome::InFlight, Problem::in_flight(retry_after))
        }
        Ok(Begin::Mismatch) => answer(Outcome::Mismatch, Problem::mismatch()),
        Ok(Begin::Expired { completed_at }) => {
            answer(Outcome::Expired, Problem::key_expired(completed_at))
        }
        Err(e) if e.is_retryable() && config.fail_open => {
            tracing::debug!(error = %e, "idempotency store unavailable; failing open");
            shared.observe(Outcome::Unguarded);
            Decision::FailOpen
        }
        // An outage is logged once, where it starts and ends (idem_core::telemetry): per
        // request it is only a debug line. Anything else is worth a warning each time.
        Err(e) if e.is_retryable() => {
            tracing::debug!(error = %e, "idempotency store unavailable before the handler ran");
            answer(
                Outcome::StoreError,
                Problem::store_failed(&e, config.store_retry_after),
            )
        }
        Err(e) => {
            tracing::warn!(error = %e, "idempotency store failed before the handler ran");
            answer(
                Outcome::StoreError,
                Problem::store_failed(&e, config.store_retry_after),
            )
        }
    }
}

/// How the handler ended: its response or error, or the payload of its panic.
type Ran<R, E> = Result<Result<R, E>, Box<dyn std::any::Any + Send>>;

/// Step 3, run: the inner service under the lease, which the engine's heartbeat renews
/// while it works ([`Idem::run_with_heartbeat`] with [`OnLost::Finish`]: a handler whose
/// lease is lost still runs to its end, and storing its outcome then finds the lease
/// lost). A panic of the service is caught, so that [`store`] can release the key first.
/// Returns how it ended and the lease as last renewed.
async fn run<S, ReqBody, ResBody>(
    shared: &Shared,
    mut inner: S,
    id: RecordId,
    handle: &LeaseHandle,
    mut req: Request<RequestBody<ReqBody>>,
) -> (Ran<S::Response, S::Error>, Lease)
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
{
    let attempt = handle.attempt();
    req.extensions_mut().insert(IdempotencyInfo { id, attempt });
    req.extensions_mut().insert(handle.clone());
    tracing::Span::current().record("attempt", attempt);
    let started = Instant::now();
    // `call` itself may panic, before any future exists: it is inside the caught future.
    let work = AssertUnwindSafe(async move { inner.call(req).await }).catch_unwind();
    let mut work = std::pin::pin!(work);
    let granted = handle.lease().clone();
    let (lease, ran) = if shared.config.heartbeat {
        let beating = shared
            .idem
            .run_with_heartbeat(granted, OnLost::Finish, work.as_mut());
        // `Finish` never gives the work up; were it to, the work still ends here.
        match beating.await {
            Ok(renewed) => renewed,
            Err(_) => (handle.lease().clone(), work.await),
        }
    } else {
        (granted, work.await)
    };
    metrics::histogram!("idem_http_handler_duration_seconds")
        .record(started.elapsed().as_secs_f64());
    (ran, lease)
}

/// Step 4, store: after an error or a panic of the service, releases the key (then returns
/// the error, or resumes the panic); after a response, see [`store_response`].
async fn store<R, E>(
    shared: &Arc<Shared>,
    handle: &LeaseHandle,
    lease: Lease,
    ran: Ran<Response<R>, E>,
) -> Result<Response<ResponseBody>, E>
where
    R: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    match ran {
        Ok(Ok(response)) => Ok(store_response(shared, handle, lease, response).await),
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

/// Stores the handler's response when it should be, and answers with it: left in flight
/// unstored when marked [`KeepInFlight::Always`]; a body that is whole already is stored
/// before it is sent ([`store_whole`]); any other is streamed to the client as it comes and
/// stored at its end ([`stream`]).
async fn store_response<R>(
    shared: &Arc<Shared>,
    handle: &LeaseHandle,
    lease: Lease,
    response: Response<R>,
) -> Response<ResponseBody>
where
    R: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let (parts, body) = response.into_parts();
    let keep_in_flight = parts.extensions.get::<KeepInFlight>().copied();
    if keep_in_flight == Some(KeepInFlight::Always) {
        shared.observe(Outcome::NotStored);
        return Response::from_parts(parts, ResponseBody::new(body));
    }
    let mut body = Box::pin(body);
    // One poll in place, never a wait: a body whose first frame ends it (a handler's
    // `String` or JSON, an upstream's small answer already read) is whole, and is stored
    // before it is sent, head and body in one write, with no task and no channel. What
    // that buys: a small guarded response through the middleware costs about 20 µs of CPU
    // instead of 68 µs streamed, through `idem proxy` 40 µs instead of 48 to 65 µs.
    let first = if body.is_end_stream() {
        Some(None)
    } else {
        let first = body.frame().now_or_never();
        first.map(|f| f.map(|f| f.map_err(Into::into)))
    };
    let read = match first {
        Some(None) => Buffer::Whole(Bytes::new(), None),
        Some(Some(Err(e))) => Buffer::Broken(Bytes::new(), e),
        Some(Some(Ok(frame))) if body.is_end_stream() => match frame.into_data() {
            Ok(data) if data.len() > shared.config.max_response_body => {
                Buffer::Oversize(data, body)
            }
            Ok(data) => Buffer::Whole(data, None),
            Err(frame) => Buffer::Whole(Bytes::new(), frame.into_trailers().ok()),
        },
        Some(Some(Ok(frame))) => return stream(shared, handle, lease, parts, Some(frame), body),
        None => return stream(shared, handle, lease, parts, None, body),
    };
    store_whole(shared, handle, &lease, parts, keep_in_flight, read).await
}

/// Stores a body read whole, and answers with it: sent unstored when it broke off (the key
/// released, unless [`KeepInFlight::IfBodyBreaks`]) or is over
/// [`crate::Config::max_response_body`] (per [`Unstored`]); stored otherwise (see [`keep`]),
/// with `Idempotency-Expires`, and never sent when it should have been stored and was not.
async fn store_whole<R>(
    shared: &Shared,
    handle: &LeaseHandle,
    lease: &Lease,
    mut parts: http::response::Parts,
    keep_in_flight: Option<KeepInFlight>,
    read: Buffer<R>,
) -> Response<ResponseBody>
where
    R: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let config = &shared.config;
    let body = match read {
        Buffer::Broken(read, e) => {
            // The client sees the same break it would have seen without the layer.
            if keep_in_flight.is_none() {
                release(&shared.idem, lease, "the response body failed").await;
            }
            shared.observe(Outcome::NotStored);
            let failure = futures_util::stream::iter([Err::<Frame<Bytes>, _>(e)]);
            ResponseBody::new(Prefixed::new(read, Box::pin(StreamBody::new(failure))))
        }
        Buffer::Oversize(read, rest) => {
            let limit = config.max_response_body;
            tracing::warn!(limit, "response too large to store; sent unstored");
            if config.unstored == Unstored::Release {
                release(&shared.idem, lease, "a response too large to store").await;
            }
            shared.observe(Outcome::NotStored);
            ResponseBody::new(Prefixed::new(read, rest))
        }
        Buffer::Whole(mut bytes, trailers) => {
            if config.sse_ids && crate::join::is_sse(&parts.headers) {
                let mut ids = crate::join::SseIds::default();
                bytes = [ids.push(&bytes), ids.finish()].concat().into();
            }
            let (status, headers) = (parts.status, &parts.headers);
            match keep(shared, lease, handle, status, headers, bytes.clone()).await {
                // The first response advertises its expiry too, as replays do.
                Kept::Stored => insert_expires(&mut parts.headers, shared.idem.config().retention),
                Kept::Unstored => {}
                Kept::Unrecorded => {
                    return Problem::not_recorded(config.store_retry_after).into_response()
                }
                Kept::Superseded => {
                    return Problem::lease_lost(config.store_retry_after).into_response()
                }
            }
            ResponseBody::buffered(bytes, trailers)
        }
    };
    Response::from_parts(parts, body)
}

/// The frames a streamed response's client receives, and an error in place of a clean end.
type Sent = Result<Frame<Bytes>, BoxError>;

/// Frames read ahead of a client that reads slower than the body comes: a few, so that
/// memory held per stream stays the kept copy (at most
/// [`crate::Config::max_response_body`]) plus these; a slower client slows the reading, as
/// it would without the layer, until it leaves.
const FRAMES_AHEAD: usize = 4;

/// Answers with a body that is not whole yet (`first`, its first frame if one came, then
/// `body`): the head at once, then each frame as it comes, read by [`pump`] in a task of
/// its own so that a client going away stops nothing but the sending.
fn stream<R>(
    shared: &Arc<Shared>,
    handle: &LeaseHandle,
    lease: Lease,
    mut parts: http::response::Parts,
    first: Option<Frame<Bytes>>,
    body: Pin<Box<R>>,
) -> Response<ResponseBody>
where
    R: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let config = &shared.config;
    let head = (parts.status, parts.headers.clone());
    let keep_in_flight = parts.extensions.get::<KeepInFlight>().copied();
    // Sent before the body is known to be stored: it holds if the stream ends cleanly
    // within the limit.
    let storable = body.size_hint().lower() <= config.max_response_body as u64;
    if storable && (config.store_status)(parts.status) {
        insert_expires(&mut parts.headers, shared.idem.config().retention);
    }
    // Recorded as it comes, for duplicates to join, when it may be stored at its end.
    let recorder = (storable && (config.store_status)(parts.status)).then(|| {
        let head = crate::join::encode_head(config, parts.status, &parts.headers);
        crate::join::Recorder::start(&shared.idem, lease.clone(), head)
    });
    let (tx, mut rx) = mpsc::channel::<Sent>(FRAMES_AHEAD);
    let pumped = pump(
        shared.clone(),
        handle.clone(),
        lease,
        head,
        keep_in_flight,
        (
            first,
            body,
            recorder,
            (config.sse_ids && crate::join::is_sse(&parts.headers))
                .then(crate::join::SseIds::default),
        ),
        tx,
    );
    tokio::spawn(pumped.in_current_span());
    let received = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    Response::from_parts(parts, ResponseBody::new(StreamBody::new(received)))
}

/// A streamed body as [`pump`] reads it: its first frame if one was read, the rest, its
/// recording for duplicates to join, and the numbering of its events.
type Streamed<R> = (
    Option<Frame<Bytes>>,
    Pin<Box<R>>,
    Option<crate::join::Recorder>,
    Option<crate::join::SseIds>,
);

/// How the reading of a streamed body ended.
enum Read {
    /// The body ended: what was kept of it (`None`: over the limit), its trailers, and its
    /// last data frame when the body said it was the last, held back with the end.
    Ended {
        kept: Option<Bytes>,
        trailers: Option<HeaderMap>,
        last: Option<Bytes>,
    },
    /// The body broke off with this error.
    Broken(BoxError),
    /// The client went away and the route cancels ([`OnDisconnect::Cancel`]).
    Left,
}

/// Reads a streamed body to its end under the lease (renewed by the heartbeat as while the
/// handler ran), sending each frame on through `tx` and keeping its bytes up to the limit;
/// then decides, as [`store_whole`] does, and only after the completion is stored lets the
/// client's body end cleanly (its last frame, its trailers, then the channel closed). When
/// storing fails, the client's body ends with an error instead: the client sees the
/// response break off, never a clean end of an unrecorded response.
async fn pump<R>(
    shared: Arc<Shared>,
    handle: LeaseHandle,
    lease: Lease,
    (status, headers): (StatusCode, HeaderMap),
    keep_in_flight: Option<KeepInFlight>,
    (first, body, recorder, ids): Streamed<R>,
    tx: mpsc::Sender<Sent>,
) where
    R: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let config = &shared.config;
    let reading = std::pin::pin!(read_on(config, (first, body, recorder), ids, &tx));
    let (lease, read) = if config.heartbeat {
        let mut reading = reading;
        let beating =
            shared
                .idem
                .run_with_heartbeat(lease.clone(), OnLost::Finish, reading.as_mut());
        // `Finish` never gives the work up; were it to, the reading still ends here.
        match beating.await {
            Ok(renewed) => renewed,
            Err(_) => (lease, reading.await),
        }
    } else {
        (lease, reading.await)
    };
    let (kept, trailers, last) = match read {
        Read::Left => {
            release(&shared.idem, &lease, "its client left a streamed response").await;
            shared.observe(Outcome::NotStored);
            return;
        }
        Read::Broken(e) => {
            if keep_in_flight.is_none() {
                release(&shared.idem, &lease, "the response body failed").await;
            }
            shared.observe(Outcome::NotStored);
            // The client sees the same break it would have seen without the layer.
            let _ = tx.send(Err(e)).await;
            return;
        }
        Read::Ended {
            kept,
            trailers,
            last,
        } => (kept, trailers, last),
    };
    match kept {
        None => {
            let limit = config.max_response_body;
            tracing::warn!(limit, "streamed response too large to store; sent unstored");
            if config.unstored == Unstored::Release {
                release(&shared.idem, &lease, "a response too large to store").await;
            }
            shared.observe(Outcome::NotStored);
        }
        Some(bytes) => match keep(&shared, &lease, &handle, status, &headers, bytes).await {
            Kept::Stored | Kept::Unstored => {}
            Kept::Unrecorded => {
                let _ = tx
                    .send(Err("the response could not be recorded".into()))
                    .await;
                return;
            }
            Kept::Superseded => {
                let _ = tx
                    .send(Err(
                        "the lease was lost before the response was recorded".into()
                    ))
                    .await;
                return;
            }
        },
    }
    // The clean end: the held-back frames, then the channel closed as `tx` is dropped. A
    // client that left misses them, as it missed the rest.
    let frames = last
        .map(Frame::data)
        .into_iter()
        .chain(trailers.map(Frame::trailers));
    for frame in frames {
        if tx.send(Ok(frame)).await.is_err() {
            break;
        }
    }
}

/// Reads `body` (its first frame, if already read, then the rest) to its end, sending each
/// data frame on through `tx` while the client is there, and keeping the bytes while they
/// are within [`crate::Config::max_response_body`]. A data frame after which the body says
/// it has ended is held back (the end of a body whose length is known is its last bytes),
/// and so are trailers. With [`OnDisconnect::Cancel`], returns as soon as the client is
/// seen gone, dropping the body.
async fn read_on<R>(
    config: &crate::Config,
    (mut first, mut body, mut recorder): (
        Option<Frame<Bytes>>,
        Pin<Box<R>>,
        Option<crate::join::Recorder>,
    ),
    mut ids: Option<crate::join::SseIds>,
    tx: &mpsc::Sender<Sent>,
) -> Read
where
    R: Body<Data = Bytes, Error: Into<BoxError>>,
{
    let limit = config.max_response_body;
    let cancel = config.on_disconnect == OnDisconnect::Cancel;
    let mut kept = (body.size_hint().lower() <= limit as u64).then(Chunks::default);
    let mut trailers = None;
    // Whether the client still receives: once it left, the body is read on unsent.
    let mut client = true;
    loop {
        let frame = if let Some(frame) = first.take() {
            frame
        } else {
            if body.is_end_stream() {
                break;
            }
            let next = if cancel {
                tokio::select! {
                    next = body.frame() => next,
                    // The client's body was dropped: the route gives the work up, and the
                    // body is dropped with this future (a proxy's upstream connection
                    // closes).
                    () = tx.closed() => return Read::Left,
                }
            } else {
                body.frame().await
            };
            match next {
                None => break,
                Some(Ok(frame)) => frame,
                Some(Err(e)) => return Read::Broken(e.into()),
            }
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                trailers = frame.into_trailers().ok().or(trailers);
                continue;
            }
        };
        // Events numbered as they end; at the body's end, what never ended too.
        let data = match &mut ids {
            Some(ids) if body.is_end_stream() => [ids.push(&data), ids.finish()].concat().into(),
            Some(ids) => ids.push(&data),
            None => data,
        };
        if data.is_empty() && !body.is_end_stream() {
            continue;
        }
        if let Some(chunks) = &mut kept {
            chunks.push(data.clone());
            if chunks.len() > limit {
                kept = None;
                // Never stored: nothing more for duplicates to join.
                recorder = None;
            }
        }
        if let Some(recorder) = &recorder {
            recorder.push(data.clone());
        }
        if body.is_end_stream() {
            if let Some(recorder) = recorder {
                recorder.end();
            }
            return Read::Ended {
                kept: kept.map(Chunks::into_bytes),
                trailers,
                last: Some(data),
            };
        }
        // Waits while the client is `FRAMES_AHEAD` behind; fails once it has left.
        if client && tx.send(Ok(Frame::data(data))).await.is_err() {
            if cancel {
                return Read::Left;
            }
            client = false;
        }
    }
    // What the numbering still holds (an event the body never ended) goes out as the end.
    let last = ids
        .map(|mut ids| ids.finish())
        .filter(|rest| !rest.is_empty());
    if let (Some(chunks), Some(rest)) = (&mut kept, &last) {
        chunks.push(rest.clone());
    }
    if let Some(recorder) = recorder {
        recorder.end();
    }
    Read::Ended {
        kept: kept.map(Chunks::into_bytes),
        trailers,
        last,
    }
}

/// Stores a whole response when its status should be (else releases the key), unless the
/// handler did already.
async fn keep(
    shared: &Shared,
    lease: &Lease,
    handle: &LeaseHandle,
    status: StatusCode,
    headers: &HeaderMap,
    bytes: Bytes,
) -> Kept {
    let config = &shared.config;
    let stored = config.to_stored(status, headers, bytes);
    let kept = if let Some(committed) = handle.committed_response() {
        // The handler completed the record in its own transaction: nothing to store.
        if committed != stored {
            tracing::warn!(
                "the handler committed a response other than the one it returned; \
                 retries are replayed the committed one"
            );
        }
        shared.idem.completed_elsewhere(lease).await;
        Kept::Stored
    } else if !(config.store_status)(status) {
        release(&shared.idem, lease, "a response whose status is not stored").await;
        Kept::Unstored
    } else {
        match shared.idem.complete(lease, stored.clone()).await {
            Ok(()) => Kept::Stored,
            Err(e) => not_completed(shared, lease, stored, e).await,
        }
    };
    shared.observe(match kept {
        Kept::Stored => Outcome::Executed,
        Kept::Unstored => Outcome::NotStored,
        Kept::Unrecorded => Outcome::StoreError,
        Kept::Superseded => Outcome::LeaseLost,
    });
    kept
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

/// Reports `outcome` and answers with `problem`.
fn refuse(shared: &Shared, outcome: Outcome, problem: Problem) -> Response<ResponseBody> {
    shared.observe(outcome);
    problem.into_response()
}
