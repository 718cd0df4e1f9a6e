//! Agents' tool calls behind `idem proxy`, with real processes: the MCP example
//! (`examples/mcp`, a server built with the official TypeScript SDK whose `charge` tool
//! counts its charges, installed with `npm ci` from its committed lock file) behind a
//! JSON-RPC route, driven by the official MCP client (`tests/mcp_client.js`); and a minimal
//! A2A agent (`tests/a2a_server.js`) whose `message/send` is keyed by `messageId`. On the
//! memory store, Redis and PostgreSQL, in modules named after them (`cargo test -p
//! idem-cli --test mcp redis`); a missing node fails the run with
//! `IDEM_TEST_REQUIRE_BACKENDS=1`, and skips the tests otherwise.

mod support;

use std::process::Command;

use idem_http::jsonrpc::codes;
use idem_testkit::harness::eventually;
use serde_json::{json, Value};
use support::{call, client, idem, ms, secs, Proc};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/mcp");
const CLIENT_JS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_client.js");
const A2A_JS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/a2a_server.js");

/// The routes file of the README's MCP section.
const MCP_ROUTES: &str = r#"
[[route]]
path = "/mcp"
jsonrpc_methods = ["tools/call"]
key_pointer = "/params/_meta/idempotencyKey"
"#;

/// `npm ci` in the example; `false` when node or npm is missing.
fn install() -> bool {
    support::npm_ci_once(EXAMPLE)
}

/// The example's MCP server on a free port, answering calls as SSE streams (or as JSON
/// bodies with `json`); `printed` is its base URL.
fn mcp_server(json: bool) -> Proc {
    let mut node = Command::new("node");
    node.arg("server.js").current_dir(EXAMPLE).env("PORT", "0");
    if json {
        node.env("JSON_RESPONSE", "1");
    }
    let mut proc = Proc::listening(node);
    proc.printed = proc.printed.trim_end_matches("/mcp").to_owned();
    proc
}

