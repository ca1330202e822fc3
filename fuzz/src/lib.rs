//! The bodies of zcnbd's fuzz targets. They live beside the regression test that replays
//! them (`crates/zcnbd-server/tests/fuzz_harness/`) and are included here by path, so the
//! fuzzer and `cargo test` run exactly the same code.
#![forbid(unsafe_code)]

#[path = "../../crates/zcnbd-server/tests/fuzz_harness/mod.rs"]
pub mod harness;
