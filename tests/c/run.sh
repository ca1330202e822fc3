#!/usr/bin/env bash
# Builds the C test and example against the *installed* header and library (shared and
# static), then runs the test against zcnbd, nbdkit and qemu-nbd.
# Needs `cargo build --release` first. CI=true: a missing server fails the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

scripts/install-lib.sh "$work/prefix" >/dev/null
export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
cflags="$(pkg-config --cflags zcnbd)"
libs="$(pkg-config --libs zcnbd)"
cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags tests/c/test_zcnbd.c $libs \
  -Wl,-rpath,"$work/prefix/lib" -o "$work/test_shared"
cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags tests/c/test_zcnbd.c \
  "$work/prefix/lib/libzcnbd.a" $(pkg-config --libs --static zcnbd | sed 's/-lzcnbd//') \
  -o "$work/test_static"
cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags examples/c/zcnbd-cat.c $libs \
  -Wl,-rpath,"$work/prefix/lib" -o "$work/zcnbd-cat"
if ldd "$work/test_static" | grep -q libzcnbd; then
  echo "the static test links libzcnbd.so" >&2
  exit 1
fi

wait_for() { for _ in $(seq 100); do [[ -S "$1" ]] && return 0; sleep 0.05; done; return 1; }

run_against() {
  local name="$1" sock="$2"
  wait_for "$sock" || { echo "$name did not start" >&2; exit 1; }
  "$work/test_shared" "nbd+unix:///?socket=$sock"
  "$work/test_static" "nbd+unix:///?socket=$sock"
  echo "  C ABI passes against $name"
}

missing() {
  if [[ "${CI:-}" == true ]]; then echo "$1 missing (CI=true)" >&2; exit 1; fi
  echo "SKIP: $1 not installed"
}

target/release/zcnbd serve --memory 64M -s "$work/zcnbd.sock" 2>/dev/null &
pids+=($!)
run_against zcnbd "$work/zcnbd.sock"
# The example copies the whole export; compare with what a blocking read sees.
"$work/zcnbd-cat" "nbd+unix:///?socket=$work/zcnbd.sock" > "$work/copy.img"
[[ "$(stat -c %s "$work/copy.img")" == $((64 << 20)) ]] || { echo "zcnbd-cat copied a wrong size" >&2; exit 1; }

if command -v nbdkit >/dev/null; then
  nbdkit -f --exit-with-parent -U "$work/nbdkit.sock" memory 64M 2>>"$work/servers.log" &
  pids+=($!)
  run_against nbdkit "$work/nbdkit.sock"
else missing nbdkit; fi

if command -v qemu-nbd >/dev/null; then
  truncate -s 64M "$work/disk.img"
  qemu-nbd -f raw -t -e 4 -k "$work/qemu.sock" "$work/disk.img" 2>>"$work/servers.log" &
  pids+=($!)
  run_against qemu-nbd "$work/qemu.sock"
else missing qemu-nbd; fi
echo "C ABI tests passed"
