//! End to end over real HTTP: an axum server on a loopback port behind the layer, a hyper
//! client, the in-memory store (wrapped where a test needs the store to fail): refusals,
//! failures injected at chosen steps, what is stored. The cases that depend on the store
//! (races, replay, mismatch, scopes, release, lease renewal, an unreachable store) run
//! against every backend in `backends.rs`. Last, the span and metrics of every guarded
//! request, neither of which gives the key away.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use idem_core::telemetry::KeyHash;
use idem_core::{Idem, Key, MemoryCapacity, MemoryStore, RecordId, Scope, Store};
use idem_http::{Config, IdempotencyLayer, KeepInFlight, MissingKey, Outcome, Unstored};
use idem_testkit::faults::FaultyStore;
use idem_testkit::telemetry::{logs_of, metrics_of, FmtSpan, Level};
use metrics_util::debugging::DebugValue;
use tower_layer::Layer;
use tower_service::Service;

mod support;

use support::*;

/// `POST /pay`, answered by [`pay`] behind `layer`.
fn pay_app(runs: &Runs, layer: IdempotencyLayer) -> Router {
    Router::new()
        .route("/pay", post_counted(runs, pay))
        .layer(layer)
}

fn layer(store: impl Store + 'static, config: Config, outcomes: &Outcomes) -> IdempotencyLayer {
    layer_with(Idem::new(store), config, outcomes)
}

// ---------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn missing_or_malformed_keys_are_refused_with_400() {
    let (server, runs, outcomes) =
        serve_pay(Idem::new(MemoryStore::new()), Config::default()).await;

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
    for _ in 0..2 {
        let reply = server.post("/pay", &[JSON], "{}").await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    assert_eq!(runs.get(), 2);
    assert_eq!(outcomes.count(Outcome::Unguarded), 2);
}

#[tokio::test]
async fn an_oversize_request_is_refused_with_413() {
    let config = Config::default().with_max_request_body(1024);
    let (server, runs, _) = serve_pay(Idem::new(MemoryStore::new()), config).await;
    let key = [("idempotency-key", "big-1")];

    // Declared length over the limit.
    let declared = server.post("/pay", &key, &"a".repeat(1025)).await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        declared.problem_type(),
        "urn:idem:problem:request-body-too-large"
    );
    // No declared length: the limit is found while reading.
    // A body of known chunks and unknown length, sent with chunked encoding.
    let chunks = (0..5).map(|_| Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b'a'; 300]))));
    let chunked = StreamBody::new(futures_util::stream::iter(chunks));
    let streamed = server
        .send_body("/pay", &key, chunked.boxed())
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

/// [`serve_pay`] on a memory store that fails when told to, and that store.
async fn serve_pay_faulty(config: Config) -> (Arc<FaultyStore>, Server, Runs, Outcomes) {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let (server, runs, outcomes) = serve_pay(Idem::from_arc(store.clone()), config).await;
    (store, server, runs, outcomes)
}

