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
}

impl Shared {
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

/// The `idem_http_requests_total` counter of `outcome`. Each label is a literal (the same
/// as [`Outcome::as_str`], which a test checks): with literal labels the macro keeps the key
/// in a static, where a label it is handed at run time makes it allocate and hash a key on
/// every request.
pub(crate) fn requests_total(outcome: Outcome) -> metrics::Counter {
    macro_rules! counter {
        ($label:literal) => {
            metrics::counter!("idem_http_requests_total", "outcome" => $label)
        };
    }
    match outcome {
        Outcome::Executed => counter!("executed"),
        Outcome::NotStored => counter!("not_stored"),
        Outcome::Replayed => counter!("replayed"),
        Outcome::InFlight => counter!("in_flight"),
        Outcome::Mismatch => counter!("mismatch"),
        Outcome::Rejected => counter!("rejected"),
        Outcome::StoreError => counter!("store_error"),
        Outcome::Unguarded => counter!("unguarded"),
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::DebuggingRecorder;

    use super::*;

    #[test]
    fn each_outcome_counts_under_its_own_name() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            for (n, outcome) in (1..).zip(Outcome::ALL) {
                requests_total(outcome).increment(n);
            }
        });
        let mut counted: Vec<(String, u64)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                metrics_util::debugging::DebugValue::Counter(n) => {
                    let key = key.key();
                    assert_eq!(key.name(), "idem_http_requests_total");
                    let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
                    let [("outcome", label)] = labels[..] else {
                        panic!("one label, outcome: {labels:?}");
                    };
                    Some((label.to_owned(), n))
                }
                _ => None,
            })
            .collect();
        counted.sort();
        let mut expected: Vec<(String, u64)> = (1..)
            .zip(Outcome::ALL)
            .map(|(n, outcome)| (outcome.as_str().to_owned(), n))
            .collect();
        expected.sort();
        assert_eq!(counted, expected);
    }
}
