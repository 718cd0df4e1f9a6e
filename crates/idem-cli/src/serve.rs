//! `idem serve`: the demo payments API (README, "Two commands") behind the idempotency
//! middleware. `POST /payments` makes a payment, the side effect; `GET /payments` and
//! `GET /payments/{id}` read the caller's (`Authorization: Bearer <name>`, which also scopes
//! the keys); `GET /metrics` renders every metric the process records, `GET /livez` answers
//! while the process runs and `GET /readyz` while its store answers. The demo headers hold
//! the handler before or after the payment commits; where payments live: [`crate::ledger`].

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::header::{ALLOW, AUTHORIZATION, CONTENT_TYPE, LOCATION};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{middleware, Json, Router};
use idem_core::{Error, Idem, Key, RecordId, Scope, Store};
use idem_http::{Config, IdempotencyLayer, LeaseHandle, MissingKey};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::args::ServeArgs;
use crate::error::{listen_error, CliError, Done};
use crate::ledger::{Backend, Ledger, Payment};
use crate::signal::shutdown_signal;
use crate::store::{self, Use};
use crate::telemetry::install_exporter;

/// The header that makes the handler sleep, to show races.
pub const DELAY_HEADER: &str = "x-demo-delay-ms";
/// The header that makes the handler sleep after the payment is committed and before it
/// answers: the window in which a crash loses the response but not the payment.
pub const AFTER_COMMIT_HEADER: &str = "x-demo-delay-after-commit-ms";
/// The longest accepted demo delay.
const MAX_DELAY: Duration = Duration::from_secs(60);

/// The demo's state: its payments, the store `/readyz` reads, and the exporter `/metrics`
/// renders.
#[derive(Debug)]
pub struct Demo {
    ledger: Ledger,
    store: Arc<dyn Store>,
    exporter: PrometheusHandle,
}

/// Settings of the demo service.
#[derive(Debug, Clone)]
pub struct Options {
    /// When set, a request for a key in flight waits this long for the first one's response
    /// instead of answering 409 at once.
    pub wait: Option<Duration>,
    /// How long a request holds its key while the handler runs.
    pub lease: Duration,
    /// How long a stored response is replayed.
    pub retention: Duration,
    /// The longest a duplicate waits when it asks with `Prefer: wait=N`.
    pub max_wait: Duration,
    /// What a request on a key whose stored response was forgotten gets.
    pub after_retention: idem_core::AfterRetention,
    /// How long a tombstone is kept, under [`idem_core::AfterRetention::Refuse`].
    pub tombstone: Duration,
    /// The store as printed at start-up: its URL without the password.
    pub store: String,
    /// What `GET /metrics` renders.
    pub exporter: PrometheusHandle,
}

/// The demo's router over the store and payments of `backend`.
pub fn app(backend: Backend, options: &Options) -> Router {
    let Backend { store, ledger } = backend;
    let demo = Arc::new(Demo {
        ledger,
        store: store.clone(),
        exporter: options.exporter.clone(),
    });
    let mut config = idem_core::Config::default()
        .with_lease(options.lease)
        .with_retention(options.retention);
    config.wait = options.wait;
    config.after_retention = options.after_retention;
    config.tombstone = options.tombstone;
    let idem = Idem::from_arc(store).with_config(config);
    let layer = IdempotencyLayer::new(idem)
        .with_config(
            Config::default()
                .with_missing_key(MissingKey::Reject)
                .with_max_wait(options.max_wait)
                // A method the path does not take (405) says nothing about the request's
                // outcome: the key is released, not kept for a refusal.
                .with_store_status(|status| {
                    status != StatusCode::METHOD_NOT_ALLOWED
                        && idem_http::default_store_status(status)
                }),
        )
        .with_scope(|parts| caller(&parts.headers).and_then(|name| Scope::new(name).ok()));

    // Only the payment routes are guarded: /metrics, /livez and /readyz stay readable when
    // the store is down.
    let monitor = layer.monitor();
    let payments = Router::new()
        .route("/payments", get(list_payments).post(create_payment))
        .route("/payments/{id}", get(get_payment))
        .layer(layer)
        // Before the key is claimed: the demo headers are not part of the fingerprint, so
        // a refusal of a bad one must not be stored and replayed once it is fixed.
        .layer(middleware::from_fn(check_demo_headers));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        // What became of a key, without sending its request again (`Link: rel="monitor"`).
        .route_service("/.idem/keys", monitor.clone())
        .route_service("/.idem/keys/{*id}", monitor)
        .merge(payments)
        .fallback(|| async {
            problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Not found",
                "no such route",
            )
        })
        .layer(middleware::map_response(method_not_allowed_as_problem))
        .with_state(demo)
}

