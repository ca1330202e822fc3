# zcnbd over AF_VSOCK, inside the guest through vsock_loopback (CID 1: this machine), which the
# host here lacks. `zcnbd serve --vsock` on both engines; on io_uring with --data-path
# zerocopy, so the mechanisms that differ by socket are all tried on vsock: memory-export
# reads by sendfile and writes received in place, file reads spliced page cache -> pipe ->
# socket, and file writes (spliced off TCP and Unix sockets; vsock on 6.1 cannot answer
# FIONREAD, so they are received into buffers). Clients: ours (`zcnbd bench --verify`: the
# region written with stamped blocks, every block read back checked by its crc32c) and
# libnbd's (nbdinfo) on nbd+vsock://1/.
file=$WORK/vsock.img
SERVER_PID_FILE=$WORK/zcnbd.pid
VSOCK_URI=nbd+vsock://1/vmlab

vsock_loopback() {
    modprobe vsock_loopback || fail "modprobe vsock_loopback"
}

# vsock_start PREFIX memory|file ARGS...: zcnbd serving export vmlab with ARGS (which say
# where it listens); ready once its pid file is written (--pid-file: after the listeners).
vsock_start() {
    local p=$1 backend=$2 export_args="--memory 64M"
    shift 2
    SERVER_FILE=
    if [ "$backend" = file ]; then
        rm -f "$file"
        truncate -s 64M "$file"
        SERVER_FILE=$file
        export_args=$file
    fi
    rm -f "$SERVER_PID_FILE"
    # shellcheck disable=SC2086
    server_start zcnbd serve $export_args -x vmlab --pid-file "$SERVER_PID_FILE" --stats -v "$@" ||
        { result "$p/start" fail "zcnbd serve $* did not start"; return 1; }
}

# bench_verify URI: our client writes the first 16 MiB with stamped blocks (prefill), then
# writes and reads at 4k and 1m, checking every block it reads; no verify error, no failed
# request, and every cell moved data.
bench_verify() {
    local json=$WORK/bench.json
    rm -f "$json"
    zcnbd bench "$1" --rw write,read --bs 4k,1m --iodepth 8 --size 16M --runtime 1s \
        --prefill --verify --no-ceiling --json "$json" || fail "zcnbd bench exited $?" || return 1
    local cells
    cells=$(grep -o '"verify_errors": *[0-9]*' "$json" | wc -l)
    [ "$cells" -ge 4 ] || fail "$cells cells measured, 4 expected" || return 1
    if grep -Eq '"(verify_errors|errors)": *[1-9]' "$json"; then
        fail "verify errors or failed requests: $(grep -Eo '"(verify_errors|errors)": *[0-9]+' "$json" | sort | uniq -c)"
        return 1
    fi
    if grep -Eq '"iops": *0(\.0)?,' "$json"; then
        fail "a cell moved no data"
    fi
}

# nbdinfo_size URI: libnbd connects and reads the export's size (64 MiB).
nbdinfo_size() {
    nbdinfo "$1" || fail "nbdinfo $1" || return 1
    local size
    size=$(nbdinfo --size "$1") || return 1
    [ "$size" = $((64 << 20)) ] || fail "nbdinfo --size $1: $size"
}

# counter NAME: a --stats counter from the stopped server's log.
counter() {
    awk -v n="$1" '$1 == n { print $2 }' "$SERVER_LOG"
}

# expect_counter PREFIX NAME: the counter is above zero (the mechanism moved bytes on vsock).
expect_counter() {
    VMLAB_T0=$(now)
    local value
    value=$(counter "$2")
    if [ "${value:-0}" -gt 0 ]; then
        result "$1/$2" pass "$2=$value"
    else
        result "$1/$2" fail "$2=${value:-missing}: the mechanism did not run on vsock"
    fi
}

# vsock_engine PREFIX ENGINE DATA_PATH memory|file COUNTERS...: serve on vsock only, check
# with both clients, then that each counter in COUNTERS moved bytes.
vsock_engine() {
    local p=$1 engine=$2 path=$3 backend=$4
    shift 4
    vsock_start "$p" "$backend" --engine "$engine" --data-path "$path" --vsock || return 1
    check "$p/nbdinfo" 60 nbdinfo_size "$VSOCK_URI"
    check "$p/bench-verify" 240 bench_verify "$VSOCK_URI"
    server_stop
    metric "$p" $(awk '$2 ~ /^[0-9]+$/ && $1 ~ /_bytes$|^requests$/ { printf "%s=%s ", $1, $2 }' "$SERVER_LOG")
    local name
    for name in "$@"; do
        expect_counter "$p" "$name"
    done
}

if check vsock/modprobe 30 vsock_loopback; then
    vsock_engine vsock-uring-memory uring zerocopy memory \
        sent_splice_bytes received_in_place_bytes ring_enters
    vsock_engine vsock-uring-file uring zerocopy file sent_splice_bytes ring_enters
    vsock_engine vsock-portable-file portable auto file write_bytes
    # TCP and vsock (on a port of its own) from one server.
    if vsock_start vsock-and-tcp memory --engine portable -p "$VMLAB_PORT" --vsock=10810; then
        check vsock-and-tcp/nbdinfo-vsock 60 nbdinfo_size nbd+vsock://1:10810/vmlab
        check vsock-and-tcp/nbdinfo-tcp 60 nbdinfo_size "nbd://127.0.0.1:$VMLAB_PORT/vmlab"
        server_stop
    fi
fi
