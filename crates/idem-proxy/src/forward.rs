//! [`Forward`]: the service behind the idempotency layer that sends a request on to the
//! upstream, with the headers RFC 9110 asks a proxy to drop and add.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE, HOST};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_core::BoxError;
use idem_http::{IdempotencyInfo, KeepInFlight};
use tokio::time::Instant;

use crate::ProxyError;

/// The body type the proxy hands on in both directions.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// The header carrying the record's attempt to the upstream: 1 on a key's first run, above
/// 1 when an earlier run's lease ended without a stored response (a proxy crashed, or the
/// upstream's answer was lost).
pub const ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// The headers RFC 9110 section 7.6.1 names hop-by-hop, besides those a `Connection` header
/// lists: they describe one connection and are never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// The client's address, put in each request's extensions by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Peer(pub(crate) SocketAddr);

/// Which `Host` the upstream receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HostHeader {
    /// The client's `Host` (or HTTP/2 `:authority`), unchanged (the default): the upstream
    /// sees the name the client used.
    #[default]
    Keep,
    /// The upstream URL's host and port.
    Upstream,
}

/// Where and how requests are sent on.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UpstreamConfig {
    /// The upstream's base URL: `http://` or `https://`, host, port, and an optional path
    /// prefix put before every request's path.
    pub url: Uri,
    /// How long the upstream has to answer with a response head, from the moment the
    /// request is handed to the connection. Default: 30 s.
    pub timeout: Duration,
    /// A PEM file of certificate authorities trusted for an `https://` upstream, besides
    /// the system's roots. Default: none.
    pub ca_file: Option<std::path::PathBuf>,
    /// Which `Host` the upstream receives. Default: [`HostHeader::Keep`].
    pub host: HostHeader,
}

impl UpstreamConfig {
    /// The upstream at `url` with every other setting at its default.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Config`] when `url` is not an absolute `http://` or `https://` URL.
    pub fn new(url: &str) -> Result<Self, ProxyError> {
        let url: Uri = url.trim().parse().map_err(|e| {
            ProxyError::Config(format!(
                "upstream {url:?} is not a URL ({e}); expected e.g. http://127.0.0.1:3000"
            ))
        })?;
        let scheme_ok = url.scheme() == Some(&Scheme::HTTP) || url.scheme() == Some(&Scheme::HTTPS);
        if !scheme_ok || url.authority().is_none() {
            return Err(ProxyError::Config(format!(
                "upstream {url} must be an http:// or https:// URL with a host, e.g. \
                 http://127.0.0.1:3000"
            )));
        }
        if url.query().is_some() {
            return Err(ProxyError::Config(format!(
                "upstream {url} has a query; give only scheme, host, port and a path prefix"
            )));
        }
        Ok(Self {
            url,
            timeout: Duration::from_secs(30),
            ca_file: None,
            host: HostHeader::Keep,
        })
    }
}

/// Sends requests on to the upstream over a pooled keep-alive client (HTTP/1.1; TLS with
/// rustls for `https://`). A failure is an [`UpstreamFailure`] (the key is released), or,
/// when the request may have reached the upstream, a `502` or `504`
/// `application/problem+json` marked [`KeepInFlight::Always`] (see its `Service::call`).
#[derive(Clone)]
pub struct Forward {
    shared: Arc<Upstream>,
    /// Whether an unknown outcome releases the key instead of leaving it in flight.
    release_unknown: bool,
}

struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    scheme: Scheme,
    authority: Authority,
    /// The upstream URL's path without its trailing `/`: empty for none.
    prefix: String,
    timeout: Duration,
    host: HostHeader,
}

impl fmt::Debug for Forward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Forward")
            .field(
                "upstream",
                &format_args!(
                    "{}://{}{}",
                    self.shared.scheme, self.shared.authority, self.shared.prefix
                ),
            )
            .field("timeout", &self.shared.timeout)
            .field("release_unknown", &self.release_unknown)
            .finish()
    }
}

