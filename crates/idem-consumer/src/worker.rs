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
use tokio::task::{JoinHandle, JoinSet};

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

impl Settled {
    /// `self` when the broker took the step `what` (an ack, a NAK...); unsettled when it
    /// answered `result` with an error (and `then` says what the broker does now).
    #[cfg(any(feature = "nats", feature = "redis-streams"))]
    pub(crate) fn unless_failed<E: fmt::Display>(
        self,
        result: Result<(), E>,
        what: &str,
        then: &str,
    ) -> Settled {
        match result {
            Ok(()) => self,
            Err(e) => {
                tracing::warn!(error = %e, "{what} failed; {then}");
                Settled::Unsettled
            }
        }
    }
}

/// Adds what a delivery task returned to `summary`.
fn count(summary: &mut Summary, done: Result<Settled, tokio::task::JoinError>) {
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
async fn next_slot<F: Future<Output = ()>>(
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

/// Where a worker takes its deliveries from, and how it stops taking them.
pub(crate) trait Source {
    /// One delivery taken, with what it takes to settle it.
    type Broker: Broker;
    /// How the source fails for good.
    type Error;
    /// Waits for the next delivery. Cancel safe: dropped when shutdown starts.
    async fn next(&mut self) -> Next<Self::Broker, Self::Error>;
    /// Shutdown, step 1 (`failed`: the source ended in [`Next::Failed`]): take no more
    /// deliveries, and hand back those taken but not started.
    async fn stop(&mut self, _failed: bool) {}
    /// Shutdown, last step, once the handlers in progress have settled their deliveries:
    /// says the worker stopped, having done `summary`.
    async fn close(self, summary: &Summary);
}

/// What [`Source::next`] came back with. (A broker built alone may not need every variant.)
#[cfg_attr(
    not(all(feature = "nats", feature = "rabbitmq", feature = "redis-streams")),
    allow(dead_code)
)]
pub(crate) enum Next<B, E> {
    /// A delivery to run.
    Delivery(B),
    /// Nothing this time (an empty read, a failure the client recovers from): ask again.
    Again,
    /// The source failed for good: stop and report it.
    Failed(E),
    /// No more deliveries will come: stop.
    End,
}

/// What every worker holds besides its topology and its broker's options: its consumer, and
/// how many handlers run at once.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) consumer: Consumer,
    pub(crate) concurrency: usize,
}

impl Settings {
    /// `consumer`, with concurrency 4.
    pub(crate) fn new(consumer: Consumer) -> Self {
        Self {
            consumer,
            concurrency: 4,
        }
    }
}

