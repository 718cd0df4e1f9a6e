//! `idem-relay` as an operator starts it: while Redis is down (it starts, says so, and
//! relays once Redis answers), and from the variables the `idem` binary reads too
//! (`IDEM_STORE`, `IDEM_PREFIX`, `IDEM_SCHEMA`), the former ones warning.
//!
//! Needs `IDEM_TEST_DATABASE_URL`, and `redis-server` on `PATH` (the test starts its own, to
//! stop it). Each test works in a PostgreSQL schema of its own.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, RecordId, RecordState,
    Response, Scope, Store,
};
use idem_outbox::TieredStore;
use idem_postgres::PgStore;
use idem_redis::testing::{self, RedisServer};
use idem_redis::RedisStore;
use idem_testkit::harness;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::{sleep, Instant};

mod support;
use support::relay_command;

const RELAY: &str = env!("CARGO_BIN_EXE_idem-relay");
/// Generous for a loaded 2-core machine; nothing here asserts speed.
const PATIENCE: Duration = Duration::from_secs(30);

async fn migrated(db_url: &str) -> PgStore {
    let pg = PgStore::connect(db_url)
        .await
        .expect("connect to IDEM_TEST_DATABASE_URL")
        .with_schema(&harness::unique_name("idem_t_"))
        .expect("a valid schema name");
    idem_outbox::migrate(&pg).await.expect("migrate");
    pg
}

async fn drop_schema(pg: &PgStore) {
    let _ = sqlx::query(&format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        pg.quoted_schema()
    ))
    .execute(pg.pool())
    .await;
}

