//! End to end over real HTTP: an axum server on a loopback port behind the layer, a hyper
//! client, the in-memory store (wrapped where a test needs the store to fail).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_core::{
    Begin, BeginRequest, Completion, Error, Idem, Lease, MemoryStore, Record, RecordId, Scope,
    Store,
};
use idem_http::{Config, IdempotencyLayer, MissingKey, Outcome, Unstored};

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

type ClientBody = BoxBody<Bytes, Infallible>;

struct Server {
    base: String,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, ClientBody>,
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(doc["status"], self.status.as_u16());
        doc["type"].as_str().unwrap().to_owned()
    }
}

async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        base: format!("http://{addr}"),
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

impl Server {
    async fn send_body(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: ClientBody,
    ) -> Result<Reply, hyper_util::client::legacy::Error> {
        let mut req = http::Request::post(format!("{}{path}", self.base));
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        let response = self.client.request(req.body(body).unwrap()).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let body = Full::new(Bytes::from(body.to_owned())).boxed();
        self.send_body(path, headers, body).await.unwrap()
    }
}

/// Counts runs of the protected side effect.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn next(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// Records the layer's outcomes.
#[derive(Clone, Default)]
struct Outcomes(Arc<Mutex<Vec<Outcome>>>);

impl Outcomes {
    fn count(&self, outcome: Outcome) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|o| **o == outcome)
            .count()
    }
}

fn layer(store: impl Store + 'static, config: Config, outcomes: &Outcomes) -> IdempotencyLayer {
    layer_with(Idem::new(store), config, outcomes)
}

fn layer_with(idem: Idem, config: Config, outcomes: &Outcomes) -> IdempotencyLayer {
    let outcomes = outcomes.clone();
    IdempotencyLayer::new(idem)
        .with_config(config)
        .with_scope(|parts| {
            let auth = parts.headers.get("authorization")?.to_str().ok()?;
            Scope::new(auth.strip_prefix("Bearer ")?).ok()
        })
        .with_observer(move |o| outcomes.0.lock().unwrap().push(o))
}

/// `POST /pay`: one run of the side effect per call, answering 201 with the run number and
/// the request body, after `x-delay-ms`.
fn pay_app(runs: &Runs, layer: IdempotencyLayer) -> Router {
    let runs = runs.clone();
    Router::new()
        .route(
            "/pay",
            post(move |headers: HeaderMap, body: Bytes| {
                let runs = runs.clone();
                async move {
                    let n = runs.next();
                    if let Some(ms) = headers.get("x-delay-ms") {
                        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    let doc = serde_json::json!({
                        "run": n,
                        "request": String::from_utf8_lossy(&body),
                    });
                    (StatusCode::CREATED, axum::Json(doc))
                }
            }),
        )
        .layer(layer)
}

const JSON: (&str, &str) = ("content-type", "application/json");

// ---------------------------------------------------------------------------------------
// Races
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_identical_requests_runs_the_handler_once() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let server = serve(pay_app(
        &runs,
        layer(MemoryStore::new(), Config::default(), &outcomes),
    ))
    .await;
    let server = Arc::new(server);

    let mut tasks = Vec::new();
    for _ in 0..24 {
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            server
                .post(
                    "/pay",
                    &[
                        ("idempotency-key", "burst-1"),
                        ("authorization", "Bearer alice"),
                        ("x-delay-ms", "300"),
                        JSON,
                    ],
                    r#"{"amount": 1250, "currency": "EUR"}"#,
                )
                .await
        }));
    }
    let mut created = Vec::new();
    let mut conflicts = 0;
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            StatusCode::CREATED => created.push(reply.body),
            StatusCode::CONFLICT => {
                assert_eq!(reply.problem_type(), "urn:idem:problem:request-in-flight");
                let after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!((1..=30).contains(&after), "retry-after {after}");
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert_eq!(runs.get(), 1, "the handler ran more than once");
    assert!(!created.is_empty());
    assert!(created.iter().all(|b| *b == created[0]));
    assert_eq!(created.len() + conflicts, 24);
    assert_eq!(outcomes.count(Outcome::Executed), 1);
    assert_eq!(outcomes.count(Outcome::InFlight), conflicts);

    // Every caller that got 409 gets the one stored response when it retries.
    let retry = server
        .post(
            "/pay",
            &[
                ("idempotency-key", "burst-1"),
                ("authorization", "Bearer alice"),
                JSON,
            ],
            r#"{"currency": "EUR", "amount": 1250}"#,
        )
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, created[0]);
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_wait_every_caller_of_a_burst_gets_the_one_response() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let idem = Idem::new(MemoryStore::new()).with_config(idem_core::Config {
        wait: Some(Duration::from_secs(5)),
        ..idem_core::Config::default()
    });
    let server = Arc::new(
        serve(pay_app(
            &runs,
            layer_with(idem, Config::default(), &outcomes),
        ))
        .await,
    );

    let mut tasks = Vec::new();
    for _ in 0..12 {
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            server
                .post(
                    "/pay",
                    &[("idempotency-key", "burst-2"), ("x-delay-ms", "200"), JSON],
                    r#"{"amount": 1}"#,
                )
                .await
        }));
    }
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    assert_eq!(runs.get(), 1);
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert!(replies.iter().all(|r| r.body == replies[0].body));
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

