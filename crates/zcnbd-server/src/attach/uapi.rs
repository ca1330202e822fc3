//! The ublk driver's user-space interface (`include/uapi/linux/ublk_cmd.h`), as Linux 6.12 has
//! it - the kernel the VM lab boots - and the later bits zcnbd detects: constants, and the
//! structures packed and unpacked by hand at their C offsets (no `unsafe`; the tests pin every
//! size, offset and opcode to the values the 6.12 header compiles to).
//!
//! Control commands go to `/dev/ublk-control` as `IORING_OP_URING_CMD` on a ring of 128-byte
//! entries, with a [`CtrlCmd`] in the command area; I/O commands go to `/dev/ublkcN` on an
//! ordinary ring, with an [`IoCmd`]. The kernel describes each request in a read-only array of
//! [`IoDesc`] mapped from `/dev/ublkcN`, one per tag.

/// `_IOC(dir, 'u', nr, size)` on x86-64 and the other architectures with the generic layout.
const fn ioc(dir: u32, nr: u32, size: u32) -> u32 {
    (dir << 30) | (size << 16) | ((b'u' as u32) << 8) | nr
}
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// Control commands (the ioctl-encoded forms, 6.4+, which every kernel since accepts).
pub mod ctrl_op {
    use super::{ioc, CTRL_CMD_BYTES, IOC_READ, IOC_WRITE};
    const RW: u32 = IOC_READ | IOC_WRITE;
    const S: u32 = CTRL_CMD_BYTES as u32;
    /// The CPUs whose requests a queue gets (`data`: the queue), as a cpumask.
    pub const GET_QUEUE_AFFINITY: u32 = ioc(IOC_READ, 0x01, S);
    pub const GET_DEV_INFO: u32 = ioc(IOC_READ, 0x02, S);
    pub const ADD_DEV: u32 = ioc(RW, 0x04, S);
    pub const DEL_DEV: u32 = ioc(RW, 0x05, S);
    pub const START_DEV: u32 = ioc(RW, 0x06, S);
    pub const STOP_DEV: u32 = ioc(RW, 0x07, S);
    pub const SET_PARAMS: u32 = ioc(RW, 0x08, S);
    pub const GET_PARAMS: u32 = ioc(IOC_READ, 0x09, S);
    pub const START_USER_RECOVERY: u32 = ioc(RW, 0x10, S);
    pub const END_USER_RECOVERY: u32 = ioc(RW, 0x11, S);
    pub const GET_FEATURES: u32 = ioc(IOC_READ, 0x13, S);
}

/// I/O commands on `/dev/ublkcN`.
pub mod io_op {
    use super::{ioc, IOC_READ, IOC_WRITE, IO_CMD_BYTES};
    const RW: u32 = IOC_READ | IOC_WRITE;
    const S: u32 = IO_CMD_BYTES as u32;
    pub const FETCH_REQ: u32 = ioc(RW, 0x20, S);
    pub const COMMIT_AND_FETCH_REQ: u32 = ioc(RW, 0x21, S);
    /// Zero copy (6.15+): the request's pages as a fixed buffer of the queue's ring.
    pub const REGISTER_IO_BUF: u32 = ioc(RW, 0x23, S);
    pub const UNREGISTER_IO_BUF: u32 = ioc(RW, 0x24, S);
}

/// Device features (`DevInfo::flags`).
pub mod feature {
    pub const SUPPORT_ZERO_COPY: u64 = 1 << 0;
    pub const URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
    pub const NEED_GET_DATA: u64 = 1 << 2;
    pub const USER_RECOVERY: u64 = 1 << 3;
    pub const USER_RECOVERY_REISSUE: u64 = 1 << 4;
    pub const UNPRIVILEGED_DEV: u64 = 1 << 5;
    pub const CMD_IOCTL_ENCODE: u64 = 1 << 6;
    pub const USER_COPY: u64 = 1 << 7;
    pub const ZONED: u64 = 1 << 8;
    /// 6.16+: the request's buffer registered with each FETCH/COMMIT, no extra commands.
    pub const AUTO_BUF_REG: u64 = 1 << 11;
}

