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
    /// `auto`: memory-export reads this long or longer go by `sendfile` (see
    /// [`remote_splice_min`]).
    pub sendfile_min: usize,
}

/// `auto`'s threshold for reads that leave without entering user memory - a memory export's
/// by `sendfile`, a plain NBD upstream's spliced from its socket - to a peer on another host.
/// Measured over a veth pair into a network namespace (the peer's receive costs its own
/// stack, as a remote client's does): from 256 KiB `sendfile` moved 0.95x-1.29x what sending
/// from the mapping did at 0.71x-0.83x the server CPU per GiB
/// (docs/benchmarks/large-requests.md), and the proxy's splice 0.95x-1.17x what receiving
/// into a buffer did at 0.72x-0.85x (docs/benchmarks/proxy.md); at 64 KiB both lost. That was
/// on an Intel Xeon; on an AMD EPYC both lost at 256 KiB and 1 MiB too, with each side's
/// receive work split off or not (docs/benchmarks/veth.md): a 1 MiB copy there costs less
/// than references to its 256 pages. So a ring tries both ways for a memory export's reads
/// (`sendfile_trial.rs`); `--splice-min-bytes` lets a server choose.
pub const SPLICE_MIN_BYTES_REMOTE: usize = 256 * 1024;

/// `auto`'s threshold for a connection's zero-copy reads (memory `sendfile`, NBD-upstream
/// splice): `--splice-min-bytes` when given; else [`SPLICE_MIN_BYTES_REMOTE`] for a peer on
/// another host, and never for one on this host (loopback, the connection's own address, a
/// Unix socket): there the client then reads the pages itself, cold, and on the project's
/// VMs it moved 0.70x the MiB/s for the same CPU in all.
pub fn remote_splice_min(options: &EngineOptions, peer_on_this_host: bool) -> usize {
    match options.splice_min_bytes {
        Some(min) => min,
        None if peer_on_this_host => usize::MAX,
        None => SPLICE_MIN_BYTES_REMOTE,
    }
}

/// Whether a connection's memory-export reads of [`SPLICE_MIN_BYTES_REMOTE`] or more go the
/// way its ring's trials say, `sendfile` or from the mapping (`sendfile_trial.rs`): `auto`,
/// `--splice-min-bytes` not given, a peer on another host.
pub fn sendfile_tried(options: &EngineOptions, peer_on_this_host: bool) -> bool {
    options.data_path == DataPath::Auto && options.splice_min_bytes.is_none() && !peer_on_this_host
}

/// Whether a connection between `peer` and `local` (IP addresses; `None`: not IP, as a Unix
/// socket) stays on this host: no IP, a loopback peer, or the peer at the local address.
pub fn is_same_host(peer: Option<std::net::IpAddr>, local: Option<std::net::IpAddr>) -> bool {
    match peer {
        None => true,
        Some(peer) => peer.is_loopback() || Some(peer) == local,
    }
}

/// Chooses how to answer a read of one place.
pub fn choose_read(options: &EngineOptions, facts: ReadFacts) -> ReadMechanism {
    let splice = |min: usize| match options.data_path {
        DataPath::Copy => false,
        DataPath::ZeroCopy => true,
        DataPath::Auto => facts.len >= min,
    };
    let copy = options.data_path == DataPath::Copy;
    let file_min = options.splice_min_bytes.unwrap_or(usize::MAX);
    match facts.medium {
        Medium::Memory if copy => ReadMechanism::Bounce,
        Medium::Memory if splice(facts.sendfile_min) && facts.sendfile_ok => {
            ReadMechanism::Sendfile
        }
        Medium::Memory => ReadMechanism::Mapped,
        Medium::PageCache if splice(file_min) => ReadMechanism::Splice,
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
/// under BBR and on Unix sockets alike (docs/benchmarks/large-requests.md).
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
