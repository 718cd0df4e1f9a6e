//! `scripts/test <backend>` starts only the servers that backend needs and selects only its
//! tests (`--plan` prints what a run would do).

use std::process::Command;

fn plan(args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/test");
    let mut run = Command::new("bash");
    run.arg(script).arg("--plan").args(args);
    idem_testkit::harness::stdout_of(&mut run)
}

#[test]
fn each_backend_starts_only_its_servers_and_runs_only_its_tests() {
    // Each backend, the servers its plan starts (its whole `servers:` line), and a part of
    // its command.
    let redis_only = "-- redis --skip redis_cluster --skip tiered";
    let cases = [
        ("memory", "(none)", "cargo test --workspace -- memory::"),
        ("redis", "redis", redis_only),
        ("redis_cluster", "(none)", "-- redis_cluster"),
        ("postgres", "postgres", "-- postgres --skip tiered"),
        ("tiered", "redis postgres", "-- tiered relay"),
        ("rabbitmq", "rabbitmq", "-- rabbitmq"),
        ("nats", "nats", "-- nats"),
        ("walkthrough", "redis postgres", "then: scripts/walkthrough"),
    ];
    for (backend, servers, command) in cases {
        let plan = plan(&[backend]);
        let servers = format!("servers: {servers}");
        assert!(plan.lines().any(|l| l == servers), "{backend}: {plan}");
        assert!(plan.contains(command), "{backend}: {plan}");
    }
}

#[test]
fn a_full_run_and_cargo_arguments_keep_working() {
    let all = plan(&[]);
    assert!(
        all.contains("servers: redis postgres rabbitmq nats"),
        "{all}"
    );
    assert!(all.contains("command: cargo test --workspace\n"), "{all}");
    assert!(all.contains("then: scripts/walkthrough"), "{all}");
    let one = plan(&["-p", "idem-postgres"]);
    assert!(
        one.contains("command: cargo test -p idem-postgres\n"),
        "{one}"
    );
    let within = plan(&["redis", "-p", "idem-cli", "--", "--nocapture"]);
    assert!(
        within.contains("command: cargo test -p idem-cli -- redis --skip redis_cluster --skip tiered --nocapture"),
        "{within}"
    );
}
