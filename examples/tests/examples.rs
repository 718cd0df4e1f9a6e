//! The guide's Rust examples (docs/library.md): quoted there exactly as they are in `examples/`, with
//! the dependency versions idem uses, and run: the quick start always, the axum handler
//! against PostgreSQL (`mod postgres`, `IDEM_TEST_DATABASE_URL`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The chapter of the guide that quotes the examples.
const CHAPTER: &str = include_str!("../../docs/library.md");
const WORKSPACE: &str = include_str!("../../Cargo.toml");

/// The body of the fenced block right after the line `marker` in the chapter.
fn block_after(marker: &str) -> String {
    let start = CHAPTER
        .find(marker)
        .unwrap_or_else(|| panic!("docs/library.md has no line {marker:?}"));
    let mut lines = CHAPTER[start..].lines().skip(1);
    let fence = lines.next().unwrap_or_default();
    assert!(fence.starts_with("```"), "no code block after {marker:?}");
    let mut body = String::new();
    for line in lines.by_ref() {
        if line == "```" {
            return body;
        }
        body.push_str(line);
        body.push('\n');
    }
    panic!("the block after {marker:?} is not closed")
}

#[test]
fn the_guide_quotes_each_example_as_it_is() {
    for name in ["first_request", "axum_payments"] {
        let path = format!("examples/examples/{name}.rs");
        let file = std::fs::read_to_string(
            concat!(env!("CARGO_MANIFEST_DIR"), "/..").to_owned() + "/" + &path,
        )
        .unwrap();
        let quoted = block_after(&format!("<!-- {path} -->"));
        assert!(
            quoted == file,
            "docs/library.md's copy of {path} differs from the file: copy the file into it"
        );
    }
}

/// The version the workspace gives `name` (`name = "1.2"` or `name = { version = "1.2", ...`).
fn workspace_version(name: &str) -> Option<String> {
    let line = WORKSPACE
        .lines()
        .find(|line| line.starts_with(&format!("{name} = ")))?;
    let after = line.split_once("version = \"").map_or_else(
        || line.split_once(" = \"").map(|(_, v)| v),
        |(_, v)| Some(v),
    )?;
    Some(after.split('"').next()?.to_owned())
}

#[test]
fn the_guide_lists_the_dependencies_at_the_versions_idem_uses() {
    let block = block_after("<!-- dependencies of examples/examples/axum_payments.rs -->");
    let mut named = Vec::new();
    for line in block.lines().filter(|l| l.contains(" = ")) {
        let (name, rest) = line.split_once(" = ").unwrap();
        if name.starts_with('[') || name.starts_with('#') {
            continue;
        }
        let version = rest
            .split_once("version = \"")
            .map_or(rest.trim_start_matches('"'), |(_, v)| v)
            .split('"')
            .next()
            .unwrap();
        let ours = workspace_version(name)
            .unwrap_or_else(|| panic!("the workspace does not depend on {name}"));
        assert!(
            ours.starts_with(version),
            "docs/library.md asks for {name} {version}; idem uses {ours}"
        );
        named.push(name.to_owned());
    }
    for needed in ["idemkit", "axum", "serde_json", "sqlx", "tokio"] {
        assert!(
            named.iter().any(|n| n == needed),
            "{needed} missing in {block}"
        );
    }
}

/// The example `name`, built by `cargo test` next to this test's own binary.
fn example(name: &str) -> Command {
    let mut path: PathBuf = std::env::current_exe().unwrap();
    path.pop(); // deps/
    path.pop();
    path.push("examples");
    path.push(name);
    Command::new(path)
}

#[test]
fn the_quick_start_runs_once_and_replays() {
    let text = idem_testkit::harness::stdout_of(&mut example("first_request"));
    assert_eq!(
        text,
        "first call: 201 {\"charge\":\"ch_1\"}\nretry: 201 {\"charge\":\"ch_1\"}\n"
    );
}

/// A running example, killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `curl` as a user runs it: the status line, headers and body.
fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-s", "-i", "-m", "10"])
        .args(args)
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

mod postgres {
    use super::*;

    #[test]
    fn the_axum_handler_pays_once_per_key() {
        let Some(url) = idem_testkit::harness::database_url() else {
            return;
        };
        let mut child = example("axum_payments")
            .env("DATABASE_URL", &url)
            .env("LISTEN", "127.0.0.1:0")
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the axum example");
        let stdout = child.stdout.take().unwrap();
        let _running = Running(child);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("it listens");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .expect(&line)
            .to_owned();

        let key = format!("Idempotency-Key: {}", uuid::Uuid::new_v4());
        let auth = format!("Authorization: Bearer {}", uuid::Uuid::new_v4());
        let pay = || {
            curl(&[
                "-X",
                "POST",
                &format!("{base}/payments"),
                "-H",
                &auth,
                "-H",
                &key,
                "-H",
                "Content-Type: application/json",
                "-d",
                r#"{"amount": 1250}"#,
            ])
        };
        let first = pay();
        assert!(first.starts_with("HTTP/1.1 201"), "{first}");
        let again = pay();
        assert!(again.starts_with("HTTP/1.1 201"), "{again}");
        assert!(
            again.to_lowercase().contains("idempotent-replayed: true"),
            "{again}"
        );
        let body = |reply: &str| reply.rsplit("\r\n\r\n").next().unwrap().to_owned();
        assert_eq!(body(&first), body(&again));
    }
}
