//! The guide's quick start: one request under an idempotency key, then its retry.
//! Run it: cargo run -p idem-examples --example first_request
use idemkit::{Begin, Fingerprint, Idem, Key, MemoryStore, RecordId, Response, Scope};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let idem = Idem::new(MemoryStore::new());
    let id = RecordId::new(Scope::new("customer-42")?, Key::new("7c1e-charge")?);
    let body = br#"{"amount":1250,"currency":"EUR"}"#;

    for attempt in ["first call", "retry"] {
        let response = match idem.begin(&id, Fingerprint::of_bytes(body)).await? {
            Begin::Acquired(lease) | Begin::TookOver(lease) => {
                let response = Response::new(201, r#"{"charge":"ch_1"}"#); // charge the card, once
                idem.complete(&lease, response.clone()).await?; // fenced by the lease
                response
            }
            Begin::Replay(replay) => replay.completion.response, // a retry: the original
            Begin::InFlight { retry_after } => {
                Response::new(409, format!("retry in {retry_after:?}"))
            }
            Begin::Mismatch => Response::new(422, "key reused with a different request"),
            Begin::Expired { .. } => Response::new(410, "key expired: its result was forgotten"),
        };
        let body = String::from_utf8_lossy(&response.body);
        println!("{attempt}: {} {body}", response.status);
    }
    Ok(())
}
