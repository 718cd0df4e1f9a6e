//! A key's life as its client sees it, through `idem proxy` with real processes, on every
//! store: `Prefer: wait=N`, `Prefer: respond-async` and the status monitor (across two
//! proxies, and with the proxy doing the work killed), and tombstones that refuse a key
//! once its retention ended and leave with the purge. The upstream is the Python one of
//! `tests/upstream.py`, which counts the runs of each key.

mod support;

use std::time::Instant;

use hyper::StatusCode;
use idem_testkit::harness::eventually;
use support::{call, client, idem, ms, secs, HttpClient, Proc, Reply};

const ALICE: (&str, &str) = ("authorization", "Bearer alice");
const BOB: (&str, &str) = ("authorization", "Bearer bob");

/// The Python upstream on a free port; its base URL is `Proc::printed`.
fn upstream() -> Proc {
    support::upstream_py(0, "HTTP/1.1")
}

/// The store of one test: its `--store` URL and the flags that give the test a key prefix or
/// schema of its own; `None` (the test returns) when its server is missing and not
/// required. The schema's name, for PostgreSQL, is the third field.
fn store(backend: &str) -> Option<(String, Vec<String>, Option<String>)> {
    let name = idem_testkit::harness::unique_name("idem_life_");
    let redis = || idem_testkit::harness::redis_url();
    let pg = || idem_testkit::harness::database_url();
    Some(match backend {
        "memory" => ("memory".to_owned(), vec![], None),
        "redis" => (redis()?, vec!["--prefix".into(), name], None),
        "postgres" => (pg()?, vec!["--schema".into(), name.clone()], Some(name)),
        _ => (
            format!("tiered:{}|{}", redis()?, pg()?),
            vec![
                "--prefix".into(),
                name.clone(),
                "--schema".into(),
                name.clone(),
            ],
            Some(name),
        ),
    })
}

/// One test's world: the upstream, a client, and the store its proxies share.
struct Life {
    up: Proc,
    client: HttpClient,
    store: String,
    flags: Vec<String>,
    /// The PostgreSQL schema of the test, where it has one.
    schema: Option<String>,
}

impl Life {
    /// On the store `backend` (see [`store`]), the proxies taking `flags` too; `None` (the
    /// test returns) when its server is missing and not required.
    fn on(backend: &str, flags: &[&str]) -> Option<Self> {
        let (store, mut store_flags, schema) = self::store(backend)?;
        store_flags.extend(flags.iter().map(|flag| flag.to_string()));
        Some(Self {
            up: upstream(),
            client: client(),
            store,
            flags: store_flags,
            schema,
        })
    }

    /// `idem proxy` to the upstream on the store; its base URL is `Proc::printed`.
    fn proxy(&self) -> Proc {
        let args = ["proxy", "--listen", "127.0.0.1:0", "--upstream"];
        let mut command = idem(&args);
        command.arg(&self.up.printed);
        command.args(["--store", &self.store, "--migrate"]);
        command.args(&self.flags);
        Proc::listening(command)
    }
}

