# The kernel client against `zcnbd serve` in the guest: both engines, a memory and a file
# export, one and four connections (and a Unix socket once).
file=$WORK/export.img

# zcnbd_checks PREFIX CONNECTIONS ENGINE memory|file [unix]
zcnbd_checks() {
    local p=$1 conns=$2 engine=$3 backend=$4 where="-p $VMLAB_PORT"
    SERVER_FILE= SERVER_SOCKET=
    if [ "${5:-}" = unix ]; then
        SERVER_SOCKET=$WORK/zcnbd.sock
        rm -f "$SERVER_SOCKET"
        where="-s $SERVER_SOCKET"
    fi
    local export_args="--memory $EXPORT_SIZE"
    if [ "$backend" = file ]; then
        rm -f "$file"
        truncate -s "$EXPORT_BYTES" "$file"
        SERVER_FILE=$file
        export_args=$file
    fi
    # shellcheck disable=SC2086
    if ! server_start zcnbd serve $export_args -x vmlab --engine "$engine" $where --stats; then
        result "$p/start" fail "zcnbd serve did not start"
        return 1
    fi
    kernel_client_checks "$p" "$conns" vmlab
    server_stop
    # The engine asked for is the one that ran (no silent fallback to the portable engine).
    if [ "$engine" = uring ]; then
        VMLAB_T0=$(now)
        local enters
        enters=$(awk '$1 == "ring_enters" { print $2 }' "$SERVER_LOG")
        if [ "${enters:-0}" -gt 0 ]; then
            result "$p/engine" pass "ring_enters=$enters"
        else
            result "$p/engine" fail "--engine uring, but the server counted no io_uring_enter"
        fi
    fi
    SERVER_SOCKET=
}

zcnbd_checks zcnbd-uring-memory 1 uring memory
zcnbd_checks zcnbd-uring-file 4 uring file
zcnbd_checks zcnbd-portable-memory 4 portable memory
zcnbd_checks zcnbd-portable-file-unix 1 portable file unix
