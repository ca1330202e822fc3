#!/usr/bin/env bash
# Small requests (issue 25): latency at low queue depth and cost per request, zcnbd beside
# nbdkit, plain and TLS, TCP and Unix sockets, with both clients; then the larger requests and
# the file export before and after, so a regression shows. Prints the tables, and with OUT=DIR
# keeps their raw JSON (and Markdown) there.
#
#   1. zcnbd bench (zcnbd's client library): 4k randread/randwrite, iodepth 1, 16 and 64, TCP.
#   2. The same on Unix sockets, iodepth 1 and 16.
#   3. The same cells driven by fio's nbd engine (libnbd, `zcnbd bench --client fio`): 4k,
#      iodepth 1, TCP then Unix; then iodepth 16 over TCP. TLS targets: libnbd finds the
#      run's certificates through $HOME/.pki/libnbd (fio's URI may not name files).
#   4. With OLD=PATH (an older zcnbd binary), OLD beside this build under fio at iodepth 16:
#      64k and 1m on the memory export, plain and TLS; 4k, 64k and 1m on a file export (in
#      /dev/shm).
#
#   bench/small_requests.sh   (environment: ZCNBD, OLD, RUNTIME (default 3), REPEAT (3), SIZE (1G), OUT)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
zcnbd=${ZCNBD:-$repo/target/release/zcnbd}
runtime=${RUNTIME:-3}
repeat=${REPEAT:-3}
size=${SIZE:-1G}
out=${OUT:-}
old=${OLD:-}
[ -x "$zcnbd" ] || { echo "bench/small_requests.sh: no zcnbd at $zcnbd (cargo build --release)" >&2; exit 1; }
for tool in nbdkit fio certtool; do
    command -v "$tool" >/dev/null || { echo "bench/small_requests.sh: $tool is missing (scripts/install-deps.sh)" >&2; exit 1; }
done
[ -n "$out" ] && mkdir -p "$out"
keep() { [ -n "$out" ] && echo "--json=$out/$1.json --markdown=$out/$1.md" || true; }
under_fio() { "$zcnbd" bench --client fio --no-ceiling --runtime "${runtime}s" \
    --repeat "$repeat" --size "$size" "$@"; }

# shellcheck disable=SC2046
"$zcnbd" bench --bs 4k --iodepth 1,16,64 --runtime "${runtime}s" --repeat "$repeat" --size "$size" \
    --no-ceiling $(keep small-zcnbd-bench-tcp) \
    zcnbd:memory nbdkit:memory zcnbd:memory:tls nbdkit:memory:tls
echo
# shellcheck disable=SC2046
"$zcnbd" bench --bs 4k --iodepth 1,16 --runtime "${runtime}s" --repeat "$repeat" --size "$size" \
    --no-ceiling $(keep small-zcnbd-bench-unix) \
    zcnbd:memory:unix nbdkit:memory:unix zcnbd:memory:tls:unix nbdkit:memory:tls:unix
echo
# shellcheck disable=SC2046
under_fio --rw randread,randwrite --bs 4k --iodepth 1 $(keep small-fio-iodepth1-tcp) \
    zcnbd:memory nbdkit:memory zcnbd:memory:tls nbdkit:memory:tls
echo
# shellcheck disable=SC2046
under_fio --rw randread,randwrite --bs 4k --iodepth 1 $(keep small-fio-iodepth1-unix) \
    zcnbd:memory:unix nbdkit:memory:unix zcnbd:memory:tls:unix nbdkit:memory:tls:unix
echo
# shellcheck disable=SC2046
under_fio --rw randread,randwrite --bs 4k --iodepth 16 $(keep small-fio-iodepth16-tcp) \
    zcnbd:memory nbdkit:memory zcnbd:memory:tls nbdkit:memory:tls
if [ -n "$old" ]; then
    echo
    # shellcheck disable=SC2046
    under_fio --rw randread,randwrite --bs 64k,1m --iodepth 16 $(keep larger-before-after) \
        zcnbd@"$old":memory zcnbd:memory zcnbd@"$old":memory:tls zcnbd:memory:tls
    echo
    # In a tmpfs: on ext4 the page cache's writeback of the targets' files decides the write
    # cells (the first target of a run measured 0.6-0.75x the others, whichever it was).
    shm=/dev/shm/zcnbd-small-requests
    mkdir -p "$shm"
    trap 'rm -rf "$shm"' EXIT
    # shellcheck disable=SC2046
    under_fio --rw randread,randwrite --bs 4k,64k,1m --iodepth 16 \
        $(keep file-before-after) zcnbd@"$old":"$shm/before.raw" zcnbd:"$shm/after.raw"
fi
