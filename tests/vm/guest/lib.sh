# Helpers for the guest's test scripts (busybox ash). Sourced by /vmlab/run-tests before each
# script in /vmlab/guest.d, so a script reads as a list of checks.
#
# The host reads only lines that start with "@@VMLAB " on the console:
#   @@VMLAB result NAME pass|fail|skip SECONDS DETAIL...
#   @@VMLAB metric NAME key=value...
# Everything else on the console is the log the host keeps when a check fails.

# Debian's busybox runs its own applets before any program on PATH (its shell is built with
# FEATURE_SH_STANDALONE): the real tools the checks rely on are called by their full paths.
dd() { /usr/bin/dd "$@"; }
blkdiscard() { /usr/sbin/blkdiscard "$@"; }
blockdev() { /usr/sbin/blockdev "$@"; }
fstrim() { /usr/sbin/fstrim "$@"; }

VMLAB_PORT=10809
NBD=/dev/nbd0
MNT=/mnt/vmlab
WORK=/tmp/vmlab
mkdir -p "$WORK"

# Seconds since boot, with hundredths (from /proc/uptime).
now() { cut -d' ' -f1 /proc/uptime; }

# result NAME STATUS DETAIL...: one line the host turns into a pass, failure or skip.
result() {
    local name=$1 status=$2
    shift 2
    echo "@@VMLAB result $name $status $(elapsed) $*"
}

# metric NAME key=value...: numbers for the host's tables, not checks.
metric() {
    echo "@@VMLAB metric $*"
}

log() { echo "vmlab: $*"; }

# emit_file NAME PATH: a file for the host (the guest has no other way out than the console):
# every line prefixed "@@VMLAB data NAME ", then its sha256, which the host checks.
emit_file() {
    sed "s/^/@@VMLAB data $1 /" "$2"
    echo "@@VMLAB datasum $1 $(sha256sum <"$2" | cut -d' ' -f1)"
}