impl Forward {
    /// A forwarder to `config`'s upstream.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Config`] when the CA file cannot be read or holds no certificate.
    pub fn new(config: &UpstreamConfig) -> Result<Self, ProxyError> {
        let tls = tls_config(config.ca_file.as_deref())?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            // The `Host` is set here, as the route says.
            .set_host(false)
            .build(connector);
        let url = &config.url;
        Ok(Self {
            shared: Arc::new(Upstream {
                client,
                scheme: url.scheme().cloned().unwrap_or(Scheme::HTTP),
                authority: url
                    .authority()
                    .cloned()
                    .ok_or_else(|| ProxyError::Config(format!("upstream {url} has no host")))?,
                prefix: url.path().trim_end_matches('/').to_owned(),
                timeout: config.timeout,
                host: config.host,
            }),
            release_unknown: false,
        })
    }

    /// The same upstream; with `release` set, a request whose outcome is unknown (sent, and
    /// its answer lost) releases its key rather than leaving it in flight until its lease
    /// ends: for routes whose upstream is itself idempotent.
    pub fn with_release_unknown(mut self, release: bool) -> Self {
        self.release_unknown = release;
        self
    }

    /// Sends `req` on and returns the upstream's response, the proxy's own answer when the
    /// outcome is unknown and the key stays in flight, or the failure that releases it.
    async fn forward(
        self,
        req: Request<ProxyBody>,
    ) -> Result<Response<ProxyBody>, UpstreamFailure> {
        let upstream = &self.shared;
        let (mut parts, body) = req.into_parts();
        let guarded = parts.extensions.get::<IdempotencyInfo>().map(|i| i.attempt);
        let peer = parts.extensions.get::<Peer>().map(|p| p.0);
        let original_host = parts.headers.get(HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let path = parts.uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let target = format!("{}{path}", upstream.prefix);
        let uri = Uri::builder()
            .scheme(upstream.scheme.clone())
            .authority(upstream.authority.clone())
            .path_and_query(target)
            .build();
        let Ok(uri) = uri else {
            return Err(UpstreamFailure {
                status: StatusCode::BAD_REQUEST,
                kind: "bad-target",
                title: "Bad request target",
                detail: "the request's path cannot be sent to the upstream",
            });
        };
        parts.uri = uri;
        // The upstream connection is HTTP/1.1 whatever the client spoke, and the client's
        // connection decides the version of its answer (below).
        let client_version = std::mem::replace(&mut parts.version, Version::HTTP_11);
        strip_hop_by_hop(&mut parts.headers);
        add_forwarded(&mut parts.headers, peer, original_host.as_ref());
        let host = match upstream.host {
            HostHeader::Keep => original_host,
            HostHeader::Upstream => HeaderValue::from_str(upstream.authority.as_str()).ok(),
        };
        if let Some(host) = host {
            parts.headers.insert(HOST, host);
        }
        if let Some(attempt) = guarded {
            parts.headers.insert(ATTEMPT, HeaderValue::from(attempt));
        }
        let req = Request::from_parts(parts, body);

        let started = Instant::now();
        let sent = tokio::time::timeout(upstream.timeout, upstream.client.request(req)).await;
        metrics::histogram!("idem_proxy_upstream_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        // The upstream may have acted and its answer is lost: the key stays in flight until
        // its lease ends, unless the route releases it (or nothing guards the request).
        let keep_in_flight = guarded.is_some() && !self.release_unknown;
        match sent {
            Ok(Ok(response)) => {
                let (mut parts, body) = response.into_parts();
                // An HTTP/1.0 upstream's answer written as HTTP/1.0 would close an HTTP/1.1
                // client's connection after it: the version is each connection's own.
                parts.version = client_version;
                strip_hop_by_hop(&mut parts.headers);
                if keep_in_flight {
                    // A body cut off midway: the upstream acted, its answer is lost.
                    parts.extensions.insert(KeepInFlight::IfBodyBreaks);
                }
                Ok(Response::from_parts(
                    parts,
                    body.map_err(Into::into).boxed_unsync(),
                ))
            }
            Ok(Err(e)) if e.is_connect() => {
                // Nothing was sent: the key is released, and a retry runs once the upstream
                // is back.
                upstream_error("connect");
                tracing::warn!(error = %source_chain(&e), "upstream unreachable");
                Err(UpstreamFailure {
                    status: StatusCode::BAD_GATEWAY,
                    kind: "upstream-unreachable",
                    title: "Upstream unreachable",
                    detail: "the upstream refused the connection or could not be reached; the \
                             request was not sent, retry with the same idempotency key",
                })
            }
            Ok(Err(e)) => {
                upstream_error("lost");
                tracing::warn!(error = %source_chain(&e), "upstream connection lost after the request was sent");
                unknown(
                    keep_in_flight,
                    UpstreamFailure {
                        status: StatusCode::BAD_GATEWAY,
                        kind: "upstream-connection-lost",
                        title: "Upstream connection lost",
                        detail: "the connection to the upstream broke after the request was \
                                 sent: it may have been processed; a retry with the same key \
                                 gets 409 until the key's lease ends, then runs it again",
                    },
                )
            }
            Err(_) => {
                upstream_error("timeout");
                tracing::warn!(timeout = ?upstream.timeout, "upstream timed out after the request was sent");
                unknown(
                    keep_in_flight,
                    UpstreamFailure {
                        status: StatusCode::GATEWAY_TIMEOUT,
                        kind: "upstream-timeout",
                        title: "Upstream timed out",
                        detail: "the upstream did not answer in time after the request was \
                                 sent: it may have been processed; a retry with the same key \
                                 gets 409 until the key's lease ends, then runs it again",
                    },
                )
            }
        }
    }
}

/// An answer the proxy makes itself because the upstream's is missing: a `502` or `504`
/// (or a `400` for a path that cannot be sent on). [`Forward`] returns it as its error, so
/// that the idempotency layer releases the key and never stores it, whatever statuses the
/// route stores: the proxy's own 502 is not the upstream's answer. [`Proxy`](crate::Proxy)
/// turns it into an `application/problem+json` response ([`UpstreamFailure::into_response`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamFailure {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: &'static str,
}

impl UpstreamFailure {
    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The problem document's type, `urn:idem:problem:<kind>`: `upstream-unreachable`,
    /// `upstream-connection-lost`, `upstream-timeout` or `bad-target`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The `application/problem+json` response the client gets.
    pub fn into_response(self) -> Response<ProxyBody> {
        problem(self.status, self.kind, self.title, self.detail)
    }
}

impl fmt::Display for UpstreamFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.kind, self.detail)
    }
}

