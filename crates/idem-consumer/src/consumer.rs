//! [`Consumer`]: runs a message's handler once per key and decides what happens to the
//! delivery.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::telemetry::KeyHash;
use idem_core::{
    Error, Failure, FailurePolicy, Fingerprint, Idem, Key, Lease, Once, OnceError, RecordId, Scope,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::key::{child_key, FingerprintSource, InvalidMessage, KeySource};
use crate::message::Message;

/// The shortest delay of a [`Delivery::Requeue`], so that a lease on the point of expiring
/// does not make a delivery bounce between broker and consumer in a tight loop.
pub const MIN_REQUEUE_DELAY: Duration = Duration::from_millis(20);

/// What to do with a message whose handler failed for good ([`Failure::Terminal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnTerminal {
    /// Dead-letter the message and release its key (the default): an operator can look at it,
    /// fix the cause and republish it, and the handler runs again. A duplicate that arrives
    /// meanwhile runs the handler again too (and is dead-lettered again if it fails again).
    #[default]
    DeadLetter,
    /// Store the failure and ack: every duplicate is acked with
    /// [`Outcome::FailedBefore`] without running the handler. Nothing is dead-lettered for a
    /// terminal failure (retries that run out are dead-lettered all the same).
    StoreAndAck,
    /// Store the failure and dead-letter the message: duplicates are acked with
    /// [`Outcome::FailedBefore`]; republishing the dead letter does not run the handler again
    /// until the record is evicted or expires.
    StoreAndDeadLetter,
}

impl OnTerminal {
    fn failure_policy(self) -> FailurePolicy {
        match self {
            Self::DeadLetter => FailurePolicy::Release,
            Self::StoreAndAck | Self::StoreAndDeadLetter => FailurePolicy::Store,
        }
    }
}

/// How a [`Consumer`] retries, requeues and gives up. Every field has a documented default.
#[derive(Debug, Clone, PartialEq, Eq, derive_setters::Setters)]
#[setters(prefix = "with_")]
#[non_exhaustive]
pub struct Policy {
    /// How many times the handler may start on one message before it is dead-lettered.
    /// Counted as the failed attempts in [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER) plus the
    /// acquisitions of the key in the store, so a consumer that crashed (or lost its lease)
    /// while running the handler counts too, and a message that kills every consumer is
    /// dead-lettered instead of looping forever. Values below 1 count as 1. Default: 5.
    pub max_attempts: u32,
    /// The delay before the second attempt after a [`Failure::Retryable`]; it doubles with
    /// every further attempt. Default: 1 s.
    pub retry_delay: Duration,
    /// The longest delay between two attempts. Default: 60 s.
    pub max_retry_delay: Duration,
    /// What a terminal failure does. Default: [`OnTerminal::DeadLetter`].
    pub on_terminal: OnTerminal,
    /// When another consumer holds a live lease on the key, the message is requeued after the
    /// holder's lease time left, but never later than this (at least [`MIN_REQUEUE_DELAY`]).
    /// Default: 5 s.
    pub max_in_flight_delay: Duration,
    /// When the store is unavailable (or answers with an error), the message is requeued
    /// after this long, and the handler does not run. Default: 1 s.
    pub unavailable_delay: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            on_terminal: OnTerminal::DeadLetter,
            max_in_flight_delay: Duration::from_secs(5),
            unavailable_delay: Duration::from_secs(1),
        }
    }
}

impl Policy {
    /// The delay before the attempt after failed attempt number `attempt` (1-based):
    /// `retry_delay * 2^(attempt - 1)`, at most `max_retry_delay`.
    pub fn retry_delay_after(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(30);
        self.retry_delay
            .saturating_mul(1u32 << doublings)
            .min(self.max_retry_delay)
    }
}

