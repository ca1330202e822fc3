//! `Sqe::lend`: what each operation lends and points at, and what a failure gives back.
use super::*;
use crate::buffer_pool::BufferPool;

fn recv_mem() -> Lent<Box<RecvMem>> {
    Lent::new(RecvMem::new(vec![0; 64].into_boxed_slice(), 16))
}

#[test]
fn a_receive_lends_the_range_it_points_at() {
    let mut mem = recv_mem();
    let (range, wait_all) = (4..12, true);
    let op = Op::RecvStage {
        fd: 3,
        mem: &mut mem,
        range,
        wait_all,
    };
    let prepared = Sqe::new(7, op).lend().unwrap();
    assert!(matches!(prepared, Prepared::Recv { len: 8, .. }));
    assert_eq!(prepared.fill(b"0123456789"), 8);
    assert!(mem.is_lent() && mem.get_mut().is_none());
    mem.complete();
    assert_eq!(&mem.get_mut().unwrap().stage[4..12], b"01234567");
}

#[test]
fn a_range_outside_the_memory_lends_nothing() {
    let mut mem = recv_mem();
    let (range, wait_all) = (60..70, false);
    let op = Op::RecvStage {
        fd: 3,
        mem: &mut mem,
        range,
        wait_all,
    };
    assert!(Sqe::new(7, op).lend().is_err());
    assert!(!mem.is_lent());
}

#[test]
fn a_failed_chain_gives_back_what_it_lent() {
    let pool = BufferPool::new(0);
    let mut header = Lent::new(b"head".to_vec());
    let mut buf = Lent::new(IoBuf::Pooled(pool.get(8)));
    let send = Op::SendMore {
        fd: 3,
        bytes: &mut header,
        from: 1,
        more: true,
    };
    let past_the_end = Op::Write {
        fd: 4,
        buf: &mut buf,
        from: 9,
        offset: 0,
        dsync: false,
    };
    let mut chain = [Sqe::new(1, send), Sqe::new(2, past_the_end)];
    assert!(lend_chain(&mut chain).is_err());
    assert!(!header.is_lent() && !buf.is_lent());
}

#[test]
fn payload_and_next_header_share_one_recvmsg() {
    let pool = BufferPool::new(0);
    let mut dest = Lent::new(Dest::Buf(IoBuf::Pooled(pool.get(6))));
    let mut mem = recv_mem();
    let op = Op::RecvPayloadAndHeader {
        fd: 3,
        dest: &mut dest,
        range: 2..6,
        mem: &mut mem,
        header_bytes: 32,
    };
    let mut sqe = Sqe::new(1, op);
    assert_eq!(sqe.lend().unwrap().fill(b"abcdHEADER"), 10);
    // Stands in for the completion.
    sqe.unlend();
    let Some(Dest::Buf(buf)) = dest.get_mut() else {
        panic!("the payload buffer is still lent");
    };
    assert_eq!(&buf.as_mut_slice()[2..6], b"abcd");
    assert_eq!(&mem.get_mut().unwrap().stage[..6], b"HEADER");
}

#[test]
fn a_spliced_replys_header_sends_its_rest() {
    let mut header = Lent::new(b"header".to_vec());
    let op = Op::SendMore {
        fd: 3,
        bytes: &mut header,
        from: 2,
        more: true,
    };
    assert_eq!(Sqe::new(1, op).lend().unwrap().bytes(), b"ader");
    assert!(header.is_lent());
    header.complete();
}
