//! Where an export's bytes live, per request: the answer of [`Backend::map`] for a range, a
//! short list of segments an engine can move itself (QEMU's `bdrv_block_status` mapping,
//! imago's `get_mapping`): bytes at a file offset, bytes in a mapping, zeroes, or "ask the
//! stack" for bytes that are computed (RBD, a layer that changes data). The engines' zero-copy
//! mechanisms work on these segments, whatever layer named them.
//!
//! Descriptors in a place are the backend's own and stay open as long as the stack that
//! answered: an engine holds the stack for as long as it uses them.
//!
//! [`Backend::map`]: super::Backend::map

use std::os::fd::RawFd;

use zcnbd_proto::consts::state;
use zcnbd_proto::Extent;

use crate::sys::mapping::MappedRange;

/// Most segments one map holds; past that the rest of the range is one [`Place::Stack`]
/// segment (read and written through the stack's methods), so a map never grows with the
/// request's length.
pub const SEGMENTS_MAX: usize = 64;

/// What a map is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapFor {
    /// Reading. `holes`: ranges that read as zeroes are wanted as [`Place::Zero`] (a sparse
    /// reply leaves them out); without it a backend whose holes read as zeroes from their
    /// place need not look for them.
    Read { holes: bool },
    /// Writing: places a payload may be written to directly (a backend that allocates, an
    /// image, allocates first). Never [`Place::Zero`].
    Write,
}

/// The kinds of place an engine can move bytes to and from itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// A memory export's memfd and its shared mapping.
    Memory,
    /// A file through the page cache.
    PageCache,
    /// A file with an O_DIRECT descriptor (and a buffered twin for unaligned requests).
    Direct,
}

/// Where one run of bytes lives.
#[derive(Debug)]
pub enum Place {
    /// A memory export's pages: its memfd (for `sendfile`/splice, at the range's offset) and
    /// the range of its shared mapping (send from it, receive into it).
    Memory { fd: RawFd, range: MappedRange },
    /// A file through the page cache, at `offset`.
    File { fd: RawFd, offset: u64 },
    /// A file opened with O_DIRECT (aligned I/O) and buffered (the rest), at `offset`.
    Direct {
        direct: RawFd,
        buffered: RawFd,
        offset: u64,
    },
    /// Reads as zeroes, with nothing behind it to send (a hole).
    Zero,
    /// Nowhere an engine can reach: read and written through the stack's methods.
    Stack,
}

impl Place {
    /// The medium an engine moves this place's bytes with (`None`: zeroes or the stack).
    pub fn medium(&self) -> Option<Medium> {
        match self {
            Place::Memory { .. } => Some(Medium::Memory),
            Place::File { .. } => Some(Medium::PageCache),
            Place::Direct { .. } => Some(Medium::Direct),
            Place::Zero | Place::Stack => None,
        }
    }

    /// Whether `next`, of `len` bytes, continues this place of `len_here` bytes, so the two
    /// are one segment.
    fn continued_by(&self, len_here: u64, next: &Place) -> bool {
        match (self, next) {
            (Place::Zero, Place::Zero) | (Place::Stack, Place::Stack) => true,
            (Place::File { fd, offset }, Place::File { fd: f, offset: o }) => {
                fd == f && offset.checked_add(len_here) == Some(*o)
            }
            (
                Place::Direct { direct, offset, .. },
                Place::Direct {
                    direct: d,
                    offset: o,
                    ..
                },
            ) => direct == d && offset.checked_add(len_here) == Some(*o),
            _ => false,
        }
    }
}

/// One run of a mapped range.
#[derive(Debug)]
pub struct Segment {
    /// Bytes in the run (never 0).
    pub len: u64,
    pub place: Place,
}

/// Where the bytes of a range live: segments in order, covering it. Reused by its owner (an
/// engine keeps one per connection), so mapping a request allocates nothing once warm.
#[derive(Debug)]
pub struct Map {
    segments: Vec<Segment>,
    /// A FUA write to these places is durable once written with `RWF_DSYNC` (a raw file);
    /// false where the stack has more to make durable (an image's metadata): a FUA write
    /// then goes through the stack, which flushes.
    pub dsync_is_fua: bool,
}

impl Default for Map {
    fn default() -> Self {
        Map {
            segments: Vec::with_capacity(4),
            dsync_is_fua: true,
        }
    }
}

