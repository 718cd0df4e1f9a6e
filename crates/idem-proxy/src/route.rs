//! [`Route`]: which requests are guarded, and how; [`Proxy`]: the service that picks a
//! route for each request and sends it on.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{ALLOW, AUTHORIZATION, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use idem_core::{BoxError, Idem, Scope, Store};
use idem_http::{IdempotencyLayer, IdempotencyService};
use tower::{Layer, ServiceExt};

use crate::forward::{Forward, ProxyBody, UpstreamConfig, UpstreamFailure};
use crate::ProxyError;

/// One guarded route: the requests whose path starts with [`Route::path`] and whose method
/// is one of the layer's [`idem_http::Config::methods`] run under the idempotency layer with
/// these settings. Every other request is passed through untouched (but for the
/// hop-by-hop and `Forwarded` headers).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Route {
    /// The path prefix, matched by whole segments: `/payments` matches `/payments` and
    /// `/payments/7`, not `/paymentsx`. Default: `/`, every path.
    pub path: String,
    /// The layer's settings: methods guarded (default POST and PATCH), key header, missing
    /// key, anonymous callers, fingerprint, body limits, statuses stored.
    pub http: idem_http::Config,
    /// The engine's settings: lease, retention, wait for an in-flight request.
    pub engine: idem_core::Config,
    /// The request header whose value scopes the keys, hashed (SHA-256) so that no
    /// credential is ever stored. Default: `Authorization`.
    pub scope_header: HeaderName,
    /// Whether a request whose outcome is unknown (sent, and the upstream's answer lost)
    /// releases its key rather than leaving it in flight until its lease ends. Default:
    /// `false`.
    pub release_unknown: bool,
}

impl Default for Route {
    fn default() -> Self {
        Self {
            path: "/".to_owned(),
            http: idem_http::Config::default(),
            engine: idem_core::Config::default(),
            scope_header: AUTHORIZATION,
            release_unknown: false,
        }
    }
}

impl Route {
    /// Whether `path` is under this route's prefix, by whole segments.
    pub fn matches(&self, path: &str) -> bool {
        let prefix = self.path.trim_end_matches('/');
        match path.strip_prefix(prefix) {
            Some(rest) => rest.is_empty() || rest.starts_with('/') || prefix.is_empty(),
            None => false,
        }
    }
}

/// The scope of a request from the value of `header`: [`scope_of`] its value, or `None`
/// when the header is absent or empty.
pub(crate) fn header_scope(header: &HeaderName, parts: &Parts) -> Option<Scope> {
    scope_of(header, parts.headers.get(header)?.as_bytes())
}

/// The scope the proxy keeps a caller's keys in, from the value of its scope header `header`
/// (`None` when `value` is empty or blank): `<header>:<hex>`, the header's name in lower case
/// and the lower-case hex of [`idem_core::Fingerprint::of_bytes`] of the value as sent, the
/// SHA-256 of `idem-fp-v2`, then the part's name `body` and the value, each after its
/// length as 8 big-endian bytes. No credential is stored in clear; an operator derives a
/// caller's scope from its header value with `idem inspect --scope-header-value`.
///
/// ```
/// # use idem_proxy::scope_of;
/// let scope = scope_of(&http::header::AUTHORIZATION, b"Bearer alice").unwrap();
/// assert!(scope.as_str().starts_with("authorization:"));
/// ```
pub fn scope_of(header: &HeaderName, value: &[u8]) -> Option<Scope> {
    if value.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let digest = idem_core::Fingerprint::of_bytes(value).to_hex();
    Scope::new(format!("{header}:{digest}")).ok()
}

/// The reverse proxy as a service: each request goes to the first [`Route`] whose path and
/// methods match it, through the idempotency layer, and on to the upstream; a request no
/// route guards goes straight to the upstream.
#[derive(Clone)]
pub struct Proxy {
    routes: Arc<[Guarded]>,
    forward: Forward,
}

#[derive(Clone)]
struct Guarded {
    route: Route,
    service: IdempotencyService<Forward>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let routes: Vec<&Route> = self.routes.iter().map(|g| &g.route).collect();
        f.debug_struct("Proxy")
            .field("routes", &routes)
            .field("forward", &self.forward)
            .finish()
    }
}

impl Proxy {
    /// A proxy to `upstream` guarding `routes` (in order: the first that matches a request
    /// takes it), with every key in `store`.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Config`] when the upstream's TLS settings cannot be loaded.
    pub fn new(
        store: Arc<dyn Store>,
        upstream: &UpstreamConfig,
        routes: Vec<Route>,
    ) -> Result<Self, ProxyError> {
        let forward = Forward::new(upstream)?;
        let routes = routes
            .into_iter()
            .map(|route| {
                let idem = Idem::from_arc(store.clone()).with_config(route.engine.clone());
                let header = route.scope_header.clone();
                let layer = IdempotencyLayer::new(idem)
                    .with_config(route.http.clone())
                    .with_scope(move |parts: &Parts| header_scope(&header, parts));
                let inner = forward.clone().with_release_unknown(route.release_unknown);
                Guarded {
                    service: layer.layer(inner),
                    route,
                }
            })
            .collect();
        Ok(Self { routes, forward })
    }