/// What to do with a delivery, as decided by [`Consumer::process`].
#[must_use = "a delivery must be acked, requeued, nacked or dead-lettered"]
#[derive(Debug)]
pub enum Delivery<T> {
    /// Ack the delivery: the work is done (now or before), or its terminal failure is stored.
    Ack(Outcome<T>),
    /// Put the message back for a later delivery, after `after`; this was not an attempt of
    /// the handler, so keep [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER) as it is. Never drop it:
    /// if the consumer holding the key dies, this copy is the one that gets the work done.
    Requeue {
        /// How long to wait before the message is delivered again.
        after: Duration,
        /// Why.
        reason: RequeueReason,
    },
    /// The handler failed and may succeed later: its key was released. Deliver the message
    /// again after `after`, with [`ATTEMPT_HEADER`](crate::ATTEMPT_HEADER) set to `attempt`.
    Nack {
        /// The retry delay from the [`Policy`].
        after: Duration,
        /// The attempts made so far, this one included.
        attempt: u32,
        /// The handler's error.
        error: String,
    },
    /// Move the message to the dead-letter queue (and ack or reject the original); never ack
    /// it silently.
    DeadLetter {
        /// Why.
        reason: DeadLetterReason,
        /// The attempts made so far.
        attempt: u32,
    },
}

/// The result of a delivery that is acked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The handler ran now and its value was stored.
    Executed {
        /// The handler's value.
        value: T,
        /// Which attempt this was (1 for the first).
        attempt: u32,
    },
    /// A duplicate: the handler ran before, and this is its stored value.
    Replayed(T),
    /// A duplicate of a message whose terminal failure was stored: its message.
    FailedBefore(String),
    /// The handler failed for good now and the failure was stored
    /// ([`OnTerminal::StoreAndAck`]).
    Failed {
        /// The handler's error.
        error: String,
        /// Which attempt this was.
        attempt: u32,
    },
}

/// Why a [`Delivery::Requeue`].
#[derive(Debug)]
#[non_exhaustive]
pub enum RequeueReason {
    /// Another consumer holds a live lease on the key (a duplicate in progress, or a consumer
    /// that died and whose lease has not run out yet).
    InFlight,
    /// The lease was lost while the handler ran (it ran longer than the lease and could not
    /// extend it, or another consumer took the key over): the handler was cancelled at its
    /// next `.await`, and the consumer now holding the key finishes the work.
    LeaseLost,
    /// The store failed; the handler did not run unguarded.
    Store(Error),
}

/// Why a [`Delivery::DeadLetter`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The message has no usable key or fingerprint; the handler did not run.
    Invalid(InvalidMessage),
    /// The key was used before by a message with another fingerprint: a key collision or a
    /// reused key, not a duplicate. The handler did not run.
    Mismatch,
    /// The key's message was handled before, and its stored value was forgotten when its
    /// retention ended (the engine's `after_retention` is `Refuse`): the handler did not
    /// run again.
    Expired,
    /// The handler failed for good; `stored` tells whether the failure was stored for replay.
    Terminal {
        /// The handler's error.
        error: String,
        /// Whether the failure was stored.
        stored: bool,
    },
    /// The handler kept failing (or its consumers kept crashing) until
    /// [`Policy::max_attempts`] ran out.
    Exhausted {
        /// The last error.
        error: String,
        /// Whether the failure was stored.
        stored: bool,
    },
    /// The handler's value could not be stored as JSON, or a stored value does not decode
    /// as the handler's type (a programming error, or a deploy that changed the type).
    Codec(String),
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(e) => write!(f, "invalid message: {e}"),
            Self::Mismatch => f.write_str("key reused by a message with another fingerprint"),
            Self::Expired => f.write_str("key handled before, its stored value since forgotten"),
            Self::Terminal { error, .. } => write!(f, "terminal failure: {error}"),
            Self::Exhausted { error, .. } => write!(f, "attempts exhausted: {error}"),
            Self::Codec(e) => write!(f, "stored value codec error: {e}"),
        }
    }
}

impl<T> Delivery<T> {
    /// A short name for logs and metrics: `"ack"`, `"requeue"`, `"nack"`, `"dead-letter"`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Ack(_) => "ack",
            Self::Requeue { .. } => "requeue",
            Self::Nack { .. } => "nack",
            Self::DeadLetter { .. } => "dead-letter",
        }
    }

    /// The handler's value, whether it ran now or before.
    pub fn value(&self) -> Option<&T> {
        match self {
            Self::Ack(Outcome::Executed { value, .. } | Outcome::Replayed(value)) => Some(value),
            _ => None,
        }
    }
}

