//! The `idem` binary as a user runs it: `idem serve` as a process on a free loopback port,
//! driven over HTTP, then stopped with SIGTERM; the operator commands' errors and exit
//! codes; and `inspect`, `stats`, `evict` next to `idem serve` on real Redis (`mod redis`,
//! `IDEM_TEST_REDIS_URL`), a Redis Cluster the test starts (`mod redis_cluster`),
//! PostgreSQL (`mod postgres`, `IDEM_TEST_DATABASE_URL`) and the tiered store of both
//! (`mod tiered`); `scripts/test` provides the URLs.

mod support;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_serve_runs_the_payments_demo_and_stops_on_sigterm() {
    let mut served = serve("memory", &[]);
    let client = client();
    let payments = format!("{}/payments", served.printed);
    let alice = "Bearer alice";
    let order = r#"{"amount": 1250, "currency": "EUR"}"#;

    // The three-call tour: first call, replay, mismatch.
    let order_1 = payment(alice, "order-1", &[]);
    let first = call(&client, "POST", &payments, &order_1, order).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let payment_json = first.json();
    assert_eq!(payment_json["amount"], 1250);
    assert_eq!(payment_json["currency"], "EUR");
    let id = payment_json["id"].as_str().unwrap().to_owned();
    assert_eq!(first.headers["location"], format!("/payments/{id}"));

    let replay = call(&client, "POST", &payments, &order_1, order).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert!(replay.headers.contains_key("idempotency-expires"));
    assert_eq!(replay.body, first.body);

    let other = r#"{"amount": 9999, "currency": "EUR"}"#;
    let mismatch = call(&client, "POST", &payments, &order_1, other).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(mismatch.headers["content-type"], "application/problem+json");

    // A race: eight identical slow requests, one payment.
    let race = race(&client, &[&served], alice, "race-1", 8).await;
    let count = |status: StatusCode| race.iter().filter(|r| r.status == status).count();
    let (created, conflicts) = (count(StatusCode::CREATED), count(StatusCode::CONFLICT));
    assert!(created > 0 && created + conflicts == race.len(), "{race:?}");

    // Refusals.
    let json = ("content-type", "application/json");
    let no_key = [("authorization", alice), json];
    let no_key = call(&client, "POST", &payments, &no_key, order).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);
    let negative = r#"{"amount": -1, "currency": "EUR"}"#;
    let bad_1 = payment(alice, "bad-1", &[]);
    let invalid = call(&client, "POST", &payments, &bad_1, negative).await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(invalid.json()["type"], "urn:idem:demo:invalid-payment");
    let anonymous = [json, ("idempotency-key", "anon-1")];
    let anonymous = call(&client, "POST", &payments, &anonymous, order).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        anonymous.problem_type(),
        "urn:idem:problem:principal-missing"
    );

    // The side effect ran once per key: two payments for alice, none for bob.
    assert_eq!(list(&client, &served, alice).await["count"], 2);
    let one = format!("{payments}/{id}");
    let alices = call(&client, "GET", &one, &[("authorization", alice)], "").await;
    assert_eq!(alices.json()["id"], id.as_str());
    assert_eq!(list(&client, &served, "Bearer bob").await["count"], 0);
    let bob = ("authorization", "Bearer bob");
    let not_bobs = call(&client, "GET", &one, &[bob], "").await;
    assert_eq!(not_bobs.status, StatusCode::NOT_FOUND);

    let metrics = format!("{}/metrics", served.printed);
    let metrics = call(&client, "GET", &metrics, &[], "").await;
    let text = String::from_utf8(metrics.body.to_vec()).unwrap();
    let metric = |outcome: &str| -> u64 {
        let prefix = format!("idem_http_requests_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {outcome} in {text}"))
            .parse()
            .unwrap()
    };
    // executed: order-1, race-1 and bad-1 (a stored 422); anon-1 was refused before the
    // handler, as was the request without a key.
    assert_eq!(metric("executed"), 3, "{text}");
    assert_eq!(
        metric("replayed") as usize,
        1 + (8 - 1 - conflicts),
        "{text}"
    );
    assert_eq!(metric("in_flight") as usize, conflicts, "{text}");
    assert_eq!(metric("mismatch"), 1, "{text}");
    assert_eq!(metric("rejected"), 2, "{text}");
    assert!(
        text.contains("idem_demo_payments_created_total 2"),
        "{text}"
    );

    // SIGTERM: a clean stop.
    let exit = tokio::task::spawn_blocking(move || served.terminate())
        .await
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
}

#[test]
fn operator_commands_say_clearly_what_they_cannot_do() {
    // A store nothing answers for: exit 3, naming the store but not its password.
    let port = idem_testkit::harness::free_port();
    let closed = format!("redis://:hunter2@127.0.0.1:{port}");
    let closed_pg = closed.replace("redis", "postgres");
    let cases: [(&[&str], i32, &str); 7] = [
        (
            &["inspect", "order-1", "--scope", "alice"],
            2,
            "memory store lives inside one",
        ),
        (
            &["evict", "order-1", "--store", &closed],
            3,
            "cannot open store redis://:***@127.0.0.1:",
        ),
        (
            &["serve", "--store", &closed_pg],
            3,
            "cannot open store postgres://:***@",
        ),
        (&["stats", "--store", &closed], 3, "(connection refused)"),
        (&["stats"], 2, "memory store lives inside one"),
        (&["inspect", "has space"], 2, "invalid key"),
        (&["serve", "--store", "mysql://x"], 2, "unknown store"),
    ];
    for (args, code, says) in cases {
        let (got, _, err) = run(args);
        assert_eq!(got, code, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("hunter2"), "{args:?}: {err}");
    }

    // `--help` names IDEM_STORE but never prints its value, which may hold a password.
    let store = ("IDEM_STORE", "postgres://app:hunter2@db/pay");
    let (_, help, _) = run_with(&["inspect", "--help"], &[store]);
    assert!(help.contains("IDEM_STORE"), "{help}");
    assert!(!help.contains("hunter2"), "{help}");
    // Nor a default store the operator commands refuse.
    for command in ["inspect", "stats", "migrate", "serve"] {
        let (_, help, _) = run(&[command, "--help"]);
        assert!(!help.contains("[default: memory]"), "{command}: {help}");
    }
}

