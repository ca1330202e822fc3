//! Request headers through the decoder and `validate_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::request::run(data));