// ---------------------------------------------------------------------------------------
// Replay, mismatch, scope
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_replay_is_byte_for_byte_with_allowed_headers_only() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/blob",
            post(move || {
                let r = r.clone();
                async move {
                    let n = r.next() as u8;
                    let body: Vec<u8> = (0..=255u8).chain([0xff, 0xfe, n]).collect();
                    let mut headers = HeaderMap::new();
                    headers.insert(
                        "content-type",
                        HeaderValue::from_static("application/octet-stream"),
                    );
                    headers.insert("location", HeaderValue::from_static("/blob/7"));
                    headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
                    headers.insert("x-request-id", HeaderValue::from_static("req-1"));
                    (StatusCode::ACCEPTED, headers, body).into_response()
                }
            }),
        )
        .layer(layer(MemoryStore::new(), Config::default(), &outcomes));
    let server = serve(app).await;
    let headers = [("idempotency-key", "\"blob-1\"")];

    let first = server.post("/blob", &headers, "").await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert!(!first.replayed());
    assert_eq!(first.header("set-cookie"), Some("session=secret"));
    assert_eq!(first.header("x-request-id"), Some("req-1"));

    let again = server.post("/blob", &headers, "").await;
    assert_eq!(runs.get(), 1);
    assert_eq!(again.status, StatusCode::ACCEPTED);
    assert_eq!(again.body, first.body, "replayed body differs");
    assert_eq!(again.body.len(), 259);
    assert!(again.replayed());
    assert_eq!(
        again.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(again.header("location"), Some("/blob/7"));
    assert_eq!(
        again.header("set-cookie"),
        None,
        "Set-Cookie must never be replayed"
    );
    assert_eq!(
        again.header("x-request-id"),
        None,
        "unlisted headers are not replayed"
    );
    assert_eq!(again.header("content-length"), Some("259"));
    let expires = httpdate::parse_http_date(again.header("idempotency-expires").unwrap()).unwrap();
    let left = expires.duration_since(SystemTime::now()).unwrap();
    assert!(left > Duration::from_secs(23 * 3600) && left <= Duration::from_secs(24 * 3600));

    // The key in its quoted (RFC 8941) and bare forms is the same key.
    let bare = server
        .post("/blob", &[("idempotency-key", "blob-1")], "")
        .await;
    assert!(bare.replayed());
    assert_eq!(bare.body, first.body);
    assert_eq!(outcomes.count(Outcome::Replayed), 2);
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_refused_with_422() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let server = serve(pay_app(
        &runs,
        layer(MemoryStore::new(), Config::default(), &outcomes),
    ))
    .await;
    let key = ("idempotency-key", "k-mismatch");

    let first = server.post("/pay", &[key, JSON], r#"{"amount": 1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Same JSON, other key order and spacing: a retry, not a mismatch.
    let same = server
        .post("/pay", &[key, JSON], r#"{ "amount" : 1 }"#)
        .await;
    assert!(same.replayed());
    let other = server.post("/pay", &[key, JSON], r#"{"amount": 2}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.problem_type(),
        "urn:idem:problem:idempotency-key-reused"
    );
    assert_eq!(runs.get(), 1);
    assert_eq!(outcomes.count(Outcome::Mismatch), 1);
}

#[tokio::test]
async fn one_scope_never_sees_another_scopes_response() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let server = serve(pay_app(
        &runs,
        layer(MemoryStore::new(), Config::default(), &outcomes),
    ))
    .await;
    let body = r#"{"amount": 5}"#;
    let as_user = |user: &'static str| {
        [
            ("idempotency-key", "shared-key"),
            ("authorization", user),
            JSON,
        ]
    };

    let alice = server.post("/pay", &as_user("Bearer alice"), body).await;
    let bob = server.post("/pay", &as_user("Bearer bob"), body).await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed(), "bob was handed alice's response");
    assert_ne!(alice.body, bob.body);
    assert_eq!(runs.get(), 2);

    let alice_again = server.post("/pay", &as_user("Bearer alice"), body).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    // Anonymous requests share the global scope, apart from every named one.
    let anonymous = server
        .post("/pay", &[("idempotency-key", "shared-key"), JSON], body)
        .await;
    assert!(!anonymous.replayed());
    assert_eq!(runs.get(), 3);
}

