//! For tests: the store's calls as it sends them again after a dropped connection, so that
//! a test can check that a call sent twice counts once. Not part of the API. (Throwaway
//! Redis and Valkey servers are `idem_testkit::redis`'s and `idem_testkit::valkey`'s.)

use std::time::Duration;

use idem_core::{Completion, Error, Lease};

use crate::RedisStore;

/// `complete` as the store sends it again after its connection dropped: it also succeeds
/// when the record already holds this completion.
///
/// # Errors
///
/// As [`idem_core::Store::complete`].
pub async fn complete_resent(
    store: &RedisStore,
    lease: &Lease,
    completion: &Completion,
    ttl: Duration,
) -> Result<(), Error> {
    let encoded = crate::codec::encode_completion(completion, &store.config().body)?;
    let key = store.record_key(lease.id());
    let mut conn = store.ready().await?;
    store
        .complete_on(&mut conn, &key, lease, &encoded, ttl, true)
        .await
}

/// `release` as the store sends it again after its connection dropped: it also succeeds
/// when the record is absent.
///
/// # Errors
///
/// As [`idem_core::Store::release`].
pub async fn release_resent(store: &RedisStore, lease: &Lease) -> Result<(), Error> {
    let key = store.record_key(lease.id());
    let mut conn = store.ready().await?;
    store.release_on(&mut conn, &key, lease, true).await
}
