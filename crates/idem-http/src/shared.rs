//! [`Shared`]: the state every service made by one layer shares, and how the layer reports
//! what it did.

use std::sync::Arc;

use http::request::Parts;
use idem_core::{Idem, Scope};

use crate::config::Config;
use crate::outcome::Outcome;

/// Finds the scope of a request from its head (method, URI, headers, extensions).
pub type ScopeFn = Arc<dyn Fn(&Parts) -> Option<Scope> + Send + Sync>;

/// Told what the layer did with each guarded request.
pub type ObserverFn = Arc<dyn Fn(Outcome) + Send + Sync>;

/// What every service made by one layer shares.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) idem: Idem,
    pub(crate) config: Config,
    pub(crate) scope: Option<ScopeFn>,
    pub(crate) observer: Option<ObserverFn>,
    /// The key sealing the status monitor's ids, once read.
    pub(crate) sealer: Sealer,
    /// Which answers a JSON-RPC route stores (by their JSON-RPC response, not only their
    /// status); `None` on an HTTP route.
    pub(crate) answers: Option<AnswerFilter>,
}

/// Whether an answer (its status, headers and whole body) is stored.
pub(crate) type AnswerFilter =
    Arc<dyn Fn(http::StatusCode, &http::HeaderMap, &[u8]) -> bool + Send + Sync>;

/// The key that seals the status monitor's ids (see [`crate::monitor`]), once read from (or
/// written to) the store, and when a read last failed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sealer {
    pub(crate) key: Arc<tokio::sync::OnceCell<[u8; 32]>>,
    pub(crate) failed: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

impl Shared {
    /// Whether an answer is stored: by [`Shared::answers`] on a JSON-RPC route, else by
    /// its status ([`Config::store_status`]).
    pub(crate) fn stores(
        &self,
        status: http::StatusCode,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> bool {
        match &self.answers {
            Some(stores) => stores(status, headers, body),
            None => (self.config.store_status)(status),
        }
    }

    /// Reports what the layer did with a guarded request: to the observer, to the request's
    /// span (`outcome`), and as the `idem_http_requests_total` counter.
    pub(crate) fn observe(&self, outcome: Outcome) {
        tracing::Span::current().record("outcome", outcome.as_str());
        requests_total(outcome).increment(1);
        if let Some(observer) = &self.observer {
            observer(outcome);
        }
    }
}

/// The `idem_http_requests_total` counter of `outcome`.
pub(crate) fn requests_total(outcome: Outcome) -> metrics::Counter {
    metrics::counter!("idem_http_requests_total", "outcome" => outcome.as_str())
}
