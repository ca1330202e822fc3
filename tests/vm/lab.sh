#!/usr/bin/env bash
# The VM lab: boots a Debian kernel under QEMU with an initramfs holding zcnbd, nbdkit,
# qemu-nbd, the kernel's NBD client (nbd.ko + nbd-client), e2fsprogs and fio, runs the guest's
# test scripts (tests/vm/guest.d/*.sh) and turns what they print into a pass or a failure.
# The guest also gets two virtio disks that are zcnbd exports on the host (one over TCP, one
# over a Unix socket); after the guest has written them, the host checks their contents.
#
#   tests/vm/lab.sh [--shell] [--only GLOB] [--bench] [--attach-sources LIST] [--repeats N]
#                   [--kernel default|zero-copy] [--accel auto|tcg|kvm] [--timeout SECONDS]
#                   [--smp N]
#
#   --shell          boot to a shell on this terminal instead (tests: /vmlab/run-tests [GLOB];
#                    leave with poweroff -f, or Ctrl-A X)
#   --only GLOB      run only the guest scripts whose name matches, e.g. --only '2*'
#   --bench          also run the fio comparison (guest.d/90-bench.sh) and print its table,
#                    and zcnbd bench plain vs kTLS (guest.d/91-bench-own-client.sh, console log)
#   --attach-sources the attach comparison's sources (guest.d/92-bench-attach.sh), a comma
#                    list of ext4, raw, qcow2, nbd (default: all four)
#   --repeats        the attach comparison's runs of each cell (default 1), interleaved: every
#                    tool once, then every tool again; its table gives the median and range
#   --kernel         the guest's kernel. default: bookworm-security's 6.12 (the host's apt;
#                    ZCNBD_VM_KERNEL and ZCNBD_VM_KERNEL_SUITE pick another, see fetch.sh).
#                    zero-copy: trixie-backports' linux-image-6.17.13+deb13-amd64, for ublk
#                    zero copy (UBLK_F_AUTO_BUF_REG, 6.16+), fetched through a private apt
#                    configuration (the host's sources are not touched), cached in
#                    $ZCNBD_VM_CACHE/zero-copy, results in target/vmlab-zero-copy, so neither
#                    run disturbs the other's. The guest sees vmlab.kernel=NAME on its command
#                    line (and uname -r).
#   --accel          auto (default): KVM if a short boot proves it works here, else TCG
#   --timeout        hard limit for the whole guest run (default 1200 s)
#   --smp            the guest's vCPUs (default 2)
#
# Environment:
#   ZCNBD_BIN        the server put in the guest and run on the host
#                    (default: $CARGO_TARGET_DIR or target, /release/zcnbd)
#   ZCNBD_VM_CACHE   downloaded guest packages (default: ~/.cache/zcnbd-vm; --kernel zero-copy
#                    uses its zero-copy/)
#   ZCNBD_VM_OUT     initramfs, console log, results (default: target/vmlab, or
#                    target/vmlab-zero-copy with --kernel zero-copy)
#   ZCNBD_VM_ACCEL   the default for --accel
#   CI=true          a host that cannot run the lab (no QEMU, no tools) fails instead of
#                    skipping
#
# The results: one line per check, then "vmlab: N passed, N failed, N skipped". The console
# log is $ZCNBD_VM_OUT/console.log; when a check fails, its part of the log is printed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

mode=test only= bench=0 attach_sources= repeats=1 accel=${ZCNBD_VM_ACCEL:-auto} limit=1200 smp=2
kernel_choice=default
while [ $# -gt 0 ]; do
    case $1 in
    --shell) mode=shell ;;
    --only) only=$2; shift ;;
    --only=*) only=${1#--only=} ;;
    --bench) bench=1 ;;
    --attach-sources) attach_sources=$2; shift ;;
    --attach-sources=*) attach_sources=${1#--attach-sources=} ;;
    --repeats) repeats=$2; shift ;;
    --repeats=*) repeats=${1#--repeats=} ;;
    --kernel) kernel_choice=$2; shift ;;
    --kernel=*) kernel_choice=${1#--kernel=} ;;
    --accel) accel=$2; shift ;;
    --accel=*) accel=${1#--accel=} ;;
    --timeout) limit=$2; shift ;;
    --timeout=*) limit=${1#--timeout=} ;;
    --smp) smp=$2; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "vmlab: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

bin=${ZCNBD_BIN:-${CARGO_TARGET_DIR:-$repo/target}/release/zcnbd}
cache=${ZCNBD_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zcnbd-vm}
out_suffix=
case $kernel_choice in
default) ;;
zero-copy)
    # ublk zero copy (UBLK_F_AUTO_BUF_REG) is in 6.16 and later; Debian 12 has 6.12 at most, so
    # the kernel comes from trixie-backports (fetch.sh's private apt configuration). A real
    # image, not the linux-image-amd64 meta package: backports move on (to 7.x, whose images
    # are split in three packages), and the lab should boot the kernel it was proved with.
    export ZCNBD_VM_KERNEL=linux-image-6.17.13+deb13-amd64 ZCNBD_VM_KERNEL_SUITE=trixie-backports
    # Its own cache and results: the default kernel's stay as they are.
    cache=$cache/zero-copy
    out_suffix=-zero-copy
    ;;
