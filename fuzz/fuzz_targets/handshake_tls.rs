//! Client bytes into the sans-IO server handshake of a server that offers or requires TLS.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::handshake::run_tls(data));