/// GET_FEATURES' answer: 8 bytes, the flags this kernel's driver knows (6.5+).
pub const FEATURES_BYTES: usize = 8;

/// The features of zero-copy mode, asked for together: each request's pages registered as a
/// fixed buffer of its queue's ring (`AUTO_BUF_REG`, 6.16+), which the queue's own reads and
/// writes use in place; and `USER_COPY`, through which a request the stack answers itself
/// copies its data to or from the tag's buffer (`pread`/`pwrite` on `/dev/ublkcN`).
pub const ZERO_COPY_FEATURES: u64 = feature::AUTO_BUF_REG | feature::USER_COPY;

/// `UBLK_AUTO_BUF_REG_FALLBACK`: a request whose pages could not be registered still comes,
/// marked [`io_desc::F_NEED_REG_BUF`], instead of failing with EIO. Registration fails when
/// the ring is going away (the serving process was killed: a request dispatched then would
/// fail instead of waiting for `--recover`) or is not ready yet (a takeover).
pub const AUTO_BUF_REG_FALLBACK: u8 = 1 << 0;

/// `struct ublk_auto_buf_reg` in an I/O command's `sqe->addr` (AUTO_BUF_REG): the fixed
/// buffer slot to register the request's pages at (low 16 bits) and its flags (bits 16-23):
/// [`AUTO_BUF_REG_FALLBACK`].
pub const fn auto_buf_reg(index: u16) -> u64 {
    index as u64 | (AUTO_BUF_REG_FALLBACK as u64) << 16
}

/// The position in `/dev/ublkcN` of byte `offset` of queue `q_id`'s tag `tag`'s request, for
/// USER_COPY's `pread` (a write request's data) and `pwrite` (a read request's data).
pub const fn user_copy_pos(q_id: u16, tag: u16, offset: u32) -> u64 {
    const IO_BUF_OFFSET: u64 = 0x8000_0000;
    const IO_BUF_BITS: u32 = 25;
    const TAG_BITS: u32 = 16;
    IO_BUF_OFFSET
        + ((q_id as u64) << (IO_BUF_BITS + TAG_BITS))
        + ((tag as u64) << IO_BUF_BITS)
        + offset as u64
}

/// Device states (`DevInfo::state`).
pub mod state {
    pub const DEAD: u16 = 0;
    pub const LIVE: u16 = 1;
    pub const QUIESCED: u16 = 2;
}

/// A request's operation (`IoDesc::op_flags`' low byte) and flags.
pub mod io_desc {
    pub const OP_READ: u8 = 0;
    pub const OP_WRITE: u8 = 1;
    pub const OP_FLUSH: u8 = 2;
    pub const OP_DISCARD: u8 = 3;
    pub const OP_WRITE_ZEROES: u8 = 5;
    pub const F_FUA: u32 = 1 << 13;
    /// On WRITE_ZEROES: keep the blocks allocated (NBD's NO_HOLE).
    pub const F_NOUNMAP: u32 = 1 << 15;
    /// Zero-copy mode: the request's pages are not registered with the ring (a failed
    /// automatic registration, [`super::AUTO_BUF_REG_FALLBACK`]); its data goes through
    /// `/dev/ublkcN` (USER_COPY).
    pub const F_NEED_REG_BUF: u32 = 1 << 17;
}

/// `UBLK_ATTR_*` of the basic parameters.
pub mod attr {
    pub const READ_ONLY: u32 = 1 << 0;
    pub const ROTATIONAL: u32 = 1 << 1;
    pub const VOLATILE_CACHE: u32 = 1 << 2;
    pub const FUA: u32 = 1 << 3;
}

/// `UBLK_PARAM_TYPE_*`.
pub const PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const PARAM_TYPE_DISCARD: u32 = 1 << 1;

