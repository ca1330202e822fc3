#!/usr/bin/env bash
# Install the system packages the tests need (Debian/Ubuntu): real NBD clients and
# servers for the interop suites, a C toolchain with pkg-config for the C ABI test, OpenSSL's
# headers for the build (TLS), GnuTLS's tools (certtool, psktool) for the TLS tests and
# systemd-socket-activate for the socket-activation tests.
#
# Idempotent: does nothing when every needed command and Python module is
# already present.  Otherwise, when running as root on a system with apt-get,
# runs `apt-get update` once and installs the missing packages.  Exits 1 if
# something is still missing afterwards (or cannot be installed).
set -euo pipefail

# Debian's interpreter: python3-libnbd and python3-pytest install for it, not
# for whatever python3 (pyenv, venv, ...) comes first on PATH.
PYTHON=${ZCNBD_PYTHON:-/usr/bin/python3}

# command -> Debian package that provides it
declare -A COMMANDS=(
    [nbdkit]=nbdkit
    [nbdinfo]=libnbd-bin
    [nbdcopy]=libnbd-bin
    [nbdsh]=python3-libnbd
    [fio]=fio
    [qemu-img]=qemu-utils
    [qemu-io]=qemu-utils
    [qemu-nbd]=qemu-utils
    [nbd-server]=nbd-server
    [iperf3]=iperf3
    [pkg-config]=pkg-config
    [cc]=gcc
    [ss]=iproute2
    [certtool]=gnutls-bin
    [psktool]=gnutls-bin
    [gnutls-cli]=gnutls-bin
    [systemd-socket-activate]=systemd
    [systemd-analyze]=systemd
)
# Python module (for $PYTHON) -> Debian package
declare -A MODULES=(
    [nbd]=python3-libnbd
    [pytest]=python3-pytest
)

log() { printf 'install-deps: %s\n' "$*" >&2; }

# Prints the packages providing whatever is missing, one per line (sorted, unique).
missing_packages() {
    local cmd mod
    {
        for cmd in "${!COMMANDS[@]}"; do
            # nbd-server lives in /usr/sbin on some releases; look there too.
            if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1; then
                printf '%s\n' "${COMMANDS[$cmd]}"
            fi
        done
        for mod in "${!MODULES[@]}"; do
            if ! [ -x "$PYTHON" ] || ! "$PYTHON" -c "import $mod" >/dev/null 2>&1; then
                printf '%s\n' "${MODULES[$mod]}"
            fi
        done
        # The openssl crate builds against the system's OpenSSL 3 (TLS).
        if ! pkg-config --exists 'openssl >= 3' 2>/dev/null; then
            printf '%s\n' libssl-dev
        fi
        # fio must have been built with the nbd ioengine (libnbd).
        if command -v fio >/dev/null 2>&1 && ! fio --enghelp=nbd >/dev/null 2>&1; then
            printf '%s\n' fio
        fi
    } | sort -u
}

mapfile -t missing < <(missing_packages)
if [ "${#missing[@]}" -eq 0 ]; then
    log "all test dependencies are already installed; nothing to do"
    exit 0
fi

log "missing packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "cannot install them (need root and apt-get); please run:"
    log "  apt-get install --no-install-recommends ${missing[*]}"
    exit 1
fi

log "running: apt-get update"
apt-get update
log "running: apt-get install -y --no-install-recommends ${missing[*]}"
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"

mapfile -t still_missing < <(missing_packages)
if [ "${#still_missing[@]}" -ne 0 ]; then
    log "still missing after installation: ${still_missing[*]}"
    exit 1
fi
log "installed: ${missing[*]}"
