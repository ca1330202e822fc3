use super::super::netlink::{attrs, Attr, MESSAGE_HEADER_BYTES};
use super::*;

fn body(msg: &[u8]) -> &[u8] {
    &msg[MESSAGE_HEADER_BYTES + 4..]
}

fn u64_of(a: &Attr<'_>) -> u64 {
    u64::from_ne_bytes(a.value.try_into().unwrap())
}

#[test]
fn connect_carries_the_export_and_every_socket() {
    let msg = connect(
        0x1b,
        1,
        &Connect {
            index: None,
            size_bytes: 64 << 20,
            block_size_bytes: 512,
            server_flags: 0x1 | 0x4 | 0x100,
            timeout_s: 0,
            dead_conn_timeout_s: 300,
            sockets: &[5, 6],
            backend: "zcnbd:/tmp/disk.raw",
        },
    )
    .unwrap();
    assert_eq!(u16::from_ne_bytes(msg[4..6].try_into().unwrap()), 0x1b);
    assert_eq!(msg[16], cmd::CONNECT);
    let read = attrs(body(&msg)).unwrap();
    assert!(
        read.iter().all(|a| a.kind != attr::INDEX),
        "no index: the kernel picks"
    );
    let get = |k| read.iter().find(|a| a.kind == k).unwrap();
    assert_eq!(u64_of(get(attr::SIZE_BYTES)), 64 << 20);
    assert_eq!(u64_of(get(attr::BLOCK_SIZE_BYTES)), 512);
    assert_eq!(u64_of(get(attr::SERVER_FLAGS)), 0x105);
    assert_eq!(u64_of(get(attr::DEAD_CONN_TIMEOUT)), 300);
    assert_eq!(
        get(attr::BACKEND_IDENTIFIER).value,
        b"zcnbd:/tmp/disk.raw\0"
    );
    let items = get(attr::SOCKETS).nested().unwrap();
    assert!(items.iter().all(|i| i.kind == attr::SOCK_ITEM));
    let fds: Vec<u32> = items
        .iter()
        .map(|i| {
            let fd = i.nested().unwrap();
            assert_eq!(fd[0].kind, attr::SOCK_FD);
            fd[0].u32().unwrap()
        })
        .collect();
    assert_eq!(fds, [5, 6]);
}

#[test]
fn connect_to_a_chosen_index() {
    let msg = connect(
        0x1b,
        1,
        &Connect {
            index: Some(3),
            size_bytes: 1 << 20,
            block_size_bytes: 4096,
            server_flags: 1,
            timeout_s: 0,
            dead_conn_timeout_s: 0,
            sockets: &[9],
            backend: "zcnbd",
        },
    )
    .unwrap();
    let read = attrs(body(&msg)).unwrap();
    assert_eq!(read[0].kind, attr::INDEX);
    assert_eq!(read[0].u32().unwrap(), 3);
}

#[test]
fn disconnect_and_reconfigure_name_the_device() {
    let d = disconnect(0x1b, 2, 7).unwrap();
    assert_eq!(d[16], cmd::DISCONNECT);
    let read = attrs(body(&d)).unwrap();
    assert_eq!((read[0].kind, read[0].u32().unwrap()), (attr::INDEX, 7));
    let r = reconfigure(0x1b, 3, 7, &[11], "zcnbd:recovery:x").unwrap();
    assert_eq!(r[16], cmd::RECONFIGURE);
    let read = attrs(body(&r)).unwrap();
    assert_eq!(read[0].u32().unwrap(), 7);
    assert_eq!(read[1].kind, attr::BACKEND_IDENTIFIER);
    assert_eq!(read[1].value, b"zcnbd:recovery:x\0");
    let item = &read[2].nested().unwrap()[0];
    assert_eq!(item.nested().unwrap()[0].u32().unwrap(), 11);
}

#[test]
fn the_connect_reply_gives_the_index_or_an_error() {
    let mut reply = 8u16.to_ne_bytes().to_vec();
    reply.extend_from_slice(&attr::INDEX.to_ne_bytes());
    reply.extend_from_slice(&4u32.to_ne_bytes());
    assert_eq!(connected_index(&reply), Ok(4));
    assert!(connected_index(&reply[..6]).is_err());
    assert!(connected_index(&[]).is_err());
}
