//! The harness of the end-to-end tests: an axum server on a loopback port behind the
//! layer, a hyper client, and counters of handler runs and of the layer's outcomes.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{post, MethodRouter};
use axum::Router;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_core::{Idem, Scope};
use idem_http::{Anonymous, Config, IdempotencyLayer, Outcome};

pub type ClientBody = BoxBody<Bytes, Infallible>;

#[derive(Clone)]
pub struct Server {
    pub base: String,
    pub client: Client<hyper_util::client::legacy::connect::HttpConnector, ClientBody>,
}

#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts that this reply is the replay of `first`: marked replayed, with its status and
    /// its bytes.
    #[track_caller]
    pub fn assert_replay_of(&self, first: &Reply) {
        assert!(self.replayed(), "not a replay: {self:?}");
        assert_eq!((self.status, &self.body), (first.status, &first.body));
    }

    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(doc["status"], self.status.as_u16());
        doc["type"].as_str().unwrap().to_owned()
    }
}

pub async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        base: format!("http://{addr}"),
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

impl Server {
    pub async fn send_body(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: ClientBody,
    ) -> Result<Reply, hyper_util::client::legacy::Error> {
        let mut req = http::Request::post(format!("{}{path}", self.base));
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        let response = self.client.request(req.body(body).unwrap()).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let body = Full::new(Bytes::from(body.to_owned())).boxed();
        self.send_body(path, headers, body).await.unwrap()
    }

    /// [`Server::post`] in a task of its own.
    pub fn spawn_post(
        &self,
        path: &'static str,
        headers: &[(&'static str, &'static str)],
        body: &'static str,
    ) -> tokio::task::JoinHandle<Reply> {
        let (server, headers) = (self.clone(), headers.to_vec());
        tokio::spawn(async move { server.post(path, &headers, body).await })
    }
}

/// Counts runs of the protected side effect.
#[derive(Clone, Default)]
pub struct Runs(pub Arc<AtomicUsize>);

impl Runs {
    pub fn next(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// Records the layer's outcomes.
#[derive(Clone, Default)]
pub struct Outcomes(pub Arc<Mutex<Vec<Outcome>>>);

impl Outcomes {
    pub fn count(&self, outcome: Outcome) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|o| **o == outcome)
            .count()
    }
}

/// A layer scoped by `Authorization: Bearer <name>` (the name itself), where requests
/// without one share the anonymous scope (the refusal of anonymous requests, the default,
/// is tested on its own).
pub fn layer_with(idem: Idem, config: Config, outcomes: &Outcomes) -> IdempotencyLayer {
    let outcomes = outcomes.clone();
    IdempotencyLayer::new(idem)
        .with_config(config.with_anonymous(Anonymous::Shared))
        .with_scope(|parts| {
            let auth = parts.headers.get("authorization")?.to_str().ok()?;
            Scope::new(auth.strip_prefix("Bearer ")?).ok()
        })
        .with_observer(move |o| outcomes.0.lock().unwrap().push(o))
}

/// A `POST` handler that counts its calls in `runs` and runs `handler` with the call's
/// number (from 1), the request headers and the request body.
pub fn post_counted<F, Fut, R>(runs: &Runs, handler: F) -> MethodRouter
where
    F: Fn(usize, HeaderMap, Bytes) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    let runs = runs.clone();
    post(move |headers: HeaderMap, body: Bytes| {
        let runs = runs.clone();
        let handler = handler.clone();
        async move { handler(runs.next(), headers, body).await }
    })
}

/// Serves `POST path`, answered by `handler` as in [`post_counted`], behind [`layer_with`]
/// on `idem` and `config`: the server, the handler's run count and the layer's outcomes.
pub async fn serve_counted<F, Fut, R>(
    idem: Idem,
    config: Config,
    path: &str,
    handler: F,
) -> (Server, Runs, Outcomes)
where
    F: Fn(usize, HeaderMap, Bytes) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    let (runs, outcomes) = (Runs::default(), Outcomes::default());
    let app = Router::new().route(path, post_counted(&runs, handler));
    let server = serve(app.layer(layer_with(idem, config, &outcomes))).await;
    (server, runs, outcomes)
}

/// The payments handler: one run of the side effect per call (run `n`), answering 201 with
/// the run number and the request body, after `x-delay-ms`.
pub async fn pay(n: usize, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    if let Some(ms) = headers.get("x-delay-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let doc = serde_json::json!({
        "run": n,
        "request": String::from_utf8_lossy(&body),
    });
    (StatusCode::CREATED, axum::Json(doc))
}

/// Serves `POST /pay`, answered by [`pay`], behind [`layer_with`] on `idem` and `config`: the server, the
/// handler's run count and the layer's outcomes.
pub async fn serve_pay(idem: Idem, config: Config) -> (Server, Runs, Outcomes) {
    serve_counted(idem, config, "/pay", pay).await
}

pub const JSON: (&str, &str) = ("content-type", "application/json");
