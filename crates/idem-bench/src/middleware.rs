//! The middleware over loopback HTTP: a trivial axum handler served bare and behind
//! `IdempotencyLayer` on the in-memory store, driven by a hyper client in this process.
//!
//! Besides requests/s, each phase's CPU time per request (the whole process: client,
//! server and runtime) is printed to stderr: on a machine shared with other work,
//! requests/s moves with the other load, CPU time per request much less.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemkit::http::{Anonymous, Config, IdempotencyLayer};
use idemkit::{Idem, MemoryStore};

use crate::phases::drive;
use crate::report::PhaseReport;

/// The request body: a small JSON document, fingerprinted by the layer.
const BODY: &str =
    r#"{"customer":"cus_42","amount":1250,"currency":"EUR","lines":[{"sku":"sku-1","qty":2}]}"#;

/// The benchmark's pooled HTTP/1.1 client.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A loopback listener and its `http://` base URL.
pub(crate) async fn bind() -> Result<(tokio::net::TcpListener, String), String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("binding a loopback port: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("loopback port: {e}"))?;
    Ok((listener, format!("http://{addr}")))
}

/// Starts the app on a loopback port and returns its `POST` URL.
async fn serve(app: Router) -> Result<String, String> {
    let (listener, url) = bind().await?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("idem-bench: http server: {e}");
        }
    });
    Ok(format!("{url}/orders"))
}

/// The trivial handler: 201 and a short text.
fn app() -> Router {
    Router::new().route(
        "/orders",
        post(|| async { (StatusCode::CREATED, "created") }),
    )
}

/// Sends `n` POSTs from `concurrency` callers, each with `Idempotency-Key: <keys>-<i>`.
pub(crate) async fn hammer(
    name: &str,
    client: &HttpClient,
    url: &str,
    keys: &str,
    n: usize,
    concurrency: usize,
) -> Result<PhaseReport, String> {
    let (client, url, keys) = (
        client.clone(),
        Arc::<str>::from(url),
        Arc::<str>::from(keys),
    );
    drive(name, n, concurrency, move |i| {
        let (client, url, keys) = (client.clone(), url.clone(), keys.clone());
        async move {
            let request = http::Request::post(&*url)
                .header("content-type", "application/json")
                .header("idempotency-key", format!("{keys}-{i}"))
                .body(Full::new(Bytes::from_static(BODY.as_bytes())))
                .map_err(|e| format!("building a request: {e}"))?;
            let response = client
                .request(request)
                .await
                .map_err(|e| format!("http: {e}"))?;
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("http body: {e}"))?;
            match (status, replayed) {
                (StatusCode::CREATED, false) => Ok("created"),
                (StatusCode::CREATED, true) => Ok("replayed"),
                (other, _) => Err(format!("http: unexpected status {other}")),
            }
        }
    })
    .await
}

/// Requests per second of the bare handler, then behind the layer on new keys, then
/// behind the layer on the same keys again (replays); `ROUNDS` rounds of the three,
/// interleaved so that a change in the machine's other load hits all three alike, and the
/// median round of each kept.
pub async fn run(n: usize, concurrency: usize) -> Result<Vec<PhaseReport>, String> {
    const ROUNDS: usize = 3;
    let bare = serve(app()).await?;
    // One caller: its requests share the anonymous scope.
    let layer = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
        .with_config(Config::default().with_anonymous(Anonymous::Shared));
    let guarded = serve(app().layer(layer)).await?;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    // Untimed: opens the pooled connections to both servers.
    for url in [&bare, &guarded] {
        hammer(
            "warmup",
            &client,
            url,
            "warm",
            concurrency * 10,
            concurrency,
        )
        .await?;
    }
    let mut rounds: [Vec<PhaseReport>; 3] = Default::default();
    let mut cpu: [Vec<Duration>; 3] = Default::default();
    for round in 0..ROUNDS {
        let keys = format!("k{round}");
        let phases = [
            ("http bare", &bare, "bare"),
            ("http layer new keys", &guarded, &*keys),
            ("http layer replays", &guarded, &*keys),
        ];
        for (i, (name, url, keys)) in phases.into_iter().enumerate() {
            let before = process_cpu();
            rounds[i].push(hammer(name, &client, url, keys, n, concurrency).await?);
            if let (Some(before), Some(after)) = (before, process_cpu()) {
                cpu[i].push((after.saturating_sub(before)) / n.max(1) as u32);
            }
        }
    }
    if cpu.iter().all(|c| c.len() == ROUNDS) {
        let [bare, new, replays] = cpu.map(|mut c| {
            c.sort_unstable();
            c[c.len() / 2]
        });
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let ratio = |d: Duration| bare.as_secs_f64() / d.as_secs_f64().max(f64::EPSILON);
        eprintln!(
            "idem-bench: http CPU per request (client and server, median round): bare {:.1} µs, \
             layer new keys {:.1} µs ({:.3} of bare's requests per CPU second), \
             replays {:.1} µs ({:.3})",
            us(bare),
            us(new),
            ratio(new),
            us(replays),
            ratio(replays),
        );
    }
    Ok(rounds.into_iter().map(median).collect())
}

/// This process's CPU time so far: the sum of `/proc/self/task/*/schedstat` (time on a CPU
/// of every thread; Linux only, `None` elsewhere). Threads that ended are not counted:
/// tokio's workers live as long as the run.
pub(crate) fn process_cpu() -> Option<Duration> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(total))
}

/// The report of median throughput.
fn median(mut reports: Vec<PhaseReport>) -> PhaseReport {
    reports.sort_by(|a, b| a.throughput().total_cmp(&b.throughput()));
    reports.swap_remove(reports.len() / 2)
}
