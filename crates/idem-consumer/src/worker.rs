//! What the broker workers share: the counts of a run, running one delivery's handler
//! through the [`Consumer`] in a task of its own, and what each decision does (through the
//! [`Broker`] steps each worker implements).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idem_core::Failure;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::consumer::{Consumer, Context, DeadLetterReason, Delivery, Policy};
use crate::message::Message;

/// Counts of what one run of a worker did with its deliveries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Deliveries acked as done (now, before, or as a stored failure).
    pub acked: u64,
    /// Deliveries handed back for a later delivery (key in flight elsewhere, store down,
    /// handler panicked): a requeue on RabbitMQ, a NAK with a delay on JetStream, an entry
    /// left pending on Redis Streams.
    pub requeued: u64,
    /// Deliveries republished for a retry after a retryable failure.
    pub retried: u64,
    /// Deliveries republished to the dead-letter destination.
    pub dead_lettered: u64,
    /// Deliveries that could not be settled (the connection failed): the broker delivers
    /// them again.
    pub unsettled: u64,
}

/// How one delivery ended on the broker.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Settled {
    Acked,
    Requeued,
    Retried,
    DeadLettered,
    Unsettled,
}

/// Adds what a delivery task returned to `summary`.
pub(crate) fn count(summary: &mut Summary, done: Result<Settled, tokio::task::JoinError>) {
    match done {
        Ok(Settled::Acked) => summary.acked += 1,
        Ok(Settled::Requeued) => summary.requeued += 1,
        Ok(Settled::Retried) => summary.retried += 1,
        Ok(Settled::DeadLettered) => summary.dead_lettered += 1,
        Ok(Settled::Unsettled) => summary.unsettled += 1,
        // The settling code itself does not panic; count it as unsettled if it ever does.
        Err(e) => {
            tracing::error!(error = %e, "delivery task failed");
            summary.unsettled += 1;
        }
    }
}

/// Waits for a free handler slot, counting the deliveries settled meanwhile into `summary`;
/// `None` once `shutdown` completes. A worker takes a slot before it takes a delivery, so
/// that deliveries wait on the broker (or in its client's small buffer) rather than as
/// tasks here.
pub(crate) async fn next_slot<F: Future<Output = ()>>(
    slots: &Arc<Semaphore>,
    tasks: &mut JoinSet<Settled>,
    summary: &mut Summary,
    shutdown: &mut Pin<&mut F>,
) -> Option<OwnedSemaphorePermit> {
    loop {
        tokio::select! {
            () = shutdown.as_mut() => return None,
            Some(done) = tasks.join_next(), if !tasks.is_empty() => count(summary, done),
            // The semaphore is never closed; stop if it ever is.
            slot = slots.clone().acquire_owned() => return slot.ok(),
        }
    }
}

