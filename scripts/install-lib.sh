#!/usr/bin/env bash
# Installs the C library built by `cargo build --release` (libzcnbd.so, libzcnbd.a, from
# $CARGO_TARGET_DIR if set), the header include/zcnbd.h and a pkg-config file under PREFIX
# (default /usr/local).
# Usage: scripts/install-lib.sh [PREFIX]
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-/usr/local}"
prefix="$(mkdir -p "$prefix" && cd "$prefix" && pwd)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
release="${CARGO_TARGET_DIR:-target}/release"
for f in "$release/libzcnbd.so" "$release/libzcnbd.a"; do
  [[ -f "$f" ]] || { echo "missing $f: run cargo build --release first" >&2; exit 1; }
done
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$release/libzcnbd.so" "$prefix/lib/"
install -m 0644 "$release/libzcnbd.a" "$prefix/lib/"
install -m 0644 include/zcnbd.h "$prefix/include/"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" pkgconfig/zcnbd.pc.in \
  > "$prefix/lib/pkgconfig/zcnbd.pc"
echo "installed libzcnbd $version under $prefix"
