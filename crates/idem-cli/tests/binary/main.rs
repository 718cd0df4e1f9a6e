//! The `idem` binary as a user runs it: `idem serve` as a process on a free loopback port,
//! driven over HTTP, then stopped with SIGTERM, and the operator commands next to it. One
//! file per topic, each with a module per store (`redis`, `redis_cluster`, `postgres`,
//! `tiered`, `tls`, ...), so that `cargo test redis` runs one store's:
//!
//! - `demo`: the payments demo `idem serve` runs, and what it stores under a key;
//! - `crashes`: `kill -9` after the commit or mid-handler, two processes racing for a key,
//!   the purge of expired records;
//! - `startup`: `idem serve` started while its store is down or persists nothing;
//! - `operators`: `inspect`, `stats`, `stuck`, `evict`, `migrate` and `purge` on live and
//!   broken records;
//! - `mistakes`: errors that name the cause and the fix, and their exit codes.
//!
//! Real Redis (`IDEM_TEST_REDIS_URL`), PostgreSQL (`IDEM_TEST_DATABASE_URL`), Redis
//! Clusters and TLS servers the tests start; `scripts/test` provides the URLs.

#[path = "../support/mod.rs"]
mod support;

mod crashes;
mod demo;
mod mistakes;
mod operators;
mod startup;

use std::time::{Duration, Instant};

use hyper::StatusCode;
use idem_testkit::harness::eventually;
use serde_json::json;
use support::{
    assert_fields, call, client, exits, idem, json, ms, ok, ok_json, request, run, run_on,
    run_with, secs, send, HttpClient, Proc, Reply, BIN,
};

/// `idem serve --store <store> --migrate <extra>` on a free port; its base URL is
/// `Proc::printed`.
fn serve(store: &str, extra: &[&str]) -> Proc {
    let args = ["serve", "--listen", "127.0.0.1:0", "--store", store];
    let mut command = idem(&args);
    command.arg("--migrate").args(extra);
    Proc::listening(command)
}

/// A payer of the test's own: its name (`<prefix>-<random>`, as the demo's rows name their
/// owner) and the `Authorization` header value that makes requests its own.
fn payer(prefix: &str) -> (String, String) {
    let owner = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    let auth = format!("Bearer {owner}");
    (owner, auth)
}

/// The headers of a JSON payment by `auth` (`Bearer <name>`) under `key`, then `extra`.
fn payment<'a>(
    auth: &'a str,
    key: &'a str,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        ("authorization", auth),
        ("content-type", "application/json"),
        ("idempotency-key", key),
    ];
    headers.extend_from_slice(extra);
    headers
}

/// `GET /payments` as `auth`: the caller's payments, as the server lists them.
async fn list(client: &HttpClient, served: &Proc, auth: &str) -> serde_json::Value {
    let url = format!("{}/payments", served.printed);
    let reply = call(client, "GET", &url, &[("authorization", auth)], "").await;
    assert_eq!(reply.status, StatusCode::OK);
    reply.json()
}

/// The demo's payments of `owner` in PostgreSQL, counted.
async fn payment_rows(pool: &sqlx::PgPool, owner: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_demo.payments WHERE owner = $1")
        .bind(owner)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `send()` again every 200 ms while it answers `status`, for 20 s at most: the last reply.
async fn retry_while<F>(status: u16, mut send: impl FnMut() -> F) -> Reply
where
    F: std::future::Future<Output = Reply>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = send().await;
        if reply.status != status || Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `n` identical slow payments (300 ms in the handler) by `auth` under `key`, sent at once
/// and spread over `servers`: their replies.
async fn race(
    client: &HttpClient,
    servers: &[&Proc],
    auth: &str,
    key: &str,
    n: usize,
) -> Vec<Reply> {
    let slow = payment(auth, key, &[("x-demo-delay-ms", "300")]);
    let order = r#"{"amount": 500, "currency": "USD"}"#;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let url = format!("{}/payments", servers[i % servers.len()].printed);
        let (client, req) = (client.clone(), request("POST", &url, &slow, order));
        tasks.spawn(async move { send(&client, req).await.unwrap() });
    }
    tasks.join_all().await
}

/// `order` paid by `auth` under `key` through `served`.
async fn pay(client: &HttpClient, served: &Proc, auth: &str, key: &str, order: &str) -> Reply {
    let url = format!("{}/payments", served.printed);
    call(client, "POST", &url, &payment(auth, key, &[]), order).await
}

/// `order` paid by `auth` under the key `order-1` with the `extra` header, sent in the
/// background to `served`, which the test kills mid-request (so the reply may be an error).
fn pay_in_background(
    client: &HttpClient,
    served: &Proc,
    auth: &str,
    extra: (&str, &str),
    order: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let url = format!("{}/payments", served.printed);
    let req = request("POST", &url, &payment(auth, "order-1", &[extra]), order);
    let client = client.clone();
    tokio::spawn(async move { send(&client, req).await })
}

/// `IDEM_TEST_REDIS_URL` and `IDEM_TEST_DATABASE_URL`, when both are set.
fn both_urls() -> Option<(String, String)> {
    Some((
        idem_testkit::harness::redis_url()?,
        idem_testkit::harness::database_url()?,
    ))
}
