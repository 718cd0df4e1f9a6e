//! `idem-relay`'s errors name their cause and fix as `idem`'s do (the same explanations,
//! `idem_core::reach`): a bare metrics port, no store, a PostgreSQL URL at a Redis port.

use std::process::Command;

use idem_redis::testing::{self, RedisServer};

const RELAY: &str = env!("CARGO_BIN_EXE_idem-relay");

/// `idem-relay <args>` without the store variables: its exit code and stderr.
fn relay(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(RELAY);
    for var in ["IDEM_STORE", "IDEM_DATABASE_URL", "IDEM_REDIS_URL"] {
        cmd.env_remove(var);
    }
    let out = cmd.args(args).output().expect("idem-relay runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn relay_errors_say_what_to_write() {
    let (code, err) = relay(&["run", "--metrics-listen", "9187"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--metrics-listen 127.0.0.1:9187"), "{err}");

    // `dead` needs only PostgreSQL, and the error says so.
    let (code, err) = relay(&["dead", "list"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("postgres:// URL"), "{err}");
}

#[test]
fn relay_names_the_protocol_found_at_the_port() {
    if !testing::available() {
        return;
    }
    let redis = RedisServer::start().expect("start redis-server");
    let port = redis.url().rsplit(':').next().unwrap().to_owned();
    let url = format!("postgres://postgres:hunter2@127.0.0.1:{port}/test");
    let (code, err) = relay(&["dead", "list", "--store", &url]);
    assert_eq!(code, Some(3), "{err}");
    assert!(
        err.contains("speaks Redis and this URL expects PostgreSQL"),
        "{err}"
    );
    assert!(err.contains("use redis://"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}
