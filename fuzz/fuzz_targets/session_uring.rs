//! A whole server session over a socket pair, on the io_uring engine (`--data-path auto`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::session::run_uring(data));
