//! The errors of idem. Outcomes such as replay, in flight and mismatch are values of
//! [`crate::Begin`], not errors.

/// The result of a store or lease operation: `Result<T>` is `Result<T, idem_core::Error>`,
/// as [`std::io::Result`] is for I/O. The error type can still be named for other errors.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A boxed error source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong with a store or a lease.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached or did not answer in time: connection refused or
    /// dropped, a timeout, a full pool, a server out of memory. Retry later; never run the
    /// work unguarded because of it.
    #[error("{store} store unavailable: {source}")]
    Unavailable {
        /// The backend's name (`"memory"`, `"redis"`, `"postgres"`, ...).
        store: &'static str,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// The store answered with an error that retrying will not fix (a bad configuration, a
    /// missing table, a script error).
    #[error("{store} store error: {source}")]
    Backend {
        /// The backend's name.
        store: &'static str,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// A stored record could not be decoded. It is left as it is for an operator to look at.
    #[error("{store} store holds a corrupt record: {detail}")]
    Corrupt {
        /// The backend's name.
        store: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The lease was taken over, released, or its record expired: nothing was changed.
    #[error("lease lost: the key was taken over, released or expired, and nothing was changed")]
    LeaseLost,
    /// The store does not offer this operation.
    #[error("the {store} store does not support {what}")]
    Unsupported {
        /// The backend's name.
        store: &'static str,
        /// The operation.
        what: &'static str,
    },
    /// A request to the store was refused before it was sent (for example a body over the
    /// store's limit).
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl Error {
    /// An [`Error::Unavailable`] from any error.
    pub fn unavailable(store: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Unavailable {
            store,
            source: source.into(),
        }
    }

    /// An [`Error::Backend`] from any error.
    pub fn backend(store: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Backend {
            store,
            source: source.into(),
        }
    }

    /// An [`Error::Corrupt`].
    pub fn corrupt(store: &'static str, detail: impl Into<String>) -> Self {
        Self::Corrupt {
            store,
            detail: detail.into(),
        }
    }

    /// Whether the same call may succeed later (only [`Error::Unavailable`]).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }
}
