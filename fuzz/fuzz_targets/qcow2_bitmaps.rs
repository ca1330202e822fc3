//! A whole qcow2 image file, arbitrary bytes: its persistent dirty bitmaps listed, each
//! loaded, and block status asked of each (`qemu:dirty-bitmap:NAME`). Nothing may panic or
//! allocate without bound; every answer must describe the range asked and agree with the
//! bits. The body is `zcnbd_server::export::qcow2_bitmaps::fuzz::run`, which the unit tests
//! also run over `regressions/qcow2_bitmaps/` and generated damaged images.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_server::export::qcow2_bitmaps::fuzz::run(data));
