//! The flags of the commands that main.rs dispatches, and the value parsers every command's
//! flags use (`--listen`, seconds). What the flags mean is read where they are used.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

/// The store every command opens: `IDEM_STORE`, `IDEM_PREFIX`, `IDEM_SCHEMA`.
#[derive(Debug, Args)]
pub struct StoreArg {
    /// The store: `redis://[:PASSWORD@]HOST:PORT[/DB]`,
    /// `redis+cluster://HOST:PORT[,HOST:PORT...]`, `postgres://USER[:PASSWORD]@HOST/DB`,
    /// `tiered:REDIS_URL|POSTGRES_URL`, or `memory` (inside this process only: the default;
    /// the commands that read or relay a shared store refuse it).
    // The URL may hold a password: `--help` must not print the variable's value. The
    // default is said above, not as `[default: memory]`, which the operator commands'
    // `--help` would show for a store they refuse.
    #[arg(
        long,
        env = "IDEM_STORE",
        hide_env_values = true,
        default_value = "memory",
        hide_default_value = true
    )]
    pub store: String,
    /// The Redis key prefix of the records (default `idem:`).
    #[arg(long, env = "IDEM_PREFIX", value_name = "PREFIX")]
    pub prefix: Option<String>,
    /// The PostgreSQL schema of idem's tables (default `idem`).
    #[arg(long, env = "IDEM_SCHEMA", value_name = "SCHEMA")]
    pub schema: Option<String>,
}

// `idem serve`'s flags.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on; port 0 picks a free port (the URL is printed).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = parse_listen)]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub store: StoreArg,
    /// Make a request for a key in flight wait up to this many milliseconds for the first
    /// request's response, instead of answering 409 at once.
    #[arg(long, value_name = "MS")]
    pub wait_ms: Option<u64>,
    /// The longest a duplicate waits for the first request's response when it asks with
    /// `Prefer: wait=N`.
    #[arg(long, default_value = "10000", value_name = "MS")]
    pub max_wait_ms: u64,
    /// A request on a key whose stored response was forgotten (its retention ended): run
    /// it again, or refuse it with 410 while the key's tombstone is kept.
    #[arg(long, default_value = "run", value_parser = ["run", "refuse"])]
    pub after_retention: String,
    /// How long a tombstone is kept after the stored response is forgotten, with
    /// --after-retention refuse.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub tombstone_secs: Option<Duration>,
    /// How long a request holds its key while the handler runs (fractions allowed); a
    /// crashed server's keys are taken over by a retry after it.
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    pub lease: Duration,
    /// How long a stored response is replayed (fractions allowed).
    #[arg(long, default_value = "86400", value_name = "SECS", value_parser = parse_secs)]
    pub retention: Duration,
    /// On PostgreSQL and tiered stores, delete expired records every SECS (0: never), so
    /// the database does not grow forever.
    #[arg(long, default_value = "60", value_name = "SECS", value_parser = parse_secs)]
    pub purge_every: Duration,
    /// Apply idem's migrations (and the outbox's, on a tiered store) at start; without it,
    /// a database without idem's tables is an error that says to run `idem migrate`.
    #[arg(long)]
    pub migrate: bool,
}

// The flags of `idem inspect` and `idem evict`: one record.
#[derive(Debug, Args)]
pub struct RecordArgs {
    /// The idempotency key.
    pub key: String,
    /// The key's scope (in the demo: the caller's name); the global scope when absent.
    #[arg(long, default_value = "")]
    pub scope: String,
    /// Instead of --scope: the value of a caller's scope header behind `idem proxy` (e.g.
    /// 'Bearer alice'), whose scope is derived as the proxy derives it.
    #[arg(long, value_name = "VALUE", conflicts_with = "scope")]
    pub scope_header_value: Option<String>,
    /// The proxy's scope header that --scope-header-value is the value of.
    #[arg(
        long,
        value_name = "NAME",
        default_value = "Authorization",
        requires = "scope_header_value"
    )]
    pub scope_header: String,
    #[command(flatten)]
    pub store: StoreArg,
}

