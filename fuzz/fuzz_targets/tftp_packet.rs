//! Any datagram through TFTP's parser, encoder and option negotiation: the same path
//! `tests/it/fuzz.rs` drives on every test run (`tftp::exercise`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    bootfleet::tftp::exercise::exercise(data);
});
