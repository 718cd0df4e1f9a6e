//! Opening the store `--store` names ([`StoreUrl`], idem-core's one parser of store URLs)
//! with [`idemkit::connect_url`], with errors that name it without its password.

use std::sync::Arc;

use idem_core::url::StoreUrl;
use idem_core::{Error, Store};

use crate::CliError;

/// Reads a `--store` value.
///
/// # Errors
///
/// [`CliError::Usage`] for an unknown scheme (the message names what is accepted).
pub fn parse(url: &str) -> Result<StoreUrl, CliError> {
    StoreUrl::parse(url).map_err(|e| CliError::Usage(e.to_string()))
}

/// Opens the store: Redis and PostgreSQL are reached (and PostgreSQL's schema migrated)
/// before this returns, so a wrong URL fails here rather than at the first request.
///
/// # Errors
///
/// [`CliError::Usage`] for a URL the backend refuses; [`CliError::Open`] when the store
/// cannot be reached or fails. Neither carries the URL's password.
pub async fn open(url: &StoreUrl) -> Result<Arc<dyn Store>, CliError> {
    idemkit::connect_url(url)
        .await
        .map_err(|e| open_error(url, e))
}

/// The error of opening the store `url` names: [`CliError::Usage`] for a URL the backend
/// refuses, [`CliError::Open`] otherwise; the message names the store without its password.
pub fn open_error(url: &StoreUrl, e: Error) -> CliError {
    // Drivers may quote the URL they were given: never let its password through.
    let detail = url.scrub(&e.to_string());
    match e {
        Error::Invalid(_) => CliError::Usage(format!("cannot open store {url}: {detail}")),
        _ => CliError::Open(format!("cannot open store {url}: {detail}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_schemes_are_usage_errors_without_the_password() {
        assert_eq!(parse("memory").unwrap(), StoreUrl::Memory);
        for bad in ["mysql://root:hunter2@db/x", ""] {
            let Err(CliError::Usage(msg)) = parse(bad) else {
                panic!("{bad:?} is no store")
            };
            assert!(!msg.contains("hunter2"), "{msg}");
        }
    }

    #[tokio::test]
    async fn opening_an_unreachable_store_names_it_without_its_password() {
        // Port 1 on loopback: nothing listens there.
        let url = parse("redis://:hunter2@127.0.0.1:1").unwrap();
        let Err(CliError::Open(msg)) = open(&url).await else {
            panic!("nothing listens on port 1")
        };
        assert!(msg.contains("redis://:***@127.0.0.1:1"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }
}