/// The operator commands against a shared store, next to `idem serve` on the same store:
/// a payment in flight then completed, as `inspect` and `stats` show it, then evicted so
/// that the same key runs again. The caller (the Bearer token, hence the scope) is unique
/// to the call, so tests sharing a server never count each other's records.
async fn operator_commands_over(store: &str) {
    let served = serve(store, &[]);
    let client = client();
    let payments = format!("{}/payments", served.printed);
    let caller = format!("ops-{}", uuid::Uuid::new_v4().simple());
    let auth = format!("Bearer {caller}");
    let order = r#"{"amount": 1250, "currency": "EUR"}"#;
    let cmd = run_on(["--store", store]);

    // A slow first request: while it runs, the record is in progress under a lease.
    let first = {
        let (client, payments, auth) = (client.clone(), payments.clone(), auth.clone());
        tokio::spawn(async move {
            let headers = payment(&auth, "order-1", &[("x-demo-delay-ms", "4000")]);
            call(&client, "POST", &payments, &headers, order).await
        })
    };
    let inspect = || async {
        let (code, out, err) = cmd(&["inspect", "order-1", "--scope", &caller, "--json"]);
        if code != 0 {
            assert_eq!(code, 1, "{err}");
            assert!(err.contains("no record for"), "{err}");
        }
        (code == 0).then(|| json(&out))
    };
    let in_flight = eventually("the request in the store", secs(10), ms(50), inspect).await;
    let want = json!({"state": "in_progress", "scope": caller, "attempt": 1});
    assert_fields(&in_flight, want);
    assert_eq!(in_flight["lease"]["expired"], false, "{in_flight}");
    assert!(in_flight["lease"]["remaining_ms"].as_u64().unwrap() > 0);
    let text = ok(cmd(&["inspect", "order-1", "--scope", &caller]));
    let token = in_flight["lease"]["token"].as_str().unwrap();
    for line in ["state        in progress", token, "attempt      1"] {
        assert!(text.contains(line), "{line}: {text}");
    }
    let stats = ok_json(cmd(&["stats", "--scope", &caller, "--json"]));
    assert_fields(&stats, json!({"in_flight": 1, "succeeded": 0}));
    let text = ok(cmd(&["stats", "--scope", &caller]));
    assert!(text.contains("in flight       1"), "{text}");

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let payment_id = first.json()["id"].as_str().unwrap().to_owned();

    // Completed: the stored response is the one the client got.
    let done = ok_json(cmd(&["inspect", "order-1", "--scope", &caller, "--json"]));
    assert_eq!(done["state"], "completed", "{done}");
    assert_fields(
        &done["completion"],
        json!({"kind": "succeeded", "status": 201}),
    );
    assert_eq!(
        done["completion"]["body"].as_str().unwrap().as_bytes(),
        &first.body[..]
    );
    assert_eq!(done["fingerprint"], in_flight["fingerprint"]);
    let stored = done["completion"]["headers"].as_array().unwrap();
    assert!(stored.iter().any(|h| h[0] == "content-type"), "{done}");
    let expires = done["expires_in_ms"].as_u64().unwrap();
    assert!(
        (23 * 3600 * 1000..=24 * 3600 * 1000).contains(&expires),
        "{done}"
    );
    let text = ok(cmd(&["inspect", "order-1", "--scope", &caller]));
    assert!(
        text.contains("state        completed (succeeded, status 201)"),
        "{text}"
    );
    assert!(text.contains(&payment_id), "{text}");

    let stats = ok_json(cmd(&["stats", "--scope", &caller, "--json"]));
    let counts = json!({"in_flight": 0, "succeeded": 1, "failed": 0, "stuck": 0});
    assert_fields(&stats, counts);
    assert_fields(&stats, json!({"scope": caller, "complete": true}));
    let text = ok(cmd(&["stats", "--scope", &caller]));
    assert!(text.contains("succeeded       1"), "{text}");
    assert!(
        !text.contains("ALARM") && !text.contains("PARTIAL"),
        "{text}"
    );
    let all = ok_json(cmd(&["stats", "--json"]));
    assert_eq!(all["scope"], serde_json::Value::Null, "{all}");

    // A retry is a replay; once evicted, the key runs again.
    let headers = payment(&auth, "order-1", &[]);
    let replay = call(&client, "POST", &payments, &headers, order).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.body, first.body);

    let out = ok(cmd(&["evict", "order-1", "--scope", &caller]));
    assert_eq!(
        out,
        format!("evicted key \"order-1\" in scope \"{caller}\"\n")
    );
    exits(1, cmd(&["inspect", "order-1", "--scope", &caller]));
    exits(1, cmd(&["evict", "order-1", "--scope", &caller]));
    let stats = ok_json(cmd(&["stats", "--scope", &caller, "--json"]));
    assert_eq!(stats["succeeded"], 0, "{stats}");

    let again = call(&client, "POST", &payments, &headers, order).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.headers.contains_key("idempotent-replayed"));
    assert_ne!(
        again.json()["id"],
        payment_id.as_str(),
        "the key did not run again"
    );
    assert_eq!(list(&client, &served, &auth).await["count"], 2);
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

