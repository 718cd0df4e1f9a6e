//! JSON-RPC routes end to end over real HTTP: an axum JSON-RPC handler (an MCP-shaped
//! `tools/call` of a `charge` tool that counts its runs, `tools/list`, notifications, and an
//! A2A-shaped `message/send`) behind the layer, a hyper client, and the store under test.
//! The cases are written once in `cases` and run per backend in a module named after it
//! (`memory`, `redis`, `postgres`), so `cargo test redis` runs one backend.

use std::future::Future;
use std::pin::Pin;

#[allow(dead_code)]
mod support;

/// What cleans up after a test.
type Teardown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One `#[tokio::test]` per case, on stores from `$factory` (an
/// `async fn() -> Option<(Arc<dyn Store>, Option<Teardown>)>`; `None`: the backend is
/// missing and the harness said why, or failed the run when backends are required).
macro_rules! jsonrpc_cases {
    ($factory:path) => {
        jsonrpc_cases!(@each $factory;
            a_retry_with_a_new_id_gets_the_first_result_with_its_id,
            twenty_concurrent_copies_run_the_tool_once,
            with_a_wait_every_copy_gets_the_result_with_its_own_id,
            other_arguments_under_the_key_get_the_jsonrpc_error_and_no_run,
            other_messages_pass_through_untouched,
            a_call_without_a_key_follows_missing_key,
            failed_calls_release_the_key_unless_store_errors,
            an_sse_answer_is_replayed_with_the_id_inside_its_event,
            an_sse_answer_reaches_the_caller_as_it_comes,
            a_batch_holding_a_guarded_call_is_refused,
            an_a2a_message_is_sent_once_per_message_id,
            a_client_that_gives_up_gets_the_answer_on_retry,
        );
    };
    (@each $factory:path; $($case:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some((store, teardown)) = $factory().await else {
                    return;
                };
                crate::cases::$case(store).await;
                if let Some(teardown) = teardown {
                    teardown.await;
                }
            }
        )*
    };
}

mod cases {
    //! The cases, each taking the store under test.

    use std::convert::Infallible;
    use std::sync::Arc;
    use std::time::Duration;

    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::Router;
    use bytes::Bytes;
    use futures_util::StreamExt;
    use idem_core::{Idem, Store};
    use idem_http::jsonrpc::codes;
    use idem_http::{Config, JsonRpc, MissingKey, Outcome};
    use serde_json::{json, Value};

    use crate::support::*;

    /// Runs of each method the server counts: `charge` (a tool call), `tools/list`, A2A's
    /// `message/send`, and notifications.
    #[derive(Clone, Default)]
    struct Counts {
        charge: Runs,
        list: Runs,
        send: Runs,
        notified: Runs,
    }

