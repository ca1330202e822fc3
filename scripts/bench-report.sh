#!/usr/bin/env bash
# Today's results for a reader: zcnbd beside nbdkit and qemu-nbd on this machine, one
# interleaved `zcnbd bench` run per source - a memory export (plain and TLS; qemu-nbd, which
# has none, serves a file in tmpfs), a raw file, a
# qcow2 image (qemu-nbd only: nbdkit has no qcow2 plugin in Debian), and a Ceph RBD image on a
# throwaway cluster (RBD=1; qemu-nbd, and fio's rbd engine with no NBD, fio driving) - each over randread and randwrite at 4 KiB, 64 KiB
# and 1 MiB and queue depths 1 and 16. Writes docs/benchmarks/README.md (the tables, the
# machine, the versions, the commit, the date and this command) and keeps every run's raw JSON
# Markdown and plot in docs/benchmarks/data/DATE-COMMIT/.
#
#   scripts/bench-report.sh            REPEAT=3 RUNTIME=3s: about 25 minutes; RBD=1 adds ~6
#
# A benchmark is a program that prints a table, never a test: nothing here fails on a number.
# Environment: ZCNBD (the binary), REPEAT, RUNTIME, RBD=1, SCRATCH (default /var/tmp/zcnbd-report).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
zcnbd=${ZCNBD:-$repo/target/release/zcnbd}
repeat=${REPEAT:-3}
runtime=${RUNTIME:-3s}
scratch=${SCRATCH:-/var/tmp/zcnbd-report}
for tool in nbdkit qemu-nbd qemu-img qemu-io; do
    command -v "$tool" >/dev/null ||
        { echo "bench-report.sh: $tool is missing (scripts/install-deps.sh)" >&2; exit 1; }
done
[ -x "$zcnbd" ] || { echo "bench-report.sh: no zcnbd at $zcnbd (cargo build --release)" >&2; exit 1; }

date=$(date -u +%F)
commit=$(git -C "$repo" rev-parse --short HEAD)
dirty=$(git -C "$repo" status --porcelain --untracked-files=no | head -1)
data=docs/benchmarks/data/$date-$commit
mkdir -p "$repo/$data"
rm -rf "$scratch"
mkdir -p "$scratch"
trap 'rm -rf "$scratch"; [ -z "${ceph_dir:-}" ] || "$repo/tests/ceph/cluster.sh" stop "$ceph_dir" >/dev/null 2>&1' EXIT

# Each target on its own copy of the data: QEMU and zcnbd lock the files they serve.
echo "making the files in $scratch" >&2
for t in zcnbd nbdkit qemu; do
    qemu-img create -q -f raw "$scratch/file-$t.raw" 1G
    qemu-io -f raw -c "write -P 0x5a 0 1G" "$scratch/file-$t.raw" >/dev/null
done
for t in zcnbd qemu; do
    qemu-img create -q -f qcow2 -o cluster_size=64k "$scratch/image-$t.qcow2" 1G
    qemu-io -f qcow2 -c "write -P 0x5a 0 1G" "$scratch/image-$t.qcow2" >/dev/null
done
sync

matrix=(--rw randread,randwrite --bs 4k,64k,1m --iodepth 1,16 --runtime "$runtime"
    --repeat "$repeat" --size 1G --no-ceiling)
# run NAME TARGET...: one interleaved run, its JSON and Markdown kept.
run() {
    local name=$1
    shift
    echo >&2
    echo "== $name: $*" >&2
    "$zcnbd" bench "$@" "${matrix[@]}" --json "$repo/$data/$name.json" \
        --markdown "$repo/$data/$name.md" --plot "$repo/$data/$name.png"
}

