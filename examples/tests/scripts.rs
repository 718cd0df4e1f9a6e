//! `scripts/test <backend>` starts only the servers that backend needs and selects only its
//! tests (`--plan` prints what a run would do).

use std::process::Command;

fn plan(args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/test");
    let out = Command::new("bash")
        .arg(script)
        .arg("--plan")
        .args(args)
        .output()
        .expect("bash runs scripts/test");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn each_backend_starts_only_its_servers_and_runs_only_its_tests() {
    let cases = [
        (
            "memory",
            "servers: (none)",
            "cargo test --workspace -- memory::",
        ),
        (
            "redis",
            "servers: redis\n",
            "-- redis --skip redis_cluster --skip tiered",
        ),
        ("redis_cluster", "servers: (none)", "-- redis_cluster"),
        (
            "postgres",
            "servers: postgres\n",
            "-- postgres --skip tiered",
        ),
        ("tiered", "servers: redis postgres\n", "-- tiered relay"),
        ("rabbitmq", "servers: rabbitmq\n", "-- rabbitmq"),
        ("nats", "servers: nats\n", "-- nats"),
        (
            "walkthrough",
            "servers: redis postgres\n",
            "then: scripts/walkthrough",
        ),
    ];
    for (backend, servers, command) in cases {
        let plan = plan(&[backend]);
        assert!(plan.contains(servers), "{backend}: {plan}");
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