/// `idem serve` killed with `kill -9` after the payment's transaction committed and before
/// the response was written (`x-demo-delay-after-commit-ms` holds it in that window): after
/// a restart, the retry replays the committed payment, and PostgreSQL holds one row.
async fn a_crash_after_the_commit_loses_nothing(store: &str, database: &str) {
    let pool = sqlx::PgPool::connect(database).await.unwrap();
    let client = client();
    let (owner, auth) = payer("crash");
    let order = r#"{"amount": 1250, "currency": "EUR"}"#;
    let mut served = serve(store, &[]);

    let hold_after_commit = ("x-demo-delay-after-commit-ms", "30000");
    let first = pay_in_background(&client, &served, &auth, hold_after_commit, order);
    let committed = || async { (payment_rows(&pool, &owner).await > 0).then_some(()) };
    eventually("the payment committed", secs(20), ms(20), committed).await;
    // The payment is committed and its response not yet written: kill -9.
    served.stop();
    assert!(first.await.unwrap().is_err(), "the killed server answered");

    let served = serve(store, &[]);
    // On the tiered store the killed process's Redis lease answers 409 until the relay
    // copies the committed completion into Redis (as the README says): retry as a client
    // would, after Retry-After. PostgreSQL alone replays at once.
    let retry = retry_while(409, || pay(&client, &served, &auth, "order-1", order)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(
        payment_rows(&pool, &owner).await,
        1,
        "the payment was made twice"
    );
    let listed = list(&client, &served, &auth).await;
    assert_eq!(listed["count"], 1);
    assert_eq!(listed["payments"][0]["id"], retry.json()["id"]);
}

/// `idem serve --lease 2` killed with `kill -9` while a handler runs, before anything was
/// committed: after a restart, the retry is refused while the dead server's lease lasts and
/// takes the key over within seconds of its end (not the default 30 s lease), and the
/// payment is made once.
async fn a_crash_mid_handler_frees_the_key_after_the_lease(store: &str, database: &str) {
    let pool = sqlx::PgPool::connect(database).await.unwrap();
    let client = client();
    let (owner, auth) = payer("lease");
    let order = r#"{"amount": 700, "currency": "EUR"}"#;
    let mut served = serve(store, &["--lease", "2"]);
    let first = pay_in_background(&client, &served, &auth, ("x-demo-delay-ms", "30000"), order);
    // Let the first request take the key, then kill -9 the server mid-handler.
    tokio::time::sleep(Duration::from_millis(500)).await;
    served.stop();
    let killed = Instant::now();
    assert!(first.await.unwrap().is_err(), "the killed server answered");

    let served = serve(store, &["--lease", "2"]);
    let mut refused = 0;
    let retry = loop {
        let reply = pay(&client, &served, &auth, "order-1", order).await;
        if reply.status != StatusCode::CONFLICT {
            break reply;
        }
        refused += 1;
        assert!(
            killed.elapsed() < Duration::from_secs(8),
            "the key is still held {:?} after the crash: --lease was not applied",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(retry.headers.get("idempotent-replayed").is_none());
    assert!(refused > 0, "the dead server's lease was not honoured");
    assert_eq!(payment_rows(&pool, &owner).await, 1);
}

/// `idem serve --retention 1 --purge-every 1`: the payment's completed record is deleted
/// from PostgreSQL in the background once it expires, so the demo does not grow forever.
async fn serve_purges_expired_records(store: &str, database: &str) {
    let pool = sqlx::PgPool::connect(database).await.unwrap();
    let client = client();
    let (owner, auth) = payer("purge");
    let served = serve(store, &["--retention", "1", "--purge-every", "1"]);
    let order = r#"{"amount": 100, "currency": "EUR"}"#;
    let made = pay(&client, &served, &auth, "order-1", order).await;
    assert_eq!(made.status, StatusCode::CREATED, "{:?}", made.body);
    let records = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem.records WHERE scope = $1")
            .bind(owner.as_bytes())
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(records().await, 1, "the completed record was not stored");
    let purged = || async { (records().await == 0).then_some(()) };
    eventually("the expired record purged", secs(15), ms(200), purged).await;
    // The payment itself stays: only idempotency records expire.
    assert_eq!(payment_rows(&pool, &owner).await, 1);
}

/// Two `idem serve` processes on one database: 40 identical requests split across them
/// make one payment, and both list the same one.
async fn a_race_across_two_processes_runs_once(store: &str, database: &str) {
    let pool = sqlx::PgPool::connect(database).await.unwrap();
    let client = client();
    let servers = [serve(store, &[]), serve(store, &[])];
    let (owner, auth) = payer("race");

    let mut created = Vec::new();
    for reply in race(&client, &[&servers[0], &servers[1]], &auth, "race-40", 40).await {
        match reply.status {
            StatusCode::CREATED => created.push(reply.json()["id"].clone()),
            StatusCode::CONFLICT => assert_eq!(reply.headers["retry-after"], "1"),
            other => panic!("unexpected {other}: {:?}", reply.body),
        }
    }
    assert!(!created.is_empty());
    assert!(created.iter().all(|id| *id == created[0]), "{created:?}");
    assert_eq!(
        payment_rows(&pool, &owner).await,
        1,
        "the race paid more than once"
    );
    for server in &servers {
        let listed = list(&client, server, &auth).await;
        assert_eq!(listed["count"], 1);
        assert_eq!(listed["payments"][0]["id"], created[0]);
    }
}

/// A backend module's test `serve_inspect_stats_evict`: [`operator_commands_over`] on the
/// store `$open` gives, with what keeps its servers up, when it gives one.
macro_rules! serve_inspect_stats_evict {
    ($open:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn serve_inspect_stats_evict() {
            if let Some((url, _servers)) = $open {
                super::operator_commands_over(&url).await;
            }
        }
    };
}

mod redis {
    //! Against `IDEM_TEST_REDIS_URL`.

    serve_inspect_stats_evict!(idem_testkit::harness::redis_url().map(|url| (url, ())));
}

mod postgres {
    //! Against `IDEM_TEST_DATABASE_URL` (idem's tables in schema `idem` there).

    serve_inspect_stats_evict!(idem_testkit::harness::database_url().map(|url| (url, ())));

    /// One test per case of the parent module, each run with `IDEM_TEST_DATABASE_URL` as
    /// both the store and the database the case reads; without one, the harness has said
    /// why (or failed the run, when backends are required).
    macro_rules! on_database {
        ($($case:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                if let Some(url) = idem_testkit::harness::database_url() {
                    super::$case(&url, &url).await;
                }
            }
        )*};
    }

    on_database!(
        a_crash_after_the_commit_loses_nothing,
        serve_purges_expired_records,
        a_crash_mid_handler_frees_the_key_after_the_lease,
        a_race_across_two_processes_runs_once,
    );
}

mod redis_cluster {
    //! Against a 3-primary Redis Cluster this test starts (`redis-server` and `redis-cli`
    //! from `PATH`), through a `redis+cluster://` URL.

    use idem_testkit::redis::{self as testing, RedisCluster};

    serve_inspect_stats_evict!(match testing::available() {
        false => None,
        true => {
            let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3)).await;
            let cluster = cluster.unwrap().expect("start a 3-primary cluster");
            Some((cluster.url(), cluster))
        }
    });
}

/// `IDEM_TEST_REDIS_URL` and `IDEM_TEST_DATABASE_URL`, when both are set.
fn both_urls() -> Option<(String, String)> {
    Some((
        idem_testkit::harness::redis_url()?,
        idem_testkit::harness::database_url()?,
    ))
}

mod tiered {
    //! The tiered store: `tiered:<IDEM_TEST_REDIS_URL>|<IDEM_TEST_DATABASE_URL>`.

    serve_inspect_stats_evict!(super::both_urls().map(|(r, p)| (format!("tiered:{r}|{p}"), ())));

