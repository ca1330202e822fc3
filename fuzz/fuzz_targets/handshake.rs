//! Client bytes into the sans-IO server handshake.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::handshake::run(data));
