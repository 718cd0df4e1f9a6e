//! An idempotent RabbitMQ consumer: each payment is charged once, however many times its
//! message is published or delivered.
//!
//! ```text
//! cargo run -p idem-consumer --features rabbitmq --example consumer
//! ```
//!
//! It connects to `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), publishes
//! five messages for three payments (a publisher that retried sends a payment twice, with
//! the same `x-idempotency-key` as the HTTP request that created it), consumes them until
//! they are all settled or Ctrl-C, prints what happened, and deletes its queues.

mod shared;

use std::time::Duration;

use idem_consumer::rabbitmq::{with_idempotency_key, Topology, Worker};
use idem_core::Key;
use lapin::options::ConfirmSelectOptions;
use lapin::{BasicProperties, Connection, ConnectionProperties};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    // payments, payments.retry (backoff before a retry) and payments.dead (dead letters).
    let topology = Topology::for_queue(format!("idem-example-payments-{}", std::process::id()))
        .with_expires(Duration::from_secs(600));
    topology.declare(&channel).await?;

    // The request's idempotency key travels in a header (see `shared::PAYMENTS`).
    for (key, amount) in shared::PAYMENTS {
        let properties = with_idempotency_key(BasicProperties::default(), &Key::new(key)?, None);
        let payload = shared::payment(amount);
        topology
            .publish(&channel, payload.as_bytes(), properties)
            .await?;
    }

    let summary = Worker::new(shared::consumer()?, topology.clone())
        .run(&conn, shared::charge, shared::stop())
        .await?;
    shared::report(&summary, "deliveries acked");
    topology.delete(&channel).await?;
    Ok(())
}
