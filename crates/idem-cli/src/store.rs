//! Store URLs: which backend `--store` names, and opening it with [`idemkit::connect`].

use std::fmt;
use std::sync::Arc;

use idem_core::url::{redact, scrub};
use idem_core::{Error, Store};

use crate::CliError;

/// A parsed `--store` value.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreUrl {
    /// `memory`: the in-memory store of this process.
    Memory,
    /// `redis://...`, `rediss://...`, `unix://...` (one server) or `redis+cluster://...`.
    Redis(String),
    /// `postgres://...` or `postgresql://...`.
    Postgres(String),
    /// `tiered:<redis URL>|<postgres URL>`: Redis first, PostgreSQL the arbiter.
    Tiered(String),
}

impl StoreUrl {
    /// Reads a `--store` value.
    ///
    /// # Errors
    ///
    /// [`CliError::Usage`] for an unknown scheme.
    pub fn parse(url: &str) -> Result<Self, CliError> {
        let url = url.trim();
        let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
        match scheme.to_ascii_lowercase().as_str() {
            tiered if tiered.starts_with("tiered:") => Ok(Self::Tiered(url.to_owned())),
            "memory" | "memory:" | "mem" => Ok(Self::Memory),
            "redis" | "rediss" | "unix" | "redis+cluster" | "rediss+cluster" => {
                Ok(Self::Redis(url.to_owned()))
            }
            "postgres" | "postgresql" => Ok(Self::Postgres(url.to_owned())),
            _ => Err(CliError::Usage(format!(
                "unknown store {:?}: use memory, redis://HOST:PORT, \
                 redis+cluster://HOST:PORT[,HOST:PORT...], postgres://USER@HOST/DB or \
                 tiered:REDIS_URL|POSTGRES_URL",
                redact(url)
            ))),
        }
    }

    /// Opens the store with [`idemkit::connect`]: Redis and PostgreSQL are reached (and
    /// PostgreSQL's schema migrated) before this returns, so a wrong URL fails here rather
    /// than at the first request.
    ///
    /// # Errors
    ///
    /// [`CliError::Usage`] for a URL the backend refuses; [`CliError::Open`] when the
    /// store cannot be reached or fails. Neither carries the URL's password.
    pub async fn open(&self) -> Result<Arc<dyn Store>, CliError> {
        let url = match self {
            Self::Memory => "memory",
            Self::Redis(url) | Self::Postgres(url) | Self::Tiered(url) => url.as_str(),
        };
        idemkit::connect(url).await.map_err(|e| {
            // Drivers may quote the URL they were given: never let its password through.
            let detail = scrub(&e.to_string(), url);
            match e {
                Error::Invalid(_) => CliError::Usage(format!("cannot open store {self}: {detail}")),
                _ => CliError::Open(format!("cannot open store {self}: {detail}")),
            }
        })
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Memory => f.write_str("memory"),
            // Never print credentials a URL may carry.
            Self::Redis(url) | Self::Postgres(url) | Self::Tiered(url) => f.write_str(&redact(url)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_urls() {
        assert_eq!(StoreUrl::parse("memory").unwrap(), StoreUrl::Memory);
        assert_eq!(StoreUrl::parse("memory://").unwrap(), StoreUrl::Memory);
        assert!(matches!(
            StoreUrl::parse("redis://127.0.0.1:6379"),
            Ok(StoreUrl::Redis(_))
        ));
        assert!(matches!(
            StoreUrl::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001"),
            Ok(StoreUrl::Redis(_))
        ));
        assert!(matches!(
            StoreUrl::parse("postgresql://u@h/db"),
            Ok(StoreUrl::Postgres(_))
        ));
        assert!(matches!(
            StoreUrl::parse("tiered:redis://h:6379|postgres://u@h/db"),
            Ok(StoreUrl::Tiered(_))
        ));
        assert!(matches!(
            StoreUrl::parse("mysql://x"),
            Err(CliError::Usage(_))
        ));
        assert!(matches!(StoreUrl::parse(""), Err(CliError::Usage(_))));
    }

    #[test]
    fn urls_print_without_secrets() {
        let url = StoreUrl::parse("postgres://app:hunter2@db:5432/pay").unwrap();
        assert_eq!(url.to_string(), "postgres://app:***@db:5432/pay");
        let url = StoreUrl::parse("redis://:hunter2@127.0.0.1:6379/0").unwrap();
        assert_eq!(url.to_string(), "redis://:***@127.0.0.1:6379/0");
        let url = StoreUrl::parse("redis://127.0.0.1:6379/0").unwrap();
        assert_eq!(url.to_string(), "redis://127.0.0.1:6379/0");
        let url = StoreUrl::parse("tiered:redis://:pw1@r:6379|postgres://app:pw2@db/pay").unwrap();
        assert_eq!(
            url.to_string(),
            "tiered:redis://:***@r:6379|postgres://app:***@db/pay"
        );
        let Err(CliError::Usage(msg)) = StoreUrl::parse("mysql://root:hunter2@db/x") else {
            panic!("mysql is no store")
        };
        assert!(!msg.contains("hunter2"), "{msg}");
    }

    #[tokio::test]
    async fn opening_an_unreachable_store_names_it_without_its_password() {
        // Port 1 on loopback: nothing listens there.
        let url = StoreUrl::parse("redis://:hunter2@127.0.0.1:1").unwrap();
        let Err(CliError::Open(msg)) = url.open().await else {
            panic!("nothing listens on port 1")
        };
        assert!(msg.contains("redis://:***@127.0.0.1:1"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }
}
