//! `idem proxy` as a user runs it: real processes in front of a real upstream (a Python
//! standard-library service, `tests/upstream.py`, that counts its side effects per key).
//! The cases that do not depend on the store run on the memory store (one proxy: two
//! processes cannot share it); the cases that take two proxies on one store (50 concurrent
//! duplicates, a proxy killed with `kill -9`) run on every shared store, in modules named
//! after them (`redis`, `redis_cluster`, `postgres`, `tiered`); `scripts/test` provides the
//! URLs, and with `IDEM_TEST_REQUIRE_BACKENDS=1` a missing server fails the test.

mod support;

use std::process::Command;
use std::time::Duration;

use hyper::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_testkit::harness::eventually;
use support::{call, client, idem, ms, request, run, secs, send, HttpClient, Proc, Reply};

/// The Python upstream on `port` (0: a free one); its base URL is `Proc::printed`.
fn upstream_on(port: u16) -> Proc {
    upstream_speaking(port, "HTTP/1.1")
}

/// The Python upstream on `port`, answering as `version` (`HTTP/1.1` or `HTTP/1.0`).
fn upstream_speaking(port: u16, version: &str) -> Proc {
    support::upstream_py(port, version)
}

/// `idem proxy --upstream <upstream> --store <store> --migrate <extra>` on a free port; its
/// base URL is `Proc::printed`.
fn proxy(upstream: &str, store: &str, extra: &[&str]) -> Proc {
    let args = ["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream];
    let mut command = idem(&args);
    command.args(["--store", store, "--migrate"]).args(extra);
    Proc::listening(command)
}

/// `text` in a file named `name` in a directory of its own.
fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    support::temp_file("idem_proxy_", name, text)
}

