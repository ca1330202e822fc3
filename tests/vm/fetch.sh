#!/usr/bin/env bash
# Fetches what the guest needs that the host does not have, from Debian's packages, into a
# cache: the kernel with its modules (the image linux-image-6.12-amd64 points at, from
# bookworm-security: it has ublk_drv.ko for zcnbd attach, besides nbd.ko, tls.ko and
# vsock_loopback.ko), busybox-static, nbd-client and the one library of nbd-client's the host
# lacks. Nothing is installed on the host: `apt-get download` and `dpkg-deb -x`.
#
#   tests/vm/fetch.sh CACHE_DIR
#
# Environment:
#   ZCNBD_VM_KERNEL        the kernel package (default linux-image-6.12-amd64). A meta package
#                          (linux-image-amd64 for 6.1, linux-image-6.12-amd64) is followed to
#                          the image it depends on; a real image (linux-image-6.17.13+deb13-amd64)
#                          is taken as it is.
#   ZCNBD_VM_KERNEL_SUITE  where the kernel comes from. Empty (default): the host's apt. A
#                          Debian suite, e.g. trixie-backports (6.17, with ublk zero copy): a
#                          private apt configuration in CACHE_DIR/apt, for the kernel only - the
#                          host's sources stay as they are (the suite's keys must be in
#                          /usr/share/keyrings, from debian-archive-keyring). Its package list is
#                          refreshed when it is a day old. busybox-static, nbd-client and
#                          libnl-genl-3-200 still come from the host's apt.
#
# Leaves CACHE_DIR/root (the packages' files) and CACHE_DIR/root.versions (what is in it, one
# "package=version" a line). Idempotent: when the versions apt offers are the ones already in
# the cache, nothing is downloaded. When apt cannot answer (no package lists, no network, or a
# kernel the suite no longer has) and a cache exists, the cache is used as it is.
set -euo pipefail

cache=${1:?usage: fetch.sh CACHE_DIR}
mkdir -p "$cache"
log() { printf 'vmlab fetch: %s\n' "$*" >&2; }
kernel_package=${ZCNBD_VM_KERNEL:-linux-image-6.12-amd64}
kernel_suite=${ZCNBD_VM_KERNEL_SUITE:-}

if [ "$(dpkg --print-architecture 2>/dev/null)" != amd64 ]; then
    log "the lab boots an amd64 Debian kernel with the host's amd64 binaries; this host is not amd64"
    exit 1
fi

