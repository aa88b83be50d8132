//! The layer rules, checked against the imports: which top-level modules each part of
//! the server may name (`crate::<module>`), written once here and in ARCHITECTURE.md
//! ("Layers"). A violation fails with the file and what it named; each exception is
//! listed with its reason and must still be needed, so the list only shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::tidy::rust_files;

/// Each part and the modules it may name besides itself. `api` is the wire contract
/// (the `bootfleet-api` crate), `clock` wall-clock time.
const RULES: &[(&str, &[&str])] = &[
    ("clock", &[]),
    ("udp_buffer", &[]),
    ("heap", &[]),
    ("http_client", &[]),
    ("audit", &[]),
    ("auth", &["api", "clock", "store"]),
    ("dhcp", &["api", "clock", "udp_buffer"]),
    ("tftp", &["api", "clock", "udp_buffer", "image"]),
    ("boot", &["api"]),
    ("image", &["api", "clock", "http_client"]),
    ("store", &["api", "audit", "clock"]),
    ("leader", &["clock", "store"]),
    ("health", &["api", "clock"]),
    ("fabric", &["api"]),
    ("tpm", &["api"]),
    (
        "metrics",
        &["api", "auth", "clock", "dhcp", "store", "tftp"],
    ),
    ("registry", &["api", "clock", "image", "store"]),
    (
        "events",
        &["api", "clock", "http_client", "leader", "store"],
    ),
    (
        "node",
        &[
            "api", "clock", "boot", "dhcp", "fabric", "health", "image", "leader", "metrics",
            "registry", "store", "tpm",
        ],
    ),
    (
        "power",
        &["api", "clock", "http_client", "leader", "node", "store"],
    ),
    (
        "rollout",
        &[
            "api",
            "clock",
            "events",
            "http_client",
            "leader",
            "node",
            "registry",
            "store",
        ],
    ),
    (
        "http",
        &[
            "api",
            "audit",
            "auth",
            "clock",
            "events",
            "http_client",
            "image",
            "metrics",
            "node",
            "power",
            "registry",
            "rollout",
            "tftp",
        ],
    ),
    ("cli", &["api", "auth", "config", "http_client"]),
    (
        "storm",
        &[
            "api",
            "clock",
            "http_client",
            "tftp",
            "cli",
            "tpm",
            "udp_buffer",
        ],
    ),
    (
        "config",
        &[
            "api", "dhcp", "events", "fabric", "health", "http", "image", "metrics", "node",
            "power", "rollout", "store", "tftp", "tpm",
        ],
    ),
    (
        "server",
        &[
            "api",
            "auth",
            "boot",
            "clock",
            "config",
            "dhcp",
            "events",
            "health",
            "heap",
            "http",
            "http_client",
            "image",
            "leader",
            "metrics",
            "node",
            "power",
            "registry",
            "rollout",
            "store",
            "tpm",
            "tftp",
            "udp_buffer",
        ],
    ),
];

/// Files allowed more than their part, and why. Each must still use what it is allowed.
const EXCEPTIONS: &[(&str, &[&str], &str)] = &[
    (
        "src/cli/serve.rs",
        &["dhcp", "server"],
        "the one command that runs the server",
    ),
    (
        "src/storm/copy.rs",
        &["server"],
        "the bound's listener uses the server's backlog helper",
    ),
    (
        "src/storm/dhcp.rs",
        &["dhcp"],
        "its tests check the simulator's packets with the server's parser",
    ),
];