/// `POST <proxy>/charge` as alice with `key`, the upstream taking `delay_ms`.
async fn charge(client: &HttpClient, proxy: &str, key: &str, delay_ms: u64) -> Reply {
    let charge = support::charge(proxy, key, ms(delay_ms), r#"{"amount": 1250}"#);
    send(client, charge).await.unwrap()
}

/// `POST <url>` as alice with `key` and the body `{}`.
async fn post(client: &HttpClient, url: &str, key: &str) -> Reply {
    let headers = [("authorization", "Bearer alice"), ("idempotency-key", key)];
    call(client, "POST", url, &headers, "{}").await
}

/// How many times `key` ran upstream, and the `Idempotency-Attempt` of each run.
async fn runs(client: &HttpClient, upstream: &Proc, key: &str) -> (u64, Vec<String>) {
    let (count, attempts, _) = support::runs(client, &upstream.printed, key).await;
    (count, attempts)
}

/// 50 concurrent duplicates, half through each proxy: one upstream execution, every other
/// answer a byte-identical replay or a 409; then every retry a byte-identical replay.
async fn concurrent_duplicates_run_once(upstream: &Proc, proxies: [&str; 2]) {
    let client = client();
    let key = format!("race-{}", uuid::Uuid::new_v4().simple());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..50 {
        let (client, proxy, key) = (client.clone(), proxies[i % 2].to_owned(), key.clone());
        tasks.spawn(async move { charge(&client, &proxy, &key, 400).await });
    }
    let replies = tasks.join_all().await;
    assert_eq!(
        runs(&client, upstream, &key).await,
        (1, vec!["1".to_owned()])
    );
    // One answer is the execution; each of the 49 others is a replay or a 409.
    let executed: Vec<&Reply> = replies.iter().filter(|r| !r.replayed()).collect();
    let conflicts = executed
        .iter()
        .filter(|r| r.status == StatusCode::CONFLICT)
        .count();
    assert_eq!(executed.len() - conflicts, 1, "{replies:?}");
    let first = *executed
        .iter()
        .find(|r| r.status != StatusCode::CONFLICT)
        .unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // Every replay among them and every retry after, through either proxy, is the first
    // answer byte for byte: status, allowlisted headers, body.
    let mut replays: Vec<Reply> = replies.iter().filter(|r| r.replayed()).cloned().collect();
    for proxy in proxies {
        replays.push(charge(&client, proxy, &key, 0).await);
    }
    for replay in &replays {
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!((replay.status, &replay.body), (first.status, &first.body));
        for name in ["content-type", "location"] {
            assert_eq!(replay.header(name), first.header(name), "{name}");
        }
        // Not in the replay allowlist: sent with the first response only.
        assert_eq!(replay.header("x-charge-serial"), None);
    }
    assert!(first.header("x-charge-serial").is_some());
    assert_eq!(runs(&client, upstream, &key).await.0, 1);
}

/// A proxy killed (`kill -9`) while the upstream works on a key: a retry through the other
/// proxy gets 409 until the dead proxy's lease (2 s) ends, then runs once, attempt 2.
async fn a_killed_proxy_leaves_its_key_to_the_lease(upstream: &Proc, mut a: Proc, b: Proc) {
    let client = client();
    let key = format!("crash-{}", uuid::Uuid::new_v4().simple());
    let slow = {
        let (client, base, key) = (client.clone(), a.printed.clone(), key.clone());
        tokio::spawn(async move {
            let headers = [
                ("authorization", "Bearer alice"),
                ("idempotency-key", key.as_str()),
                ("x-delay-ms", "3000"),
            ];
            let url = format!("{base}/charge");
            send(&client, request("POST", &url, &headers, "{}"))
                .await
                .is_ok()
        })
    };
    // The upstream counts the run as soon as the request arrives.
    let arrived = || async { (runs(&client, upstream, &key).await.0 > 0).then_some(()) };
    eventually("the request upstream", secs(10), ms(50), arrived).await;
    a.stop();
    assert!(!slow.await.unwrap(), "the killed proxy answered");
    let url = format!("{}/charge", b.printed);
    let retry = || post(&client, &url, &key);
    let first = retry().await;
    assert_eq!(first.status, StatusCode::CONFLICT, "{first:?}");
    // 409 until the lease ends (2 s after its last renewal), then one run, attempt 2.
    let answered = || async {
        let reply = retry().await;
        (reply.status != StatusCode::CONFLICT).then_some(reply)
    };
    let taken_over = eventually("an answer but 409", secs(10), ms(200), answered).await;
    assert_eq!(taken_over.status, StatusCode::CREATED, "{taken_over:?}");
    assert_eq!(taken_over.json()["attempt"], "2");
    assert_eq!(
        runs(&client, upstream, &key).await,
        (2, vec!["1".to_owned(), "2".to_owned()])
    );
    let replay = retry().await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, taken_over.body);
}

mod memory {
    use super::*;

