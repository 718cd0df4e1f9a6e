//! How a command ends: what it printed ([`Done`]) or why it failed ([`CliError`]), and the
//! exit code of each ([`EXIT_CODES`]).

use std::fmt;
use std::net::SocketAddr;

/// The exit codes, as `--help` and docs/operations.md list them.
pub const EXIT_CODES: &str =
    "Exit codes: 0 success, 1 no such record, 2 bad input or unsupported, \
    3 store, I/O or listen error (unreachable store, missing schema, port in use), 4 corrupt \
    record (inspect) or partial answer (stats, stuck, purge stopped at --timeout; the output \
    says so).";

/// What a command printed, and its exit code (0, or 4 for a partial answer).
#[derive(Debug)]
pub struct Done {
    /// Standard output.
    pub output: String,
    /// The exit code.
    pub code: u8,
}

impl Done {
    /// A complete answer.
    pub fn ok(output: String) -> Self {
        Self { output, code: 0 }
    }

    /// A complete answer, or a partial one (exit 4).
    pub fn partial_unless(complete: bool, output: String) -> Self {
        Self {
            output,
            code: if complete { 0 } else { 4 },
        }
    }
}

/// Why a command failed; each kind has its exit code.
#[derive(Debug)]
pub enum CliError {
    /// No such record (exit 1).
    NotFound(String),
    /// Bad input (exit 2).
    Usage(String),
    /// Not supported by this build (exit 2).
    Unsupported(String),
    /// The store failed (exit 3).
    Store(idem_core::Error),
    /// The store could not be opened (exit 3); the message names it, without its password.
    Open(String),
    /// An I/O error (exit 3).
    Io(std::io::Error),
    /// The record read is corrupt or not idem's (exit 4); the message says what is wrong.
    Corrupt(String),
}

impl CliError {
    /// The kind's name in a JSON error, and its exit code.
    pub fn kind(&self) -> (&'static str, u8) {
        match self {
            Self::NotFound(_) => ("not_found", 1),
            Self::Usage(_) => ("usage", 2),
            Self::Unsupported(_) => ("unsupported", 2),
            Self::Store(_) => ("store", 3),
            Self::Open(_) => ("open", 3),
            Self::Io(_) => ("io", 3),
            Self::Corrupt(_) => ("corrupt", 4),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotFound(m)
            | Self::Usage(m)
            | Self::Unsupported(m)
            | Self::Open(m)
            | Self::Corrupt(m) => f.write_str(m),
            Self::Store(e) => write!(f, "store error: {e}"),
            Self::Io(e) => write!(f, "I/O error: {e}"),
        }
    }
}

impl From<idem_core::Error> for CliError {
    fn from(e: idem_core::Error) -> Self {
        Self::Store(e)
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// One error as the JSON object `--json` prints on stderr.
pub fn json_error(kind: &str, message: &str, code: u8) -> String {
    serde_json::json!({
        "error": { "kind": kind, "message": message, "exit_code": code }
    })
    .to_string()
}

/// A failed bind is the machine's state, not bad input: it exits 3 and names the fix.
pub fn listen_error(addr: SocketAddr, e: &std::io::Error) -> CliError {
    let hint = match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            "the port is in use; stop the other process or pick another --listen port (0 picks a free one)"
        }
        std::io::ErrorKind::PermissionDenied => "ports below 1024 need privileges; pick a higher port",
        std::io::ErrorKind::AddrNotAvailable => "this machine has no such address; try 127.0.0.1",
        _ => "check --listen",
    };
    CliError::Open(format!("cannot listen on {addr}: {e} ({hint})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_in_use_is_not_bad_input() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = tokio::net::TcpListener::bind(addr).await.unwrap_err();
        let err = listen_error(addr, &e);
        assert_eq!(err.kind(), ("open", 3));
        assert!(err.to_string().contains("in use"), "{err}");
    }
}
