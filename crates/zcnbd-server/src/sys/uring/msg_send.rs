//! A `sendmsg` (or `SENDMSG_ZC` / `SEND_ZC`) in flight, and the two pieces of memory it
//! lends the kernel, each for as long as the kernel may use it:
//!
//! - the iovecs and the `msghdr` pointing at them, read while the send runs: lent to each
//!   submission until that submission's result;
//! - the items (reply buffers, registered runs, mapping references) the iovecs point into:
//!   lent to each submission until its *last* completion, which for a zero-copy send is the
//!   kernel's notification (`IORING_CQE_F_NOTIF`) that it no longer holds the pages.
//!
//! A send is settled - its items can be retired - once neither is lent.

use super::fixed::FixedBuf;
use super::lent::Lent;
use crate::sys::mapping::MappedRange;

/// A piece of a reply on the wire, borrowed from the item that holds it.
pub enum WirePiece<'a> {
    /// Bytes the item owns (headers, a reply buffer).
    Bytes(&'a [u8]),
    /// A range of the memory export's mapping.
    Mapped(&'a MappedRange),
    /// A registered run: its header and data, one contiguous range.
    Fixed(&'a FixedBuf),
}

/// What a send carries: items that say what bytes they put on the wire, in order.
///
/// Safe to implement: every piece is borrowed from the item for as long as the item is
/// (`'a`), and `'static` items own what they lend, so a piece stays valid and unchanged as
/// long as the item is neither changed nor dropped - which the send's [`Lent`] ensures until
/// the kernel is done with it.
pub trait Wire: 'static {
    /// Calls `visit` with each piece, in wire order.
    fn pieces<'a>(&'a self, visit: &mut dyn FnMut(WirePiece<'a>));
}

/// The iovecs of a send and the `msghdr` that points at those still to send. Boxed, so the
/// addresses the kernel holds do not move with the send.
struct MsgVecs {
    iov: Vec<libc::iovec>,
    /// First iovec not yet fully sent.
    iov_start: usize,
    msg: libc::msghdr,
}

impl MsgVecs {
    /// Trims the first `n` unsent bytes off the iovecs.
    fn advance(&mut self, mut n: usize) {
        while n > 0 && self.iov_start < self.iov.len() {
            let v = &mut self.iov[self.iov_start];
            if n >= v.iov_len {
                n -= v.iov_len;
                v.iov_len = 0;
                self.iov_start += 1;
            } else {
                v.iov_base = (v.iov_base as usize + n) as *mut _;
                v.iov_len -= n;
                n = 0;
            }
        }
        while self.iov_start < self.iov.len() && self.iov[self.iov_start].iov_len == 0 {
            self.iov_start += 1;
        }
    }

    /// What the next submission points at: the one range left of registered buffer
    /// `fixed`, if given and that is all that is left; the one range left of a `plain`
    /// (not zero-copy) send; otherwise the `msghdr`, pointed at the iovecs still to send.
    fn target(&mut self, fixed: Option<u16>, plain: bool) -> SendTarget {
        let rest = &mut self.iov[self.iov_start..];
        if let (Some(index), [range]) = (fixed, &*rest) {
            return SendTarget::Fixed {
                ptr: range.iov_base.cast_const().cast(),
                len: range.iov_len,
                index,
            };
        }
        if let (true, [range]) = (plain, &*rest) {
            return SendTarget::One {
                ptr: range.iov_base.cast_const().cast(),
                len: range.iov_len,
            };
        }
        self.msg.msg_iov = rest.as_mut_ptr();
        self.msg.msg_iovlen = rest.len() as _;
        SendTarget::Msg(&self.msg)
    }
}

/// What a send's submission entry points at.
pub enum SendTarget {
    /// A `msghdr`, for `sendmsg` or `SENDMSG_ZC`.
    Msg(*const libc::msghdr),
    /// `len` bytes at `ptr`, for a plain `SEND`: a reply (or the rest of a batch) in one
    /// range needs no `msghdr` and iovec array copied in and checked, which under a client
    /// that keeps one small write in flight is most sends.
    One { ptr: *const u8, len: usize },
    /// `len` bytes at `ptr` inside registered buffer `index`, for `SEND_ZC`.
    Fixed {
        ptr: *const u8,
        len: usize,
        index: u16,
    },
}

/// A send in flight: its items and the iovecs pointing into them, each in a [`Lent`].
pub struct MsgSend<I> {
    /// Lent to every submission until its last completion (result, or notification).
    items: Lent<Vec<I>>,
    /// Lent to every submission until its result.
    vecs: Lent<Box<MsgVecs>>,
    /// The registered buffer of a lone fixed reply, named by a zero-copy `SEND_ZC`.
    fixed: Option<u16>,
    pub sent: usize,
    pub total: usize,
    /// How many items the send carries.
    pub count: usize,
    pub zerocopy: bool,
    /// A notification said the kernel copied the data anyway.
    pub copied: bool,
}

/// The iovecs of `items`' pieces, and the registered buffer if they are one fixed run.
fn layout<I: Wire>(items: &[I]) -> (Vec<libc::iovec>, Option<u16>) {
    let mut iov = Vec::with_capacity(items.len() * 2);
    let mut fixed = None;
    let iovec = |ptr: *const u8, len: usize| libc::iovec {
        iov_base: ptr as *mut _,
        iov_len: len,
    };
    for item in items {
        item.pieces(&mut |piece| match piece {
            WirePiece::Bytes(bytes) => iov.push(iovec(bytes.as_ptr(), bytes.len())),
            // Validation put the range inside the export, which the mapping covers.
            WirePiece::Mapped(range) => {
                if let Some(ptr) = range.io_range(0..range.len()) {
                    iov.push(iovec(ptr, range.len()));
                }
            }
            WirePiece::Fixed(buf) => {
                let (start, len) = buf.wire();
                fixed = Some(buf.index());
                iov.push(iovec(start, len));
            }
        });
    }
    // Only a send that is one registered run can name it.
    let fixed = fixed.filter(|_| iov.len() == 1);
    (iov, fixed)
}

impl<I: Wire> MsgSend<I> {
    /// A send of `items`, laid out but not yet submitted.
    pub fn new(items: Vec<I>, zerocopy: bool) -> Box<MsgSend<I>> {
        let (iov, fixed) = layout(&items);
        let total = iov.iter().map(|v| v.iov_len).sum();
        let count = items.len();
        // SAFETY: msghdr is a plain C struct of integers and pointers (plus, on some libcs,
        // padding), for all of which zero is a valid value.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        let vecs = Box::new(MsgVecs {
            iov,
            iov_start: 0,
            msg,
        });
        Box::new(MsgSend {
            items: Lent::new(items),
            vecs: Lent::new(vecs),
            fixed,
            sent: 0,
            total,
            count,
            zerocopy,
            copied: false,
        })
    }

    /// Lends the iovecs and the items to one more submission and says what its entry points
    /// at; the driver submits it, or calls [`MsgSend::not_submitted`]. `None` while the
    /// previous submission's result is still to come (its `msghdr` must not change).
    pub(super) fn lend(&mut self) -> Option<SendTarget> {
        if self.vecs.is_lent() {
            return None;
        }
        let fixed = self.fixed.filter(|_| self.zerocopy);
        // `SEND_ZC` reads the registered range, not the `msghdr`; lending the iovecs to it
        // anyway keeps one rule for every result.
        let plain = !self.zerocopy;
        let target = self.vecs.lend(|vecs| vecs.target(fixed, plain));
        // The iovecs point into the items, which the kernel reads until the last completion.
        self.items.lend(|_| ());
        Some(target)
    }

    /// A submission's result arrived: the kernel is done with the iovecs and, unless a
    /// notification is still to come (`more`), with the items.
    pub fn on_result(&mut self, more: bool) {
        self.vecs.complete();
        if !more {
            self.items.complete();
        }
    }

    /// A zero-copy notification arrived: the kernel no longer holds that submission's pages.
    pub fn on_notification(&mut self) {
        self.items.complete();
    }

    /// The lent submission was never submitted: everything comes straight back.
    pub(super) fn not_submitted(&mut self) {
        self.on_result(false);
    }

    /// Marks `n` more bytes sent, trimming the iovecs; true when everything is sent. Called
    /// after the result that reported them, when the iovecs are no longer lent.
    pub fn advance(&mut self, n: usize) -> bool {
        self.sent += n;
        if let Some(vecs) = self.vecs.get_mut() {
            vecs.advance(n);
        }
        self.sent >= self.total
    }

    /// Whether nothing more will complete for this send: nothing is lent.
    pub fn is_settled(&self) -> bool {
        !self.items.is_lent() && !self.vecs.is_lent()
    }

    /// The items back, once the send is settled; otherwise they stay lent (and leak).
    pub fn into_items(self) -> Result<Vec<I>, Lent<Vec<I>>> {
        self.items.reclaim()
    }
}