/// Refuses a request whose demo delay headers are not whole milliseconds up to a minute,
/// with 400, before the idempotency layer sees it.
async fn check_demo_headers(request: axum::extract::Request, next: middleware::Next) -> Response {
    for name in [DELAY_HEADER, AFTER_COMMIT_HEADER] {
        if let Err(detail) = demo_delay(request.headers(), name) {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid-delay",
                "Invalid delay",
                detail,
            );
        }
    }
    next.run(request).await
}

/// axum answers a method a route does not take with an empty 405: give it a problem+json
/// body like every other refusal, keeping its `Allow` header.
async fn method_not_allowed_as_problem(response: Response) -> Response {
    if response.status() != StatusCode::METHOD_NOT_ALLOWED
        || response.headers().contains_key(CONTENT_TYPE)
    {
        return response;
    }
    let allow = response.headers().get(ALLOW).cloned();
    let detail = match allow.as_ref().and_then(|a| a.to_str().ok()) {
        Some(allowed) => format!("this path takes {allowed}"),
        None => "this path does not take this method".to_owned(),
    };
    let mut problem = problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        detail,
    );
    if let Some(allow) = allow {
        problem.headers_mut().insert(ALLOW, allow);
    }
    problem
}

/// Runs `idem serve` until SIGTERM or Ctrl-C.
///
/// # Errors
///
/// Bad flags, a store that cannot be opened, a port that cannot be listened on.
pub async fn run(args: ServeArgs) -> Result<Done, CliError> {
    let service = Use::Service {
        migrate: args.migrate,
        purge_every: args.purge_every,
    };
    let opened = store::open(&args.store, service).await?;
    let url = opened.url().clone();
    let backend = Backend::open(opened).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| listen_error(args.listen, &e))?;
    let after_retention = match args.after_retention.as_str() {
        "refuse" => idem_core::AfterRetention::Refuse,
        _ if args.tombstone_secs.is_some() => {
            return Err(CliError::Usage(
                "--tombstone-secs applies only with --after-retention refuse: add it, \
                 or remove --tombstone-secs"
                    .into(),
            ))
        }
        _ => idem_core::AfterRetention::Run,
    };
    let options = Options {
        wait: args.wait_ms.map(Duration::from_millis),
        max_wait: Duration::from_millis(args.max_wait_ms),
        after_retention,
        tombstone: args
            .tombstone_secs
            .unwrap_or_else(|| idem_core::Config::default().tombstone),
        lease: args.lease,
        retention: args.retention,
        store: url.to_string(),
        exporter: install_exporter()?,
    };
    tracing::info!(
        store = %options.store,
        listen = %args.listen,
        wait_ms = args.wait_ms,
        "idem serve starting"
    );
    serve(listener, backend, &options, shutdown_signal("idem demo")).await?;
    Ok(Done::ok("idem demo: stopped\n".into()))
}

/// Serves the demo on `listener` until `shutdown` resolves, printing the URL first.
///
/// # Errors
///
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    backend: Backend,
    options: &Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    // Written with errors ignored: whoever started the server may have closed our stdout
    // after reading the URL, and that must not stop the server.
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "idem demo: payments API listening on http://{addr} (store: {}; payments {})",
        options.store,
        backend.ledger.describe()
    );
    let _ = writeln!(
        out,
        "try: curl -i -X POST http://{addr}/payments -H 'Authorization: Bearer alice' \
         -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
         -d '{{\"amount\": 1250, \"currency\": \"EUR\"}}'"
    );
    let _ = out.flush();
    axum::serve(listener, app(backend, options))
        .with_graceful_shutdown(shutdown)
        .await
}

/// The longest caller name accepted.
const MAX_CALLER: usize = 64;

/// The caller named by `Authorization: Bearer <name>` (a demo: the token is the name, at
/// most 64 bytes). The middleware's scope and the handlers use this one function, so a
/// request the handlers treat as anonymous is also keyed as anonymous.
fn caller(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() && token.len() <= MAX_CALLER)
        .then(|| token.to_owned())
}

