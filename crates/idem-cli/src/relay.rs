//! `idem relay`: the outbox relay of the tiered store (`idem_outbox::Relay`), and its
//! dead-letter commands.

use std::future::Future;
use std::io::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use clap::{Args, Subcommand};
use idemkit::outbox::{Outbox, Relay, RelayConfig, TieredStore};
use idemkit::url::StoreUrl;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use crate::args::StoreArg;
use crate::error::{listen_error, CliError, Done};
use crate::store::{self, Use};

/// `idem relay`'s commands.
#[derive(Debug, Subcommand)]
pub enum RelayCommand {
    /// Run the relay worker until SIGTERM or SIGINT (it then finishes its batch and exits 0).
    Run(Box<RunArgs>),
    /// List or retry the outbox rows that failed too often (dead letters).
    #[command(subcommand)]
    Dead(DeadCommand),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    // The tiered store, `tiered:REDIS_URL|POSTGRES_URL`, as `idem serve --store` takes it;
    // `--prefix` the application's Redis key prefix.
    #[command(flatten)]
    store: StoreArg,
    /// Apply idem's and the outbox's migrations at start (safe while other instances do
    /// too); without it, the relay waits for them (`idem serve --migrate` or `idem migrate`
    /// makes them), saying so once.
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
    #[arg(long, value_name = "ADDR", value_parser = |s: &str| crate::args::listen_address("--metrics-listen", s))]
    metrics_listen: Option<SocketAddr>,
    /// Log level: error, warn, info, debug or trace (`RUST_LOG`, when set, filters instead).
    #[arg(long, env = "IDEM_RELAY_LOG", default_value = "info")]
    pub log: tracing::Level,
}

#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// List the dead rows, oldest first (`--json`: one JSON object a line).
    List {
        // The tiered store, or its `postgres://` half.
        #[command(flatten)]
        store: StoreArg,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Make dead rows pending again (tries reset, due now).
    Retry {
        // The tiered store, or its `postgres://` half.
        #[command(flatten)]
        store: StoreArg,
        /// Only these rows (repeat the flag for several); all dead rows when absent.
        #[arg(long = "id", value_name = "ID")]
        ids: Vec<i64>,
    },
}

/// Runs an `idem relay` command.
pub async fn run(command: RelayCommand, json: bool) -> Result<Done, CliError> {
    match command {
        RelayCommand::Run(args) => run_relay(*args).await,
        RelayCommand::Dead(DeadCommand::List { store, limit }) => {
            let opened = store::open(&store, Use::Outbox).await?;
            let outbox = Outbox::new(store::outbox_pg(&opened)?);
            let entries = outbox.dead_entries(limit).await?;
            Ok(Done::ok(dead_list(outbox.schema(), &entries, json)))
        }
        RelayCommand::Dead(DeadCommand::Retry { store, ids }) => {
            let opened = store::open(&store, Use::Outbox).await?;
            let outbox = Outbox::new(store::outbox_pg(&opened)?);
            let ids = (!ids.is_empty()).then_some(ids);
            let n = outbox.retry_dead(ids.as_deref()).await?;
            Ok(Done::ok(if json {
                format!("{}\n", serde_json::json!({ "retried": n }))
            } else {
                format!("{n} dead outbox rows made pending again\n")
            }))
        }
    }
}

/// What `idem relay dead list` prints: a table, or one JSON object a line.
fn dead_list(schema: &str, entries: &[idemkit::outbox::DeadEntry], json: bool) -> String {
    let mut out = String::new();
    if json {
        for e in entries {
            let line = serde_json::json!({
                "id": e.id,
                "scope": e.scope,
                "key": e.key,
                "tries": e.tries,
                "last_error": e.last_error,
                "age_seconds": e.age.as_secs_f64(),
            });
            out.push_str(&format!("{line}\n"));
        }
    } else if entries.is_empty() {
        out.push_str(&format!("no dead outbox rows in schema {schema}\n"));
    } else {
        out.push_str(&format!(
            "{:>10}  {:>5}  {:>8}  scope/key: last error\n",
            "id", "tries", "age"
        ));
        for e in entries {
            out.push_str(&format!(
                "{:>10}  {:>5}  {:>7}s  {}/{}: {}\n",
                e.id,
                e.tries,
                e.age.as_secs(),
                e.scope,
                e.key,
                e.last_error.as_deref().unwrap_or("-")
            ));
        }
    }
    out
}

