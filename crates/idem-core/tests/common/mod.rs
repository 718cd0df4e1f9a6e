//! Test doubles the core's integration tests share.

use std::time::Duration;

use async_trait::async_trait;
use idem_core::{Begin, BeginRequest, Completion, Lease, Record, RecordId, Result, Store};

/// A store that never answers.
#[derive(Debug)]
pub struct Hang;

#[async_trait]
impl Store for Hang {
    fn name(&self) -> &'static str {
        "hang"
    }
    async fn begin(&self, _: BeginRequest<'_>) -> Result<Begin> {
        std::future::pending().await
    }
    async fn complete(&self, _: &Lease, _: &Completion, _: Duration) -> Result<()> {
        std::future::pending().await
    }
    async fn release(&self, _: &Lease) -> Result<()> {
        std::future::pending().await
    }
    async fn extend(&self, _: &Lease, _: Duration) -> Result<Lease> {
        std::future::pending().await
    }
    async fn get(&self, _: &RecordId) -> Result<Option<Record>> {
        std::future::pending().await
    }
    async fn evict(&self, _: &RecordId) -> Result<bool> {
        std::future::pending().await
    }
}
