//! The listeners: the proxy itself (HTTP/1.1 and HTTP/2 over cleartext, h2c) and the admin
//! listener (`/metrics`, `/livez`, `/readyz`).

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use idem_core::{Key, RecordId, Scope, Store};
use tokio::net::TcpListener;

use crate::forward::{problem, Peer, ProxyBody};
use crate::route::Proxy;

/// How a server stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every request in flight at the shutdown signal was answered.
    Complete,
    /// The drain timeout passed with requests still in flight; they were cut off.
    TimedOut,
}

/// Serves `proxy` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish the requests it has in flight (their responses stored before they are
/// sent), for at most `drain`, and returns.
pub async fn serve(
    listener: TcpListener,
    proxy: Proxy,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) -> Drained {
    serve_with(listener, shutdown, drain, move |req, peer| {
        let proxy = proxy.clone();
        async move {
            let mut req = req;
            req.extensions_mut().insert(Peer(peer));
            proxy.handle(req).await
        }
    })
    .await
}

/// Serves the admin endpoints on `listener` until `shutdown` resolves: `GET /metrics` (what
/// `metrics` renders, Prometheus text), `GET /livez` (200 while the process runs) and
/// `GET /readyz` (200 while `store` answers a read within 2 s, else 503).
pub async fn serve_admin(
    listener: TcpListener,
    store: Arc<dyn Store>,
    metrics: Arc<dyn Fn() -> String + Send + Sync>,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, shutdown, Duration::from_secs(1), move |req, _| {
        let store = store.clone();
        let metrics = metrics.clone();
        async move { admin(&req, store.as_ref(), metrics.as_ref()).await }
    })
    .await;
}

/// Accepts connections on `listener` and answers each request with `handle`, until
/// `shutdown`; then drains for at most `drain`.
async fn serve_with<F, Fut>(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
    handle: F,
) -> Drained
where
    F: Fn(Request<Incoming>, std::net::SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, most often: pause rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            // Stop accepting; the connections open go on below.
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let answer = handle(req, peer);
            async move { Ok::<_, Infallible>(answer.await) }
        });
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        let connection = graceful.watch(connection.into_owned());
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    // Every connection finishes the request it is on, then closes.
    match tokio::time::timeout(drain, graceful.shutdown()).await {
        Ok(()) => Drained::Complete,
        Err(_) => Drained::TimedOut,
    }
}

/// One admin request.
async fn admin(
    req: &Request<Incoming>,
    store: &dyn Store,
    metrics: &(dyn Fn() -> String + Send + Sync),
) -> Response<ProxyBody> {
    if req.method() != Method::GET {
        return problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "Method not allowed",
            "the admin endpoints answer GET only",
        );
    }
    match req.uri().path() {
        "/metrics" => text(StatusCode::OK, metrics(), "text/plain; version=0.0.4"),
        "/livez" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        "/readyz" => {
            // Any read will do: the answer (no such record) says the store is reachable.
            let probe = RecordId::new(
                Scope::global(),
                Key::new("idem-proxy-readyz").expect("a valid key"),
            );
            match tokio::time::timeout(Duration::from_secs(2), store.get(&probe)).await {
                Ok(Ok(_)) => text(StatusCode::OK, "ready\n".into(), "text/plain"),
                Ok(Err(e)) => problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store-unavailable",
                    "Store unavailable",
                    &format!("the idempotency store failed: {e}"),
                ),
                Err(_) => problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store-unavailable",
                    "Store unavailable",
                    "the idempotency store did not answer within 2 s",
                ),
            }
        }
        _ => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            "the admin endpoints are /metrics, /livez and /readyz",
        ),
    }
}

fn text(status: StatusCode, body: String, content_type: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