    /// Answers one request: guarded by its route, or passed through.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        if self
            .routes
            .iter()
            .any(|g| g.service.is_monitor(req.uri().path()))
        {
            return self.monitor(req).await;
        }
        let guarded = self.routes.iter().find(|g| {
            g.route.matches(req.uri().path()) && g.route.http.methods.contains(req.method())
        });
        let answered = match guarded {
            Some(g) => g
                .service
                .clone()
                .oneshot(req)
                .await
                .map(|response| response.map(BodyExt::boxed_unsync)),
            None => self.forward.clone().oneshot(req).await,
        };
        // A failure reaches here after the layer released its key: it was never stored.
        answered.unwrap_or_else(UpstreamFailure::into_response)
    }

    /// The status monitor (see [`idem_http::monitor`]): `OPTIONS` on its path lists every
    /// route's key lifetime; a lookup is answered by the first route that knows the key
    /// for the caller (each route finds the caller's scope its own way), else 404.
    async fn monitor<B>(&self, req: Request<B>) -> Response<ProxyBody> {
        let (parts, _) = req.into_parts();
        let path = parts.uri.path().trim_end_matches('/');
        let bare = self
            .routes
            .iter()
            .any(|g| g.route.http.monitor_path.trim_end_matches('/') == path);
        if bare && parts.method == Method::OPTIONS {
            let routes: Vec<serde_json::Value> = self
                .routes
                .iter()
                .map(|g| {
                    let mut lifetime = g.service.lifetime();
                    lifetime["path"] = g.route.path.clone().into();
                    lifetime
                })
                .collect();
            let body = serde_json::json!({ "routes": routes }).to_string();
            let body = Full::new(Bytes::from(body)).map_err(|e| match e {});
            let mut response = Response::new(body.boxed_unsync());
            let headers = response.headers_mut();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            headers.insert(ALLOW, HeaderValue::from_static("OPTIONS, GET, HEAD"));
            return response;
        }
        for g in self.routes.iter() {
            if let Some(answer) = g.service.monitor(&parts).await {
                return answer.map(BodyExt::boxed_unsync);
            }
        }
        idem_http::monitor::not_found().map(BodyExt::boxed_unsync)
    }

    /// Whether `method` on `path` would be guarded.
    pub fn guards(&self, method: &Method, path: &str) -> bool {
        self.routes
            .iter()
            .any(|g| g.route.matches(path) && g.route.http.methods.contains(method))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_match_by_whole_segments() {
        let route = |path: &str| Route {
            path: path.to_owned(),
            ..Route::default()
        };
        assert!(route("/").matches("/anything/at/all"));
        assert!(route("/payments").matches("/payments"));
        assert!(route("/payments/").matches("/payments/7"));
        assert!(route("/payments").matches("/payments/7"));
        assert!(!route("/payments").matches("/paymentsx"));
        assert!(!route("/payments").matches("/pay"));
    }

    #[test]
    fn scopes_are_hashed_header_values() {
        let parts = |auth: Option<&str>| {
            let mut req = Request::builder().uri("/");
            if let Some(auth) = auth {
                req = req.header("authorization", auth);
            }
            req.body(()).unwrap().into_parts().0
        };
        let alice = header_scope(&AUTHORIZATION, &parts(Some("Bearer alice"))).unwrap();
        assert!(alice.as_str().starts_with("authorization:"));
        assert!(!alice.as_str().contains("alice"));
        let bob = header_scope(&AUTHORIZATION, &parts(Some("Bearer bob"))).unwrap();
        assert_ne!(alice, bob);
        assert_eq!(header_scope(&AUTHORIZATION, &parts(None)), None);
        assert_eq!(header_scope(&AUTHORIZATION, &parts(Some(" "))), None);
        assert_eq!(scope_of(&AUTHORIZATION, b"Bearer alice"), Some(alice));
    }

    /// The derivation as docs/proxy.md and `scope_of` describe it, computed by hand.
    #[test]
    fn a_scope_is_the_header_name_and_the_framed_sha256_of_the_value() {
        use sha2::{Digest as _, Sha256};
        let value = b"Bearer alice";
        let mut hasher = Sha256::new();
        hasher.update(b"idem-fp-v2");
        hasher.update(4u64.to_be_bytes());
        hasher.update(b"body");
        hasher.update((value.len() as u64).to_be_bytes());
        hasher.update(value);
        let hex: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let scope = scope_of(&HeaderName::from_static("x-api-key"), value).unwrap();
        assert_eq!(scope.as_str(), format!("x-api-key:{hex}"));
    }
}
