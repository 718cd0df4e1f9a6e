//! A RabbitMQ worker on [`lapin`]: consume a queue, run each delivery through a
//! [`Consumer`], and ack, requeue, retry or dead-letter it as decided.
//!
//! # Topology
//!
//! [`Topology::for_queue`] names three durable queues, and [`Topology::declare`] declares
//! them:
//!
//! ```text
//!  publishers ──▶ <queue> ──▶ Worker ──ack──▶ (done)
//!                   ▲   ▲        │ │
//!   requeue: nack + │   │        │ └─ dead letter: publish a copy to <queue>.dead
//!   requeue after a │   │        │    (+ x-idem-dead-letter-reason), then ack
//!   sleep ──────────┘   │        │
//!                       │        └─ retry: publish a copy to <queue>.retry with
//!   the copy's TTL ends:│           expiration = backoff and x-idem-attempt = n,
//!   dead-lettered back ─┘           then ack
//!   to <queue>         <queue>.retry (no consumer; x-dead-letter-exchange "",
//!                                     x-dead-letter-routing-key <queue>)
//! ```
//!
//! docs/consumers.md's table says what each [`Delivery`](crate::Delivery) does
//! here. A requeue is held for its delay without a concurrency slot, but within the prefetch
//! window (cut short on shutdown). A retry is a copy in the retry queue with a TTL of the
//! backoff and [`ATTEMPT_HEADER`], which the broker dead-letters back to the main queue:
//! this counts attempts on any queue type (classic or quorum). RabbitMQ expires messages
//! only at the head of a queue, so a retry may come later than its backoff, never earlier.
//! A dead letter carries [`DEAD_LETTER_REASON_HEADER`] and [`ATTEMPT_HEADER`]. The original
//! is acked once the broker confirmed the copy.
//!
//! A dead-letter queue may hold a copy twice (a crash between the copy and the ack). If the
//! broker refuses a copy, the original is requeued instead of acked. The broker redelivers
//! the messages of a consumer that dies when its channel closes.
//!
//! # Shutdown
//!
//! When the `shutdown` future of [`Worker::run`] completes: the worker cancels its
//! consumer (no new deliveries), stops taking deliveries from its buffer, lets the handlers
//! in progress finish and settles their deliveries (held requeues are nacked at once), then
//! closes its channel, which hands every delivery it had not started back to the broker.

use std::fmt;
use std::future::{poll_fn, Future};
use std::time::Duration;

use futures_core::Stream;
use idem_core::{Failure, Key, Scope};
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;

use crate::consumer::{Consumer, Context, DeadLetterReason};
use crate::key::propagation_headers;
use crate::message::{HeaderValue, Message, ATTEMPT_HEADER, DEAD_LETTER_REASON_HEADER};
pub use crate::worker::Summary;
use crate::worker::{self, Broker, Next, Settled, Source};

/// What went wrong with the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker or the connection failed.
    #[error("AMQP: {0}")]
    Amqp(#[from] lapin::Error),
    /// The consumer failed while running (the channel or connection closed under it). The
    /// handlers in progress were finished first; `summary` says what was done.
    #[error("the consumer failed: {source}")]
    ConsumerFailed {
        /// The broker's error.
        #[source]
        source: lapin::Error,
        /// What the worker did before.
        summary: Summary,
    },
    /// The broker refused (nacked) a message published to `queue`.
    #[error("the broker refused a message published to {queue:?}")]
    Refused {
        /// The queue published to.
        queue: String,
    },
    /// A queue name or consumer tag is longer than AMQP allows.
    #[error("{what} {name:?} is longer than 255 bytes")]
    NameTooLong {
        /// `"queue"`, `"consumer tag"`, ...
        what: &'static str,
        /// The name.
        name: String,
    },
}

/// The queues a [`Worker`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Topology {
    /// The queue consumed.
    pub queue: String,
    /// Where retries wait out their backoff before they are dead-lettered back to `queue`.
    pub retry_queue: String,
    /// Where dead letters go.
    pub dead_letter_queue: String,
    /// When set, [`Topology::declare`] gives each queue this `x-expires`: the broker deletes
    /// a queue unused (no consumer, no `basic.get`) that long, messages and all. For tests
    /// and temporary queues. Default: `None`.
    pub expires: Option<Duration>,
}

