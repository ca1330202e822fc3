#!/usr/bin/env bash
# Builds the C tests and example against the *installed* header and library (shared and
# static), then runs the test against zcnbd, nbdkit and qemu-nbd, and over TLS (nbds+unix://,
# certificates made with certtool) against zcnbd and nbdkit; and the metadata context test
# against qemu-nbd (-A -B b0) and zcnbd on a qcow2 chain with a dirty bitmap, nbdinfo's map
# as the oracle.
# Needs `cargo build --release` first (in $CARGO_TARGET_DIR if set; ZCNBD_BIN overrides the
# server binary). CI=true: a missing server or tool fails the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
zcnbd_bin="${ZCNBD_BIN:-${CARGO_TARGET_DIR:-target}/release/zcnbd}"
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
cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags tests/c/test_zcnbd_meta.c $libs \
  -Wl,-rpath,"$work/prefix/lib" -o "$work/meta_shared"
cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags tests/c/test_zcnbd_meta.c \
  "$work/prefix/lib/libzcnbd.a" $(pkg-config --libs --static zcnbd | sed 's/-lzcnbd//') \
  -o "$work/meta_static"
cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags examples/c/zcnbd-cat.c $libs \
  -Wl,-rpath,"$work/prefix/lib" -o "$work/zcnbd-cat"
for bin in test_static meta_static; do
  if ldd "$work/$bin" | grep -q libzcnbd; then
    echo "the static test $bin links libzcnbd.so" >&2
    exit 1
  fi
done

wait_for() { for _ in $(seq 100); do [[ -S "$1" ]] && return 0; sleep 0.05; done; return 1; }

missing() {
  if [[ "${CI:-}" == true ]]; then echo "$1 missing (CI=true)" >&2; exit 1; fi
  echo "SKIP: $1 not installed"
}

# Starts server $1 on a fresh socket, whose path it leaves in $sock. (Not meant for
# `$(...)`: the server would hold the substitution's pipe open and its pid would be lost.)
n=0
sock=
start() {
  n=$((n + 1))
  sock="$work/$1.$n.sock"
  local log="$work/servers.log"
  case "$1" in
    zcnbd) "$zcnbd_bin" serve --memory 64M -s "$sock" >>"$log" 2>&1 & ;;
    nbdkit) nbdkit -f --exit-with-parent -U "$sock" memory 64M >>"$log" 2>&1 & ;;
    qemu-nbd)
      truncate -s 64M "$work/disk.$n.img"
      qemu-nbd -f raw -t -e 4 -k "$sock" "$work/disk.$n.img" >>"$log" 2>&1 & ;;
    zcnbd-tls)
      "$zcnbd_bin" serve --memory 64M -s "$sock" --tls=require \
        --tls-certificates="$work/tls/server" >>"$log" 2>&1 & ;;
    nbdkit-tls)
      nbdkit -f --exit-with-parent -U "$sock" --tls=require \
        --tls-certificates="$work/tls/server" memory 64M >>"$log" 2>&1 & ;;
    qemu-nbd-qcow2)
      qemu-nbd -r -A -B b0 -t -e 4 -k "$sock" -f qcow2 "$work/meta/img.qcow2" >>"$log" 2>&1 & ;;
    zcnbd-qcow2) "$zcnbd_bin" serve -r -B b0 -s "$sock" "$work/meta/img.qcow2" >>"$log" 2>&1 & ;;
  esac
  pids+=($!)
  wait_for "$sock" || { echo "$1 did not start" >&2; cat "$log" >&2; exit 1; }
}

# Each binary gets a server of its own: the test ends by closing with requests in flight,
# which nbdkit 1.32 sometimes answers with an assertion failure (raw_send_socket: sock >= 0)
# after the client has gone; a fresh server keeps that from failing the next run.
run_against() {
  local name="$1" query="${2:-}"
  local scheme=nbd
  [[ -n "$query" ]] && scheme=nbds
  for bin in test_shared test_static; do
    start "$name"
    "$work/$bin" "$scheme+unix:///?socket=$sock$query"
  done
  echo "  C ABI passes against $name"
}

