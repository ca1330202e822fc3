//! The `http_response` fuzz target's body (`fuzz/fuzz_targets/http_response.rs`), which the
//! unit tests also run over mangled heads: a response head parsed whole and cut short, and a
//! range checked against it. Nothing may panic; a head is "need more" until its last byte;
//! a range accepted is exactly the one asked.

use super::response::{check_range, parse_head, ContentRange, Framing, HEAD_BYTES_MAX};

/// `data`: 16 bytes of parameters (the range's offset and length, little-endian; the size is
/// the offset plus twice the length), then the bytes received from a server.
pub fn run(data: &[u8]) {
    let (params, received) = data.split_at(data.len().min(16));
    let mut p = [0u8; 16];
    p[..params.len()].copy_from_slice(params);
    let [a, b] = [&p[..8], &p[8..]].map(|h| u64::from_le_bytes(h.try_into().unwrap_or_default()));
    let (offset, len) = (a >> 1, (b >> 1).max(1));
    let size = offset.saturating_add(len.saturating_mul(2));
    let Ok(Some(head)) = parse_head(received) else {
        return;
    };
    assert!(head.len <= received.len() && head.len <= HEAD_BYTES_MAX);
    assert_eq!(parse_head(&received[..head.len]), Ok(Some(head.clone())));
    assert_eq!(parse_head(&received[..head.len - 1]), Ok(None));
    if let Ok((total, framing)) = check_range(&head, offset, len, Some(size)) {
        let last = offset + (len - 1);
        let wanted = ContentRange::Bytes {
            first: offset,
            last,
            total: Some(size),
        };
        assert_eq!((head.content_range, total), (Some(wanted), size));
        assert!(!head.transfer_coded);
        match framing {
            Framing::Length => assert_eq!(head.content_length, Some(len)),
            Framing::UntilClose => assert_eq!(head.content_length, None),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_range_asked_is_accepted() {
        let mut input: Vec<u8> = [4u64, 8].iter().flat_map(|p| p.to_le_bytes()).collect();
        input.extend_from_slice(b"HTTP/1.1 206 x\r\nContent-Range: bytes 2-5/10\r\n\r\nBODY");
        super::run(&input);
    }
}
