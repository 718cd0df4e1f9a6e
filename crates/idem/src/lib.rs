//! # idem
//!
//! Run an operation (charge a card, create an order, handle a message) once per idempotency
//! key, and hand every retry the original result.
//!
//! This facade re-exports [`idem_core`] (the state machine, the storage trait and the
//! embedded in-memory store); each storage backend or integration is a cargo feature that
//! re-exports its crate as a module. See the workspace README for the list.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use idem::{Failure, Fingerprint, Idem, Key, MemoryStore, Once, RecordId, Scope};
//!
//! let idem = Idem::new(MemoryStore::new());
//! let id = RecordId::new(Scope::new("orders").unwrap(), Key::new("order-1").unwrap());
//! let fp = Fingerprint::of_bytes(b"create order 1");
//! let once = idem
//!     .execute_once(&id, fp, |_lease| async { Ok::<_, Failure<String>>("created".to_owned()) })
//!     .await
//!     .unwrap();
//! assert!(matches!(once, Once::Executed { .. }));
//! # }
//! ```

pub use idem_core::*;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
