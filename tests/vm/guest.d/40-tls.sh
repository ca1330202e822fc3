# TLS in the guest: the kernel client through nbd-client's TLS (GnuTLS) against
# `zcnbd serve --tls=require`, and the kernel's own TLS (kTLS) being there for the server.
#
# The hook for kTLS: when zcnbd hands its record layer to the kernel, the check
# "tls/ktls-server" below becomes the kernel-client and fio checks over TLS with kTLS on the
# server side, and asserts from the server's counters that sendfile, splice and zero-copy
# sends are still in use.
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

tls_checks() {
    nbd_connect 1 vmlab -cacertfile "$tls/ca-cert.pem" -tlshostname localhost || return 1
    fs_cycle || { nbd_disconnect; return 1; }
    fio_verify libaio 4k || { nbd_disconnect; return 1; }
    fio_verify io_uring 1M || { nbd_disconnect; return 1; }
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

if server_start zcnbd serve --memory "$EXPORT_SIZE" -x vmlab --tls=require \
    --tls-certificates="$tls/server" -p "$VMLAB_PORT" --stats; then
    check tls/plain-client-refused 30 plain_refused
    check tls/kernel-client 300 tls_checks
    server_stop
    VMLAB_T0=$(now)
    conns=$(awk '$1 == "tls_connections" { print $2 }' "$SERVER_LOG")
    if [ "${conns:-0}" -gt 0 ]; then
        result tls/server-counted pass "tls_connections=$conns"
    else
        result tls/server-counted fail "the server counted no TLS connection"
    fi
else
    result tls/start fail "zcnbd serve --tls=require did not start"
fi

skip tls/ktls-server "zcnbd's TLS records are made in user space (OpenSSL); kTLS not yet"
