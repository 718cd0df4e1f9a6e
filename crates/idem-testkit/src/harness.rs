//! Finding the servers tests run against.
//!
//! Backends come from environment URLs: `IDEM_TEST_REDIS_URL`, `IDEM_TEST_DATABASE_URL`,
//! `IDEM_TEST_AMQP_URL` and `IDEM_TEST_NATS_URL`.
//! `scripts/test` (the README's test command) sets them, starting throwaway servers from the
//! binaries on `PATH` when they are not set. When a URL is missing, a test prints why and
//! returns early, unless `IDEM_TEST_REQUIRE_BACKENDS=1`, which makes it fail instead: CI sets
//! it, so nothing skips there.

use std::net::TcpListener;

/// Whether a missing backend fails the run (`IDEM_TEST_REQUIRE_BACKENDS=1`).
pub fn backends_required() -> bool {
    std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_ok_and(|v| v == "1" || v == "true")
}

/// The URL in `var`, or `None` with a printed reason. Panics when backends are required.
pub fn url_from_env(var: &str, what: &str) -> Option<String> {
    let url = std::env::var(var).ok().filter(|url| !url.trim().is_empty());
    if url.is_none() {
        skip(&format!(
            "{what} tests need {var}: run them through `scripts/test`, which starts a \
             throwaway {what} server, or set {var} to a server of yours"
        ));
    }
    url
}

/// The Redis URL for tests (`IDEM_TEST_REDIS_URL`), e.g. `redis://127.0.0.1:6379`.
pub fn redis_url() -> Option<String> {
    url_from_env("IDEM_TEST_REDIS_URL", "Redis")
}

/// The PostgreSQL URL for tests (`IDEM_TEST_DATABASE_URL`), e.g.
/// `postgres://postgres@127.0.0.1:5432/test`.
pub fn database_url() -> Option<String> {
    url_from_env("IDEM_TEST_DATABASE_URL", "PostgreSQL")
}

/// The NATS URL for tests (`IDEM_TEST_NATS_URL`), e.g. `nats://127.0.0.1:4222`: a server
/// with JetStream (`nats-server -js`).
pub fn nats_url() -> Option<String> {
    url_from_env("IDEM_TEST_NATS_URL", "NATS")
}

/// A loopback port that refuses every connection for as long as the process runs: a
/// socket bound to it and never listening holds it, so no server started meanwhile (another
/// test's, on a port the OS picked) can take it. For stores pointed at a server that is not
/// there; [`free_port`]'s port could be taken by such a server, and the store would meet a
/// stranger's protocol instead of a refused connection.
pub fn refused_port() -> u16 {
    // tokio's `TcpSocket` binds without listening (std's `TcpListener` always listens).
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind(([127, 0, 0, 1], 0).into())
        .expect("a loopback port the OS picks");
    let port = socket.local_addr().expect("the bound address").port();
    // Held until the process exits: the port must stay refused for every later test.
    std::mem::forget(socket);
    port
}

/// A loopback port nothing listens on now, for a server about to start on it. It lies below
/// the kernel's range of ports for outgoing connections
/// (`/proc/sys/net/ipv4/ip_local_port_range`), where no client's connection (nor one to the
/// port itself while the server starts) can take it first. Another process starting a
/// server may still: callers that start servers retry on a new port. Scripts get theirs
/// from this crate's `free-port` binary.
pub fn free_port() -> u16 {
    free_port_and(0)
}

/// A [`free_port`] whose port `offset` above is free too (a Redis Cluster node's bus port
/// is its port + 10000).
pub fn free_port_and(offset: u16) -> u16 {
    use std::hash::{BuildHasher, RandomState};

    let outgoing = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    const LOWEST: u16 = 10_000;
    let top = match outgoing.saturating_sub(offset) {
        top if top > LOWEST + 1_000 => top,
        _ => 32_768u16.saturating_sub(offset).max(LOWEST + 1_000),
    };
    let free = |port: u16| TcpListener::bind(("127.0.0.1", port)).is_ok();
    for attempt in 0u32..1_000 {
        let draw = RandomState::new().hash_one((std::process::id(), attempt));
        let port = LOWEST + u16::try_from(draw % u64::from(top - LOWEST)).unwrap_or(0);
        if free(port) && (offset == 0 || port.checked_add(offset).is_some_and(free)) {
            return port;
        }
    }
    panic!("no free loopback port below {top}");
}

/// Whether something a test needs beyond a URL (server binaries on `PATH`, say) is there:
/// `true` when `present`; otherwise prints why the test is skipped and returns `false`, or
/// panics when backends are required.
pub fn present(present: bool, what: &str) -> bool {
    if !present {
        skip(&format!("{what} is missing"));
    }
    present
}

/// Prints why a test is skipped, or panics when backends are required.
fn skip(why: &str) {
    assert!(
        !backends_required(),
        "IDEM_TEST_REQUIRE_BACKENDS=1 and {why}"
    );
    eprintln!("skipping: {why}");
}

/// Polls `check` every `every` until it gives a value, which it returns; fails the test with
/// `what` (what never happened) after `patience`.
///
/// # Panics
///
/// When `check` gives nothing within `patience`.
pub async fn eventually<T, F>(
    what: &str,
    patience: std::time::Duration,
    every: std::time::Duration,
    mut check: impl FnMut() -> F,
) -> T
where
    F: std::future::Future<Output = Option<T>>,
{
    let started = tokio::time::Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(started.elapsed() < patience, "{what} within {patience:?}");
        tokio::time::sleep(every).await;
    }
}

/// The standard output of `command`, run to its end.
///
/// # Panics
///
/// When the command cannot start or does not succeed: the message names the command and
/// carries its standard error.
pub fn stdout_of(command: &mut std::process::Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?} cannot start: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A schema (or key prefix) name of its own for one test: `<prefix><unix seconds>_<12 hex>`,
/// so tests share a server without meeting, and [`is_stale`] can tell leftovers by age.
pub fn unique_name(prefix: &str) -> String {
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}{}_{}", unix_secs(), &random[..12])
}

/// Whether `name`, made by [`unique_name`] with `prefix`, is older than an hour: the
/// leftover of a test run that ended, safe to drop.
pub fn is_stale(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|rest| rest.split('_').next())
        .and_then(|secs| secs.parse::<u64>().ok())
        .is_some_and(|created| created + 3600 < unix_secs())
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_age() {
        let a = unique_name("idem_t_");
        assert_ne!(a, unique_name("idem_t_"));
        assert!(!is_stale(&a, "idem_t_"));
        assert!(is_stale("idem_t_1000_abcdef012345", "idem_t_"));
        assert!(!is_stale("other_1000_abcdef012345", "idem_t_"));
        assert!(!is_stale("idem_t_notanumber_x", "idem_t_"));
    }

    #[test]
    fn a_refused_port_refuses_connections() {
        let port = refused_port();
        let err = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        // Held: the OS gives the port to nobody else.
        assert!(TcpListener::bind(("127.0.0.1", port)).is_err());
    }
}