fn problem(status: StatusCode, kind: &str, title: &str, detail: impl Into<String>) -> Response {
    let doc = idem_http::problem_json(
        &format!("urn:idem:demo:{kind}"),
        title,
        status,
        &detail.into(),
    );
    let mut response = (status, doc).into_response();
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(idem_http::PROBLEM_JSON),
    );
    response
}

fn unauthorized() -> Response {
    let mut response = problem(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "Caller unknown",
        "send Authorization: Bearer <your name>",
    );
    response.headers_mut().insert(
        "www-authenticate",
        HeaderValue::from_static("Bearer realm=\"idem-demo\""),
    );
    response
}

async fn create_payment(
    State(demo): State<Arc<Demo>>,
    lease: Option<LeaseHandle>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(owner) = caller(&headers) else {
        return unauthorized();
    };
    let request: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid-json",
                "Body is not JSON",
                format!(
                "expected a JSON object such as {{\"amount\": 1250, \"currency\": \"EUR\"}}: {e}"
            ),
            )
        }
    };
    let (amount, currency) = match validate(&request) {
        Ok(fields) => fields,
        Err(detail) => {
            return problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid-payment",
                "Invalid payment",
                detail,
            )
        }
    };
    // `check_demo_headers` refused a bad delay before the key was claimed.
    let delay = demo_delay(&headers, DELAY_HEADER).unwrap_or_default();
    let after_commit = demo_delay(&headers, AFTER_COMMIT_HEADER).unwrap_or_default();
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }

    let payment = Payment {
        id: format!("pay_{}", &uuid::Uuid::new_v4().simple().to_string()[..16]),
        amount,
        currency,
        status: "succeeded".into(),
        created_at: rfc3339(SystemTime::now()),
        owner,
    };
    let mut out = HeaderMap::new();
    out.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(location) = HeaderValue::from_str(&format!("/payments/{}", payment.id)) {
        out.insert(LOCATION, location);
    }
    let body = match serde_json::to_vec(&payment) {
        Ok(body) => Bytes::from(body),
        Err(e) => return unavailable(&Error::Invalid(e.to_string())),
    };
    // The side effect. On PostgreSQL the payment's row and the completed idempotency
    // record commit together.
    let completion = lease
        .as_ref()
        .map(|lease| lease.completion(StatusCode::CREATED, &out, body.clone()));
    let held = lease.as_ref().zip(completion.as_ref());
    match demo.ledger.pay(&payment, held, after_commit).await {
        Ok(()) => {}
        Err(Error::LeaseLost) => {
            return problem(
                StatusCode::CONFLICT,
                "request-taken-over",
                "Request taken over",
                "another request took this idempotency key over while this one ran; \
                 nothing was paid by this one: retry with the same key for the outcome",
            )
        }
        Err(e) => return unavailable(&e),
    }
    metrics::counter!("idem_demo_payments_created_total").increment(1);
    (StatusCode::CREATED, out, body).into_response()
}

/// A demo delay header: `Ok(None)` when absent, why not when it is not a whole number of
/// milliseconds up to a minute.
fn demo_delay(headers: &HeaderMap, name: &str) -> Result<Option<Duration>, String> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
        .filter(|d| *d <= MAX_DELAY)
        .map(Some)
        .ok_or_else(|| format!("{name} must be a whole number of milliseconds, at most 60000"))
}

/// The payments database failed: 503, which the layer does not store, so a retry with the
/// same key runs again.
fn unavailable(e: &Error) -> Response {
    tracing::warn!(error = %e, "payments database failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "payments-unavailable",
        "Payments unavailable",
        "the payment could not be recorded; retry with the same idempotency key",
    )
}

/// Checks `{"amount": <positive integer, minor units>, "currency": "<ISO 4217 code>"}`.
fn validate(request: &serde_json::Value) -> Result<(u64, String), String> {
    let Some(object) = request.as_object() else {
        return Err("the body must be a JSON object".into());
    };
    if let Some(unknown) = object
        .keys()
        .find(|k| !matches!(k.as_str(), "amount" | "currency"))
    {
        return Err(format!(
            "unknown field {unknown:?}: only amount and currency are accepted"
        ));
    }
    let amount = match object.get("amount") {
        Some(v) => v
            .as_u64()
            .filter(|a| (1..=100_000_000).contains(a))
            .ok_or("amount must be a whole number of minor units from 1 to 100000000")?,
        None => return Err("amount is required".into()),
    };
    let currency = match object.get("currency").and_then(|v| v.as_str()) {
        Some(c) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => c.to_owned(),
        Some(_) => return Err("currency must be three capital letters, such as EUR".into()),
        None => return Err("currency is required (a string such as \"EUR\")".into()),
    };
    Ok((amount, currency))
}

