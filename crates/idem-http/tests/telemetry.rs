//! Every guarded request reports a span and metrics, and neither gives the key away.

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_core::telemetry::KeyHash;
use idem_core::{Idem, Key, MemoryStore, RecordId, Scope};
use idem_http::IdempotencyLayer;
use idem_testkit::telemetry::{logs_of, metrics_of, FmtSpan, Level};
use metrics_util::debugging::DebugValue;
use tower_layer::Layer;
use tower_service::Service;

const KEY: &str = "secret-order-key-7";

/// The same request twice through the layer: the handler runs, then its response replays.
async fn twice() {
    let app = Router::new().route("/pay", post(|| async { (StatusCode::CREATED, "paid") }));
    let layer = IdempotencyLayer::new(Idem::new(MemoryStore::new()))
        .with_scope(|_| Some(Scope::new("tenant-a").unwrap()));
    let mut service = layer.layer(app);
    for expected in [StatusCode::CREATED, StatusCode::CREATED] {
        let request = Request::post("/pay")
            .header("idempotency-key", KEY)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
            .unwrap();
        let response = service.call(request).await.unwrap();
        assert_eq!(response.status(), expected);
    }
}

#[test]
fn requests_are_counted_by_outcome_and_the_handler_timed() {
    let mut counters = Vec::new();
    let mut handler_samples = 0;
    for (key, _, _, value) in metrics_of(twice()).into_vec() {
        let key = key.key().clone();
        let labels: Vec<String> = key.labels().map(|l| l.value().to_owned()).collect();
        match value {
            DebugValue::Counter(n) if key.name().starts_with("idem_http") && n > 0 => {
                counters.push(format!("{} {} {n}", key.name(), labels.join(",")));
            }
            DebugValue::Histogram(values) if key.name() == "idem_http_handler_duration_seconds" => {
                handler_samples += values.len();
            }
            _ => {}
        }
    }
    counters.sort();
    // Every outcome is registered (at 0) when the layer is built; two of them moved.
    assert_eq!(
        counters,
        [
            "idem_http_requests_total executed 1",
            "idem_http_requests_total replayed 1",
        ]
    );
    assert_eq!(
        handler_samples, 1,
        "the handler ran once and was timed once"
    );
}

#[test]
fn request_spans_carry_the_outcome_and_the_key_hash_only() {
    let out = logs_of(Level::INFO, FmtSpan::CLOSE, twice());
    let id = RecordId::new(Scope::new("tenant-a").unwrap(), Key::new(KEY).unwrap());
    let hash = format!("key_hash={}", KeyHash::of(&id));
    assert_eq!(out.matches("idem.http").count(), 2, "{out}");
    assert_eq!(out.matches(&hash).count(), 2, "{out}");
    for field in [
        "method=POST",
        "path=\"/pay\"",
        "scope=tenant-a",
        "outcome=\"executed\"",
        "outcome=\"replayed\"",
        "attempt=1",
        "status=201",
    ] {
        assert!(out.contains(field), "no {field} in {out}");
    }
    assert!(!out.contains(KEY), "the key leaked: {out}");
    assert!(!out.contains("amount"), "the body leaked: {out}");
}
