//! The quick start on the embedded in-memory store: concurrent duplicates of one request,
//! one execution, every caller handed the same result; then a retry with a different body.
//!
//! Run it with `cargo run -p idemkit --example quickstart`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::{
    Begin, Config, Fingerprint, Idem, JsonSelection, Key, MemoryStore, RecordId, Response, Scope,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Duplicates wait up to 2 s for the first caller's result instead of getting "in flight".
    let idem = Idem::new(MemoryStore::new())
        .with_config(Config::default().with_wait(Duration::from_secs(2)));
    let charges = Arc::new(AtomicUsize::new(0));
    let id = RecordId::new(Scope::new("customer-42")?, Key::new("7c1e-charge")?);
    let fingerprint = |body: &str| -> Result<Fingerprint, idemkit::JsonError> {
        Ok(Fingerprint::builder()
            .text("method", "POST")
            .text("path", "/payments")
            .json("body", body.as_bytes(), &JsonSelection::All)?
            .finish())
    };

    let mut callers = Vec::new();
    for caller in 0..8 {
        let (idem, id, charges) = (idem.clone(), id.clone(), charges.clone());
        // The same request, serialised differently by each client: same fingerprint.
        let body = if caller % 2 == 0 {
            r#"{"amount": 1250, "currency": "EUR"}"#
        } else {
            r#"{"currency":"EUR","amount":1250}"#
        };
        let fp = fingerprint(body)?;
        callers.push(tokio::spawn(async move {
            match idem.begin(&id, fp).await? {
                Begin::Acquired(lease) | Begin::TookOver(lease) => {
                    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(50)).await; // the card network
                    let response = Response::new(201, format!(r#"{{"charge":"ch_{n}"}}"#));
                    idem.complete(&lease, response.clone()).await?;
                    Ok::<_, idemkit::Error>(format!(
                        "caller {caller}: executed  -> {}",
                        show(&response)
                    ))
                }
                Begin::Replay(replay) => Ok(format!(
                    "caller {caller}: replayed  -> {}",
                    show(&replay.completion.response)
                )),
                Begin::InFlight { retry_after } => Ok(format!(
                    "caller {caller}: in flight, retry in {retry_after:?}"
                )),
                Begin::Mismatch => Ok(format!("caller {caller}: mismatch")),
                Begin::Expired { .. } => Ok(format!("caller {caller}: key expired")),
            }
        }));
    }
    for caller in callers {
        println!("{}", caller.await??);
    }
    println!(
        "the card was charged {} time(s)",
        charges.load(Ordering::SeqCst)
    );

    let other = fingerprint(r#"{"amount": 9999, "currency": "EUR"}"#)?;
    match idem.begin(&id, other).await? {
        Begin::Mismatch => println!("same key, different body: refused (mismatch)"),
        other => println!("unexpected: {other:?}"),
    }
    Ok(())
}

fn show(response: &Response) -> String {
    format!(
        "{} {}",
        response.status,
        String::from_utf8_lossy(&response.body)
    )
}
