//! A NATS JetStream worker on [`async_nats`]: pull messages from a durable consumer, run
//! each through a [`Consumer`], and ack, NAK, retry or dead-letter it as decided.
//!
//! JetStream's own de-duplication (`Nats-Msg-Id` within the stream's duplicate window) only
//! covers publishing, and only for a while: a consumer still receives a message at least
//! once (redelivery after `ack_wait`, a publisher that retries after the window). The
//! worker makes its handler take effect once per idempotency key.
//!
//! # Topology
//!
//! [`Topology::new`] names a stream, the subject consumed, a durable pull consumer and a
//! dead-letter stream; [`Topology::declare`] creates what is missing:
//!
//! ```text
//!  publishers ──▶ <subject> ─▶ stream <stream> ─▶ consumer <stream>-idem ─▶ Worker ──ack──▶ (done)
//!                    ▲                      ▲                                 │ │ │
//!   retry: a copy to the message's subject  └── NAK with a delay ─────────────┘ │ │
//!   with x-idem-attempt and x-idem-retry-at, then ack ──────────────────────────┘ │
//!                          stream <stream>-dead ◀── a copy to <subject>.dead ─────┘
//!                                                   with x-idem-dead-letter-reason, then ack
//! ```
//!
//! docs/consumers.md's table says what each [`Delivery`](crate::Delivery) does
//! here. A copy (retry, dead letter) carries [`ATTEMPT_HEADER`], and [`RETRY_AT_HEADER`] or
//! [`DEAD_LETTER_REASON_HEADER`]; the original is acked once the stream confirmed the copy.
//! A worker that receives a retry early NAKs it with the time left (not an attempt).
//!
//! A copy carries the original's headers, but its `Nats-Msg-Id` moves to
//! `x-idem-nats-msg-id` (read back as `Nats-Msg-Id` by [`message_of`]), so that the stream's
//! duplicate window does not drop the copy as a duplicate of the original. If the stream
//! refuses the copy, the original is NAKed instead of acked.
//!
//! # Leases and redelivery
//!
//! While a handler runs, the worker sends `+WPI` ("work in progress") every third of the
//! consumer's `ack_wait`, so JetStream does not hand the message to another worker; the
//! engine extends the lease in the store meanwhile. A worker that dies stops both: JetStream
//! delivers its messages again after `ack_wait` (NAKed while the dead worker's leases hold).
//!
//! # Shutdown
//!
//! When the `shutdown` future of [`Worker::run`] completes, the worker stops pulling, lets
//! the handlers in progress finish and settles their messages. Messages pulled but not
//! started are not acked: JetStream delivers them again after `ack_wait`.

use std::fmt;
use std::future::{poll_fn, Future};
use std::time::Duration;

use async_nats::header::HeaderMap;
use async_nats::jetstream::consumer::pull::{self, MessagesErrorKind};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream, AckKind, Context as JetStream};
use futures_core::Stream;
use idem_core::{Failure, Key, Scope};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::consumer::{Consumer, Context, DeadLetterReason};
use crate::key::propagation_headers;
use crate::message::{Message, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER, RETRY_AT_HEADER};
use crate::worker::{self, retry_at, Broker, Next, Settled, Source, Summary};

/// JetStream's de-duplication header. To key messages by it, give the consumer
/// `KeySource::Header(NATS_MSG_ID_HEADER.into())`.
pub const NATS_MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Where a copy (retry, dead letter) keeps the original's `Nats-Msg-Id`.
const COPIED_MSG_ID_HEADER: &str = "x-idem-nats-msg-id";

