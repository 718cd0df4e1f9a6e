//! Store URLs: which backend `--store` names, and opening it.

use std::fmt;
use std::sync::Arc;

use idem_core::{MemoryStore, Store};

use crate::CliError;

/// A parsed `--store` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory`: the in-memory store of this process.
    Memory,
    /// `redis://...` or `rediss://...`.
    Redis(String),
    /// `postgres://...` or `postgresql://...`.
    Postgres(String),
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
            "memory" | "memory:" | "mem" => Ok(Self::Memory),
            "redis" | "rediss" => Ok(Self::Redis(url.to_owned())),
            "postgres" | "postgresql" => Ok(Self::Postgres(url.to_owned())),
            _ => Err(CliError::Usage(format!(
                "unknown store {url:?}: use memory, redis://HOST:PORT or postgres://USER@HOST/DB"
            ))),
        }
    }

    /// The backend's name.
    pub fn backend(&self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Redis(_) => "redis",
            Self::Postgres(_) => "postgres",
        }
    }

    /// Opens the store.
    ///
    /// # Errors
    ///
    /// [`CliError::Unsupported`] for a backend not built into this binary.
    pub async fn open(&self) -> Result<Arc<dyn Store>, CliError> {
        match self {
            Self::Memory => Ok(Arc::new(MemoryStore::new())),
            Self::Redis(_) | Self::Postgres(_) => Err(CliError::Unsupported(format!(
                "store backend {} not built in yet: this build of idem has the memory store only",
                self.backend()
            ))),
        }
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Memory => f.write_str("memory"),
            // Never print credentials a URL may carry.
            Self::Redis(url) | Self::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

/// `scheme://user:secret@host/...` without the secret.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}{path}")
            } else {
                format!("{scheme}://{user}@{host}{path}")
            }
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_urls() {
        assert_eq!(StoreUrl::parse("memory").unwrap(), StoreUrl::Memory);
        assert_eq!(StoreUrl::parse("memory://").unwrap(), StoreUrl::Memory);
        assert_eq!(
            StoreUrl::parse("redis://127.0.0.1:6379").unwrap().backend(),
            "redis"
        );
        assert_eq!(
            StoreUrl::parse("postgresql://u@h/db").unwrap().backend(),
            "postgres"
        );
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
        let url = StoreUrl::parse("redis://127.0.0.1:6379/0").unwrap();
        assert_eq!(url.to_string(), "redis://127.0.0.1:6379/0");
    }
}