    /// `idem serve` on the tiered store while its Redis is down: it starts, says so, takes
    /// payments on PostgreSQL alone, and says when Redis answers again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_starts_while_redis_is_down() {
        let Some(postgres) = idem_testkit::harness::database_url() else {
            return;
        };
        let Some(mut redis) = idem_testkit::redis::throwaway(&[]) else {
            return;
        };
        redis.stop();
        let store = format!("tiered:{}|{postgres}", redis.url());
        let mut served = super::serve(&store, &[]);
        let client = super::client();
        let (_, auth) = super::payer("down");
        let order = r#"{"amount": 300, "currency": "EUR"}"#;
        let pay = |key| super::pay(&client, &served, &auth, key, order);
        for replayed in [false, true] {
            let paid = pay("order-1").await;
            assert_eq!(paid.status, 201, "{:?}", paid.body);
            assert_eq!(paid.replayed(), replayed);
        }

        redis.start_again().expect("restart redis-server");
        // The server notices within its one-second probe.
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        let second = pay("order-2").await;
        assert_eq!(second.status, 201, "{:?}", second.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 2);

        let log = served.stop();
        assert!(log.contains("Redis unreachable at start"), "{log}");
        assert!(log.contains("Redis reachable"), "{log}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crash_after_the_commit_loses_nothing() {
        let Some((redis, postgres)) = super::both_urls() else {
            return;
        };
        let store = format!("tiered:{redis}|{postgres}");
        // The relay, as it runs next to the services, copies committed completions into
        // Redis, where the killed process left its lease.
        let mut relay = super::idem(&["relay", "run", "--store", &store]);
        relay.args(["--metrics-listen", "127.0.0.1:0"]);
        let _relay = super::Proc::spawn(relay, "metrics on http://");
        super::a_crash_after_the_commit_loses_nothing(&store, &postgres).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_race_across_two_processes_runs_once() {
        let Some((redis, postgres)) = super::both_urls() else {
            return;
        };
        let store = format!("tiered:{redis}|{postgres}");
        super::a_race_across_two_processes_runs_once(&store, &postgres).await;
    }
}

mod tls {
    //! The tiered store over TLS with certificate verification on: a `redis-server` with a
    //! `--tls-port` and a PostgreSQL with `ssl=on` that this test starts, with certificates
    //! it makes, reached through `rediss://...?tls_ca_file=` and
    //! `postgres://...?sslmode=verify-full&sslrootcert=`.

    serve_inspect_stats_evict!(super::support::TlsServers::start().map(|servers| {
        let ca = servers.pki.path("ca.pem");
        (servers.tiered_url(&ca, &ca), servers)
    }));
}

/// Records written through the library, as an application would.
mod records {
    use std::time::Duration;

    use idem_core::{
        Begin, Config, Fingerprint, Idem, Key, Lease, RecordId, Response, Scope, Store,
    };

    pub fn id(scope: &str, key: &str) -> RecordId {
        RecordId::new(Scope::new(scope).unwrap(), Key::new(key).unwrap())
    }

    /// A fresh lease on `id` through an engine with `config`.
    async fn acquired(store: impl Store + 'static, config: Config, id: &RecordId) -> (Idem, Lease) {
        let idem = Idem::new(store).with_config(config);
        let Begin::Acquired(lease) = idem.begin(id, Fingerprint::of_bytes(b"r")).await.unwrap()
        else {
            panic!("fresh key")
        };
        (idem, lease)
    }

    /// A completed record (201).
    pub async fn completed(store: impl Store + 'static, id: &RecordId) {
        let (idem, lease) = acquired(store, Config::default(), id).await;
        idem.complete(&lease, Response::new(201, "paid"))
            .await
            .unwrap();
    }

    /// An in-progress record whose 1 ms lease is left to expire: the worker "died".
    pub async fn abandoned(store: impl Store + 'static, id: &RecordId) {
        let config = Config::default()
            .with_lease(Duration::from_millis(1))
            .with_retention(Duration::from_secs(600));
        // Nothing releases or completes it: the lease runs out, as when a worker dies.
        let _ = acquired(store, config, id).await;
    }

    /// A completed record kept 1 ms: expired at once.
    pub async fn expired(store: impl Store + 'static, id: &RecordId) {
        let config = Config::default().with_retention(Duration::from_millis(1));
        let (idem, lease) = acquired(store, config, id).await;
        idem.complete(&lease, Response::new(201, "paid"))
            .await
            .unwrap();
    }
}

mod redis_persistence {
    //! `idem serve` on throwaway `redis-server`s, one persisting nothing and one with an
    //! append-only file: only the first is warned about at start, and not when it is the
    //! Redis of a tiered store.

    use idem_testkit::redis::{self as testing, RedisServer};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_warns_when_redis_persists_nothing() {
        let Some(bare) = testing::throwaway(&[]) else {
            return;
        };
        let aof = RedisServer::start_with(&["--appendonly", "yes"]).expect("start redis-server");
        let mut stores = vec![(bare.url(), true), (aof.url(), false)];
        // The tiered store's Redis needs no persistence (PostgreSQL is the arbiter): no
        // warning, which would tell its user to use the store they already use.
        if let Some(postgres) = idem_testkit::harness::database_url() {
            stores.push((format!("tiered:{}|{postgres}", bare.url()), false));
        }
        let client = super::client();
        for (store, warned) in stores {
            let mut served = super::serve(&store, &[]);
            // One payment, so that every store has been used (a store may check its server
            // on first use rather than at start).
            let (_, auth) = super::payer("persist");
            let order = r#"{"amount": 1, "currency": "EUR"}"#;
            let paid = super::pay(&client, &served, &auth, "k", order).await;
            assert_eq!(paid.status, 201, "{store}");
            let log = served.stop();
            assert_eq!(
                log.contains("REDIS PERSISTS NOTHING"),
                warned,
                "{store}: {log}"
            );
        }
        // An operator's command starts no store: reading a record is no moment to warn.
        let err = super::exits(0, super::run(&["stats", "--store", &bare.url()]));
        assert!(!err.contains("REDIS PERSISTS NOTHING"), "{err}");
    }
}

mod memory {
    //! `idem serve` on the memory store: what the demo stores under a key.

    /// Refusals that are not final for the request are not stored: a bad demo header (not
    /// part of the fingerprint) and a method the path does not take; the 405 is
    /// problem+json like every other refusal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_demo_stores_only_what_is_final_for_the_request() {
        let served = super::serve("memory", &[]);
        let client = super::client();
        let (_, auth) = super::payer("final");
        let url = format!("{}/payments", served.printed);
        let order = r#"{"amount": 300, "currency": "EUR"}"#;

        let bad = super::payment(&auth, "order-1", &[("x-demo-delay-ms", "soon")]);
        let refused = super::call(&client, "POST", &url, &bad, order).await;
        assert_eq!(refused.status, 400, "{:?}", refused.body);
        assert_eq!(refused.headers["content-type"], "application/problem+json");
        // The header fixed: the payment runs, rather than the 400 being replayed.
        let paid = super::pay(&client, &served, &auth, "order-1", order).await;
        assert_eq!(paid.status, 201, "{:?}", paid.body);
        assert!(!paid.replayed());