/// What went wrong with the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A JetStream request failed: `what` says which.
    #[error("JetStream: {what}: {source}")]
    Broker {
        /// The request: `"create the stream"`, `"pull messages"`, ...
        what: &'static str,
        /// The client's error.
        #[source]
        source: async_nats::Error,
    },
    /// The consumer was deleted (or is not a pull consumer) while the worker ran. The
    /// handlers in progress were finished first; `summary` says what was done.
    #[error("the consumer failed: {source}")]
    ConsumerFailed {
        /// The client's error.
        #[source]
        source: async_nats::Error,
        /// What the worker did before.
        summary: Summary,
    },
    /// The subject consumed ends in the `>` wildcard, which would also capture its own dead
    /// letters (`<subject>.dead`). Consume a subject with `*` wildcards, or name each
    /// subject.
    #[error(
        "the subject {subject:?} ends in `>`, which would capture its own dead letters \
         (<subject>.dead): use `*` wildcards or a subject without wildcards"
    )]
    TailWildcard {
        /// The subject.
        subject: String,
    },
}

fn broker<E>(what: &'static str) -> impl FnOnce(E) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |e| Error::Broker {
        what,
        source: Box::new(e),
    }
}

/// The stream, subject and consumers a [`Worker`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Topology {
    /// The stream that stores the messages.
    pub stream: String,
    /// The subject consumed (the durable consumer's filter); `*` wildcards allowed. Retry
    /// copies go back to each message's own subject.
    pub subject: String,
    /// The durable pull consumer the workers share. Default: `"<stream>-idem"`.
    pub consumer: String,
    /// The stream that stores the dead letters, published to `<subject>.dead`. Default:
    /// `"<stream>-dead"`.
    pub dead_letter_stream: String,
    /// How long JetStream waits for an ack before it delivers a message again, when
    /// [`Topology::declare`] creates the consumer. The worker sends "work in progress" every
    /// third of it while a handler runs; a worker that dies has its messages delivered again
    /// after it. Default: 30 s.
    pub ack_wait: Duration,
}

impl Topology {
    /// `stream` consuming `subject`, with the default consumer and dead-letter stream names.
    pub fn new(stream: impl Into<String>, subject: impl Into<String>) -> Self {
        let stream = stream.into();
        Self {
            consumer: format!("{stream}-idem"),
            dead_letter_stream: format!("{stream}-dead"),
            subject: subject.into(),
            stream,
            ack_wait: Duration::from_secs(30),
        }
    }

