//! The store flags of the long-running commands that serve or consume (`proxy`, `consume`).

use std::time::Duration;

use clap::Args;

use crate::args::{parse_secs, StoreArg};
use crate::error::CliError;
use crate::store::{self, Use};

/// The store, whether to migrate it, and how often to purge it.
#[derive(Debug, Args)]
pub struct ServingStore {
    #[command(flatten)]
    store: StoreArg,
    /// Apply idem's migrations at start (PostgreSQL and tiered stores).
    #[arg(long)]
    migrate: bool,
    /// On PostgreSQL and tiered stores, delete expired records every SECS.
    #[arg(long, default_value = "60", value_name = "SECS", value_parser = parse_secs)]
    purge_every: Duration,
}

impl ServingStore {
    /// Opens the store for a service ([`Use::Service`]), with these flags.
    ///
    /// # Errors
    ///
    /// As [`store::open`].
    pub async fn open(&self) -> Result<store::Opened, CliError> {
        let service = Use::Service {
            migrate: self.migrate,
            purge_every: self.purge_every,
        };
        store::open(&self.store, service).await
    }
}
