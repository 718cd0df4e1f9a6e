//! What a command emits besides its output: log lines on stderr ([`init_logs`]) and, for a
//! long-running command, Prometheus metrics ([`install_exporter`]).

use idem_core::telemetry::LATENCY_BUCKETS;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::CliError;

/// Installs the log subscriber: lines on stderr, filtered by `RUST_LOG` (else `default`),
/// as text or JSON.
pub fn init_logs(format: &str, default: &str) {
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

/// Installs the Prometheus recorder of a long-running command, with idem's latency buckets.
pub fn install_exporter() -> Result<PrometheusHandle, CliError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
        .and_then(|builder| builder.install_recorder())
        .map_err(|e| CliError::Io(std::io::Error::other(format!("metrics: {e}"))))
}