// ---------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn missing_or_malformed_keys_are_refused_with_400() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let server = serve(pay_app(
        &runs,
        layer(MemoryStore::new(), Config::default(), &outcomes),
    ))
    .await;

    let missing = server.post("/pay", &[JSON], "{}").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.problem_type(),
        "urn:idem:problem:idempotency-key-missing"
    );
    for bad in ["has space", "\"unterminated", &"x".repeat(256)] {
        let reply = server
            .post("/pay", &[("idempotency-key", bad), JSON], "{}")
            .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(
            reply.problem_type(),
            "urn:idem:problem:idempotency-key-invalid"
        );
    }
    assert_eq!(runs.get(), 0);
    assert_eq!(outcomes.count(Outcome::Rejected), 4);

    // Optional keys: the request runs unguarded.
    let outcomes = Outcomes::default();
    let config = Config::default().with_missing_key(MissingKey::PassThrough);
    let server = serve(pay_app(&runs, layer(MemoryStore::new(), config, &outcomes))).await;
    assert_eq!(
        server.post("/pay", &[JSON], "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        server.post("/pay", &[JSON], "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 2);
    assert_eq!(outcomes.count(Outcome::Unguarded), 2);
}

/// A body of known chunks and unknown length, sent with chunked encoding.
struct Chunked(VecDeque<Bytes>);

impl Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
    }
}

#[tokio::test]
async fn an_oversize_request_is_refused_with_413() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let config = Config::default().with_max_request_body(1024);
    let server = serve(pay_app(&runs, layer(MemoryStore::new(), config, &outcomes))).await;
    let key = [("idempotency-key", "big-1")];

    // Declared length over the limit.
    let declared = server.post("/pay", &key, &"a".repeat(1025)).await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        declared.problem_type(),
        "urn:idem:problem:request-body-too-large"
    );
    // No declared length: the limit is found while reading.
    let chunks = (0..5).map(|_| Bytes::from(vec![b'a'; 300])).collect();
    let streamed = server
        .send_body("/pay", &key, Chunked(chunks).boxed())
        .await
        .unwrap();
    assert_eq!(streamed.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.get(), 0);
    // At the limit: accepted.
    let ok = server.post("/pay", &key, &"a".repeat(1024)).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);
}

// ---------------------------------------------------------------------------------------
// Store failures
// ---------------------------------------------------------------------------------------

