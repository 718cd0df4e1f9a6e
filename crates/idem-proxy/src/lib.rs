//! # idem-proxy
//!
//! An idempotency gateway: a reverse proxy that puts idem's whole `Idempotency-Key`
//! promise in front of any HTTP service, in any language, with no change to the service.
//! It is the tower middleware of `idem-http` ([`idem_http::IdempotencyLayer`]) wrapped
//! around a service that forwards to the upstream ([`Forward`]): the guarded path is the
//! layer's, with nothing written twice. The `idem proxy` command runs it.
//!
//! Routes ([`Route`]), forwarding by RFC 9110 ([`HostHeader`], the [`ATTEMPT`] header) and
//! what becomes of a key when the outcome is unknown ([`idem_http::KeepInFlight`]): the guide's
//! chapter docs/proxy.md. The settings of `idem proxy`, read from its routes file and its
//! flags alike: [`ProxyFile`], [`UpstreamSpec`] and [`RouteSpec`] (which are `clap::Args`),
//! resolved into [`Settings`].
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use idem_core::MemoryStore;
//! use idem_proxy::{serve, Proxy, Route, UpstreamConfig};
//!
//! let upstream = UpstreamConfig::new("http://127.0.0.1:3000")?;
//! let proxy = Proxy::new(Arc::new(MemoryStore::new()), &upstream, vec![Route::default()])?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! serve(listener, proxy, std::future::pending(), std::time::Duration::from_secs(30)).await;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod config;
mod forward;
mod route;
mod server;

pub use config::{ProxyFile, RouteSpec, Secs, Settings, UpstreamSpec};
pub use forward::{Forward, HostHeader, ProxyBody, UpstreamConfig, UpstreamFailure, ATTEMPT};
pub use route::{scope_of, Proxy, Route};
pub use server::{serve, serve_admin, Drained};

/// Why a proxy could not be set up.
#[derive(Debug)]
#[non_exhaustive]
pub enum ProxyError {
    /// A setting is wrong: the message names it and what is expected.
    Config(String),
}

impl std::fmt::Display for ProxyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Config(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ProxyError {}
