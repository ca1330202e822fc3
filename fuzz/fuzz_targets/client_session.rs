//! Arbitrary server replies through the client's transmission session.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::client::run_session(data));