/// The in-memory store, with switches that make its calls fail as an unreachable store's.
#[derive(Debug, Default)]
struct Flaky {
    inner: MemoryStore,
    begin_down: AtomicBool,
    complete_down: AtomicBool,
    /// `complete` fails this many more times, then works.
    complete_failures: AtomicUsize,
    /// `complete` writes, then reports a timeout, this many more times.
    complete_lost_answers: AtomicUsize,
}

fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

fn down() -> Error {
    Error::unavailable("flaky", std::io::Error::other("connection refused"))
}

#[async_trait]
impl Store for Flaky {
    fn name(&self) -> &'static str {
        "flaky"
    }
    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin, Error> {
        if self.begin_down.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner.begin(req).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        c: &Completion,
        retention: Duration,
    ) -> Result<(), Error> {
        if take_one(&self.complete_failures) || self.complete_down.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner.complete(lease, c, retention).await?;
        if take_one(&self.complete_lost_answers) {
            return Err(down());
        }
        Ok(())
    }
    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        self.inner.release(lease).await
    }
    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        self.inner.extend(lease, by).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }
    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        self.inner.evict(id).await
    }
}

#[tokio::test]
async fn an_unavailable_store_fails_closed_with_503_or_open_when_asked() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let store = Arc::new(Flaky::default());
    store.begin_down.store(true, Ordering::SeqCst);
    let idem = Idem::from_arc(store.clone());
    let server = serve(pay_app(
        &runs,
        layer_with(idem.clone(), Config::default(), &outcomes),
    ))
    .await;
    let key = [("idempotency-key", "down-1"), JSON];

    let reply = server.post("/pay", &key, "{}").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(runs.get(), 0, "the handler ran unguarded");
    assert_eq!(outcomes.count(Outcome::StoreError), 1);

    // Back up: the key was never taken, so the request runs now.
    store.begin_down.store(false, Ordering::SeqCst);
    assert_eq!(
        server.post("/pay", &key, "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 1);

    // Fail open, by choice.
    store.begin_down.store(true, Ordering::SeqCst);
    let config = Config::default().with_fail_open(true);
    let open = serve(pay_app(&runs, layer_with(idem, config, &outcomes))).await;
    assert_eq!(
        open.post("/pay", &key, "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 2);
    assert_eq!(outcomes.count(Outcome::Unguarded), 1);
}

#[tokio::test]
async fn a_brief_store_failure_after_the_handler_is_retried_before_sending() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let store = Arc::new(Flaky::default());
    store.complete_failures.store(2, Ordering::SeqCst);
    let server = serve(pay_app(
        &runs,
        layer_with(Idem::from_arc(store.clone()), Config::default(), &outcomes),
    ))
    .await;
    let key = [("idempotency-key", "flaky-1"), JSON];

    let first = server.post("/pay", &key, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = server.post("/pay", &key, "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_response_that_cannot_be_stored_is_never_sent_as_done_and_never_rerun() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let store = Arc::new(Flaky::default());
    store.complete_down.store(true, Ordering::SeqCst);
    let config = Config::default().with_store_response_within(Duration::from_millis(300));
    let server = serve(pay_app(
        &runs,
        layer_with(Idem::from_arc(store.clone()), config, &outcomes),
    ))
    .await;
    let key = [("idempotency-key", "unrecorded-1"), JSON];

    let first = server.post("/pay", &key, "{}").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        first.problem_type(),
        "urn:idem:problem:outcome-not-recorded"
    );
    assert!(first.header("retry-after").is_some());
    assert_eq!(outcomes.count(Outcome::StoreError), 1);

    // The key is still held (not released): a retry now does not run the handler again.
    let retry = server.post("/pay", &key, "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(runs.get(), 1);

    // The store recovers: the background task stores the response, and a retry gets it.
    store.complete_down.store(false, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let replay = loop {
        let reply = server.post("/pay", &key, "{}").await;
        if reply.status != StatusCode::CONFLICT {
            break reply;
        }
        assert!(tokio::time::Instant::now() < deadline, "never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    let doc: serde_json::Value = serde_json::from_slice(&replay.body).unwrap();
    assert_eq!(doc["run"], 1);
    assert_eq!(runs.get(), 1);
}

// ---------------------------------------------------------------------------------------
// What is stored
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_5xx_releases_the_key_and_a_4xx_is_stored() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/flaky",
            post(move |body: String| {
                let r = r.clone();
                async move {
                    let n = r.next();
                    match (body.as_str(), n) {
                        ("client-error", _) => (StatusCode::BAD_REQUEST, format!("bad {n}")),
                        (_, 1) => (StatusCode::BAD_GATEWAY, format!("down {n}")),
                        _ => (StatusCode::CREATED, format!("made {n}")),
                    }
                }
            }),
        )
        .layer(layer(MemoryStore::new(), Config::default(), &outcomes));
    let server = serve(app).await;
    let key = [("idempotency-key", "five-1")];

    let first = server.post("/flaky", &key, "x").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let second = server.post("/flaky", &key, "x").await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed(), "a 5xx must not be stored");
    assert_eq!(&second.body[..], b"made 2");
    assert_eq!(runs.get(), 2);
    assert!(server.post("/flaky", &key, "x").await.replayed());

    let key = [("idempotency-key", "four-1")];
    let bad = server.post("/flaky", &key, "client-error").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let bad_again = server.post("/flaky", &key, "client-error").await;
    assert!(bad_again.replayed());
    assert_eq!(bad_again.body, bad.body);
    assert_eq!(runs.get(), 3);
    assert_eq!(outcomes.count(Outcome::NotStored), 1);
}

#[tokio::test]
async fn a_panicking_handler_releases_the_key() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/boom",
            post(move || {
                let r = r.clone();
                async move {
                    if r.next() == 1 {
                        panic!("handler panicked on purpose (expected in this test)");
                    }
                    (StatusCode::CREATED, "ok")
                }
            }),
        )
        .layer(layer(MemoryStore::new(), Config::default(), &outcomes));
    let server = serve(app).await;
    let key = [("idempotency-key", "boom-1")];

    // The panic is resumed after the release: the connection breaks, as it would without
    // the layer.
    let body = Full::new(Bytes::new()).boxed();
    assert!(server.send_body("/boom", &key, body).await.is_err());
    let retry = server.post("/boom", &key, "").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(runs.get(), 2);
    assert_eq!(outcomes.count(Outcome::NotStored), 1);
}

#[tokio::test]
async fn an_oversize_response_is_sent_but_not_stored() {
    for (unstored, retry_status, runs_after) in [
        (Unstored::KeepLease, StatusCode::CONFLICT, 1),
        (Unstored::Release, StatusCode::OK, 2),
    ] {
        let runs = Runs::default();
        let outcomes = Outcomes::default();
        let r = runs.clone();
        let app = Router::new()
            .route(
                "/big",
                post(move || {
                    let r = r.clone();
                    async move {
                        r.next();
                        "z".repeat(4096)
                    }
                }),
            )
            .layer(layer(
                MemoryStore::new(),
                Config::default()
                    .with_max_response_body(1024)
                    .with_unstored(unstored),
                &outcomes,
            ));
        let server = serve(app).await;
        let key = [("idempotency-key", "big-response")];

        let first = server.post("/big", &key, "").await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(first.body.len(), 4096, "the response must be sent whole");
        let retry = server.post("/big", &key, "").await;
        assert_eq!(retry.status, retry_status, "{unstored:?}");
        assert!(!retry.replayed());
        assert_eq!(runs.get(), runs_after, "{unstored:?}");
        assert!(outcomes.count(Outcome::NotStored) >= 1);
    }
}

#[tokio::test]
async fn other_methods_pass_through_untouched() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/thing",
            axum::routing::put(move || {
                let r = r.clone();
                async move { format!("put {}", r.next()) }
            }),
        )
        .layer(layer(MemoryStore::new(), Config::default(), &outcomes));
    let server = serve(app).await;
    for n in 1..=2 {
        let req = http::Request::put(format!("{}/thing", server.base))
            .header("idempotency-key", "put-1")
            .body(Full::new(Bytes::new()).boxed())
            .unwrap();
        let response = server.client.request(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("idempotent-replayed").is_none());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, format!("put {n}"));
    }
    assert_eq!(outcomes.0.lock().unwrap().len(), 0);
}

