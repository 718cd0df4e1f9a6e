//! The operator commands: `inspect`, `evict`, `stats`.

use std::fmt::Write as _;
use std::time::Duration;

use idem_core::{CompletionKind, Record, RecordId, RecordState, Scope, Store};

use crate::CliError;

/// Reads one record and renders it, human-readable or as JSON.
///
/// # Errors
///
/// [`CliError::NotFound`] when the record is absent or expired; store errors.
pub async fn inspect(store: &dyn Store, id: &RecordId, json: bool) -> Result<String, CliError> {
    let record = store
        .get(id)
        .await?
        .ok_or_else(|| CliError::NotFound(format!("no record for {}", describe(id))))?;
    Ok(if json {
        let mut doc = record_json(&record).to_string();
        doc.push('\n');
        doc
    } else {
        record_text(&record)
    })
}

/// Deletes one record whatever its state.
///
/// # Errors
///
/// [`CliError::NotFound`] when there was none; store errors.
pub async fn evict(store: &dyn Store, id: &RecordId, json: bool) -> Result<String, CliError> {
    if !store.evict(id).await? {
        return Err(CliError::NotFound(format!(
            "no record for {}",
            describe(id)
        )));
    }
    Ok(if json {
        format!(
            "{}\n",
            serde_json::json!({
                "evicted": true,
                "scope": id.scope().as_str(),
                "key": id.key().as_str(),
            })
        )
    } else {
        format!("evicted {}\n", describe(id))
    })
}

/// Counts records by state; in-progress records whose lease expired more than
/// `stuck_after` ago are the "stuck" alarm.
///
/// # Errors
///
/// Store errors, [`idem_core::Error::Unsupported`] included.
pub async fn stats(
    store: &dyn Store,
    scope: Option<&Scope>,
    stuck_after: Duration,
    json: bool,
) -> Result<String, CliError> {
    let stats = store.stats(scope, stuck_after).await?;
    Ok(if json {
        format!(
            "{}\n",
            serde_json::json!({
                "scope": scope.map(Scope::as_str),
                "in_flight": stats.in_flight,
                "expired_leases": stats.expired_leases,
                "stuck": stats.stuck,
                "stuck_after_ms": millis(stuck_after),
                "succeeded": stats.succeeded,
                "failed": stats.failed,
            })
        )
    } else {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "scope           {}",
            scope.map_or("(all)", |s| if s.as_str().is_empty() {
                "(global)"
            } else {
                s.as_str()
            })
        );
        let _ = writeln!(out, "in flight       {}", stats.in_flight);
        let _ = writeln!(out, "expired leases  {}", stats.expired_leases);
        let _ = writeln!(
            out,
            "stuck           {} (lease expired over {} ago, no retry came){}",
            stats.stuck,
            human(stuck_after),
            if stats.stuck > 0 { "  <- ALARM" } else { "" }
        );
        let _ = writeln!(out, "succeeded       {}", stats.succeeded);
        let _ = writeln!(out, "failed          {}", stats.failed);
        out
    })
}

fn describe(id: &RecordId) -> String {
    if id.scope().as_str().is_empty() {
        format!("key {:?} (global scope)", id.key().as_str())
    } else {
        format!(
            "key {:?} in scope {:?}",
            id.key().as_str(),
            id.scope().as_str()
        )
    }
}

fn record_json(record: &Record) -> serde_json::Value {
    let mut doc = serde_json::json!({
        "scope": record.id.scope().as_str(),
        "key": record.id.key().as_str(),
        "fingerprint": record.fingerprint.to_hex(),
        "attempt": record.attempt,
        "expires_in_ms": millis(record.expires_in),
    });
    match &record.state {
        RecordState::InProgress {
            token,
            lease_remaining,
        } => {
            doc["state"] = "in_progress".into();
            doc["lease"] = serde_json::json!({
                "token": token.to_string(),
                "remaining_ms": millis(*lease_remaining),
                "expired": lease_remaining.is_zero(),
            });
        }
        RecordState::Completed(completion) => {
            doc["state"] = "completed".into();
            let response = &completion.response;
            doc["completion"] = serde_json::json!({
                "kind": kind(completion.kind),
                "status": response.status,
                "headers": response
                    .headers
                    .iter()
                    .map(|(n, v)| serde_json::json!([n, String::from_utf8_lossy(v)]))
                    .collect::<Vec<_>>(),
                "body_bytes": response.body.len(),
                "body": String::from_utf8_lossy(&response.body),
            });
        }
    }
    doc
}

