#!/usr/bin/env bash
# Builds the Debian package target/debian/zcnbd_VERSION-1_ARCH.deb with cargo-deb: the
# command, the C library (libzcnbd.so, libzcnbd.a) with zcnbd.h and zcnbd.pc, man pages and
# shell completions made by `zcnbd generate-docs`, and the systemd units (the list is
# [package.metadata.deb] in crates/zcnbd/Cargo.toml). Prints the .deb's path last.
#
#   scripts/package-deb.sh
#
# Installs cargo-deb (CARGO_DEB_VERSION, with --locked) into ~/.cargo/bin when it is absent or
# another version: about 3 minutes of CPU once, then kept. Builds the release binary and
# library only if cargo finds them out of date (scripts/test.sh has built them already).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_DEB_VERSION=3.8.0
log() { printf 'package-deb: %s\n' "$*" >&2; }

if [ "$(cargo deb --version 2>/dev/null)" != "cargo-deb $CARGO_DEB_VERSION" ]; then
    log "installing cargo-deb $CARGO_DEB_VERSION (cargo install --locked; a few minutes, once)"
    started=$(date +%s)
    cargo install cargo-deb --version "$CARGO_DEB_VERSION" --locked --quiet
    log "cargo-deb installed in $(($(date +%s) - started)) s"
fi

target=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release -p zcnbd -p zcnbd-capi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

# What the package holds besides cargo's output, made where cargo-deb's asset list looks
# (target/release/ is its name for the target directory).
staged=$target/release/deb
rm -rf "$staged"
mkdir -p "$staged"
"$target/release/zcnbd" generate-docs "$staged"
gzip -9n "$staged"/man/*.1 "$staged"/man/*.5
# cargo-deb strips the programs and shared libraries it packages (--strip below), not archives.
strip --strip-debug -o "$staged/libzcnbd.a" "$target/release/libzcnbd.a"
sed -e "s|@PREFIX@|/usr|" -e "s|@VERSION@|$version|" pkgconfig/zcnbd.pc.in >"$staged/zcnbd.pc"

# --no-build: built above, with the library crate cargo-deb would not build for this package.
# --strip: the release profile's line tables (for backtraces in development) stay out of the
# package, which they would make five times larger.
cargo deb -p zcnbd --no-build --strip --output "$target/debian/" >&2
deb=$(ls -t "$target"/debian/zcnbd_"$version"-*_*.deb | head -1)
log "built $deb ($(du -h "$deb" | cut -f1))"
echo "$deb"
