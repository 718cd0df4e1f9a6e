//! The facade exposes libraries only: no binary's dependency (argument parsing, an HTTP
//! server, a metrics exporter, a log subscriber) reaches a library user through a feature.

use std::process::Command;

/// The crates of the `idem` binary that no library feature may pull in.
const BINARY_ONLY: [&str; 4] = [
    "clap",
    "axum",
    "metrics-exporter-prometheus",
    "tracing-subscriber",
];

/// The names of the crates `cargo tree` lists as normal dependencies of `idemkit` with
/// `features`.
fn normal_dependencies(features: &str) -> Vec<String> {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let mut tree = Command::new(env!("CARGO"));
    tree.args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
        .args(["--manifest-path", manifest, "-p", "idemkit"])
        .args(["--features", features]);
    idem_testkit::harness::stdout_of(&mut tree)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn library_features_pull_in_no_binary_dependency() {
    // `axum` is the one feature that asks for axum (LeaseHandle as its extractor).
    for features in ["outbox", "redis,postgres,http,consumer,rabbitmq,tls-rustls"] {
        let deps = normal_dependencies(features);
        assert!(deps.iter().any(|d| d == "idem-core"), "{deps:?}");
        let leaked: Vec<_> = BINARY_ONLY
            .iter()
            .filter(|name| deps.iter().any(|d| d == *name))
            .collect();
        assert!(
            leaked.is_empty(),
            "idemkit --features {features} pulls in {leaked:?}"
        );
    }
}

#[test]
fn the_rabbitmq_feature_brings_the_broker_client() {
    assert!(normal_dependencies("rabbitmq").iter().any(|d| d == "lapin"));
    assert!(!normal_dependencies("consumer").iter().any(|d| d == "lapin"));
}
