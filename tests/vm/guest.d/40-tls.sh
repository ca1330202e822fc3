# TLS in the guest, whose kernel has kTLS (tls.ko): the kernel client through nbd-client's
# TLS (GnuTLS, TLS 1.3) against `zcnbd serve --tls=require`, which hands the sending half of
# each connection's record layer to the kernel (OpenSSL installs TLS_TX on the socket).
# The server's counters prove it: TLS connections sent by the kernel, no byte encrypted in
# user space, and the io_uring engine's zero-copy mechanisms (sendfile from the memfd,
# in-place receives, splice from the page cache) still in use on encrypted connections.
tls=/vmlab/tls

# tls/ulp: tls.ko is loaded (at boot) and offered as a TCP upper-layer protocol.
tls_ulp() {
    log "tcp_available_ulp: $(cat /proc/sys/net/ipv4/tcp_available_ulp)"
    grep -qw tls /proc/sys/net/ipv4/tcp_available_ulp || fail "no tls in tcp_available_ulp"
}
check tls/ulp 30 tls_ulp

if [ ! -f "$tls/ca-cert.pem" ]; then
    skip tls/kernel-client "no certificates in the initramfs (the host has no certtool)"
    return 0
fi

# tls_checks BLOCK_SIZES...: the kernel client over TLS, a file system and fio's verify.
tls_checks() {
    # A long timeout: under TCG on a busy host, encrypting in an emulated CPU is slow.
    NBD_TIMEOUT=120 nbd_connect 1 vmlab -cacertfile "$tls/ca-cert.pem" -tlshostname localhost || return 1
    fs_cycle || { nbd_disconnect; return 1; }
    for bs in "$@"; do
        fio_verify io_uring "$bs" || { nbd_disconnect; return 1; }
    done
    nbd_disconnect
}

# A plain-text client is refused by a --tls=require server.
plain_refused() {
    if nbd-client 127.0.0.1 "$VMLAB_PORT" "$NBD" -N vmlab -b 4096 -t 10; then
        nbd_disconnect
        fail "a plain-text client was attached to a --tls=require server"
        return 1
    fi
    log "refused, as it should be"
}

# counter NAME: a counter from the stopped server's --stats table.
counter() {
    awk -v n="$1" '$1 == n { print $2 }' "$SERVER_LOG"
}

# expect_counters PREFIX NAME... : each named counter is above zero; tls_encrypted_bytes is
# zero (the kernel encrypted every reply and option reply).
expect_counters() {
    local p=$1 name value detail= bad=
    shift
    for name in tls_connections tls_kernel_connections "$@"; do
        value=$(counter "$name")
        detail="$detail $name=${value:-missing}"
        [ "${value:-0}" -gt 0 ] || bad="$bad $name"
    done
    value=$(counter tls_encrypted_bytes)
    detail="$detail tls_encrypted_bytes=${value:-missing}"
    [ "${value:-1}" = 0 ] || bad="$bad tls_encrypted_bytes"
    grep -q 'records sent by the kernel (kTLS)' "$SERVER_LOG" || bad="$bad start-log-line"
    if [ -z "$bad" ]; then
        result "$p/ktls-counters" pass "$detail"
    else
        result "$p/ktls-counters" fail "expected otherwise:$bad;$detail"
    fi
}

# ktls_run PREFIX EXPORT ENGINE-ARGS -- COUNTERS...: one server, the kernel client's checks,
# then its counters.
ktls_run() {
    local p=$1 export_args=$2 engine_args=$3 counters
    shift 3
    counters="$*"
    # shellcheck disable=SC2086
    if ! server_start zcnbd serve $export_args -x vmlab --tls=require \
        --tls-certificates="$tls/server" -p "$VMLAB_PORT" --stats $engine_args; then
        result "$p/start" fail "zcnbd serve --tls=require did not start"
        return 1
    fi
    if [ "$p" = tls-portable ]; then
        check "$p/plain-client-refused" 30 plain_refused
        check "$p/kernel-client" 300 tls_checks 4k 1M
    else
        check "$p/kernel-client" 300 tls_checks 1M
    fi
    server_stop
    VMLAB_T0=$(now)
    # shellcheck disable=SC2086
    expect_counters "$p" $counters
}

file=$WORK/tls-export.img
mkdir -p "$WORK"
rm -f "$file"
truncate -s "$EXPORT_BYTES" "$file"

# Portable engine: replies written in plain text (a memory export's by the reader thread);
# the kernel encrypts.
ktls_run tls-portable "--memory $EXPORT_SIZE" "--engine portable -v"
# io_uring, memory export: replies sent from the memfd's mapping (no sendfile under kTLS: see
# uring/conn/mod.rs), writes received in place.
ktls_run tls-uring-memory "--memory $EXPORT_SIZE" "--engine uring --data-path zerocopy -v" \
    sent_plain_bytes received_in_place_bytes
# io_uring, buffered file: replies spliced from the page cache.
ktls_run tls-uring-file "$file" "--engine uring --data-path zerocopy -v" sent_splice_bytes
rm -f "$file"
