//! The `memory` phase: what one stored record costs the in-memory store, in resident memory.
//!
//! It fills a fresh [`MemoryStore`] with completed records shaped like the demo's payments
//! (a JSON body of `--body-bytes`, each in its own buffer as a real response's is, and the
//! demo's two headers: `content-type` and a `location` naming the new payment) and divides
//! the growth of the process's resident set (`VmRSS`) by the record count. Run it first,
//! or alone, in its process: memory that earlier phases freed would be reused and hide part
//! of the cost (`measure` runs it before any other phase).

use std::time::{Duration, Instant};

use bytes::Bytes;
use idemkit::{
    Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, MemoryCapacity, MemoryStore,
    RecordId, Response, Scope, Store,
};

use crate::report::{Figure, PhaseReport, Target};

/// The resident set of a record before the compact layout: 1,012 B with a 155 B body and
/// 200,000 keys, measured by this phase on the layout of commit 220b1ca (a map of ids to
/// entries, and a second copy of each id in a `BTreeMap` expiry index). The target is half.
const BEFORE: f64 = 1012.0;

/// The process's resident set in bytes, from `/proc/self/status`.
fn rss() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("the memory phase reads /proc/self/status (Linux only): {e}"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "no VmRSS line in /proc/self/status".into())
}

/// Stores `n` completed records with a `body_bytes` body each; returns the phase (one
/// operation = begin + complete) and the figures: resident bytes per record, and beyond
/// its body.
pub async fn run(n: usize, body_bytes: usize) -> Result<(PhaseReport, Vec<Figure>), String> {
    // Room for every record: the phase measures the layout, not the bound.
    let store = MemoryStore::new().with_capacity(
        MemoryCapacity::default()
            .with_records(n.saturating_mul(2))
            .with_bytes(usize::MAX),
    );
    let scope = Scope::new("bench-memory").map_err(|e| e.to_string())?;
    let lease = Duration::from_secs(30);
    let retention = Duration::from_secs(24 * 3600);
    let before = rss()?;
    let started = Instant::now();
    for i in 0..n {
        // A UUID-shaped key, as clients send them.
        let key = format!("{:08x}-0000-4000-8000-{:012x}", i, i.wrapping_mul(7919));
        let id = RecordId::new(scope.clone(), Key::new(key).map_err(|e| e.to_string())?);
        let req = BeginRequest {
            id: &id,
            fingerprint: Fingerprint::of_bytes(&i.to_le_bytes()),
            token: FencingToken::random(),
            lease,
            retention,
        };
        let Begin::Acquired(held) = store.begin(req).await.map_err(|e| e.to_string())? else {
            return Err(format!("record {i}: a fresh key was not acquired"));
        };
        let response = Response::new(201, Bytes::from(vec![b'x'; body_bytes]))
            .with_header("content-type", "application/json")
            .with_header("location", format!("/payments/pay_{i:016x}"));
        store
            .complete(&held, &Completion::succeeded(response), retention)
            .await
            .map_err(|e| e.to_string())?;
    }
    let elapsed = started.elapsed();
    let grown = rss()?.saturating_sub(before) as f64;
    if store.len() != n {
        return Err(format!("{} records held, {n} stored", store.len()));
    }
    let per_record = grown / n.max(1) as f64;
    let basis =
        format!("VmRSS growth over {n} completed records of a {body_bytes} B body and 2 headers");
    let figures = vec![
        Figure::new(
            "memory store: RSS per record",
            per_record,
            "B",
            basis.clone(),
        )
        .target(Target::AtMost(BEFORE / 2.0)),
        Figure::new(
            "memory store: RSS per record beyond its body",
            per_record - body_bytes as f64,
            "B",
            basis,
        ),
    ];
    let mut phase = PhaseReport::new(
        "memory footprint",
        1,
        elapsed,
        Vec::new(),
        Default::default(),
    );
    phase.set_ops(n);
    // Kept until here, so nothing was freed before the second reading.
    drop(store);
    Ok((phase, figures))
}