fn record_text(record: &Record) -> String {
    let mut out = String::new();
    let scope = record.id.scope().as_str();
    let _ = writeln!(
        out,
        "scope        {}",
        if scope.is_empty() { "(global)" } else { scope }
    );
    let _ = writeln!(out, "key          {}", record.id.key().as_str());
    match &record.state {
        RecordState::InProgress {
            token,
            lease_remaining,
        } => {
            let _ = writeln!(out, "state        in progress");
            if lease_remaining.is_zero() {
                let _ = writeln!(
                    out,
                    "lease        {token}, expired (the next request takes it over)"
                );
            } else {
                let _ = writeln!(
                    out,
                    "lease        {token}, {} left",
                    human(*lease_remaining)
                );
            }
        }
        RecordState::Completed(completion) => {
            let response = &completion.response;
            let _ = writeln!(
                out,
                "state        completed ({}, status {})",
                kind(completion.kind),
                response.status
            );
            for (name, value) in &response.headers {
                let _ = writeln!(
                    out,
                    "header       {name}: {}",
                    String::from_utf8_lossy(value)
                );
            }
            let body = String::from_utf8_lossy(&response.body);
            let shown: String = body.chars().take(200).collect();
            let more = if shown.len() < body.len() { " ..." } else { "" };
            let _ = writeln!(
                out,
                "body         {} bytes: {shown}{more}",
                response.body.len()
            );
        }
    }
    let _ = writeln!(out, "attempt      {}", record.attempt);
    let _ = writeln!(out, "expires in   {}", human(record.expires_in));
    let _ = writeln!(out, "fingerprint  {}", record.fingerprint.to_hex());
    out
}

fn kind(kind: CompletionKind) -> &'static str {
    match kind {
        CompletionKind::Succeeded => "succeeded",
        CompletionKind::Failed => "failed",
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `1h02m03s`, `4m05s`, `6.5s`.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 3600 {
        format!("{}h{:02}m{:02}s", secs / 3600, secs % 3600 / 60, secs % 60)
    } else if secs >= 60 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Begin, Fingerprint, Idem, Key, MemoryStore, Response, Scope};

    fn id(key: &str) -> RecordId {
        RecordId::new(Scope::new("alice").unwrap(), Key::new(key).unwrap())
    }

    #[tokio::test]
    async fn inspect_and_evict_over_a_store() {
        let store = MemoryStore::new();
        let idem = Idem::new(store.clone());
        let fp = Fingerprint::of_bytes(b"req");

        let Begin::Acquired(lease) = idem.begin(&id("k1"), fp).await.unwrap() else {
            panic!("fresh key")
        };
        let text = inspect(&store, &id("k1"), false).await.unwrap();
        assert!(text.contains("state        in progress"), "{text}");
        assert!(text.contains(&lease.token().to_string()), "{text}");
        assert!(text.contains("attempt      1"), "{text}");

        let response =
            Response::new(201, r#"{"id":"pay_1"}"#).with_header("content-type", "application/json");
        idem.complete(&lease, response).await.unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&inspect(&store, &id("k1"), true).await.unwrap()).unwrap();
        assert_eq!(doc["state"], "completed");
        assert_eq!(doc["scope"], "alice");
        assert_eq!(doc["completion"]["status"], 201);
        assert_eq!(doc["completion"]["body"], r#"{"id":"pay_1"}"#);
        assert_eq!(doc["completion"]["headers"][0][0], "content-type");
        assert_eq!(doc["fingerprint"], fp.to_hex());
        let expires = doc["expires_in_ms"].as_u64().unwrap();
        assert!(expires > 23 * 3600 * 1000 && expires <= 24 * 3600 * 1000);

        assert!(matches!(
            inspect(&store, &id("absent"), false).await,
            Err(CliError::NotFound(_))
        ));
        assert_eq!(
            evict(&store, &id("k1"), false).await.unwrap(),
            "evicted key \"k1\" in scope \"alice\"\n"
        );
        assert!(matches!(
            evict(&store, &id("k1"), false).await,
            Err(CliError::NotFound(_))
        ));
        // Evicted: the key runs again.
        assert!(matches!(
            idem.begin(&id("k1"), fp).await.unwrap(),
            Begin::Acquired(_)
        ));
    }

    #[tokio::test]
    async fn stats_over_a_store() {
        let store = MemoryStore::new();
        let idem = Idem::new(store.clone());
        let fp = Fingerprint::of_bytes(b"req");
        let Begin::Acquired(_held) = idem.begin(&id("k1"), fp).await.unwrap() else {
            panic!("fresh key")
        };
        let Begin::Acquired(done) = idem.begin(&id("k2"), fp).await.unwrap() else {
            panic!("fresh key")
        };
        idem.complete(&done, Response::new(201, "ok"))
            .await
            .unwrap();
        let scope = Scope::new("alice").unwrap();
        let text = stats(&store, Some(&scope), Duration::from_secs(300), false)
            .await
            .unwrap();
        assert!(text.contains("in flight       1"), "{text}");
        assert!(text.contains("succeeded       1"), "{text}");
        assert!(!text.contains("ALARM"), "{text}");
        let doc: serde_json::Value = serde_json::from_str(
            &stats(&store, None, Duration::from_secs(300), true)
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(doc["in_flight"], 1);
        assert_eq!(doc["stuck"], 0);
        assert_eq!(doc["scope"], serde_json::Value::Null);
    }

    #[test]
    fn durations() {
        assert_eq!(human(Duration::from_millis(6500)), "6.5s");
        assert_eq!(human(Duration::from_secs(245)), "4m05s");
        assert_eq!(human(Duration::from_secs(3723)), "1h02m03s");
    }
}