/// The top-level modules a file names as `crate::<module>`.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("crate::") {
        // `bootfleet_api::` or `some_crate::` are other crates, not ours.
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = text[i + 7..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// The part a source file belongs to: its folder under `src/`, or its file stem.
fn part_of(root: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(root.join("src")).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    Some(first.trim_end_matches(".rs").to_string())
}

/// Every rule violation, and every exception no longer needed.
fn violations(root: &Path) -> Vec<String> {
    let rules: BTreeMap<&str, &[&str]> = RULES.iter().copied().collect();
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut found = Vec::new();
    let mut used_exceptions = BTreeSet::new();
    for file in &files {
        let Some(part) = part_of(root, file) else {
            continue;
        };
        let Some(allowed) = rules.get(part.as_str()) else {
            continue;
        };
        let rel = file
            .strip_prefix(root)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        let exception = EXCEPTIONS.iter().find(|(f, _, _)| *f == rel);
        let text = std::fs::read_to_string(file).unwrap();
        for module in named_modules(&text) {
            if module == part || allowed.contains(&module.as_str()) {
                continue;
            }
            match exception {
                Some((f, extra, _)) if extra.contains(&module.as_str()) => {
                    used_exceptions.insert((*f, module));
                }
                _ => found.push(format!("{rel} ({part}) names crate::{module}")),
            }
        }
    }
    for (f, extra, why) in EXCEPTIONS {
        for m in *extra {
            if !used_exceptions.contains(&(*f, m.to_string())) {
                found.push(format!("exception {f} -> {m} ({why}) is no longer needed"));
            }
        }
    }
    found
}

#[test]
fn every_part_names_only_the_layers_below_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let found = violations(root);
    assert!(
        found.is_empty(),
        "layer rules broken:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_rules_cover_every_part_of_the_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let ruled: BTreeSet<&str> = RULES.iter().map(|(p, _)| *p).collect();
    let unruled: BTreeSet<String> = files
        .iter()
        .filter_map(|f| part_of(root, f))
        .filter(|p| !["lib", "main", "bin"].contains(&p.as_str()) && !ruled.contains(p.as_str()))
        .collect();
    assert!(unruled.is_empty(), "parts with no layer rule: {unruled:?}");
}

#[test]
fn the_wire_contract_and_the_agent_know_nothing_of_the_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (krate, may) in [("api", &[][..]), ("agent", &["bootfleet-api"][..])] {
        let manifest =
            std::fs::read_to_string(root.join(format!("crates/{krate}/Cargo.toml"))).unwrap();
        for line in manifest.lines().filter(|l| l.starts_with("bootfleet")) {
            let dep = line.split([' ', '=']).next().unwrap();
            assert!(may.contains(&dep), "crates/{krate} depends on {dep}");
        }
        let mut files = Vec::new();
        rust_files(&root.join(format!("crates/{krate}/src")), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            assert!(
                !text.contains("bootfleet::"),
                "{} names the server crate",
                f.display()
            );
        }
    }
    let agent_main = std::fs::read_to_string(root.join("src/bin/bootfleet-agent.rs")).unwrap();
    assert!(
        !agent_main.contains("bootfleet::"),
        "the agent binary names the server crate"
    );
}

/// The checker itself: it sees each violation the re-layering removed.
#[test]
fn the_checker_finds_what_the_rules_forbid() {
    let named = named_modules(
        "use crate::store::Store;\nlet x = crate::node::state::transition;\nuse bootfleet_api::Mac;",
    );
    assert_eq!(
        named,
        ["node", "store"].iter().map(|s| s.to_string()).collect()
    );
    let rules: BTreeMap<&str, &[&str]> = RULES.iter().copied().collect();
    // What issue 14 found, each now refused by the rules.
    for (part, module) in [
        ("dhcp", "store"),
        ("store", "node"),
        ("store", "dhcp"),
        ("cli", "http"),
        ("cli", "registry"),
        ("cli", "store"),
        ("boot", "store"),
        ("boot", "node"),
        ("http", "store"),
    ] {
        assert!(!rules[part].contains(&module), "{part} may name {module}");
    }
}

/// Node state has one writer: only `node/controller.rs` calls the store's state writes
/// (a transition, a discovery, a reimage), so every one passes the transition table.
#[test]
fn only_the_controller_writes_node_state() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let writes = [
        ".set_state(",
        ".set_state_via(",
        ".discover(",
        ".discover_within(",
        ".request_reimage(",
        ".reimage_step(",
    ];
    let mut found = Vec::new();
    for file in files {
        let rel = file
            .strip_prefix(root)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        if rel == "src/node/controller.rs" || rel.starts_with("src/store/") {
            continue;
        }
        // Method chains span lines: compare with the whitespace taken out.
        let text: String = std::fs::read_to_string(&file)
            .unwrap()
            .split_whitespace()
            .collect();
        for w in writes {
            if text.contains(&format!("store{w}")) {
                found.push(format!("{rel} calls the store's {w}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "node state written outside the controller:\n{}",
        found.join("\n")
    );
}