/// Runs `handler` for `message` through `consumer` in a task of its own, so that a panic in
/// the handler is caught here and the delivery is still settled: `None` then (hand the
/// delivery back; its lease runs out and the next attempt is counted).
pub(crate) async fn decide<T, E, H, Fut>(
    consumer: &Consumer,
    message: Message,
    handler: Arc<H>,
) -> Option<Delivery<T>>
where
    T: Serialize + DeserializeOwned + Send + 'static,
    E: fmt::Display + Send + 'static,
    H: Fn(Message, Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, Failure<E>>> + Send + 'static,
{
    let consumer = consumer.clone();
    let decided = tokio::spawn(async move {
        consumer
            .process(&message, |ctx| handler(message.clone(), ctx))
            .await
    })
    .await;
    match decided {
        Ok(decision) => Some(decision),
        Err(e) => {
            tracing::error!(error = %e, "handler panicked; handing the delivery back");
            None
        }
    }
}

/// Awaits `decided` (a [`decide`]), with `beat` called every `period` meanwhile: the sign of
/// life that stops the broker from handing the delivery to another worker while the handler
/// runs (the engine extends the lease in the store).
#[cfg(any(feature = "nats", feature = "redis-streams"))]
pub(crate) async fn with_heartbeat<D, B, Beat>(
    decided: impl Future<Output = D>,
    period: Duration,
    mut beat: B,
) -> D
where
    B: FnMut() -> Beat,
    Beat: Future<Output = ()>,
{
    let mut heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let mut decided = std::pin::pin!(decided);
    loop {
        tokio::select! {
            decision = &mut decided => return decision,
            _ = heartbeat.tick() => beat().await,
        }
    }
}

/// The steps a worker takes on its broker to settle one delivery; [`settle`] chooses
/// between them, the same way for every broker.
pub(crate) trait Broker {
    /// Acknowledges the delivery: done.
    async fn ack(&mut self) -> Settled;
    /// Hands the delivery back, to be delivered again after `after` (not an attempt).
    async fn hand_back(&mut self, after: Duration) -> Settled;
    /// Publishes a copy for a retry after `after`, with [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER)
    /// set to `attempt`, and acknowledges the original once the copy is confirmed. False
    /// (the original untouched) when the copy was not confirmed.
    async fn retry(&mut self, attempt: u32, after: Duration) -> bool;
    /// Publishes a copy to the dead-letter destination, with
    /// [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) and
    /// [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER), and acknowledges the original once the
    /// copy is confirmed. False (the original untouched) when the copy was not confirmed.
    async fn dead_letter(&mut self, reason: &DeadLetterReason, attempt: u32) -> bool;
}

/// Carries out `decision` (`None`: the handler panicked) on the broker. A copy that cannot
/// be published hands the original back instead: a message is never dropped.
pub(crate) async fn settle<T>(
    decision: Option<Delivery<T>>,
    policy: &Policy,
    broker: &mut impl Broker,
) -> Settled {
    match decision {
        // The handler panicked: back after a while (its lease runs out meanwhile, and the
        // next attempt is counted).
        None => broker.hand_back(policy.unavailable_delay).await,
        Some(Delivery::Ack(_)) => broker.ack().await,
        Some(Delivery::Requeue { after, .. }) => broker.hand_back(after).await,
        Some(Delivery::Nack { after, attempt, .. }) => {
            if broker.retry(attempt, after).await {
                Settled::Retried
            } else {
                broker.hand_back(after).await
            }
        }
        Some(Delivery::DeadLetter { reason, attempt }) => {
            if broker.dead_letter(&reason, attempt).await {
                Settled::DeadLettered
            } else {
                broker.hand_back(policy.unavailable_delay).await
            }
        }
    }
}

/// The [`RETRY_AT_HEADER`](crate::RETRY_AT_HEADER) of a retry copy due after `after`: Unix
/// milliseconds, as text.
#[cfg(any(feature = "nats", feature = "redis-streams"))]
pub(crate) fn retry_at(after: Duration) -> String {
    unix_millis()
        .saturating_add(u64::try_from(after.as_millis()).unwrap_or(u64::MAX))
        .to_string()
}

/// The Unix time in milliseconds (0 before 1970), for the retry deadlines carried in
/// [`RETRY_AT_HEADER`](crate::RETRY_AT_HEADER).
#[cfg(any(feature = "nats", feature = "redis-streams"))]
pub(crate) fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How long a retry copy whose [`RETRY_AT_HEADER`](crate::RETRY_AT_HEADER) says `retry_at`
/// must still wait: `None` when it is due (or the header is absent or garbled). Never longer
/// than `longest` (the policy's longest retry delay), so a clock far ahead on the publishing
/// side cannot park a message for long.
#[cfg(any(feature = "nats", feature = "redis-streams"))]
pub(crate) fn not_due(
    message: &Message,
    longest: std::time::Duration,
) -> Option<std::time::Duration> {
    let retry_at: u64 = message
        .text_header(crate::RETRY_AT_HEADER)?
        .trim()
        .parse()
        .ok()?;
    let left = retry_at.checked_sub(unix_millis()).filter(|&ms| ms > 0)?;
    Some(std::time::Duration::from_millis(left).min(longest))
}