/// `POST <proxy>/charge` as `who` with `key`, the upstream taking `delay_ms`, and `extra`
/// headers.
async fn charge(
    client: &HttpClient,
    proxy: &Proc,
    who: (&str, &str),
    key: &str,
    delay_ms: u64,
    extra: &[(&str, &str)],
) -> Reply {
    let url = format!("{}/charge", proxy.printed);
    let delay = delay_ms.to_string();
    let mut headers = vec![
        who,
        ("idempotency-key", key),
        ("x-delay-ms", delay.as_str()),
    ];
    headers.extend_from_slice(extra);
    call(client, "POST", &url, &headers, r#"{"amount":100}"#).await
}

/// [`charge`] as alice, in a task of its own: the first request of a key, which a
/// duplicate then meets in flight.
fn in_background(
    client: &HttpClient,
    proxy: &Proc,
    key: &str,
    delay_ms: u64,
) -> tokio::task::JoinHandle<Reply> {
    let (client, url, key) = (client.clone(), proxy.printed.clone(), key.to_owned());
    tokio::spawn(async move {
        let url = format!("{url}/charge");
        let delay = delay_ms.to_string();
        let headers = [
            ALICE,
            ("idempotency-key", key.as_str()),
            ("x-delay-ms", delay.as_str()),
        ];
        call(&client, "POST", &url, &headers, r#"{"amount":100}"#).await
    })
}

/// `GET <proxy><path>` as `who`.
async fn get(client: &HttpClient, proxy: &Proc, who: (&str, &str), path: &str) -> Reply {
    let url = format!("{}{path}", proxy.printed);
    call(client, "GET", &url, &[who], "").await
}

/// How many times `key` ran upstream.
async fn runs(client: &HttpClient, upstream: &Proc, key: &str) -> u64 {
    support::runs(client, &upstream.printed, key).await.0
}

fn fresh(what: &str) -> String {
    format!("{what}-{}", uuid::Uuid::new_v4().simple())
}

/// `Prefer: wait=N`: a duplicate waits up to `min(N, max_wait)` for the first response,
/// and says so in `Preference-Applied`; `wait=0`, or a bound shorter than the work, is
/// answered 409 once it passes.
async fn a_duplicate_waits_as_long_as_it_prefers(backend: &str) {
    let Some(life) = Life::on(backend, &["--max-wait-ms", "2500"]) else {
        return;
    };
    let (up, client, p) = (&life.up, &life.client, life.proxy());

    // wait=2 against a 1 s handler: the stored 201.
    let key = fresh("wait");
    let first = in_background(client, &p, &key, 1000);
    tokio::time::sleep(ms(300)).await;
    let waited = charge(client, &p, ALICE, &key, 1000, &[("prefer", "wait=2")]).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
    assert!(waited.replayed(), "{waited:?}");
    assert_eq!(waited.body, first.body);
    assert_eq!(waited.header("preference-applied"), Some("wait=2"));
    assert_eq!(runs(client, up, &key).await, 1);

    // Against a 5 s handler: wait=0 is answered at once, wait=9 after the bound (2.5 s,
    // said in whole seconds).
    let key = fresh("slow");
    let slow = in_background(client, &p, &key, 5000);
    tokio::time::sleep(ms(300)).await;
    let started = Instant::now();
    let at_once = charge(client, &p, ALICE, &key, 5000, &[("prefer", "wait=0")]).await;
    assert_eq!(at_once.status, StatusCode::CONFLICT, "{at_once:?}");
    assert_eq!(at_once.header("preference-applied"), Some("wait=0"));
    assert!(started.elapsed() < ms(1000), "{:?}", started.elapsed());
    let started = Instant::now();
    let bounded = charge(client, &p, ALICE, &key, 5000, &[("prefer", "wait=9")]).await;
    let waited = started.elapsed();
    assert_eq!(bounded.status, StatusCode::CONFLICT, "{bounded:?}");
    assert_eq!(bounded.header("preference-applied"), Some("wait=2"));
    assert!(waited >= ms(2400) && waited < ms(4500), "{waited:?}");
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(runs(client, up, &key).await, 1);
}

/// `Prefer: respond-async` on two proxies over one store (one, on the memory store): 202
/// at once with the monitor's `Location`; a duplicate through the other proxy gets the same
/// 202 and `Location`; the monitor answers 202 while the work runs, then the stored
/// response, to the same principal only (404 to another); the monitor by key answers
/// alike; the upstream runs once.
async fn respond_async_answers_at_once_and_the_monitor_follows(backend: &str) {
    // A route that makes duplicates wait: one that asked for an answer at once does not.
    let Some(life) = Life::on(backend, &["--wait-ms", "5000"]) else {
        return;
    };
    let (up, client, a) = (&life.up, &life.client, life.proxy());
    let b_proc = (backend != "memory").then(|| life.proxy());
    let b = b_proc.as_ref().unwrap_or(&a);
    let key = fresh("async");
    let prefer = [("prefer", "respond-async")];

    let started = Instant::now();
    let accepted = charge(client, &a, ALICE, &key, 1500, &prefer).await;
    assert!(started.elapsed() < ms(1000), "{:?}", started.elapsed());
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{accepted:?}");
    assert_eq!(accepted.header("preference-applied"), Some("respond-async"));
    let location = accepted.header("location").expect("a Location").to_owned();
    assert!(location.starts_with("/.idem/keys/"), "{location}");
    assert!(
        !location.contains(&key),
        "the opaque id shows the key: {location}"
    );

    let started = Instant::now();
    let duplicate = charge(client, b, ALICE, &key, 1500, &prefer).await;
    assert!(started.elapsed() < ms(1000), "{:?}", started.elapsed());
    assert_eq!(duplicate.status, StatusCode::ACCEPTED, "{duplicate:?}");
    assert_eq!(duplicate.header("location"), Some(location.as_str()));

    let running = get(client, b, ALICE, &location).await;
    assert_eq!(running.status, StatusCode::ACCEPTED, "{running:?}");
    assert!(running.header("retry-after").is_some());
    let stranger = get(client, b, BOB, &location).await;
    assert_eq!(stranger.status, StatusCode::NOT_FOUND, "{stranger:?}");
    assert_eq!(stranger.problem_type(), "urn:idem:problem:not-completed");

    let done = || async {
        let reply = get(client, b, ALICE, &location).await;
        (reply.status != StatusCode::ACCEPTED).then_some(reply)
    };
    let done = eventually("the work to complete", secs(10), ms(100), done).await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert!(done.replayed(), "{done:?}");
    assert_eq!(done.json()["attempt"], "1");
    let by_key = get(client, &a, ALICE, &format!("/.idem/keys/by-key/{key}")).await;
    assert_eq!((by_key.status, &by_key.body), (done.status, &done.body));
    let stranger = get(client, &a, BOB, &format!("/.idem/keys/by-key/{key}")).await;
    assert_eq!(stranger.status, StatusCode::NOT_FOUND, "{stranger:?}");
    // Every guarded answer names the key's monitor.
    let replay = charge(client, b, ALICE, &key, 1500, &[]).await;
    assert_eq!(replay.body, done.body);
    let link = format!("</.idem/keys/by-key/{key}>; rel=\"monitor\"");
    assert_eq!(replay.header("link"), Some(link.as_str()));
    assert_eq!(runs(client, up, &key).await, 1);
}

/// The proxy doing a `respond-async` request's work is killed (`kill -9`): through the
/// other proxy the monitor answers in flight until the dead proxy's lease ends, then that
/// the work did not complete (404), and a retry of the key runs it again.
async fn a_killed_worker_is_in_flight_until_its_lease_ends(backend: &str) {
    let Some(life) = Life::on(backend, &["--lease", "2"]) else {
        return;
    };
    let client = &life.client;
    let (mut a, b) = (life.proxy(), life.proxy());
    let key = fresh("killed");

    let accepted = charge(
        client,
        &a,
        ALICE,
        &key,
        30_000,
        &[("prefer", "respond-async")],
    )
    .await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{accepted:?}");
    let location = accepted.header("location").unwrap().to_owned();
    a.stop();
    let killed = Instant::now();
    let running = get(client, &b, ALICE, &location).await;
    assert_eq!(running.status, StatusCode::ACCEPTED, "{running:?}");
    let abandoned = || async {
        let reply = get(client, &b, ALICE, &location).await;
        (reply.status != StatusCode::ACCEPTED).then_some(reply)
    };
    let abandoned = eventually("the dead lease to end", secs(10), ms(100), abandoned).await;
    assert!(killed.elapsed() >= ms(1000), "{:?}", killed.elapsed());
    assert_eq!(abandoned.status, StatusCode::NOT_FOUND, "{abandoned:?}");
    assert_eq!(abandoned.problem_type(), "urn:idem:problem:not-completed");
    let retry = charge(client, &b, ALICE, &key, 0, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(retry.json()["attempt"], "2");
}

/// `after_retention = "refuse"`: once the stored response is forgotten, the key is refused
/// with 410 (`key-expired`), through the request and the monitor alike, and never runs;
/// another key runs; once the tombstone's time is over (and the purge has run, where a
/// store purges), the key is new again, and no tombstone row is left.
async fn an_expired_key_is_refused_until_its_tombstone_leaves(backend: &str) {
    let lifetime = ["--retention", "2", "--after-retention", "refuse"];
    let tombstones = ["--tombstone-secs", "3", "--purge-every", "1"];
    let Some(life) = Life::on(backend, &[lifetime, tombstones].concat()) else {
        return;
    };
    let (up, client, p) = (&life.up, &life.client, life.proxy());
    let key = fresh("stone");

    let first = charge(client, &p, ALICE, &key, 0, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = charge(client, &p, ALICE, &key, 0, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    let expired = || async {
        let reply = charge(client, &p, ALICE, &key, 0, &[]).await;
        (reply.status != StatusCode::CREATED).then_some(reply)
    };
    let expired = eventually("the retention to end", secs(10), ms(100), expired).await;
    assert_eq!(expired.status, StatusCode::GONE, "{expired:?}");
    assert_eq!(expired.problem_type(), "urn:idem:problem:key-expired");
    let monitor = get(client, &p, ALICE, &format!("/.idem/keys/by-key/{key}")).await;
    assert_eq!(monitor.status, StatusCode::GONE, "{monitor:?}");
    // Another principal's key of the same name was never used: it runs.
    assert_eq!(
        charge(client, &p, BOB, &key, 0, &[]).await.status,
        StatusCode::CREATED
    );
    let other = fresh("other");
    assert_eq!(
        charge(client, &p, ALICE, &other, 0, &[]).await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs(client, up, &key).await, 2, "alice once, bob once");

    let new_again = || async {
        let reply = charge(client, &p, ALICE, &key, 0, &[]).await;
        (reply.status == StatusCode::CREATED).then_some(reply)
    };
    let again = eventually("the tombstone to leave", secs(15), ms(200), new_again).await;
    assert!(!again.replayed(), "{again:?}");
    assert_eq!(runs(client, up, &key).await, 3);
    if let Some(schema) = &life.schema {
        // The purge (every second) deletes tombstones like any expired record.
        let pool = sqlx::PgPool::connect(&idem_testkit::harness::database_url().unwrap())
            .await
            .unwrap();
        // Rows whose scope starts with "\x01tombstone": expired ones stay until purged.
        let sql = format!(
            "SELECT count(*) FROM \"{schema}\".records \
             WHERE position('\\x01746f6d6273746f6e65'::bytea in scope) = 1"
        );
        let count = || async {
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        assert!(
            count().await > 0,
            "the tombstones are rows of the records table"
        );
        let purged = || async { (count().await == 0).then_some(()) };
        eventually(
            "the purge to delete every tombstone",
            secs(15),
            ms(200),
            purged,
        )
        .await;
    }
}

support::on_stores!(
    [memory, redis, postgres, tiered],
    [
        a_duplicate_waits_as_long_as_it_prefers,
        respond_async_answers_at_once_and_the_monitor_follows,
        an_expired_key_is_refused_until_its_tombstone_leaves,
    ]
);

mod killed {
    use super::a_killed_worker_is_in_flight_until_its_lease_ends;

    crate::support::on_stores!(
        [redis, postgres, tiered],
        [a_killed_worker_is_in_flight_until_its_lease_ends]
    );
}

/// `idem serve` answers the same way: `Prefer: respond-async` and its monitor, `OPTIONS`
/// on the monitor with the key lifetime, and a key refused once its retention ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_serve_shows_a_keys_whole_life() {
    let client = client();
    let args = ["serve", "--store", "memory", "--listen", "127.0.0.1:0"];
    let lifetime = [
        "--retention",
        "2",
        "--after-retention",
        "refuse",
        "--max-wait-ms",
        "3000",
    ];
    let mut command = idem(&args);
    command.args(lifetime);
    let serve = Proc::listening(command);
    let pay = |extra: Vec<(&'static str, &'static str)>| {
        let url = format!("{}/payments", serve.printed);
        let client = client.clone();
        async move {
            let mut headers = vec![
                ALICE,
                ("idempotency-key", "serve-1"),
                ("content-type", "application/json"),
                ("x-demo-delay-ms", "800"),
            ];
            headers.extend(extra);
            call(
                &client,
                "POST",
                &url,
                &headers,
                r#"{"amount":1250,"currency":"EUR"}"#,
            )
            .await
        }
    };
    let accepted = pay(vec![("prefer", "respond-async")]).await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{accepted:?}");
    let location = accepted.header("location").unwrap().to_owned();
    let done = || async {
        let reply = get(&client, &serve, ALICE, &location).await;
        (reply.status != StatusCode::ACCEPTED).then_some(reply)
    };
    let done = eventually("the payment", secs(10), ms(100), done).await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert_eq!(pay(vec![]).await.body, done.body);

    let options = call(
        &client,
        "OPTIONS",
        &format!("{}/.idem/keys", serve.printed),
        &[],
        "",
    )
    .await;
    let lifetime = options.json();
    assert_eq!(lifetime["retention_secs"], 2.0, "{lifetime}");
    assert_eq!(lifetime["after_retention"], "refuse", "{lifetime}");
    assert_eq!(lifetime["max_wait_ms"], 3000, "{lifetime}");

    let expired = || async {
        let reply = pay(vec![]).await;
        (reply.status != StatusCode::CREATED).then_some(reply)
    };
    let expired = eventually("the retention to end", secs(10), ms(100), expired).await;
    assert_eq!(expired.status, StatusCode::GONE, "{expired:?}");
    assert_eq!(expired.problem_type(), "urn:idem:problem:key-expired");
}
