//! `idem proxy` over loopback HTTP, side by side in one run: a minimal hyper upstream
//! (201 and a short body, never the bottleneck) reached directly, through the proxy with
//! nothing guarded (pass-through), and through the proxy guarding every POST on the memory
//! store and on the run's `--store`, with new keys and with replays; at concurrency 1 and
//! at `--concurrency`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_proxy::{Proxy, Route, UpstreamConfig};
use idemkit::http::Anonymous;
use idemkit::{MemoryStore, Store};

use crate::middleware::{hammer, HttpClient};
use crate::report::{Figure, PhaseReport, Target};

/// A loopback listener and its `http://` base URL.
async fn bind() -> Result<(tokio::net::TcpListener, String), String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("binding a loopback port: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("loopback port: {e}"))?;
    Ok((listener, format!("http://{addr}")))
}

/// The minimal upstream: HTTP/1.1 keep-alive, 201 and `created` to every request.
async fn upstream() -> Result<String, String> {
    let (listener, url) = bind().await?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        // Read the body whole, as a real service does.
                        let _ = req.into_body().collect().await;
                        let mut response =
                            http::Response::new(Full::new(Bytes::from_static(b"created")));
                        *response.status_mut() = StatusCode::CREATED;
                        Ok::<_, Infallible>(response)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(url)
}

/// An `idem proxy` to `upstream` guarding `routes` on `store`, in this process.
async fn proxy(
    store: Arc<dyn Store>,
    upstream: &str,
    routes: Vec<Route>,
) -> Result<String, String> {
    let config = UpstreamConfig::new(upstream).map_err(|e| e.to_string())?;
    let proxy = Proxy::new(store, &config, routes).map_err(|e| e.to_string())?;
    let (listener, url) = bind().await?;
    tokio::spawn(idem_proxy::serve(
        listener,
        proxy,
        std::future::pending(),
        Duration::ZERO,
    ));
    Ok(url)
}

/// The phases at concurrency 1 (`n1` requests each) and at `concurrency` (`n`), with the
/// guarded rows on the memory store and, unless it is the memory store, on `store`
/// (`store_name` in the rows' names); and the figures against the targets.
pub async fn run(
    store: Arc<dyn Store>,
    store_name: &str,
    n: usize,
    n1: usize,
    concurrency: usize,
) -> Result<(Vec<PhaseReport>, Vec<Figure>), String> {
    let up = upstream().await?;
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pass = proxy(memory.clone(), &up, Vec::new()).await?;
    // One caller: its requests share the anonymous scope.
    let route = || {
        let mut route = Route::default();
        route.http = route.http.clone().with_anonymous(Anonymous::Shared);
        vec![route]
    };
    let mut targets = vec![("memory".to_owned(), proxy(memory, &up, route()).await?)];
    if store_name != "memory" {
        let scheme = store_name.split("://").next().unwrap_or(store_name);
        targets.push((scheme.to_owned(), proxy(store, &up, route()).await?));
    }
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency.max(1))
        .build_http();
    let orders = |base: &str| format!("{base}/orders");
    let mut reports = Vec::new();
    let mut figures = Vec::new();
    for (c, n) in [(1, n1), (concurrency, n)] {
        // Untimed: opens the pooled connections (client to proxy, proxy to upstream).
        let bases = [&up, &pass]
            .into_iter()
            .chain(targets.iter().map(|(_, u)| u));
        for base in bases {
            hammer(
                "warmup",
                &client,
                &orders(base),
                &format!("warm{c}"),
                c * 20,
                c,
            )
            .await?;
        }
        let name = |what: &str| format!("proxy C={c}: {what}");
        let direct = hammer(
            &name("direct to upstream"),
            &client,
            &orders(&up),
            "d",
            n,
            c,
        )
        .await?;
        let passed = hammer(&name("pass-through"), &client, &orders(&pass), "p", n, c).await?;
        let pass_rate = passed.throughput();
        let pass_is = "requests through the proxy, unguarded";
        let direct_is = "requests straight to the upstream";
        let ratio = Figure::ratio(
            name("pass-through / direct"),
            pass_rate,
            direct.throughput(),
            direct_is,
        );
        figures.push(ratio);
        let mut guarded = Vec::new();
        for (store, base) in &targets {
            let (url, keys) = (orders(base), format!("k{c}"));
            let new = hammer(
                &name(&format!("guarded new keys, {store}")),
                &client,
                &url,
                &keys,
                n,
                c,
            )
            .await?;
            let replays = hammer(
                &name(&format!("guarded replays, {store}")),
                &client,
                &url,
                &keys,
                n,
                c,
            )
            .await?;
            let floor = if store == "memory" { 0.75 } else { 0.6 };
            let what = name(&format!("guarded new keys / pass-through, {store}"));
            let figure = Figure::ratio(what, new.throughput(), pass_rate, pass_is);
            figures.push(figure.target(Target::AtLeast(floor)));
            let what = name(&format!("guarded replays / pass-through, {store}"));
            let figure = Figure::ratio(what, replays.throughput(), pass_rate, pass_is);
            figures.push(figure.target(Target::AtLeast(1.5)));
            if c == 1 && store == "memory" {
                let added = new.p99().saturating_sub(passed.p99());
                let basis = format!(
                    "p99 {:?} guarded new keys vs {:?} pass-through",
                    new.p99(),
                    passed.p99()
                );
                let figure = Figure::new(
                    name("p99 added by the guard, memory"),
                    added.as_secs_f64() * 1e3,
                    "ms",
                    basis,
                );
                figures.push(figure.target(Target::AtMost(1.0)));
            }
            guarded.extend([new, replays]);
        }
        reports.extend([direct, passed]);
        reports.extend(guarded);
    }
    Ok((reports, figures))
}