/// Waits until a line holding `text` was logged.
async fn logged(lines: &Mutex<Vec<String>>, text: &str) {
    let deadline = Instant::now() + PATIENCE;
    while !lines.lock().unwrap().iter().any(|l| l.contains(text)) {
        assert!(
            Instant::now() < deadline,
            "idem-relay never logged {text:?}; it logged: {:#?}",
            lines.lock().unwrap()
        );
        sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_starts_while_redis_is_down_and_relays_once_it_returns() {
    let Some(db_url) = harness::database_url() else {
        return;
    };
    if !testing::available() {
        return;
    }
    let mut server = RedisServer::start().expect("start redis-server");
    let redis_url = server.url();
    let prefix = format!("idem-relay-start-{}:", uuid::Uuid::new_v4().simple());
    let pg = migrated(&db_url).await;
    server.stop();

    let mut relay = relay_command()
        .arg("run")
        .env("IDEM_STORE", format!("tiered:{redis_url}|{db_url}"))
        .env("IDEM_PREFIX", &prefix)
        .env("IDEM_SCHEMA", pg.schema())
        .args(["--poll-ms", "50", "--backoff-ms", "50", "--log", "info"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idem-relay");
    let lines = Arc::new(Mutex::new(Vec::new()));
    {
        let lines = lines.clone();
        let mut stderr = BufReader::new(relay.stderr.take().unwrap()).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                lines.lock().unwrap().push(line);
            }
        });
    }
    logged(&lines, "Redis unreachable at start").await;
    logged(&lines, "idem relay started").await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "{:#?}",
        lines.lock().unwrap()
    );

    // A completion committed while Redis is down: PostgreSQL alone takes it, and its
    // outbox row waits for the relay.
    let redis = RedisStore::builder(&redis_url)
        .with_prefix(prefix.clone())
        .connect_lazy()
        .unwrap();
    let tiered = TieredStore::new(redis.clone(), pg.clone());
    let id = RecordId::new(Scope::global(), Key::new("paid-while-down").unwrap());
    let Begin::Acquired(lease) = tiered
        .begin(BeginRequest {
            id: &id,
            fingerprint: Fingerprint::of_bytes(b"order"),
            token: FencingToken::random(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(600),
        })
        .await
        .expect("PostgreSQL alone answers while Redis is down")
    else {
        panic!("a fresh key")
    };
    let completion = Completion::succeeded(Response::new(201, "paid"));
    tiered
        .complete(&lease, &completion, Duration::from_secs(600))
        .await
        .expect("complete in PostgreSQL");

    // Redis returns: the relay says so and writes the completion into it.
    server.start_again().expect("restart redis-server");
    let deadline = Instant::now() + PATIENCE;
    loop {
        match redis.get(&id).await {
            Ok(Some(record)) => {
                assert!(matches!(record.state, RecordState::Completed(ref c) if *c == completion));
                break;
            }
            _ => {
                assert!(
                    Instant::now() < deadline,
                    "the relay never wrote the completion into Redis: {:#?}",
                    lines.lock().unwrap()
                );
                sleep(Duration::from_millis(100)).await;
            }
        }
    }
    logged(&lines, "Redis reachable").await;
    assert!(relay.try_wait().unwrap().is_none(), "the relay stopped");

    let pid = relay.id().unwrap().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    let status = tokio::time::timeout(PATIENCE, relay.wait())
        .await
        .expect("idem-relay stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
    drop_schema(&pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_commands_read_the_shared_variables_and_warn_on_the_old() {
    let Some(db_url) = harness::database_url() else {
        return;
    };
    let pg = migrated(&db_url).await;
    let relay = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(RELAY);
        cmd.args(["dead", "list"]);
        for var in [
            "IDEM_STORE",
            "IDEM_SCHEMA",
            "IDEM_PREFIX",
            "IDEM_DATABASE_URL",
            "IDEM_REDIS_URL",
        ] {
            cmd.env_remove(var);
        }
        let out = cmd.envs(env.iter().copied()).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let schema = pg.schema().to_owned();

    let (code, out, err) = relay(&[("IDEM_STORE", &db_url), ("IDEM_SCHEMA", &schema)]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains(&format!("no dead outbox rows in schema {schema}")),
        "{out}"
    );
    assert!(!err.contains("deprecated"), "{err}");

    // The former variable still works, and says what replaces it.
    let (code, out, err) = relay(&[("IDEM_DATABASE_URL", &db_url), ("IDEM_SCHEMA", &schema)]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("no dead outbox rows"), "{out}");
    assert!(err.contains("IDEM_DATABASE_URL is deprecated"), "{err}");
    assert!(err.contains("IDEM_STORE"), "{err}");

    // Both: the new one wins, the old one is named as ignored.
    let (code, _, err) = relay(&[
        ("IDEM_STORE", &db_url),
        ("IDEM_DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
        ("IDEM_SCHEMA", &schema),
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("IDEM_DATABASE_URL is ignored"), "{err}");

    // Neither: bad input, naming what to set.
    let (code, _, err) = relay(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("IDEM_STORE"), "{err}");
    drop_schema(&pg).await;
}

/// Without `--migrate`, `idem-relay run` on a database lacking idem's tables stops, says to
/// run `idem migrate`, and creates nothing: only `idem migrate` and explicit flags change a
/// schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_migrate_changes_no_schema() {
    let Some(db_url) = harness::database_url() else {
        return;
    };
    let schema = harness::unique_name("idem_relay_nomig_");
    let relay = relay_command()
        .args(["run", "--schema", &schema, "--log", "warn"])
        // No Redis listens on port 1: the relay would start without it, so only the schema
        // check can stop it.
        .env("IDEM_STORE", format!("tiered:redis://127.0.0.1:1|{db_url}"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A relay that got past the check runs until stopped: bound the wait.
    let out = tokio::time::timeout(Duration::from_secs(30), relay.wait_with_output())
        .await
        .expect("idem-relay run started without --migrate on a schema lacking idem's tables");
    let out = out.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("run `idem migrate"), "{err}");
    let pool = sqlx::PgPool::connect(&db_url).await.unwrap();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(&schema)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        !exists,
        "idem-relay run created schema {schema} without --migrate"
    );
}