    /// Sets [`Topology::consumer`].
    pub fn with_consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = consumer.into();
        self
    }

    /// Sets [`Topology::ack_wait`].
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Where dead letters of a message published to `subject` go: `"<subject>.dead"`.
    pub fn dead_letter_subject(subject: &str) -> String {
        format!("{subject}.dead")
    }

    /// Creates the stream (capturing [`Topology::subject`]), the dead-letter stream
    /// (capturing `<subject>.dead`) and the durable pull consumer (explicit acks,
    /// [`Topology::ack_wait`], unlimited deliveries: the worker decides when to give up),
    /// unless they exist; existing ones are used as they are.
    ///
    /// # Errors
    ///
    /// [`Error::Broker`]; [`Error::TailWildcard`].
    pub async fn declare(&self, js: &JetStream) -> Result<(), Error> {
        if self.subject.split('.').any(|token| token == ">") {
            return Err(Error::TailWildcard {
                subject: self.subject.clone(),
            });
        }
        let stream = js
            .get_or_create_stream(stream::Config {
                name: self.stream.clone(),
                subjects: vec![self.subject.clone()],
                ..stream::Config::default()
            })
            .await
            .map_err(broker("create the stream"))?;
        js.get_or_create_stream(stream::Config {
            name: self.dead_letter_stream.clone(),
            subjects: vec![Self::dead_letter_subject(&self.subject)],
            ..stream::Config::default()
        })
        .await
        .map_err(broker("create the dead-letter stream"))?;
        stream
            .get_or_create_consumer(
                &self.consumer,
                pull::Config {
                    durable_name: Some(self.consumer.clone()),
                    filter_subject: self.subject.clone(),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_deliver: -1,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(broker("create the consumer"))?;
        Ok(())
    }

    /// Deletes both streams, their messages and the consumer (for tests and teardown).
    ///
    /// # Errors
    ///
    /// [`Error::Broker`].
    pub async fn delete(&self, js: &JetStream) -> Result<(), Error> {
        for stream in [&self.stream, &self.dead_letter_stream] {
            js.delete_stream(stream)
                .await
                .map_err(broker("delete a stream"))?;
        }
        Ok(())
    }
}

/// Pulls from a durable consumer and runs each message through a [`Consumer`]. See the
/// [module docs](self) for what each decision does on the broker, and for shutdown.
/// `examples/nats.rs` runs one from a fresh clone.
#[derive(Debug, Clone)]
pub struct Worker {
    settings: worker::Settings,
    topology: Topology,
    batch: usize,
}

impl Worker {
    /// A worker for `topology`'s consumer, with concurrency 4 and batches of 16.
    pub fn new(consumer: Consumer, topology: Topology) -> Self {
        Self {
            settings: worker::Settings::new(consumer),
            topology,
            batch: 16,
        }
    }

    /// How many messages one pull request asks for (at least 1). Pulled messages wait in
    /// the worker for a free handler, and their `ack_wait` runs meanwhile: keep it a small
    /// multiple of the concurrency. Default: 16.
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }
    worker::run_method! {
        /// Pulls from the topology's consumer (which must exist: see [`Topology::declare`]) until
        /// `shutdown` completes, then shuts down cleanly (see the [module docs](self)). `handler`
        /// gets each message and its [`Context`]; its value is stored as JSON and handed to
        /// duplicates.
        ///
        /// # Errors
        ///
        /// [`Error::Broker`] when the stream or consumer cannot be found or pulling cannot start;
        /// [`Error::ConsumerFailed`] when the consumer is deleted while the worker runs (after the
        /// handlers in progress finished).
        js: &JetStream,
        Error::ConsumerFailed
    }

    /// Starts consuming: the worker's [`Source`].
    async fn source(&self, js: &JetStream) -> Result<Pulling, Error> {
        let stream = js
            .get_stream(&self.topology.stream)
            .await
            .map_err(broker("find the stream"))?;
        let consumer: PullConsumer =
            stream
                .get_consumer(&self.topology.consumer)
                .await
                .map_err(|source| Error::Broker {
                    what: "find the consumer",
                    source,
                })?;
        let ack_wait = consumer.cached_info().config.ack_wait;
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.batch)
            .messages()
            .await
            .map_err(broker("pull messages"))?;
        tracing::info!(stream = %self.topology.stream, consumer = %self.topology.consumer, "consuming");
        Ok(Pulling {
            stream: self.topology.stream.clone(),
            js: js.clone(),
            messages: Some(messages),
            ack_wait,
        })
    }
}

/// The worker's pull subscription.
struct Pulling {
    stream: String,
    js: JetStream,
    /// `None` once shutdown starts: dropping it stops pulling (messages pulled but not
    /// started come back after `ack_wait`).
    messages: Option<pull::Stream>,
    ack_wait: Duration,
}

impl Source for Pulling {
    type Broker = Pulled;
    type Error = async_nats::Error;

    async fn next(&mut self) -> Next<Pulled, async_nats::Error> {
        let Some(messages) = self.messages.as_mut() else {
            return Next::End;
        };
        match poll_fn(|cx| std::pin::Pin::new(&mut *messages).poll_next(cx)).await {
            Some(Ok(delivery)) => Next::Delivery(Pulled {
                js: self.js.clone(),
                delivery,
                ack_wait: self.ack_wait,
            }),
            // The consumer is gone: nothing more will come.
            Some(Err(e))
                if matches!(
                    e.kind(),
                    MessagesErrorKind::ConsumerDeleted | MessagesErrorKind::PushBasedConsumer
                ) =>
            {
                tracing::error!(error = %e, "consumer failed");
                Next::Failed(Box::new(e))
            }
            // A missed heartbeat, a failed pull request, the server away for a while: the
            // client pulls again; wait a little so an outage is not a busy loop.
            Some(Err(e)) => {
                tracing::warn!(error = %e, "pulling messages failed; pulling again");
                tokio::time::sleep(Duration::from_millis(100)).await;
                Next::Again
            }
            None => Next::End,
        }
    }

