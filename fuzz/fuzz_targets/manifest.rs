//! Any text as a manifest: the same path `tests/it/fuzz.rs` drives on every test run
//! (`image::exercise::exercise_manifest`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        bootfleet::image::exercise::exercise_manifest(text);
    }
});
