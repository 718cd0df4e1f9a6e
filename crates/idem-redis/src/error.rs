//! How Redis errors map onto [`idem_core::Error`].

use idem_core::Error;
use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::STORE;

/// Too few replicas acknowledged a write within [`crate::Durability::timeout`]. The source
/// of the [`Error::Unavailable`] that `begin` and `complete` return then.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{acked} of the {wanted} replicas required acknowledged the {step} in time{}",
    if *.kept { " (the write stays on the primary)" } else { " (the lease was released)" }
)]
pub struct ReplicationError {
    /// Replicas that acknowledged (`WAIT`'s answer).
    pub acked: u32,
    /// Replicas required ([`crate::Durability::replicas`]).
    pub wanted: u32,
    /// `"begin"` or `"complete"`.
    pub step: &'static str,
    /// Whether the write stays on the primary (after `complete`) or was undone (after
    /// `begin`, the lease is released).
    pub kept: bool,
}

/// The store refused a server whose `maxmemory-policy` evicts keys
/// ([`crate::EvictionCheck::Refuse`]). The source of the [`Error::Backend`] returned then.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "redis maxmemory-policy is {policy:?}: records may be evicted, letting retries run the \
     work again; set it to noeviction or allow it with EvictionCheck::Warn"
)]
pub struct EvictionPolicyError {
    /// The policy the server reported.
    pub policy: String,
}

/// The error code the scripts use for a value that is not a record.
const CORRUPT: &str = "IDEM_CORRUPT";

/// Maps a Redis error: connection trouble, timeouts and a server that cannot take writes
/// now (out of memory, loading, failing over) are `Unavailable`; a value that is not a record
/// is `Corrupt`; anything else is `Backend`.
pub(crate) fn classify(err: RedisError) -> Error {
    if err.code() == Some(CORRUPT) {
        return Error::corrupt(STORE, err.detail().unwrap_or("not a record").to_owned());
    }
    let transient_server = matches!(
        err.kind(),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        ) | ErrorKind::ClusterConnectionNotFound
    ) || matches!(err.code(), Some("OOM" | "BUSY" | "NOREPLICAS"));
    if err.is_timeout()
        || err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || transient_server
    {
        Error::unavailable(STORE, err)
    } else {
        Error::backend(STORE, err)
    }
}

/// A reply of a shape the scripts never send.
pub(crate) fn unexpected(what: &str, reply: &redis::Value) -> Error {
    Error::backend(STORE, format!("unexpected reply to {what}: {reply:?}"))
}
