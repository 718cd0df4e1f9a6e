//! The guide's complete axum handler: a payment and its idempotency record committed in one
//! PostgreSQL transaction. Run it next to a PostgreSQL server:
//!   DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run -p idem-examples --example axum_payments
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idemkit::http::{IdempotencyLayer, LeaseHandle};
use idemkit::postgres::PgStore;
use idemkit::{Error, Idem};

async fn create_payment(
    State(store): State<PgStore>,
    lease: LeaseHandle, // the request's lease, from the layer
    Json(order): Json<serde_json::Value>,
) -> Result<Response, StatusCode> {
    let unavailable = |e: sqlx::Error| {
        eprintln!("payment not made: {e}");
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut tx = store.pool().begin().await.map_err(unavailable)?;
    let id: i64 = sqlx::query_scalar("INSERT INTO payments (amount) VALUES ($1) RETURNING id")
        .bind(order["amount"].as_i64())
        .fetch_one(&mut *tx)
        .await
        .map_err(unavailable)?; // the business write

    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let body = format!(r#"{{"payment":{id}}}"#);
    let completion = lease.completion(StatusCode::CREATED, &headers, body.clone());
    match store
        .complete_in(&mut tx, lease.lease(), &completion, lease.retention())
        .await
    {
        Ok(()) => {}
        Err(Error::LeaseLost) => return Err(StatusCode::CONFLICT), // taken over: tx rolls back
        Err(e) => {
            eprintln!("payment rolled back: {e}");
            return Err(StatusCode::SERVICE_UNAVAILABLE);
        }
    }
    tx.commit().await.map_err(unavailable)?; // the payment and its record, both or neither
    lease.committed(&completion); // the layer stores nothing more
    Ok((StatusCode::CREATED, headers, body).into_response())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?; // postgres://USER@HOST/DB
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".into());

    let store = PgStore::connect(&url).await?;
    store.migrate().await?; // idem's own schema, `idem`
    sqlx::query("CREATE TABLE IF NOT EXISTS payments (id BIGSERIAL PRIMARY KEY, amount BIGINT)")
        .execute(store.pool())
        .await?; // the business table

    let layer =
        IdempotencyLayer::new(Idem::new(store.clone())).with_scope(idemkit::http::bearer_scope);
    let app: Router = Router::new()
        .route("/payments", post(create_payment))
        .layer(layer)
        .with_state(store);
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
