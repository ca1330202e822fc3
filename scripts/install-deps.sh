#!/usr/bin/env bash
# Install the system packages the tests need (Debian/Ubuntu): real NBD clients and
# servers for the interop suites, a C toolchain with pkg-config for the C ABI test, OpenSSL's
# headers for the build (TLS), GnuTLS's tools (certtool, psktool) for the TLS tests,
# systemd-socket-activate for the socket-activation tests, ethtool for `zcnbd bench --netns`
# (NAPI threads on the veth pair, so each side's receive work is its own), Ceph (a monitor, an OSD, the `ceph`
# and `rbd` tools and librbd, which the server loads at run time) for the RBD exports and their throwaway test cluster
# (tests/ceph/cluster.sh), QEMU's rbd block driver (qemu-block-extra) for the qemu-nbd RBD bench
# target, dpkg-dev (dpkg-shlibdeps, which cargo-deb asks for the package's dependencies) and
# man-db for the Debian package's test (cargo-deb itself is installed by
# scripts/package-deb.sh), and QEMU's x86 system emulator for the VM lab (tests/vm; the guest's own kernel and tools are fetched by tests/vm/fetch.sh into
# a cache, never installed on the host).
#
# Idempotent: does nothing when every needed command and Python module is
# already present.  Otherwise, when running as root on a system with apt-get,
# runs `apt-get update` once and installs the missing packages.  Exits 1 if
# something is still missing afterwards (or cannot be installed).  No install may remove a
# package (`--no-remove`).
#
# QEMU's packages must all come from one release: qemu-system-x86 from Debian 12 (7.2) cannot
# sit beside a backported qemu-utils (10), which some machine images have.  When the installed
# qemu-utils is a backport, QEMU's packages are installed from the same backports suite,
# through a private apt list directory (the system's sources are left as they are).  Ceph comes
# from Debian 12 (16.2); the backported qemu-block-extra (10) links against that librbd1, so
# installing both removes and downgrades nothing (checked with `apt-get -s`).
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
    [ethtool]=ethtool
    [certtool]=gnutls-bin
    [openssl]=openssl
    [dmsetup]=dmsetup
    [sfdisk]=fdisk
    [xz]=xz-utils
    [psktool]=gnutls-bin
    [gnutls-cli]=gnutls-bin
    [systemd-socket-activate]=systemd
    [systemd-analyze]=systemd
    [ceph-mon]=ceph-mon
    [ceph-osd]=ceph-osd
    [ceph]=ceph-common
    [rbd]=ceph-common
    [dpkg-shlibdeps]=dpkg-dev
    [man]=man-db
    [nginx]=nginx
)
# QEMU's commands -> packages, installed from qemu-utils' release (install_qemu below)
declare -A QEMU_COMMANDS=(
    [qemu-system-x86_64]=qemu-system-x86
)
# Python module (for $PYTHON) -> Debian package
declare -A MODULES=(
    [nbd]=python3-libnbd
    [pytest]=python3-pytest
)

log() { printf 'install-deps: %s\n' "$*" >&2; }

# Whether QEMU can open rbd: images (its block-rbd module is installed beside qemu-img).
qemu_has_rbd() {
    local dir
    for dir in /usr/lib/*/qemu /usr/lib/qemu /usr/lib64/qemu; do
        [ -e "$dir/block-rbd.so" ] && return 0
    done
    return 1
}

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
        for cmd in "${!QEMU_COMMANDS[@]}"; do
            if ! command -v "$cmd" >/dev/null 2>&1; then
                printf '%s\n' "${QEMU_COMMANDS[$cmd]}"
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
        # librbd and librados, which the server loads at run time for RBD exports (the build
        # needs neither them nor their headers).
        if ! /sbin/ldconfig -p | grep -q 'librbd\.so\.1 '; then
            printf '%s\n' librbd1
        fi
        # QEMU's rbd block driver (a module from qemu-block-extra), for qemu-nbd rbd:POOL/IMAGE.
        if command -v qemu-img >/dev/null 2>&1 && ! qemu_has_rbd; then
            printf '%s\n' qemu-block-extra
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
    log "  apt-get install --no-install-recommends --no-remove ${missing[*]}"
    exit 1
fi

is_qemu_package() {
    local p
    [ "$1" = qemu-block-extra ] && return 0
    for p in "${QEMU_COMMANDS[@]}"; do [ "$p" = "$1" ] && return 0; done
    return 1
}

# Installs QEMU's packages from the release the installed qemu-utils came from.
install_qemu() {
    local version codename repo dir
    version=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
    case "$version" in
    *~bpo*) ;;
    *)
        log "running: apt-get install -y --no-install-recommends --no-remove $*"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends --no-remove "$@"
        return
        ;;
    esac
    codename=$(. /etc/os-release && printf '%s' "$VERSION_CODENAME")
    # The backports suite lives in the same archive as the release itself.
    repo=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(IDENTIFIER)' |
        awk -v r="$codename" '$2 == r && $3 == "Packages" { print $1; exit }')
    if [ -z "$repo" ]; then
        log "qemu-utils $version is a backport, but no apt source serves $codename"
        return 1
    fi
    dir=/var/lib/zcnbd/apt-backports
    mkdir -p "$dir/lists/partial" "$dir/sources.list.d"
    rm -f "$dir/sources.list.d/"*
    cp /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list "$dir/sources.list.d/" 2>/dev/null || true
    printf 'Types: deb\nURIs: %s\nSuites: %s-backports\nComponents: main\nSigned-By: %s\n' \
        "$repo" "$codename" /usr/share/keyrings/debian-archive-keyring.gpg \
        >"$dir/sources.list.d/zcnbd-backports.sources"
    local apt=(-o "Dir::Etc::sourceparts=$dir/sources.list.d" -o "Dir::State::lists=$dir/lists")
    log "qemu-utils $version is a backport: installing $* from $codename-backports"
    apt-get "${apt[@]}" update
    DEBIAN_FRONTEND=noninteractive apt-get "${apt[@]}" install -y --no-install-recommends \
        --no-remove -t "$codename-backports" "$@"
}

log "running: apt-get update"
apt-get update
plain=() qemu=()
for p in "${missing[@]}"; do
    if is_qemu_package "$p"; then qemu+=("$p"); else plain+=("$p"); fi
done
if [ "${#plain[@]}" -ne 0 ]; then
    log "running: apt-get install -y --no-install-recommends --no-remove ${plain[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends --no-remove "${plain[@]}"
fi
# After the plain install: it may have brought qemu-utils (nbdkit does not, the image may).
if [ "${#qemu[@]}" -ne 0 ]; then
    install_qemu "${qemu[@]}"
fi

mapfile -t still_missing < <(missing_packages)
if [ "${#still_missing[@]}" -ne 0 ]; then
    log "still missing after installation: ${still_missing[*]}"
    exit 1
fi
log "installed: ${missing[*]}"