# Seconds since the last check began (check and the scripts reset it).
VMLAB_T0=0
elapsed() { awk -v a="$VMLAB_T0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# check NAME TIMEOUT CMD...: runs CMD (a command or shell function, in a subshell: it cannot
# change the caller's variables) with a time limit; passes when it exits 0, is skipped when it
# exits 77 (after cant_tell), fails otherwise. Its output goes to the console, so a failure's
# reason is in the log.
check() {
    local name=$1 limit=$2 rc pid watchdog
    shift 2
    VMLAB_T0=$(now)
    rm -f "$WORK/skip-reason"
    log "--- $name: $*"
    ("$@") &
    pid=$!
    (
        sleep "$limit"
        log "$name: timed out after ${limit}s, killing"
        kill_tree "$pid"
    ) &
    watchdog=$!
    wait "$pid"
    rc=$?
    kill_tree "$watchdog"
    wait "$watchdog" 2>/dev/null
    if [ "$rc" = 0 ]; then
        result "$name" pass
    elif [ "$rc" = 77 ]; then
        result "$name" skip "$(cat "$WORK/skip-reason" 2>/dev/null)"
    elif [ "$rc" -ge 128 ]; then
        result "$name" fail "killed (signal $((rc - 128))): timed out after ${limit}s?"
    else
        result "$name" fail "exit $rc"
    fi
    return "$rc"
}

# kill_tree PID: SIGKILL to PID, then to everything it had started (the parent first, so a
# shell waiting on a child cannot go on to its next command).
kill_tree() {
    local children
    children=$(ps -o pid,ppid | awk -v p="$1" '$2 == p { print $1 }')
    kill -KILL "$1" 2>/dev/null
    for child in $children; do
        kill_tree "$child"
    done
}

# skip NAME REASON...
skip() {
    local name=$1
    shift
    VMLAB_T0=$(now)
    result "$name" skip "$*"
}

fail() { log "FAIL: $*"; return 1; }

# cant_tell REASON: inside a check, says why it cannot tell (then "return 77": a skip).
cant_tell() {
    mkdir -p "$WORK"
    echo "$*" >"$WORK/skip-reason"
    log "cannot tell: $*"
}

# --- servers -------------------------------------------------------------------------------

SERVER_PID=
SERVER_LOG=$WORK/server.log

# listening PORT: a TCP socket listens on PORT (read from /proc: no connection, which a
# server would count and log).
listening() {
    local hex
    hex=$(printf ':%04X ' "$1")
    awk -v p="$hex" 'index($2 " ", p) && $4 == "0A" { found = 1 } END { exit !found }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# server_start CMD...: starts a server in the background (its log in $SERVER_LOG) and waits
# until it listens on the port (or on the socket named by $SERVER_SOCKET, or until it has
# written the pid file $SERVER_PID_FILE: zcnbd's --pid-file, for listeners /proc cannot show).
server_start() {
    mkdir -p "$WORK"
    log "server: $*"
    "$@" >"$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    local i=0
    while [ $i -lt 300 ]; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            cat "$SERVER_LOG"
            SERVER_PID=
            fail "server exited at start"
            return 1
        fi
        if [ -n "${SERVER_PID_FILE:-}" ]; then
            [ -s "$SERVER_PID_FILE" ] && return 0
        elif [ -n "${SERVER_SOCKET:-}" ]; then
            [ -S "$SERVER_SOCKET" ] && return 0
        elif listening "$VMLAB_PORT"; then
            return 0
        fi
        sleep 0.2
        i=$((i + 1))
    done
    server_stop KILL
    fail "server did not listen within 60s"
}

# server_stop [SIGNAL]: stops the server (SIGTERM: a clean shutdown, the log shows --stats)
# and prints its log.
server_stop() {
    local sig=${1:-TERM} i=0
    [ -n "$SERVER_PID" ] || return 0
    kill -"$sig" "$SERVER_PID" 2>/dev/null
    while kill -0 "$SERVER_PID" 2>/dev/null && [ $i -lt 150 ]; do
        sleep 0.2
        i=$((i + 1))
    done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=
    log "server log:"
    sed 's/^/  | /' "$SERVER_LOG"
}

# Blocks the server holds: its backing file, or the memory export's memfd.
server_allocated_kib() {
    if [ -n "${SERVER_FILE:-}" ]; then
        echo $(($(stat -c %b "$SERVER_FILE") / 2))
        return
    fi
    local fd
    for fd in /proc/"$SERVER_PID"/fd/*; do
        case $(readlink "$fd") in
        /memfd:*)
            echo $(($(stat -L -c %b "$fd") / 2))
            return
            ;;
        esac
    done
    echo unknown
}

# --- the kernel client ---------------------------------------------------------------------

# nbd_connect CONNECTIONS NAME [nbd-client options...]: attaches /dev/nbd0 to the server.
nbd_connect() {
    local conns=$1 name=$2
    shift 2
    local where="127.0.0.1 $VMLAB_PORT"
    [ -n "${SERVER_SOCKET:-}" ] && where="-unix $SERVER_SOCKET"
    # shellcheck disable=SC2086
    nbd-client $where "$NBD" -N "$name" -C "$conns" -b 4096 -t "${NBD_TIMEOUT:-30}" "$@" || return 1
    local i=0
    while [ "$(cat /sys/block/nbd0/size)" = 0 ] && [ $i -lt 50 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    [ "$(cat /sys/block/nbd0/size)" != 0 ] || fail "nbd0 has no size after connecting"
}

nbd_disconnect() {
    nbd-client -d "$NBD" >/dev/null 2>&1
    local i=0
    while [ -e /sys/block/nbd0/pid ] && [ $i -lt 100 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    [ ! -e /sys/block/nbd0/pid ] || fail "nbd0 still connected after nbd-client -d"
}

# --- file contents ---------------------------------------------------------------------------

# Reference files with known content, made once per boot in tmpfs.
REF=$WORK/ref
make_reference_files() {
    [ -f "$REF/.done" ] && return 0
    mkdir -p "$REF"
    local i
    for i in 1 2 3 4 5 6 7 8; do
        dd if=/dev/urandom of="$REF/f$i" bs=64k count=$((i * 2)) 2>/dev/null || return 1
    done
    seq 1 20000 >"$REF/lines.txt"
    touch "$REF/.done"
}

copy_reference_files() {
    local f
    mkdir -p "$1/dir"
    for f in "$REF"/f* "$REF"/lines.txt; do
        cp "$f" "$1/dir/" || return 1
    done
}

verify_reference_files() {
    local f
    for f in "$REF"/f* "$REF"/lines.txt; do
        cmp "$f" "$1/dir/${f##*/}" || return 1
    done
}

# --- the kernel client's checks on one server --------------------------------------------------

# The export size every guest-side server offers: small, TCG is slow.
EXPORT_BYTES=$((128 << 20))
EXPORT_SIZE=128M

# ext4 made, mounted, written with known content, unmounted, the caches dropped, mounted again
# and read back, then e2fsck -n finds nothing to fix.
fs_cycle() {
    make_reference_files || return 1
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$NBD" || return 1
    mkdir -p "$MNT"
    mount -t ext4 "$NBD" "$MNT" || return 1
    copy_reference_files "$MNT" || return 1
    sync
    umount "$MNT" || return 1
    blockdev --flushbufs "$NBD"
    echo 3 >/proc/sys/vm/drop_caches
    mount -t ext4 "$NBD" "$MNT" || return 1
    verify_reference_files "$MNT" || { umount "$MNT"; return 1; }
    umount "$MNT" || return 1
    e2fsck -fn "$NBD"
}

# fstrim on the mounted filesystem after a file is removed: the server's allocation (its file's
# blocks, or the memory export's memfd pages) shrinks, so TRIM reached the export.
fs_trim() {
    mount -t ext4 "$NBD" "$MNT" || return 1
    dd if=/dev/urandom of="$MNT/big" bs=1M count=24 2>/dev/null || return 1
    sync
    local before after
    before=$(server_allocated_kib)
    rm "$MNT/big"
    sync
    fstrim -v "$MNT" || { umount "$MNT"; return 1; }
    sync
    after=$(server_allocated_kib)
    umount "$MNT" || return 1
    log "server allocation: ${before} KiB with the file, ${after} KiB after fstrim"
    if [ "$before" = unknown ]; then
        cant_tell "fstrim ran; this server's allocation is not visible from outside"
        return 77
    fi
    [ "$after" -le $((before - 16384)) ] || fail "fstrim freed less than 16 MiB on the server"
}

# blkdiscard -z (WRITE_ZEROES where the device offers it, else written zeroes) over data just
# written: the range reads back as zeroes, the data around it is untouched.
zero_range() {
    log "write_zeroes_max_bytes=$(cat /sys/block/nbd0/queue/write_zeroes_max_bytes)" \
        "discard_max_bytes=$(cat /sys/block/nbd0/queue/discard_max_bytes)"
    dd if=/dev/urandom of="$WORK/pattern" bs=1M count=12 2>/dev/null
    dd if="$WORK/pattern" of="$NBD" bs=1M seek=64 oflag=direct conv=notrunc status=none || return 1
    blkdiscard -f -z -o $((66 << 20)) -l $((8 << 20)) "$NBD" || return 1
    local zeroes got
    zeroes=$(dd if=/dev/zero bs=1M count=8 2>/dev/null | sha256sum)
    got=$(dd if="$NBD" bs=1M skip=66 count=8 iflag=direct 2>/dev/null | sha256sum)
    [ "$got" = "$zeroes" ] || fail "the zeroed range does not read back as zeroes"
    got=$(dd if="$NBD" bs=1M skip=64 count=2 iflag=direct 2>/dev/null | sha256sum)
    [ "$got" = "$(dd if="$WORK/pattern" bs=1M count=2 2>/dev/null | sha256sum)" ] ||
        fail "data before the zeroed range changed"
    got=$(dd if="$NBD" bs=1M skip=74 count=2 iflag=direct 2>/dev/null | sha256sum)
    [ "$got" = "$(dd if="$WORK/pattern" bs=1M skip=10 count=2 2>/dev/null | sha256sum)" ] ||
        fail "data after the zeroed range changed"
}

# The server offers FLUSH and FUA (the kernel shows a write-back cache with FUA), and sync
# with a flush of the device's buffers succeeds.
flush_fua() {
    local wc fua
    wc=$(cat /sys/block/nbd0/queue/write_cache)
    fua=$(cat /sys/block/nbd0/queue/fua)
    log "write_cache=$wc fua=$fua"
    [ "$wc" = "write back" ] || fail "no FLUSH: the kernel shows write_cache=$wc"
    [ "$fua" = 1 ] || fail "no FUA"
    dd if=/dev/urandom of="$NBD" bs=4k count=16 oflag=direct,sync conv=notrunc status=none || return 1
    sync && blockdev --flushbufs "$NBD"
}

# fio_verify ENGINE BS: random writes with crc32c verification headers (fio reads every block
# back and checks it), then random reads that check every block again.
fio_verify() {
    local engine=$1 bs=$2 size=8M
    [ "$bs" = 1M ] && size=32M
    local common="--filename=$NBD --direct=1 --ioengine=$engine --iodepth=16 --bs=$bs --size=$size
        --verify=crc32c --verify_fatal=1 --minimal"
    local out=$WORK/fio.out
    # shellcheck disable=SC2086
    fio --name=write $common --rw=randwrite >"$out" 2>&1 || { cat "$out"; return 1; }
    cut -d';' -f1-5,47-50 "$out"
    # shellcheck disable=SC2086
    fio --name=read $common --rw=randread >"$out" 2>&1 || { cat "$out"; return 1; }
    cut -d';' -f1-9 "$out"
}

# kernel_client_checks PREFIX CONNECTIONS EXPORT [nbd-client options]: every kernel-client
# check against the server already started (server_start), ending disconnected.
kernel_client_checks() {
    local p=$1 conns=$2 name=$3
    shift 3
    check "$p/connect-C$conns" 60 nbd_connect "$conns" "$name" "$@" || return 1
    log "nbd0: $(cat /sys/block/nbd0/size) sectors, $conns connection(s)," \
        "pids: $(cat /sys/block/nbd0/pid 2>/dev/null)"
    check "$p/ext4" 300 fs_cycle
    check "$p/fstrim" 120 fs_trim
    check "$p/blkdiscard-z" 60 zero_range
    check "$p/flush-fua" 60 flush_fua
    local engine bs
    for engine in libaio io_uring; do
        for bs in 4k 1M; do
            check "$p/fio-$engine-$bs" 180 fio_verify "$engine" "$bs"
        done
    done
    check "$p/disconnect" 60 nbd_disconnect
}

# list_exports NAME...: `nbd-client -l` names each export.
list_exports() {
    local out=$WORK/list.out name
    nbd-client -l 127.0.0.1 "$VMLAB_PORT" >"$out" 2>&1
    cat "$out"
    for name in "$@"; do
        grep -qx "$name" "$out" || fail "nbd-client -l does not list $name"
    done
}

# read_only_device EXPORT: attached, the device is read-only (a direct write fails), reads
# work.
read_only_device() {
    nbd_connect 1 "$1" || return 1
    local ro
    ro=$(blockdev --getro "$NBD")
    log "blockdev --getro: $ro, /sys/block/nbd0/ro: $(cat /sys/block/nbd0/ro)"
    if [ "$ro" != 1 ]; then
        nbd_disconnect
        fail "the device is writable"
        return 1
    fi
    if dd if=/dev/zero of="$NBD" bs=4k count=1 oflag=direct conv=notrunc status=none 2>/dev/null; then
        nbd_disconnect
        fail "a write to the read-only device succeeded"
        return 1
    fi
    dd if="$NBD" of=/dev/null bs=1M count=8 iflag=direct status=none || { nbd_disconnect; return 1; }
    nbd_disconnect
}

# killed_server: the server is killed (SIGKILL) while the kernel client has reads and writes in
# flight; both fail within the client's timeout (-t), nothing hangs, nbd-client -d cleans up.
killed_server() {
    local timeout_s=10
    NBD_TIMEOUT=$timeout_s nbd_connect 1 "$1" || return 1
    (while dd if="$NBD" of=/dev/null bs=1M count=32 iflag=direct status=none; do :; done) &
    local reader=$!
    (while dd if=/dev/zero of="$NBD" bs=1M count=32 oflag=direct conv=notrunc status=none; do :; done) &
    local writer=$!
    sleep 2
    kill -0 "$reader" && kill -0 "$writer" || fail "the I/O stopped before the server was killed"
    local t0 i=0
    t0=$(now)
    kill -KILL "$SERVER_PID"
    while { kill -0 "$reader" || kill -0 "$writer"; } 2>/dev/null && [ $i -lt $(((timeout_s + 20) * 5)) ]; do
        sleep 0.2
        i=$((i + 1))
    done
    local waited
    waited=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    if kill -0 "$reader" 2>/dev/null || kill -0 "$writer" 2>/dev/null; then
        fail "I/O still blocked ${waited}s after the server was killed (-t $timeout_s)"
        return 1
    fi
    log "the reads and writes failed ${waited}s after the server was killed (-t $timeout_s)"
    nbd_disconnect || return 1
    [ "$(cat /sys/block/nbd0/size)" = 0 ] || fail "nbd0 keeps its size after nbd-client -d"
}
