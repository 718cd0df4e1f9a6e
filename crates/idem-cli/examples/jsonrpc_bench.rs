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

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_core::{MemoryStore, Store};
use idem_http::{Anonymous, JsonRpc};
use idem_proxy::Route;
use idemkit::OpenOptions;
use support::HttpClient;

mod support;

/// The upstream: `tools/call` answered after `tool` with a small result, as JSON.
async fn upstream(tool: Duration) -> String {
    support::upstream(
        "application/json",
        move |req: http::Request<Incoming>| async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let call: serde_json::Value = serde_json::from_slice(&body).unwrap();
            if !tool.is_zero() {
                tokio::time::sleep(tool).await;
            }
            let answer = serde_json::json!({"jsonrpc": "2.0", "id": call["id"],
            "result": {"content": [{"type": "text", "text": "charged"}]}});
            Full::new(Bytes::from(answer.to_string()))
        },
    )
    .await
}

/// `n` `tools/call`s to `url` at concurrency `c`, call `i` keyed `<keys>-<i>`: per second.
async fn hammer(client: &HttpClient, url: &str, keys: &str, n: usize, c: usize) -> f64 {
    let (client, url, keys) = (client.clone(), url.to_owned(), keys.to_owned());
    let started = Instant::now();
    support::by_callers(n, c, move |i| {
        let (client, url) = (client.clone(), url.clone());
        let body = serde_json::json!({"jsonrpc": "2.0", "id": i,
            "method": "tools/call", "params": {"name": "charge",
            "arguments": {"amount": 1250, "currency": "EUR"},
            "_meta": {"idempotencyKey": format!("{keys}-{i}")}}})
        .to_string();
        async move {
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
    .await;
    n as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let tool_ms: u64 = args.next().map_or(0, |a| a.parse().unwrap());
    let n: usize = args.next().map_or(5000, |a| a.parse().unwrap());
    let up = upstream(Duration::from_millis(tool_ms)).await;
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pass = support::proxy(memory.clone(), &up, Vec::new()).await;
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
    let mut targets = vec![(
        "memory".to_owned(),
        support::proxy(memory, &up, route()).await,
    )];
    if let Ok(url) = std::env::var("IDEM_BENCH_REDIS_URL") {
        let store = idemkit::open(&url, &OpenOptions::default())
            .await
            .unwrap()
            .store();
        targets.push((
            "redis".to_owned(),
            support::proxy(store, &up, route()).await,
        ));
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
