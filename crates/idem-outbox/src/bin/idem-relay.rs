//! `idem-relay`: the outbox relay worker of idem's tiered store, and its dead-letter
//! commands.
//!
//! Exit codes: 0 success (and a clean stop on SIGTERM/SIGINT); 2 bad input; 3 a store or
//! I/O error.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idem_core::telemetry::LATENCY_BUCKETS;
use idem_core::url::StoreUrl;
use idem_core::Error;
use idem_outbox::{Outbox, Relay, RelayConfig};
use idem_postgres::PgStore;
use idem_redis::RedisStore;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "idem-relay",
    version,
    about = "Relays completions committed in PostgreSQL (the outbox of idem's tiered store) into Redis",
    after_help = "Exit codes: 0 success or a clean stop on SIGTERM/SIGINT, 2 bad input, 3 store or I/O error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the relay worker until SIGTERM or SIGINT (it then finishes its batch and exits 0).
    Run(RunArgs),
    /// List or retry the outbox rows that failed too often (dead letters).
    #[command(subcommand)]
    Dead(DeadCommand),
}

/// Where the stores are. `idem-relay` and `idem` read the same variables: `IDEM_STORE`,
/// `IDEM_PREFIX`, `IDEM_SCHEMA`, `IDEM_LOG_FORMAT`. The former `IDEM_DATABASE_URL` and
/// `IDEM_REDIS_URL` (and `--database-url`, `--redis-url`, `--redis-prefix`) still work,
/// with a warning.
#[derive(Debug, Args)]
struct StoreArgs {
    /// The tiered store, `tiered:REDIS_URL|POSTGRES_URL`, as `idem serve --store` takes it
    /// (the dead-letter commands need only a `postgres://` URL). Redis with the same key
    /// prefix as the application's.
    // The URL may hold a password: `--help` must not print the variable's value.
    #[arg(long, env = "IDEM_STORE", hide_env_values = true, value_name = "URL")]
    store: Option<String>,
    /// Deprecated: the PostgreSQL half of --store.
    #[arg(long, value_name = "URL", hide = true)]
    database_url: Option<String>,
    /// Deprecated: the Redis half of --store.
    #[arg(long, value_name = "URL", hide = true)]
    redis_url: Option<String>,
    /// idem's schema in that database.
    #[arg(long, env = "IDEM_SCHEMA", default_value = idem_postgres::DEFAULT_SCHEMA)]
    schema: String,
    /// The Redis key prefix of the application's RedisStore, when it is not the default
    /// (`idem:`).
    #[arg(
        long,
        env = "IDEM_PREFIX",
        alias = "redis-prefix",
        value_name = "PREFIX"
    )]
    prefix: Option<String>,
}

/// The store URLs, from `--store` / `IDEM_STORE` or the deprecated names.
#[derive(Debug)]
struct Urls {
    redis: Option<String>,
    postgres: String,
}

/// The deprecated variables, read only when neither `--store` nor `IDEM_STORE` is set.
const OLD_DATABASE_VAR: &str = "IDEM_DATABASE_URL";
const OLD_REDIS_VAR: &str = "IDEM_REDIS_URL";

/// A deprecated setting and the name it came by: the flag, else the variable.
fn former(
    flag: &Option<String>,
    flag_name: &'static str,
    var: &'static str,
) -> Option<(String, &'static str)> {
    flag.clone()
        .map(|url| (url, flag_name))
        .or_else(|| std::env::var(var).ok().map(|url| (url, var)))
}