/// A FETCH or COMMIT completion's result when the device is going away: no re-fetch.
pub const IO_RES_ABORT: i32 = -19;
/// The deepest queue the driver takes.
pub const MAX_QUEUE_DEPTH: u16 = 4096;
/// Bytes of one queue's descriptor area in `/dev/ublkcN`'s mapping (at `q * this`).
pub const fn desc_area_offset(queue: u16) -> u64 {
    queue as u64 * round_up_page(MAX_QUEUE_DEPTH as u64 * IO_DESC_BYTES as u64)
}
/// The length to map for a queue of `depth` tags.
pub const fn desc_area_len(depth: u16) -> u64 {
    round_up_page(depth as u64 * IO_DESC_BYTES as u64)
}
const fn round_up_page(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

pub const CTRL_CMD_BYTES: usize = 32;
pub const DEV_INFO_BYTES: usize = 64;
pub const IO_DESC_BYTES: usize = 24;
pub const IO_CMD_BYTES: usize = 16;
pub const PARAMS_BYTES: usize = 112;

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_ne_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}
fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_ne_bytes(a)
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(a)
}

/// `struct ublksrv_ctrl_cmd`: a control command's arguments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtrlCmd {
    /// The device; `u32::MAX` in ADD_DEV: the lowest free id.
    pub dev_id: u32,
    /// Must be `u16::MAX` (no queue) for every command zcnbd sends.
    pub queue_id: u16,
    /// Bytes at `addr`.
    pub len: u16,
    /// The command's buffer (device info, parameters, features), in this process.
    pub addr: u64,
    /// START_DEV and END_USER_RECOVERY: the serving process's pid; GET_QUEUE_AFFINITY: the
    /// queue.
    pub data: u64,
}

impl CtrlCmd {
    /// The 32 bytes, to put at the start of a URING_CMD's 80-byte command area.
    pub fn encode(&self) -> [u8; CTRL_CMD_BYTES] {
        let mut b = [0u8; CTRL_CMD_BYTES];
        put_u32(&mut b, 0, self.dev_id);
        put_u16(&mut b, 4, self.queue_id);
        put_u16(&mut b, 6, self.len);
        put_u64(&mut b, 8, self.addr);
        put_u64(&mut b, 16, self.data);
        b
    }
}

/// `struct ublksrv_ctrl_dev_info`: what a device is; ADD_DEV writes the kernel's answer back
/// (its id, the features it kept, the queues it allowed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub flags: u64,
    /// Opaque to the kernel, kept with the device: zcnbd marks its devices here.
    pub ublksrv_flags: u64,
}

impl DevInfo {
    pub fn encode(&self) -> [u8; DEV_INFO_BYTES] {
        let mut b = [0u8; DEV_INFO_BYTES];
        put_u16(&mut b, 0, self.nr_hw_queues);
        put_u16(&mut b, 2, self.queue_depth);
        put_u16(&mut b, 4, self.state);
        put_u32(&mut b, 8, self.max_io_buf_bytes);
        put_u32(&mut b, 12, self.dev_id);
        put_u32(&mut b, 16, self.ublksrv_pid as u32);
        put_u64(&mut b, 24, self.flags);
        put_u64(&mut b, 32, self.ublksrv_flags);
        b
    }

    pub fn decode(b: &[u8; DEV_INFO_BYTES]) -> DevInfo {
        DevInfo {
            nr_hw_queues: get_u16(b, 0),
            queue_depth: get_u16(b, 2),
            state: get_u16(b, 4),
            max_io_buf_bytes: get_u32(b, 8),
            dev_id: get_u32(b, 12),
            ublksrv_pid: get_u32(b, 16) as i32,
            flags: get_u64(b, 24),
            ublksrv_flags: get_u64(b, 32),
        }
    }
}

/// `struct ublksrv_io_desc`: one request, as the kernel describes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoDesc {
    pub op_flags: u32,
    /// Length in 512-byte sectors.
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub addr: u64,
}

