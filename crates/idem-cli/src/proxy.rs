//! `idem proxy`: the idempotency gateway in front of any HTTP service (`idem-proxy`).

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use http::{HeaderName, Method};
use idem_proxy::{
    AfterRetentionSpec, AnonymousSpec, Drained, Header, HostHeader, HostSpec, MethodName,
    MissingKeySpec, PathPrefix, Proxy, ProxyFile, RouteSpec, Secs, Settings, UpstreamSpec,
};

use crate::args::{parse_listen, parse_secs, StoreArg};
use crate::error::{listen_error, CliError, Done};
use crate::store::{self, Use};

/// `idem proxy`'s flags. Route settings given here are the defaults of every route of
/// `--config`, over the file's `[defaults]` and under each route's own.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Address to listen on (HTTP/1.1 and HTTP/2 over cleartext); port 0 picks a free port
    /// (the URL is printed).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = parse_listen)]
    listen: SocketAddr,
    /// The service requests go to: `http://HOST:PORT[/PREFIX]` or `https://...`.
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,
    #[command(flatten)]
    store: StoreArg,
    /// Apply idem's migrations at start (PostgreSQL and tiered stores).
    #[arg(long)]
    migrate: bool,
    /// On PostgreSQL and tiered stores, delete expired records every SECS.
    #[arg(long, default_value = "60", value_name = "SECS", value_parser = parse_secs)]
    purge_every: Duration,
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
    /// How long the upstream has to answer with a response head [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    upstream_timeout: Option<Duration>,
    /// A PEM file of certificate authorities trusted for an `https://` upstream, besides
    /// the system's.
    #[arg(long, value_name = "FILE")]
    upstream_ca_file: Option<PathBuf>,
    /// The `Host` the upstream receives: the client's (`keep`) or the upstream URL's
    /// [default: keep].
    #[arg(long, value_parser = ["keep", "upstream"])]
    host: Option<String>,
    /// The guarded methods, comma-separated [default: POST,PATCH].
    #[arg(long, value_delimiter = ',', value_parser = parse_method)]
    methods: Option<Vec<Method>>,
    /// The guarded path prefix [default: /].
    #[arg(long, value_name = "PREFIX")]
    path: Option<String>,
    /// The header carrying the key [default: Idempotency-Key].
    #[arg(long, value_name = "NAME", value_parser = parse_header)]
    key_header: Option<HeaderName>,
    /// A guarded request without a key: refused with 400, or passed through [default:
    /// reject].
    #[arg(long, value_parser = ["reject", "pass"])]
    missing_key: Option<String>,
    /// The request header whose value, hashed, scopes the keys [default: Authorization].
    #[arg(long, value_name = "NAME", value_parser = parse_header)]
    scope_header: Option<HeaderName>,
    /// A request without the scope header: refused with 401, or keyed in one scope shared
    /// by every such caller [default: refuse].
    #[arg(long, value_parser = ["refuse", "shared"])]
    anonymous: Option<String>,
    /// How long a request holds its key while the upstream works; a crashed proxy's keys
    /// are taken over by a retry after it [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    lease: Option<Duration>,
    /// How long a stored response is replayed [default: 86400].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    retention: Option<Duration>,
    /// Make a request for a key in flight wait up to MS milliseconds for the first one's
    /// response, instead of answering 409 at once.
    #[arg(long, value_name = "MS")]
    wait_ms: Option<u64>,
    /// The longest a duplicate waits for the first response when it asks with
    /// `Prefer: wait=N` [default: 10000].
    #[arg(long, value_name = "MS")]
    max_wait_ms: Option<u64>,
    /// A request on a key whose stored response was forgotten (its retention ended): run
    /// it again, or refuse it with 410 while the key's tombstone is kept [default: run].
    #[arg(long, value_parser = ["run", "refuse"])]
    after_retention: Option<String>,
    /// How long a tombstone is kept after the stored response is forgotten, with
    /// --after-retention refuse [default: 604800].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    tombstone_secs: Option<Duration>,
    /// When the upstream's answer is lost after the request was sent (a timeout, a reset),
    /// release the key at once instead of leaving it in flight until its lease ends.
    #[arg(long)]
    release_unknown: bool,
}

fn parse_method(text: &str) -> Result<Method, String> {
    let upper = text.trim().to_ascii_uppercase();
    Method::from_bytes(upper.as_bytes())
        .map_err(|_| format!("an HTTP method such as POST expected, not {text:?}"))
}

fn parse_header(text: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(text.trim().as_bytes())
        .map_err(|_| format!("a header name such as X-Api-Key expected, not {text:?}"))
}

impl ProxyArgs {
    /// The route settings the flags give.
    fn route_flags(&self) -> Result<RouteSpec, CliError> {
        let path = match &self.path {
            Some(path) if !path.starts_with('/') => {
                return Err(CliError::Usage(format!(
                    "--path must start with /, such as /payments, not {path:?}"
                )))
            }
            path => path.clone().map(PathPrefix),
        };
        Ok(RouteSpec {
            path,
            methods: self
                .methods
                .as_ref()
                .map(|methods| methods.iter().cloned().map(MethodName).collect()),
            key_header: self.key_header.clone().map(Header),
            missing_key: self.missing_key.as_deref().map(|m| match m {
                "pass" => MissingKeySpec::Pass,
                _ => MissingKeySpec::Reject,
            }),
            scope_header: self.scope_header.clone().map(Header),
            anonymous: self.anonymous.as_deref().map(|a| match a {
                "shared" => AnonymousSpec::Shared,
                _ => AnonymousSpec::Refuse,
            }),
            lease_secs: self.lease.map(Secs),
            retention_secs: self.retention.map(Secs),
            wait_ms: self.wait_ms,
            max_wait_ms: self.max_wait_ms,
            after_retention: self.after_retention.as_deref().map(|a| match a {
                "refuse" => AfterRetentionSpec::Refuse,
                _ => AfterRetentionSpec::Run,
            }),
            tombstone_secs: self.tombstone_secs.map(Secs),
            release_unknown: self.release_unknown.then_some(true),
            ..RouteSpec::default()
        })
    }

    /// The upstream settings the flags give.
    fn upstream_flags(&self) -> UpstreamSpec {
        UpstreamSpec {
            url: self.upstream.clone(),
            timeout_secs: self.upstream_timeout.map(Secs),
            ca_file: self.upstream_ca_file.clone(),
            host: self.host.as_deref().map(|h| match h {
                "upstream" => HostSpec::Upstream,
                _ => HostSpec::Keep,
            }),
        }
    }

    /// The settings of the flags over the file.
    fn settings(&self) -> Result<Settings, CliError> {
        let file = match &self.config {
            Some(path) => ProxyFile::read(path).map_err(|e| CliError::Usage(e.to_string()))?,
            None => ProxyFile::default(),
        };
        Settings::resolve(&file, &self.route_flags()?, &self.upstream_flags())
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
    let service = Use::Service {
        migrate: args.migrate,
        purge_every: args.purge_every,
    };
    let opened = store::open(&args.store, service).await?;
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