        let one = format!("{url}/pay_0000000000000000");
        let patch = super::payment(&auth, "order-2", &[]);
        let not_allowed = super::call(&client, "PATCH", &one, &patch, order).await;
        assert_eq!(not_allowed.status, 405);
        let problem = Some("application/problem+json");
        assert_eq!(not_allowed.header("content-type"), problem);
        assert!(not_allowed.headers.contains_key("allow"));
        assert_eq!(not_allowed.json()["status"], 405);
        // The same key on the right route runs: no 405 was stored under it (that would
        // answer 422, another request under the same key).
        let paid = super::call(&client, "POST", &url, &patch, order).await;
        assert_eq!(paid.status, 201, "{:?}", paid.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 2);
    }
}

mod redis_password {
    //! A Redis that refuses the password: that refusal is the one thing said.

    use idem_testkit::redis as testing;

    #[test]
    fn a_wrong_password_is_said_without_a_maxmemory_warning_first() {
        let Some(server) = testing::throwaway(&[]) else {
            return;
        };
        // The password set once the server is up (its readiness check needs none).
        let set = server.cli(&["CONFIG", "SET", "requirepass", "right"]);
        assert_eq!(set.expect("redis-cli").trim(), "OK", "set a password");
        let url = server.url().replacen("redis://", "redis://:wrong@", 1);
        let err = super::exits(3, super::run(&["stats", "--store", &url]));
        assert!(!err.contains("maxmemory"), "{err}");
        assert!(err.to_lowercase().contains("pass"), "{err}");
        assert!(!err.contains(":wrong@"), "{err}");
    }
}

mod redis_outage {
    //! `idem serve` on a plain Redis store started while that Redis is stopped: it starts,
    //! answers 503 (fail closed: no payment runs unguarded), says so in one log line, and
    //! takes payments as soon as Redis answers.

    use idem_testkit::redis as testing;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_starts_while_redis_is_down_and_answers_503_until_it_returns() {
        let Some(mut redis) = testing::throwaway(&[]) else {
            return;
        };
        redis.stop();
        let mut served = super::serve(&redis.url(), &[]);
        let client = super::client();
        let (_, auth) = super::payer("outage");
        let order = r#"{"amount": 300, "currency": "EUR"}"#;
        let pay = || super::pay(&client, &served, &auth, "order-1", order);
        let refused = pay().await;
        assert_eq!(refused.status, 503, "{:?}", refused.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 0);
        // Alive, and not ready while its store does not answer.
        let get = |path: &str| {
            let url = format!("{}{path}", served.printed);
            let client = client.clone();
            async move { super::call(&client, "GET", &url, &[], "").await }
        };
        assert_eq!(get("/livez").await.status, 200);
        let not_ready = get("/readyz").await;
        assert_eq!(not_ready.status, 503, "{not_ready:?}");
        assert_eq!(
            not_ready.problem_type(),
            "urn:idem:problem:store-unavailable"
        );

        redis.start_again().expect("restart redis-server");
        // The store reconnects on its next call; allow it a few tries.
        let paid = super::retry_while(503, pay).await;
        assert_eq!(paid.status, 201, "{:?}", paid.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 1);
        let ready = get("/readyz").await;
        assert_eq!(ready.status, 200, "{ready:?}");

        let log = served.stop();
        assert_eq!(
            log.matches("Redis unreachable at start").count(),
            1,
            "{log}"
        );
    }
}

mod redis_keyspace {
    //! `idem stats` on a throwaway `redis-server` holding 2 million keys (made with `DEBUG
    //! POPULATE`), never on the shared server.

    use std::time::Instant;

    use idem_redis::RedisStore;
    use idem_testkit::redis as testing;

    use super::{assert_fields, json, records};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stats_reads_two_million_keys_page_by_page_and_stops_at_its_timeout() {
        let Some(server) = testing::throwaway(&["--enable-debug-command", "yes"]) else {
            return;
        };
        // 1.8 million keys of another application, and 200,000 under idem's prefix whose
        // names are not records' (DEBUG POPULATE names them `<prefix>:<n>`).
        server
            .cli(&["DEBUG", "POPULATE", "1800000", "other"])
            .unwrap();
        server
            .cli(&["DEBUG", "POPULATE", "200000", "idem:{00000000}x"])
            .unwrap();
        let store = RedisStore::connect(server.url()).await.unwrap();
        records::completed(store.clone(), &records::id("alice", "a")).await;
        records::completed(store.clone(), &records::id("bob", "b")).await;
        records::abandoned(store.clone(), &records::id("carol", "c")).await;
        assert_eq!(server.cli(&["DBSIZE"]).unwrap().trim(), "2000003");
        let url = server.url();

        let started = Instant::now();
        let stats = super::run_on(["--store", &url]);
        let (code, out, err) =
            stats(&["stats", "--stuck-after", "0", "--timeout", "600", "--json"]);
        let took = started.elapsed();
        assert_eq!(code, 0, "{err}");
        let doc = super::json(&out);
        assert_fields(
            &doc,
            json!({"succeeded": 2, "expired_leases": 1, "stuck": 1, "corrupt": 0}),
        );
        assert_fields(
            &doc,
            json!({"complete": true, "foreign": 200_000, "keys_read": 200_003}),
        );
        // Standard error is not a terminal here: no progress lines.
        assert!(!err.contains("keys read"), "{err}");
        eprintln!("idem stats over 2,000,003 keys: {took:?}");

        // A limit far below what the walk takes: the counts so far, marked, exit 4.
        let (code, out, err) = stats(&["stats", "--timeout", "0.2", "--json"]);
        assert_eq!(code, 4, "{err}");
        let doc = super::json(&out);
        assert_eq!(doc["complete"], false, "{doc}");
        let stopped = json!({"reason": "timeout", "timeout_ms": 200});
        assert_fields(&doc["stopped"], stopped);
        assert!(doc["keys_read"].as_u64().unwrap() < 200_003, "{doc}");
        let (code, text, _) = stats(&["stats", "--timeout", "0.2"]);
        assert_eq!(code, 4);
        assert!(text.starts_with("PARTIAL"), "{text}");
        assert!(text.contains("lower bound"), "{text}");

        // On a terminal (util-linux `script` gives the command one), progress on stderr.
        let script = std::process::Command::new("script")
            .args(["-qec"])
            .arg(format!(
                "{} stats --store {url} --timeout 1.5 --json",
                super::BIN
            ))
            .arg("/dev/null")
            .env("RUST_LOG", "error")
            .output();
        match script {
            Ok(out) if out.status.code() == Some(4) => {
                let tty = String::from_utf8_lossy(&out.stdout);
                assert!(tty.contains("\ridem stats: "), "{tty:?}");
                assert!(tty.contains("keys read, primary 1 of 1 about "), "{tty:?}");
            }
            other => {
                eprintln!("no `script` to give idem a terminal; progress not checked: {other:?}")
            }
        }
    }
}

