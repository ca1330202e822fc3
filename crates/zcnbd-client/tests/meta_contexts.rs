//! Metadata contexts beyond `base:allocation` against real servers: qemu-nbd (`-A -B b0`)
//! and zcnbd on a qcow2 chain with a persistent dirty bitmap (`common/images.rs`). What the
//! client reports for each context must be what nbdinfo (libnbd) reports on the same server,
//! and the dirty bitmap must be exactly the ranges written after it was added.

mod common;

use common::images::{self, Mapped, Served, BITMAP, DIRTY, IMAGE_BYTES};
use zcnbd_client::{Client, ClientOptions, Error};
use zcnbd_proto::consts::BASE_ALLOCATION;
use zcnbd_proto::meta::ALLOCATION_DEPTH;

const ABSENT: &str = "qemu:dirty-bitmap:absent";

fn connect(served: &Served, contexts: &[&str], connections: usize) -> Client {
    let options = ClientOptions {
        connections,
        meta_contexts: contexts.iter().map(|c| c.to_string()).collect(),
        ..ClientOptions::default()
    };
    Client::connect_with(&served.uri, &options).expect("connect")
}

/// The map of `context` over the whole export, asked in windows of at most `window` bytes
/// (each answer may cover less; the next request starts where it ended), merged.
fn walk(c: &Client, context: &str, window: u64) -> Vec<Mapped> {
    let size = c.size();
    let mut map = Vec::new();
    let mut at = 0;
    while at < size {
        let asked = window.min(size - at);
        let extents = c
            .block_status_of(context, at, asked)
            .unwrap_or_else(|e| panic!("{context} at {at}: {e}"));
        assert!(!extents.is_empty(), "{context} at {at}: no extents");
        let start = at;
        for e in extents {
            // The last extent may reach past the window; only what was asked counts.
            let length = e.length.min(start + asked - at);
            if length == 0 {
                break;
            }
            map.push((at, length, e.flags));
            at += length;
        }
    }
    images::merge(map)
}

/// The client's map of `context` equals nbdinfo's, whatever the window.
fn same_as_nbdinfo(c: &Client, served: &Served, context: &str) -> Vec<Mapped> {
    let oracle = images::nbdinfo_map(&served.uri, context);
    for window in [IMAGE_BYTES, 3 << 20, 1000 * 1024] {
        assert_eq!(
            walk(c, context, window),
            oracle,
            "{context}, window {window}"
        );
    }
    oracle
}

/// The dirty ranges of a bitmap map.
fn dirty(map: &[Mapped]) -> Vec<(u64, u64)> {
    map.iter()
        .filter(|e| e.2 & 1 != 0)
        .map(|e| (e.0, e.1))
        .collect()
}

fn needs_tools() -> Option<()> {
    match images::missing(&["qemu-img", "qemu-io", "qemu-nbd", "nbdinfo"]) {
        Some(tool) => images::skip("metadata contexts", &format!("{tool} is not installed")),
        None => Some(()),
    }
}

#[test]
fn qemu_nbd_dirty_bitmap_and_allocation_depth() {
    let Some(()) = needs_tools() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let image = images::make_chain(dir.path());
    let served = images::qemu_nbd(dir.path(), &image);
    let c = connect(&served, &[BITMAP, ALLOCATION_DEPTH, ABSENT], 1);

    // The absent bitmap is no error: it is not selected, and block status for it is refused.
    let mut names: Vec<&str> = c.meta_contexts().iter().map(|m| m.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, [BASE_ALLOCATION, ALLOCATION_DEPTH, BITMAP]);
    assert!(c.has_meta_context(BITMAP) && !c.has_meta_context(ABSENT));
    assert!(matches!(
        c.block_status_of(ABSENT, 0, 4096),
        Err(Error::Unsupported(_))
    ));

    let bitmap = same_as_nbdinfo(&c, &served, BITMAP);
    assert_eq!(dirty(&bitmap), DIRTY);
    let depth = same_as_nbdinfo(&c, &served, ALLOCATION_DEPTH);
    let depths: Vec<u32> = depth.iter().map(|e| e.2).collect();
    assert!([0, 1, 2].iter().all(|d| depths.contains(d)), "{depth:?}");
    same_as_nbdinfo(&c, &served, BASE_ALLOCATION);
    // The old call still answers for base:allocation.
    let base = c.block_status(0, IMAGE_BYTES).expect("base:allocation");
    assert_eq!(
        base,
        c.block_status_of(BASE_ALLOCATION, 0, IMAGE_BYTES).unwrap()
    );
    one_request_for_every_context(&c);
}