#[tokio::test]
async fn a_slow_handler_keeps_its_lease_alive() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let idem = Idem::new(MemoryStore::new()).with_config(idem_core::Config {
        lease: Duration::from_millis(600),
        ..idem_core::Config::default()
    });
    let server = Arc::new(
        serve(pay_app(
            &runs,
            layer_with(idem, Config::default(), &outcomes),
        ))
        .await,
    );
    let headers = [("idempotency-key", "slow-1"), ("x-delay-ms", "2000"), JSON];

    let first = {
        let server = server.clone();
        tokio::spawn(async move { server.post("/pay", &headers, "{}").await })
    };
    // Well past the first lease's length: without renewal a retry would take the key over.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let retry = server.post("/pay", &headers, "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);
}

/// A bare tower service whose first call fails with an error (not a response).
#[derive(Clone)]
struct FailsOnce(Runs);

impl tower_service::Service<http::Request<idem_http::RequestBody<Full<Bytes>>>> for FailsOnce {
    type Response = http::Response<Full<Bytes>>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<idem_http::RequestBody<Full<Bytes>>>) -> Self::Future {
        std::future::ready(if self.0.next() == 1 {
            Err("inner service failed")
        } else {
            Ok(http::Response::new(Full::new(Bytes::from_static(b"done"))))
        })
    }
}