/// What a handler is told about the delivery it runs for.
#[derive(Debug, Clone)]
pub struct Context {
    id: RecordId,
    attempt: u32,
    lease: Lease,
    /// What [`Context::retry_after`] asked for, read once the handler has returned.
    retry_after: Arc<Mutex<Option<Duration>>>,
}

impl Context {
    /// The message's record: its scope and key.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// The message's idempotency key.
    pub fn key(&self) -> &Key {
        self.id.key()
    }

    /// Which attempt this is: 1 for the first; counts failed attempts and takeovers from
    /// consumers that crashed.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The lease the handler runs under (extended in the background while it runs).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// A stable key for a downstream step of this message: see [`child_key`].
    pub fn child_key(&self, step: &str) -> Key {
        child_key(self.id.key(), step)
    }

    /// Asks that, if this attempt fails with [`Failure::Retryable`], the next one start no
    /// sooner than `after` (say, the `Retry-After` a service the handler called answered
    /// with): the retry then waits the longer of `after` and the policy's delay, at most
    /// [`Policy::max_retry_delay`]. The last call wins; without one, the policy's delay.
    pub fn retry_after(&self, after: Duration) {
        // A poisoned lock only means another clone panicked mid-write of an Option.
        *self
            .retry_after
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(after);
    }
}

/// Runs each message's handler once per key over an at-least-once broker, and tells the
/// caller what to do with the delivery ([`Delivery`]).
///
/// Each message gets a record in the engine's store under a scope (the consumer group or
/// queue, so that two groups each handle the message once) and a key (from a header or a
/// payload hash, see [`KeySource`]). The handler runs under [`Idem::execute_once`]: its value
/// is stored as JSON, a duplicate is acked with the stored value, a duplicate of a message in
/// progress is requeued (never dropped), and a store that fails means requeue, never
/// running the handler unguarded.
///
/// The engine's [`Config`](idem_core::Config) is used as given (its lease, extended while the
/// handler runs; its retention, which must outlast the broker's redelivery window; its
/// `wait`, which makes a duplicate wait for the holder's result instead of being requeued),
/// except its [`FailurePolicy`], which [`Policy::on_terminal`] decides. The crate docs'
/// quick start shows a duplicate acked with the stored value.
#[derive(Debug, Clone)]
pub struct Consumer {
    idem: Idem,
    scope: Scope,
    scope_header: Option<String>,
    keys: KeySource,
    fingerprints: FingerprintSource,
    policy: Policy,
}

/// How one run under `execute_once` failed; its `Display` is what a stored failure holds.
#[derive(Debug)]
enum RunError {
    Handler {
        error: String,
        attempt: u32,
        retryable: bool,
    },
    Exhausted {
        error: String,
        attempt: u32,
    },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handler { error, .. } => f.write_str(error),
            Self::Exhausted { error, attempt } => {
                write!(f, "gave up after {attempt} attempts: {error}")
            }
        }
    }
}

impl Consumer {
    /// A consumer over `idem` whose records live in `scope` (name it after the consumer group
    /// or queue, and never reuse the scope of the HTTP requests whose keys the messages
    /// carry: their records hold HTTP responses). Default key source, fingerprint source and
    /// policy.
    pub fn new(idem: Idem, scope: Scope) -> Self {
        let policy = Policy::default();
        Self {
            idem: with_failure_policy(idem, policy.on_terminal),
            scope,
            scope_header: None,
            keys: KeySource::default(),
            fingerprints: FingerprintSource::default(),
            policy,
        }
    }

    /// Where keys come from. Default: the [`IDEMPOTENCY_KEY_HEADER`](crate::IDEMPOTENCY_KEY_HEADER)
    /// header.
    pub fn with_keys(mut self, keys: KeySource) -> Self {
        self.keys = keys;
        self
    }

    /// What fingerprints are computed from. Default: the payload's bytes.
    pub fn with_fingerprints(mut self, fingerprints: FingerprintSource) -> Self {
        self.fingerprints = fingerprints;
        self
    }