*) echo "vmlab: --kernel is default or zero-copy, not $kernel_choice" >&2; exit 2 ;;
esac
out=${ZCNBD_VM_OUT:-${CARGO_TARGET_DIR:-$repo/target}/vmlab$out_suffix}
console=$out/console.log
started=$(date +%s)

log() { printf 'vmlab: %s\n' "$*" >&2; }
elapsed() { echo $(($(date +%s) - started)); }

# A host that cannot run the lab: a failure under CI (as the interop suite fails on missing
# tools), else a loud skip.
cannot_run() {
    log "cannot run the VM lab: $*"
    if [ "${CI:-}" = true ]; then
        log "CI=true: failing (run scripts/install-deps.sh)"
        echo "vmlab: 0 passed, 1 failed, 0 skipped"
        exit 1
    fi
    log "SKIPPED (set CI=true to make this a failure)"
    echo "vmlab: 0 passed, 0 failed, 1 skipped"
    exit 0
}

# --- preflight ---------------------------------------------------------------------------------

# certtool makes the guest's TLS credentials: without it the TLS and kTLS checks could only
# skip, so it is required like the rest (a missing tool fails the lab under CI=true).
host_tools=(qemu-system-x86_64 qemu-img qemu-nbd nbdkit nbdcopy nbdinfo fio mkfs.ext4 e2fsck debugfs
    fstrim blkdiscard blockdev strip dpkg-deb apt-get certtool dmsetup xz sfdisk losetup)
for tool in "${host_tools[@]}"; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1 || cannot_run "no $tool"
done
export PATH="$PATH:/usr/sbin:/sbin"
[ -x "$bin" ] || cannot_run "no zcnbd binary at $bin (cargo build --release)"
mkdir -p "$out"
# Tables of an earlier run must not pass for this one's.
rm -f "$out"/fio-table.* "$out"/own-bench.*

"$here/fetch.sh" "$cache" || cannot_run "could not fetch the guest's packages"
groot=$cache/root
kernel_version=$(sed -n '1s/^linux-image-\([^=]*\)=.*/\1/p' "$cache/root.versions")
vmlinuz=$groot/boot/vmlinuz-$kernel_version
[ -f "$vmlinuz" ] || cannot_run "no kernel in the cache ($vmlinuz)"
# The kernel's modules: bookworm's packages put them in /lib/modules, trixie's (merged /usr)
# in /usr/lib/modules. In the initramfs /lib is /usr/lib, so both land in /lib/modules there.
modroot=$groot/lib/modules/$kernel_version
[ -d "$modroot" ] || modroot=$groot/usr/lib/modules/$kernel_version
[ -d "$modroot" ] || cannot_run "no modules for $kernel_version in the cache"

# --- the initramfs -----------------------------------------------------------------------------

ir=$out/initramfs
# Host programs the guest runs, copied with their shared libraries.
guest_programs=(
    /usr/sbin/mkfs.ext4 /usr/sbin/mke2fs /usr/sbin/e2fsck /usr/sbin/fstrim /usr/sbin/blkdiscard
    /usr/sbin/blockdev /usr/bin/fio /usr/bin/dd /usr/bin/nbdkit /usr/bin/qemu-nbd
    /usr/bin/qemu-img /usr/bin/nbdinfo /usr/sbin/dmsetup /usr/sbin/sfdisk /usr/sbin/losetup
)
nbdkit_plugins=/usr/lib/x86_64-linux-gnu/nbdkit/plugins
nbdkit_plugin_names=(memory file)
# Loaded at boot; the kernel loads others on demand through modprobe. kTLS needs its AEADs
# ready before a socket asks for them: busybox's modprobe cannot resolve the kernel's
# "crypto-gcm(aes)" requests, so the ciphers TLS suites use are loaded here.
# "a|b": the first of them this kernel has, as a module or built in. 6.12 has crc32c_generic
# and crc32c_intel (the crypto API's crc32c, which its ext4 asks for); 6.17 has neither: CRC32C
# is in the CRC library there (the built-in crc32, with the SSE4.2 code; ext4 and jbd2 call it
# directly), and crc32c_cryptoapi is the crypto API's crc32c over it.
modules_load=(nbd 'crc32c_generic|crc32c_cryptoapi' 'crc32c_intel|crc32' ext4 virtio_pci
    virtio_blk tls ctr gcm ghash_generic ghash_clmulni_intel aesni_intel chacha20poly1305)
# In the initramfs for tests that load them (vsock; device-mapper and a RAM disk for the
# failing disk). One this kernel lacks is left out with a note (Debian's 6.1 has no
# ublk_drv): the tests that modprobe it skip, saying so.
modules_extra=(vsock_loopback dm_mod dm_flakey dm_log_writes brd ublk_drv loop)

