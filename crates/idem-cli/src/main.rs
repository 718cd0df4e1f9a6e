//! `idem`: the demo payments service behind the idempotency middleware, the HTTP gateway
//! (`proxy`), the tiered store's relay (`relay`), and the operator commands; its exit codes
//! are [`EXIT_CODES`].

use std::fmt;
use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idem_core::telemetry::LATENCY_BUCKETS;
use idem_core::{Key, RecordId, Scope};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

mod consume;
mod ledger;
mod ops;
mod proxy;
mod relay;
mod serve;
mod store;

use idemkit::postgres::{PurgeConfig, PurgeHandle};
use idemkit::url::StoreUrl;

/// The exit codes, as `--help` and docs/operations.md list them.
const EXIT_CODES: &str = "Exit codes: 0 success, 1 no such record, 2 bad input or unsupported, \
    3 store, I/O or listen error (unreachable store, missing schema, port in use), 4 corrupt \
    record (inspect) or partial answer (stats, stuck, purge stopped at --timeout; the output \
    says so).";

#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Idempotency keys for HTTP APIs and message consumers: a demo service, an HTTP gateway, the tiered store's relay and operator tools",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines on stderr look: `text`, or `json` (one object a line, for a log
    /// pipeline). Which lines: `RUST_LOG` (default `info` for `serve` and `proxy`, `relay
    /// run`'s `--log` level, `warn` otherwise).
    #[arg(
        long,
        global = true,
        env = "IDEM_LOG_FORMAT",
        default_value = "text",
        value_parser = ["text", "json"]
    )]
    log_format: String,
    /// Print JSON instead of text: the result on stdout, and on stderr an error as one JSON
    /// object (`{"error": {"kind", "message", "exit_code"}}`, the last line) after the log
    /// lines, which are JSON too.
    #[arg(long, global = true)]
    json: bool,
}

/// Installs the log subscriber: lines on stderr, filtered by `RUST_LOG` (else `default`),
/// as text or JSON.
fn init_logs(format: &str, default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Another subscriber already installed (never in this binary) is not worth a panic.
    let _ = if format == "json" {
        builder.json().try_init()
    } else {
        builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init()
    };
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the demo payments API behind the idempotency middleware.
    Serve(ServeArgs),
    /// Run the idempotency gateway in front of any HTTP service.
    Proxy(Box<proxy::ProxyArgs>),
    /// Deliver each message of a RabbitMQ queue, NATS JetStream subject or Redis stream
    /// once per idempotency key to an HTTP handler of any service.
    Consume(Box<consume::ConsumeArgs>),
    /// Show one record: state, lease holder and time left, attempts, expiry, stored response.
    Inspect(RecordArgs),
    /// Delete one record whatever its state, so that the key runs again. On a tiered store:
    /// in Redis, in PostgreSQL, and the key's outbox rows.
    Evict(RecordArgs),
    /// Count records by state, the stuck ones (in progress, lease expired long ago), and on
    /// Redis the corrupt and foreign keys under the prefix.
    ///
    /// A stuck record's worker died or gave up and no retry came to take it over. On Redis
    /// the count reads the keyspace a page at a time, with progress on stderr when it is a
    /// terminal; at --timeout it prints what it counted, marked partial, and exits 4.
    Stats(SurveyArgs),
    /// List the stuck records (lease expired long ago, no retry), the corrupt ones (Redis
    /// and PostgreSQL), and on Redis the foreign keys under the prefix.
    Stuck(StuckArgs),
    /// Delete expired records (PostgreSQL; Redis expires its records itself).
    Purge(PurgeArgs),
    /// Create or update idem's tables in PostgreSQL (and the outbox's, on a tiered store):
    /// the only command that changes a schema.
    Migrate(StoreArg),
    /// Relay the completions a tiered store committed in PostgreSQL (its outbox) into
    /// Redis, and list or retry the rows that failed too often.
    #[command(subcommand)]
    Relay(relay::RelayCommand),
}

/// The store every command opens: `IDEM_STORE`, `IDEM_PREFIX`, `IDEM_SCHEMA`.
#[derive(Debug, Args)]
struct StoreArg {
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
    store: String,
    /// The Redis key prefix of the records (default `idem:`).
    #[arg(long, env = "IDEM_PREFIX", value_name = "PREFIX")]
    prefix: Option<String>,
    /// The PostgreSQL schema of idem's tables (default `idem`).
    #[arg(long, env = "IDEM_SCHEMA", value_name = "SCHEMA")]
    schema: Option<String>,
}

