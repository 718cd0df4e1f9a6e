//! # idem-core
//!
//! The state machine of idem, the storage trait its backends implement, and the embedded
//! in-memory store.
//!
//! idem makes an operation (charge a card, create an order, handle a message) run once per
//! idempotency key and hands every retry the original result. Each key is a record in a
//! [`Store`], identified by a [`Scope`] (tenant, principal, route, consumer group) and a
//! [`Key`], and carrying the [`Fingerprint`] of the request that created it:
//!
//! ```text
//!                  begin (same fingerprint)
//!   ┌────────┐   ───────────────────────────▶  ┌──────────────────────────┐
//!   │ absent │                                 │ in progress              │
//!   └────────┘  ◀───────────────────────────   │ lease: token, deadline,  │
//!       ▲          release / fail (Release)    │ attempt                  │
//!       │                                      └──────────────────────────┘
//!       │ retention                              │  ▲            │
//!       │ elapsed               complete / fail  │  │ deadline   │ begin while live:
//!       │                         (Store)        │  │ passed,    │   InFlight
//!   ┌───────────────────────┐                    │  │ begin:     │ begin, other
//!   │ completed             │ ◀──────────────────┘  │ TookOver   │   fingerprint:
//!   │ response + retention  │                       └────────────┘   Mismatch
//!   └───────────────────────┘
//!     begin: Replay (same fingerprint) or Mismatch
//! ```
//!
//! - [`Idem::begin`] answers with a [`Begin`]: `Acquired` or `TookOver` (run the work, you
//!   hold a [`Lease`]), `Replay` (the stored [`Response`]), `InFlight` (another worker holds
//!   a live lease; retry after the hint, or set [`Config::wait`] to wait for its result) or
//!   `Mismatch` (the key was used for a different request).
//! - [`Idem::complete`], [`Idem::fail`], [`Idem::release`] and [`Idem::extend`] carry the
//!   lease. The store checks its [`FencingToken`]: a worker whose lease was taken over, or
//!   whose key was released and acquired again, gets [`Error::LeaseLost`] and changes
//!   nothing.
//! - Lease deadlines are decided by the store's clock, so instances' clock drift does not
//!   matter.
//! - [`Idem::execute_once`] wraps all of it for message consumers and plain functions.
//!
//! Outcomes are values; [`Error`] is for stores failing ([`Error::Unavailable`] is
//! retryable) and lost leases.
//!
//! ## Quick start
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Begin, Fingerprint, Idem, JsonSelection, Key, MemoryStore, RecordId, Response, Scope};
//!
//! let idem = Idem::new(MemoryStore::new());
//! let id = RecordId::new(Scope::new("user-7")?, Key::new("3f9c-payment")?);
//! let body = br#"{"amount": 1250, "currency": "EUR"}"#;
//! let fp = Fingerprint::builder()
//!     .text("method", "POST")
//!     .text("path", "/payments")
//!     .json("body", body, &JsonSelection::All)?
//!     .finish();
//!
//! let response = match idem.begin(&id, fp).await? {
//!     Begin::Acquired(lease) | Begin::TookOver(lease) => {
//!         let response = Response::new(201, r#"{"id":"pay_1"}"#);
//!         idem.complete(&lease, response.clone()).await?;
//!         response
//!     }
//!     Begin::Replay(replay) => replay.completion.response,
//!     Begin::InFlight { retry_after } => Response::new(409, format!("retry in {retry_after:?}")),
//!     Begin::Mismatch => Response::new(422, "key reused with another request"),
//!     Begin::Expired { .. } => Response::new(410, "key used long ago; its result is gone"),
//! };
//! assert_eq!(response.status, 201);
//! # Ok(()) }
//! ```
//!
//! Other backends live in their own crates and implement [`Store`]; the conformance suite in
//! `idem-testkit` checks any of them against the contract.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod begin_rule;
mod clock;
mod engine;
mod error;
mod fingerprint;
mod key;
mod memory;
pub mod orphan;
mod record;
mod store;
pub mod telemetry;
mod tombstone;
pub mod watch;

pub use clock::{Clock, ManualClock, SystemClock};
pub use engine::{AfterRetention, Config, Failure, FailurePolicy, Idem, OnLost, Once, OnceError};
pub use error::{BoxError, Error, Result};
pub use fingerprint::{remove_pointer, Fingerprint, FingerprintBuilder, JsonError, JsonSelection};
pub use key::{Key, KeyError, RecordId, Scope, MAX_KEY_LEN, MAX_SCOPE_LEN};
pub use memory::{CapacityError, MemoryCapacity, MemoryStore, RECORD_OVERHEAD};
pub use record::{
    decode_meta, encode_meta, Completion, CompletionKind, DecodeError, FencingToken, Lease, Record,
    RecordState, Replay, Response,
};
pub use store::{Begin, BeginRequest, Stats, Store, StreamRead};
pub use tombstone::id as tombstone_id;
pub use watch::{Watch, Watchers};
