//! How sqlx and PostgreSQL errors map to the core's error kinds. SQLSTATE codes and sqlx's
//! error variants decide, never message text.

use idem_core::Error;

/// The store's name in errors.
pub(crate) const NAME: &str = "postgres";

/// A serialization failure (`40001`) or a deadlock (`40P01`) inside a caller's transaction.
///
/// PostgreSQL aborts the transaction on either, so the statement cannot be retried in
/// place: roll back and run the whole transaction again. The store's own calls (on the
/// pool, outside any caller transaction) retry these themselves; this error only reaches
/// callers of the `*_in` methods that pass their own transaction. It comes as the source of
/// an [`Error::Unavailable`] (retryable); [`is_transaction_conflict`] recognises it.
#[derive(Debug, thiserror::Error)]
#[error("transaction conflict (SQLSTATE {code}): roll back and retry the whole transaction")]
pub struct TransactionConflict {
    /// `40001` or `40P01`.
    pub code: String,
    /// The database's error.
    #[source]
    pub source: sqlx::Error,
}

/// Whether `err` is a [`TransactionConflict`]: the caller's transaction was aborted by a
/// serialization failure or a deadlock and must be retried from its start.
pub fn is_transaction_conflict(err: &Error) -> bool {
    match err {
        Error::Unavailable { source, .. } => source.is::<TransactionConflict>(),
        _ => false,
    }
}

/// What an error means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Retryable: the server is going away, overloaded, or the wait was cut short.
    Unavailable,
    /// A serialization failure or a deadlock: retry the statement (outside a caller's
    /// transaction) or the whole transaction (inside one).
    Conflict,
    /// A stored value that does not decode.
    Corrupt,
    /// Anything else.
    Backend,
}

/// Classifies a SQLSTATE.
pub(crate) fn classify_sqlstate(code: &str) -> Class {
    match code {
        "40001" | "40P01" => Class::Conflict,
        // 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now,
        // 57014 query_canceled (statement_timeout), 55P03 lock_not_available (lock_timeout).
        "57P01" | "57P02" | "57P03" | "57014" | "55P03" => Class::Unavailable,
        // Class 08: connection exceptions. Class 53: insufficient resources (53300 too many
        // connections, 53200 out of memory, 53100 disk full).
        _ if code.starts_with("08") || code.starts_with("53") => Class::Unavailable,
        _ => Class::Backend,
    }
}

/// The SQLSTATE of a database error.
pub(crate) fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether the statement that failed with `err` may simply be sent again (outside a caller's
/// transaction): PostgreSQL rolled it back whole.
pub(crate) fn is_conflict(err: &sqlx::Error) -> bool {
    sqlstate(err).is_some_and(|c| classify_sqlstate(&c) == Class::Conflict)
}

/// How a connection's session ended under a statement, as [`session_ended`] tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Before the statement ran: `57P01` (admin_shutdown: a fast shutdown or restart, or
    /// `pg_terminate_backend`) and `57P02` (crash_shutdown) are sent to a session as it is
    /// ended, and PostgreSQL rolled back whatever the statement had started.
    Before,
    /// The connection broke with no word from the server (an immediate shutdown, a crash,
    /// a reset): the statement may have run, and committed, before it broke.
    Unknown,
}

/// Whether, and how, `err` says the connection's session ended under the statement.
pub(crate) fn session_ended(err: &sqlx::Error) -> Option<Ended> {
    use std::io::ErrorKind;
    match err {
        sqlx::Error::Io(io) => matches!(
            io.kind(),
            ErrorKind::UnexpectedEof
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::BrokenPipe
        )
        .then_some(Ended::Unknown),
        _ => sqlstate(err)
            .is_some_and(|c| c == "57P01" || c == "57P02")
            .then_some(Ended::Before),
    }
}

/// Which core error kind a sqlx error becomes.
pub(crate) fn kind(err: &sqlx::Error) -> Class {
    match err {
        // A refused or dropped connection, a TLS failure, no connection free before the
        // acquire timeout, a closed pool, a crashed connection worker: the store is out of
        // reach for now.
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Class::Unavailable,
        sqlx::Error::Database(db) => classify_sqlstate(db.code().as_deref().unwrap_or("")),
        // A value in a row that its column type cannot hold: the stored record is bad.
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => Class::Corrupt,
        _ => Class::Backend,
    }
}

/// Maps a sqlx error to the core's kinds.
pub fn map(err: sqlx::Error) -> Error {
    match kind(&err) {
        Class::Unavailable => Error::unavailable(NAME, err),
        Class::Conflict => Error::unavailable(
            NAME,
            TransactionConflict {
                code: sqlstate(&err).unwrap_or_default(),
                source: err,
            },
        ),
        Class::Corrupt => Error::corrupt(NAME, err.to_string()),
        Class::Backend => Error::backend(NAME, err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_classify() {
        assert_eq!(classify_sqlstate("40001"), Class::Conflict);
        assert_eq!(classify_sqlstate("40P01"), Class::Conflict);
        assert_eq!(classify_sqlstate("57P01"), Class::Unavailable);
        assert_eq!(classify_sqlstate("53300"), Class::Unavailable);
        assert_eq!(classify_sqlstate("08006"), Class::Unavailable);
        assert_eq!(classify_sqlstate("55P03"), Class::Unavailable);
        assert_eq!(classify_sqlstate("42P01"), Class::Backend);
        assert_eq!(classify_sqlstate("23505"), Class::Backend);
        assert_eq!(classify_sqlstate(""), Class::Backend);
    }

    #[test]
    fn transport_errors_are_unavailable() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(map(sqlx::Error::Io(refused)).is_retryable());
        assert!(map(sqlx::Error::PoolTimedOut).is_retryable());
        assert!(map(sqlx::Error::PoolClosed).is_retryable());
        assert!(matches!(
            map(sqlx::Error::Decode("bad".into())),
            Error::Corrupt { .. }
        ));
        assert!(matches!(
            map(sqlx::Error::RowNotFound),
            Error::Backend { .. }
        ));
    }
}