# A CA, a server certificate for localhost, and a client directory that trusts the CA.
make_tls_creds() {
  local d="$work/tls"
  mkdir -p "$d/server" "$d/client"
  certtool --generate-privkey --outfile "$d/ca-key.pem" 2>/dev/null
  printf 'cn = test CA\nca\ncert_signing_key\nexpiration_days = 2\n' >"$d/ca.info"
  certtool --generate-self-signed --load-privkey "$d/ca-key.pem" --template "$d/ca.info" \
    --outfile "$d/server/ca-cert.pem" 2>/dev/null
  cp "$d/server/ca-cert.pem" "$d/client/"
  certtool --generate-privkey --outfile "$d/server/server-key.pem" 2>/dev/null
  chmod 600 "$d/server/server-key.pem"
  printf 'cn = localhost\ndns_name = localhost\ntls_www_server\nencryption_key\nsigning_key\nexpiration_days = 2\n' \
    >"$d/server.info"
  certtool --generate-certificate --load-ca-certificate "$d/server/ca-cert.pem" \
    --load-ca-privkey "$d/ca-key.pem" --load-privkey "$d/server/server-key.pem" \
    --template "$d/server.info" --outfile "$d/server/server-cert.pem" 2>/dev/null
}

run_against zcnbd
# The example copies the whole export; the copy must have the export's size.
start zcnbd
"$work/zcnbd-cat" "nbd+unix:///?socket=$sock" > "$work/copy.img"
[[ "$(stat -c %s "$work/copy.img")" == $((64 << 20)) ]] || { echo "zcnbd-cat copied a wrong size" >&2; exit 1; }

if command -v nbdkit >/dev/null; then run_against nbdkit; else missing nbdkit; fi
if command -v qemu-nbd >/dev/null; then run_against qemu-nbd; else missing qemu-nbd; fi
if command -v certtool >/dev/null; then
  make_tls_creds
  run_against zcnbd-tls "&tls-certificates=$work/tls/client"
  if command -v nbdkit >/dev/null; then
    run_against nbdkit-tls "&tls-certificates=$work/tls/client"
  fi
else
  missing certtool
fi
# A qcow2 over a qcow2 backing file (allocation depths 0, 1, 2) with a persistent dirty
# bitmap b0 in the top image, dirty where it was written after the bitmap was added.
make_meta_image() {
  local d="$work/meta"
  mkdir -p "$d"
  qemu-img create -q -f qcow2 "$d/base.qcow2" 64M
  qemu-io -f qcow2 -c 'write -P 0x11 0 2M' -c 'write -P 0x12 8M 1M' "$d/base.qcow2" >/dev/null
  qemu-img create -q -f qcow2 -b "$d/base.qcow2" -F qcow2 "$d/img.qcow2"
  qemu-img bitmap --add "$d/img.qcow2" b0
  qemu-io -f qcow2 -c 'write -P 0x55 1M 64k' -c 'write -P 0x66 10M 192k' -c 'write -z 20M 64k' \
    "$d/img.qcow2" >/dev/null
}

# Runs the metadata context test for context $2 against server $1 (both binaries), with
# nbdinfo's map of the same server as the oracle.
meta_against() {
  local name="$1" context="$2"
  for bin in meta_shared meta_static; do
    start "$name"
    local uri="nbd+unix:///?socket=$sock"
    nbdinfo --map="$context" "$uri" >"$work/map.txt"
    "$work/$bin" "$uri" "$context" "$work/map.txt"
  done
  echo "  C ABI metadata context $context passes against $name"
}

meta_tools_missing=
for tool in qemu-img qemu-io qemu-nbd nbdinfo; do
  command -v "$tool" >/dev/null || meta_tools_missing="$tool"
done
if [[ -z "$meta_tools_missing" ]]; then
  make_meta_image
  meta_against qemu-nbd-qcow2 qemu:dirty-bitmap:b0
  meta_against qemu-nbd-qcow2 qemu:allocation-depth
  meta_against zcnbd-qcow2 qemu:allocation-depth
  meta_against zcnbd-qcow2 qemu:dirty-bitmap:b0
else
  missing "$meta_tools_missing"
fi
echo "C ABI tests passed"
