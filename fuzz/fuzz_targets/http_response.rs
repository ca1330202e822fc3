//! An HTTP response's head as a web server might send it to the HTTP source, arbitrary bytes
//! after 16 bytes that choose the range asked: parsed whole and cut short, then the range
//! checked. Nothing may panic; a range accepted is exactly the one asked. The body is
//! `zcnbd_server::export::http_fuzz::run`, which the unit tests also run over mangled heads.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_server::export::http_fuzz::run(data));
