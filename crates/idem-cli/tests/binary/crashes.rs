//! Processes killed with `kill -9` after the commit or mid-handler, two processes racing
//! for one key, and the purge of expired records: on PostgreSQL (whose payments table the
//! cases read) and on the tiered store.

use super::*;

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

mod postgres {
    //! Against `IDEM_TEST_DATABASE_URL`.

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

mod tiered {
    //! The tiered store: `tiered:<IDEM_TEST_REDIS_URL>|<IDEM_TEST_DATABASE_URL>`.

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