    async fn stop(&mut self, _failed: bool) {
        self.messages = None;
    }

    /// Acks and NAKs are queued for the connection's writer task: they are flushed before
    /// the worker says it stopped, so that a process exiting right after does not lose them
    /// (JetStream would deliver those messages again after `ack_wait`).
    async fn close(self, summary: &Summary) {
        let flushed = tokio::time::timeout(FLUSH_TIMEOUT, self.js.client().flush()).await;
        if !matches!(flushed, Ok(Ok(()))) {
            tracing::warn!("the last acks may not have reached the server; JetStream delivers those messages again");
        }
        tracing::info!(stream = %self.stream, ?summary, "stopped");
    }
}

/// One message pulled by the worker, to settle.
struct Pulled {
    js: JetStream,
    delivery: jetstream::Message,
    ack_wait: Duration,
}

impl Pulled {
    /// Publishes a copy of the message to `subject`, and acks the original once the stream
    /// confirms the copy. Returns false (original not acked) when the copy was not
    /// confirmed.
    async fn copy_then_ack(&self, subject: String, extra: &[(&str, String)]) -> bool {
        let headers = copy_headers(self.delivery.headers.as_ref(), extra);
        let published = match self
            .js
            .publish_with_headers(subject.clone(), headers, self.delivery.payload.clone())
            .await
        {
            Ok(confirm) => confirm.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(error) = published {
            tracing::warn!(%subject, %error, "copy not confirmed");
            return false;
        }
        if let Err(e) = self.delivery.ack().await {
            // The copy is out and the original comes back: a harmless duplicate.
            tracing::warn!(error = %e, "ack after copy failed; JetStream will deliver the original again");
        }
        true
    }
}

impl Broker for Pulled {
    const RETRY_AT: bool = true;

    fn message(&self) -> Message {
        message_of(&self.delivery)
    }

    /// "Work in progress" every third of ack_wait, so JetStream does not hand the message
    /// to another worker while the handler runs.
    fn heartbeat(&self) -> Option<Duration> {
        Some((self.ack_wait / 3).max(Duration::from_millis(100)))
    }

    async fn beat(&self) {
        if let Err(e) = self.delivery.ack_with(AckKind::Progress).await {
            tracing::warn!(error = %e, "work-in-progress ack failed");
        }
    }

    async fn ack(&mut self) -> Settled {
        Settled::Acked.unless_failed(self.delivery.ack().await, "ack", DELIVERED_AGAIN)
    }

    /// NAKs the message so that JetStream delivers it again after `after`.
    async fn hand_back(&mut self, after: Duration) -> Settled {
        let nak = self.delivery.ack_with(AckKind::Nak(Some(after))).await;
        Settled::Requeued.unless_failed(nak, "nak", DELIVERED_AGAIN)
    }

    async fn retry(&mut self, attempt: u32, after: Duration) -> bool {
        let extra = [
            (ATTEMPT_HEADER, attempt.to_string()),
            (RETRY_AT_HEADER, retry_at(after)),
        ];
        let subject = self.delivery.subject.to_string();
        self.copy_then_ack(subject, &extra).await
    }

