//! Untrusted bundles and manifests through the publish path's pure parts, as fuzzers and
//! property tests drive them: a manifest parses or is refused with a reason; a bundle is
//! staged whole or refused whole, and a refused one leaves no temp file behind. Shared by
//! `fuzz/fuzz_targets/{bundle,manifest}.rs` and `tests/it/fuzz.rs`.

use super::blobstore::BlobStore;
use super::bundle::{BundleLimits, ingest};
use super::manifest::Manifest;

/// Parses `text` as a manifest; returns whether it was accepted. Panics if an accepted
/// manifest names no kernel or a refusal gives no reason.
pub fn exercise_manifest(text: &str) -> bool {
    match Manifest::parse(text) {
        Ok(m) => {
            let paths = m.artifact_paths();
            assert!(
                paths
                    .iter()
                    .any(|(role, _)| *role == crate::api::image::Role::Kernel),
                "an accepted manifest names its kernel"
            );
            true
        }
        Err(e) => {
            assert!(!e.to_string().trim().is_empty(), "a refusal says why");
            false
        }
    }
}

/// Limits small enough that a fuzzer reaches them.
pub fn small_limits() -> BundleLimits {
    BundleLimits {
        max_entries: 16,
        max_artifact_bytes: 1 << 20,
        max_manifest_bytes: 16 << 10,
        max_bundle_bytes: 4 << 20,
        min_free_bytes: 0,
        ..BundleLimits::default()
    }
}

/// Ingests `bytes` as a bundle into `store`; returns whether it was staged (and then
/// drops what was staged). Panics if a refusal leaves a file in the blob directory.
pub fn exercise_bundle(bytes: &[u8], store: &BlobStore, limits: &BundleLimits) -> bool {
    let staged = ingest(bytes, store, limits);
    let ok = staged.is_ok();
    drop(staged);
    let left = std::fs::read_dir(store.dir())
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(
        left, 0,
        "a bundle left {left} file(s) in the blob directory"
    );
    ok
}