/// `block_status_all` routes one reply's chunks to their contexts: each list is what a
/// request for that context alone gets.
fn one_request_for_every_context(c: &Client) {
    for (offset, length) in [(0, IMAGE_BYTES), (1 << 20, 10 << 20), (20 << 20, 4096)] {
        let all = c.block_status_all(offset, length).expect("block status");
        assert_eq!(all.len(), c.meta_contexts().len());
        for (context, extents) in c.meta_contexts().iter().zip(&all) {
            let alone = c.block_status_of(&context.name, offset, length).unwrap();
            assert_eq!(extents, &alone, "{} at {offset}+{length}", context.name);
        }
    }
}

#[test]
fn qemu_nbd_contexts_over_several_connections() {
    let Some(()) = needs_tools() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let image = images::make_chain(dir.path());
    let served = images::qemu_nbd(dir.path(), &image);
    // Ids are per connection: every connection routes its chunks by its own.
    let c = connect(&served, &[ALLOCATION_DEPTH, BITMAP], 3);
    // qemu-nbd advertises multi-conn on a read-only export.
    assert_eq!(c.connections(), 3);
    let oracle = images::nbdinfo_map(&served.uri, BITMAP);
    for _ in 0..2 * c.connections() {
        assert_eq!(walk(&c, BITMAP, 5 << 20), oracle);
    }
    one_request_for_every_context(&c);
}

#[test]
fn qemu_nbd_only_the_contexts_asked_for() {
    let Some(()) = needs_tools() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let image = images::make_chain(dir.path());
    let served = images::qemu_nbd(dir.path(), &image);
    // The default: base:allocation alone, as before.
    let c = Client::connect(&served.uri).expect("connect");
    let names: Vec<&str> = c.meta_contexts().iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, [BASE_ALLOCATION]);
    assert!(matches!(
        c.block_status_of(BITMAP, 0, 4096),
        Err(Error::Unsupported(_))
    ));
    // Without base:allocation: the bitmap alone.
    let options = ClientOptions {
        base_allocation: false,
        meta_contexts: vec![BITMAP.into()],
        ..ClientOptions::default()
    };
    let c = Client::connect_with(&served.uri, &options).expect("connect");
    assert_eq!(c.meta_contexts().len(), 1);
    assert!(!c.geometry().base_allocation);
    assert!(matches!(
        c.block_status(0, 4096),
        Err(Error::Unsupported(_))
    ));
    assert_eq!(dirty(&walk(&c, BITMAP, IMAGE_BYTES)), DIRTY);
    // A bad list is refused before anything is sent.
    for bad in [vec!["no-namespace".to_string()], vec![BITMAP.into(); 2]] {
        let options = ClientOptions {
            meta_contexts: bad,
            ..ClientOptions::default()
        };
        let err = Client::connect_with(&served.uri, &options).err();
        assert!(matches!(err, Some(Error::MetaContexts(_))), "{err:?}");
    }
}

#[test]
fn zcnbd_allocation_depth_and_dirty_bitmap_of_a_qcow2_chain() {
    let Some(()) = needs_tools() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let image = images::make_chain(dir.path());
    let Some(served) = images::zcnbd(dir.path(), &image) else {
        return;
    };
    let c = connect(&served, &[ALLOCATION_DEPTH, BITMAP, ABSENT], 1);
    assert!(c.has_meta_context(ALLOCATION_DEPTH) && !c.has_meta_context(ABSENT));
    let depth = same_as_nbdinfo(&c, &served, ALLOCATION_DEPTH);
    same_as_nbdinfo(&c, &served, BASE_ALLOCATION);
    assert!(
        c.has_meta_context(BITMAP),
        "zcnbd serve -B b0 offers the image's bitmap"
    );
    assert_eq!(dirty(&same_as_nbdinfo(&c, &served, BITMAP)), DIRTY);
    one_request_for_every_context(&c);
    drop(c);
    drop(served);
    // The same chain under qemu-nbd: both servers see the same depths.
    let qemu = images::qemu_nbd(dir.path(), &image);
    assert_eq!(images::nbdinfo_map(&qemu.uri, ALLOCATION_DEPTH), depth);
}

#[test]
fn qemu_nbd_contexts_found_by_listing_its_namespace() {
    let Some(()) = needs_tools() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let image = images::make_chain(dir.path());
    let served = images::qemu_nbd(dir.path(), &image);
    for connections in [1, 3] {
        let options = ClientOptions {
            connections,
            list_meta_contexts: vec!["qemu:".into(), "base:".into()],
            ..ClientOptions::default()
        };
        let c = Client::connect_with(&served.uri, &options).expect("connect");
        assert_eq!(c.connections(), connections);
        let mut names: Vec<&str> = c.meta_contexts().iter().map(|m| m.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, [BASE_ALLOCATION, ALLOCATION_DEPTH, BITMAP]);
        assert_eq!(c.meta_contexts_left_out(), 0);
        assert_eq!(dirty(&same_as_nbdinfo(&c, &served, BITMAP)), DIRTY);
        same_as_nbdinfo(&c, &served, ALLOCATION_DEPTH);
        one_request_for_every_context(&c);
    }
}
