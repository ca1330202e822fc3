#!/usr/bin/env bash
# Disk images served by zcnbd beside qemu-nbd (issue 23): one `zcnbd bench` run per image kind,
# each target on its own copy of the same image (an image can be opened for writing by one
# server at a time: both take QEMU's locks), every copy read into the page cache the same way
# before the run so that no target starts warmer than another. Prints the tables; with OUT=DIR also keeps their
# Markdown and raw JSON there.
#
#   bench/images.sh [SCRATCH]     (default /var/tmp/zcnbd-images; removed at the end)
#
# Images (64 KiB clusters, qemu-img's default; made by qemu-img and qemu-io):
#   full   1 GiB, every cluster written (qemu-io writes it through)
#   half   1 GiB over a raw 1 GiB backing file full of data, every other MiB written in the image
#   empty  512 GiB, nothing written: every write allocates (random 4k writes, each in a new cluster
#          but for a few in a thousand; 2 s per cell, as each allocation costs a whole cluster of
#          disk: about 8 GiB per target)
# Targets: zcnbd (defaults), zcnbd --direct (O_DIRECT data clusters), qemu-nbd with its defaults
# (--cache=writeback --aio=threads), and qemu-nbd with --cache=none --aio=io_uring (O_DIRECT, the
# other choice QEMU's docs suggest).
# With OLD=PATH (an older zcnbd binary), a fourth target: OLD on its own copy (...-old.qcow2),
# right after this build's, to measure a change side by side in one run.
# Environment: ZCNBD (the binary), OLD, RUNTIME (default 5s), REPEAT (3), OUT, TAG (in the names
# of OUT's files), KINDS (default
# "full half empty"; in a tmpfs leave out empty, whose allocations would fill memory), RAMDISK.
# With RAMDISK=SIZE (say 9G; root and loop devices needed), SCRATCH is an ext4 made for the run
# on a loop device (`losetup --direct-io=on`) over a file of SIZE in /dev/shm: a disk in memory,
# so that O_DIRECT targets are held by what each server spends per request rather than by the
# machine's disk (the project's VMs' virtio disk gives both O_DIRECT servers the same 4 KiB
# IOPS). The loop device's own kernel threads' CPU is counted for neither server.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
zcnbd=${ZCNBD:-$repo/target/release/zcnbd}
scratch=${1:-/var/tmp/zcnbd-images}
runtime=${RUNTIME:-5s}
repeat=${REPEAT:-3}
out=${OUT:-}
kinds=${KINDS:-full half empty}
tag=${TAG:-}
old=${OLD:-}

for tool in qemu-img qemu-io qemu-nbd python3; do
    command -v "$tool" >/dev/null || { echo "bench/images.sh: $tool is missing (scripts/install-deps.sh)" >&2; exit 1; }
done
[ -x "$zcnbd" ] || { echo "bench/images.sh: no zcnbd at $zcnbd (cargo build --release)" >&2; exit 1; }
[ -z "$old" ] || [ -x "$old" ] || { echo "bench/images.sh: OLD=$old is not an executable" >&2; exit 1; }

ramdisk=${RAMDISK:-}
backing= loopdev=
cleanup() {
    cd /
    if [ -n "$loopdev" ]; then
        umount "$scratch" 2>/dev/null || true
        losetup -d "$loopdev" 2>/dev/null || true
    fi
    [ -z "$backing" ] || rm -f "$backing"
    rm -rf "$scratch"
}
rm -rf "$scratch"
mkdir -p "$scratch"
trap cleanup EXIT
if [ -n "$ramdisk" ]; then
    backing=$(mktemp /dev/shm/zcnbd-images-XXXXXX)
    truncate -s "$ramdisk" "$backing"
    loopdev=$(losetup --direct-io=on -f --show "$backing")
    mkfs.ext4 -q "$loopdev"
    mount "$loopdev" "$scratch"
    echo "scratch: ext4 on $loopdev (direct I/O) over $backing ($ramdisk)" >&2
fi
cd "$scratch"

qcow2() { qemu-img create -q -f qcow2 -o cluster_size=64k "$@"; }

echo "making the images in $scratch" >&2
qcow2 full.qcow2 1G
qemu-io -f qcow2 -c "write -P 0x5a 0 1G" full.qcow2 >/dev/null
qemu-img create -q -f raw base.raw 1G
qemu-io -f raw -c "write -P 0x3c 0 1G" base.raw >/dev/null
qcow2 -b base.raw -F raw half.qcow2 1G
half_writes=()
for ((mib = 0; mib < 1024; mib += 2)); do
    half_writes+=(-c "write -P 0x77 ${mib}M 1M")
done
qemu-io -f qcow2 "${half_writes[@]}" half.qcow2 >/dev/null
qcow2 empty.qcow2 512G
for kind in full half empty; do
    for target in zcnbd zcnbd-direct qemu qemu-direct ${old:+old}; do
        cp --sparse=always "$kind.qcow2" "$kind-$target.qcow2"
    done
done
sync
# Every copy's pages dropped from the cache, then read once: each target starts with its whole
# image in the page cache, in the same state as the others' (the servers, not the disk, are
# measured; the O_DIRECT targets read the disk whatever the cache holds).
python3 -c '
import os, sys
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    while os.read(fd, 1 << 20):
        pass
    os.close(fd)
' ./*.qcow2 base.raw

# run KIND RW BS SIZE [RUNTIME]: one interleaved zcnbd bench run over the three copies of KIND.
run() {
    local kind=$1 rw=$2 bs=$3 size=$4 seconds=${5:-$runtime}
    local args=(--rw "$rw" --bs "$bs" --runtime "$seconds" --repeat "$repeat" --size "$size"
        --no-prefill --no-ceiling)
    if [ -n "$out" ]; then
        mkdir -p "$out"
        args+=(--json "$out/images$tag-$kind.json" --markdown "$out/images$tag-$kind.md")
    fi
    echo >&2
    echo "== $kind: $rw $bs" >&2
    local targets=("zcnbd:$scratch/$kind-zcnbd.qcow2" "zcnbd:$scratch/$kind-zcnbd-direct.qcow2:direct")
    if [ -n "$old" ]; then
        targets+=("zcnbd@$old:$scratch/$kind-old.qcow2")
    fi
    "$zcnbd" bench "${targets[@]}" \
        "qemu-nbd:$scratch/$kind-qemu.qcow2" \
        "qemu-nbd:$scratch/$kind-qemu-direct.qcow2:--cache=none:--aio=io_uring" "${args[@]}"
}

for kind in $kinds; do
    case $kind in
    full) run full randread,randwrite 4k,1m 1G ;;
    half) run half randread 4k,1m 1G ;;
    empty) run empty randwrite 4k 512G 2s ;;
    *) echo "bench/images.sh: no image kind $kind" >&2; exit 1 ;;
    esac
done