/// `idem proxy` to `upstream` on `store` with `flags`, and `routes` as its routes file;
/// its base URL is `Proc::printed`.
fn proxy(upstream: &str, store: &Store, routes: &str, flags: &[&str]) -> Proc {
    let file = support::temp_file("idem_mcp_", "routes.toml", routes);
    let args = ["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream];
    let mut command = idem(&args);
    command
        .args(["--store", &store.url, "--migrate", "--config"])
        .arg(&file);
    command.args(&store.flags).args(flags);
    Proc::listening(command)
}

/// A store for one test: its `--store` URL and the flags that give the test keys of its
/// own (a Redis key prefix, a PostgreSQL schema).
struct Store {
    url: String,
    flags: Vec<String>,
}

impl Store {
    /// The store named `backend`, or `None` when its server is not configured.
    fn named(backend: &str) -> Option<Self> {
        match backend {
            "memory" => Self::memory(),
            "redis" => Self::redis(),
            "postgres" => Self::postgres(),
            other => panic!("no store named {other}"),
        }
    }

    fn memory() -> Option<Self> {
        Some(Self {
            url: "memory".into(),
            flags: Vec::new(),
        })
    }

    fn redis() -> Option<Self> {
        let name = idem_testkit::harness::unique_name("idem_mcp_");
        Some(Self {
            url: idem_testkit::harness::redis_url()?,
            flags: vec!["--prefix".into(), format!("{name}:")],
        })
    }

    fn postgres() -> Option<Self> {
        let name = idem_testkit::harness::unique_name("idem_mcp_");
        Some(Self {
            url: idem_testkit::harness::database_url()?,
            flags: vec!["--schema".into(), name],
        })
    }
}

/// The official client running `case` against `url` with `key`: what it saw.
async fn mcp_client(case: &str, url: &str, key: &str) -> Value {
    let mut node = Command::new("node");
    node.arg(CLIENT_JS)
        .args([case, url, key])
        .env("NODE_PATH", format!("{EXAMPLE}/node_modules"));
    let out = tokio::task::spawn_blocking(move || node.output().expect("run node"))
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{case}: {stdout}\n{stderr}");
    serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{case}: {e}: {stdout}\n{stderr}"))
}

/// How many charges the server made.
async fn charges(server: &Proc) -> u64 {
    let url = format!("{}/charges", server.printed);
    let doc = call(&client(), "GET", &url, &[], "").await.json();
    doc["count"].as_u64().unwrap()
}

/// Every case of the official client against the example behind the proxy, on the store
/// named `backend`.
async fn the_official_mcp_client_charges_once_per_key(backend: &str) {
    the_official_client_charges_once_per_key(backend, false).await;
}

/// Every case of the official client against the example behind the proxy on the store
/// named `backend`, the server answering each call as one JSON body when `json_answers`,
/// else as an SSE stream.
async fn the_official_client_charges_once_per_key(backend: &str, json_answers: bool) {
    let Some(store) = Store::named(backend) else {
        return;
    };
    if !tokio::task::spawn_blocking(install).await.unwrap() {
        return;
    }
    let server = mcp_server(json_answers);
    let p = proxy(&server.printed, &store, MCP_ROUTES, &[]);
    let url = format!("{}/mcp", p.printed);
    let key = |case: &str| format!("{case}-{}", uuid::Uuid::new_v4().simple());

    // A retry with the same key and a new id: the first result (the SDK accepts only an
    // answer carrying the id it sent), from a new connection too; one charge.
    let seen = mcp_client("retry", &url, &key("retry")).await;
    let first = &seen["first"]["text"];
    assert!(
        first.as_str().unwrap().starts_with("charged 1250 EUR: ch_"),
        "{seen}"
    );
    assert_eq!(seen["retry"]["text"], *first, "{seen}");
    assert_eq!(seen["again"]["text"], *first, "{seen}");
    assert_eq!(charges(&server).await, 1);

    // 20 concurrent copies: one charge; every copy gets its result or the in-flight error.
    let burst_key = key("burst");
    let seen = mcp_client("burst", &url, &burst_key).await;
    let answers = seen["answers"].as_array().unwrap();
    let results: Vec<&Value> = answers.iter().filter(|a| a.get("text").is_some()).collect();
    assert!(!results.is_empty(), "{seen}");
    assert!(
        results.iter().all(|r| r["text"] == results[0]["text"]),
        "{seen}"
    );
    for refused in answers.iter().filter(|a| a.get("text").is_none()) {
        assert_eq!(refused["code"], codes::IN_FLIGHT, "{seen}");
        assert_eq!(refused["data"]["idempotencyKey"], burst_key.as_str());
    }
    assert_eq!(charges(&server).await, 2);

    // Other arguments under the key: the JSON-RPC error naming the key, and no charge.
    let reused = key("reused");
    let seen = mcp_client("mismatch", &url, &reused).await;
    assert!(seen["first"]["text"].is_string(), "{seen}");
    assert_eq!(seen["other"]["code"], codes::KEY_REUSED, "{seen}");
    assert_eq!(seen["other"]["data"]["idempotencyKey"], reused.as_str());
    assert_eq!(charges(&server).await, 3);

    // initialize, tools/list, a notification and ping pass through untouched.
    let seen = mcp_client("passthrough", &url, "unused").await;
    assert_eq!(seen["lists"], json!([["charge"], ["charge"]]), "{seen}");
    assert_eq!(charges(&server).await, 3);

    // No key: refused by default (missing_key = "reject"), and no charge...
    let seen = mcp_client("nokey", &url, "unused").await;
    assert_eq!(seen["first"]["code"], codes::KEY_MISSING, "{seen}");
    assert_eq!(charges(&server).await, 3);
    // ... or passed on unguarded with missing_key = "pass": a charge per call.
    let open = proxy(
        &server.printed,
        &store,
        MCP_ROUTES,
        &["--missing-key", "pass"],
    );
    let seen = mcp_client("nokey", &format!("{}/mcp", open.printed), "unused").await;
    assert!(seen["first"]["text"].is_string(), "{seen}");
    assert_ne!(seen["first"]["text"], seen["second"]["text"], "{seen}");
    assert_eq!(charges(&server).await, 5);
}

/// An A2A `message/send`, keyed by `messageId`: a retry with a new id gets the first task
/// with its id; the id reused for another message gets the JSON-RPC error; one run each.
async fn an_a2a_message_is_sent_once_per_message_id(backend: &str) {
    let Some(store) = Store::named(backend) else {
        return;
    };
    let found = Command::new("node").arg("--version").output();
    if !idem_testkit::harness::present(found.is_ok_and(|o| o.status.success()), "Node.js") {
        return;
    }
    let agent = Proc::listening({
        let mut node = Command::new("node");
        node.arg(A2A_JS);
        node
    });
    let routes = r#"
[[route]]
path = "/"
jsonrpc_methods = ["message/send"]
key_pointer = "/params/message/messageId"
"#;
    let p = proxy(&agent.printed, &store, routes, &[]);
    let client = client();
    let message_id = uuid::Uuid::new_v4().to_string();
    let send = |id: Value, text: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "message/send", "params": {"message": {
            "role": "user", "kind": "message", "messageId": message_id,
            "parts": [{"kind": "text", "text": text}]}}})
        .to_string()
    };
    let headers = [
        ("authorization", "Bearer alice"),
        ("content-type", "application/json"),
    ];
    let url = format!("{}/", p.printed);
    let first = call(&client, "POST", &url, &headers, &send(json!(1), "book it")).await;
    assert_eq!(first.json()["result"]["id"], "task-1", "{first:?}");
    let retry = call(
        &client,
        "POST",
        &url,
        &headers,
        &send(json!("r-2"), "book it"),
    )
    .await;
    assert!(retry.replayed(), "{retry:?}");
    // Byte for byte the first answer, but for its id.
    let expected = String::from_utf8(first.body.to_vec())
        .unwrap()
        .replace(r#""id":1,"#, r#""id":"r-2","#);
    assert_eq!(String::from_utf8(retry.body.to_vec()).unwrap(), expected);
    let other = call(
        &client,
        "POST",
        &url,
        &headers,
        &send(json!(3), "cancel it"),
    )
    .await;
    assert_eq!(other.status, 200);
    let error = &other.json()["error"];
    assert_eq!(error["code"], codes::KEY_REUSED, "{other:?}");
    assert_eq!(error["data"]["idempotencyKey"], message_id.as_str());
    assert_eq!(other.json()["id"], 3);
    let sent = call(&client, "GET", &format!("{}/sent", agent.printed), &[], "").await;
    assert_eq!(sent.json()["sent"], 1);
}

