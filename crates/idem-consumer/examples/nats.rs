//! An idempotent NATS JetStream worker: each payment is charged once, however many times
//! its message is published or delivered.
//!
//! ```text
//! cargo run -p idem-consumer --features nats --example nats
//! ```
//!
//! It connects to `NATS_URL` (default `nats://127.0.0.1:4222`, a `nats-server -js`), publishes
//! five messages for three payments (a publisher that retried sends a payment twice, with
//! the same `x-idempotency-key` as the HTTP request that created it), consumes them for two
//! seconds or until Ctrl-C, prints what happened, and deletes its streams.

mod shared;

use idem_consumer::nats::{with_idempotency_key, Topology, Worker};
use idem_core::Key;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_string());
    let js = async_nats::jetstream::new(async_nats::connect(&url).await?);

    // Stream PAYMENTS-<pid> on subject payments-<pid>.requested, its dead-letter stream
    // (subject payments-<pid>.requested.dead) and a durable pull consumer.
    let id = std::process::id();
    let topology = Topology::new(format!("PAYMENTS-{id}"), format!("payments-{id}.requested"));
    topology.declare(&js).await?;

    // The request's idempotency key travels in a header (see `shared::PAYMENTS`).
    for (key, amount) in shared::PAYMENTS {
        let headers = with_idempotency_key(async_nats::HeaderMap::new(), &Key::new(key)?, None);
        let payload = shared::payment(amount);
        js.publish_with_headers(topology.subject.clone(), headers, payload.into())
            .await?
            .await?;
    }

    let summary = Worker::new(shared::consumer()?, topology.clone())
        .run(&js, shared::charge, shared::stop())
        .await?;
    shared::report(&summary, "messages acked");
    topology.delete(&js).await?;
    Ok(())
}