impl StoreArg {
    /// Opens the store of a long-running command (`serve`, `proxy`): migrated first with
    /// `migrate`, started while a tiered store's Redis is down, and on PostgreSQL and tiered
    /// stores purged of expired records every `purge_every` (never when zero) for as long
    /// as the returned handle lives.
    async fn open_serving(
        &self,
        migrate: bool,
        purge_every: Duration,
    ) -> Result<(StoreUrl, store::Opened, Option<PurgeHandle>), CliError> {
        let url = store::parse(&self.store)?;
        let schema_mode = store::SchemaMode::migrate_if(migrate);
        let opened = store::open(&url, self, schema_mode, true).await?;
        // Expired records are deleted in the background; Redis expires its own, the memory
        // store sweeps as it writes.
        let purge = match opened.pg() {
            Some(pg) if !purge_every.is_zero() => {
                Some(pg.spawn_purge(PurgeConfig::default().with_interval(purge_every)))
            }
            _ => None,
        };
        Ok((url, opened, purge))
    }
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Address to listen on; port 0 picks a free port (the URL is printed).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = parse_listen)]
    listen: SocketAddr,
    #[command(flatten)]
    store: StoreArg,
    /// Make a request for a key in flight wait up to this many milliseconds for the first
    /// request's response, instead of answering 409 at once.
    #[arg(long, value_name = "MS")]
    wait_ms: Option<u64>,
    /// The longest a duplicate waits for the first request's response when it asks with
    /// `Prefer: wait=N`.
    #[arg(long, default_value = "10000", value_name = "MS")]
    max_wait_ms: u64,
    /// A request on a key whose stored response was forgotten (its retention ended): run
    /// it again, or refuse it with 410 while the key's tombstone is kept.
    #[arg(long, default_value = "run", value_parser = ["run", "refuse"])]
    after_retention: String,
    /// How long a tombstone is kept after the stored response is forgotten, with
    /// --after-retention refuse.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    tombstone_secs: Option<Duration>,
    /// How long a request holds its key while the handler runs (fractions allowed); a
    /// crashed server's keys are taken over by a retry after it.
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    lease: Duration,
    /// How long a stored response is replayed (fractions allowed).
    #[arg(long, default_value = "86400", value_name = "SECS", value_parser = parse_secs)]
    retention: Duration,
    /// On PostgreSQL and tiered stores, delete expired records every SECS (0: never), so
    /// the database does not grow forever.
    #[arg(long, default_value = "60", value_name = "SECS", value_parser = parse_secs)]
    purge_every: Duration,
    /// Apply idem's migrations (and the outbox's, on a tiered store) at start; without it,
    /// a database without idem's tables is an error that says to run `idem migrate`.
    #[arg(long)]
    migrate: bool,
}

#[derive(Debug, Args)]
struct RecordArgs {
    /// The idempotency key.
    key: String,
    /// The key's scope (in the demo: the caller's name); the global scope when absent.
    #[arg(long, default_value = "")]
    scope: String,
    /// Instead of --scope: the value of a caller's scope header behind `idem proxy` (e.g.
    /// 'Bearer alice'), whose scope is derived as the proxy derives it.
    #[arg(long, value_name = "VALUE", conflicts_with = "scope")]
    scope_header_value: Option<String>,
    /// The proxy's scope header that --scope-header-value is the value of.
    #[arg(
        long,
        value_name = "NAME",
        default_value = "Authorization",
        requires = "scope_header_value"
    )]
    scope_header: String,
    #[command(flatten)]
    store: StoreArg,
}

#[derive(Debug, Args)]
struct SurveyArgs {
    #[command(flatten)]
    store: StoreArg,
    /// One scope only (all scopes when absent).
    #[arg(long)]
    scope: Option<String>,
    /// In-progress records whose lease expired more than this many seconds ago count as
    /// stuck.
    #[arg(long, default_value_t = 300, value_name = "SECS")]
    stuck_after: u64,
    /// Stop after this many seconds (fractions allowed) and print what was found so far,
    /// marked partial (exit 4).
    #[arg(long, default_value = "300", value_name = "SECS", value_parser = parse_secs)]
    timeout: Duration,
}

#[derive(Debug, Args)]
struct StuckArgs {
    #[command(flatten)]
    survey: SurveyArgs,
    /// List at most this many keys.
    #[arg(long, default_value_t = 100)]
    limit: u32,
}

