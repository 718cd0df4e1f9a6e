//! `idem proxy` over loopback HTTP, side by side in one run: a minimal hyper upstream
//! (201 and a short body, never the bottleneck) reached directly, through the proxy with
//! nothing guarded (pass-through), through nginx as a plain reverse proxy (with `--nginx`),
//! and through the proxy guarding every POST on the memory store and on the run's
//! `--store`, with new keys and with replays; at concurrency 1 and at `--concurrency`. On a
//! `redis://` store, the Redis commands each guarded request sends (`INFO commandstats`
//! deltas) and a `PING` row (one round trip) beside them.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_proxy::{Proxy, Route, UpstreamConfig};
use idemkit::http::Anonymous;
use idemkit::{MemoryStore, Store};

use crate::middleware::{bind, hammer, process_cpu, HttpClient};
use crate::redis_floor::RedisSide;
use crate::report::{Figure, PhaseReport, Target};

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

/// nginx as a plain reverse proxy to the upstream: its own configuration and prefix in a
/// temporary directory, a free loopback port, `daemon off`, keep-alive connections to the
/// upstream; stopped (and the directory removed) when dropped.
struct Nginx {
    child: Child,
    dir: PathBuf,
    url: String,
}

impl Nginx {
    async fn start(binary: &Path, upstream: &str) -> Result<Self, String> {
        let authority = upstream.trim_start_matches("http://");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("a free port for nginx: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!("idem-bench-nginx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let d = dir.display();
        // Debian's defaults where they matter (one worker per core, 768 connections each),
        // no access log, and HTTP/1.1 keep-alive to the upstream as the proxy has.
        let conf = format!(
            "worker_processes auto;\n\
             error_log {d}/error.log warn;\n\
             pid {d}/nginx.pid;\n\
             events {{ worker_connections 768; }}\n\
             http {{\n\
               access_log off;\n\
               client_body_temp_path {d}/body;\n\
               proxy_temp_path {d}/proxy;\n\
               fastcgi_temp_path {d}/fastcgi;\n\
               uwsgi_temp_path {d}/uwsgi;\n\
               scgi_temp_path {d}/scgi;\n\
               upstream bench {{ server {authority}; keepalive 128; }}\n\
               server {{\n\
                 listen 127.0.0.1:{port};\n\
                 location / {{\n\
                   proxy_pass http://bench;\n\
                   proxy_http_version 1.1;\n\
                   proxy_set_header Connection \"\";\n\
                   proxy_set_header Host $host;\n\
                   proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
                 }}\n\
               }}\n\
             }}\n"
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf).map_err(|e| format!("{}: {e}", conf_path.display()))?;
        let child = Command::new(binary)
            .arg("-c")
            .arg(&conf_path)
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .args(["-g", "daemon off;"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", binary.display()))?;
        let nginx = Self {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(nginx.dir.join("error.log")).unwrap_or_default();
                return Err(format!("nginx did not listen on {port} within 10 s: {log}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(nginx)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its workers (SIGKILL would leave them running).
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The phases at concurrency 1 (`n1` requests each) and at `concurrency` (`n`), with the
/// guarded rows on the memory store and, unless it is the memory store, on `store`
/// (`store_name` in the rows' names); nginx beside them when `nginx` names its binary; the
/// Redis commands per guarded request when `redis` is `store`'s server; and the figures
/// against the targets.
pub async fn run(
    store: Arc<dyn Store>,
    store_name: &str,
    redis: Option<Arc<RedisSide>>,
    nginx: Option<&Path>,
    (n, n1, concurrency): (usize, usize, usize),
) -> Result<(Vec<PhaseReport>, Vec<Figure>), String> {
    let up = upstream().await?;
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pass = proxy(memory.clone(), &up, Vec::new()).await?;
    let nginx = match nginx {
        Some(binary) => Some(Nginx::start(binary, &up).await?),
        None => None,
    };
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
            .chain(nginx.as_ref().map(|n| &n.url))
            .chain(targets.iter().map(|(_, u)| u));
        let warm = format!("warm{c}");
        for base in bases {
            hammer("warmup", &client, &orders(base), &warm, c * 20, c).await?;
        }
        let name = |what: &str| format!("proxy C={c}: {what}");
        let mut run = async |what: &str, base: &str, keys: &str| {
            let (what, url) = (name(what), orders(base));
            timed(&mut figures, &what, &client, &url, keys, n, c).await
        };
        let direct = run("direct to upstream", &up, "d").await?;
        let passed = run("pass-through", &pass, "p").await?;
        let reference = match &nginx {
            Some(nginx) => Some(run("nginx (reference)", &nginx.url, "x").await?),
            None => None,
        };
        let (pass_rate, direct_rate) = (passed.throughput(), direct.throughput());
        let pass_is = "requests through the proxy, unguarded";
        let direct_is = "requests straight to the upstream";
        let what = name("pass-through / direct");
        figures.push(Figure::ratio(what, pass_rate, direct_rate, direct_is));
        if let Some(reference) = &reference {
            let rate = reference.throughput();
            let what = name("nginx / direct");
            figures.push(Figure::ratio(what, rate, direct_rate, direct_is));
            let what = name("pass-through / nginx");
            let nginx_is = "requests through nginx";
            figures.push(Figure::ratio(what, pass_rate, rate, nginx_is));
        }
        // One Redis round trip from this process, to set the guarded rows against.
        let ping = match &redis {
            Some(side) => Some(
                side.ping(&name("redis PING (one round trip)"), n, c)
                    .await?,
            ),
            None => None,
        };
        let mut guarded = Vec::new();
        for (store, base) in &targets {
            let (url, keys) = (orders(base), format!("k{c}"));
            // The store's server, for the commands each request sends.
            let side = redis.as_deref().filter(|_| store != "memory");
            let mut phase = async |what: &str| {
                let what = name(&format!("guarded {what}, {store}"));
                let mut server = Vec::new();
                let report = timed(&mut figures, &what, &client, &url, &keys, n, c);
                let report = crate::with_cpu(&mut server, side, &what, report).await?;
                figures.extend(server);
                Ok::<_, String>(report)
            };
            let new = phase("new keys").await?;
            let replays = phase("replays").await?;
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
        reports.extend(reference);
        reports.extend(ping);
        reports.extend(guarded);
    }
    Ok((reports, figures))
}

/// [`hammer`], and the CPU time this process (client, proxy and upstream; not nginx, not
/// redis-server) spent per request, as a figure: it moves much less than requests/s with
/// the machine's other load.
async fn timed(
    figures: &mut Vec<Figure>,
    what: &str,
    client: &HttpClient,
    url: &str,
    keys: &str,
    n: usize,
    c: usize,
) -> Result<PhaseReport, String> {
    let before = process_cpu();
    let report = hammer(what, client, url, keys, n, c).await?;
    if let (Some(before), Some(after)) = (before, process_cpu()) {
        let per_request = after.saturating_sub(before).as_secs_f64() * 1e6 / n.max(1) as f64;
        let basis = "this process: client, proxy, upstream".to_owned();
        figures.push(Figure::new(
            format!("{what}: CPU per request"),
            per_request,
            "µs",
            basis,
        ));
    }
    Ok(report)
}
