//! Tombstones: what is left of a completed key once its retention ends, on routes that
//! refuse such a key rather than run it again ([`crate::AfterRetention::Refuse`]).
//!
//! A tombstone is an ordinary record of the store, under the key's own key in a scope of
//! its own ([`id`]), written after the completion and kept `retention + tombstone` from
//! then, so it outlives the completed record by `tombstone`. It holds the request's
//! fingerprint and when the work completed (milliseconds since the Unix epoch, as its
//! body), and no response. Being a record, it expires, is purged and is counted like one,
//! on every store, with no store of its own knowing about it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::{RecordId, Scope};
use crate::record::{Completion, FencingToken, RecordState, Response};
use crate::store::{Begin, BeginRequest, Store};
use crate::telemetry::Instrumented;

/// The record holding `id`'s tombstone: the same key, in the reserved scope
/// `U+0001 "tombstone:" scope U+0001` ([`Scope::reserved`]), which no caller's scope can
/// equal. A scope too long for that is named by its digest instead (`"tombstone#" hex`,
/// which no `"tombstone:"` name can equal either).
pub fn id(id: &RecordId) -> RecordId {
    let scope = id.scope().as_str();
    let reserved = Scope::reserved(&format!("tombstone:{scope}")).unwrap_or_else(|_| {
        let digest = Fingerprint::of_bytes(scope.as_bytes()).to_hex();
        Scope::reserved(&format!("tombstone#{digest}")).expect("a digest fits in a scope")
    });
    RecordId::new(reserved, id.key().clone())
}

/// Writes `id`'s tombstone, kept for `ttl`. A tombstone already there (the key completed
/// again after a release, or a second writer) is left as it is.
pub(crate) async fn write(
    calls: &Instrumented,
    id: &RecordId,
    fingerprint: Fingerprint,
    ttl: Duration,
) -> Result<()> {
    let tomb = self::id(id);
    let req = BeginRequest {
        id: &tomb,
        fingerprint,
        token: FencingToken::random(),
        lease: Duration::from_secs(10),
        retention: ttl,
    };
    let lease = match calls.begin(req).await? {
        Begin::Acquired(lease) | Begin::TookOver(lease) => lease,
        _ => return Ok(()),
    };
    let completed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let stone = Completion::succeeded(Response::new(0, completed.to_string()));
    calls.complete(&lease, &stone, ttl).await
}

/// When `id` completed, if its tombstone is kept.
pub(crate) async fn find(calls: &Instrumented, id: &RecordId) -> Result<Option<SystemTime>> {
    let Some(record) = calls.get(&self::id(id)).await? else {
        return Ok(None);
    };
    let RecordState::Completed(stone) = record.state else {
        // Being written: the key completed a moment ago.
        return Ok(Some(SystemTime::now()));
    };
    let millis = std::str::from_utf8(&stone.response.body)
        .ok()
        .and_then(|text| text.parse::<u64>().ok())
        .ok_or_else(|| {
            Error::corrupt(
                calls.name(),
                "a tombstone's completion time is not a number",
            )
        })?;
    Ok(Some(UNIX_EPOCH + Duration::from_millis(millis)))
}