impl IoDesc {
    pub fn decode(b: &[u8]) -> IoDesc {
        IoDesc {
            op_flags: get_u32(b, 0),
            nr_sectors: get_u32(b, 4),
            start_sector: get_u64(b, 8),
            addr: get_u64(b, 16),
        }
    }

    /// The operation (`io_desc::OP_*`).
    pub fn op(&self) -> u8 {
        (self.op_flags & 0xff) as u8
    }

    pub fn offset(&self) -> u64 {
        self.start_sector << 9
    }

    pub fn bytes(&self) -> u64 {
        (self.nr_sectors as u64) << 9
    }
}

/// `struct ublksrv_io_cmd`: FETCH and COMMIT's arguments (the 16-byte command area).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    /// COMMIT: bytes done, or a negative errno.
    pub result: i32,
    /// Copy mode: the tag's buffer (the kernel copies a write's data there before the FETCH
    /// completes, and a read's data from there at COMMIT).
    pub addr: u64,
}

impl IoCmd {
    pub fn encode(&self) -> [u8; IO_CMD_BYTES] {
        let mut b = [0u8; IO_CMD_BYTES];
        put_u16(&mut b, 0, self.q_id);
        put_u16(&mut b, 2, self.tag);
        put_u32(&mut b, 4, self.result as u32);
        put_u64(&mut b, 8, self.addr);
        b
    }
}

/// `struct ublk_params` with its basic and discard parts (the only ones zcnbd sets).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Params {
    pub types: u32,
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub dev_sectors: u64,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
}

impl Params {
    pub fn encode(&self) -> [u8; PARAMS_BYTES] {
        let mut b = [0u8; PARAMS_BYTES];
        put_u32(&mut b, 0, PARAMS_BYTES as u32);
        put_u32(&mut b, 4, self.types);
        // basic, at 8
        put_u32(&mut b, 8, self.attrs);
        b[12] = self.logical_bs_shift;
        b[13] = self.physical_bs_shift;
        b[14] = self.io_opt_shift;
        b[15] = self.io_min_shift;
        put_u32(&mut b, 16, self.max_sectors);
        put_u64(&mut b, 24, self.dev_sectors);
        // discard, at 40: alignment 0, granularity, max discard, max write zeroes, segments
        put_u32(&mut b, 44, self.discard_granularity);
        put_u32(&mut b, 48, self.max_discard_sectors);
        put_u32(&mut b, 52, self.max_write_zeroes_sectors);
        put_u16(&mut b, 56, self.max_discard_segments);
        b
    }