# Copies FILE to the same path under the initramfs, with the libraries ldd names (looked up
# in the cached packages too: nbd-client's libnl-genl is not on the host).
install_program() {
    local src=$1 dest=${2:-$1} lib
    mkdir -p "$ir$(dirname "$dest")"
    cp -L "$src" "$ir$dest"
    while read -r lib; do
        local guest_path=${lib#"$groot"}
        [ -e "$ir$guest_path" ] && continue
        mkdir -p "$ir$(dirname "$guest_path")"
        cp -L "$lib" "$ir$guest_path"
    done < <(LD_LIBRARY_PATH="$groot/lib/x86_64-linux-gnu:$groot/usr/lib/x86_64-linux-gnu" ldd "$src" |
        awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
}

# The files of the modules named (each "a|b" resolved to the first this kernel has) and of
# their dependencies (from each .ko's modinfo "depends="), deepest first; the names after
# --optional may be missing. Debian's 6.12 and 6.17 ship them xz-compressed (.ko.xz), 6.1
# plain. With --names, prints the resolved names of the modules before --optional instead.
module_closure() {
    python3 - "$modroot" "$@" <<'EOF'
import lzma, os, re, sys
base, args = sys.argv[1], sys.argv[2:]
print_names = args[:1] == ["--names"]
if print_names:
    args = args[1:]
names, optional = (args[: args.index("--optional")], args[args.index("--optional") + 1 :]) \
    if "--optional" in args else (args, [])
paths = {}
for d, _, files in os.walk(base):
    for f in files:
        for suffix in (".ko", ".ko.xz"):
            if f.endswith(suffix):
                paths[f[: -len(suffix)].replace("-", "_")] = os.path.join(d, f)
# Built into this kernel (6.12 has virtio_pci and ctr built in): nothing to copy.
builtin = {os.path.basename(l.strip()).split(".ko")[0].replace("-", "_")
           for l in open(os.path.join(base, "modules.builtin"))}
def resolve(alternatives):
    for name in alternatives.split("|"):
        name = name.replace("-", "_")
        if name in paths or name in builtin:
            return name
    return None
seen, order = set(builtin), []
def visit(name):
    name = name.replace("-", "_")
    if name in seen:
        return
    seen.add(name)
    if name not in paths:
        sys.exit(f"module {name} not found under {base}")
    data = open(paths[name], "rb").read()
    if paths[name].endswith(".xz"):
        data = lzma.decompress(data)
    m = re.search(rb"depends=([^\0]*)\0", data)
    for dep in (m.group(1).decode().split(",") if m and m.group(1) else []):
        visit(dep)
    order.append(paths[name])
resolved = []
for n in names:
    name = resolve(n)
    if name is None:
        sys.exit(f"module {n} not found under {base} (neither a module nor built in)")
    resolved.append(name)
    visit(name)
for n in optional:
    name = resolve(n)
    if name is None:
        print(f"vmlab: this kernel has no module {n}: left out", file=sys.stderr)
        continue
    visit(name)
print("\n".join(resolved if print_names else order))
EOF
}

# TLS credentials for the guest's TLS test (guest.d/40-tls.sh): a CA and a certificate for
# "localhost", in nbdkit's/QEMU's layout (certtool is one of the host tools checked above).
make_tls_credentials() {
    local dir=$1
    mkdir -p "$dir/server"
    (
        cd "$dir"
        certtool --generate-privkey --outfile ca-key.pem
        printf 'cn = vmlab CA\nca\ncert_signing_key\nexpiration_days = 2\n' >ca.info
        certtool --generate-self-signed --load-privkey ca-key.pem --template ca.info \
            --outfile ca-cert.pem
        certtool --generate-privkey --outfile server/server-key.pem
        printf 'cn = localhost\ndns_name = localhost\nip_address = 127.0.0.1\ntls_www_server\nencryption_key\nsigning_key\nexpiration_days = 2\n' >server.info
        certtool --generate-certificate --load-ca-certificate ca-cert.pem \
            --load-ca-privkey ca-key.pem --load-privkey server/server-key.pem \
            --template server.info --outfile server/server-cert.pem
        cp ca-cert.pem server/
        chmod 600 server/server-key.pem
        rm ca-key.pem ca.info server.info
    ) >/dev/null 2>&1
}

build_initramfs() {
    rm -rf "$ir"
    mkdir -p "$ir"/{bin,usr/bin,usr/sbin,usr/lib64,usr/local/bin,etc,vmlab/guest.d,proc,sys,dev,tmp,mnt}
    mkdir -p "$ir/usr/lib/x86_64-linux-gnu"
    ln -s usr/lib "$ir/lib"
    ln -s usr/lib64 "$ir/lib64"
    ln -s usr/sbin "$ir/sbin"
    cp "$groot/bin/busybox" "$ir/bin/busybox"
    local p
    for p in "${guest_programs[@]}"; do
        install_program "$p"
    done
    install_program "$groot/sbin/nbd-client" /usr/sbin/nbd-client
    for p in "${nbdkit_plugin_names[@]}"; do
        install_program "$nbdkit_plugins/nbdkit-$p-plugin.so"
    done
    # zcnbd without its debug info (43 MB -> 7 MB), with the libraries it links.
    strip -o "$out/zcnbd.stripped" "$bin"
    install_program "$out/zcnbd.stripped" /usr/local/bin/zcnbd
    # The hostile upstream of the attach checks (built by cargo build --all-targets).
    local misbehaving
    misbehaving=$(dirname "$bin")/examples/misbehaving_server
    if [ -x "$misbehaving" ]; then
        strip -o "$out/misbehaving.stripped" "$misbehaving"
        install_program "$out/misbehaving.stripped" /usr/local/bin/zcnbd-misbehaving-server
    else
        log "no $misbehaving (cargo build --release --all-targets): the hostile-upstream checks fail"
    fi
    cp /etc/mke2fs.conf "$ir/etc/" 2>/dev/null || true
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$ir/etc/passwd"
    printf 'root:x:0:\n' >"$ir/etc/group"
    printf '127.0.0.1 localhost\n::1 localhost\n' >"$ir/etc/hosts"

    local moddir=/lib/modules/$kernel_version ko
    mkdir -p "$ir$moddir"
    while read -r ko; do
        local rel=$moddir/${ko#"$modroot"/}
        mkdir -p "$ir$(dirname "$rel")"
        # Uncompressed: busybox's insmod hands the kernel the file as it is.
        case $ko in
        *.xz) xz -dc "$ko" >"$ir${rel%.xz}" ;;
        *) cp "$ko" "$ir$rel" ;;
        esac
    done < <(module_closure "${modules_load[@]}" --optional "${modules_extra[@]}")
    cp "$modroot"/modules.{order,builtin} "$ir$moddir/"
    "$groot/bin/busybox" depmod -b "$ir" "$kernel_version"
    module_closure --names "${modules_load[@]}" >"$ir/vmlab/modules.load"

    make_tls_credentials "$ir/vmlab/tls"
    cp "$here/guest/init" "$ir/init"
    cp "$here/guest/run-tests" "$here/guest/lib.sh" "$here/guest/powercut" "$ir/vmlab/"
    cp "$here"/guest.d/*.sh "$ir/vmlab/guest.d/"
    chmod +x "$ir/init" "$ir/vmlab/run-tests" "$ir/vmlab/powercut"
    (cd "$ir" && find . | LC_ALL=C sort | "$groot/bin/busybox" cpio -o -H newc 2>/dev/null) \
        >"$out/initramfs.cpio"
}

# --- QEMU ----------------------------------------------------------------------------------------

qemu_base=(qemu-system-x86_64 -cpu max -m 1G -nographic -nic none -no-reboot
    -kernel "$vmlinuz" -initrd "$out/initramfs.cpio")
cmdline="console=ttyS0 quiet panic=-1 mitigations=off vmlab.kernel=$kernel_choice"

# KVM where a short boot shows it works (on some VMs /dev/kvm cannot boot a stock kernel:
# QEMU aborts on an MSR, or the kernel never leaves its decompressor); the answer is kept in
# the cache per host kernel and QEMU version.
choose_accel() {
    case $accel in tcg | kvm) echo "$accel"; return ;; esac
    if [ ! -w /dev/kvm ]; then
        echo tcg
        return
    fi
    local key
    key="$(uname -r)-$(qemu-system-x86_64 --version | head -1 | tr -c 'A-Za-z0-9.\n' _)"
    local stamp=$cache/kvm-probe-$key
    if [ ! -f "$stamp" ]; then
        log "probing KVM with a short boot (at most 30 s)"
        if timeout -k 5 30 "${qemu_base[@]}" -accel kvm -smp 1 \
            -append "$cmdline vmlab.only=none" </dev/null 2>&1 | grep -q '@@VMLAB done'; then
            echo kvm >"$stamp"
        else
            echo tcg >"$stamp"
        fi
    fi
    cat "$stamp"
}

# --- the host's exports for the guest's virtio disks ----------------------------------------------

host_server_pid=
disk_tcp_name=vm-tcp disk_unix_name=vm-unix
disk_unix_file=$out/disk-unix.img
disk_socket=$out/zcnbd.sock
disk_bytes=$((128 << 20))

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_host_exports() {
    disk_port=$(free_port)
    rm -f "$disk_unix_file" "$disk_socket"
    truncate -s "$disk_bytes" "$disk_unix_file"
    # One server, two exports: the memory one on TCP, the file one on the Unix socket (a
    # second server: zcnbd listens on one address).
    "$bin" serve --memory "$disk_bytes" -x "$disk_tcp_name" -p "$disk_port" \
        >"$out/host-server-tcp.log" 2>&1 &
    host_server_pid=$!
    "$bin" serve "$disk_unix_file" -x "$disk_unix_name" -s "$disk_socket" \
        >"$out/host-server-unix.log" 2>&1 &
    host_server_unix_pid=$!
    local i
    for i in $(seq 100); do
        if [ -S "$disk_socket" ] && nbdinfo --size "nbd://127.0.0.1:$disk_port/$disk_tcp_name" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    log "the host's zcnbd exports did not come up"
    cat "$out"/host-server-*.log >&2
    return 1
}

stop_host_exports() {
    local pid
    for pid in ${host_server_pid:-} ${host_server_unix_pid:-}; do
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    host_server_pid= host_server_unix_pid=
}

# --- results ------------------------------------------------------------------------------------

# Host checks of the disks the guest wrote: the whole device's sha256 as the guest read it
# (virtio-blk through QEMU's NBD client) against nbdcopy's copy (libnbd), e2fsck on the copy,
# each file's sha256 through debugfs, and qemu-img compare of the export against the copy.
host_results=()
verify_disk() {
    local dev=$1 uri=$2 image=$out/$1.img
    local want_sha
    want_sha=$(awk -v d="$dev" '$1 == "@@VMLAB" && $2 == "metric" && $3 == "virtio-device" && $4 == d { sub("sha256=", "", $5); print $5 }' "$console" | tail -1)
    if [ -z "$want_sha" ]; then
        host_results+=("host/$dev-verify skip 0 the guest wrote nothing to /dev/$dev")
        return
    fi
    local why=
    rm -f "$image"
    if ! nbdcopy "$uri" "$image" 2>"$out/nbdcopy-$dev.log"; then
        why="nbdcopy $uri failed: $(cat "$out/nbdcopy-$dev.log")"
    elif [ "$(sha256sum <"$image" | cut -d' ' -f1)" != "$want_sha" ]; then
        why="the export's sha256 differs from what the guest read"
    elif ! e2fsck -fn "$image" >"$out/e2fsck-$dev.log" 2>&1; then
        why="e2fsck -fn on the export's copy: $(tail -3 "$out/e2fsck-$dev.log")"
    elif ! qemu-img compare -f raw -F raw "$image" "$uri" >/dev/null 2>&1; then
        why="qemu-img compare of the export and nbdcopy's copy differ"
    else
        local path sha got files=0
        while read -r path sha; do
            got=$(debugfs -R "cat $path" "$image" 2>/dev/null | sha256sum | cut -d' ' -f1)
            if [ "$got" != "$sha" ]; then
                why="$path: sha256 through debugfs differs"
                break
            fi
            files=$((files + 1))
        done < <(awk -v d="$dev" '$1 == "@@VMLAB" && $2 == "metric" && $3 == "virtio-file" && $4 == d { sub("sha256=", "", $6); print $5, $6 }' "$console")
        [ -z "$why" ] && [ "$files" = 0 ] && why="the guest listed no files"
    fi
    if [ -n "$why" ]; then
        host_results+=("host/$dev-verify fail 0 $why")
    else
        host_results+=("host/$dev-verify pass 0 $uri: device sha256, e2fsck -fn, $files files, qemu-img compare")
    fi
}

# --- crash consistency at every FLUSH ------------------------------------------------------------

# guest.d/26-log-writes.sh's log, replayed to every mark, and for its qcow2 image to every
# entry (tests/vm/replay_log_writes.py).
log_writes_test() {
    local bytes
    bytes=$(awk '$1 == "@@VMLAB" && $2 == "metric" && $3 == "log-writes-done" { sub("bytes=", "", $4); print $4 }' "$console" | tail -1)
    [ -n "$bytes" ] || return 0
    local out line
    out=$("$here/replay_log_writes.py" "$log_writes_disk" "$bytes" 2>&1)
    if ! grep -q '^host/log-writes-qcow2 ' <<<"$out"; then
        host_results+=("host/log-writes fail 0 the replay failed: $(tail -1 <<<"$out")")
        return 0
    fi
    while IFS= read -r line; do
        case $line in host/*) host_results+=("$line") ;; esac
    done <<<"$out"
}

# --- the power cut ----------------------------------------------------------------------------

# Durability through a power cut (guest/powercut): the guest runs zcnbd (io_uring and portable
# engines) on files of an ext4 disk that QEMU writes with cache=writeback - a guest flush
# reaches the host file, everything else stays in the guest's memory - writes with FUA and
# with a FLUSH through the kernel client (and through a `zcnbd attach` ublk device, and to a
# qcow2 served with --direct), says when every write is acknowledged durable, and
# the host kills QEMU with SIGKILL then. A second boot reads the disk: every acknowledged
# region must be there. Without the server's syncs the data would be lost with the guest's
# page cache.
powercut_test() {
    case powercut in ${only:-*}) ;; *) return 0 ;; esac
    local dir=$out/powercut-files image=$out/powercut.img engine
    local write_log=$out/powercut-write.log check_log=$out/powercut-check.log
    rm -rf "$dir" "$image"
    mkdir -p "$dir"
    for engine in uring portable attach; do
        dd if=/dev/zero of="$dir/export-$engine.img" bs=1M count=8 status=none
    done
    qemu-img create -q -f qcow2 "$dir/export-qcow2-direct.img" 8M
    if ! mkfs.ext4 -q -F -d "$dir" "$image" 64M >"$out/powercut-mkfs.log" 2>&1; then
        host_results+=("host/powercut fail 0 mkfs.ext4 -d: $(tail -1 "$out/powercut-mkfs.log")")
        return
    fi
    local drive=(-drive "file=$image,format=raw,if=virtio,cache=writeback")
    log "power cut: writing (accel $chosen_accel)"
    "${qemu_base[@]}" -accel "$chosen_accel" "${smp_args[@]}" "${drive[@]}" \
        -append "$cmdline vmlab.powercut=write" </dev/null >"$write_log" 2>&1 &
    local qemu=$! i
    for i in $(seq 1500); do
        grep -q '@@VMLAB powercut \(acknowledged\|error\)' "$write_log" && break
        kill -0 "$qemu" 2>/dev/null || break
        sleep 0.2
    done
    kill -KILL "$qemu" 2>/dev/null || true
    wait "$qemu" 2>/dev/null || true
    if ! grep -q '@@VMLAB powercut acknowledged' "$write_log"; then
        local why
        why=$(tr -d '\r' <"$write_log" | grep -o '@@VMLAB powercut error.*' | head -1)
        host_results+=("host/powercut fail 0 the writing boot did not finish: ${why:-see $write_log}")
        return
    fi
    log "power cut: QEMU killed; booting again to read the disk"
    timeout -k 10 300 "${qemu_base[@]}" -accel "$chosen_accel" "${smp_args[@]}" "${drive[@]}" \
        -append "$cmdline vmlab.powercut=check" </dev/null >"$check_log" 2>&1 || true
    local kind want got skipped
    for engine in uring portable attach qcow2-direct; do
        skipped=$(tr -d '\r' <"$write_log" | grep -o "powercut-skipped engine=$engine reason=.*" | head -1)  || true
        if [ -n "$skipped" ]; then
            host_results+=("host/powercut-$engine skip 0 ${skipped#*reason=}")
            continue
        fi
        for kind in fua flush; do
            want=$(tr -d '\r' <"$write_log" | awk -v e="engine=$engine" -v k="$kind=" '
                $2 == "metric" && $3 == "powercut-written" && $4 == e {
                    for (i = 5; i <= NF; i++) if (index($i, k) == 1) print substr($i, length(k) + 1) }' | tail -1)
            got=$(tr -d '\r' <"$check_log" | sed 's/^.*@@VMLAB /@@VMLAB /' | awk -v e="engine=$engine" -v k="$kind=" '
                $2 == "metric" && $3 == "powercut-found" && $4 == e {
                    for (i = 5; i <= NF; i++) if (index($i, k) == 1) print substr($i, length(k) + 1) }' | tail -1)
            if [ -z "$got" ]; then
                host_results+=("host/powercut-$engine-$kind fail 0 the second boot read nothing (see $check_log)")
            elif [ "$want" = "$got" ]; then
                host_results+=("host/powercut-$engine-$kind pass 0 1 MiB acknowledged durable before SIGKILL, found after reboot")
            else
                host_results+=("host/powercut-$engine-$kind fail 0 acknowledged-durable data lost in the power cut: sha256 ${want:0:12}... written, ${got:0:12}... found ($write_log, $check_log)")
            fi
        done
    done
}

# Prints the console's lines for one check: from its "--- NAME" line to its result.
check_log() {
    awk -v n="$1" '
        index($0, "vmlab: --- " n ":") { on = 1 }
        on { print "  | " $0 }
        on && $1 == "@@VMLAB" && $2 == "result" && $3 == n { exit }' "$console" | tail -80
}

report() {
    local passed=0 failed=0 skipped=0 line name status secs detail
    local failed_names=()
    printf '\n%-44s %-5s %6s  %s\n' check result secs detail
    while read -r line; do
        read -r name status secs detail <<<"$line"
        printf '%-44s %-5s %6s  %s\n' "$name" "$status" "$secs" "$detail"
        case $status in
        pass) passed=$((passed + 1)) ;;
        skip) skipped=$((skipped + 1)) ;;
        *) failed=$((failed + 1)); failed_names+=("$name") ;;
        esac
    done < <({
        awk '$1 == "@@VMLAB" && $2 == "result" { $1 = $2 = ""; sub(/^ +/, ""); print }' "$console"
        printf '%s\n' "${host_results[@]}"
    } | sed '/^$/d')
    if ! grep -q '^@@VMLAB done' "$console"; then
        failed=$((failed + 1))
        printf '%-44s %-5s %6s  %s\n' guest/finished fail "$(elapsed)" \
            "the guest did not finish (time limit ${limit}s, panic or hang); last lines:"
        tail -40 "$console" | sed 's/^/  | /'
    fi
    if [ "$passed" = 0 ] && [ "$failed" = 0 ]; then
        failed=1
        echo "vmlab: no check ran"
    fi
    local n
    for n in "${failed_names[@]}"; do
        printf '\n--- the log of %s (whole console: %s)\n' "$n" "$console"
        check_log "$n"
    done
    [ "$failed" = 0 ] || cp "$console" "$out/console-failed.log"
    guest_files
    bench_table
    attach_table
    printf '\nvmlab: guest run %s s, whole lab %s s (accel %s, kernel %s)\n' "$guest_seconds" "$(elapsed)" \
        "$chosen_accel" "$kernel_version"
    echo "vmlab: $passed passed, $failed failed, $skipped skipped"
    [ "$failed" = 0 ]
}

# Files the guest printed with emit_file (guest/lib.sh) into $out/NAME, checked against the
# sha256 the guest printed after them; a file that came out damaged is reported and removed.
guest_files() {
    local name want got
    for name in $(awk '$1 == "@@VMLAB" && $2 == "datasum" { print $3 }' "$console" | sort -u); do
        awk -v n="$name" '$1 == "@@VMLAB" && $2 == "data" && $3 == n {
            sub(/^@@VMLAB data [^ ]+ ?/, ""); print }' "$console" >"$out/$name"
        want=$(awk -v n="$name" '$1 == "@@VMLAB" && $2 == "datasum" && $3 == n { print $4 }' "$console" | tail -1)
        got=$(sha256sum <"$out/$name" | cut -d' ' -f1)
        if [ "$want" = "$got" ]; then
            log "from the guest: $out/$name"
        else
            log "from the guest: $name came through the console damaged (sha256 differs); dropped"
            rm -f "$out/$name"
        fi
    done
}

# The host's CPU, for the tables' captions (the guest's CPU is QEMU's model of it).
host_cpu() { awk -F': *' '$1 ~ /^model name/ { print $2; exit }' /proc/cpuinfo; }

# The console's `@@VMLAB metric KIND key=value ...` lines as FILE: a JSON object naming the
# host CPU, the accelerator, the guest kernel, zcnbd's version and the date, with one row per
# line (numbers as numbers).
metric_rows_json() {
    local kind=$1 file=$2
    {
        printf '{\n  "host_cpu": "%s",\n  "accel": "%s",\n  "guest_kernel": "%s",\n' \
            "$(host_cpu)" "$chosen_accel" "$kernel_version"
        printf '  "zcnbd": "%s",\n  "date": "%s",\n  "rows": [' \
            "$("$bin" --version 2>/dev/null | head -1)" "$(date -u +%FT%TZ)"
        awk -v kind="$kind" '$1 == "@@VMLAB" && $3 == kind {
                sep = (n++ ? "," : "")
                printf "%s\n    {", sep
                for (i = 4; i <= NF; i++) {
                    split($i, p, "=")
                    v = (p[2] ~ /^[0-9.]+$/) ? p[2] : "\"" p[2] "\""
                    printf "%s\"%s\": %s", (i > 4 ? ", " : ""), p[1], v
                }
                printf "}"
            }
            END { printf "\n" }' "$console"
        printf '  ]\n}\n'
    } >"$file"
}

# The fio comparison (--bench): one row per server, block size and pattern, printed as a
# Markdown table (fio-table.md) with the raw rows beside it (fio-table.json).
bench_table() {
    grep -q '^@@VMLAB metric bench ' "$console" || return 0
    metric_rows_json bench "$out/fio-table.json"
    {
        echo
        echo "fio inside the guest (kernel client, /dev/nbd0, direct=1, libaio, iodepth 16, one job),"
        echo "server in the same guest; emulated CPU (QEMU $chosen_accel on $(host_cpu)): read the"
        echo "CPU columns as relative cost per I/O, not as absolute speed; raw rows: $out/fio-table.json"
        echo
        echo "| server | bs | rw | MiB/s | IOPS | server CPU s/GiB | guest CPU s/GiB |"
        echo "|---|---|---|---:|---:|---:|---:|"
        awk '$1 == "@@VMLAB" && $3 == "bench" {
            delete kv
            for (i = 4; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] }
            printf "| %s | %s | %s | %s | %s | %s | %s |\n", kv["server"], kv["bs"], kv["rw"], kv["mibs"], kv["iops"], kv["server_cpu_s_per_gib"], kv["guest_cpu_s_per_gib"]
        }' "$console"
    } | tee "$out/fio-table.md"
}

# The attach comparison (guest.d/92-bench-attach.sh) as target/vmlab/attach-table.{md,json}:
# one row per source, tool and cell - the median of its runs (--repeats) and their IOPS range -
# and for the other tools zcnbd attach's median IOPS over theirs in the same cell.
attach_table() {
    grep -q '^@@VMLAB metric attach-bench ' "$console" || return 0
    local rows='$1 == "@@VMLAB" && $3 == "attach-bench"'
    metric_rows_json attach-bench "$out/attach-table.json"
    {
        echo
        echo "fio inside the guest on a local disk made by each tool (direct=1, libaio, one job,"
        echo "iodepth 32), all in one boot; emulated CPU (QEMU $chosen_accel on $(host_cpu)): read"
        echo "the ratios, not the absolute figures; each row the median of its runs, interleaved"
        echo "(IOPS range: the lowest and highest run); raw rows: $out/attach-table.json"
        echo
        echo "| source | tool | bs | rw | runs | MiB/s | IOPS | IOPS range | zcnbd attach × | process CPU s/GiB | guest CPU s/GiB |"
        echo "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
        awk "$rows"' {
            delete kv
            for (i = 4; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] }
            row = kv["target"] SUBSEP kv["tool"] SUBSEP kv["bs"] SUBSEP kv["rw"]
            if (!(row in runs)) { order[++rows] = row; part[rows, "target"] = kv["target"]
                part[rows, "tool"] = kv["tool"]; part[rows, "bs"] = kv["bs"]; part[rows, "rw"] = kv["rw"] }
            r = ++runs[row]
            split("mibs iops process_cpu_s_per_gib guest_cpu_s_per_gib", names, " ")
            for (j in names) v[row, names[j], r] = kv[names[j]]
        }
        # The median of the runs of `row` for metric `m` ("kernel" stays as it is).
        function median(row, m,    n, i, j, t, a) {
            n = runs[row]
            if (v[row, m, 1] !~ /^[0-9.]+$/) return v[row, m, 1]
            for (i = 1; i <= n; i++) a[i] = v[row, m, i] + 0
            for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
            lo = a[1]; hi = a[n]
            return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
        }
        END {
            for (i = 1; i <= rows; i++) {
                row = order[i]
                if (part[i, "tool"] == "zcnbd-attach")
                    ours[part[i, "target"], part[i, "bs"], part[i, "rw"]] = median(row, "iops")
            }
            for (i = 1; i <= rows; i++) {
                row = order[i]; cell = part[i, "target"] SUBSEP part[i, "bs"] SUBSEP part[i, "rw"]
                iops = median(row, "iops"); range = sprintf("%d-%d", lo, hi)
                ratio = "-"
                if (part[i, "tool"] != "zcnbd-attach" && iops > 0 && (cell in ours))
                    ratio = sprintf("%.2f", ours[cell] / iops)
                cpu = median(row, "process_cpu_s_per_gib")
                if (cpu ~ /^[0-9.]+$/) cpu = sprintf("%.2f", cpu)
                printf "| %s | %s | %s | %s | %d | %.1f | %d | %s | %s | %s | %.2f |\n", part[i, "target"],
                    part[i, "tool"], part[i, "bs"], part[i, "rw"], runs[row], median(row, "mibs"), iops,
                    range, ratio, cpu, median(row, "guest_cpu_s_per_gib")
            }
        }' "$console"
    } | tee "$out/attach-table.md"
}

# --- run -----------------------------------------------------------------------------------------

log "building the initramfs (kernel $kernel_version)"
build_initramfs
log "initramfs: $(du -h "$out/initramfs.cpio" | cut -f1)"
chosen_accel=$(choose_accel)
smp_args=(-smp "$smp")
append="$cmdline"
[ -n "$only" ] && append="$append vmlab.only=$only"
[ "$bench" = 1 ] && append="$append vmlab.bench"
[ -n "$attach_sources" ] && append="$append vmlab.attach=$attach_sources"
case $repeats in
[1-9] | [1-9][0-9]) append="$append vmlab.repeats=$repeats" ;;
*) echo "vmlab: --repeats takes 1 to 99, not '$repeats'" >&2; exit 2 ;;
esac

trap 'stop_host_exports' EXIT
start_host_exports
# The third disk holds guest.d/26-log-writes.sh's log (replayed here after the run).
log_writes_disk=$out/log-writes.img
rm -f "$log_writes_disk"
truncate -s 128M "$log_writes_disk"
drives=(
    -drive "file=nbd://127.0.0.1:$disk_port/$disk_tcp_name,format=raw,if=virtio,cache=none"
    -drive "file=nbd+unix:///$disk_unix_name?socket=$disk_socket,format=raw,if=virtio,cache=none"
    -drive "file=$log_writes_disk,format=raw,if=virtio,cache=writeback"
)

if [ "$mode" = shell ]; then
    log "booting to a shell (accel $chosen_accel); /vmlab/run-tests runs the tests, poweroff -f leaves"
    "${qemu_base[@]}" -accel "$chosen_accel" "${smp_args[@]}" "${drives[@]}" -append "$append vmlab.shell"
    exit 0
fi

log "booting the guest (accel $chosen_accel, $smp vCPUs, at most ${limit}s); console: $console"
guest_started=$(date +%s)
set +e
timeout -k 10 "$limit" "${qemu_base[@]}" -accel "$chosen_accel" "${smp_args[@]}" "${drives[@]}" \
    -append "$append" </dev/null 2>&1 | tee "$console" |
    sed -un 's/^.*@@VMLAB \(result\|booted\) /vmlab: \1 /p' >&2
set -e
guest_seconds=$(($(date +%s) - guest_started))
# Without carriage returns, and with the terminal codes SeaBIOS prints before the first line
# taken off the results' lines.
tr -d '\r' <"$console" | sed 's/^.*@@VMLAB /@@VMLAB /' >"$console.tmp" && mv "$console.tmp" "$console"

verify_disk vda "nbd://127.0.0.1:$disk_port/$disk_tcp_name"
verify_disk vdb "nbd+unix:///$disk_unix_name?socket=$disk_socket"
stop_host_exports
log_writes_test
powercut_test
report