impl Map {
    /// Forgets the segments, for the next range.
    pub fn clear(&mut self) {
        self.segments.clear();
        self.dsync_is_fua = true;
    }

    /// Appends `len` bytes at `place`, joined to the last segment where it continues it; at
    /// [`SEGMENTS_MAX`] the rest of the range is left to the stack.
    pub fn push(&mut self, len: u64, place: Place) {
        if len == 0 {
            return;
        }
        let count = self.segments.len();
        if let Some(last) = self.segments.last_mut() {
            let full = count >= SEGMENTS_MAX;
            if last.place.continued_by(last.len, &place) || full {
                // At the cap the last segment is always the stack's (below).
                last.len += len;
                return;
            }
        }
        let place = if count + 1 >= SEGMENTS_MAX {
            Place::Stack
        } else {
            place
        };
        self.segments.push(Segment { len, place });
    }

    /// Appends `[offset, offset+len)` as described by `extents` (from `offset` on): runs that
    /// read as zeroes as [`Place::Zero`], data at `place_at(offset, len)`, and whatever the
    /// extents leave out as the stack's. How a backend that can cheaply tell holes maps a read
    /// that wants them.
    pub fn push_extents(
        &mut self,
        offset: u64,
        len: u64,
        extents: &[Extent],
        mut place_at: impl FnMut(u64, u64) -> Place,
    ) {
        let mut done = 0u64;
        for e in extents {
            let n = e.length.min(len - done);
            if n == 0 {
                break;
            }
            let place = if e.flags & state::ZERO != 0 {
                Place::Zero
            } else {
                place_at(offset + done, n)
            };
            self.push(n, place);
            done += n;
        }
        self.push_stack(len - done);
    }

    /// Appends `len` bytes that only the stack's methods reach.
    pub fn push_stack(&mut self, len: u64) {
        self.push(len, Place::Stack);
    }

    /// The segments, in order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The only segment, when one covers the whole range.
    pub fn single(&self) -> Option<&Segment> {
        match self.segments.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// Takes the only segment out, when one covers the whole range.
    pub fn take_single(&mut self) -> Option<Segment> {
        match self.segments.len() {
            1 => self.segments.pop(),
            _ => None,
        }
    }

    /// Bytes the segments cover.
    pub fn covered(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Whether every segment is of `kind`.
    pub fn all(&self, kind: impl Fn(&Place) -> bool) -> bool {
        self.segments.iter().all(|s| kind(&s.place))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(offset: u64) -> Place {
        Place::File { fd: 7, offset }
    }

    #[test]
    fn contiguous_runs_join() {
        let mut map = Map::default();
        map.push(4096, file(0));
        map.push(4096, file(4096));
        map.push(4096, file(65536));
        map.push(10, Place::Zero);
        map.push(20, Place::Zero);
        map.push(0, Place::Stack);
        let got: Vec<(u64, Option<Medium>)> = map
            .segments()
            .iter()
            .map(|s| (s.len, s.place.medium()))
            .collect();
        assert_eq!(
            got,
            [
                (8192, Some(Medium::PageCache)),
                (4096, Some(Medium::PageCache)),
                (30, None)
            ]
        );
        assert_eq!(map.covered(), 8192 + 4096 + 30);
        assert!(map.single().is_none());
    }

    #[test]
    fn the_rest_goes_to_the_stack_at_the_cap() {
        let mut map = Map::default();
        for i in 0..(SEGMENTS_MAX as u64 + 10) {
            // Never contiguous: every other run is a hole.
            let place = if i % 2 == 0 {
                file(i * 1000)
            } else {
                Place::Zero
            };
            map.push(100, place);
        }
        assert_eq!(map.segments().len(), SEGMENTS_MAX);
        let last = map.segments().last().unwrap();
        assert!(matches!(last.place, Place::Stack));
        assert_eq!(last.len, 11 * 100);
        assert_eq!(map.covered(), (SEGMENTS_MAX as u64 + 10) * 100);
    }

    #[test]
    fn clear_resets_durability() {
        let mut map = Map::default();
        map.push(1, Place::Stack);
        map.dsync_is_fua = false;
        map.clear();
        assert!(map.dsync_is_fua && map.segments().is_empty());
    }
}
