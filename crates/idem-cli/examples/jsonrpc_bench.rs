//! `tools/call` through `idem proxy` (in this process) in front of a minimal JSON-RPC
//! upstream (hyper; `tools/call` answered after `--tool-ms`, as one JSON body): unguarded
//! (pass-through, no route), and guarded by a JSON-RPC route on the memory store and on
//! Redis (`IDEM_BENCH_REDIS_URL`), with new keys and with replays, at concurrency 1 and 32.
//! Prints a Markdown table of requests per second and the ratios to pass-through.
//!
//! ```sh
//! IDEM_BENCH_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run --release -p idem-cli --example jsonrpc_bench -- [TOOL_MS] [N]
//! ```

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_core::{MemoryStore, Store};
use idem_http::{Anonymous, JsonRpc};
use idem_proxy::{Proxy, Route, UpstreamConfig};
use tokio::net::TcpListener;

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// The upstream: `tools/call` answered after `tool` with a small result, as JSON.
async fn upstream(tool: Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: http::Request<hyper::body::Incoming>| async move {
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let call: serde_json::Value = serde_json::from_slice(&body).unwrap();
                        if !tool.is_zero() {
                            tokio::time::sleep(tool).await;
                        }
                        let answer = serde_json::json!({"jsonrpc": "2.0", "id": call["id"],
                            "result": {"content": [{"type": "text", "text": "charged"}]}});
                        let mut response =
                            http::Response::new(Full::new(Bytes::from(answer.to_string())));
                        response.headers_mut().insert(
                            http::header::CONTENT_TYPE,
                            http::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, Infallible>(response)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

/// A proxy to `upstream` on `store` with `routes`: its URL.
async fn proxy(store: Arc<dyn Store>, upstream: &str, routes: Vec<Route>) -> String {
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

/// `n` `tools/call`s to `url` at concurrency `c`, call `i` keyed `<keys>-<i>`: per second.
async fn hammer(client: &HttpClient, url: &str, keys: &str, n: usize, c: usize) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..c)
        .map(|_| {
            let (client, url, keys, next) = (
                client.clone(),
                url.to_owned(),
                keys.to_owned(),
                next.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let body = serde_json::json!({"jsonrpc": "2.0", "id": i,
                        "method": "tools/call", "params": {"name": "charge",
                        "arguments": {"amount": 1250, "currency": "EUR"},
                        "_meta": {"idempotencyKey": format!("{keys}-{i}")}}})
                    .to_string();
                    let req = http::Request::post(&url)
                        .header("content-type", "application/json")
                        .header("accept", "application/json, text/event-stream")
                        .body(Full::new(Bytes::from(body)))
                        .unwrap();
                    let response = client.request(req).await.unwrap();
                    assert!(response.status().is_success(), "{:?}", response.status());
                    let body = response.into_body().collect().await.unwrap().to_bytes();
                    assert!(body.windows(9).any(|w| w == b"\"result\":"), "{body:?}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    n as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let tool_ms: u64 = args.next().map_or(0, |a| a.parse().unwrap());
    let n: usize = args.next().map_or(5000, |a| a.parse().unwrap());
    let up = upstream(Duration::from_millis(tool_ms)).await;
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pass = proxy(memory.clone(), &up, Vec::new()).await;
    let route = || {
        let mut route = Route::default();
        route.path = "/mcp".into();
        route.http = route
            .http
            .clone()
            .with_methods([http::Method::POST])
            .with_anonymous(Anonymous::Shared)
            .with_jsonrpc(JsonRpc::new(["tools/call"]));
        vec![route]
    };
    let mut targets = vec![("memory".to_owned(), proxy(memory, &up, route()).await)];
    if let Ok(url) = std::env::var("IDEM_BENCH_REDIS_URL") {
        let store = idemkit::connect(&url).await.unwrap();
        targets.push(("redis".to_owned(), proxy(store, &up, route()).await));
    }
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .build_http();
    let run = uuid::Uuid::new_v4().simple().to_string();
    println!("tool {tool_ms} ms, {n} calls per row\n");
    println!("| | C=1 | C=32 |\n|---|---|---|");
    let mut rows: Vec<(String, [f64; 2])> = Vec::new();
    let mut pass_rates = [0.0; 2];
    for (i, c) in [1, 32].into_iter().enumerate() {
        let mcp = |base: &str| format!("{base}/mcp");
        // Untimed: opens the pooled connections.
        for base in std::iter::once(&pass).chain(targets.iter().map(|(_, u)| u)) {
            hammer(&client, &mcp(base), &format!("warm{c}-{run}"), c * 20, c).await;
        }
        pass_rates[i] = hammer(&client, &mcp(&pass), "p", n, c).await;
        for (store, base) in &targets {
            let keys = format!("{run}-{c}");
            let new = hammer(&client, &mcp(base), &keys, n, c).await;
            let replays = hammer(&client, &mcp(base), &keys, n, c).await;
            for (what, rate) in [("new keys", new), ("replays", replays)] {
                let name = format!("guarded {what}, {store}");
                match rows.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, rates)) => rates[i] = rate,
                    None => {
                        let mut rates = [0.0; 2];
                        rates[i] = rate;
                        rows.push((name, rates));
                    }
                }
            }
        }
    }
    println!(
        "| pass-through | {:.0}/s | {:.0}/s |",
        pass_rates[0], pass_rates[1]
    );
    for (name, rates) in rows {
        println!(
            "| {name} | {:.0}/s ({:.2} of pass-through) | {:.0}/s ({:.2}) |",
            rates[0],
            rates[0] / pass_rates[0],
            rates[1],
            rates[1] / pass_rates[1]
        );
    }
}