    /// GET_PARAMS' answer (the parts above).
    pub fn decode(b: &[u8; PARAMS_BYTES]) -> Params {
        Params {
            types: get_u32(b, 4),
            attrs: get_u32(b, 8),
            logical_bs_shift: b[12],
            physical_bs_shift: b[13],
            io_opt_shift: b[14],
            io_min_shift: b[15],
            max_sectors: get_u32(b, 16),
            dev_sectors: get_u64(b, 24),
            discard_granularity: get_u32(b, 44),
            max_discard_sectors: get_u32(b, 48),
            max_write_zeroes_sectors: get_u32(b, 52),
            max_discard_segments: get_u16(b, 56),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_are_the_6_12_headers() {
        assert_eq!(ctrl_op::ADD_DEV, 0xC020_7504);
        assert_eq!(ctrl_op::START_DEV, 0xC020_7506);
        assert_eq!(ctrl_op::GET_DEV_INFO, 0x8020_7502);
        assert_eq!(ctrl_op::GET_FEATURES, 0x8020_7513);
        assert_eq!(ctrl_op::GET_QUEUE_AFFINITY, 0x8020_7501);
        assert_eq!(ctrl_op::END_USER_RECOVERY, 0xC020_7511);
        assert_eq!(io_op::FETCH_REQ, 0xC010_7520);
        assert_eq!(io_op::COMMIT_AND_FETCH_REQ, 0xC010_7521);
        assert_eq!(io_op::REGISTER_IO_BUF, 0xC010_7523);
    }

    #[test]
    fn layouts_are_the_c_ones() {
        let cmd = CtrlCmd {
            dev_id: u32::MAX,
            queue_id: u16::MAX,
            len: 64,
            addr: 0x1122_3344_5566_7788,
            data: 7,
        }
        .encode();
        assert_eq!(&cmd[0..4], &[0xff; 4]);
        assert_eq!(&cmd[6..8], &64u16.to_ne_bytes());
        assert_eq!(&cmd[8..16], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&cmd[16..24], &7u64.to_ne_bytes());
        let info = DevInfo {
            nr_hw_queues: 2,
            queue_depth: 128,
            state: state::QUIESCED,
            max_io_buf_bytes: 1 << 20,
            dev_id: 3,
            ublksrv_pid: -1,
            flags: feature::USER_RECOVERY | feature::USER_RECOVERY_REISSUE,
            ublksrv_flags: 0x7a63_6e62_6400,
        };
        let bytes = info.encode();
        assert_eq!(&bytes[16..20], &(-1i32).to_ne_bytes());
        assert_eq!(&bytes[24..32], &0x18u64.to_ne_bytes());
        assert_eq!(DevInfo::decode(&bytes), info);
        let given = Params {
            types: PARAM_TYPE_BASIC | PARAM_TYPE_DISCARD,
            attrs: attr::READ_ONLY,
            logical_bs_shift: 9,
            dev_sectors: 8,
            max_discard_segments: 1,
            ..Params::default()
        };
        let params = given.encode();
        assert_eq!(Params::decode(&params), given);
        assert_eq!(&params[0..4], &112u32.to_ne_bytes());
        assert_eq!(&params[24..32], &8u64.to_ne_bytes());
        assert_eq!(&params[56..58], &1u16.to_ne_bytes());
        let io = IoCmd {
            q_id: 1,
            tag: 5,
            result: -5,
            addr: 9,
        }
        .encode();
        assert_eq!(&io[2..4], &5u16.to_ne_bytes());
        assert_eq!(&io[4..8], &(-5i32).to_ne_bytes());
        let mut desc = [0u8; IO_DESC_BYTES];
        desc[0..4].copy_from_slice(&(1u32 | io_desc::F_FUA).to_ne_bytes());
        desc[4..8].copy_from_slice(&8u32.to_ne_bytes());
        desc[8..16].copy_from_slice(&2u64.to_ne_bytes());
        let d = IoDesc::decode(&desc);
        assert_eq!(
            (d.op(), d.offset(), d.bytes()),
            (io_desc::OP_WRITE, 1024, 4096)
        );
        assert!(d.op_flags & io_desc::F_FUA != 0);
    }

    #[test]
    fn zero_copy_encodings_are_the_6_16_headers() {
        // UBLKSRV_IO_BUF_OFFSET + (qid << UBLK_QID_OFF) + (tag << UBLK_TAG_OFF) + offset,
        // with UBLK_IO_BUF_BITS 25 and UBLK_TAG_BITS 16.
        assert_eq!(user_copy_pos(0, 0, 0), 0x8000_0000);
        assert_eq!(user_copy_pos(0, 1, 512), 0x8000_0000 + (1 << 25) + 512);
        assert_eq!(user_copy_pos(1, 0, 0), 0x8000_0000 + (1 << 41));
        assert_eq!(feature::AUTO_BUF_REG, 0x800);
        assert_eq!(feature::USER_COPY, 0x80);
        // index in the low 16 bits, flags (FALLBACK) in bits 16-23.
        assert_eq!(auto_buf_reg(7), 7 | 1 << 16);
        assert_eq!(io_desc::F_NEED_REG_BUF, 0x2_0000);
    }

    #[test]
    fn descriptor_areas_are_placed_per_queue() {
        assert_eq!(desc_area_offset(0), 0);
        assert_eq!(desc_area_offset(1), 98304);
        assert_eq!(desc_area_len(128), 4096);
        assert_eq!(desc_area_len(4096), 98304);
    }
}