/// A raw `tools/call` of `charge` with `id` and `key`, the server taking `delay_ms`.
fn raw_call(id: u64, key: &str, delay_ms: u64) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "charge",
        "arguments": {"amount": 300, "currency": "EUR", "delay_ms": delay_ms},
        "_meta": {"idempotencyKey": key}}})
    .to_string()
}

/// The JSON-RPC message of an SSE answer's `data:` line.
fn event_data(reply: &support::Reply) -> Value {
    let text = String::from_utf8_lossy(&reply.body);
    let data = text
        .lines()
        .find_map(|line| line.strip_prefix("data: "))
        .unwrap_or_else(|| panic!("no data line: {reply:?}"));
    serde_json::from_str(data).unwrap()
}

/// A proxy killed (`kill -9`) while the tool charges: a retry through another proxy gets
/// the in-flight error until the dead proxy's lease (2 s) ends, then runs as attempt 2,
/// which the example answers from its ledger: one charge, and the retry gets it with its
/// own id.
async fn a_killed_proxy_leaves_the_call_to_its_lease(backend: &str) {
    let Some(store) = Store::named(backend) else {
        return;
    };
    if !tokio::task::spawn_blocking(install).await.unwrap() {
        return;
    }
    let server = mcp_server(false);
    let a = proxy(&server.printed, &store, MCP_ROUTES, &["--lease", "2"]);
    let b = proxy(&server.printed, &store, MCP_ROUTES, &["--lease", "2"]);
    let key = format!("crash-{}", uuid::Uuid::new_v4().simple());
    let headers = [
        ("authorization", "Bearer alice"),
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    let client = client();
    let mut a = a;
    let slow = {
        let (client, url, body) = (
            client.clone(),
            format!("{}/mcp", a.printed),
            raw_call(1, &key, 4000),
        );
        tokio::spawn(async move {
            support::send(&client, support::request("POST", &url, &headers, &body))
                .await
                .is_ok()
        })
    };
    let charged = || async { (charges(&server).await > 0).then_some(()) };
    eventually("the charge upstream", secs(10), ms(50), charged).await;
    a.stop();
    assert!(!slow.await.unwrap(), "the killed proxy answered");
    let url = format!("{}/mcp", b.printed);
    let first = call(&client, "POST", &url, &headers, &raw_call(2, &key, 4000)).await;
    assert_eq!(first.json()["error"]["code"], codes::IN_FLIGHT, "{first:?}");
    assert!(first.header("retry-after").is_some());
    let answered = || async {
        let reply = call(&client, "POST", &url, &headers, &raw_call(3, &key, 4000)).await;
        let in_flight = reply.header("content-type") == Some("application/json");
        (!in_flight).then_some(reply)
    };
    let taken_over = eventually("an answer but in flight", secs(15), ms(200), answered).await;
    let doc = event_data(&taken_over);
    assert_eq!(doc["id"], 3, "{doc}");
    assert_eq!(doc["result"]["structuredContent"]["id"], "ch_1", "{doc}");
    assert_eq!(charges(&server).await, 1);
    let replay = call(&client, "POST", &url, &headers, &raw_call(4, &key, 4000)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(event_data(&replay)["id"], 4);
    assert_eq!(charges(&server).await, 1);
}

support::on_stores!(
    [memory, redis, postgres],
    [
        the_official_mcp_client_charges_once_per_key,
        an_a2a_message_is_sent_once_per_message_id,
    ]
);

/// The crash of a proxy, on the stores two proxies share.
mod crash {
    use super::a_killed_proxy_leaves_the_call_to_its_lease;

    crate::support::on_stores!(
        [redis, postgres],
        [a_killed_proxy_leaves_the_call_to_its_lease]
    );
}

/// The same cases with the server answering each call as one JSON body, not an SSE stream.
mod json_answers {
    mod memory {
        use crate::the_official_client_charges_once_per_key;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_official_mcp_client_charges_once_per_key() {
            the_official_client_charges_once_per_key("memory", true).await;
        }
    }
}

/// `--check-config` names a JSON-RPC route's settings.
#[test]
fn check_config_shows_the_jsonrpc_route() {
    let dir = std::env::temp_dir().join(idem_testkit::harness::unique_name("idem_mcp_"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("routes.toml");
    std::fs::write(&file, MCP_ROUTES).unwrap();
    let out = idem(&[
        "proxy",
        "--upstream",
        "http://127.0.0.1:3001",
        "--check-config",
    ])
    .arg("--config")
    .arg(&file)
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(
            r#"route POST /mcp: key_header = "idempotency-key", scope_header = "authorization""#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"jsonrpc_methods = ["tools/call"], key_pointer = "/params/_meta/idempotencyKey", ignore_meta = ["progressToken"], store_errors = false (no wait_ms: the in-flight JSON-RPC error at once)"#
        ),
        "{text}"
    );
}
