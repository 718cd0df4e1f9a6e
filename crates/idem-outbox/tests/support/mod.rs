//! What the outbox's test binaries share.

use std::process::Stdio;

use tokio::process::Command;

/// `idem-relay` as the tests start it: without the `IDEM_*` variables (and `RUST_LOG`) of
/// the environment the tests run in, so only what the test passes counts; with no input;
/// killed when its handle is dropped, so a failing test leaves no relay running.
pub fn relay_command() -> Command {
    let mut relay = Command::new(env!("CARGO_BIN_EXE_idem-relay"));
    for var in [
        "IDEM_STORE",
        "IDEM_DATABASE_URL",
        "IDEM_REDIS_URL",
        "IDEM_SCHEMA",
        "IDEM_PREFIX",
        "RUST_LOG",
    ] {
        relay.env_remove(var);
    }
    relay.stdin(Stdio::null()).kill_on_drop(true);
    relay
}
