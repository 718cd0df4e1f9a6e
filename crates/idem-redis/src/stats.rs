//! [`idem_core::Store::stats`] on Redis: `SCAN` every primary for the store's keys, read
//! each record's head, and count by state against the server's clock.
//!
//! An operator's tool, not a hot path: it costs one `SCAN` page plus one pipelined round
//! trip per page of up to [`PAGE`] keys, on every primary. It is not a snapshot: records
//! that change while it runs may be counted in their old or new state, or missed.

use std::time::Duration;

use idem_core::{CompletionKind, Error, Scope, Stats};
use redis::Value;

use crate::codec::{self, Head, IN_PROGRESS_LEN};
use crate::connection::Conn;
use crate::error::unexpected;

/// Keys asked for per `SCAN` step.
const PAGE: usize = 1000;

/// Counts the records under `prefix` (in `scope`, or all of them).
pub(crate) async fn stats(
    conn: &mut Conn,
    prefix: &str,
    scope: Option<&Scope>,
    stuck_after: Duration,
) -> Result<Stats, Error> {
    let pattern = pattern(prefix, scope);
    let stuck_after = i64::try_from(stuck_after.as_millis()).unwrap_or(i64::MAX);
    let mut stats = Stats::default();
    for node in conn.primaries().await? {
        let mut cursor = 0u64;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(PAGE);
            let reply = conn.on_node(&node, scan).await?;
            let (next, keys): (u64, Vec<Vec<u8>>) =
                redis::from_redis_value(reply.clone()).map_err(|_| unexpected("SCAN", &reply))?;
            if !keys.is_empty() {
                // The clock, every head and its time to live in one round trip (a lease's
                // deadline is the key's expiry minus the margin its head holds). A
                // completed record's head holds its kind within these bytes.
                let mut pipe = redis::pipe();
                pipe.cmd("TIME");
                for key in &keys {
                    pipe.cmd("GETRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(IN_PROGRESS_LEN - 1);
                    pipe.cmd("PTTL").arg(key);
                }
                let replies = conn
                    .pipeline_on_node(&node, pipe, 2 * keys.len() + 1)
                    .await?;
                let now = server_millis(&replies[0])?;
                for pair in replies[1..].chunks_exact(2) {
                    if let [Value::BulkString(head), Value::Int(pttl)] = pair {
                        count(&mut stats, head, *pttl, now, stuck_after);
                    }
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(stats)
}

/// Adds one record's head to the counts (`pttl_ms`: the key's time to live). Heads that
/// are empty (the record expired since the scan) or not a record are skipped.
fn count(stats: &mut Stats, head: &[u8], pttl_ms: i64, now_ms: i64, stuck_after_ms: i64) {
    match codec::decode_head(head, pttl_ms, now_ms) {
        Some(Head::InProgress { lease_left_ms, .. }) => {
            if lease_left_ms > 0 {
                stats.in_flight += 1;
            } else {
                stats.expired_leases += 1;
                if -lease_left_ms > stuck_after_ms {
                    stats.stuck += 1;
                }
            }
        }
        Some(Head::Completed { kind, .. }) => match kind {
            Some(CompletionKind::Succeeded) => stats.succeeded += 1,
            Some(CompletionKind::Failed) => stats.failed += 1,
            None => {}
        },
        None => {}
    }
}

/// `TIME` as Unix milliseconds.
fn server_millis(reply: &Value) -> Result<i64, Error> {
    let (secs, micros): (i64, i64) =
        redis::from_redis_value_ref(reply).map_err(|_| unexpected("TIME", reply))?;
    Ok(secs * 1000 + micros / 1000)
}

/// The `SCAN MATCH` pattern of the store's keys: `<prefix>{????????}<scope length>:<scope>*`
/// with Redis glob characters escaped (braces are literal in Redis patterns).
fn pattern(prefix: &str, scope: Option<&Scope>) -> Vec<u8> {
    let mut out = Vec::new();
    escape(prefix.as_bytes(), &mut out);
    out.extend_from_slice(b"{????????}");
    if let Some(scope) = scope {
        let scope = scope.as_str();
        escape(format!("{}:{scope}", scope.len()).as_bytes(), &mut out);
    }
    out.push(b'*');
    out
}

fn escape(text: &[u8], out: &mut Vec<u8>) {
    for &b in text {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_escape_globs() {
        let scope = Scope::new("a*b[c]").unwrap();
        assert_eq!(
            pattern("idem:", Some(&scope)),
            b"idem:{????????}6:a\\*b\\[c\\]*".to_vec()
        );
        assert_eq!(pattern("p?", None), b"p\\?{????????}*".to_vec());
        // Scope lengths keep "ab" from matching the records of scope "a" with key "b...".
        let a = Scope::new("a").unwrap();
        assert_eq!(pattern("", Some(&a)), b"{????????}1:a*".to_vec());
    }

    #[test]
    fn counts_by_state() {
        let fp = idem_core::Fingerprint::of_bytes(b"f");
        let in_progress = codec::in_progress(&idem_core::FencingToken::random(), 1_000, &fp, 1);
        let mut stats = Stats::default();
        // A time to live of 1.5 s with a 1 s margin: 500 ms of lease left.
        count(&mut stats, &in_progress, 1_500, 0, 0);
        // 500 ms past the deadline, and 500 ms is not yet stuck at 10 s.
        count(&mut stats, &in_progress, 500, 0, 0);
        count(&mut stats, &in_progress, 500, 0, 10_000);
        let mut completed = vec![b'c'; 50];
        completed[37] = 0xc0;
        count(&mut stats, &completed, 100, 0, 0);
        completed[37] = 0x80;
        count(&mut stats, &completed, 100, 0, 0);
        count(&mut stats, b"", -2, 0, 0);
        count(&mut stats, b"garbage", 100, 0, 0);
        assert_eq!(
            stats,
            Stats::default()
                .with_in_flight(1)
                .with_expired_leases(2)
                .with_stuck(1)
                .with_succeeded(1)
                .with_failed(1)
        );
    }
}