mod redis_broken {
    //! Corrupt and foreign records under a unique prefix on `IDEM_TEST_REDIS_URL`:
    //! `stats` counts them, `stuck` lists them, `inspect` says what is wrong.

    use idem_redis::RedisStore;
    use redis::AsyncCommands as _;

    use super::{assert_fields, json, records};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stats_stuck_and_inspect_name_broken_records() {
        let Some(url) = idem_testkit::harness::redis_url() else {
            return;
        };
        let prefix = format!("ops-{}:", uuid::Uuid::new_v4().simple());
        let store = RedisStore::builder(url.as_str())
            .with_prefix(prefix.clone())
            .connect()
            .await
            .unwrap();
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut raw = client.get_multiplexed_async_connection().await.unwrap();

        records::completed(store.clone(), &records::id("s", "good")).await;
        records::abandoned(store.clone(), &records::id("s", "gone")).await;
        let good: Vec<u8> = raw
            .get(store.record_key(&records::id("s", "good")))
            .await
            .unwrap();
        // Five kinds of corrupt values, each under a real record's key.
        let mut lz4 = good.clone();
        lz4[0] = b'z';
        let mut meta_past_end = good[..37].to_vec();
        meta_past_end.extend_from_slice(&1000u32.to_be_bytes());
        let corrupt: [(&str, Vec<u8>); 5] = [
            ("tag", b"value:1".to_vec()),
            ("empty", Vec::new()),
            ("short", b"p0123456789".to_vec()),
            ("meta", meta_past_end),
            ("lz4", lz4),
        ];
        let mut writes = redis::pipe();
        for (key, value) in &corrupt {
            writes.set(store.record_key(&records::id("s", key)), value);
        }
        // Three foreign keys: a hash and a list at records' keys, a string whose name is
        // not a record's.
        writes
            .hset(store.record_key(&records::id("s", "hash")), "f", "v")
            .rpush(store.record_key(&records::id("s", "list")), "v")
            .set(format!("{prefix}{{00000000}}odd"), "v");
        let _: () = writes.query_async(&mut raw).await.unwrap();
        let cmd = super::run_on(["--store", &url, "--prefix", &prefix]);

        let doc = super::ok_json(cmd(&["stats", "--stuck-after", "0", "--json"]));
        let counts = json!({"succeeded": 1, "stuck": 1, "corrupt": 5, "foreign": 3});
        assert_fields(&doc, counts);
        assert_eq!(doc["keys_read"], 10, "{doc}");
        let (_, text, _) = cmd(&["stats"]);
        assert!(text.contains("corrupt         5"), "{text}");
        assert!(text.contains("ALARM"), "{text}");

        let doc = super::ok_json(cmd(&["stuck", "--stuck-after", "0", "--json"]));
        let rows = doc["records"].as_array().unwrap();
        let of = |problem: &str| -> Vec<&serde_json::Value> {
            rows.iter().filter(|r| r["problem"] == problem).collect()
        };
        assert_eq!(of("stuck").len(), 1, "{doc}");
        assert_eq!(of("stuck")[0]["key"], "gone");
        assert_eq!(of("stuck")[0]["attempt"], 1);
        let mut corrupt_keys: Vec<&str> = of("corrupt")
            .iter()
            .map(|r| r["key"].as_str().unwrap())
            .collect();
        corrupt_keys.sort_unstable();
        assert_eq!(
            corrupt_keys,
            ["empty", "lz4", "meta", "short", "tag"],
            "{doc}"
        );
        assert_eq!(of("foreign").len(), 3, "{doc}");
        let (_, text, _) = cmd(&["stuck", "--stuck-after", "0"]);
        assert!(
            text.contains("stuck    key \"gone\" in scope \"s\""),
            "{text}"
        );
        assert!(text.contains("idem evict"), "{text}");

        // `inspect` names what is wrong, and how to clear it.
        let err = super::exits(4, cmd(&["inspect", "tag", "--scope", "s"]));
        assert!(err.contains("unknown record tag 'v'"), "{err}");
        assert!(err.contains("idem evict tag --scope s"), "{err}");
        let err = super::exits(4, cmd(&["inspect", "hash", "--scope", "s"]));
        assert!(err.contains("another type"), "{err}");
        let err = super::exits(4, cmd(&["inspect", "meta", "--scope", "s", "--json"]));
        let want = json!({"kind": "corrupt", "exit_code": 4});
        assert_fields(&super::json(&err)["error"], want);

        // Evicted, the key is no longer counted.
        super::exits(0, cmd(&["evict", "tag", "--scope", "s"]));
        let (_, out, _) = cmd(&["stats", "--json"]);
        assert_eq!(super::json(&out)["corrupt"], 4);

        // Another prefix sees none of it.
        let (_, out, _) =
            super::run(&["stats", "--json", "--store", &url, "--prefix", "ops-none:"]);
        assert_eq!(super::json(&out)["keys_read"], 0);
        let keys: Vec<String> = raw.keys(format!("{prefix}*")).await.unwrap();
        for key in keys {
            let _: () = raw.del(key).await.unwrap();
        }
    }
}

mod postgres_schema {
    //! Operator commands on `IDEM_TEST_DATABASE_URL` in a schema of their own: only
    //! `migrate` changes it.

    use idemkit::postgres::PgStore;

