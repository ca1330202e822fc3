//! Arbitrary server handshake bytes through the client's handshake.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::client::run_handshake(data));
