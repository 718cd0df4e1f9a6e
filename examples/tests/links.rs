//! Every link of the README, the guide (`docs/`), ARCHITECTURE.md and BENCHMARKS.md leads
//! somewhere: a relative link names a file or folder of the repository, and its `#anchor`
//! a heading of that file (as GitHub makes anchors of headings). Links to other sites are
//! not followed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Markdown files whose links are checked.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut files: Vec<PathBuf> = ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("the guide's folder docs/")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    chapters.sort();
    files.extend(chapters);
    files
}

/// The anchor GitHub gives a heading: lower case, spaces to `-`, every character but
/// letters, digits, `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside fenced blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut inside = false;
    let mut found = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            inside = !inside;
            continue;
        }
        if !inside && line.starts_with('#') {
            found.insert(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

/// The targets of a file's inline links `[text](target)`, outside fenced blocks and code
/// spans, with the line each is on.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut inside = false;
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("```") {
            inside = !inside;
            continue;
        }
        if inside {
            continue;
        }
        // Code spans hold no links.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            found.push((n + 1, after[..end].to_owned()));
            rest = &after[end..];
        }
    }
    found
}

#[test]
fn every_link_of_the_docs_leads_somewhere() {
    let mut broken = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let dir = doc.parent().unwrap();
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, fragment) = target.split_once('#').unwrap_or((target.as_str(), ""));
            let file = if path.is_empty() {
                doc.clone()
            } else {
                dir.join(path)
            };
            let name = format!("{}:{line}", doc.strip_prefix(root()).unwrap().display());
            if !file.exists() {
                broken.push(format!("{name}: {target}: no such file"));
                continue;
            }
            if !fragment.is_empty() {
                let target_text = std::fs::read_to_string(&file).unwrap_or_default();
                if !anchors(&target_text).contains(fragment) {
                    broken.push(format!("{name}: {target}: no such heading"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    assert_eq!(
        anchor(" A complete axum service on PostgreSQL"),
        "a-complete-axum-service-on-postgresql"
    );
    assert_eq!(
        anchor(" idem consume: any service's message handler"),
        "idem-consume-any-services-message-handler"
    );
    assert_eq!(
        anchor(" Agents' tool calls: JSON-RPC routes (MCP, A2A)"),
        "agents-tool-calls-json-rpc-routes-mcp-a2a"
    );
}