# qemu-nbd has no memory export: a file in tmpfs stands in for it.
shm=/dev/shm/zcnbd-report
rm -rf "$shm"
mkdir -p "$shm"
trap 'rm -rf "$scratch" "$shm"; [ -z "${ceph_dir:-}" ] || "$repo/tests/ceph/cluster.sh" stop "$ceph_dir" >/dev/null 2>&1' EXIT
truncate -s 1G "$shm/memory.raw" "$shm/memory-tls.raw"
run memory zcnbd:memory nbdkit:memory "qemu-nbd:$shm/memory.raw"
run memory-tls zcnbd:memory:tls nbdkit:memory:tls "qemu-nbd:$shm/memory-tls.raw:tls"
run file "zcnbd:$scratch/file-zcnbd.raw" "nbdkit:$scratch/file-nbdkit.raw" \
    "qemu-nbd:$scratch/file-qemu.raw"
run qcow2 "zcnbd:$scratch/image-zcnbd.qcow2" "qemu-nbd:$scratch/image-qemu.qcow2"
if [ "${RBD:-0}" = 1 ]; then
    ceph_dir=$scratch/ceph
    eval "$("$repo/tests/ceph/cluster.sh" start "$ceph_dir" | sed 's/^/export /')"
    for t in zcnbd qemu fio; do rbd create "rbd/report-$t" --size 1G; done
    # fio drives these cells, so that fio's rbd engine - librbd with no NBD in between, the
    # best an RBD export can do - stands beside the two servers (zcnbd's cache setting).
    run rbd --client fio zcnbd:rbd:rbd/report-zcnbd qemu-nbd:rbd:rbd/report-qemu \
        fio-rbd:rbd/report-fio:rbd_cache=false
fi

# The page: what, where, how; then each run's tables as zcnbd bench wrote them.
{
    echo "# How zcnbd compares today"
    echo
    echo "zcnbd beside nbdkit and qemu-nbd, each serving the same kind of data on its own copy,"
    echo "measured by \`zcnbd bench\` (zcnbd's client library; fio's for RBD, to stand fio's rbd"
    echo "engine beside the servers) in one interleaved run per source:"
    echo "MiB/s, IOPS, latency and the CPU each side spent per GiB moved. Written by"
    echo "\`scripts/bench-report.sh\` (REPEAT=$repeat RUNTIME=$runtime${RBD:+ RBD=$RBD}) on $date from"
    echo "\`git $commit\`${dirty:+ (with uncommitted changes)}; raw JSON and Markdown in"
    echo "[data/$date-$commit/](data/$date-$commit/). How to read and repeat it:"
    echo "[methodology.md](methodology.md); older measurements: [history.md](history.md); local disks from \`zcnbd attach\`: [attach.md](attach.md); NBD proxies: [proxy.md](proxy.md); files on web servers: [http.md](http.md); disk images with O_DIRECT: [images-direct.md](images-direct.md); loopback or veth: [veth.md](veth.md); the two engines at 4 KiB reads: [engines.md](engines.md); large requests on a memory export (writes in place, sendfile to other hosts, TLS writes): [large-requests.md](large-requests.md); a file export's 4 KiB reads before and after remembering its data: [file-holes.md](file-holes.md); fio's 4 KiB requests at half of nbdkit's server CPU, by coalescing: [coalescing.md](coalescing.md)."
    echo
    echo "- zcnbd: \`$("$zcnbd" --version)\`; nbdkit: \`$(nbdkit --version | head -1)\`;"
    echo "  qemu-nbd: \`$(qemu-nbd --version | head -1)\`"
    for name in memory memory-tls file qcow2 rbd; do
        [ -f "$repo/$data/$name.md" ] || continue
        echo
        case $name in
        memory) echo "## A memory export" ;;
        memory-tls) echo "## A memory export over TLS" ;;
        file) echo "## A raw file (1 GiB, in the page cache)" ;;
        qcow2) echo "## A qcow2 image (1 GiB, every cluster allocated)" ;;
        rbd) echo "## A Ceph RBD image (a one-OSD cluster on this machine; fio as the client)" ;;
        esac
        echo
        sed -e 's/^## /### /' -e 's/^### zcnbd bench$//' "$repo/$data/$name.md"
        echo
        echo "![$name: MiB/s and IOPS against block size](data/$date-$commit/$name.png)"
    done
} >"$repo/docs/benchmarks/README.md"
echo "wrote docs/benchmarks/README.md and $data/" >&2
