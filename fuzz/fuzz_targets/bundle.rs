//! Any bytes as a bundle (plain, gzip or zstd tar): staged whole or refused whole, with
//! nothing left behind; the same path `tests/it/fuzz.rs` drives on every test run
//! (`image::exercise::exercise_bundle`).
#![no_main]

use std::sync::OnceLock;

use bootfleet::image::blobstore::BlobStore;
use bootfleet::image::exercise::{exercise_bundle, small_limits};
use libfuzzer_sys::fuzz_target;

fn store() -> &'static BlobStore {
    static STORE: OnceLock<(tempfile::TempDir, BlobStore)> = OnceLock::new();
    let (_, store) = STORE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        (dir, store)
    });
    store
}

fuzz_target!(|data: &[u8]| {
    exercise_bundle(data, store(), &small_limits());
});
