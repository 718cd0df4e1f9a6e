//! Every store call reports a span and metrics, and neither gives the key away.

use std::sync::Arc;
use std::time::Duration;

use idem_core::telemetry::{Instrumented, KeyHash};
use idem_core::{
    Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint, Key, MemoryStore, RecordId,
    Response, Scope, Store,
};
use idem_testkit::telemetry::{logs_of, metrics_of, FmtSpan, Level};
use metrics_util::debugging::DebugValue;
use metrics_util::MetricKind;

mod common;
use common::Hang;

fn id() -> RecordId {
    RecordId::new(
        Scope::new("tenant-7").unwrap(),
        Key::new("secret-order-key").unwrap(),
    )
}

async fn lifecycle(store: &Instrumented) {
    let id = id();
    let req = || BeginRequest {
        id: &id,
        fingerprint: Fingerprint::of_bytes(b"request"),
        token: FencingToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(60),
    };
    let Begin::Acquired(lease) = store.begin(req()).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    let done = Completion::succeeded(Response::new(201, "card-number-4111"));
    store
        .complete(&lease, &done, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(matches!(
        store.begin(req()).await.unwrap(),
        Begin::Replay(_)
    ));
    assert!(matches!(store.release(&lease).await, Err(Error::LeaseLost)));
}

#[test]
fn metrics_count_every_call_by_outcome() {
    let store = Instrumented::new(Arc::new(MemoryStore::new()));
    let snapshot = metrics_of(lifecycle(&store));
    let mut counters = Vec::new();
    let mut histograms = 0;
    for (key, _, _, value) in snapshot.into_vec() {
        let (kind, key) = key.into_parts();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        match (kind, value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => {
                counters.push(format!("{} {} {n}", key.name(), labels.join(",")));
            }
            (MetricKind::Histogram, DebugValue::Histogram(values)) => {
                assert_eq!(key.name(), "idem_store_call_duration_seconds");
                histograms += values.len();
            }
            other => panic!("unexpected metric {other:?}"),
        }
    }
    counters.sort();
    assert_eq!(
        counters,
        [
            "idem_lease_lost_total store=memory,op=release 1",
            "idem_store_calls_total store=memory,op=begin,outcome=acquired 1",
            "idem_store_calls_total store=memory,op=begin,outcome=replay 1",
            "idem_store_calls_total store=memory,op=complete,outcome=ok 1",
            "idem_store_calls_total store=memory,op=release,outcome=lease_lost 1",
        ]
    );
    assert_eq!(histograms, 4, "one latency sample per call");
}

#[test]
fn spans_name_the_key_by_its_hash_only() {
    let store = Instrumented::new(Arc::new(MemoryStore::new()));
    let out = logs_of(Level::DEBUG, FmtSpan::CLOSE, lifecycle(&store));
    let hash = KeyHash::of(&id()).to_string();
    assert_eq!(out.matches("idem.store").count(), 4, "{out}");
    assert_eq!(out.matches(&format!("key_hash={hash}")).count(), 4, "{out}");
    for field in [
        "store=\"memory\"",
        "op=\"begin\"",
        "scope=tenant-7",
        "outcome=\"acquired\"",
        "outcome=\"replay\"",
        "outcome=\"lease_lost\"",
        "attempt=1",
        "elapsed_us=",
    ] {
        assert!(out.contains(field), "no {field} in {out}");
    }
    assert!(!out.contains("secret-order-key"), "the key leaked: {out}");
    assert!(!out.contains("card-number"), "the body leaked: {out}");
}

/// `Idem` reports its store calls, and a call cut off by the time limit counts as
/// unavailable.
#[test]
fn idem_reports_its_calls_and_their_time_limit() {
    let snapshot = metrics_of(async {
        let idem = idem_core::Idem::new(MemoryStore::new());
        let fp = Fingerprint::of_bytes(b"request");
        assert!(matches!(
            idem.begin(&id(), fp).await.unwrap(),
            Begin::Acquired(_)
        ));
        let hang = idem_core::Idem::new(Hang).with_config(
            idem_core::Config::default().with_store_timeout(Duration::from_millis(20)),
        );
        assert!(matches!(
            hang.begin(&id(), fp).await,
            Err(Error::Unavailable { store: "hang", .. })
        ));
    });
    let mut counters: Vec<String> = snapshot
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => {
                let key = key.key().clone();
                let labels: Vec<String> = key.labels().map(|l| l.value().to_owned()).collect();
                Some(format!("{} {} {n}", key.name(), labels.join(",")))
            }
            _ => None,
        })
        .collect();
    counters.sort();
    assert_eq!(
        counters,
        [
            "idem_store_calls_total hang,begin,unavailable 1",
            "idem_store_calls_total memory,begin,acquired 1",
        ]
    );
}

/// A full memory store refusing new keys is not an outage: no "unavailable" warning, no
/// "answers again" line, while it keeps answering the keys it holds.
#[test]
fn a_full_memory_store_is_not_logged_as_an_outage() {
    let full =
        MemoryStore::new().with_capacity(idem_core::MemoryCapacity::default().with_records(1));
    let idem = idem_core::Idem::new(full);
    let out = logs_of(Level::INFO, FmtSpan::NONE, async {
        let fp = Fingerprint::of_bytes(b"request");
        assert!(matches!(
            idem.begin(&id(), fp).await.unwrap(),
            Begin::Acquired(_)
        ));
        for i in 0..3 {
            let other = RecordId::new(Scope::global(), Key::new(format!("k{i}")).unwrap());
            let refused = idem.begin(&other, fp).await;
            assert!(
                matches!(refused, Err(Error::Unavailable { .. })),
                "{refused:?}"
            );
            assert!(matches!(
                idem.begin(&id(), fp).await.unwrap(),
                Begin::InFlight { .. }
            ));
        }
    });
    assert!(!out.contains("unavailable"), "{out}");
    assert!(!out.contains("answers again"), "{out}");
}
