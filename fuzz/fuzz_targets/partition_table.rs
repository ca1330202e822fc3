//! A disk's first bytes with an MBR, extended boot records or a GPT as anyone may have written
//! them, and a partition number: the partition filter's lookup either refuses the table or
//! finds a partition inside the disk, reading only inside it and within the table's bounds.
//! The body is `zcnbd_server::export::layers::partition_fuzz::run`, which the unit tests also
//! run over mangled tables.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zcnbd_server::export::layers::partition_fuzz::run(data));
