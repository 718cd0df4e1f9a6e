//! [`IdempotencyService`]: the request path of the layer, in four named steps: [`admit`],
//! [`decide`], [`run`] and [`store`].

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full};
use idem_core::{Begin, BoxError, Fingerprint, Lease, RecordId, Scope};
use tower_service::Service;
use tracing::field::Empty;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody};
use crate::config::{Anonymous, MissingKey};
use crate::error::Problem;
use crate::future::{Detach, ResponseFuture};
use crate::handle::LeaseHandle;
use crate::outcome::Outcome;
use crate::prefer::{Prefer, PREFERENCE_APPLIED};
use crate::request::{fingerprint, read_body, read_key};
use crate::respond::store_response;
use crate::response::replay_response;
use crate::shared::Shared;
use crate::steps::{answered, pass, record_on_span, run_leased, Admission, Ran};

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
    if let Some(rpc) = shared.config.jsonrpc.clone() {
        // A protocol inside HTTP: its calls are found in the body, not in the method.
        return match crate::jsonrpc::admit(&shared, rpc, req).await {
            Admission::Guard(call, req) => {
                Detach::new(crate::jsonrpc::claim(shared, inner, call, req)).await
            }
            Admission::Pass(req) => pass(inner, req).await,
            Admission::Refuse(response) => Ok(response),
        };
    }
    let ((id, fingerprint), req) = match admit(&shared, req).await {
        Admission::Guard(guard, req) => (guard, req),
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

/// Step 1, admit: decides whether the request is guarded, handed on or refused, from its
/// key, its scope and its body (read within [`crate::Config::max_request_body`]), and
/// fingerprints it. Nothing is claimed yet: a client that goes away here leaves nothing.
async fn admit<B>(shared: &Shared, req: Request<B>) -> Admission<B, (RecordId, Fingerprint)>
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
    record_on_span(&id);
    let fingerprint = fingerprint(config, &parts, &bytes);
    let req = Request::from_parts(parts, Either::Left(Full::new(bytes)));
    Admission::Guard((id, fingerprint), req)
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
                    let mut body = std::pin::pin!(response.into_body());
                    while let Some(Ok(_)) = body.frame().await {}
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

/// Step 3, run: the inner service under the lease (see [`run_leased`]).
async fn run<S, ReqBody, ResBody>(
    shared: &Shared,
    mut inner: S,
    id: RecordId,
    handle: &LeaseHandle,
    req: Request<RequestBody<ReqBody>>,
) -> (Ran<S::Response, S::Error>, Lease)
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
{
    run_leased(shared, id, handle, req, |req| inner.call(req)).await
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
    let response = answered(shared, &lease, ran).await?;
    Ok(store_response(shared, handle, lease, response).await)
}

/// Reports `outcome` and answers with `problem`.
fn refuse(shared: &Shared, outcome: Outcome, problem: Problem) -> Response<ResponseBody> {
    shared.observe(outcome);
    problem.into_response()
}
