//! The operator commands (`inspect`, `stats`, `stuck`, `evict`, `migrate`, `purge`) next to
//! `idem serve` on every store, on records in every state, broken ones included, and on a
//! keyspace of millions of keys.

use super::*;

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

mod tiered {
    //! The tiered store: `tiered:<IDEM_TEST_REDIS_URL>|<IDEM_TEST_DATABASE_URL>`.

    serve_inspect_stats_evict!(super::both_urls().map(|(r, p)| (format!("tiered:{r}|{p}"), ())));
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
