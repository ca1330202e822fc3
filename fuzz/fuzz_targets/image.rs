//! A damaged qcow2 image opened and used: reads, maps, block status, writes, zeroing.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_fuzz::harness::image::run(data));
