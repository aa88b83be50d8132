//! Tidiness checks: every module documents itself, every example config parses.

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_module_starts_with_a_doc_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("tests"), &mut files);
    assert!(files.len() > 10);
    let undocumented: Vec<_> = files
        .iter()
        .filter(|f| !std::fs::read_to_string(f).unwrap().starts_with("//!"))
        .collect();
    assert!(
        undocumented.is_empty(),
        "modules without a //! line: {undocumented:?}"
    );
}

#[test]
fn example_configs_parse() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("deploy/bootfleet.toml");
    let cfg = bootfleet::config::FileConfig::load(&path).unwrap();
    assert_eq!(cfg.listen, Some("0.0.0.0:8080".parse().unwrap()));
    assert!(cfg.limits.max_artifact_bytes > 0);
}

#[test]
fn readme_test_command_is_what_ci_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    assert!(
        readme.contains("sudo ./scripts/test"),
        "README names the test command"
    );
    assert!(
        ci.contains("./scripts/test"),
        ".ci/run calls the README's test command"
    );
}
