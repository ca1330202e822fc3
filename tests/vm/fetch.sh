#!/usr/bin/env bash
# Fetches what the guest needs that the host does not have, from Debian's packages, into a
# cache: the kernel with its modules (the image linux-image-6.12-amd64 points at, from
# bookworm-security: it has ublk_drv.ko for zcnbd attach, besides nbd.ko, tls.ko and
# vsock_loopback.ko; ZCNBD_VM_KERNEL names another, e.g. linux-image-amd64 for 6.1),
# busybox-static, nbd-client and the one library of nbd-client's the host lacks. Nothing is installed on the host: `apt-get download` and `dpkg-deb -x`.
#
#   tests/vm/fetch.sh CACHE_DIR
#
# Leaves CACHE_DIR/root (the packages' files) and CACHE_DIR/root.versions (what is in it, one
# "package=version" a line). Idempotent: when the versions apt offers are the ones already in
# the cache, nothing is downloaded. When apt cannot answer (no package lists, no network) and a
# cache exists, the cache is used as it is.
set -euo pipefail

cache=${1:?usage: fetch.sh CACHE_DIR}
mkdir -p "$cache"
log() { printf 'vmlab fetch: %s\n' "$*" >&2; }
kernel_package=${ZCNBD_VM_KERNEL:-linux-image-6.12-amd64}

if [ "$(dpkg --print-architecture 2>/dev/null)" != amd64 ]; then
    log "the lab boots an amd64 Debian kernel with the host's amd64 binaries; this host is not amd64"
    exit 1
fi

# Prints "package=version" for each package the guest needs, as apt would fetch them now.
wanted() {
    local kernel p v
    kernel=$(apt-cache depends "$kernel_package" 2>/dev/null |
        awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
    [ -n "$kernel" ] || return 1
    for p in "$kernel" busybox-static nbd-client libnl-genl-3-200; do
        v=$(apt-cache policy "$p" 2>/dev/null | awk '$1 == "Candidate:" { print $2 }')
        case "$v" in '' | '(none)') return 1 ;; esac
        printf '%s=%s\n' "$p" "$v"
    done
}

if ! list=$(wanted); then
    if [ "$(id -u)" = 0 ]; then
        log "apt knows no kernel package yet: running apt-get update"
        apt-get update -qq >&2 || true
    fi
    if ! list=$(wanted); then
        if [ -s "$cache/root.versions" ]; then
            log "apt cannot say what is current; using the cached packages:" $(cat "$cache/root.versions")
            exit 0
        fi
        log "cannot find $kernel_package, busybox-static, nbd-client through apt"
        exit 1
    fi
fi

if [ -d "$cache/root" ] && [ "$(cat "$cache/root.versions" 2>/dev/null)" = "$list" ]; then
    exit 0
fi

log "downloading:" $list
rm -rf "$cache/debs" "$cache/root.new"
mkdir -p "$cache/debs" "$cache/root.new"
# shellcheck disable=SC2086
(cd "$cache/debs" && apt-get download -q -o APT::Sandbox::User=root $list >&2)
for deb in "$cache"/debs/*.deb; do
    dpkg-deb -x "$deb" "$cache/root.new"
done
rm -rf "$cache/root" "$cache/debs"
mv "$cache/root.new" "$cache/root"
printf '%s\n' "$list" >"$cache/root.versions"
log "cached in $cache/root"
