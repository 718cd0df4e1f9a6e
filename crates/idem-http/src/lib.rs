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
//! | first request for the key | the handler runs; its response is stored, then sent, with `Idempotency-Expires: <HTTP date>`, when the stored response is forgotten |
//! | retry of a completed request | the stored status, body and allowed headers, plus `Idempotent-Replayed: true` and `Idempotency-Expires` |
//! | same key, different request | 422 |
//! | same key while the first is running | 409 with a short `Retry-After` ([`Config::in_flight_retry_after`], 1 s by default, never past the first request's lease time left), or, with [`idem_core::Config::wait`] set, the first request's response once it is stored |
//! | store unavailable | 503 with `Retry-After` ([`Config::store_retry_after`]); with [`Config::fail_open`], the handler runs unguarded |
//!
//! The layer's own answers are `application/problem+json` documents (RFC 9457) whose `type`
//! is `urn:idem:problem:<kind>`: `idempotency-key-missing`, `idempotency-key-invalid`,
//! `request-body-too-large`, `request-body-unreadable`, `idempotency-key-reused`,
//! `principal-missing`, `request-in-flight`, `store-unavailable`, `store-error`,
//! `outcome-not-recorded`, `stored-response-invalid`.
//!
//! ## Work outlives the connection
//!
//! Once the key is claimed, the handler and the storing of its response are work that
//! outlives the response future: the response future polls it in place, and should it be
//! dropped first, the work moves to a task of its own. A client that disconnects (a
//! timeout, a closed tab) drops the response future, not the work: the handler runs to its end, its
//! response is stored, and the client's retry gets it replayed (or a 409 with a short
//! `Retry-After` while it still runs, or the response itself with
//! [`idem_core::Config::wait`]). Before the key is claimed (reading the key and the body)
//! nothing is held, and a disconnect there leaves nothing behind.
//!
//! ## Scope and fingerprint
//!
//! Every key is scoped by [`IdempotencyLayer::with_scope`], typically by the authenticated
//! principal, so one tenant can never be handed another tenant's stored response
//! ([`bearer_scope`] is a ready-made extractor). The fingerprint covers the method, the
//! path with its query, the headers of [`Config::fingerprint_headers`] and the body, in
//! canonical form when its content type is JSON (`application/json` or `*/*+json`; key
//! order and whitespace do not count, and [`Config::json_selection`] can leave volatile
//! fields out).
//!
//! ## What is stored
//!
//! By default 2xx responses and the 4xx that are final for the request are stored and
//! replayed; 401, 403, 408, 409, 423, 425 and 429 never are, as a retry may well succeed
//! (the table: [`default_store_status`]; change it with [`Config::with_store_status`]).
//! For a response not stored, an error of the inner service or a panic (caught, the key
//! released, then the panic resumed) the key is released, so a retry runs the handler
//! again. Only the headers of [`Config::replay_headers`] are stored: `Set-Cookie` and
//! hop-by-hop headers are sent with the first response only, unless listed. Response
//! trailers are never stored.
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
//! When the handler writes to PostgreSQL and the keys live there too (`PgStore`, or the
//! tiered store's `TieredStore`), the handler can commit the completed record **in the same
//! transaction as its business write**: the [`LeaseHandle`] in its request extensions
//! hands it the lease, `complete_in` writes the record on the handler's transaction, and
//! [`LeaseHandle::committed`] tells the layer, which then sends the response without
//! storing it again. A crash between the commit and the response loses nothing: the retry
//! gets the committed response replayed, and the payment is never made twice. A handler
//! that returns without completing leaves the storing to the layer; on stores without
//! transactions (memory, Redis) the layer stores the response as usual.
//!
//! In axum, take the handle with `Extension<LeaseHandle>`, or, with this crate's `axum`
//! feature, as `LeaseHandle` (or `Option<LeaseHandle>`) directly:
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
//! ## When storing the response fails
//!
//! The response is stored before it is sent. If storing fails (the store went down while
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
//! If the lease was lost instead (taken over by a retry after it expired, or evicted by an
//! operator), the response is sent unstored: another request now owns the key.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod config;
mod error;
mod future;
mod handle;
mod layer;
mod outcome;
mod request;
mod response;
mod service;
mod shared;

pub use body::{RequestBody, ResponseBody};
pub use config::{
    default_store_status, Anonymous, Config, MissingKey, StatusFilter, Unstored, TRANSIENT_4XX,
};
pub use error::{problem_json, PROBLEM_JSON};
pub use future::ResponseFuture;
pub use handle::LeaseHandle;
pub use layer::{bearer_scope, IdempotencyLayer};
pub use outcome::{IdempotencyInfo, KeepInFlight, Outcome};
pub use response::{EXPIRES, REPLAYED};
pub use service::IdempotencyService;
pub use shared::{ObserverFn, ScopeFn};
