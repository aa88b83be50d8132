//! Tidiness checks: every module documents itself, every example config parses.

use std::path::Path;

/// Every `.rs` file under `dir`.
pub fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
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
    rust_files(&root.join("crates"), &mut files);
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
    assert_eq!(cfg.reimage.group_label.as_deref(), Some("rack"));
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

#[test]
fn architecture_draws_exactly_the_node_transition_table() {
    use bootfleet::api::NodeState;
    use bootfleet::node::state::ALLOWED;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let block = doc
        .split("```text node-lifecycle\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("ARCHITECTURE.md has a ```text node-lifecycle block");
    let mut drawn = Vec::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let (from, tos) = line.split_once("->").expect("lines read `from -> to, to`");
        let from =
            NodeState::parse(from.trim()).unwrap_or_else(|| panic!("unknown state in {line:?}"));
        for to in tos.split(',') {
            let to =
                NodeState::parse(to.trim()).unwrap_or_else(|| panic!("unknown state in {line:?}"));
            drawn.push((from, to));
        }
    }
    let mut table = ALLOWED.to_vec();
    drawn.sort();
    table.sort();
    assert_eq!(
        drawn, table,
        "ARCHITECTURE.md and node::state::ALLOWED disagree"
    );
}

#[test]
fn the_readme_manifest_parses_and_pins_the_kernel_it_copies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let manifest = readme
        .split("cat > my-image/manifest.toml <<TOML\n")
        .nth(1)
        .and_then(|rest| rest.split("\nTOML\n").next())
        .expect("README writes my-image/manifest.toml with an expanding heredoc");
    assert!(
        manifest.contains("kernel = \"$(uname -r)\""),
        "the kernel pin is the kernel the README copies"
    );
    let m = bootfleet::image::manifest::Manifest::parse(
        &manifest.replace("$(uname -r)", "6.1.0-28-cloud-amd64"),
    )
    .unwrap();
    assert_eq!(m.pins["kernel"], "6.1.0-28-cloud-amd64");
}
