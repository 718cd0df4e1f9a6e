//! [`IdempotencyLayer`]: the tower layer and its settings.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use idem_core::{Idem, Scope};
use tower_layer::Layer;

use crate::config::Config;
use crate::outcome::Outcome;
use crate::service::IdempotencyService;
use crate::shared::{requests_total, AnswerFilter, Shared};

/// A tower [`Layer`] that makes the guarded methods (POST and PATCH by default) of the
/// wrapped service idempotent with an `Idempotency-Key` header, over an [`Idem`] engine and
/// its store. See the crate docs for what it answers and stores.
///
/// ```
/// use idem_core::{Idem, MemoryStore};
/// use idem_http::{Config, IdempotencyLayer, MissingKey};
///
/// let layer = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
///     .with_config(Config::default().with_missing_key(MissingKey::PassThrough))
///     .with_scope(idem_http::bearer_scope)
///     .with_observer(|outcome| println!("idempotency: {outcome}"));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl IdempotencyLayer {
    /// A layer over `idem` with the default [`Config`], no scope extractor (set one with
    /// [`IdempotencyLayer::with_scope`]: until then every guarded request is anonymous,
    /// see [`crate::Anonymous`]), and no observer.
    pub fn new(idem: Idem) -> Self {
        // Every outcome's series exists from the start (at 0), so a rate or an alert on it
        // sees the series before the first event.
        for outcome in Outcome::ALL {
            requests_total(outcome).increment(0);
        }
        Self {
            shared: Arc::new(Shared {
                idem,
                config: Config::default(),
                scope: None,
                observer: None,
                sealer: Default::default(),
                answers: None,
            }),
        }
    }

    /// The status monitor of this layer's keys (see [`crate::monitor`]) as a service, to
    /// route the requests under [`Config::monitor_path`] to when they do not pass through
    /// the layer's own services.
    pub fn monitor(&self) -> crate::monitor::Monitor {
        crate::monitor::Monitor::new(self.shared.clone())
    }

    /// Replaces the [`Config`].
    pub fn with_config(mut self, config: Config) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        shared.answers = config.jsonrpc.clone().map(|rpc| {
            let stores: AnswerFilter = Arc::new(move |status, headers, body| {
                crate::jsonrpc::storable(&rpc, status, headers, body)
            });
            stores
        });
        shared.config = config;
        self
    }

    /// Sets how a request's scope is found, typically the authenticated principal, so that
    /// one caller's keys never meet another's. Default: none.
    ///
    /// When `scope` returns `None` (an anonymous request), or no extractor is set, the
    /// request is refused with 401 `application/problem+json` (`principal-missing`) before
    /// anything is claimed, unless the route opts into one key space shared by every
    /// anonymous caller with [`Config::with_anonymous`]`(`[`crate::Anonymous::Shared`]`)`
    /// (keyed in [`Scope::global`], apart from every named scope).
    pub fn with_scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.shared).scope = Some(Arc::new(scope));
        self
    }

    /// Sets a function told the [`Outcome`] of every guarded request (for metrics). It runs
    /// on the request's task: keep it quick. Default: none.
    pub fn with_observer(mut self, observer: impl Fn(Outcome) + Send + Sync + 'static) -> Self {
        Arc::make_mut(&mut self.shared).observer = Some(Arc::new(observer));
        self
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// The engine.
    pub fn idem(&self) -> &Idem {
        &self.shared.idem
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("idem", &self.shared.idem)
            .field("config", &self.shared.config)
            .field("scope", &self.shared.scope.as_ref().map(|_| "Fn(&Parts)"))
            .field(
                "observer",
                &self.shared.observer.as_ref().map(|_| "Fn(Outcome)"),
            )
            .finish()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.shared.clone())
    }
}

/// A scope extractor for [`IdempotencyLayer::with_scope`]: the request's
/// `Authorization: Bearer <token>` credential, hashed (SHA-256, hex, prefixed `bearer:`) so
/// that no credential is ever written to the store. `None` without such a header.
///
/// Two tokens of the same principal get different scopes; use an extractor that reads the
/// authenticated principal (for example from an extension an authentication layer put
/// there) when a principal holds several tokens.
pub fn bearer_scope(parts: &Parts) -> Option<Scope> {
    let value = parts
        .headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return None;
    }
    let digest = idem_core::Fingerprint::of_bytes(token.as_bytes()).to_hex();
    Scope::new(format!("bearer:{digest}")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(auth: Option<&str>) -> Parts {
        let mut req = http::Request::builder().uri("/x");
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn bearer_scope_hashes_the_token() {
        let alice = bearer_scope(&parts(Some("Bearer alice"))).unwrap();
        assert!(alice.as_str().starts_with("bearer:"));
        assert!(!alice.as_str().contains("alice"));
        assert_eq!(
            bearer_scope(&parts(Some("bearer  alice "))),
            Some(alice.clone())
        );
        assert_ne!(bearer_scope(&parts(Some("Bearer bob"))), Some(alice));
        assert_eq!(bearer_scope(&parts(Some("Basic YWxpY2U6"))), None);
        assert_eq!(bearer_scope(&parts(Some("Bearer "))), None);
        assert_eq!(bearer_scope(&parts(None)), None);
    }
}
