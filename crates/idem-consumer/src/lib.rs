//! wip docs

mod consumer;
mod key;
mod message;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

pub use consumer::{
    Consumer, Context, DeadLetterReason, Delivery, OnTerminal, Outcome, Policy, RequeueReason,
    MIN_REQUEUE_DELAY,
};
pub use key::{child_key, FingerprintSource, InvalidMessage, KeySource};
pub use message::{
    HeaderValue, Message, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, IDEMPOTENCY_KEY_HEADER,
    IDEMPOTENCY_SCOPE_HEADER,
};