impl std::error::Error for UpstreamFailure {}

/// An unknown outcome: a response marked [`KeepInFlight::Always`] (neither stored nor
/// released) when `keep_in_flight`, else the failure, which releases the key.
fn unknown(
    keep_in_flight: bool,
    failure: UpstreamFailure,
) -> Result<Response<ProxyBody>, UpstreamFailure> {
    if !keep_in_flight {
        return Err(failure);
    }
    let mut response = failure.into_response();
    response.extensions_mut().insert(KeepInFlight::Always);
    Ok(response)
}

impl<B> tower::Service<Request<B>> for Forward
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ProxyBody>;
    type Error = UpstreamFailure;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, UpstreamFailure>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamFailure>> {
        // The pooled client queues requests itself.
        Poll::Ready(Ok(()))
    }

    /// Sends the request on. A guarded request (one the idempotency layer runs under a
    /// lease) carries `Idempotency-Attempt`. When the upstream cannot be reached the error
    /// is `502 upstream-unreachable` and the key is released; when the connection breaks or
    /// times out after the request was sent, the answer is `502 upstream-connection-lost`
    /// or `504 upstream-timeout`, marked [`KeepInFlight::Always`] so that the key stays in
    /// flight until its lease ends (with [`Forward::with_release_unknown`], the error,
    /// which releases it).
    fn call(&mut self, req: Request<B>) -> Self::Future {
        let req = req.map(|body| body.map_err(Into::into).boxed_unsync());
        let forward = self.clone();
        Box::pin(forward.forward(req))
    }
}

/// Removes the hop-by-hop headers and every header a `Connection` header names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    // `Upgrade` is hop-by-hop too; the proxy does not tunnel upgraded connections.
    headers.remove(http::header::UPGRADE);
}