#[derive(Debug, Args)]
struct PurgeArgs {
    #[command(flatten)]
    store: StoreArg,
    /// Stop after this many seconds (fractions allowed); what was deleted stays deleted.
    #[arg(long, default_value = "300", value_name = "SECS", value_parser = parse_secs)]
    timeout: Duration,
}

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
    fn kind(&self) -> (&'static str, u8) {
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

/// One error as the JSON object `--json` prints on stderr.
fn json_error(kind: &str, message: &str, code: u8) -> String {
    serde_json::json!({
        "error": { "kind": kind, "message": message, "exit_code": code }
    })
    .to_string()
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

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` print and exit 0; with `--json` anywhere, a usage
            // error is JSON too (clap has not told us whether the flag parsed).
            let wants_json = std::env::args_os().any(|a| a == "--json");
            if !wants_json || !e.use_stderr() {
                e.exit();
            }
            let message = e.kind().to_string();
            let detail = e.to_string();
            let detail = detail.lines().next().unwrap_or(&message);
            let detail = detail.strip_prefix("error: ").unwrap_or(detail);
            let _ = writeln!(std::io::stderr(), "{}", json_error("usage", detail, 2));
            return ExitCode::from(2);
        }
    };
    let default_level = match &cli.command {
        // sqlx reports every statement at info: its warnings are enough.
        Command::Serve(_) | Command::Proxy(_) | Command::Consume(_) => "info,sqlx=warn".to_owned(),
        Command::Relay(relay::RelayCommand::Run(args)) => {
            let level = args.log;
            format!("{level},sqlx={}", level.min(tracing::Level::WARN))
        }
        _ => "warn".to_owned(),
    };
    // With --json, stderr holds JSON lines only: the logs as well as an error.
    let log_format = if cli.json { "json" } else { &cli.log_format };
    init_logs(log_format, &default_level);
    let json = cli.json;
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "idem: cannot start the async runtime: {e}"
            );
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(run(cli.command, json)) {
        Ok(done) => {
            // A closed stdout (say, `idem inspect ... | head -1`) is not an error worth a
            // panic: the output was not wanted.
            let _ = std::io::stdout().write_all(done.output.as_bytes());
            ExitCode::from(done.code)
        }
        Err(e) => {
            let (kind, code) = e.kind();
            let line = if json {
                json_error(kind, &e.to_string(), code)
            } else {
                format!("idem: {e}")
            };
            let _ = writeln!(std::io::stderr(), "{line}");
            ExitCode::from(code)
        }
    }
}

async fn run(command: Command, json: bool) -> Result<Done, CliError> {
    match command {
        Command::Serve(args) => {
            let (url, opened, _purge) = args
                .store
                .open_serving(args.migrate, args.purge_every)
                .await?;
            let backend = ledger::Backend::open(&url, opened).await?;
            let listener = tokio::net::TcpListener::bind(args.listen)
                .await
                .map_err(|e| listen_error(args.listen, &e))?;
            let after_retention = match args.after_retention.as_str() {
                "refuse" => idem_core::AfterRetention::Refuse,
                _ if args.tombstone_secs.is_some() => {
                    return Err(CliError::Usage(
                        "--tombstone-secs applies only with --after-retention refuse: add it, \
                         or remove --tombstone-secs"
                            .into(),
                    ))
                }
                _ => idem_core::AfterRetention::Run,
            };
            let options = serve::Options {
                wait: args.wait_ms.map(Duration::from_millis),
                max_wait: Duration::from_millis(args.max_wait_ms),
                after_retention,
                tombstone: args
                    .tombstone_secs
                    .unwrap_or_else(|| idem_core::Config::default().tombstone),
                lease: args.lease,
                retention: args.retention,
                store: url.to_string(),
                exporter: install_exporter()?,
            };
            tracing::info!(
                store = %options.store,
                listen = %args.listen,
                wait_ms = args.wait_ms,
                "idem serve starting"
            );
            serve::run(listener, backend, &options, shutdown_signal("idem demo")).await?;
            Ok(Done::ok("idem demo: stopped\n".into()))
        }
        Command::Proxy(args) => proxy::run(*args).await,
        Command::Consume(args) => consume::run(*args).await,
        Command::Inspect(args) => {
            let (opened, id) = open_for_record(&args).await?;
            ops::inspect(opened.store().as_ref(), &id, json).await
        }
        Command::Evict(args) => {
            let (opened, id) = open_for_record(&args).await?;
            ops::evict(opened.store().as_ref(), &id, json).await
        }
        Command::Stats(args) => {
            let (opened, survey) = open_for_survey(args, json).await?;
            ops::stats(&opened, &survey).await
        }
        Command::Stuck(args) => {
            let (opened, survey) = open_for_survey(args.survey, json).await?;
            ops::stuck(&opened, &survey, args.limit).await
        }
        Command::Purge(args) => {
            let opened = open_shared(&args.store, store::SchemaMode::Require).await?;
            ops::purge(&opened, args.timeout, json).await
        }
        Command::Migrate(args) => {
            let opened = open_shared(&args, store::SchemaMode::Leave).await?;
            ops::migrate(&opened, json).await
        }
        Command::Relay(command) => relay::run(command, json).await,
    }
}

/// Opens the store of `stats` or `stuck`, without migrating, and what they look at.
async fn open_for_survey(
    args: SurveyArgs,
    json: bool,
) -> Result<(store::Opened, ops::Survey), CliError> {
    let scope = args
        .scope
        .map(Scope::new)
        .transpose()
        .map_err(|e| CliError::Usage(format!("invalid scope: {e}")))?;
    let opened = open_shared(&args.store, store::SchemaMode::Require).await?;
    let survey = ops::Survey {
        scope,
        stuck_after: Duration::from_secs(args.stuck_after),
        timeout: args.timeout,
        json,
    };
    Ok((opened, survey))
}

/// Opens a shared store (refusing the memory store) for an operator command.
async fn open_shared(
    args: &StoreArg,
    schema_mode: store::SchemaMode,
) -> Result<store::Opened, CliError> {
    let url = store::parse(&args.store)?;
    // The memory store lives inside one process: another has nothing to read.
    if url == StoreUrl::Memory {
        return Err(CliError::Unsupported(
            "the memory store lives inside one `idem serve` process and cannot be read from \
             another; pass --store with a shared store (redis://..., postgres://...)"
                .into(),
        ));
    }
    store::open(&url, args, schema_mode, false).await
}

/// Opens the store of `inspect` or `evict`, without migrating, refusing the memory store.
async fn open_for_record(args: &RecordArgs) -> Result<(store::Opened, RecordId), CliError> {
    let key = Key::new(args.key.clone())
        .map_err(|e| CliError::Usage(format!("invalid key {:?}: {e}", args.key)))?;
    let scope = match &args.scope_header_value {
        Some(value) => proxy::caller_scope(&args.scope_header, value)?,
        None => Scope::new(args.scope.clone())
            .map_err(|e| CliError::Usage(format!("invalid scope: {e}")))?,
    };
    let opened = open_shared(&args.store, store::SchemaMode::Require).await?;
    Ok((opened, RecordId::new(scope, key)))
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, and says so on stderr as `<who>: shutting down`.
/// The handlers are in place when this returns, before the future is first polled: a signal
/// sent as soon as the process says it runs is not lost (it would kill the process).
fn shutdown_signal(who: &'static str) -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{signal, SignalKind};
        [
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ]
    };
    async move {
        #[cfg(unix)]
        {
            // A handler that could not be installed never resolves: the other one stops us.
            let [interrupt, terminate] = signals.map(|signal| async move {
                match signal {
                    Ok(mut signal) => {
                        signal.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            });
            tokio::select! {
                () = interrupt => {},
                () = terminate => {},
            }
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        let _ = writeln!(std::io::stderr(), "{who}: shutting down");
    }
}

/// `--listen`: a socket address or a host name and port, with a hint for a bare port.
fn parse_listen(text: &str) -> Result<SocketAddr, String> {
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
fn listen_address(flag: &str, text: &str) -> Result<SocketAddr, String> {
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

/// `--timeout`: seconds, fractions allowed, above zero.
fn parse_secs(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("a number of seconds expected (e.g. 30 or 0.5), not {text:?}"))?;
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("a number of seconds above zero expected, not {text:?}"))
}

/// Installs the Prometheus recorder of a long-running command, with idem's latency buckets.
fn install_exporter() -> Result<metrics_exporter_prometheus::PrometheusHandle, CliError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
        .and_then(|builder| builder.install_recorder())
        .map_err(|e| CliError::Io(std::io::Error::other(format!("metrics: {e}"))))
}

/// A failed bind is the machine's state, not bad input: it exits 3 and names the fix.
fn listen_error(addr: SocketAddr, e: &std::io::Error) -> CliError {
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
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

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