impl Topology {
    /// `queue`, `"<queue>.retry"` and `"<queue>.dead"`.
    pub fn for_queue(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            retry_queue: format!("{queue}.retry"),
            dead_letter_queue: format!("{queue}.dead"),
            queue,
            expires: None,
        }
    }

    /// Sets [`Topology::expires`].
    pub fn with_expires(mut self, expires: Duration) -> Self {
        self.expires = Some(expires);
        self
    }

    fn arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        if let Some(expires) = self.expires {
            // A signed 64-bit integer: the table type RabbitMQ reads for every integer.
            let millis = i64::try_from(expires.as_millis().max(1)).unwrap_or(i64::MAX);
            args.insert("x-expires".into(), AMQPValue::LongLongInt(millis));
        }
        args
    }

    /// Declares the three queues, durable. The main queue is declared without arguments
    /// other than [`Topology::expires`] (declare it yourself beforehand if it needs some,
    /// e.g. `x-queue-type: quorum`, and skip this; a redeclaration with other arguments fails
    /// with `PRECONDITION_FAILED`). The retry queue
    /// dead-letters expired messages to the default exchange with the main queue's name as
    /// routing key.
    ///
    /// # Errors
    ///
    /// [`Error::Amqp`] from the broker; [`Error::NameTooLong`].
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(short("queue", &self.queue)?, durable, self.arguments())
            .await?;
        let mut retry_args = self.arguments();
        retry_args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from("")),
        );
        retry_args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(self.queue.as_str())),
        );
        channel
            .queue_declare(
                short("retry queue", &self.retry_queue)?,
                durable,
                retry_args,
            )
            .await?;
        channel
            .queue_declare(
                short("dead-letter queue", &self.dead_letter_queue)?,
                durable,
                self.arguments(),
            )
            .await?;
        Ok(())
    }

    /// Publishes `payload` with `properties` to the queue (through the default exchange)
    /// and, on a channel in confirm mode (`confirm_select`), waits until the broker
    /// confirms it: a producer's hand-over. [`with_idempotency_key`] adds the key to the
    /// properties.
    ///
    /// ```no_run
    /// # async fn producer(channel: lapin::Channel) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_consumer::rabbitmq::{with_idempotency_key, Topology};
    /// use idem_core::Key;
    /// let topology = Topology::for_queue("payments");
    /// let persistent = lapin::BasicProperties::default().with_delivery_mode(2);
    /// let properties = with_idempotency_key(persistent, &Key::new("3f9c-payment")?, None);
    /// topology.publish(&channel, br#"{"amount": 5}"#, properties).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Amqp`] from the broker; [`Error::Refused`] when it nacks the message;
    /// [`Error::NameTooLong`].
    pub async fn publish(
        &self,
        channel: &Channel,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), Error> {
        let queue = short("queue", &self.queue)?;
        let options = BasicPublishOptions::default();
        let confirm = channel
            .basic_publish(ShortString::from(""), queue, options, payload, properties)
            .await?;
        if confirm.await?.is_nack() {
            return Err(Error::Refused {
                queue: self.queue.clone(),
            });
        }
        Ok(())
    }

    /// Deletes the three queues and the messages in them (for tests and teardown).
    ///
    /// # Errors
    ///
    /// The broker's errors.
    pub async fn delete(&self, channel: &Channel) -> Result<(), Error> {
        for queue in [&self.queue, &self.retry_queue, &self.dead_letter_queue] {
            channel
                .queue_delete(short("queue", queue)?, QueueDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// Consumes a queue and runs each delivery through a [`Consumer`]. See the
/// [module docs](self) for what each decision does on the broker, and for shutdown.
/// `examples/consumer.rs` runs one from a fresh clone.
#[derive(Debug, Clone)]
pub struct Worker {
    settings: worker::Settings,
    topology: Topology,
    prefetch: u16,
    consumer_tag: String,
}

impl Worker {
    /// A worker for `topology.queue`, with prefetch 16, concurrency 4 and a consumer tag the
    /// broker picks.
    pub fn new(consumer: Consumer, topology: Topology) -> Self {
        Self {
            settings: worker::Settings::new(consumer),
            topology,
            prefetch: 16,
            consumer_tag: String::new(),
        }
    }

    /// How many unacked deliveries the broker hands this worker at once (`basic.qos`).
    /// Deliveries held for a delayed requeue count too, so keep it above the concurrency.
    /// 0 means no limit. Default: 16.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// The consumer tag. Default: empty, so the broker picks one.
    pub fn with_consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    worker::run_method! {
        /// Consumes the queue on a new channel of `connection` until `shutdown` completes or the
        /// broker cancels the consumer, then shuts down cleanly (see the [module docs](self)).
        /// `handler` gets each message and its [`Context`]; its value is stored as JSON and handed
        /// to duplicates.
        ///
        /// # Errors
        ///
        /// [`Error::Amqp`] when opening the channel, setting the prefetch, enabling publisher
        /// confirms or starting the consumer fails; [`Error::ConsumerFailed`] when the channel or
        /// connection fails while consuming (after the handlers in progress finished; the
        /// deliveries not settled go back to the queue); [`Error::NameTooLong`].
        connection: &Connection,
        Error::ConsumerFailed
    }

    /// Starts consuming: the worker's [`Source`].
    async fn source(&self, connection: &Connection) -> Result<Consuming, Error> {
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        // Copies for retries and dead letters are acked only once the broker confirms them.
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                short("queue", &self.topology.queue)?,
                short("consumer tag", &self.consumer_tag)?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!(queue = %self.topology.queue, tag = %deliveries.tag(), "consuming");
        Ok(Consuming {
            topology: self.topology.clone(),
            channel,
            deliveries,
            stopping: watch::Sender::new(false),
        })
    }
}

/// The worker's consumer on its channel.
struct Consuming {
    topology: Topology,
    channel: Channel,
    deliveries: lapin::Consumer,
    /// Tells held requeues to stop sleeping when shutdown starts.
    stopping: watch::Sender<bool>,
}

impl Source for Consuming {
    type Broker = Received;
    type Error = lapin::Error;

    async fn next(&mut self) -> Next<Received, lapin::Error> {
        match poll_fn(|cx| std::pin::Pin::new(&mut self.deliveries).poll_next(cx)).await {
            Some(Ok(delivery)) => Next::Delivery(Received {
                topology: self.topology.clone(),
                channel: self.channel.clone(),
                stopping: self.stopping.subscribe(),
                delivery,
            }),
            Some(Err(e)) => {
                tracing::error!(error = %e, "consumer failed");
                Next::Failed(e)
            }
            // The broker cancelled the consumer (the queue was deleted, for instance).
            None => {
                tracing::warn!(tag = %self.deliveries.tag(), "consumer cancelled by the broker");
                Next::End
            }
        }
    }

    /// No new deliveries (the channel may already be gone), and held requeues nacked at
    /// once.
    async fn stop(&mut self, failed: bool) {
        self.stopping.send_replace(true);
        if !failed {
            let tag = self.deliveries.tag();
            let cancelled = self
                .channel
                .basic_cancel(tag, BasicCancelOptions::default());
            if let Err(e) = cancelled.await {
                tracing::warn!(error = %e, "basic.cancel failed");
            }
        }
    }

    /// Closing the channel makes the broker requeue what was delivered but not started.
    async fn close(self, summary: &Summary) {
        if let Err(e) = self.channel.close(200, "OK".into()).await {
            tracing::debug!(error = %e, "channel close");
        }
        tracing::info!(queue = %self.topology.queue, ?summary, "stopped");
    }
}

/// One delivery taken by the worker, to settle.
struct Received {
    topology: Topology,
    channel: Channel,
    stopping: watch::Receiver<bool>,
    delivery: AmqpDelivery,
}

impl Received {
    /// Publishes a copy of the delivery to `queue`, and acks the original once the broker
    /// confirms the copy. Returns false (original not acked) when the copy was not
    /// confirmed.
    async fn copy_then_ack(&self, queue: &str, properties: BasicProperties) -> bool {
        let Ok(routing_key) = short("queue", queue) else {
            return false;
        };
        let published = self
            .channel
            .basic_publish(
                ShortString::from(""),
                routing_key,
                // Mandatory: a queue that does not exist returns the copy, and it counts as
                // not confirmed.
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &self.delivery.data,
                properties,
            )
            .await;
        let confirmed = match published {
            Ok(confirm) => match confirm.await {
                Ok(lapin::Confirmation::Ack(None)) => true,
                Ok(other) => {
                    tracing::warn!(%queue, confirmation = ?other, "copy not accepted");
                    false
                }
                Err(e) => {
                    tracing::warn!(%queue, error = %e, "copy not confirmed");
                    false
                }
            },
            Err(e) => {
                tracing::warn!(%queue, error = %e, "publish failed");
                false
            }
        };
        if !confirmed {
            return false;
        }
        if !matches!(
            self.delivery.acker.ack(BasicAckOptions::default()).await,
            Ok(true)
        ) {
            // The copy is out and the original comes back: a harmless duplicate.
            tracing::warn!("ack after copy failed; the broker will redeliver the original");
        }
        true
    }

    fn headers(&self, attempt: u32) -> FieldTable {
        let mut headers = self
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        headers.insert(
            ATTEMPT_HEADER.into(),
            AMQPValue::LongLongInt(attempt.into()),
        );
        headers
    }
}

impl Broker for Received {
    const RETRY_AT: bool = false;

    fn message(&self) -> Message {
        message_of(&self.delivery)
    }

    async fn ack(&mut self) -> Settled {
        let acked = self.delivery.acker.ack(BasicAckOptions::default()).await;
        settled(acked, "ack", Settled::Acked)
    }

    /// Holds the delivery for `after` (less if shutdown starts), then nacks it with requeue.
    async fn hand_back(&mut self, after: Duration) -> Settled {
        if !*self.stopping.borrow() {
            tokio::select! {
                () = tokio::time::sleep(after) => {}
                _ = self.stopping.changed() => {}
            }
        }
        let nack = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        settled(
            self.delivery.acker.nack(nack).await,
            "nack",
            Settled::Requeued,
        )
    }

    async fn retry(&mut self, attempt: u32, after: Duration) -> bool {
        // Milliseconds as text, as RabbitMQ wants; at least 1 so it is a delay.
        let ttl = after.as_millis().clamp(1, u128::from(u32::MAX)).to_string();
        let properties = copy_properties(
            &self.delivery.properties,
            self.headers(attempt),
            Some(ttl.into()),
        );
        self.copy_then_ack(&self.topology.retry_queue, properties)
            .await
    }

    async fn dead_letter(&mut self, reason: &DeadLetterReason, attempt: u32) -> bool {
        let mut headers = self.headers(attempt);
        headers.insert(
            DEAD_LETTER_REASON_HEADER.into(),
            AMQPValue::LongString(reason.to_string().into()),
        );
        let properties = copy_properties(&self.delivery.properties, headers, None);
        self.copy_then_ack(&self.topology.dead_letter_queue, properties)
            .await
    }
}

/// The [`Message`] of a delivery: its payload, its `content-type` property as the header
/// `content-type`, and its text and integer headers (others, such as `x-death`, are left
/// out; a `content-type` among them wins over the property).
pub fn message_of(delivery: &AmqpDelivery) -> Message {
    let mut message = Message::new(delivery.data.clone());
    if let Some(content_type) = delivery.properties.content_type() {
        message = message.with_header("content-type", content_type.as_str());
    }
    if let Some(headers) = delivery.properties.headers() {
        for (name, value) in headers.inner() {
            if let Some(value) = header_value(value) {
                message = message.with_header(name.as_str(), value);
            }
        }
    }
    message
}

fn header_value(value: &AMQPValue) -> Option<HeaderValue> {
    Some(match value {
        AMQPValue::LongString(s) => {
            HeaderValue::Text(std::str::from_utf8(s.as_bytes()).ok()?.to_owned())
        }
        AMQPValue::ShortString(s) => HeaderValue::Text(s.as_str().to_owned()),
        AMQPValue::ShortShortInt(n) => HeaderValue::Int((*n).into()),
        AMQPValue::ShortShortUInt(n) => HeaderValue::Int((*n).into()),
        AMQPValue::ShortInt(n) => HeaderValue::Int((*n).into()),
        AMQPValue::ShortUInt(n) => HeaderValue::Int((*n).into()),
        AMQPValue::LongInt(n) => HeaderValue::Int((*n).into()),
        AMQPValue::LongUInt(n) => HeaderValue::Int((*n).into()),
        AMQPValue::LongLongInt(n) => HeaderValue::Int(*n),
        _ => return None,
    })
}

/// Adds the headers of [`propagation_headers`] (`key`, and when given the publishing
/// request's `scope`, for [`Consumer::with_scope_header`]) to a message's properties, keeping
/// its other headers: publish with these from the HTTP handler whose request had `key`.
///
/// ```
/// use idem_consumer::rabbitmq::with_idempotency_key;
/// use idem_core::{Key, Scope};
/// let key = Key::new("3f9c-payment").unwrap();
/// let props = with_idempotency_key(lapin::BasicProperties::default(), &key, Some(&Scope::new("tenant-1").unwrap()));
/// let headers = props.headers().as_ref().unwrap();
/// assert!(headers.contains_key("x-idempotency-key"));
/// assert!(headers.contains_key("x-idempotency-scope"));
/// ```
pub fn with_idempotency_key(
    properties: BasicProperties,
    key: &Key,
    scope: Option<&Scope>,
) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    for (name, value) in propagation_headers(key, scope) {
        headers.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    properties.with_headers(headers)
}

/// What an ack or nack (`what`) that answered `result` settled: `done` when the broker got
/// it; otherwise nothing, and the broker will redeliver.
fn settled(result: Result<bool, lapin::Error>, what: &str, done: Settled) -> Settled {
    match result {
        Ok(true) => done,
        // `Ok(false)`: the channel is gone (lapin poisons its ackers).
        Ok(false) => {
            tracing::warn!("channel closed before the {what}; the broker will redeliver");
            Settled::Unsettled
        }
        Err(e) => {
            tracing::warn!(error = %e, "{what} failed; the broker will redeliver");
            Settled::Unsettled
        }
    }
}

/// The properties of a copy: the original's, without `user-id` (the broker refuses a
/// publish whose `user-id` is not the connection's user, closing the channel), persistent,
/// and with `headers` and `expiration` as given (a TTL the original came with must not
/// expire its dead letter). lapin's builder can only set fields, so this starts afresh.
fn copy_properties(
    p: &BasicProperties,
    headers: FieldTable,
    expiration: Option<ShortString>,
) -> BasicProperties {
    /// `set` with the original's value, when it has one.
    fn keep<T: Clone>(
        out: BasicProperties,
        value: &Option<T>,
        set: fn(BasicProperties, T) -> BasicProperties,
    ) -> BasicProperties {
        match value {
            Some(v) => set(out, v.clone()),
            None => out,
        }
    }
    type P = BasicProperties;
    let out = P::default().with_headers(headers).with_delivery_mode(2);
    let out = keep(out, &expiration, P::with_expiration);
    let out = keep(out, p.content_type(), P::with_content_type);
    let out = keep(out, p.content_encoding(), P::with_content_encoding);
    let out = keep(out, p.priority(), P::with_priority);
    let out = keep(out, p.correlation_id(), P::with_correlation_id);
    let out = keep(out, p.reply_to(), P::with_reply_to);
    let out = keep(out, p.message_id(), P::with_message_id);
    let out = keep(out, p.timestamp(), P::with_timestamp);
    let out = keep(out, p.kind(), P::with_type);
    let out = keep(out, p.app_id(), P::with_app_id);
    keep(out, p.cluster_id(), P::with_cluster_id)
}

/// A queue name or tag as an AMQP short string, refused (not panicking) past 255 bytes.
fn short(what: &'static str, name: &str) -> Result<ShortString, Error> {
    ShortString::try_new(name).map_err(|_| Error::NameTooLong {
        what,
        name: name.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy keeps every property of the original but `user-id`, is persistent, and takes
    /// the headers and expiration it is given.
    #[test]
    fn copies_keep_the_properties_but_user_id() {
        // What a copy keeps as it is.
        let kept = |p: BasicProperties| {
            p.with_content_type("application/json".into())
                .with_content_encoding("gzip".into())
                .with_priority(7)
                .with_correlation_id("corr".into())
                .with_reply_to("replies".into())
                .with_message_id("msg-1".into())
                .with_timestamp(1_700_000_000)
                .with_type("payment".into())
                .with_app_id("shop".into())
                .with_cluster_id("c1".into())
        };
        let original = kept(BasicProperties::default())
            .with_delivery_mode(1)
            .with_expiration("60000".into())
            .with_user_id("someone".into());
        let mut headers = FieldTable::default();
        headers.insert("x-idem-attempt".into(), AMQPValue::LongLongInt(2));
        let copy = copy_properties(&original, headers.clone(), Some("500".into()));
        let expected = kept(BasicProperties::default())
            .with_headers(headers.clone())
            .with_delivery_mode(2)
            .with_expiration("500".into());
        assert_eq!(copy, expected);
        // No expiration given: the original's is not kept.
        let copy = copy_properties(&original, headers, None);
        assert_eq!(copy.expiration(), &None);
        assert_eq!(copy.user_id(), &None);
    }
}
