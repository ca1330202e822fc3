//! An export another NBD server serves (`nbd://`, `nbds://`, `nbd+unix://`, `nbd+vsock://`),
//! reached through zcnbd's client library: reads land straight in the caller's buffer (the
//! client reads the reply's payload into it), writes leave from it, and the upstream's
//! flags say what the export can do. `zcnbd attach nbd://...` uses it (a remote export as a
//! local disk, replacing nbd-client); errors come back as the upstream's errno.

use std::io::{self, IoSlice};

use zcnbd_client::{Client, ClientOptions, WriteFlags};
use zcnbd_proto::consts::transmission_flags as tf;
use zcnbd_proto::Extent;

use crate::export::backend::Backend;
use crate::export::flags::{Capabilities, ZeroError, ZeroFlags};

/// The most connections to one upstream (`--connections`), as nbdcopy and libnbd allow.
pub const UPSTREAM_CONNECTIONS_MAX: usize = 16;

/// An upstream NBD export.
pub struct NbdBackend {
    client: Client,
    flags: u16,
    base_allocation: bool,
}

impl std::fmt::Debug for NbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdBackend")
            .field("size", &self.client.size())
            .field("flags", &self.flags)
            .finish()
    }
}

/// A connection that failed, naming the upstream (its URI names only files, never keys).
fn connect_error(uri: &str, e: zcnbd_client::Error) -> io::Error {
    let kind = io::Error::from_raw_os_error(e.errno()).kind();
    io::Error::new(kind, format!("upstream {uri}: {e}"))
}

/// The upstream's errno, for the caller (the stack and the block layer map errnos).
fn errno(e: zcnbd_client::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

impl NbdBackend {
    /// Connects to `uri` with `connections` connections (more than one only if the upstream
    /// allows multi-conn).
    pub fn connect(uri: &str, connections: usize) -> io::Result<NbdBackend> {
        if connections == 0 || connections > UPSTREAM_CONNECTIONS_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("connections: 1 to {UPSTREAM_CONNECTIONS_MAX} (UPSTREAM_CONNECTIONS_MAX)"),
            ));
        }
        let options = ClientOptions {
            connections,
            base_allocation: true,
            ..ClientOptions::default()
        };
        let client = Client::connect_with(uri, &options).map_err(|e| connect_error(uri, e))?;
        let geometry = client.geometry();
        let (flags, base_allocation) = (geometry.flags, geometry.base_allocation);
        tracing::info!(
            %uri,
            size = client.size(),
            connections = client.connections(),
            flags = format_args!("{flags:#x}"),
            "connected to the upstream NBD server"
        );
        Ok(NbdBackend {
            client,
            flags,
            base_allocation,
        })
    }

    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

impl Backend for NbdBackend {
    fn size(&self) -> u64 {
        self.client.size()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            write: !self.has(tf::READ_ONLY),
            flush: self.has(tf::SEND_FLUSH),
            fua: self.has(tf::SEND_FUA),
            trim: self.has(tf::SEND_TRIM),
            zero: self.has(tf::SEND_WRITE_ZEROES),
            fast_zero: self.has(tf::SEND_FAST_ZERO),
            cache: self.has(tf::SEND_CACHE),
            multi_conn: self.has(tf::CAN_MULTI_CONN),
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.client.read_at(buf, offset).map(drop).map_err(errno)
    }

    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.client
            .write_vectored_at(&[IoSlice::new(buf)], offset, WriteFlags { fua })
            .map(drop)
            .map_err(errno)
    }

    fn flush(&self) -> io::Result<()> {
        self.client.flush().map_err(errno)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.client
            .trim(offset, len, WriteFlags { fua })
            .map_err(errno)
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        let asked = zcnbd_client::ZeroFlags {
            fua: flags.fua,
            no_hole: !flags.may_trim,
            fast: flags.fast,
        };
        match self.client.write_zeroes(offset, len, asked) {
            Ok(()) => Ok(()),
            Err(e) if flags.fast && e.errno() == libc::EOPNOTSUPP => Err(ZeroError::NotFast),
            Err(e) => Err(ZeroError::Io(errno(e))),
        }
    }

    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.has(tf::SEND_CACHE) {
            true => self.client.cache(offset, len).map_err(errno),
            false => Ok(()),
        }
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if !self.base_allocation {
            out.push(Extent {
                length: len,
                flags: 0,
            });
            return Ok(());
        }
        let mut left = len;
        for e in self.client.block_status(offset, len).map_err(errno)? {
            if left == 0 || out.len() >= extents_max.max(1) {
                break;
            }
            let length = e.length.min(left);
            out.push(Extent {
                length,
                flags: e.flags,
            });
            left -= length;
        }
        if out.is_empty() {
            out.push(Extent {
                length: len,
                flags: 0,
            });
        }
        Ok(())
    }

    fn block_size_minimum(&self) -> u32 {
        self.client.geometry().minimum
    }

    /// Finding holes costs a round trip to the upstream: every read is one read.
    fn sparse_reads(&self) -> bool {
        false
    }
}