#[tokio::test]
async fn an_unavailable_store_fails_closed_with_503_or_open_when_asked() {
    let (store, server, runs, outcomes) = serve_pay_faulty(Config::default()).await;
    store.set_begin_down(true);
    let key = [("idempotency-key", "down-1"), JSON];

    let reply = server.post("/pay", &key, "{}").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(runs.get(), 0, "the handler ran unguarded");
    assert_eq!(outcomes.count(Outcome::StoreError), 1);

    // Back up: the key was never taken, so the request runs now.
    store.set_begin_down(false);
    assert_eq!(
        server.post("/pay", &key, "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 1);

    // Fail open, by choice.
    store.set_begin_down(true);
    let config = Config::default().with_fail_open(true);
    let idem = Idem::from_arc(store.clone());
    let open = serve(pay_app(&runs, layer_with(idem, config, &outcomes))).await;
    assert_eq!(
        open.post("/pay", &key, "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 2);
    assert_eq!(outcomes.count(Outcome::Unguarded), 1);
}

/// The in-memory store at its capacity: a new key gets 503 problem+json with `Retry-After`
/// and the handler does not run, while the keys already stored still replay.
#[tokio::test]
async fn a_full_memory_store_refuses_new_keys_with_503_and_still_replays() {
    let store = MemoryStore::new().with_capacity(MemoryCapacity::default().with_records(2));
    let (server, runs, outcomes) = serve_pay(Idem::new(store), Config::default()).await;
    let mut stored = Vec::new();
    for key in ["k1", "k2"] {
        let reply = server
            .post("/pay", &[("idempotency-key", key), JSON], "{}")
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        stored.push(reply);
    }
    let refused = server
        .post("/pay", &[("idempotency-key", "k3"), JSON], "{}")
        .await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.problem_type(), "urn:idem:problem:store-unavailable");
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(runs.get(), 2, "the handler ran for a refused key");
    assert_eq!(outcomes.count(Outcome::StoreError), 1);
    let again = server
        .post("/pay", &[("idempotency-key", "k1"), JSON], "{}")
        .await;
    again.assert_replay_of(&stored[0]);
    assert_eq!(runs.get(), 2);
}

/// A store failure after the handler ran is retried before the response is sent: a brief
/// outage (the next two writes fail), or a write that landed but was reported failed (its
/// retry finds the record completed with this very response). Sent once, then replayed.
#[tokio::test]
async fn a_store_failure_after_the_handler_is_retried_before_sending() {
    // (key, writes that fail, writes whose answer is lost, writes in all)
    for (key, failed, lost, writes) in [("flaky-1", 2, 0, 3), ("lost-answer-1", 0, 1, 2)] {
        let (store, server, runs, outcomes) = serve_pay_faulty(Config::default()).await;
        store.fail_next_completes(failed);
        store.lose_next_complete_answers(lost);
        let key = [("idempotency-key", key), JSON];
        let first = server.post("/pay", &key, "{}").await;
        assert_eq!(first.status, StatusCode::CREATED, "{key:?}");
        assert_eq!(outcomes.count(Outcome::Executed), 1, "{key:?}");
        assert_eq!(
            store.completes(),
            writes,
            "{key:?}: the failed write is retried"
        );
        let again = server.post("/pay", &key, "{}").await;
        again.assert_replay_of(&first);
        assert_eq!(runs.get(), 1, "{key:?}");
    }
}

#[tokio::test]
async fn a_response_that_cannot_be_stored_is_never_sent_as_done_and_never_rerun() {
    let config = Config::default().with_store_response_within(Duration::from_millis(300));
    let (store, server, runs, outcomes) = serve_pay_faulty(config).await;
    store.set_complete_down(true);
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
    store.set_complete_down(false);
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
async fn a_panicking_handler_releases_the_key() {
    let (server, runs, outcomes) = serve_counted(
        Idem::new(MemoryStore::new()),
        Config::default(),
        "/boom",
        |n, _, _| async move {
            if n == 1 {
                panic!("handler panicked on purpose (expected in this test)");
            }
            (StatusCode::CREATED, "ok")
        },
    )
    .await;
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
        let (server, runs, outcomes) = serve_counted(
            Idem::new(MemoryStore::new()),
            Config::default()
                .with_max_response_body(1024)
                .with_unstored(unstored),
            "/big",
            |_, _, _| async { "z".repeat(4096) },
        )
        .await;
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
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
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

/// A guarded POST with `key`, for a bare service behind the layer.
fn keyed_post(key: &'static str) -> http::Request<Full<Bytes>> {
    http::Request::post("/x")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// Drives `svc` to readiness, then calls it with `req`.
async fn ready_call<S, R>(svc: &mut S, req: R) -> S::Future
where
    S: tower_service::Service<R>,
    S::Error: std::fmt::Debug,
{
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
    svc.call(req)
}

/// A bare tower service whose first call fails: with an error (not a response), or when
/// `.1` is true, with a panic before it returns a future.
#[derive(Clone)]
struct FailsOnce(Runs, bool);

impl tower_service::Service<http::Request<idem_http::RequestBody<Full<Bytes>>>> for FailsOnce {
    type Response = http::Response<Full<Bytes>>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<idem_http::RequestBody<Full<Bytes>>>) -> Self::Future {
        let first = self.0.next() == 1;
        if first && self.1 {
            panic!("call panicked on purpose (expected in this test)");
        }
        std::future::ready(if first {
            Err("inner service failed")
        } else {
            Ok(http::Response::new(Full::new(Bytes::from_static(b"done"))))
        })
    }
}

/// [`FailsOnce`] (panicking when `panics`) behind the layer on a memory store: the service,
/// its run count and the layer's outcomes.
fn guarded_fails_once(panics: bool) -> (idem_http::IdempotencyService<FailsOnce>, Runs, Outcomes) {
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
    let layer = layer(MemoryStore::new(), Config::default(), &outcomes);
    (layer.layer(FailsOnce(runs.clone(), panics)), runs, outcomes)
}

#[tokio::test]
async fn an_inner_service_error_releases_the_key() {
    let (mut svc, runs, _) = guarded_fails_once(false);
    let request = || keyed_post("err-1");
    assert_eq!(
        ready_call(&mut svc, request()).await.await.unwrap_err(),
        "inner service failed"
    );
    let response = ready_call(&mut svc, request()).await.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().get("idempotent-replayed").is_none());
    let replay = ready_call(&mut svc, request()).await.await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn a_service_whose_call_panics_releases_the_key() {
    use futures_util::FutureExt;

    let (mut svc, runs, outcomes) = guarded_fails_once(true);
    let request = || keyed_post("call-panic-1");
    let first = std::panic::AssertUnwindSafe(ready_call(&mut svc, request()).await)
        .catch_unwind()
        .await;
    assert!(first.is_err(), "the panic was not resumed");
    // Released before the panic went on: the retry runs the service, it does not get 409.
    let retry = ready_call(&mut svc, request()).await.await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(runs.get(), 2);
    assert_eq!(outcomes.count(Outcome::NotStored), 1);
}

#[tokio::test]
async fn a_lease_lost_while_the_handler_runs_leaves_nothing_stored() {
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
    let store = MemoryStore::new();
    let idem = Idem::new(store.clone())
        .with_config(idem_core::Config::default().with_lease(Duration::from_millis(300)));
    let server = serve(pay_app(
        &runs,
        layer_with(idem, Config::default(), &outcomes),
    ))
    .await;
    let headers = [
        ("idempotency-key", "evicted-1"),
        ("x-delay-ms", "1500"),
        JSON,
    ];

    let first = server.spawn_post("/pay", &headers, "{}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    // An operator evicts the key while the handler runs: the lease is gone.
    let id = RecordId::new(Scope::global(), idem_core::Key::new("evicted-1").unwrap());
    assert!(store.evict(&id).await.unwrap());
    let first = first.await.unwrap();
    // The handler's 201 is not the key's answer (nothing will replay it): never sent as one.
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert_eq!(first.problem_type(), "urn:idem:problem:lease-lost");
    assert!(first.header("retry-after").is_some());
    assert_eq!(outcomes.count(Outcome::LeaseLost), 1);
    assert_eq!(
        store.get(&id).await.unwrap(),
        None,
        "nothing was stored under a lost lease"
    );
}

// ---------------------------------------------------------------------------------------
// The status table, anonymous callers, hints
// ---------------------------------------------------------------------------------------

/// `POST /status`: answers with the status its body names, counting runs.
fn status_app(runs: &Runs, layer: IdempotencyLayer) -> Router {
    Router::new()
        .route(
            "/status",
            post_counted(runs, |n, _, body| async move {
                let code = std::str::from_utf8(&body).unwrap().trim().parse().unwrap();
                (StatusCode::from_u16(code).unwrap(), format!("run {n}"))
            }),
        )
        .layer(layer)
}

#[tokio::test]
async fn by_default_final_answers_are_stored_and_transient_refusals_are_not() {
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
    let server = serve(status_app(
        &runs,
        layer(MemoryStore::new(), Config::default(), &outcomes),
    ))
    .await;
    let stored = [200, 201, 202, 204, 400, 404, 410, 422];
    let not_stored = [401, 403, 408, 409, 423, 425, 429, 500, 502, 503, 303];
    for code in stored.iter().chain(&not_stored) {
        let key = format!("status-{code}");
        let headers = [("idempotency-key", key.as_str())];
        let first = server.post("/status", &headers, &code.to_string()).await;
        assert_eq!(first.status.as_u16(), *code);
        let before = runs.get();
        let retry = server.post("/status", &headers, &code.to_string()).await;
        assert_eq!(retry.status.as_u16(), *code);
        if stored.contains(code) {
            assert!(retry.replayed(), "{code} must be stored");
            assert_eq!(runs.get(), before, "{code} ran again");
            assert!(first.header("idempotency-expires").is_some(), "{code}");
        } else {
            assert!(!retry.replayed(), "{code} must not be stored");
            assert_eq!(runs.get(), before + 1, "{code} was not run again");
            assert!(first.header("idempotency-expires").is_none(), "{code}");
        }
    }

    // Configurable: store every answer, a 429 too.
    let runs = Runs::default();
    let config = Config::default().with_store_status(|_| true);
    let server = serve(status_app(
        &runs,
        layer(MemoryStore::new(), config, &outcomes),
    ))
    .await;
    let headers = [("idempotency-key", "status-429-kept")];
    server.post("/status", &headers, "429").await;
    assert!(server.post("/status", &headers, "429").await.replayed());
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_request_without_a_principal_is_refused_with_401_unless_the_route_shares_one() {
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
    let refusing = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
        .with_scope(idem_http::bearer_scope)
        .with_observer({
            let outcomes = outcomes.clone();
            move |o| outcomes.0.lock().unwrap().push(o)
        });
    let server = serve(pay_app(&runs, refusing)).await;
    let key = ("idempotency-key", "anon-1");
    let as_alice = [key, JSON, ("authorization", "Bearer alice")];

    let anonymous = server.post("/pay", &[key, JSON], "{}").await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        anonymous.problem_type(),
        "urn:idem:problem:principal-missing"
    );
    assert_eq!(anonymous.header("www-authenticate"), Some("Bearer"));
    assert_eq!(runs.get(), 0, "the handler ran for an anonymous caller");
    assert_eq!(outcomes.count(Outcome::Rejected), 1);
    let named = server.post("/pay", &as_alice, "{}").await;
    assert_eq!(named.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);

    // No scope extractor at all: every request is anonymous, and refused.
    let bare = serve(pay_app(
        &runs,
        IdempotencyLayer::new(Idem::new(MemoryStore::new())),
    ))
    .await;
    let reply = bare.post("/pay", &as_alice, "{}").await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(runs.get(), 1);

    // A route that opts into the shared anonymous scope: anonymous callers share one key
    // space, apart from alice's.
    let shared = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
        .with_scope(idem_http::bearer_scope)
        .with_config(Config::default().with_anonymous(idem_http::Anonymous::Shared));
    let server = serve(pay_app(&runs, shared)).await;
    let first = server.post("/pay", &[key, JSON], "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = server.post("/pay", &[key, JSON], "{}").await;
    assert!(second.replayed());
    let alice = server.post("/pay", &as_alice, "{}").await;
    assert!(!alice.replayed());
    assert_eq!(runs.get(), 3);
}

#[tokio::test]
async fn retry_after_is_a_short_hint_and_the_expiry_is_advertised_from_the_first_response() {
    use std::time::SystemTime;

    async fn conflict_hint(lease: Duration, hint: Option<Duration>) -> u64 {
        let (runs, outcomes) = (Runs::default(), Outcomes::default());
        let idem = Idem::new(MemoryStore::new())
            .with_config(idem_core::Config::default().with_lease(lease));
        let mut config = Config::default();
        if let Some(hint) = hint {
            config = config.with_in_flight_retry_after(hint);
        }
        let server = serve(pay_app(&runs, layer_with(idem, config, &outcomes))).await;
        let headers = [("idempotency-key", "hint-1"), ("x-delay-ms", "1500"), JSON];
        let first = server.spawn_post("/pay", &headers, "{}");
        while runs.get() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let busy = server.post("/pay", &headers, "{}").await;
        assert_eq!(busy.status, StatusCode::CONFLICT);
        first.await.unwrap();
        busy.header("retry-after").unwrap().parse().unwrap()
    }
    // A 30 s lease: the hint is 1 s, not the lease time left.
    assert_eq!(conflict_hint(Duration::from_secs(30), None).await, 1);
    // Configurable.
    assert_eq!(
        conflict_hint(Duration::from_secs(30), Some(Duration::from_secs(5))).await,
        5
    );
    // Never past the lease time left (whole seconds, rounded up).
    assert!(conflict_hint(Duration::from_millis(1200), Some(Duration::from_secs(20))).await <= 2);

    // The first response says when the stored response is forgotten, as replays do.
    let (server, ..) = serve_pay(Idem::new(MemoryStore::new()), Config::default()).await;
    let headers = [("idempotency-key", "expires-1"), JSON];
    let first = server.post("/pay", &headers, "{}").await;
    let replay = server.post("/pay", &headers, "{}").await;
    for reply in [&first, &replay] {
        let expires =
            httpdate::parse_http_date(reply.header("idempotency-expires").unwrap()).unwrap();
        let left = expires.duration_since(SystemTime::now()).unwrap();
        assert!(left > Duration::from_secs(23 * 3600) && left <= Duration::from_secs(24 * 3600));
    }
}

#[tokio::test]
async fn a_key_in_structured_field_string_form_is_the_same_key_as_the_plain_token() {
    let (server, runs, _) = serve_pay(Idem::new(MemoryStore::new()), Config::default()).await;
    let as_alice = |key| {
        [
            ("idempotency-key", key),
            JSON,
            ("authorization", "Bearer alice"),
        ]
    };
    let plain = server.post("/pay", &as_alice("order-7"), "{}").await;
    assert_eq!(plain.status, StatusCode::CREATED);
    let quoted = server.post("/pay", &as_alice("\"order-7\""), "{}").await;
    assert!(quoted.replayed(), "the quoted form is another key");
    quoted.assert_replay_of(&plain);
    // And the other way round: a key first sent quoted is replayed to its plain form.
    let first = server.post("/pay", &as_alice("\"order-8\""), "{}").await;
    let second = server.post("/pay", &as_alice("order-8"), "{}").await;
    second.assert_replay_of(&first);
    assert_eq!(runs.get(), 2);
}

/// `POST /unknown`: answers 504 marked [`idem_http::KeepInFlight::Always`], or, with body
/// `broken`, a 200 whose body breaks off, marked [`idem_http::KeepInFlight::IfBodyBreaks`].
fn unknown_app(runs: &Runs, layer: IdempotencyLayer) -> Router {
    Router::new()
        .route(
            "/unknown",
            post_counted(runs, |_, _, body| async move {
                if body == "broken" {
                    let frames = futures_util::stream::iter([
                        Ok::<_, std::io::Error>(Frame::data(Bytes::from("part"))),
                        Err(std::io::Error::other("upstream reset")),
                    ]);
                    let body = axum::body::Body::new(StreamBody::new(frames));
                    return (Extension(KeepInFlight::IfBodyBreaks), body).into_response();
                }
                let keep = Extension(KeepInFlight::Always);
                (StatusCode::GATEWAY_TIMEOUT, keep, "lost").into_response()
            }),
        )
        .layer(layer)
}

#[tokio::test]
async fn a_response_marked_keep_in_flight_leaves_the_key_held_until_its_lease_ends() {
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
    let idem = Idem::new(MemoryStore::new())
        .with_config(idem_core::Config::default().with_lease(Duration::from_millis(600)));
    let server = serve(unknown_app(
        &runs,
        layer_with(idem, Config::default(), &outcomes),
    ))
    .await;
    for body in ["lost", "broken"] {
        let key = format!("unknown-{body}");
        let headers = [
            ("idempotency-key", key.as_str()),
            ("authorization", "Bearer alice"),
        ];
        let send = || async {
            if body == "lost" {
                let reply = server.post("/unknown", &headers, body).await;
                assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT);
                return;
            }
            // The body breaks off: the client sees the break (the head and the cut may reach
            // it together, or the head not at all).
            let mut req = http::Request::post(format!("{}/unknown", server.base));
            for (n, v) in headers {
                req = req.header(n, v);
            }
            let req = req.body(Full::new(Bytes::from(body)).boxed()).unwrap();
            if let Ok(response) = server.client.request(req).await {
                assert!(response.into_body().collect().await.is_err());
            }
        };
        send().await;
        // Neither stored nor released: retries get 409 while the lease lasts.
        let retry = server.post("/unknown", &headers, body).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{body}");
        assert_eq!(runs.get(), if body == "lost" { 1 } else { 3 });
        tokio::time::sleep(Duration::from_millis(700)).await;
        // After the lease, a retry takes the key over and runs again.
        send().await;
        assert_eq!(runs.get(), if body == "lost" { 2 } else { 4 });
    }
}

// ---------------------------------------------------------------------------------------
// Telemetry
// ---------------------------------------------------------------------------------------

const KEY: &str = "secret-order-key-7";

/// The same request twice through the layer: the handler runs, then its response replays.
async fn twice() {
    let app = Router::new().route("/pay", post(|| async { (StatusCode::CREATED, "paid") }));
    let layer = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
        .with_scope(|_| Some(Scope::new("tenant-a").unwrap()));
    let mut service = layer.layer(app);
    for expected in [StatusCode::CREATED, StatusCode::CREATED] {
        let request = http::Request::post("/pay")
            .header("idempotency-key", KEY)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
            .unwrap();
        let response = service.call(request).await.unwrap();
        assert_eq!(response.status(), expected);
    }
}

#[test]
fn requests_are_counted_by_outcome_and_the_handler_timed() {
    let mut counters = Vec::new();
    let mut handler_samples = 0;
    for (key, _, _, value) in metrics_of(twice()).into_vec() {
        let key = key.key().clone();
        let labels: Vec<String> = key.labels().map(|l| l.value().to_owned()).collect();
        match value {
            DebugValue::Counter(n) if key.name().starts_with("idem_http") && n > 0 => {
                counters.push(format!("{} {} {n}", key.name(), labels.join(",")));
            }
            DebugValue::Histogram(values) if key.name() == "idem_http_handler_duration_seconds" => {
                handler_samples += values.len();
            }
            _ => {}
        }
    }
    counters.sort();
    // Every outcome is registered (at 0) when the layer is built; two of them moved.
    assert_eq!(
        counters,
        [
            "idem_http_requests_total executed 1",
            "idem_http_requests_total replayed 1",
        ]
    );
    assert_eq!(
        handler_samples, 1,
        "the handler ran once and was timed once"
    );
}

#[test]
fn request_spans_carry_the_outcome_and_the_key_hash_only() {
    let out = logs_of(Level::INFO, FmtSpan::CLOSE, twice());
    let id = RecordId::new(Scope::new("tenant-a").unwrap(), Key::new(KEY).unwrap());
    let hash = format!("key_hash={}", KeyHash::of(&id));
    assert_eq!(out.matches("idem.http").count(), 2, "{out}");
    assert_eq!(out.matches(&hash).count(), 2, "{out}");
    for field in [
        "method=POST",
        "path=\"/pay\"",
        "scope=tenant-a",
        "outcome=\"executed\"",
        "outcome=\"replayed\"",
        "attempt=1",
        "status=201",
    ] {
        assert!(out.contains(field), "no {field} in {out}");
    }
    assert!(!out.contains(KEY), "the key leaked: {out}");
    assert!(!out.contains("amount"), "the body leaked: {out}");
}