# apt for the kernel: the host's, or (ZCNBD_VM_KERNEL_SUITE) one whose sources, lists and
# archives are all in CACHE_DIR/apt. The installed-package database is the host's (apt needs
# one; nothing is installed). Only the Packages index is fetched (the host's apt.conf.d may add
# appstream or Contents targets, megabytes the lab does not need), only for amd64 (the host may
# have foreign architectures), and the host's pins do not apply.
kapt_opts=()
if [ -n "$kernel_suite" ]; then
    kapt=$cache/apt
    # trixie-backports, trixie-updates and trixie are signed with trixie's archive keys, and
    # trixie-security with its security key, on security.debian.org.
    codename=${kernel_suite%%-*}
    case $kernel_suite in
    *-security)
        mirror=http://deb.debian.org/debian-security
        keys=/usr/share/keyrings/debian-archive-$codename-security-automatic.gpg
        ;;
    *)
        mirror=http://deb.debian.org/debian
        keys=/usr/share/keyrings/debian-archive-$codename-stable.gpg,/usr/share/keyrings/debian-archive-$codename-automatic.gpg
        ;;
    esac
    for key in ${keys//,/ }; do
        if [ ! -f "$key" ]; then
            log "no $key for $kernel_suite (a newer debian-archive-keyring has it)"
            exit 1
        fi
    done
    mkdir -p "$kapt/state/lists/partial" "$kapt/cache/archives/partial"
    printf 'deb [arch=amd64 target=Packages signed-by=%s] %s %s main\n' \
        "$keys" "$mirror" "$kernel_suite" >"$kapt/sources.list"
    kapt_opts=(-o "Dir::State=$kapt/state" -o "Dir::Cache=$kapt/cache"
        -o "Dir::Etc::SourceList=$kapt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::status=/var/lib/dpkg/status -o APT::Architecture=amd64
        -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null)
fi
kapt_cache() { apt-cache "${kapt_opts[@]}" "$@"; }

# The suite's package list, fetched when there is none or it is a day old: backports move on,
# and the kernel they have today may be gone from the archive next month (then the cached one
# is used). Failing to fetch it (offline) is not an error here: wanted() says what apt knows.
# With "now", fetched whatever its age.
refresh_suite_lists() {
    [ -n "$kernel_suite" ] || return 0
    if [ "${1:-}" != now ] &&
        [ -n "$(find "$kapt/state/lists" -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null)" ]; then
        return 0
    fi
    log "fetching $kernel_suite's package list into $kapt"
    apt-get "${kapt_opts[@]}" -o APT::Sandbox::User=root update -qq >&2 ||
        log "apt-get update for $kernel_suite failed"
}

# The kernel packages a kernel package stands for: the image - a meta package depends on it
# (linux-image-6.12-amd64 on linux-image-6.12.117+deb12-amd64), a real image depends on no
# other image - then the image's own linux-binary-*/linux-modules-* packages (Debian's 7.x
# images are split so; 6.17's and older images hold vmlinuz and the modules themselves).
kernel_packages() {
    local deps image
    deps=$(kapt_cache depends "$kernel_package" 2>/dev/null) || return 1
    [ -n "$deps" ] || return 1
    image=$(awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }' <<<"$deps")
    image=${image:-$kernel_package}
    echo "$image"
    kapt_cache depends "$image" 2>/dev/null |
        awk '$1 == "Depends:" && $2 ~ /^linux-(binary|modules)-[0-9]/ { print $2 }'
}

# Print "package=version" for the kernel's packages and for the rest, as apt would fetch them
# now; wanted() prints both, the kernel's first (lab.sh takes its version from the first line).
wanted_kernel() {
    local kernel p v
    kernel=$(kernel_packages) || return 1
    for p in $kernel; do
        v=$(kapt_cache policy "$p" 2>/dev/null | awk '$1 == "Candidate:" { print $2 }')
        case "$v" in '' | '(none)') return 1 ;; esac
        printf '%s=%s\n' "$p" "$v"
    done
}
wanted_host() {
    local p v
    for p in busybox-static nbd-client libnl-genl-3-200; do
        v=$(apt-cache policy "$p" 2>/dev/null | awk '$1 == "Candidate:" { print $2 }')
        case "$v" in '' | '(none)') return 1 ;; esac
        printf '%s=%s\n' "$p" "$v"
    done
}
wanted() { wanted_kernel && wanted_host; }

refresh_suite_lists
if ! list=$(wanted); then
    # The suite's list may be a day old and the kernel gone from it; the host's lists are
    # updated (as root) only when they are what lacks a package.
    if [ -n "$kernel_suite" ] && ! wanted_kernel >/dev/null; then
        refresh_suite_lists now
    fi
    if [ "$(id -u)" = 0 ] && ! { if [ -n "$kernel_suite" ]; then wanted_host; else wanted; fi; } >/dev/null; then
        log "apt knows no kernel package yet: running apt-get update"
        apt-get update -qq >&2 || true
    fi
    if ! list=$(wanted); then
        if [ -s "$cache/root.versions" ]; then
            log "apt cannot say what is current; using the cached packages:" $(cat "$cache/root.versions")
            exit 0
        fi
        log "cannot find $kernel_package${kernel_suite:+ (in $kernel_suite)}, busybox-static, nbd-client through apt"
        exit 1
    fi
fi

if [ -d "$cache/root" ] && [ "$(cat "$cache/root.versions" 2>/dev/null)" = "$list" ]; then
    exit 0
fi

log "downloading:" $list
rm -rf "$cache/debs" "$cache/root.new"
mkdir -p "$cache/debs" "$cache/root.new"
# The kernel through its apt (the suite's, when one is named), the rest through the host's.
# shellcheck disable=SC2046
(cd "$cache/debs" && apt-get download -q "${kapt_opts[@]}" -o APT::Sandbox::User=root \
    $(grep '^linux-' <<<"$list") >&2)
# shellcheck disable=SC2046
(cd "$cache/debs" && apt-get download -q -o APT::Sandbox::User=root $(grep -v '^linux-' <<<"$list") >&2)
for deb in "$cache"/debs/*.deb; do
    dpkg-deb -x "$deb" "$cache/root.new"
done
rm -rf "$cache/root" "$cache/debs"
mv "$cache/root.new" "$cache/root"
printf '%s\n' "$list" >"$cache/root.versions"
log "cached in $cache/root"