    /// Appends the text of header `name` (for example
    /// [`IDEMPOTENCY_SCOPE_HEADER`](crate::IDEMPOTENCY_SCOPE_HEADER), the tenant of the HTTP
    /// request) to the scope: records then live in `"<scope>/<header>"`, so tenants that pick
    /// the same key never share a record. A message without the header, or whose combined
    /// scope is longer than [`idem_core::MAX_SCOPE_LEN`], is dead-lettered. Default: not set.
    pub fn with_scope_header(mut self, name: impl Into<String>) -> Self {
        self.scope_header = Some(name.into());
        self
    }

    /// The retry, requeue and dead-letter policy. Default: [`Policy::default`].
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.idem = with_failure_policy(self.idem, policy.on_terminal);
        self.policy = policy;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The engine.
    pub fn idem(&self) -> &Idem {
        &self.idem
    }

    /// The record and fingerprint of `message`.
    ///
    /// # Errors
    ///
    /// [`InvalidMessage`] when it has no usable key, scope or fingerprint.
    pub fn identify(&self, message: &Message) -> Result<(RecordId, Fingerprint), InvalidMessage> {
        let scope = match &self.scope_header {
            None => self.scope.clone(),
            Some(name) => {
                let tenant =
                    message
                        .text_header(name)
                        .ok_or_else(|| InvalidMessage::MissingScope {
                            header: name.clone(),
                        })?;
                // The consumer's own scope comes first and is the same for every message, so
                // "<scope>/<tenant>" is injective in the tenant.
                Scope::new(format!("{}/{}", self.scope, tenant))?
            }
        };
        let key = self.keys.key_of(message)?;
        let fingerprint = self.fingerprints.fingerprint_of(message)?;
        Ok((RecordId::new(scope, key), fingerprint))
    }

    /// Runs `handler` for `message` unless its key was handled before, and decides what to do
    /// with the delivery. The handler's value is stored as JSON and handed to every
    /// duplicate. See [`Delivery`] for each decision; this never panics and never returns an
    /// error: every failure is a decision.
    ///
    /// The handler is dropped at its next `.await` if the lease is lost while it runs (see
    /// [`Idem::execute_once`]); what it did before then stands, so keep the lease longer than
    /// the handler's longest pause between `.await`s, and make the side effect itself
    /// idempotent where it can be (pass [`Context::child_key`] to a payment provider).
    pub async fn process<T, E, F, Fut>(&self, message: &Message, handler: F) -> Delivery<T>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, Failure<E>>>,
    {
        let before = message.failed_attempts();
        let (id, fingerprint) = match self.identify(message) {
            Ok(found) => found,
            Err(invalid) => {
                tracing::warn!(error = %invalid, "message without a usable key: dead-lettered");
                return Delivery::DeadLetter {
                    reason: DeadLetterReason::Invalid(invalid),
                    attempt: before,
                };
            }
        };
        let max_attempts = self.policy.max_attempts.max(1);
        let asked = Arc::new(Mutex::new(None));
        let retry_after = asked.clone();
        let work = |lease: Lease| async move {
            let attempt = before.saturating_add(lease.attempt());
            if attempt > max_attempts {
                // Earlier attempts ended without a result (consumers crashed while holding the
                // key): do not start the handler again.
                return Err(Failure::Terminal(RunError::Exhausted {
                    error: format!(
                        "the handler started {} times without finishing (consumers crashed or \
                         lost their lease)",
                        attempt - 1
                    ),
                    attempt: attempt - 1,
                }));
            }
            let ctx = Context {
                id: lease.id().clone(),
                attempt,
                lease,
                retry_after,
            };
            match handler(ctx).await {
                Ok(value) => Ok(value),
                Err(Failure::Retryable(e)) if attempt >= max_attempts => {
                    Err(Failure::Terminal(RunError::Exhausted {
                        error: e.to_string(),
                        attempt,
                    }))
                }
                Err(Failure::Retryable(e)) => Err(Failure::Retryable(RunError::Handler {
                    error: e.to_string(),
                    attempt,
                    retryable: true,
                })),
                Err(Failure::Terminal(e)) => Err(Failure::Terminal(RunError::Handler {
                    error: e.to_string(),
                    attempt,
                    retryable: false,
                })),
            }
        };
        let decision = match self.idem.execute_once(&id, fingerprint, work).await {
            Ok(once) => self.on_once(once, before),
            Err(e) => {
                let asked = *asked
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                self.on_error(e, before, asked)
            }
        };
        match &decision {
            Delivery::DeadLetter { reason, attempt } => {
                tracing::warn!(key_hash = %KeyHash::of(&id), attempt, %reason, "dead-lettered");
            }
            Delivery::Nack {
                after,
                attempt,
                error,
            } => {
                tracing::info!(key_hash = %KeyHash::of(&id), attempt, ?after, %error, "handler failed; retry later")
            }
            Delivery::Requeue { after, reason } => {
                tracing::debug!(key_hash = %KeyHash::of(&id), ?after, ?reason, "requeued");
            }
            Delivery::Ack(_) => tracing::debug!(key_hash = %KeyHash::of(&id), "acked"),
        }
        decision
    }