    /// A JSON-RPC server: `tools/call` of `charge` answers `charged <amount> (run <n>)`, a
    /// tool error when `arguments.fail`, after `arguments.delay_ms`, as SSE when the
    /// request asks for `text/event-stream` only; `tools/list` lists it; `message/send`
    /// answers a task; a notification gets 202.
    async fn rpc(counts: Counts, headers: HeaderMap, body: Bytes) -> Response {
        let message: Value = match serde_json::from_slice(&body) {
            Ok(message) => message,
            Err(_) => {
                let error = json!({"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}});
                return axum::Json(error).into_response();
            }
        };
        if message.is_array() {
            let answers: Vec<Value> = message
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m.get("id").is_some())
                .map(|m| json!({"jsonrpc":"2.0","id":m["id"],"result":{"batched":true}}))
                .collect();
            return axum::Json(Value::Array(answers)).into_response();
        }
        // A response the client sends back has no method: nothing to answer.
        let (Some(id), true) = (message.get("id").cloned(), message.get("method").is_some()) else {
            counts.notified.next();
            return StatusCode::ACCEPTED.into_response();
        };
        let result = match message["method"].as_str().unwrap_or_default() {
            "tools/call" if message["params"]["name"] != "charge" => {
                let error = json!({"jsonrpc":"2.0","id":id,"error":{"code":-32602,"message":"Unknown tool"}});
                return axum::Json(error).into_response();
            }
            "tools/call" => {
                let args = &message["params"]["arguments"];
                if let Some(ms) = args["delay_ms"].as_u64() {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                let n = counts.charge.next();
                let text = format!("charged {} (run {n})", args["amount"]);
                let failed = args["fail"] == json!(true);
                json!({"content":[{"type":"text","text":text}],"isError":failed})
            }
            "tools/list" => {
                counts.list.next();
                json!({"tools":[{"name":"charge"}]})
            }
            "message/send" => {
                let n = counts.send.next();
                json!({"kind":"task","id":format!("task-{n}"),"status":{"state":"completed"}})
            }
            _ => {
                let error = json!({"jsonrpc":"2.0","id":id,"error":{"code":-32601,"message":"Method not found"}});
                return axum::Json(error).into_response();
            }
        };
        let answer = json!({"result": result, "jsonrpc": "2.0", "id": id}).to_string();
        let sse = headers.get("accept").and_then(|v| v.to_str().ok()) == Some("text/event-stream");
        if !sse {
            return ([("content-type", "application/json")], answer).into_response();
        }
        // An event stream that is not whole at once: a comment, then the answer's event
        // (after `x-answer-after-ms`, 5 by default).
        let after = headers
            .get("x-answer-after-ms")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(5);
        let frames = [
            (5, Bytes::from_static(b": opening\n\n")),
            (
                after,
                Bytes::from(format!("event: message\nid: ev-1\ndata: {answer}\n\n")),
            ),
        ];
        let stream = futures_util::stream::iter(frames).then(|(ms, frame)| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, Infallible>(frame)
        });
        (
            [("content-type", "text/event-stream")],
            axum::body::Body::from_stream(stream),
        )
            .into_response()
    }

    /// The JSON-RPC server on `/mcp` behind a JSON-RPC route of `rpc` on `store`.
    async fn serve_rpc(
        store: Arc<dyn Store>,
        engine: idem_core::Config,
        rpc_settings: JsonRpc,
        config: Config,
    ) -> (Server, Counts, Outcomes) {
        let (counts, outcomes) = (Counts::default(), Outcomes::default());
        let idem = Idem::from_arc(store).with_config(engine);
        let config = config.with_jsonrpc(rpc_settings);
        let handler_counts = counts.clone();
        let app = Router::new()
            .route(
                "/mcp",
                post(move |headers: HeaderMap, body: Bytes| {
                    rpc(handler_counts.clone(), headers, body)
                }),
            )
            .layer(layer_with(idem, config, &outcomes));
        (serve(app).await, counts, outcomes)
    }

    async fn mcp_on(store: Arc<dyn Store>) -> (Server, Counts, Outcomes) {
        let rpc = JsonRpc::new(["tools/call"]);
        serve_rpc(store, idem_core::Config::default(), rpc, Config::default()).await
    }

    const ALICE: (&str, &str) = ("authorization", "Bearer alice");

    /// `POST /mcp` of `body` as alice.
    async fn post_mcp(server: &Server, body: &str) -> Reply {
        post_mcp_with(server, &[], body).await
    }

    /// `POST /mcp` of `body` as alice, with the `extra` headers.
    async fn post_mcp_with(server: &Server, extra: &[(&str, &str)], body: &str) -> Reply {
        let headers: Vec<_> = [ALICE, JSON]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        server.post("/mcp", &headers, body).await
    }

    /// As alice, the `tools/call` of [`call`].
    async fn charge(server: &Server, id: Value, key: Option<&str>, arguments: Value) -> Reply {
        post_mcp(server, &call(id, key, arguments)).await
    }

    /// Twenty copies of the call of `key` with `arguments` (ids 0 to 19), sent at once, each
    /// from a task of its own: the replies, in the order of their ids.
    async fn twenty_copies(server: &Server, key: &str, arguments: Value) -> Vec<Reply> {
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let server = server.clone();
                let body = call(json!(i), Some(key), arguments.clone());
                tokio::spawn(async move { post_mcp(&server, &body).await })
            })
            .collect();
        let mut replies = Vec::with_capacity(tasks.len());
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    }

    /// A `tools/call` of `charge` with `id`, `key` (none: no `_meta`) and `arguments`.
    fn call(id: Value, key: Option<&str>, arguments: Value) -> String {
        let mut params = json!({"name": "charge", "arguments": arguments});
        if let Some(key) = key {
            params["_meta"] = json!({"idempotencyKey": key, "progressToken": id});
        }
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}).to_string()
    }

    fn doc(reply: &Reply) -> Value {
        serde_json::from_slice(&reply.body).unwrap_or_else(|e| panic!("{e}: {reply:?}"))
    }

    /// Asserts that `reply` is the layer's JSON-RPC error `code` answering `id`, with HTTP
    /// 200; returns its `error.data`.
    #[track_caller]
    fn assert_error(reply: &Reply, code: i64, id: Value) -> Value {
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        let doc = doc(reply);
        assert_eq!(doc["jsonrpc"], "2.0", "{doc}");
        assert_eq!(doc["id"], id, "{doc}");
        assert_eq!(doc["error"]["code"], code, "{doc}");
        assert!(doc["error"]["message"].is_string(), "{doc}");
        doc["error"]["data"].clone()
    }

    pub async fn a_retry_with_a_new_id_gets_the_first_result_with_its_id(store: Arc<dyn Store>) {
        let (server, counts, outcomes) = mcp_on(store).await;
        let first = charge(&server, json!(1), Some("pay-1"), json!({"amount": 5})).await;
        assert_eq!(first.status, StatusCode::OK);
        assert!(!first.replayed());
        assert!(first.header("idempotency-expires").is_some(), "{first:?}");
        assert_eq!(
            doc(&first)["result"]["content"][0]["text"],
            "charged 5 (run 1)"
        );
        // The retry: a new id and progress token, the arguments written otherwise.
        let retry_body = call(json!("two"), Some("pay-1"), json!({"amount": 5.0}));
        let retry = post_mcp(&server, &retry_body).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.status, StatusCode::OK);
        // Byte for byte the first answer, but for its id.
        let expected = String::from_utf8(first.body.to_vec())
            .unwrap()
            .replace(r#""id":1"#, r#""id":"two""#);
        assert_eq!(String::from_utf8(retry.body.to_vec()).unwrap(), expected);
        assert_eq!(counts.charge.get(), 1);
        assert_eq!(outcomes.count(Outcome::Replayed), 1);
        // The key belongs to its principal: another caller runs the tool for itself.
        let bob = ("authorization", "Bearer bob");
        let theirs = server.post("/mcp", &[bob, JSON], &retry_body).await;
        assert!(!theirs.replayed());
        assert_eq!(counts.charge.get(), 2);
        // The session header takes no part.
        let session = ("mcp-session-id", "another-session");
        let body = call(json!(3), Some("pay-1"), json!({"amount": 5}));
        let again = post_mcp_with(&server, &[session], &body).await;
        assert!(again.replayed());
        assert_eq!(doc(&again)["id"], 3);
        assert_eq!(counts.charge.get(), 2);
    }

    pub async fn twenty_concurrent_copies_run_the_tool_once(store: Arc<dyn Store>) {
        let (server, counts, outcomes) = mcp_on(store).await;
        let arguments = json!({"amount": 7, "delay_ms": 300});
        let replies = twenty_copies(&server, "burst-1", arguments.clone()).await;
        let mut answered = 0;
        for (i, reply) in replies.iter().enumerate() {
            let doc = doc(reply);
            if doc.get("result").is_some() {
                answered += 1;
                assert_eq!(doc["id"], i);
                assert_eq!(doc["result"]["content"][0]["text"], "charged 7 (run 1)");
            } else {
                let data = assert_error(reply, codes::IN_FLIGHT, json!(i));
                assert_eq!(data["idempotencyKey"], "burst-1");
                assert!(data["retryAfterSeconds"].as_u64().unwrap() >= 1);
                assert!(reply.header("retry-after").is_some());
            }
        }
        assert_eq!(counts.charge.get(), 1);
        assert!(answered >= 1);
        assert_eq!(outcomes.count(Outcome::Executed), 1);
        // Once it is done, each retry gets its result.
        let late = charge(&server, json!(99), Some("burst-1"), arguments).await;
        assert!(late.replayed());
        assert_eq!(doc(&late)["id"], 99);
        assert_eq!(counts.charge.get(), 1);
    }

    pub async fn with_a_wait_every_copy_gets_the_result_with_its_own_id(store: Arc<dyn Store>) {
        let engine = idem_core::Config::default().with_wait(Duration::from_secs(10));
        let rpc = JsonRpc::new(["tools/call"]);
        let (server, counts, _) = serve_rpc(store, engine, rpc, Config::default()).await;
        let arguments = json!({"amount": 8, "delay_ms": 300});
        for (i, reply) in twenty_copies(&server, "wait-1", arguments)
            .await
            .iter()
            .enumerate()
        {
            let doc = doc(reply);
            assert_eq!(doc["id"], i, "{doc}");
            assert_eq!(doc["result"]["content"][0]["text"], "charged 8 (run 1)");
        }
        assert_eq!(counts.charge.get(), 1);
    }

    pub async fn other_arguments_under_the_key_get_the_jsonrpc_error_and_no_run(
        store: Arc<dyn Store>,
    ) {
        let (server, counts, outcomes) = mcp_on(store).await;
        charge(&server, json!(1), Some("pay-2"), json!({"amount": 5})).await;
        let other = charge(&server, json!(2), Some("pay-2"), json!({"amount": 500})).await;
        let data = assert_error(&other, codes::KEY_REUSED, json!(2));
        assert_eq!(data["idempotencyKey"], "pay-2");
        assert_eq!(data["type"], "urn:idem:problem:idempotency-key-reused");
        assert!(!other.replayed());
        assert_eq!(counts.charge.get(), 1);
        assert_eq!(outcomes.count(Outcome::Mismatch), 1);
    }

    pub async fn other_messages_pass_through_untouched(store: Arc<dyn Store>) {
        let (server, counts, outcomes) = mcp_on(store).await;
        let list = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"idempotencyKey":"k"}}}"#;
        for _ in 0..2 {
            let reply = post_mcp(&server, list).await;
            assert!(!reply.replayed());
            assert_eq!(doc(&reply)["result"]["tools"][0]["name"], "charge");
        }
        assert_eq!(counts.list.get(), 2);
        // A notification, even of a guarded method (it has no id, so no answer to keep).
        let note = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        assert_eq!(post_mcp(&server, note).await.status, StatusCode::ACCEPTED);
        let note = r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"charge"}}"#;
        assert_eq!(post_mcp(&server, note).await.status, StatusCode::ACCEPTED);
        assert_eq!(counts.notified.get(), 2);
        // A response the client sends back, and a body that is not JSON: the server's.
        let response = r#"{"jsonrpc":"2.0","id":"s-1","result":{}}"#;
        assert_eq!(
            post_mcp(&server, response).await.status,
            StatusCode::ACCEPTED
        );
        let garbage = post_mcp(&server, "{nope").await;
        assert_eq!(doc(&garbage)["error"]["code"], -32700);
        assert_eq!(counts.charge.get(), 0);
        // None of them is reported as guarded.
        assert!(outcomes.0.lock().unwrap().is_empty());
    }

    pub async fn a_call_without_a_key_follows_missing_key(store: Arc<dyn Store>) {
        let (server, counts, _) = mcp_on(store.clone()).await;
        let reply = charge(&server, json!(4), None, json!({"amount": 1})).await;
        let data = assert_error(&reply, codes::KEY_MISSING, json!(4));
        assert!(data["detail"]
            .as_str()
            .unwrap()
            .contains("/params/_meta/idempotencyKey"));
        assert_eq!(counts.charge.get(), 0);
        // The key header is read when the body has none.
        let header = ("idempotency-key", "from-header");
        let body = call(json!(5), None, json!({"amount": 1}));
        post_mcp_with(&server, &[header], &body).await;
        let retry = post_mcp_with(&server, &[header], &body).await;
        assert!(retry.replayed());
        assert_eq!(counts.charge.get(), 1);
        // A malformed key is refused.
        let bad = charge(&server, json!(6), Some("a b"), json!({"amount": 1})).await;
        assert_error(&bad, codes::KEY_INVALID, json!(6));
        // Keys optional: handed on unguarded, each time.
        let rpc = JsonRpc::new(["tools/call"]);
        let config = Config::default().with_missing_key(MissingKey::PassThrough);
        let (server, counts, outcomes) =
            serve_rpc(store, idem_core::Config::default(), rpc, config).await;
        for _ in 0..2 {
            let reply = post_mcp(&server, &body).await;
            assert!(doc(&reply).get("result").is_some());
        }
        assert_eq!(counts.charge.get(), 2);
        assert_eq!(outcomes.count(Outcome::Unguarded), 2);
    }

    pub async fn failed_calls_release_the_key_unless_store_errors(store: Arc<dyn Store>) {
        let (server, counts, outcomes) = mcp_on(store.clone()).await;
        let failing = call(json!(1), Some("fail-1"), json!({"amount": 1, "fail": true}));
        for run in 1..=2 {
            let reply = post_mcp(&server, &failing).await;
            assert!(!reply.replayed());
            assert_eq!(doc(&reply)["result"]["isError"], true);
            assert_eq!(counts.charge.get(), run);
        }
        assert_eq!(outcomes.count(Outcome::NotStored), 2);
        // A JSON-RPC error from the server: the key released too.
        let unknown = json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"refund","_meta":{"idempotencyKey":"fail-2"}}})
        .to_string();
        for _ in 0..2 {
            let reply = post_mcp(&server, &unknown).await;
            assert!(!reply.replayed());
            assert_eq!(doc(&reply)["error"]["code"], -32602);
        }
        assert_eq!(outcomes.count(Outcome::NotStored), 4);
        // With store_errors, the failure is the call's answer.
        let rpc = JsonRpc::new(["tools/call"]).with_store_errors(true);
        let (server, counts, _) =
            serve_rpc(store, idem_core::Config::default(), rpc, Config::default()).await;
        post_mcp(&server, &failing).await;
        let retry = post_mcp(&server, &failing).await;
        assert!(retry.replayed());
        assert_eq!(doc(&retry)["result"]["isError"], true);
        assert_eq!(counts.charge.get(), 1);
    }

    /// An SSE answer goes to its caller event by event, not buffered to its end: the
    /// first event arrives while the answer's is still to come; the whole stream is then
    /// stored, and a retry gets it with its own `id`.
    pub async fn an_sse_answer_reaches_the_caller_as_it_comes(store: Arc<dyn Store>) {
        use http_body_util::BodyExt;
        let (server, counts, _) = mcp_on(store).await;
        let mut req = http::Request::post(format!("{}/mcp", server.base));
        let headers = [
            ALICE,
            JSON,
            ("accept", "text/event-stream"),
            ("x-answer-after-ms", "1500"),
        ];
        for (n, v) in headers {
            req = req.header(n, v);
        }
        let live = |id| call(json!(id), Some("live-1"), json!({"amount": 9}));
        let body = http_body_util::Full::new(Bytes::from(live(1))).boxed();
        let started = tokio::time::Instant::now();
        let response = server
            .client
            .request(req.body(body).unwrap())
            .await
            .unwrap();
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut body = response.into_body();
        let first = loop {
            let frame = body.frame().await.expect("a frame").expect("no error");
            if let Ok(data) = frame.into_data() {
                break data;
            }
        };
        assert_eq!(first, ": opening\n\n");
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "{:?}",
            started.elapsed()
        );
        let rest = body.collect().await.expect("a clean end").to_bytes();
        let text = String::from_utf8([first, rest].concat()).unwrap();
        assert!(text.contains(r#""id":1"#), "{text}");
        let sse = ("accept", "text/event-stream");
        let retry = post_mcp_with(&server, &[sse], &live(2)).await;
        assert!(retry.replayed(), "{retry:?}");
        let expected = text.replace(r#""id":1,"#, r#""id":2,"#);
        assert_eq!(String::from_utf8(retry.body.to_vec()).unwrap(), expected);
        assert_eq!(counts.charge.get(), 1);
    }

    pub async fn an_sse_answer_is_replayed_with_the_id_inside_its_event(store: Arc<dyn Store>) {
        let (server, counts, _) = mcp_on(store.clone()).await;
        let sse = ("accept", "text/event-stream");
        let body = |id| call(json!(id), Some("sse-1"), json!({"amount": 9}));
        let first = post_mcp_with(&server, &[sse], &body(1)).await;
        assert_eq!(first.header("content-type"), Some("text/event-stream"));
        let text = String::from_utf8(first.body.to_vec()).unwrap();
        assert!(
            text.starts_with(": opening\n\nevent: message\nid: ev-1\ndata: {"),
            "{text}"
        );
        let retry = post_mcp_with(&server, &[sse], &body(2)).await;
        assert!(retry.replayed());
        assert_eq!(retry.header("content-type"), Some("text/event-stream"));
        let expected = text.replace(r#""id":1,"#, r#""id":2,"#);
        assert_ne!(expected, text);
        assert_eq!(String::from_utf8(retry.body.to_vec()).unwrap(), expected);
        assert_eq!(counts.charge.get(), 1);
        // A route that replays no headers: the stream is still found, and its id rewritten.
        let rpc = JsonRpc::new(["tools/call"]);
        let config = Config::default().with_replay_headers([]);
        let (server, counts, _) = serve_rpc(store, idem_core::Config::default(), rpc, config).await;
        let body = |id| call(json!(id), Some("sse-2"), json!({"amount": 9}));
        let first = post_mcp_with(&server, &[sse], &body(1)).await;
        let retry = post_mcp_with(&server, &[sse], &body(2)).await;
        assert!(retry.replayed());
        assert_eq!(retry.header("content-type"), None);
        let text = String::from_utf8(first.body.to_vec()).unwrap();
        let expected = text.replace(r#""id":1,"#, r#""id":2,"#);
        assert_eq!(String::from_utf8(retry.body.to_vec()).unwrap(), expected);
        assert_eq!(counts.charge.get(), 1);
    }

    pub async fn a_batch_holding_a_guarded_call_is_refused(store: Arc<dyn Store>) {
        let (server, counts, _) = mcp_on(store).await;
        let batch = format!(
            "[{},{}]",
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            call(json!(2), Some("batch-1"), json!({"amount": 1}))
        );
        let reply = post_mcp(&server, &batch).await;
        let data = assert_error(&reply, codes::BATCH_REFUSED, Value::Null);
        assert!(data["detail"].as_str().unwrap().contains("tools/call"));
        assert_eq!(counts.charge.get(), 0);
        assert_eq!(counts.list.get(), 0);
        // A compressed body hides its method: refused, whatever it holds.
        let gzip = ("content-encoding", "gzip");
        let reply = server
            .post("/mcp", &[ALICE, JSON, gzip], "\u{1f}\u{8b}")
            .await;
        let data = assert_error(&reply, codes::BODY_REFUSED, Value::Null);
        assert!(
            data["detail"].as_str().unwrap().contains("uncompressed"),
            "{data}"
        );
        // A batch of other calls is the server's.
        let others = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#;
        let reply = post_mcp(&server, others).await;
        assert_eq!(doc(&reply)[0]["result"]["batched"], true);
    }

    pub async fn a_client_that_gives_up_gets_the_answer_on_retry(store: Arc<dyn Store>) {
        let (server, counts, _) = mcp_on(store).await;
        let arguments = json!({"amount": 3, "delay_ms": 600});
        // The client gives up after 100 ms, the answer lost; the call runs on.
        let first = charge(&server, json!(1), Some("dropped-1"), arguments.clone());
        let gave_up = tokio::time::timeout(Duration::from_millis(100), first).await;
        assert!(gave_up.is_err());
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(counts.charge.get(), 1);
        let retry = charge(&server, json!(2), Some("dropped-1"), arguments).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(doc(&retry)["id"], 2);
        assert_eq!(
            doc(&retry)["result"]["content"][0]["text"],
            "charged 3 (run 1)"
        );
        assert_eq!(counts.charge.get(), 1);
    }

    pub async fn an_a2a_message_is_sent_once_per_message_id(store: Arc<dyn Store>) {
        let rpc = JsonRpc::new(["message/send"]).with_key_pointer("/params/message/messageId");
        let (server, counts, _) =
            serve_rpc(store, idem_core::Config::default(), rpc, Config::default()).await;
        let send = |id: u32, message_id: &str, text: &str| {
            json!({"jsonrpc":"2.0","id":id,"method":"message/send","params":{"message":{
                "role":"user","kind":"message","messageId":message_id,
                "parts":[{"kind":"text","text":text}]}}})
            .to_string()
        };
        let first = server
            .post("/mcp", &[ALICE, JSON], &send(1, "m-1", "book it"))
            .await;
        assert_eq!(doc(&first)["result"]["id"], "task-1");
        let retry = server
            .post("/mcp", &[ALICE, JSON], &send(2, "m-1", "book it"))
            .await;
        assert!(retry.replayed());
        assert_eq!(doc(&retry)["id"], 2);
        assert_eq!(doc(&retry)["result"]["id"], "task-1");
        let other = server
            .post("/mcp", &[ALICE, JSON], &send(3, "m-1", "cancel it"))
            .await;
        let data = assert_error(&other, codes::KEY_REUSED, json!(3));
        assert_eq!(data["idempotencyKey"], "m-1");
        let next = server
            .post("/mcp", &[ALICE, JSON], &send(4, "m-2", "book it"))
            .await;
        assert_eq!(doc(&next)["result"]["id"], "task-2");
        assert_eq!(counts.send.get(), 2);
    }
}

mod memory {
    use std::sync::Arc;

    use idem_core::{MemoryStore, Store};

    use crate::Teardown;

    async fn store() -> Option<(Arc<dyn Store>, Option<Teardown>)> {
        Some((Arc::new(MemoryStore::new()), None))
    }

    jsonrpc_cases!(store);
}

mod redis {
    //! One Redis server: `IDEM_TEST_REDIS_URL`, a key prefix per test.

    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::Store;
    use idem_redis::RedisStore;
    use idem_testkit::harness;

    use crate::Teardown;

    async fn store() -> Option<(Arc<dyn Store>, Option<Teardown>)> {
        let url = harness::redis_url()?;
        let prefix = format!("idem-http-jsonrpc-{}:", uuid::Uuid::new_v4().simple());
        let store = RedisStore::builder(url)
            .with_prefix(prefix)
            .with_timeouts(Duration::from_secs(1), Duration::from_secs(8))
            .connect()
            .await
            .expect("connect to IDEM_TEST_REDIS_URL");
        Some((Arc::new(store), None))
    }

    jsonrpc_cases!(store);
}

mod postgres {
    //! PostgreSQL: `IDEM_TEST_DATABASE_URL`, a schema per test, dropped when it passes.

    use std::sync::Arc;

    use idem_core::Store;
    use idem_testkit::postgres;

    use crate::Teardown;

    async fn store() -> Option<(Arc<dyn Store>, Option<Teardown>)> {
        let store = postgres::fresh_store(8).await?;
        store.migrate().await.expect("migrate");
        let dropped = store.clone();
        let teardown: Teardown = Box::pin(async move { postgres::drop_schema(&dropped).await });
        Some((Arc::new(store), Some(teardown)))
    }

    jsonrpc_cases!(store);
}
