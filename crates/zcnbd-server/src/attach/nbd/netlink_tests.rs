use super::*;

/// A message as the kernel would send it: header, then `body`.
fn message(kind: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let len = (MESSAGE_HEADER_BYTES + body.len()) as u32;
    let mut m = Vec::new();
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&0u16.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&77u32.to_ne_bytes());
    m.extend_from_slice(body);
    while !m.len().is_multiple_of(4) {
        m.push(0);
    }
    m
}

fn error(seq: u32, errno: i32) -> Vec<u8> {
    // The error code, then the request's header (as the kernel echoes it).
    let mut body = (-errno).to_ne_bytes().to_vec();
    body.extend_from_slice(&[0; MESSAGE_HEADER_BYTES]);
    message(TYPE_ERROR, seq, &body)
}

fn generic(family: u16, seq: u32, cmd: u8, attrs: &[u8]) -> Vec<u8> {
    let mut body = vec![cmd, 1, 0, 0];
    body.extend_from_slice(attrs);
    message(family, seq, &body)
}

fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut a = ((ATTR_HEADER_BYTES + value.len()) as u16)
        .to_ne_bytes()
        .to_vec();
    a.extend_from_slice(&kind.to_ne_bytes());
    a.extend_from_slice(value);
    while !a.len().is_multiple_of(4) {
        a.push(0);
    }
    a
}

#[test]
fn a_request_has_its_headers_and_padded_attributes() {
    let mut req = Request::new(0x1a, 7, 1, 42);
    req.u32(1, 5).string(2, "abc").u64(3, 1 << 40);
    let bytes = req.finish().unwrap();
    // 16 + 4, then 8, 8 ("abc\0"), 12.
    assert_eq!(bytes.len(), 20 + 8 + 8 + 12);
    assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap()), 48);
    assert_eq!(u16::from_ne_bytes(bytes[4..6].try_into().unwrap()), 0x1a);
    assert_eq!(
        u16::from_ne_bytes(bytes[6..8].try_into().unwrap()),
        0x5,
        "REQUEST|ACK"
    );
    assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into().unwrap()), 42);
    assert_eq!(&bytes[16..20], &[7, 1, 0, 0]);
    let read = attrs(&bytes[20..]).unwrap();
    assert_eq!(read.len(), 3);
    assert_eq!(read[0].u32().unwrap(), 5);
    assert_eq!(read[1].value, b"abc\0");
    assert_eq!(read[2].value, (1u64 << 40).to_ne_bytes());
}

#[test]
fn nested_attributes_carry_the_flag_and_their_whole_length() {
    let mut req = Request::new(0x1a, 1, 1, 1);
    req.nested(7, |s| {
        s.nested(1, |i| {
            i.u32(1, 3);
        });
        s.nested(1, |i| {
            i.u32(1, 4);
        });
    });
    let bytes = req.finish().unwrap();
    let outer = &bytes[20..];
    assert_eq!(
        u16::from_ne_bytes(outer[2..4].try_into().unwrap()),
        7 | ATTR_NESTED
    );
    assert_eq!(
        u16::from_ne_bytes(outer[0..2].try_into().unwrap()) as usize,
        outer.len()
    );
    let top = attrs(outer).unwrap();
    assert_eq!(top[0].kind, 7, "the nested flag is masked off when read");
    let items = top[0].nested().unwrap();
    let fds: Vec<u32> = items
        .iter()
        .map(|i| i.nested().unwrap()[0].u32().unwrap())
        .collect();
    assert_eq!(fds, [3, 4]);
}

#[test]
fn an_attribute_over_64k_is_refused_not_wrapped() {
    let mut req = Request::new(0x1a, 1, 1, 1);
    req.string(10, &"x".repeat(70_000));
    assert!(matches!(req.finish(), Err(NetlinkError::TooLong(_))));
}

#[test]
fn the_controller_answers_a_family_id() {
    let req = get_family("nbd", 9).unwrap();
    let read = attrs(&req[20..]).unwrap();
    assert_eq!(read[0].kind, CTRL_ATTR_FAMILY_NAME);
    assert_eq!(read[0].value, b"nbd\0");
    let mut reply_attrs = attr(CTRL_ATTR_FAMILY_NAME, b"nbd\0");
    reply_attrs.extend(attr(CTRL_ATTR_FAMILY_ID, &0x21u16.to_ne_bytes()));
    let mut datagram = generic(CONTROLLER, 9, 1, &reply_attrs);
    datagram.extend(error(9, 0));
    let mut answer = Answer::default();
    answer.take(&datagram, 9).unwrap();
    assert_eq!(answer.done, Some(Ok(())));
    let (_, body) = answer.reply.unwrap();
    assert_eq!(family_id(&body).unwrap(), 0x21);
}

#[test]
fn an_error_is_its_errno_and_other_requests_are_left_aside() {
    let mut datagram = error(3, 99);
    datagram.extend(error(4, libc::ENOENT));
    let mut answer = Answer::default();
    answer.take(&datagram, 4).unwrap();
    assert_eq!(answer.done, Some(Err(libc::ENOENT)));
    assert_eq!(answer.reply, None);
}

#[test]
fn a_reply_and_its_ack_may_come_in_two_datagrams() {
    let mut answer = Answer::default();
    answer
        .take(&generic(0x1a, 5, 1, &attr(1, &6u32.to_ne_bytes())), 5)
        .unwrap();
    assert_eq!(answer.done, None);
    answer.take(&error(5, 0), 5).unwrap();
    assert_eq!(answer.done, Some(Ok(())));
    assert_eq!(answer.reply.unwrap().0, 1);
}

#[test]
fn hostile_messages_are_errors() {
    let good = generic(0x1a, 5, 1, &attr(1, &6u32.to_ne_bytes()));
    // Every truncation of a valid message.
    for cut in 1..good.len() {
        let mut answer = Answer::default();
        assert!(answer.take(&good[..cut], 5).is_err(), "cut at {cut}");
    }
    // A message length shorter than its header, or past the datagram.
    let mut short = good.clone();
    short[0..4].copy_from_slice(&3u32.to_ne_bytes());
    assert!(matches!(
        messages(&short),
        Err(NetlinkError::BadLength { len: 3, .. })
    ));
    let mut long = good.clone();
    long[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
    assert_eq!(messages(&long), Err(NetlinkError::Truncated("message")));
    // An attribute length below its header, or past its message.
    let mut bad_attr = good.clone();
    bad_attr[20..22].copy_from_slice(&2u16.to_ne_bytes());
    assert!(Answer::default().take(&bad_attr, 5).is_err());
    let mut long_attr = good.clone();
    long_attr[20..22].copy_from_slice(&200u16.to_ne_bytes());
    assert!(Answer::default().take(&long_attr, 5).is_err());
    // An error message too short for its code; a generic message without its header.
    assert!(Answer::default()
        .take(&message(TYPE_ERROR, 5, &[0, 0]), 5)
        .is_err());
    assert!(Answer::default().take(&message(0x1a, 5, &[1]), 5).is_err());
    // A value of the wrong size.
    let two = attr(1, &[1, 2]);
    let wrong = attrs(&two).unwrap();
    assert!(matches!(
        wrong[0].u32(),
        Err(NetlinkError::BadValue { want: 4, .. })
    ));
    assert_eq!(find(&wrong, 9), Err(NetlinkError::Missing(9)));
}

#[test]
fn random_bytes_never_panic() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for len in 0..512 {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let _ = Answer::default().take(&bytes, 1);
        let _ = attrs(&bytes);
    }
}
