#!/usr/bin/env bash
# Small requests (issue 25): latency at low queue depth and cost per request, zcnbd beside
# nbdkit, plain and TLS, TCP and Unix sockets, with both clients; then the larger requests and
# the file export before and after, so a regression shows. Prints the tables, and with OUT=DIR
# keeps their raw JSON (and Markdown) there.
#
#   1. zcnbd bench (zcnbd's client library): 4k randread/randwrite, iodepth 1, 16 and 64, TCP.
#   2. The same on Unix sockets, iodepth 1 and 16.
#   3. fio's nbd engine (libnbd): 4k, iodepth 1, TCP then Unix; then iodepth 16 over TCP.
#      TLS targets: fio_compare.py hands libnbd its certificates through $HOME/.pki/libnbd
#      (fio's URI may not name files).
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
for tool in nbdkit fio certtool /usr/bin/python3; do
    command -v "$tool" >/dev/null || { echo "bench/small_requests.sh: $tool is missing (scripts/install-deps.sh)" >&2; exit 1; }
done
[ -n "$out" ] && mkdir -p "$out"
keep() { [ -n "$out" ] && echo "--json=$out/$1.json --markdown=$out/$1.md" || true; }
fio_compare() { /usr/bin/python3 "$repo/bench/fio_compare.py" --zcnbd "$zcnbd" --no-ceiling \
    --numjobs 1 --runtime "$runtime" --repeat "$repeat" --size "$size" "$@"; }

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
fio_compare --rw randread,randwrite --bs 4k --iodepth 1 $(keep small-fio-iodepth1-tcp) \
    zcnbd=zcnbd:memory nbdkit=nbdkit:memory zcnbd-tls=zcnbd:memory:tls nbdkit-tls=nbdkit:memory:tls
echo
# shellcheck disable=SC2046
fio_compare --rw randread,randwrite --bs 4k --iodepth 1 $(keep small-fio-iodepth1-unix) \
    zcnbd=zcnbd:memory:unix nbdkit=nbdkit:memory:unix \
    zcnbd-tls=zcnbd:memory:tls,unix nbdkit-tls=nbdkit:memory:tls,unix
echo
# shellcheck disable=SC2046
fio_compare --rw randread,randwrite --bs 4k --iodepth 16 $(keep small-fio-iodepth16-tcp) \
    zcnbd=zcnbd:memory nbdkit=nbdkit:memory zcnbd-tls=zcnbd:memory:tls nbdkit-tls=nbdkit:memory:tls
if [ -n "$old" ]; then
    echo
    # shellcheck disable=SC2046
    fio_compare --rw randread,randwrite --bs 64k,1m --iodepth 16 $(keep larger-before-after) \
        before=zcnbd@"$old":memory after=zcnbd:memory \
        before-tls=zcnbd@"$old":memory:tls after-tls=zcnbd:memory:tls
    echo
    # shellcheck disable=SC2046
    # In a tmpfs: on ext4 the page cache's writeback of the targets' files decides the write
    # cells (the first target of a run measured 0.6-0.75x the others, whichever it was).
    fio_compare --rw randread,randwrite --bs 4k,64k,1m --iodepth 16 --scratch /dev/shm \
        $(keep file-before-after) before-file=zcnbd@"$old":file after-file=zcnbd:file
fi
