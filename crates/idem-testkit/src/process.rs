//! What every throwaway server of this crate does the same way: run as an unprivileged user
//! when the tests run as root (PostgreSQL and RabbitMQ refuse root, or switch away from it),
//! wait for a server to come up, and run a tool that must succeed.

use std::io;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this process runs as root.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// The first of `candidates` that exists, when running as root; `None` otherwise (the
/// server then runs as this process's user).
pub(crate) fn server_user(candidates: &[&'static str]) -> Option<&'static str> {
    if !is_root() {
        return None;
    }
    candidates.iter().copied().find(|user| {
        Command::new("id")
            .arg(user)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// A command running `program` as `user` (through `runuser`), or as this process's user.
pub(crate) fn as_user(user: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match user {
        Some(user) => {
            let mut command = Command::new("runuser");
            command.args(["-u", user, "--"]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// Gives `path` (recursively) to `user`, when there is one.
pub(crate) fn chown(user: Option<&str>, path: &std::path::Path) -> io::Result<()> {
    match user {
        Some(user) => run(
            Command::new("chown").args(["-R", user]).arg(path),
            String::new,
        ),
        None => Ok(()),
    }
}

/// Runs `command` to its end; an error (with its output and what `context` says then, a
/// server's log say) unless it succeeds.
pub(crate) fn run(command: &mut Command, context: impl FnOnce() -> String) -> io::Result<()> {
    let out = command.stdin(Stdio::null()).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{command:?} failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            context()
        )))
    }
}

/// Polls `ready` every 20 ms until it says yes (`Ok`), fails, or `limit` passes (a
/// `TimedOut` error).
pub(crate) fn wait_until(
    limit: Duration,
    mut ready: impl FnMut() -> io::Result<bool>,
) -> io::Result<()> {
    let started = Instant::now();
    loop {
        if ready()? {
            return Ok(());
        }
        if started.elapsed() > limit {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("not ready after {limit:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