/// A send the driver can submit, whatever its items: what `Op::SendMsg` takes. Sealed:
/// the driver trusts what it points at, so only [`MsgSend`] is one. Its methods are the
/// driver's: a connection reports completions with [`MsgSend::on_result`] and
/// [`MsgSend::on_notification`].
pub trait SendLoan: sealed::Sealed {
    /// See [`MsgSend::lend`].
    fn lend_target(&mut self) -> Option<(SendTarget, bool)>;
    /// See [`MsgSend::not_submitted`].
    fn unlend(&mut self);
}

mod sealed {
    pub trait Sealed {}
    impl<I> Sealed for super::MsgSend<I> {}
}

impl<I: Wire> SendLoan for MsgSend<I> {
    fn lend_target(&mut self) -> Option<(SendTarget, bool)> {
        let zerocopy = self.zerocopy;
        self.lend().map(|target| (target, zerocopy))
    }

    fn unlend(&mut self) {
        self.not_submitted();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Header-only items.
    impl Wire for Vec<u8> {
        fn pieces<'a>(&'a self, visit: &mut dyn FnMut(WirePiece<'a>)) {
            visit(WirePiece::Bytes(self));
        }
    }

    fn header_item(bytes: &[u8]) -> Vec<u8> {
        bytes.to_vec()
    }

    #[test]
    fn advance_trims_iovecs_across_boundaries() {
        let mut send = MsgSend::new(vec![header_item(b"abcd"), header_item(b"efgh")], false);
        assert_eq!(send.total, 8);
        let Some(SendTarget::Msg(msg)) = send.lend() else {
            panic!("a send of two ranges points at a msghdr");
        };
        // SAFETY: `msg` points into `send`'s boxed iovecs, which are alive and lent here.
        assert_eq!(unsafe { (*msg).msg_iovlen }, 2);
        send.on_result(false);
        assert!(!send.advance(5));
        // One range left: a plain send points at it.
        let Some(SendTarget::One { ptr, len }) = send.lend() else {
            panic!("the rest of a plain send is one range");
        };
        assert_eq!(len, 3);
        // SAFETY: `ptr..ptr + len` lies in the second item, alive and lent here.
        assert_eq!(unsafe { std::slice::from_raw_parts(ptr, len) }, b"fgh");
        send.on_result(false);
        assert!(send.advance(3));
        assert!(send.is_settled());
    }

    #[test]
    fn a_zero_copy_send_of_one_range_still_points_at_a_msghdr() {
        let mut send = MsgSend::new(vec![header_item(b"abcd")], true);
        assert!(matches!(send.lend(), Some(SendTarget::Msg(_))));
        send.on_result(true);
        send.on_notification();
        assert!(send.is_settled());
    }

    #[test]
    fn iovecs_come_back_with_the_result_items_with_the_notification() {
        let mut send = MsgSend::new(vec![header_item(b"abcd")], true);
        assert!(send.lend().is_some());
        // The msghdr is the kernel's until the result.
        assert!(send.lend().is_none());
        send.on_result(true);
        assert!(
            !send.is_settled(),
            "settled before the zero-copy notification"
        );
        // A retry may go out while the first notification is still to come.
        assert!(send.lend().is_some());
        send.on_result(true);
        send.on_notification();
        assert!(!send.is_settled());
        send.on_notification();
        assert!(send.is_settled());
        assert_eq!((*send).into_items().map(|items| items.len()).ok(), Some(1));
    }

    #[test]
    fn unsettled_items_are_not_handed_back() {
        let mut send = MsgSend::new(vec![header_item(b"ab")], false);
        assert!(send.lend().is_some());
        assert!((*send).into_items().is_err());
    }
}
