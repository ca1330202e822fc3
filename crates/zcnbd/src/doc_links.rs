//! The documentation's relative links resolve: README, CONTRIBUTING and everything under docs/
//! and bench/ (files move; a link left behind should fail here, not in a reader's browser).

use std::path::{Path, PathBuf};

/// The relative link targets of a Markdown text (`[text](target)`, anchors dropped; web
/// addresses and bare anchors skipped).
fn relative_links(text: &str) -> Vec<&str> {
    let mut links = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split('#').next().unwrap_or("");
        let remote = target.contains("://") || target.starts_with("mailto:");
        if !target.is_empty() && !remote && !target.contains(char::is_whitespace) {
            links.push(target);
        }
    }
    links
}

/// Every Markdown file of the tree's documentation.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    let mut dirs = vec![root.join("docs"), root.join("bench")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files
}

#[test]
fn every_relative_link_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut broken = Vec::new();
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for link in relative_links(&text) {
            if !dir.join(link).exists() {
                broken.push(format!("{}: {link}", file.display()));
            }
        }
    }
    assert_eq!(broken, Vec::<String>::new());
}

#[test]
fn links_are_found_and_web_addresses_skipped() {
    let text = "a [x](docs/a.md#top) b [y](https://e.org/z) [z](#here) [w](../b.md)";
    assert_eq!(relative_links(text), ["docs/a.md", "../b.md"]);
}
