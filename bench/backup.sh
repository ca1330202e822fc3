#!/usr/bin/env bash
# Incremental backup through dirty bitmaps (issue 24): prints two tables, and with OUT=DIR keeps
# their raw JSON (and the second's Markdown) there.
#
#   1. bench/incremental_backup.py: a 4 GiB file export in a tmpfs with a tracked bitmap, 1%
#      changed in 1 MiB writes, then again in 4 KiB writes (each dirties a whole 64 KiB granule):
#      bytes read and time of the incremental backup against the full copy (nbdcopy).
#   2. The cost of tracking: zcnbd bench, 4k random writes to a memory export with and without
#      one tracked bitmap (-B), interleaved, at iodepth 1 and 16.
#
#   bench/backup.sh            (environment: ZCNBD, RUNTIME (default 3s), REPEAT (10), OUT, SIZE (4G))
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
zcnbd=${ZCNBD:-$repo/target/release/zcnbd}
runtime=${RUNTIME:-3s}
repeat=${REPEAT:-10}
size=${SIZE:-4G}
out=${OUT:-}
[ -x "$zcnbd" ] || { echo "bench/backup.sh: no zcnbd at $zcnbd (cargo build --release)" >&2; exit 1; }
for tool in nbdcopy qemu-img /usr/bin/python3; do
    command -v "$tool" >/dev/null || { echo "bench/backup.sh: $tool is missing (scripts/install-deps.sh)" >&2; exit 1; }
done
[ -n "$out" ] && mkdir -p "$out"
json() { [ -n "$out" ] && echo "--json=$out/$1" || true; }

for write in 1M 4K; do
    /usr/bin/python3 "$repo/bench/incremental_backup.py" --zcnbd "$zcnbd" --size "$size" --write "$write" \
        $(json "backup-$write.json")
    echo
done

for depth in 1 16; do
    md=()
    [ -n "$out" ] && md=(--markdown "$out/tracking-iodepth$depth.md" --json "$out/tracking-iodepth$depth.json")
    "$zcnbd" bench --rw randwrite --bs 4k --iodepth "$depth" --runtime "$runtime" --repeat "$repeat" \
        --no-ceiling "${md[@]}" zcnbd:memory zcnbd:memory:--bitmap=b0
    echo
done