impl StoreArgs {
    /// Resolves the URLs; `warn` receives one line per deprecated name in use.
    fn urls(&self, mut warn: impl FnMut(String)) -> Result<Urls, Failure> {
        let old_database = former(&self.database_url, "--database-url", OLD_DATABASE_VAR);
        let old_redis = former(&self.redis_url, "--redis-url", OLD_REDIS_VAR);
        if let Some(store) = &self.store {
            for (_, name) in old_database.iter().chain(&old_redis) {
                warn(format!("{name} is ignored: --store (IDEM_STORE) is set"));
            }
            return match StoreUrl::parse(store).map_err(Failure::from)? {
                StoreUrl::Tiered { redis, postgres } => Ok(Urls {
                    redis: Some(redis),
                    postgres,
                }),
                StoreUrl::Postgres(postgres) => Ok(Urls {
                    redis: None,
                    postgres,
                }),
                other => Err(Failure::Input(format!(
                    "--store {other}: the relay works on a tiered store, \
                     tiered:REDIS_URL|POSTGRES_URL (or a postgres:// URL for `dead`)"
                ))),
            };
        }
        let Some((postgres, name)) = old_database else {
            return Err(Failure::Input(
                "no store: pass --store (or set IDEM_STORE): `run` takes the tiered store, \
                 tiered:REDIS_URL|POSTGRES_URL; `dead list` and `dead retry` a postgres:// URL \
                 is enough"
                    .into(),
            ));
        };
        warn(format!(
            "{name} is deprecated: use --store tiered:REDIS_URL|POSTGRES_URL (or IDEM_STORE)"
        ));
        if let Some((_, name)) = &old_redis {
            warn(format!(
                "{name} is deprecated: use --store tiered:REDIS_URL|POSTGRES_URL (or IDEM_STORE)"
            ));
        }
        if !postgres.starts_with("postgres://") && !postgres.starts_with("postgresql://") {
            return Err(Failure::Input(format!(
                "{name} must be a postgres:// URL, not {:?}",
                idem_core::url::redact(&postgres)
            )));
        }
        Ok(Urls {
            redis: old_redis.map(|(url, _)| url),
            postgres,
        })
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    stores: StoreArgs,
    /// Apply idem's and the outbox's migrations at start (safe while other instances do
    /// too); without it, a database without them is an error that says to run
    /// `idem migrate`.
    #[arg(long)]
    migrate: bool,
    /// Outbox rows per transaction.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
    /// Poll interval in milliseconds (notifications wake the relay sooner).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    poll_ms: u64,
    /// Failed applications of a row before it is marked dead.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    max_tries: u32,
    /// The pause before retrying a failed row, doubling with each failure, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    backoff_ms: u64,
    /// The longest pause before retrying a failed row, in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    backoff_cap_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9187; port 0 picks
    /// a free port, printed on standard output).
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_listen)]
    metrics_listen: Option<SocketAddr>,
    /// Log level: error, warn, info, debug or trace (`RUST_LOG`, when set, filters instead,
    /// with the same syntax as every tracing-subscriber program).
    #[arg(long, env = "IDEM_RELAY_LOG", default_value = "info")]
    log: tracing::Level,
    /// How log lines on stderr look: `text`, or `json` (one object a line).
    #[arg(
        long,
        env = "IDEM_LOG_FORMAT",
        default_value = "text",
        value_parser = ["text", "json"]
    )]
    log_format: String,
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// List the dead rows, oldest first.
    List {
        #[command(flatten)]
        stores: StoreArgs,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Print one JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Make dead rows pending again (tries reset, due now).
    Retry {
        #[command(flatten)]
        stores: StoreArgs,
        /// Only these rows (repeat the flag for several); all dead rows when absent.
        #[arg(long = "id", value_name = "ID")]
        ids: Vec<i64>,
    },
}

/// A failure and the exit code it maps to.
#[derive(Debug)]
enum Failure {
    /// Bad input: 2.
    Input(String),
    /// A store or I/O error: 3.
    Store(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            Error::Invalid(msg) => Failure::Input(msg),
            other => Failure::Store(other.to_string()),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem-relay: cannot start the runtime: {e}");
            return ExitCode::from(3);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Dead(cmd) => dead(cmd).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Input(msg)) => {
            eprintln!("idem-relay: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Store(msg)) => {
            eprintln!("idem-relay: {msg}");
            ExitCode::from(3)
        }
    }
}

/// Installs the Prometheus recorder for this process's metrics (the relay's and the stores'):
/// latency histograms get [`LATENCY_BUCKETS`].
fn exporter() -> Result<PrometheusHandle, Failure> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
        .and_then(|builder| builder.install_recorder())
        .map_err(|e| Failure::Store(format!("metrics recorder: {e}")))
}