/// A worker's `with_concurrency` option and its `run`, the same for every worker (the
/// bounds on the handler said once): `run` takes the broker connection `$conn: $Conn`,
/// starts the worker's [`Source`] with its `source(&self, $conn)`, runs it, and reports a
/// failure of the source as `Error::$failed`. The names in the signature resolve in the
/// broker's module.
macro_rules! run_method {
    ($(#[$doc:meta])* $conn:ident: $Conn:ty, Error::$failed:ident) => {
        /// How many handlers run at once (at least 1). Default: 4.
        pub fn with_concurrency(mut self, concurrency: usize) -> Self {
            self.settings.concurrency = concurrency.max(1);
            self
        }

        $(#[$doc])*
        pub async fn run<T, E, H, Fut>(
            &self,
            $conn: $Conn,
            handler: H,
            shutdown: impl Future<Output = ()>,
        ) -> Result<Summary, Error>
        where
            T: Serialize + DeserializeOwned + Send + 'static,
            E: fmt::Display + Send + 'static,
            H: Fn(Message, Context) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<T, Failure<E>>> + Send + 'static,
        {
            let source = self.source($conn).await?;
            let settings = &self.settings;
            worker::run(source, &settings.consumer, settings.concurrency, handler, shutdown)
                .await
                .map_err(|(source, summary)| Error::$failed { source, summary })
        }
    };
}
pub(crate) use run_method;

/// Runs deliveries from `source` through `consumer` with at most `concurrency` handlers at
/// once, until `shutdown` completes or the source ends; then stops `source`, lets the
/// handlers in progress finish and settle their deliveries, and closes it. Returns what was
/// done; with the source's failure if it failed.
pub(crate) async fn run<S, T, E, H, Fut>(
    mut source: S,
    consumer: &Consumer,
    concurrency: usize,
    handler: H,
    shutdown: impl Future<Output = ()>,
) -> Result<Summary, (S::Error, Summary)>
where
    S: Source,
    T: Serialize + DeserializeOwned + Send + 'static,
    E: fmt::Display + Send + 'static,
    H: Fn(Message, Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, Failure<E>>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let policy = consumer.policy();
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut tasks = JoinSet::new();
    let mut summary = Summary::default();
    let mut failure = None;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A free handler slot first, so that deliveries are taken only when a handler can
        // start on them soon (the broker's redelivery clock runs from the delivery).
        let Some(slot) = next_slot(&slots, &mut tasks, &mut summary, &mut shutdown).await else {
            break;
        };
        let next = tokio::select! {
            () = &mut shutdown => break,
            next = source.next() => next,
        };
        match next {
            Next::Delivery(broker) => {
                let (consumer, handler) = (consumer.clone(), handler.clone());
                // The handler runs in a task of its own, so that a panic in it is caught
                // and the delivery is still settled.
                let decide = move |message: Message| {
                    tokio::spawn(async move {
                        consumer
                            .process(&message, |ctx| handler(message.clone(), ctx))
                            .await
                    })
                };
                tasks.spawn(handle(broker, policy.clone(), decide, slot));
            }
            Next::Again => {}
            Next::Failed(e) => {
                failure = Some(e);
                break;
            }
            Next::End => break,
        }
    }
    source.stop(failure.is_some()).await;
    while let Some(done) = tasks.join_next().await {
        count(&mut summary, done);
    }
    source.close(&summary).await;
    match failure {
        Some(e) => Err((e, summary)),
        None => Ok(summary),
    }
}

/// One delivery's task: a retry copy that is not due yet goes back at once (not an
/// attempt); otherwise `decide` runs the handler (with the broker's heartbeat meanwhile, if
/// it has one), `slot` is freed, and the decision is carried out. A handler that panicked
/// hands the delivery back: its lease runs out and the next attempt is counted.
async fn handle<B: Broker, T>(
    mut broker: B,
    policy: Policy,
    decide: impl FnOnce(Message) -> JoinHandle<Delivery<T>>,
    slot: OwnedSemaphorePermit,
) -> Settled {
    let message = broker.message();
    if B::RETRY_AT {
        if let Some(left) = not_due(&message, policy.max_retry_delay) {
            drop(slot);
            return broker.hand_back(left).await;
        }
    }
    let decided = decide(message);
    let decided = match broker.heartbeat() {
        Some(period) => with_heartbeat(decided, period, || broker.beat()).await,
        None => decided.await,
    };
    drop(slot);
    let decision = decided
        .inspect_err(|e| tracing::error!(error = %e, "handler panicked; handing the delivery back"))
        .ok();
    settle(decision, &policy, &mut broker).await
}

/// Awaits `decided`, with `beat` called every `period` meanwhile: the sign of
/// life that stops the broker from handing the delivery to another worker while the handler
/// runs (the engine extends the lease in the store).
async fn with_heartbeat<D, B, Beat>(
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

/// One delivery taken by a worker, and the steps the worker takes on its broker to settle
/// it; [`settle`] chooses between them, the same way for every broker.
pub(crate) trait Broker: Send + Sync + 'static {
    /// Whether retry copies come back to the consumed stream with
    /// [`RETRY_AT_HEADER`](crate::RETRY_AT_HEADER), to be handed back until they are due.
    const RETRY_AT: bool;
    /// The delivery as a [`Message`].
    fn message(&self) -> Message;
    /// How often [`Broker::beat`] must run while the handler does; `None`: never.
    fn heartbeat(&self) -> Option<Duration> {
        None
    }
    /// A sign of life: the delivery is still being worked on.
    fn beat(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// Acknowledges the delivery: done.
    fn ack(&mut self) -> impl Future<Output = Settled> + Send;
    /// Hands the delivery back, to be delivered again after `after` (not an attempt).
    fn hand_back(&mut self, after: Duration) -> impl Future<Output = Settled> + Send;
    /// Publishes a copy for a retry after `after`, with [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER)
    /// set to `attempt`, and acknowledges the original once the copy is confirmed. False
    /// (the original untouched) when the copy was not confirmed.
    fn retry(&mut self, attempt: u32, after: Duration) -> impl Future<Output = bool> + Send;
    /// Publishes a copy to the dead-letter destination, with
    /// [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) and
    /// [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER), and acknowledges the original once the
    /// copy is confirmed. False (the original untouched) when the copy was not confirmed.
    fn dead_letter(
        &mut self,
        reason: &DeadLetterReason,
        attempt: u32,
    ) -> impl Future<Output = bool> + Send;
}

/// Carries out `decision` (`None`: the handler panicked) on the broker. A copy that cannot
/// be published hands the original back instead: a message is never dropped.
async fn settle<T>(
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
pub(crate) fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How long a retry copy whose [`RETRY_AT_HEADER`](crate::RETRY_AT_HEADER) says `retry_at`
/// must still wait: `None` when it is due (or the header is absent or garbled). Never longer
/// than `longest` (the policy's longest retry delay), so a clock far ahead on the publishing
/// side cannot park a message for long.
fn not_due(message: &Message, longest: std::time::Duration) -> Option<std::time::Duration> {
    let retry_at: u64 = message
        .text_header(crate::RETRY_AT_HEADER)?
        .trim()
        .parse()
        .ok()?;
    let left = retry_at.checked_sub(unix_millis()).filter(|&ms| ms > 0)?;
    Some(std::time::Duration::from_millis(left).min(longest))
}