    async fn dead_letter(&mut self, reason: &DeadLetterReason, attempt: u32) -> bool {
        let extra = [
            (ATTEMPT_HEADER, attempt.to_string()),
            (DEAD_LETTER_REASON_HEADER, reason.to_string()),
        ];
        let subject = Topology::dead_letter_subject(&self.delivery.subject);
        self.copy_then_ack(subject, &extra).await
    }
}

/// How long a stopping worker waits for its last acks to be written.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// What JetStream does with a message whose ack or NAK failed.
const DELIVERED_AGAIN: &str = "JetStream will deliver the message again";

/// The original's headers, `Nats-Msg-Id` moved aside (see the [module docs](self)), and
/// `extra` set.
fn copy_headers(original: Option<&HeaderMap>, extra: &[(&str, String)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(original) = original {
        for (name, values) in original.iter() {
            let name = name.as_ref();
            if extra.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) {
                continue;
            }
            let name = if name.eq_ignore_ascii_case(NATS_MSG_ID_HEADER) {
                COPIED_MSG_ID_HEADER
            } else {
                name
            };
            for value in values {
                headers.append(name, value.as_str());
            }
        }
    }
    for (name, value) in extra {
        headers.insert(*name, value.as_str());
    }
    headers
}

/// The [`Message`] of a JetStream message: its payload and headers (the last value of a
/// header given several times); on a copy made by a worker, `x-idem-nats-msg-id` reads as
/// `Nats-Msg-Id` again.
pub fn message_of(delivery: &async_nats::Message) -> Message {
    let mut message = Message::new(delivery.payload.to_vec());
    let mut copied_id = None;
    if let Some(headers) = &delivery.headers {
        for (name, values) in headers.iter() {
            let Some(value) = values.last() else { continue };
            let name: &str = name.as_ref();
            if name.eq_ignore_ascii_case(COPIED_MSG_ID_HEADER) {
                copied_id = Some(value.as_str().to_owned());
            } else {
                message = message.with_header(name, value.as_str());
            }
        }
    }
    if let Some(id) = copied_id {
        message = message.with_header(NATS_MSG_ID_HEADER, id);
    }
    message
}

/// Adds the headers of [`propagation_headers`] (`key`, and when given the publishing
/// request's `scope`, for [`Consumer::with_scope_header`]) to `headers`: publish with these
/// (`js.publish_with_headers`) from the HTTP handler whose request had `key`. Set
/// [`NATS_MSG_ID_HEADER`] as well to have JetStream drop re-publications within its
/// duplicate window, before any consumer sees them.
///
/// ```
/// use idem_consumer::nats::with_idempotency_key;
/// use idem_core::{Key, Scope};
/// let key = Key::new("3f9c-payment").unwrap();
/// let headers = with_idempotency_key(async_nats::HeaderMap::new(), &key, Some(&Scope::new("tenant-1").unwrap()));
/// assert_eq!(headers.get("x-idempotency-key").unwrap().as_str(), "3f9c-payment");
/// assert_eq!(headers.get("x-idempotency-scope").unwrap().as_str(), "tenant-1");
/// ```
pub fn with_idempotency_key(mut headers: HeaderMap, key: &Key, scope: Option<&Scope>) -> HeaderMap {
    for (name, value) in propagation_headers(key, scope) {
        headers.insert(name, value.as_str());
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(headers: HeaderMap) -> async_nats::Message {
        async_nats::Message {
            subject: "orders.created".into(),
            reply: None,
            payload: "{}".into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        }
    }

    /// A copy keeps the original's headers, moves `Nats-Msg-Id` aside and overrides the
    /// ones it sets; reading the copy gives back the original's `Nats-Msg-Id`.
    #[test]
    fn copies_move_the_message_id_aside_and_read_it_back() {
        let mut original = HeaderMap::new();
        original.insert(NATS_MSG_ID_HEADER, "order-7");
        original.insert("x-trace", "t1");
        original.insert(ATTEMPT_HEADER, "1");
        let jetstream_message = delivery(original);
        let copy = copy_headers(
            jetstream_message.headers.as_ref(),
            &[(ATTEMPT_HEADER, "2".to_string())],
        );
        assert!(copy.get(NATS_MSG_ID_HEADER).is_none());
        assert_eq!(copy.get(COPIED_MSG_ID_HEADER).unwrap().as_str(), "order-7");
        let read = message_of(&delivery(copy));
        assert_eq!(read.text_header(NATS_MSG_ID_HEADER), Some("order-7"));
        assert_eq!(read.text_header("x-trace"), Some("t1"));
        assert_eq!(read.failed_attempts(), 2);
    }
}
