//! `idem proxy`: the idempotency gateway in front of any HTTP service (`idem-proxy`).

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use http::{HeaderName, Method};
use idem_proxy::{Drained, HostHeader, Proxy, ProxyFile, RouteSpec, Settings, UpstreamSpec};

use crate::args::{parse_listen, parse_secs};
use crate::error::{listen_error, CliError, Done};
use crate::serving::ServingStore;

/// `idem proxy`'s flags. Route settings given here are the defaults of every route of
/// `--config`, over the file's `[defaults]` and under each route's own; the upstream and
/// route settings are idem-proxy's own structs, which the file is read into too.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Address to listen on (HTTP/1.1 and HTTP/2 over cleartext); port 0 picks a free port
    /// (the URL is printed).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = parse_listen)]
    listen: SocketAddr,
    #[command(flatten)]
    upstream: UpstreamSpec,
    #[command(flatten)]
    store: ServingStore,
    /// A TOML routes file (see docs/proxy.md); flags override its `[defaults]`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Check the flags and `--config`, print the routes, and exit without starting.
    #[arg(long)]
    check_config: bool,
    /// Serve `/metrics`, `/livez` and `/readyz` on this address.
    #[arg(long, value_name = "ADDR", value_parser = parse_listen)]
    admin_listen: Option<SocketAddr>,
    /// On SIGTERM, how long requests in flight may take to finish (fractions allowed).
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    shutdown_timeout: Duration,
    #[command(flatten)]
    route: RouteSpec,
}

impl ProxyArgs {
    /// The settings of the flags over the file.
    fn settings(&self) -> Result<Settings, CliError> {
        let file = match &self.config {
            Some(path) => ProxyFile::read(path).map_err(|e| CliError::Usage(e.to_string()))?,
            None => ProxyFile::default(),
        };
        Settings::resolve(&file, &self.route, &self.upstream)
            .map_err(|e| CliError::Usage(e.to_string()))
    }
}

/// What `--check-config` prints: the upstream and each route.
fn describe(settings: &Settings) -> String {
    let upstream = &settings.upstream;
    let host = match upstream.host {
        HostHeader::Keep => "keep".to_owned(),
        HostHeader::Upstream => "upstream".to_owned(),
        other => format!("{other:?}").to_lowercase(),
    };
    let mut out = format!(
        "upstream url = \"{}\", timeout_secs = {}, host = \"{host}\"\n",
        upstream.url,
        secs(upstream.timeout)
    );
    for route in &settings.routes {
        let methods: Vec<&str> = route.http.methods.iter().map(Method::as_str).collect();
        out.push_str(&format!(
            "route {} {}: key_header = \"{}\", scope_header = \"{}\", lease_secs = {}, \
             retention_secs = {}",
            methods.join(","),
            route.path,
            route.http.header,
            route.scope_header,
            secs(route.engine.lease),
            secs(route.engine.retention),
        ));
        if let Some(rpc) = &route.http.jsonrpc {
            let key = rpc.key_pointer.as_ref().map_or_else(
                || "\"\" (the key header only)".to_owned(),
                |p| format!("{p:?}"),
            );
            out.push_str(&format!(
                ", jsonrpc_methods = {:?}, key_pointer = {key}, ignore_meta = {:?}, \
                 store_errors = {}",
                rpc.methods, rpc.ignore_meta, rpc.store_errors
            ));
        }
        if route.engine.after_retention == idem_core::AfterRetention::Refuse {
            out.push_str(&format!(
                ", after_retention = refuse, tombstone_secs = {}",
                secs(route.engine.tombstone)
            ));
        }
        match (route.engine.wait, &route.http.jsonrpc) {
            (Some(wait), _) => out.push_str(&format!(", wait_ms = {}\n", wait.as_millis())),
            (None, None) => out.push_str(" (no wait_ms: 409 at once)\n"),
            (None, Some(_)) => {
                out.push_str(" (no wait_ms: the in-flight JSON-RPC error at once)\n")
            }
        }
    }
    out.push_str("every other request passes through\n");
    out
}

/// A duration as the routes file writes seconds: `30`, or `0.5` for a fraction.
fn secs(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        d.as_secs().to_string()
    } else {
        d.as_secs_f64().to_string()
    }
}

/// The scope `idem proxy` keeps the keys of a caller in, whose scope header `header` has
/// the value `value` (`idem inspect --scope-header-value`).
///
/// # Errors
///
/// [`CliError::Usage`] for a bad header name, or a blank value (which scopes nothing).
pub fn caller_scope(header: &str, value: &str) -> Result<idem_core::Scope, CliError> {
    let name = HeaderName::try_from(header)
        .map_err(|e| CliError::Usage(format!("--scope-header {header:?}: {e}")))?;
    idem_proxy::scope_of(&name, value.as_bytes()).ok_or_else(|| {
        CliError::Usage(
            "--scope-header-value is blank: the proxy scopes no request by a blank value".into(),
        )
    })
}

/// Runs `idem proxy` until SIGTERM or Ctrl-C, then drains.
pub async fn run(args: ProxyArgs) -> Result<Done, CliError> {
    let settings = args.settings()?;
    if args.check_config {
        return Ok(Done::ok(format!("config OK\n{}", describe(&settings))));
    }
    let opened = args.store.open().await?;
    let url = opened.url();
    let store = opened.store();
    let proxy = Proxy::new(store.clone(), &settings.upstream, settings.routes.clone())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| listen_error(args.listen, &e))?;
    let exporter = crate::telemetry::install_exporter()?;
    let admin = match args.admin_listen {
        Some(addr) => {
            let admin = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| listen_error(addr, &e))?;
            let render = Arc::new(move || exporter.render());
            Some(tokio::spawn(idem_proxy::serve_admin(
                admin,
                store.clone(),
                render,
                std::future::pending(),
            )))
        }
        None => None,
    };
    let addr = listener.local_addr()?;
    tracing::info!(listen = %addr, upstream = %settings.upstream.url, store = %url, "idem proxy starting");
    // Written with errors ignored: whoever started the proxy may have closed our stdout.
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "idem proxy: listening on http://{addr}, upstream {} (store: {url})",
        settings.upstream.url
    );
    let _ = out.flush();
    let drained = idem_proxy::serve(
        listener,
        proxy,
        crate::signal::shutdown_signal("idem proxy"),
        args.shutdown_timeout,
    )
    .await;
    if let Some(admin) = admin {
        admin.abort();
    }
    Ok(Done::ok(match drained {
        Drained::Complete => "idem proxy: stopped, every request answered\n".into(),
        Drained::TimedOut => {
            tracing::warn!(timeout = ?args.shutdown_timeout, "requests still in flight at the shutdown timeout were cut off");
            "idem proxy: stopped at --shutdown-timeout with requests in flight\n".into()
        }
    }))
}
