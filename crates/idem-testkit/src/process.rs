//! What every throwaway server of this crate does the same way: run as an unprivileged user
//! when the tests run as root (PostgreSQL and RabbitMQ refuse root, or switch away from it),
//! run under a watchdog, wait for a server to come up, and run a tool that must succeed.

use std::ffi::OsStr;
use std::io;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `program --version` runs and succeeds.
pub(crate) fn runs(program: impl AsRef<OsStr>) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `"$SERVER_BIN" "$@"` and stops it on `SIGTERM` (from [`terminate`]) or when the test
/// process (`WATCH_PID`) is gone; in the second case nothing will drop the server, so the
/// watchdog also removes its directory (`SERVER_DIR`).
const WATCHDOG: &str = r#"
"$SERVER_BIN" "$@" &
srv=$!
trap 'kill $srv 2>/dev/null; wait $srv; exit 0' TERM INT
while kill -0 "$WATCH_PID" 2>/dev/null && kill -0 "$srv" 2>/dev/null; do sleep 0.2; done
kill "$srv" 2>/dev/null
wait "$srv"
kill -0 "$WATCH_PID" 2>/dev/null || rm -rf "$SERVER_DIR"
"#;

/// Starts `server` with `args` under the watchdog, its directory `dir` and its standard
/// error to `stderr`, and waits up to `limit` until `ready`; stopped again, and an error,
/// when it exits first or is not ready in time.
pub(crate) fn start_watched(
    server: &Path,
    args: &[impl AsRef<OsStr>],
    dir: &Path,
    stderr: Stdio,
    limit: Duration,
    ready: impl FnMut() -> bool,
) -> io::Result<Child> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("sh")
        .args(args)
        .env("WATCH_PID", std::process::id().to_string())
        .env("SERVER_BIN", server)
        .env("SERVER_DIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()?;
    match wait_for(&mut child, &server.display().to_string(), limit, ready) {
        Ok(()) => Ok(child),
        Err(e) => {
            terminate(child);
            Err(e)
        }
    }
}

/// Waits up to `limit` until `ready`; an error when `child` (running `name`) exits first.
pub(crate) fn wait_for(
    child: &mut Child,
    name: &str,
    limit: Duration,
    mut ready: impl FnMut() -> bool,
) -> io::Result<()> {
    wait_until(limit, || match child.try_wait()? {
        Some(status) => Err(io::Error::other(format!("{name} exited: {status}"))),
        None => Ok(ready()),
    })
}

/// Stops a watched server (`SIGTERM` to its watchdog, which stops the server and waits for
/// it), and waits for the watchdog.
pub(crate) fn terminate(mut child: Child) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let _ = child.wait();
}

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
