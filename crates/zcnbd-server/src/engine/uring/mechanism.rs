//! Which mechanism moves each payload on the io_uring engine: the data path's policy, in safe
//! code with no I/O. The engine gathers the facts (the medium of the place the export's stack
//! mapped the request to, the request, what the kernel and the connection reported), asks
//! here, and moves the bytes the way it is told; every row of the table in `uring` (the
//! engine) is a unit test below. A request whose range the stack maps to no single place
//! (several runs, zeroes, bytes only the stack computes) never gets here: the dispatcher runs
//! it through the stack.

use crate::engine::options::{DataPath, EngineOptions};
use crate::export::Medium;

/// How a read's reply is produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMechanism {
    /// Memory export: header and data in one `sendmsg` straight from the mapping.
    Mapped,
    /// Memory export: `sendfile` from the memfd on the ring thread.
    Sendfile,
    /// Buffered file: spliced page cache -> pipe -> socket.
    Splice,
    /// `READ` into a pooled buffer, then `sendmsg` (files, and the copy baseline).
    Bounce,
    /// O_DIRECT: `READ_FIXED` into a registered run when one is free, else a pooled buffer
    /// (O_DIRECT when aligned).
    Direct,
}

/// What a read's choice depends on.
#[derive(Debug, Clone, Copy)]
pub struct ReadFacts {
    /// Where the stack mapped the whole range.
    pub medium: Medium,
    pub len: usize,
    /// The socket is nonblocking, so the ring thread may `sendfile` into it.
    pub sendfile_ok: bool,
}

/// Chooses how to answer a read of one place.
pub fn choose_read(options: &EngineOptions, facts: ReadFacts) -> ReadMechanism {
    let splice = match options.data_path {
        DataPath::Copy => false,
        DataPath::ZeroCopy => true,
        DataPath::Auto => facts.len >= options.splice_min_bytes,
    };
    let copy = options.data_path == DataPath::Copy;
    match facts.medium {
        Medium::Memory if copy => ReadMechanism::Bounce,
        Medium::Memory if splice && facts.sendfile_ok => ReadMechanism::Sendfile,
        Medium::Memory => ReadMechanism::Mapped,
        Medium::PageCache if splice => ReadMechanism::Splice,
        Medium::PageCache => ReadMechanism::Bounce,
        Medium::Direct => ReadMechanism::Direct,
    }
}

/// Where a write's payload is received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMechanism {
    /// Straight into the memory export's mapping at its offset.
    InPlace,
    /// Spliced socket -> pipe -> file (buffered file).
    Piped,
    /// O_DIRECT: into a registered run when one is free, then `WRITE_FIXED`; else as
    /// [`WriteMechanism::Bounce`].
    Direct,
    /// Into a pooled buffer, then written (or copied into the mapping).
    Bounce,
}

/// What a write's choice depends on.
#[derive(Debug, Clone, Copy)]
pub struct WriteFacts {
    /// Where the stack mapped the whole range.
    pub medium: Medium,
    pub len: usize,
    /// The request asks for `FUA`, which only the write path carries (`RWF_DSYNC`).
    pub fua: bool,
    /// No request bytes wait in the connection's header stage: the whole payload is still
    /// in the socket (a splice takes it from there).
    pub stage_empty: bool,
    /// The socket says how many bytes it holds (`FIONREAD`), which a splice off it needs to
    /// never wait: TCP and Unix sockets do, vsock on older kernels (Linux 6.1) does not.
    pub socket_fionread: bool,
    /// The in-place limit (see [`in_place_max`]).
    pub in_place_max: usize,
}

/// Chooses where a write's payload (`len > 0`) is received.
pub fn choose_write(options: &EngineOptions, facts: WriteFacts) -> WriteMechanism {
    match facts.medium {
        Medium::PageCache
            if facts.stage_empty
                && facts.socket_fionread
                && splice_write_pays(options, facts.len, facts.fua) =>
        {
            WriteMechanism::Piped
        }
        Medium::Memory if in_place_pays(options, &facts) => WriteMechanism::InPlace,
        Medium::Direct => WriteMechanism::Direct,
        _ => WriteMechanism::Bounce,
    }
}

fn in_place_pays(options: &EngineOptions, facts: &WriteFacts) -> bool {
    match options.data_path {
        DataPath::Copy => false,
        DataPath::ZeroCopy => true,
        DataPath::Auto => facts.len <= facts.in_place_max,
    }
}

/// Whether a buffered-file write of `len` bytes is spliced off the socket.
fn splice_write_pays(options: &EngineOptions, len: usize, fua: bool) -> bool {
    let pays = match options.data_path {
        DataPath::Copy => false,
        DataPath::ZeroCopy => true,
        DataPath::Auto => len >= options.receive_splice_min_bytes,
    };
    pays && !fua
}

/// `auto`'s in-place receive limit: `--receive-in-place-max-bytes`, else every size. Large
/// writes once went through a buffer under BBR and on Unix sockets, from a measurement on an
/// older kernel; on Linux 6.18 receiving them in place moved more for less server CPU on TCP
/// under BBR and on Unix sockets alike (docs/benchmarks/writes.md).
pub fn in_place_max(options: &EngineOptions) -> usize {
    options.receive_in_place_max_bytes.unwrap_or(usize::MAX)
}

/// Whether the next send, of a reply with `data_bytes` of data, is a zero-copy send (for
/// replies that can be: O_DIRECT reads), given that the kernel has not yet reported copying.
pub fn zerocopy_send_pays(options: &EngineOptions, data_bytes: usize) -> bool {
    match options.data_path {
        DataPath::Copy => false,
        DataPath::ZeroCopy => true,
        DataPath::Auto => data_bytes >= options.zerocopy_send_min_bytes,
    }
}

/// Whether a connection to an export whose stack maps to `medium` uses the ring's
/// registered buffers.
pub fn uses_fixed_buffers(options: &EngineOptions, medium: Option<Medium>) -> bool {
    medium == Some(Medium::Direct) && options.data_path != DataPath::Copy
}

#[cfg(test)]
#[path = "mechanism_tests.rs"]
mod tests;
