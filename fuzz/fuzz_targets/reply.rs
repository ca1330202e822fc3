//! Reply headers through the client's decoder, and the reply encoders round-tripped.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::reply::run(data));
