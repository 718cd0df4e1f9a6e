//! `idem`: the demo payments service behind the idempotency middleware, the HTTP gateway
//! (`proxy`), the tiered store's relay (`relay`), and the operator commands; its exit codes
//! are [`EXIT_CODES`].

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod args;
mod consume;
mod error;
mod ledger;
mod ops;
mod proxy;
mod relay;
mod serve;
mod serving;
mod signal;
mod store;
mod telemetry;

use crate::args::{PurgeArgs, RecordArgs, ServeArgs, StoreArg, StuckArgs, SurveyArgs};
use crate::error::{json_error, CliError, Done, EXIT_CODES};
use crate::store::{SchemaMode, Use};

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
    telemetry::init_logs(log_format, &default_level);
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
    let operator = Use::Operator(SchemaMode::Require);
    match command {
        Command::Serve(args) => serve::run(args).await,
        Command::Proxy(args) => proxy::run(*args).await,
        Command::Consume(args) => consume::run(*args).await,
        Command::Inspect(args) => {
            let id = ops::record_id(&args)?;
            let opened = store::open(&args.store, operator).await?;
            ops::inspect(opened.store().as_ref(), &id, json).await
        }
        Command::Evict(args) => {
            let id = ops::record_id(&args)?;
            let opened = store::open(&args.store, operator).await?;
            ops::evict(opened.store().as_ref(), &id, json).await
        }
        Command::Stats(args) => {
            let survey = ops::Survey::of(&args, json)?;
            let opened = store::open(&args.store, operator).await?;
            ops::stats(&opened, &survey).await
        }
        Command::Stuck(args) => {
            let survey = ops::Survey::of(&args.survey, json)?;
            let opened = store::open(&args.survey.store, operator).await?;
            ops::stuck(&opened, &survey, args.limit).await
        }
        Command::Purge(args) => {
            let opened = store::open(&args.store, operator).await?;
            ops::purge(&opened, args.timeout, json).await
        }
        Command::Migrate(args) => {
            let opened = store::open(&args, Use::Operator(SchemaMode::Leave)).await?;
            ops::migrate(&opened, json).await
        }
        Command::Relay(command) => relay::run(command, json).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