// The flags of `idem stats` (and `idem stuck`): what to count, for how long.
#[derive(Debug, Args)]
pub struct SurveyArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// One scope only (all scopes when absent).
    #[arg(long)]
    pub scope: Option<String>,
    /// In-progress records whose lease expired more than this many seconds ago count as
    /// stuck.
    #[arg(long, default_value_t = 300, value_name = "SECS")]
    pub stuck_after: u64,
    /// Stop after this many seconds (fractions allowed) and print what was found so far,
    /// marked partial (exit 4).
    #[arg(long, default_value = "300", value_name = "SECS", value_parser = parse_secs)]
    pub timeout: Duration,
}

// `idem stuck`'s flags.
#[derive(Debug, Args)]
pub struct StuckArgs {
    #[command(flatten)]
    pub survey: SurveyArgs,
    /// List at most this many keys.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
}

// `idem purge`'s flags.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Stop after this many seconds (fractions allowed); what was deleted stays deleted.
    #[arg(long, default_value = "300", value_name = "SECS", value_parser = parse_secs)]
    pub timeout: Duration,
}

/// `--listen`: a socket address or a host name and port, with a hint for a bare port.
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    listen_address("--listen", text)
}

/// Reads the address of a binary's listening flag (`--listen`, `--metrics-listen`):
/// `IP:PORT`, `[IPv6]:PORT`, or `HOST:PORT` with a host name, resolved now to its first
/// address (`localhost:8080`). The error says what to write, with `flag` in its example:
/// a bare port is not taken, since which interface to open is worth writing down.
///
/// # Errors
///
/// A message for the user when `text` is none of those, or its host name does not resolve.
pub fn listen_address(flag: &str, text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    if text.parse::<u16>().is_ok() {
        return Err(format!(
            "HOST:PORT expected, e.g. {flag} 127.0.0.1:{text} (this machine only) or \
             0.0.0.0:{text} (every interface)"
        ));
    }
    let host_port = text.rsplit_once(':');
    let Some((host, port)) = host_port.filter(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
    else {
        return Err(format!(
            "HOST:PORT expected (e.g. 127.0.0.1:8080, [::1]:8080 or localhost:8080), not {text:?}"
        ));
    };
    match std::net::ToSocketAddrs::to_socket_addrs(text).map(|mut addrs| addrs.next()) {
        Ok(Some(addr)) => Ok(addr),
        Ok(None) | Err(_) => Err(format!(
            "the host name {host:?} does not resolve: write an IP address, e.g. {flag} \
             127.0.0.1:{port}"
        )),
    }
}

/// `--timeout` and every `SECS` flag: seconds, fractions allowed, above zero, read as every
/// `_secs` field of idem is ([`idem_proxy::Secs`]).
pub fn parse_secs(text: &str) -> Result<Duration, String> {
    text.parse::<idem_proxy::Secs>().map(|secs| secs.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_takes_host_port_and_says_so() {
        assert_eq!(
            parse_listen("127.0.0.1:0"),
            Ok("127.0.0.1:0".parse().unwrap())
        );
        let err = parse_listen("8080").unwrap_err();
        assert!(
            err.contains("HOST:PORT") && err.contains("127.0.0.1:8080"),
            "{err}"
        );
        assert!(parse_listen("localhost").unwrap_err().contains("HOST:PORT"));
        let local = parse_listen("localhost:8080").unwrap();
        assert!(local.ip().is_loopback() && local.port() == 8080, "{local}");
        let err = listen_address("--metrics-listen", "9187").unwrap_err();
        assert!(err.contains("--metrics-listen 127.0.0.1:9187"), "{err}");
        let err = parse_listen("no-such-host.invalid:80").unwrap_err();
        assert!(err.contains("does not resolve"), "{err}");
    }
}
