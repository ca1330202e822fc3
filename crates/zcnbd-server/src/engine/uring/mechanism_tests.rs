//! Every row of the io_uring engine's data-path table (`uring`), as the policy decides it.

use super::*;
use Medium::*;
use ReadMechanism as R;
use WriteMechanism as W;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

fn options(data_path: DataPath) -> EngineOptions {
    EngineOptions {
        data_path,
        ..EngineOptions::default()
    }
}

fn read(medium: Medium, len: usize) -> ReadFacts {
    ReadFacts {
        medium,
        len,
        sendfile_ok: true,
        sendfile_min: usize::MAX,
    }
}

fn write(medium: Medium, len: usize) -> WriteFacts {
    WriteFacts {
        medium,
        len,
        fua: false,
        stage_empty: true,
        socket_fionread: true,
        in_place_max: usize::MAX,
    }
}

#[test]
fn reads_by_data_path_and_medium() {
    use DataPath::*;
    let cases = [
        (Memory, [R::Bounce, R::Sendfile, R::Mapped]),
        (PageCache, [R::Bounce, R::Splice, R::Bounce]),
        (Direct, [R::Direct, R::Direct, R::Direct]),
    ];
    for (medium, expected) in cases {
        for (path, want) in [Copy, ZeroCopy, Auto].into_iter().zip(expected) {
            let got = choose_read(&options(path), read(medium, 64 * KIB));
            assert_eq!(got, want, "{medium:?} under {path:?}");
        }
    }
}

#[test]
fn auto_splices_reads_from_the_threshold_and_sendfile_needs_a_nonblocking_socket() {
    let o = EngineOptions {
        splice_min_bytes: Some(MIB),
        ..options(DataPath::Auto)
    };
    let memory = |len| ReadFacts {
        sendfile_min: remote_splice_min(&o, true),
        ..read(Memory, len)
    };
    assert_eq!(choose_read(&o, memory(MIB - 1)), R::Mapped);
    assert_eq!(choose_read(&o, memory(MIB)), R::Sendfile);
    assert_eq!(choose_read(&o, read(PageCache, MIB)), R::Splice);
    let blocking = ReadFacts {
        sendfile_ok: false,
        ..memory(MIB)
    };
    assert_eq!(choose_read(&o, blocking), R::Mapped);
}

#[test]
fn auto_sends_large_memory_reads_by_sendfile_only_to_peers_on_another_host() {
    let o = options(DataPath::Auto);
    assert_eq!(remote_splice_min(&o, true), usize::MAX);
    assert_eq!(remote_splice_min(&o, false), SPLICE_MIN_BYTES_REMOTE);
    let remote = |len| ReadFacts {
        sendfile_min: remote_splice_min(&o, false),
        ..read(Memory, len)
    };
    assert_eq!(choose_read(&o, remote(256 * KIB - 1)), R::Mapped);
    assert_eq!(choose_read(&o, remote(256 * KIB)), R::Sendfile);
    // Files keep their own default (never), whoever the peer.
    assert_eq!(choose_read(&o, read(PageCache, MIB)), R::Bounce);
    // An explicit --splice-min-bytes holds for every peer.
    let set = EngineOptions {
        splice_min_bytes: Some(64 * KIB),
        ..options(DataPath::Auto)
    };
    assert_eq!(remote_splice_min(&set, true), 64 * KIB);
    assert_eq!(remote_splice_min(&set, false), 64 * KIB);
}

#[test]
fn a_peer_is_on_this_host_over_loopback_at_our_own_address_or_without_ip() {
    let ip = |s: &str| Some(s.parse::<std::net::IpAddr>().unwrap());
    assert!(is_same_host(None, None));
    assert!(is_same_host(ip("127.0.0.1"), ip("127.0.0.1")));
    assert!(is_same_host(ip("127.0.0.2"), ip("127.0.0.1")));
    assert!(is_same_host(ip("::1"), ip("::1")));
    assert!(is_same_host(ip("10.1.2.3"), ip("10.1.2.3")));
    assert!(!is_same_host(ip("10.1.2.4"), ip("10.1.2.3")));
    assert!(!is_same_host(ip("fd00::2"), ip("fd00::1")));
}

#[test]
fn writes_by_data_path_and_medium() {
    use DataPath::*;
    let cases = [
        (Memory, [W::Bounce, W::InPlace, W::InPlace]),
        (PageCache, [W::Bounce, W::Piped, W::Piped]),
        (Direct, [W::Direct, W::Direct, W::Direct]),
    ];
    for (medium, expected) in cases {
        for (path, want) in [Copy, ZeroCopy, Auto].into_iter().zip(expected) {
            let got = choose_write(&options(path), write(medium, MIB));
            assert_eq!(got, want, "{medium:?} under {path:?}");
        }
    }
}

#[test]
fn spliced_writes_need_the_threshold_no_fua_an_empty_stage_and_fionread() {
    let o = options(DataPath::Auto);
    let min = o.receive_splice_min_bytes;
    assert_eq!(choose_write(&o, write(PageCache, min - 1)), W::Bounce);
    assert_eq!(choose_write(&o, write(PageCache, min)), W::Piped);
    let fua = WriteFacts {
        fua: true,
        ..write(PageCache, min)
    };
    assert_eq!(choose_write(&o, fua), W::Bounce);
    let staged = WriteFacts {
        stage_empty: false,
        ..write(PageCache, min)
    };
    assert_eq!(choose_write(&o, staged), W::Bounce);
    let vsock = WriteFacts {
        socket_fionread: false,
        ..write(PageCache, min)
    };
    assert_eq!(choose_write(&o, vsock), W::Bounce);
    assert_eq!(choose_write(&options(DataPath::ZeroCopy), vsock), W::Bounce);
}

#[test]
fn auto_receives_memory_writes_of_every_size_in_place_unless_limited() {
    let o = options(DataPath::Auto);
    assert_eq!(in_place_max(&o), usize::MAX);
    let facts = |max, len| WriteFacts {
        in_place_max: max,
        ..write(Memory, len)
    };
    assert_eq!(
        choose_write(&o, facts(in_place_max(&o), 4 * MIB)),
        W::InPlace
    );
    let set = EngineOptions {
        receive_in_place_max_bytes: Some(4096),
        ..options(DataPath::Auto)
    };
    assert_eq!(in_place_max(&set), 4096);
    assert_eq!(choose_write(&set, facts(4096, 4096)), W::InPlace);
    assert_eq!(choose_write(&set, facts(4096, 4097)), W::Bounce);
    // The baseline and zerocopy ignore the limit.
    assert_eq!(
        choose_write(&options(DataPath::Copy), facts(4096, 16)),
        W::Bounce
    );
    assert_eq!(
        choose_write(&options(DataPath::ZeroCopy), facts(4096, MIB)),
        W::InPlace
    );
}

#[test]
fn zero_copy_sends_and_registered_buffers() {
    let auto = options(DataPath::Auto);
    let min = auto.zerocopy_send_min_bytes;
    assert!(!zerocopy_send_pays(&auto, min - 1));
    assert!(zerocopy_send_pays(&auto, min));
    assert!(zerocopy_send_pays(&options(DataPath::ZeroCopy), 1));
    assert!(!zerocopy_send_pays(&options(DataPath::Copy), MIB));
    assert!(uses_fixed_buffers(&auto, Some(Direct)));
    assert!(!uses_fixed_buffers(&options(DataPath::Copy), Some(Direct)));
    assert!(!uses_fixed_buffers(&auto, Some(Memory)));
}
