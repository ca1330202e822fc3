//! `zcnbd bench`: the seeds' before/after tables, measured with zcnbd's client library
//! against zcnbd and its peers, side by side, with the machine's loopback ceiling.

pub mod plot;
pub mod report;
pub mod results;