    use super::{assert_fields, json, records};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_migrate_changes_the_schema_and_stuck_purge_work() {
        let Some(url) = idem_testkit::harness::database_url() else {
            return;
        };
        let schema = idem_testkit::harness::unique_name("idem_ops_");
        let cmd = super::run_on(["--store", &url, "--schema", &schema]);
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let exists = || super::support::schema_exists(&url, &schema);

        for args in [
            &["stats"][..],
            &["stuck"],
            &["inspect", "k"],
            &["evict", "k"],
            &["purge"],
            &["serve", "--listen", "127.0.0.1:0"],
        ] {
            let (code, _, err) = cmd(args);
            assert_eq!(code, 3, "{args:?}: {err}");
            assert!(err.contains("has no idem tables in schema"), "{err}");
            assert!(
                err.contains(&format!(
                    "run `idem migrate --store <url> --schema {schema}`"
                )),
                "{err}"
            );
            // The binary's flag is named, not only the library's setting.
            assert!(err.contains("`--migrate` on `idem serve`"), "{err}");
        }
        assert!(
            !exists().await,
            "a read-only command (or serve without --migrate) created the schema"
        );

        let doc = super::ok_json(cmd(&["migrate", "--json"]));
        assert_eq!(doc["applied"], serde_json::json!([1, 3]));
        assert!(exists().await);
        let out = super::ok(cmd(&["migrate"]));
        assert!(out.contains("up to date"), "{out}");
        super::exits(1, cmd(&["inspect", "k"]));

        let store = PgStore::connect(&url)
            .await
            .unwrap()
            .with_schema(&schema)
            .unwrap();
        records::abandoned(store.clone(), &records::id("s", "gone")).await;
        records::completed(store.clone(), &records::id("s", "done")).await;
        records::expired(store.clone(), &records::id("s", "old")).await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;

        let doc = super::ok_json(cmd(&["stuck", "--stuck-after", "0", "--json"]));
        let rows = doc["records"].as_array().unwrap();
        assert_eq!(rows.len(), 1, "{doc}");
        assert_fields(
            &rows[0],
            json!({"key": "gone", "scope": "s", "problem": "stuck"}),
        );
        // A completed record whose metadata names an unknown completion kind.
        records::completed(store.clone(), &records::id("s", "bad")).await;
        sqlx::query(&format!(
            "UPDATE {}.records SET meta = set_byte(meta, 1, 9) WHERE key = 'bad'",
            store.quoted_schema()
        ))
        .execute(&pool)
        .await
        .unwrap();
        let doc = super::ok_json(cmd(&["stats", "--stuck-after", "0", "--json"]));
        let counts = json!({"stuck": 1, "succeeded": 1, "corrupt": 1, "foreign": null});
        assert_fields(&doc, counts);
        let err = super::exits(4, cmd(&["inspect", "bad", "--scope", "s"]));
        assert!(err.contains("unknown completion kind"), "{err}");
        let doc = super::ok_json(cmd(&["stuck", "--stuck-after", "0", "--json"]));
        let problems: Vec<(&str, &str)> = doc["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["key"].as_str().unwrap(), r["problem"].as_str().unwrap()))
            .collect();
        assert_eq!(problems, [("gone", "stuck"), ("bad", "corrupt")], "{doc}");

        assert_eq!(super::ok_json(cmd(&["purge", "--json"]))["purged"], 1);
        let (_, out, _) = cmd(&["purge"]);
        assert!(out.contains("purged 0 expired records"), "{out}");

        idem_testkit::postgres::drop_schema(&store).await;
    }
}

mod errors {
    //! Errors that name the cause and the fix; `--json` errors as JSON.

    use super::{assert_fields, json};

    #[test]
    fn wrong_ports_and_schemes_say_what_to_do() {
        let Some((redis, postgres)) = super::both_urls() else {
            return;
        };
        let port = |url: &str| {
            let after_colon = url.rsplit(':').next().unwrap();
            after_colon.split('/').next().unwrap().to_owned()
        };
        let (redis_port, pg_port) = (port(&redis), port(&postgres));

        let closed = idem_testkit::harness::refused_port();
        for url in [
            format!("postgres://postgres@127.0.0.1:{closed}/test"),
            format!("redis://127.0.0.1:{closed}"),
        ] {
            let err = super::exits(3, super::run(&["stats", "--store", &url, "--json"]));
            let doc = super::json(&err);
            assert_fields(&doc["error"], json!({"kind": "open", "exit_code": 3}));
            let message = doc["error"]["message"].as_str().unwrap();
            assert!(message.contains("connection refused"), "{message}");
            assert!(message.contains("start the server"), "{message}");
        }

        // Another server at the port, or one that accepts connections and never answers (a
        // timeout, said as such).
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in silent.incoming().flatten() {
                held.push(stream);
            }
        });
        let timed_out = "answered nothing in time (timed out)";
        for (url, says) in [
            (
                format!("redis://127.0.0.1:{pg_port}"),
                "speaks PostgreSQL and this URL expects Redis: use postgres://",
            ),
            (
                format!("postgres://postgres@127.0.0.1:{redis_port}/test"),
                "speaks Redis and this URL expects PostgreSQL",
            ),
            (format!("redis://127.0.0.1:{silent_port}"), timed_out),
            (
                format!("postgres://postgres@127.0.0.1:{silent_port}/test"),
                timed_out,
            ),
        ] {
            let err = super::exits(3, super::run(&["stats", "--store", &url]));
            assert!(err.contains(says), "{url}: {err}");
        }

