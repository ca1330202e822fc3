#!/usr/bin/env bash
# The Debian package, installed on this machine as an administrator would (dpkg -i, as root or
# through sudo -n), then used: /usr/bin/zcnbd's version, `man -w`, the completions, the units
# where systemd looks, the header and pkg-config file with a C program built against the
# installed library and run against the installed server (captive, --run), and one
# socket-activated `nbdinfo [ zcnbd serve ]`. A second dpkg -i (the re-install path), then
# dpkg -r and dpkg -P. The package is gone at the end, so nothing after this test finds
# /usr/bin/zcnbd; if it was installed before, the package just built is installed again.
#
#   tests/package/test.sh        (builds the .deb with scripts/package-deb.sh)
#
# CI=true: a missing tool (dpkg, man, pkg-config, cc, nbdinfo, sudo for a non-root user) fails
# the test rather than skipping it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

log() { printf 'package test: %s\n' "$*" >&2; }
cannot_run() {
    log "cannot run: $*"
    if [ "${CI:-}" = true ]; then
        echo "package: 0 passed, 1 failed"
        exit 1
    fi
    log "SKIPPED (set CI=true to make this a failure)"
    exit 0
}

as_root=()
if [ "$(id -u)" -ne 0 ]; then
    sudo -n true 2>/dev/null || cannot_run "not root, and sudo -n does not work"
    as_root=(sudo -n)
fi
for tool in dpkg dpkg-query man pkg-config cc nbdinfo bash; do
    command -v "$tool" >/dev/null 2>&1 || cannot_run "no $tool (scripts/install-deps.sh)"
done