    /// An upstream, one proxy in front of it on the memory store with `extra` flags, and a
    /// client.
    fn memory_proxy(extra: &[&str]) -> (Proc, Proc, HttpClient) {
        let up = upstream_on(0);
        let p = proxy(&up.printed, "memory", extra);
        (up, p, client())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_duplicates_run_once_and_replay_byte_for_byte() {
        let (up, p, _) = memory_proxy(&[]);
        concurrent_duplicates_run_once(&up, [&p.printed, &p.printed]).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_disconnects_gets_the_stored_response_on_retry() {
        let (up, p, client) = memory_proxy(&[]);
        // The client gives up after 300 ms; the upstream takes 1 s.
        let gave_up = tokio::time::timeout(
            Duration::from_millis(300),
            charge(&client, &p.printed, "gone-1", 1000),
        )
        .await;
        assert!(gave_up.is_err());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let retry = charge(&client, &p.printed, "gone-1", 0).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(runs(&client, &up, "gone-1").await.0, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upstream_refusing_connections_is_a_502_and_the_key_is_released() {
        let port = idem_testkit::harness::free_port();
        let url = format!("http://127.0.0.1:{port}");
        let p = proxy(&url, "memory", &[]);
        let client = client();
        let refused = charge(&client, &p.printed, "refused-1", 0).await;
        assert_eq!(refused.status, StatusCode::BAD_GATEWAY);
        assert_eq!(
            refused.problem_type(),
            "urn:idem:problem:upstream-unreachable"
        );
        // The upstream comes back: the retry runs, once.
        let up = upstream_on(port);
        let retry = charge(&client, &p.printed, "refused-1", 0).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert!(!retry.replayed());
        assert_eq!(
            runs(&client, &up, "refused-1").await,
            (1, vec!["1".to_owned()])
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upstream_timing_out_after_receiving_leaves_the_key_in_flight() {
        let (up, p, client) = memory_proxy(&["--upstream-timeout", "0.5", "--lease", "30"]);
        let url = format!("{}/hang", p.printed);
        let first = post(&client, &url, "hang-1").await;
        assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(first.problem_type(), "urn:idem:problem:upstream-timeout");
        // The upstream may have acted: the key is neither stored nor released.
        let retry = post(&client, &url, "hang-1").await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
        assert_eq!(runs(&client, &up, "hang-1").await.0, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upstream_500_is_passed_on_and_not_stored() {
        let (up, p, client) = memory_proxy(&[]);
        let url = format!("{}/status/500", p.printed);
        for n in 1..=2 {
            let reply = post(&client, &url, "five-1").await;
            assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert!(!reply.replayed());
            assert_eq!(runs(&client, &up, "five-1").await.0, n);
        }
    }

    /// A route that stores 5xx stores the upstream's, never the proxy's own 502 or 504:
    /// those say the upstream's answer is missing (nothing sent, or an unknown outcome the
    /// route releases), so a retry runs again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_route_storing_5xx_never_stores_the_proxys_own_502_or_504() {
        let routes = temp_file(
            "routes.toml",
            "[[route]]\nstore_status = [\"2xx\", \"5xx\"]\nrelease_unknown = true\n",
        );
        let port = idem_testkit::harness::free_port();
        let url = format!("http://127.0.0.1:{port}");
        let config = routes.to_str().unwrap();
        let p = proxy(
            &url,
            "memory",
            &["--config", config, "--upstream-timeout", "0.5"],
        );
        let client = client();
        let post = |path: &str, key: &'static str| {
            let (client, url) = (client.clone(), format!("{}{path}", p.printed));
            async move { post(&client, &url, key).await }
        };
        // Nothing listens: the proxy's 502, not stored.
        let refused = post("/charge", "k5-refused").await;
        assert_eq!(refused.status, StatusCode::BAD_GATEWAY);
        assert_eq!(
            refused.problem_type(),
            "urn:idem:problem:upstream-unreachable"
        );
        let up = upstream_on(port);
        let retry = post("/charge", "k5-refused").await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert_eq!(runs(&client, &up, "k5-refused").await.0, 1);
        // The upstream's own 503 is stored, as the route says.
        let unavailable = post("/status/503", "k5-503").await;
        assert_eq!(unavailable.status, StatusCode::SERVICE_UNAVAILABLE);
        let replay = post("/status/503", "k5-503").await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, unavailable.body);
        assert_eq!(runs(&client, &up, "k5-503").await.0, 1);
        // A timeout the route releases: the proxy's 504, not stored; the retry runs again.
        for n in 1..=2 {
            let timeout = post("/hang", "k5-hang").await;
            assert_eq!(timeout.status, StatusCode::GATEWAY_TIMEOUT, "{timeout:?}");
            assert!(!timeout.replayed(), "{timeout:?}");
            assert_eq!(runs(&client, &up, "k5-hang").await.0, n);
        }
        let _ = std::fs::remove_dir_all(routes.parent().unwrap());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mismatches_and_missing_principals_never_reach_the_upstream() {
        let (up, p, client) = memory_proxy(&[]);
        let first = charge(&client, &p.printed, "mm-1", 0).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let other_body = [
            ("authorization", "Bearer alice"),
            ("idempotency-key", "mm-1"),
            ("content-type", "application/json"),
        ];
        let url = format!("{}/charge", p.printed);
        let mismatch = call(&client, "POST", &url, &other_body, r#"{"amount": 9999}"#).await;
        assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            mismatch.problem_type(),
            "urn:idem:problem:idempotency-key-reused"
        );
        let anonymous = call(&client, "POST", &url, &[("idempotency-key", "mm-2")], "{}").await;
        assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            anonymous.problem_type(),
            "urn:idem:problem:principal-missing"
        );
        assert!(anonymous.header("www-authenticate").is_some());
        assert_eq!(runs(&client, &up, "mm-1").await.0, 1);
        assert_eq!(runs(&client, &up, "mm-2").await.0, 0);
        // Keys are scoped by the hashed Authorization: bob's mm-1 is his own.
        let bob = [("authorization", "Bearer bob"), ("idempotency-key", "mm-1")];
        let reply = call(&client, "POST", &url, &bob, r#"{"amount": 1250}"#).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        assert_eq!(runs(&client, &up, "mm-1").await.0, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pass_through_requests_are_forwarded_untouched() {
        let (_up, p, client) = memory_proxy(&[]);
        let url = format!("{}/echo/a%20b?x=1&y=%2F", p.printed);
        let headers = [
            ("x-custom", "kept"),
            ("authorization", "Bearer alice"),
            ("connection", "x-hop"),
            ("x-hop", "dropped"),
            ("x-forwarded-for", "10.1.2.3"),
        ];
        let reply = call(&client, "PUT", &url, &headers, "raw \u{1} body").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.header("x-upstream"), Some("python"));
        assert!(!reply.replayed());
        let doc = reply.json();
        assert_eq!(doc["method"], "PUT");
        assert_eq!(doc["target"], "/echo/a%20b?x=1&y=%2F");
        assert_eq!(doc["body"], "raw \u{1} body");
        let got = doc["headers"].as_array().unwrap();
        let get = |name: &str| {
            got.iter()
                .find(|h| h[0] == name)
                .map(|h| h[1].as_str().unwrap())
        };
        assert_eq!(get("x-custom"), Some("kept"));
        assert_eq!(get("authorization"), Some("Bearer alice"));
        assert_eq!(
            get("x-hop"),
            None,
            "a header named in Connection was forwarded"
        );
        assert_eq!(get("x-forwarded-for"), Some("10.1.2.3, 127.0.0.1"));
        assert_eq!(get("x-forwarded-proto"), Some("http"));
        let host = p.printed.trim_start_matches("http://");
        assert_eq!(get("host"), Some(host), "the client's Host is kept");
        assert_eq!(get("x-forwarded-host"), Some(host));
        assert!(get("forwarded").unwrap().contains("for=127.0.0.1"));
        assert_eq!(get("idempotency-attempt"), None);

        // A streamed response arrives whole, chunk by chunk.
        let stream = call(&client, "GET", &format!("{}/stream", p.printed), &[], "").await;
        let parts: String = (0..5).map(|i| format!("part {i}\n")).collect();
        assert_eq!(stream.body, parts.as_bytes());

        // A guarded request carries its key and attempt upstream.
        let guarded = charge(&client, &p.printed, "attempt-1", 0).await;
        assert_eq!(guarded.json()["attempt"], "1");
    }

    /// The client's connection decides the HTTP version of every answer, whatever the
    /// upstream speaks: behind an HTTP/1.0 upstream (Python's `http.server` by default) an
    /// HTTP/1.1 client still gets HTTP/1.1 and keeps its connection, on the guarded path,
    /// for a replay and on pass-through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http_1_0_upstream_leaves_the_client_on_http_1_1() {
        use http_body_util::BodyExt as _;
        let up = upstream_speaking(0, "HTTP/1.0");
        let p = proxy(&up.printed, "memory", &[]);
        let addr = p.printed.trim_start_matches("http://");
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        let guarded = [
            ("host", addr),
            ("authorization", "Bearer alice"),
            ("idempotency-key", "http10-1"),
            ("content-type", "application/json"),
        ];
        let charge = || request("POST", "/charge", &guarded, r#"{"amount": 1250}"#);
        let echo = || request("GET", "/echo", &[("host", addr)], "");
        for (what, req, status, replayed) in [
            ("the first answer", charge(), StatusCode::CREATED, false),
            ("a replay", charge(), StatusCode::CREATED, true),
            ("a pass-through answer", echo(), StatusCode::OK, false),
        ] {
            // An answer that closed the connection leaves nothing to send the next one on.
            sender
                .ready()
                .await
                .unwrap_or_else(|e| panic!("before {what}: the connection is gone: {e}"));
            let response = sender
                .send_request(req)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(response.status(), status, "{what}");
            assert_eq!(response.version(), hyper::Version::HTTP_11, "{what}");
            let replay = response.headers().get("idempotent-replayed");
            assert_eq!(replay.is_some_and(|v| v == "true"), replayed, "{what}");
            assert!(
                response
                    .headers()
                    .get("connection")
                    .is_none_or(|v| v != "close"),
                "{what}: {:?}",
                response.headers()
            );
            response.into_body().collect().await.unwrap();
        }
    }

    #[test]
    fn check_config_validates_without_starting_and_names_the_line_of_a_bad_field() {
        let good = temp_file(
            "good.toml",
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n\n[[route]]\npath = \"/payments\"\nmethods = [\"POST\"]\nscope_header = \"X-Api-Key\"\n",
        );
        let check = |file: &std::path::Path| {
            let file = file.to_str().unwrap();
            run(&["proxy", "--check-config", "--config", file])
        };
        let (code, stdout, err) = check(&good);
        assert_eq!(code, 0, "{err}");
        assert!(
            stdout.contains("config OK") && stdout.contains("route POST /payments"),
            "{stdout}"
        );
        // Values as the file writes them, not as Rust debug-prints them.
        assert!(stdout.contains("scope_header = \"x-api-key\""), "{stdout}");
        assert!(stdout.contains("host = \"keep\""), "{stdout}");
        assert!(stdout.contains("lease_secs = 30,"), "{stdout}");
        assert!(
            !stdout.contains("Some(") && !stdout.contains("None"),
            "{stdout}"
        );

        let bad = temp_file(
            "bad.toml",
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n\n[[route]]\nlease_sec = 5\n",
        );
        let (code, _, stderr) = check(&bad);
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains("bad.toml, line 5"), "{stderr}");
        assert!(
            stderr.contains("lease_sec") && stderr.contains("lease_secs"),
            "{stderr}"
        );

        // No upstream anywhere.
        let (code, _, stderr) = run(&["proxy", "--check-config"]);
        assert_eq!(code, 2);
        assert!(stderr.contains("--upstream"));
        for file in [good, bad] {
            let _ = std::fs::remove_dir_all(file.parent().unwrap());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http2_clients_over_cleartext_are_guarded_alike() {
        let (up, p, client) = memory_proxy(&[]);
        let h2: HttpClient = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let first = charge(&h2, &p.printed, "h2-1", 0).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let retry = charge(&client, &p.printed, "h2-1", 0).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, first.body);
        assert_eq!(runs(&client, &up, "h2-1").await.0, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sigterm_under_load_answers_every_request_in_flight() {
        let (_up, mut p, client) = memory_proxy(&["--shutdown-timeout", "10"]);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..10 {
            let (client, base) = (client.clone(), p.printed.clone());
            tasks.spawn(async move { charge(&client, &base, &format!("drain-{i}"), 1000).await });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let status = tokio::task::spawn_blocking(move || p.terminate())
            .await
            .unwrap();
        for reply in tasks.join_all().await {
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        }
        assert!(status.success(), "{status:?}");
    }
}

/// A store that two proxies share: its `--store` URL and the flags that give one test keys
/// of its own; `None` (the test returns) when its server is missing and not required.
struct SharedStore {
    url: String,
    flags: Vec<String>,
    /// A throwaway cluster, stopped when the test ends.
    _cluster: Option<idem_testkit::redis::RedisCluster>,
}

impl SharedStore {
    /// The store at `url`; each of `flags` (`--prefix`, `--schema`) names a fresh key
    /// prefix or schema, one name for all (`--migrate` creates the schema).
    fn on(url: String, flags: &[&str]) -> Option<Self> {
        let name = idem_testkit::harness::unique_name("idem_proxy_");
        let flags = flags.iter().flat_map(|f| [f.to_string(), name.clone()]);
        Some(Self {
            url,
            flags: flags.collect(),
            _cluster: None,
        })
    }

    /// Redis at `IDEM_TEST_REDIS_URL`.
    async fn redis() -> Option<Self> {
        Self::on(idem_testkit::harness::redis_url()?, &["--prefix"])
    }

    /// A throwaway 3-primary Redis Cluster of this test's own.
    async fn redis_cluster() -> Option<Self> {
        if !idem_testkit::redis::available() {
            return None;
        }
        let cluster = tokio::task::spawn_blocking(|| idem_testkit::redis::RedisCluster::start(3))
            .await
            .unwrap()
            .expect("start a 3-primary cluster");
        let url = cluster.url();
        Some(Self {
            _cluster: Some(cluster),
            ..Self::on(url, &[])?
        })
    }

    /// PostgreSQL at `IDEM_TEST_DATABASE_URL`.
    async fn postgres() -> Option<Self> {
        Self::on(idem_testkit::harness::database_url()?, &["--schema"])
    }

    /// The tiered store on both.
    async fn tiered() -> Option<Self> {
        let redis = idem_testkit::harness::redis_url()?;
        let pg = idem_testkit::harness::database_url()?;
        Self::on(format!("tiered:{redis}|{pg}"), &["--schema", "--prefix"])
    }

    /// Two proxies on this store with a 2 s lease (so that a dead proxy's key is taken over
    /// soon), and the upstream they share.
    fn two_proxies(&self) -> (Proc, Proc, Proc) {
        let mut extra: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        extra.extend(["--lease", "2"]);
        let up = upstream_on(0);
        let a = proxy(&up.printed, &self.url, &extra);
        let b = proxy(&up.printed, &self.url, &extra);
        (up, a, b)
    }
}

/// The cases that take two proxy processes on one store, once per shared store, each in a
/// module named after its store (`cargo test -p idem-cli --test proxy postgres`).
macro_rules! on_every_shared_store {
    ($($backend:ident),* $(,)?) => {$(
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_duplicates_through_two_proxies_run_once() {
                let Some(store) = SharedStore::$backend().await else {
                    return;
                };
                let (up, a, b) = store.two_proxies();
                concurrent_duplicates_run_once(&up, [&a.printed, &b.printed]).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_killed_proxy_leaves_its_key_to_the_lease_then_attempt_2_runs_once() {
                let Some(store) = SharedStore::$backend().await else {
                    return;
                };
                let (up, a, b) = store.two_proxies();
                a_killed_proxy_leaves_its_key_to_the_lease(&up, a, b).await;
            }
        }
    )*};
}

on_every_shared_store!(redis, redis_cluster, postgres, tiered);

mod operators {
    use super::*;

    /// The proxy keeps keys by a derivation of the scope header's value: `idem inspect
    /// --scope-header-value` makes the same one, so an operator finds a caller's key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inspect_finds_a_callers_key_by_its_scope_header_value() {
        let Some(store) = SharedStore::redis().await else {
            return;
        };
        let flags: Vec<&str> = store.flags.iter().map(String::as_str).collect();
        let up = upstream_on(0);
        let p = proxy(&up.printed, &store.url, &flags);
        let paid = charge(&client(), &p.printed, "scoped-1", 0).await;
        assert_eq!(paid.status, StatusCode::CREATED, "{paid:?}");
        let inspect = |value: &str| {
            let args = ["inspect", "scoped-1", "--scope-header-value", value];
            run(&[&args[..], &["--store", &store.url], &flags].concat())
        };
        let (code, out, err) = inspect("Bearer alice");
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("completed (succeeded, status 201)"), "{out}");
        // Another caller's value: another scope, no such key there.
        let (code, _, err) = inspect("Bearer bob");
        assert_eq!(code, 1, "{err}");
    }
}

mod admin {
    use super::*;
    use idem_testkit::redis as testing;

    /// The proxy starts while nothing answers at its Redis (`/readyz` says so), but refuses
    /// to start when another server answers there: a PostgreSQL port will never become a
    /// Redis, and waiting for it would answer 503 for good.
    #[test]
    fn a_redis_url_at_a_postgresql_port_is_refused_at_start() {
        let Some((store, _)) = crate::support::redis_url_at_the_postgresql_port() else {
            return;
        };
        let args = ["proxy", "--listen", "127.0.0.1:0", "--store", &store];
        let (code, _, err) = run(&[&args[..], &["--upstream", "http://127.0.0.1:9"]].concat());
        assert_eq!(code, 3, "{err}");
        assert!(
            err.contains("speaks PostgreSQL and this URL expects Redis: use postgres://"),
            "{err}"
        );
    }

    /// `/readyz` says ready only while the store answers; `/livez` and `/metrics` answer
    /// all along.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readyz_follows_the_store_and_metrics_count_the_upstream() {
        let redis = tokio::task::spawn_blocking(|| testing::throwaway(&[])).await;
        let Some(mut redis) = redis.unwrap() else {
            return;
        };
        let up = upstream_on(0);
        let admin_port = idem_testkit::harness::free_port().to_string();
        let admin_addr = format!("127.0.0.1:{admin_port}");
        let p = proxy(&up.printed, &redis.url(), &["--admin-listen", &admin_addr]);
        let client = client();
        let admin = |path: &'static str| {
            let (client, url) = (client.clone(), format!("http://{admin_addr}{path}"));
            async move { call(&client, "GET", &url, &[], "").await }
        };
        assert_eq!(admin("/livez").await.status, StatusCode::OK);
        assert_eq!(admin("/readyz").await.status, StatusCode::OK);
        assert_eq!(
            charge(&client, &p.printed, "adm-1", 0).await.status,
            StatusCode::CREATED
        );
        let metrics = admin("/metrics").await;
        let text = String::from_utf8_lossy(&metrics.body);
        assert!(
            text.contains("idem_proxy_upstream_duration_seconds"),
            "{text}"
        );
        assert!(
            text.contains("idem_http_requests_total{outcome=\"executed\"} 1"),
            "{text}"
        );

        let mut redis = tokio::task::spawn_blocking(move || {
            redis.stop();
            redis
        })
        .await
        .unwrap();
        let down = admin("/readyz").await;
        assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{down:?}");
        assert_eq!(down.problem_type(), "urn:idem:problem:store-unavailable");
        assert_eq!(admin("/livez").await.status, StatusCode::OK);
        // Fail closed: a guarded request is refused, and never reaches the upstream.
        let refused = charge(&client, &p.printed, "adm-2", 0).await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(runs(&client, &up, "adm-2").await.0, 0);

        // Held until the test ends: dropping it stops the server.
        let _redis = tokio::task::spawn_blocking(move || {
            redis.start_again().unwrap();
            redis
        })
        .await
        .unwrap();
        let ready = || async { (admin("/readyz").await.status == StatusCode::OK).then_some(()) };
        eventually("ready once the store returned", secs(10), ms(100), ready).await;
    }
}

mod express {
    //! The README's Express example (`examples/express`), installed with `npm ci` from its
    //! committed lock file, behind `idem proxy`.

    use super::*;

    const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/express");

    /// The example's service on a free port, installed with `npm ci` first; `None` when node
    /// or npm is missing.
    async fn service() -> Option<Proc> {
        let install = || crate::support::npm_ci_once(EXAMPLE);
        if !tokio::task::spawn_blocking(install).await.unwrap() {
            return None;
        }
        let mut node = Command::new("node");
        node.arg("server.js").current_dir(EXAMPLE).env("PORT", "0");
        Some(Proc::listening(node))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_express_example_charges_once_behind_the_proxy() {
        let Some(service) = service().await else {
            return;
        };
        let p = proxy(&service.printed, "memory", &[]);
        let client = client();
        let headers = [
            ("authorization", "Bearer alice"),
            ("idempotency-key", "order-1"),
            ("content-type", "application/json"),
            ("x-delay-ms", "300"),
        ];
        let pay = format!("{}/payments", p.printed);
        let body = r#"{"amount": 1250, "currency": "EUR"}"#;
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let (client, pay) = (client.clone(), pay.clone());
            tasks.spawn(async move { call(&client, "POST", &pay, &headers, body).await });
        }
        for reply in tasks.join_all().await {
            assert!(
                reply.status == StatusCode::CREATED || reply.status == StatusCode::CONFLICT,
                "{reply:?}"
            );
        }
        let first = call(&client, "POST", &pay, &headers, body).await;
        assert!(first.replayed(), "{first:?}");
        assert_eq!(first.json()["idempotencyKey"], "order-1");
        assert_eq!(first.json()["attempt"], 1);
        let alice = [("authorization", "Bearer alice")];
        let listed = call(&client, "GET", &pay, &alice, "").await;
        assert_eq!(listed.json()["count"], 1, "{listed:?}");
    }

    /// The example's handler as the proxy drives it after an unknown outcome: attempt 2 of a
    /// key whose attempt 1 is still charging gets that charge, not a second one; attempt 2
    /// of a key its ledger does not hold charges.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_express_example_checks_its_ledger_on_attempt_2() {
        let Some(service) = service().await else {
            return;
        };
        let client = client();
        let pay = format!("{}/payments", service.printed);
        let body = r#"{"amount": 1250, "currency": "EUR"}"#;
        let attempt = |key: &'static str, n: &'static str, delay: &'static str| {
            let (client, pay) = (client.clone(), pay.clone());
            let headers = [
                ("authorization", "Bearer alice"),
                ("content-type", "application/json"),
                ("idempotency-key", key),
                ("idempotency-attempt", n),
                ("x-delay-ms", delay),
            ];
            async move { call(&client, "POST", &pay, &headers, body).await }
        };
        // Attempt 1 charges and takes 1.5 s; its answer is lost, as when the proxy dies.
        let first = tokio::spawn(attempt("order-7", "1", "1500"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = attempt("order-7", "2", "0").await;
        let first = first.await.unwrap();
        assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
        assert_eq!(second.json()["id"], first.json()["id"], "{second:?}");
        assert_eq!(second.json()["attempt"], 1, "{second:?}");
        let other = attempt("order-8", "2", "0").await;
        assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
        assert_ne!(other.json()["id"], first.json()["id"]);
        let alice = [("authorization", "Bearer alice")];
        let listed = call(&client, "GET", &pay, &alice, "").await;
        assert_eq!(listed.json()["count"], 2, "{listed:?}");
    }
}
