//! A whole server session over a socket pair.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::session::run(data));
