//! What the benchmark examples share: a loopback upstream, `idem proxy` in this process in
//! front of it, and work spread over concurrent callers.
#![allow(dead_code)] // each example uses a part

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioIo;
use idem_core::Store;
use idem_proxy::{Proxy, Route, UpstreamConfig};
use tokio::net::TcpListener;

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// An HTTP/1.1 upstream on a free loopback port answering every request with `answer`'s
/// body, as `content_type`: its URL.
pub async fn upstream<F, Fut, B>(content_type: &'static str, answer: F) -> String
where
    F: Fn(http::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = B> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let body = answer(req);
                    async move {
                        let mut response = http::Response::new(body.await);
                        response.headers_mut().insert(
                            http::header::CONTENT_TYPE,
                            http::HeaderValue::from_static(content_type),
                        );
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

/// `idem proxy` to `upstream` on `store` with `routes`, in this process: its URL.
pub async fn proxy(store: Arc<dyn Store>, upstream: &str, routes: Vec<Route>) -> String {
    let config = UpstreamConfig::new(upstream).unwrap();
    let proxy = Proxy::new(store, &config, routes).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(idem_proxy::serve(
        listener,
        proxy,
        std::future::pending(),
        Duration::ZERO,
    ));
    url
}

/// Runs `work(i)` for every `i` in `0..n` on `c` concurrent callers, each taking the next
/// `i` when done with its last: the results, in no particular order.
pub async fn by_callers<T, F, Fut>(n: usize, c: usize, work: F) -> Vec<T>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = T> + Send,
    T: Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..c)
        .map(|_| {
            let (work, next) = (work.clone(), next.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break got;
                    }
                    got.push(work(i).await);
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for worker in workers {
        all.extend(worker.await.unwrap());
    }
    all
}