deb=$(scripts/package-deb.sh | tail -1)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
work=$(mktemp -d)
installed_before=0
status=$(dpkg-query -W -f='${Status}' zcnbd 2>/dev/null || true)
[ "$status" = "install ok installed" ] && installed_before=1
cleanup() {
    rm -rf "$work"
    if [ "$installed_before" = 1 ]; then
        "${as_root[@]}" dpkg -i "$deb" >/dev/null
    else
        "${as_root[@]}" dpkg -P zcnbd >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

passed=0 failed=0
check() {
    local name=$1
    shift
    if "$@" >"$work/out" 2>&1; then
        passed=$((passed + 1))
        echo "ok   $name"
    else
        failed=$((failed + 1))
        echo "FAIL $name"
        sed 's/^/     | /' "$work/out"
    fi
}

install_deb() { "${as_root[@]}" dpkg -i "$deb"; }

# The files the package is for, each where its users look.
has_files() {
    local f listed
    listed=$(dpkg -L zcnbd)
    for f in /usr/bin/zcnbd /usr/lib/libzcnbd.so /usr/lib/libzcnbd.a /usr/include/zcnbd.h \
        /usr/lib/pkgconfig/zcnbd.pc /usr/share/man/man1/zcnbd.1.gz \
        /usr/share/man/man1/zcnbd-serve.1.gz /usr/share/man/man1/zcnbd-bench.1.gz \
        /usr/share/man/man1/zcnbd-bitmap.1.gz /usr/share/man/man1/zcnbd-filter.1.gz /usr/share/man/man1/zcnbd-attach.1.gz \
        /usr/share/man/man5/zcnbd.toml.5.gz \
        /usr/share/bash-completion/completions/zcnbd /usr/share/zsh/vendor-completions/_zcnbd \
        /usr/share/fish/vendor_completions.d/zcnbd.fish \
        /usr/lib/systemd/system/zcnbd@.service /usr/lib/systemd/system/zcnbd@.socket; do
        grep -qx "$f" <<<"$listed" || { echo "dpkg -L zcnbd does not list $f"; return 1; }
        [ -s "$f" ] || { echo "$f is missing or empty"; return 1; }
    done
    [ -d /etc/zcnbd ] || { echo "postinst made no /etc/zcnbd"; return 1; }
}

version_matches() {
    local got
    got=$(/usr/bin/zcnbd --version)
    echo "$got"
    [ "$got" = "zcnbd $version" ]
}

man_finds_pages() {
    local page got
    for page in zcnbd zcnbd-serve zcnbd-bench; do
        got=$(man -w "$page")
        echo "$page: $got"
        [ "$got" = "/usr/share/man/man1/$page.1.gz" ] || return 1
    done
    got=$(man -P cat zcnbd-serve)
    grep -q -- '--vsock' <<<"$got"
}

completions_load() {
    bash -c 'source /usr/share/bash-completion/completions/zcnbd && complete -p zcnbd'
}

units_where_systemd_looks() {
    command -v systemd-analyze >/dev/null || { echo "no systemd-analyze"; return 1; }
    local paths
    paths=$(systemd-analyze unit-paths)
    grep -qx /usr/lib/systemd/system <<<"$paths"
}

# pkg-config answers from the installed file alone, and a C program built with its flags
# (no rpath: the loader finds /usr/lib/libzcnbd.so) copies a whole export served by the
# installed zcnbd.
c_program_against_the_installed_library() {
    local cflags libs
    cflags=$(env -u PKG_CONFIG_PATH pkg-config --cflags zcnbd)
    libs=$(env -u PKG_CONFIG_PATH pkg-config --libs zcnbd)
    echo "pkg-config: cflags '$cflags' libs '$libs'"
    [ "$(env -u PKG_CONFIG_PATH pkg-config --modversion zcnbd)" = "$version" ] || return 1
    # shellcheck disable=SC2086
    cc -std=c11 -Wall -Wextra -Werror -D_DEFAULT_SOURCE $cflags examples/c/zcnbd-cat.c $libs \
        -o "$work/zcnbd-cat" || return 1
    # (Not `ldd | grep -q`: under pipefail, grep leaving early can fail ldd with SIGPIPE.)
    local linked
    linked=$(ldd "$work/zcnbd-cat")
    grep -Eq '=> (/usr)?/lib/libzcnbd\.so' <<<"$linked" || { echo "$linked"; return 1; }
    /usr/bin/zcnbd serve --memory 3M --run "'$work/zcnbd-cat' \"\$uri\" >'$work/copy.img'" || return 1
    [ "$(stat -c %s "$work/copy.img")" = $((3 << 20)) ]
}

# libnbd starts the installed server for one connection (socket activation).
socket_activated_nbdinfo() {
    local size
    size=$(nbdinfo --size -- [ /usr/bin/zcnbd serve --memory 64M ])
    echo "size: $size"
    [ "$size" = $((64 << 20)) ]
}

# Ceph is optional: librbd is loaded at run time, so the package suggests it and depends on
# no Ceph library (a fresh machine installs it without pulling Ceph in).
ceph_is_only_suggested() {
    local depends suggests
    depends=$(dpkg-deb -f "$deb" Depends)
    suggests=$(dpkg-deb -f "$deb" Suggests)
    echo "Depends: $depends"
    echo "Suggests: $suggests"
    ! grep -Eq 'librbd|librados' <<<"$depends" && grep -q librbd1 <<<"$suggests"
}

removed() {
    "${as_root[@]}" dpkg -r zcnbd || return 1
    [ ! -e /usr/bin/zcnbd ] && [ ! -e /usr/lib/libzcnbd.so ] || { echo "files left"; return 1; }
    [ -d /etc/zcnbd ] || { echo "dpkg -r removed /etc/zcnbd (a purge's job)"; return 1; }
    "${as_root[@]}" dpkg -P zcnbd || return 1
    [ ! -d /etc/zcnbd ] || { echo "dpkg -P left the empty /etc/zcnbd"; return 1; }
}

log "installing $deb"
check "dpkg -i" install_deb
check "files in place" has_files
check "Ceph only suggested" ceph_is_only_suggested
check "zcnbd --version" version_matches
check "man -w" man_finds_pages
check "bash completion" completions_load
check "units in systemd's path" units_where_systemd_looks
check "C program via pkg-config" c_program_against_the_installed_library
check "nbdinfo [ zcnbd serve ]" socket_activated_nbdinfo
check "dpkg -i again" install_deb
check "dpkg -r, dpkg -P" removed
echo "package: $passed passed, $failed failed"
[ "$failed" = 0 ]
