//! # idem-http
//!
//! A tower middleware that makes `POST` and `PATCH` handlers idempotent: a request carrying
//! an `Idempotency-Key` header runs the handler at most once per key, and every retry gets
//! the stored response. It follows the IETF Idempotency-Key draft, works in any tower-based
//! server (axum, tonic's HTTP layer, hyper with `tower`), and depends on the `http` and
//! `tower` crates only, not on a web framework. Keys live in any [`idem_core::Store`]:
//! the in-memory store, Redis or Postgres.
//!
//! ## Quick start (axum)
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use axum::{routing::post, Router};
//! use idem_core::{Idem, MemoryStore};
//! use idem_http::IdempotencyLayer;
//! use tower_service::Service;
//!
//! let layer = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
//!     .with_scope(idem_http::bearer_scope);
//! let mut app = Router::new()
//!     .route("/payments", post(|| async { (axum::http::StatusCode::CREATED, "paid") }))
//!     .layer(layer);
//!
//! let request = || {
//!     http::Request::post("/payments")
//!         .header("idempotency-key", "3f9c-payment")
//!         .header("authorization", "Bearer alice")
//!         .body(axum::body::Body::from("{}"))
//!         .unwrap()
//! };
//! let first = app.call(request()).await.unwrap();
//! assert_eq!(first.status(), 201);
//! let retry = app.call(request()).await.unwrap();
//! assert_eq!(retry.status(), 201);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! ## What a guarded request gets
//!
//! Requests whose method is not in [`Config::methods`] pass through untouched. The others:
//!
//! | case | answer |
//! |---|---|
//! | no key | 400, or passed through unguarded with [`MissingKey::PassThrough`] |
//! | malformed key (not 1 to 255 bytes of visible ASCII; an RFC 8941 quoted string is unwrapped first), or the header twice | 400 |
//! | no principal: the scope extractor found none ([`IdempotencyLayer::with_scope`]) | 401, unless the route opts into a shared anonymous scope ([`Anonymous::Shared`]) |
//! | body larger than [`Config::max_request_body`] | 413 (before the handler runs) |
//! | first request for the key | the handler runs; its response is stored, then sent, with `Idempotency-Expires: <HTTP date>`, when the stored response is forgotten; a streamed body is sent as it comes and stored at its end (below) |
//! | retry of a completed request | the stored status, body and allowed headers, plus `Idempotent-Replayed: true` and `Idempotency-Expires` |
//! | same key, different request | 422 |
//! | same key while the first is running | 409 with a short `Retry-After` ([`Config::in_flight_retry_after`], 1 s by default, never past the first request's lease time left), or, with [`idem_core::Config::wait`] set, the first request's response once it is stored |
//! | same key while the first is running, with `Prefer: wait=N` | waits up to `min(N, `[`Config::max_wait`]`)` for the stored response, then 409; `Preference-Applied: wait=M` |
//! | `Prefer: respond-async` | 202 at once with the `Location` of the key's status monitor ([`monitor`]); the work runs on; a duplicate in flight gets the same 202 |
//! | key whose stored response was forgotten, under [`idem_core::AfterRetention::Refuse`] | 410 `key-expired` while its tombstone is kept; the handler does not run |
//! | store unavailable | 503 with `Retry-After` ([`Config::store_retry_after`]); with [`Config::fail_open`], the handler runs unguarded |
//!
//! Every answer for a key names its status monitor: `Link: </.idem/keys/by-key/{key}>;
//! rel="monitor"` (see [`monitor`]).
//!
//! The layer's own answers are `application/problem+json` documents (RFC 9457) whose `type`
//! is `urn:idem:problem:<kind>`: `idempotency-key-missing`, `idempotency-key-invalid`,
//! `request-body-too-large`, `request-body-unreadable`, `idempotency-key-reused`,
//! `principal-missing`, `request-in-flight`, `store-unavailable`, `store-error`,
//! `outcome-not-recorded`, `lease-lost`, `stored-response-invalid`, `key-expired`, and from
//! the status monitor `not-completed` and `method-not-allowed`.
//!
//! ## Work outlives the connection, scope, fingerprint, what is stored
//!
//! docs/http-middleware.md says these once: the claimed work runs to its end when the
//! client disconnects; keys are scoped by [`IdempotencyLayer::with_scope`] ([`bearer_scope`]
//! is ready-made); the fingerprint covers the method, the path with its query,
//! [`Config::fingerprint_headers`] and the body (canonical JSON, [`Config::json_selection`]);
//! [`default_store_status`] says which responses are stored, and the key is released for the
//! others, for an error of the inner service and for a panic (resumed after the release).
//! Only [`Config::replay_headers`] are stored; trailers never are.
//!
//! An inner service that cannot know its outcome (a proxy whose upstream connection broke
//! after the request was sent) marks its response with [`KeepInFlight`]: the layer then
//! neither stores it nor releases the key, which stays in flight until its lease ends.
//!
//! A response body larger than [`Config::max_response_body`] is sent as it streams but not
//! stored; the key is then left to its lease ([`Unstored::KeepLease`], the default:
//! retries get 409 until the lease expires, then run the handler again) or released
//! ([`Unstored::Release`]).
//!
//! While the handler runs, its lease is renewed every third of [`idem_core::Config::lease`]
//! by the engine's heartbeat ([`idem_core::Idem::run_with_heartbeat`];
//! [`Config::heartbeat`]), so a slow handler is not taken over by a retry. The handler
//! finds an [`IdempotencyInfo`] and a [`LeaseHandle`] in its request extensions:
//! `attempt` above 1 means an earlier run's lease expired without a stored response.
//!
//! ## Completing in the handler's transaction
//!
//! On `PgStore` and the tiered store the handler can commit the completed record in the
//! same transaction as its business write (docs/http-middleware.md): the
//! [`LeaseHandle`] in its request extensions (an axum extractor with the `axum` feature)
//! hands it the lease, and [`LeaseHandle::committed`] tells the layer not to store the
//! response again. A handler that does not complete leaves the storing to the layer.
//!
//! ```no_run
//! use axum::extract::{Extension, State};
//! use axum::http::{HeaderMap, HeaderValue, StatusCode};
//! use axum::response::{IntoResponse, Response};
//! use axum::routing::post;
//! use axum::Router;
//! use idem_core::Idem;
//! use idem_http::{IdempotencyLayer, LeaseHandle};
//! use idem_postgres::PgStore;
//!
//! async fn pay(
//!     State(store): State<PgStore>,
//!     Extension(lease): Extension<LeaseHandle>,
//!     request: String,
//! ) -> Result<Response, StatusCode> {
//!     let unavailable = |_| StatusCode::SERVICE_UNAVAILABLE;
//!     let mut tx = store.pool().begin().await.map_err(unavailable)?;
//!     // The business write.
//!     let id: i64 = sqlx::query_scalar("INSERT INTO payments (request) VALUES ($1) RETURNING id")
//!         .bind(&request)
//!         .fetch_one(&mut *tx)
//!         .await
//!         .map_err(unavailable)?;
//!     let mut headers = HeaderMap::new();
//!     headers.insert("content-type", HeaderValue::from_static("application/json"));
//!     let body = format!(r#"{{"payment":{id}}}"#);
//!     // The completed record, in the same transaction: both commit or neither does.
//!     // LeaseLost (another request took the key over) drops `tx`: nothing is committed.
//!     let completion = lease.completion(StatusCode::CREATED, &headers, body.clone());
//!     store
//!         .complete_in(&mut tx, lease.lease(), &completion, lease.retention())
//!         .await
//!         .map_err(|_| StatusCode::CONFLICT)?;
//!     tx.commit().await.map_err(unavailable)?;
//!     lease.committed(&completion);
//!     Ok((StatusCode::CREATED, headers, body).into_response())
//! }
//!
//! # async fn start() -> Result<(), idem_core::Error> {
//! let store = PgStore::connect("postgres://app@127.0.0.1/app").await?;
//! store.migrate().await?;
//! let layer = IdempotencyLayer::new(Idem::new(store.clone())).with_scope(idem_http::bearer_scope);
//! let app: Router = Router::new()
//!     .route("/payments", post(pay))
//!     .layer(layer)
//!     .with_state(store);
//! # let _ = app; Ok(()) }
//! ```
//!
//! The tiered store's `complete_in` is called the same way; call its `publish` after the
//! commit to copy the completion into Redis at once (its relay does it otherwise).
//!
//! ## Streamed responses
//!
//! A body that is not whole when the handler returns it (Server-Sent Events, chunked
//! NDJSON, an upstream's answer still arriving) goes to the client frame by frame as it is
//! produced, read in a task of its own and kept, up to [`Config::max_response_body`], to be
//! stored. Its end is the commit point: the client's body ends cleanly only once the
//! response is stored (a body of known length holds back its last frame until then), and
//! ends with an error when it cannot be (the store down past
//! [`Config::store_response_within`], or the lease lost): over HTTP/1.1 chunked the
//! connection is cut before the terminating chunk. So a clean end means recorded (for a
//! stream within the limit whose status is stored); a cut means not recorded, and a retry
//! with the same key gets 409 until the response is stored or the lease ends, as for a
//! buffered response's 503. A client that goes away
//! mid-stream stops nothing: the body is read to its end under the renewed lease and
//! stored, and a retry gets it replayed whole; with [`OnDisconnect::Cancel`] the body is
//! dropped instead, the key released and nothing stored. A stream over the limit is passed
//! on unstored per [`Config::unstored`], decided at its end. Memory per live stream is the
//! kept copy (at most the limit) and a few frames on their way to a slow client, whose
//! pace the reading follows while it is connected.
//!
//! A duplicate that comes while the stream runs joins it, on any instance on the same
//! store: the stream is written to the store in batches as it comes (16 KiB, or 20 ms after
//! a batch's first byte; [`idem_core::Store::append`], fenced by the lease), and the
//! duplicate gets the same status and replayed headers, every byte so far, then the rest as
//! it comes, and the same end. Before the head is written, or once the stream has ended or
//! will not be stored, duplicates get 409, or wait with [`idem_core::Config::wait`], as for
//! any request in flight. A retry of a `text/event-stream` response that carries
//! `Last-Event-ID` gets only the events after that one, joined live or replayed.
//!
//! ## When storing the response fails
//!
//! A whole response is stored before it is sent. If storing fails (the store went down while
//! the handler ran), the layer does **not** release the key, since a retry would then run
//! the handler again at once. It keeps trying to store the response in a background task
//! for up to the lease length, and waits up to [`Config::store_response_within`] for it:
//!
//! - stored within that time: the response is sent as usual;
//! - not yet: the client gets 503 `outcome-not-recorded` with `Retry-After`, never the
//!   unrecorded response. The record stays in progress, so retries get 409 meanwhile; once
//!   the background task stores the response, a retry gets it replayed. Only if the store
//!   stays down past the whole lease does a retry take the key over and run the handler
//!   again, with [`IdempotencyInfo::attempt`] above 1 telling it so.
//!
//! If the lease was lost instead (taken over by a retry after it expired, released, or
//! evicted by an operator), nothing of this request can be stored, and its response is
//! never sent as if it were the key's answer: the client gets 503 `lease-lost` with
//! `Retry-After`, and its retry with the same key converges on the key's one recorded
//! answer (409 while the other attempt runs, then its replay). A lease is lost this way
//! only when the store stayed unreachable past the lease's deadline (the heartbeat retries
//! a failed renewal within 250 ms until then), and then the other attempt may have run
//! while this one still did: see [`IdempotencyInfo::attempt`].
//!
//! ## JSON-RPC routes (MCP, A2A)
//!
//! A protocol inside HTTP sends every call as a `POST` to one path, with a request `id`
//! that changes on every retry. [`Config::with_jsonrpc`] makes a route guard the calls of
//! the methods it names (MCP's `tools/call`, A2A's `message/send`), keyed by a JSON pointer
//! into the request (or the key header), fingerprinted by `method` and `params` without the
//! `id`, the key and the per-attempt `_meta` entries; every other message passes through
//! untouched, a replay carries the retry's `id`, and every refusal is a JSON-RPC error
//! ([`jsonrpc`] has the table and the codes).
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod config;
mod error;
mod future;
mod handle;
mod join;
pub mod jsonrpc;
mod layer;
pub mod monitor;
mod outcome;
mod prefer;
mod request;
mod respond;
mod response;
mod service;
mod settle;
mod shared;
mod steps;

pub use body::{RequestBody, ResponseBody};
pub use config::{
    default_store_status, Anonymous, Config, MissingKey, OnDisconnect, StatusFilter, Unstored,
    TRANSIENT_4XX,
};
pub use error::{problem_json, PROBLEM_JSON};
pub use future::ResponseFuture;
pub use handle::LeaseHandle;
pub use jsonrpc::JsonRpc;
pub use layer::{bearer_scope, IdempotencyLayer};
pub use outcome::{IdempotencyInfo, KeepInFlight, Outcome};
pub use prefer::PREFERENCE_APPLIED;
pub use response::{EXPIRES, REPLAYED};
pub use service::IdempotencyService;
pub use shared::{ObserverFn, ScopeFn};
