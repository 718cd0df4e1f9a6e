//! # idem-consumer
//!
//! Exactly-once processing over an at-least-once broker. Brokers redeliver, publishers
//! retry and consumers crash, so a message can arrive many times; with idem its handler
//! changes the world once per idempotency key, and every copy is settled correctly:
//!
//! ```text
//!   message ──▶ key + fingerprint ──▶ Idem::execute_once ──▶ Delivery
//!   (headers,    (KeySource,            (the store decides,      Ack          done now or before
//!    payload)     FingerprintSource)     fenced by the lease)    Requeue      held elsewhere / store down
//!                                                                Nack         retryable failure, key released
//!                                                                DeadLetter   terminal, exhausted, invalid
//! ```
//!
//! - [`Consumer::process`] runs a handler under [`idem_core::Idem::execute_once`] and
//!   returns a [`Delivery`]: what to do with the message on the broker. A duplicate of
//!   finished work is acked with the stored value; a duplicate of work in progress (or of a
//!   consumer that died holding the key) is requeued, never dropped, until the holder
//!   finishes or its lease runs out; a store that is down means requeue, never running the
//!   handler unguarded; a retryable failure releases the key and asks for a delayed retry; a
//!   terminal failure, or retries that run out ([`Policy::max_attempts`], counting consumers
//!   that crashed mid-work), is dead-lettered (or stored, per [`OnTerminal`]), never acked
//!   silently.
//! - Keys come from a header ([`IDEMPOTENCY_KEY_HEADER`], propagated from the HTTP request
//!   that published the message, so the HTTP entry point and the worker share one
//!   idempotency boundary) or from a canonical hash of chosen payload fields
//!   ([`KeySource::PayloadHash`], volatile fields left out). [`child_key`] derives stable
//!   keys for the calls a handler makes downstream.
//! - Three workers carry the decisions out on a broker, each behind a feature (`rabbitmq`,
//!   `nats`, `redis-streams`): docs/consumers.md's table says what each decision
//!   does on each broker, and each module's docs say how.
//!
//! Use a consumer scope of its own (the consumer group or queue): the record of a message is
//! not the record of the HTTP request that published it, even though both have the same key.
//!
//! ## Quick start
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_consumer::{Consumer, Delivery, Message, Outcome, IDEMPOTENCY_KEY_HEADER};
//! use idem_core::{Failure, Idem, MemoryStore, Scope};
//!
//! let consumer = Consumer::new(Idem::new(MemoryStore::new()), Scope::new("emails")?);
//! let message = Message::new(br#"{"to": "ada@example.com"}"#.to_vec())
//!     .with_header(IDEMPOTENCY_KEY_HEADER, "signup-7f3a");
//!
//! let mut decisions = Vec::new();
//! for _delivery in 0..3 {
//!     let decision = consumer
//!         .process(&message, |ctx| async move {
//!             // ... send the welcome e-mail, with ctx.child_key("welcome") as the
//!             // provider's idempotency key ...
//!             Ok::<_, Failure<String>>(format!("sent for {}", ctx.key()))
//!         })
//!         .await;
//!     match &decision {
//!         Delivery::Ack(_) => { /* basic.ack */ }
//!         Delivery::Requeue { .. } => { /* put it back after `after` */ }
//!         Delivery::Nack { .. } => { /* redeliver after `after` as attempt + 1 */ }
//!         Delivery::DeadLetter { .. } => { /* move it to the dead-letter queue */ }
//!     }
//!     decisions.push(decision);
//! }
//! // The handler ran once; the later deliveries were acked with its stored value.
//! assert!(matches!(decisions[0], Delivery::Ack(Outcome::Executed { attempt: 1, .. })));
//! assert!(matches!(&decisions[2], Delivery::Ack(Outcome::Replayed(v)) if v == "sent for signup-7f3a"));
//! # Ok(()) }
//! ```
//!
//! ## Attempts
//!
//! An attempt is counted when the handler starts ([`Policy::max_attempts`] says how). Broker
//! counters such as `x-delivery-count` are not used: requeueing a copy of a message in
//! progress elsewhere is not a failed attempt.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod consumer;
mod key;
mod message;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams"))]
mod worker;

pub use consumer::{
    Consumer, Context, DeadLetterReason, Delivery, OnTerminal, Outcome, Policy, RequeueReason,
    MIN_REQUEUE_DELAY,
};
pub use key::{child_key, propagation_headers, FingerprintSource, InvalidMessage, KeySource};
pub use message::{
    HeaderValue, Message, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER,
    IDEMPOTENCY_SCOPE_HEADER, RETRY_AT_HEADER,
};
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis-streams")))
)]
pub use worker::Summary;