/// Adds `Forwarded` and `X-Forwarded-For` (appended to any earlier hops'), and sets
/// `X-Forwarded-Proto` and `X-Forwarded-Host` to this hop's.
pub(crate) fn add_forwarded(
    headers: &mut HeaderMap,
    peer: Option<SocketAddr>,
    host: Option<&HeaderValue>,
) {
    let xff = HeaderName::from_static("x-forwarded-for");
    let mut forwarded = Vec::new();
    if let Some(peer) = peer {
        let ip = peer.ip();
        let earlier = headers
            .get(&xff)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let value = match earlier {
            Some(earlier) => format!("{earlier}, {ip}"),
            None => ip.to_string(),
        };
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(&xff, value);
        }
        // RFC 7239: an IPv6 address is bracketed and quoted.
        forwarded.push(if ip.is_ipv6() {
            format!("for=\"[{ip}]\"")
        } else {
            format!("for={ip}")
        });
    }
    if let Some(host) = host.and_then(|h| h.to_str().ok()) {
        forwarded.push(format!("host=\"{}\"", host.replace(['"', '\\'], "")));
        if let Ok(value) = HeaderValue::from_str(host) {
            headers.insert(HeaderName::from_static("x-forwarded-host"), value);
        }
    }
    forwarded.push("proto=http".to_owned());
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if let Ok(value) = HeaderValue::from_str(&forwarded.join(";")) {
        headers.append(http::header::FORWARDED, value);
    }
}

/// Counts an upstream failure by kind: `connect`, `lost` or `timeout`.
fn upstream_error(kind: &'static str) {
    metrics::counter!("idem_proxy_upstream_errors_total", "kind" => kind).increment(1);
}

/// An error with its sources, for a log line.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The proxy's own answer: an `application/problem+json` document.
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
) -> Response<ProxyBody> {
    let doc = idem_http::problem_json(&format!("urn:idem:problem:{kind}"), title, status, detail);
    let mut response = Response::new(
        Full::new(Bytes::from(doc))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(idem_http::PROBLEM_JSON),
    );
    response
}

/// The TLS settings of an `https://` upstream: the system's roots, plus `ca_file`'s.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, ProxyError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;

    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A system certificate rustls cannot parse is skipped, as browsers do.
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let shown = path.display();
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| ProxyError::Config(format!("cannot read the CA file {shown}: {e}")))?;
        if certs.is_empty() {
            return Err(ProxyError::Config(format!(
                "the CA file {shown} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
            )));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| {
                ProxyError::Config(format!("a certificate in {shown} is not usable: {e}"))
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ProxyError::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_named_in_connection_are_dropped() {
        let mut headers = HeaderMap::new();
        for (n, v) in [
            ("connection", "keep-alive, x-secret"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic eA=="),
            ("authorization", "Bearer alice"),
            ("idempotency-key", "k-1"),
        ] {
            headers.append(n, HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut headers);
        let left: Vec<_> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["authorization", "idempotency-key"]);
    }

    #[test]
    fn forwarded_headers_append_to_earlier_hops() {
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        let peer: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        add_forwarded(
            &mut headers,
            Some(peer),
            Some(&HeaderValue::from_static("api.example:8080")),
        );
        assert_eq!(headers["x-forwarded-for"], "10.0.0.1, 127.0.0.1");
        assert_eq!(headers["x-forwarded-proto"], "http");
        assert_eq!(headers["x-forwarded-host"], "api.example:8080");
        assert_eq!(
            headers["forwarded"],
            "for=127.0.0.1;host=\"api.example:8080\";proto=http"
        );
        let mut v6 = HeaderMap::new();
        add_forwarded(&mut v6, Some("[::1]:80".parse().unwrap()), None);
        assert_eq!(v6["forwarded"], "for=\"[::1]\";proto=http");
    }

    #[test]
    fn upstream_urls_are_checked() {
        assert!(UpstreamConfig::new("http://127.0.0.1:3000").is_ok());
        assert!(UpstreamConfig::new("https://api.example/base/").is_ok());
        for bad in [
            "127.0.0.1:3000",
            "ftp://x",
            "http://",
            "http://x/?a=1",
            "not a url",
        ] {
            let e = UpstreamConfig::new(bad).unwrap_err().to_string();
            assert!(e.contains("http://"), "{bad}: {e}");
        }
    }
}