/// `--metrics-listen`: a socket address or a host name and port, with a hint for a bare
/// port.
fn parse_metrics_listen(text: &str) -> Result<SocketAddr, String> {
    idem_core::reach::listen_address("--metrics-listen", text)
}

/// The failure to open the store at `url`: what is wrong and what to do when the error or a
/// probe of the port tells (nothing listens, another protocol there), else the error as the
/// driver tells it; never the URL's password.
async fn open_failure(url: &str, e: Error) -> Failure {
    if matches!(e, Error::Invalid(_)) {
        return Failure::from(e);
    }
    let name = idem_core::url::redact(url);
    match idem_core::reach::explain(url, &e).await {
        Some(hint) => Failure::Store(format!("cannot open store {name}: {hint}")),
        None => Failure::Store(format!(
            "cannot open store {name}: {}",
            idem_core::url::scrub(&e.to_string(), url)
        )),
    }
}

/// Opens PostgreSQL in the schema asked for.
async fn pg_store(url: &str, schema: &str) -> Result<PgStore, Failure> {
    match PgStore::connect(url).await {
        Ok(store) => Ok(store.with_schema(schema)?),
        Err(e) => Err(open_failure(url, e).await),
    }
}

/// Prints a deprecation warning on stderr (before any log subscriber exists).
fn deprecated(line: String) {
    eprintln!("idem-relay: warning: {line}");
}

/// Connects to Redis; when it is out of reach, starts without it: the relay keeps the rows
/// pending (its batches fail without counting tries) and relays them once Redis answers,
/// which a task logs.
async fn redis_store(url: &str, prefix: Option<&String>) -> Result<RedisStore, Failure> {
    // The tiered store's Redis: PostgreSQL is the arbiter, so Redis needs no persistence.
    let mut builder = RedisStore::builder(url).with_persistence_check(false);
    if let Some(prefix) = prefix {
        builder = builder.with_prefix(prefix.clone());
    }
    let redacted = idem_core::url::redact(url);
    let opened = match builder.connect_or_wait(&redacted).await {
        Ok(opened) => opened,
        Err(e) => return Err(open_failure(url, e).await),
    };
    match opened {
        (redis, true) => Ok(redis),
        (redis, false) => {
            tracing::warn!(
                redis = %redacted,
                "Redis unreachable at start: relaying waits for it (completions stay in \
                 PostgreSQL's outbox, nothing is lost)"
            );
            Ok(redis)
        }
    }
}

async fn run(args: RunArgs) -> Result<(), Failure> {
    // sqlx logs every migration statement's notices at info: keep it to warnings.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        let level = args.log;
        let sqlx = level.min(tracing::Level::WARN);
        EnvFilter::new(format!("{level},sqlx={sqlx}"))
    });
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if args.log_format == "json" {
        logs.json().try_init()
    } else {
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init()
    };
    if args.backoff_cap_ms < args.backoff_ms {
        return Err(Failure::Input(format!(
            "--backoff-cap-ms ({}) must not be below --backoff-ms ({})",
            args.backoff_cap_ms, args.backoff_ms
        )));
    }
    // Bind the metrics port first: a port in use is a configuration error, better found
    // before connecting anywhere.
    let metrics =
        match args.metrics_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| {
                Failure::Store(format!("cannot listen on {addr} for metrics: {e}"))
            })?),
            None => None,
        };
    let urls = args.stores.urls(deprecated)?;
    let Some(redis_url) = urls.redis.as_deref() else {
        return Err(Failure::Input(
            "idem-relay run needs the Redis half too: --store tiered:REDIS_URL|POSTGRES_URL".into(),
        ));
    };
    // Redis first: a bad URL is found before anything is written to the database.
    let redis = redis_store(redis_url, args.stores.prefix.as_ref()).await?;
    let pg = pg_store(&urls.postgres, &args.stores.schema).await?;
    if args.migrate {
        // Safe while other instances migrate too.
        idem_outbox::migrate(&pg).await?;
    } else {
        let mut pending = pg.pending_migrations().await?;
        pending.extend(pg.pending_migrations_with(idem_outbox::migrator()).await?);
        if !pending.is_empty() {
            return Err(Failure::Store(format!(
                "schema {:?} lacks migrations {pending:?}: run `idem migrate --store \
                 tiered:REDIS_URL|POSTGRES_URL --schema {}` first, or start the relay with \
                 --migrate",
                pg.schema(),
                pg.schema()
            )));
        }
    }
    let config = RelayConfig::default()
        .with_batch(args.batch)
        .with_poll_interval(Duration::from_millis(args.poll_ms))
        .with_max_tries(args.max_tries)
        .with_backoff_base(Duration::from_millis(args.backoff_ms))
        .with_backoff_cap(Duration::from_millis(args.backoff_cap_ms));
    let relay = Relay::new(pg, redis).with_config(config);
    tracing::info!(
        database = %idem_core::url::redact(&urls.postgres),
        redis = %idem_core::url::redact(redis_url),
        schema = %args.stores.schema,
        batch = args.batch,
        poll_ms = args.poll_ms,
        max_tries = args.max_tries,
        "idem-relay starting"
    );

    let shutdown = shutdown_signal();
    if let Some(listener) = metrics {
        let addr = listener
            .local_addr()
            .map_err(|e| Failure::Store(format!("metrics listener: {e}")))?;
        // Standard output carries this one line, for scripts and tests that asked for port 0.
        println!("idem-relay: metrics on http://{addr}/metrics");
        tokio::spawn(serve_metrics(listener, relay.clone(), exporter()?));
    }
    relay.run(shutdown).await;
    Ok(())
}