        // Usage errors are JSON too with --json, and exit 2.
        let (code, out, err) = super::run(&["stats", "--timeout", "soon", "--json"]);
        assert_eq!((code, out.as_str()), (2, ""), "{err}");
        let doc = super::json(&err);
        assert_eq!(doc["error"]["kind"], "usage");
        let message = doc["error"]["message"].as_str().unwrap();
        assert!(message.contains("--timeout"), "{doc}");
        let (code, _, err) = super::run(&["inspect", "k", "--json"]);
        assert_eq!(code, 2);
        assert_eq!(super::json(&err)["error"]["kind"], "unsupported");
    }

    /// `idem serve` starts while nothing answers at its Redis (it waits, answering 503), but
    /// refuses to start, as `idem stats` does, when another server answers there: a
    /// PostgreSQL port will never become a Redis.
    #[test]
    fn serve_refuses_a_redis_url_at_a_postgresql_port() {
        let Some(postgres) = idem_testkit::harness::database_url() else {
            return;
        };
        let pg_port = postgres
            .rsplit(':')
            .next()
            .unwrap()
            .split('/')
            .next()
            .unwrap();
        let redis = format!("redis://127.0.0.1:{pg_port}");
        for store in [redis.clone(), format!("tiered:{redis}|{postgres}")] {
            let serve = ["serve", "--listen", "127.0.0.1:0", "--store", &store];
            let err = super::exits(3, super::run(&[&serve[..], &["--migrate"]].concat()));
            assert!(
                err.contains("speaks PostgreSQL and this URL expects Redis: use postgres://"),
                "{store}: {err}"
            );
            assert!(!err.contains("unreachable at start"), "{store}: {err}");
        }
    }

    /// A fake AMQP broker on a free port: it answers any greeting with AMQP's protocol
    /// header, as RabbitMQ does.
    fn fake_amqp() -> u16 {
        fake_server(b"AMQP\x00\x00\x09\x01")
    }

    /// A server on a free port that answers any greeting with `reply` and closes.
    fn fake_server(reply: &'static [u8]) -> u16 {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                let mut greeting = [0; 64];
                let _ = stream.read(&mut greeting);
                let _ = stream.write_all(reply);
            }
        });
        port
    }

    #[test]
    fn a_new_users_mistakes_are_named_with_their_fix() {
        // A host name in --listen is resolved (the store error comes next, not --listen's).
        let serve = ["serve", "--listen", "localhost:0", "--store", "x:"];
        let err = super::exits(2, super::run(&serve));
        assert!(!err.contains("--listen"), "{err}");

        // A PostgreSQL URL at a broker's port.
        let amqp = fake_amqp();
        let url = format!("postgres://postgres@127.0.0.1:{amqp}/test");
        let err = super::exits(3, super::run(&["stats", "--store", &url]));
        assert!(
            err.contains("speaks AMQP (RabbitMQ) and this URL expects PostgreSQL"),
            "{err}"
        );
        // A Redis URL there: the explanation alone, with no driver's parse error first.
        let url = format!("redis://127.0.0.1:{amqp}");
        for command in ["stats", "serve"] {
            let err = super::exits(3, super::run(&[command, "--store", &url]));
            assert!(
                err.contains("speaks AMQP (RabbitMQ) and this URL expects Redis"),
                "{command}: {err}"
            );
            assert!(
                !err.contains("Unexpected") && !err.contains("WARN"),
                "{err}"
            );
        }
        // A web server that answers a request without a version with a bare HTML page, as
        // Python's `http.server` does.
        let web = fake_server(b"<!DOCTYPE HTML>\n<html><body>Bad request</body></html>\n");
        let url = format!("redis://127.0.0.1:{web}");
        let err = super::exits(3, super::run(&["stats", "--store", &url]));
        assert!(
            err.contains("speaks HTTP and this URL expects Redis: that is a web server"),
            "{err}"
        );

        let Some(redis) = idem_testkit::harness::redis_url() else {
            return;
        };
        // The demo keys records by caller: a key looked up in the global scope says so.
        let err = super::exits(1, super::run(&["inspect", "order-1", "--store", &redis]));
        assert!(err.contains("--scope alice"), "{err}");

        // TLS asked of a plain-text Redis.
        let plain = redis.replacen("redis://", "rediss://", 1);
        let err = super::exits(3, super::run(&["stats", "--store", &plain]));
        assert!(err.contains("without TLS"), "{err}");
        assert!(err.contains("use redis://"), "{err}");
    }

    #[test]
    fn the_store_and_its_names_come_from_the_shared_variables() {
        let Some(redis) = idem_testkit::harness::redis_url() else {
            return;
        };
        let prefix = format!("ops-env-{}:", uuid::Uuid::new_v4().simple());
        let env = [("IDEM_STORE", redis.as_str()), ("IDEM_PREFIX", &prefix)];
        let doc = super::ok_json(super::run_with(&["stats", "--json"], &env));
        assert_eq!(doc["keys_read"], 0);
        let (_, help, _) = super::run(&["stats", "--help"]);
        for var in ["IDEM_STORE", "IDEM_PREFIX", "IDEM_SCHEMA"] {
            assert!(help.contains(var), "{help}");
        }
    }
}

mod tiered_evict {
    //! `evict` through a `tiered:` URL, in a schema and prefix of its own.

    use idem_core::Store as _;
    use idemkit::outbox::TieredStore;
    use idemkit::postgres::PgStore;
    use idemkit::redis::RedisStore;
    use redis::AsyncCommands as _;

    use super::{assert_fields, json, records};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn evict_deletes_both_tiers_and_the_outbox_rows() {
        let Some((redis_url, pg_url)) = super::both_urls() else {
            return;
        };
        let schema = idem_testkit::harness::unique_name("idem_ops_");
        let prefix = format!("ops-{}:", uuid::Uuid::new_v4().simple());
        let url = format!("tiered:{redis_url}|{pg_url}");
        let cmd = super::run_on(["--store", &url, "--schema", &schema, "--prefix", &prefix]);
        let doc = super::ok_json(cmd(&["migrate", "--json"]));
        assert_eq!(doc["applied"], serde_json::json!([1, 3, 1001]));

        let pg = PgStore::connect(&pg_url)
            .await
            .unwrap()
            .with_schema(&schema)
            .unwrap();
        let redis = RedisStore::builder(redis_url.as_str())
            .with_prefix(prefix.clone())
            .connect()
            .await
            .unwrap();
        let tiered = TieredStore::new(redis.clone(), pg.clone());
        let id = records::id("s", "paid");
        records::completed(tiered.clone(), &id).await;
        let outbox_rows = || super::support::outbox_rows(&pg, Some("paid"));
        // Completed in both tiers, its outbox row not yet relayed (no relay runs here).
        assert!(redis.get(&id).await.unwrap().is_some());
        assert!(pg.get(&id).await.unwrap().is_some());
        assert_eq!(outbox_rows().await, 1);

        // A corrupt value in the Redis tier: counted and listed, with PostgreSQL's states.
        let client = redis::Client::open(redis_url.as_str()).unwrap();
        let mut raw = client.get_multiplexed_async_connection().await.unwrap();
        let broken = records::id("s", "broken");
        let _: () = raw.set(redis.record_key(&broken), "garbage").await.unwrap();
        let doc = super::ok_json(cmd(&["stats", "--json"]));
        assert_fields(&doc, json!({"succeeded": 1, "corrupt": 1}));
        let doc = super::ok_json(cmd(&["stuck", "--json"]));
        assert_fields(
            &doc["records"][0],
            json!({"key": "broken", "problem": "corrupt"}),
        );
        let _: () = raw.del(redis.record_key(&broken)).await.unwrap();

        let out = super::ok(cmd(&["evict", "paid", "--scope", "s"]));
        assert_eq!(out, "evicted key \"paid\" in scope \"s\"\n");
        assert!(redis.get(&id).await.unwrap().is_none(), "left in Redis");
        assert!(pg.get(&id).await.unwrap().is_none(), "left in PostgreSQL");
        assert_eq!(outbox_rows().await, 0, "outbox rows left for the relay");

        idem_testkit::postgres::drop_schema(&pg).await;
        let _: () = raw.del(redis.record_key(&id)).await.unwrap();
    }
}