async fn run_relay(args: RunArgs) -> Result<Done, CliError> {
    if args.backoff_cap_ms < args.backoff_ms {
        return Err(CliError::Usage(format!(
            "--backoff-cap-ms ({}) must not be below --backoff-ms ({})",
            args.backoff_cap_ms, args.backoff_ms
        )));
    }
    // Bind the metrics port first: a port in use is a configuration error, better found
    // before connecting anywhere.
    let metrics = match args.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|e| listen_error(addr, &e))?,
        ),
        None => None,
    };
    let opened = store::open(
        &args.store,
        Use::Relay {
            migrate: args.migrate,
        },
    )
    .await?;
    let (url, tiered) = (opened.url(), store::tiered(&opened)?);
    let mut shutdown = Box::pin(crate::signal::shutdown_signal("idem relay"));
    if !args.migrate && !schema_ready(url, &tiered, shutdown.as_mut()).await? {
        return Ok(Done::ok("idem relay: stopped\n".into()));
    }
    let config = RelayConfig::default()
        .with_batch(args.batch)
        .with_poll_interval(Duration::from_millis(args.poll_ms))
        .with_max_tries(args.max_tries)
        .with_backoff_base(Duration::from_millis(args.backoff_ms))
        .with_backoff_cap(Duration::from_millis(args.backoff_cap_ms));
    let relay = Relay::new(tiered.pg().clone(), tiered.redis().clone()).with_config(config);
    tracing::info!(
        store = %url,
        schema = %relay.schema(),
        batch = args.batch,
        poll_ms = args.poll_ms,
        max_tries = args.max_tries,
        "idem relay starting"
    );
    if let Some(listener) = metrics {
        let addr = listener.local_addr()?;
        // Standard output carries this one line, for scripts and tests that asked for port 0;
        // written with errors ignored: whoever started the relay may have closed it.
        let mut out = std::io::stdout();
        let _ = writeln!(out, "idem relay: metrics on http://{addr}/metrics");
        let _ = out.flush();
        tokio::spawn(serve_metrics(
            listener,
            relay.clone(),
            crate::telemetry::install_exporter()?,
        ));
    }
    relay.run(shutdown).await;
    Ok(Done::ok("idem relay: stopped\n".into()))
}

/// Waits until the database of the tiered store `url` has idem's and the outbox's tables, as
/// `idem serve --migrate`, `idem migrate` or a relay started with `--migrate` make them,
/// saying once what it waits for; `false` when `shutdown` came first.
///
/// # Errors
///
/// [`CliError::Open`] when PostgreSQL cannot be read.
async fn schema_ready(
    url: &StoreUrl,
    tiered: &TieredStore,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Result<bool, CliError> {
    let pg = tiered.pg();
    let mut said = false;
    loop {
        let mut pending = pg.pending_migrations().await?;
        pending.extend(
            pg.pending_migrations_with(idemkit::outbox::migrator())
                .await?,
        );
        if pending.is_empty() {
            if said {
                tracing::info!(schema = %pg.schema(), "the outbox is there: relaying");
            }
            return Ok(true);
        }
        if !said {
            tracing::warn!(
                store = %url,
                schema = %pg.schema(),
                "waiting for idem's tables and the outbox (migrations {pending:?} not applied), \
                 checking every second: `idem serve --migrate` or `idem migrate --store <url>` \
                 makes them, or start the relay with --migrate"
            );
            said = true;
        }
        tokio::select! {
            // Nothing is in flight while waiting: stop at once.
            () = shutdown.as_mut() => return Ok(false),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
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