async fn dead(cmd: DeadCommand) -> Result<(), Failure> {
    match cmd {
        DeadCommand::List {
            stores,
            limit,
            json,
        } => {
            let urls = stores.urls(deprecated)?;
            let outbox = Outbox::new(pg_store(&urls.postgres, &stores.schema).await?);
            let entries = outbox.dead_entries(limit).await?;
            if json {
                for e in &entries {
                    let line = serde_json::json!({
                        "id": e.id,
                        "scope": e.scope,
                        "key": e.key,
                        "tries": e.tries,
                        "last_error": e.last_error,
                        "age_seconds": e.age.as_secs_f64(),
                    });
                    println!("{line}");
                }
            } else if entries.is_empty() {
                println!("no dead outbox rows in schema {}", outbox.schema());
            } else {
                println!(
                    "{:>10}  {:>5}  {:>8}  scope/key: last error",
                    "id", "tries", "age"
                );
                for e in &entries {
                    println!(
                        "{:>10}  {:>5}  {:>7}s  {}/{}: {}",
                        e.id,
                        e.tries,
                        e.age.as_secs(),
                        e.scope,
                        e.key,
                        e.last_error.as_deref().unwrap_or("-")
                    );
                }
            }
            Ok(())
        }
        DeadCommand::Retry { stores, ids } => {
            let urls = stores.urls(deprecated)?;
            let outbox = Outbox::new(pg_store(&urls.postgres, &stores.schema).await?);
            let ids = (!ids.is_empty()).then_some(ids);
            let n = outbox.retry_dead(ids.as_deref()).await?;
            println!("{n} dead outbox rows made pending again");
            Ok(())
        }
    }
}

/// Resolves on SIGTERM or SIGINT (ctrl-c). The SIGTERM handler is in place when this
/// returns, before the future is first polled: a signal sent as soon as the relay says it
/// runs is not lost.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    async move {
        #[cfg(unix)]
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot handle SIGTERM; only SIGINT stops the relay");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("signal received: finishing the current batch");
    }
}

/// Serves `GET /metrics` on `listener` (axum): the Prometheus text of every metric this
/// process records, with the relay's gauges read from PostgreSQL first (the last ones when
/// PostgreSQL does not answer).
async fn serve_metrics(listener: TcpListener, relay: Relay, exporter: PrometheusHandle) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let (relay, exporter) = (relay.clone(), exporter.clone());
            async move {
                if let Err(error) = relay.observe().await {
                    tracing::warn!(%error, "metrics: gauges not read; serving the last ones");
                }
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    exporter.render(),
                )
            }
        }),
    );
    if let Err(error) = axum::serve(listener, app).await {
        tracing::error!(%error, "metrics listener stopped");
    }
}