#[tokio::test]
async fn an_inner_service_error_releases_the_key() {
    use tower_layer::Layer;
    use tower_service::Service;

    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let mut svc =
        layer(MemoryStore::new(), Config::default(), &outcomes).layer(FailsOnce(runs.clone()));
    let request = || {
        http::Request::post("/x")
            .header("idempotency-key", "err-1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
    assert_eq!(
        svc.call(request()).await.unwrap_err(),
        "inner service failed"
    );
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
    let response = svc.call(request()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().get("idempotent-replayed").is_none());
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
    let replay = svc.call(request()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn a_stored_response_whose_answer_was_lost_is_sent() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let store = Arc::new(Flaky::default());
    store.complete_lost_answers.store(1, Ordering::SeqCst);
    let server = serve(pay_app(
        &runs,
        layer_with(Idem::from_arc(store.clone()), Config::default(), &outcomes),
    ))
    .await;
    let key = [("idempotency-key", "lost-answer-1"), JSON];

    // The write landed but was reported failed; the retry of the write finds the record
    // completed with this very response.
    let first = server.post("/pay", &key, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(outcomes.count(Outcome::Executed), 1);
    let again = server.post("/pay", &key, "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_lease_lost_while_the_handler_runs_leaves_nothing_stored() {
    let runs = Runs::default();
    let outcomes = Outcomes::default();
    let store = MemoryStore::new();
    let idem = Idem::new(store.clone()).with_config(idem_core::Config {
        lease: Duration::from_millis(300),
        ..idem_core::Config::default()
    });
    let server = Arc::new(
        serve(pay_app(
            &runs,
            layer_with(idem, Config::default(), &outcomes),
        ))
        .await,
    );
    let headers = [
        ("idempotency-key", "evicted-1"),
        ("x-delay-ms", "1500"),
        JSON,
    ];

    let first = {
        let server = server.clone();
        tokio::spawn(async move { server.post("/pay", &headers, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    // An operator evicts the key while the handler runs: the lease is gone.
    let id = RecordId::new(Scope::global(), idem_core::Key::new("evicted-1").unwrap());
    assert!(store.evict(&id).await.unwrap());
    let first = first.await.unwrap();
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the handler's answer is still sent"
    );
    assert!(!first.replayed());
    assert_eq!(outcomes.count(Outcome::NotStored), 1);
    assert_eq!(
        store.get(&id).await.unwrap(),
        None,
        "nothing was stored under a lost lease"
    );
}
