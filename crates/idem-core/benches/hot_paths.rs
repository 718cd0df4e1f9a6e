//! CPU hot paths: fingerprints with canonical JSON, and record metadata encoding.
#![allow(missing_docs)] // criterion_group! generates undocumented items
//! Run with `cargo bench -p idem-core --bench hot_paths`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use idem_core::{decode_meta, encode_meta, CompletionKind, Fingerprint, JsonSelection, Response};

fn payment_json(items: usize) -> Vec<u8> {
    let lines: Vec<String> = (0..items)
        .map(|i| {
            format!(r#"{{"sku":"sku-{i}","qty":{i},"price":{{"amount":1250,"currency":"EUR"}}}}"#)
        })
        .collect();
    format!(
        r#"{{"customer":"cus_42","sent_at":"2026-11-22T18:00:00Z","amount":1250,"currency":"EUR","lines":[{}]}}"#,
        lines.join(",")
    )
    .into_bytes()
}

fn fingerprints(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    for items in [1usize, 32] {
        let body = payment_json(items);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(format!("canonical_json_{}B", body.len()), |b| {
            b.iter(|| {
                Fingerprint::builder()
                    .text("method", "POST")
                    .text("path", "/payments")
                    .json("body", black_box(&body), &JsonSelection::All)
                    .map(|f| f.finish())
            })
        });
        // The same canonical form by way of a `serde_json::Value` tree (what `json` did
        // before it streamed): the side-by-side comparison for the streaming path above.
        group.bench_function(format!("canonical_json_via_value_{}B", body.len()), |b| {
            b.iter(|| {
                let value: serde_json::Value = serde_json::from_slice(black_box(&body)).ok()?;
                Some(
                    Fingerprint::builder()
                        .text("method", "POST")
                        .text("path", "/payments")
                        .json_value("body", &value, &JsonSelection::All)
                        .finish(),
                )
            })
        });
        let except = JsonSelection::Except(vec!["/sent_at".into()]);
        group.bench_function(format!("json_except_{}B", body.len()), |b| {
            b.iter(|| {
                Fingerprint::builder()
                    .json("body", black_box(&body), &except)
                    .map(|f| f.finish())
            })
        });
        group.bench_function(format!("raw_bytes_{}B", body.len()), |b| {
            b.iter(|| Fingerprint::of_bytes(black_box(&body)))
        });
    }
    group.finish();
}

fn metadata(c: &mut Criterion) {
    let response = Response::new(201, Bytes::from(vec![b'x'; 256]))
        .with_header("content-type", "application/json")
        .with_header("location", "/payments/pay_123");
    let meta = encode_meta(CompletionKind::Succeeded, &response);
    c.bench_function("meta/encode", |b| {
        b.iter(|| encode_meta(CompletionKind::Succeeded, black_box(&response)))
    });
    c.bench_function("meta/decode", |b| {
        b.iter(|| decode_meta(black_box(&meta), response.body.clone()))
    });
}

criterion_group!(benches, fingerprints, metadata);
criterion_main!(benches);