    fn on_once<T>(&self, once: Once<T>, before: u32) -> Delivery<T> {
        match once {
            Once::Executed { value, attempt } => Delivery::Ack(Outcome::Executed {
                value,
                attempt: before.saturating_add(attempt),
            }),
            Once::Replayed(value) => Delivery::Ack(Outcome::Replayed(value)),
            Once::FailedBefore(error) => Delivery::Ack(Outcome::FailedBefore(error)),
            Once::InFlight { retry_after } => Delivery::Requeue {
                after: retry_after.clamp(
                    MIN_REQUEUE_DELAY,
                    self.policy.max_in_flight_delay.max(MIN_REQUEUE_DELAY),
                ),
                reason: RequeueReason::InFlight,
            },
            Once::Mismatch => Delivery::DeadLetter {
                reason: DeadLetterReason::Mismatch,
                attempt: before,
            },
            Once::Expired { .. } => Delivery::DeadLetter {
                reason: DeadLetterReason::Expired,
                attempt: before,
            },
        }
    }

    /// The decision for a run that failed; `asked`: the handler's [`Context::retry_after`].
    fn on_error<T>(
        &self,
        error: OnceError<RunError>,
        before: u32,
        asked: Option<Duration>,
    ) -> Delivery<T> {
        match error {
            OnceError::Work {
                error:
                    RunError::Handler {
                        error,
                        attempt,
                        retryable: true,
                    },
                ..
            } => Delivery::Nack {
                after: self
                    .policy
                    .retry_delay_after(attempt)
                    .max(asked.unwrap_or_default().min(self.policy.max_retry_delay)),
                attempt,
                error,
            },
            OnceError::Work {
                error:
                    RunError::Handler {
                        error,
                        attempt,
                        retryable: false,
                    },
                stored,
            } => {
                if stored && self.policy.on_terminal == OnTerminal::StoreAndAck {
                    Delivery::Ack(Outcome::Failed { error, attempt })
                } else {
                    Delivery::DeadLetter {
                        reason: DeadLetterReason::Terminal { error, stored },
                        attempt,
                    }
                }
            }
            OnceError::Work {
                error: RunError::Exhausted { error, attempt },
                stored,
            } => Delivery::DeadLetter {
                reason: DeadLetterReason::Exhausted { error, stored },
                attempt,
            },
            OnceError::Store(Error::LeaseLost) => Delivery::Requeue {
                after: self.policy.max_in_flight_delay.max(MIN_REQUEUE_DELAY),
                reason: RequeueReason::LeaseLost,
            },
            OnceError::Store(e) => Delivery::Requeue {
                after: self.policy.unavailable_delay,
                reason: RequeueReason::Store(e),
            },
            OnceError::Codec(e) => Delivery::DeadLetter {
                reason: DeadLetterReason::Codec(e.to_string()),
                attempt: before,
            },
        }
    }
}

fn with_failure_policy(idem: Idem, on_terminal: OnTerminal) -> Idem {
    let mut config = idem.config().clone();
    config.failure = on_terminal.failure_policy();
    idem.with_config(config)
}