async fn get_payment(
    State(demo): State<Arc<Demo>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let Some(owner) = caller(&headers) else {
        return unauthorized();
    };
    match demo.ledger.find(&owner, &id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "payment-not-found",
            "Payment not found",
            format!("{owner} has no payment {id}"),
        ),
        Err(e) => unavailable(&e),
    }
}

async fn list_payments(State(demo): State<Arc<Demo>>, headers: HeaderMap) -> Response {
    let Some(owner) = caller(&headers) else {
        return unauthorized();
    };
    match demo.ledger.list(&owner).await {
        Ok(payments) => Json(serde_json::json!({ "count": payments.len(), "payments": payments }))
            .into_response(),
        Err(e) => unavailable(&e),
    }
}

async fn metrics(State(demo): State<Arc<Demo>>) -> Response {
    let content_type = "text/plain; version=0.0.4; charset=utf-8";
    ([(CONTENT_TYPE, content_type)], demo.exporter.render()).into_response()
}

/// 200 while the store answers a read within 2 s, else 503 problem+json, as `idem proxy`'s
/// `/readyz`: a load balancer sends payments only where they can be guarded.
async fn readyz(State(demo): State<Arc<Demo>>) -> Response {
    // Any read will do: the answer (no such record) says the store is reachable.
    let probe = RecordId::new(
        Scope::global(),
        Key::new("idem-serve-readyz").expect("a valid key"),
    );
    let detail = match tokio::time::timeout(Duration::from_secs(2), demo.store.get(&probe)).await {
        Ok(Ok(_)) => return "ready\n".into_response(),
        Ok(Err(e)) => format!("the idempotency store failed: {e}"),
        Err(_) => "the idempotency store did not answer within 2 s".to_owned(),
    };
    let status = StatusCode::SERVICE_UNAVAILABLE;
    let doc = idem_http::problem_json(
        "urn:idem:problem:store-unavailable",
        "Store unavailable",
        status,
        &detail,
    );
    let content_type = HeaderValue::from_static(idem_http::PROBLEM_JSON);
    (status, [(CONTENT_TYPE, content_type)], doc).into_response()
}

/// `2025-01-31T12:34:56Z` from a system time (UTC, whole seconds).
fn rfc3339(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let secs = i64::try_from(secs).unwrap_or(i64::MAX);
    jiff::Timestamp::from_second(secs)
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_827_696); // leap day 2000
        assert_eq!(rfc3339(t), "2000-02-29T12:34:56Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_735_689_599);
        assert_eq!(rfc3339(t), "2024-12-31T23:59:59Z");
    }

    #[test]
    fn validation() {
        let v = |s: &str| validate(&serde_json::from_str(s).unwrap());
        assert_eq!(
            v(r#"{"amount":1250,"currency":"EUR"}"#),
            Ok((1250, "EUR".into()))
        );
        assert!(v(r#"{"amount":0,"currency":"EUR"}"#).is_err());
        assert!(v(r#"{"amount":-5,"currency":"EUR"}"#).is_err());
        assert!(v(r#"{"amount":12.5,"currency":"EUR"}"#).is_err());
        assert!(v(r#"{"amount":1,"currency":"eur"}"#).is_err());
        assert!(v(r#"{"amount":1}"#).is_err());
        assert!(v(r#"{"currency":"EUR"}"#).is_err());
        assert!(v(r#"{"amount":1,"currency":"EUR","x":1}"#).is_err());
        assert!(v(r#"[1]"#).is_err());
    }

    #[test]
    fn callers() {
        let h = |v: &str| caller(&HeaderMap::from_iter([(AUTHORIZATION, v.parse().unwrap())]));
        assert_eq!(h("Bearer alice"), Some("alice".into()));
        assert_eq!(h("bearer bob"), Some("bob".into()));
        assert_eq!(h("Basic x"), None);
        assert_eq!(h(&format!("Bearer {}", "a".repeat(65))), None);
        assert_eq!(caller(&HeaderMap::new()), None);
    }
}
